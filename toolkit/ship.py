"""``python -m toolkit ship HEAD --out DIR`` (``make pretrained``): a trained head folder → the small folder the
repository ships (``pretrained/<target>/eagle``), so a fresh clone decodes with a trained arm at once.

What is written: the head's weights in float16 (half the bytes; the arm loads them into the target's dtype,
and verification keeps decoding exact whatever the head's precision), its ``head.json`` and
``draft_vocab.safetensors`` unchanged, the training run's record (``run.json``, ``eval.json``; absolute paths under
the working directory written relative to it, so the committed record names no one's machine) and ``SHIPPED.md``:
what the folder is, the command that rebuilt it, and the sizes. The head is read back from the new folder and must
draft the same top-1 tokens as the original on a probe before the folder appears (written beside, then
renamed into place).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from decode.common.device import DTYPES
from decode.common.errors import UserError
from decode.core.models import DEFAULT_TARGET
from decode.choose.heads.common import HEAD_CONFIG, HEAD_WEIGHTS, read_head_config, read_head_weights
from decode.core.vocab import VOCAB_FILE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("head", help="a trained head folder (head.json + head.safetensors), e.g. "
                                "runs/pools/smollm2-135m-instruct-small/heads/eagle")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="the target the head was trained for (default: %(default)s)")
    p.add_argument("--out", required=True, help="the folder to write (replaced only with --force)")
    p.add_argument("--dtype", default="float16", choices=sorted(DTYPES), help="weights dtype (default: %(default)s)")
    p.add_argument("--command", dest="rebuild_command", default="",
                   help="the command that rebuilds the head (written to SHIPPED.md)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")


def portable_paths(obj, root: Path):
    """``obj`` (parsed JSON) with every absolute path string under ``root`` made relative to it."""
    if isinstance(obj, dict):
        return {k: portable_paths(v, root) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable_paths(v, root) for v in obj]
    if isinstance(obj, str) and obj.startswith("/"):
        path = Path(obj)
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return obj


def _check_same_drafts(src: Path, dst: Path, target_name: str) -> float:
    """Top-1 agreement of the shipped head with the original on random features; returns the agreement
    (1.0 expected, up to float16 rounding ties)."""
    from decode.choose.heads import load_head
    from decode.core.models import load_model

    target, _ = load_model(target_name)
    a, b = load_head(src, target), load_head(dst, target)
    d = target.config.hidden_size
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 16, d, generator=g)
    ids = torch.randint(0, target.config.vocab_size, (1, 16), generator=g)
    with torch.no_grad():
        la, lb = a.draft_logits(a(feats, ids)), b.draft_logits(b(feats, ids))
    return float((la.argmax(-1) == lb.argmax(-1)).float().mean())


def ship(head: Path, out: Path, target: str, dtype: str = "float16", command: str = "", force: bool = False,
         check: bool = True) -> Path:
    meta = read_head_config(head)
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError(f"--out {out} exists and is not empty; pass --force to replace it")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in read_head_weights(head).items()}
    save_file(state, str(tmp / HEAD_WEIGHTS))
    if (head / VOCAB_FILE).is_file():
        shutil.copy2(head / VOCAB_FILE, tmp / VOCAB_FILE)
    records = {name: json.loads((head / name).read_text()) for name in ("run.json", "eval.json")
               if (head / name).is_file()}
    for name, record in records.items():
        (tmp / name).write_text(json.dumps(portable_paths(record, Path.cwd()), indent=2) + "\n")
    shutil.copy2(head / HEAD_CONFIG, tmp / HEAD_CONFIG)
    agreement = _check_same_drafts(head, tmp, target) if check else None
    if agreement is not None and agreement < 0.95:
        raise UserError(f"the {dtype} head drafts other tokens than the original ({agreement:.0%} top-1 agreement on "
                        "a probe); ship it in float32 (--dtype float32)")
    size = sum(f.stat().st_size for f in tmp.iterdir())
    heldout = records.get("eval.json", {}).get("heldout", {})
    run = records.get("run.json", {})
    trained_in = (run.get("train") or {}).get("dtype") or "float32"  # the trainer's compute dtype (auto: bf16 on GPUs)
    warm = (run.get("head") or {}).get("init_from")
    lines = [f"# Shipped {meta.get('kind', 'head')} head", "",
             "Produced by this project's own pipeline; rebuild it with:", "", "```bash",
             command or f"python -m toolkit ship {head} --out {out}", "```", "",
             f"- weights: {dtype} ({size / 2 ** 20:.1f} MiB in this folder); trained in {trained_in}, saved in float32",
             *([f"- warm-started from: {warm} (run.json: head.init_from)"] if warm else []),
             f"- target: {meta.get('target_spec') or meta.get('target', {}).get('name_or_path', '?')}",
             "- held-out metrics at training time: "
             f"{json.dumps(heldout, sort_keys=True) if heldout else 'see run.json'}",
             f"- top-1 agreement of these {dtype} weights with the float32 ones on a probe: "
             + ("not checked" if agreement is None else f"{agreement:.3f}"), ""]
    (tmp / "SHIPPED.md").write_text("\n".join(lines))
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; a shipped file is for everyone
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def run(args) -> int:
    head, out = Path(args.head), Path(args.out)
    if not (head / HEAD_CONFIG).is_file():
        raise UserError(f"{head} is not a trained head folder (no {HEAD_CONFIG}); `make pool BUDGET=small` trains one")
    ship(head, out, args.target, args.dtype, args.rebuild_command, args.force)
    print(f"shipped {head} → {out} ({sum(f.stat().st_size for f in out.iterdir()) / 2 ** 20:.1f} MiB)", file=sys.stderr)
    return 0
