"""The BanditSpec loop. One round is :meth:`SpecEngine.step`: select an arm → propose → score (one
target forward) → verify → roll the target cache back → commit the kept tokens, let every arm observe,
update the policy and the length controller. ``generate`` is ``begin`` + ``step`` until done + ``finish``;
counterfactual traces (decode/simulation/traces.py) drive the same ``step``.

Timed regions synchronise the target's device first (decode/common/device.py), so queued GPU work falls
inside the phase that issued it. The round moves nothing of size V to the host: the verifier packs what
the host needs (accepted count, next token, per-position statistics, the draft ids) into one small
transfer (decode/core/verify/__init__.py ``Verifier.verify``).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from ..choose.arms.base import Arm, ArmEnv, build_arms
from ..core.attention import gqa_attention_model, probe_attention
from ..core.cost import CostCurve, probe
from ..common.device import synchronize
from ..core.draft import RoundRecord, StepResult, StepTimes
from ..common.errors import UserError
from ..core.hidden import HiddenStates
from ..core.lean import resolve_forward
from ..core.linear import linear_model, pack_arm_linears, packing_of, probe_linear
from ..choose.feedback import CounterfactualScorer, PendingRound
from ..choose.length import LengthController
from ..core.models import eos_token_ids
from ..choose.policies.base import Policy
from ..choose.policies.simple import Fixed
from ..core.sampling import SamplingConfig
from ..core.target import Target
from ..core.tree import draft_depth
from ..core.verify import Verifier


def reads_cost(policy: Policy, length: LengthController) -> bool:
    """Whether a query decoded with ``policy`` and ``length`` reads the verification cost curve (which is then
    probed first: :meth:`SpecEngine.seed_cost`)."""
    return policy.uses_cost or length.uses_cost


class TokenBudget:
    """What a sequence in flight knows of its end: ``max_new_tokens``, ``tokens`` generated, ``stopped_by``
    (one definition for the serial engine's query and the batched engine's row)."""

    max_new_tokens: int
    tokens: list[int]
    stopped_by: str

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)

    @property
    def done(self) -> bool:
        return self.stopped_by == "eos" or self.remaining <= 0


@dataclass
class DecodeState(TokenBudget):
    """One query in flight (made by :meth:`SpecEngine.begin`, advanced by :meth:`SpecEngine.step`)."""

    prompt_ids: list[int]
    policy: Policy
    length: LengthController
    max_new_tokens: int
    ctx: list[int] = field(default_factory=list)  # prompt + generated tokens
    tokens: list[int] = field(default_factory=list)  # generated tokens
    rounds: list[RoundRecord] = field(default_factory=list)
    times: list[StepTimes] = field(default_factory=list)  # per round, beside ``rounds``
    stopped_by: str = "length"  # "eos" | "length"
    start: float = 0.0  # perf_counter() when the query started (after any step-time measurement)
    setup_time: float = 0.0  # seconds of begin(): policy/controller/arm resets and the target prefill
    # full-information feedback (decode/choose/feedback.py): rounds whose counterfactuals are not resolved yet;
    # None when the policy learns from the played arm only (nothing is scored)
    pending: list[PendingRound] | None = None
    # the target's hidden states at the cached positions, prompt first (kept for the prefix cache, which stores the
    # finished sequence: Target.remember); None when there is no prefix cache or the arms read none
    hidden: list[HiddenStates] | None = None


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int]  # new tokens only
    rounds: list[RoundRecord] = field(default_factory=list)
    wall_time: float = 0.0  # setup (resets + prefill) + all rounds (+ trace recording, decode/simulation/traces.py)
    stopped_by: str = "length"  # "eos" | "length"
    trace: object | None = None  # a decode.simulation.traces.Trace when recorded with its record_trace
    setup_time: float = 0.0  # the part of wall_time spent in begin() (resets + prefill)
    step_times: list[StepTimes] = field(default_factory=list)  # per round, beside ``rounds``

    @property
    def target_forwards(self) -> int:
        """Every target forward of the decoding (MAT's denominator): one verification per round plus
        those arms ran themselves. Not counted: the prefill, the step-time measurement and
        counterfactual trace work (instrumentation, not decoding)."""
        return len(self.rounds) + sum(r.extra_target_forwards for r in self.rounds)


class SpecEngine:
    """step_time: seconds of one autoregressive step (a one-token target forward), the unit of the
    throughput reward; None = measure it once, at the start of the first query (``begin``)."""

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
        self.max_nodes = max(getattr(a, "max_nodes", a.L) for a in arms)  # tree arms score more positions than L
        self.step_time = step_time
        self.scorer = CounterfactualScorer(arms, greedy=verifier.cfg.greedy)
        self.cost = CostCurve()  # c(n): every round's verification forward is a measurement (decode/core/cost.py)
        # seconds a live round spends outside drafting and verification (choice, feedback, bookkeeping), a running
        # mean: part of every round's cost whatever it drafts (the cost-aware router adds it to c(n))
        self.round_overhead = 0.0

    def set_sampling(self, cfg: SamplingConfig) -> None:
        """Decode the next queries under ``cfg`` (temperature, top-k, top-p): the verifier, every arm's draft
        distribution and the counterfactual scorer's exactness all follow it (``decode serve`` sets it per
        request). Not mid-query: a round's draft and its verification must use the same config."""
        self.verifier.cfg = cfg
        self.scorer.greedy = cfg.greedy
        for a in self.arms:
            a.set_sampling(cfg)

    def _clock(self) -> float:
        """perf_counter() once the target's device has finished its queued work."""
        synchronize(getattr(self.target, "device", None))
        return time.perf_counter()

    def measure_step_time(self, prompt_ids: list[int], repeats: int = 5) -> float:
        """Median time of ``repeats`` one-token target forwards + argmax after prefilling the prompt
        (one warm-up forward first); the cache is rolled back after each, so nothing changes."""
        self.target.prefill(prompt_ids)
        keep, last = len(prompt_ids) - 1, prompt_ids[-1]
        times = []
        for k in range(repeats + 1):
            t0 = self._clock()
            int(self.target.score(last, torch.empty(0, dtype=torch.long)).logits[-1].argmax())  # syncs
            if k:
                times.append(self._clock() - t0)
            self.target.rollback(keep)
        return statistics.median(times)

    def prepare(self, prompt_lengths, max_new_tokens: int, *, show: bool = True) -> dict | None:
        """Before a run of queries: size the target's cache for the longest of them once (a static cache then
        keeps one shape for the whole run) and, on a compiled target, compile the verification forward for
        every number of positions a chain round can score (1 … max L + 1; trees run eagerly). Returns the
        compiled target's ``describe()`` (graphs, seconds), or None when nothing is compiled."""
        lengths = [int(n) for n in prompt_lengths]
        if lengths:
            self.target.reserve_capacity(max(lengths) + max_new_tokens + self.max_nodes + 1)
        if self.target.compiled is None:
            return None
        self.target.warm_up(self.max_len + 1, show=show)
        return self.target.compiled.describe()

    def _arm_target_forwards(self) -> int:
        """Target forwards the arms have run themselves (an arm counts them in its ``target_forwards``)."""
        return sum(getattr(a, "target_forwards", 0) for a in self.arms)

    # ---- one query: begin → step … → finish ------------------------------------------------------------

    def begin(self, prompt_ids: list[int], policy: Policy, max_new_tokens: int,
              length: LengthController | None = None, reset_policy: bool = True) -> DecodeState:
        """Start a query: validate, measure the step time if not known yet, reset the policy (unless
        ``reset_policy`` is False), the length controller and every arm, and prefill the target."""
        if max_new_tokens <= 0:
            raise UserError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        if len(prompt_ids) == 0:
            raise UserError("empty prompt: there is nothing to continue")
        if policy.K != len(self.arms):
            raise ValueError(f"policy built for {policy.K} arms, engine has {len(self.arms)}")
        prompt_ids = list(prompt_ids)
        length = length or LengthController()
        if self.step_time is None:
            self.step_time = self.measure_step_time(prompt_ids)
        start = self._clock()
        if reset_policy:
            policy.new_query()
        full = bool(getattr(policy, "fullinfo", False))
        if full:
            unscored = [a.label for j, a in enumerate(self.arms) if j not in self.scorer.scorable]
            if unscored and getattr(policy, "needs_every_arm", False):
                raise UserError(f"policy {policy.name} learns from every arm's reward every round, but "
                                f"{', '.join(unscored)} cannot be scored without playing them (counterfactual "
                                f"feedback covers model-free arms, and EAGLE chains in greedy runs); use "
                                f"ucbspec:fullinfo=true or thompson:"
                                f"fullinfo=true, which learn those arms from their own rounds")
            self.scorer.new_query()
        length.reset()
        if length.uses_cost:
            length.use_cost(self.cost)
        if reads_cost(policy, length):
            self.seed_cost(prompt_ids)
        for arm in self.arms:
            arm.reset(prompt_ids)
        # the most the target cache will hold: every token but the last, plus one round's scored positions
        # (L + 1, or a tree's nodes + 1; sizes a static cache)
        self.target.prefill(prompt_ids, capacity=len(prompt_ids) + max_new_tokens + self.max_nodes + 1)
        state = DecodeState(prompt_ids, policy, length, max_new_tokens, ctx=list(prompt_ids), start=start,
                            pending=[] if full else None)
        if policy.uses_cost:  # a round scoring n positions, in steps: c(n) at this query's context as it grows, and
            # the round's overhead
            policy.use_cost(lambda n, ctx=state.ctx: (self.cost.steps(n, len(ctx))
                                                      + self.round_overhead / self.step_time),
                            [a.L for a in self.arms])
        if self.target.prefix_cache is not None and self.target.want_hidden:
            state.hidden = [] if self.target.prefill_hidden is None else [self.target.prefill_hidden]
        state.setup_time = self._clock() - start
        return state

    def step(self, state: DecodeState, arm: int | None = None, *, counterfactual: bool = False,
             keep: int | None = None) -> StepResult:
        """One round from ``state.ctx``.

        arm: the arm to play; None = ``state.policy.select()``.
        counterfactual: only ask what ``arm`` would produce here: propose (without the length
            controller), score and verify, then roll the target cache back to ``keep`` tokens (default
            len(ctx) − 1, as it was) and change nothing else (no tokens, observe or updates).
        """
        if state.done:
            raise ValueError("the query is finished (EOS or token budget reached); begin() a new one")
        if keep is not None and not counterfactual:
            raise ValueError("keep= is for counterfactual steps; a live round keeps the accepted prefix")
        t_start = self._clock()
        live_feedback = state.pending is not None and not counterfactual
        if live_feedback:  # every scorable arm proposes from this prefix (a router reads the features first)
            proposal = self.scorer.before_round(state.policy, state.ctx, state.remaining)
        t_sel = self._clock()
        i = state.policy.select() if arm is None else int(arm)
        a = self.arms[i]
        ctx, remaining = state.ctx, state.remaining
        max_len = min(a.L, remaining - 1)
        keep_going = None if counterfactual else state.length.keep_going(i, max_len=max_len, context=len(ctx))
        f0 = self._arm_target_forwards()
        t0 = self._clock()
        draft = a.propose(ctx, max_len, keep_going)
        t1 = self._clock()
        n = len(ctx)
        scored = self.target.score_tree(ctx[-1], draft) if draft.is_tree else self.target.score(ctx[-1], draft.tokens)
        t2 = self._clock()
        self.cost.observe(len(draft) + 1, n, t2 - t1)
        outcome = self.verifier.verify(scored.logits, draft)
        t3 = self._clock()
        if counterfactual:
            self.target.rollback(n - 1 if keep is None else keep)
        elif outcome.path is not None:  # a tree: keep only the accepted root path's entries
            self.target.keep_path(n, outcome.path)
        else:
            self.target.rollback(n + outcome.accepted)
        t4 = self._clock()
        hidden = None
        if scored.hidden is not None:
            hidden = scored.hidden.rows(slice(0, outcome.accepted + 1) if outcome.path is None
                                        else [0] + [i + 1 for i in outcome.path])
        times = StepTimes(t0 - t_sel, t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        if live_feedback:
            times.feedback = t_sel - t_start
        if counterfactual:
            times.total = self._clock() - t_start
            return StepResult(i, draft, outcome, [], None, times, hidden)

        new = outcome.tokens[:remaining]
        for j, tok in enumerate(new):
            if tok in self.eos:
                new = new[:j + 1]
                state.stopped_by = "eos"
                break
        self.commit(state, new, hidden)
        # accepted draft tokens cut off by EOS are not counted: new = kept draft tokens (+ the bonus)
        depth = draft_depth(draft)
        rec = RoundRecord(arm=i, drafted=len(draft), accepted=min(outcome.accepted, len(new)),
                          new_tokens=len(new), draft_time=t1 - t0, verify_time=t4 - t1, tv=outcome.tv,
                          accept_prob=outcome.accept_prob, max_len=a.L, step_time=self.step_time,
                          extra_target_forwards=self._arm_target_forwards() - f0,
                          depth=depth if depth != len(draft) else None)
        state.rounds.append(rec)
        state.policy.update(i, rec)
        # the controllers count draft positions along a path (a chain's length): a tree's or K chains' depth,
        # not its node count (a fully accepted depth-3 tree is no rejection at a depth 4 never drafted)
        state.length.update(depth, outcome, arm=i)
        state.length.observe_round(rec)
        if live_feedback:
            self.scorer.after_round(state.policy, rec, proposal, getattr(a, "last_match", 0), state.pending,
                                    state.rounds, state.tokens, remaining, finished=state.done)
        t5 = self._clock()
        times.update, times.total = t5 - t4, t5 - t_start
        self.round_overhead += 0.05 * (times.total - (t1 - t0) - (t4 - t1) - self.round_overhead)  # EMA, ~20 rounds
        state.times.append(times)
        return StepResult(i, draft, outcome, new, rec, times, hidden)

    def commit(self, state: DecodeState, tokens: list[int], hidden: HiddenStates | None = None) -> None:
        """Append ``tokens`` to the query and let the length controller and every arm observe them
        (``hidden``: the target's hidden states at the positions that produced them, last row last).
        The target cache must already hold the new context minus its last token."""
        state.ctx.extend(tokens)
        state.tokens.extend(tokens)
        if hidden is not None:
            state.length.observe_target(hidden.final[-1])
            if state.hidden is not None:
                state.hidden.append(hidden.rows(slice(0, len(tokens))))
        for a in self.arms:
            a.observe(state.ctx, hidden if a.uses_target_hidden else None)

    def finish(self, state: DecodeState) -> Generation:
        """The query's Generation; wall_time runs from begin() to now. With a prefix cache the finished sequence is
        kept in it (:meth:`Target.remember`)."""
        if self.target.prefix_cache is not None:
            parts = state.hidden or []
            hidden = HiddenStates.concat(parts) if parts else None
            self.target.remember(state.ctx, hidden)
        return Generation(len(state.prompt_ids), state.tokens, state.rounds, self._clock() - state.start,
                          state.stopped_by, setup_time=state.setup_time, step_times=state.times)

    def seed_cost(self, prompt_ids: list[int]) -> None:
        """Probe the verification curve at every size a round may score that nothing has measured yet (after
        ``prompt_ids``; then every round refines it): before a cost-aware round plans, or in a warm-up, so that no
        timed run pays for it. Probing only an empty curve left it without a one-token forward after decode eval's
        warm-up (rounds of 4 and 2 positions): c(n) is read against t(1), so it fell back to n, and the head drafted
        1 token a round through make demo's first two prompts (code and chat) until a round scored one position."""
        measured = self.cost.sizes()
        missing = [n for n in range(1, self.max_len + 2) if n not in measured]
        if missing:
            probe(self.cost, self.target, prompt_ids, missing, clock=self._clock)

    def warm_up(self, prompt_ids: list[int], max_new_tokens: int = 8, probe_cost: bool = True) -> None:
        """One untimed decode before any timed one (one-off costs, and the step time a throughput reward reads), with a
        fixed arm and no length controller, so no policy or controller learns from it; with ``probe_cost`` (a length
        controller or policy that reads the cost curve will decode) the verification curve probed too
        (:meth:`seed_cost`), which the first timed query would otherwise pay for: 0.8-1.5 s of a 5 s reply of
        `decode generate` with the shipped pool on a 2-core CPU."""
        self.generate(prompt_ids, Fixed(len(self.arms), self.max_len), max_new_tokens)
        if probe_cost:
            self.seed_cost(prompt_ids)

    def generate(self, prompt_ids: list[int], policy: Policy, max_new_tokens: int,
                 length: LengthController | None = None, reset_policy: bool = True) -> Generation:
        """Decode one prompt: ``begin``, ``step`` until EOS or the budget, ``finish``.

        reset_policy: start the query with ``policy.new_query()`` (re-initialises it unless it was
            built with carry=true); False leaves the policy exactly as it is.
        """
        state = self.begin(prompt_ids, policy, max_new_tokens, length, reset_policy)
        while not state.done:
            self.step(state)
        return self.finish(state)


def target_run_model(model, linear: str) -> tuple[torch.nn.Module, str, dict]:
    """The model our engines run the target as: its linear layers as ``linear`` (a resolved kind of
    decode/core/linear.py; ``auto`` measured here) and, on a CPU, grouped-query attention that reads the cache's
    heads as they are (decode/core/attention.py; its kernel for a few masked positions measured here too).
    ``model`` itself is not modified. Returns (run model, the linear kind, {"linear": --linear auto's measurements,
    "attention": the attention probe's}, each None where nothing was measured)."""
    probe = None
    if linear == "auto":  # resolve_linear leaves auto where packing is usable: measure which runs faster here
        linear, run_model, probe = probe_linear(model)
    else:
        run_model = linear_model(model, linear)
    run_model = gqa_attention_model(run_model, in_place=run_model is not model)
    return run_model, linear, {"linear": probe, "attention": probe_attention(run_model)}


def build_engine(model, tokenizer, arm_specs: list[str], sampling: SamplingConfig, generator: torch.Generator, *,
                 cache: str, compile: bool = False, linear: str = "stock", verifier: str = "auto",
                 target_name: str = "target", trust_remote_code: bool = False,
                 needs_hidden: bool = False, forward: str = "auto") -> SpecEngine:
    """The engine a command decodes with: the target wrapper (``cache`` kind, optionally compiled, its linear
    layers run as ``linear``: a resolved kind of decode/core/linear.py, ``auto`` measured here; on a CPU its
    grouped-query attention reads the cache's heads as they are: decode/core/attention.py; its eager forwards run
    ``forward``: lean, hf or auto = lean where it can run, decode/core/lean.py), the arm pool
    built from ``arm_specs`` (arms that own a cache use the same kind), the verifier and the EOS ids. ``model`` itself
    is not modified: the hf reference keeps running it, and arms that copy or load weights into target modules
    (EAGLE's layer, early-exit stacks) build on it, never on packed weights that a later ``load_state_dict`` would
    not reach.
    The target returns hidden states when an arm or ``needs_hidden`` (a length controller) reads them."""
    run_model, linear, probes = target_run_model(model, linear)
    target = Target(run_model, tokenizer, want_hidden=False, cache=cache, compile=compile,
                    forward=resolve_forward(forward, run_model, cache, compile))
    target.linear, target.linear_probe, target.attention_probe = linear, probes["linear"], probes["attention"]
    env = ArmEnv(model, tokenizer, sampling, generator, target_name=target_name,
                 trust_remote_code=trust_remote_code, target=target, cache=cache)
    arms = build_arms(arm_specs, env)
    if (packing := packing_of(run_model)) is not None:  # the arms' modules run the target's kernel
        pack_arm_linears(arms, model, *packing)
    target.want_hidden = needs_hidden or any(a.uses_target_hidden for a in arms)
    return SpecEngine(target, arms, Verifier(sampling, verifier, generator), eos_token_ids(model, tokenizer))
