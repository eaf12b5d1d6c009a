"""Atomic file writes: a reader (or a resumed run) never sees a half-written file."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temp file beside ``path`` and ``os.replace`` it in (parents are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj, *, indent: int | None = 1, sort_keys: bool = False) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=False) + "\n")


def iter_jsonl(path: str | os.PathLike, where: str):
    """Yield ``(line number, row)`` for each non-blank line of a JSONL file; a bad line is a UserError
    naming ``where`` (the flag or recipe field that points at the file), the file and the line."""
    from .errors import UserError
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: {path}:{lineno} is not valid JSON ({exc.msg})") from None
