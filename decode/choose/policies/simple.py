"""Fixed(arm) and Random: the baselines every adaptive policy is compared with."""
from __future__ import annotations

from ...common.errors import UserError
from .base import Policy, register


@register("fixed")
class Fixed(Policy):
    def __init__(self, n_arms, max_len, seed=0, arm: int = 0, **kw):
        if not 0 <= arm < n_arms:
            raise UserError(f"fixed: arm index {arm} out of range for {n_arms} arms")
        self.arm = arm
        super().__init__(n_arms, max_len, seed, **kw)

    def select(self) -> int:
        return self.arm


@register("random")
class Random(Policy):
    def select(self) -> int:
        return int(self.rng.integers(self.K))
