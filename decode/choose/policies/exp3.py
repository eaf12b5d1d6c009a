"""EXP3 with uniform mixing (Auer et al. 2002; MetaSD's EXP3 baseline, γ = 0.4).

p_i = (1 − γ)·w_i/Σw + γ/K; after playing I with unit reward r: w_I ← w_I·exp(γ·(r/p_I)/K).
Weights are kept in log space, so they never overflow; mixing keeps every p_i ≥ γ/K.
"""
from __future__ import annotations

import numpy as np

from ...common.errors import UserError
from .base import Policy, register


@register("exp3")
class EXP3(Policy):
    default_reward = "bd"

    def __init__(self, n_arms, max_len, seed=0, gamma: float = 0.4, **kw):
        if not 0 < gamma <= 1:
            raise UserError(f"exp3: gamma must be in (0, 1], got {gamma}")
        self.gamma = float(gamma)
        super().__init__(n_arms, max_len, seed, **kw)

    def reset(self):
        super().reset()
        self.log_w = np.zeros(self.K)
        self.last_p: np.ndarray | None = None

    def probabilities(self) -> np.ndarray:
        w = np.exp(self.log_w - self.log_w.max())
        return (1 - self.gamma) * w / w.sum() + self.gamma / self.K

    def select(self) -> int:
        self.last_p = self.probabilities()
        return int(self.rng.choice(self.K, p=self.last_p))

    def _update(self, arm, value):
        p = self.last_p if self.last_p is not None else self.probabilities()
        self.log_w[arm] += self.gamma * (self.reward.unit(value) / p[arm]) / self.K
        self.last_p = None
