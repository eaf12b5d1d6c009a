"""Where a round's time goes, per arm: draft (the arm's propose), target forward (the verification
forward), verify, cache rollback, bookkeeping (policy select/update, length controller, every arm's
observe, the round record) and other (the rest of the decode loop), as ms per round and % of a round.

Each arm decodes the prompts alone (a fixed-arm policy over the whole pool, as ``decode eval`` runs
it), greedy, through ``SpecEngine.generate``; the phases are the timings ``SpecEngine.step`` measured
in those very rounds (after a device synchronisation), so they describe the real round. A round's
time is the generation's wall time minus its setup (resets + prefill), divided by its rounds; "other"
is that minus the measured phases. "outside" = everything but the target forward and the drafting
(issue 12 aims below 3% of a round). A warm-up generation per arm runs first and is not counted.

``--cache all`` runs every arm on an engine per cache kind (dynamic, static, prefix) in one process,
interleaved per prompt (the same model; each engine has its own target cache and arm caches), and
adds each kind's tokens/s ÷ dynamic's per arm: ratios measured side by side, not across runs.
"""
from __future__ import annotations

import argparse
import platform
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..common.device import DEVICES, DTYPES, dtype_name, resolve_device, resolve_dtype
from ..engine.loop import Generation, build_engine
from .draft_cost import draft_token_cost
from ..common.errors import UserError
from ..common.io import atomic_write_json, atomic_write_text
from ..choose.length import build_length
from ..core.lean import FORWARD_KINDS
from ..core.linear import LINEAR_KINDS, resolve_linear
from ..core.models import DEFAULT_TARGET, load_model
from ..choose.policies.simple import Fixed
from ..core.cost import curve_summary, markdown_curve, verification_forwards
from ..evaluation.report import cost_plan_record, cost_plan_summary
from ..core.sampling import SamplingConfig
from ..common.specs import split_specs
from ..evaluation.suites import BUILTIN, encode_prompt, load_jsonl_suite, select
from ..core.target import CACHE_KINDS, auto_cache_kind
from ..core.verify import BACKENDS

# (key, column title); "other" is computed, the rest come from StepTimes
PHASES = [("draft", "draft"), ("target_forward", "target fwd"), ("verify", "verify"), ("rollback", "rollback"),
          ("bookkeeping", "bookkeeping"), ("other", "other")]
OUTSIDE = ("verify", "rollback", "bookkeeping", "other")  # not the target forward, not the drafting


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the hub")
    p.add_argument("--arms", default="pld:L=4;suffix:L=6;none",
                   help="arm specs separated by ';', as in `decode eval` (default: %(default)s)")
    p.add_argument("--suite", help="Spec-Bench style JSONL (question_id, category, turns); default: built-in mixed set")
    p.add_argument("--categories", help="comma-separated categories to keep (default: all)")
    p.add_argument("--limit", type=int, help="at most N >= 1 prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=64, help="integer >= 1 (default: %(default)s)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default="auto", help=f"{DEVICES} (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help=f"auto|{'|'.join(DTYPES)} (default: %(default)s)")
    p.add_argument("--verifier", default="auto", choices=BACKENDS)
    p.add_argument("--cache", default="auto", choices=("auto", *CACHE_KINDS, "all"),
                   help="KV cache of the target and of the arms that own one; auto = static on CUDA or with "
                        "--compile, prefix on a CPU; 'all' compares every kind side by side (default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target's verification forward (needs --cache static)")
    p.add_argument("--linear", choices=LINEAR_KINDS, default="auto",
                   help="the target's linear layers: onednn (pre-packed, CPU), stream (our CPU kernel), stock, or "
                        "auto (default: the fastest measured on a CPU)")
    p.add_argument("--forward", choices=FORWARD_KINDS, default="auto",
                   help="the target's eager forwards: lean, hf, or auto (default: lean where it can run)")
    p.add_argument("--length", default="fixed",
                   help="draft-length controller per arm (as for `decode eval --length`, e.g. cost): the table then "
                        "shows the lengths it chose and, for cost, its expected vs realised tokens per step")
    p.add_argument("--out", help="also write the breakdown as JSON here (the table beside it as .md)")
    p.add_argument("--no-progress", action="store_true")


def breakdown(gens: list[Generation], plans: list[tuple[float, float]] = ()) -> dict:
    """One arm's generations → rounds, tokens, ms per round and % of a round for every phase, the drafted
    lengths, and with a cost controller's ``plans`` ((E[tokens], planned cost) per round) its expected vs
    realised tokens per step of cost."""
    rounds = sum(len(g.rounds) for g in gens)
    if rounds == 0:
        raise UserError("no rounds were decoded; nothing to break down")
    loop = sum(g.wall_time - g.setup_time for g in gens)  # every round, loop overhead included
    st = [t for g in gens for t in g.step_times]
    secs = {"draft": sum(t.draft for t in st), "target_forward": sum(t.score for t in st),
            "verify": sum(t.verify for t in st), "rollback": sum(t.rollback for t in st),
            "bookkeeping": sum(t.bookkeeping for t in st)}
    secs["other"] = loop - sum(secs.values())
    tokens = sum(len(g.tokens) for g in gens)
    drafted = sum(r.drafted for g in gens for r in g.rounds)
    return {
        # one drafted token's cost as a fraction of a one-token target step (None: the arm drafted nothing)
        "draft_cost": draft_token_cost(gens) if drafted else None,
        "generations": len(gens), "rounds": rounds, "tokens": tokens, "tokens_per_round": tokens / rounds,
        "round_ms": 1000 * loop / rounds, "tokens_per_s": tokens / loop if loop > 0 else 0.0,
        "phases": {k: {"ms_per_round": 1000 * v / rounds, "percent": 100 * v / loop if loop > 0 else 0.0}
                   for k, v in secs.items()},
        "outside_percent": 100 * sum(secs[k] for k in OUTSIDE) / loop if loop > 0 else 0.0,
        "draft_lengths": {str(n): c for n, c in sorted(Counter(r.drafted for g in gens for r in g.rounds).items())},
        **({"cost_plan": cost_plan_summary([cost_plan_record(plans, [r for g in gens for r in g.rounds])], tokens)}
           if plans else {}),
    }


def markdown_table(arms: dict[str, dict]) -> str:
    head = ("| arm | rounds | tokens/round | round ms | " + " | ".join(f"{t} ms (%)" for _, t in PHASES)
            + " | outside fwd+draft | drafted token (× step) | drafted lengths (rounds) |")
    rows = [head, "|" + "---|" * (len(PHASES) + 7)]
    for label, b in arms.items():
        cells = [f"{b['phases'][k]['ms_per_round']:.3f} ({b['phases'][k]['percent']:.1f}%)" for k, _ in PHASES]
        c = b.get("draft_cost")
        cost = f"{c['draft_ms_per_token']:.3f} ms ({c['fraction']:.3f})" if c else "—"
        rows.append(f"| {label} | {b['rounds']} | {b['tokens_per_round']:.2f} | {b['round_ms']:.3f} | "
                    + " | ".join(cells) + f" | {b['outside_percent']:.1f}% | {cost} | {_lengths(b)} |")
    return "\n".join(rows)


def _lengths(b: dict) -> str:
    """``2:40 4:100`` (length:rounds), then a cost controller's expected → realised tokens per step."""
    text = " ".join(f"{n}:{c}" for n, c in b["draft_lengths"].items())
    plan = b.get("cost_plan")
    if plan:
        text += (f"; tokens/step expected {plan['expected_tokens_per_step']:.2f} → realised "
                 f"{plan['realised_tokens_per_step']:.2f}")
    return text


def run(args) -> int:
    for flag, v in (("--max-new-tokens", args.max_new_tokens), ("--limit", args.limit), ("--threads", args.threads)):
        if v is not None and v < 1:
            raise UserError(f"{flag} must be an integer >= 1, got {v}")
    out = Path(args.out) if args.out else None
    if out is not None and (out.is_dir() or out.suffix == ".md"):
        raise UserError(f"--out {out}: pass a .json file path (the table is written beside it as .md)")
    specs = split_specs(args.arms or "")
    if not specs:
        raise UserError("no arms: pass --arms (e.g. 'pld:L=4;suffix:L=6;none')")
    probe_length = build_length(args.length, 0)  # a bad --length spec fails here, before the model loads
    if args.compile and args.cache not in ("static", "auto"):  # also refuses 'all': compile would favour one side
        raise UserError(f"--compile needs --cache static (a {args.cache} cache changes shape every round)")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    linear = resolve_linear(args.linear, device, dtype)
    prompts = load_jsonl_suite(args.suite) if args.suite else list(BUILTIN)
    cats = None if args.categories is None else [c.strip() for c in args.categories.split(",") if c.strip()]
    prompts = select(prompts, cats, args.limit)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model, tok = load_model(args.target, dtype=dtype, device=str(device), trust_remote_code=args.trust_remote_code)
    sampling = SamplingConfig()
    gen = torch.Generator().manual_seed(0)
    cache = auto_cache_kind(device, args.compile) if args.cache == "auto" else args.cache
    caches = CACHE_KINDS if cache == "all" else (cache,)
    engines = {c: build_engine(model, tok, specs, sampling, gen, cache=c, compile=args.compile, linear=linear,
                               verifier=args.verifier, forward=args.forward,
                               target_name=args.target, trust_remote_code=args.trust_remote_code,
                               needs_hidden=probe_length.needs_target_hidden) for c in caches}
    labels = [a.label for a in next(iter(engines.values())).arms]
    encoded = [encode_prompt(tok, p.text) for p in prompts]
    K = len(labels)
    runs = [(c, i) for i in range(K) for c in caches]  # what one prompt decodes, in rotation

    def policy(i):
        return Fixed(K, engines[caches[0]].max_len, arm=i)

    lengths = {r: build_length(args.length, 0) for r in runs}  # one controller per arm (and cache)
    plans: dict[tuple[str, int], list] = {r: [] for r in runs}

    compile_info = {c: e.prepare([len(x) for x in encoded], args.max_new_tokens, show=not args.no_progress)
                    for c, e in engines.items()}
    for c, i in runs:  # warm-up (and the step-time measurement), not counted
        engines[c].generate(encoded[0], policy(i), min(8, args.max_new_tokens))
    gens: dict[tuple[str, int], list[Generation]] = {r: [] for r in runs}
    per_gen = []
    bar = tqdm(total=len(encoded) * len(runs), desc="bench-round", unit="run", disable=args.no_progress)
    for pi, (p, ids) in enumerate(zip(prompts, encoded)):
        for c, i in runs[pi % len(runs):] + runs[:pi % len(runs)]:  # rotate: noise hits all alike
            g = engines[c].generate(ids, policy(i), args.max_new_tokens, length=lengths[(c, i)])
            gens[(c, i)].append(g)
            plans[(c, i)] += lengths[(c, i)].take_plans()
            per_gen.append({"arm": labels[i], "cache": c, "prompt_id": p.id, "rounds": len(g.rounds),
                            "new_tokens": len(g.tokens), "wall_time": g.wall_time, "setup_time": g.setup_time})
            bar.update()
    bar.close()
    several = len(caches) > 1
    result = {(f"{labels[i]} [{c}]" if several else labels[i]): breakdown(gens[(c, i)], plans[(c, i)]) for c, i in runs}
    others = [c for c in caches if c != "dynamic"]
    speed = {key: r["tokens_per_s"] for key, r in result.items()}
    ratios = ({c: {labels[i]: speed[f"{labels[i]} [{c}]"] / speed[f"{labels[i]} [dynamic]"] for i in range(K)}
               for c in others} if several else None)
    table = markdown_table(result)
    if ratios:
        table += ("\n\n| arm | " + " | ".join(f"{c} ÷ dynamic tokens/s" for c in others) + " |\n|---|"
                  + "---|" * len(others) + "\n"
                  + "\n".join(f"| {labels[i]} | " + " | ".join(f"{ratios[c][labels[i]]:.3f}" for c in others) + " |"
                              for i in range(K)))
    curves = {c: curve_summary(f for (cc, _), gs in gens.items() if cc == c for g in gs
                               for f in verification_forwards(g.prompt_len, g.rounds, g.step_times)) for c in caches}
    for c, curve in curves.items():  # the device's verification curve over this run (per cache: shapes differ)
        if curve is not None:
            table += (f"\n\nVerification cost c(n){f' [{c}]' if several else ''} (one-token steps, medians of "
                      f"{curve['forwards']} forwards):\n\n" + markdown_curve(curve))
    print(table)
    compiled = (f" + compile ({sum(i['seconds'] for i in compile_info.values() if i):.0f} s of compiling before the "
                f"run)" if args.compile else "")
    print(f"\n{len(encoded)} prompt(s) x {args.max_new_tokens} new tokens, {device}/{dtype_name(dtype)}, "
          f"{torch.get_num_threads()} thread(s), {'every' if several else cache} cache, {linear} linears, "
          f"{next(iter(engines.values())).target.forward_kind} forward{compiled}; "
          "outside = verify + rollback + "
          "bookkeeping + other (draft includes model-free lookups)")
    if out is not None:
        report = {"config": {k: v for k, v in vars(args).items() if k != "func"} | {
                      "arm_specs": specs, "arm_labels": labels, "device": str(device), "dtype": dtype_name(dtype),
                      "linear": linear, "forward": {c: e.target.forward_kind for c, e in engines.items()},
                      "threads": torch.get_num_threads(),
                      "step_time": {c: e.step_time for c, e in engines.items()}, "compile": compile_info,
                      "torch": torch.__version__,
                      "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")},
                  "arms": result, "over_dynamic": ratios, "cost_curve": curves, "generations": per_gen, "table": table}
        atomic_write_json(out, report)
        atomic_write_text(out.with_suffix(".md"), table + "\n")
        print(f"report: {out}")
    return 0
