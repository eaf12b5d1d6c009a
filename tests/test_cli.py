"""`python -m decode eval` end to end: report contents and clear errors for bad input."""
import json
import subprocess
import sys

import pytest


def run_eval(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "decode", "eval", "--no-progress", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=600)


def test_eval_report_on_tiny_target(tiny_target_dir, tmp_path):
    out = tmp_path / "r.json"
    r = run_eval("--target", tiny_target_dir, "--arms", "pld:L=3;suffix:L=4;none", "--policies", "ucbspec,exp3spec",
                 "--max-new-tokens", "12", "--categories", "code,summarization", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "| method |" in r.stdout
    rep = json.loads(out.read_text())
    methods = {"autoregressive", "arm:pld@3", "arm:suffix@4", "arm:none", "policy:ucbspec", "policy:exp3spec", "oracle"}
    assert set(rep["summary"]) == methods
    for m, s in rep["summary"].items():
        assert s["lossless"] is True, m
        assert set(s["per_category"]) == {"code", "summarization"}
        assert {"mat", "tokens_per_s", "speedup"} <= set(s)
    assert rep["summary"]["autoregressive"]["mat"] == 1.0
    assert "fraction_of_oracle" in rep["summary"]["policy:ucbspec"]
    rec = next(r for r in rep["records"] if r["method"] == "policy:ucbspec")
    assert {"rounds", "accept_lengths", "arms", "new_tokens", "token_ids", "text", "wall_time"} <= set(rec)
    assert len(rec["arms"]) == rec["rounds"] and sum(rec["accept_lengths"]) + rec["rounds"] >= rec["new_tokens"]
    assert out.with_suffix(".md").read_text().startswith("| method |")


def test_eval_sampling_mode_runs(tiny_target_dir, tmp_path):
    r = run_eval("--target", tiny_target_dir, "--arms", "pld:L=3", "--policies", "random", "--max-new-tokens", "6",
                 "--limit", "1", "--categories", "chat", "--temperature", "0.8", "--top-k", "20",
                 "--out", str(tmp_path / "s.json"))
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "s.json").read_text())
    assert rep["summary"]["arm:pld@3"]["lossless"] is None  # only defined for greedy


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
    from decode.traces import load_traces
    tr = load_traces(traces)
    assert sorted(t.meta["category"] for t in tr) == ["chat", "code"]
    assert all(t.arm_labels == ["pld@3", "suffix@4"] and t.n_tokens > 0 for t in tr)
    sim = subprocess.run([sys.executable, "-m", "decode", "simulate", "--no-progress", "--no-plot", "--seeds", "2",
                          "--traces", str(traces), "--policies", "ucbspec", "--out", str(tmp_path / "sim.json")],
                         capture_output=True, text=True, timeout=600)
    assert sim.returncode == 0, sim.stderr
    assert "ucbspec" in json.loads((tmp_path / "sim.json").read_text())["summary"]["policies"]


@pytest.mark.parametrize("args,needle", [
    (["--arms", "bogus:L=2"], "unknown arm 'bogus'"),
    (["--policies", "bogus"], "unknown policy 'bogus'"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be > 0"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
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
    from decode.errors import UserError, run_user_command

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
