"""The small ops of a decoder layer, fused: RMSNorm, rotary embedding, the gated SiLU, and attention for the few
query rows of a round (``torch.ops.adaspec_glue``, glue.cpp; float32 CPU tensors).

Why: between its linears a layer of the default target runs ~40 small PyTorch ops (a composite RMSNorm of seven,
rotary embedding through ``rotate_half``'s slices and concatenations, SDPA's setup for a dozen queries). Each costs
microseconds of dispatch, allocation and setup, on caches the weight stream has just flushed: skipping them in a
verification forward (12 positions, 300 tokens of context, AMX Xeon, 2 threads; runs/diag/glue_abl.py) took the
norms 6.0 ms, rotary 2.2 ms and attention 7.5 ms of a 65 ms forward whose linears were ~40 ms. With these ops the
lean forward (decode/core/lean.py) scored 1 / 4 / 8 / 12 positions in 35.0 / 38.4 / 41.4 / 45.6 ms against 41.4 /
43.9 / 46.8 / 51.1 on PyTorch's (runs/diag/glue_ab.py), and the shipped pool went from 1.49x to 1.65x plain
``generate`` on dev prompts (docs/performance.md). vLLM ships its own ``rms_norm``, ``rotary_embedding``,
``silu_and_mul`` and attention ops for the same reason (on GPUs).

What they compute: :func:`rms_norm` is transformers' float32 RMSNorm, ``weight * (x * rsqrt(mean(x²) + eps))``
(the mean summed in another order: float32 rounding apart); :func:`rope_` is ``x * cos + rotate_half(x) * sin``
with the same roundings (bit-identical); :func:`silu_mul` and :func:`attention` (softmax(q kᵀ · scale + mask) v per
query head over its key/value head) use their own exp, a degree-7 polynomial after range reduction within a few
float32 ulps of ``torch.exp``. tests/test_glue_kernel.py holds each to PyTorch's ops; tests/test_lean.py the whole
forward to transformers'.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from .build import build_op

SOURCE = Path(__file__).with_name("glue.cpp")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
ATTENTION_MAX_QUERIES = 32  # more query positions (a prefill) go to SDPA's blocked kernel
MAX_HEAD_DIM = 128  # glue.cpp keeps up to kMaxDV = 16 vectors of a head in registers (8 floats each with AVX2)


@functools.lru_cache(maxsize=None)
def glue_usable() -> str | None:
    """None once the ops are built (or loaded) and registered, else the reason they cannot run."""
    return build_op("adaspec_glue", SOURCE, CFLAGS, "the fused layer ops")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.adaspec_glue.rms_norm(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the gated MLP's activation."""
    return torch.ops.adaspec_glue.silu_mul(gate, up)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on the q and k projections' outputs ``[B, n, heads * head_dim]`` (contiguous); ``cos``/``sin``:
    ``[B, n, head_dim]``, one row per row of q and k."""
    torch.ops.adaspec_glue.rope_(q, k, cos, sin)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """``q`` ``[1, heads, n, D]`` (roped; the transposed view of a projection's output reads without a copy),
    ``k``/``v`` the cache's ``[1, kv_heads, T, D]``, ``mask`` None (every key) or ``[1, 1, n, >= T]`` bool (True =
    attend) or float (added); returns ``[1, n, heads * D]``."""
    heads, n = q.shape[1], q.shape[2]
    if mask is not None:
        mask = mask.reshape(mask.shape[-2], mask.shape[-1])
    flat = q.transpose(1, 2).reshape(n, -1)
    return torch.ops.adaspec_glue.attention(flat, k, v, mask, heads, scale).view(1, n, -1)
