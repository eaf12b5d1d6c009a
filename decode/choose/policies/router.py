"""Per-round routing (ALGORITHMS.md §10): pick the arm for THIS round from features known before
drafting, learnt online with full-information feedback.

Before each round every model-free arm has already proposed from the prefix (decode/choose/feedback.py), so
the router sees, per arm, the draft's length and the arm's match length (the n-gram length prompt
lookup matched, the suffix automaton's match length). Context of arm j = (j, bucket(draft length),
bucket(match length)), buckets 0, 1, 2, 3–4, 5–8, 9–16, 17+. The estimate for a context is its mean
reward shrunk towards the arm's overall mean (``prior`` pseudo-observations), plus a UCB bonus
c·sqrt(ln t / (n + 1)) for contexts seen rarely. Every round each scored arm's counterfactual reward
is learnt under the features it had in that round, so contexts fill up at full-information speed; arms
that cannot be scored (neural) have no per-round features and are learnt from their own rounds (one
context each).

Cost-aware routing (``cost=true``; reward ``tokens``): the router picks argmax_j E_j / cost_j instead of argmax_j
E_j, with E_j its estimate (bonus included) in tokens per round and cost_j = c(n_j + 1) + o + n_j·d_j in one-token
steps: c the engine's verification cost curve at the current context (decode/core/cost.py), o the engine's
measured per-round overhead (choice, feedback, bookkeeping: paid by every round, so it favours rounds that
yield more), n_j the arm's draft length this round (already known for the arms that proposed before the choice,
else its preset L), d_j its measured drafting cost per token (the median of its last records: decode/core/cost.py
``DraftCost``; 0 for an arm whose draft for this round already exists: that cost is spent whichever arm is played).
Off by default: it measured slower than the plain router over the shipped pool (2.27× against 2.34× plain
``generate``, MAT 1.47 against 1.71; docs/evaluation.md).

Arms with no counterfactual record (neural arms that cannot be scored, e.g. a union holding an EAGLE chain, learnt
from their own rounds only) are explored by Thompson sampling (``explore=thompson``, the default): their value is
a draw from Beta(1 + S, 1 + n - S), S the sum of their n unit rewards (Agrawal & Goyal's posterior for rewards in
[0, 1]), instead of mean + c·sqrt(ln t / (n + 1)). A bonus small enough for the full-information contexts (c = 0.1)
cannot bring back an arm whose first rounds were unlucky: over the shipped pool on Spec-Bench dev (13 × 2, 96
tokens) the router played the 6-node union (MAT 2.03 alone, the best arm) in its first two rounds, on a writing
prompt, where it drafted 4 tokens and none was accepted, and never again in the other 1,243 (the head's chain, MAT
1.77 alone, in 934). ``explore=ucb``: the bonus for every arm (as before).

A router chooses per round, so it is not bounded by the per-prompt oracle (one arm per prompt); the
per-round oracle (best arm every round in hindsight) bounds it. Warm start: build the policy once with
``carry=true`` and what it learnt on earlier prompts stays (``decode eval`` does this per method).
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from ...common.errors import UserError
from ...core.cost import DraftCost
from .base import Policy, register


def bucket(x: int) -> int:
    """0, 1, 2, 3–4, 5–8, 9–16, 17+ → 0…6 (log-spaced: long matches differ less than short ones)."""
    for b, hi in enumerate(_EDGES):
        if x <= hi:
            return b
    return len(_EDGES)


_EDGES = (0, 1, 2, 4, 8, 16)
EXPLORE = ("thompson", "ucb")  # how arms without counterfactual records are explored (module docstring)


@register("router")
class Router(Policy):
    name = "router"
    always_fullinfo = True

    def __init__(self, n_arms, max_len, seed=0, prior: float = 2.0, c: float = 0.1, cost: bool = False,
                 explore: str = "thompson", **kw):
        if explore not in EXPLORE:
            raise UserError(f"router: explore must be one of {', '.join(EXPLORE)}, got {explore!r}")
        if prior < 0:
            raise UserError(f"router: prior must be >= 0 pseudo-observations, got {prior}")
        if c < 0:
            raise UserError(f"router: c must be >= 0, got {c}")
        self.prior, self.c, self.cost, self.explore = float(prior), float(c), bool(cost), explore
        self._steps, self._lengths = None, None
        super().__init__(n_arms, max_len, seed, **kw)
        if self.cost and self.reward.name != "tokens":
            raise UserError(f"router: cost=true divides expected tokens per round by their cost, so it needs "
                            f"reward=tokens (got reward={self.reward.name})")

    @property
    def uses_cost(self) -> bool:
        return self.cost

    def reset(self):
        super().reset()
        self.sum_arm = np.zeros(self.K)
        self.ctx_sum: dict[tuple, float] = defaultdict(float)
        self.ctx_n: dict[tuple, int] = defaultdict(int)
        self.features: dict[int, tuple[int, int]] = {}
        # cost=true: drafting steps per drafted token, per arm (named apart from the running-mean array that state files
        # saved before it, which load as an attribute nothing reads: the costs are learnt again)
        self.draft_steps = DraftCost()

    def context(self, arm: int, features: dict | None) -> tuple:
        f = (features or {}).get(arm)
        return (arm,) if f is None else (arm, bucket(f[0]), bucket(f[1]))

    def see(self, features: dict[int, tuple[int, int]]) -> None:
        """The round's per-arm features (draft length, match length), before ``select``."""
        self.features = features

    def estimate(self, arm: int) -> float:
        key = self.context(arm, self.features)
        n = self.ctx_n.get(key, 0)
        arm_mean = self.sum_arm[arm] / self.n_obs[arm]
        mean = (self.ctx_sum.get(key, 0.0) + self.prior * arm_mean) / (n + self.prior) if n + self.prior > 0 \
            else arm_mean
        return mean + self.c * math.sqrt(math.log(self.t + 1) / (n + 1))

    def scored(self, arm: int) -> bool:
        """Whether the arm has had counterfactual records (observations beyond its plays): a full-information arm."""
        return bool(self.n_obs[arm] > self.pulls[arm])

    def value(self, arm: int) -> float:
        """The arm's value this round in [0, 1] (plus a bonus): :meth:`estimate`, or for an arm learnt from its own
        rounds only, under ``explore=thompson``, a draw from its posterior (module docstring)."""
        if self.explore == "ucb" or self.scored(arm):
            return self.estimate(arm)
        s, n = float(self.sum_arm[arm]), float(self.n_obs[arm])
        return float(self.rng.beta(1.0 + s, 1.0 + max(n - s, 0.0)))

    def score(self, arm: int) -> float:
        """What ``select`` maximises: the arm's :meth:`value`, or with ``cost=true`` expected tokens per step of
        cost."""
        est = self.value(arm)
        if not self.cost or self._steps is None:
            return est
        tokens = self.reward.lo + (self.reward.hi - self.reward.lo) * est
        f = self.features.get(arm)
        n = f[0] if f is not None else self._lengths[arm]
        drafting = 0.0 if f is not None else n * self.draft_steps[arm]  # an existing draft is spent already
        return tokens / (self._steps(n + 1) + drafting)

    def select(self) -> int:
        first = self.first_unobserved()
        if first is not None:
            return first
        return int(np.argmax([self.score(j) for j in range(self.K)]))

    def update(self, arm, record):
        super().update(arm, record)
        self.draft_steps.observe(record)

    def _learn(self, arm: int, value: float, features: dict | None) -> None:
        u = self.reward.unit(value)
        self.sum_arm[arm] += u
        key = self.context(arm, features)
        self.ctx_sum[key] += u
        self.ctx_n[key] += 1

    def _update(self, arm, value):
        self._learn(arm, value, self.features)  # the played arm, under the features this round showed

    def update_full(self, played, records, features=None):
        for j, rec in records.items():
            if j != played:
                self.n_obs[j] += 1
                self._learn(j, self.reward(rec), features)
                self.draft_steps.observe(rec)
