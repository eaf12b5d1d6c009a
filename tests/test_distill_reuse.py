"""`toolkit distill` takes the rows of a shipped answers folder (`reuse`) instead of generating them, when the
folder's recorded conditions match this run's; only the other rows are generated."""
from __future__ import annotations

import json

import pytest
import torch

import toolkit.distill as D
from decode.common.errors import UserError
from toolkit.answers import RECORD, export_answers
from toolkit.distill import distill, load_distill_recipe, load_distilled

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [f"Reuse question number {i} " + "and more " * i for i in range(4)]


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    from decode.core.models import load_model
    return load_model(tiny_target_dir)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reuse_prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"q": q}) + "\n" for q in PROMPTS))
    return path


def recipe(out, target, prompts_file, n, *extra):
    return load_distill_recipe(task="math", overrides=[
        f"target={target}", f"sources=[{{type: jsonl, path: '{prompts_file}', field: q}}]", f"num_prompts={n}",
        "generation.temperatures=[0.0, 0.7]", "generation.max_new_tokens=6", "generation.batch_size=2",
        "shard_size=2", "leakage.eval_files=[]", "filters.rules=[]", f"out={out}", *extra])


class Counting(torch.nn.Module):
    """The target, counting its forward calls; ``forbid`` makes any call an error."""

    def __init__(self, model, forbid: bool = False):
        super().__init__()
        self.model, self.forbid, self.calls = model, forbid, 0
        self.config, self.generation_config = model.config, model.generation_config

    def forward(self, **kw):
        if self.forbid:
            raise AssertionError("the target was called for a row that should have been reused")
        self.calls += 1
        return self.model(**kw)


class _Bf16(torch.nn.Module):
    """Reports bfloat16 parameters (the dtype distill() reads off a given model); never called here."""

    def __init__(self, model):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
        self.config = model.config


def rows_of(out) -> list[dict]:
    return sorted(load_distilled(out, include_filtered=True).to_list(), key=lambda r: r["id"])


@pytest.fixture(scope="module")
def shipped(tmp_path_factory, tiny, tiny_target_dir, prompts_file):
    """A 2-prompt run (generated: reuse=null) and its answers folder."""
    model, tok = tiny
    root = tmp_path_factory.mktemp("reuse")
    run = recipe(root / "two", tiny_target_dir, prompts_file, 2, "reuse=null")
    m = distill(run, model=model, tokenizer=tok, progress=False)
    assert m["reuse"] == {"folder": None, "rows_reused": 0, "skipped": "reuse=null"}
    export_answers([run.out_dir], root / "answers", eval_files=())
    return root / "answers", run, m


def test_every_shipped_row_is_reused_and_the_target_is_never_called(shipped, tiny, tiny_target_dir, prompts_file,
                                                                   tmp_path):
    folder, first, _ = shipped
    model, tok = tiny
    r = recipe(tmp_path / "again", tiny_target_dir, prompts_file, 2, f"reuse={folder}")
    m = distill(r, model=Counting(model, forbid=True), tokenizer=tok, progress=False)
    assert m["status"] == "complete" and m["counts"]["rows"] == 4
    assert m["reuse"] == {"folder": str(folder), "rows_reused": 4}
    assert m["time"]["this_session_generated_tokens"] == 0 and m["throughput"]["generated_tokens"] == 0
    assert rows_of(r.out_dir) == rows_of(first.out_dir)  # every column, the decoded text and filters included
    import pyarrow.parquet as pq
    metas = [json.loads(pq.read_schema(p).metadata[b"adaspec"]) for p in sorted((r.out_dir / "shards").glob("*"))]
    assert [x["reused_rows"] for x in metas] == [2, 2] and all(x["generated_tokens"] == 0 for x in metas)


def test_a_larger_run_reuses_the_shipped_prompts_and_generates_the_others(shipped, tiny, tiny_target_dir,
                                                                           prompts_file, tmp_path, capsys):
    folder, first, _ = shipped
    model, tok = tiny
    ref = distill(recipe(tmp_path / "ref", tiny_target_dir, prompts_file, 4, "reuse=null"), model=model,
                  tokenizer=tok, progress=False)
    r = recipe(tmp_path / "four", tiny_target_dir, prompts_file, 4, f"reuse={folder}")
    counting = Counting(model)
    m = distill(r, model=counting, tokenizer=tok, progress=True)
    bar = capsys.readouterr().err
    assert "8/8" in bar and "9/8" not in bar  # the progress bar counts reused and generated rows once each
    assert m["counts"]["rows"] == 8 and m["reuse"]["rows_reused"] == 4 and counting.calls > 0
    got, old = rows_of(r.out_dir), {row["id"]: row for row in rows_of(first.out_dir)}
    new = [row for row in got if row["id"] not in old]
    assert sorted({row["prompt"] for row in new}) == PROMPTS[2:] and len(new) == 4
    for row in got:
        if row["id"] in old:
            assert row == old[row["id"]]
    assert m["time"]["this_session_generated_tokens"] == sum(row["response_tokens"] for row in new)
    # greedy rows are the target's whichever way they came; the fingerprint is the reuse=null run's
    want = {row["id"]: row["response_ids"] for row in rows_of(ref["recipe"]["out"]) if row["temperature"] == 0.0}
    assert {row["id"]: row["response_ids"] for row in got if row["temperature"] == 0.0} == want
    assert m["fingerprint"] == ref["fingerprint"]


def test_an_explicit_folder_that_cannot_be_used_is_one_clear_error(shipped, tiny, tiny_target_dir, prompts_file,
                                                                   tmp_path):
    folder, _, _ = shipped
    model, tok = tiny
    longer = recipe(tmp_path / "x", tiny_target_dir, prompts_file, 2, f"reuse={folder}", "generation.max_new_tokens=8")
    with pytest.raises(UserError, match=r"generation\.max_new_tokens \(6 there, 8 here\).*reuse=null"):
        distill(longer, model=model, tokenizer=tok, progress=False)
    with pytest.raises(UserError, match=r"dtype \('float32' there, 'bfloat16' here\)"):
        distill(recipe(tmp_path / "x", tiny_target_dir, prompts_file, 2, f"reuse={folder}"),
                model=_Bf16(model), tokenizer=tok, progress=False)
    with pytest.raises(UserError, match=f"reuse={tmp_path / 'nowhere'}: .*not an answers folder.*reuse=null"):
        distill(recipe(tmp_path / "x", tiny_target_dir, prompts_file, 2, f"reuse={tmp_path / 'nowhere'}"),
                model=model, tokenizer=tok, progress=False)
    code = load_distill_recipe(task="code", overrides=[
        f"target={tiny_target_dir}", f"sources=[{{type: jsonl, path: '{prompts_file}', field: q}}]",
        "num_prompts=1", "generation.max_new_tokens=6", "leakage.eval_files=[]", f"out={tmp_path / 'x'}",
        f"reuse={folder}"])
    with pytest.raises(UserError, match="no code answers there .it has math"):
        distill(code, model=model, tokenizer=tok, progress=False)
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_auto_reuses_when_conditions_match_and_else_says_why_and_generates(shipped, tiny, tiny_target_dir,
                                                                          prompts_file, tmp_path, monkeypatch,
                                                                          capsys):
    folder, _, _ = shipped
    model, tok = tiny
    monkeypatch.setattr(D, "auto_answers_folder", lambda target: folder)
    m = distill(recipe(tmp_path / "match", tiny_target_dir, prompts_file, 2), model=Counting(model, forbid=True),
                tokenizer=tok, progress=False)
    assert m["reuse"]["rows_reused"] == 4 and capsys.readouterr().err == ""
    m = distill(recipe(tmp_path / "other", tiny_target_dir, prompts_file, 2, "generation.max_new_tokens=8"),
                model=model, tokenizer=tok, progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("distill math: not reusing ")
    assert "generation.max_new_tokens (6 there, 8 here)" in err[0]
    assert m["reuse"]["rows_reused"] == 0 and "max_new_tokens" in m["reuse"]["skipped"]
    assert m["time"]["this_session_generated_tokens"] == m["counts"]["response_tokens"] > 0
    monkeypatch.setattr(D, "auto_answers_folder", lambda target: tmp_path / "absent")
    m = distill(recipe(tmp_path / "none", tiny_target_dir, prompts_file, 2), model=model, tokenizer=tok,
                progress=False)
    assert capsys.readouterr().err == "" and m["reuse"]["rows_reused"] == 0
    assert m["time"]["this_session_generated_tokens"] == m["counts"]["response_tokens"] > 0
    # reuse=auto with a target that is no alias: nothing shipped is its
    monkeypatch.undo()
    assert D.auto_answers_folder(str(tiny_target_dir)) is None
    assert D.auto_answers_folder("smollm2-135m-instruct") == D.REPO_ROOT / "pretrained/smollm2-135m-instruct/answers"


def test_the_shipped_math_answers_match_the_default_recipe_in_float32_only():
    """The real artifact: the math recipe at the medium budget's answer length finds its rows; bfloat16 is told why
    not. No target is loaded."""
    r = load_distill_recipe(task="math", overrides=["num_prompts=4"])
    src = D._reuse_source(r, torch.float32)
    assert src.notice is None and len(src.rows) > 100 and src.folder.name == "answers"
    src = D._reuse_source(r, torch.bfloat16)
    assert not src.rows and "dtype ('float32' there, 'bfloat16' here)" in src.notice
    assert D._reuse_source(load_distill_recipe(task="math", overrides=["reuse=null"]), torch.float32).skipped


def test_reused_runs_read_normally_and_reuse_is_not_part_of_the_fingerprint(shipped, tiny, tiny_target_dir,
                                                                            prompts_file, tmp_path):
    folder, first, m1 = shipped
    model, tok = tiny
    r = recipe(tmp_path / "again", tiny_target_dir, prompts_file, 2, f"reuse={folder}")
    m = distill(r, model=Counting(model, forbid=True), tokenizer=tok, progress=False)
    assert m["fingerprint"] == m1["fingerprint"]
    assert len(load_distilled(r.out_dir)) == m["counts"]["kept"] == 4
    # an existing run (written with reuse=null) is finished whatever reuse says now, or if its manifest predates it
    for reuse in ("auto", "null", str(folder)):
        again = recipe(first.out_dir, tiny_target_dir, prompts_file, 2, f"reuse={reuse}")
        assert distill(again, model=Counting(model, forbid=True), tokenizer=tok,
                       progress=False)["time"]["this_session_generated_tokens"] == 0
    manifest = json.loads((first.out_dir / "manifest.json").read_text())
    del manifest["recipe"]["reuse"]
    (first.out_dir / "manifest.json").write_text(json.dumps(manifest))
    assert distill(first, model=Counting(model, forbid=True), tokenizer=tok, progress=False)["status"] == "complete"


def test_the_fingerprint_is_what_it_was_before_reuse_existed():
    """Pinned: the value the code before `reuse` gave for this recipe, so finished runs stay finished."""
    from toolkit.data.sources import JsonlSource
    units = [D.Unit("0123456789abcdef0123", 0, 0.0), D.Unit("fedcba98765432100123", 0, 0.7)]
    for reuse in ("auto", None, "pretrained/smollm2-135m-instruct/answers"):
        r = D.DistillRecipe(task="math", target="smollm2-135m-instruct", num_prompts=4, out="runs/x", device="cpu",
                            dtype="float32", sources=[JsonlSource(path="prompts.jsonl", field="q")], reuse=reuse)
        assert D._fingerprint(r, units, [[1, 2, 3]], torch.float32) == "02b9946994b8b93c"


def test_the_cli_takes_reuse_overrides_and_reports_reused_rows(shipped, tiny_target_dir, prompts_file, tmp_path):
    from helpers import run_main
    from toolkit.cli import main
    folder, _, _ = shipped
    for value, shown in (("null", "reuse: null"), ("auto", "reuse: auto"), (str(folder), f"reuse: {folder}")):
        res = run_main(main, ["distill", "--task", "math", "--print-recipe", f"reuse={value}"])
        assert res.returncode == 0 and shown in res.stdout
    assert "reuse: auto" in run_main(main, ["distill", "--task", "math", "--print-recipe"]).stdout
    res = run_main(main, ["distill", "--task", "math", "--no-progress", f"reuse={folder}", f"target={tiny_target_dir}",
                          f"sources=[{{type: jsonl, path: '{prompts_file}', field: q}}]", "num_prompts=2",
                          "generation.temperatures=[0.0, 0.7]", "generation.max_new_tokens=6",
                          "generation.batch_size=2", "shard_size=2", "leakage.eval_files=[]", "filters.rules=[]",
                          f"out={tmp_path / 'cli'}"])
    assert res.returncode == 0, res.stderr
    assert f"4 reused from {folder}, 0 generated" in res.stderr
    assert json.loads((folder / RECORD).read_text())["tasks"]["math"]["rows"] == 4


def test_a_shipped_row_rendered_to_other_prompt_ids_is_generated(shipped, tiny, tiny_target_dir, prompts_file,
                                                                 tmp_path):
    import gzip
    import shutil
    folder, first, _ = shipped
    model, tok = tiny
    changed = tmp_path / "answers"
    shutil.copytree(folder, changed)
    rows = [json.loads(line) for line in gzip.open(changed / "math.jsonl.gz", "rt")]
    rows[0]["prompt_ids"] = rows[0]["prompt_ids"][1:]  # as if another tokenizer or template had rendered it
    with gzip.open(changed / "math.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    r = recipe(tmp_path / "out", tiny_target_dir, prompts_file, 2, f"reuse={changed}")
    m = distill(r, model=model, tokenizer=tok, progress=False)
    assert m["reuse"]["rows_reused"] == 3
    got = {row["id"]: row for row in rows_of(r.out_dir)}
    assert m["time"]["this_session_generated_tokens"] == got[rows[0]["id"]]["response_tokens"] > 0
    original = {row["id"]: row for row in rows_of(first.out_dir)}
    assert got[rows[0]["id"]]["prompt_ids"] == original[rows[0]["id"]]["prompt_ids"] != rows[0]["prompt_ids"]
    assert all(got[k] == original[k] for k in got if k != rows[0]["id"])


def test_shards_with_the_most_rows_to_generate_run_first(tiny, tiny_target_dir, tmp_path, monkeypatch):
    """A stopped greedy run re-answers the rows the filters dropped (they were not shipped) the same way again:
    wholly shipped shards run first (they cost nothing), then the shards with the most rows to generate, so a
    time-limited run spends its minutes on prompts never answered. The rows do not depend on the order."""
    import gzip

    from toolkit.answers import _gzip_rows

    model, tok = tiny
    longest_first = tmp_path / "p.jsonl"
    longest_first.write_text("".join(json.dumps({"q": q}) + "\n" for q in reversed(PROMPTS)))
    two = distill(recipe(tmp_path / "two", tiny_target_dir, longest_first, 2, "reuse=null"), model=model,
                  tokenizer=tok, progress=False)
    folder = tmp_path / "answers"
    export_answers([two["recipe"]["out"]], folder, eval_files=())
    # the plan runs the longest prompts first: shards 0 and 1 are PROMPTS[3] and PROMPTS[2] at both temperatures,
    # all shipped; one of shard 1's rows goes missing, as a row the filters dropped would
    path = folder / "math.jsonl.gz"
    with gzip.open(path, "rt") as fh:
        rows = [json.loads(line) for line in fh]
    kept = [r for r in rows if not (r["prompt"] == PROMPTS[2] and r["temperature"] == 0.7)]
    assert len(kept) == len(rows) - 1 == 3
    path.write_bytes(_gzip_rows(kept))
    order = []
    write = D._write_shard
    monkeypatch.setattr(D, "_write_shard", lambda p, rows, meta: (order.append(meta["shard"]), write(p, rows, meta)))
    r = recipe(tmp_path / "four", tiny_target_dir, longest_first, 4, f"reuse={folder}")
    m = distill(r, model=model, tokenizer=tok, progress=False)
    assert order == [0, 2, 3, 1] and m["status"] == "complete" and m["reuse"]["rows_reused"] == 3
    ref = distill(recipe(tmp_path / "ref", tiny_target_dir, longest_first, 4, "reuse=null"), model=model,
                  tokenizer=tok, progress=False)
    assert m["fingerprint"] == ref["fingerprint"]
    greedy = [(row["id"], row["response_ids"]) for row in rows_of(r.out_dir) if row["temperature"] == 0.0]
    assert greedy == [(row["id"], row["response_ids"]) for row in rows_of(ref["recipe"]["out"])
                      if row["temperature"] == 0.0]
