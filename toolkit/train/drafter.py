"""Task-specialised independent drafters (MetaSD, ALGORITHMS.md §3), trained on self-distilled data.

A recipe (``recipes/drafters/*.yaml``, schema :class:`DrafterRecipe`) picks the model — a new
Llama-architecture decoder on the target's vocabulary (embeddings optionally from the target,
projected when the widths differ; tied LM head), or an existing HF model fine-tuned in full or
with LoRA — and the loss: SFT on the target's responses, optionally mixed with a KD term against the
frozen target (forward KL or TRL's generalised JSD). Two-stage training is two runs: ``--task all``
(every distilled task) then ``--task <t>`` with ``model.source=pretrained`` pointing at the first
export. The run ends with an export folder and its held-out agreement/acceptance.

Draft vocabulary (``draft_vocab``, FR-Spec; decode/core/vocab.py): after training, the most frequent tokens
of the target's own responses in the training split plus the special tokens — by default the fewest
that cover 95% of them, as for the EAGLE and early-exit heads — are saved in the export as
``draft_vocab.safetensors``; the ``drafter`` arm drafts from them (``vocab=auto``). On a MetaSD-shaped
drafter the [V, d] LM head costs more than its decoder layers, so this is where a drafted token's cost
goes down. Training stays over the full vocabulary: the pruned drafter's distribution is the trained
one renormalised over the subset, the subset can be re-chosen (``draft_vocab.*`` overrides, same
checkpoints) without retraining, and a two-stage run fine-tunes a full model. ``draft_vocab: null``
exports a full-vocabulary drafter. The held-out evaluation measures the drafter as the arm runs it and,
beside it, with the full vocabulary (``full_vocab``), so the report shows what the subset costs.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from decode.common.errors import UserError
from decode.common.io import atomic_write_json
from decode.core.models import DEFAULT_TARGET, check_vocab_compatible, load_model

from ..config import DraftVocabSection, to_dict
from .data import DataSection, collator, load_examples, split_heldout, tokenize_sft
from .runtime import (Placement, TrainSection, deepspeed_config, is_main_process, placement, run_training,
                      train_fingerprint)


@dataclass
class LoraSection:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])

    def __post_init__(self):
        if self.enabled and self.r < 1:
            raise UserError(f"model.lora.r must be >= 1, got {self.r}")


@dataclass
class ModelSection:
    source: Literal["new", "pretrained"] = "new"  # new decoder from the shape below, or fine-tune `path`
    path: str | None = None  # pretrained: HF folder, hub id, alias or an earlier export (two-stage)
    layers: int = 2
    hidden: int = 768
    heads: int = 12
    kv_heads: int | None = None  # default = heads
    intermediate: int | None = None  # default = 4 × hidden (MetaSD's Llama-68M shape)
    max_positions: int = 2048
    init_embeddings: Literal["target", "random"] = "target"  # target: copy, or project to `hidden`
    init_layers: list[int] = field(default_factory=list)  # copy these target layers (same layer shape only)
    freeze_embeddings: bool = False  # keep the (tied) embeddings/LM head fixed: faster on CPU
    lora: LoraSection = field(default_factory=LoraSection)

    def __post_init__(self):
        if self.source == "pretrained" and not self.path:
            raise UserError("model.source=pretrained needs model.path (an HF model folder, hub id, alias or export)")
        if self.source == "new":
            kv = self.kv_heads or self.heads
            if min(self.layers, self.hidden, self.heads, kv) < 1:
                raise UserError("model.layers, model.hidden, model.heads and model.kv_heads must be >= 1")
            if self.hidden % self.heads:
                raise UserError(f"model.hidden={self.hidden} must be divisible by model.heads={self.heads}")
            if self.heads % kv:
                raise UserError(f"model.heads={self.heads} must be divisible by model.kv_heads={kv}")
            if self.lora.enabled:
                raise UserError("model.lora.enabled needs model.source=pretrained (LoRA adapts an existing model); "
                                "a new drafter trains all its weights")
            if any(i < 0 for i in self.init_layers) or len(self.init_layers) > self.layers:
                raise UserError(f"model.init_layers={self.init_layers}: give at most model.layers={self.layers} "
                                f"non-negative target layer indices")


@dataclass
class KDSection:
    weight: float = 0.0  # loss = (1 − weight)·SFT + weight·KD; 0 = SFT only (no target forward)
    divergence: Literal["forward_kl", "jsd"] = "forward_kl"
    beta: float = 0.5  # generalised JSD interpolation (TRL GKD: 0 = forward KL, 1 = reverse KL)
    temperature: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.weight <= 1.0:
            raise UserError(f"kd.weight must be in [0, 1], got {self.weight}")
        if not 0.0 <= self.beta <= 1.0:
            raise UserError(f"kd.beta must be in [0, 1], got {self.beta}")
        if self.temperature <= 0:
            raise UserError(f"kd.temperature must be > 0, got {self.temperature}")


@dataclass
class EvalSection:
    enabled: bool = True
    L: int = 4  # draft length for the expected-MAT estimate


@dataclass
class DrafterRecipe:
    name: str  # runs go to <out_root>/<name>/<task>/
    target: str = DEFAULT_TARGET
    out_root: str = "runs/drafters"
    out_dir: str | None = None  # overrides <out_root>/<name>/<task>
    resume: str = "auto"  # auto (latest checkpoint of the same setup) | never | <checkpoint folder>
    trust_remote_code: bool = False
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    kd: KDSection = field(default_factory=KDSection)
    eval: EvalSection = field(default_factory=EvalSection)
    draft_vocab: DraftVocabSection | None = field(default_factory=DraftVocabSection)  # null = full vocabulary


# --------------------------------------------------------------------------- models

def project_embeddings(E: torch.Tensor, hidden: int, seed: int = 0) -> torch.Tensor:
    """Target embeddings [V, d] → [V, hidden]: a copy, the top principal directions (narrower), or a
    random isometry (wider), so the drafter starts from the target's token geometry. Computed on the CPU:
    the same initial drafter whatever device holds the target."""
    E = E.detach().float().cpu()
    d = E.shape[1]
    if hidden == d:
        return E.clone()
    if hidden < d:
        centred = E - E.mean(0)
        _, vecs = torch.linalg.eigh(centred.T @ centred)  # ascending eigenvalues
        return E @ vecs[:, -hidden:].flip(-1)
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=g))
    return E @ q[:d]


def _new_config(section: ModelSection, target):
    from transformers import LlamaConfig

    tc = target.config
    extra = {}
    rope = getattr(tc, "rope_parameters", None)
    if rope:
        extra["rope_parameters"] = dict(rope)
    return LlamaConfig(
        vocab_size=target.get_output_embeddings().weight.shape[0],
        hidden_size=section.hidden,
        intermediate_size=section.intermediate or 4 * section.hidden,
        num_hidden_layers=section.layers,
        num_attention_heads=section.heads,
        num_key_value_heads=section.kv_heads or section.heads,
        max_position_embeddings=section.max_positions,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        tie_word_embeddings=True,
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=getattr(tc, "eos_token_id", None),
        pad_token_id=getattr(tc, "pad_token_id", None),
        **extra,
    )


def _copy_target_layers(model, target, section: ModelSection) -> None:
    tc, dc = target.config, model.config
    same = ["hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size"]
    diff = [k for k in same if getattr(tc, k, None) != getattr(dc, k)]
    layers = getattr(getattr(target, "model", None), "layers", None)
    if diff or layers is None:
        raise UserError(f"model.init_layers copies target layers, so the drafter's layer shape must equal the "
                        f"target's; differing: {', '.join(diff) or 'target has no model.layers'} — set model.hidden/"
                        "heads/kv_heads/intermediate to the target's "
                        f"({', '.join(f'{k}={getattr(tc, k, None)}' for k in same)})"
                        f" or model.init_layers=[]")
    for j, i in enumerate(section.init_layers):
        if i >= len(layers):
            raise UserError(f"model.init_layers: target has {len(layers)} layers, index {i} is out of range")
        model.model.layers[j].load_state_dict(layers[i].state_dict())
    model.model.norm.load_state_dict(target.model.norm.state_dict())


def build_drafter(section: ModelSection, target, target_tok, *, init: bool = True, trust_remote_code: bool = False):
    """The drafter to train (``init=False``: same structure, weights to be loaded afterwards)."""
    if section.source == "pretrained":
        model, tok = load_model(section.path, trust_remote_code=trust_remote_code)
        check_vocab_compatible(target_tok, tok, drafter_name=section.path,
                               target_vocab_size=target.get_output_embeddings().weight.shape[0],
                               drafter_vocab_size=model.get_output_embeddings().weight.shape[0])
        if (Path(section.path) / "drafter.json").is_file():
            from ..export import check_target
            check_target(section.path, target_tok)
    else:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(_new_config(section, target))
        if init and section.init_embeddings == "target":
            with torch.no_grad():
                model.get_input_embeddings().weight.copy_(
                    project_embeddings(target.get_input_embeddings().weight, section.hidden))
            model.tie_weights()
        if init and section.init_layers:
            _copy_target_layers(model, target, section)
    if section.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    if section.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lc = section.lora
        model = get_peft_model(model, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                                 target_modules=list(lc.target_modules), task_type="CAUSAL_LM"))
    model.train()
    return model


# --------------------------------------------------------------------------- loss

def make_loss(kd: KDSection, target=None):
    """SFT cross-entropy on response tokens, mixed with KD against the frozen target when kd.weight > 0."""
    jsd = None
    if kd.weight > 0:
        if target is None:
            raise ValueError("kd.weight > 0 needs the target model")
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.gkd import GKDTrainer

        jsd = GKDTrainer.generalized_jsd_loss
        target.eval().requires_grad_(False)
    beta = 0.0 if kd.divergence == "forward_kl" else kd.beta

    def loss_fn(model, inputs):
        ids, attn = inputs["input_ids"], inputs.get("attention_mask")
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        labels = inputs["labels"][:, 1:]
        mask = labels != -100
        q = logits[mask].float()
        if q.shape[0] == 0:
            zero = logits.sum() * 0.0
            return zero, {}
        sft = F.cross_entropy(q, labels[mask])
        if jsd is None:
            return sft, {"sft_loss": sft.item()}
        if next(target.parameters()).device != ids.device:
            target.to(ids.device)
        with torch.no_grad():
            p = target(input_ids=ids, attention_mask=attn).logits[:, :-1][mask].float()
        kdl = jsd(q, p, beta=beta, temperature=kd.temperature)
        loss = (1.0 - kd.weight) * sft + kd.weight * kdl
        return loss, {"sft_loss": sft.item(), "kd_loss": kdl.item()}

    return loss_fn


# --------------------------------------------------------------------------- run

def out_dir_for(recipe: DrafterRecipe, task: str) -> Path:
    return Path(recipe.out_dir) if recipe.out_dir else Path(recipe.out_root) / recipe.name / task


def _fingerprint(recipe: DrafterRecipe, task: str, place: Placement) -> dict:
    """What a checkpoint depends on; resume=auto refuses checkpoints whose setup differs."""
    d = to_dict(recipe)
    train = train_fingerprint(recipe.train, place, ignore=("max_steps", "epochs", "logging_steps", "save_steps",
                                                           "save_total_limit", "dataloader_workers"))
    data = {k: v for k, v in d["data"].items() if k != "heldout_max"}
    return {"task": task, "target": recipe.target, "model": d["model"], "data": data, "kd": d["kd"], "train": train}


def train_drafter(recipe: DrafterRecipe, task: str, *, recipe_file: str | None = None, callbacks=()) -> Path:
    """Train, export and evaluate one drafter; returns the export folder."""
    from transformers import set_seed

    from ..export import export_model, write_eval

    if not task or "/" in task:
        raise UserError(f"--task must be a task name (e.g. math, code, chat) or 'all', got {task!r}")
    out = out_dir_for(recipe, task)
    ds_cfg = deepspeed_config(recipe.train.deepspeed)  # fail fast on a bad config
    place = placement(recipe.train, deepspeed=ds_cfg is not None)  # and on a device/dtype this machine lacks
    main = is_main_process()
    set_seed(recipe.train.seed)

    examples = load_examples(recipe.data, task)  # before the target: a data problem fails in a second
    # frozen (KD teacher, initial weights): float32 on the training device; its forwards run under autocast
    target, ttok = load_model(recipe.target, device=place.device, dtype=torch.float32,
                              trust_remote_code=recipe.trust_remote_code)
    if ttok.pad_token_id is None:
        ttok.pad_token = ttok.eos_token
    train_raw, held_raw = split_heldout(examples, recipe.data)
    train_ds = tokenize_sft(train_raw, ttok, recipe.data.max_length)
    held_ds = tokenize_sft(held_raw, ttok, recipe.data.max_length) if len(held_raw) else None
    if len(train_ds) == 0:
        raise UserError(f"no trainable examples: every response was cut away by data.max_length="
                        f"{recipe.data.max_length}; raise it")

    model = build_drafter(recipe.model, target, ttok, trust_remote_code=recipe.trust_remote_code)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if main:
        print(f"[train-drafter] task={task} recipe={recipe.name} examples={len(train_ds)} held-out="
              f"{len(held_ds) if held_ds else 0} trainable params={trainable:,} deepspeed="
              f"{recipe.train.deepspeed or 'off'} device={place.device} dtype={str(place.dtype)[6:]} out={out}",
              flush=True)

    def rebuild():
        return build_drafter(recipe.model, target, ttok, init=False, trust_remote_code=recipe.trust_remote_code)

    run = run_training(model, make_loss(recipe.kd, target), train_ds, collator(ttok), section=recipe.train,
                       resume=recipe.resume, out=out, fingerprint=_fingerprint(recipe, task, place), place=place,
                       processing_class=ttok, callbacks=callbacks, rebuild=rebuild, tag="train-drafter")
    module = run.module
    export = out / "export"
    if module is not None:
        from .heads import build_draft_vocab

        module = module.to("cpu").eval()
        vocab = build_draft_vocab(recipe.draft_vocab, train_ds, ttok, target)  # the target's own output tokens
        summary = {**run.summary(), "examples": len(train_ds), "trainable_parameters": trainable}
        recipe_dict = {**to_dict(recipe), "file": recipe_file}
        export_model(module, ttok, export, target=recipe.target, target_tokenizer=ttok, task=task,
                     recipe=recipe_dict, extra={"training": summary,
                                                "draft_vocab": None if vocab is None else vocab.info})
        if vocab is not None:
            vocab.save(export)
        atomic_write_json(out / "train_summary.json", summary, indent=2, sort_keys=True)
        if recipe.eval.enabled and held_ds is not None and len(held_ds):
            metrics = _heldout_eval(export, vocab, target.to(place.device).eval(), held_ds, place, recipe.eval.L)
            write_eval(export, metrics)
            print(f"[train-drafter] held-out: agreement={metrics['agreement']:.3f} acceptance(1-TV)="
                  f"{metrics['acceptance']:.3f} over {metrics['positions']} positions; export → {export}", flush=True)
        else:
            print(f"[train-drafter] export → {export} (no held-out evaluation)", flush=True)
    run.trainer.accelerator.wait_for_everyone()
    return export


def _heldout_eval(export: Path, vocab, target, held_ds, place: Placement, L: int) -> dict:
    """Held-out agreement/acceptance of the export as the decode arm loads it (its draft vocabulary
    included), plus the full-vocabulary figures and the vocabulary's size/coverage when it has one."""
    from decode.choose.arms.model import DraftVocabLM

    from .metrics import heldout_agreement

    drafter, _ = load_model(str(export), device=place.device)  # what the decode arm will load
    with place.autocast():
        if vocab is None:
            return {**heldout_agreement(drafter, target, held_ds, L=L), "draft_vocab": None}
        metrics = heldout_agreement(DraftVocabLM(drafter, vocab), target, held_ds, L=L)
        full = heldout_agreement(drafter, target, held_ds, L=L)
    keep = ("agreement", "acceptance", "label_accuracy", "drafter_nll", "expected_mat_greedy", "expected_mat_sampled")
    return {**metrics, "draft_vocab": vocab.info, "full_vocab": {k: full[k] for k in keep}}


def train(recipe: DrafterRecipe, task: str, recipe_file: str | None = None) -> Path:
    """The catalog's entry (:mod:`.kinds`): ``python -m toolkit train drafter``."""
    return train_drafter(recipe, task, recipe_file=recipe_file)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``python -m toolkit train-drafter`` (= ``train drafter``, kept for existing command lines)."""
    from .cli import add_kind_arguments

    add_kind_arguments(parser, "drafter")


def run(args) -> int:
    """UserErrors propagate to the CLI."""
    from .cli import run_kind

    return run_kind("drafter", args)


def main(argv: list[str] | None = None) -> int:
    """``scripts/train_drafter.py`` (python, torchrun or deepspeed: the command line is the same)."""
    from .cli import main_for

    return main_for("drafter", argv)
