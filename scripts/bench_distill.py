"""Benchmark: distillation generation (toolkit.distill.generate_batch) vs plain HF ``generate``.

Same prompts (GSM8K train, chat template), greedy, interleaved A/B per batch size so both see the
same machine load. Tokens are counted up to and including EOS. Also reports whether every greedy
row equals plain ``generate``'s row.

    .venv/bin/python scripts/bench_distill.py --batch-sizes 1 8 32 --max-new-tokens 128 [--threads 1] \
        [--device auto|cpu|cuda[:N]] [--dtype auto|float32|bfloat16|float16]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from decode.common.device import DEVICES, DTYPES, dtype_name, synchronize
from decode.common.errors import run_user_command
from decode.common.io import atomic_write_json
from decode.core.models import DEFAULT_TARGET, load_model
from decode.core.sampling import SamplingConfig
from toolkit.data.sources import GSM8KSource, iter_source
from toolkit.data.templates import Template
from decode.core.models import eos_token_ids
from toolkit.distill import generate_batch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--device", default="auto", help=f"{DEVICES} (auto: CUDA when a GPU is visible, else CPU)")
    ap.add_argument("--dtype", default="auto", help=f"auto|{'|'.join(DTYPES)} (auto: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    return run_user_command(bench, args)


def bench(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.target, device=args.device, dtype=args.dtype)
    device = model.device
    prompts = [Template().render(tok, p.text)[1] for p in iter_source(GSM8KSource(limit=max(args.batch_sizes)))]
    eos = set(eos_token_ids(model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def upto_eos(seq):
        for i, t in enumerate(seq):
            if t in eos:
                return seq[:i + 1]
        return seq

    @torch.inference_mode()
    def plain(batch):
        w = max(map(len, batch))
        ids = torch.full((len(batch), w), pad)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):
            ids[i, w - len(p):] = torch.tensor(p)
            mask[i, w - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=pad)
        return [upto_eos(out[i, w:].tolist()) for i in range(len(batch))]

    def ours(batch):
        return [g.ids for g in generate_batch(model, batch, sampling=SamplingConfig(0.0),
                                              max_new_tokens=args.max_new_tokens, eos_ids=eos, pad_id=pad)]

    results = {"target": args.target, "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
               "device": str(device), "dtype": dtype_name(model.dtype), "runs": []}
    for bs in args.batch_sizes:
        batch = prompts[:bs]
        row = {"batch_size": bs}
        for name, fn in (("plain_generate", plain), ("distill", ours)):
            synchronize(device)
            t0 = time.perf_counter()
            outs = fn(batch)
            synchronize(device)
            dt = time.perf_counter() - t0
            n = sum(len(o) for o in outs)
            row[name] = {"tokens": n, "seconds": round(dt, 2), "tokens_per_s": round(n / dt, 2)}
            row.setdefault("outputs", {})[name] = outs
        row["greedy_rows_identical"] = sum(a == b for a, b in zip(*row.pop("outputs").values()))
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        atomic_write_json(args.out, results, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
