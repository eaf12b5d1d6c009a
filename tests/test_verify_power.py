"""Speculative sampling's whole emitted block follows its exact law, and the tests catch wrong verifiers.

Why: a first-token test with one-token drafts cannot tell a correct verifier from one that draws the
residual at the wrong position or the bonus from the wrong row. Here the target's distribution is
fixed per position (in real decoding position i is conditioned on the draft prefix; fixing it makes
the law exact and cheap), drafts have L = 3 tokens, and the joint law of the emitted block
(j accepted tokens + 1 correction/bonus) is compared with its exact value:

  rejection at position k ≤ L:  P(y_1..y_k) = Π_{i<k} min(p_i, q_i)(y_i) · [p_k − q_k]_+(y_k)
  all L accepted:               P(y_1..y_{L+1}) = Π_{i≤L} min(p_i, q_i)(y_i) · p_{L+1}(y_{L+1})

(summing over the block structure gives the target's own law, which is what "lossless" means).
Deliberately wrong verifiers (one change each to a copy of the reference) must fail these checks;
``python tests/test_verify_power.py`` prints each mutant's rejection rate over 20 seeds.
"""
from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from decode.core.sampling import SamplingConfig, probs, sample_from
from decode.core.verify.reference import VerifyResult, verify_reference

V, L = 6, 3
N = 40_000  # samples per block-law check: each runs as one batched verifier call
ALPHA = 1e-3
# target probabilities per position (row L = the bonus row); distinct values, so top-k has no ties
P_ROWS = [[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
          [0.04, 0.10, 0.45, 0.06, 0.30, 0.05],
          [0.10, 0.35, 0.04, 0.30, 0.06, 0.15],
          [0.03, 0.06, 0.10, 0.16, 0.25, 0.40]]
# draft probabilities, far from the target (acceptance ≈ 0.5 per position)
Q_ROWS = [[0.10, 0.05, 0.20, 0.30, 0.24, 0.11],
          [0.30, 0.09, 0.15, 0.25, 0.11, 0.10],
          [0.25, 0.12, 0.30, 0.08, 0.20, 0.05]]
ONE_HOT = [1, 4, 3]  # a deterministic arm's draft: second-best target tokens
TARGET_LOGITS = torch.tensor(P_ROWS).log()
DRAFT_LOGITS = torch.tensor(Q_ROWS).log()
CONFIGS = {"T1": SamplingConfig(1.0),
           "topk": SamplingConfig(0.8, top_k=4)}  # p = 0 tokens in the drafts, and a residual reaching them


# ---------------------------------------------------------------------------------------------- mutants

def _variant(target_logits, draft_tokens, draft_probs, cfg, uniforms, mutation=None) -> VerifyResult:
    """Sampling verification written plainly; ``mutation`` names one deliberate bug (None = correct)."""
    B, L1, Vv = target_logits.shape
    n = L1 - 1
    rows = torch.arange(B)
    p = probs(target_logits, cfg)
    q = (draft_probs.float() if draft_probs is not None
         else torch.nn.functional.one_hot(draft_tokens, Vv).float())
    p_tok = p[:, :n].gather(-1, draft_tokens[..., None])[..., 0]
    q_tok = q.gather(-1, draft_tokens[..., None])[..., 0]
    if mutation == "ratio_inverted":  # min(1, q/p)
        ratio = torch.where(p_tok > 0, torch.minimum(q_tok / torch.where(p_tok > 0, p_tok, 1.0), torch.ones(())), 0.0)
    else:
        ratio = torch.where(q_tok > 0, torch.minimum(p_tok / torch.where(q_tok > 0, q_tok, 1.0), torch.ones(())),
                            (p_tok > 0).float())
    if mutation == "accept_when_q_zero":
        ratio = torch.where(q_tok > 0, ratio, 1.0)
    u = uniforms[:, :n]
    ok = u <= ratio if mutation == "accept_u_le" else u < ratio
    a = torch.cumprod(ok.long(), -1).sum(-1)
    pos = a
    if mutation == "residual_next_position":
        pos = (a + 1).clamp(max=n)
    elif mutation == "residual_prev_position":
        pos = (a - 1).clamp(min=0)
    q_pad = torch.cat([q, q.new_zeros(B, 1, Vv)], 1)
    resid = p[rows, pos] if mutation == "residual_from_p" else (p[rows, pos] - q_pad[rows, pos]).clamp_min(0)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p[rows, pos])
    bonus = p[rows, torch.full_like(a, max(n - 1, 0) if mutation == "bonus_wrong_row" else n)]
    final = torch.where((a < n)[:, None], resid, bonus)
    tv = 0.5 * (p[:, :n] - q).abs().sum(-1)
    return VerifyResult(a, sample_from(final, uniforms[:, n]), ratio, tv)


def _mutant(name):
    def fn(*args):
        return _variant(*args, mutation=name)
    fn.__name__ = name
    return fn


# mutant → the check that must catch it ("block law": chi-square; the others are deterministic)
MUTANTS = {"residual_from_p": "block law",
           "residual_next_position": "block law",
           "residual_prev_position": "block law",
           "bonus_wrong_row": "block law",
           "ratio_inverted": "block law",
           "accept_u_le": "p=0 never accepted",
           "accept_when_q_zero": "p=0 never accepted"}


# ---------------------------------------------------------------------------------------- exact block law

def _dists(cfg):
    p = probs(TARGET_LOGITS, cfg).double()
    q = probs(DRAFT_LOGITS, cfg).double()
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def exact_block_law(p: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """P(emitted block) over codes of [y_1..y_{L+1}] padded with V (see :func:`block_codes`)."""
    n, Vv = q.shape
    law = np.zeros((Vv + 1) ** (n + 1))
    acc = torch.minimum(p[:n], q).numpy()
    resid = (p[:n] - q).clamp_min(0).numpy()
    last = [resid[k] for k in range(n)] + [p[n].numpy()]
    for k in range(1, n + 2):  # block length k: k-1 accepted, then the correction (k ≤ n) or bonus
        for ys in itertools.product(range(Vv), repeat=k):
            pr = math.prod(acc[i, ys[i]] for i in range(k - 1)) * last[k - 1][ys[-1]]
            if pr > 0:
                law[_code(list(ys), n, Vv)] = pr
    return law


def _code(ys, n, Vv):
    return sum(y * (Vv + 1) ** i for i, y in enumerate(ys + [Vv] * (n + 1 - len(ys))))


def block_codes(res: VerifyResult, tokens: torch.Tensor, Vv: int) -> np.ndarray:
    """Each row's emitted block (accepted drafts + next_token, padded with V) as one integer."""
    B, n = tokens.shape
    pos = torch.arange(n + 1)
    block = torch.cat([tokens, torch.zeros(B, 1, dtype=torch.long)], 1)
    block = torch.where(pos < res.accepted[:, None], block, Vv)
    block[torch.arange(B), res.accepted] = res.next_token
    return (block * (Vv + 1) ** pos).sum(-1).numpy()


def chi2_pvalue(counts: np.ndarray, expected_p: np.ndarray) -> float:
    """Chi-square p-value; cells expected below 5 are pooled. Any count in an impossible cell → 0."""
    counts, expected_p = np.asarray(counts, np.float64), np.asarray(expected_p, np.float64)
    n = counts.sum()
    if counts[expected_p <= 0].sum() > 0:
        return 0.0
    big = expected_p * n >= 5
    obs = np.append(counts[big], counts[~big & (expected_p > 0)].sum())
    exp = np.append(expected_p[big], expected_p[~big & (expected_p > 0)].sum()) * n
    keep = exp > 0
    exp = exp[keep] * obs[keep].sum() / exp[keep].sum()
    return float(chisquare(obs[keep], exp).pvalue)


def block_law_pvalues(fn, cfg_name: str, one_hot: bool, seed: int, n: int = N) -> tuple[float, float]:
    """(joint law of the whole block, law of (block length, last token)) p-values from one batched call."""
    cfg = CONFIGS[cfg_name]
    p, q = _dists(cfg)
    g = torch.Generator().manual_seed(seed)
    if one_hot:
        tokens = torch.tensor(ONE_HOT).expand(n, L).contiguous()
        q_used, draft_probs = torch.nn.functional.one_hot(tokens[0], V).double(), None
    else:
        tokens = torch.multinomial(q.float(), n, replacement=True, generator=g).T.contiguous()
        q_used, draft_probs = q, q.float().expand(n, L, V)
    u = torch.rand(n, L + 1, generator=g)
    res = fn(TARGET_LOGITS.expand(n, L + 1, V), tokens, draft_probs, cfg, u)
    codes = block_codes(res, tokens, V)
    law = exact_block_law(p, q_used)
    assert abs(law.sum() - 1) < 1e-9
    joint = chi2_pvalue(np.bincount(codes, minlength=law.size), law)
    # (block length, last token): the residual/bonus draws alone, where those mutants act
    length = res.accepted.numpy()
    last = res.next_token.numpy()
    lengths = np.zeros(law.size, dtype=np.int64)
    lasts = np.zeros(law.size, dtype=np.int64)
    for c in np.nonzero(law)[0]:
        digits = [(c // (V + 1) ** i) % (V + 1) for i in range(L + 1)]
        k = sum(d < V for d in digits)
        lengths[c], lasts[c] = k - 1, digits[k - 1]
    law_jl = np.bincount(lengths * V + lasts, weights=law, minlength=(L + 1) * V)
    marginal = chi2_pvalue(np.bincount(length * V + last, minlength=(L + 1) * V), law_jl)
    return joint, marginal


# ------------------------------------------------------------------------------------- deterministic checks

def _hand_logits(rows):
    return torch.tensor(rows).log()[None]


# L = 2, V = 4, T = 1. p0 = (.1,.2,.3,.4), p1 = (.4,.3,.2,.1), bonus p2 uniform; q0 = p1, q1 = p0.
# TV(p_i, q_i) = ½(.3+.1+.1+.3) = .4 at both positions.
_P3 = [[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]
_Q2 = [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]
HAND_CASES = [
    # name, target rows, draft tokens, q rows (None = one-hot), cfg, uniforms, accepted, next_token, accept_prob, tv
    # both accepted (ratios 1, 1); bonus from p2 uniform: u=.6 → token 2 (row 1 would give token 1)
    ("bonus", _P3, [3, 0], _Q2, SamplingConfig(1.0), [0.99, 0.5, 0.6], 2, 2, [1.0, 1.0], [0.4, 0.4]),
    # ratio .2/.3 = 2/3 twice: u=.5 accepts, u=.7 rejects at 1; residual [p1 − q1]+ = (.3,.1,0,0) → (.75,.25):
    # u=.8 → token 1 (from p1 alone: 2; at position 2: 3; at position 0: 3)
    ("residual at 1", _P3, [1, 2], _Q2, SamplingConfig(1.0), [0.5, 0.7, 0.8], 1, 1, [2 / 3, 2 / 3], [0.4, 0.4]),
    # ratio .1/.4 = .25: u=.3 rejects at 0; residual [p0 − q0]+ = (0,0,.1,.3) → (0,0,.25,.75): u=.2 → token 2
    ("residual at 0", _P3, [0, 3], _Q2, SamplingConfig(1.0), [0.3, 0.0, 0.2], 0, 2, [0.25, 0.25], [0.4, 0.4]),
    # top-2: p0 = (0,0,3/7,4/7), p1 = (4/7,3/7,0,0). One-hot draft 0 has p = 0: rejected even at u = 0;
    # residual p0 − onehot(0) = p0: u=.5 → token 3 (cdf 3/7 < .5)
    ("p=0 one-hot, u=0", _P3, [0, 0], None, SamplingConfig(1.0, top_k=2), [0.0, 0.0, 0.5], 0, 3, [0.0, 4 / 7],
     [1.0, 3 / 7]),
    # q0(0) = 0 and p0(0) = 0: rejected even at u = 0; residual [p0 − q0]+ = (0, 0, 1/35, 19/70)
    # → (0, 0, 2/21, 19/21): u=.5 → token 3. TV0 = ½(.3 + 1/35 + 19/70) = .3;
    # p1 = (4/7, 3/7, 0, 0) vs q1 = (.5, .5, 0, 0): ratio 6/7, TV1 = 1/14
    ("p=0, q=0", _P3, [0, 1], [[0.0, 0.3, 0.4, 0.3], [0.5, 0.5, 0.0, 0.0]], SamplingConfig(1.0, top_k=2),
     [0.0, 0.0, 0.5], 0, 3, [0.0, 6 / 7], [0.3, 1 / 14]),
    # q0(3) = 0 < p0(3) = 4/7: min(1, p/0) = 1, accepted (probability 0 when drafts ~ q);
    # TV0 = ½(.3 + 19/70 + 4/7) = 4/7. q1(1) = .5, p1(1) = 3/7: ratio 6/7, u = .9 rejects;
    # residual [p1 − q1]+ = (1/14, 0, 0, 0) → token 0
    ("q=0 < p", _P3, [3, 1], [[0.0, 0.3, 0.7, 0.0], [0.5, 0.5, 0.0, 0.0]], SamplingConfig(1.0, top_k=2),
     [0.99, 0.9, 0.99], 1, 0, [1.0, 6 / 7], [4 / 7, 1 / 14]),
]


def hand_case_failures(fn) -> list[str]:
    """Names of the hand-computed cases where ``fn`` disagrees with the values worked out above."""
    failed = []
    for name, rows, toks, q, cfg, u, acc, nxt, aprob, tv in HAND_CASES:
        logits = _hand_logits(rows)
        draft_probs = None if q is None else torch.tensor(q)[None]
        res = fn(logits, torch.tensor([toks]), draft_probs, cfg, torch.tensor([u]))
        ok = (int(res.accepted[0]) == acc and int(res.next_token[0]) == nxt
              and np.allclose(res.accept_prob[0].tolist(), aprob, atol=1e-5)
              and np.allclose(res.tv[0].tolist(), tv, atol=1e-5))
        if not ok:
            failed.append(name)
    return failed


def p_zero_accepted(fn) -> list[str]:
    """Draft tokens the target cannot emit (cut by top-k) with u = 0: one-hot and q-less-than-p cases."""
    cfg = SamplingConfig(1.0, top_k=2)
    logits = _hand_logits([_P3[0], _P3[0]])  # top-2 keeps tokens 2, 3
    u = torch.zeros(1, 2)
    cases = {"one-hot": None,
             "q > 0": torch.tensor([[[0.5, 0.5, 0.0, 0.0]]]),
             "q = 0": torch.tensor([[[0.0, 0.5, 0.5, 0.0]]])}
    return [name for name, q in cases.items()
            if int(fn(logits, torch.tensor([[0]]), q, cfg, u).accepted[0]) != 0]


def suite_failures(fn, seed: int = 0) -> set[str]:
    """Every check this file makes of a verifier; the names of those it fails."""
    failed = set()
    for cfg_name in CONFIGS:
        for one_hot in (False, True):
            if min(block_law_pvalues(fn, cfg_name, one_hot, seed)) < ALPHA:
                failed.add("block law")
    if hand_case_failures(fn):
        failed.add("hand cases")
    if p_zero_accepted(fn):
        failed.add("p=0 never accepted")
    return failed


# ---------------------------------------------------------------------------------------------- tests

def test_unmutated_variant_is_the_reference():
    """The mutants are one-change copies of the reference: without a change it matches draw for draw."""
    g = torch.Generator().manual_seed(1)
    for cfg in (*CONFIGS.values(), SamplingConfig(1.1, top_p=0.7)):
        logits = 2 * torch.randn(500, L + 1, 9, generator=g)
        q = probs(2 * torch.randn(500, L, 9, generator=g), cfg)
        for dp in (q, None):
            src = q if dp is not None else probs(logits[:, :L], cfg)
            tokens = torch.multinomial(src.reshape(-1, 9), 1, generator=g).reshape(500, L)
            u = torch.rand(500, L + 1, generator=g)
            a, b = _variant(logits, tokens, dp, cfg, u), verify_reference(logits, tokens, dp, cfg, u)
            assert torch.equal(a.accepted, b.accepted) and torch.equal(a.next_token, b.next_token)
            torch.testing.assert_close(a.accept_prob, b.accept_prob)
            torch.testing.assert_close(a.tv, b.tv)


@pytest.mark.parametrize("one_hot", [False, True], ids=["stochastic", "one-hot"])
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_reference_block_law(cfg_name, one_hot):
    joint, marginal = block_law_pvalues(verify_reference, cfg_name, one_hot, seed=0)
    assert joint > ALPHA and marginal > ALPHA, (joint, marginal)


def test_exact_law_marginalises_to_target():
    """The block law is right: summing out the block structure, each position's token is ~ p_i."""
    for cfg in CONFIGS.values():
        p, q = _dists(cfg)
        law = exact_block_law(p, q)
        digits = np.array([[(c // (V + 1) ** i) % (V + 1) for i in range(L + 1)] for c in range(law.size)])
        reach = 1.0
        for i in range(L + 1):
            at = np.bincount(digits[:, i], weights=law, minlength=V + 1)  # P(block has y_i = v)
            np.testing.assert_allclose(at[:V] / at[:V].sum(), p[i].numpy(), atol=1e-12)
            np.testing.assert_allclose(at[:V].sum(), reach, atol=1e-12)
            reach *= float(torch.minimum(p[i], q[i]).sum()) if i < L else 0.0


def test_reference_hand_cases():
    assert hand_case_failures(verify_reference) == []
    assert p_zero_accepted(verify_reference) == []


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_mutant_is_caught(mutant):
    failed = suite_failures(_mutant(mutant))
    assert MUTANTS[mutant] in failed, failed


# ---------------------------------------------------------------------------------------------- power

def power_table(seeds: int = 20, n: int = N) -> dict[str, dict[str, float]]:
    """Fraction of seeds where each check rejects each verifier (the reference's row is the false-alarm rate)."""
    verifiers = {"reference": verify_reference, **{m: _mutant(m) for m in MUTANTS}}
    table = {}
    for name, fn in verifiers.items():
        row = {}
        for cfg_name in CONFIGS:
            for one_hot in (False, True):
                key = f"{cfg_name}/{'one-hot' if one_hot else 'stochastic'}"
                row[key] = float(np.mean([min(block_law_pvalues(fn, cfg_name, one_hot, 1000 + s, n)) < ALPHA
                                          for s in range(seeds)]))
        row["hand cases"] = float(bool(hand_case_failures(fn)))
        row["p=0 at u=0"] = float(bool(p_zero_accepted(fn)))
        table[name] = row
    return table


if __name__ == "__main__":
    for n in (N, N // 10):
        t0 = time.perf_counter()
        table = power_table(n=n)
        cols = list(next(iter(table.values())))
        print(f"\nrejection rate over 20 seeds (block law: N={n}, p < {ALPHA}); deterministic checks: 0/1")
        print("| verifier | " + " | ".join(cols) + " |")
        print("|---|" + "---:|" * len(cols))
        for name, row in table.items():
            print(f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + " |")
        print(f"({time.perf_counter() - t0:.0f} s)")
