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

A few queries (2..``GROUPED_MATMUL_MAX`` positions: a verification block, a batched round's block) go through two
matmuls per key/value head instead (:func:`grouped_attention`): the group's query heads and positions are one
``[heads/kv · W, dim]`` operand against that head's keys, so the cache is read once per key/value head. PyTorch's
CPU SDPA reads it once per query head and query block, and its cost doubles from one position to two: measured
(2 threads, Zen 5, 9 query / 3 KV heads of 64) at 16 rows × 300 cached tokens 0.51 ms for 2 positions against
0.21 ms for one, where the matmuls take 0.25 ms (3 positions: 0.71 → 0.33; 4 rows: 0.15 → 0.08; one row × 1,000
tokens, 3 positions: 0.15 → 0.10); past 8 positions SDPA's blocked kernel is as fast or faster (prefill stays on it).

On CUDA, SDPA with a mask and ``enable_gqa`` falls back to its math kernel, so this is CPU-only.
"""
from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import ragged
from .models import weight_sharing_copy

NAME = "adaspec_gqa_sdpa"
GROUPED_MATMUL_MAX = 8  # the most query positions :func:`grouped_attention` takes (module docstring)


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
    if (2 <= query.shape[2] <= GROUPED_MATMUL_MAX and not dropout and mask.ndim == 4 and mask.shape[1] == 1
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
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
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
