"""EXP3Spec (BanditSpec Alg. 5): anytime EXP3 on the loss (L+1−Y)/L with importance weighting.

For round t (1-based): η_t = sqrt(log K / (t·K)); p_t ∝ exp(−η_t Σ_{s<t} Ẑ_s);
Ẑ_{i,s} = 1{i = I_s}·(L+1−Y_s)/(L·p_{s,i}).
"""
from __future__ import annotations

import math

import numpy as np

from .base import Policy, register


@register("exp3spec")
class EXP3Spec(Policy):
    name = "exp3spec"

    def reset(self):
        super().reset()
        self.cum_loss = np.zeros(self.K)
        self.last_p: np.ndarray | None = None

    def probabilities(self) -> np.ndarray:
        t = self.t + 1
        eta = math.sqrt(math.log(self.K) / (t * self.K)) if self.K > 1 else 0.0
        z = -eta * self.cum_loss
        w = np.exp(z - z.max())  # stable softmax; never exactly zero for finite losses
        return w / w.sum()

    def select(self) -> int:
        self.last_p = self.probabilities()
        return int(self.rng.choice(self.K, p=self.last_p))

    def _update(self, arm, record):
        p = self.last_p if self.last_p is not None else self.probabilities()
        self.cum_loss[arm] += (self.L + 1 - record.y) / (self.L * p[arm])
        self.last_p = None
