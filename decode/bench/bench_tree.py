"""Time one verification forward against the number of positions it scores: chains and token trees of
1…64 nodes, as a multiple of a one-token step (the trade-off a tree-size bandit learns: on a CPU the
cost grows with the nodes, on a GPU far less).

Every size is measured interleaved (chain, tree, one-token step, in a rotating order) after warm-up, on
a prompt's real cache; the cache is rolled back after each forward, so every measurement starts from
the same context. Trees are random with a fixed seed (each node's parent drawn among the earlier
nodes, depth ≤ 8), so the mask is a real tree mask.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..common.device import DTYPES, dtype_name, resolve_device, resolve_dtype, synchronize
from ..core.draft import Draft
from ..common.errors import UserError
from ..evaluation.eval_config import CACHES, resolve_cache
from ..common.io import atomic_write_json, atomic_write_text
from ..core.models import DEFAULT_TARGET, load_model
from ..evaluation.suites import BUILTIN, encode_prompt
from ..core.target import Target
from ..core.tree import depths

SIZES = (1, 2, 4, 8, 16, 32, 64)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the hub")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="node counts (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7, help="timed forwards per size and kind (median; default 7)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help=f"auto|{'|'.join(DTYPES)}")
    p.add_argument("--cache", choices=("auto", *CACHES), default="auto")
    p.add_argument("--out", help="also write the table as JSON here (and .md beside it)")
    p.add_argument("--no-progress", action="store_true")


def random_tree(n: int, gen: torch.Generator, max_depth: int = 8) -> torch.Tensor:
    """Parents of a random tree of ``n`` nodes (topological order, depth ≤ ``max_depth``)."""
    parents, depth = [], []
    for i in range(n):
        choices = [-1] + [j for j in range(i) if depth[j] < max_depth]
        p = choices[int(torch.randint(len(choices), (1,), generator=gen))]
        parents.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
    return torch.tensor(parents)


def _time(fn, device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def measure(target: Target, prompt_ids: list[int], sizes: list[int], repeats: int, progress: bool = True) -> dict:
    """Median seconds of a one-token step and of chain/tree forwards of each size, interleaved."""
    gen = torch.Generator().manual_seed(0)
    V = target.model.get_output_embeddings().weight.shape[0]
    target.prefill(prompt_ids, capacity=len(prompt_ids) + max(sizes) + 2)
    keep, last = len(prompt_ids) - 1, prompt_ids[-1]
    dev = getattr(target, "device", None)
    empty = torch.empty(0, dtype=torch.long)

    def step():
        target.score(last, empty)
        target.rollback(keep)

    rows = {}
    for n in tqdm(sizes, desc="sizes", disable=not progress):
        toks = torch.randint(V, (n,), generator=gen)
        tree = Draft(toks, parents=random_tree(n, gen))
        chain = Draft(toks)
        kinds = {"step": step,
                 "chain": lambda: (target.score(last, chain.tokens), target.rollback(keep)),
                 "tree": lambda: (target.score_tree(last, tree), target.rollback(keep))}
        times = {k: [] for k in kinds}
        names = list(kinds)
        for r in range(repeats + 1):
            order = names[r % 3:] + names[:r % 3]
            for k in order:
                t = _time(kinds[k], dev)
                if r:  # the first pass warms up
                    times[k].append(t)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows[n] = {"step_ms": 1000 * med["step"], "chain_ms": 1000 * med["chain"], "tree_ms": 1000 * med["tree"],
                   "chain_x_step": med["chain"] / med["step"], "tree_x_step": med["tree"] / med["step"],
                   "depth": int(depths(tree.parents).max())}
    return rows


def markdown_table(rows: dict) -> str:
    lines = ["| nodes | tree depth | one-token step ms | chain ms (× step) | tree ms (× step) |",
             "|---:|---:|---:|---:|---:|"]
    for n, r in rows.items():
        lines.append(f"| {n} | {r['depth']} | {r['step_ms']:.1f} | {r['chain_ms']:.1f} ({r['chain_x_step']:.2f}) | "
                     f"{r['tree_ms']:.1f} ({r['tree_x_step']:.2f}) |")
    return "\n".join(lines)


def run(args) -> int:
    try:
        sizes = sorted({int(x) for x in args.sizes.split(",") if x.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise UserError(f"--sizes: comma-separated node counts >= 1, got '{args.sizes}'")
    if args.repeats < 1 or (args.threads is not None and args.threads < 1):
        raise UserError("--repeats and --threads must be integers >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    cache = resolve_cache(args.cache, device, False)
    model, tok = load_model(args.target, dtype=dtype, device=device, trust_remote_code=args.trust_remote_code)
    target = Target(model, tok, cache=cache)
    prompt = next(p for p in BUILTIN if p.category == "summarization")
    rows = measure(target, encode_prompt(tok, prompt.text), sizes, args.repeats, progress=not args.no_progress)
    table = markdown_table(rows)
    print(f"{args.target} on {device} ({dtype_name(dtype)}, {cache} cache, {torch.get_num_threads()} threads), "
          f"one built-in prompt, median of {args.repeats}:\n")
    print(table)
    if args.out:
        out = Path(args.out)
        atomic_write_json(out, {"config": {"target": args.target, "device": str(device), "dtype": dtype_name(dtype),
                                           "cache": cache, "threads": torch.get_num_threads(),
                                           "platform": platform.platform(), "repeats": args.repeats},
                                "sizes": {str(k): v for k, v in rows.items()}, "table": table})
        atomic_write_text(out.with_suffix(".md"), table + "\n")
    return 0
