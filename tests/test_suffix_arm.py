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


def _brute_pld_chains(ctx, L, max_ngram, K):
    """Reference for pld K > 1: every occurrence, longest n first then latest first, first token not seen yet."""
    out, firsts = [], set()
    for n in range(min(max_ngram, len(ctx) - 1), 0, -1):
        for start in reversed(range(len(ctx) - n)):
            if ctx[start:start + n] == ctx[len(ctx) - n:]:
                cont = ctx[start + n:start + n + L]
                if cont[0] not in firsts and len(out) < K:
                    firsts.add(cont[0])
                    out.append(cont)
    return out


def test_pld_k_continues_each_distinct_earlier_occurrence_as_one_tree():
    from decode.core.tree import leaf_chains
    ctx = [1, 2, 5, 6, 7, 1, 2, 8, 9, 4, 1, 2, 5, 6, 0, 3, 1, 2]
    one, many = PromptLookupArm(L=3, max_ngram=2), PromptLookupArm(L=3, max_ngram=2, K=3)
    d = many.propose(ctx, 3)
    chains = [c.tokens.tolist() for c in leaf_chains(d)]
    # the latest occurrence's continuation first (K=1's draft), then 8 9 4; 5 6 7 starts like the first: skipped
    assert chains == [one.propose(ctx, 3).tokens.tolist(), [8, 9, 4]] == [[5, 6, 0], [8, 9, 4]]
    assert d.is_tree and d.q is None and many.label == "pld@3x3" and many.max_nodes == 9
    assert [c.tokens.tolist() for c in leaf_chains(many.propose(ctx, 1))] == [[5], [8]]  # max_len caps every chain
    rng = random.Random(0)
    for _ in range(300):
        ctx = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        d, want = many.propose(ctx, 3), _brute_pld_chains(ctx, 3, 2, 3)
        assert sorted(c.tokens.tolist() for c in leaf_chains(d)) == sorted(want), ctx
        assert d.tokens[:len(want)].tolist() == [c[0] for c in want]  # siblings in the order found
