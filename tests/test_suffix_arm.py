"""The suffix-automaton drafter finds the longest earlier-occurring suffix and its latest occurrence."""
import random

from decode.choose.arms.ngram import PromptLookupArm
from decode.choose.arms.suffix import SuffixArm, SuffixAutomaton


def brute(text):
    n = len(text)
    for L in range(n - 1, 0, -1):
        suf = text[n - L:]
        for e in range(n - 2, L - 2, -1):
            if text[e - L + 1:e + 1] == suf:
                return L, e
    return 0, -1


def test_suffix_automaton_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        text = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        sa = SuffixAutomaton()
        for t in text:
            sa.extend(t)
        assert sa.match() == brute(text), text


def test_suffix_arm_continuation_and_incremental_growth():
    arm = SuffixArm(L=3, min_match=2)
    ctx = [5, 6, 7, 8, 9, 1, 5, 6]
    arm.reset(ctx)
    assert arm.propose(ctx, 3).tokens.tolist() == [7, 8, 9]
    ctx += [7, 2, 5, 6, 7]
    assert arm.propose(ctx, 3).tokens.tolist() == [2, 5, 6]  # latest earlier occurrence of "5 6 7"
    assert len(arm.propose([1, 2, 3], 3)) == 0  # a new, unrelated context rebuilds the index


def test_pld_prefers_latest_match_and_respects_budget():
    arm = PromptLookupArm(L=4, max_ngram=2)
    ctx = [1, 2, 3, 4, 1, 2, 9, 9, 1, 2]
    assert arm.propose(ctx, 4).tokens.tolist() == [9, 9, 1, 2]
    assert arm.propose(ctx, 1).tokens.tolist() == [9]
    assert len(arm.propose([1, 2, 3], 4)) == 0
