"""The ``stream`` linear: ``y = x @ W.T`` for the few rows a decoding round multiplies, reading each weight once.

Why: a round scores 1 … L+1 positions (a tree: its nodes + 1), so every linear of the target multiplies a handful
of rows by a weight matrix it must stream from memory; on a CPU that is memory-bound, so scoring 8 positions should
cost about what scoring 1 does. The BLAS kernels do not get there: on a 2-core AMX Xeon (`lscpu` model 167)
MKL's sgemm steps in 30 ms for 1-3 positions and 44 ms for 4 (a small-row cliff: the verification curve jumps at the
fourth position), oneDNN's packed matmul is flat but slower from the first row (38 ms). This kernel packs each
weight once into blocks of 32 output columns, k-major (one sequential read per block), and multiplies up to 12 rows
(AVX-512; 3 with AVX2) per pass over a block with fused multiply-adds (gcc vector extensions, built with
``-march=native`` for the machine it runs on), summing over k in chunks of 64 so its float32 rounding is of stock's
size.

It is a C++ torch op (``torch.ops.adaspec_stream.linear``) built on first use with
``torch.utils.cpp_extension`` (gcc, the Python headers and ninja; ~15 s once, then loaded from
``<cache>/kernels``). ``--linear auto`` measures it beside the stock and oneDNN linears on the loaded target and
keeps it where it is faster (decode/core/linear.py); where it cannot be built, :func:`stream_usable` says why.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from ...common.errors import UserError
from .build import build_op

SOURCE = Path(__file__).with_name("stream_linear.cpp")
BLOCK = 32  # output columns per packed block (kCols in the source)
CFLAGS = ("-O3", "-march=native", "-fopenmp")


@functools.lru_cache(maxsize=None)
def stream_usable() -> str | None:
    """None once the op is built (or loaded) and registered here, else the reason it cannot run."""
    why = build_op("adaspec_stream", SOURCE, CFLAGS, "the stream linear kernel")
    if why is None:
        torch.library.register_fake("adaspec_stream::linear")(_fake_linear)
    return why


def _fake_linear(x, packed, bias, n):
    return x.new_empty((*x.shape[:-1], n))


def pack_stream(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] float32 weight as [ceil(N / 32), K, 32] (zero padded), the layout the kernel streams. Builds or
    loads the kernel first: packing for a kernel that cannot run here is an error naming why."""
    why = stream_usable()
    if why is not None:
        raise UserError(f"the stream linear kernel cannot run here: {why}; use --linear stock (or auto)")
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = weight.detach().new_zeros(blocks * BLOCK, k)
    padded[:n] = weight.detach()
    return padded.view(blocks, BLOCK, k).transpose(1, 2).contiguous()


def stream_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = pack_stream(weight)`` and ``n`` its output features
    (inference only: no autograd); the op is registered by :func:`stream_usable` (which :func:`pack_stream` calls)."""
    return torch.ops.adaspec_stream.linear(x, packed, bias, n)
