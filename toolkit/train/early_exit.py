"""EESD early-exit recipe (`make train-early-exit TASK=...`): cross-entropy of the early-exit drafter
(target's first N layers, frozen → trainable exit layer + norm + LM head) on a mix of the target's
self-distilled answers and open text (``open_text.fraction`` of the training examples). Only the
first N target layers run, never the full target, except for the held-out agreement at the end.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F

from decode.heads import EarlyExitDrafter, save_head

from .data import collator
from .heads import (HeadRecipe, OpenTextSection, count_trainable, fit, head_placement, load_frozen_target,
                    out_dir_of, tokenized_splits, with_open_text, write_eval)
from .metrics import heldout_agreement

KIND = "early_exit"


@dataclass
class EarlyExitSection:
    n_layers: int | None = None  # first-N target layers under the exit layer; null = ≈10% of the layers


@dataclass
class EarlyExitRecipe(HeadRecipe):
    head: EarlyExitSection = field(default_factory=EarlyExitSection)
    open_text: OpenTextSection = field(default_factory=lambda: OpenTextSection(
        path="../shared/data/gsm8k/train.jsonl", fraction=0.25))


def loss_fn(model: EarlyExitDrafter, inputs):
    """CE on labelled positions; the LM head runs only there (its cost dominates at this size)."""
    h = model.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    labels = inputs["labels"][:, 1:]
    mask = labels != -100
    logits = model.lm_head(h[:, :-1][mask])
    ce = F.cross_entropy(logits.float(), labels[mask])
    return ce, {"ce": ce.item()}


def train(recipe: EarlyExitRecipe) -> dict:
    from toolkit.config import to_dict

    from .runtime import train_fingerprint

    out = out_dir_of(recipe, KIND)
    place = head_placement(recipe)
    target, tok = load_frozen_target(recipe.target, place)
    distilled, held = tokenized_splits(recipe, tok)
    train_ds, n_open = with_open_text(distilled, recipe.open_text, tok, recipe.data.max_length, recipe.train.seed)
    head = EarlyExitDrafter(target, recipe.head.n_layers)
    head.freeze_shared()
    fp = {"kind": KIND, "target": recipe.target, "task": recipe.task, "examples": len(train_ds),
          "head": to_dict(recipe.head), "open_text": to_dict(recipe.open_text),
          "train": train_fingerprint(recipe.train, place)}
    trained, seconds = fit(head, loss_fn, train_ds, collator(tok), recipe, out, fp, place)
    if trained is None:
        return {}
    trained.eval()
    with place.autocast():
        heldout = heldout_agreement(trained, target, held, progress=recipe.progress) if len(held) else None
    report = {"kind": KIND, "task": recipe.task, "target": recipe.target, "n_layers": trained.n_layers,
              "train_examples": {"distilled": len(distilled), "open_text": n_open},
              "trainable_params": count_trainable(trained), "train_seconds": round(seconds, 1),
              "heldout": heldout,
              "recipe": to_dict(recipe)}
    save_head(trained, out, extra={"target_spec": recipe.target, "task": recipe.task})
    write_eval(out, report)
    return report


def main(argv=None) -> int:
    from .heads import run_main
    return run_main(KIND, EarlyExitRecipe, train, argv)
