"""UCBSpec (BanditSpec Alg. 4): round-robin start, then the largest mean tokens-per-round + radius.

cr_{i,t} = (L/2)·sqrt((1+n)/n² · (1 + 2·log(K·t²·sqrt(1+n)/δ))), with Y = tokens the round produced.
With another reward (``reward=bd`` ...) the radius scales with that reward's range instead of L.
"""
from __future__ import annotations

import math

import numpy as np

from ...common.errors import UserError
from .base import Policy, register


def ucbspec_radius(L: float, n: int, t: int, K: int, delta: float) -> float:
    return (L / 2) * math.sqrt((1 + n) / n ** 2 * (1 + 2 * math.log(K * t ** 2 * math.sqrt(1 + n) / delta)))


@register("ucbspec")
class UCBSpec(Policy):
    supports_fullinfo = True
    def __init__(self, n_arms, max_len, seed=0, delta: float = 0.5, **kw):
        if not 0 < delta <= 1:  # a confidence level; δ > 1 can make the radius' log negative
            raise UserError(f"ucbspec: delta must be in (0, 1], got {delta}")
        self.delta = float(delta)
        super().__init__(n_arms, max_len, seed, **kw)

    def reset(self):
        super().reset()
        self.sum_y = np.zeros(self.K)

    def _update(self, arm, value):
        self.sum_y[arm] += value

    def scores(self) -> np.ndarray:
        span = self.reward.hi - self.reward.lo  # = L for Y
        mean = self.sum_y / self.n_obs
        cr = np.array([ucbspec_radius(span, int(n), self.t, self.K, self.delta) for n in self.n_obs])
        return mean + cr

    def select(self) -> int:
        first = self.first_unobserved()  # rounds 1..K: each arm once (fewer when counterfactuals filled some)
        if first is not None:
            return first
        return int(np.argmax(self.scores()))
