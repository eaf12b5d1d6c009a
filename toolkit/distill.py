"""Self-distillation: the target answers task prompts; the answers become drafter training data.

``python -m toolkit distill --task math [key=value ...]`` (or ``make distill TASK=math``) runs a
recipe from ``recipes/tasks/``. Each selected prompt is answered once at each temperature, by the
target on ``device`` in ``dtype`` (``device=cuda dtype=bfloat16``; default ``auto``: CUDA + bfloat16 when a
GPU is visible, else CPU + float32). The resolved dtype is part of the run's identity (a resume in another
dtype is refused); the device is not (a run may resume on another device).

Output (``out``, default ``runs/distill/<task>``):

* ``shards/shard-XXXXX.parquet``: fixed slices of a deterministic plan, each written atomically
  (temp file + ``os.replace``). A rerun skips finished shards, so an interrupted run resumes
  without duplicated or lost rows; sampled rows are seeded per batch, so a resumed run reproduces
  what an uninterrupted one would have written.
* ``manifest.json``: recipe, target, prompt selection counts, filter counts, throughput, time,
  ``reuse`` (below) and ``status``: ``running`` while shards are written (or after a kill), ``stopped`` when the
  ``max_minutes`` budget ended the session, ``complete``. Training reads an unfinished run's finished shards
  only when asked (``allow_partial_data=true``); rerunning the same command continues it.

Shipped answers (``reuse``, default ``auto``): before generating, the rows of an answers folder
(:mod:`toolkit.answers`; ``auto`` = ``pretrained/<target>/answers`` when ``target`` is an alias and that folder
exists) are taken instead of generated, when the folder's recorded conditions for the task (target, dtype, template,
filters, answer length, sampling; not the prompt limit, which only skips prompts) equal this run's. A planned row is
reused when its id is shipped *and* the shipped prompt ids equal this run's rendering; the rest are generated as
usual (rows a filter dropped or that leaked were not shipped, so they are generated; shards with the most rows to
generate run first, so a time-limited run answers new prompts before it re-answers dropped ones). An explicit folder
that is missing or differs is an error naming the fields; ``auto`` says on stderr why nothing is reused and
generates; ``null`` never reuses. ``reuse`` is not part of the run's identity: a reused row is the target's answer
under the same conditions. Shards record ``reused_rows``, the manifest ``reuse: {folder, rows_reused}`` (or
``skipped``).

:func:`load_distilled` is the reading side used by the training recipes. Row columns:
``id, task, source, prompt, prompt_text, prompt_ids, response, response_ids, temperature,
finish_reason, prompt_tokens, response_tokens, filtered``. ``response_ids`` are exactly the tokens
the target generated, ending with its end-of-sequence token when ``finish_reason == "stop"``
(``"length"``: hit ``max_new_tokens``); ``response`` is their text without that token.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import torch

from decode.common.device import dtype_name, resolve_dtype
from decode.common.errors import UserError
from decode.common.io import REPO_ROOT, atomic_path, atomic_write_json, resolve_repo_path
from decode.core.models import DEFAULT_TARGET, eos_token_ids
from decode.core.sampling import SamplingConfig, choose_token

from . import answers as shipped_answers
from .config import DTypeName, check_device_spec, dump_yaml, load_recipe, resolve_device_field, task_recipe, to_dict
from .data.filters import FilterConfig, first_match
from .data.leakage import DEFAULT_EVAL_FILES, EvalIndex
from .data.prompts import select_prompts
from .data.sources import GSM8KSource, Source
from .data.templates import Template

COLUMNS = ("id", "task", "source", "prompt", "prompt_text", "prompt_ids", "response", "response_ids",
           "temperature", "finish_reason", "prompt_tokens", "response_tokens", "filtered")
FORMAT_VERSION = 2  # bump when the plan (row order, batching, seeding) changes: old runs cannot be resumed


# --------------------------------------------------------------------------- recipe

@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.3, 0.7, 1.0])
    max_new_tokens: int = 256
    batch_size: int = 32
    top_k: int = 0  # 0 = off: sampled rows follow the target's distribution at that temperature
    top_p: float = 1.0
    max_prompt_tokens: int = 1024  # longer prompts are skipped (counted as too_long)
    threads: int | None = None  # torch CPU threads; null = torch's default (on a busy shared CPU, 1 is often faster)
    renamed_fields: ClassVar[dict[str, str]] = {"dtype": "dtype (top level)", "device": "device (top level)"}

    def __post_init__(self):
        if not self.temperatures:
            raise UserError("generation.temperatures is empty; give at least one, e.g. [0.0]")
        if (not all(0 <= t < float("inf") for t in self.temperatures)
                or len(set(self.temperatures)) != len(self.temperatures)):
            raise UserError(f"generation.temperatures must be distinct, finite and >= 0, got {self.temperatures}")
        if self.threads is not None and self.threads < 1:
            raise UserError(f"generation.threads must be >= 1 or null (torch default), got {self.threads}")
        for name in ("max_new_tokens", "batch_size", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"generation.{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k < 0:
            raise UserError(f"generation.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"generation.top_p must be in (0, 1] (1 = off), got {self.top_p}")


@dataclass(frozen=True, kw_only=True)
class LeakageConfig:
    eval_files: list[str] = field(default_factory=lambda: list(DEFAULT_EVAL_FILES))
    ngram: int = 13


@dataclass(frozen=True, kw_only=True)
class DistillRecipe:
    task: str
    target: str = DEFAULT_TARGET
    device: str = "auto"  # auto | cpu | cuda[:N]; auto = CUDA when a GPU is visible, else CPU
    dtype: DTypeName = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    sources: list[Source] = field(default_factory=lambda: [GSM8KSource()])
    num_prompts: int | None = 256  # null = every prompt the sources yield
    shuffle: bool = False  # read all sources and take a seeded random subset instead of the first ones
    seed: int = 0
    template: Template = field(default_factory=Template)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    filters: FilterConfig = field(default_factory=FilterConfig)
    leakage: LeakageConfig = field(default_factory=LeakageConfig)
    out: str | None = None  # null = runs/distill/<task>
    shard_size: int = 256  # rows per shard file (the unit of resume)
    trust_remote_code: bool = False
    # an answers folder (toolkit answers) whose rows are taken instead of generated when its recorded conditions
    # match; auto = pretrained/<target>/answers for an alias target when it exists; null = generate every row
    reuse: str | None = "auto"
    # time budget: once this many minutes have passed in this session, stop after the shard being generated; the
    # manifest says "stopped" (finished shards are usable with allow_partial) and the same command continues it
    max_minutes: float | None = None

    def __post_init__(self):
        check_device_spec(self.device, "device")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise UserError(f"max_minutes must be > 0 or null (no time budget), got {self.max_minutes}")
        if not self.task or not self.task.replace("_", "").replace("-", "").isalnum():
            raise UserError(f"task must be a short name like 'math', got {self.task!r}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise UserError(f"num_prompts must be >= 1 or null (every prompt), got {self.num_prompts}")
        if self.shard_size < 1:
            raise UserError(f"shard_size must be >= 1, got {self.shard_size}")
        if self.reuse is not None and not self.reuse.strip():
            raise UserError("reuse must be auto, an answers folder or null (never reuse), got an empty string")
        bs = self.generation.batch_size
        if self.shard_size % bs:  # shards are generated batch by batch: a remainder is a short, wasteful batch
            raise UserError(f"shard_size={self.shard_size} must be a multiple of generation.batch_size={bs}; "
                            f"set shard_size={max(bs, self.shard_size // bs * bs)} or a generation.batch_size "
                            f"that divides {self.shard_size}")

    @property
    def out_dir(self) -> Path:
        return Path(self.out or f"runs/distill/{self.task}")


def load_distill_recipe(path: str | Path | None = None, overrides=(), *, task: str | None = None) -> DistillRecipe:
    if path is None and task is None:
        raise UserError("give a recipe: --recipe recipes/tasks/<task>.yaml or --task <task>")
    return load_recipe(DistillRecipe, path if path is not None else task_recipe(task), overrides)


# --------------------------------------------------------------------------- batched generation

@dataclass
class Generation:
    ids: list[int]  # generated tokens, including the final end-of-sequence token when finish == "stop"
    finish_reason: str  # "stop" | "length"


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], *, sampling: SamplingConfig | list[SamplingConfig],
                   max_new_tokens: int,
                   eos_ids: set[int], pad_id: int = 0, generator: torch.Generator | None = None,
                   on_step: Callable[[int], None] | None = None) -> list[Generation]:
    """Generate for a batch of prompts with the target: left padding, one shared KV cache.

    Rows that finish leave the batch (their cache rows are dropped), so the remaining rows do not pay
    for them. ``sampling`` is one config or one per row (a batch may mix temperatures). Greedy rows
    equal ``model.generate(do_sample=False)`` for the same prompt; all rows draw through
    :func:`decode.core.sampling.choose_token`, the one place logits are processed.
    ``on_step(n)`` is told after every step how many tokens it produced (for progress displays).
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    B = len(prompts)
    configs = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * B
    if len(configs) != B:
        raise ValueError(f"generate_batch: {len(configs)} sampling configs for {B} prompts")
    width = max(len(p) for p in prompts)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    logits = out.logits[:, -1, :]
    next_pos = pos[:, -1:] + 1
    active = list(range(B))  # batch row → prompt index
    results: list[list[int]] = [[] for _ in range(B)]
    finish = ["length"] * B
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device) if eos_ids else None
    for step in range(max_new_tokens):
        row_cfg = [configs[i] for i in active]
        if all(c == row_cfg[0] for c in row_cfg):
            tok = _choose(logits, row_cfg[0], generator)
        else:  # one call per distinct config, in first-appearance order (deterministic with a seeded generator)
            tok = torch.empty(len(active), dtype=torch.long, device=logits.device)
            for cfg in dict.fromkeys(row_cfg):
                rows = torch.tensor([r for r, c in enumerate(row_cfg) if c == cfg], device=logits.device)
                tok[rows] = _choose(logits[rows], cfg, generator)
        done = torch.isin(tok, eos) if eos is not None else torch.zeros_like(tok, dtype=torch.bool)
        tok_list, done_list = tok.tolist(), done.tolist()
        for r, i in enumerate(active):
            results[i].append(tok_list[r])
            if done_list[r]:
                finish[i] = "stop"
        if on_step is not None:
            on_step(len(tok_list))
        if step == max_new_tokens - 1:
            break
        if any(done_list):
            keep = [r for r, d in enumerate(done_list) if not d]
            if not keep:
                break
            active = [active[r] for r in keep]
            idx = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(idx)
            tok, mask, next_pos = tok[idx], mask[idx], next_pos[idx]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, past_key_values=cache,
                    use_cache=True)
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    return [Generation(r, f) for r, f in zip(results, finish)]


def _choose(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """:func:`choose_token`'s tokens on the logits' device. Greedy rows pick on the device; sampled rows
    draw on the CPU, where the per-batch seeded generator lives, so a sampled row depends on the seed and
    the logits only, not on the device that produced them."""
    if cfg.greedy or logits.device.type == "cpu":
        return choose_token(logits, cfg, generator)[0]
    return choose_token(logits.float().cpu(), cfg, generator)[0].to(logits.device)


# --------------------------------------------------------------------------- plan & shards

@dataclass(frozen=True)
class Unit:
    uid: str
    prompt: int  # index into the selected prompts
    temperature: float


def _uid(task: str, source: str, text: str, temperature: float) -> str:
    return hashlib.sha256(f"{task}\x00{source}\x00{text}\x00{temperature!r}".encode()).hexdigest()[:20]


def plan_units(task, prompts, prompt_ids, temperatures) -> list[Unit]:
    """Every prompt at every temperature, longest prompts first (less padding per batch); the copies of a
    prompt at its temperatures are adjacent, so they share a batch and its padding."""
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompt_ids[i]), i))
    return [Unit(_uid(task, prompts[i].source, prompts[i].text, t), i, t) for i in order for t in temperatures]


def _shard_path(out: Path, k: int) -> Path:
    return out / "shards" / f"shard-{k:05d}.parquet"


def _write_shard(path: Path, rows: list[dict], meta: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=_schema()).replace_schema_metadata(
        {"adaspec": json.dumps(meta)})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())


def _schema():
    import pyarrow as pa

    return pa.schema([
        ("id", pa.string()), ("task", pa.string()), ("source", pa.string()), ("prompt", pa.string()),
        ("prompt_text", pa.string()), ("prompt_ids", pa.list_(pa.int32())), ("response", pa.string()),
        ("response_ids", pa.list_(pa.int32())), ("temperature", pa.float64()), ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int32()), ("response_tokens", pa.int32()), ("filtered", pa.string()),
    ])


def _shard_meta(path: Path) -> dict | None:
    import pyarrow.parquet as pq

    try:
        md = pq.read_schema(path).metadata or {}
        return json.loads(md[b"adaspec"])
    except Exception:  # unreadable or foreign file: regenerate it
        return None


def _fingerprint(recipe: DistillRecipe, units: list[Unit], prompt_ids: list[list[int]], dtype: torch.dtype) -> str:
    """What the rows depend on: the recipe with the *resolved* dtype (``auto`` differs between machines and
    changes the numbers), without the device (a run may resume on another device in the same dtype)."""
    d = to_dict(recipe)
    d.pop("out", None)
    d.pop("device", None)
    # where rows may be copied from is not what they are: a reused row is the target's answer under the same
    # recorded conditions (checked before it is taken), so runs written before the field existed still resume
    d.pop("reuse", None)
    d.pop("max_minutes", None)  # when a session stops, not what its rows are
    d["dtype"] = dtype_name(dtype)
    d["generation"].pop("threads", None)  # speed only: may change between sessions
    h = hashlib.sha256(json.dumps([FORMAT_VERSION, d], sort_keys=True).encode())
    for u in units:
        h.update(f"{u.uid}:{prompt_ids[u.prompt]}\n".encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- the job

def _load_tokenizer(recipe: DistillRecipe):
    from transformers import AutoTokenizer

    from decode.core.models import resolve_path

    path = resolve_path(recipe.target)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=recipe.trust_remote_code)
    except OSError as exc:
        raise UserError(f"target: could not load the tokenizer of '{recipe.target}': {exc}") from None


def select_rendered(recipe: DistillRecipe, tokenizer):
    """The recipe's prompts (leakage-checked against its eval files, too-long ones skipped) and each prompt's
    rendering through the recipe's template: ``(selection, {prompt text: (rendered text, ids)})``."""
    index = EvalIndex.from_files(recipe.leakage.eval_files, recipe.leakage.ngram)
    rendered: dict[str, tuple[str, list[int]]] = {}

    def check(p):
        text, ids = recipe.template.render(tokenizer, p.text)
        if len(ids) > recipe.generation.max_prompt_tokens:
            return "too_long"
        rendered[p.text] = (text, ids)
        return None

    sel = select_prompts(recipe.sources, recipe.num_prompts, eval_index=index, check=check,
                         shuffle=recipe.shuffle, seed=recipe.seed)
    return sel, rendered


@dataclass
class ReuseSource:
    """Where this run's rows may come from instead of the target: ``rows`` (shipped rows by id; empty when nothing
    is reused), the ``folder`` they come from, and when nothing is, why (``skipped``; ``notice``: the line to print)."""
    folder: Path | None = None
    rows: dict[str, dict] = field(default_factory=dict)
    skipped: str | None = None
    notice: str | None = None

    def row_for(self, unit: Unit, prompt_ids: list[int]) -> dict | None:
        """The shipped row for ``unit`` when there is one rendered to the same prompt ids as this run's."""
        row = self.rows.get(unit.uid)
        return row if row is not None and list(row["prompt_ids"]) == list(prompt_ids) else None


def auto_answers_folder(target: str) -> Path | None:
    """``reuse=auto``'s folder: ``pretrained/<target>/answers`` for an alias target (a local folder or hub id
    names no shipped answers), whether or not it exists."""
    from decode.core.models import ALIASES

    return REPO_ROOT / "pretrained" / target / "answers" if target in ALIASES else None


def _reuse_source(recipe: DistillRecipe, dtype: torch.dtype) -> ReuseSource:
    """The answers folder named by ``recipe.reuse`` and its rows for ``recipe.task``, checked against this run's
    conditions. An explicit folder that cannot be used is a :class:`UserError`; ``auto`` falls back to generating."""
    if recipe.reuse is None:
        return ReuseSource(skipped="reuse=null")
    explicit = recipe.reuse != "auto"
    if explicit:
        folder = resolve_repo_path(recipe.reuse) or Path(recipe.reuse).expanduser()
    else:
        folder = auto_answers_folder(recipe.target)
        if folder is None or not (folder / shipped_answers.RECORD).is_file():
            return ReuseSource(skipped=f"no shipped answers for target {recipe.target!r} (reuse=auto)")
    shown = shipped_answers._portable(folder)
    fix = "pass reuse=null to generate every row" + (", or reuse=<another answers folder>" if explicit else "")

    def cannot(reason: str) -> ReuseSource:
        if explicit:
            raise UserError(f"reuse={recipe.reuse}: {reason}; {fix}")
        return ReuseSource(skipped=reason, notice=f"distill {recipe.task}: not reusing {shown} ({reason})")

    try:
        record = shipped_answers.read_record(folder)
    except UserError as exc:
        return cannot(str(exc))
    entry = record["tasks"].get(recipe.task)
    if entry is None:
        return cannot(f"no {recipe.task} answers there (it has {', '.join(sorted(record['tasks'])) or 'none'})")
    here = shipped_answers.conditions({"recipe": to_dict(recipe), "target": {"dtype": dtype_name(dtype)}})
    diffs = shipped_answers.differences(here, entry.get("conditions") or {})
    if diffs:
        if explicit:
            raise UserError(f"reuse={recipe.reuse}: its {recipe.task} answers were distilled under other conditions: "
                            f"{'; '.join(diffs)}; {fix}, or set those fields as they are there "
                            f"(e.g. dtype=..., generation.max_new_tokens=...) with another out")
        return cannot(f"other conditions: {'; '.join(diffs)}")
    try:
        rows = shipped_answers.load_answers(folder, recipe.task)
    except UserError as exc:
        return cannot(str(exc))
    return ReuseSource(folder=folder, rows={r["id"]: r for r in rows})


def distill(recipe: DistillRecipe, *, model=None, tokenizer=None, overwrite: bool = False,
            progress: bool = True) -> dict:
    """Run (or resume) a distillation recipe; returns the manifest. ``model``/``tokenizer`` override the target."""
    t_start = time.time()
    out = recipe.out_dir
    gen = recipe.generation
    if model is None:  # checked before anything loads: `device=cuda` on a machine without one is one line
        device = resolve_device_field(recipe.device, "device")
        dtype = resolve_dtype(recipe.dtype, device, flag="dtype")
    else:
        p = next(model.parameters())
        device, dtype = p.device, p.dtype
    if tokenizer is None:
        tokenizer = _load_tokenizer(recipe)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    sel, rendered = select_rendered(recipe, tokenizer)
    prompts = sel.prompts
    prompt_text = [rendered[p.text][0] for p in prompts]
    prompt_ids = [rendered[p.text][1] for p in prompts]
    units = plan_units(recipe.task, prompts, prompt_ids, gen.temperatures)
    fp = _fingerprint(recipe, units, prompt_ids, dtype)
    n_shards = (len(units) + recipe.shard_size - 1) // recipe.shard_size
    reuse = _reuse_source(recipe, dtype)  # before `out` is touched: a wrong reuse= folder is one line

    def shard_units(k: int) -> list[Unit]:
        return units[k * recipe.shard_size:(k + 1) * recipe.shard_size]

    manifest_path = out / "manifest.json"
    old: dict = {}
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text())
        if old.get("fingerprint") != fp:
            if not overwrite:
                changed = sorted(k for k in set(old.get("recipe", {})) | set(to_dict(recipe))
                                 if k not in ("out", "device", "reuse")
                                 and old.get("recipe", {}).get(k) != to_dict(recipe).get(k))
                old_dtype = old.get("target", {}).get("dtype")
                if old_dtype and old_dtype != dtype_name(dtype) and "dtype" not in changed:
                    changed.append(f"dtype {old_dtype} → {dtype_name(dtype)} (auto: bfloat16 on CUDA, float32 on CPU)")
                if old.get("format_version") != FORMAT_VERSION:
                    changed.append(f"written by toolkit format {old.get('format_version')}, now {FORMAT_VERSION}")
                raise UserError(f"{out} holds a distillation run of a different recipe or prompt set "
                                f"(changed: {', '.join(changed) or 'selected prompts'}); pass out=<new dir> "
                                f"or --overwrite to replace it (its data stays readable with load_distilled)")
            for f in (out / "shards").glob("*.parquet"):
                f.unlink()
            old = {}
    (out / "shards").mkdir(parents=True, exist_ok=True)
    for stale in (out / "shards").glob(".shard-*.tmp"):  # a run killed while writing
        stale.unlink()

    done: dict[int, dict] = {}
    for k in range(n_shards):
        p = _shard_path(out, k)
        if p.is_file():
            meta = _shard_meta(p)
            if meta and meta.get("fingerprint") == fp and meta.get("shard") == k:
                done[k] = meta
    for p in (out / "shards").glob("shard-*.parquet"):  # foreign / beyond-plan files never mix in
        if int(p.stem.split("-")[1]) not in done:
            p.unlink()

    base = {
        "format_version": FORMAT_VERSION, "task": recipe.task, "fingerprint": fp, "recipe": to_dict(recipe),
        "target": {"spec": recipe.target,
                   "model": type(model).__name__ if model is not None else old.get("target", {}).get("model"),
                   "tokenizer": getattr(tokenizer, "name_or_path", None),
                   "device": str(device), "dtype": dtype_name(dtype)},
        "started_unix": old.get("started_unix", round(t_start, 1)), "sessions": old.get("sessions", 0) + 1,
        "prompts": sel.stats, "shards": n_shards, "planned_rows": len(units), "columns": list(COLUMNS),
    }

    def reuse_block() -> dict:
        block = {"folder": shipped_answers._portable(reuse.folder) if reuse.folder else None,
                 "rows_reused": sum(m.get("reused_rows", 0) for m in done.values())}
        return {**block, "skipped": reuse.skipped} if reuse.skipped else block

    atomic_write_json(manifest_path, {**base, "status": "running", "completed_shards": len(done),
                                      "reuse": reuse_block()}, indent=2)

    pending = [k for k in range(n_shards) if k not in done]
    stopped = False
    session_tokens, session_gen_s = 0, 0.0
    if pending and reuse.notice:
        print(reuse.notice, file=sys.stderr)
    taken = {u.uid: row for k in pending for u in shard_units(k)
             if (row := reuse.row_for(u, prompt_ids[u.prompt])) is not None}
    pending.sort(key=lambda k: _shard_priority(shard_units(k), taken))
    if pending:
        eos_ids: set[int] = set()
        if any(u.uid not in taken for k in pending for u in shard_units(k)):  # else the target is never loaded
            if model is None:
                from decode.core.models import load_model

                model, _ = load_model(recipe.target, dtype=dtype, device=device,
                                      trust_remote_code=recipe.trust_remote_code)
                base["target"]["model"] = type(model).__name__
            limit = getattr(model.config, "max_position_embeddings", None)
            longest = max(len(ids) for ids in prompt_ids) + gen.max_new_tokens
            if limit and longest > limit:
                raise UserError(f"generation: the longest prompt ({longest - gen.max_new_tokens} tokens) plus "
                                f"max_new_tokens ({gen.max_new_tokens}) exceeds the target's context of {limit}; "
                                f"lower generation.max_prompt_tokens or generation.max_new_tokens")
            eos_ids = set(eos_token_ids(model, tokenizer))
        from tqdm.auto import tqdm

        threads_before = torch.get_num_threads()
        if gen.threads:
            torch.set_num_threads(gen.threads)

        bar = tqdm(total=len(units), initial=sum(m["rows"] for m in done.values()), unit="row",
                   desc=f"distill {recipe.task}", disable=not progress, dynamic_ncols=True)
        live = {"tokens": 0, "t0": time.perf_counter(), "shown": 0.0}

        def on_step(n: int) -> None:  # tokens/s while a long batch is still running
            live["tokens"] += n
            now = time.perf_counter()
            if progress and now - live["shown"] >= 1.0:
                live["shown"] = now
                bar.set_postfix_str(f"{live['tokens'] / (now - live['t0']):.1f} tok/s, {live['tokens']} tok",
                                    refresh=True)
        try:
            for k in pending:
                planned = shard_units(k)
                by_uid = {u.uid: _reused_row(recipe, tokenizer, prompts[u.prompt], prompt_text[u.prompt],
                                             prompt_ids[u.prompt], u, taken[u.uid])
                          for u in planned if u.uid in taken}
                bar.update(len(by_uid))
                fresh = [u for u in planned if u.uid not in by_uid]  # generated in batches, seeded as always
                tokens, secs = 0, 0.0
                for b in range(0, len(fresh), gen.batch_size):
                    batch = fresh[b:b + gen.batch_size]
                    g = torch.Generator().manual_seed(recipe.seed * 1_000_003 + k * 10_007 + b)
                    t0 = time.perf_counter()
                    outs = generate_batch(model, [prompt_ids[u.prompt] for u in batch],
                                          sampling=[SamplingConfig(u.temperature, gen.top_k, gen.top_p)
                                                    for u in batch],
                                          max_new_tokens=gen.max_new_tokens, eos_ids=eos_ids, pad_id=pad_id,
                                          generator=g, on_step=on_step)
                    secs += time.perf_counter() - t0
                    n_tok = sum(len(o.ids) for o in outs)
                    tokens += n_tok
                    session_tokens += n_tok
                    session_gen_s += time.perf_counter() - t0
                    for u, o in zip(batch, outs):
                        by_uid[u.uid] = _row(recipe, tokenizer, prompts[u.prompt], prompt_text[u.prompt],
                                             prompt_ids[u.prompt], u, o, eos_ids)
                    bar.update(len(batch))
                rows = [by_uid[u.uid] for u in planned]  # plan order, reused or not
                meta = {"fingerprint": fp, "shard": k, "rows": len(rows), "generated_tokens": tokens,
                        "generation_seconds": round(secs, 3), "reused_rows": len(rows) - len(fresh)}
                _write_shard(_shard_path(out, k), rows, meta)
                done[k] = meta
                atomic_write_json(manifest_path, {**base, "status": "running", "completed_shards": len(done),
                                                  "reuse": reuse_block()}, indent=2)
                if (recipe.max_minutes is not None and len(done) < n_shards
                        and time.time() - t_start >= recipe.max_minutes * 60):
                    stopped = True
                    break
        finally:
            bar.close()
            torch.set_num_threads(threads_before)

    manifest = {**base, **_summarise(out, done, recipe), "status": "stopped" if stopped else "complete",
                "completed_shards": len(done), "reuse": reuse_block(),
                "time": {"finished_unix": round(time.time(), 1),
                         "this_session_seconds": round(time.time() - t_start, 2),
                         "this_session_generation_seconds": round(session_gen_s, 2),
                         "this_session_generated_tokens": session_tokens}}
    atomic_write_json(manifest_path, manifest, indent=2)
    return manifest


def _shard_priority(planned: list[Unit], taken: dict) -> tuple[bool, int]:
    """Sort key of a pending shard: wholly shipped shards first (they cost no generation), then the shards with the
    most rows to generate. A shard a stopped run already finished holds few of them — only the rows the filters
    dropped, which greedy decoding answers the same way again — so prompts never answered come before those
    re-attempts, and a time-limited run spends its minutes on new answers. Each shard keeps its own seed, so the
    rows do not depend on the order."""
    fresh = sum(u.uid not in taken for u in planned)
    return fresh > 0, -fresh


def _row(recipe, tokenizer, prompt, prompt_text, prompt_ids, unit: Unit, o: Generation, eos_ids) -> dict:
    body = o.ids[:-1] if o.finish_reason == "stop" and o.ids and o.ids[-1] in eos_ids else o.ids
    text = tokenizer.decode(body, skip_special_tokens=False)
    return {
        "id": unit.uid, "task": recipe.task, "source": prompt.source, "prompt": prompt.text,
        "prompt_text": prompt_text, "prompt_ids": list(prompt_ids), "response": text, "response_ids": o.ids,
        "temperature": unit.temperature, "finish_reason": o.finish_reason, "prompt_tokens": len(prompt_ids),
        "response_tokens": len(o.ids), "filtered": first_match(text, body, o.finish_reason, recipe.filters),
    }


def _reused_row(recipe, tokenizer, prompt, prompt_text, prompt_ids, unit: Unit, shipped: dict) -> dict:
    """The row :func:`_row` would write for a shipped answer: same text decoding, filters recomputed."""
    ids = list(shipped["response_ids"])
    # generate_batch says "stop" only when the last token is an end-of-sequence token: that one is stripped
    eos = {ids[-1]} if shipped["finish_reason"] == "stop" and ids else set()
    return _row(recipe, tokenizer, prompt, prompt_text, prompt_ids, unit, Generation(ids, shipped["finish_reason"]),
                eos)


def _summarise(out: Path, done: dict, recipe: DistillRecipe) -> dict:
    """Counts and throughput over the finished shards ``done`` (every shard once a run is complete)."""
    import pyarrow.parquet as pq

    filtered, finish, per_temp = Counter(), Counter(), Counter()
    rows = kept = resp_tokens = 0
    for k in sorted(done):
        t = pq.read_table(_shard_path(out, k), columns=["filtered", "finish_reason", "temperature",
                                                        "response_tokens"]).to_pydict()
        rows += len(t["filtered"])
        for f, fr, temp in zip(t["filtered"], t["finish_reason"], t["temperature"]):
            filtered[f or "kept"] += 1
            finish[fr] += 1
            per_temp[str(temp)] += 1
        resp_tokens += sum(t["response_tokens"])
    kept = filtered.pop("kept", 0)
    gen_s = sum(m["generation_seconds"] for m in done.values())
    gen_tok = sum(m["generated_tokens"] for m in done.values())
    gen_rows = rows - sum(m.get("reused_rows", 0) for m in done.values())
    return {
        "counts": {"rows": rows, "kept": kept, "filtered": sum(filtered.values()), "response_tokens": resp_tokens,
                   "finish_reason": dict(finish), "rows_per_temperature": dict(per_temp)},
        "filters": {"rules": list(recipe.filters.rules),
                    "dropped": {r: filtered.get(r, 0) for r in recipe.filters.rules}},
        "throughput": {"generated_tokens": gen_tok, "generation_seconds": round(gen_s, 2),
                       "tokens_per_s": round(gen_tok / gen_s, 2) if gen_s else None,
                       "rows_per_s": round(gen_rows / gen_s, 3) if gen_s else None,
                       "batch_size": recipe.generation.batch_size},
    }


# --------------------------------------------------------------------------- reading side

def load_distilled(out_dir, *, include_filtered: bool = False, allow_partial: bool = False):
    """The distilled rows of one run directory (or a list of them) as a ``datasets.Dataset``.

    Rows flagged by a filter are dropped unless ``include_filtered``. An unfinished run is an error
    unless ``allow_partial`` (then only its finished shards are read).
    """
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    dirs = [out_dir] if isinstance(out_dir, (str, Path)) else list(out_dir)
    tables = []
    for d in map(Path, dirs):
        mf = d / "manifest.json"
        if not mf.is_file():
            raise UserError(f"no distilled dataset at {d} (manifest.json missing); create it with "
                            f"`make distill TASK=<task>` or `python -m toolkit distill --task <task>`")
        manifest = json.loads(mf.read_text())
        if manifest.get("status") != "complete" and not allow_partial:
            raise UserError(f"distillation in {d} is unfinished ({manifest.get('completed_shards')}/"
                            f"{manifest.get('shards')} shards); rerun the same command to resume it, "
                            f"or pass allow_partial=True")
        for k in range(manifest["shards"]):
            p = _shard_path(d, k)
            meta = _shard_meta(p) if p.is_file() else None
            if meta is None or meta.get("fingerprint") != manifest["fingerprint"]:
                if allow_partial:
                    continue
                raise UserError(f"{p} is missing or from another run; rerun the distillation to repair {d}")
            tables.append(pq.read_table(p, schema=_schema()).replace_schema_metadata(None))
    table = pa.concat_tables(tables) if tables else _schema().empty_table()
    if not include_filtered:
        table = table.filter(pc.equal(table["filtered"], ""))
    return datasets.Dataset(datasets.table.InMemoryTable(table))


# --------------------------------------------------------------------------- CLI

def add_arguments(parser) -> None:
    g = parser.add_mutually_exclusive_group(required=True)
    g.add_argument("--recipe", help="recipe YAML, e.g. recipes/tasks/math.yaml")
    g.add_argument("--task", help="shorthand for recipes/tasks/<task>.yaml (math, code, chat, summarization, "
                                  "translation, qa)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="recipe overrides, dotted keys: num_prompts=64 generation.batch_size=16 target=... "
                             "device=auto|cpu|cuda[:N] dtype=auto|float32|bfloat16|float16")
    parser.add_argument("--overwrite", action="store_true", help="replace a run of a different recipe in `out`")
    parser.add_argument("--print-recipe", action="store_true", help="print the resolved recipe and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    recipe = load_distill_recipe(args.recipe, args.overrides, task=args.task)
    if args.print_recipe:
        print(dump_yaml(recipe), end="")
        return 0
    m = distill(recipe, overwrite=args.overwrite, progress=not args.no_progress)
    c, tp, ru = m["counts"], m["throughput"], m["reuse"]
    reused = (f"{ru['rows_reused']} reused" + (f" from {ru['folder']}" if ru["folder"] else "")
              if ru["rows_reused"] else "none reused")
    speed = f"{tp['tokens_per_s']} tok/s" if tp["tokens_per_s"] is not None else "no tokens generated"
    print(f"distill {recipe.task}: {c['rows']} rows ({c['kept']} kept, filtered {m['filters']['dropped']}; "
          f"{reused}, {c['rows'] - ru['rows_reused']} generated), {c['response_tokens']} response tokens, "
          f"{speed} → {recipe.out_dir}", file=sys.stderr)
    if m["status"] == "stopped":
        print(f"distill {recipe.task}: stopped by max_minutes={recipe.max_minutes} after {m['completed_shards']}/"
              f"{m['shards']} shards; the finished ones are usable (allow_partial_data=true); rerun the same "
              f"command to continue", file=sys.stderr)
    return 0
