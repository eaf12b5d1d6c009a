"""Thompson sampling over arms with a Beta(1 + S_i, 1 + F_i) posterior on a [0, 1] reward.

Non-binary rewards use the Bernoulli trick (Agrawal & Goyal 2012): draw b ~ Bernoulli(r) and count
b as a success, 1 − b as a failure. Each round plays argmax of one posterior draw per arm.
"""
from __future__ import annotations

import numpy as np

from ...common.errors import UserError
from .base import Policy, register


@register("thompson")
class Thompson(Policy):
    supports_fullinfo = True
    default_reward = "bd"

    def __init__(self, n_arms, max_len, seed=0, alpha: float = 1.0, beta: float = 1.0, **kw):
        if alpha <= 0 or beta <= 0:
            raise UserError(f"thompson: prior alpha and beta must be > 0, got {alpha}, {beta}")
        self.alpha0, self.beta0 = float(alpha), float(beta)
        super().__init__(n_arms, max_len, seed, **kw)

    def reset(self):
        super().reset()
        self.succ = np.zeros(self.K)
        self.fail = np.zeros(self.K)

    def select(self) -> int:
        return int(np.argmax(self.rng.beta(self.alpha0 + self.succ, self.beta0 + self.fail)))

    def _update(self, arm, value):
        b = float(self.rng.random() < self.reward.unit(value))
        self.succ[arm] += b
        self.fail[arm] += 1.0 - b
