"""``decode eval --batch 1,2,4,8``: speculation under load (issue 32 §3). For each batch size B, the methods decode
the suite with B sequences in flight and the report gives, per method and B, goodput (generated tokens of the
whole batch per second), per-request latency p50/p95, MAT (tokens per target forward per row) and how many rows
equal their own plain greedy decoding, with a figure of goodput against B.

Methods (decode/engine/batch.py; ``--arms`` must batch: model-free arms; chains of EAGLE heads, drafters and
early-exit layers):

* ``hf``: HF ``generate`` on groups of B prompts, left-padded (the plain baseline at that B: static batches);
* ``batch:none``: our batched rounds without speculation;
* ``batch:<arm>``: every row plays that arm at its L (fixed speculation), one per ``--arms`` arm;
* ``batch:<arm>+schedule``: the first arm with K from the batch size alone (``--batch-schedule``: vLLM's
  ``num_speculative_tokens_per_batch_size``, TensorRT-LLM's ``draft_len_schedule``);
* ``batch:<arm>+ema``: the first arm with K from an EMA of accepted lengths over tiers (``--batch-ema``:
  SGLang's ``--speculative-adaptive`` in spirit);
* ``batch:<policy>+cost``: the adaptive method, one per ``--policies`` spec: every row's own policy over
  ``--arms`` (no ``none`` needed: the joint length may be 0, and a row in a block W wide drafts for free up to W),
  or with ``carry=true`` one policy every row shares (as ``decode serve`` runs it), the draft length chosen jointly
  for the batch from the learnt cost of its block, the acceptance statistics shared across rows.

Each method keeps one engine for the whole run, as a server keeps one: what it learnt (the cost of its blocks, the
first segment paying the probe; the arms' acceptance; a round's own work; a carry=true policy) carries from one
segment and batch size to the next. A resumed run starts that learning afresh at the segments it still decodes.

Our methods batch continuously: B rows in flight, a finished row's place taken by the next prompt before the next
round. Every request arrives at the start of its segment, so a row's latency includes its wait for a place (and
for ``hf``, for its group's whole batch). Interleaving: the suite is cut into segments of 4·B prompts. Our
engines decode a segment in **lockstep**: one round of each in turn (its rows joining first), in an order that
rotates per segment, each timed on its own clock (the sum of its turns: its joins' prefills and its rounds;
a row's latency is that clock when it finished). On a 2-core machine whose speed drifts by 10–20% within minutes,
methods run one after the other met different machines (a segment at B = 16 takes each ~30 s); turns of ~0.1 s
meet the same one (the price: every engine holds its cache at once, memory the sum of theirs, ~1 GB an engine at
B = 16 on the default target). HF ``generate``, one call per group, runs alone before or after them, by turns.
Sampled runs draw from generators seeded per segment (the global one for HF and whatever else uses it), so they
are reproducible for the same set of methods to decode. Each finished (B, segment, method) is appended to the
records file as its run completes, and rerunning the same command resumes.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..choose.arms import ArmEnv, build_arm
from ..choose.policies import build_policy
from ..common.errors import UserError
from ..common.device import DTYPES
from ..common.io import JsonlLog, atomic_path, atomic_write_json, atomic_write_text
from ..common.specs import parse_spec
from ..core.lean import resolve_forward
from ..core.models import eos_token_ids, load_model, pad_token_id
from ..core.sampling import SamplingConfig
from ..core.verify import Verifier
from ..engine.batch import BatchEngine, check_batch_arm_specs
from ..engine.loop import target_run_model
from .eval_config import check_resume
from .peers import hf_generate_batch
from .report import load_records, rotated
from .suites import encode_prompt

FORMAT = "adaspec-batch-eval-records/1"
SCHEMA = "adaspec-batch-eval-report/1"
SEGMENT = 4  # prompts per segment, in batch sizes
HF = "hf"


@dataclass
class BatchMethod:
    name: str
    arms: tuple[str, ...] = ()
    policy: str = "fixed:arm=0"
    length: str = "fixed"


def batch_methods(cfg) -> list[BatchMethod]:
    """The methods of a batched evaluation (module docstring); a spec that cannot batch is a UserError naming
    its flag."""
    check_batch_arm_specs(cfg.arms)
    drafting = [s for s in cfg.arms if parse_spec(s)[0] != "none"]
    methods = [BatchMethod(HF), BatchMethod("batch:none", ("none",))]
    methods += [BatchMethod(f"batch:{s}", (s,)) for s in drafting]
    if drafting:
        first = drafting[0]
        methods += [BatchMethod(f"batch:{first}+schedule", (first,), length=f"schedule:{cfg.batch_schedule}"),
                    BatchMethod(f"batch:{first}+ema", (first,), length=f"ema:{cfg.batch_ema}")]
    pool = tuple(cfg.arms)
    for spec in cfg.policies:
        build_policy(spec, len(pool), 1)  # names and parameters checked before any model loads
        methods.append(BatchMethod(f"batch:{spec}+cost", pool, spec, "cost"))
    return methods


def _segments(n: int, B: int, repeat: int = 1) -> list[list[int]]:
    """The prompt indices of each segment at batch size B: the suite cut into 4·B prompts, ``repeat`` passes over
    it (segment ``si`` belongs to pass ``si // (segments per pass)``)."""
    size = SEGMENT * B
    one = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    return one * repeat


def _record_key(r: dict) -> tuple:
    """What makes a record of a batched evaluation unique: a reference's prompt, a run's (B, segment, method)."""
    return ("reference", r.get("prompt_id")) if r.get("kind") == "reference" else (r.get("B"), r.get("segment"),
                                                                                    r.get("method"))


def evaluate_batched(cfg, prompts, keys, environment) -> int:
    """Decode every (B, segment, method) not yet in ``cfg.records_path``, then write the report (module
    docstring). ``prompts``/``keys``: the selected suite and its [id, category, digest] keys."""
    methods = batch_methods(cfg)
    header, records, good = None, [], 0
    if not cfg.fresh:  # --fresh: whatever is there is discarded unread
        header, records, good, notes = load_records(cfg.records_path, fmt=FORMAT, key=_record_key,
                                                    tool="decode eval --batch")
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
    check_resume(cfg, header, records, keys)
    if header is not None and not records:
        header = None
    names = [m.name for m in methods]
    if header is not None and header["methods"] != names:
        raise UserError(f"--out {cfg.out}: {cfg.records_path} was decoded with the methods {header['methods']}, this "
                        f"run has {names}; pass another --out, or add --fresh to discard those records")
    sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p)
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model, tok = load_model(cfg.target, dtype=DTYPES[cfg.dtype], device=device,
                            trust_remote_code=cfg.trust_remote_code)
    encoded = [encode_prompt(tok, p.text) for p in prompts]
    eos = eos_token_ids(model, tok)
    pad = pad_token_id(tok, eos)
    run, linear, probes = target_run_model(model, cfg.linear)
    env = ArmEnv(model, tok, sampling)
    if header is None:
        saved = {k: v for k, v in cfg.to_dict().items() if k not in ("fresh", "no_progress", "no_plots")}
        header = {"format": FORMAT, "config": saved, "prompts": keys, "methods": names,
                  "environment": environment, "linear": linear, "linear_probe": probes["linear"],
                  "attention_probe": probes["attention"], "forward": resolve_forward(cfg.forward, run, "prefix")}
    done = {(r["B"], r["segment"], r["method"]) for r in records if "B" in r}
    refs = {r["prompt_id"]: r["token_ids"] for r in records if r.get("kind") == "reference"}

    longest = {m.name: max(build_arm(s, env).L for s in m.arms) for m in methods if m.arms}

    engines: dict[str, BatchEngine] = {}  # each method's engine, kept across its segments (module docstring)

    def engine(m: BatchMethod, seed: int, keep: bool = True) -> BatchEngine:
        """The method's engine (made on first use; ``keep`` False: a throwaway one) with this segment's verifier."""
        verifier = Verifier(sampling, cfg.verifier, torch.Generator().manual_seed(seed))
        if keep and m.name in engines:
            eng = engines[m.name]
            eng.verifier = verifier
            return eng
        seeds = iter(range(seed, seed + 1_000_000))
        carried = []  # a carry=true policy: one object for every row of the engine, as a server's

        def make_policy(K: int):
            if carried:
                return carried[0]
            policy = build_policy(m.policy, K, longest[m.name], seed=next(seeds))
            if policy.carry:
                carried.append(policy)
            return policy
        eng = BatchEngine(run, lambda: [build_arm(s, env) for s in m.arms], make_policy, verifier, eos,
                          pad_id=pad, length=m.length, stock_model=model, seed=seed, forward=header["forward"])
        if keep:
            engines[m.name] = eng
        return eng

    todo = [(B, si, m.name) for B in cfg.batch for si in range(len(_segments(len(prompts), B, cfg.batch_repeat)))
            for m in methods if (B, si, m.name) not in done]
    log = JsonlLog(cfg.records_path, keep_bytes=good if records else 0)
    try:
        if not records:
            log.append(header)
        if sampling.greedy and len(refs) < len(prompts):  # every row's plain greedy decoding, one prompt at a time
            for p, ids in tqdm(list(zip(prompts, encoded)), desc="references", unit="prompt",
                               disable=cfg.no_progress):
                if p.id not in refs:
                    [(tokens, _)], _ = hf_generate_batch(model, [ids], cfg.max_new_tokens, sampling, eos, pad)
                    refs[p.id] = tokens
                    rec = {"kind": "reference", "prompt_id": p.id, "token_ids": tokens}
                    log.append(rec)
                    records.append(rec)
        if todo:
            warm = min(4, cfg.max_new_tokens)  # one-off costs before the first timed run
            hf_generate_batch(model, encoded[:2], warm, sampling, eos, pad)
            engine(methods[1], 0, keep=False).generate(encoded[:2], warm)
        bar = tqdm(total=len(todo), desc="eval --batch", unit="run", disable=cfg.no_progress)
        for bi, B in enumerate(cfg.batch):
            per_pass = len(_segments(len(prompts), B))
            for si, seg in enumerate(_segments(len(prompts), B, cfg.batch_repeat)):
                pending = [n for n in rotated(names, si + bi) if (B, si, n) not in done]
                ours = [n for n in pending if n != HF]
                seed = cfg.seed * 1_000_003 + si
                batch = [encoded[i] for i in seg]
                groups = [ours] if ours else []
                if HF in pending:  # HF runs alone, before our engines' lockstep run or after it, by turns
                    groups.insert(len(groups) if (si + bi) % 2 else 0, [HF])
                for group in groups:
                    torch.manual_seed(seed)  # HF generate samples from the global generator
                    if group == [HF]:
                        results = {HF: _hf_segment(model, batch, B, cfg.max_new_tokens, sampling, eos, pad)}
                    else:
                        results = _lockstep({n: engine(methods[names.index(n)], seed) for n in group}, batch, B,
                                            cfg.max_new_tokens)
                    for name, (rows, seconds) in results.items():
                        rec = {"B": B, "segment": si, "pass": si // per_pass, "method": name, "seconds": seconds,
                               "rows": [{"prompt_id": prompts[i].id, **r} for i, r in zip(seg, rows)]}
                        if name in engines:  # what its choices rested on at the segment's end
                            rec["estimates"] = engines[name].estimates()
                        log.append(rec)
                        records.append(rec)
                        tps = sum(len(r["token_ids"]) for r in rows) / seconds
                        bar.set_postfix_str(f"B={B} {name[:24]} {tps:.1f} tok/s")
                        bar.update()
        bar.close()
    except KeyboardInterrupt:
        print(f"interrupted: the finished runs are kept in {cfg.records_path}; run the same command again to resume",
              file=sys.stderr)
        raise
    finally:
        log.close()
    report = build_batch_report(header, records, margins=_margins(model, prompts, encoded, refs, records))
    table = batch_table(report)
    out = Path(cfg.out)
    atomic_write_json(out, report)
    text = table + "\n"
    if not cfg.no_plots:
        fig = goodput_figure(report)
        path = out.with_name(f"{out.stem}.goodput_vs_batch.png")
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", metadata={"Software": None})
        text += f"\n![goodput against batch size]({path.name})\n"
    atomic_write_text(cfg.table_path, text)
    print(table)
    print(f"\nreport: {out}  (table: {cfg.table_path}; records: {cfg.records_path})")
    return 0


def _hf_segment(model, batch: list[list[int]], B: int, n: int, sampling: SamplingConfig, eos,
                pad) -> tuple[list[dict], float]:
    """One segment through HF ``generate``, groups of B prompts in turn: per row its tokens, latency (from the
    segment's start, to its group's end) and forwards, and the segment's seconds."""
    t0 = time.perf_counter()
    rows = []
    for g in range(0, len(batch), B):
        out, _ = hf_generate_batch(model, batch[g:g + B], n, sampling, eos, pad)
        t = time.perf_counter() - t0
        rows += [{"token_ids": tokens, "latency": t, "forwards": len(tokens)} for tokens, _ in out]
    return rows, time.perf_counter() - t0


def _lockstep(engines: dict[str, BatchEngine], batch: list[list[int]], B: int,
              n: int) -> dict[str, tuple[list[dict], float]]:
    """One segment through several engines at once, a round of each in turn (module docstring): per engine its
    rows (tokens; latency: the engine's own seconds when the row finished; target forwards; drafted and accepted
    tokens) and its own seconds, the sum of its turns (joins' prefills and rounds)."""
    runs = {name: eng.decoding(batch, n, max_batch=B) for name, eng in engines.items()}
    own = dict.fromkeys(engines, 0.0)
    rows: dict[str, dict[int, dict]] = {name: {} for name in engines}
    while runs:
        for name in list(runs):
            t = time.perf_counter()
            finished = next(runs[name], None)
            if finished is None:
                del runs[name]
                continue
            own[name] += time.perf_counter() - t
            for k, r in finished:
                rows[name][k] = {"token_ids": r.tokens, "latency": own[name], "forwards": len(r.rounds),
                                 "accepted": sum(x.accepted for x in r.rounds),
                                 "drafted": sum(x.drafted for x in r.rounds)}
    return {name: ([rows[name][k] for k in range(len(batch))], own[name]) for name in engines}


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _margins(model, prompts, encoded, refs: dict, records: list[dict]) -> dict:
    """The target's own top-2 logit margin at each (prompt, position) where a row first differs from its plain
    greedy decoding: a near-tie another batch shape's float rounding can flip, when it is tiny."""
    where = {}
    by_id = {p.id: i for i, p in enumerate(prompts)}
    for r in records:
        for row in r.get("rows", ()):
            ref = refs.get(row["prompt_id"])
            d = None if ref is None else _first_difference(row["token_ids"], ref)
            if d is not None and d < len(ref):
                where[(row["prompt_id"], d)] = None
    for pid, d in where:
        i = by_id[pid]
        ids = torch.tensor([encoded[i] + refs[pid][:d]], device=model.device)
        with torch.inference_mode():
            top = model(ids).logits[0, -1].float().topk(2).values
        where[(pid, d)] = round(float(top[0] - top[1]), 5)
    return {f"{pid}@{d}": v for (pid, d), v in where.items()}


def build_batch_report(header: dict, records: list[dict], margins: dict | None = None) -> dict:
    """Per B and method: goodput, latency p50/p95, MAT, rows equal to plain greedy (with where and how near a tie
    the first difference of each other row is); a summary of the adaptive methods against the best baseline."""
    refs = {r["prompt_id"]: r["token_ids"] for r in records if r.get("kind") == "reference"}
    margins = margins or {}
    results: dict = {}
    for r in records:
        if "B" not in r:
            continue
        cell = results.setdefault(str(r["B"]), {}).setdefault(r["method"], {"tokens": 0, "seconds": 0.0,
                                                                           "latency": [], "forwards": 0,
                                                                           "rows": 0, "lossless_rows": 0,
                                                                           "differs_at": [], "passes": {}})
        cell["seconds"] += r["seconds"]
        one_pass = cell["passes"].setdefault(r.get("pass", 0), [0, 0.0])  # [tokens, seconds] of each pass
        one_pass[1] += r["seconds"]
        for row in r["rows"]:
            cell["tokens"] += len(row["token_ids"])
            one_pass[0] += len(row["token_ids"])
            cell["latency"].append(row["latency"])
            cell["forwards"] += row["forwards"]
            cell["rows"] += 1
            ref = refs.get(row["prompt_id"])
            if ref is not None:
                d = _first_difference(row["token_ids"], ref)
                if d is None:
                    cell["lossless_rows"] += 1
                else:
                    cell["differs_at"].append({"prompt_id": row["prompt_id"], "position": d,
                                               "top2_margin": margins.get(f"{row['prompt_id']}@{d}")})
    order = header["methods"]
    out: dict = {}
    for B, cells in sorted(results.items(), key=lambda kv: int(kv[0])):
        out[B] = {}
        for name in [m for m in order if m in cells]:
            c = cells[name]
            lat = sorted(c.pop("latency"))
            out[B][name] = {"goodput": c["tokens"] / c["seconds"] if c["seconds"] else 0.0,
                            "p50": statistics.median(lat) if lat else 0.0,
                            "p95": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else 0.0,
                            "mat": c["tokens"] / c["forwards"] if c["forwards"] else 0.0,
                            "tokens": c["tokens"], "seconds": c["seconds"], "rows": c["rows"],
                            "lossless_rows": c["lossless_rows"] if refs else None, "differs_at": c["differs_at"],
                            "goodput_per_pass": [t / s if s else 0.0 for _, (t, s) in sorted(c["passes"].items())]}
    summary = {}
    for B, cells in out.items():
        base = [v["goodput"] for k, v in cells.items() if not k.endswith("+cost")]
        best = max(base, default=0.0)
        summary[B] = {"best_baseline": max((k for k in cells if not k.endswith("+cost")),
                                           key=lambda k: cells[k]["goodput"], default=None),
                      **{k: {"vs_best_baseline": v["goodput"] / best if best else None,
                             "vs_hf": v["goodput"] / cells[HF]["goodput"] if HF in cells and cells[HF]["goodput"]
                             else None,
                             "vs_best_baseline_per_pass": _per_pass_ratio(v, [b for n, b in cells.items()
                                                                             if not n.endswith("+cost")])}
                         for k, v in cells.items() if k.endswith("+cost")}}
    return {"schema": SCHEMA, "config": header["config"], "environment": header.get("environment"),
            "linear": header.get("linear"), "methods": order, "prompts": len(header["prompts"]),
            "results": out, "summary": summary}


def _per_pass_ratio(cell: dict, baselines: list[dict]) -> list[float | None]:
    """Per pass over the suite: the method's goodput ÷ the best baseline's in that same pass (a pass is a sample of
    the machine's noise: the spread of these ratios is what a difference between methods is read against)."""
    out = []
    for p, g in enumerate(cell["goodput_per_pass"]):
        best = max((b["goodput_per_pass"][p] for b in baselines if p < len(b["goodput_per_pass"])), default=0.0)
        out.append(g / best if best else None)
    return out


def batch_table(report: dict) -> str:
    """The markdown table: one row per (method, B)."""
    passes = max((len(c.get("goodput_per_pass", ())) for cells in report["results"].values()
                  for c in cells.values()), default=1)
    extra = (" goodput per pass |", "---|") if passes > 1 else ("", "")
    lines = ["| method | B | goodput tok/s | × hf | p50 s | p95 s | MAT | rows = plain greedy |" + extra[0],
             "|---|---|---|---|---|---|---|---|" + extra[1]]
    for B, cells in report["results"].items():
        hf = cells.get(HF, {}).get("goodput")
        for name, c in cells.items():
            same = "—" if c["lossless_rows"] is None else f"{c['lossless_rows']}/{c['rows']}"
            per = f" {' / '.join(f'{g:.1f}' for g in c.get('goodput_per_pass', ()))} |" if passes > 1 else ""
            lines.append(f"| {name} | {B} | {c['goodput']:.1f} | {c['goodput'] / hf:.2f} | {c['p50']:.2f} | "
                         f"{c['p95']:.2f} | {c['mat']:.2f} | {same} |{per}" if hf else
                         f"| {name} | {B} | {c['goodput']:.1f} | — | {c['p50']:.2f} | {c['p95']:.2f} | "
                         f"{c['mat']:.2f} | {same} |{per}")
    env = report.get("environment") or {}
    cfg = report["config"]
    lines += ["", f"{report['prompts']} prompts, {cfg['max_new_tokens']} new tokens, "
                  f"{'greedy' if not cfg['temperature'] else 'temperature ' + str(cfg['temperature'])}, "
                  f"{env.get('threads', '?')} thread(s), {report.get('linear')} linears, {cfg['device']}."]
    for B, s in report["summary"].items():
        for name, v in s.items():
            if name != "best_baseline" and v["vs_best_baseline"] is not None:
                per = v.get("vs_best_baseline_per_pass") or []
                lines.append(f"B={B}: {name} at {v['vs_best_baseline']:.2f}× the best baseline ({s['best_baseline']})"
                             + (f", {v['vs_hf']:.2f}× hf" if v["vs_hf"] else "")
                             + (f"; per pass {' / '.join('—' if x is None else f'{x:.2f}' for x in per)}"
                                if len(per) > 1 else ""))
    for B, cells in report["results"].items():
        for name, c in cells.items():
            for d in c["differs_at"]:
                lines.append(f"B={B} {name}: prompt {d['prompt_id']} differs from its plain greedy decoding at token "
                             f"{d['position']} (the target's top-2 logit margin there: {d['top2_margin']})")
    return "\n".join(lines)


def goodput_figure(report: dict):
    """Goodput against B (log2 axis), one line per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from .plots import _colour
    fig = Figure(figsize=(7.5, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    sizes = sorted(int(b) for b in report["results"])
    for i, name in enumerate(report["methods"]):
        pts = [(b, report["results"][str(b)][name]["goodput"]) for b in sizes if name in report["results"][str(b)]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=_colour(i), label=name,
                    linestyle="--" if name == HF else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size B (sequences in flight)")
    ax.set_ylabel("goodput (generated tokens/s of the batch)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig
