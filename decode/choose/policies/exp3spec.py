"""EXP3Spec (BanditSpec Alg. 5): anytime EXP3 on the loss (L+1−Y)/L with importance weighting.

For round t (1-based): η_t = sqrt(log K / (t·K)); p_t ∝ exp(−η_t Σ_{s<t} Ẑ_s);
Ẑ_{i,s} = 1{i = I_s}·(L+1−Y_s)/(L·p_{s,i}). With another reward the loss is 1 − unit reward.
"""
from __future__ import annotations

import math

import numpy as np

from .base import Policy, register


@register("exp3spec")
class EXP3Spec(Policy):
    def reset(self):
        super().reset()
        self.cum_loss = np.zeros(self.K)
        self.last_p: np.ndarray | None = None

    def probabilities(self) -> np.ndarray:
        t = self.t + 1
        eta = math.sqrt(math.log(self.K) / (t * self.K)) if self.K > 1 else 0.0
        z = -eta * self.cum_loss
        # stable softmax; the exponent floor keeps every probability > 0 (exp(-700) ≈ 1e-304)
        w = np.exp(np.maximum(z - z.max(), -700.0))
        return w / w.sum()

    def select(self) -> int:
        self.last_p = self.probabilities()
        return int(self.rng.choice(self.K, p=self.last_p))

    def _update(self, arm, value):
        p = self.last_p if self.last_p is not None else self.probabilities()
        hi, lo = self.reward.hi, self.reward.lo
        self.cum_loss[arm] += (hi - value) / ((hi - lo) * p[arm])  # (L+1−Y)/(L·p) for Y
        self.last_p = None
