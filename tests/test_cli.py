"""`python -m decode eval` end to end: report contents and clear errors for bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from decode.core.kernels.glue import glue_usable
from helpers import run_main


def run_eval(*args, subprocess_=False):
    """``decode eval`` in this process (helpers.run_main); ``subprocess_=True`` runs the real
    ``python -m decode`` entry point once, where the process boundary itself is under test."""
    argv = ["eval", "--no-progress", *args]
    if subprocess_:
        return subprocess.run([sys.executable, "-m", "decode", *argv], capture_output=True, text=True, timeout=600)
    from decode.commands.cli import main
    return run_main(main, argv)


def test_eval_report_on_tiny_target(tiny_target_dir, tmp_path):
    """Through ``python -m decode`` itself: the entry point, stdout and the exit code as a user gets them."""
    out = tmp_path / "r.json"
    r = run_eval("--target", tiny_target_dir, "--arms", "pld:L=3;suffix:L=4;none", "--policies", "ucbspec,exp3spec",
                 "--max-new-tokens", "12", "--categories", "code,summarization", "--cache", "static",
                 "--out", str(out), subprocess_=True)
    assert r.returncode == 0, r.stderr
    assert "| method |" in r.stdout
    rep = json.loads(out.read_text())
    methods = {"hf", "autoregressive", "arm:pld@3", "arm:suffix@4", "arm:none", "policy:ucbspec", "policy:exp3spec",
               "oracle"}
    assert set(rep["summary"]) == methods
    for m, s in rep["summary"].items():
        assert s["lossless"] is True, m  # token for token equal to HF generate
        assert set(s["per_category"]) == {"code", "summarization"}
        assert {"mat", "tokens_per_s", "speedup", "speedup_vs_hf"} <= set(s)
    assert rep["summary"]["autoregressive"]["mat"] == 1.0 and rep["summary"]["hf"]["mat"] == 1.0
    assert rep["summary"]["hf"]["speedup_vs_hf"] == 1.0
    assert any("tokens" in w for w in rep["warnings"])  # 2 prompts × 12 tokens is far too short to time
    assert "× vs hf" in r.stdout and "× vs autoregressive" in r.stdout and "meaningless" in r.stdout
    timed = [rec for rec in rep["records"] if rec["method"] != "oracle"]
    first = [rec["method"] for rec in timed if rec["prompt_id"] == timed[0]["prompt_id"]]
    second = [rec["method"] for rec in timed if rec["prompt_id"] != timed[0]["prompt_id"]]
    assert first[0] == "hf" and second[-1] == "hf"  # hf takes its turn in the rotated order
    assert "fraction_of_oracle" in rep["summary"]["policy:ucbspec"]
    rec = next(r for r in rep["records"] if r["method"] == "policy:ucbspec")
    assert {"rounds", "accept_lengths", "arms", "new_tokens", "token_ids", "text", "wall_time"} <= set(rec)
    assert len(rec["arms"]) == rec["rounds"] and sum(rec["accept_lengths"]) + rec["rounds"] >= rec["new_tokens"]
    assert out.with_suffix(".md").read_text().startswith("| method |")
    cfg = rep["config"]
    assert (cfg["device"], cfg["dtype"]) == ("cpu", "float32") and cfg["cache"] == "static"
    assert rep["complete"] is True and (tmp_path / "r.records.jsonl").exists()


def test_eval_runs_peers_interleaved_and_checked_against_hf(tiny_target_dir, tmp_path):
    """--peers: transformers' own speculative decoders, in the same rotated loop, lossless vs hf, with a
    speed-up over plain generate like every method; the dynamic cache is selectable."""
    out = tmp_path / "report.json"
    r = run_eval("--target", tiny_target_dir, "--arms", "pld:L=3", "--policies", "",
                 "--peers", "hf-pld:L=3;hf-early-exit:layers=1", "--cache", "dynamic", "--device", "cpu",
                 "--dtype", "float32", "--max-new-tokens", "12", "--categories", "code,chat", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["config"]["cache"] == "dynamic" and rep["config"]["peers"] == ["hf-pld:L=3", "hf-early-exit:layers=1"]
    assert rep["config"]["forward"] == "lean" and rep["config"]["fused_ops"] is (glue_usable() is None)
    assert "hf-early-exit:layers=1" in rep["config"]["peer_settings"]
    for m in ("hf-pld:L=3", "hf-early-exit:layers=1"):
        s = rep["summary"][m]
        assert s["lossless"] is True and s["speedup_vs_hf"] > 0, m
        assert f"| {m} |" in r.stdout
    order = [[x["method"] for x in rep["records"] if x["prompt_id"] == pid] for pid in ("builtin-code", "builtin-chat")]
    assert order[0][1:3] == ["hf-pld:L=3", "hf-early-exit:layers=1"] and order[1][0] == "hf-pld:L=3"  # rotated
    assert (tmp_path / "records.jsonl").exists()


def test_eval_in_bfloat16_on_cpu(tiny_target_dir, tmp_path):
    """--dtype reaches the model (bf16 outputs need not equal fp32 ones, so losslessness is not asserted)."""
    out = tmp_path / "b.json"
    r = run_eval("--target", tiny_target_dir, "--arms", "pld:L=3", "--policies", "ucbspec", "--dtype", "bfloat16",
                 "--max-new-tokens", "8", "--categories", "chat", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["config"]["dtype"] == "bfloat16" and rep["summary"]["arm:pld@3"]["new_tokens"] > 0
    assert rep["config"]["forward"] == "lean" and rep["config"]["fused_ops"] is False  # float32 kernels
    assert "--forward auto: the lean loop runs PyTorch's ops between the linears (the fused layer ops are float32" \
        in r.stderr


def test_eval_sampling_mode_runs(tiny_target_dir, tmp_path):
    r = run_eval("--target", tiny_target_dir, "--arms", "pld:L=3", "--policies", "random", "--max-new-tokens", "6",
                 "--limit", "1", "--categories", "chat", "--temperature", "0.8", "--top-k", "20",
                 "--out", str(tmp_path / "s.json"))
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "s.json").read_text())
    assert rep["summary"]["arm:pld@3"]["lossless"] is None  # only defined for greedy
    assert rep["summary"]["hf"]["lossless"] is None and rep["summary"]["hf"]["tokens_per_s"] > 0  # timed all the same


def test_eval_length_controller_and_recorded_traces_replay(tiny_target_dir, tmp_path):
    """--length runs every arm/policy under Beta-TS (still lossless); --record-traces writes dense traces
    that `decode simulate --traces` replays, with one trace per prompt tagged with its id and category."""
    out, traces = tmp_path / "r.json", tmp_path / "traces.json"
    r = run_eval("--target", tiny_target_dir, "--arms", "pld:L=3;suffix:L=4",
                 "--policies", "ucbspec;thompson:carry=true",
                 "--length", "beta-ts:alpha=2", "--max-new-tokens", "10", "--categories", "code,chat",
                 "--record-traces", str(traces), "--out", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["config"]["length"] == "beta-ts:alpha=2"
    assert "policy:thompson:carry=true" in rep["summary"]  # one policy object learnt across both prompts
    assert all(s["lossless"] for s in rep["summary"].values())
    from decode.simulation.traces import load_traces
    tr = load_traces(traces)
    assert sorted(t.meta["category"] for t in tr) == ["chat", "code"]
    assert all(t.arm_labels == ["pld@3", "suffix@4"] and t.n_tokens > 0 for t in tr)
    from decode.commands.cli import main
    sim = run_main(main, ["simulate", "--no-progress", "--no-plot", "--seeds", "2", "--traces", str(traces),
                          "--policies", "ucbspec", "--out", str(tmp_path / "sim.json")])
    assert sim.returncode == 0, sim.stderr
    assert "ucbspec" in json.loads((tmp_path / "sim.json").read_text())["summary"]["policies"]


@pytest.mark.parametrize("args,needle", [
    (["--arms", "bogus:L=2"], "unknown arm 'bogus'"),
    (["--policies", "bogus"], "unknown policy 'bogus'"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--length", "warp"], "unknown length controller 'warp'"),
    (["--length", "cali-ts:predictor=/no/such/dir"], "make train-calibrator"),
    (["--categories", "nope"], "not in the suite"),
    (["--target", "/does/not/exist"], "unknown model"),
])
def test_bad_input_is_a_clear_error(tiny_target_dir, tmp_path, args, needle):
    base = ["--target", tiny_target_dir, "--max-new-tokens", "4", "--out", str(tmp_path / "x.json")]
    r = run_eval(*base, *args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_suite_files(tiny_target_dir, tmp_path):
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"question_id": 1, "turns": ["hi"]}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"question_id": 1, "category": "x", "turns": [""]}) + "\n")
    for path, needle in [(missing, "missing field(s) category"), (empty, "non-empty string"),
                         (tmp_path / "nope.jsonl", "file not found")]:
        r = run_eval("--target", tiny_target_dir, "--suite", str(path), "--out", str(tmp_path / "x.json"))
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_drafter_with_another_vocabulary_is_rejected(tiny_target_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from helpers import tiny_llama
    vocab = {f"w{i}": i for i in range(100)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path / "other_vocab"
    tiny_llama(vocab=100).save_pretrained(d)
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0").save_pretrained(d)
    r = run_eval("--target", tiny_target_dir, "--arms", f"drafter:path={d},L=3", "--max-new-tokens", "4",
                 "--out", str(tmp_path / "x.json"))
    assert r.returncode == 2 and "vocabulary" in r.stderr and "Traceback" not in r.stderr


def test_run_user_command_exit_codes(capsys):
    """A body's int is its exit code; a summary (dict/None) is success; UserError → 2; Ctrl-C → 130."""
    from decode.common.errors import UserError, run_user_command

    assert run_user_command(lambda: {"train_seconds": 1.0}) == 0
    assert run_user_command(lambda: None) == 0
    assert run_user_command(lambda: 3) == 3

    def bad():
        raise UserError("field x: fix it")

    def interrupted():
        raise KeyboardInterrupt

    assert run_user_command(bad) == 2
    assert "error: field x: fix it" in capsys.readouterr().err
    assert run_user_command(interrupted, interrupted="stopped") == 130
    assert "stopped" in capsys.readouterr().err


# ---- bad input caught before any work (in-process: no model may be loaded) --------------------------------

@pytest.fixture
def no_model(monkeypatch):
    """Fail loudly if a check that should come first only comes after loading the model."""
    import decode.evaluation.evaluate

    def refuse(*a, **k):
        raise AssertionError("model loaded before the input was validated")
    monkeypatch.setattr(decode.evaluation.evaluate, "load_model", refuse)


def eval_error(capsys, *args) -> str:
    from decode.commands.cli import main
    assert main(["eval", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line
    return err


@pytest.mark.parametrize("args,needle", [
    (["--limit", "0"], "--limit must be an integer >= 1, got 0"),
    (["--limit", "-2"], "--limit must be an integer >= 1, got -2"),
    (["--max-new-tokens", "-3"], "--max-new-tokens must be an integer >= 1, got -3"),
    (["--top-k", "-1"], "--top-k must be an integer >= 0, got -1"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0 (0 = greedy), got inf"),
    (["--seed", "-1"], "--seed must be an integer in [0, 4294967295], got -1"),
    (["--categories", ","], "--categories: no category names given; pass a comma-separated list of: chat, code"),
    (["--categories", "code,nope"], "nope not in the suite; available: chat, code, extraction"),
    (["--policies", "ucbspec,ucbspec"], "--policies: 'ucbspec' duplicates 'ucbspec'"),
    (["--peers", "bogus:L=2"], "unknown peer 'bogus'"),
    (["--peers", "hf-pld:L=0"], "L must be an integer >= 1, got '0'"),
    (["--peers", "hf-pld:L=3;hf-pld:L=3"], "duplicates"),
    (["--peers", "hf-assisted:path=/no/such/drafter"], "/no/such/drafter"),
    (["--device", "tpu"], "--device must be auto|cpu|cuda[:N]"),
    (["--dtype", "fp8"], "--dtype must be auto|float32|bfloat16|float16, got 'fp8'"),
    (["--compile", "--cache", "dynamic"], "--compile needs --cache static"),
])
def test_out_of_range_values_are_one_line_errors(no_model, capsys, tmp_path, args, needle):
    assert needle in eval_error(capsys, "--out", str(tmp_path / "r.json"), *args)


def test_output_paths_are_checked_before_any_work(no_model, capsys, tmp_path):
    """An unwritable --out used to surface as IsADirectoryError after every prompt had been decoded."""
    folder = tmp_path / "a_folder"
    folder.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    ok = str(tmp_path / "r.json")
    cases = [
        (["--out", str(folder)], "is a folder; pass a file path"),
        (["--out", str(tmp_path / "r.md")], "the markdown table is written beside the report as .md"),
        (["--out", str(tmp_path / "r.jsonl")], "the records are written beside the report"),
        (["--out", ok, "--record-traces", str(tmp_path / "r.records.jsonl")], "the same file as --out (records)"),
        (["--out", str(a_file / "r.json")], f"{a_file} is a file, not a folder"),
        (["--out", ok, "--record-traces", str(folder)], "--record-traces"),
        (["--out", ok, "--record-traces", ok], "--record-traces"),
        (["--out", ok, "--record-traces", str(tmp_path / "r.md")], "the same file as --out (table)"),
    ]
    for args, needle in cases:
        err = eval_error(capsys, *args)
        assert needle in err, (args, err)
    (folder / "r.md").mkdir()  # the table's path is a folder
    assert "--out (table)" in eval_error(capsys, "--out", str(folder / "r.json"))


def test_bad_suite_bytes_and_rows_name_the_file_and_line(no_model, capsys, tmp_path):
    good = json.dumps({"question_id": 1, "category": "x", "turns": ["hi"]})
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(good.encode() + b"\n" + bytes(range(128, 256)) + b"\n")
    number = tmp_path / "number.jsonl"
    number.write_text(good + "\n5\n")
    listing = tmp_path / "list.jsonl"
    listing.write_text("[1, 2]\n")
    out = ["--out", str(tmp_path / "r.json")]
    assert f"--suite {binary}:2: not UTF-8 text" in eval_error(capsys, "--suite", str(binary), *out)
    assert f"--suite {number}:2: expected a JSON object" in eval_error(capsys, "--suite", str(number), *out)
    assert f"--suite {listing}:1: expected a JSON object" in eval_error(capsys, "--suite", str(listing), *out)
    assert "is a folder" in eval_error(capsys, "--suite", str(tmp_path), *out)


def test_every_subcommand_help_has_a_complete_description(capsys):
    """The description was the docstring's first line, which for eval stopped mid-sentence."""
    import importlib
    import decode.commands.cli
    import toolkit.cli
    from decode.commands.cli import describe
    for cli in (decode.commands.cli, toolkit.cli):
        for name, (module, help_text) in cli.COMMANDS.items():
            desc = describe(importlib.import_module(module).__doc__, help_text)
            assert desc.endswith("."), (name, desc)
            with pytest.raises(SystemExit):
                cli.main([name, "--help"])
            assert desc in " ".join(capsys.readouterr().out.split()), name
    assert describe(None, "fallback") == "fallback"


def test_a_reader_closing_the_pipe_early_is_not_a_traceback():
    """`decode compare A B | head`: the reader goes away; we stop quietly (exit 141, like SIGPIPE)."""
    import subprocess
    import sys
    code = ("import sys; from decode.common.errors import run_user_command; "
            "sys.exit(run_user_command(lambda: [print('x' * 100) for _ in range(200000)]))")
    p = subprocess.run(f"{sys.executable} -c \"{code}\" | head -1", shell=True, capture_output=True, text=True,
                       executable="/bin/bash")
    assert p.stdout == "x" * 100 + "\n"
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def test_decode_commands_build_without_the_serving_stack():
    """`decode eval` must not need fastapi/uvicorn/prometheus (a GPU image without them, a training box): only
    `decode serve` may load the HTTP stack, when it runs."""
    import subprocess
    import sys

    code = ("import builtins, sys\n"
            "real = builtins.__import__\n"
            "def fake(name, *a, **k):\n"
            "    if name.split('.')[0] in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client'):\n"
            "        raise ImportError('No module named ' + name)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = fake\n"
            "from decode.commands.cli import main\n"
            "sys.exit(main(['eval', '--help']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage: decode eval" in r.stdout


@pytest.mark.parametrize("argv, out", [(["--help"], "usage: {prog} [-h]"), (["evl"], "invalid choice: 'evl'"),
                                       ([], "the following arguments are required: command")])
@pytest.mark.parametrize("prog", ["decode", "toolkit"])
def test_the_command_list_and_a_mistyped_command_import_no_subcommand(prog, argv, out):
    """`decode --help` or a mistyped command answers at once: no subcommand module (each pulls in torch and
    transformers, 20-40 s on a 2-core machine) is imported to list them."""
    cli = "decode.commands.cli" if prog == "decode" else "toolkit.cli"
    code = (f"import sys\nfrom {cli} import COMMANDS, main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m in {v[0] for v in COMMANDS.values()})\n"
            "print('LOADED', loaded)\n")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    assert out.format(prog=prog) in r.stdout + r.stderr
    assert "LOADED []" in r.stdout, r.stdout[-2000:]
