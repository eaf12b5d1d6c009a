"""Rebuild an evaluation's report.json and markdown table from its records.jsonl (``decode eval`` writes
one line per finished (method, prompt) pair as it goes, after a first line with the run's configuration).

``python -m decode report runs/x`` (a folder, a report .json or the records .jsonl) derives everything
else from the records: the per-prompt ``oracle``, the summary per method, the timing warnings, the
table and the figures (decode/evaluation/plots.py; report.json's fields: docs/report_schema.md). ``decode eval``
ends with the same function, so an interrupted-then-resumed run and an uninterrupted one give the same
report (timing fields aside). A partial records file (a run still going
or interrupted) gives a report over the prompts every method has finished, with a warning saying so.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..common import metrics
from ..core.cost import curve_summary, markdown_curve
from ..common.errors import UserError
from .eval_config import is_eval_table, records_path, report_path
from ..common.io import (atomic_write_json, atomic_write_text, check_output_file, is_report_json, read_jsonl_log,
                         refuse_foreign)

HF = "hf"
AR = "autoregressive"
ORACLE = "oracle"
ENGINE_KINDS = ("autoregressive", "arm", "policy")  # methods that decode through our engine (and its target)
FORMAT = "adaspec-eval-records/1"
SCHEMA = "adaspec-eval-report/2"  # report.json's fields, documented in docs/report_schema.md


# ---- the records file -----------------------------------------------------------------------------------------

def record_key(r: dict) -> tuple:
    """What makes a ``decode eval`` record unique: its method on its prompt."""
    return r.get("method"), r.get("prompt_id")


def load_records(path: str | os.PathLike, where: str = "--out", fmt: str = FORMAT, key=record_key,
                 tool: str = "decode eval") -> tuple[dict | None, list[dict], int, list[str]]:
    """``(header, records, good_bytes, notes)`` of a records file written by ``tool`` (its first line's ``format``
    is ``fmt``); header None when the file is missing or holds no complete first line (nothing to resume).
    ``good_bytes`` ends before a torn last line; a second record with the same ``key`` is ignored (and noted)."""
    path = Path(path)
    if not path.exists():
        return None, [], 0, []
    rows, good, note = read_jsonl_log(path, where)
    notes = [note] if note else []
    if not rows:
        return None, [], 0, notes
    header, records = rows[0], rows[1:]
    if not isinstance(header, dict) or header.get("format") != fmt:
        raise UserError(f"{where}: {path} is not a records file written by `{tool}` (first line lacks "
                        f"format {fmt}); move it away or pass another --out")
    seen, unique = set(), []
    for r in records:
        k = key(r)
        if k in seen:
            notes.append(f"{path}: a second record of {' on '.join(map(str, k))} is ignored")
            continue
        seen.add(k)
        unique.append(r)
    return header, unique, good, notes


def rotated(names: list[str], pi: int) -> list[str]:
    """The interleaved order of prompt ``pi``: rotated by one per prompt, so noise hits all methods alike."""
    k = pi % len(names)
    return names[k:] + names[:k]


# ---- summary ------------------------------------------------------------------------------------------------

def _depths(rec: dict) -> list[int]:
    """Per round, the draft positions a path reached: a tree's depth, not its node count (``drafted``); records
    without ``depths`` (peers, runs before it was recorded) drafted chains."""
    return rec.get("depths") or rec["drafted"]


def _aggregate(recs: list[dict]) -> dict:
    toks = sum(r["new_tokens"] for r in recs)
    fwd = sum(r["rounds"] for r in recs)
    wall = sum(r["wall_time"] for r in recs)
    acc = sum(sum(r["accept_lengths"]) for r in recs)
    dr = sum(sum(r["drafted"]) for r in recs)
    mat = metrics.mat(toks, fwd)
    return {"prompts": len(recs), "new_tokens": toks, "target_forwards": fwd, "wall_time": wall,
            "mat": mat, "tau": mat, "tokens_per_s": metrics.tokens_per_s(toks, wall),
            "acceptance_rate": metrics.acceptance_rate(acc, dr),
            "acceptance_per_position": metrics.acceptance_per_position(
                [a for r in recs for a in r["accept_lengths"]], [d for r in recs for d in _depths(r)]),
            "hm": metrics.harmonic_mean_metric(acc, dr, toks)}


def _speedups(s: dict, ar: dict, hf: dict) -> dict:
    s["speedup"] = metrics.speedup(s["tokens_per_s"], ar["tokens_per_s"])
    s["speedup_vs_hf"] = metrics.speedup(s["tokens_per_s"], hf["tokens_per_s"])
    return s


def draft_lengths(records: list[dict]) -> dict:
    """``{arm label: {drafted length: rounds}}`` over the rounds of ``records`` (what a length controller
    chose, per arm; lengths as strings, ascending). Empty for methods that play no arm (hf, peers)."""
    counts: dict[str, dict[int, int]] = {}
    for r in records:
        for arm, n in zip(r.get("arms") or [], r.get("drafted") or []):
            counts.setdefault(arm, {})
            counts[arm][n] = counts[arm].get(n, 0) + 1
    return {a: {str(n): c[n] for n in sorted(c)} for a, c in counts.items()}


def cost_plan_record(plans: list[tuple[float, float]], rounds) -> dict:
    """One generation's ``cost_plan``: the controller's (E[tokens], planned cost) per round summed, beside
    the measured cost of its ``rounds`` (RoundRecords: draft + verification time in one-token steps)."""
    return {"expected_tokens": sum(e for e, _ in plans), "expected_cost_steps": sum(c for _, c in plans),
            "cost_steps": sum(r.time / r.step_time for r in rounds if r.step_time > 0)}


def cost_plan_summary(plans: list[dict], tokens: int) -> dict:
    """The cost controller's expected tokens per step of cost (what its plans promised) beside the realised
    ones (tokens emitted / the rounds' measured draft + verification time in one-token steps)."""
    exp_cost, cost = sum(p["expected_cost_steps"] for p in plans), sum(p["cost_steps"] for p in plans)
    return {"expected_tokens_per_step": sum(p["expected_tokens"] for p in plans) / exp_cost if exp_cost else 0.0,
            "realised_tokens_per_step": tokens / cost if cost else 0.0}


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
        lengths = draft_lengths(recs)
        if lengths:
            s["draft_lengths"] = lengths
        plans = [r["cost_plan"] for r in recs if r.get("cost_plan")]
        if plans:
            s["cost_plan"] = cost_plan_summary(plans, sum(r["new_tokens"] for r in recs if r.get("cost_plan")))
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


def compile_seconds(compile_info: dict | None, method: str, kind: str) -> float | None:
    """Seconds a method's compilation took before the run (not part of its tokens/s): our engine's methods
    share the compiled target (``compile_info["engine"]``), a compiling peer has its own entry; None when
    the method compiled nothing."""
    info = compile_info or {}
    entry = info.get("engine") if kind in ENGINE_KINDS else info.get(method)
    return None if entry is None else float(entry["seconds"])


def markdown_table(summary: dict, cats: list[str], warnings: list[str] = ()) -> str:
    """Per category MAT / speed-up vs hf; overall MAT, speed-up vs hf and vs our autoregressive loop;
    compile seconds (paid once before the run, outside tokens/s) when anything compiled; then the timing
    warnings, if any."""
    compiled = any(s.get("compile_seconds") is not None for s in summary.values())
    head = ("| method | " + " | ".join(f"{c} MAT / ×hf" for c in cats)
            + " | all MAT | × vs hf | × vs autoregressive | lossless vs hf |" + (" compile s |" if compiled else ""))
    sep = "|" + "---|" * (len(cats) + 5 + compiled)
    rows = [head, sep]
    for m, s in summary.items():
        cells = [f"{s['per_category'][c]['mat']:.2f} / {s['per_category'][c]['speedup_vs_hf']:.2f}" for c in cats]
        ll = "—" if s["lossless"] is None else ("yes" if s["lossless"] else "NO")
        frac = f" ({s['fraction_of_oracle']['speedup']:.0%} of oracle)" if "fraction_of_oracle" in s else ""
        secs = s.get("compile_seconds")
        comp = (" — |" if secs is None else f" {secs:.0f} |") if compiled else ""
        rows.append(f"| {m} | " + " | ".join(cells)
                    + f" | {s['mat']:.2f} | {s['speedup_vs_hf']:.2f}{frac} | {s['speedup']:.2f} | {ll} |" + comp)
    if warnings:
        rows += ["", "**Warning: these speed-ups may be meaningless:**", *(f"- {w}" for w in warnings)]
    return "\n".join(rows)


# ---- EAGLE heads: decode-time acceptance beside the training-time figure (issue 31) ---------------------------

def _head_record(path: str) -> dict | None:
    """The ``heldout`` figures of a head folder's run record (``eval.json``), None when there are none."""
    f = Path(path) / "eval.json"  # as the arm loaded it: relative to the working directory
    try:
        return json.loads(f.read_text()).get("heldout") if f.is_file() else None
    except (OSError, ValueError):
        return None


def eagle_heads(config: dict, records: list[dict], cats: list[str]) -> dict:
    """For each ``eagle:path=...`` arm of the run: its own method's (``arm:<label>``, every round played by that arm)
    decode-time acceptance per draft position, overall and per category (``positions``: [reached, accepted] per
    position, so binomial errors can be put on it), beside the training-time held-out figures of the head's run
    record (``<path>/eval.json`` ``heldout``, read when the report is built; None when the folder has none).
    Position 1 is the greedy first-token agreement at the positions where rounds start; the training figure
    counts every position of the distilled held-out answers (scripts/bench_eagle_consistency.py compares both on
    the same answers)."""
    from ..common.specs import parse_spec

    out = {}
    specs, labels = config.get("arms") or [], config.get("arm_labels") or []
    for spec, label in zip(specs, labels):
        try:
            name, params = parse_spec(spec)
        except UserError:
            continue
        if name != "eagle" or "path" not in params:
            continue
        recs = [r for r in records if r["method"] == f"arm:{label}"]
        if not recs:
            continue

        def block(rs):
            counts = [list(c) for c in metrics.reach_counts([a for r in rs for a in r["accept_lengths"]],
                                                            [d for r in rs for d in _depths(r)])]
            return {"rounds": sum(len(r["drafted"]) for r in rs), "positions": counts,
                    "acceptance_per_position": [a / n if n else None for n, a in counts]}

        out[label] = {"path": params["path"], "training_heldout": _head_record(params["path"]), "all": block(recs),
                      "per_category": {c: block([r for r in recs if r["category"] == c]) for c in cats}}
    return out


def markdown_heads(heads: dict) -> str:
    """The EAGLE block under the table: per head and category, decode-time acceptance at draft positions 1, 2, …
    (rounds reaching the position) beside the training-time held-out top-1 agreement."""
    rows = []
    for label, h in heads.items():
        t = h["training_heldout"] or {}
        train = (f"{t['top1_agreement']:.3f} ({t.get('positions', '?')} positions, {t.get('examples', '?')} answers)"
                 if "top1_agreement" in t else "— (no run record)")
        depth = len(h["all"]["positions"])
        rows += [f"\n\n**EAGLE head {label}** ({h['path']}): decode-time acceptance per draft position "
                 f"(method arm:{label}; P(position i accepted | the draft reached i), rounds reaching it) beside "
                 f"the training-time held-out top-1 agreement {train}:\n",
                 "| category | rounds | " + " | ".join(f"position {i + 1}" for i in range(depth)) + " |",
                 "|" + "---|" * (depth + 2)]
        for c, b in [("all", h["all"]), *h["per_category"].items()]:
            cells = [f"{a / n:.3f} ({n})" if n else "—" for n, a in b["positions"]]
            cells += ["—"] * (depth - len(cells))
            rows.append(f"| {c} | {b['rounds']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# ---- the report ------------------------------------------------------------------------------------------------

def build_report(header: dict, records: list[dict]) -> tuple[dict, str]:
    """(report, markdown table) from a records file's header and records: a pure function of the two, so
    ``decode report`` rebuilds exactly what ``decode eval`` wrote. Records are put in the interleaved
    order they were decoded in; prompts some method has not finished are left out (with a warning)."""
    names = [m["name"] for m in header["methods"]]
    arm_methods = [m["name"] for m in header["methods"] if m["kind"] == "arm"]
    by = {(r["method"], r["prompt_id"]): r for r in records}
    prompts = header["prompts"]  # [id, category, text digest]
    done = [(pi, p) for pi, p in enumerate(prompts) if all((m, p[0]) in by for m in names)]
    if not done:
        raise UserError(f"no prompt has a record from every method yet ({len(records)} records for "
                        f"{len(prompts)} prompts × {len(names)} methods); rerun the `decode eval` command to go on")
    recs = [by[(m, p[0])] for pi, p in done for m in rotated(names, pi)]
    recs += oracle_records(recs, arm_methods)
    cfg = header["config"]
    greedy = float(cfg["temperature"]) == 0.0
    summary = summarize(recs, names + [ORACLE], header["arm_labels"], greedy)
    kinds = {m["name"]: m["kind"] for m in header["methods"]} | {ORACLE: "arm"}
    for m, s in summary.items():
        s["compile_seconds"] = compile_seconds(header.get("compile"), m, kinds.get(m, ""))
    warnings = timing_warnings(recs, summary)
    if len(done) < len(prompts):
        warnings.insert(0, f"partial run: {len(done)} of {len(prompts)} prompts have every method's record; "
                           f"this report covers those (rerun the `decode eval` command to finish)")
    cats = sorted({p[1] for _, p in done})
    config = {**cfg, "arm_labels": header["arm_labels"], "methods": names, "reference": HF, "prompts": len(prompts)}
    if header.get("peer_settings"):
        config["peer_settings"] = header["peer_settings"]
    config.update(header.get("environment", {}))
    if header.get("compile"):
        config["compile_info"] = header["compile"]
    if header.get("forward"):  # what --forward resolved to (older reports: the flag as given, if anything)
        config["forward"] = header["forward"]
    if header.get("fused_ops") is not None:
        config["fused_ops"] = header["fused_ops"]
    for probe in ("linear_probe", "attention_probe"):
        if header.get(probe):
            config[probe] = header[probe]
    report = {"schema_version": SCHEMA, "config": config, "complete": len(done) == len(prompts), "records": recs,
              "summary": summary, "warnings": warnings}
    table = markdown_table(summary, cats, warnings)
    heads = eagle_heads(config, recs, cats)
    if heads:
        report["eagle_heads"] = heads
        table += markdown_heads(heads)
    # c(n) over every verification forward of our engine's methods (autoregressive and arms alike)
    curve = curve_summary(f for r in recs if r["method"] != ORACLE for f in r.get("verify_forwards", ()))
    if curve is not None:
        report["cost_curve"] = curve
        table += ("\n\n**Verification cost c(n)** (one forward scoring n positions, in one-token steps; "
                  f"medians of {curve['forwards']} forwards):\n\n" + markdown_curve(curve))
    return report, table


def figures_note(report: Path, plots: bool) -> str:
    """``"; figures: runs/x/report.*.png"`` for the line naming a run's outputs ("" without plots)."""
    from .plots import figure_path
    return f"; figures: {figure_path(report, '*')}" if plots else ""


def write_report(report: dict, table: str, path: str | os.PathLike, plots: bool = True) -> tuple[Path, Path]:
    """report.json at ``path``, the table as .md beside it and, with ``plots``, the figures
    (decode/evaluation/plots.py) beside both, linked from the .md's "## Figures" section."""
    path = Path(path)
    table_path = path.with_suffix(".md")
    atomic_write_json(path, report)
    text = table + "\n"
    if plots:
        from .plots import figures_markdown, write_figures  # matplotlib only when drawing
        text += "\n" + figures_markdown(write_figures(report, path))
    atomic_write_text(table_path, text)
    return path, table_path


# ---- CLI ------------------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the eval's output folder, its report .json (the --out of `decode eval`) or its "
                                "records .jsonl")
    p.add_argument("--out", help="report JSON to write (default: the report beside the records; the markdown "
                                 "table goes beside it as .md)")
    p.add_argument("--no-plots", action="store_true",
                   help="skip the figures (PNG files beside the report, linked from its .md)")
    p.add_argument("--force", action="store_true",
                   help="replace a file at --out (or its .md) that this tool did not write (refused otherwise)")


def check_outputs(out: Path, records: Path, force: bool = False) -> None:
    """Before the report is built: the report and its table can be written, neither is the records file it is
    built from, and neither replaces a file this tool did not write (unless ``force``)."""
    if out.suffix in (".md", ".jsonl"):
        raise UserError(f"--out {out}: the report is JSON and its table goes beside it as .md; name the report "
                        f"e.g. {out.with_suffix('.json')}")
    for name, p, is_own in (("--out", out, is_report_json), ("--out (table)", out.with_suffix(".md"), is_eval_table)):
        if p.resolve() == records.resolve():
            raise UserError(f"{name} {p}: is the records file the report is built from; pass another path")
        check_output_file(p, name)
        if not force:
            refuse_foreign(p, name, is_own, "--force")


def locate_records(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        cands = [p / "records.jsonl"] if (p / "records.jsonl").exists() else sorted(p.glob("*.records.jsonl"))
        if len(cands) != 1:
            found = ", ".join(c.name for c in cands) or "none"
            raise UserError(f"{p}: expected one records file (records.jsonl or NAME.records.jsonl) in the folder, "
                            f"found {found}; pass the file itself")
        return cands[0]
    rec = p if p.suffix == ".jsonl" else records_path(p)
    if not rec.exists():
        raise UserError(f"{path}: no records file at {rec}; `decode eval --out {report_path(rec)}` writes it")
    return rec


def _from_records(rec: Path, where: str) -> tuple[dict, str, list[dict], list[str]]:
    """``(report, table, records, notes)`` rebuilt from a records file."""
    header, records, _, notes = load_records(rec, where=where)
    if header is None:
        raise UserError(f"{rec}: holds no configuration line (the run stopped before decoding anything)")
    report, table = build_report(header, records)
    return report, table, records, notes


def load_report(path: str | os.PathLike) -> tuple[dict, Path, list[str]]:
    """``(report, source, notes)`` for a run given as its folder, report .json or records .jsonl: rebuilt
    from the records when they are there (what ``decode report`` would write, in the current schema), else
    the report .json as written (an older run kept without its records)."""
    p = Path(path)
    if p.is_dir() and not (p / "records.jsonl").exists() and not any(p.glob("*.records.jsonl")) \
            and (p / "report.json").is_file():
        p = p / "report.json"
    if p.suffix == ".json" and p.is_file() and not records_path(p).exists():
        try:
            report = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{path}: {p} is not a JSON report ({exc})") from exc
        if not isinstance(report, dict) or not {"config", "summary"} <= report.keys():
            raise UserError(f"{path}: {p} is not a `decode eval` report (it lacks 'config' and 'summary')")
        return report, p, []
    rec = locate_records(p)
    report, _, _, notes = _from_records(rec, str(path))
    return report, rec, notes


def run(args) -> int:
    rec = locate_records(args.path)
    out = Path(args.out) if args.out else report_path(rec)
    check_outputs(out, rec, getattr(args, "force", False))
    report, table, records, notes = _from_records(rec, str(args.path))
    for n in notes:
        print(f"note: {n}")
    out, table_path = write_report(report, table, out, plots=not args.no_plots)
    print(table)
    print(f"\nreport: {out}  (table: {table_path}{figures_note(out, not args.no_plots)}; from {len(records)} "
          f"records in {rec})")
    return 0
