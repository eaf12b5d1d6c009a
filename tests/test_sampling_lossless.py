"""Speculative sampling follows the target's distribution (chi-square tests)."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from decode.choose.arms.base import Arm
from decode.choose.arms.model import DrafterModelArm
from decode.core.draft import Draft
from decode.engine.loop import SpecEngine
from decode.choose.policies.simple import Fixed
from decode.core.sampling import SamplingConfig, probs
from decode.core.target import Target
from decode.core.verify import Verifier, verify_reference
from helpers import tiny_llama

V = 6


class ConstantArm(Arm):
    """Deterministic (one-hot) drafter that always proposes the same tokens."""
    name = "const"

    def __init__(self, tokens):
        super().__init__(len(tokens))
        self.tokens = tokens

    def propose(self, context, max_len, keep_going=None):
        return Draft(torch.tensor(self.tokens[:max_len]))


def _chi2_ok(counts, expected_p, n):
    counts, expected_p = np.asarray(counts, dtype=np.float64), np.asarray(expected_p, dtype=np.float64)
    mask = expected_p * n >= 5  # pool tiny cells so chi-square is valid
    obs = np.append(counts[mask], counts[~mask].sum())
    exp = np.append(expected_p[mask] * n, expected_p[~mask].sum() * n)
    keep = exp > 0
    exp = exp[keep] * obs[keep].sum() / exp[keep].sum()  # float64 renormalisation of the expected counts
    return chisquare(obs[keep], exp).pvalue


@pytest.mark.parametrize("cfg", [SamplingConfig(1.0), SamplingConfig(0.7, top_k=4), SamplingConfig(1.0, top_p=0.8)])
def test_verifier_output_distribution_batched(cfg):
    torch.manual_seed(0)
    n, L = 40000, 3
    tl = torch.randn(1, L + 1, V) * 1.5
    dl = torch.randn(1, L, V) * 1.5
    p, q = probs(tl, cfg)[0], probs(dl, cfg)[0]
    draft = torch.multinomial(q, n, replacement=True).T  # [n, L] drafts from q
    res = verify_reference(tl.expand(n, -1, -1), draft, q.expand(n, -1, -1), cfg, torch.rand(n, L + 1))
    # first emitted token: draft[0] if accepted else the correction
    first = torch.where(res.accepted > 0, draft[:, 0], res.next_token)
    counts = np.bincount(first.numpy(), minlength=V)
    assert _chi2_ok(counts, p[0].numpy(), n) > 1e-3
    # one-hot drafter: a fixed draft token, still exact
    fixed = torch.full((n, L), 2)
    res = verify_reference(tl.expand(n, -1, -1), fixed, None, cfg, torch.rand(n, L + 1))
    first = torch.where(res.accepted > 0, fixed[:, 0], res.next_token)
    assert _chi2_ok(np.bincount(first.numpy(), minlength=V), p[0].numpy(), n) > 1e-3


def _exact_two_token_dist(model, prompt, cfg):
    with torch.inference_mode():
        p1 = probs(model(torch.tensor([prompt])).logits[0, -1], cfg)
        joint = torch.zeros(V, V)
        for a in range(V):
            p2 = probs(model(torch.tensor([prompt + [a]])).logits[0, -1], cfg)
            joint[a] = p1[a] * p2
    return joint.flatten().numpy()


def _assert_first_two_tokens_follow_target(eng, target, cfg, prompt=(0, 2, 4), n=2500):
    """Chi-square of the engine's first two sampled tokens against the target's exact joint law."""
    counts = np.zeros(V * V)
    for _ in range(n):
        toks = eng.generate(list(prompt), Fixed(1, 2), 2).tokens
        counts[toks[0] * V + toks[1]] += 1
    assert _chi2_ok(counts, _exact_two_token_dist(target, list(prompt), cfg), n) > 1e-3


# static caches (decode/core/target.py) are checked here where cheap: target + drafter; logits equal the
# dynamic cache's within fp32 tolerance (tests/test_static_cache.py), so the rest need not repeat
@pytest.mark.parametrize("drafter_kind,cache", [("stochastic", "dynamic"), ("stochastic", "static"),
                                                ("stochastic", "prefix"), ("one-hot", "dynamic")])
def test_engine_first_two_tokens_follow_target(drafter_kind, cache):
    cfg = SamplingConfig(1.0)
    target = tiny_llama(vocab=V, hidden=16, layers=1, seed=4, peaked=4.0)
    gen = torch.Generator().manual_seed(0)
    if drafter_kind == "stochastic":
        arm = DrafterModelArm(tiny_llama(vocab=V, hidden=16, layers=1, seed=5, peaked=4.0), cfg, 2, gen, cache=cache)
    else:
        arm = ConstantArm([1, 3])
    eng = SpecEngine(Target(target, cache=cache), [arm], Verifier(cfg, generator=gen))
    _assert_first_two_tokens_follow_target(eng, target, cfg)


@pytest.mark.parametrize("head_kind,cache", [("early_exit", "dynamic"), ("eagle", "dynamic"), ("eagle", "static"),
                                                     ("eagle", "prefix")])
def test_self_drafting_heads_first_two_tokens_follow_target(head_kind, cache):
    """The heads' drafts (q from the exit layer / EAGLE feature head) keep sampling exact."""
    from decode.choose.arms.eagle import EagleArm
    from decode.choose.arms.early_exit import EarlyExitArm
    from decode.choose.heads import EagleHead, EarlyExitDrafter

    cfg = SamplingConfig(1.0)
    target = tiny_llama(vocab=V, hidden=16, layers=3, seed=4, peaked=4.0)
    gen = torch.Generator().manual_seed(0)
    wrapped = Target(target, want_hidden=True, cache=cache)
    if head_kind == "early_exit":
        arm = EarlyExitArm(EarlyExitDrafter(target, 1), cfg, L=2, generator=gen, target=wrapped, cache=cache)
    else:
        arm = EagleArm(EagleHead(target, init="last_layer"), target, cfg, L=2, generator=gen, target=wrapped,
                       cache=cache)
    eng = SpecEngine(wrapped, [arm], Verifier(cfg, generator=gen))
    _assert_first_two_tokens_follow_target(eng, target, cfg)


def test_chi2_detects_a_wrong_distribution():
    """The test above has power: a biased sampler is rejected."""
    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    biased = rng.choice(4, size=4000, p=[0.45, 0.3, 0.15, 0.1])
    assert _chi2_ok(np.bincount(biased, minlength=4).astype(float), p, 4000) < 1e-3
