"""Cost of one drafted token as a fraction of one target step (issue 13), from measured rounds.

A "target step" is one autoregressive step: a one-token target forward, as the engine measures it for
the throughput reward (``RoundRecord.step_time``); a drafted token's cost is the arm's drafting time
(``StepTimes.draft``: every ``Arm.propose`` call, catch-up of tokens the arm missed included) divided
by the tokens it drafted. ``fraction`` = that cost ÷ one step; a round of L drafted tokens pays
L × fraction steps of drafting besides its verification forward (``verify_forward_ms``, the mean
``StepTimes.score``, which grows with the positions it scores).

Call it on the generations of one arm decoding alone, e.g. beside ``decode.bench.bench_round.breakdown``::

    cost = draft_token_cost(gens)   # {"draft_ms_per_token", "target_step_ms", "fraction", ...}
"""
from __future__ import annotations

from ..common.errors import UserError


def draft_token_cost(gens) -> dict:
    """``gens``: ``decode.engine.loop.Generation`` records with ``step_times`` beside their ``rounds``."""
    rounds = [(r, t) for g in gens for r, t in zip(g.rounds, g.step_times)]
    drafted = sum(r.drafted for r, _ in rounds)
    if not rounds or drafted == 0:
        raise UserError("no drafted tokens in these generations: the arm drafted nothing (or no step "
                        "times were recorded), so the cost of a drafted token is undefined")
    draft_s = sum(t.draft for _, t in rounds)
    step_s = rounds[0][0].step_time
    if not step_s > 0:
        raise UserError("the rounds carry no step time (one-token target forward); decode them with SpecEngine")
    per_token = draft_s / drafted
    return {"rounds": len(rounds), "drafted_tokens": drafted, "draft_ms_per_token": 1000 * per_token,
            "target_step_ms": 1000 * step_s, "fraction": per_token / step_s,
            "verify_forward_ms": 1000 * sum(t.score for _, t in rounds) / len(rounds)}
