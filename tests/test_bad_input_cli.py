"""Bad input on the command lines (issue 2 of the bad-input sweep): a user's file is never replaced without
--fresh/--force, a damaged head folder is one error naming it, --max-new-tokens is bounded by the target's
context, output paths and every spec are checked before any work, and a binary or a folder where a text file
belongs is a clear error. Every case runs in-process and fails before a model would load."""
import json
from pathlib import Path

import pytest

from decode.commands.cli import main as decode_main
from decode.common.errors import UserError
from helpers import tiny_llama

NO_TARGET = "/nonexistent/target"  # a spec error must win over the target's own


@pytest.fixture
def no_model(monkeypatch):
    """Fail loudly if a check that should come first only comes after loading a model. Every module that binds
    ``load_model`` at import is imported first and patched too: one imported for the first time while the patch is
    on would keep ``refuse`` for the rest of the worker's tests."""
    import importlib

    def refuse(*a, **k):
        raise AssertionError("model loaded before the input was validated")
    modules = [importlib.import_module(name) for name in (  # all imported before any is patched
        "decode.core.models", "decode.evaluation.evaluate", "decode.evaluation.batched", "decode.commands.generate",
        "decode.choose.arms.model", "decode.bench.bench_round", "decode.bench.bench_tree", "toolkit.train.drafter")]
    for mod in modules:
        monkeypatch.setattr(mod, "load_model", refuse)


def one_line_error(capsys, code: int) -> str:
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def eval_error(capsys, *args) -> str:
    return one_line_error(capsys, decode_main(["eval", "--no-progress", *args]))


def generate_error(capsys, *args) -> str:
    return one_line_error(capsys, decode_main(["generate", "hi", *args]))


# --------------------------------------------------------------------------- a user's file is never lost

def test_eval_never_replaces_a_file_it_did_not_write(no_model, capsys, tmp_path):
    """`decode eval --out victim.json` overwrote a user's unrelated file without a word (exit 0)."""
    victim = tmp_path / "victim.json"
    victim.write_text('{"mine": 1}\n')
    err = eval_error(capsys, "--target", NO_TARGET, "--out", str(victim))
    assert str(victim) in err and "not an output of this tool" in err and "--fresh" in err
    assert victim.read_text() == '{"mine": 1}\n'
    notes = tmp_path / "notes.md"  # the table's path beside --out notes.json
    notes.write_text("# my notes\n")
    err = eval_error(capsys, "--target", NO_TARGET, "--out", str(tmp_path / "notes.json"))
    assert "--out (table)" in err and str(notes) in err and notes.read_text() == "# my notes\n"
    err = eval_error(capsys, "--target", NO_TARGET, "--out", str(tmp_path / "r.json"), "--record-traces", str(victim))
    assert "--record-traces" in err and str(victim) in err


def test_eval_replaces_its_own_outputs_and_anything_with_fresh(tmp_path):
    """A report and table this tool wrote are replaced (rerunning resumes); --fresh replaces anything."""
    from decode.evaluation.eval_config import EvalConfig
    from decode.evaluation.report import write_report
    from decode.simulation.traces import write_traces
    out, traces = tmp_path / "r.json", tmp_path / "t.json"
    write_report({"schema_version": "adaspec-eval-report/2", "config": {}, "summary": {}}, "| method | x |", out,
                 plots=False)
    write_traces(traces, [])
    EvalConfig(out=str(out), record_traces=str(traces)).check_outputs()
    out.write_text("user data\n")
    with pytest.raises(UserError, match="pass --fresh"):
        EvalConfig(out=str(out)).check_outputs()
    EvalConfig(out=str(out), fresh=True).check_outputs()


def test_simulate_and_report_never_replace_a_file_they_did_not_write(capsys, tmp_path):
    victim = tmp_path / "victim.json"
    victim.write_text('{"mine": 1}\n')
    sim = ["simulate", "--no-progress", "--seeds", "1", "--length", "50", "--policies", "ucbspec", "--out", str(victim)]
    err = one_line_error(capsys, decode_main(sim))
    assert str(victim) in err and "--force" in err and victim.read_text() == '{"mine": 1}\n'
    assert decode_main([*sim, "--force"]) == 0  # said so: replaced
    assert "summary" in json.loads(victim.read_text())
    assert decode_main(sim) == 0  # its own report, table and plot: replaced without --force
    capsys.readouterr()

    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text("{}\n")
    (run / "report.json").write_text("precious\n")  # `decode report run/` writes report.json beside the records
    err = one_line_error(capsys, decode_main(["report", str(run), "--no-plots"]))
    assert str(run / "report.json") in err and "--force" in err
    assert (run / "report.json").read_text() == "precious\n"
    err = one_line_error(capsys, decode_main(["report", str(run), "--no-plots", "--force"]))
    assert "not a records file" in err  # past the output check, to the records themselves


# --------------------------------------------------------------------------- output paths before the work

def test_output_paths_are_checked_before_the_work(no_model, capsys, tmp_path, monkeypatch):
    """/sys/report.json failed with PermissionError after the model loaded (root passes os.access there);
    simulate/report --out a folder or a path under a file failed after the simulation ran."""
    import decode.evaluation.report
    import decode.simulation.simulate

    def no_work(*a, **k):
        raise AssertionError("worked before the output path was checked")
    monkeypatch.setattr(decode.simulation.simulate, "simulate", no_work)
    monkeypatch.setattr(decode.evaluation.report, "_from_records", no_work)
    if Path("/sys").is_dir():
        err = eval_error(capsys, "--target", NO_TARGET, "--out", "/sys/report.json")
        assert "--out /sys/report.json: cannot write into /sys" in err
    folder, a_file = tmp_path / "folder", tmp_path / "a_file"
    folder.mkdir()
    a_file.write_text("x")
    sim = ["simulate", "--no-progress", "--seeds", "1", "--length", "50", "--policies", "ucbspec"]
    assert "is a folder" in one_line_error(capsys, decode_main([*sim, "--out", str(folder)]))
    assert f"{a_file} is a file, not a folder" in one_line_error(
        capsys, decode_main([*sim, "--out", str(a_file / "r.json")]))
    (tmp_path / "records.jsonl").write_text("{}\n")
    rep = ["report", str(tmp_path / "records.jsonl"), "--no-plots"]
    assert "is a folder" in one_line_error(capsys, decode_main([*rep, "--out", str(folder)]))
    assert f"{a_file} is a file, not a folder" in one_line_error(
        capsys, decode_main([*rep, "--out", str(a_file / "r.json")]))
    err = one_line_error(capsys, decode_main([*rep, "--out", str(tmp_path / "records.jsonl")]))
    assert "--out" in err and (tmp_path / "records.jsonl").read_text() == "{}\n"  # the records are never replaced


# --------------------------------------------------------------------------- damaged head folders

@pytest.fixture
def head_dir(tmp_path):
    from decode.choose.heads import EagleHead, save_head
    return save_head(EagleHead(tiny_llama(seed=1)), tmp_path / "head")


def damage(folder: Path, how: str) -> str:
    """Damage a head folder; returns what the error must name besides the folder."""
    w, j = folder / "head.safetensors", folder / "head.json"
    if how == "random-bytes":
        w.write_bytes(bytes(range(256)) * 4)
    elif how == "truncated-weights":
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif how == "truncated-json":
        j.write_text(j.read_text()[:20])
        return "head.json"
    elif how == "missing-weights":
        w.unlink()
    return "head.safetensors"


DAMAGE = ["random-bytes", "truncated-weights", "truncated-json", "missing-weights"]


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_head_folder_is_one_error_naming_it_in_eval_and_generate(no_model, capsys, head_dir, how):
    what = damage(head_dir, how)
    for err in (eval_error(capsys, "--target", NO_TARGET, "--arms", f"eagle:path={head_dir},L=2",
                           "--out", str(head_dir.parent / "r.json")),
                generate_error(capsys, "--target", NO_TARGET, "--arms", f"eagle:path={head_dir},L=2")):
        assert str(head_dir) in err and what in err, err


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_head_folder_is_one_error_naming_it_in_export(no_model, capsys, head_dir, how):
    from toolkit.cli import main as toolkit_main
    what = damage(head_dir, how)
    out = head_dir.parent / "export"
    err = one_line_error(capsys, toolkit_main(["export", str(head_dir), "--format", "eagle", "--out", str(out),
                                               "--target", NO_TARGET]))
    assert str(head_dir) in err and what in err, err
    assert not out.exists()


def test_head_weights_that_do_not_fit_and_another_target_name_the_folder(head_dir):
    """Tensors missing or of another shape, and a head trained for another target: each a UserError naming
    the folder (a shape mismatch was a raw RuntimeError; another target's error named no folder)."""
    from safetensors.torch import load_file, save_file

    from decode.choose.heads import load_head
    target = tiny_llama(seed=1)
    with pytest.raises(UserError, match=rf"{head_dir}.*hidden_size=32.*hidden_size=48"):
        load_head(head_dir, tiny_llama(hidden=48))
    weights = head_dir / "head.safetensors"
    state = load_file(str(weights))
    name = next(iter(state))
    save_file({k: v for k, v in state.items() if k != name}, str(weights))
    with pytest.raises(UserError, match=rf"head folder {head_dir}: .*missing"):
        load_head(head_dir, target)
    save_file({**state, name: state[name][..., :1].contiguous()}, str(weights))
    with pytest.raises(UserError, match=rf"head folder {head_dir}: head.safetensors does not fit"):
        load_head(head_dir, target)


# --------------------------------------------------------------------------- specs before anything loads

@pytest.mark.parametrize("args, needle", [
    (["--arms", "pld:L="], "L must be an integer >= 0, got ''"),
    (["--arms", "pld:L=-1"], "L must be an integer >= 0, got '-1'"),
    (["--arms", "suffix:L=abc"], "L must be an integer >= 0, got 'abc'"),
    (["--arms", "bogus:L=2"], "unknown arm 'bogus'"),
    (["--arms", "eagle:path=/no/such/head"], "/no/such/head is not a trained head folder (no such folder"),
    (["--arms", "union:arms=pld:L=-1+suffix"], "L must be an integer >= 0, got '-1'"),
    (["--policies", "bogus"], "unknown policy 'bogus'"),
    (["--policies", "ucbspec:delta=2"], "delta must be in (0, 1]"),
])
def test_eval_specs_are_checked_before_the_target_loads(no_model, capsys, tmp_path, args, needle):
    """They used to surface ~23 s in, after the model had loaded and the linear probe had run."""
    assert needle in eval_error(capsys, "--target", NO_TARGET, "--out", str(tmp_path / "r.json"), *args)


@pytest.mark.parametrize("arms, needle", [
    ("pld:L=-1", "L must be an integer >= 0, got '-1'"),
    ("eagle:path=/no/such/head,L=2", "/no/such/head is not a trained head folder (no such folder"),
])
def test_generate_specs_are_checked_before_the_target_loads(no_model, capsys, arms, needle):
    assert needle in generate_error(capsys, "--target", NO_TARGET, "--arms", arms)


# --------------------------------------------------------------------------- --max-new-tokens and the context

def test_max_new_tokens_is_bounded_by_the_targets_context_up_front(no_model, capsys, tiny_target_dir, tmp_path):
    """--max-new-tokens 100000000 tried to allocate 76.8 GB after 25 s; the tiny target's context is 512."""
    err = eval_error(capsys, "--target", tiny_target_dir, "--max-new-tokens", "100000000",
                     "--out", str(tmp_path / "r.json"))
    assert "--max-new-tokens 100000000" in err and "context of 512 tokens" in err and "at most 511" in err
    err = generate_error(capsys, "--target", tiny_target_dir, "--max-new-tokens", "100000000")
    assert "context of 512 tokens" in err and "at most 511" in err


def test_prompts_past_the_context_are_noted_before_the_engine_is_built(capsys, tiny_target_dir, tmp_path,
                                                                       monkeypatch):
    """A prompt + --max-new-tokens beyond the context still decodes (suites with long prompts did before),
    with a note saying so before the engine's probe and caches."""
    import decode.evaluation.evaluate

    def no_engine(*a, **k):
        raise UserError("stopped before the engine")
    monkeypatch.setattr(decode.evaluation.evaluate, "build_engine", no_engine)
    assert decode_main(["eval", "--no-progress", "--target", tiny_target_dir, "--max-new-tokens", "500",
                        "--categories", "chat,code", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "note: 2 of 2 prompts (up to " in err and "--max-new-tokens 500 exceed" in err
    assert "context of 512 tokens" in err and err.index("note:") < err.index("stopped before the engine")


# --------------------------------------------------------------------------- a binary or a folder as a text file

def test_binary_or_folder_traces_and_recipes_are_clear_errors(capsys, tmp_path):
    from toolkit.cli import main as toolkit_main
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(128, 256)) * 8)
    sim = ["simulate", "--no-progress", "--no-plot", "--out", str(tmp_path / "s.json"), "--traces"]
    assert "not UTF-8 text" in one_line_error(capsys, decode_main([*sim, str(binary)]))
    assert "is a folder" in one_line_error(capsys, decode_main([*sim, str(tmp_path)]))
    assert "not UTF-8 text" in one_line_error(capsys, toolkit_main(["train", "eagle", "--recipe", str(binary)]))
    assert "is a folder" in one_line_error(capsys, toolkit_main(["train", "eagle", "--recipe", str(tmp_path)]))
