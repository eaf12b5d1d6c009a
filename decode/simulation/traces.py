"""Counterfactual traces: from one prefix, what EVERY arm would have produced.

At a recorded position each arm proposes from the same context, the target scores that draft and
the verifier decides, then the target cache is rolled back — so the simulator (``decode simulate
--traces``) can replay any policy offline on real model behaviour.

Recorded by :func:`record_trace` (``record_trace(engine, prompt_ids, policy, max_new_tokens, MODE)``),
which drives the engine's own round (``SpecEngine.step``; a counterfactual step is the same round with
a forced arm that commits nothing). Two modes:
- ``"rounds"``: at each live round, before the live arm drafts, every other arm is scored from the
  same prefix (K − 1 extra target forwards per round). The live arm's entry is the live round
  itself. Cheap; a replay is exact for policies that visit the same positions (e.g. the fixed arm
  that produced the trace); elsewhere the simulator uses the nearest earlier recorded position.
- ``"dense"``: after the generation, every arm is scored at EVERY token position of the output
  (K target forwards per generated token). Under greedy decoding the output does not depend on the
  policy, so a replay of ANY policy is exact.

Random-number state (torch's global RNG, the verifier's and the arms' generators) is saved before
and restored after the counterfactual work, so the live output is the one an untraced run makes.
Timings of traced runs include that extra work (and an independent drafter never has to catch up
its cache), so measure speed in untraced runs. The counterfactual target forwards are instrumentation:
they are not counted in ``Generation.target_forwards``.

File format (``write_traces``/``load_traces``): JSON ``{"version": 1, "traces": [Trace.to_dict()]}``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..core.draft import StepResult
from ..engine.loop import DecodeState, Generation, SpecEngine
from ..common.errors import UserError
from ..common.io import atomic_write_json
from ..choose.length import LengthController
from ..choose.policies.base import Policy

VERSION = 1
MODES = ("rounds", "dense")


@dataclass
class ArmStep:
    """What one arm produced (or would have produced) from one prefix."""

    y: int  # tokens the round yields: accepted + 1 (before any EOS/budget truncation)
    drafted: int
    accepted: int  # the verifier's count
    draft_time: float = 0.0
    verify_time: float = 0.0
    tv: list[float] = field(default_factory=list)  # per drafted position, as in Outcome
    accept_prob: list[float] = field(default_factory=list)


@dataclass
class TraceStep:
    pos: int  # generated tokens before this prefix (0 = right after the prompt)
    arms: list[ArmStep]
    live: int = -1  # the arm the live run played here (-1: not a live round start)


@dataclass
class Trace:
    mode: str
    prompt_len: int
    max_new_tokens: int
    n_tokens: int  # tokens the live run generated
    stopped_by: str
    arm_labels: list[str]
    arm_L: list[int]
    steps: list[TraceStep] = field(default_factory=list)
    mismatches: int = 0  # dense greedy: positions whose verified tokens disagree with the output
    meta: dict = field(default_factory=dict)  # free-form (prompt id, category, policy, ...)
    step_time: float = 0.0  # seconds of one autoregressive step in the recording run (0: not recorded)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Trace":
        steps = [TraceStep(s["pos"], [ArmStep(**a) for a in s["arms"]], s.get("live", -1)) for s in d["steps"]]
        return Trace(d["mode"], d["prompt_len"], d["max_new_tokens"], d["n_tokens"], d["stopped_by"],
                     list(d["arm_labels"]), list(d["arm_L"]), steps, d.get("mismatches", 0), d.get("meta", {}),
                     d.get("step_time", 0.0))


class RngGuard:
    """Save torch RNG states the counterfactual work would consume, restore them on exit."""

    def __init__(self, engine):
        gens = [getattr(engine.verifier, "generator", None)] + [getattr(a, "generator", None) for a in engine.arms]
        self.gens = list({id(g): g for g in gens if isinstance(g, torch.Generator)}.values())

    def __enter__(self):
        self.global_state = torch.get_rng_state()
        self.states = [g.get_state() for g in self.gens]
        return self

    def __exit__(self, *exc):
        torch.set_rng_state(self.global_state)
        for g, s in zip(self.gens, self.states):
            g.set_state(s)
        return False


def arm_step(res: StepResult) -> ArmStep:
    """The trace entry of one (live or counterfactual) round."""
    o = res.outcome
    return ArmStep(o.accepted + 1, len(res.draft), o.accepted, res.times.draft,
                   res.times.score + res.times.verify + res.times.rollback, list(o.tv), list(o.accept_prob))


def counterfactual_round(engine: SpecEngine, state: DecodeState, skip: int) -> list[ArmStep | None]:
    """Every arm except ``skip`` (the live one) from the same prefix; the live path is untouched."""
    out: list[ArmStep | None] = [None] * len(engine.arms)
    with RngGuard(engine):
        for j in range(len(engine.arms)):
            if j != skip:
                out[j] = arm_step(engine.step(state, j, counterfactual=True))
    return out


def dense_trace(engine: SpecEngine, prompt_ids: list[int], tokens: list[int], max_new_tokens: int, stopped_by: str,
                policy: Policy, live_starts: dict[int, int] | None = None) -> Trace:
    """Score every arm at every position of a finished generation (fresh prefill; arms reset); after
    the K counterfactual steps at a position, the output's next token is committed."""
    tr = Trace("dense", len(prompt_ids), max_new_tokens, len(tokens), stopped_by,
               [a.label for a in engine.arms], [a.L for a in engine.arms], step_time=engine.step_time or 0.0)
    live_starts = live_starts or {}
    K = len(engine.arms)
    with RngGuard(engine):
        state = engine.begin(prompt_ids, policy, max_new_tokens, reset_policy=False)
        for m in range(len(tokens)):
            n = len(state.ctx)
            steps, hidden = [], None
            for j in range(K):
                # the last arm keeps ctx[-1] in the cache: the next prefix is one token longer
                res = engine.step(state, j, counterfactual=True, keep=n if j == K - 1 else None)
                steps.append(arm_step(res))
                if hidden is None and res.hidden is not None:
                    hidden = res.hidden.rows(slice(0, 1))
                k = min(len(res.outcome.tokens), len(tokens) - m)
                if engine.verifier.cfg.greedy and res.outcome.tokens[:k] != tokens[m:m + k]:
                    tr.mismatches += 1
            tr.steps.append(TraceStep(m, steps, live_starts.get(m, -1)))
            engine.commit(state, [tokens[m]], hidden)
    return tr


def record_trace(engine: SpecEngine, prompt_ids: list[int], policy: Policy, max_new_tokens: int,
                 mode: str = "dense", length: LengthController | None = None,
                 reset_policy: bool = True) -> Generation:
    """Decode one prompt like ``engine.generate`` and record its counterfactual trace (``mode``
    "rounds" or "dense", see the module docstring) in ``Generation.trace``. The live output equals an
    untraced run's; ``wall_time`` includes the trace work."""
    if mode not in MODES:
        raise UserError(f"trace mode must be one of {', '.join(MODES)}, got '{mode}'")
    state = engine.begin(prompt_ids, policy, max_new_tokens, length, reset_policy)
    steps: list[TraceStep] = []
    while not state.done:
        if mode == "rounds":
            pos, i = len(state.tokens), state.policy.select()
            cf = counterfactual_round(engine, state, skip=i)
            res = engine.step(state, i)
            cf[i] = arm_step(res)
            steps.append(TraceStep(pos, cf, i))
        else:
            engine.step(state)
    if mode == "rounds":
        trace = Trace("rounds", len(state.prompt_ids), max_new_tokens, len(state.tokens), state.stopped_by,
                      [a.label for a in engine.arms], [a.L for a in engine.arms], steps,
                      step_time=engine.step_time)
    else:
        starts, pos = {}, 0
        for r in state.rounds:
            starts[pos] = r.arm
            pos += r.new_tokens
        trace = dense_trace(engine, state.prompt_ids, state.tokens, max_new_tokens, state.stopped_by,
                            state.policy, starts)
    gen = engine.finish(state)
    gen.trace = trace
    return gen


def write_traces(path: str | os.PathLike, traces: list[Trace | dict]) -> None:
    """Write traces atomically as JSON (parent folders are created)."""
    data = {"version": VERSION, "traces": [t.to_dict() if isinstance(t, Trace) else t for t in traces]}
    atomic_write_json(path, data, indent=None)


def load_traces(path: str | os.PathLike) -> list[Trace]:
    path = Path(path)
    if not path.exists():
        raise UserError(f"--traces: no file at {path}; record one with `decode eval --record-traces {path}`")
    if path.is_dir():
        raise UserError(f"--traces: {path} is a folder; pass the trace file `decode eval --record-traces` wrote")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"--traces: {path} is not UTF-8 text (a binary file?); pass the JSON trace file "
                        f"`decode eval --record-traces` wrote") from None
    except OSError as exc:
        raise UserError(f"--traces: cannot read {path} ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"--traces: {path} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("version") != VERSION or "traces" not in data:
        raise UserError(f"--traces: {path} is not a version-{VERSION} trace file written by "
                        "`decode eval --record-traces`")
    traces = [Trace.from_dict(d) for d in data["traces"]]
    if not traces:
        raise UserError(f"--traces: {path} holds no traces")
    return traces
