"""``python -m toolkit answers DIR [DIR ...] --out FOLDER``: the target's distilled answers as a small artifact the
repository can ship, so a fresh machine starts from them instead of distilling from nothing (issue 31).

Each finished distillation folder (``toolkit distill``'s output: parquet shards + manifest) contributes its kept
rows (those no filter flagged). ``FOLDER`` holds one ``<task>.jsonl.gz`` per task — one row per answer: ``id``
(the distiller's unit id: task, source, prompt text and temperature), ``task``, ``source``, ``prompt``,
``prompt_ids``, ``response_ids``, ``temperature``, ``finish_reason`` — sorted by id, gzip without a timestamp (the
same rows give the same bytes, so git stores a rerun as no change) — and ``answers.json``, the run record: per task
the rows, answer tokens, the generation conditions the rows share (target, dtype, template, answer length,
sampling, filters) and the distillation folders and commands they came from. The prompt limit
(``generation.max_prompt_tokens``) is not a condition: it only skips prompts, and a prompt within two limits gets the
same answer under both.

Running it again with more folders *extends* the artifact: rows are merged by id (a row already shipped is kept),
and a folder distilled under other conditions than the rows already there is refused, naming the field. Before
anything is written, every row's prompt is checked against the evaluation questions (``--eval-files``: Spec-Bench
dev and the GSM8K test split by default) with the distiller's own leakage index; leaking rows are dropped and
counted. The artifact must stay small enough to ship (``--max-mb``, default 25). ``--partial`` also takes the
finished shards of a distillation that was stopped (a time limit, a lost machine); its run entry says so, and
rerunning that distillation finishes it.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import sys
import time
from pathlib import Path

from decode.common.answers import FORMAT, RECORD, load_answers, read_record, task_file  # noqa: F401 (re-exported)
from decode.common.errors import UserError
from decode.common.io import atomic_path, atomic_write_json

COLUMNS = ("id", "task", "source", "prompt", "prompt_ids", "response_ids", "temperature", "finish_reason")
EVAL_FILES = ("../shared/data/spec_bench/question_dev.jsonl", "../shared/data/gsm8k/test.jsonl")
# the recipe fields every row of one task's file must share: they change what an answer is
CONDITION_KEYS = ("target", "dtype", "template", "filters")
# not max_prompt_tokens: it skips prompts, never changes an answer
GENERATION_KEYS = ("max_new_tokens", "top_k", "top_p")


def conditions(manifest: dict) -> dict:
    """What a distillation's rows depend on besides their prompt and temperature (from its manifest)."""
    recipe = manifest.get("recipe") or {}
    out = {k: recipe.get(k) for k in CONDITION_KEYS}
    out["dtype"] = (manifest.get("target") or {}).get("dtype", out["dtype"])  # the resolved dtype, not "auto"
    gen = recipe.get("generation") or {}
    out["generation"] = {k: gen.get(k) for k in GENERATION_KEYS}
    return out


def comparable(cond: dict) -> dict:
    """``cond`` (this module's :func:`conditions`, or one an older record wrote) cut to the fields compared today:
    records written when the prompt limit was a condition still match."""
    out = {k: cond.get(k) for k in CONDITION_KEYS}
    out["generation"] = {k: (cond.get("generation") or {}).get(k) for k in GENERATION_KEYS}
    return out


def differences(here: dict, there: dict) -> list[str]:
    """The fields in which two runs' conditions differ, each as ``field (there, here)``."""
    return _differences(comparable(here), comparable(there))


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    diffs = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            diffs += _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            diffs.append(f"{prefix}{k} ({y!r} there, {x!r} here)")
    return diffs


def _portable(path: Path) -> str:
    """``path`` relative to the working directory when under it: a shipped record names no one's machine."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _gzip_rows(rows: list[dict]) -> bytes:
    """One task file's bytes: JSON lines, gzip without a timestamp (the same rows give the same bytes)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as gz:
        for r in rows:
            gz.write((json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8"))
    return buf.getvalue()


def _write_bytes(path: Path, data: bytes) -> int:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    return len(data)


def export_answers(dirs: list[str | os.PathLike], out: str | os.PathLike, *,
                   eval_files: tuple[str, ...] | list[str] = EVAL_FILES, max_mb: float = 25.0,
                   command: str | None = None, partial: bool = False) -> dict:
    """Merge the kept rows of finished distillation folders ``dirs`` into the answers folder ``out`` (created or
    extended); returns its run record. ``partial``: a stopped distillation's finished shards count too."""
    from .data.leakage import EvalIndex
    from .distill import load_distilled

    out = Path(out)
    record = read_record(out) if (out / RECORD).is_file() else {"format": FORMAT, "tasks": {}}
    index = EvalIndex.from_files(eval_files) if eval_files else None
    by_task: dict[str, dict[str, dict]] = {}
    for task in record["tasks"]:
        by_task[task] = {r["id"]: r for r in load_answers(out, task)}
    summary: dict[str, dict] = {}
    for d in map(Path, dirs):
        mf = d / "manifest.json"
        if not mf.is_file():
            raise UserError(f"{d}: no distillation here (manifest.json missing)")
        manifest = json.loads(mf.read_text())
        task = manifest.get("task")
        if not task:
            raise UserError(f"{mf}: names no task")
        cond = conditions(manifest)
        entry = record["tasks"].setdefault(task, {"conditions": cond, "runs": [], "rows": 0})
        diffs = differences(cond, entry["conditions"])
        if diffs:
            raise UserError(f"{d}: distilled under other conditions than the {task} answers in {out}: "
                            f"{'; '.join(diffs)}; export it to another folder")
        entry["conditions"] = comparable(entry["conditions"])
        finished = manifest.get("status") == "complete"
        if not finished and not partial:
            raise UserError(f"{d}: the distillation is unfinished ({manifest.get('completed_shards')}/"
                            f"{manifest.get('shards')} shards); rerun its command to finish it, or pass --partial "
                            f"to ship its finished shards")
        rows = load_distilled(d, allow_partial=partial)  # rows a filter flagged are left out
        seen = by_task.setdefault(task, {})
        added = leaked = 0
        for r in rows:
            if r["id"] in seen:
                continue
            if index is not None and index.leaks(r["prompt"]):
                leaked += 1
                continue
            seen[r["id"]] = {k: r[k] for k in COLUMNS}
            added += 1
        entry["runs"].append({"folder": _portable(d), "fingerprint": manifest.get("fingerprint"),
                              "rows_added": added, "rows_leaking_dropped": leaked,
                              "finished_unix": (manifest.get("time") or {}).get("finished_unix"),
                              "device": (manifest.get("target") or {}).get("device"),
                              "tokens_per_s": (manifest.get("throughput") or {}).get("tokens_per_s"),
                              **({} if finished else {"partial": f"{manifest.get('completed_shards')}/"
                                                                 f"{manifest.get('shards')} shards"})})
        s = summary.setdefault(task, {"added": 0, "leaked": 0})
        s["added"] += added
        s["leaked"] += leaked
    files = {}
    for task, rows in by_task.items():
        ordered = [rows[k] for k in sorted(rows)]
        files[task] = (ordered, _gzip_rows(ordered))  # compressed once: the size checked is the size written
    total = sum(len(data) for _, data in files.values())
    if total > max_mb * 2 ** 20:
        raise UserError(f"the answers would take {total / 2 ** 20:.1f} MiB, over --max-mb {max_mb:g}; ship a subset "
                        f"(fewer folders) or raise the limit knowingly")
    for task, (ordered, data) in files.items():
        nbytes = _write_bytes(task_file(out, task), data)
        entry = record["tasks"][task]
        entry.update(rows=len(ordered), answer_tokens=sum(len(r["response_ids"]) for r in ordered),
                     temperatures=sorted({r["temperature"] for r in ordered}), bytes=nbytes)
    record.update(eval_files=list(eval_files), updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if command:
        record.setdefault("commands", []).append(command)
    atomic_write_json(out / RECORD, record)
    record["_summary"] = summary
    return record


# --------------------------------------------------------------------------- CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dirs", nargs="+", metavar="DIR", help="finished distillation folders (toolkit distill's out)")
    p.add_argument("--out", required=True, help="answers folder to create or extend "
                                                "(e.g. pretrained/smollm2-135m-instruct/answers)")
    p.add_argument("--eval-files", nargs="*", default=list(EVAL_FILES),
                   help="evaluation question files no shipped prompt may overlap (13-word n-grams; "
                        "default: Spec-Bench dev and the GSM8K test split)")
    p.add_argument("--max-mb", type=float, default=25.0, help="largest artifact allowed, MiB (default 25)")
    p.add_argument("--partial", action="store_true", help="also take the finished shards of a stopped "
                                                          "distillation (rerunning it finishes it)")


def run(args) -> int:
    command = "python -m toolkit answers " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else None
    record = export_answers(args.dirs, args.out, eval_files=args.eval_files, max_mb=args.max_mb, command=command,
                            partial=args.partial)
    for task, s in sorted(record["_summary"].items()):
        t = record["tasks"][task]
        print(f"{task}: +{s['added']} rows ({s['leaked']} dropped as leaking), {t['rows']} in all, "
              f"{t['answer_tokens']} answer tokens, {t['bytes'] / 1024:.0f} KiB")
    print(f"answers: {args.out} ({RECORD}: the run record)")
    return 0
