"""Evaluate arms and policies against plain HF generate and our own autoregressive loop, interleaved per
prompt on the same target.

Methods (one decode function each, fed to one loop; the order rotates per prompt so machine noise hits
all alike): ``hf`` (the reference, HF ``generate``), ``autoregressive`` (our engine without
speculation), every arm fixed, every policy over the pool, and the per-prompt ``oracle`` (best fixed
arm in hindsight). Writes report.json (config, one record per (method, prompt), summary per method,
timing warnings) and the markdown table beside it.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import metrics
from .arms import ArmEnv, build_arm
from .arms.none import NoSpecArm
from .engine import Generation, SpecEngine
from .errors import UserError
from .io import atomic_write_json, atomic_write_text
from .length import LengthController, build_length
from .models import DEFAULT_TARGET, load_model
from .policies import build_policy
from .policies.simple import Fixed
from .sampling import SamplingConfig
from .specs import parse_spec, split_specs
from .suites import BUILTIN, Prompt, encode_prompt, load_jsonl_suite, select
from .target import Target
from .traces import write_traces
from .verify import BACKENDS, Verifier

HF = "hf"
AR = "autoregressive"
ORACLE = "oracle"
MAX_SEED = 2**32 - 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the hub")
    p.add_argument("--suite", help="Spec-Bench style JSONL (question_id, category, turns); default: built-in mixed set")
    p.add_argument("--categories", help="comma-separated categories to keep (default: all)")
    p.add_argument("--limit", type=int, help="at most N >= 1 prompts per category")
    p.add_argument("--arms", default="pld:L=4;suffix:L=6",
                   help="arm specs separated by ';' (e.g. 'pld:L=4;suffix:L=8;drafter:path=DIR,L=4;none')")
    p.add_argument("--pool", help="pool YAML (recipes/pools/*.yaml); its arms are added to --arms")
    p.add_argument("--policies", default="ucbspec;exp3spec",
                   help="policy specs separated by ';' (e.g. 'ucbspec;ducb:discount=0.9,c=0.1'); ',' separates "
                        "a spec's key=value parameters, and a ',' before a bare name also starts a new spec")
    p.add_argument("--length", help="draft-length controller for every arm and policy run (a fresh one per "
                                    "method): fixed (default), beta-ts[:alpha=..,beta=..], "
                                    "cali-ts[:predictor=top1|<calibrator folder>]")
    p.add_argument("--record-traces", metavar="PATH",
                   help="also record counterfactual traces (every arm scored at every position of the "
                        "autoregressive output) for `decode simulate --traces PATH`; an extra pass per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, help="integer >= 1 (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help=">= 0; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help=">= 0; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--seed", type=int, default=0, help=f"integer in [0, {MAX_SEED}]")
    p.add_argument("--verifier", default="auto", choices=BACKENDS)
    p.add_argument("--out", default="runs/eval/report.json",
                   help="report JSON file (the markdown table is written beside it with the suffix .md)")
    p.add_argument("--no-progress", action="store_true")


# ---- input checks: everything is validated before any model is loaded -------------------------------

def _check_ranges(args) -> None:
    """One-line errors naming the flag and its valid range (NaN/inf included)."""
    ints = [("--max-new-tokens", args.max_new_tokens, 1, None), ("--limit", args.limit, 1, None),
            ("--top-k", args.top_k, 0, None), ("--seed", args.seed, 0, MAX_SEED)]
    for flag, v, lo, hi in ints:
        if v is not None and (v < lo or (hi is not None and v > hi)):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise UserError(f"{flag} must be an integer {rng}, got {v}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")


def _check_outputs(args) -> list[Path]:
    """Fail before decoding, not after it, on an output path that cannot be written: a folder, a parent
    that is a file, an unwritable folder, or two outputs on the same file. Returns the report paths."""
    out = Path(args.out)
    if out.suffix == ".md":
        raise UserError(f"--out {out}: the markdown table is written beside the report as .md; "
                        f"name the report e.g. {out.with_suffix('.json')}")
    paths = [("--out", out), ("--out (table)", out.with_suffix(".md"))]
    if args.record_traces:
        paths.append(("--record-traces", Path(args.record_traces)))
    seen = {}
    for flag, p in paths:
        key = p.resolve()
        if key in seen:
            raise UserError(f"{flag} {p}: the same file as {seen[key]}; pass another path")
        seen[key] = flag
        if p.is_dir():
            raise UserError(f"{flag} {p}: is a folder; pass a file path")
        parent = p.parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise UserError(f"{flag} {p}: {parent} is a file, not a folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UserError(f"{flag} {p}: cannot write into {parent} (permission denied)")
    return [out, out.with_suffix(".md")]


def _arm_specs(args) -> list[str]:
    specs = split_specs(args.arms or "")
    if args.pool:
        from .pools import load_pool
        specs += load_pool(args.pool)
    if not specs:
        raise UserError("no arms: pass --arms (e.g. 'pld:L=4;suffix:L=6') or --pool")
    return specs


def parse_policy_specs(text: str) -> list[str]:
    """``--policies`` with the arms' splitting rule (decode/specs.py split_specs: ';' between specs,
    ',' between a spec's parameters), so ``ducb:discount=0.9,c=0.1;ucbspec`` is two policies.
    Duplicates are refused: their records would merge under one method name."""
    specs = split_specs(text)
    seen = {}
    for s in specs:
        name, params = parse_spec(s)
        key = (name, tuple(sorted(params.items())))
        if key in seen:
            raise UserError(f"--policies: '{s}' duplicates '{seen[key]}'; each policy is evaluated once")
        seen[key] = s
    return specs


def _eos_ids(model, tok) -> list[int]:
    ids = set()
    for src in (getattr(tok, "eos_token_id", None), getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return sorted(ids)


# ---- methods: one decode function each -----------------------------------------------------------------

def truncate_at_eos(tokens: list[int], eos) -> tuple[list[int], str]:
    """The engine's stopping rule: keep up to and including the first EOS token."""
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[:j + 1], "eos"
    return tokens, "length"


@torch.inference_mode()
def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig, eos: list[int],
                pad_token_id: int) -> tuple[list[int], float, str]:
    """The reference decoder: plain HF ``generate`` (no streamer, no assistant) on the same prompt ids.

    Returns (new tokens, seconds, "eos" | "length"). Tokens follow the engine's convention (the first
    EOS is kept, nothing after it), so greedy outputs compare token for token. The checkpoint's own
    generation_config is swapped out for the call: its penalties, forced tokens or sampling defaults
    would make HF decode something other than the plain model.
    """
    from transformers import GenerationConfig

    opts = dict(do_sample=not sampling.greedy)
    if not sampling.greedy:
        opts.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=list(eos) or None,
                           pad_token_id=pad_token_id, use_cache=True, **opts)
    x = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    saved, model.generation_config = model.generation_config, GenerationConfig()
    try:
        start = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
        tokens = out[0, len(prompt_ids):].tolist()
        seconds = time.perf_counter() - start
    finally:
        model.generation_config = saved
    tokens, stopped_by = truncate_at_eos(tokens, set(eos))
    return tokens, seconds, stopped_by


class HFMethod:
    """``hf``: one target forward per token, so MAT = 1 by definition."""

    name, kind = HF, "hf"

    def __init__(self, model, sampling: SamplingConfig, eos: list[int], pad_token_id: int):
        self.model, self.sampling, self.eos, self.pad = model, sampling, eos, pad_token_id

    def decode(self, ids: list[int], pi: int, max_new_tokens: int) -> dict:
        tokens, seconds, stopped_by = hf_generate(self.model, ids, max_new_tokens, self.sampling, self.eos, self.pad)
        n = len(tokens)
        return {"new_tokens": n, "rounds": n, "accept_lengths": [0] * n, "drafted": [0] * n, "arms": [],
                "draft_time": 0.0, "verify_time": seconds, "wall_time": seconds, "stopped_by": stopped_by,
                "token_ids": tokens}


class EngineMethod:
    """Our engine with a fixed arm (``policy_spec`` None) or a policy. Each method owns its length
    controller and its carry=true policy, so nothing learnt under one method leaks into another."""

    def __init__(self, name: str, kind: str, engine: SpecEngine, labels: list[str], *, arm: int = 0,
                 policy_spec: str | None = None, length: LengthController | None = None, seed: int = 0):
        self.name, self.kind, self.engine, self.labels = name, kind, engine, labels
        self.arm, self.policy_spec, self.length, self.seed = arm, policy_spec, length, seed
        self.carried = None

    def _policy(self, pi: int):
        n, max_len = len(self.engine.arms), self.engine.max_len
        if self.policy_spec is None:
            return Fixed(n, max_len, arm=self.arm)
        if self.carried is not None:  # carry=true: one policy learns across the whole suite
            return self.carried
        policy = build_policy(self.policy_spec, n, max_len, seed=self.seed + pi)
        if policy.carry:
            self.carried = policy
        return policy

    def decode(self, ids: list[int], pi: int, max_new_tokens: int) -> dict:
        g: Generation = self.engine.generate(ids, self._policy(pi), max_new_tokens, length=self.length)
        return {"new_tokens": len(g.tokens), "rounds": g.target_forwards,
                "accept_lengths": [r.accepted for r in g.rounds], "drafted": [r.drafted for r in g.rounds],
                "arms": [self.labels[r.arm] for r in g.rounds] if self.kind != "autoregressive" else [],
                "draft_time": sum(r.draft_time for r in g.rounds),
                "verify_time": sum(r.verify_time for r in g.rounds),
                "wall_time": g.wall_time, "stopped_by": g.stopped_by, "token_ids": g.tokens}


def build_methods(target: Target, env: ArmEnv, arm_specs: list[str], policy_specs: list[str], verifier: Verifier,
                  eos: list[int], length: LengthController, seed: int, hf: HFMethod) -> tuple[list, list[str]]:
    """[hf, autoregressive, every arm, every policy]; arm and policy methods get their own copy of
    ``length`` (a copy, not a rebuild: a trained predictor is loaded once)."""
    arms = [build_arm(s, env) for s in arm_specs]
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise UserError(f"duplicate arms in the pool: {labels}; give drafters distinct name=... labels")
    engine = SpecEngine(target, arms, verifier, eos)
    ar_engine = SpecEngine(target, [NoSpecArm()], verifier, eos)
    methods = [hf, EngineMethod(AR, "autoregressive", ar_engine, labels)]
    methods += [EngineMethod(f"arm:{lab}", "arm", engine, labels, arm=i, length=copy.deepcopy(length))
                for i, lab in enumerate(labels)]
    for spec in policy_specs:
        build_policy(spec, len(arms), engine.max_len)  # validate names/params before any decoding
        methods.append(EngineMethod(f"policy:{spec}", "policy", engine, labels, policy_spec=spec,
                                    length=copy.deepcopy(length), seed=seed))
    return methods, labels


# ---- summary ----------------------------------------------------------------------------------------------

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


def _speedups(s: dict, ar: dict, hf: dict) -> dict:
    s["speedup"] = metrics.speedup(s["tokens_per_s"], ar["tokens_per_s"])
    s["speedup_vs_hf"] = metrics.speedup(s["tokens_per_s"], hf["tokens_per_s"])
    return s


def summarize(records: list[dict], method_names: list[str], labels: list[str], greedy: bool) -> dict:
    """Per method: MAT, tokens/s, ``speedup`` (vs our autoregressive loop), ``speedup_vs_hf``,
    ``lossless`` (greedy: token ids equal hf's on every prompt; None when sampling), per category."""
    by_method = {m: [r for r in records if r["method"] == m] for m in method_names}
    reference = {r["prompt_id"]: r["token_ids"] for r in by_method[HF]}
    cats = sorted({r["category"] for r in records})

    def in_cat(recs, c):
        return [r for r in recs if r["category"] == c]

    base = {b: _aggregate(by_method[b]) for b in (AR, HF)}
    base_cat = {b: {c: _aggregate(in_cat(by_method[b], c)) for c in cats} for b in (AR, HF)}
    summary = {}
    for m, recs in by_method.items():
        s = _speedups(_aggregate(recs), base[AR], base[HF])
        s["lossless"] = all(r["token_ids"] == reference[r["prompt_id"]] for r in recs) if greedy else None
        s["per_category"] = {c: _speedups(_aggregate(in_cat(recs, c)), base_cat[AR][c], base_cat[HF][c])
                             for c in cats}
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


def timing_warnings(records: list[dict], summary: dict) -> list[str]:
    """Why the speed-ups of this run may be meaningless (metrics.speedup_warnings on the hf reference's
    per-prompt tokens/s, every method's and category cell's speed-up vs hf and its MAT)."""
    ref = [r for r in records if r["method"] == HF]
    tps = [metrics.tokens_per_s(r["new_tokens"], r["wall_time"]) for r in ref]
    cells = []
    for m, s in summary.items():
        cells.append((m, s["speedup_vs_hf"], s["mat"]))
        if len(s["per_category"]) > 1:
            cells += [(f"{m} [{c}]", cs["speedup_vs_hf"], cs["mat"]) for c, cs in s["per_category"].items()]
    return metrics.speedup_warnings(tps, sum(r["new_tokens"] for r in ref), cells,
                                    step_cost_ratio=summary[AR]["speedup_vs_hf"])


def oracle_records(records: list[dict], arm_methods: list[str]) -> list[dict]:
    """Per prompt, the fixed arm with the fewest target forwards (ties: less wall time) in hindsight."""
    out = []
    for pid in dict.fromkeys(r["prompt_id"] for r in records):
        cands = [r for r in records if r["prompt_id"] == pid and r["method"] in arm_methods]
        best = min(cands, key=lambda r: (r["rounds"], r["wall_time"]))
        out.append({**best, "method": ORACLE, "oracle_arm": best["method"]})
    return out


def markdown_table(summary: dict, cats: list[str], warnings: list[str] = ()) -> str:
    """Per category MAT / speed-up vs hf; overall MAT, speed-up vs hf and vs our autoregressive loop;
    then the timing warnings, if any."""
    head = ("| method | " + " | ".join(f"{c} MAT / ×hf" for c in cats)
            + " | all MAT | × vs hf | × vs autoregressive | lossless vs hf |")
    sep = "|" + "---|" * (len(cats) + 5)
    rows = [head, sep]
    for m, s in summary.items():
        cells = [f"{s['per_category'][c]['mat']:.2f} / {s['per_category'][c]['speedup_vs_hf']:.2f}" for c in cats]
        ll = "—" if s["lossless"] is None else ("yes" if s["lossless"] else "NO")
        frac = f" ({s['fraction_of_oracle']['speedup']:.0%} of oracle)" if "fraction_of_oracle" in s else ""
        rows.append(f"| {m} | " + " | ".join(cells)
                    + f" | {s['mat']:.2f} | {s['speedup_vs_hf']:.2f}{frac} | {s['speedup']:.2f} | {ll} |")
    if warnings:
        rows += ["", "**Warning: these speed-ups may be meaningless:**", *(f"- {w}" for w in warnings)]
    return "\n".join(rows)


# ---- the run -------------------------------------------------------------------------------------------------

def _record_traces(args, methods: list, prompts: list[Prompt], encoded: list[list[int]], gen) -> None:
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
    _check_ranges(args)
    out, table_path = _check_outputs(args)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    arm_specs = _arm_specs(args)
    policy_specs = parse_policy_specs(args.policies or "")
    length = build_length(args.length, args.seed)  # validated (and any predictor loaded) before the models
    prompts = load_jsonl_suite(args.suite) if args.suite else list(BUILTIN)
    cats_arg = None if args.categories is None else [c.strip() for c in args.categories.split(",") if c.strip()]
    prompts = select(prompts, cats_arg, args.limit)

    torch.manual_seed(args.seed)
    model, tok = load_model(args.target, trust_remote_code=args.trust_remote_code)
    gen = torch.Generator().manual_seed(args.seed)
    target = Target(model, tok, want_hidden=False)
    env = ArmEnv(model, tok, sampling, gen, target_name=args.target, trust_remote_code=args.trust_remote_code,
                 target=target)
    verifier = Verifier(sampling, args.verifier, gen)
    eos = _eos_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
    hf = HFMethod(model, sampling, eos, pad)
    methods, labels = build_methods(target, env, arm_specs, policy_specs, verifier, eos, length, args.seed, hf)
    if any(a.uses_target_hidden for a in methods[-1].engine.arms) or length.needs_target_hidden:
        target.want_hidden = True
    encoded = [encode_prompt(tok, p.text) for p in prompts]

    # warm-up so the first timed runs do not pay one-off costs; engines directly with a fixed arm and no
    # length controller, so no carried policy or controller learns from it
    warm = min(8, args.max_new_tokens)
    hf.decode(encoded[0], 0, warm)
    for engine in {id(m.engine): m.engine for m in methods if m.kind != "hf"}.values():
        engine.generate(encoded[0], Fixed(len(engine.arms), engine.max_len), warm)
    records = []
    bar = tqdm(total=len(prompts) * len(methods), desc="eval", unit="run", disable=args.no_progress)
    for pi, (p, ids) in enumerate(zip(prompts, encoded)):
        order = methods[pi % len(methods):] + methods[:pi % len(methods)]  # rotate: noise hits all alike
        for m in order:
            seed = args.seed * 1_000_003 + pi
            gen.manual_seed(seed)
            torch.manual_seed(seed)  # HF generate samples from the global generator
            fields = m.decode(ids, pi, args.max_new_tokens)
            records.append({"method": m.name, "prompt_id": p.id, "category": p.category, **fields,
                            "text": tok.decode(fields["token_ids"], skip_special_tokens=True)})
            bar.set_postfix_str(f"{m.name[:24]} {metrics.tokens_per_s(fields['new_tokens'], fields['wall_time']):.1f} tok/s")
            bar.update()
    bar.close()
    if args.record_traces:
        _record_traces(args, methods, prompts, encoded, gen)

    names = [m.name for m in methods]
    arm_methods = [m.name for m in methods if m.kind == "arm"]
    records += oracle_records(records, arm_methods)
    names.append(ORACLE)
    summary = summarize(records, names, labels, sampling.greedy)
    warnings = timing_warnings(records, summary)
    cats = sorted({p.category for p in prompts})
    report = {
        "config": {**{k: v for k, v in vars(args).items() if k != "func"}, "arm_specs": arm_specs, "arm_labels": labels,
                   "policies": policy_specs, "reference": HF, "torch": torch.__version__,
                   "platform": platform.platform(), "threads": torch.get_num_threads(),
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")},
        "records": records, "summary": summary, "warnings": warnings,
    }
    table = markdown_table(summary, cats, warnings)
    atomic_write_json(out, report)
    atomic_write_text(table_path, table + "\n")
    print(table)
    print(f"\nreport: {out}  (table: {table_path})")
    return 0
