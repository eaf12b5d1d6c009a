"""`python -m toolkit pool`: the stages run in order, a rerun skips the finished ones, bad input fails fast."""
import json
from pathlib import Path

import pytest

from decode.engine.pools import load_pool, map_paths
from toolkit.cli import main
from toolkit.pool import _with, BUDGETS, STATE, plan

SUITE = str(Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question_dev.jsonl")


def test_tiny_pool_end_to_end_then_every_stage_is_skipped(tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "pool"
    argv = ["pool", "--target", tiny_target_dir, "--budget", "tiny", "--out", str(out), "--suite", SUITE]
    names = [n for n, _ in plan(tiny_target_dir, "tiny", out, SUITE)]
    assert names == ["distill:math", "train:eagle", "pool-file", "eval"]
    # --stop-after (what `make pretrained` uses): the stages up to it run, the rest wait for a rerun
    assert main(argv + ["--stop-after", "train:eagle"]) == 0
    err = capsys.readouterr().err
    assert all(f"[pool] {n}: run" in err for n in names[:2]) and "stopped after train:eagle" in err
    assert not (out / "pool.yaml").exists()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert all(f"[pool] {n}: skip (finished)" in err for n in names[:2])
    assert all(f"[pool] {n}: run" in err for n in names[2:])
    assert (out / "heads" / "eagle" / "head.json").exists()
    pool = load_pool(out / "pool.yaml")  # the shipped pool's arms and length, each EAGLE arm on the head trained here
    head = str(out / "heads" / "eagle")
    assert pool.length == "cost" and [s.replace(head, "H") for s in pool.arms] == [
        "eagle:path=H,L=6,tree=dynamic,topk=4,expand=1,nodes=11", "pld:L=4", "suffix:L=3",
        "union:arms=eagle:path=H:L=5:tree=dynamic:topk=4:expand=1:nodes=9+pld:L=4,nodes=11"]
    report = json.loads((out / "eval" / "report.json").read_text())
    assert any(m.startswith("arm:eagle") for m in report["summary"]) and report["summary"]["hf"]
    assert set(json.loads((out / STATE).read_text())["stages"]) == set(names)
    assert main(argv + ["--stop-after", "train:eagle"]) == 0  # stops at a finished stage too
    assert "pool-file: skip" not in capsys.readouterr().err
    assert main(argv) == 0  # a rerun: nothing runs again
    err = capsys.readouterr().err
    assert all(f"[pool] {n}: skip (finished)" in err for n in names)
    # a stage whose command changed (another budget, another target) runs again; the others stay skipped
    state = json.loads((out / STATE).read_text())
    state["stages"]["eval"]["command"] = ["an", "older", "command"]
    (out / STATE).write_text(json.dumps(state))
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "[pool] eval: run" in err and "[pool] train:eagle: skip (finished)" in err
    # a remade pool file makes the eval run again, afresh (its records were of the old pool), though its command
    # is the same
    state = json.loads((out / STATE).read_text())
    state["stages"]["pool-file"]["command"] = ["pool-file", "pld:L=2"]
    (out / STATE).write_text(json.dumps(state))
    before = (out / "eval" / "records.jsonl").stat().st_mtime_ns
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "[pool] pool-file: run" in err and "[pool] eval: run again (an earlier stage ran)" in err
    assert (out / "eval" / "records.jsonl").stat().st_mtime_ns > before  # resumed, it would have decoded nothing


def test_bad_input_fails_fast_and_dry_run_only_prints(tmp_path, capsys):
    assert main(["pool", "--budget", "huge", "--out", str(tmp_path / "p")]) == 2
    assert "--budget must be one of" in capsys.readouterr().err
    assert main(["pool", "--suite", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "p")]) == 2
    assert "--suite" in capsys.readouterr().err
    assert main(["pool", "--stop-after", "train:nothing", "--out", str(tmp_path / "p"), "--suite", SUITE]) == 2
    assert "--stop-after must name one of this budget's stages" in capsys.readouterr().err
    assert main(["pool", "--budget", "small", "--dry-run", "--out", str(tmp_path / "p"), "--suite", SUITE]) == 0
    err = capsys.readouterr().err
    assert "train.max_minutes=15" in err and "num_prompts=16" in err and not (tmp_path / "p" / STATE).exists()


@pytest.mark.parametrize("name", list(BUDGETS))
def test_every_budget_plans_distill_train_pool_eval(name, tmp_path):
    stages = [n for n, _ in plan("t", name, tmp_path, SUITE)]
    assert stages[-2:] == ["pool-file", "eval"] and "train:eagle" in stages
    assert sum(s.startswith("distill:") for s in stages) == len(BUDGETS[name].tasks) + len(BUDGETS[name].greedy)


@pytest.mark.parametrize("name", list(BUDGETS))
def test_every_stage_command_sets_each_key_once(name, tmp_path):
    # a budget's overrides replace the shared AT_SCALE values instead of repeating the key with a second value
    for _, argv in plan("t", name, tmp_path, SUITE):
        keys = [a.split("=", 1)[0] for a in argv if "=" in a and not a.startswith("-")]
        assert len(keys) == len(set(keys)), argv
    eagle = dict(plan("t", "medium", tmp_path, SUITE))["train:eagle"]
    assert "open_text.fraction=0.3" in eagle and "open_text.fraction=0.95" not in eagle


@pytest.mark.parametrize("budget", ["gpu", "medium"])
def test_eagle3_budgets_warm_start_only_from_a_shipped_head_of_their_layout(budget, tmp_path, monkeypatch):
    from toolkit import pool
    monkeypatch.setattr(pool, "REPO_ROOT", tmp_path)
    head = tmp_path / "pretrained" / "t" / "eagle" / "head.json"

    def init_from():
        return [a for a in dict(plan("t", budget, tmp_path, SUITE))["train:eagle"]
                if a.startswith(("head.init_from=", "train.lr="))]
    own_lr = {"gpu": ["train.lr=5e-4"], "medium": []}[budget]  # medium: the recipe's lr when it trains from its init
    assert init_from() == own_lr  # nothing shipped
    head.parent.mkdir(parents=True)
    head.write_text(json.dumps({"kind": "eagle", "init": "identity"}))  # an EAGLE-1 head: not EAGLE-3's layout
    assert init_from() == own_lr
    head.write_text(json.dumps({"kind": "eagle", "layer": "eagle3", "feature_layers": [2, 15, 27]}))
    warm_lr = {"gpu": ["train.lr=5e-4"], "medium": ["train.lr=2e-4"]}[budget]  # medium's batch of 4 fine-tunes slower
    assert sorted(init_from()) == sorted([f"head.init_from={head.parent}", *warm_lr])
    assert not any(a.startswith("head.init_from=") for a in dict(plan("t", "small", tmp_path, SUITE))["train:eagle"])


def test_warm_started_budgets_read_open_text_past_what_the_head_trained_on(tmp_path, monkeypatch):
    from toolkit import pool
    monkeypatch.setattr(pool, "REPO_ROOT", tmp_path)
    head = tmp_path / "pretrained" / "t" / "eagle"
    head.mkdir(parents=True)
    (head / "head.json").write_text(json.dumps({"kind": "eagle", "layer": "eagle3"}))

    def skip():
        return [a for a in dict(plan("t", "medium", tmp_path, SUITE))["train:eagle"] if a.startswith("open_text.skip")]
    assert skip() == []  # no run record: nothing known to skip
    record = {"recipe": {"open_text": {"source": "sharegpt", "path": None}}, "train_examples": {"open_text": 2875}}
    (head / "eval.json").write_text(json.dumps(record))
    assert skip() == ["open_text.skip=2875"]  # a record from before open_text_read: the rows trained on
    record["recipe"]["open_text"]["skip"] = 2875
    record["train_examples"]["open_text_read"] = 3380
    (head / "eval.json").write_text(json.dumps(record))
    assert skip() == ["open_text.skip=6255"]  # its own skip + the rows it read
    record["recipe"]["open_text"]["source"] = "jsonl"  # other text: nothing of ShareGPT was read
    (head / "eval.json").write_text(json.dumps(record))
    assert skip() == []


def test_gpu_budget_trains_on_the_shipped_answers_too(tmp_path, monkeypatch):
    from toolkit import pool
    monkeypatch.setattr(pool, "REPO_ROOT", tmp_path)
    record = tmp_path / "pretrained" / "t" / "answers" / "answers.json"

    def answers(budget="gpu"):
        return [a for a in dict(plan("t", budget, tmp_path, SUITE))["train:eagle"] if a.startswith("data.answers=")]
    assert answers() == []  # nothing shipped
    record.parent.mkdir(parents=True)
    assert answers() == []  # a folder without its run record is no answers folder
    record.write_text("{}")
    assert answers() == answers("medium") == [f"data.answers={record.parent}"] and answers("small") == []


def test_gpu_budget_runs_end_to_end_on_cpu_when_shrunk(smol_path, tmp_path, capsys, monkeypatch):
    """The gpu budget's pipeline (float32 distill, EAGLE-3 with 7 TTT steps on a ShareGPT mix, features online,
    dev eval) at a smoke size on the CPU, which it only accepts when --device cpu asks for it."""
    import dataclasses

    from helpers import save_tiny_target
    from toolkit import pool

    tiny_target_dir = save_tiny_target(tmp_path / "target4", smol_path, layers=8)  # EAGLE-3 fuses layers (2, 4, 5)

    gpu = BUDGETS["gpu"]
    eagle = dict(plan("t", "gpu", tmp_path, SUITE, "cuda"))["train:eagle"]
    assert {"head.ttt_steps=7", "feature_cache.enabled=false", "open_text.source=sharegpt", "train.device=cuda"} \
        <= set(eagle) and "recipes/heads/eagle3.yaml" in " ".join(eagle)
    small = dataclasses.replace(gpu, tasks=("math",), prompts=2, max_new_tokens=16, eagle_minutes=None, eagle_steps=2,
                                eval_tokens=8, distill_overrides=gpu.distill_overrides + ("filters.rules=[]",),
                                greedy=(("math", 3),), greedy_minutes=1e-9,  # stops after its first shard
                                greedy_overrides=_with(gpu.greedy_overrides, "generation.batch_size=2",
                                                       "shard_size=2", "filters.rules=[]"),
                                eagle_overrides=gpu.eagle_overrides + ("open_text.max_rows=8",))
    monkeypatch.setitem(pool.BUDGETS, "gpu", small)
    out = tmp_path / "pool"
    argv = ["pool", "--target", tiny_target_dir, "--budget", "gpu", "--out", str(out), "--suite", SUITE]
    if not __import__("torch").cuda.is_available():
        assert main(argv) == 2 and "sized for one GPU" in capsys.readouterr().err
    assert main(argv + ["--device", "cpu", "--stop-after", "train:eagle"]) == 0
    head = json.loads((out / "heads" / "eagle3" / "head.json").read_text())
    trained = json.loads((out / "heads" / "eagle3" / "eval.json").read_text())["recipe"]
    assert head["layer"] == "eagle3" and head["feature_layers"] == [2, 4, 5] and trained["head"]["ttt_steps"] == 7
    assert json.loads((out / "distill" / "math" / "manifest.json").read_text())["target"]["dtype"] == "float32"
    greedy = json.loads((out / "distill" / "math_greedy" / "manifest.json").read_text())
    assert greedy["status"] == "stopped" and greedy["completed_shards"] == 1 and greedy["shards"] == 2
    assert "2 distillations at once: distill:math, distill:math_greedy" in capsys.readouterr().err
    # trained on both: the four-temperature answers and the stopped greedy run's finished shard
    from toolkit.distill import load_distilled
    from toolkit.train.data import is_heldout
    prompts = [p for d in ("math", "math_greedy")
               for p in load_distilled(out / "distill" / d, allow_partial=True)["prompt"]]
    assert len(prompts) == 2 * 4 + 2
    trained = json.loads((out / "heads" / "eagle3" / "eval.json").read_text())["train_examples"]["distilled"]
    assert trained == sum(not is_heldout(p, 0.125) for p in prompts)
    # resumed without --device (as on the machine that evaluates it): the finished stages stay finished
    assert main(argv + ["--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "[pool] train:eagle: skip (finished)" in err and "[pool] eval: run" in err
    report = json.loads((out / "eval" / "report.json").read_text())
    assert any(m.startswith("arm:eagle") for m in report["summary"])


def test_pool_file_is_the_shipped_composition_with_the_trained_head(tmp_path):
    # every EAGLE arm of recipes/pools/pretrained.yaml (a union's sub-arm too) reads the new head; the rest is kept
    from toolkit.pool import SHIPPED_POOL
    shipped = load_pool(SHIPPED_POOL)
    stage = dict(plan("t", "medium", tmp_path, SUITE))["pool-file"]
    head = str(tmp_path / "heads" / "eagle3")
    assert stage[1] == f"length={shipped.length}"
    want = [map_paths(a, lambda name, path: head if name == "eagle" else path) for a in shipped.arms]
    assert stage[2:] == want and sum(head in a for a in want) == 2
    assert not any("pretrained/" in a for a in stage)
    large = dict(plan("t", "large", tmp_path, SUITE))["pool-file"]  # large adds its early-exit head
    assert large[-1] == f"early_exit:path={tmp_path / 'heads' / 'early_exit'},L=3"


def test_map_paths_reaches_union_sub_arms():
    spec = "union:arms=eagle:path=a/b:L=2+pld:L=4+drafter:path=c:L=3,nodes=6"
    assert map_paths(spec, lambda name, path: f"{name}@{path}") == (
        "union:arms=eagle:path=eagle@a/b:L=2+pld:L=4+drafter:path=drafter@c:L=3,nodes=6")
    assert map_paths("pld:L=4", lambda name, path: 1 / 0) == "pld:L=4"


def test_the_pool_drafts_with_the_trained_head_unless_its_warm_start_scored_higher(tmp_path):
    from decode.common.errors import UserError
    from toolkit.pool import pool_head, write_pool_file
    trained, start = tmp_path / "heads" / "eagle3", tmp_path / "shipped"
    trained.mkdir(parents=True)
    assert pool_head(trained) == (trained, "the head trained here")  # no record: a cold run of a tiny budget

    def record(before, after, init_from=str(start)):
        (trained / "eval.json").write_text(json.dumps({
            "heldout": {"top1_agreement": after}, "heldout_init": {"top1_agreement": before},
            "recipe": {"head": {"init_from": init_from}}}))

    record(0.635, 0.640)
    assert pool_head(trained)[0] == trained
    record(0.635, 0.630)  # training lost half a point: the head it started from, if it is still there
    head, why = pool_head(trained)
    assert head == trained and "no longer at" in why
    start.mkdir()
    (start / "head.json").write_text("{}")
    head, why = pool_head(trained)
    assert head == start and "63.5% against 63.0%" in why
    spec = ["length=cost", f"eagle:path={trained},L=3", "pld:L=4",
            f"union:arms=eagle:path={trained}:L=2+pld:L=4,nodes=6"]
    text = write_pool_file(tmp_path, "t", "medium", spec).read_text()
    assert str(trained) not in text and text.count(f"path={start}") == 2 and "# EAGLE arms: the head it was" in text
    (trained / "eval.json").write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        pool_head(trained)
