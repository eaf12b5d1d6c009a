"""Counterfactual (full-information) feedback: what every other arm would have yielded in a round,
scored against the verified tokens without another target forward (ALGORITHMS.md §10, HedgeSpec).

Which arms are scored: arms whose proposal is a deterministic function of the context
(``Arm.free_counterfactual``: prompt lookup, suffix, no speculation, unions of those) and, in greedy runs,
arms whose greedy draft is one cheaply (``Arm.greedy_counterfactual``: the EAGLE chain, whose catch-up head
forward over the verified tokens is owed anyway; its would-be draft adds L-1 head steps). Before the
round's verification each of them proposes from the same prefix the played arm saw (counted in the
round's time as ``StepTimes.feedback``); its draft d (m tokens) is then matched against the
tokens the query goes on to emit. The match is resolved once a mismatch appears or m tokens are
known — usually in the same round, at most a round or two later when d agrees with everything emitted
so far (HedgeSpec's delay). Other neural arms (drafters, early exit, EAGLE trees, EAGLE under sampling,
whose draft is random) are not scored: they get bandit feedback only (when played).

Exactness:
- greedy: the target's continuation does not depend on which arm was played, so the matched length IS
  the accepted count that playing arm j would have given (``exact=True``);
- sampling: the emitted tokens are a sample of the target's own distribution, and a deterministic
  draft token is accepted with probability p(token) — the same probability with which the emitted
  token equals it. The matched length therefore has exactly the distribution of arm j's acceptance
  length, but it is another sample than the one playing j would have drawn (``exact=False``).

Times of a counterfactual record: its own measured drafting time, and the verification time the
engine has seen for a draft of that length (a running mean over the query's live rounds; the played
round's when that length was never verified) — an estimate, used by the throughput reward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..core.draft import RoundRecord


@dataclass
class PendingRound:
    """Counterfactual drafts of one live round, waiting for enough emitted tokens to be resolved."""

    round_index: int  # index of the live round in DecodeState.rounds
    start: int  # len(DecodeState.tokens) when the round began
    remaining: int  # token budget left when the round began
    drafts: dict[int, list[int]]  # scored arm -> its draft from the round's prefix
    draft_times: dict[int, float]
    features: dict[int, tuple[int, int]]  # arm -> (draft length, match length) known before drafting
    resolved: dict[int, RoundRecord] = field(default_factory=dict)


def show(policy, features: dict[int, tuple[int, int]]) -> None:
    """Hand a policy that reads per-arm features (``see``: the router) this round's."""
    see = getattr(policy, "see", None)
    if see is not None:
        see(features)


def match_length(draft: list[int], emitted: list[int]) -> tuple[int, bool]:
    """(leading tokens of ``draft`` equal to ``emitted``, whether that count is final): final once a
    mismatch is seen or every draft token has been compared."""
    k = 0
    n = min(len(draft), len(emitted))
    while k < n and draft[k] == emitted[k]:
        k += 1
    return k, (k < n or k == len(draft))


class CounterfactualScorer:
    """Proposes for every scorable arm before a live round and resolves the drafts as tokens arrive.

    One per engine; per-query state lives in the ``DecodeState`` (``pending``) so queries don't mix."""

    def __init__(self, arms, greedy: bool):
        self.arms = arms
        self.greedy = greedy
        self.verify_sum: dict[int, float] = {}  # drafted length -> summed live verification time (per query)
        self.verify_n: dict[int, int] = {}

    @property
    def scorable(self) -> list[int]:
        """The arms scored this query (greedy adds the arms whose greedy draft is deterministic)."""
        return [j for j, a in enumerate(self.arms) if getattr(a, "free_counterfactual", False)
                or (self.greedy and getattr(a, "greedy_counterfactual", False))]

    def new_query(self) -> None:
        self.verify_sum.clear()
        self.verify_n.clear()

    def propose(self, ctx: list[int], remaining: int) -> tuple[dict[int, list[int]], dict[int, float],
                                                              dict[int, tuple[int, int]]]:
        """Every scorable arm proposes from ``ctx`` (no length controller: the arm's full preset L, as a
        fixed-arm run without a controller drafts). Returns drafts, drafting seconds and the per-arm
        features a router sees before choosing: (draft length, the arm's match length)."""
        drafts, times, features = {}, {}, {}
        for j in self.scorable:
            a = self.arms[j]
            t0 = time.perf_counter()
            drafts[j] = a.propose(ctx, min(a.L, remaining - 1)).tokens.tolist()
            times[j] = time.perf_counter() - t0
            features[j] = (len(drafts[j]), int(getattr(a, "last_match", 0)))
        return drafts, times, features

    def before_round(self, policy, ctx: list[int], remaining: int) -> tuple[dict, dict, dict]:
        """Before a live round's choice: every scorable arm proposes from ``ctx`` and a policy that reads
        features (the router) sees them. Returns what :meth:`after_round` needs: (drafts, times, features)."""
        proposal = self.propose(ctx, remaining)
        show(policy, proposal[2])
        return proposal

    def after_round(self, policy, record: RoundRecord, proposal: tuple[dict, dict, dict], last_match: int,
                    pending: list[PendingRound], rounds: list[RoundRecord], tokens: list[int], remaining: int,
                    finished: bool) -> None:
        """After a live round (``record`` played, already in ``rounds``; its tokens already in ``tokens``;
        ``remaining`` the budget it began with): learn its verification time, queue its counterfactual drafts,
        and hand every round that became complete its reward vector (``policy.update_full``)."""
        drafts, times, features = proposal
        self.observe_live(record)
        features.setdefault(record.arm, (record.drafted, int(last_match)))
        drafts.pop(record.arm, None)
        times.pop(record.arm, None)
        pending.append(PendingRound(len(rounds) - 1, len(tokens) - record.new_tokens, remaining, drafts, times,
                                    features))
        self.settle(policy, pending, rounds, tokens, finished)

    def settle(self, policy, pending: list[PendingRound], rounds: list[RoundRecord], tokens: list[int],
               finished: bool) -> None:
        """Hand every pending round that the emitted ``tokens`` now complete its reward vector; what a round whose
        counterfactual drafts were not made (a batched round that could not speculate) still owes the earlier ones."""
        for p in self.resolve(pending, rounds, tokens, finished=finished):
            played = rounds[p.round_index]
            policy.update_full(played.arm, played.feedback, p.features)

    def observe_live(self, record: RoundRecord) -> None:
        """Learn the verification time of a live round's draft length (for counterfactual times)."""
        self.verify_sum[record.drafted] = self.verify_sum.get(record.drafted, 0.0) + record.verify_time
        self.verify_n[record.drafted] = self.verify_n.get(record.drafted, 0) + 1

    def _verify_time(self, drafted: int, played: RoundRecord) -> float:
        n = self.verify_n.get(drafted, 0)
        return self.verify_sum[drafted] / n if n else played.verify_time

    def resolve(self, pending: list[PendingRound], rounds: list[RoundRecord], tokens: list[int],
                finished: bool) -> list[PendingRound]:
        """Resolve what the emitted ``tokens`` now decide; returns the rounds that became complete (their
        live record's ``feedback`` filled in) and removes them from ``pending``. When the query is
        ``finished``, every draft still open is resolved on what was emitted (EOS or the budget cut it)."""
        done = []
        for p in list(pending):
            played = rounds[p.round_index]
            emitted = tokens[p.start:]
            for j, d in p.drafts.items():
                if j in p.resolved:
                    continue
                k, final = match_length(d, emitted)
                if not (final or finished):
                    continue
                new = min(k + 1, p.remaining)
                if finished:  # EOS or the budget ended the query: nothing past the emitted tokens exists
                    new = min(new, len(emitted))
                acc = min(k, new)
                # greedy: 1 per matched position, then 0 at the mismatch (the target rejects there)
                probs = [1.0] * acc + ([0.0] if acc < len(d) else [])
                p.resolved[j] = RoundRecord(
                    arm=j, drafted=len(d), accepted=acc, new_tokens=new, draft_time=p.draft_times[j],
                    verify_time=self._verify_time(len(d), played), accept_prob=probs, max_len=self.arms[j].L,
                    step_time=played.step_time, counterfactual=True, exact=self.greedy)
            if len(p.resolved) == len(p.drafts):
                played.feedback = {played.arm: played, **p.resolved}
                pending.remove(p)
                done.append(p)
        return done
