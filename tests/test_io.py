"""decode.common.io: atomic writes leave either the old or the new content, never a half-written file,
and give results the permissions a plain write would."""
import os
import stat

import pytest

from decode.common.io import atomic_path, atomic_write_text, iter_jsonl
from decode.common.errors import UserError


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_file_replaced_with_umask_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        p = tmp_path / "sub" / "report.json"
        atomic_write_text(p, "one")
        atomic_write_text(p, "two")
        assert p.read_text() == "two"
        assert _mode(p) == 0o644  # mkstemp alone would leave 0600
        assert sorted(x.name for x in p.parent.iterdir()) == ["report.json"]
    finally:
        os.umask(old)


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert p.read_text() == "old"
    assert [x.name for x in tmp_path.iterdir()] == ["a.txt"]


def test_folder_swapped_in_whole(tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "export"
        with atomic_path(out, directory=True) as tmp:
            (tmp / "weights").write_text("v1")
            (tmp / "stale").write_text("x")
        with atomic_path(out, directory=True) as tmp:
            (tmp / "weights").write_text("v2")
        assert sorted(x.name for x in out.iterdir()) == ["weights"]
        assert (out / "weights").read_text() == "v2"
        assert _mode(out) == 0o755
        with pytest.raises(KeyError):
            with atomic_path(out, directory=True) as tmp:
                (tmp / "weights").write_text("v3")
                raise KeyError("interrupted")
        assert (out / "weights").read_text() == "v2"
        assert [x.name for x in tmp_path.iterdir()] == ["export"]
    finally:
        os.umask(old)


def test_iter_jsonl_names_the_bad_line(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"a": 1}\n\n{"a": \n')
    rows = iter_jsonl(p, "--suite")
    assert next(rows) == (1, {"a": 1})
    with pytest.raises(UserError, match=r"--suite: .*rows.jsonl:3 is not valid JSON"):
        next(rows)
