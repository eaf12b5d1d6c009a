"""EAGLE head recipe (`make train-eagle TASK=...`): the frozen target computes its features on the
fly from distilled text (no stored features); loss = SmoothL1(predicted feature, target feature)
+ ce_weight · CE(target distribution, head distribution) through the target's frozen LM head;
uniform noise on the input features as in EAGLE. Saves a head folder for the ``eagle`` arm and
records held-out teacher-forced top-1 agreement with the target.

With ``draft_vocab`` (default: the tokens covering 95% of the target's distilled outputs) the head's
logits cover only that subset; the CE term matches the target's distribution renormalised over the
subset (the best a subset drafter can do), and agreement counts the drafted target id.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from decode.errors import UserError
from decode.heads import EagleHead

from .data import collator
from toolkit.config import DraftVocabSection

from .heads import HeadRecipe, OpenTextSection, count_trainable, finish, fit, head_fingerprint, text_setup
from .metrics import position_stats

KIND = "eagle"


@dataclass
class EagleSection:
    init: Literal["identity", "last_layer", "random"] = "identity"  # see decode.heads.EagleHead
    ce_weight: float = 0.1  # EAGLE-1's w
    noise: float = 0.1  # half-width of U(-a, a) added to input features while training (0 = off)
    # serving layout: false/false = no input RMSNorm on the layer, no fc bias, which vLLM, SGLang and
    # speculators run (`python -m toolkit export --format speculators` and vLLM load it); true/true = EAGLE-1's head
    input_norm: bool = True
    fc_bias: bool = True

    def __post_init__(self):
        if self.ce_weight < 0 or self.noise < 0:
            raise UserError(f"head.ce_weight and head.noise must be >= 0, got {self.ce_weight}, {self.noise}")


@dataclass
class EagleRecipe(HeadRecipe):
    head: EagleSection = field(default_factory=EagleSection)
    open_text: OpenTextSection = field(default_factory=OpenTextSection)  # EAGLE learns from any text
    draft_vocab: DraftVocabSection | None = field(default_factory=DraftVocabSection)  # null = full vocabulary


class EagleTrainModule(nn.Module):
    """Registers the head only; the frozen target rides along unregistered."""

    def __init__(self, target, head: EagleHead):
        super().__init__()
        self.head = head
        self._target = (target,)

    @property
    def target(self):
        return self._target[0]


def _shifted(model: EagleTrainModule, inputs: dict, noise: float):
    """Head input (f_j, x_{j+1}) → prediction of f_{j+1}; mask: x_{j+2} is a response token.
    Returns (predicted features, target features, target logits) at the masked positions only
    (the LM head, the dominant cost at this model size, runs only where the loss looks)."""
    ids, attn, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
    target = model.target
    if target.device != ids.device:  # unregistered, so the Trainer/DeepSpeed did not move it
        target.to(ids.device)
    mask = torch.zeros_like(ids[:, 1:], dtype=torch.bool)
    mask[:, :-1] = labels[:, 2:] != -100
    with torch.no_grad():
        feats = target.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state.float()
        tgt = feats[:, 1:][mask]
        p_logits = target.get_output_embeddings()(tgt).float()
    x = feats[:, :-1]
    if noise and model.training:
        x = x + (torch.rand_like(x) * 2 - 1) * noise
    pred = model.head(x, ids[:, 1:], attention_mask=attn[:, :-1])
    return pred[mask], tgt, p_logits


def make_loss(section: EagleSection):
    def loss_fn(model, inputs):
        pred, feat, p_logits = _shifted(model, inputs, section.noise)
        if pred.shape[0] == 0:
            zero = sum(p.sum() for p in model.head.parameters()) * 0.0
            return zero, {}
        reg = F.smooth_l1_loss(pred, feat)
        head = model.head
        q_logits = head.logits(pred)  # over the draft vocabulary
        ce = -(torch.softmax(head.restrict(p_logits), -1) * torch.log_softmax(q_logits, -1)).sum(-1).mean()
        acc = (head.target_ids(q_logits.argmax(-1)) == p_logits.argmax(-1)).float().mean()
        return reg + section.ce_weight * ce, {"reg": reg.item(), "ce": ce.item(), "top1": acc.item()}
    return loss_fn


@torch.inference_mode()
def heldout_agreement(module: EagleTrainModule, examples, progress: bool = True) -> dict:
    """Teacher-forced (true features in, one step ahead) top-1 agreement and 1 − TV with the target."""
    from tqdm.auto import tqdm

    module.eval()
    dev = next(module.head.parameters()).device
    tot = {"n": 0, "agree": 0.0, "overlap": 0.0}
    for ex in tqdm(examples, desc="held-out agreement", disable=not progress):
        inputs = {k: torch.tensor([ex[k]], device=dev) for k in ("input_ids", "attention_mask", "labels")}
        pred, _, p_logits = _shifted(module, inputs, 0.0)
        if pred.shape[0]:
            s = position_stats(p_logits, module.head.draft_logits(pred).float())
            for k in tot:
                tot[k] += s[k]
    n = max(tot["n"], 1)
    return {"examples": len(examples), "positions": tot["n"], "top1_agreement": tot["agree"] / n,
            "acceptance": tot["overlap"] / n}


def train(recipe: EagleRecipe) -> dict:
    from toolkit.config import to_dict

    st = text_setup(recipe, KIND)
    head = EagleHead(st.target, init=recipe.head.init, draft_vocab=st.vocab, input_norm=recipe.head.input_norm,
                     fc_bias=recipe.head.fc_bias)
    fp = head_fingerprint(recipe, KIND, st.place, examples=len(st.train), head=to_dict(recipe.head),
                          draft_vocab=to_dict(recipe.draft_vocab))
    run = fit(EagleTrainModule(st.target, head), make_loss(recipe.head), st.train, collator(st.tokenizer), recipe,
              st.out, fp, st.place)
    trained = run.module
    if trained is None:
        return {}
    with st.place.autocast():
        heldout = heldout_agreement(trained, st.heldout, recipe.progress) if len(st.heldout) else None
    return finish(trained.head, recipe, KIND, st.out, run, train_examples=st.train_examples(),
                  trainable_params=count_trainable(trained.head),
                  feature="post-norm final hidden state (LM-head input)", draft_vocab=st.vocab_info(), heldout=heldout)


def main(argv=None) -> int:
    """``python -m toolkit train eagle`` (scripts/train_eagle.py)."""
    from .cli import main_for
    return main_for(KIND, argv)
