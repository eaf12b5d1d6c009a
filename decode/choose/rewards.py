"""Rewards a policy learns from, computed from one RoundRecord (ALGORITHMS.md §2–3).

Every reward has a known range [lo, hi] so policies can either use the raw value (UCBSpec and
EXP3Spec use Y ∈ [1, L+1] exactly as in BanditSpec) or the unit value (v − lo)/(hi − lo) ∈ [0, 1]
(MetaSD-UCB, EXP3, Thompson, ...). L is the policy's L: the largest speculation length in the pool,
so arms with different lengths (γ-arms) are compared on one scale.

Rounds that drafted nothing (plain decoding, a "none" arm, PLD with no match, ``pld:L=0``) get
BE = BD = 0: no speculative gain and no alignment evidence. Y still counts the one token they made
and throughput still measures their speed, which is why γ-arms (γ = 0 is plain decoding) should be
run with ``tokens`` or ``throughput``.

Every value depends on the round alone (no state across rounds), so a policy's means average
numbers on one fixed scale.
"""
from __future__ import annotations

from ..core.draft import RoundRecord
from ..common.registry import Registry


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
    """MetaSD's BE = accepted / γ ∈ [0, 1], γ = the arm's preset speculation length (``max_len``), not
    the tokens it happened to draft: a 1-token n-gram match must not score like a full 8-token draft.
    0 for γ = 0 (plain decoding)."""

    def __call__(self, record):
        return record.accepted / record.max_len if record.max_len > 0 else 0.0


def _one_minus_mean(tv) -> float:
    return min(1.0, max(0.0, 1.0 - sum(tv) / len(tv))) if len(tv) else 0.0


@register("bd")
class BlockDivergence(Reward):
    """MetaSD's BD = 1 − mean TV(target, draft) over the N_t positions the target scored: every
    drafted position, also past the first rejection (0 when nothing was drafted). Lower variance
    than BE and never zero for a real draft (MetaSD Thm. 1)."""

    def __call__(self, record):
        return _one_minus_mean(record.tv[:record.drafted])


@register("bd_prefix")
class BlockDivergencePrefix(Reward):
    """BD over the positions up to and including the first rejection only, i.e. the positions whose
    draft tokens decided the round (a variant: ignores the target's evidence past the rejection)."""

    def __call__(self, record):
        return _one_minus_mean(record.tv[:min(record.accepted + 1, record.drafted)])


@register("throughput")
class Throughput(Reward):
    """Tokens per autoregressive step (BanditSpec §6.2's tokens/s on a fixed scale): tokens the
    round kept ÷ (round time / ``step_time``), where step_time is one one-token target forward
    (measured once by the engine before its first query, or given to it). Drafting, switching catch-up and
    verification all count. Plain decoding scores ≈ 1; clipped to [0, L+1] (a round makes at most L+1 tokens and
    takes at least about one step). The scale is known before the query, so UCB means stay
    comparable — a running maximum would drift during the query."""

    @property
    def hi(self) -> float:
        return float(self.L + 1)

    def __call__(self, record):
        if not record.step_time > 0:
            raise ValueError("the throughput reward needs RoundRecord.step_time > 0 (seconds of one "
                             "autoregressive step; SpecEngine measures it)")
        if record.time <= 0:
            return self.hi if record.new_tokens > 0 else 0.0
        return min(self.hi, max(0.0, record.new_tokens * record.step_time / record.time))
