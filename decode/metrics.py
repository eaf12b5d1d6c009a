"""Every reported metric, defined once (ALGORITHMS.md §6)."""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence


def mat(new_tokens: int, target_forwards: int) -> float:
    """Mean accepted tokens = generated tokens / target forward passes (1.0 for autoregressive)."""
    return new_tokens / target_forwards if target_forwards else 0.0


def tokens_per_s(new_tokens: int, seconds: float) -> float:
    return new_tokens / seconds if seconds > 0 else 0.0


def speedup(tps: float, baseline_tps: float) -> float:
    """Tokens/s relative to autoregressive decoding of the same target, prompts and run."""
    return tps / baseline_tps if baseline_tps > 0 else 0.0


def acceptance_rate(accepted: int, drafted: int) -> float:
    """v_d = accepted draft tokens / drafted tokens (0 when nothing was drafted)."""
    return accepted / drafted if drafted else 0.0


def harmonic_mean_metric(accepted: int, drafted: int, total_tokens: int) -> float:
    """EESD's HM = 2·v·r/(v + r), v = accepted/drafted, r = accepted/total generated tokens."""
    v = acceptance_rate(accepted, drafted)
    r = accepted / total_tokens if total_tokens else 0.0
    return 2 * v * r / (v + r) if v + r > 0 else 0.0


def pull_counts(arms: Iterable[int], labels: Sequence[str]) -> dict[str, int]:
    c = Counter(arms)
    return {labels[i]: int(c.get(i, 0)) for i in range(len(labels))}


def stopping_time_regret(policy_rounds: float, fixed_rounds: Sequence[float]) -> float:
    """BanditSpec: E[ST(ALG)] − min_i E[ST(ALG_i)] (rounds, i.e. target forwards)."""
    return policy_rounds - min(fixed_rounds)


def best_arm_ratio(chosen: Sequence[int], best_arm: int) -> float:
    """Fraction of rounds that played the best arm in hindsight."""
    return sum(1 for a in chosen if a == best_arm) / len(chosen) if chosen else 0.0
