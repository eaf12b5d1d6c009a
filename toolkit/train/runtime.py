"""HF ``Trainer`` + DeepSpeed plumbing shared by every trained artifact.

The same command runs as ``python``, ``torchrun`` or ``deepspeed`` (CPU accelerator + gloo here, GPUs
and several nodes elsewhere): the launcher only sets rank environment variables, and the DeepSpeed
config is a JSON file from ``recipes/deepspeed`` whose "auto" values the Trainer fills in.
Artifacts supply a model and a ``loss_fn``; :func:`run_training` does the rest once for every kind (resume
check, run record, training arguments, the loss trainer, a time budget, throughput, gathering the trained
weights, also from ZeRO-3 shards).

Time budget (``train.max_minutes``): training stops after the first optimizer step past the budget, saves a
checkpoint there and returns as at ``max_steps`` (the caller exports); rerunning the same command resumes
from that checkpoint for another budget. Throughput: tokens (attention-mask positions; rows for inputs
without a mask) per second of training, in the progress logs and the run's summary.

Device and dtype (``train.device``, ``train.dtype``; :func:`placement`): ``auto`` trains on CUDA when a GPU
is visible (each process of a multi-process launch on GPU ``LOCAL_RANK``), else on the CPU; ``train.dtype``
is the *compute* dtype of mixed precision — ``auto`` = bfloat16 on a GPU that supports it, float32
elsewhere. Weights, the trained ones and the frozen target's, stay float32 (master copies); every forward
inside the loss (the trained model's, the frozen target's features / KD logits) runs under autocast in
that dtype, and DeepSpeed's bf16/fp16 sections follow it. ``float16`` needs a GPU (a loss-scaled fp16
step has no CPU path): on a CPU it is an error, as are a GPU that is not there, ``bfloat16`` on a GPU
without it, and ``cpu`` with DeepSpeed on a GPU machine (DeepSpeed picks its accelerator from the hardware).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch
from transformers import Trainer, TrainerCallback

from decode.common.errors import UserError
from decode.common.io import atomic_write_json

from ..config import DTypeName, check_device_spec, resolve_device_field, to_dict

REPO_ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED_DIR = REPO_ROOT / "recipes" / "deepspeed"


@dataclass
class TrainSection:
    max_steps: int = -1  # > 0 overrides epochs (`make train-drafter MAX_STEPS=n` for smoke runs)
    epochs: float = 1.0
    max_minutes: float | None = None  # time budget: stop (checkpoint + export) after this much training; null = none
    batch_size: int = 8  # per device
    grad_accum: int = 1
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup: float = 0.03  # < 1: share of the total steps; >= 1: number of steps
    scheduler: str = "cosine"  # any transformers lr_scheduler_type
    max_grad_norm: float = 1.0
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda[:N]: auto = CUDA when a GPU is visible (GPU LOCAL_RANK per process)
    dtype: DTypeName = "auto"  # compute dtype (mixed precision): auto = bfloat16 on a bf16 GPU, else float32
    deepspeed: str | None = "zero2"  # recipes/deepspeed/<name>.json or a path; null = no DeepSpeed
    logging_steps: int = 10
    save_steps: int = 200  # checkpoint every n optimizer steps (resume restarts from the latest)
    save_total_limit: int = 2
    gradient_checkpointing: bool = False
    dataloader_workers: int = 0
    renamed_fields: ClassVar[dict[str, str]] = {"precision": "train.dtype (auto|float32|bfloat16|float16)"}

    def __post_init__(self):
        check_device_spec(self.device, "train.device")
        for name in ("batch_size", "grad_accum", "logging_steps", "save_steps", "save_total_limit"):
            if getattr(self, name) < 1:
                raise UserError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise UserError("train.max_steps must be a positive number of steps or -1 (use epochs), "
                            f"got {self.max_steps}")
        if self.max_steps == -1 and self.epochs <= 0:
            raise UserError(f"train.epochs must be > 0 when train.max_steps=-1, got {self.epochs}")
        if self.lr <= 0:
            raise UserError(f"train.lr must be > 0, got {self.lr}")
        if self.warmup < 0:
            raise UserError(f"train.warmup must be >= 0 (a ratio < 1 or a step count), got {self.warmup}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise UserError(f"train.max_minutes must be > 0 (minutes of training) or null (no budget), "
                            f"got {self.max_minutes}")


# --------------------------------------------------------------------------- launch environment

def ensure_process_group_env() -> None:
    """Plain ``python`` with DeepSpeed still needs rank variables; launchers (deepspeed, torchrun) set them."""
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


@dataclass(frozen=True)
class Placement:
    """Where this process computes: ``device`` and the compute ``dtype`` (weights stay float32)."""

    device: torch.device
    dtype: torch.dtype

    def autocast(self):
        """Autocast to the compute dtype (nothing for float32): wrap every forward outside the Trainer too
        (held-out metrics, data collection), so they see the numbers training saw."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def placement(section: TrainSection, *, deepspeed: bool = False) -> Placement:
    """Resolve ``train.device``/``train.dtype`` on this machine (module docstring); impossible choices are
    one-line errors naming the field, before any model loads."""
    dev = resolve_device_field(section.device, "train.device")
    if dev.type == "cuda":
        # the Trainer puts each process on GPU LOCAL_RANK (launchers) or on the first visible GPU (plain python)
        mine = int(os.environ.get("LOCAL_RANK", "0"))
        if dev.index is not None and dev.index != mine:
            raise UserError(f"train.device={section.device}: this process trains on cuda:{mine} (the trainer uses "
                            f"GPU LOCAL_RANK under a launcher, the first visible GPU otherwise); pick the GPU with "
                            f"CUDA_VISIBLE_DEVICES={dev.index} and train.device=cuda")
        if mine >= torch.cuda.device_count():
            raise UserError(f"train.device={section.device}: LOCAL_RANK={mine} but only {torch.cuda.device_count()} "
                            f"CUDA device(s) are visible; launch at most one process per GPU")
        dev = torch.device("cuda", mine)
    elif deepspeed and torch.cuda.is_available():
        raise UserError("train.device=cpu with train.deepspeed: DeepSpeed uses the GPU it finds; set "
                        "train.deepspeed=null to train on the CPU, or train.device=auto")
    spec = section.dtype
    bf16_ok = dev.type != "cuda" or torch.cuda.is_bf16_supported()
    if spec == "auto":
        spec = "bfloat16" if dev.type == "cuda" and bf16_ok else "float32"
    if spec == "float16" and dev.type != "cuda":
        raise UserError("train.dtype=float16 needs a CUDA device (fp16 mixed precision scales the loss on a GPU); "
                        "on the CPU use float32 (auto) or bfloat16")
    if spec == "bfloat16" and not bf16_ok:
        raise UserError(f"train.dtype=bfloat16: {torch.cuda.get_device_name(dev)} has no bfloat16 support; use "
                        f"float16, float32 or auto")
    return Placement(dev, getattr(torch, spec))


def train_fingerprint(section: TrainSection, place: Placement, ignore: tuple[str, ...] = ()) -> dict:
    """The train section as a checkpoint depends on it: the resolved compute dtype (``auto`` differs between
    machines), not the device (a run may resume on another device) nor the time budget (a stopped run
    resumes with another one); ``ignore`` drops more fields."""
    d = to_dict(section)
    for k in ("device", "max_minutes", *ignore):
        d.pop(k, None)
    d["dtype"] = str(place.dtype).removeprefix("torch.")
    return d


def deepspeed_config(name: str | None) -> dict | None:
    """Load a ZeRO config by name (``zero2`` → recipes/deepspeed/zero2.json) or path; None disables DeepSpeed."""
    if name in (None, "", "none"):
        return None
    p = Path(name)
    candidates = [p] if p.suffix == ".json" else []
    candidates += [DEEPSPEED_DIR / f"{name}.json", DEEPSPEED_DIR / name]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        avail = sorted(x.stem for x in DEEPSPEED_DIR.glob("*.json"))
        raise UserError(f"train.deepspeed={name!r}: no such DeepSpeed config; use one of {avail}, a path to a "
                        f"JSON file, or null to train without DeepSpeed")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"train.deepspeed: {path} is not valid JSON: {exc}") from None
    stage = cfg.get("zero_optimization", {}).get("stage") if isinstance(cfg, dict) else None
    if stage not in (0, 1, 2, 3):
        raise UserError(f"train.deepspeed: {path} needs zero_optimization.stage in 0..3")
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:
        raise UserError(f"train.deepspeed={name!r} but DeepSpeed is not importable ({exc}); install the pinned "
                        f"deepspeed or set train.deepspeed=null") from None
    return cfg


def training_arguments(section: TrainSection, ckpt_dir: Path, ds_config: dict | None,
                       place: Placement | None = None):
    """TrainingArguments from a recipe section. Build models *before* calling this: with ZeRO-3 the
    arguments switch transformers' loaders to partitioned construction."""
    from transformers import TrainingArguments

    place = place or placement(section, deepspeed=ds_config is not None)
    if ds_config is not None:
        ensure_process_group_env()
    args = TrainingArguments(
        output_dir=str(ckpt_dir),
        per_device_train_batch_size=section.batch_size,
        gradient_accumulation_steps=section.grad_accum,
        learning_rate=section.lr,
        weight_decay=section.weight_decay,
        warmup_steps=section.warmup if section.warmup < 1 else int(section.warmup),
        lr_scheduler_type=section.scheduler,
        max_grad_norm=section.max_grad_norm,
        max_steps=section.max_steps,
        num_train_epochs=section.epochs,
        seed=section.seed,
        data_seed=section.seed,
        logging_steps=section.logging_steps,
        save_strategy="steps",
        save_steps=section.save_steps,
        save_total_limit=section.save_total_limit,
        activation_checkpointing=section.gradient_checkpointing,
        dataloader_num_workers=section.dataloader_workers,
        remove_unused_columns=False,
        report_to=[],
        deepspeed=ds_config,
        use_cpu=place.device.type == "cpu",
        bf16=place.dtype == torch.bfloat16,
        fp16=place.dtype == torch.float16,
    )
    if ds_config is None and place.device.type == "cuda" and torch.cuda.device_count() > 1 and args.n_gpu > 1:
        args._n_gpu = 1  # one process trains on one GPU (HF would wrap DataParallel); more GPUs: one process each
    return args


# --------------------------------------------------------------------------- trainer

# loss_fn(model, inputs) -> (mean loss over this micro-batch, {name: float} to log)
LossFn = Callable[[torch.nn.Module, dict], "tuple[torch.Tensor, dict[str, float]]"]


class LossTrainer(Trainer):
    """HF Trainer whose loss comes from an artifact's ``loss_fn``.

    ``loss_fn`` returns the mean over its micro-batch; the Trainer divides by the accumulation steps
    (the same convention for every artifact, whatever its model's forward accepts). Extra values
    the loss function reports (e.g. the SFT and KD terms) are averaged into the log lines.
    """

    loss_is_scaled_for_ga = False

    def __init__(self, *args, loss_fn: LossFn, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_fn = loss_fn
        self.model_accepts_loss_kwargs = False
        self._extra: dict[str, list[float]] = defaultdict(list)
        self.tokens_seen = 0  # this call of train(); this process until run_training sums the processes
        self.token_unit = "tokens"
        self.train_seconds = 0.0
        self._t0: float | None = None

    def train(self, *args, **kwargs):
        self.tokens_seen, self._t0 = 0, time.perf_counter()
        try:
            return super().train(*args, **kwargs)
        finally:
            self.train_seconds = time.perf_counter() - self._t0

    def tokens_per_second(self) -> float:
        elapsed = (time.perf_counter() - self._t0) if self._t0 is not None else 0.0
        return self.tokens_seen / elapsed if elapsed > 0 else 0.0

    def _count(self, inputs: dict) -> None:
        mask = inputs.get("attention_mask")
        if mask is not None:
            self.tokens_seen += int(mask.sum())
        else:  # row data (the calibrator): count rows
            self.token_unit = "rows"
            first = next((v for v in inputs.values() if hasattr(v, "shape") and v.ndim), None)
            self.tokens_seen += int(first.shape[0]) if first is not None else 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self._count(inputs)
        with self._autocast():  # also the frozen target's and submodule forwards, which the Trainer's own
            loss, logs = self.loss_fn(model, inputs)  # autocast (around model.forward only) would miss
        if model.training:
            for k, v in logs.items():
                self._extra[k].append(float(v))
        return (loss, None) if return_outputs else loss

    def _autocast(self):
        dtype = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else None
        if dtype is None:
            return contextlib.nullcontext()
        if self.is_deepspeed_enabled:  # its engine runs its own forward in DeepSpeed's bf16/fp16 (same dtype);
            with contextlib.suppress(ImportError, AttributeError):  # its once-per-run notice says so: silence it
                import deepspeed.runtime.torch_autocast as ds_autocast
                ds_autocast._WARNED_NESTED_AUTOCAST = True
        return torch.autocast(self.args.device.type, dtype=dtype)

    def log(self, logs, *args, **kwargs):
        if self._extra and "loss" in logs:
            logs.update({k: round(sum(v) / len(v), 4) for k, v in self._extra.items()})
            self._extra.clear()
        if "loss" in logs and self._t0 is not None:
            logs[f"{self.token_unit}_per_s"] = round(self.tokens_per_second(), 1)
        super().log(logs, *args, **kwargs)


class TimeBudget(TrainerCallback):
    """Stops training after the first optimizer step past ``minutes`` of training (measured from the start of
    this ``train()`` call) and saves a checkpoint there; every rank stops at the same step."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60.0
        self.t0 = None
        self.stopped = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        over = time.perf_counter() - self.t0 >= self.seconds and state.global_step < state.max_steps
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = torch.tensor([float(over)], device=args.device)  # rank 0's clock differs from the others'
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            over = bool(flag.item())
        if over and not control.should_training_stop:
            self.stopped = True
            control.should_training_stop = True
            control.should_save = True
        return control


# --------------------------------------------------------------------------- one training run

@dataclass
class TrainRun:
    """What :func:`run_training` returns: the trained module (None on ranks other than 0) and the facts of
    the run for its record (:meth:`summary`)."""

    module: torch.nn.Module | None
    trainer: LossTrainer
    seconds: float
    training_loss: float
    resumed_from: str | None
    stopped_by_time_budget: bool

    def summary(self) -> dict:
        state = self.trainer.state
        losses = [r["loss"] for r in state.log_history if "loss" in r]
        unit = self.trainer.token_unit
        return {"global_step": state.global_step, "train_loss": self.training_loss,
                "last_logged_loss": losses[-1] if losses else None, "seconds": round(self.seconds, 1),
                f"train_{unit}": self.trainer.tokens_seen,
                f"{unit}_per_second": round(self.trainer.tokens_seen / self.seconds, 1) if self.seconds > 0 else 0.0,
                "stopped_by_time_budget": self.stopped_by_time_budget, "resumed_from": self.resumed_from}


def run_training(module: torch.nn.Module, loss_fn: LossFn, train_ds, collate, *, section: TrainSection,
                 resume: str, out: Path, fingerprint: dict, place: Placement, progress: bool = True,
                 processing_class=None, callbacks=(), rebuild: Callable[[], torch.nn.Module] | None = None,
                 tag: str = "train") -> TrainRun:
    """One training run of any kind in ``out``: the resume check against ``out/run.json`` (then written with
    ``fingerprint``), training arguments, :class:`LossTrainer` with the time budget, and the gathered module.
    Build ``module`` before calling (ZeRO-3: see :func:`training_arguments`); ``rebuild`` makes an empty copy
    of it for ZeRO-3 gathering (default: ``module`` itself is reused). Every rank calls this."""
    ckpt, run_file = out / "checkpoints", out / "run.json"
    ds_cfg = deepspeed_config(section.deepspeed)
    args = training_arguments(section, ckpt, ds_cfg, place)
    args.disable_tqdm = not progress
    resumed = resume_checkpoint(resume, ckpt, fingerprint, run_file)
    if is_main_process():
        atomic_write_json(run_file, fingerprint, indent=2, sort_keys=True)
        if resumed:
            print(f"[{tag}] resuming from {resumed}", flush=True)
    budget = TimeBudget(section.max_minutes) if section.max_minutes else None
    trainer = LossTrainer(model=module, args=args, train_dataset=train_ds, data_collator=collate,
                          processing_class=processing_class, loss_fn=loss_fn,
                          callbacks=list(callbacks) + ([budget] if budget else []))
    if resumed and ds_cfg is None and _finished(trainer, resumed):
        # HF's loop would run one more step before noticing max_steps: load the checkpoint and train nothing
        from transformers import TrainerState

        trainer._load_from_checkpoint(resumed)
        trainer.state = TrainerState.load_from_json(str(Path(resumed) / "trainer_state.json"))
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        training_loss = losses[-1] if losses else float("nan")
        if is_main_process():
            print(f"[{tag}] {resumed} already reached the planned {trainer.state.global_step} steps; exporting it",
                  flush=True)
    else:
        training_loss = trainer.train(resume_from_checkpoint=resumed).training_loss
    stopped = bool(budget and budget.stopped)
    if torch.distributed.is_available() and torch.distributed.is_initialized():  # tokens of every process
        seen = torch.tensor([trainer.tokens_seen], device=trainer.args.device)
        torch.distributed.all_reduce(seen)
        trainer.tokens_seen = int(seen.item())
    if stopped and is_main_process():
        print(f"[{tag}] time budget train.max_minutes={section.max_minutes} reached at step "
              f"{trainer.state.global_step}: checkpoint saved, exporting; rerun the same command to continue",
              flush=True)
    trained = trained_module(trainer, rebuild or (lambda: module))
    return TrainRun(trained, trainer, trainer.train_seconds, training_loss, resumed, stopped)


def _finished(trainer: LossTrainer, checkpoint: str) -> bool:
    """Has ``checkpoint`` already trained the steps this run plans (``max_steps``, or the epochs' steps)?"""
    import math

    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    args = trainer.args
    if args.max_steps > 0:
        total = args.max_steps
    else:
        batches = len(trainer.get_train_dataloader())
        per_epoch = max(math.ceil(batches / args.gradient_accumulation_steps), 1)
        total = math.ceil(args.num_train_epochs * per_epoch)
    return int(state.get("global_step", 0)) >= total


# --------------------------------------------------------------------------- resume

def resume_checkpoint(resume: str, ckpt_dir: Path, fingerprint: dict, run_file: Path) -> str | None:
    """Checkpoint to resume from: ``auto`` = the latest in ``ckpt_dir`` if it came from the same run
    setup (``fingerprint``), ``never``, or an explicit checkpoint folder."""
    from transformers.trainer_utils import get_last_checkpoint

    if resume == "never":
        return None
    if resume != "auto":
        p = Path(resume)
        if not (p.is_dir() and (p / "trainer_state.json").is_file()):
            raise UserError(f"resume={resume}: not a checkpoint folder (expected .../checkpoint-N with "
                            f"trainer_state.json); use resume=auto or resume=never")
        return str(p)
    last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.is_dir() else None
    if last is None:
        return None
    if run_file.is_file():
        before = json.loads(run_file.read_text())
        changed = sorted(k for k in set(before) | set(fingerprint) if before.get(k) != fingerprint.get(k))
        if changed:
            raise UserError(f"{ckpt_dir} holds checkpoints of a different setup (changed: {', '.join(changed)}); "
                            f"pass resume=never to start over there, or out_dir=<new folder>")
    return last


# --------------------------------------------------------------------------- gathering

def trained_module(trainer, rebuild: Callable[[], torch.nn.Module]) -> torch.nn.Module | None:
    """The trained module with full weights on the main process (None on other ranks).

    Every rank must call this (ZeRO-3 gathers collectively). Without ZeRO-3 the unwrapped model already
    holds full weights; with it, ``rebuild()`` makes an empty copy outside DeepSpeed's partitioning
    and the consolidated weights are loaded into it.
    """
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    if not (trainer.is_deepspeed_enabled and is_deepspeed_zero3_enabled()):
        return trainer.accelerator.unwrap_model(trainer.model) if trainer.is_world_process_zero() else None
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if not trainer.is_world_process_zero():
        return None
    unset_hf_deepspeed_config()  # training is over: build the copy as a plain module
    module = rebuild()
    missing, unexpected = module.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    tied = set(getattr(module, "_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"gathered ZeRO-3 weights do not fit the rebuilt module: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    return module
