"""Grouped-query attention without copying the cache: the target's attention on a CPU.

Why: a verification forward scores several positions at an offset into the cache, so transformers builds a
causal mask, and with a mask its SDPA path expands every key/value head to the query heads (``repeat_kv``)
before calling the kernel: a copy of the whole cache per layer per round (default target: 3 KV heads → 9,
30 layers; at 1,200 tokens of context it made scoring 2 positions cost 49.9 ms against 39.4 ms for one).
PyTorch's CPU SDPA takes the grouped heads directly (``enable_gqa=True``) also with a mask, which transformers
enables only for one-query forwards (no mask) or by a process-wide environment variable. Measured on that
context: 2 positions 38.7 ms, 3 positions 42.6 (from 49.9 and 52.3).

:func:`gqa_attention_model` returns the target's run model with this attention; the stock model (the ``hf``
reference, arms that run target layers) keeps transformers' own. Only the masked, grouped case changes;
every other call is transformers' ``sdpa`` as it is. Results differ from ``repeat_kv`` + SDPA by float32
summation order only (another kernel path, like scoring n positions instead of one); greedy equality with plain
``generate`` is what the tests and every evaluation's lossless column check.

A few queries (2..``GROUPED_MATMUL_MAX`` positions where measured faster: a verification block, a batched round's
block) go through two matmuls per key/value head instead (:func:`grouped_attention`): the group's query heads and
positions are one ``[heads/kv · W, dim]`` operand against that head's keys, so the cache is read once per key/value
head. PyTorch's CPU SDPA reads it once per query head and query block, and its cost doubles from one position to
two: measured (2 threads, Zen 5, 9 query / 3 KV heads of 64) at 16 rows × 300 cached tokens 0.51 ms for 2 positions
against 0.21 ms for one, where the matmuls take 0.25 ms (3 positions: 0.71 → 0.33; 4 rows: 0.15 → 0.08; one row ×
1,000 tokens, 3 positions: 0.15 → 0.10); past 8 positions SDPA's blocked kernel is as fast or faster (prefill stays
on it).

Which kernel wins depends on the machine: on an AMX Xeon SDPA was faster at every shape tried (16 rows × 420 tokens,
2 positions: 99.3 ms a forward against 108.6 with the matmuls). :func:`probe_attention` times both on the model's
attention shape once per process and sets ``GROUPED_SIZES``, the block sizes the matmuls run (measured faster), as
``--linear auto`` measures the linears; the engines run it when they build the target's run model.

On CUDA, SDPA with a mask and ``enable_gqa`` falls back to its math kernel, so this is CPU-only.
"""
from __future__ import annotations

import sys

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..common.device import interleaved_medians, seconds_of
from . import ragged
from .models import weight_sharing_copy

NAME = "adaspec_gqa_sdpa"
GROUPED_MATMUL_MAX = 8  # the most query positions :func:`grouped_attention` is considered for (module docstring)
GROUPED_SIZES = frozenset(range(2, GROUPED_MATMUL_MAX + 1))  # the masked block sizes it runs (probe_attention sets it)
GROUPED_MARGIN = 0.97  # a block size runs the matmuls only where they measured 3% faster: a tie stays on stock SDPA
_PROBED: dict[tuple, dict] = {}  # probe_attention's result per attention shape, once per process


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs):
    """transformers' ``sdpa`` attention, except that a masked forward of a grouped-query layer passes the
    key/value heads to SDPA as they are (``enable_gqa``) instead of repeating them; a ragged block's queries
    (decode/core/ragged.py) are attended padded and their outputs gathered again."""
    block = ragged.active()  # a batched round's block fed ragged: attention sees it padded (decode/core/ragged.py)
    if block is None:
        return _attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    out, weights = _attention(module, block.scatter_heads(query), key, value, attention_mask, dropout, scaling,
                              is_causal, **kwargs)
    return block.gather(out), weights


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
               **kwargs):
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (attention_mask is None or groups <= 1 or query.device.type != "cpu" or kwargs.get("softcap") is not None
             or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask[:, :, :, :key.shape[-2]] if attention_mask.ndim == 4 else attention_mask
    if (query.shape[2] in GROUPED_SIZES and not dropout and mask.ndim == 4 and mask.shape[1] == 1
            and query.dtype in (torch.float32, torch.float64)):
        out = grouped_attention(query, key, value, mask, scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                               scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """Softmax attention of ``query`` [B, H, W, d] over grouped ``key``/``value`` [B, KV, T, d] (query head h reads
    key/value head h // (H / KV), as ``repeat_kv`` pairs them) under ``mask`` [B, 1, W, T] (additive, or bool =
    visible): [B, H, W, d], as SDPA with ``enable_gqa`` computes it, in two matmuls per key/value head (module
    docstring; float32 or float64, where the scores keep the inputs' precision)."""
    B, H, W, d = query.shape
    KV, T = key.shape[1], key.shape[2]
    G = H // KV
    if mask.dtype == torch.bool:
        hidden = torch.finfo(query.dtype).min
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(~mask, hidden)
    scores = torch.matmul(query.reshape(B, KV, G * W, d), key.transpose(-1, -2))
    scores.mul_(d ** -0.5 if scale is None else scale)
    scores = scores.view(B, KV, G, W, T).add_(mask[:, :, None].to(scores.dtype)).view(B, KV, G * W, T)
    return torch.matmul(scores.softmax(-1), value).view(B, H, W, d)


def _time_kernels(rows: int, heads: int, kv: int, dim: int, positions: int, context: int, dtype: torch.dtype,
                  reps: int) -> dict[str, float]:
    """Median seconds of :func:`grouped_attention` and of SDPA with ``enable_gqa`` on one masked block of ``positions``
    queries per row over ``context`` cached keys (a verification block's causal mask), interleaved, after a warm-up."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, positions, dim, generator=g, dtype=dtype)
    k, v = (torch.randn(rows, kv, context, dim, generator=g, dtype=dtype) for _ in range(2))
    # a boolean mask, as transformers' sdpa masks are (the matmuls turn it additive per call, a cost they pay)
    mask = torch.ones(positions, context, dtype=torch.bool).tril(context - positions).expand(rows, 1, -1, -1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.inference_mode():
        return interleaved_medians({"grouped": lambda: seconds_of(lambda: grouped_attention(q, k, v, mask)),
                                    "sdpa": lambda: seconds_of(lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True))},
                                   reps)


def probe_attention(model: torch.nn.Module, rows: tuple[int, ...] = (1, 16), context: int = 384, reps: int = 15,
                    measure=_time_kernels) -> dict | None:
    """Time the grouped matmuls against SDPA on ``model``'s attention shape (query heads, key/value heads, head
    size, dtype) for masked blocks of 2 … ``GROUPED_MATMUL_MAX`` positions at ``rows`` rows over ``context`` cached
    tokens, and set ``GROUPED_SIZES`` to the sizes at which the matmuls took ``GROUPED_MARGIN`` of SDPA's time or
    less, summed over the rows (none: SDPA runs every masked block). Once per process and shape (a few tenths of a
    second); returns {"grouped_sizes", "context", "rows", "ms": {kernel: {positions: ms summed over rows}}}, or None
    where the model does not run this module's attention on a CPU."""
    global GROUPED_SIZES
    param = next(model.parameters())
    if param.device.type != "cpu" or not any(c._attn_implementation == NAME for c in _attention_configs(model)):
        return None
    heads, kv, dim = _attention_shape(model)
    key = (heads, kv, dim, param.dtype, rows, context)
    if key not in _PROBED:
        sizes = range(2, GROUPED_MATMUL_MAX + 1)
        ms = {"grouped": {}, "sdpa": {}}
        for n in sizes:
            per_row = [measure(r, heads, kv, dim, n, context, param.dtype, reps) for r in rows]
            for name in ms:
                ms[name][n] = round(1e3 * sum(t[name] for t in per_row), 3)
        grouped = [n for n in sizes if ms["grouped"][n] < GROUPED_MARGIN * ms["sdpa"][n]]
        _PROBED[key] = {"grouped_sizes": grouped, "context": context, "rows": list(rows),
                        "ms": {name: {str(n): v for n, v in per.items()} for name, per in ms.items()}}
        what = (f"grouped matmuls for blocks of {','.join(map(str, grouped))} positions, SDPA for the others"
                if grouped else "SDPA for every masked block")
        print(f"attention probe: {what} (blocks of {sizes[0]}..{sizes[-1]} positions at {'+'.join(map(str, rows))} "
              f"rows × {context} tokens: " + ", ".join(f"{k} {'/'.join(f'{v:.2f}' for v in per.values())} ms"
                                                     for k, per in ms.items()) + ")", file=sys.stderr)
    GROUPED_SIZES = frozenset(_PROBED[key]["grouped_sizes"])
    return _PROBED[key]


def _attention_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size) of ``model``'s decoder attention."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    return (heads, getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, gqa_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as transformers' sdpa


def gqa_attention_model(model: torch.nn.Module, *, in_place: bool = False) -> torch.nn.Module:
    """``model`` running :func:`gqa_sdpa_attention` where it runs transformers' ``sdpa`` on a CPU with grouped
    key/value heads; else ``model`` itself. The result is a copy of the module tree that shares every parameter
    and buffer with ``model`` (only its config differs), so ``model`` keeps running as it did; ``in_place``
    changes ``model`` itself instead (a copy made for the run already, e.g. the packed-linear one)."""
    heads, kv, _ = _attention_shape(model)
    device = next(model.parameters()).device
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or kv == heads or device.type != "cpu":
        return model
    return our_attention_model(model, in_place=in_place)


def our_attention_model(model: torch.nn.Module, *, in_place: bool = False) -> torch.nn.Module:
    """``model`` running :func:`gqa_sdpa_attention` (``model`` itself where it does already; else a weight-sharing
    copy, or ``model`` changed with ``in_place``). Whatever the device and heads: where the grouped path does not
    apply it runs transformers' ``sdpa`` as it is, and a batched round's ragged block (decode/core/ragged.py) needs
    this attention to unpack it."""
    if all(c._attn_implementation == NAME for c in _attention_configs(model)):
        return model
    _register()
    fast = model if in_place else weight_sharing_copy(model)
    fast.set_attn_implementation(NAME)
    for config in _attention_configs(fast):  # a copy's configs are its own (copied with it)
        config._attn_implementation = NAME
    return fast.eval()


def _attention_configs(model: torch.nn.Module) -> list:
    """Every config a module of ``model`` reads its attention from: not the model's alone, since a head's layer,
    cloned from the target's, reads the target's config, not its stack's."""
    return [c for m in model.modules() if hasattr(c := getattr(m, "config", None), "_attn_implementation")]
