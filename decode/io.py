"""Atomic file writes: a reader (or a resumed run) never sees a half-written file."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | os.PathLike, *, directory: bool = False):
    """Yield a temp path beside ``path`` (a file, or a created folder with ``directory=True``) to write;
    when the block succeeds it replaces ``path`` in one rename (an existing folder is swapped out, then
    removed), else it is deleted. Parents are created. The result gets the permissions a plain write
    would (mkstemp/mkdtemp would leave it 0600/0700, unreadable to the rest of a team)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, (0o777 if directory else 0o666) & ~_umask())
        if directory and path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / "x")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temp file beside ``path`` and rename it in (parents are created)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


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
