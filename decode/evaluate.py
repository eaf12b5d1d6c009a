"""Evaluate arms and policies: autoregressive baseline, every arm fixed, every policy, and the
per-prompt oracle (best fixed arm in hindsight), interleaved per prompt on the same target.

Writes report.json (config, one record per (method, prompt), summary per method) and report.md.
"""
from __future__ import annotations

import argparse
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import metrics
from .arms import ArmEnv, build_arm
from .arms.none import NoSpecArm
from .engine import Generation, SpecEngine
from .errors import UserError
from .io import atomic_write_json, atomic_write_text
from .length import build_length
from .models import DEFAULT_TARGET, load_model
from .policies import build_policy
from .policies.simple import Fixed
from .sampling import SamplingConfig
from .specs import split_specs
from .suites import BUILTIN, Prompt, encode_prompt, load_jsonl_suite, select
from .target import Target
from .traces import write_traces
from .verify import BACKENDS, Verifier

AR = "autoregressive"
ORACLE = "oracle"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the hub")
    p.add_argument("--suite", help="Spec-Bench style JSONL (question_id, category, turns); default: built-in mixed set")
    p.add_argument("--categories", help="comma-separated categories to keep")
    p.add_argument("--limit", type=int, help="at most N prompts per category")
    p.add_argument("--arms", default="pld:L=4;suffix:L=6",
                   help="arm specs separated by ';' (e.g. 'pld:L=4;suffix:L=8;drafter:path=DIR,L=4;none')")
    p.add_argument("--pool", help="pool YAML (recipes/pools/*.yaml); its arms are added to --arms")
    p.add_argument("--policies", default="ucbspec,exp3spec", help="policy specs, ',' or ';' separated")
    p.add_argument("--length", help="draft-length controller for every arm and policy run: fixed (default), "
                                    "beta-ts[:alpha=..,beta=..], cali-ts[:predictor=top1|<calibrator folder>]")
    p.add_argument("--record-traces", metavar="PATH",
                   help="also record counterfactual traces (every arm scored at every position of the "
                        "autoregressive output) for `decode simulate --traces PATH`; an extra pass per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verifier", default="auto", choices=BACKENDS)
    p.add_argument("--out", default="runs/eval/report.json", help="report path (a .md table is written beside it)")
    p.add_argument("--no-progress", action="store_true")


@dataclass
class Method:
    name: str
    engine: SpecEngine
    policy_spec: str | None  # None → fixed arm given by ``fixed``
    fixed: int = 0
    kind: str = "policy"  # "autoregressive" | "arm" | "policy"


def _arm_specs(args) -> list[str]:
    specs = split_specs(args.arms or "")
    if args.pool:
        from .pools import load_pool
        specs += load_pool(args.pool)
    if not specs:
        raise UserError("no arms: pass --arms (e.g. 'pld:L=4;suffix:L=6') or --pool")
    return specs


def _eos_ids(model, tok) -> list[int]:
    ids = set()
    for src in (getattr(tok, "eos_token_id", None), getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return sorted(ids)


def build_methods(target: Target, env: ArmEnv, arm_specs: list[str], policy_specs: list[str], verifier: Verifier,
                  eos: list[int]) -> tuple[list[Method], list[str]]:
    arms = [build_arm(s, env) for s in arm_specs]
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise UserError(f"duplicate arms in the pool: {labels}; give drafters distinct name=... labels")
    engine = SpecEngine(target, arms, verifier, eos)
    ar_engine = SpecEngine(target, [NoSpecArm()], verifier, eos)
    methods = [Method(AR, ar_engine, None, 0, "autoregressive")]
    methods += [Method(f"arm:{lab}", engine, None, i, "arm") for i, lab in enumerate(labels)]
    for spec in policy_specs:
        build_policy(spec, len(arms), engine.max_len)  # validate names/params before any decoding
        methods.append(Method(f"policy:{spec}", engine, spec, 0, "policy"))
    return methods, labels


def _record(m: Method, p: Prompt, gen: Generation, tok, labels) -> dict:
    arms_played = [r.arm for r in gen.rounds]
    return {
        "method": m.name, "prompt_id": p.id, "category": p.category,
        "new_tokens": len(gen.tokens), "rounds": gen.target_forwards,
        "accept_lengths": [r.accepted for r in gen.rounds],
        "drafted": [r.drafted for r in gen.rounds],
        "arms": [labels[a] for a in arms_played] if m.kind != "autoregressive" else [],
        "draft_time": sum(r.draft_time for r in gen.rounds),
        "verify_time": sum(r.verify_time for r in gen.rounds),
        "wall_time": gen.wall_time, "stopped_by": gen.stopped_by,
        "token_ids": gen.tokens, "text": tok.decode(gen.tokens, skip_special_tokens=True),
    }


def _aggregate(recs: list[dict]) -> dict:
    toks = sum(r["new_tokens"] for r in recs)
    fwd = sum(r["rounds"] for r in recs)
    wall = sum(r["wall_time"] for r in recs)
    acc = sum(sum(r["accept_lengths"]) for r in recs)
    dr = sum(sum(r["drafted"]) for r in recs)
    return {"prompts": len(recs), "new_tokens": toks, "target_forwards": fwd, "wall_time": wall,
            "mat": metrics.mat(toks, fwd), "tokens_per_s": metrics.tokens_per_s(toks, wall),
            "acceptance_rate": metrics.acceptance_rate(acc, dr),
            "hm": metrics.harmonic_mean_metric(acc, dr, toks)}


def summarize(records: list[dict], method_names: list[str], labels: list[str], greedy: bool) -> dict:
    by_method = {m: [r for r in records if r["method"] == m] for m in method_names}
    ar = {r["prompt_id"]: r for r in by_method[AR]}
    cats = sorted({r["category"] for r in records})
    base = _aggregate(by_method[AR])
    base_cat = {c: _aggregate([r for r in by_method[AR] if r["category"] == c]) for c in cats}
    summary = {}
    for m, recs in by_method.items():
        s = _aggregate(recs)
        s["speedup"] = metrics.speedup(s["tokens_per_s"], base["tokens_per_s"])
        s["lossless"] = all(r["token_ids"] == ar[r["prompt_id"]]["token_ids"] for r in recs) if greedy else None
        s["per_category"] = {}
        for c in cats:
            cs = _aggregate([r for r in recs if r["category"] == c])
            cs["speedup"] = metrics.speedup(cs["tokens_per_s"], base_cat[c]["tokens_per_s"])
            s["per_category"][c] = cs
        if m.startswith("policy:") or m == ORACLE:
            played = [a for r in recs for a in r["arms"]]
            s["arm_pulls"] = {lab: played.count(lab) for lab in labels}
        summary[m] = s
    if ORACLE in summary:
        o = summary[ORACLE]
        for m, s in summary.items():
            if m.startswith("policy:"):
                s["fraction_of_oracle"] = {
                    "mat": s["mat"] / o["mat"] if o["mat"] else 0.0,
                    "speedup": s["speedup"] / o["speedup"] if o["speedup"] else 0.0,
                    "per_category": {c: {"mat": s["per_category"][c]["mat"] / o["per_category"][c]["mat"],
                                         "speedup": s["per_category"][c]["speedup"] / o["per_category"][c]["speedup"]}
                                     for c in cats if o["per_category"][c]["mat"] and o["per_category"][c]["speedup"]},
                }
    return summary


def oracle_records(records: list[dict], arm_methods: list[str]) -> list[dict]:
    """Per prompt, the fixed arm with the fewest target forwards (ties: less wall time) in hindsight."""
    out = []
    for pid in dict.fromkeys(r["prompt_id"] for r in records):
        cands = [r for r in records if r["prompt_id"] == pid and r["method"] in arm_methods]
        best = min(cands, key=lambda r: (r["rounds"], r["wall_time"]))
        out.append({**best, "method": ORACLE, "oracle_arm": best["method"]})
    return out


def markdown_table(summary: dict, cats: list[str]) -> str:
    head = "| method | " + " | ".join(f"{c} MAT / ×" for c in cats) + " | all MAT | all × | lossless |"
    sep = "|" + "---|" * (len(cats) + 4)
    rows = [head, sep]
    for m, s in summary.items():
        cells = [f"{s['per_category'][c]['mat']:.2f} / {s['per_category'][c]['speedup']:.2f}" for c in cats]
        ll = "—" if s["lossless"] is None else ("yes" if s["lossless"] else "NO")
        frac = f" ({s['fraction_of_oracle']['speedup']:.0%} of oracle)" if "fraction_of_oracle" in s else ""
        rows.append(f"| {m} | " + " | ".join(cells) + f" | {s['mat']:.2f} | {s['speedup']:.2f}{frac} | {ll} |")
    return "\n".join(rows)


def _record_traces(args, methods: list[Method], prompts: list[Prompt], encoded: list[list[int]], gen) -> None:
    """Dense counterfactual traces (decode/traces.py): for each prompt, the fixed-first-arm output is
    re-scored by every arm at every position; a separate pass so timed runs above stay untouched."""
    engine = next(m.engine for m in methods if m.kind == "arm")
    traces = []
    for pi, (p, ids) in enumerate(tqdm(list(zip(prompts, encoded)), desc="traces", unit="prompt",
                                       disable=args.no_progress)):
        gen.manual_seed(args.seed * 1_000_003 + pi)
        g = engine.generate(ids, Fixed(len(engine.arms), engine.max_len, arm=0), args.max_new_tokens, trace="dense")
        g.trace.meta = {"id": p.id, "category": p.category}
        traces.append(g.trace)
    write_traces(args.record_traces, traces)
    print(f"traces: {args.record_traces}  (replay: python -m decode simulate --traces {args.record_traces})")


def run(args) -> int:
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    arm_specs = _arm_specs(args)
    policy_specs = split_specs(args.policies or "")
    length = build_length(args.length, args.seed)  # validated (and any predictor loaded) before the models
    prompts = load_jsonl_suite(args.suite) if args.suite else list(BUILTIN)
    cats_arg = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    prompts = select(prompts, cats_arg, args.limit)

    torch.manual_seed(args.seed)
    model, tok = load_model(args.target, trust_remote_code=args.trust_remote_code)
    gen = torch.Generator().manual_seed(args.seed)
    target = Target(model, tok, want_hidden=False)
    env = ArmEnv(model, tok, sampling, gen, target_name=args.target, trust_remote_code=args.trust_remote_code,
                 target=target)
    verifier = Verifier(sampling, args.verifier, gen)
    eos = _eos_ids(model, tok)
    methods, labels = build_methods(target, env, arm_specs, policy_specs, verifier, eos)
    if any(a.uses_target_hidden for a in methods[-1].engine.arms) or length.needs_target_hidden:
        target.want_hidden = True
    encoded = [encode_prompt(tok, p.text) for p in prompts]

    # warm-up so the first timed method does not pay one-off allocation costs
    methods[0].engine.generate(encoded[0], Fixed(1, 0), min(8, args.max_new_tokens))
    records, carried = [], {}
    bar = tqdm(total=len(prompts) * len(methods), desc="eval", unit="run", disable=args.no_progress)
    for pi, (p, ids) in enumerate(zip(prompts, encoded)):
        order = methods[pi % len(methods):] + methods[:pi % len(methods)]  # rotate: noise hits all alike
        for m in order:
            gen.manual_seed(args.seed * 1_000_003 + pi)
            n_arms = len(m.engine.arms)
            if m.policy_spec is None:
                policy = Fixed(n_arms, m.engine.max_len, arm=m.fixed)
            elif m.name in carried:  # carry=true: one policy learns across the whole suite
                policy = carried[m.name]
            else:
                policy = build_policy(m.policy_spec, n_arms, m.engine.max_len, seed=args.seed + pi)
                if policy.carry:
                    carried[m.name] = policy
            g = m.engine.generate(ids, policy, args.max_new_tokens,
                                  length=None if m.kind == "autoregressive" else length)
            records.append(_record(m, p, g, tok, labels))
            bar.set_postfix_str(f"{m.name[:24]} {len(g.tokens) / max(g.wall_time, 1e-9):.1f} tok/s")
            bar.update()
    bar.close()
    if args.record_traces:
        _record_traces(args, methods, prompts, encoded, gen)

    names = [m.name for m in methods]
    arm_methods = [m.name for m in methods if m.kind == "arm"]
    records += oracle_records(records, arm_methods)
    names.append(ORACLE)
    summary = summarize(records, names, labels, sampling.greedy)
    cats = sorted({p.category for p in prompts})
    report = {
        "config": {**{k: v for k, v in vars(args).items() if k != "func"}, "arm_specs": arm_specs, "arm_labels": labels,
                   "policies": policy_specs, "torch": torch.__version__, "platform": platform.platform(),
                   "threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")},
        "records": records, "summary": summary,
    }
    out = Path(args.out)
    table = markdown_table(summary, cats)
    atomic_write_json(out, report)
    atomic_write_text(out.with_suffix(".md"), table + "\n")
    print(table)
    print(f"\nreport: {out}  (table: {out.with_suffix('.md')})")
    return 0
