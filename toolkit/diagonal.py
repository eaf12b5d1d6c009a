"""MetaSD's diagonal: every drafter scored on every task's held-out distilled split, to see whether each
task drafter beats the generalist (``all``) on its own task.

``python -m toolkit diagonal --drafters math=PATH,code=PATH,all=PATH --data-root runs/distill`` scores each
drafter on each task's held-out prompts — the split the trainer held out (:func:`toolkit.train.data.is_heldout`
by prompt hash; by default at the smallest ``data.heldout_fraction`` the drafters' recipes used, so no drafter
trained on any prompt scored; a smaller fraction's prompts are a subset of a larger one's) — teacher-forced
on the target's own responses:

* ``label_agreement``: the drafter's top-1 token equals the target's response token (its label);
* with the target loaded (``--target``, default: the one in the drafters' ``drafter.json``; ``none`` skips
  it): ``target_agreement`` (top-1 equals the target's top-1) and ``acceptance`` = 1 − TV(target, drafter)
  per position (:func:`toolkit.train.metrics.position_stats`), the expected speculative-sampling acceptance.

Drafters score as the ``drafter`` arm drafts (``--vocab auto``: from their draft vocabulary when their
folder has one). The target runs once per example, every drafter beside it. The report is a markdown
matrix per metric (rows drafters, columns tasks, the diagonal in bold) with a last row per column saying
whether the task's drafter beats the generalist, and, with ``--out``, the numbers as JSON (the tables
beside it as .md).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from decode.common.errors import UserError
from decode.common.io import atomic_write_json, atomic_write_text

GENERALIST = "all"
METRICS = {"label_agreement": "top-1 agreement with the target's response tokens (teacher-forced)",
           "target_agreement": "top-1 agreement with the target's own top-1",
           "acceptance": "expected acceptance 1 − TV(target, drafter)"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafters", required=True,
                   help="NAME=PATH pairs separated by ',' (a task's drafter is named after its task; the generalist "
                        f"'{GENERALIST}'), e.g. math=runs/drafters/x/math/export,all=runs/drafters/x/all/export")
    p.add_argument("--data-root", required=True, help="distilled data: one folder per task (<root>/<task>/)")
    p.add_argument("--tasks", help="comma-separated tasks (columns); default: the drafters' names but "
                                   f"'{GENERALIST}'")
    p.add_argument("--generalist", default=GENERALIST, help="the drafter the task drafters are compared with "
                                                            "(default: %(default)s)")
    p.add_argument("--heldout-fraction", type=float,
                   help="held-out share of prompts, as the trainer's data.heldout_fraction (default: the smallest "
                        "one the drafters' recipes used, else 0.05)")
    p.add_argument("--max-examples", type=int, default=200,
                   help="held-out examples per task, as the trainer's data.heldout_max (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=512, help="prompt + response tokens per example "
                                                               "(default: %(default)s)")
    p.add_argument("--target", help="the target (alias, folder or hub id) for target agreement and 1 − TV; "
                                    "'none' = labels only (default: the target in the drafters' drafter.json)")
    p.add_argument("--vocab", default="auto", choices=("auto", "none"),
                   help="auto: each drafter drafts from its folder's draft vocabulary when it has one, as the "
                        "drafter arm does; none: the full vocabulary (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the 1 − TV estimate; 0 = plain softmax, as the trainer's held-out "
                        "evaluation (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda[:N] (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16 (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--out", help="write the results as JSON here (the tables beside it as .md)")
    p.add_argument("--no-progress", action="store_true")


def parse_drafters(spec: str) -> dict[str, str]:
    """``"math=a,all=b"`` → {"math": "a", "all": "b"} (order kept)."""
    out: dict[str, str] = {}
    for item in (s.strip() for s in (spec or "").split(",")):
        if not item:
            continue
        name, sep, path = (x.strip() for x in item.partition("="))
        if not sep or not name or not path:
            raise UserError(f"--drafters: '{item}' must look like NAME=PATH (e.g. math=runs/drafters/x/math/export)")
        if name in out:
            raise UserError(f"--drafters names '{name}' twice; give each drafter one name")
        out[name] = path
    if not out:
        raise UserError("--drafters is empty; pass NAME=PATH pairs, e.g. math=PATH,all=PATH")
    return out


def _metadata(path: str) -> dict:
    """A trained export's drafter.json, or {} for a plain HF model."""
    from .export import DRAFTER_META, read_metadata

    return read_metadata(path) if (Path(path) / DRAFTER_META).is_file() else {}


def _from_recipes(metas: dict[str, dict], key: str) -> list:
    return [m["recipe"]["data"][key] for m in metas.values() if key in ((m.get("recipe") or {}).get("data") or {})]


def resolve_setup(args, metas: dict[str, dict]) -> tuple[str | None, float]:
    """(target spec or None, held-out fraction) from the flags, else from the drafters' metadata."""
    from .train.data import DataSection

    fraction = args.heldout_fraction
    if fraction is None:
        used = _from_recipes(metas, "heldout_fraction")
        fraction = min(used) if used else DataSection.heldout_fraction
    if not 0.0 < fraction < 1.0:
        raise UserError(f"--heldout-fraction must be in (0, 1), got {fraction}")
    target = args.target
    if target is None:
        named = sorted({m["target"] for m in metas.values() if m.get("target")})
        if len(named) > 1:
            raise UserError(f"the drafters were trained for different targets ({', '.join(named)}); pass --target")
        if not named:
            raise UserError("no drafter.json names a target (plain HF models?); pass --target SPEC or --target none")
        target = named[0]
    return (None if target.strip().lower() == "none" else target), fraction


def heldout_split(data_root: str, task: str, fraction: float, max_examples: int, tokenizer, max_length: int):
    """The task's held-out distilled examples, tokenised as the trainer does (same prompt-hash split)."""
    from .train.data import DataSection, load_examples, split_heldout, tokenize_sft

    section = DataSection(root=data_root, heldout_fraction=fraction, heldout_max=max_examples, max_length=max_length)
    _, held = split_heldout(load_examples(section, task), section)
    held = tokenize_sft(held, tokenizer, max_length) if len(held) else held
    if len(held) == 0:
        raise UserError(f"task '{task}': no held-out examples at --heldout-fraction {fraction} (the split is by "
                        f"prompt hash); distil more prompts or raise --heldout-fraction")
    return held


@torch.inference_mode()
def score(drafters: dict[str, torch.nn.Module], target, examples, sampling, progress: bool = False) -> dict:
    """{drafter: {positions, label_agreement[, target_agreement, acceptance]}} over ``examples``; the target
    (or None) runs once per example."""
    from tqdm.auto import tqdm

    from .train.metrics import position_stats

    tot = {name: {"n": 0, "label_hits": 0.0, "agree": 0.0, "overlap": 0.0} for name in drafters}
    dev = next(next(iter(drafters.values())).parameters()).device
    for ex in tqdm(examples, desc="held-out", disable=not progress):
        ids = torch.tensor([ex["input_ids"]], device=dev)
        labels = torch.tensor(ex["labels"][1:], device=dev)
        mask = labels != -100
        if not mask.any():
            continue
        p = None if target is None else target(input_ids=ids).logits[0, :-1][mask].float()
        for name, drafter in drafters.items():
            q = drafter(input_ids=ids).logits[0, :-1][mask].float()
            t = tot[name]
            t["n"] += int(mask.sum())
            t["label_hits"] += (q.argmax(-1) == labels[mask]).sum().item()
            if p is not None:
                s = position_stats(p, q, sampling)
                t["agree"] += s["agree"]
                t["overlap"] += s["overlap"]
    out = {}
    for name, t in tot.items():
        n = max(t["n"], 1)
        cell = {"positions": t["n"], "label_agreement": t["label_hits"] / n}
        if target is not None:
            cell.update(target_agreement=t["agree"] / n, acceptance=t["overlap"] / n)
        out[name] = cell
    return out


def verdicts(cells: dict, tasks: list[str], generalist: str, metric: str) -> dict:
    """Per task: the task drafter's ``metric`` minus the generalist's, and whether it beats it."""
    out = {}
    for task in tasks:
        if task not in cells or generalist not in cells:
            out[task] = {"delta": None, "beats_generalist": None,
                         "why": f"no '{task}' drafter" if task not in cells else f"no '{generalist}' drafter"}
            continue
        delta = cells[task][task][metric] - cells[generalist][task][metric]
        out[task] = {"delta": delta, "beats_generalist": delta > 0}
    return out


def markdown(cells: dict, tasks: list[str], generalist: str, metric: str, verdict: dict) -> str:
    """One metric's matrix: rows drafters, columns tasks, diagonal in bold, then task drafter − generalist."""
    lines = [f"### {METRICS[metric]}", "", "| drafter \\ task | " + " | ".join(tasks) + " |",
             "|---|" + "---|" * len(tasks)]
    for name, row in cells.items():
        vals = [f"**{row[t][metric]:.3f}**" if name == t else f"{row[t][metric]:.3f}" for t in tasks]
        lines.append(f"| {name} | " + " | ".join(vals) + " |")
    last = []
    for t in tasks:
        v = verdict[t]
        last.append("—" if v["delta"] is None else
                    f"{v['delta']:+.3f} ({'beats' if v['beats_generalist'] else 'does not beat'})")
    lines.append(f"| task drafter − {generalist} | " + " | ".join(last) + " |")
    return "\n".join(lines)


def run(args) -> int:
    from decode.choose.arms.model import DraftVocabLM, load_drafter_vocab
    from decode.core.models import check_vocab_compatible, load_model
    from decode.core.sampling import SamplingConfig
    from decode.core.vocab import describe

    paths = parse_drafters(args.drafters)
    tasks = ([t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks
             else [n for n in paths if n != args.generalist])
    if not tasks:
        raise UserError(f"no tasks: name the task drafters after their tasks or pass --tasks (the generalist "
                        f"'{args.generalist}' is not a task)")
    if args.max_examples < 1 or args.max_length < 8:
        raise UserError("--max-examples must be >= 1 and --max-length >= 8")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    out = Path(args.out) if args.out else None
    if out is not None and (out.is_dir() or out.suffix == ".md"):
        raise UserError(f"--out {out}: pass a .json file path (the tables are written beside it as .md)")
    metas = {name: _metadata(path) for name, path in paths.items()}
    target_spec, fraction = resolve_setup(args, metas)

    target, tok, target_name = None, None, "target"
    if target_spec is not None:
        target, tok = load_model(target_spec, device=args.device, dtype=args.dtype,
                                 trust_remote_code=args.trust_remote_code)
        target_name = target_spec
    drafters, vocabs = {}, {}
    for name, path in paths.items():
        model, dtok = load_model(path, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
        V = model.get_output_embeddings().weight.shape[0]
        if tok is None:  # labels only: the first drafter's tokenizer (an export carries the target's)
            tok, target_name, ref_V = dtok, f"drafter '{name}'", V
        check_vocab_compatible(tok, dtok, target_name=target_name, drafter_name=path,
                               target_vocab_size=target.get_output_embeddings().weight.shape[0] if target is not None
                               else ref_V, drafter_vocab_size=V)
        try:
            vocab = load_drafter_vocab(path, V, args.vocab)
        except UserError as exc:
            raise UserError(f"--drafters {name}={path}: {exc}") from None
        vocabs[name] = None if vocab is None else vocab.info
        drafters[name] = model if vocab is None else DraftVocabLM(model, vocab)
        print(f"[diagonal] {name}: {path} ({describe(vocab)})", flush=True)

    sampling = SamplingConfig(args.temperature)
    cells: dict[str, dict] = {name: {} for name in paths}
    sizes = {}
    for task in tasks:
        held = heldout_split(args.data_root, task, fraction, args.max_examples, tok, args.max_length)
        sizes[task] = len(held)
        for name, cell in score(drafters, target, held, sampling, progress=not args.no_progress).items():
            cells[name][task] = cell
        print(f"[diagonal] {task}: {len(held)} held-out examples, {cells[next(iter(paths))][task]['positions']} "
              f"positions", flush=True)

    metrics = ["label_agreement"] + (["acceptance", "target_agreement"] if target is not None else [])
    verdict = {m: verdicts(cells, tasks, args.generalist, m) for m in metrics}
    md = "\n\n".join(markdown(cells, tasks, args.generalist, m, verdict[m]) for m in metrics)
    md += (f"\n\nHeld-out prompts: fraction {fraction} of each task by prompt hash (at most {args.max_examples} "
           f"examples: {', '.join(f'{t} {n}' for t, n in sizes.items())}); target: {target_spec or 'not loaded'}; "
           f"draft vocabularies: {args.vocab}.")
    print(md, flush=True)
    if out is not None:
        report = {"drafters": paths, "tasks": tasks, "generalist": args.generalist, "data_root": args.data_root,
                  "heldout_fraction": fraction, "max_examples": args.max_examples, "heldout_examples": sizes,
                  "max_length": args.max_length, "target": target_spec, "vocab": args.vocab, "draft_vocab": vocabs,
                  "temperature": args.temperature, "cells": cells, "verdicts": verdict, "markdown": md}
        atomic_write_json(out, report, indent=2)
        atomic_write_text(out.with_suffix(".md"), md + "\n")
        print(f"[diagonal] → {out}", flush=True)
    return 0
