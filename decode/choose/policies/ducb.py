"""Discounted UCB (Kocsis & Szepesvári 2006; MetaSD Alg. 6) for rewards that drift within a query.

After each round all statistics decay by ``discount``: N_i ← d·N_i + 1{I=i}, S_i ← d·S_i + r·1{I=i};
score_i = S_i/N_i + c·sqrt(2·ln(Σ_j N_j)/N_i). An idle arm's N_i shrinks, so its radius grows until
it is tried again. Each arm is played once first.

Numerics: d^k underflows after ~14k idle rounds at d = 0.95 (ln(2.2e-308)/ln 0.95), which would
make S_i/N_i = 0/0. An arm whose N_i falls below the smallest normal double is forgotten (N_i =
S_i = 0) and, like an unplayed arm, scores +inf, so it is re-explored (also with c = 0).
"""
from __future__ import annotations

import math

import numpy as np

from ...common.errors import UserError
from .base import Policy, register


@register("ducb")
class DiscountedUCB(Policy):
    default_reward = "bd"

    def __init__(self, n_arms, max_len, seed=0, discount: float = 0.95, c: float = 0.01, **kw):
        if not 0 < discount <= 1:
            raise UserError(f"ducb: discount must be in (0, 1], got {discount}")
        if c < 0:
            raise UserError(f"ducb: c must be >= 0, got {c}")
        self.discount, self.c = float(discount), float(c)
        super().__init__(n_arms, max_len, seed, **kw)

    def reset(self):
        super().reset()
        self.N = np.zeros(self.K)
        self.S = np.zeros(self.K)

    def _update(self, arm, value):
        self.N *= self.discount
        self.S *= self.discount
        gone = self.N < np.finfo(float).tiny
        self.N[gone] = 0.0
        self.S[gone] = 0.0
        self.N[arm] += 1.0
        self.S[arm] += self.reward.unit(value)

    def scores(self) -> np.ndarray:
        seen = self.N > 0
        n = np.where(seen, self.N, 1.0)
        log_total = math.log(max(self.N.sum(), 1.0))
        radius = self.c * math.sqrt(2 * log_total) / np.sqrt(n)  # finite for any normal n > 0
        return np.where(seen, self.S / n + radius, np.inf)

    def select(self) -> int:
        if self.t < self.K:
            return self.t
        return int(np.argmax(self.scores()))
