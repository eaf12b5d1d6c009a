"""`toolkit answers`: finished distillations → the compressed, deduplicated, leakage-checked answers folder."""
import gzip
import json

import pytest

from decode.common.errors import UserError
from toolkit.answers import RECORD, export_answers, load_answers


def _distill(root, target, n, *extra, task="math", max_new=12):
    from toolkit.distill import distill, load_distill_recipe
    out = root / f"{task}-{n}-{max_new}"
    r = load_distill_recipe(task=task, overrides=[
        f"target={target}", f"num_prompts={n}", f"generation.max_new_tokens={max_new}",
        "generation.temperatures=[0.0]", "generation.batch_size=2", f"out={out}", "shard_size=2",
        "leakage.eval_files=[]", "filters.rules=[]", *extra])
    distill(r, progress=False)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target_dir, one_thread):
    root = tmp_path_factory.mktemp("answers")
    return root, _distill(root, tiny_target_dir, 2), _distill(root, tiny_target_dir, 4)


def test_export_writes_rows_that_equal_the_distilled_ones_and_a_run_record(runs, tmp_path):
    from toolkit.distill import load_distilled
    root, two, _ = runs
    rec = export_answers([two], tmp_path / "a", eval_files=[], command="python -m toolkit answers ...")
    rows = load_answers(tmp_path / "a", "math")
    want = sorted(load_distilled(two), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == [r["id"] for r in want]
    for got, row in zip(rows, want):
        assert got["prompt_ids"] == row["prompt_ids"] and got["response_ids"] == row["response_ids"]
        assert got["temperature"] == row["temperature"] and got["prompt"] == row["prompt"]
    task = json.loads((tmp_path / "a" / RECORD).read_text())["tasks"]["math"]
    assert task["rows"] == 2 and task["answer_tokens"] == sum(len(r["response_ids"]) for r in rows)
    assert task["conditions"]["generation"]["max_new_tokens"] == 12 and task["runs"][0]["rows_added"] == 2
    assert rec["commands"] == ["python -m toolkit answers ..."]


def test_a_second_export_extends_by_id_and_the_bytes_are_reproducible(runs, tmp_path):
    _, two, four = runs
    export_answers([two], tmp_path / "a", eval_files=[])
    export_answers([four], tmp_path / "a", eval_files=[])  # the first two prompts again, plus two new ones
    rows = load_answers(tmp_path / "a", "math")
    assert len(rows) == 4 and len({r["id"] for r in rows}) == 4
    assert json.loads((tmp_path / "a" / RECORD).read_text())["tasks"]["math"]["runs"][1]["rows_added"] == 2
    export_answers([four], tmp_path / "b", eval_files=[])
    assert (tmp_path / "a" / "math.jsonl.gz").read_bytes() == (tmp_path / "b" / "math.jsonl.gz").read_bytes()


def test_rows_whose_prompt_leaks_into_the_eval_questions_are_dropped(runs, tmp_path):
    _, two, _ = runs
    export_answers([two], tmp_path / "x", eval_files=[])
    prompt = load_answers(tmp_path / "x", "math")[0]["prompt"]
    questions = tmp_path / "eval.jsonl"
    questions.write_text(json.dumps({"question": prompt}) + "\n")
    rec = export_answers([two], tmp_path / "a", eval_files=[str(questions)])
    assert rec["_summary"]["math"] == {"added": 1, "leaked": 1}
    assert prompt not in {r["prompt"] for r in load_answers(tmp_path / "a", "math")}


def test_other_conditions_are_refused_naming_the_field(runs, tiny_target_dir, tmp_path):
    root, two, _ = runs
    export_answers([two], tmp_path / "a", eval_files=[])
    longer = _distill(root, tiny_target_dir, 2, max_new=20)
    with pytest.raises(UserError, match="generation.max_new_tokens"):
        export_answers([longer], tmp_path / "a", eval_files=[])
    assert len(load_answers(tmp_path / "a", "math")) == 2  # nothing written


def test_a_prompt_limit_is_not_a_condition_and_an_older_record_with_one_still_matches(runs, tiny_target_dir,
                                                                                       tmp_path):
    """The prompt limit only skips prompts: runs under two limits merge, and their shared prompts' answers agree."""
    root, two, _ = runs
    export_answers([two], tmp_path / "a", eval_files=[])
    rec = json.loads((tmp_path / "a" / RECORD).read_text())
    assert "max_prompt_tokens" not in rec["tasks"]["math"]["conditions"]["generation"]
    rec["tasks"]["math"]["conditions"]["generation"]["max_prompt_tokens"] = 1024  # as records before it wrote
    (tmp_path / "a" / RECORD).write_text(json.dumps(rec))
    limited = _distill(root, tiny_target_dir, 3, "generation.max_prompt_tokens=200")  # the same first prompts
    export_answers([limited], tmp_path / "a", eval_files=[])
    rows = {r["id"]: r for r in load_answers(tmp_path / "a", "math")}
    assert len(rows) == 3
    from toolkit.distill import load_distilled
    for r in load_distilled(limited):
        assert rows[r["id"]]["response_ids"] == r["response_ids"]


def test_a_stopped_distillation_ships_its_finished_shards_only_when_asked(runs, tiny_target_dir, tmp_path):
    import shutil
    root, _, four = runs
    stopped = tmp_path / "stopped"
    shutil.copytree(four, stopped)
    mf = stopped / "manifest.json"
    m = json.loads(mf.read_text())
    m.update(status="running", completed_shards=1)
    mf.write_text(json.dumps(m))
    (stopped / "shards" / "shard-00001.parquet").unlink()  # stopped while writing its second shard
    with pytest.raises(UserError, match=r"unfinished \(1/2 shards\).*--partial"):
        export_answers([stopped], tmp_path / "a", eval_files=[])
    assert not (tmp_path / "a" / RECORD).exists()
    export_answers([stopped], tmp_path / "a", eval_files=[], partial=True)
    rows = load_answers(tmp_path / "a", "math")
    assert len(rows) == 2
    run = json.loads((tmp_path / "a" / RECORD).read_text())["tasks"]["math"]["runs"][0]
    assert run["partial"] == "1/2 shards" and run["rows_added"] == 2
    export_answers([four], tmp_path / "a", eval_files=[])  # the finished rerun extends it
    assert len(load_answers(tmp_path / "a", "math")) == 4


def test_unfinished_or_missing_folders_and_a_damaged_file_are_clear_errors(runs, tmp_path):
    _, two, _ = runs
    with pytest.raises(UserError, match="manifest.json missing"):
        export_answers([tmp_path / "nowhere"], tmp_path / "a", eval_files=[])
    with pytest.raises(UserError, match="not an answers folder"):
        load_answers(tmp_path)
    export_answers([two], tmp_path / "a", eval_files=[])
    (tmp_path / "a" / "math.jsonl.gz").write_bytes(gzip.compress(b'{"id": "x"}\n')[:10])
    with pytest.raises(UserError, match="unreadable answers file"):
        load_answers(tmp_path / "a")
    with pytest.raises(UserError, match="over --max-mb"):
        export_answers([two], tmp_path / "b", eval_files=[], max_mb=1e-6)


def test_the_shipped_answers_are_whole_and_their_ids_are_the_distillers():
    """pretrained/<target>/answers: every task file reads back, its row count and tokens match the run record,
    ids are unique and are the distiller's unit ids of (task, source, prompt, temperature)."""
    from pathlib import Path

    from toolkit.answers import read_record
    from toolkit.distill import _uid
    folder = Path(__file__).resolve().parent.parent / "pretrained" / "smollm2-135m-instruct" / "answers"
    record = read_record(folder)
    assert set(record["tasks"]) == {"math", "code", "chat", "summarization", "translation", "qa"}
    for task, entry in record["tasks"].items():
        rows = load_answers(folder, task)
        assert len(rows) == entry["rows"] and sum(len(r["response_ids"]) for r in rows) == entry["answer_tokens"]
        assert len({r["id"] for r in rows}) == len(rows) and all(r["task"] == task for r in rows)
        assert all(r["id"] == _uid(task, r["source"], r["prompt"], r["temperature"]) for r in rows)
        assert entry["conditions"]["target"] == "smollm2-135m-instruct"
