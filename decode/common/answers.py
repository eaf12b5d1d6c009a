"""Reading an answers folder (``python -m toolkit answers`` writes it: one ``<task>.jsonl.gz`` per task and the run
record ``answers.json``): the training half reads its rows as data, the ``rest`` arm as its datastore."""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from .errors import UserError

RECORD = "answers.json"
FORMAT = "adaspec-answers/1"


def task_file(folder: Path, task: str) -> Path:
    """Where an answers folder holds the rows of ``task``."""
    return folder / f"{task}.jsonl.gz"


def load_answers(folder: str | os.PathLike, task: str | None = None) -> list[dict]:
    """The rows of an answers folder (one task, or every task in name order)."""
    folder = Path(folder)
    record = read_record(folder)
    tasks = [task] if task is not None else sorted(record["tasks"])
    rows = []
    for t in tasks:
        if t not in record["tasks"]:
            raise UserError(f"{folder}: no answers for task '{t}' (it has {', '.join(sorted(record['tasks']))})")
        path = task_file(folder, t)
        try:
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                rows += [json.loads(line) for line in fh if line.strip()]
        except (OSError, EOFError, ValueError) as exc:
            raise UserError(f"{path}: unreadable answers file ({exc}); restore it from git or rebuild it with "
                            f"`python -m toolkit answers`") from None
    return rows


def read_record(folder: str | os.PathLike) -> dict:
    """The folder's run record (``answers.json``), its format checked."""
    folder = Path(folder)
    path = folder / RECORD
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{folder} is not an answers folder ({RECORD} missing)") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable ({exc})") from None
    if record.get("format") != FORMAT:
        raise UserError(f"{path}: format {record.get('format')!r}, expected {FORMAT!r}")
    return record
