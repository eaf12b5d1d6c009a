"""EAGLE head recipe (`make train-eagle TASK=...`): the frozen target computes its features on the
fly from distilled text (no stored features); loss = SmoothL1(predicted feature, target feature)
+ ce_weight · CE(target distribution, head distribution) through the target's frozen LM head;
uniform noise on the input features as in EAGLE. Saves a head folder for the ``eagle`` arm and
records held-out teacher-forced top-1 agreement with the target.

With ``draft_vocab`` (default: the tokens covering 95% of the target's distilled outputs) the head's
logits cover only that subset; the CE term matches the target's distribution renormalised over the
subset (the best a subset drafter can do), and agreement counts the drafted target id.

EAGLE-3 options (ALGORITHMS.md §9; recipe ``recipes/heads/eagle3.yaml``; decode/choose/heads/eagle.py):

* ``head.features: fused``: the head reads target layers ``head.feature_layers`` (default EAGLE-3's
  (2, N//2, N-3)) through its ``fuse`` layer and predicts no feature; the loss is CE only.
* ``head.ttt_steps: k`` (training-time test): the head is unrolled k steps and every step has a loss,
  weighted ``ttt_decay``**step (EAGLE-3: 0.8**step, summed, not normalised). Step 0 is teacher forced: slot j
  reads (g_j, x_{j+1}) at position j, causally, and predicts the target's distribution at position j+1. Step
  s ≥ 1: slot j reads (its own step-(s-1) output, x_{j+s+1}) at position j+s, attends to the step-0 keys of
  slots 0..j and to its own keys of steps 1..s (a diagonal), and predicts the target at position j+s+1 —
  exactly what draft step s+1 computes at decode time after the true entries 0..j (the arm's head cache holds
  true entries plus the current draft's own). Tokens are the true ones (teacher forcing on tokens, as EAGLE-3).
  The earlier steps' keys/values ride in an HF ``DynamicCache`` and each step passes a 4-D additive mask to the
  head's own HF decoder stack. Works for EAGLE-1-style heads too (their feature input is their own prediction).

Deviations from EAGLE-3's reference training (SafeAILab/EAGLE ``traineagle3``), each on purpose:
  * positions: step s runs at position j+s, as drafting does; the reference keeps position j at every step;
  * positions whose target top token lies outside the draft vocabulary keep their loss (against the target's
    distribution renormalised over the subset, as the EAGLE-1 recipe does); the reference masks them out;
  * ``recipes/heads/eagle3.yaml`` unrolls 3 steps (CPU budget); the reference unrolls 7.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from decode.common.errors import UserError
from decode.choose.heads import EagleHead
from decode.choose.heads.eagle import eagle3_layers
from decode.core.hidden import layer_features

from .data import collator
from .features import FeatureCacheSection, with_feature_cache
from toolkit.config import DraftVocabSection

from .heads import HeadRecipe, OpenTextSection, count_trainable, finish, fit, head_fingerprint, text_setup
from .metrics import position_stats

KIND = "eagle"


@dataclass
class EagleSection:
    init: Literal["identity", "last_layer", "random"] = "identity"  # see decode.choose.heads.EagleHead
    ce_weight: float = 0.1  # EAGLE-1's w (features: final); fused heads have a CE-only loss and ignore it
    noise: float = 0.1  # half-width of U(-a, a) added to input features while training (0 = off)
    # serving layout: false/false = no input RMSNorm on the layer, no fc bias, which vLLM, SGLang and
    # speculators run (`python -m toolkit export --format speculators` and vLLM load it); true/true = EAGLE-1's head
    input_norm: bool = True
    fc_bias: bool = True
    # final = EAGLE-1 (post-norm final hidden state in, predicted); fused = EAGLE-3 (feature_layers fused in,
    # recurrent hidden state out, CE-only loss)
    features: Literal["final", "fused"] = "final"
    feature_layers: list[int] | None = None  # fused only: HF hidden_states ids; null = EAGLE-3's (2, N//2, N-3)
    ttt_steps: int = 1  # training-time test: unrolled steps with a loss each (1 = EAGLE-1 training)
    ttt_decay: float = 0.8  # step s's loss weight = ttt_decay**s (EAGLE-3: 0.8)
    # fused only: eagle1 = fc(cat[emb, g]) + the target's layer class; eagle3 = EAGLE-3's own first layer (separate
    # norms, 2d q/k/v, no fc): the layout speculators' Eagle3 holds, so `toolkit export --format speculators` is exact
    layer: Literal["eagle1", "eagle3"] = "eagle1"
    # warm start: a trained EAGLE head folder (e.g. pretrained/<target>/eagle) whose weights and draft vocabulary the
    # head starts from instead of `init`; its layout (features, feature_layers, layer, input_norm, fc_bias) must be
    # this section's, and the recipe's draft_vocab is then not built (the source's vocabulary indexes its LM head)
    init_from: str | None = None

    def __post_init__(self):
        if self.ce_weight < 0 or self.noise < 0:
            raise UserError(f"head.ce_weight and head.noise must be >= 0, got {self.ce_weight}, {self.noise}")
        if self.feature_layers is not None and self.features != "fused":
            raise UserError("head.feature_layers picks the fused layers: set head.features=fused too (or drop it)")
        if self.layer == "eagle3" and (self.features != "fused" or not self.input_norm):
            raise UserError("head.layer=eagle3 is EAGLE-3's first layer: it reads fused target layers and normalises "
                            "its inputs; set head.features=fused and keep head.input_norm=true "
                            "(or use head.layer=eagle1)")
        if self.layer == "eagle3" and self.feature_layers is not None:
            self._check_eagle3_layers(self.feature_layers, None)
        if self.ttt_steps < 1:
            raise UserError(f"head.ttt_steps must be >= 1 (1 = no training-time test), got {self.ttt_steps}")
        if not 0 < self.ttt_decay <= 1:
            raise UserError(f"head.ttt_decay must be in (0, 1], got {self.ttt_decay}")

    def _check_eagle3_layers(self, layers, n_layers: int | None) -> None:
        """``head.layer=eagle3`` is the layout speculators' EAGLE-3 holds and vLLM serves: its feature layers must be
        what vLLM collects and fuses as we do (toolkit/export_formats.py ``eagle3_layer_problem``); ``n_layers``
        None = the target is not known yet (the upper bound is checked by :meth:`layers`)."""
        from toolkit.export_formats import eagle3_layer_problem

        problem = eagle3_layer_problem(layers, n_layers, ordered=True)
        if problem is None:
            return
        top = n_layers - 1 if n_layers is not None else "N-1"
        if self.feature_layers is not None:
            given = f"head.feature_layers={list(layers)}"
        else:
            given = (f"head.feature_layers (null: EAGLE-3's default (2, N//2, N-3) = {list(layers)} on this "
                     f"{n_layers}-layer target; set head.feature_layers explicitly)")
        fixed = sorted({int(i) for i in layers if int(i) >= 0 and (n_layers is None or int(i) < n_layers)})
        example = "[" + ",".join(map(str, fixed)) + "]" if len(fixed) == 3 else "[a,b,c]"
        raise UserError(f"{given} with head.layer=eagle3: {problem}. Give 3 distinct target layers in ascending "
                        f"order, 0 <= a < b < c <= {top}: e.g. head.feature_layers={example} "
                        "(or use head.layer=eagle1, "
                        "which no serving format reads)")

    def layers(self, n_layers: int) -> tuple[int, ...] | None:
        """The head's ``feature_layers`` for an ``n_layers``-layer target (None = EAGLE-1); ``layer: eagle3`` ones
        checked against the target (3 distinct, ascending, in 0..N-1: what vLLM's eagle3 reads as we do)."""
        if self.features != "fused":
            return None
        layers = tuple(self.feature_layers) if self.feature_layers is not None else eagle3_layers(n_layers)
        if self.layer == "eagle3":
            self._check_eagle3_layers(layers, n_layers)
        return layers


@dataclass
class EagleRecipe(HeadRecipe):
    head: EagleSection = field(default_factory=EagleSection)
    open_text: OpenTextSection = field(default_factory=OpenTextSection)  # EAGLE learns from any text
    draft_vocab: DraftVocabSection | None = field(default_factory=DraftVocabSection)  # null = full vocabulary
    feature_cache: FeatureCacheSection = field(default_factory=FeatureCacheSection)  # target features on disk


class EagleTrainModule(nn.Module):
    """Registers the head only; the frozen target rides along unregistered."""

    def __init__(self, target, head: EagleHead):
        super().__init__()
        self.head = head
        self._target = (target,)

    @property
    def target(self):
        return self._target[0]


def target_hidden_states(target, inputs: dict, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target's features for a batch: (feature input [B, T, D_in], final hidden [B, T, d]), float32.

    feature input = the target hidden states of ``layers`` (HF ``hidden_states`` ids, the head's
    ``target_layers``) side by side in that order, D_in = d·len(layers); final = the post-norm final state (the
    LM-head input, for the target's logits). For an EAGLE-1 head (layers (-1,)) both are the same tensor.
    Contract for a feature cache: when ``inputs`` holds ``"target_hidden"`` ([B, T, D_in], already in the
    head's layer order) the target does not run; ``"target_final"`` ([B, T, d]) must come with it unless
    layers == (-1,). Every target forward of this trainer goes through here."""
    if "target_hidden" in inputs:
        feats = inputs["target_hidden"].float()
        final = inputs.get("target_final")
        if final is None:
            if tuple(layers) != (-1,):
                raise UserError(f"cached target features for layers {list(layers)} need 'target_final' (the "
                                "post-norm final hidden state) beside 'target_hidden'")
            final = feats
        return feats, final.float()
    ids, attn = inputs["input_ids"], inputs["attention_mask"]
    if target.device != ids.device:  # unregistered, so the Trainer/DeepSpeed did not move it
        target.to(ids.device)
    everything = tuple(layers) != (-1,)
    with torch.no_grad():
        out = target.get_decoder()(input_ids=ids, attention_mask=attn, output_hidden_states=everything)
        final = out.last_hidden_state.float()
        feats = layer_features(out.hidden_states, tuple(layers)).float() if everything else final
    return feats, final


class TTTStep(NamedTuple):
    """One unrolled step at its loss positions: the head's outputs, the target's post-norm final hidden state
    at the predicted position (EAGLE-1's regression target) and, as ``rows`` of ``target_logits`` (shared by every
    step of a batch: each position's logits are computed once, not once per step that predicts it), the target's
    logits there."""
    pred: torch.Tensor
    feat: torch.Tensor
    rows: torch.Tensor
    target_logits: torch.Tensor

    @property
    def p_logits(self) -> torch.Tensor:
        return self.target_logits[self.rows]


def _shift(x: torch.Tensor, s: int, n: int, fill) -> torch.Tensor:
    """x[:, s:s+n] along dim 1, padded with ``fill`` to n columns where x ends."""
    part = x[:, s:s + n]
    if part.shape[1] == n:
        return part
    pad = torch.full((x.shape[0], n - part.shape[1], *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([part, pad], dim=1)


def ttt_mask(attn: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4-D mask [B, 1, S, (step+1)·S] for unrolled step ``step`` ≥ 1 over S slots: slot j sees the
    step-0 keys of slots ≤ j that are not padding (``attn`` [B, S]) and its own keys of steps 1..step."""
    B, S = attn.shape
    causal = torch.ones(S, S, dtype=torch.bool, device=attn.device).tril()
    first = causal[None] & attn.bool()[:, None, :]
    diag = torch.eye(S, dtype=torch.bool, device=attn.device).repeat(1, step)
    visible = torch.cat([first, diag[None].expand(B, S, step * S)], dim=-1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=attn.device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[:, None]


def unroll(model: EagleTrainModule, inputs: dict, noise: float, steps: int = 1,
           draft_vocab_only: bool = False) -> list[TTTStep]:
    """The head unrolled ``steps`` times over a batch (module docstring); step s's outputs at the slots j whose
    predicted position j+s+1 exists and carries a label (token j+s+2 is a response token). The LM head, the
    dominant cost at this model size, runs only where the loss looks. ``draft_vocab_only``: the target's logits
    over the head's draft vocabulary only (its LM head's rows: what the loss reads; 1/6 of the full LM head's
    arithmetic with the shipped 8,192 of 49,152 tokens), not over the whole vocabulary (what held-out metrics
    read); the same without a draft vocabulary."""
    ids, attn, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
    head, target = model.head, model.target
    feats, final = target_hidden_states(target, inputs, head.target_layers)
    S = ids.shape[1] - 1  # slots j = 0..T-2
    x = feats[:, :-1]
    if noise and model.training:
        x = x + (torch.rand_like(x) * 2 - 1) * noise
    g = head.input_features(x)
    slot_attn = attn[:, :-1]
    # position p is predicted (by slot p-s-1 of step s) with a loss iff token p+1 is a label, whatever the step: the
    # target's LM head runs once over those positions, not once per step (with cached features, 7 steps' passes were
    # half of a step's arithmetic on a CPU)
    needed = _shift(labels, 1, ids.shape[1], -100) != -100
    needed[:, 0] = False  # no step predicts position 0
    row_of = torch.full(needed.shape, -1, dtype=torch.long, device=ids.device)
    row_of[needed] = torch.arange(int(needed.sum()), device=ids.device)
    final = final[needed]
    with torch.no_grad():
        if draft_vocab_only and head.draft_vocab is not None:
            bias = None if head.draft_bias is None else head.draft_bias.to(target.dtype)
            target_logits = F.linear(final.to(target.dtype), head.draft_weight.to(target.dtype), bias).float()
        else:
            target_logits = target.get_output_embeddings()(final.to(target.dtype)).float()
    cache = DynamicCache() if steps > 1 else None
    pos0 = torch.arange(S, device=ids.device).unsqueeze(0)
    out = []
    for s in range(steps):
        mask = slot_attn if s == 0 else ttt_mask(slot_attn, s, g.dtype)
        h = head(g, _shift(ids, s + 1, S, 0), past_key_values=cache, attention_mask=mask, use_cache=cache is not None,
                 position_ids=pos0 + s)
        keep = _shift(labels, s + 2, S, -100) != -100
        rows = _shift(row_of, s + 1, S, -1)[keep]
        out.append(TTTStep(h[keep], final[rows], rows, target_logits))
        g = h
    return out


def make_loss(section: EagleSection):
    def loss_fn(model, inputs):
        head = model.head
        total, logs = None, {}
        steps = unroll(model, inputs, section.noise, section.ttt_steps, draft_vocab_only=True)
        p_draft = steps[0].target_logits  # the target over the draft vocabulary, and its top token, for every step
        p_top = p_draft.argmax(-1)
        for s, step in enumerate(steps):
            if step.pred.shape[0] == 0:
                continue
            q_logits = head.logits(step.pred)  # over the draft vocabulary
            ce = -(torch.softmax(p_draft[step.rows], -1) * torch.log_softmax(q_logits, -1)).sum(-1).mean()
            # the logged top1: the head's top token is the target's top token among the draft vocabulary (held-out
            # agreement, the reported figure, compares with the target's top token over the whole vocabulary)
            acc = (q_logits.argmax(-1) == p_top[step.rows]).float().mean()
            if head.fused:  # no feature to regress on: the head's output is its own recurrent state
                loss = ce
            else:
                reg = F.smooth_l1_loss(step.pred, step.feat)
                loss = reg + section.ce_weight * ce
                logs["reg" if s == 0 else f"reg@{s}"] = reg.item()
            logs["ce" if s == 0 else f"ce@{s}"] = ce.item()
            logs["top1" if s == 0 else f"top1@{s}"] = acc.item()
            loss = section.ttt_decay ** s * loss
            total = loss if total is None else total + loss
        if total is None:
            return sum(p.sum() for p in head.parameters()) * 0.0, {}
        return total, logs
    return loss_fn


@torch.inference_mode()
def heldout_agreement(module: EagleTrainModule, examples, progress: bool = True, steps: int = 1,
                      per_example: bool = False) -> dict:
    """Top-1 agreement and 1 − TV with the target, teacher forced (true features in, one step ahead), and with
    ``steps`` > 1 also per unrolled step (the head on its own outputs, as in drafting: ``by_step``).

    Positions: every response token (the first included), each predicted from the target's features of the text
    before it. ``top1_agreement`` compares the head's top token with the target's argmax there (what a greedy
    verifier accepts); ``reference_agreement`` with the example's own token (equal on greedy-distilled text).
    ``per_example``: also each example's step-0 tokens (``per_example``: {drafts, target, reference}), the
    training-side counterpart of decode/choose/arms/eagle/teacher.py's decode-side forcing (issue 31)."""
    from tqdm.auto import tqdm

    module.eval()
    dev = next(module.head.parameters()).device
    tot = [{"n": 0, "agree": 0.0, "overlap": 0.0} for _ in range(steps)]
    ref_hits, rows = 0, []
    for ex in tqdm(examples, desc="held-out agreement", disable=not progress):
        inputs = {k: torch.tensor([ex[k]], device=dev) for k in ("input_ids", "attention_mask", "labels")}
        for s, (t, step) in enumerate(zip(tot, unroll(module, inputs, 0.0, steps))):
            if not step.pred.shape[0]:
                if s == 0 and per_example:
                    rows.append({"drafts": [], "target": [], "reference": []})
                continue
            q_logits = module.head.draft_logits(step.pred).float()
            stats = position_stats(step.p_logits, q_logits)
            for k in t:
                t[k] += stats[k]
            if s == 0:  # the labels of the kept slots, in unroll's order (slot j predicts token j+2)
                labels = inputs["labels"]
                ref = _shift(labels, 2, labels.shape[1] - 1, -100)
                ref = ref[ref != -100]
                drafts = q_logits.argmax(-1)
                ref_hits += int((drafts == ref).sum())
                if per_example:
                    rows.append({"drafts": drafts.tolist(), "target": step.p_logits.argmax(-1).tolist(),
                                 "reference": ref.tolist()})
    rates = [{"positions": t["n"], "top1_agreement": t["agree"] / max(t["n"], 1),
              "acceptance": t["overlap"] / max(t["n"], 1)} for t in tot]
    report = {"examples": len(examples), **rates[0], "reference_agreement": ref_hits / max(tot[0]["n"], 1)}
    if steps > 1:
        report["by_step"] = rates
    if per_example:
        report["per_example"] = rows
    return report


_LATER_FIELDS = ("features", "feature_layers", "ttt_steps", "ttt_decay", "layer", "init_from")


def _fingerprint(section: EagleSection) -> dict:
    """The head section as checkpoints record it; the fields added after EAGLE-1 (EAGLE-3's, the warm start) only
    when set away from their defaults, so runs started before they existed still resume."""
    from toolkit.config import to_dict

    default = EagleSection()
    return {k: v for k, v in to_dict(section).items()
            if k not in _LATER_FIELDS or getattr(section, k) != getattr(default, k)}


def warm_start_head(section: EagleSection, folder: str, target, n_layers: int) -> EagleHead:
    """``head.init_from``: the trained head in ``folder`` on ``target``, to train further. Its layout must be the
    one ``section`` asks for (a different one would silently train another architecture than the recipe says)."""
    from decode.choose.heads import load_head
    from decode.common.io import resolve_repo_path

    head = load_head(resolve_repo_path(folder) or folder, target, expect="eagle")
    layers = section.layers(n_layers)
    wanted = {"features": section.features, "feature_layers": None if layers is None else tuple(layers),
              "layer": section.layer, "input_norm": section.input_norm,
              "fc_bias": section.fc_bias and section.layer == "eagle1"}  # an eagle3 layer has no fc
    have = {"features": "fused" if head.fused else "final",
            "feature_layers": tuple(head.feature_layers) if head.fused else None, "layer": head.layer,
            "input_norm": head.input_norm, "fc_bias": head.fc_bias}
    diffs = [f"head.{k}={wanted[k]!r} here, {have[k]!r} there" for k in wanted if wanted[k] != have[k]]
    if diffs:
        raise UserError(f"head.init_from={folder}: that head's layout differs from this recipe's ({'; '.join(diffs)}); "
                        "set those fields as the head has them, or drop head.init_from")
    return head.train()


def _cached_tensors(target, layers: tuple[int, ...]):
    """What the feature cache stores per example: exactly the inputs :func:`target_hidden_states` reads back
    (``target_final`` only when the head's input is not the final state itself)."""
    def compute(batch: dict) -> dict:
        feats, final = target_hidden_states(target, batch, layers)
        return {"target_hidden": feats} if tuple(layers) == (-1,) else {"target_hidden": feats, "target_final": final}
    return compute


def train(recipe: EagleRecipe) -> dict:
    from toolkit.config import to_dict

    # EAGLE-3-style runs default to their own folder (runs/heads/eagle3/<task>), so both styles can sit side by side
    eagle3 = recipe.head.features == "fused" or recipe.head.ttt_steps > 1
    warm = recipe.head.init_from
    st = text_setup(recipe, "eagle3" if eagle3 else KIND, build_vocab=warm is None)
    n_layers = st.target.config.num_hidden_layers
    if warm is not None:
        head = warm_start_head(recipe.head, warm, st.target, n_layers)
        st.vocab = head.draft_vocab
        print(f"warm start from {warm}: its weights and its draft vocabulary "
              f"({'full' if st.vocab is None else len(st.vocab)} tokens)", flush=True)
    else:
        head = EagleHead(st.target, init=recipe.head.init, draft_vocab=st.vocab, input_norm=recipe.head.input_norm,
                         fc_bias=recipe.head.fc_bias, feature_layers=recipe.head.layers(n_layers),
                         layer=recipe.head.layer)
    fp = head_fingerprint(recipe, KIND, st.place, examples=len(st.train), head=_fingerprint(recipe.head),
                          draft_vocab=to_dict(recipe.draft_vocab))
    train_ds, collate = with_feature_cache(
        recipe.feature_cache, st.out, st.train, collator(st.tokenizer), _cached_tensors(st.target, head.target_layers),
        {"target": recipe.target, "layers": list(head.target_layers), "max_length": recipe.data.max_length},
        st.place.device, recipe.progress)
    run = fit(EagleTrainModule(st.target, head), make_loss(recipe.head), train_ds, collate, recipe, st.out, fp,
              st.place)
    trained = run.module
    if trained is None:
        return {}
    heldout = _heldout(trained, st, recipe)
    # the warm start (loaded again: training changed ``head`` in place) scored on the same held-out rows, so the run
    # record says what training added; here, where only the main process arrives, not on every rank before training
    initial = None if warm is None else _heldout(
        EagleTrainModule(st.target, warm_start_head(recipe.head, warm, st.target, n_layers)), st, recipe)
    if initial is not None:
        print(f"held-out first-token agreement: {initial['top1_agreement']:.4f} before training (the warm start), "
              f"{heldout['top1_agreement']:.4f} after", flush=True)
    return finish(trained.head, recipe, KIND, st.out, run, train_examples=st.train_examples(),
                  trainable_params=count_trainable(trained.head),
                  feature=(f"fused target layers {list(head.feature_layers)}" if head.fused
                           else "post-norm final hidden state (LM-head input)"),
                  draft_vocab=st.vocab_info(), heldout=heldout,
                  **({"heldout_init": initial} if initial is not None else {}))


def _heldout(module: EagleTrainModule, st, recipe: EagleRecipe) -> dict | None:
    """:func:`heldout_agreement` on the run's held-out rows at every trained step (None without held-out rows)."""
    if not len(st.heldout):
        return None
    with st.place.autocast():
        return heldout_agreement(module, st.heldout, recipe.progress, recipe.head.ttt_steps)


def main(argv=None) -> int:
    """``python -m toolkit train eagle`` (scripts/train_eagle.py)."""
    from .cli import main_for
    return main_for(KIND, argv)
