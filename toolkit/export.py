"""Export folders that the decode runtime loads directly.

Layout: HF ``config.json`` + ``model.safetensors`` + tokenizer files (so ``decode.core.models.load_model``
and the ``drafter:path=...`` arm read it as any local model) + a small metadata file
(``drafter.json``): which target it was trained for (id and vocabulary hash), task, recipe, and the
held-out evaluation once it exists. Folders are written to a temporary sibling and renamed, so a
half-written export is never visible.
"""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

import torch

from decode.common.errors import UserError
from decode.common.io import atomic_path, atomic_write_json
from decode.core.models import vocab_fingerprint

FORMAT = 1
DRAFTER_META = "drafter.json"
EVAL_FILE = "eval.json"


def _plain(model):
    """LoRA adapters merged into the base weights, fp32, cache on: what an inference arm wants."""
    try:
        from peft import PeftModel
    except ImportError:  # peft is optional for plain models
        PeftModel = ()
    if PeftModel and isinstance(model, PeftModel):
        model = model.merge_and_unload()
    model = model.to(torch.float32)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = True
    return model


def export_model(model, tokenizer, out_dir: str | Path, *, target: str, target_tokenizer, task: str,
                 recipe: dict, kind: str = "drafter", meta_file: str = DRAFTER_META, extra: dict | None = None) -> Path:
    """Write ``model`` (+ tokenizer + metadata) to ``out_dir`` atomically; returns the folder."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = _plain(model)
    meta = {
        "format": FORMAT,
        "kind": kind,
        "target": target,
        "target_vocab_hash": vocab_fingerprint(target_tokenizer),
        "task": task,
        "parameters": sum(p.numel() for p in model.parameters()),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "recipe": recipe,
        **(extra or {}),
    }
    with atomic_path(out, directory=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / meta_file).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_metadata(path: str | Path, meta_file: str = DRAFTER_META) -> dict:
    p = Path(path) / meta_file
    if not p.is_file():
        raise UserError(f"{path} is not an export folder (no {meta_file}); train one with `make train-drafter`")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{p} is not valid JSON ({exc}); re-export the drafter") from None


def write_eval(path: str | Path, metrics: dict, meta_file: str = DRAFTER_META) -> None:
    """Store held-out metrics as ``eval.json`` and under ``eval`` in the metadata (both atomically)."""
    path = Path(path)
    meta = read_metadata(path, meta_file)
    meta["eval"] = metrics
    for name, obj in ((EVAL_FILE, metrics), (meta_file, meta)):
        atomic_write_json(path / name, obj, indent=2)


def check_target(path: str | Path, target_tokenizer, meta_file: str = DRAFTER_META) -> dict:
    """Metadata of an export, after checking it was trained for this target's vocabulary."""
    meta = read_metadata(path, meta_file)
    want = vocab_fingerprint(target_tokenizer)
    if meta.get("target_vocab_hash") != want:
        raise UserError(f"{path} was trained for target '{meta.get('target')}' "
                        f"(vocabulary {meta.get('target_vocab_hash')}) "
                        f"but this target's vocabulary is {want}; train a drafter for this target")
    return meta
