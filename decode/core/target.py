"""Target: the verifier model behind a KV cache, with prefill, scoring and rollback.

Cache invariant: for a context of n tokens the cache holds the first n-1; each round feeds
``[last token] + draft`` so every round (also the first) is one forward pass of L+1 positions.

KV caches (``KVCache``, shared with the arms that own a cache: drafter, early-exit, EAGLE) come in
three kinds, chosen per run (``cache="dynamic"|"static"|"prefix"``):

- ``dynamic``: HF ``DynamicCache``; tensors grow by concatenation, rollback crops them. Every forward
  copies the whole cache once (``torch.cat``): 12% of a one-token step at 300 tokens of context, 26% at
  1,200 (default target, 2 threads, profiled).
- ``prefix`` (the CPU default): the static allocation below, written in place, but attention reads only the
  filled prefix (views ``[:, :, :length]``, :class:`PrefixLayer`): no concatenation and no attending over
  empty capacity. Outputs are bit-identical to ``dynamic`` (same attention inputs, same kernels); shapes
  change every forward, so it is for eager forwards, not compiled graphs.
- ``static``: HF ``StaticCache``, pre-allocated ``[1, kv_heads, capacity, head_dim]`` per layer (the
  model's device and dtype); rollback only moves a length pointer. In transformers 5.x a static
  layer writes each forward's keys/values at its own ``cumulative_length`` (a 0-d tensor) and the
  causal mask's query offset is read from it, so the pointer is exactly that counter: ``crop`` sets
  it on every layer (in place, the tensor keeps its address for torch.compile), and every forward
  is given explicit ``position_ids`` from our own ``length`` (never from ``get_seq_length``).

  Why stale entries beyond the pointer are harmless: a forward of n tokens at pointer p first writes
  slots p..p+n-1 (every layer's ``update`` runs before its attention reads), and its causal mask lets
  query p+i see key slots ≤ p+i only; so every slot a query reads was written by this forward or is
  an accepted entry below p, and slots > p+n-1 (rejected drafts, an earlier longer prompt) are masked.
  tests/test_static_cache.py checks it (draft, roll back, score a different draft, compare with a
  fresh dynamic computation) instead of assuming it.

  Capacity (the allocation's length), a clear rule, never a silent truncation:
  * ``max_cache_len`` given (Target/KVCache constructor): a fixed allocation of exactly that many
    slots, reused for every sequence; a sequence that needs more is a ``UserError`` naming the
    numbers (at ``start`` when its declared capacity is larger, else at the forward that overflows).
  * ``max_cache_len=None`` (default): ``start(capacity)`` allocates ``capacity`` (undeclared: the
    prompt + ``CACHE_BUCKET``) rounded up to a multiple of ``CACHE_BUCKET`` (256), reusing the
    current allocation when it is already large enough (an evaluation allocates a few times, not
    once per prompt); a forward that would overflow re-allocates to max(2 × capacity, need rounded
    up) and copies the kept prefix. The engine declares the need at prefill: prompt +
    max_new_tokens + max draft length + 1 (a safe bound: a round writes at most prompt +
    max_new_tokens − 1 slots).
  Models whose cache layers are not plain full-attention static layers (sliding-window, linear
  attention) are refused with cache="static" or "prefix": their static layers roll their buffers and cannot be
  rolled back by a pointer.

``Target(..., compile=True)`` (static cache only) runs chain verification forwards through one static-shape
graph per number of positions (decode/core/compiled.py: the sizes a run needs are compiled at load by
``warm_up``; inductor's on-disk cache makes later runs cheap). The cache capacity is part of a graph's
shape, so a run declares its largest need once (``reserve_capacity``) and later prompts reuse that
allocation. The prefill and tree forwards stay eager (their lengths and masks vary).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from . import ragged
from .draft import Draft
from .hidden import HiddenStates, LayerSelector, check_hidden_layers, find_run, layer_runs
from .prefix_cache import PrefixCache
from ..common.errors import UserError
from .tree import tree_attention
from .compiled import CompiledForward
from .lean import LeanForward, lean_unusable

CACHE_KINDS = ("dynamic", "static", "prefix")
PREALLOCATED = ("static", "prefix")  # kinds with a fixed allocation and a length pointer
CACHE_BUCKET = 256  # static allocations are multiples of this many slots (max_cache_len=None)


@dataclass
class ScoreResult:
    logits: torch.Tensor  # [L+1, V] at [last token] + draft
    hidden: HiddenStates | None  # at the same L+1 positions when the target computes hidden states


def crop_cache(cache, keep: int) -> None:
    """Crop an HF cache to its first ``keep`` tokens.

    ``DynamicCache.crop`` changed meaning across transformers versions (older: positive = final
    length; 5.x: only negative = number of tokens to remove). A negative count means "remove this
    many" in both, so always pass that.
    """
    remove = int(cache.get_seq_length()) - keep
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {keep}")
    if remove:
        cache.crop(-remove)


def auto_cache_kind(device, compile: bool = False) -> str:
    """``--cache auto``: static on CUDA or under torch.compile (stable shapes), prefix on a CPU. There the
    static cache measured 7% slower per round than dynamic (``bench-round --cache all``, default target,
    2 threads: its attention spans the whole allocation) and prefix faster than both (one-token step at
    1,200 tokens of context: dynamic 43.4 ms, static 41.5, prefix 39.4)."""
    return "static" if compile or torch.device(device).type == "cuda" else "prefix"


class PrefixLayer(StaticLayer):
    """A static layer whose ``update`` writes the new keys/values in place and returns views of the filled
    prefix only, so attention spans the context, not the allocation. ``filled`` (a Python int: these
    shapes are meant to change) is the pointer; the causal mask is sized from it (``get_mask_sizes``)."""

    is_compileable = False

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len, **kwargs)
        self.filled = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        block = ragged.active()  # a batched round's block fed ragged (decode/core/ragged.py): W slots a row
        start = self.filled
        end = start + (key_states.shape[-2] if block is None else block.W)
        if end > self.max_cache_len:
            raise ValueError(f"prefix cache overflow: {end} tokens in {self.max_cache_len} slots (KVCache.reserve "
                             f"grows it before a forward)")
        if block is None:
            self.keys[:, :, start:end].copy_(key_states)
            self.values[:, :, start:end].copy_(value_states)
        else:
            block.write(self.keys, start, key_states)
            block.write(self.values, start, value_states)
        self.filled = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.filled + query_length, 0

    def get_seq_length(self) -> int:
        return self.filled


def check_tree_support(config) -> None:
    """Tree drafts pass one 4-D mask to every layer, which is right for full attention only (a
    sliding-window layer would need its window applied too): refuse other layer types by name."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    other = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]) - {"full_attention"})
    if other:
        raise UserError(f"tree drafts need full-attention layers; this model also has {other} layers: use chain "
                        "drafts (arms without tree=, K= or union) with it")


def check_cache_kind(kind: str) -> str:
    if kind not in CACHE_KINDS:
        raise UserError(f"cache must be one of {', '.join(CACHE_KINDS)}, got '{kind}'")
    return kind


def round_up(n: int, to: int = CACHE_BUCKET) -> int:
    return max(to, -(-n // to) * to)


def _kv_dims(config) -> tuple[int, int]:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv, head_dim


def allocate_cache(config, kind: str, size: int, dtype: torch.dtype, device, batch: int = 1) -> StaticCache:
    """A pre-allocated HF cache of ``size`` slots for ``batch`` rows: ``static`` (StaticLayer) or ``prefix``
    (:class:`PrefixLayer`: attention over the filled prefix only). Full-attention models only (a clear error
    otherwise)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    cache = StaticCache(config=config, max_cache_len=size)
    bad = [type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer]
    if bad:
        raise UserError(f"cache={kind} supports full-attention layers only; this model's cache has "
                        f"{sorted(set(bad))} layers (sliding-window / linear attention): use cache=dynamic")
    if kind == "prefix":
        cache.layers = [PrefixLayer(size) for _ in cache.layers]
    kv, head_dim = _kv_dims(config)
    cache.early_initialization(batch, kv, head_dim, dtype, device)
    return cache


class KVCache:
    """The KV cache of one sequence, with a length pointer (see the module docstring).

    ``hf`` is the HF cache object to pass as ``past_key_values``; ``length`` is the number of cached
    tokens. Protocol around a forward of n tokens: ``pos = kv.positions(n)`` (checks/grows capacity,
    returns the position ids), run the model with ``past_key_values=kv.hf, position_ids=pos``, then
    ``kv.advance(n)``. ``crop(keep)`` rolls back.
    """

    def __init__(self, config, kind: str = "dynamic", max_cache_len: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        self.kind = check_cache_kind(kind)
        if max_cache_len is not None and int(max_cache_len) < 1:
            raise UserError(f"max_cache_len must be >= 1 (or None to size the cache per prompt), got {max_cache_len}")
        self.config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.max_cache_len = None if max_cache_len is None else int(max_cache_len)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype or torch.float32
        self.hf = None
        self.length = 0
        self.capacity = 0  # allocated slots (static); 0 = nothing allocated yet
        self.allocations = 0  # static allocations so far (tests / diagnostics)
        if self.kind == "dynamic":
            self.start()  # a static one is allocated by the first start() / forward

    @classmethod
    def for_model(cls, model, kind: str = "dynamic", max_cache_len: int | None = None,
                  config=None) -> "KVCache":
        p = next(model.parameters())
        return cls(config if config is not None else model.config, kind, max_cache_len, p.device, p.dtype)

    # -- allocation ---------------------------------------------------------------------------------
    def _allocate(self, size: int) -> StaticCache:
        self.allocations += 1
        return allocate_cache(self.config, self.kind, size, self.dtype, self.device)

    def start(self, capacity: int | None = None, minimum: int = 0) -> None:
        """Begin a new sequence (length 0).

        capacity: the most tokens it will hold (declared by the caller); None = unknown: at least
        ``minimum`` (e.g. the prompt) — an unfixed static cache then allocates ``minimum`` +
        ``CACHE_BUCKET`` slots (rounded up) and grows on demand."""
        self.length = 0
        if self.kind == "dynamic":
            self.hf = DynamicCache()
            return
        need = int(capacity) if capacity is not None else int(minimum)
        if self.max_cache_len is not None:
            if need > self.max_cache_len:
                raise UserError(f"this sequence needs a KV cache of {need} tokens but max_cache_len is "
                                f"{self.max_cache_len}; raise max_cache_len (or leave it unset) or use cache=dynamic")
            size = self.max_cache_len
        else:
            size = round_up(need if capacity is not None else need + CACHE_BUCKET)
        if self.hf is None or self.capacity < size:
            self.hf, self.capacity = self._allocate(size), size
        self._sync()

    def _grow(self, need: int) -> None:
        if self.max_cache_len is not None:
            raise UserError(f"the context reached {need} tokens but the static KV cache holds max_cache_len="
                            f"{self.max_cache_len}; raise max_cache_len (or leave it unset) or use cache=dynamic")
        size = max(2 * self.capacity, round_up(need))
        old, keep = self.hf, self.length
        new = self._allocate(size)
        for a, b in zip(old.layers, new.layers):
            b.keys[:, :, :keep].copy_(a.keys[:, :, :keep])
            b.values[:, :, :keep].copy_(a.values[:, :, :keep])
        self.hf, self.capacity = new, size
        self._sync()

    def _sync(self) -> None:
        for layer in self.hf.layers:
            if self.kind == "prefix":
                layer.filled = self.length
            else:
                layer.cumulative_length.fill_(self.length)

    # -- the pointer --------------------------------------------------------------------------------
    def reserve(self, n: int) -> None:
        """Make room for a forward of ``n`` more tokens (grows a static cache if needed)."""
        if self.kind in PREALLOCATED and self.length + n > self.capacity:
            if self.hf is None:
                self.start(minimum=n)
            else:
                self._grow(self.length + n)

    def positions(self, n: int) -> torch.Tensor:
        """Position ids [1, n] for the next forward of ``n`` tokens (grows a static cache if needed)."""
        self.reserve(n)
        return torch.arange(self.length, self.length + n, device=self.device).unsqueeze(0)

    def key_length(self, n: int) -> int:
        """How many key slots a forward of ``n`` new tokens attends over (the width of a custom 4-D
        attention mask): cached + new (dynamic, prefix), the whole allocation for a static one."""
        return self.capacity if self.kind == "static" else self.length + n

    def advance(self, n: int) -> None:
        self.length += n

    def load(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Fill an empty sequence's first n slots with per-layer ``[kv heads, n, dim]`` keys and values (a prompt's
        cached prefix: decode/core/prefix_cache.py), copied; the pointer moves to n."""
        if self.length:
            raise ValueError(f"load fills an empty sequence; this one holds {self.length} tokens")
        n = keys[0].shape[-2]
        self.reserve(n)
        if self.kind == "dynamic":
            for i, (k, v) in enumerate(zip(keys, values)):
                self.hf.update(k[None].clone(), v[None].clone(), i)
        else:
            for layer, k, v in zip(self.hf.layers, keys, values):
                layer.keys[0, :, :n].copy_(k)
                layer.values[0, :, :n].copy_(v)
        self.length = n
        if self.kind in PREALLOCATED:
            self._sync()

    def export(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the first ``n`` cached tokens' keys and values, per layer ``[kv heads, n, dim]``."""
        if n > self.length:
            raise ValueError(f"cannot export {n} tokens of a cache holding {self.length}")
        layers = self.hf.layers
        return [x.keys[0, :, :n].clone() for x in layers], [x.values[0, :, :n].clone() for x in layers]

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` cached tokens."""
        if not 0 <= keep <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {keep}")
        if keep == self.length:
            return
        if self.kind == "dynamic":
            crop_cache(self.hf, keep)
        self.length = keep
        if self.kind in PREALLOCATED:
            self._sync()

    def compact(self, keep: int, slots: list[int]) -> None:
        """Keep the first ``keep`` entries followed by the entries at ``slots`` (increasing slot indices
        ≥ keep, e.g. the accepted path of a scored tree), moved into consecutive slots.

        Dynamic cache: one ``index_select`` over the sequence dim per layer. Static and prefix caches: the entries
        are copied down into slots keep.. and the pointer moves (the tensors keep their addresses)."""
        slots = [int(s) for s in slots]
        if any(b <= a for a, b in zip(slots, slots[1:])) or (slots and (slots[0] < keep or slots[-1] >= self.length)):
            raise ValueError(f"compact: slots {slots} must increase within [{keep}, {self.length})")
        if slots == list(range(keep, keep + len(slots))):  # already in place (a chain): just crop
            self.crop(keep + len(slots))
            return
        src = torch.tensor(slots, dtype=torch.long, device=self.device)
        if self.kind == "dynamic":
            idx = torch.cat([torch.arange(keep, device=self.device), src])
            for layer in self.hf.layers:
                layer.keys = layer.keys.index_select(-2, idx)
                layer.values = layer.values.index_select(-2, idx)
        else:
            dst = torch.arange(keep, keep + len(slots), device=self.device)
            for layer in self.hf.layers:
                layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
                layer.values.index_copy_(2, dst, layer.values.index_select(2, src))
        self.length = keep + len(slots)
        if self.kind in PREALLOCATED:
            self._sync()

    def get_seq_length(self) -> int:
        return self.length


class Target:
    """cache: "dynamic" | "static" | "prefix" (see the module docstring); max_cache_len: a fixed static
    allocation (None = sized per prompt from ``prefill``'s capacity, growing when needed);
    compile: torch.compile the verification forward (static cache only); forward: "hf" runs the HF model's own
    forward, "lean" our loop over its modules (decode/core/lean.py; refused where it cannot run).

    Hidden states (``want_hidden``): every forward returns :class:`~decode.core.hidden.HiddenStates`, the post-norm
    final state and, in ``extra``, the ``extra_layers`` arms asked for with :meth:`request_hidden` (EAGLE-3
    fusion); each arm reads its own layers through the selector that call returned."""

    def __init__(self, model, tokenizer=None, *, want_hidden: bool = False, cache: str = "dynamic",
                 max_cache_len: int | None = None, compile: bool = False, forward: str = "hf"):
        self.model = model
        self.tokenizer = tokenizer
        self.want_hidden = want_hidden
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.cache_kind = check_cache_kind(cache)
        if compile and cache != "static":
            raise UserError(f"compile=True needs cache=static (a {cache} cache changes shape every round)")
        self.kv = KVCache.for_model(model, cache, max_cache_len)
        self.compile = bool(compile)
        self.compiled = CompiledForward(model) if compile else None
        if forward not in ("hf", "lean"):
            raise ValueError(f"forward must be 'hf' or 'lean' (resolve --forward auto first), got '{forward}'")
        if forward == "lean" and (why := lean_unusable(model, cache, compile)) is not None:
            raise UserError(f"the lean forward cannot run this target: {why}; use forward=hf")
        self.forward_kind = forward
        self.run = LeanForward(model) if forward == "lean" else model  # what eager forwards call
        # how ``model``'s linears run: stock, onednn or mixed (decode/core/linear.py); build_engine records it
        self.linear = "stock"
        self.linear_probe: dict | None = None  # --linear auto's measurement (build_engine), else None
        self.attention_probe: dict | None = None  # decode/core/attention.py probe_attention's (build_engine)
        self.forwards = 0
        self.prefill_hidden: HiddenStates | None = None
        # prompts' KV kept across sequences (decode/core/prefix_cache.py; None: every prompt prefilled whole), and
        # how many of the last prompt's positions came from it
        self.prefix_cache: PrefixCache | None = None
        self.prefix_reused = 0
        # layers of HiddenStates.extra besides the final state, in column order (d columns each); arms add
        # theirs with request_hidden
        self.extra_layers: tuple[int, ...] = ()
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.hidden_size, self.num_layers = cfg.hidden_size, cfg.num_hidden_layers

    @property
    def fused_ops(self) -> bool | None:
        """Whether the lean forward runs the fused layer ops (decode/core/kernels/glue.py); None on transformers'."""
        return self.run.layers.fused if self.forward_kind == "lean" else None

    def request_hidden(self, layers) -> LayerSelector:
        """Ask for the hidden states of ``layers`` (ids as in :func:`~decode.core.hidden.check_hidden_layers`) in every
        forward and return the selector that reads them, in that order, from the :class:`HiddenStates` this
        target yields. Turns ``want_hidden`` on. Layers other than the final state are added to ``extra_layers``
        (a run already there is reused; a new one is appended, so earlier selectors stay valid): EAGLE-1 and
        EAGLE-3 arms can share one target."""
        layers = check_hidden_layers(layers, self.num_layers, "Target.request_hidden")
        have = self.extra_layers
        for run in filter(None, layer_runs(layers)):
            if find_run(have, run) is None:
                have = have + run
        self.extra_layers = have
        self.want_hidden = True
        return LayerSelector(layers, self.extra_layers, self.hidden_size)

    @property
    def hidden_key(self) -> tuple:
        """What a prefix cache entry's hidden states are kept under: the layers they hold."""
        return ("hidden", self.extra_layers)

    def _hidden(self, out) -> HiddenStates | None:
        return HiddenStates.from_hf(out.hidden_states, self.extra_layers) if self.want_hidden else None

    @property
    def cache(self):
        """The HF cache object of the current sequence."""
        return self.kv.hf

    @property
    def cached(self) -> int:
        return self.kv.length

    def _forward(self, ids: list[int] | torch.Tensor, hidden: bool, compiled: bool = False, last_logits: bool = False):
        """last_logits: only the last position's logits are needed (a prefill), so the LM head runs on one row
        where the model supports ``logits_to_keep`` (a 1,000-token prompt otherwise multiplies 1,000 rows by
        the whole vocabulary for nothing)."""
        x = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(1, -1)
        pos = self.kv.positions(x.shape[1])
        if compiled and self.compiled is not None:
            out = self.compiled(input_ids=x, position_ids=pos, past_key_values=self.kv.hf, output_hidden_states=hidden)
        else:
            extra = {"logits_to_keep": 1} if last_logits and self._keeps_logits else {}
            with torch.inference_mode():
                out = self.run(input_ids=x, position_ids=pos, past_key_values=self.kv.hf, use_cache=True,
                               output_hidden_states=hidden, **extra)
        self.kv.advance(x.shape[1])
        return out

    def reserve_capacity(self, capacity: int) -> None:
        """Allocate a static cache for sequences of up to ``capacity`` tokens now, so every later prompt that
        fits reuses it (one cache shape for a whole run: what compiled graphs need). No-op for a dynamic cache."""
        if self.cache_kind in PREALLOCATED:
            self.kv.start(int(capacity))

    def warm_up(self, max_positions: int, *, show: bool = True) -> float:
        """Compile the verification forward for 1 … ``max_positions`` positions now (``compile=True``; else a
        no-op returning 0) on a scratch sequence at the current cache capacity, one line per new graph on
        stderr unless ``show`` is False; returns the seconds it took. Resets the current sequence (call it
        before a query's prefill)."""
        if self.compiled is None or max_positions < 1:
            return 0.0
        start = time.perf_counter()
        self.kv.start(self.kv.capacity or None, minimum=int(max_positions) + 1)
        announce, self.compiled.announce = self.compiled.announce, show
        try:
            for n in range(1, int(max_positions) + 1):
                self.score(0, torch.zeros(n - 1, dtype=torch.long))
                self.kv.crop(0)
        finally:
            self.compiled.announce = announce
        self.forwards = 0
        return time.perf_counter() - start

    def prefill(self, prompt_ids: list[int], capacity: int | None = None) -> None:
        """Start a new sequence: cache all prompt tokens but the last.

        capacity: the most tokens this sequence will hold in the cache (prompt + max_new_tokens +
        max draft length + 1 is a safe bound); sizes a static cache (ignored by a dynamic one).
        None = unknown: the prompt plus ``CACHE_BUCKET`` slots, grown when needed (with a fixed
        ``max_cache_len``, only the prompt is checked up front)."""
        if len(prompt_ids) == 0:
            raise ValueError("empty prompt")
        if capacity is not None and capacity < len(prompt_ids) - 1:
            raise ValueError(f"capacity {capacity} is smaller than the prompt ({len(prompt_ids)} tokens)")
        self.kv.start(capacity, minimum=len(prompt_ids))
        self.forwards = 0
        self.prefill_hidden = None  # HiddenStates at the len(prompt)-1 cached positions when want_hidden
        self.prefix_reused = 0
        if len(prompt_ids) > 1:
            ids = list(prompt_ids[:-1])
            need = self.hidden_key  # what the arms read at the prompt's positions
            hit = (self.prefix_cache.longest(ids, [need] if self.want_hidden else [])
                   if self.prefix_cache is not None else None)
            if hit is not None:
                self.kv.load(hit.keys, hit.values)
                self.prefix_reused = len(hit.tokens)
                self.prefill_hidden = hit.states.get(need) if self.want_hidden else None
            if self.prefix_reused < len(ids):
                out = self._forward(ids[self.prefix_reused:], hidden=self.want_hidden, last_logits=True)
                new = self._hidden(out)
                self.prefill_hidden = new if hit is None or new is None else self.prefill_hidden.cat(new)
                if self.prefix_cache is not None:
                    keys, values = self.kv.export(len(ids))
                    self.prefix_cache.put(ids, keys, values, {need: self.prefill_hidden} if self.want_hidden else {})

    def remember(self, ctx: list[int], hidden: HiddenStates | None) -> None:
        """Keep a finished sequence in the prefix cache: its cached positions (``ctx`` but its last token, which the
        cache does not hold) with the hidden states at them (``hidden``, when the arms read them), so a chat's next
        turn, which re-sends this prompt and answer, prefills only its new message. No-op without a prefix cache, and
        where the arms read hidden states that ``hidden`` does not cover (an entry without them would serve no
        prompt of this target's: its lookups ask for them)."""
        m = len(ctx) - 1
        if self.prefix_cache is None or m < 1:
            return
        if self.want_hidden and (hidden is None or hidden.final.shape[0] != m):
            return
        keys, values = self.kv.export(m)
        self.prefix_cache.put(ctx[:m], keys, values, {self.hidden_key: hidden} if self.want_hidden else {})

    def score(self, last_token: int, draft_tokens: torch.Tensor) -> ScoreResult:
        """Verification forward over ``[last_token] + draft`` (one target forward pass)."""
        ids = torch.cat([torch.tensor([last_token]), draft_tokens.to(torch.long).cpu()])
        out = self._forward(ids, hidden=self.want_hidden, compiled=True)
        self.forwards += 1
        hidden = self._hidden(out)
        return ScoreResult(out.logits[0].float(), hidden)

    def score_tree(self, last_token: int, draft: Draft) -> ScoreResult:
        """One verification forward over ``[last_token]`` + every node of a tree draft.

        Row 0 of the logits/hidden states is at the last token, row n + 1 at node n: the target's
        distribution after the context and the root path to node n. The tree goes through the HF model's
        own inputs: per-node ``position_ids`` (context length + depth) and a 4-D additive
        ``attention_mask`` in which every node sees the cached context, the last token, its ancestors and
        itself (decode/core/tree.py ``tree_attention``). Runs eagerly (also with ``compile=True``: the compiled
        graph is the chain's, without a mask). Afterwards the cache holds all N + 1 entries; keep the
        accepted path with :meth:`keep_path`. A chain (``parents`` None) works too.
        """
        check_tree_support(self.model.config)
        parents = draft.parents if draft.parents is not None else torch.arange(-1, len(draft) - 1)
        parents = torch.cat([torch.tensor([-1]), parents + 1])  # the last token is the tree's root
        ids = torch.cat([torch.tensor([last_token]), draft.tokens.to(torch.long).cpu()])
        n = ids.numel()
        self.kv.reserve(n)
        pos, mask = tree_attention(parents, self.kv.length, self.kv.key_length(n), self.dtype, self.device)
        with torch.inference_mode():
            out = self.run(input_ids=ids.to(self.device).unsqueeze(0), position_ids=pos, attention_mask=mask,
                           past_key_values=self.kv.hf, use_cache=True, output_hidden_states=self.want_hidden)
        self.kv.advance(n)
        self.forwards += 1
        hidden = self._hidden(out)
        return ScoreResult(out.logits[0].float(), hidden)

    def keep_path(self, keep: int, path: list[int]) -> None:
        """After :meth:`score_tree` from ``keep`` - 1 cached tokens: keep the context (``keep`` entries,
        the last token's included) and the accepted nodes ``path`` (root first), compacted into
        consecutive slots; the rejected branches' entries are dropped."""
        self.kv.compact(keep, [keep + int(i) for i in path])

    def rollback(self, keep: int) -> None:
        """Keep the first ``keep`` cached tokens (the accepted prefix)."""
        self.kv.crop(keep)
