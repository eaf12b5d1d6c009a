"""PETC: pure exploration with Sequential Halving for ``budget`` rounds, then commit (MetaSD H.1).

SH (Karnin et al. 2013): R = ceil(log2 K) phases; in phase r every surviving arm is played
max(1, floor(budget / (|S_r|·R))) times in turn, then the better half (ceil(|S_r|/2), ties → lower
index) survives. As in Karnin et al., the ranking uses the mean unit reward of the CURRENT phase's
samples only (fresh, equally many per arm); ``rank=cumulative`` ranks on all pulls so far instead
(more samples, but earlier phases weigh more for the arms that survived them). After the last
phase the single survivor is played for the rest of the query — few switches, which matters when
switching costs. Default budget: 2·K·R rounds.
"""
from __future__ import annotations

import math

import numpy as np

from ...common.errors import UserError
from .base import Policy, register


@register("sh")
class SequentialHalving(Policy):
    default_reward = "bd"

    def __init__(self, n_arms, max_len, seed=0, budget: int | None = None, rank: str = "phase", **kw):
        if rank not in ("phase", "cumulative"):
            raise UserError(f"sh: rank must be 'phase' or 'cumulative', got '{rank}'")
        self.rank = rank
        self.R = max(1, math.ceil(math.log2(n_arms))) if n_arms > 1 else 0
        self.budget = int(budget) if budget is not None else 2 * n_arms * max(self.R, 1)
        if self.budget < 0:
            raise UserError(f"sh: budget must be >= 0 rounds, got {budget}")
        super().__init__(n_arms, max_len, seed, **kw)

    def reset(self):
        super().reset()
        self.sum_r = np.zeros(self.K)  # over all pulls
        self.phase_sum = np.zeros(self.K)  # over the current phase
        self.phase_n = np.zeros(self.K)
        self.alive = list(range(self.K))
        self._plan_phase()

    def _plan_phase(self):
        if len(self.alive) <= 1:
            self.queue: list[int] = []
            return
        per = max(1, self.budget // (len(self.alive) * self.R))
        self.queue = [a for _ in range(per) for a in self.alive]

    def _halve(self):
        s, n = (self.sum_r, self.pulls) if self.rank == "cumulative" else (self.phase_sum, self.phase_n)
        mean = s / np.maximum(n, 1)
        self.phase_sum[:] = 0.0
        self.phase_n[:] = 0.0
        keep = math.ceil(len(self.alive) / 2)
        ranked = sorted(self.alive, key=lambda a: (-mean[a], a))
        self.alive = sorted(ranked[:keep])
        self._plan_phase()

    def select(self) -> int:
        return self.queue[0] if self.queue else self.alive[0]

    def _update(self, arm, value):
        r = self.reward.unit(value)
        self.sum_r[arm] += r
        if self.queue:
            self.phase_sum[arm] += r
            self.phase_n[arm] += 1
            self.queue.pop(0)
            if not self.queue:
                self._halve()
