"""Every reported metric, defined once (ALGORITHMS.md §6)."""
from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Sequence

# When a measured speed-up stops meaning anything (see speedup_warnings).
MIN_BASELINE_TOKENS = 256  # fewer reference tokens: prefill and timer noise dominate tokens/s
MAX_BASELINE_CV = 0.25  # per-prompt reference tokens/s spread (std/mean) above this: the machine was noisy
MAX_SPEEDUP_OVER_MAT = 1.5  # slack over the MAT × step-cost bound before a speed-up is called implausible


def mat(new_tokens: int, target_forwards: int) -> float:
    """Mean accepted tokens = generated tokens / target forward passes (1.0 for autoregressive)."""
    return new_tokens / target_forwards if target_forwards else 0.0


def tokens_per_s(new_tokens: int, seconds: float) -> float:
    return new_tokens / seconds if seconds > 0 else 0.0


def speedup(tps: float, baseline_tps: float) -> float:
    """Tokens/s relative to a baseline decoding the same target, prompts and run (0 without a baseline)."""
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
    """Rounds per arm label; an index outside ``labels`` is an error rather than a silently lost pull."""
    c = Counter(arms)
    stray = sorted(i for i in c if not 0 <= i < len(labels))
    if stray:
        raise ValueError(f"arm indices {stray} outside the {len(labels)} labels {list(labels)}")
    return {labels[i]: int(c.get(i, 0)) for i in range(len(labels))}


def stopping_time_regret(policy_rounds: float, fixed_rounds: Sequence[float]) -> float:
    """BanditSpec: E[ST(ALG)] − min_i E[ST(ALG_i)] (rounds, i.e. target forwards)."""
    if not len(fixed_rounds):
        raise ValueError("stopping-time regret needs at least one fixed arm to compare with")
    return policy_rounds - min(fixed_rounds)


def best_arm_ratio(chosen: Sequence[int], best_arm: int) -> float:
    """Fraction of rounds that played the best arm in hindsight."""
    return sum(1 for a in chosen if a == best_arm) / len(chosen) if chosen else 0.0


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Sample standard deviation / mean (0 for fewer than two values or a zero mean)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    if mean == 0:
        return 0.0
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return math.sqrt(var) / abs(mean)


def speedup_warnings(baseline_tps: Sequence[float], baseline_tokens: int,
                     speedups: Iterable[tuple[str, float, float]], step_cost_ratio: float = 1.0) -> list[str]:
    """Reasons a speed-up table is not to be trusted (empty list: none found).

    baseline_tps: the reference's tokens/s per prompt; baseline_tokens: tokens it decoded in all.
    speedups: (label, speed-up vs the reference, MAT) per method or category cell.
    step_cost_ratio: reference time per forward ÷ our time per forward (the autoregressive loop's
        speed-up over the reference, MAT 1), so a cheaper loop is not mistaken for noise.

    Flags: fewer than MIN_BASELINE_TOKENS reference tokens; one prompt (its spread is unknown) or a
    per-prompt coefficient of variation above MAX_BASELINE_CV; and any speed-up above
    MAT × max(1, step_cost_ratio) × MAX_SPEEDUP_OVER_MAT — every round costs at least one target
    forward, so beyond that bound the ratio measures timer noise, not decoding.
    """
    out = []
    if baseline_tokens < MIN_BASELINE_TOKENS:
        out.append(f"the reference decoded only {baseline_tokens} tokens (< {MIN_BASELINE_TOKENS}): "
                   f"tokens/s is dominated by prefill and timer noise; use more prompts or --max-new-tokens")
    if len(baseline_tps) == 1:
        out.append("one prompt: the reference's timing spread cannot be estimated; use more prompts")
    else:
        cv = coefficient_of_variation(baseline_tps)
        if cv > MAX_BASELINE_CV:
            out.append(f"the reference's per-prompt tokens/s varies by {cv:.0%} (coefficient of variation > "
                       f"{MAX_BASELINE_CV:.0%}): the machine was noisy; rerun on an idle machine")
    ratio = max(1.0, step_cost_ratio)
    for label, s, m in speedups:
        bound = m * ratio * MAX_SPEEDUP_OVER_MAT
        if s > bound:
            out.append(f"{label}: speed-up {s:.2f}× exceeds MAT {m:.2f} × step-cost ratio {ratio:.2f} × "
                       f"{MAX_SPEEDUP_OVER_MAT} = {bound:.2f}: not explained by decoding, timing is unreliable")
    return out


def reach_counts(accepted: Iterable[int], drafted: Iterable[int]) -> list[tuple[int, int]]:
    """Per draft position i = 1, 2, ...: (rounds whose draft reaches i, rounds whose accepted prefix reaches i),
    over rounds that accepted ``accepted[k]`` of ``drafted[k]`` tokens (accepted ones a prefix): the counts behind
    :func:`acceptance_per_position`, kept apart so reports can put binomial errors on it."""
    reach_drafted: list[int] = []
    reach_accepted: list[int] = []
    for a, d in zip(accepted, drafted, strict=True):
        if not 0 <= a <= d:
            raise ValueError(f"a round accepted {a} of {d} drafted tokens (needs 0 <= accepted <= drafted)")
        if d > len(reach_drafted):
            grow = d - len(reach_drafted)
            reach_drafted += [0] * grow
            reach_accepted += [0] * grow
        for i in range(d):
            reach_drafted[i] += 1
        for i in range(a):
            reach_accepted[i] += 1
    return list(zip(reach_drafted, reach_accepted))


def acceptance_per_position(accepted: Iterable[int], drafted: Iterable[int]) -> list[float]:
    """Per draft position i = 1, 2, ...: P(token i accepted | a draft reached position i), the curve EAGLE and
    vLLM report: rounds whose accepted prefix reaches i / rounds whose draft reaches i. Conditioning on the
    draft's length keeps arms that often draft short (a PLD miss) comparable; empty when nothing was drafted.
    (ALGORITHMS.md §6's per-position rate conditions on position i − 1 being accepted instead: divide
    consecutive entries of :func:`reach_counts` for that.)"""
    return [acc / n for n, acc in reach_counts(accepted, drafted)]
