"""EESD early-exit recipe (`make train-early-exit TASK=...`): cross-entropy of the early-exit drafter
(target's first N layers, frozen → trainable exit layer + norm + LM head) on a mix of the target's
self-distilled answers and open text (``open_text.fraction`` of the training examples). Only the
first N target layers run, never the full target, except for the held-out agreement at the end.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F

from decode.heads import EarlyExitDrafter, save_head
from toolkit.config import DraftVocabSection

from .data import collator
from .heads import (HeadRecipe, OpenTextSection, build_draft_vocab, count_trainable, fit, head_placement,
                    load_frozen_target, out_dir_of, tokenized_splits, with_open_text, write_eval)
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
    draft_vocab: DraftVocabSection | None = field(default_factory=DraftVocabSection)  # null = full vocabulary


def loss_fn(model: EarlyExitDrafter, inputs):
    """CE on labelled positions; the LM head runs only there (its cost dominates at this size)."""
    h = model.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    labels = inputs["labels"][:, 1:]
    mask = labels != -100
    index = model.draft_index(labels[mask])  # draft-vocabulary indices, -1 outside it
    keep = index >= 0
    if not keep.any():  # no label the drafter could draft in this batch
        return sum(p.sum() for p in model.trainable_parameters()) * 0.0, {}
    logits = model.lm_head(h[:, :-1][mask][keep])
    ce = F.cross_entropy(logits.float(), index[keep])
    return ce, {"ce": ce.item(), "in_vocab": keep.float().mean().item()}


def train(recipe: EarlyExitRecipe) -> dict:
    from toolkit.config import to_dict

    from .runtime import train_fingerprint

    out = out_dir_of(recipe, KIND)
    place = head_placement(recipe)
    target, tok = load_frozen_target(recipe.target, place)
    distilled, held = tokenized_splits(recipe, tok)
    train_ds, n_open = with_open_text(distilled, recipe.open_text, tok, recipe.data.max_length, recipe.train.seed)
    vocab = build_draft_vocab(recipe.draft_vocab, distilled, tok, target)
    head = EarlyExitDrafter(target, recipe.head.n_layers, draft_vocab=vocab)
    head.freeze_shared()
    fp = {"kind": KIND, "target": recipe.target, "task": recipe.task, "examples": len(train_ds),
          "head": to_dict(recipe.head), "open_text": to_dict(recipe.open_text),
          "draft_vocab": to_dict(recipe.draft_vocab),
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
              "draft_vocab": None if vocab is None else vocab.info,
              "heldout": heldout,
              "recipe": to_dict(recipe)}
    save_head(trained, out, extra={"target_spec": recipe.target, "task": recipe.task})
    write_eval(out, report)
    return report


def main(argv=None) -> int:
    from .heads import run_main
    return run_main(KIND, EarlyExitRecipe, train, argv)
