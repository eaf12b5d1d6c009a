"""`python -m toolkit train <kind>`: every kind through the one command and its plumbing (run record, resume,
time budget, throughput), and the errors for unknown kinds and fields."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from test_heads import tiny_distilled  # noqa: F401  (the fixture)
from toolkit.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_distilled):
    """test_heads' tiny target + 10-prompt distilled math set; 2 steps, a checkpoint and a log line per step."""
    d, _, common = tiny_distilled
    return d, common + ["train.max_steps=2", "train.save_steps=1", "train.logging_steps=1"]


def train(*args) -> int:
    return main(["train", *map(str, args)])


def _drafter_recipe(d: Path, target: str) -> Path:
    rec = {"name": "tiny", "target": target, "out_root": str(d / "drafters"),
           "model": {"hidden": 32, "heads": 4, "layers": 1, "intermediate": 64, "max_positions": 256},
           "data": {"root": str(d / "distill"), "heldout_fraction": 0.3, "heldout_max": 2, "max_length": 96},
           "train": {"max_steps": 2, "batch_size": 2, "logging_steps": 1, "save_steps": 1, "deepspeed": None}}
    p = d / "drafter.yaml"
    p.write_text(yaml.safe_dump(rec))
    return p


def _logged(ckpt_dir: Path) -> list[dict]:
    last = max(ckpt_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return [r for r in json.loads((last / "trainer_state.json").read_text())["log_history"] if "loss" in r]


def test_every_kind_trains_through_the_one_command_and_records_throughput(tiny, tiny_target_dir):
    d, common = tiny
    rec = _drafter_recipe(d, tiny_target_dir)
    assert train("drafter", "--recipe", rec, "--task", "math") == 0
    summary = json.loads((d / "drafters" / "tiny" / "math" / "train_summary.json").read_text())
    assert summary["global_step"] == 2 and summary["train_tokens"] > 0 and summary["tokens_per_second"] > 0
    assert not summary["stopped_by_time_budget"]
    assert (d / "drafters" / "tiny" / "math" / "export" / "config.json").is_file()
    assert all(r["tokens_per_s"] > 0 for r in _logged(d / "drafters" / "tiny" / "math" / "checkpoints"))

    # the serving layout of an EAGLE head (no input norm, no fc bias) through the recipe, then its export
    assert train("eagle", "--task", "math", *common, f"out_dir={d}/eagle", "head.input_norm=false",
                 "head.fc_bias=false", "open_text.fraction=0") == 0
    assert train("early-exit", *common, f"out_dir={d}/ee", "head.n_layers=1", "open_text.fraction=0") == 0
    assert train("calibrator", *common, f"out_dir={d}/cal", f"collect.drafter={d}/ee", "collect.prompts=6",
                 "collect.max_new_tokens=12", "collect.L=3") == 0
    for name, kind in (("eagle", "eagle"), ("ee", "early_exit"), ("cal", "calibrator")):
        report = json.loads((d / name / "eval.json").read_text())
        assert report["kind"] == kind and report["training"]["global_step"] == 2, name
        unit = "rows" if kind == "calibrator" else "tokens"
        assert report["training"][f"{unit}_per_second"] > 0 and report["training"][f"train_{unit}"] > 0, name
        assert json.loads((d / name / "run.json").read_text())["kind"] == kind
        assert all(f"{unit}_per_s" in r for r in _logged(d / name / "checkpoints")), name
    head = json.loads((d / "eagle" / "head.json").read_text())
    assert head["input_norm"] is False and head["fc_bias"] is False
    assert main(["export", str(d / "eagle"), "--format", "speculators", "--out", str(d / "eagle_spec")]) == 0
    from toolkit.export_formats import EXPORT_META
    assert json.loads((d / "eagle_spec" / EXPORT_META).read_text())["passthrough_first_layer"] is False


def test_a_rerun_resumes_the_finished_run_without_new_steps(tiny):
    d, common = tiny
    args = ("early-exit", *common, f"out_dir={d}/ee_rerun", "head.n_layers=1", "open_text.fraction=0")
    assert train(*args) == 0
    first = json.loads((d / "ee_rerun" / "eval.json").read_text())["training"]
    assert first["resumed_from"] is None
    weights = load_file(str(d / "ee_rerun" / "head.safetensors"))
    assert train(*args) == 0
    again = json.loads((d / "ee_rerun" / "eval.json").read_text())["training"]
    assert again["resumed_from"].endswith("checkpoint-2") and again["global_step"] == 2
    assert again["train_tokens"] == 0  # nothing left to train: it exported straight away
    assert again["last_logged_loss"] == first["last_logged_loss"]
    rerun = load_file(str(d / "ee_rerun" / "head.safetensors"))  # the checkpoint's weights, not a fresh head's
    assert rerun.keys() == weights.keys() and all(torch.equal(rerun[k], weights[k]) for k in weights)
    # another setup in the same folder is refused, naming what changed
    assert train(*args, "head.n_layers=2") == 2


def test_time_budget_stops_after_a_step_exports_and_a_rerun_continues(tiny, capsys):
    d, common = tiny
    out = d / "ee_budget"
    args = ("early-exit", *common, f"out_dir={out}", "head.n_layers=1", "open_text.fraction=0", "train.max_steps=4")
    assert train(*args, "train.max_minutes=0.00001") == 0  # under a millisecond: the first step exceeds it
    report = json.loads((out / "eval.json").read_text())["training"]
    assert report["stopped_by_time_budget"] and report["global_step"] == 1
    assert (out / "head.json").is_file() and (out / "checkpoints" / "checkpoint-1").is_dir()
    assert "time budget train.max_minutes=1e-05 reached at step 1" in capsys.readouterr().out
    # the same budget again: one more step from the checkpoint
    assert train(*args, "train.max_minutes=0.00001") == 0
    report = json.loads((out / "eval.json").read_text())["training"]
    assert report["resumed_from"].endswith("checkpoint-1") and report["global_step"] == 2
    # no budget (not part of the run's setup): continues to max_steps
    assert train(*args) == 0
    report = json.loads((out / "eval.json").read_text())["training"]
    assert report["resumed_from"].endswith("checkpoint-2") and report["global_step"] == 4
    assert not report["stopped_by_time_budget"]


@pytest.mark.parametrize("argv, needle", [
    (["nope"], "unknown kind 'nope'; train one of: drafter, eagle, early-exit, calibrator"),
    (["eagle", "head.nope=1"], "head.nope"),
    (["eagle", "train.max_minutes=0"], "train.max_minutes must be > 0"),
    (["drafter"], "train drafter needs --task"),
    (["eagle", "--recipe", "recipes/heads/nope.yaml"], "not found"),
])
def test_unknown_kinds_and_fields_are_one_line(argv, needle, capsys):
    assert train(*argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_each_kind_has_help_with_its_recipe_fields(capsys):
    with pytest.raises(SystemExit) as exc:
        train("eagle", "--help")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "head.input_norm = true" in out and "train.max_minutes = null" in out and "recipes/heads/eagle.yaml" in out
    with pytest.raises(SystemExit):
        train("drafter", "--help")
    out = capsys.readouterr().out
    assert "kd.weight" in out and "name = (required)" in out


def test_the_catalog_names_a_schema_recipe_and_train_function_per_kind():
    from toolkit.train.kinds import KINDS, get_kind

    assert list(KINDS) == ["drafter", "eagle", "early-exit", "calibrator"]
    assert get_kind("early_exit") is KINDS["early-exit"]
    for kind in KINDS.values():
        assert kind.recipe_path.is_file() and callable(kind.train) and kind.schema.__name__.endswith("Recipe")
