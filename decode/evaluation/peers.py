"""The reference (plain HF ``generate``) and peers: other speculative decoders run in the same evaluation.

Every method here has ``name``, ``kind`` and ``decode(ids, pi, max_new_tokens) -> dict`` returning the
evaluation's record fields (new_tokens, rounds = target forwards, accept_lengths, drafted, arms,
draft_time, verify_time, wall_time, stopped_by, token_ids; peers add ``rounds_exact``).

* ``hf`` (:class:`HFMethod`, kind "hf"): plain ``model.generate``, the reference every run compares to.
* peers (kind "peer"), specs ``name:key=value,...`` like arms, typed and range-checked by a
  :class:`~decode.common.registry.Registry` before anything heavy loads:

  ``hf-pld:L=10,n=2``
      transformers prompt lookup: ``prompt_lookup_num_tokens=L`` (L >= 1, default 10 as in
      transformers), ``max_matching_ngram_size=n`` (n >= 1; unset = transformers' default 2).
  ``hf-static`` (``compile=true``)
      plain ``generate`` with a static cache and transformers' compiled decoding forward
      (:class:`StaticCachePeer`): the non-speculative baseline a savvy user would pick.
  ``hf-assisted:path=DIR,L=..,schedule=dsl``
      transformers assisted generation with one of our drafters (an HF causal LM folder with the
      target's vocabulary, checked, loaded on the target's device and dtype).
  ``hf-early-exit:layers=N,L=..,schedule=dsl``
      transformers' ``assistant_early_exit=N`` (LayerSkip-style self-speculation: the target's first N
      layers, its final norm and LM head draft; 1 <= N < the target's layer count).

Draft-length schedule of the two assistant peers (``schedule=``; the assistant's generation_config is
set by us, never read from the drafter's checkpoint):

* ``dsl`` (default) — transformers' own default since 4.45, its "dynamic speculation lookahead":
  ``num_assistant_tokens_schedule="constant"``, ``assistant_confidence_threshold=0.4``: the
  assistant drafts until its top token's probability falls below the threshold (at most L, default
  20 = transformers' ``num_assistant_tokens``). With scikit-learn installed, transformers also
  re-fits the threshold each round from a ROC curve of (draft probability, accepted) pairs — for a
  separate assistant only, not for early exit, and only within one ``generate`` call. This is what a
  transformers user gets by default and what its documentation recommends, hence the default.
  ``PeerMethod.settings["threshold_adaptive"]`` says whether the re-fit was available in the run.
* ``heuristic`` — transformers' older schedule (+2 draft tokens after a fully accepted draft, −1
  otherwise, starting at L, default 5 = its former default), no confidence threshold. Set as
  ``"heuristic_transient"``: plain ``"heuristic"`` writes the final length back into the assistant's
  generation_config after every call, so each prompt (and the warm-up) would start where the previous
  one ended and a record would depend on the order prompts ran in.
* ``constant`` — exactly L tokens per draft (default 5), no threshold.

Why one module of ~470 lines: every method here shares the record contract and the private ``generate``
plumbing (warm-up, EOS and budget handling, counting target forwards through a forward hook); split
apart, each file would reach into the same helpers.

Target forwards (``rounds``, so MAT = tokens / rounds compares with our engine's) are counted, not
inferred: a forward pre-hook on the target model counts every call during ``generate``. Assisted
decoding runs exactly one target forward per round (the first one doubles as the prefill), so this is
also the number of verification rounds:

* ``hf-pld``, ``hf-assisted``: every call on the target is a verification (the drafter of
  ``hf-assisted`` is a separate model, its calls are not seen).
* ``hf-early-exit``: the draft passes run through the same model. transformers drafts by setting
  ``config.num_hidden_layers = N`` on the base model for the draft call and restoring it afterwards,
  so the hook counts only calls made while the base model runs all its layers (verifications).

``accept_lengths`` / ``drafted`` per round and ``draft_time`` come from wrapping the candidate
generator of that call (``get_candidates`` = drafting, timed with device synchronisation;
``update_candidate_strategy`` receives the accepted count after transformers' EOS/length crop).
If the hook saw no call (an unexpected transformers change) the record falls back to the candidate
generator's round count, or the token count, and says ``"rounds_exact": false``.
"""
from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch

from ..common.device import synchronize
from ..common.errors import UserError
from ..common.registry import Registry
from ..core.sampling import SamplingConfig
from ..common.specs import Range, bind_params, parse_spec

HF = "hf"


# ---- the reference: plain HF generate -------------------------------------------------------------------

def truncate_at_eos(tokens: list[int], eos) -> tuple[list[int], str]:
    """The engine's stopping rule: keep up to and including the first EOS token."""
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[:j + 1], "eos"
    return tokens, "length"


@torch.inference_mode()
def hf_generate(model, ids: list[int], max_new_tokens: int, sampling: SamplingConfig, eos: list[int],
                pad_token_id: int, *, model_generation_config=None, **generate_kwargs) -> tuple[list[int], float, str]:
    """HF ``generate`` on the same prompt ids (no streamer); the reference decoder and every peer's call.

    Returns (new tokens, seconds, "eos" | "length"). Tokens follow the engine's convention (the first
    EOS is kept, nothing after it), so greedy outputs compare token for token. The checkpoint's own
    generation_config is swapped out for the call (``model_generation_config``, default a clean
    ``GenerationConfig()``; early exit reads its assistant settings from it because the model is its
    own assistant): its penalties, forced tokens or sampling defaults would make HF decode something
    other than the plain model. ``generate_kwargs``: generation settings (``prompt_lookup_num_tokens``,
    ``assistant_early_exit``, ...) go into the call's GenerationConfig, anything else (``assistant_model``)
    is passed to ``generate``. The clock is read after synchronising the model's device.
    """
    rows, seconds = hf_generate_batch(model, [ids], max_new_tokens, sampling, eos, pad_token_id,
                                      model_generation_config=model_generation_config, **generate_kwargs)
    return rows[0][0], seconds, rows[0][1]


@torch.inference_mode()
def hf_generate_batch(model, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                      eos: list[int], pad_token_id: int, *, model_generation_config=None,
                      **generate_kwargs) -> tuple[list[tuple[list[int], str]], float]:
    """:func:`hf_generate` on several prompts at once, left-padded (how HF batches decoder-only models; the
    plain baseline of ``decode eval --batch``): ([(new tokens, "eos" | "length")] per prompt, seconds)."""
    from transformers import GenerationConfig

    opts = dict(do_sample=not sampling.greedy)
    if not sampling.greedy:
        opts.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=list(eos) or None,
                           pad_token_id=pad_token_id, use_cache=True, **opts)
    call_kwargs = cfg.update(**generate_kwargs)  # settings into the config; the rest (assistant_model) as kwargs
    width = max(map(len, prompts))
    x = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, ids in enumerate(prompts):
        x[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        mask[i, width - len(ids):] = 1
    x, mask = x.to(model.device), mask.to(model.device)
    installed = model_generation_config if model_generation_config is not None else GenerationConfig()
    saved, model.generation_config = model.generation_config, installed
    try:
        synchronize(model.device)
        start = time.perf_counter()
        out = model.generate(x, attention_mask=mask, generation_config=cfg, **call_kwargs)
        synchronize(model.device)
        seconds = time.perf_counter() - start
    finally:
        model.generation_config = saved
    return [truncate_at_eos(row, set(eos)) for row in out[:, width:].tolist()], seconds


class HFMethod:
    """``hf``: one target forward per token, so MAT = 1 by definition."""

    name, kind = HF, "hf"

    def __init__(self, model, sampling: SamplingConfig, eos: list[int], pad_token_id: int):
        self.model, self.sampling, self.eos, self.pad = model, sampling, eos, pad_token_id

    def decode(self, ids: list[int], pi: int, max_new_tokens: int) -> dict:
        tokens, seconds, stopped_by = hf_generate(self.model, ids, max_new_tokens, self.sampling, self.eos, self.pad)
        n = len(tokens)
        return {"new_tokens": n, "rounds": n, "accept_lengths": [0] * n, "drafted": [0] * n, "arms": [],
                "draft_time": 0.0, "verify_time": seconds, "wall_time": seconds, "stopped_by": stopped_by,
                "token_ids": tokens}


# ---- instrumentation: target forwards and per-round draft/accept ------------------------------------------

@dataclass
class _Trace:
    target_forwards: int = 0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_time: float = 0.0
    wrapped: bool = False  # the candidate generator was seen


def _base_model(model):
    return getattr(model, getattr(model, "base_model_prefix", ""), model)


@contextmanager
def _instrument(model, *, full_layers_only: bool = False):
    """Count target forwards (pre-hook) and record each round's draft (wrapped candidate generator)."""
    trace = _Trace()
    base = _base_model(model)
    full = base.config.num_hidden_layers

    def count(module, args, kwargs):
        if not full_layers_only or base.config.num_hidden_layers == full:
            trace.target_forwards += 1

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    original = getattr(model, "_get_candidate_generator", None)
    if original is not None:
        @functools.wraps(original)
        def candidate_generator(*args, **kwargs):
            gen = original(*args, **kwargs)
            get, update = gen.get_candidates, gen.update_candidate_strategy
            trace.wrapped = True

            def get_candidates(input_ids, *a, **kw):
                synchronize(model.device)
                t0 = time.perf_counter()
                cand, logits = get(input_ids, *a, **kw)
                synchronize(model.device)
                trace.draft_time += time.perf_counter() - t0
                trace.drafted.append(int(cand.shape[-1] - input_ids.shape[-1]))
                return cand, logits

            def update_candidate_strategy(input_ids, scores, num_matches, *a, **kw):
                trace.accepted.append(int(num_matches))
                return update(input_ids, scores, num_matches, *a, **kw)

            gen.get_candidates, gen.update_candidate_strategy = get_candidates, update_candidate_strategy
            return gen

        model._get_candidate_generator = candidate_generator  # instance attribute shadows the method
    try:
        yield trace
    finally:
        handle.remove()
        if original is not None:
            del model._get_candidate_generator


# ---- peers ----------------------------------------------------------------------------------------------

@dataclass
class PeerContext:
    model: Any
    tokenizer: Any
    sampling: SamplingConfig
    eos: list[int]
    pad_token_id: int


class PeerMethod:
    """A peer: ``hf_generate`` with extra generate kwargs, instrumented. Built (validated) cheaply by the
    registry; :meth:`load` does the heavy part (a drafter model) once every spec has been checked."""

    kind = "peer"
    count_full_layers_only = False
    compiles = False  # its first call compiles (the evaluation pays and reports that before timing)

    def __init__(self, name: str, ctx: PeerContext):
        self.name, self.ctx = name, ctx
        self.settings: dict[str, Any] = {}  # the effective transformers settings, for the report's config

    def load(self) -> None:
        """Load what the peer needs (nothing for model-free peers)."""

    def generate_kwargs(self) -> dict:
        raise NotImplementedError

    def model_generation_config(self):
        return None

    def decode(self, ids: list[int], pi: int, max_new_tokens: int) -> dict:
        c = self.ctx
        with _instrument(c.model, full_layers_only=self.count_full_layers_only) as tr:
            tokens, seconds, stopped_by = hf_generate(
                c.model, ids, max_new_tokens, c.sampling, c.eos, c.pad_token_id,
                model_generation_config=self.model_generation_config(), **self.generate_kwargs())
        n = len(tokens)
        rounds, exact = tr.target_forwards, tr.target_forwards > 0
        if not exact:
            rounds = len(tr.drafted) if tr.wrapped else n
        acc = tr.accepted if tr.wrapped else []
        drafted = tr.drafted[:len(acc)] if tr.wrapped else []
        return {"new_tokens": n, "rounds": rounds, "accept_lengths": acc, "drafted": drafted, "arms": [],
                "draft_time": tr.draft_time, "verify_time": max(seconds - tr.draft_time, 0.0),
                "wall_time": seconds, "stopped_by": stopped_by, "token_ids": tokens, "rounds_exact": exact}


class PromptLookupPeer(PeerMethod):
    def __init__(self, name, ctx, L: int, n: int | None):
        super().__init__(name, ctx)
        self.settings = {"prompt_lookup_num_tokens": L,
                         "max_matching_ngram_size": n if n is not None else "default (2)"}
        self._kwargs = {"prompt_lookup_num_tokens": L}
        if n is not None:
            self._kwargs["max_matching_ngram_size"] = n

    def generate_kwargs(self):
        return dict(self._kwargs)


class StaticCachePeer(PeerMethod):
    """``hf-static``: what a savvy transformers user runs without speculation — ``generate`` with
    ``cache_implementation="static"`` and its decoding forward compiled (transformers' own auto-compile:
    ``CompileConfig``, ``dynamic=False``; CUDA graphs on a GPU, inductor's default mode on a CPU, where
    transformers compiles only when told to: ``_compile_all_devices``). transformers keeps the largest
    cache it allocated, so later prompts do not recompile. Speculation has to beat this, not only plain
    ``generate``. ``compile=false`` keeps the static cache and runs it eagerly."""

    def __init__(self, name, ctx, compile: bool):
        super().__init__(name, ctx)
        self.compiles = compile
        self.settings = {"cache_implementation": "static", "compile": compile}
        self._kwargs = {"cache_implementation": "static"}
        if compile:
            from transformers import CompileConfig

            from ..core.compiled import inductor_cache_dir

            inductor_cache_dir()  # the same on-disk cache as our compiled target
            cuda = ctx.model.device.type == "cuda"
            cfg = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead" if cuda else "default")
            cfg._compile_all_devices = True
            self._kwargs["compile_config"] = cfg
        else:
            self._kwargs["disable_compile"] = True

    def generate_kwargs(self):
        return dict(self._kwargs)


SCHEDULES = ("dsl", "heuristic", "constant")


class _QuietInnerAssistantCall(logging.Filter):
    """transformers' own assisted decoding calls the assistant's ``generate`` with a generation_config
    *and* max_new_tokens/min_new_tokens, and then warns that this is deprecated: noise about its code,
    not ours, printed in the middle of an evaluation's progress bar. Only that message is dropped."""

    def filter(self, record):
        return "Passing `generation_config` together with generation-related" not in record.getMessage()


def _quiet_inner_assistant_warning() -> None:
    log = logging.getLogger("transformers.generation.utils")
    if not any(isinstance(f, _QuietInnerAssistantCall) for f in log.filters):
        log.addFilter(_QuietInnerAssistantCall())


def _sklearn_available() -> bool:
    try:
        from transformers.utils import is_sklearn_available
        return bool(is_sklearn_available())
    except Exception:
        return False


def _assistant_config(peer: str, schedule: str, L: int | None, adaptive_possible: bool):
    """The assistant's GenerationConfig for a ``schedule=`` value (module docstring) and its description."""
    from transformers import GenerationConfig

    _quiet_inner_assistant_warning()
    if schedule not in SCHEDULES:
        raise UserError(f"peer '{peer}': bad parameters: schedule must be one of {', '.join(SCHEDULES)}, "
                        f"got '{schedule}'")
    if schedule == "dsl":
        L = 20 if L is None else L
        cfg = GenerationConfig(num_assistant_tokens=L, num_assistant_tokens_schedule="constant",
                               assistant_confidence_threshold=0.4)
        settings = {"schedule": "dsl", "num_assistant_tokens": L, "num_assistant_tokens_schedule": "constant",
                    "assistant_confidence_threshold": 0.4,
                    "threshold_adaptive": adaptive_possible and _sklearn_available()}
    else:
        L = 5 if L is None else L
        hf_schedule = "heuristic_transient" if schedule == "heuristic" else "constant"
        cfg = GenerationConfig(num_assistant_tokens=L, num_assistant_tokens_schedule=hf_schedule,
                               assistant_confidence_threshold=0.0)  # 0 = no confidence stop
        settings = {"schedule": schedule, "num_assistant_tokens": L, "num_assistant_tokens_schedule": hf_schedule,
                    "assistant_confidence_threshold": None}
    return cfg, settings


class AssistedPeer(PeerMethod):
    def __init__(self, name, ctx, path: str, L: int | None, schedule: str):
        super().__init__(name, ctx)
        _check_model_path(name, path)
        self.path = path
        self.assistant_config, self.settings = _assistant_config(name, schedule, L, adaptive_possible=True)
        self.settings["path"] = path
        self.drafter = None

    def load(self):
        from ..core.models import check_vocab_compatible, load_model

        m = self.ctx.model
        drafter, dtok = load_model(self.path, dtype=m.dtype, device=m.device)
        check_vocab_compatible(self.ctx.tokenizer, dtok, drafter_name=self.path,
                               target_vocab_size=m.config.get_text_config().vocab_size,
                               drafter_vocab_size=drafter.config.get_text_config().vocab_size)
        drafter.generation_config = self.assistant_config  # not the drafter checkpoint's own settings
        self.drafter = drafter

    def generate_kwargs(self):
        if self.drafter is None:
            self.load()
        return {"assistant_model": self.drafter}


class EarlyExitPeer(PeerMethod):
    count_full_layers_only = True

    def __init__(self, name, ctx, layers: int, L: int | None, schedule: str):
        super().__init__(name, ctx)
        total = _base_model(ctx.model).config.num_hidden_layers
        if not 1 <= layers < total:
            raise UserError(f"peer '{name}': bad parameters: layers must be an integer in [1, {total - 1}] "
                            f"(the target has {total} layers; the drafter is its first N), got '{layers}'")
        self.layers = layers
        self.assistant_config, self.settings = _assistant_config(name, schedule, L, adaptive_possible=False)
        self.settings["assistant_early_exit"] = layers

    def generate_kwargs(self):
        return {"assistant_early_exit": self.layers}

    def model_generation_config(self):
        import copy
        return copy.deepcopy(self.assistant_config)  # the model is its own assistant: it reads this


def _check_model_path(peer: str, path: str) -> None:
    """Cheap check of a drafter spec (no loading): an existing HF folder, an alias or a hub id."""
    from ..core.models import ALIASES, resolve_path

    if not path:
        raise UserError(f"peer '{peer}': bad parameters: path must name a drafter folder (path=DIR)")
    if path in ALIASES:
        return
    try:
        resolve_path(path)
    except UserError as exc:
        raise UserError(f"peer '{peer}': path: {exc}") from None


PEERS = Registry("peer", hint=" (e.g. --peers 'hf-pld:L=4;hf-early-exit:layers=4')")


@PEERS.register("hf-pld")
def _hf_pld(ctx: PeerContext, name: str, L: Annotated[int, Range(1)] = 10,
            n: Annotated[int, Range(1)] | None = None):
    """transformers' prompt lookup, L tokens a round."""
    return PromptLookupPeer(name, ctx, L, n)


@PEERS.register("hf-static")
def _hf_static(ctx: PeerContext, name: str, compile: bool = True):
    """transformers' generate on a static KV cache with its compiled decoding forward; compile=false runs it eager."""
    return StaticCachePeer(name, ctx, compile)


@PEERS.register("hf-assisted")
def _hf_assisted(ctx: PeerContext, name: str, path: str, L: Annotated[int, Range(1)] | None = None,
                 schedule: str = "dsl"):
    """transformers' assisted generation with one of our drafters, the folder given as path."""
    return AssistedPeer(name, ctx, path, L, schedule)


@PEERS.register("hf-early-exit")
def _hf_early_exit(ctx: PeerContext, name: str, layers: Annotated[int, Range(1)],
                   L: Annotated[int, Range(1)] | None = None, schedule: str = "dsl"):
    """transformers' early-exit self-speculation from the target's first `layers` layers."""
    return EarlyExitPeer(name, ctx, layers, L, schedule)


def check_peer_specs(specs: list[str]) -> None:
    """Names, typed and ranged parameters and drafter folders, without loading anything (what needs the
    model, e.g. early exit's layer count, is checked by :func:`build_peers`, still before decoding)."""
    for s in specs:
        name, params = parse_spec(s)
        if name not in PEERS.names():
            raise UserError(f"unknown peer '{name}' in '{s}'; known peers: {', '.join(PEERS.names())} "
                            f"(e.g. --peers 'hf-pld:L=4;hf-early-exit:layers=4')")
        bound = bind_params(f"peer '{s}'", name, PEERS._factories[name], 2, params)
        if "path" in bound:
            _check_model_path(s, bound["path"])


def peer_names() -> list[str]:
    return PEERS.names()


def peers_help() -> str:
    """One entry per registered peer for ``--help`` (built from the registry, so no peer goes unlisted)."""
    import inspect
    entries = []
    for name in PEERS.names():
        factory = PEERS._factories[name]
        params = [f"{k}=…" if v.default is inspect.Parameter.empty else f"{k}={v.default}"
                  for k, v in list(inspect.signature(factory).parameters.items())[2:]]
        doc = (factory.__doc__ or "").strip().rstrip(".")
        entries.append(f"{name}:{','.join(params)} — {doc}" if params else f"{name} — {doc}")
    return "; ".join(entries)


def build_peers(specs: list[str], model, tokenizer, sampling: SamplingConfig, eos: list[int],
                pad_token_id: int) -> list[PeerMethod]:
    """Peers for ``specs`` (``name:key=value,...``); every spec is validated (names, typed and ranged
    parameters, duplicates, drafter paths) before any drafter loads. A peer's ``name`` is its spec as
    given (whitespace removed), e.g. ``hf-pld:L=4``."""
    ctx = PeerContext(model, tokenizer, sampling, list(eos), pad_token_id)
    peers, seen = [], {}
    for spec in specs:
        name, params = parse_spec(spec)
        label = name + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")
        key = (name, tuple(sorted(params.items())))
        if key in seen:
            raise UserError(f"peer '{spec}' duplicates '{seen[key]}'; each peer is evaluated once")
        seen[key] = spec
        peers.append(PEERS.build(name, spec, ctx, label, **params))
    for p in peers:
        p.load()
    return peers
