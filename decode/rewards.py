"""Rewards a policy learns from, computed from one RoundRecord (ALGORITHMS.md §2–3).

Every reward has a known range [lo, hi] so policies can either use the raw value (UCBSpec and
EXP3Spec use Y ∈ [1, L+1] exactly as in BanditSpec) or the unit value (v − lo)/(hi − lo) ∈ [0, 1]
(MetaSD-UCB, EXP3, Thompson, ...). L is the policy's L: the largest speculation length in the pool,
so arms with different lengths (γ-arms) are compared on one scale.

Rounds that drafted nothing (plain decoding, a "none" arm, PLD with no match, ``pld:L=0``) get
BE = BD = 0: no speculative gain and no alignment evidence. Y still counts the one token they made
and throughput still measures their speed, which is why γ-arms (γ = 0 is plain decoding) should be
run with ``tokens`` or ``throughput``.
"""
from __future__ import annotations

from .draft import RoundRecord
from .registry import Registry


class Reward:
    name = "reward"

    def __init__(self, max_len: int):
        self.L = max(int(max_len), 1)
        self.reset()

    lo = 0.0

    @property
    def hi(self) -> float:
        return 1.0

    def reset(self) -> None:
        """New query (only stateful rewards keep anything)."""

    def __call__(self, record: RoundRecord) -> float:
        raise NotImplementedError

    def unit(self, value: float) -> float:
        """Map a raw value of this reward to [0, 1]."""
        return (value - self.lo) / (self.hi - self.lo)


REWARDS = Registry("reward", hint=" (set it with the policy parameter reward=NAME, e.g. metasd_ucb:reward=be)")
register = REWARDS.register


def reward_names() -> list[str]:
    return REWARDS.names()


def build_reward(name: str, max_len: int) -> Reward:
    return REWARDS.build(name, name, max_len)


@register("tokens")
class TokensPerRound(Reward):
    """BanditSpec's Y = accepted + 1 ∈ [1, L+1]: the quantity whose mean sets the stopping time."""

    lo = 1.0

    @property
    def hi(self) -> float:
        return float(self.L + 1)

    def __call__(self, record):
        return float(record.y)


@register("be")
class BlockEfficiency(Reward):
    """MetaSD's BE = accepted / drafted ∈ [0, 1] (0 when nothing was drafted)."""

    def __call__(self, record):
        return record.accepted / record.drafted if record.drafted else 0.0


@register("bd")
class BlockDivergence(Reward):
    """MetaSD's BD = 1 − mean TV(target, draft) over the scored positions (0 when none were scored).
    Lower variance than BE and never zero for a real draft (MetaSD Thm. 1)."""

    def __call__(self, record):
        if not record.tv:
            return 0.0
        return min(1.0, max(0.0, 1.0 - sum(record.tv) / len(record.tv)))


@register("throughput")
class Throughput(Reward):
    """Tokens per second of the round (drafting, switching catch-up and verification all count),
    divided by the largest such rate seen so far, so it lies in [0, 1] (BanditSpec §6.2)."""

    def reset(self):
        self.best = 0.0

    def __call__(self, record):
        rate = record.new_tokens / record.time if record.time > 0 else 0.0
        self.best = max(self.best, rate)
        return rate / self.best if self.best > 0 else 0.0
