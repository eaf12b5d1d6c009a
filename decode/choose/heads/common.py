"""Plumbing shared by the heads: the :class:`Head` base class (and the kind → class registry it fills),
building a partial decoder stack out of the target's own HF modules, an optional draft vocabulary
(decode/core/vocab.py), and saving/loading the trainable weights of a head as a folder.

Head modules import this one, never the reverse: a head class registers itself by its ``kind`` when
its module is imported (``decode/choose/heads/__init__.py`` imports them all, and Python runs the package
``__init__`` before any of its submodules, so the registry is full whenever :func:`load_head` runs)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ...common.errors import UserError
from ...common.io import atomic_path, atomic_write_text
from ...core.vocab import VOCAB_FILE, DraftVocab, expand_logits

HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head.json"

HEAD_KINDS: dict[str, type["Head"]] = {}  # kind (head.json "kind") → class; filled by Head subclasses


class Head(nn.Module):
    """What every head folder needs: a ``kind`` (registers the class for :func:`load_head`), the weights
    it owns (by default all of its state dict: the target's modules are used, not registered), strict
    loading of them, and ``head_config``/``from_head_config`` for ``head.json``. Heads built on top of a
    target remember its signature (:meth:`_remember_target`) and refuse another one at load."""

    kind: str = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind:
            if kind in HEAD_KINDS and HEAD_KINDS[kind].__qualname__ != cls.__qualname__:
                raise RuntimeError(f"head kind '{kind}' registered twice ({HEAD_KINDS[kind].__name__}, {cls.__name__})")
            HEAD_KINDS[kind] = cls

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.parameters())

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_strict(self, state, set(self.trainable_state_dict()), f"{self.kind} head")

    def head_config(self) -> dict:
        """Hyper-parameters for ``head.json`` (enough for :meth:`from_head_config` to rebuild the module)."""
        raise NotImplementedError

    @classmethod
    def from_head_config(cls, meta: dict, target, **extra) -> "Head":
        raise NotImplementedError

    def _remember_target(self, target: nn.Module) -> None:
        self._signature = target_signature(target)

    @classmethod
    def _check_target(cls, meta: dict, target: nn.Module | None) -> nn.Module:
        """The target a head is rebuilt on: required, and the one it was trained for."""
        if target is None:
            raise UserError(f"a {cls.kind} head needs its target model to be rebuilt")
        check_signature(meta.get("target", {}), target, f"{cls.kind} head")
        return target


def base_model(target: nn.Module) -> nn.Module:
    """The decoder stack (``LlamaModel``/``Qwen2Model``...) under a causal-LM wrapper."""
    dec = target.get_decoder() if hasattr(target, "get_decoder") else None
    if dec is None or not hasattr(dec, "layers"):
        dec = getattr(target, "model", None)
    if dec is None or not hasattr(dec, "layers"):
        raise UserError(f"{type(target).__name__} has no decoder layer stack (.model.layers); "
                        "self-drafting heads need a decoder-only HF causal LM")
    return dec


def sub_config(config, layer_sources: list[int]):
    """Copy of the target config for a stack made of the target's layers ``layer_sources``
    (keeps per-layer attention types such as sliding windows aligned with the layers used)."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = len(layer_sources)
    types = getattr(config, "layer_types", None)
    if types is not None:
        cfg.layer_types = [types[i] for i in layer_sources]
    return cfg


def clone_layer(layer: nn.Module, layer_idx: int) -> nn.Module:
    """Deep copy of a target decoder layer re-indexed to ``layer_idx`` (its slot in a KV cache)."""
    new = copy.deepcopy(layer)
    for mod in new.modules():
        if hasattr(mod, "layer_idx"):
            mod.layer_idx = layer_idx
    for p in new.parameters():
        p.requires_grad_(True)
    return new


def build_stack(target: nn.Module, layers: list[nn.Module], layer_sources: list[int], norm: nn.Module,
                embed: nn.Module | None) -> nn.Module:
    """An instance of the target's own decoder class running ``layers`` (HF forward: masks, rotary
    embeddings and caches as the target does them). Built on the meta device, then every
    submodule is replaced, so nothing is allocated twice."""
    base = base_model(target)
    cfg = sub_config(target.config, layer_sources)
    with torch.device("meta"):
        stack = type(base)(cfg)
    stack.layers = nn.ModuleList(layers)
    stack.norm = norm
    stack.rotary_emb = copy.deepcopy(base.rotary_emb)
    stack.embed_tokens = embed if embed is not None else base.embed_tokens
    for name, t in list(stack.named_parameters()) + list(stack.named_buffers()):
        if t.is_meta:
            raise RuntimeError(f"head stack kept an uninitialised tensor '{name}'")
    return stack


def target_signature(target: nn.Module) -> dict:
    cfg = target.config
    return {"model_type": cfg.model_type, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "vocab_size": target.get_output_embeddings().weight.shape[0],
            "name_or_path": str(getattr(cfg, "_name_or_path", ""))}


def check_signature(saved: dict, target: nn.Module, folder) -> None:
    now = target_signature(target)
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        if saved.get(key) != now[key]:
            raise UserError(f"head {folder} was trained for a target with {key}={saved.get(key)}, "
                            f"but the target has {key}={now[key]}; pass the target it was trained on "
                            f"({saved.get('name_or_path') or 'see head.json'}) or retrain the head")


class DraftVocabMixin:
    """What a drafting head needs for a draft vocabulary: the subset's target ids as a buffer that
    moves with the head (not saved in its weights: the vocabulary has its own file) and the mapping
    of subset logits back to the target vocabulary. ``draft_vocab=None`` = the full vocabulary."""

    draft_vocab: DraftVocab | None = None

    def _set_draft_vocab(self, vocab: DraftVocab | None, target: nn.Module) -> None:
        weight = target.get_output_embeddings().weight
        self.target_vocab_size = weight.shape[0]
        if vocab is not None and vocab.vocab_size != self.target_vocab_size:
            raise UserError(f"the draft vocabulary indexes {vocab.vocab_size} tokens but the target has "
                            f"{self.target_vocab_size}; build it for this target")
        self.draft_vocab = vocab
        self.register_buffer("draft_ids", None if vocab is None else vocab.d2t.to(weight.device), persistent=False)

    def draft_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """The rows of a [V, ...] LM-head weight/bias that the draft vocabulary keeps ([N, ...])."""
        if self.draft_vocab is None:
            return weight
        return weight.detach().index_select(0, self.draft_vocab.d2t.to(weight.device)).contiguous()

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary → over the target's (``-inf`` outside: q = 0 there)."""
        if self.draft_vocab is None:
            return logits
        return expand_logits(logits, self.draft_ids, self.target_vocab_size)

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits [..., V] → the draft vocabulary's columns [..., N] (training targets)."""
        return logits if self.draft_vocab is None else logits.index_select(-1, self.draft_ids)

    def draft_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids → draft indices, -1 for ids outside the draft vocabulary (``d2t`` is sorted)."""
        if self.draft_vocab is None:
            return ids
        pos = torch.searchsorted(self.draft_ids, ids.contiguous()).clamp(max=len(self.draft_ids) - 1)
        return torch.where(self.draft_ids[pos] == ids, pos, torch.full_like(pos, -1))

    def target_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Draft indices → target ids (``d2t``)."""
        return index if self.draft_vocab is None else self.draft_ids[index]

    def draft_vocab_config(self) -> dict:
        return {} if self.draft_vocab is None else {"draft_vocab": {"file": VOCAB_FILE, **self.draft_vocab.info}}


def save_head(head: nn.Module, out_dir, extra: dict | None = None) -> Path:
    """Write ``head.safetensors`` (and ``draft_vocab.safetensors`` when the head has one) then
    ``head.json`` into ``out_dir``, each via a temp file + rename (``head.json`` last: a folder with it
    is complete). Other files there (checkpoints) are kept."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.trainable_state_dict().items()}
    meta = {"kind": head.kind, **head.head_config(), **(extra or {})}
    (out / HEAD_CONFIG).unlink(missing_ok=True)  # incomplete until the new one lands
    with atomic_path(out / HEAD_WEIGHTS) as tmp:
        save_file(state, str(tmp))
    vocab = getattr(head, "draft_vocab", None)
    if vocab is not None:
        vocab.save(out)
    else:
        (out / VOCAB_FILE).unlink(missing_ok=True)  # a stale one from an earlier run in this folder
    atomic_write_text(out / HEAD_CONFIG, json.dumps(meta, indent=2, sort_keys=True))
    return out


def read_head_config(folder) -> dict:
    """``head.json`` of a head folder; a missing, unreadable, damaged or truncated one is a UserError naming
    the folder and what is wrong with it."""
    path = Path(folder) / HEAD_CONFIG
    if not Path(folder).is_dir():
        raise UserError(f"{folder} is not a trained head folder (no such folder, so no {HEAD_CONFIG}); train one "
                        "with `make train-eagle`, `make train-early-exit` or `make train-calibrator`")
    if not path.is_file():
        raise UserError(f"{folder} is not a trained head folder (no {HEAD_CONFIG}); train one with "
                        "`make train-eagle`, `make train-early-exit` or `make train-calibrator`")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:  # invalid JSON (a truncated or damaged file), not UTF-8, unreadable
        raise UserError(f"head folder {folder}: {HEAD_CONFIG} is damaged ({_reason(exc)}); copy the folder again "
                        "or retrain the head") from None
    if not isinstance(meta, dict):
        raise UserError(f"head folder {folder}: {HEAD_CONFIG} is not a JSON object; copy the folder again or "
                        "retrain the head")
    return meta


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _weights_path(folder) -> Path:
    """``head.safetensors`` of ``folder``; missing is a UserError naming the folder."""
    path = Path(folder) / HEAD_WEIGHTS
    if not path.is_file():
        raise UserError(f"head folder {folder}: its weights {HEAD_WEIGHTS} are missing (an incomplete copy?); "
                        "copy the folder again or retrain the head")
    return path


def _unreadable(folder, exc: BaseException) -> UserError:
    return UserError(f"head folder {folder}: {HEAD_WEIGHTS} is not a readable safetensors file, damaged or "
                     f"truncated ({_reason(exc)}); copy the folder again or retrain the head")


def read_head_weights(folder) -> dict[str, torch.Tensor]:
    """The tensors of ``head.safetensors``; a missing, truncated or damaged file is a UserError naming the
    folder and what is wrong with it (safetensors raises its own error type, or an OSError)."""
    path = _weights_path(folder)
    try:
        return load_file(str(path))
    except Exception as exc:  # SafetensorError (bad/truncated header or data), OSError
        raise _unreadable(folder, exc) from None


def _check_head_weights(folder) -> None:
    """:func:`read_head_weights`'s checks without reading the tensors: opening the file reads its header and checks
    it against the file's size (a truncated or foreign file fails). It runs each time an arm is built (a batched
    engine or a server builds every request's arms), where reading the tensors re-read the whole weights file
    (~1 ms for 10 MB) although the loaded head is cached."""
    from safetensors import safe_open

    path = _weights_path(folder)
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:  # SafetensorError (bad/truncated header), OSError
        raise _unreadable(folder, exc) from None


def check_head_folder(folder, expect: str | None = None) -> dict:
    """What can be checked of a head folder without its target (before any model loads): ``head.json``
    readable, of the ``expect``-ed kind, and its weights a readable safetensors file. Returns ``head.json``."""
    meta = read_head_config(folder)
    _head_kind(folder, meta, expect)
    _check_head_weights(folder)
    return meta


def _head_kind(folder, meta: dict, expect: str | None) -> str:
    """``head.json``'s kind: a registered one, and ``expect`` when given."""
    kind = meta.get("kind")
    if kind not in HEAD_KINDS:
        raise UserError(f"{folder}/{HEAD_CONFIG}: unknown head kind '{kind}' (known: {', '.join(HEAD_KINDS)})")
    if expect is not None and kind != expect:
        raise UserError(f"{folder} holds a '{kind}' head, expected '{expect}'")
    return kind


def load_head(folder, target: nn.Module | None = None, *, expect: str | None = None) -> nn.Module:
    """Rebuild a saved head (on top of ``target`` for the heads that wrap it), by the class registered
    for its ``kind``."""
    meta = read_head_config(folder)
    kind = _head_kind(folder, meta, expect)
    extra = {}
    if meta.get("draft_vocab"):  # heads saved before draft vocabularies draft from the full vocabulary
        if target is None:
            raise UserError(f"{folder}: a head with a draft vocabulary needs its target model to be rebuilt")
        vocab = DraftVocab.load(folder, target.get_output_embeddings().weight.shape[0])
        if len(vocab) != meta["draft_vocab"].get("size"):
            raise UserError(f"{folder}: {VOCAB_FILE} holds {len(vocab)} ids but head.json says "
                            f"{meta['draft_vocab'].get('size')}; the folder mixes two runs, retrain the head")
        extra["draft_vocab"] = vocab
    if target is not None and isinstance(meta.get("target"), dict):
        check_signature(meta["target"], target, folder)  # names the folder (the head's own check cannot)
    try:
        head = HEAD_KINDS[kind].from_head_config(meta, target, **extra)
    except (KeyError, TypeError, ValueError) as exc:  # a field missing or of the wrong type
        raise UserError(f"head folder {folder}: {HEAD_CONFIG} lacks or mistypes a field the '{kind}' head needs "
                        f"({_reason(exc)}); copy the folder again or retrain the head") from None
    state = read_head_weights(folder)
    try:
        head.load_trainable_state_dict(state)
    except UserError as exc:  # tensors missing or unexpected
        raise UserError(f"head folder {folder}: {exc}") from None
    except RuntimeError as exc:  # a tensor of another shape
        raise UserError(f"head folder {folder}: {HEAD_WEIGHTS} does not fit the head head.json describes "
                        f"({_reason(exc)[:300]}); the folder mixes two runs, retrain the head") from None
    return head.eval()


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], expected: set[str], what: str) -> None:
    missing = expected - set(state)
    unexpected = set(state) - expected
    if missing or unexpected:
        raise UserError(f"{what}: saved weights do not match the head (missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]}); retrain or pass the matching target")
    module.load_state_dict(state, strict=False)
