"""MetaSD-UCB (MetaSD Alg. 2): UCB1 with exploration strength c on a [0, 1] reward (default BD).

Each arm once, then argmax_i μ̂_i + c·sqrt(2·ln t / n_i) with t = rounds so far. The paper's c = 0.01
is tiny because BD separates drafters with little variance.
"""
from __future__ import annotations

import math

import numpy as np

from ...common.errors import UserError
from .base import Policy, register


@register("metasd_ucb")
class MetaSDUCB(Policy):
    supports_fullinfo = True
    default_reward = "bd"

    def __init__(self, n_arms, max_len, seed=0, c: float = 0.01, **kw):
        if c < 0:
            raise UserError(f"metasd_ucb: c must be >= 0, got {c}")
        self.c = float(c)
        super().__init__(n_arms, max_len, seed, **kw)

    def reset(self):
        super().reset()
        self.sum_r = np.zeros(self.K)

    def _update(self, arm, value):
        self.sum_r[arm] += self.reward.unit(value)

    def scores(self) -> np.ndarray:
        n = self.n_obs
        return self.sum_r / n + self.c * np.sqrt(2 * math.log(self.t) / n)

    def select(self) -> int:
        first = self.first_unobserved()
        if first is not None:
            return first
        return int(np.argmax(self.scores()))
