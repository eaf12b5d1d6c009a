"""Training examples from self-distilled sets (``make distill``), tokenised exactly as decode prompts.

The prompt is rendered with :func:`decode.evaluation.suites.encode_prompt` (the target's chat template, the same
ids ``decode eval`` feeds the target), the response is the target's own answer; only response tokens
carry a label. The held-out split is by prompt hash, so one prompt distilled at several temperatures
never lands on both sides.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from decode.common.errors import UserError

ALL_TASKS = "all"
# finish reasons after which the target emitted its end-of-turn token (appended as a label)
_STOPPED = {"stop", "eos", "eos_token", "end_turn"}


@dataclass
class DataSection:
    root: str = "runs/distill"  # one distilled folder per task: <root>/<task>/ (`make distill TASK=<task>`)
    path: str | None = None  # an explicit distilled folder instead of <root>/<task>
    heldout_fraction: float = 0.05  # share of prompts kept out of training for the final evaluation
    heldout_max: int = 200  # held-out examples evaluated at the end (the rest are still not trained on)
    max_examples: int | None = None  # cap on training examples (smoke runs)
    max_length: int = 512  # prompt + response tokens per example; longer ones are cut at the end
    # an answers folder (`python -m toolkit answers`, e.g. pretrained/<target>/answers) whose rows of the task(s) are
    # trained on too, after the distilled ones (a row distilled here as well counts once): a time-limited
    # distillation that reuses the shipped answers reaches only some of its shards, and the others' shipped rows
    # would otherwise be left out
    answers: str | None = None

    def __post_init__(self):
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise UserError(f"data.heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.max_length < 8:
            raise UserError(f"data.max_length must be >= 8 tokens, got {self.max_length}")
        if self.max_examples is not None and self.max_examples < 1:
            raise UserError(f"data.max_examples must be >= 1 or null, got {self.max_examples}")
        if self.heldout_max < 0:
            raise UserError(f"data.heldout_max must be >= 0, got {self.heldout_max}")


def distilled_dirs(section: DataSection, task: str) -> list[Path]:
    """The distilled folders a task trains on (``all`` = every task under ``data.root``)."""
    if section.path:
        p = Path(section.path)
        if not p.is_dir():
            raise UserError(f"data.path={p} does not exist; point it at a `make distill` output folder")
        return [p]
    root = Path(section.root)
    if task == ALL_TASKS:
        dirs = sorted(d for d in root.iterdir() if _is_distilled(d)) if root.is_dir() else []
        if not dirs:
            raise UserError(f"TASK=all needs distilled data under {root}/<task>/ but none was found; run "
                            f"`make distill TASK=<task>` for some tasks first (or set data.root=...)")
        return dirs
    d = root / task
    if not _is_distilled(d):
        from ..config import task_recipe
        task_recipe(task)  # an unknown task: list the valid ones instead of suggesting a distill that fails
        raise UserError(f"no distilled data for task '{task}' at {d}; run `make distill TASK={task}` first "
                        f"(or set data.root=... / data.path=...)")
    return [d]


def _is_distilled(d: Path) -> bool:
    return d.is_dir() and (d / "manifest.json").is_file()


def load_examples(section: DataSection, task: str, *, allow_partial: bool = False):
    """All kept distilled rows of the task(s) as one ``datasets.Dataset`` (see :mod:`toolkit.distill`), then the
    rows of ``data.answers`` not among them. ``allow_partial``: a stopped distillation's finished shards."""
    from toolkit.distill import load_distilled

    dirs = distilled_dirs(section, task)
    ds = _with_answers(load_distilled(dirs if len(dirs) > 1 else dirs[0], allow_partial=allow_partial), section, task)
    missing = [c for c in ("prompt", "response") if c not in ds.column_names]
    if missing:
        raise UserError(f"distilled data at {', '.join(map(str, dirs))} lacks column(s) {missing}; "
                        f"regenerate it with `make distill`")
    if len(ds) == 0:
        where = " in finished shards yet" if allow_partial else ""
        raise UserError(f"distilled data for task '{task}' has no kept rows{where}; rerun `make distill "
                        f"TASK={task}` with more prompts or looser filters")
    return ds


def _with_answers(ds, section: DataSection, task: str):
    """``ds`` + the rows of the answers folder ``section.answers`` for ``task`` (``all``: every task there) whose
    ids ``ds`` lacks, in ``ds``'s columns (their response text left empty: training reads the token ids)."""
    if not section.answers:
        return ds
    from datasets import Dataset, concatenate_datasets

    from toolkit.answers import load_answers, read_record

    folder = Path(section.answers)
    try:
        record = read_record(folder)
    except UserError as exc:
        raise UserError(f"data.answers={folder}: {exc}; pass a `python -m toolkit answers` folder "
                        f"(e.g. pretrained/<target>/answers) or data.answers=null") from None
    if task != ALL_TASKS and task not in record["tasks"]:
        raise UserError(f"data.answers={folder}: no {task} answers there (it has "
                        f"{', '.join(sorted(record['tasks'])) or 'none'}); pass data.answers=null")
    seen = set(ds["id"])
    rows = [{"id": r["id"], "task": r["task"], "source": r["source"], "prompt": r["prompt"], "prompt_text": None,
             "prompt_ids": r["prompt_ids"], "response": "", "response_ids": r["response_ids"],
             "temperature": r["temperature"], "finish_reason": r["finish_reason"],
             "prompt_tokens": len(r["prompt_ids"]), "response_tokens": len(r["response_ids"]), "filtered": ""}
            for r in load_answers(folder, None if task == ALL_TASKS else task) if r["id"] not in seen]
    if not rows:
        return ds
    return concatenate_datasets([ds, Dataset.from_list(rows, features=ds.features)])


def is_heldout(prompt: str, fraction: float) -> bool:
    """Deterministic, order-free split: a prompt is held out iff its hash falls below ``fraction``."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def split_heldout(ds, section: DataSection):
    """(train, heldout) by prompt hash; the held-out side is capped at ``heldout_max`` examples."""
    flags = [is_heldout(p, section.heldout_fraction) for p in ds["prompt"]]
    train = ds.select([i for i, f in enumerate(flags) if not f])
    held = ds.select([i for i, f in enumerate(flags) if f][: section.heldout_max])
    if section.max_examples is not None:
        train = train.select(range(min(section.max_examples, len(train))))
    if len(train) == 0:
        raise UserError(f"no training examples left after holding out {section.heldout_fraction:.0%} of prompts; "
                        f"distil more prompts or lower data.heldout_fraction")
    return train, held


def encode_example(tokenizer, row: dict, max_length: int) -> dict:
    """input_ids = prompt + response; labels mask the prompt. Uses the exact token ids the target saw and
    generated (``prompt_ids``/``response_ids``, ending with its end-of-turn token when it stopped);
    rows without them are rendered with the target's chat template and re-tokenised."""
    p_ids, r_ids = row.get("prompt_ids"), row.get("response_ids")
    if p_ids is None or r_ids is None:
        from decode.evaluation.suites import encode_prompt

        p_ids = encode_prompt(tokenizer, row["prompt"])
        r_ids = list(tokenizer(row["response"], add_special_tokens=False)["input_ids"])
        if (row.get("finish_reason") or "stop") in _STOPPED and tokenizer.eos_token_id is not None:
            r_ids.append(int(tokenizer.eos_token_id))
    p_ids, r_ids = list(p_ids), list(r_ids)
    ids = (p_ids + r_ids)[:max_length]
    labels = ([-100] * len(p_ids) + r_ids)[:max_length]
    return {"input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids)}


def tokenize_sft(ds, tokenizer, max_length: int):
    """Map distilled rows to SFT features; rows whose response was cut away entirely are dropped."""
    out = ds.filter(lambda r: bool(r["prompt"] and r["prompt"].strip())
                    and bool(r["response"] or r.get("response_ids")), desc="non-empty")
    out = out.map(lambda r: encode_example(tokenizer, r, max_length), remove_columns=out.column_names,
                  desc="tokenising")
    return out.filter(lambda r: any(x != -100 for x in r["labels"]), desc="dropping prompt-only rows")


def collator(tokenizer):
    """Right-pads input_ids/attention_mask and pads labels with -100 (transformers' seq2seq collator)."""
    from transformers import DataCollatorForSeq2Seq

    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, return_tensors="pt")
