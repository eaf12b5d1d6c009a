"""Self-distillation: recipes, prompt sources, filters, leakage, generation, resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from decode.common.errors import UserError
from decode.core.sampling import SamplingConfig
from toolkit.cli import main as toolkit_main
from toolkit.data import sources as S
from toolkit.data.filters import FilterConfig, first_match, tail_loop
from toolkit.data.leakage import EvalIndex
from toolkit.data.prompts import select_prompts
from toolkit.data.templates import Template
from toolkit.distill import COLUMNS, distill, generate_batch, load_distill_recipe, load_distilled

ROOT = Path(__file__).resolve().parents[1]
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench" / "question_dev.jsonl"
TASKS = ("math", "code", "chat", "summarization", "translation", "qa")


def spec_bench_turns(category: str) -> list[str]:
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows if r["category"] == category]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok(smol_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smol_path)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    from decode.core.models import load_model
    return load_model(tiny_target_dir)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_recipe(tmp_path, target, prompts_file, *extra):
    return load_distill_recipe(task="math", overrides=[
        f"target={target}", f"sources=[{{type: jsonl, path: '{prompts_file}', field: q}}]",
        "num_prompts=null", "generation.temperatures=[0.0, 0.7]", "generation.max_new_tokens=6",
        "generation.batch_size=3", "shard_size=3", f"out={tmp_path / 'out'}", *extra])


def load_rows(out) -> list[dict]:
    ds = load_distilled(out, include_filtered=True)
    return sorted(ds.to_list(), key=lambda r: r["id"])


# ----------------------------------------------------------------------------- recipes

@pytest.mark.parametrize("task", TASKS)
def test_task_recipes_load_and_select_prompts(task, tok):
    r = load_distill_recipe(task=task)
    assert r.task == task and r.generation.temperatures == [0.0, 0.3, 0.7, 1.0]
    assert r.out_dir == Path(f"runs/distill/{task}")
    sel = select_prompts(r.sources, 4, eval_index=EvalIndex.from_files(r.leakage.eval_files),
                         check=lambda p: None)
    assert len(sel.prompts) == 4 and all(p.text.strip() for p in sel.prompts)


def test_recipe_validation_errors(tmp_path):
    with pytest.raises(UserError, match="no recipe .* available tasks: .*math"):
        load_distill_recipe(task="nope")
    with pytest.raises(UserError, match="'generation.max_new_token'; did you mean 'max_new_tokens'"):
        load_distill_recipe(task="math", overrides=["generation.max_new_token=5"])
    with pytest.raises(UserError, match="temperatures must be distinct, finite and >= 0"):
        load_distill_recipe(task="math", overrides=["generation.temperatures=[0.0, -1]"])
    with pytest.raises(UserError, match=r"template.user must contain \{prompt\}"):
        load_distill_recipe(task="math", overrides=["template.user=Solve it"])
    with pytest.raises(UserError, match="'filters.rules\\[1\\]' must be one of"):
        load_distill_recipe(task="math", overrides=["filters.rules=[empty, loops]"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: math\nsources:\n  - type: gsm8k\n    pth: x.jsonl\n")
    with pytest.raises(UserError, match="unknown field 'sources\\[0\\].pth'; did you mean 'path'"):
        load_distill_recipe(bad)


def test_cli_reports_user_errors_with_exit_2(capsys):
    assert toolkit_main(["distill", "--task", "math", "generation.batch_size=big"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'generation.batch_size' must be an integer" in err
    assert "Traceback" not in err
    assert toolkit_main(["distill", "--task", "qa", "--print-recipe", "num_prompts=3"]) == 0
    assert "num_prompts: 3" in capsys.readouterr().out


# ----------------------------------------------------------------------------- sources

def test_jsonl_and_parquet_sources(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", [{"q": "one"}, {"q": "two"}, {"q": None}, {"q": "three"}])
    got = [p.text for p in S.iter_source(S.JsonlSource(path=str(tmp_path / "p.jsonl"), field="q", limit=2))]
    assert got == ["one", "two"]
    pq.write_table(pa.table({"text": ["a", "b"], "x": [1, 2]}), tmp_path / "p.parquet")
    got = list(S.iter_source(S.ParquetSource(path=str(tmp_path / "p.parquet"), field="text", name="mine")))
    assert [(p.text, p.source) for p in got] == [("a", "mine"), ("b", "mine")]
    with pytest.raises(UserError, match="no column 'prompt'.*columns: text, x"):
        list(S.iter_source(S.ParquetSource(path=str(tmp_path / "p.parquet"))))
    with pytest.raises(UserError, match="has no field 'prompt'.*field to the prompt column"):
        list(S.iter_source(S.JsonlSource(path=str(tmp_path / "p.jsonl"))))
    with pytest.raises(UserError, match="sources\\[2\\].path: file 'missing.jsonl' not found"):
        list(S.iter_source(S.JsonlSource(path="missing.jsonl"), "sources[2]"))


def test_gsm8k_default_path_resolves_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = next(S.iter_source(S.GSM8KSource()))
    assert first.source == "gsm8k" and first.text.startswith("Natalia sold clips")


def test_humaneval_source_reads_the_packaged_problems():
    got = list(S.iter_source(S.HumanEvalSource()))
    assert len(got) == 164 and got[0].text.lstrip().startswith("from typing import List")
    assert "def has_close_elements" in got[0].text


def test_sharegpt_source_routes_user_turns():
    got = list(S.iter_source(S.ShareGPTSource(bucket="summarization", limit=5)))
    assert len(got) == 5 and all(S.route_bucket(p.text) == "summarization" for p in got)
    assert {p.source for p in got} == {"sharegpt/summarization"}
    allp = list(S.iter_source(S.ShareGPTSource(limit=50)))
    assert len(allp) == 50 and len({S.route_bucket(p.text) for p in allp}) >= 3


@pytest.mark.parametrize("text, bucket", [
    ("Please translate this into French: good morning", "translation"),
    ("Can you summarize the following article? ...", "summarization"),
    ("tl;dr of this thread please", "summarization"),
    ("Write a python function that reverses a list", "code"),
    ("Why does this fail?\n```\nx = 1/0\n```", "code"),
    ("What is the capital of Peru?", "qa"),
    ("Tell me a story about a dragon who learns to fly.", "chat"),
    ("What " + "very " * 50 + "long question?", "chat"),
])
def test_sharegpt_bucket_rules(text, bucket):
    assert S.route_bucket(text) == bucket


def test_sharegpt_reader_survives_a_truncated_file(tmp_path):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
             for i in range(3)]
    text = json.dumps(convs, indent=2)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.rindex('"q2"') + 2])
    with pytest.warns(UserWarning, match="ends mid-record; using the 2 complete"):
        got = list(S.iter_sharegpt_conversations(cut))
    assert [c["id"] for c in got] == ["0", "1"]
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert [c["id"] for c in S.iter_sharegpt_conversations(whole)] == ["0", "1", "2"]


def test_hf_source_offline_fails_fast_with_a_clear_message(monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="not in the local cache and HF_HUB_OFFLINE=1"):
        list(S.iter_source(S.HFSource(dataset="adaspec-nonexistent/never-cached")))


def test_hf_source_online_but_unreachable_fails_fast(monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(S, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(UserError, match="hub is unreachable"):
        list(S.iter_source(S.HFSource(dataset="openai/gsm8k", config="main")))


# ----------------------------------------------------------------------------- templates

def test_template_matches_decode_eval_encoding(tok):
    from decode.evaluation.suites import encode_prompt
    text, ids = Template().render(tok, "What is 2+2?")
    assert ids == encode_prompt(tok, "What is 2+2?")
    assert text.endswith("<|im_start|>assistant\n") and "What is 2+2?" in text
    _, ids_sys = Template(system="Be brief.", user="Q: {prompt}").render(tok, "hi {x}")
    assert "Be brief." in tok.decode(ids_sys) and "Q: hi {x}" in tok.decode(ids_sys)
    plain_text, plain_ids = Template(chat="never").render(tok, "hello")
    assert "<|im_start|>" not in plain_text and plain_ids == tok("hello")["input_ids"]


# ----------------------------------------------------------------------------- filters

def test_filter_rules(tok):
    cfg = FilterConfig()
    assert first_match("   \n", [], "stop", cfg) == "empty"
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE: the emoji spans several tokens
    cut = tok.decode(ids[:1])
    assert first_match("Fine so far " + cut, ids[:1], "length", cfg) == "truncated_mid_token"
    assert first_match("Fine so far " + tok.decode(ids), ids, "length", cfg) == ""
    loop_ids = tok.encode("Some answer. " + ("The answer is 5. " * 12).rstrip(), add_special_tokens=False)
    assert first_match(tok.decode(loop_ids), loop_ids, "length", cfg) == "repetition_loop"
    ok_ids = tok.encode("Step 1: add 3 and 4 to get 7. Step 2: multiply 7 by 2 to get 14. "
                        "The answer is 14.", add_special_tokens=False)
    assert first_match(tok.decode(ok_ids), ok_ids, "stop", cfg) == ""
    assert first_match("x", [5, 6], "length", FilterConfig(rules=["length"])) == "length"
    assert first_match("x", [5, 6], "length", FilterConfig(rules=[])) == ""


def test_tail_loop_thresholds():
    assert tail_loop([1, 2, 3] + [7, 8] * 10, 64) == (2, 20)
    assert tail_loop([1, 2, 3, 4], 64) == (0, 0)
    cfg = FilterConfig(min_repeats=3, min_tokens=24)
    two_copies = list(range(20)) * 2  # period 20, only 2 copies
    assert first_match("t", two_copies, "length", cfg) == ""
    assert first_match("t", list(range(20)) * 3, "length", cfg) == "repetition_loop"
    assert first_match("t", [9] * 23, "length", cfg) == ""  # under min_tokens
    assert first_match("t", [9] * 24, "length", cfg) == "repetition_loop"


# ----------------------------------------------------------------------------- dedup + leakage

def test_leakage_index_catches_eval_questions_and_variants():
    idx = EvalIndex.from_files([str(SPEC_BENCH)])
    math_q = spec_bench_turns("math_reasoning")[0]
    qa_q = spec_bench_turns("qa")[0]
    de_src = spec_bench_turns("translation")[0]
    article = spec_bench_turns("summarization")[0]
    assert idx.leaks(math_q)
    assert idx.leaks("  " + math_q.upper().replace(".", " . ") + "  ")
    assert idx.leaks(qa_q.rstrip("?").lower())
    german = de_src.split(":", 1)[1]
    assert idx.leaks(f"Please translate into English:{german}")  # prefix-stripped variant
    middle = " ".join(article.split()[40:60])
    assert idx.leaks(f"Summarise this passage for me. {middle} Thanks!")  # shares a 13-word run
    clean = next(S.iter_source(S.GSM8KSource())).text
    assert not idx.leaks(clean)
    assert not idx.leaks("Who played the lead in a film?")


def test_select_prompts_dedups_and_drops_leaks(tmp_path):
    idx = EvalIndex.from_files([str(SPEC_BENCH)])
    leak = spec_bench_turns("math_reasoning")[1]
    f = write_jsonl(tmp_path / "p.jsonl", [{"q": "How many legs do 3 cats have?"}, {"q": leak},
                                           {"q": "how many legs do 3 cats have"}, {"q": "Name a prime."}])
    sel = select_prompts([S.JsonlSource(path=str(f), field="q")], None, eval_index=idx,
                         check=lambda p: "too_long" if len(p.text) > 20 else None)
    assert [p.text for p in sel.prompts] == ["Name a prime."]
    assert sel.stats["dropped"] == {"too_long": 1, "leakage": 1, "duplicate": 1}


# ----------------------------------------------------------------------------- generation

def test_generate_batch_greedy_equals_plain_generate_and_rows_stop_at_eos(tiny):
    from helpers import plain_greedy
    model, _ = tiny
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    refs = [plain_greedy(model, p, 12) for p in prompts]
    outs = generate_batch(model, prompts, sampling=SamplingConfig(0.0), max_new_tokens=12, eos_ids=set(), pad_id=0)
    assert [o.ids for o in outs] == refs and all(o.finish_reason == "length" for o in outs)
    # a batch may mix temperatures: greedy rows are unaffected by sampled neighbours, and a
    # near-zero temperature samples the argmax
    mixed = [SamplingConfig(0.0), SamplingConfig(1.0), SamplingConfig(1e-6)]
    outs = generate_batch(model, prompts, sampling=mixed, max_new_tokens=12, eos_ids=set(), pad_id=0,
                          generator=torch.Generator().manual_seed(0))
    assert outs[0].ids == refs[0] and outs[2].ids == refs[2] and len(outs[1].ids) == 12
    # make one row's 3rd greedy token the EOS: it stops there, the others are unaffected
    eos = refs[1][2]
    outs = generate_batch(model, prompts, sampling=SamplingConfig(0.0), max_new_tokens=12, eos_ids={eos}, pad_id=0)
    for o, ref in zip(outs, refs):
        cut = ref.index(eos) + 1 if eos in ref else None
        assert o.ids == ref[:cut] and o.finish_reason == ("stop" if cut else "length")


def test_distill_end_to_end_on_a_tiny_target(tmp_path, tiny, tiny_target_dir):
    model, tok = tiny
    leak = spec_bench_turns("qa")[0]
    rows = [{"q": f"Question number {i}?"} for i in range(5)] + [{"q": leak}, {"q": "question NUMBER 1"}]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    r = tiny_recipe(tmp_path, tiny_target_dir, f)
    m = distill(r, model=model, tokenizer=tok, progress=False)
    assert m["status"] == "complete" and m["planned_rows"] == 10 and m["shards"] == 4
    assert m["prompts"]["dropped"] == {"leakage": 1, "duplicate": 1}
    assert m["counts"]["rows"] == 10 and m["throughput"]["generated_tokens"] == m["counts"]["response_tokens"]
    saved = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert saved["fingerprint"] == m["fingerprint"] and saved["recipe"]["task"] == "math"
    ds = load_distilled(tmp_path / "out")
    assert set(COLUMNS) <= set(ds.column_names)
    assert len(ds) == m["counts"]["kept"] and all(row["filtered"] == "" for row in ds)
    rows = load_distilled(tmp_path / "out", include_filtered=True).to_list()
    assert sorted((r["prompt"], r["temperature"]) for r in rows) == sorted(
        (f"Question number {i}?", t) for i in range(5) for t in (0.0, 0.7))
    from helpers import plain_greedy
    for row in rows:
        assert row["task"] == "math" and row["source"] == "p"
        assert row["prompt_tokens"] == len(row["prompt_ids"]) and row["response_tokens"] == len(row["response_ids"])
        assert row["response_tokens"] == 6 and row["finish_reason"] == "length"
        assert tok.decode(row["prompt_ids"]) == row["prompt_text"]
        if row["temperature"] == 0.0:
            assert row["response_ids"] == plain_greedy(model, row["prompt_ids"], 6)
    # a second call finds everything done and generates nothing
    again = distill(r, model=model, tokenizer=tok, progress=False)
    assert again["time"]["this_session_generated_tokens"] == 0 and again["counts"] == m["counts"]
    # a different recipe into the same directory is refused unless overwriting
    r2 = tiny_recipe(tmp_path, tiny_target_dir, f, "generation.max_new_tokens=4")
    with pytest.raises(UserError, match="different recipe.*changed: generation"):
        distill(r2, model=model, tokenizer=tok, progress=False)
    assert distill(r2, model=model, tokenizer=tok, progress=False, overwrite=True)["counts"]["response_tokens"] == 40


class Crash(Exception):
    pass


class CrashAfter(torch.nn.Module):
    """The target, but its forward raises after ``n`` calls: an interruption in the middle of a shard."""

    def __init__(self, model, n):
        super().__init__()
        self.model, self.n = model, n
        self.config, self.generation_config = model.config, model.generation_config

    def forward(self, **kw):
        self.n -= 1
        if self.n < 0:
            raise Crash
        return self.model(**kw)


def test_resume_after_interruption_matches_an_uninterrupted_run(tmp_path, tiny, tiny_target_dir):
    model, tok = tiny
    f = write_jsonl(tmp_path / "p.jsonl", [{"q": f"Prompt {i} " + "word " * i} for i in range(8)])
    ref = distill(tiny_recipe(tmp_path / "ref", tiny_target_dir, f), model=model, tokenizer=tok, progress=False)
    r = tiny_recipe(tmp_path / "run", tiny_target_dir, f)
    with pytest.raises(Crash):  # 6 forwards per batch of 3 rows, shard = 1 batch: dies inside shard 2
        distill(r, model=CrashAfter(model, 14), tokenizer=tok, progress=False)
    shards = sorted((r.out_dir / "shards").glob("shard-*.parquet"))
    assert [p.name for p in shards] == ["shard-00000.parquet", "shard-00001.parquet"]
    assert json.loads((r.out_dir / "manifest.json").read_text())["status"] == "running"
    with pytest.raises(UserError, match="unfinished .*2/6 shards"):
        load_distilled(r.out_dir)
    assert len(load_distilled(r.out_dir, allow_partial=True, include_filtered=True)) == 6
    (r.out_dir / "shards" / ".shard-00002.parquet.k1ll3d.tmp").write_bytes(b"half a file")  # killed mid-write
    before = {p.name: p.stat().st_mtime_ns for p in shards}
    m = distill(r, model=model, tokenizer=tok, progress=False)
    assert m["status"] == "complete" and m["time"]["this_session_generated_tokens"] == 10 * 6
    assert {p.name: p.stat().st_mtime_ns for p in shards} == before  # finished shards were not redone
    assert not list((r.out_dir / "shards").glob(".*tmp*"))
    got, want = load_rows(r.out_dir), load_rows(ref["recipe"]["out"])
    assert len(got) == 16 == len({row["id"] for row in got})
    assert got == want  # sampled rows too: seeds are per batch, not per session


def test_a_time_budget_stops_between_shards_and_the_same_command_continues(tmp_path, tiny, tiny_target_dir):
    """max_minutes: the session ends after the shard in progress, the manifest says stopped, the finished shards
    read with allow_partial, and a rerun (any budget: it is not part of the run's identity) completes the plan."""
    model, tok = tiny
    f = write_jsonl(tmp_path / "p.jsonl", [{"q": f"Budget prompt {i} " + "word " * i} for i in range(6)])
    ref = distill(tiny_recipe(tmp_path / "ref", tiny_target_dir, f), model=model, tokenizer=tok, progress=False)
    m = distill(tiny_recipe(tmp_path / "run", tiny_target_dir, f, "max_minutes=1e-9"), model=model, tokenizer=tok,
                progress=False)
    assert m["status"] == "stopped" and m["completed_shards"] == 1 and m["shards"] == 4
    assert m["counts"]["rows"] == 3
    with pytest.raises(UserError, match="unfinished"):
        load_distilled(m["recipe"]["out"])
    assert len(load_distilled(m["recipe"]["out"], allow_partial=True, include_filtered=True)) == 3
    m = distill(tiny_recipe(tmp_path / "run", tiny_target_dir, f, "max_minutes=60"), model=model, tokenizer=tok,
                progress=False)
    assert m["status"] == "complete" and m["counts"]["rows"] == 12
    assert load_rows(m["recipe"]["out"]) == load_rows(ref["recipe"]["out"])
    with pytest.raises(UserError, match="max_minutes must be > 0"):
        tiny_recipe(tmp_path / "bad", tiny_target_dir, f, "max_minutes=0")


def test_resume_after_sigkill(tmp_path, tiny, tiny_target_dir):
    """A real kill -9 of the CLI in the middle of a run; the rerun completes without duplicates or losses."""
    model, tok = tiny
    f = write_jsonl(tmp_path / "p.jsonl", [{"q": f"Kill test prompt {i}"} for i in range(20)])
    args = [f"target={tiny_target_dir}", f"sources=[{{type: jsonl, path: '{f}', field: q}}]", "num_prompts=null",
            "generation.temperatures=[0.0, 1.0]", "generation.max_new_tokens=24", "generation.batch_size=2",
            "shard_size=2"]
    out = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "distill", "--task", "math", "--no-progress",
                             *args, f"out={out}"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = out / "shards" / "shard-00000.parquet"
    deadline = time.time() + 60
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "running" and manifest["shards"] == 20
    n_before = len(list((out / "shards").glob("shard-*.parquet")))
    assert 1 <= n_before < 20
    r = load_distill_recipe(task="math", overrides=[*args, f"out={out}"])
    m = distill(r, model=model, tokenizer=tok, progress=False)
    assert m["status"] == "complete" and m["counts"]["rows"] == 40
    rows = load_rows(out)
    assert len(rows) == 40 == len({row["id"] for row in rows})
    assert sorted((row["prompt"], row["temperature"]) for row in rows) == sorted(
        (f"Kill test prompt {i}", t) for i in range(20) for t in (0.0, 1.0))


@pytest.mark.slow
def test_real_target_greedy_rows_equal_plain_generate(tmp_path, smol):
    model, tok = smol
    r = load_distill_recipe(task="math", overrides=[
        "num_prompts=2", "generation.temperatures=[0.0]", "generation.max_new_tokens=32",
        "generation.batch_size=2", f"out={tmp_path / 'real'}"])
    distill(r, model=model, tokenizer=tok, progress=False)
    rows = load_distilled(r.out_dir, include_filtered=True).to_list()
    assert len(rows) == 2 and rows[0]["prompt_tokens"] != rows[1]["prompt_tokens"]  # left padding exercised
    for row in rows:
        ids = torch.tensor([row["prompt_ids"]])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                             pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        assert row["response_ids"] == ref
        assert row["response"] == tok.decode(ref[:-1] if row["finish_reason"] == "stop" else ref)


# ----------------------------------------------------------------------------- device and dtype

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")


def test_device_and_dtype_fields_default_auto_and_fail_at_load_naming_the_field(capsys):
    r = load_distill_recipe(task="math")
    assert (r.device, r.dtype) == ("auto", "auto")
    r = load_distill_recipe(task="math", overrides=["device=cuda:1", "dtype=bfloat16"])  # spelling only at load
    assert (r.device, r.dtype) == ("cuda:1", "bfloat16")
    with pytest.raises(UserError, match=r"device must be auto\|cpu\|cuda\[:N\], got 'gpu'"):
        load_distill_recipe(task="math", overrides=["device=gpu"])
    with pytest.raises(UserError, match="'dtype' must be one of 'auto', 'float32', 'bfloat16', 'float16', got 'bf16'"):
        load_distill_recipe(task="math", overrides=["dtype=bf16"])
    with pytest.raises(UserError, match=r"'generation.dtype' is now 'dtype \(top level\)'"):
        load_distill_recipe(task="math", overrides=["generation.dtype=float32"])
    assert toolkit_main(["distill", "--task", "math", "device=tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "device must be auto|cpu|cuda[:N], got 'tpu'" in err[0]


@NO_CUDA
def test_cuda_without_a_gpu_is_one_line_before_anything_runs(tmp_path, tiny_target_dir):
    f = write_jsonl(tmp_path / "p.jsonl", [{"q": "Question?"}])
    r = tiny_recipe(tmp_path, tiny_target_dir, f, "device=cuda")
    with pytest.raises(UserError, match="device=cuda: no CUDA device is visible.*use device=cpu or device=auto"):
        distill(r, progress=False)
    assert not (tmp_path / "out").exists()


def test_distill_loads_the_target_in_the_recipe_dtype_and_records_it(tmp_path, tiny_target_dir):
    """bfloat16 on the CPU: the target loads in bf16, rows are written, the manifest says so; the same
    command in float32 is a different run (the dtype changes the rows), a change of device is not."""
    from decode.core.models import load_model
    from helpers import plain_greedy

    f = write_jsonl(tmp_path / "p.jsonl", [{"q": f"Question number {i}?"} for i in range(3)])
    r = tiny_recipe(tmp_path, tiny_target_dir, f, "device=cpu", "dtype=bfloat16")
    m = distill(r, progress=False)
    assert m["status"] == "complete" and m["counts"]["rows"] == 6
    assert (m["target"]["device"], m["target"]["dtype"]) == ("cpu", "bfloat16")
    bf16, _ = load_model(tiny_target_dir, device="cpu", dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    for row in load_rows(tmp_path / "out"):
        if row["temperature"] == 0.0:
            assert row["response_ids"] == plain_greedy(bf16, row["prompt_ids"], 6)
    with pytest.raises(UserError, match="changed: dtype"):
        distill(tiny_recipe(tmp_path, tiny_target_dir, f, "dtype=float32"), progress=False)
    auto = tiny_recipe(tmp_path, tiny_target_dir, f, "device=auto", "dtype=bfloat16")  # same dtype: same run
    assert distill(auto, progress=False)["time"]["this_session_generated_tokens"] == 0


@CUDA
def test_distill_on_cuda_writes_the_cpu_greedy_rows_in_float32(tmp_path, tiny_target_dir):
    f = write_jsonl(tmp_path / "p.jsonl", [{"q": f"Question number {i}?"} for i in range(5)])
    rows = {}
    for dev in ("cpu", "cuda"):
        r = load_distill_recipe(task="math", overrides=[
            f"target={tiny_target_dir}", f"sources=[{{type: jsonl, path: '{f}', field: q}}]", "num_prompts=null",
            "generation.temperatures=[0.0, 1.0]", "generation.max_new_tokens=12", "generation.batch_size=2",
            "shard_size=4", f"out={tmp_path / dev}", f"device={dev}", "dtype=float32"])
        m = distill(r, progress=False)
        assert m["target"]["device"].startswith(dev) and m["target"]["dtype"] == "float32"
        rows[dev] = load_rows(tmp_path / dev)
    greedy = {d: [(x["id"], x["response_ids"]) for x in rs if x["temperature"] == 0.0] for d, rs in rows.items()}
    assert greedy["cpu"] == greedy["cuda"] and len(greedy["cpu"]) == 5
    assert all(len(x["response_ids"]) == 12 for x in rows["cuda"])  # sampled rows drew on the device too
    r = tiny_recipe(tmp_path, tiny_target_dir, f, "device=cuda", "dtype=auto", f"out={tmp_path / 'bf16'}")
    assert distill(r, progress=False)["target"]["dtype"] == "bfloat16"  # auto on a GPU
