#!/usr/bin/env python
"""Train a task drafter for the target on self-distilled data (issue: task-specialised drafters).

    deepspeed scripts/train_drafter.py --recipe recipes/drafters/cpu-small.yaml --task math [key=value ...]
    torchrun --nproc-per-node 2 scripts/train_drafter.py --recipe ... --task code
    python scripts/train_drafter.py --recipe ... --task all train.max_steps=20
    python scripts/train_drafter.py --check --recipe ... --task math   # only the checks below, then exit

The task and its distilled data, and the spelling of train.device/train.dtype, are checked before torch, the
target or DeepSpeed's workers load, so a bad TASK or device fails in a fraction of a second with one line
(naming a GPU or float16 also checks, in a few seconds, that this machine has one) (`make train-drafter` runs
``--check`` before launching DeepSpeed, whose launcher would otherwise print around it). All training lives in
:mod:`toolkit.train.drafter`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode.common.errors import UserError, run_user_command  # noqa: E402


def check_task(argv: list[str]) -> int:
    """Is ``--task`` a distilled task (or a task with a recipe in recipes/tasks/, or ``all``) under the
    recipe's ``data.root``? Anything else about the recipe is left to the full loader."""
    import argparse

    import yaml

    from toolkit.config import parse_override, task_names
    from toolkit.train.data import ALL_TASKS, DataSection, distilled_dirs

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--recipe")
    parser.add_argument("--task")
    args, rest = parser.parse_known_args(argv)
    if not args.recipe or not args.task or not Path(args.recipe).is_file():
        return 0  # the full argument parser / recipe loader reports these
    try:
        recipe = yaml.safe_load(Path(args.recipe).read_text()) or {}
    except yaml.YAMLError:
        return 0
    data = recipe.get("data") if isinstance(recipe, dict) else []
    if not isinstance(data, (dict, type(None))):
        return 0
    data = dict(data or {})
    for item in rest:
        if "=" in item and not item.startswith("-"):
            parts, value, _ = parse_override(item)
            if parts[0] == "data" and len(parts) == 2 and parts[1] in ("root", "path"):
                data[parts[1]] = value
    check_placement(recipe.get("train") if isinstance(recipe, dict) else None, rest)
    section = DataSection(root=str(data.get("root") or DataSection.root), path=data.get("path"))
    task, root = args.task, Path(section.root)
    if section.path or task == ALL_TASKS or (root / task / "manifest.json").is_file():
        distilled_dirs(section, task)  # raises with its own fix when the folder is missing
        return 0
    tasks = task_names()
    if task not in tasks:
        raise UserError(f"unknown task '{task}'; valid tasks: {', '.join(tasks)} (recipes/tasks/*.yaml), or "
                        f"{ALL_TASKS} for every distilled task")
    out = "" if root == Path(DataSection.root) else f' ARGS="out={root / task}"'
    raise UserError(f"no distilled data for task '{task}' at {root / task}; run `make distill TASK={task} N=64{out}` "
                    f"first (64 prompts; more make a better drafter) or set data.root=... / data.path=...")


def check_placement(train, rest: list[str]) -> None:
    """train.device / train.dtype from the recipe and its overrides: spelling here (no torch); a GPU or float16
    is checked against this machine by the trainer's own resolver, so the launcher never starts for nothing."""
    import typing

    from toolkit.config import DTypeName, check_device_spec, parse_override

    train = dict(train) if isinstance(train, dict) else {}
    for item in rest:
        if "=" in item and not item.startswith("-"):
            parts, value, raw = parse_override(item)
            if parts[0] == "train" and len(parts) == 2:
                train[parts[1]] = raw.strip() if parts[1] == "device" else value
    if "precision" in train:
        raise UserError("train.precision is now train.dtype (auto|float32|bfloat16|float16); rename it in the "
                        "recipe or the override")
    device, dtype = str(train.get("device") or "auto"), train.get("dtype") or "auto"
    check_device_spec(device, "train.device")
    if dtype not in typing.get_args(DTypeName):
        raise UserError(f"train.dtype must be {'|'.join(typing.get_args(DTypeName))}, got {dtype!r}")
    if device.strip().lower() != "auto" or dtype != "auto":
        from toolkit.train.runtime import TrainSection, placement
        placement(TrainSection(device=device, dtype=dtype),
                  deepspeed=train.get("deepspeed", TrainSection.deepspeed) not in (None, "", "none"))


def main() -> int:
    argv = sys.argv[1:]
    code = run_user_command(check_task, [a for a in argv if a != "--check"])
    if code or "--check" in argv:
        return code
    from toolkit.train.drafter import main as train
    return train(argv)


if __name__ == "__main__":
    sys.exit(main())
