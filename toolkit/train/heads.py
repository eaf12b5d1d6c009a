"""What the three self-drafting head recipes (EAGLE, early exit, calibrator) share on top of the
trainer plumbing (:mod:`.runtime`, :mod:`.data`): the recipe skeleton, target loading, tokenised
train/held-out splits and one ``fit`` that runs :class:`.runtime.LossTrainer` with resume.

A head's train module registers only what the head owns (the frozen target is held outside the
module), so Trainer checkpoints stay small and never contain tied/shared tensors twice.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decode.errors import UserError, run_user_command
from decode.io import atomic_write_json
from decode.models import DEFAULT_TARGET

from .data import DataSection, load_examples, split_heldout, tokenize_sft
from .runtime import (LossTrainer, Placement, TrainSection, deepspeed_config, is_main_process, placement,
                      resume_checkpoint, trained_module, training_arguments)

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = REPO_ROOT / "recipes" / "heads"


@dataclass
class HeadRecipe:
    """Fields every head recipe has; each head adds its own ``head`` section."""

    target: str = DEFAULT_TARGET
    task: str = "math"
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    out_dir: str | None = None  # null = runs/heads/<kind>/<task>
    resume: str = "auto"  # auto | never | <checkpoint folder>
    progress: bool = True
    allow_partial_data: bool = False  # train on the finished shards of a still-running/stopped distillation


@dataclass
class OpenTextSection:
    """Open (human-written) text mixed into the self-distilled set (EESD; EAGLE trains on any text)."""

    path: str | None = None  # JSONL file; null = self-distilled text only
    prompt_field: str = "question"
    response_field: str = "answer"
    fraction: float = 0.0  # share of the training examples that are open text

    def __post_init__(self):
        if not 0.0 <= self.fraction < 1.0:
            raise UserError(f"open_text.fraction must be in [0, 1), got {self.fraction}")


def out_dir_of(recipe: HeadRecipe, kind: str) -> Path:
    return Path(recipe.out_dir or f"runs/heads/{kind}/{recipe.task}")


def load_head_recipe(schema, kind: str, path: str | None, overrides, task: str | None):
    from toolkit.config import load_recipe

    path = path or RECIPES / f"{kind}.yaml"
    if not Path(path).is_file():
        raise UserError(f"recipe {path} not found; pass --recipe recipes/heads/<name>.yaml")
    over = list(overrides) + ([f"task={task}"] if task else [])
    return load_recipe(schema, path, over)


def head_placement(recipe: HeadRecipe) -> Placement:
    """``train.device``/``train.dtype`` resolved on this machine (:func:`.runtime.placement`): call it first,
    so an impossible choice fails before the target loads."""
    return placement(recipe.train, deepspeed=deepspeed_config(recipe.train.deepspeed) is not None)


def load_frozen_target(spec: str, place: Placement | None = None):
    """The target, frozen, in float32 on the training device (its forwards run under autocast in the
    compute dtype; heads initialised from its layers start as float32 master weights)."""
    from decode.models import load_model

    model, tok = load_model(spec, device=place.device if place else "cpu", dtype=torch.float32)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok


def load_distilled_examples(recipe: HeadRecipe):
    """:func:`.data.load_examples`, or with ``allow_partial_data`` the finished shards only."""
    if not recipe.allow_partial_data:
        return load_examples(recipe.data, recipe.task)
    from datasets import concatenate_datasets

    from toolkit.distill import load_distilled

    from .data import distilled_dirs
    parts = [load_distilled(d, allow_partial=True) for d in distilled_dirs(recipe.data, recipe.task)]
    ds = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if len(ds) == 0:
        raise UserError(f"no finished distilled shards for task '{recipe.task}' yet; wait for `make distill`")
    return ds


def tokenized_splits(recipe: HeadRecipe, tokenizer):
    """(train, held-out) tokenised SFT examples (prompt via the chat template, labels on the response)."""
    ds = load_distilled_examples(recipe)
    train, held = split_heldout(ds, recipe.data)
    return (tokenize_sft(train, tokenizer, recipe.data.max_length),
            tokenize_sft(held, tokenizer, recipe.data.max_length) if len(held) else held)


def build_draft_vocab(section, examples, tokenizer, target):
    """The head's draft vocabulary from the target's own output tokens (the labelled response positions
    of the tokenised distilled training split; never open text, which the target did not write), or
    None for ``draft_vocab: null``. Prints the size and the coverage achieved."""
    from decode.vocab import count_tokens, describe, select_draft_vocab, special_token_ids

    if section is None:
        return None
    V = target.get_output_embeddings().weight.shape[0]
    rows = (labels for batch in examples.iter(batch_size=1024) for labels in batch["labels"])
    counts = count_tokens(rows, V)  # -100 (prompt positions) is skipped
    vocab = select_draft_vocab(counts, size=section.size, coverage=None if section.size else section.coverage,
                               special_ids=special_token_ids(tokenizer))
    print(describe(vocab), flush=True)
    return vocab


def _resolve(path: str) -> Path:
    for p in (REPO_ROOT / path, Path(path)):
        if p.is_file():
            return p
    raise UserError(f"open_text.path={path} not found (relative paths: repo root, then the working directory); "
                    f"point it at a JSONL file or set open_text.path=null")


def with_open_text(distilled, section: OpenTextSection, tokenizer, max_length: int, seed: int):
    """Distilled examples + ``fraction/(1-fraction) × len(distilled)`` open-text rows tokenised the
    same way, shuffled together. Returns (dataset, number of open-text rows)."""
    from datasets import Dataset, concatenate_datasets

    if section.path is None or section.fraction == 0:
        return distilled, 0
    want = round(section.fraction / (1 - section.fraction) * len(distilled))
    rows = []
    with open(_resolve(section.path)) as f:
        for line in f:
            if len(rows) >= want:
                break
            r = json.loads(line)
            if section.prompt_field not in r or section.response_field not in r:
                raise UserError(f"open_text.path={section.path}: rows need '{section.prompt_field}' and "
                                f"'{section.response_field}' (set open_text.prompt_field/response_field)")
            rows.append({"prompt": r[section.prompt_field], "response": r[section.response_field],
                         "finish_reason": "stop"})
    if not rows:
        return distilled, 0
    opened = tokenize_sft(Dataset.from_list(rows), tokenizer, max_length)
    return concatenate_datasets([distilled, opened]).shuffle(seed=seed), len(opened)


def fit(module: torch.nn.Module, loss_fn, train_ds, collate, recipe: HeadRecipe, out: Path,
        fingerprint: dict, place: Placement | None = None) -> tuple[torch.nn.Module | None, float]:
    """Train ``module`` (only its requires_grad parameters) with the shared Trainer; resumes from
    ``out/checkpoints`` when the setup matches. Returns (trained module on rank 0, seconds)."""
    ckpt = out / "checkpoints"
    run_file = out / "run.json"
    resume = resume_checkpoint(recipe.resume, ckpt, fingerprint, run_file)
    if is_main_process():
        atomic_write_json(run_file, fingerprint, indent=2, sort_keys=True)
    ds_cfg = deepspeed_config(recipe.train.deepspeed)
    args = training_arguments(recipe.train, ckpt, ds_cfg, place)
    args.disable_tqdm = not recipe.progress
    trainer = LossTrainer(model=module, args=args, train_dataset=train_ds, data_collator=collate, loss_fn=loss_fn)
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    seconds = time.perf_counter() - t0
    return trained_module(trainer, lambda: module), seconds


def count_trainable(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def write_eval(out: Path, report: dict) -> None:
    atomic_write_json(out / "eval.json", report, indent=2, sort_keys=True)
    print(json.dumps(report, indent=2))


def run_main(kind: str, schema, train_fn, argv=None) -> int:
    """Shared command line of the head launchers: ``--recipe``, ``--task`` and ``key=value`` overrides;
    user errors print one line and exit 2."""
    import argparse
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = argparse.ArgumentParser(description=f"train the {kind} head (recipes/heads/{kind}.yaml)")
    ap.add_argument("--recipe", default=None, help=f"YAML recipe (default recipes/heads/{kind}.yaml)")
    ap.add_argument("--task", default=None, help="task whose distilled set to train on (runs/distill/<task>)")
    ap.add_argument("overrides", nargs="*", help="key=value recipe overrides, e.g. train.max_steps=20 train.device=cuda train.dtype=bfloat16")
    args = ap.parse_args(argv)
    return run_user_command(lambda: train_fn(load_head_recipe(schema, kind, args.recipe, args.overrides, args.task)),
                            interrupted="interrupted; rerun the same command to resume from the latest checkpoint")
