"""Cost of one drafted token as a fraction of one target step (issue 13), from measured rounds.

A "target step" is the target's verification forward of a round (``StepTimes.score``); a drafted
token's cost is the arm's drafting time (``StepTimes.draft``: every ``Arm.propose`` call, catch-up of
tokens the arm missed included) divided by the tokens it drafted. Both come from the same rounds, so
``fraction`` compares like with like; a speculative round pays roughly ``1 + L × fraction`` target steps.

Call it on the generations of one arm decoding alone, e.g. beside ``decode.bench_round.breakdown``::

    cost = draft_token_cost(gens)   # {"draft_ms_per_token", "target_step_ms", "fraction", ...}
"""
from __future__ import annotations

from .errors import UserError


def draft_token_cost(gens) -> dict:
    """``gens``: ``decode.engine.Generation`` records with ``step_times`` beside their ``rounds``."""
    rounds = [(r, t) for g in gens for r, t in zip(g.rounds, g.step_times)]
    drafted = sum(r.drafted for r, _ in rounds)
    if not rounds or drafted == 0:
        raise UserError("no drafted tokens in these generations: the arm drafted nothing (or no step "
                        "times were recorded), so the cost of a drafted token is undefined")
    draft_s = sum(t.draft for _, t in rounds)
    step_s = sum(t.score for _, t in rounds) / len(rounds)
    per_token = draft_s / drafted
    return {"rounds": len(rounds), "drafted_tokens": drafted, "draft_ms_per_token": 1000 * per_token,
            "target_step_ms": 1000 * step_s, "fraction": per_token / step_s if step_s > 0 else float("inf")}
