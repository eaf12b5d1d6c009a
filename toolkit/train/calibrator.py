"""Cali-TS calibration predictor recipe (`make train-calibrator TASK=...`).

1. Collect: decode distilled prompts greedily with a trained self-drafting arm (early exit by
   default; any arm exposing ``calibration_features``) at a fixed L against the target; every
   scored draft position i (1..min(accepted+1, drafted)) becomes a row (H_t^(T), H_{t+i}^(D), i,
   label = accepted, drafter top-1 probability). Positions after the first rejection were never
   scored by the target under the committed prefix and are not used.
2. Train θ_M = σ(MLP([W^{min(i,10)} H_t^(T), H^(D)])) with binary cross-entropy (≡ the paper's
   2-way softmax CE) through the shared Trainer.
3. Report AUROC and expected calibration error on rounds of held-out prompts, next to the
   drafter's own top-1 probability as the baseline predictor.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from decode.common.errors import UserError
from decode.common.io import atomic_path, atomic_write_text
from decode.choose.heads import CalibrationPredictor, load_head, read_head_config

from .data import is_heldout
from .heads import (HeadRecipe, count_trainable, finish, fit, head_fingerprint, head_placement,
                    load_distilled_examples, load_frozen_target, out_dir_of)

KIND = "calibrator"
DATA_FILE = "calibration_rows.safetensors"


@dataclass
class CollectSection:
    drafter: str | None = None  # trained head folder (early_exit or eagle); null = runs/heads/early_exit/<task>
    L: int = 6  # fixed draft length while collecting
    prompts: int = 10  # distinct distilled prompts decoded
    max_new_tokens: int = 48
    heldout_fraction: float = 0.25  # share of prompts (by hash) whose rounds are held out

    def __post_init__(self):
        if self.L < 1 or self.prompts < 2 or self.max_new_tokens < 2:
            raise UserError("collect.L >= 1, collect.prompts >= 2 and collect.max_new_tokens >= 2 are required")
        if not 0 < self.heldout_fraction < 1:
            raise UserError(f"collect.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")


@dataclass
class CalibratorSection:
    mlp_hidden: int = 256  # 0 = the paper's single linear layer
    max_pos: int = 10


@dataclass
class CalibratorRecipe(HeadRecipe):
    head: CalibratorSection = field(default_factory=CalibratorSection)
    collect: CollectSection = field(default_factory=CollectSection)


# --------------------------------------------------------------------------- metrics

def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve = P(score of a positive > score of a negative), ties count ½."""
    s, y = scores.double().flatten(), labels.bool().flatten()
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(s)
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, len(s) + 1, dtype=torch.float64)
    # average ranks over ties
    uniq, inv, counts = torch.unique(s, return_inverse=True, return_counts=True)
    if (counts > 1).any():
        sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, ranks)
        ranks = (sums / counts)[inv]
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def ece(probs: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> float:
    """Expected calibration error with equal-width bins: Σ_b |B|/N · |mean(p) − mean(y)| over B."""
    p, y = probs.double().flatten().clamp(0, 1), labels.double().flatten()
    idx = (p * bins).long().clamp(max=bins - 1)
    total = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            total += float(m.sum()) / len(p) * abs(float(p[m].mean() - y[m].mean()))
    return total


# --------------------------------------------------------------------------- collection

def _build_arm(folder: str, target_model, target, tok, L: int):
    from decode.choose.arms.eagle import EagleArm
    from decode.choose.arms.early_exit import EarlyExitArm
    from decode.core.sampling import SamplingConfig

    kind = read_head_config(folder).get("kind")
    head = load_head(folder, target_model)
    greedy = SamplingConfig()
    if kind == "early_exit":
        return EarlyExitArm(head, greedy, L, target=target)
    if kind == "eagle":
        return EagleArm(head, target_model, greedy, L, target=target)
    raise UserError(f"collect.drafter={folder} holds a '{kind}' head; use an early_exit or eagle head")


@torch.inference_mode()
def collect_rows(recipe: CalibratorRecipe, target_model, tok, progress: bool = True) -> dict[str, torch.Tensor]:
    from tqdm.auto import tqdm

    from decode.choose.arms.base import Arm
    from decode.engine.loop import SpecEngine
    from decode.choose.policies.simple import Fixed
    from decode.core.sampling import SamplingConfig
    from decode.evaluation.suites import encode_prompt
    from decode.core.target import Target
    from decode.core.verify import Verifier

    c = recipe.collect
    folder = c.drafter or f"runs/heads/early_exit/{recipe.task}"
    target = Target(target_model, tok, want_hidden=True)
    inner = _build_arm(folder, target_model, target, tok, c.L)

    class Recording(Arm):  # records what a predictor would see at each draft position
        uses_target_hidden = True

        def __init__(self):
            super().__init__(inner.L)
            self.log = []

        def reset(self, prompt_ids):
            inner.reset(prompt_ids)

        def propose(self, context, max_len, keep_going=None):
            d = inner.propose(context, max_len, keep_going)
            ht = inner.calibration_features(1)[0] if len(d) else None
            self.log.append((ht, d.hidden, None if d.q is None else d.q.max(-1).values))
            return d

        def observe(self, context, hidden=None):
            inner.observe(context, hidden)

    arm = Recording()
    engine = SpecEngine(target, [arm], Verifier(SamplingConfig()), eos_token_ids=[tok.eos_token_id])
    prompts = list(dict.fromkeys(load_distilled_examples(recipe)["prompt"]))[: c.prompts]
    cols = {k: [] for k in ("h_target", "h_draft", "pos", "label", "top1", "heldout")}
    for p in tqdm(prompts, desc="collecting draft rounds", disable=not progress):
        arm.log = []
        gen = engine.generate(encode_prompt(tok, p), Fixed(1, c.L), c.max_new_tokens)
        held = is_heldout(p, c.heldout_fraction)
        for rec, (ht, hd, top1) in zip(gen.rounds, arm.log):
            for i in range(1, min(rec.accepted + 1, rec.drafted) + 1):
                cols["h_target"].append(ht)
                cols["h_draft"].append(hd[i - 1])
                cols["pos"].append(i)
                cols["label"].append(float(i <= rec.accepted))
                cols["top1"].append(float(top1[i - 1]))
                cols["heldout"].append(held)
    if not cols["pos"]:
        raise UserError("collection produced no draft positions; check collect.drafter and the prompts")
    return {"h_target": torch.stack(cols["h_target"]).float(), "h_draft": torch.stack(cols["h_draft"]).float(),
            "pos": torch.tensor(cols["pos"]), "label": torch.tensor(cols["label"]),
            "top1": torch.tensor(cols["top1"]), "heldout": torch.tensor(cols["heldout"])}


def load_or_collect(recipe: CalibratorRecipe, out: Path, target_model, tok, place=None) -> dict[str, torch.Tensor]:
    """Collected rows are cached in ``out`` (keyed by the collect section) so a resumed run skips it."""
    from safetensors.torch import load_file, save_file

    from toolkit.config import to_dict

    key = json.dumps({"collect": to_dict(recipe.collect), "target": recipe.target, "task": recipe.task},
                     sort_keys=True)
    path = out / DATA_FILE
    if path.is_file() and (out / (DATA_FILE + ".json")).is_file() and \
            (out / (DATA_FILE + ".json")).read_text() == key:
        return load_file(str(path))
    with place.autocast() if place is not None else contextlib.nullcontext():  # the numbers training will see
        rows = {k: v.cpu() for k, v in collect_rows(recipe, target_model, tok, recipe.progress).items()}
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in rows.items()}, str(tmp))
    atomic_write_text(out / (DATA_FILE + ".json"), key)
    return rows


class RowDataset(torch.utils.data.Dataset):
    def __init__(self, rows: dict[str, torch.Tensor], mask: torch.Tensor):
        # "accepted", not "label": HF's default collator renames a "label" key to "labels"
        self.rows = {"h_target": rows["h_target"][mask], "h_draft": rows["h_draft"][mask], "pos": rows["pos"][mask],
                     "accepted": rows["label"][mask]}

    def __len__(self):
        return len(self.rows["pos"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.rows.items()}


def loss_fn(model: CalibrationPredictor, inputs):
    logits = model(inputs["h_target"], inputs["h_draft"], inputs["pos"])
    loss = F.binary_cross_entropy_with_logits(logits, inputs["accepted"].float())
    return loss, {"bce": loss.item()}


def evaluate(model: CalibrationPredictor, rows, mask) -> dict:
    dev = next(model.parameters()).device
    with torch.no_grad():
        theta = torch.sigmoid(model(*(rows[k][mask].to(dev) for k in ("h_target", "h_draft", "pos")))).float().cpu()
    y, top1 = rows["label"][mask], rows["top1"][mask]
    return {"rows": int(mask.sum()), "positive_rate": float(y.mean()) if len(y) else float("nan"),
            "predictor": {"auroc": auroc(theta, y), "ece": ece(theta, y),
                          "brier": float(((theta - y) ** 2).mean())},
            "top1_baseline": {"auroc": auroc(top1, y), "ece": ece(top1, y),
                              "brier": float(((top1 - y) ** 2).mean())}}


def train(recipe: CalibratorRecipe) -> dict:
    from transformers import default_data_collator

    from toolkit.config import to_dict

    out = out_dir_of(recipe, KIND)
    place = head_placement(recipe)
    target, tok = load_frozen_target(recipe.target, place)
    rows = load_or_collect(recipe, out, target, tok, place)
    held = rows["heldout"].bool()
    if held.all() or not held.any():
        raise UserError("the collected rounds are all on one side of the held-out split; raise collect.prompts "
                        "or change collect.heldout_fraction")
    d_draft = rows["h_draft"].shape[1]
    model = CalibrationPredictor(target.config.hidden_size, d_draft, recipe.head.mlp_hidden, recipe.head.max_pos)
    train_ds = RowDataset(rows, ~held)
    fp = head_fingerprint(recipe, KIND, place, rows=len(train_ds), head=to_dict(recipe.head),
                          collect=to_dict(recipe.collect))
    run = fit(model, loss_fn, train_ds, default_data_collator, recipe, out, fp, place)
    trained = run.module
    if trained is None:
        return {}
    trained.eval()
    with place.autocast():
        metrics = {"train": evaluate(trained, rows, ~held), "heldout": evaluate(trained, rows, held)}
    return finish(trained, recipe, KIND, out, run,
                  drafter=recipe.collect.drafter or f"runs/heads/early_exit/{recipe.task}",
                  trainable_params=count_trainable(trained), train_rows=len(train_ds), **metrics)


def main(argv=None) -> int:
    """``python -m toolkit train calibrator`` (scripts/train_calibrator.py)."""
    from .cli import main_for
    return main_for(KIND, argv)
