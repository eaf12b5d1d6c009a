"""Device and dtype choice, defined once for every command (``--device``/``--dtype``, recipe fields).

``auto`` means CUDA with bfloat16 when a GPU is visible, else CPU with float32 (bf16 matmuls on a CPU
are slower than fp32 and change greedy outputs). Timed regions call :func:`synchronize` so GPU work
queued asynchronously is inside the measurement.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable

import torch

from .errors import UserError

DEVICES = "auto|cpu|cuda[:N]"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str | torch.device | None = "auto", *, flag: str = "--device") -> torch.device:
    """``auto`` → cuda if available else cpu; ``cuda[:N]`` must exist (a clear error, not a late crash)."""
    if isinstance(spec, torch.device):
        return spec
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise UserError(f"{flag} must be {DEVICES}, got '{spec}'") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise UserError(f"{flag} must be {DEVICES}, got '{spec}'")
    if not torch.cuda.is_available():
        raise UserError(f"{flag} {spec}: no CUDA device is visible to PyTorch (is this the CUDA build of torch?); "
                        f"use {flag} cpu or auto")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"{flag} {spec}: only {torch.cuda.device_count()} CUDA device(s) visible "
                        f"(valid: cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return dev


def resolve_dtype(spec: str | torch.dtype | None, device: torch.device, *, flag: str = "--dtype") -> torch.dtype:
    """``auto`` → bfloat16 on CUDA, float32 elsewhere; otherwise one of :data:`DTYPES`."""
    if isinstance(spec, torch.dtype):
        return spec
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec not in DTYPES:
        raise UserError(f"{flag} must be auto|{'|'.join(DTYPES)}, got '{spec}'")
    return DTYPES[spec]


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued device work (a no-op on CPU), so a timer brackets the work it means to time."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def seconds_of(run: Callable[[], object]) -> float:
    """Wall seconds of one call of ``run`` (CPU work; GPU work must be synchronised by ``run`` itself)."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def interleaved_medians(measures: dict[Hashable, Callable[[], float]], reps: int) -> dict[Hashable, float]:
    """Median of what each ``measures`` callable returns (seconds of one run) over ``reps`` rounds that call every
    one in turn, so a machine's drift hits all alike, after one uncounted round that warms caches and oneDNN's
    primitive cache. How the probes choose between kernels (decode/core/linear.py, decode/core/attention.py)."""
    seconds: dict[Hashable, list[float]] = {key: [] for key in measures}
    for rep in range(reps + 1):
        for key, measure in measures.items():
            t = measure()
            if rep:
                seconds[key].append(t)
    return {key: statistics.median(ts) for key, ts in seconds.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
