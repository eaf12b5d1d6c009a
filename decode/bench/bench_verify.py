"""Benchmark verification: fused Triton kernel vs the PyTorch reference, achieved GB/s vs device bandwidth.

Bytes counted are those a verifier must read: the target logits once (plus the draft
probabilities once with --draft-probs). GB/s = bytes / median time. On CUDA both backends are
timed with ``triton.testing.do_bench`` (median, L2 cache flushed before every run) and the kernel's
draws are checked against the reference on shared uniforms; on CPU only the reference runs (the
kernel needs a GPU) on a smaller default grid. Writes report.json and report.md beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..common.errors import UserError
from ..common.io import atomic_write_json, atomic_write_text
from ..core.sampling import SamplingConfig
from ..core.verify.reference import verify_reference

# Vendor datasheet memory bandwidth in GB/s, matched as a substring of torch.cuda.get_device_name()
# (longest key first). "H100" alone is the SXM part ("NVIDIA H100 80GB HBM3").
PEAK_GBPS = {
    "H200": 4800, "GH200": 4000, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350, "H800": 3350,
    "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "B200": 8000,
    "L40S": 864, "L40": 864, "L4": 300, "A10G": 600, "A10": 600, "RTX 4090": 1008, "RTX 3090": 936,
}
GPU_GRID = dict(vocab="32000,128256,152064", draft_len="1,4,8", batch="1,8,64", dtypes="bf16,fp32")
CPU_GRID = dict(vocab="32000,128256", draft_len="1,4", batch="1,8", dtypes="bf16,fp32")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when available")
    p.add_argument("--vocab", help=f"comma list (default GPU {GPU_GRID['vocab']}; CPU {CPU_GRID['vocab']})")
    p.add_argument("--draft-len",
                   help=f"comma list of L (default GPU {GPU_GRID['draft_len']}; CPU {CPU_GRID['draft_len']})")
    p.add_argument("--batch", help=f"comma list (default GPU {GPU_GRID['batch']}; CPU {CPU_GRID['batch']})")
    p.add_argument("--dtypes", help="comma list of fp16, bf16, fp32 (default bf16,fp32)")
    p.add_argument("--mode", default="sample", choices=["sample", "greedy"])
    p.add_argument("--temperature", type=float, help="sampling temperature > 0 (--mode sample; default 1.0)")
    p.add_argument("--top-k", type=int, help="--mode sample: 0 = off (default); top-k/top-p add a PyTorch pre-pass "
                                             "to the kernel")
    p.add_argument("--top-p", type=float, help="--mode sample: in (0, 1], 1 = off (default)")
    p.add_argument("--draft-probs", action="store_true", help="draft distributions instead of one-hot drafts")
    p.add_argument("--backends", default=None,
                   help="comma list of fused, reference (default: both on CUDA, reference on CPU)")
    p.add_argument("--peak-gbps", type=float, help="device memory bandwidth in GB/s (default: table by device name)")
    p.add_argument("--reps", type=int, default=5, help="CPU: timed repetitions per point (median)")
    p.add_argument("--threads", type=int, help="CPU: torch threads (1 is far steadier on a shared machine)")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="CUDA: do_bench warm-up time")
    p.add_argument("--rep-ms", type=float, default=100.0, help="CUDA: do_bench measuring time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_verify/report.json", help="report path (.md written beside it)")
    p.add_argument("--no-progress", action="store_true")


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} must be a comma list of integers, got '{text}'") from None
    if not vals or min(vals) < 0 or (flag != "--draft-len" and min(vals) < 1):
        raise UserError(f"{flag} needs positive values (draft length may be 0), got '{text}'")
    return vals


def _positive(value: float, flag: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{flag} must be a finite number > 0, got {value}")


def _sampling(args) -> SamplingConfig:
    """Greedy ignores temperature/top-k/top-p, so setting them there is a mistake rather than a no-op."""
    given = [f for f, v in (("--temperature", args.temperature), ("--top-k", args.top_k), ("--top-p", args.top_p))
             if v is not None]
    if args.mode == "greedy":
        if given:
            raise UserError(f"{', '.join(given)} only apply to --mode sample; --mode greedy takes the argmax")
        return SamplingConfig(0.0)
    temperature = 1.0 if args.temperature is None else args.temperature
    if not (math.isfinite(temperature) and temperature > 0):
        raise UserError(f"--temperature must be > 0 with --mode sample, got {temperature} "
                        "(use --mode greedy for temperature 0)")
    return SamplingConfig(temperature, args.top_k or 0, 1.0 if args.top_p is None else args.top_p)


def peak_gbps(device: torch.device, override: float | None) -> float | None:
    if override is not None:
        _positive(override, "--peak-gbps")
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_GBPS, key=len, reverse=True):
        if key in name:
            return float(PEAK_GBPS[key])
    return None


def make_inputs(B: int, L: int, V: int, dtype: torch.dtype, device, draft_probs: bool, gen):
    """Random logits (std 3), drafts that agree with the target's argmax half the time, uniforms."""
    kw = dict(device=device, generator=gen)
    logits = (3 * torch.randn(B, L + 1, V, **kw)).to(dtype)
    agree = torch.rand(B, L, **kw) < 0.5
    tokens = torch.where(agree, logits[:, :L].argmax(-1), torch.randint(0, V, (B, L), **kw))
    q = torch.softmax(3 * torch.randn(B, L, V, **kw), -1) if draft_probs else None
    return logits, tokens, q, torch.rand(B, L + 1, **kw)


def _time(fn, device: torch.device, args) -> float:
    """Median milliseconds of one call."""
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _fmt(x, spec):
    return "–" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    peak = report["peak_gbps"]
    lines = [f"Verification benchmark on {report['device_name']} ({report['mode']}, "
             f"{'draft probs' if report['draft_probs'] else 'one-hot drafts'}); "
             "MB = bytes that must be read: the logits "
             f"once{' + the draft probs once' if report['draft_probs'] else ''}; "
             f"peak {_fmt(peak, '.0f')} GB/s.", "",
             "| vocab | L | batch | dtype | MB | ref ms | ref GB/s | fused ms | fused GB/s | fused % peak | speedup "
             "| draws match |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["points"]:
        lines.append(f"| {r['vocab']} | {r['L']} | {r['batch']} | {r['dtype']} | {r['bytes'] / 1e6:.3g} | "
                     f"{_fmt(r['ref_ms'], '.4g')} | {_fmt(r['ref_gbps'], '.3g')} | {_fmt(r['fused_ms'], '.4g')} | "
                     f"{_fmt(r['fused_gbps'], '.3g')} | {_fmt(r['fused_pct_peak'], '.1f')} | "
                     f"{_fmt(r['speedup'], '.2f')} | {_fmt(r['match'], '.3f')} |")
    return "\n".join(lines)


def run(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible; use --device cpu")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    grid = GPU_GRID if device.type == "cuda" else CPU_GRID
    if args.reps < 1:
        raise UserError(f"--reps must be >= 1, got {args.reps}")
    _positive(args.warmup_ms, "--warmup-ms")
    _positive(args.rep_ms, "--rep-ms")
    cfg = _sampling(args)
    peak = peak_gbps(device, args.peak_gbps)
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    vocabs = _ints(args.vocab or grid["vocab"], "--vocab")
    lens = _ints(args.draft_len or grid["draft_len"], "--draft-len")
    batches = _ints(args.batch or grid["batch"], "--batch")
    dtype_names = [d.strip() for d in (args.dtypes or grid["dtypes"]).split(",") if d.strip()]
    bad = [d for d in dtype_names if d not in DTYPES]
    if bad or not dtype_names:
        raise UserError(f"--dtypes must be a comma list of {', '.join(DTYPES)}, got '{args.dtypes}'")
    backends = [b.strip() for b in (args.backends or ("fused,reference" if device.type == "cuda" else "reference"))
                .split(",") if b.strip()]
    if not backends or set(backends) - {"fused", "reference"}:
        raise UserError(f"--backends must be a comma list of fused, reference, got '{args.backends}'")
    if "fused" in backends and device.type != "cuda":
        raise UserError("--backends fused needs a CUDA device (the kernel only runs in Triton's slow interpreter on "
                        "CPU); use --backends reference on CPU")
    fused_fn = None
    if "fused" in backends:
        from ..core.verify.fused import verify_fused
        fused_fn = verify_fused
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda" else
                   f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    out = Path(args.out)
    report = {"device_name": device_name, "device": device.type, "peak_gbps": peak, "mode": args.mode,
              "sampling": dataclasses.asdict(cfg), "draft_probs": args.draft_probs,
              "backends": backends, "torch": torch.__version__, "points": []}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    points = [(V, L, B, d) for V in vocabs for L in lens for B in batches for d in dtype_names]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    bar = tqdm(points, desc="bench-verify", unit="point", disable=args.no_progress)
    for V, L, B, dname in bar:
        bar.set_postfix_str(f"V={V} L={L} B={B} {dname}")
        dtype = DTYPES[dname]
        logits, tokens, q, u = make_inputs(B, L, V, dtype, device, args.draft_probs, gen)
        nbytes = logits.numel() * logits.element_size() + (0 if q is None else q.numel() * q.element_size())
        row = {"vocab": V, "L": L, "batch": B, "dtype": dname, "bytes": nbytes, "ref_ms": None, "fused_ms": None,
               "ref_gbps": None, "fused_gbps": None, "fused_pct_peak": None, "speedup": None, "match": None}
        if "reference" in backends:
            row["ref_ms"] = _time(lambda: verify_reference(logits, tokens, q, cfg, u, check=False), device, args)
            row["ref_gbps"] = nbytes / row["ref_ms"] / 1e6
        if fused_fn is not None:
            row["fused_ms"] = _time(lambda: fused_fn(logits, tokens, q, cfg, u, check=False), device, args)
            row["fused_gbps"] = nbytes / row["fused_ms"] / 1e6
            if peak:
                row["fused_pct_peak"] = 100.0 * row["fused_gbps"] / peak
            if row["ref_ms"] is not None:
                row["speedup"] = row["ref_ms"] / row["fused_ms"]
                a, b = fused_fn(logits, tokens, q, cfg, u), verify_reference(logits, tokens, q, cfg, u)
                same = (a.accepted.cpu() == b.accepted.cpu()) & (a.next_token.cpu() == b.next_token.cpu())
                row["match"] = float(same.float().mean())
        report["points"].append(row)
        atomic_write_json(out, report)
        del logits, tokens, q, u
    table = markdown(report)
    atomic_write_json(out, report)
    atomic_write_text(out.with_suffix(".md"), table + "\n")
    print(table)
    print(f"\nwrote {out} and {out.with_suffix('.md')}")
    return 0
