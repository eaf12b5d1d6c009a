"""Per-method differences between two evaluation runs: MAT, tokens/s, speed-up vs hf, acceptance rate and
losslessness for the methods both ran, the methods only one ran, and every configuration difference that
makes the comparison unfair (other prompts or decoding settings change the tokens; another machine,
thread count or library version changes the timings).

``python -m decode compare RUN_A RUN_B`` takes each run as its folder, report .json or records .jsonl (a
run with records is rebuilt from them, as ``decode report`` would, so old runs get today's fields);
``--json`` prints the same as one JSON object for other tools.
"""
from __future__ import annotations

import argparse
import json
import sys

from .eval_config import flag
from .report import load_report
from ..common.specs import split_specs

NOT_RECORDED = "<not recorded>"  # a field an older report lacks

# (summary field, column heading, how a value prints, how a difference prints)
METRICS = (
    ("mat", "MAT", "{:.2f}", "{:+.2f}"),
    ("tokens_per_s", "tok/s", "{:.1f}", "{:+.1%}"),  # tokens/s: relative change
    ("speedup_vs_hf", "× vs hf", "{:.2f}", "{:+.2f}"),
    ("acceptance_rate", "acceptance", "{:.2f}", "{:+.2f}"),
)
RELATIVE = {"tokens_per_s"}
# configuration fields whose difference changes the decoded tokens (so MAT and losslessness)
DECODING = ("target", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "arms", "length", "dtype",
            "verifier", "trust_remote_code")
# fields whose difference changes only the timings (tokens/s and speed-ups)
TIMING = ("device", "gpu", "threads", "cache", "compile", "torch", "transformers", "python", "platform")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_a", metavar="RUN_A", help="first run: its folder, report .json or records .jsonl")
    p.add_argument("run_b", metavar="RUN_B", help="second run (differences are B − A)")
    p.add_argument("--json", action="store_true", help="print the comparison as one JSON object")


def _cell(field: str, a, b) -> dict:
    """``{"a", "b", "delta"}``; delta is B − A, or B / A − 1 for tokens/s; None where a side lacks the value."""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return {"a": a, "b": b, "delta": None}
    if field in RELATIVE:
        return {"a": a, "b": b, "delta": b / a - 1 if a else None}
    return {"a": a, "b": b, "delta": b - a}


def _prompt_ids(report: dict) -> list[str]:
    return list(dict.fromkeys(r["prompt_id"] for r in report.get("records", [])))


def _setting(config: dict, field: str):
    """A config value as compared: NOT_RECORDED when the report lacks the field (an older run), arm specs
    as a list (early reports kept the ``--arms`` text)."""
    v = config.get(field, NOT_RECORDED)
    return split_specs(v) if field == "arms" and isinstance(v, str) else v


def config_differences(a: dict, b: dict) -> list[dict]:
    """``{"field", "a", "b", "affects"}`` per differing setting; ``affects`` is ``decoding`` (tokens, MAT and
    losslessness may differ) or ``timing`` (tokens/s and speed-ups are not comparable)."""
    ca, cb = a["config"], b["config"]
    out = []
    for field in (*DECODING, "suite", "categories", "limit"):
        va, vb = _setting(ca, field), _setting(cb, field)
        if va != vb:
            out.append({"field": field, "a": va, "b": vb, "affects": "decoding"})
    pa, pb = _prompt_ids(a), _prompt_ids(b)
    if pa != pb:
        only_a, only_b = [p for p in pa if p not in pb], [p for p in pb if p not in pa]
        out.append({"field": "prompts", "a": len(pa), "b": len(pb), "affects": "decoding",
                    "only_in_a": only_a, "only_in_b": only_b})
    for field in TIMING:
        va, vb = _setting(ca, field), _setting(cb, field)
        if va != vb:
            out.append({"field": field, "a": va, "b": vb, "affects": "timing"})
    return out


def compare(a: dict, b: dict) -> dict:
    """The comparison of two reports (B against A) as plain data: what ``--json`` prints."""
    sa, sb = a["summary"], b["summary"]
    both = [m for m in sa if m in sb]
    methods = {}
    for m in both:
        row = {f: _cell(f, sa[m].get(f), sb[m].get(f)) for f, *_ in METRICS}
        row["lossless"] = {"a": sa[m].get("lossless"), "b": sb[m].get("lossless")}
        cats = [c for c in sa[m].get("per_category", {}) if c in sb[m].get("per_category", {})]
        row["per_category"] = {c: {f: _cell(f, sa[m]["per_category"][c].get(f), sb[m]["per_category"][c].get(f))
                                   for f in ("mat", "speedup_vs_hf")} for c in cats}
        methods[m] = row
    warnings = []
    for m, row in methods.items():
        if row["lossless"]["a"] is True and row["lossless"]["b"] is False:
            warnings.append(f"{m}: lossless in A, NOT lossless in B")
        elif row["lossless"]["a"] is False and row["lossless"]["b"] is True:
            warnings.append(f"{m}: NOT lossless in A, lossless in B")
    for side, rep in (("A", a), ("B", b)):
        if rep.get("complete") is False:
            warnings.append(f"{side} is a partial run (not every prompt has every method's record)")
        if rep.get("warnings"):
            warnings.append(f"{side}'s own report warns that its speed-ups may be meaningless "
                            f"({len(rep['warnings'])} warning(s); see its report.md)")
    return {"a": {k: a["config"].get(k, NOT_RECORDED) for k in ("git_commit", "time")},
            "b": {k: b["config"].get(k, NOT_RECORDED) for k in ("git_commit", "time")},
            "config_differences": config_differences(a, b), "methods": methods,
            "only_in_a": [m for m in sa if m not in sb], "only_in_b": [m for m in sb if m not in sa],
            "warnings": warnings}


def _describe(d: dict) -> str:
    """One configuration difference in words: decoding settings by their ``decode eval`` flag, environment
    fields by their report.json name."""
    if d["field"] == "prompts":
        return (f"the prompts ({d['a']} vs {d['b']}; {len(d['only_in_a'])} only in A, "
                f"{len(d['only_in_b'])} only in B)")
    name = f"config.{d['field']}" if d["affects"] == "timing" else flag(d["field"])
    return f"{name} ({_show(d['a'])} vs {_show(d['b'])})"


def _row(m: str, row: dict) -> str:
    cells = []
    for f, _, val, dlt in METRICS:
        c = row[f]
        change = "" if c["delta"] is None else f" ({dlt.format(c['delta'])})"
        cells.append(f"{_fmt(val, c['a'])} → {_fmt(val, c['b'])}{change}")
    lossless = " / ".join({True: "yes", False: "NO", None: "—"}[row["lossless"][s]] for s in ("a", "b"))
    return f"| {m} | " + " | ".join(cells) + f" | {lossless} |"


def render(result: dict) -> str:
    """The comparison as text: the configuration warnings first (they qualify every number below), then
    one table row per method both runs have, then the methods only one has."""
    lines = [f"{side.upper()}: {result[side]['source']}  (commit {_show(result[side]['git_commit'], quote=False)}, "
             f"run at {_show(result[side]['time'], quote=False)})" for side in ("a", "b")]
    lines.append("")
    why = {"decoding": "the decoded tokens, MAT and losslessness may differ for these reasons alone",
           "timing": "tokens/s and speed-ups are not comparable"}
    for affects, reason in why.items():
        named = [_describe(d) for d in result["config_differences"] if d["affects"] == affects]
        if named:
            lines.append(f"warning: the runs differ in {'; '.join(named)}: {reason}")
    lines += [f"warning: {w}" for w in result["warnings"]]
    if lines[-1]:
        lines.append("")
    if result["methods"]:
        lines.append("| method | " + " | ".join(f"{h} A → B" for _, h, _, _ in METRICS) + " | lossless A / B |")
        lines.append("|" + "---|" * (len(METRICS) + 2))
        lines += [_row(m, row) for m, row in result["methods"].items()]
    else:
        lines.append("no method is in both runs")
    for side in ("a", "b"):
        if result[f"only_in_{side}"]:
            lines.append(f"only in {side.upper()}: {', '.join(result[f'only_in_{side}'])}")
    return "\n".join(lines)


def _show(v, quote: bool = True) -> str:
    return "not recorded" if v == NOT_RECORDED else repr(v) if quote else str(v)


def _fmt(pattern: str, v) -> str:
    return pattern.format(v) if isinstance(v, (int, float)) else "—"


def run(args) -> int:
    loaded = []
    for path in (args.run_a, args.run_b):
        report, source, notes = load_report(path)
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        loaded.append((report, str(source)))
    (a, src_a), (b, src_b) = loaded
    result = compare(a, b)
    result["a"]["source"], result["b"]["source"] = src_a, src_b
    print(json.dumps(result, indent=1, ensure_ascii=False) if args.json else render(result))
    return 0
