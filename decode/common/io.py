"""Atomic file writes: a reader (or a resumed run) never sees a half-written file."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


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


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be created in ``folder``, by creating (and removing) one: ``os.access`` says yes to
    root on read-only or virtual file systems (/sys, /proc) where the write itself then fails."""
    try:
        fd, name = tempfile.mkstemp(prefix=".adaspec-probe.", suffix=".tmp", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def check_output_file(path: str | os.PathLike, flag: str) -> None:
    """Fail before any work, not after it, on an output file that cannot be written: a folder, a parent that
    is a file, or a folder in which no file can be created (parents that do not exist yet are created by the
    writer, so the nearest existing one is probed). ``flag`` names the option in the one-line error."""
    from .errors import UserError
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {p}: is a folder; pass a file path")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {p}: {parent} is a file, not a folder")
    if not _can_create_in(parent):
        raise UserError(f"{flag} {p}: cannot write into {parent} (permission denied or a read-only file system); "
                        f"pass another path")


def is_json_object_with(path: str | os.PathLike, keys: set[str]) -> bool:
    """Whether ``path`` holds a JSON object with every one of ``keys`` (how an output this tool wrote is told from a
    user's file); False for anything unreadable."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: invalid JSON or not UTF-8
        return False
    return isinstance(data, dict) and keys <= data.keys()


def is_report_json(path: str | os.PathLike) -> bool:
    """A report this tool wrote (``decode eval``/``report``/``simulate``): ``config`` and ``summary``."""
    return is_json_object_with(path, {"config", "summary"})


def starts_with(path: str | os.PathLike, *prefixes: str) -> bool:
    """Whether the text file at ``path`` begins with one of ``prefixes`` (how a table this tool wrote is told
    from a user's file)."""
    try:
        with Path(path).open("rb") as fh:
            head = fh.read(256).decode("utf-8", errors="replace")
    except OSError:
        return False
    return head.startswith(prefixes)


def refuse_foreign(path: str | os.PathLike, flag: str, is_own, allow: str) -> None:
    """A file at ``path`` that this tool did not write (``is_own(path)`` False) is never replaced without the
    flag ``allow`` (e.g. ``--force``): a one-line error naming the path, before any work."""
    from .errors import UserError
    p = Path(path)
    if p.is_file() and not is_own(p):
        raise UserError(f"{flag} {p}: the file exists and is not an output of this tool; pass {allow} to "
                        f"replace it, or another path")


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` survive a crash (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temp file beside ``path``, fsync it, rename it in and fsync the folder (parents are
    created): after a crash the file is the old one or the new one, whole, never torn or empty."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    _fsync_dir(path.parent)


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


class JsonlLog:
    """An append-only JSONL file that survives being killed: each row is one ``write`` of a whole line,
    flushed and fsynced before :meth:`append` returns, so a crash loses at most the row being written.

    :func:`read_jsonl_log` reads such a file back, dropping a torn last line. Opening takes an exclusive
    ``flock``, so two processes never append to the same file (the second gets a clear error).
    ``keep_bytes``: truncate to this many bytes first (the good prefix that ``read_jsonl_log`` returned,
    cutting a torn last line); None = keep everything, 0 = start empty.
    """

    def __init__(self, path: str | os.PathLike, keep_bytes: int | None = None, *, where: str = "--out"):
        from .errors import UserError
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.path, "ab")
        try:
            import fcntl
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # not POSIX: no lock
            pass
        except OSError:
            self.fh.close()
            raise UserError(f"{where}: {self.path} is being written by another process (a run on the same "
                            f"output still going?); wait for it or pass another path") from None
        if keep_bytes is not None:
            self.fh.truncate(keep_bytes)  # append mode writes at the (new) end
            self._sync()

    def _sync(self) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def append(self, row) -> None:
        self.fh.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        self._sync()

    def close(self) -> None:
        if not self.fh.closed:
            self.fh.close()  # also releases the lock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def read_jsonl_log(path: str | os.PathLike, where: str) -> tuple[list, int, str | None]:
    """Rows of a :class:`JsonlLog` file: ``(rows, good_bytes, note)``. A last line that is incomplete
    (no newline) or not valid JSON is the row a killed writer left half-written: it is dropped,
    ``good_bytes`` ends before it and ``note`` says so. A bad line anywhere else is a UserError naming
    ``where``, the file and the line."""
    from .errors import UserError
    data = Path(path).read_bytes()
    rows, pos, lineno, note = [], 0, 0, None
    while pos < len(data):
        end = data.find(b"\n", pos)
        line = data[pos:] if end < 0 else data[pos:end]
        lineno += 1
        last = end < 0 or end == len(data) - 1
        if line.strip():
            try:
                row = json.loads(line.decode("utf-8"))
                if end < 0:
                    raise ValueError("no newline")
            except ValueError as exc:
                if not last:
                    raise UserError(f"{where}: {path}:{lineno} is not valid JSON ({exc}); the file is damaged "
                                    f"beyond its last line") from None
                note = f"{path}:{lineno}: dropped an incomplete last line (a write was interrupted)"
                break
            rows.append(row)
        pos = len(data) if end < 0 else end + 1
    return rows, pos, note


def resolve_repo_path(path: str | os.PathLike) -> Path | None:
    """A path as recipes and pool files name them: an absolute one as given, a relative one under the repository
    root, then under the working directory; None when it exists in neither."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p if p.exists() else None
    for base in (REPO_ROOT, Path.cwd()):
        if (base / p).exists():
            return (base / p).resolve()
    return None
