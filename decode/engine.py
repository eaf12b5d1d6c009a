"""The BanditSpec loop: select arm → draft → verify → accept → roll back caches → update policy."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from .arms.base import Arm
from .draft import RoundRecord
from .errors import UserError
from .length import LengthController
from .policies.base import Policy
from .target import Target
from .traces import MODES, ArmStep, Trace, TraceStep, counterfactual_round, dense_trace
from .verify import Verifier


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int]  # new tokens only
    rounds: list[RoundRecord] = field(default_factory=list)
    wall_time: float = 0.0  # prefill + all rounds (+ trace recording when asked)
    stopped_by: str = "length"  # "eos" | "length"
    trace: Trace | None = None  # counterfactual trace when generate(..., trace=MODE)

    @property
    def target_forwards(self) -> int:
        """Every target forward of the decoding (MAT's denominator): one verification per round plus
        those arms ran themselves. Not counted: the prefill, the step-time measurement and
        counterfactual trace work (instrumentation, not decoding)."""
        return len(self.rounds) + sum(r.extra_target_forwards for r in self.rounds)


class SpecEngine:
    """step_time: seconds of one autoregressive step (a one-token target forward), the unit of the
    throughput reward; None = measure it once, at the start of the first ``generate``."""

    def __init__(self, target: Target, arms: list[Arm], verifier: Verifier, eos_token_ids=(),
                 step_time: float | None = None):
        if not arms:
            raise UserError("the engine needs at least one arm")
        if step_time is not None and not step_time > 0:
            raise UserError(f"step_time must be > 0 seconds, got {step_time}")
        self.target = target
        self.arms = arms
        self.verifier = verifier
        self.eos = set(int(e) for e in eos_token_ids)
        self.max_len = max(a.L for a in arms)
        self.step_time = step_time

    def measure_step_time(self, prompt_ids: list[int], repeats: int = 5) -> float:
        """Median time of ``repeats`` one-token target forwards + argmax after prefilling the prompt
        (one warm-up forward first); the cache is rolled back after each, so nothing changes."""
        self.target.prefill(prompt_ids)
        keep, last = len(prompt_ids) - 1, prompt_ids[-1]
        times = []
        for k in range(repeats + 1):
            t0 = time.perf_counter()
            int(self.target.score(last, torch.empty(0, dtype=torch.long)).logits[-1].argmax())  # syncs
            if k:
                times.append(time.perf_counter() - t0)
            self.target.rollback(keep)
        return statistics.median(times)

    def _arm_target_forwards(self) -> int:
        """Target forwards the arms have run themselves (an arm counts them in its ``target_forwards``)."""
        return sum(getattr(a, "target_forwards", 0) for a in self.arms)

    def generate(self, prompt_ids: list[int], policy: Policy, max_new_tokens: int,
                 length: LengthController | None = None, reset_policy: bool = True,
                 trace: str | bool | None = None) -> Generation:
        """Decode one prompt.

        reset_policy: start the query with ``policy.new_query()`` (re-initialises it unless it was
            built with carry=true); False leaves the policy exactly as it is.
        trace: None/False, "rounds" (or True) or "dense": also record a counterfactual trace of what
            every arm would have produced (decode/traces.py) in ``Generation.trace``.
        """
        if max_new_tokens <= 0:
            raise UserError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        if len(prompt_ids) == 0:
            raise UserError("empty prompt: there is nothing to continue")
        if policy.K != len(self.arms):
            raise ValueError(f"policy built for {policy.K} arms, engine has {len(self.arms)}")
        mode = "rounds" if trace is True else (trace or None)
        if mode is not None and mode not in MODES:
            raise UserError(f"trace must be one of {', '.join(MODES)}, got '{trace}'")
        length = length or LengthController()
        if self.step_time is None:
            self.step_time = self.measure_step_time(prompt_ids)
        start = time.perf_counter()
        if reset_policy:
            policy.new_query()
        length.reset()
        for arm in self.arms:
            arm.reset(prompt_ids)
        self.target.prefill(prompt_ids)
        ctx = list(prompt_ids)
        gen = Generation(len(prompt_ids), [])
        steps: list[TraceStep] = []
        while len(gen.tokens) < max_new_tokens:
            i = policy.select()
            arm = self.arms[i]
            remaining = max_new_tokens - len(gen.tokens)
            cf = counterfactual_round(self, ctx, remaining, skip=i) if mode == "rounds" else None
            f0 = self._arm_target_forwards()
            t0 = time.perf_counter()
            draft = arm.propose(ctx, min(arm.L, remaining - 1), length.keep_going(i))
            t1 = time.perf_counter()
            n = len(ctx)
            scored = self.target.score(ctx[-1], draft.tokens)
            outcome = self.verifier.verify(scored.logits, draft)
            self.target.rollback(n + outcome.accepted)
            t2 = time.perf_counter()
            new = outcome.tokens[:remaining]
            for j, tok in enumerate(new):
                if tok in self.eos:
                    new = new[:j + 1]
                    gen.stopped_by = "eos"
                    break
            if cf is not None:
                cf[i] = ArmStep(outcome.accepted + 1, len(draft), outcome.accepted, t1 - t0, t2 - t1,
                                list(outcome.tv), list(outcome.accept_prob))
                steps.append(TraceStep(len(gen.tokens), cf, i))
            ctx.extend(new)
            gen.tokens.extend(new)
            hidden = scored.hidden[:outcome.accepted + 1] if scored.hidden is not None else None
            if hidden is not None:
                length.observe_target(hidden[-1])
            for a in self.arms:
                a.observe(ctx, hidden if a.uses_target_hidden else None)
            # accepted draft tokens cut off by EOS are not counted: new = kept draft tokens (+ the bonus)
            rec = RoundRecord(arm=i, drafted=len(draft), accepted=min(outcome.accepted, len(new)),
                              new_tokens=len(new), draft_time=t1 - t0, verify_time=t2 - t1, tv=outcome.tv,
                              accept_prob=outcome.accept_prob, max_len=arm.L, step_time=self.step_time,
                              extra_target_forwards=self._arm_target_forwards() - f0)
            gen.rounds.append(rec)
            policy.update(i, rec)
            length.update(len(draft), outcome, arm=i)
            if gen.stopped_by == "eos":
                break
        if mode == "rounds":
            gen.trace = Trace("rounds", len(prompt_ids), max_new_tokens, len(gen.tokens), gen.stopped_by,
                              [a.label for a in self.arms], [a.L for a in self.arms], steps,
                              step_time=self.step_time)
        elif mode == "dense":
            starts, pos = {}, 0
            for r in gen.rounds:
                starts[pos] = r.arm
                pos += r.new_tokens
            gen.trace = dense_trace(self, prompt_ids, gen.tokens, max_new_tokens, gen.stopped_by, starts)
            gen.trace.step_time = self.step_time
        gen.wall_time = time.perf_counter() - start
        return gen
