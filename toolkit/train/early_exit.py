"""EESD early-exit recipe (`make train-early-exit TASK=...`): cross-entropy of the early-exit drafter
(target's first N layers, frozen → trainable exit layer + norm + LM head) on a mix of the target's
self-distilled answers and open text (``open_text.fraction`` of the training examples). Only the
first N target layers run, never the full target, except for the held-out agreement at the end.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F

from decode.choose.heads import EarlyExitDrafter
from toolkit.config import DraftVocabSection

from .data import collator
from .heads import HeadRecipe, OpenTextSection, count_trainable, finish, fit, head_fingerprint, text_setup
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

    st = text_setup(recipe, KIND)
    head = EarlyExitDrafter(st.target, recipe.head.n_layers, draft_vocab=st.vocab)
    head.freeze_shared()
    fp = head_fingerprint(recipe, KIND, st.place, examples=len(st.train), head=to_dict(recipe.head),
                          open_text=to_dict(recipe.open_text), draft_vocab=to_dict(recipe.draft_vocab))
    run = fit(head, loss_fn, st.train, collator(st.tokenizer), recipe, st.out, fp, st.place)
    trained = run.module
    if trained is None:
        return {}
    trained.eval()
    with st.place.autocast():
        heldout = (heldout_agreement(trained, st.target, st.heldout, progress=recipe.progress)
                   if len(st.heldout) else None)
    return finish(trained, recipe, KIND, st.out, run, n_layers=trained.n_layers, train_examples=st.train_examples(),
                  trainable_params=count_trainable(trained), draft_vocab=st.vocab_info(), heldout=heldout)


def main(argv=None) -> int:
    """``python -m toolkit train early-exit`` (scripts/train_early_exit.py)."""
    from .cli import main_for
    return main_for(KIND, argv)
