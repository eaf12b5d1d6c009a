"""Tree verification samples from the target's law (chi-square over whole emitted blocks), and the
checks catch plausible bugs (mutants swapped into decode/core/verify/tree.py).

Setting: a vocabulary of V = 4, a target P(·|prefix) and a drafter Q(·|prefix) that depend on the
whole prefix and are far from uniform and from each other. A sample is one verification round from an
empty context (drafts of depth L = 3) whose emitted block is completed to M = L + 1 tokens by sampling
the target itself; lossless verification makes those M tokens follow Π P exactly, whatever the block
length (a wrong residual, bonus or acceptance shows up in some cell). k-Seq gets K i.i.d. chains of
Q; recursive rejection sampling gets a general tree (K − 1 deterministic top-i chains of Q and one
chain sampled from Q, siblings not i.i.d.).
"""
from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from decode.core.draft import Draft
from decode.core.sampling import SamplingConfig, probs
from decode.core.tree import merge_chains, root_path
import decode.core.verify.tree as vt

V, L = 4, 3
M = L + 1
ALPHA = 1e-3
CONFIGS = {"T1": SamplingConfig(1.0), "topk": SamplingConfig(0.8, top_k=3)}  # topk: p = 0 tokens in drafts
CFG = CONFIGS["T1"]


class Law:
    """P(·|prefix) with logits ~ scale·N(0, 1), fixed per (seed, prefix)."""

    def __init__(self, seed: int, scale: float):
        self.seed, self.scale, self.cache = seed, scale, {}

    def logits(self, prefix) -> torch.Tensor:
        key = tuple(int(t) for t in prefix)
        if key not in self.cache:
            code = sum((t + 1) * (V + 1) ** i for i, t in enumerate(key))
            g = torch.Generator().manual_seed(self.seed * 100_003 + code)
            self.cache[key] = torch.randn(V, generator=g, dtype=torch.float64).float() * self.scale
        return self.cache[key]

    def probs(self, prefix, cfg: SamplingConfig | None = None) -> torch.Tensor:
        """The distribution after the shared logits processing of ``cfg`` (default: the module's CFG)."""
        return probs(self.logits(prefix), cfg or CFG)


TARGET, DRAFTER = Law(1, 2.0), Law(2, 2.0)


def _sampled_chain(rng: np.random.Generator, start=(), depth=L) -> Draft:
    toks, rows = list(start), []
    for _ in range(depth):
        q = DRAFTER.probs(toks)
        toks.append(int(rng.choice(V, p=q.double().numpy() / float(q.double().sum()))))
        rows.append(q)
    return Draft(torch.tensor(toks[len(start):]), q=torch.stack(rows))


def _greedy_chain(first: int) -> Draft:
    toks = [first]
    while len(toks) < L:
        toks.append(int(DRAFTER.probs(toks).argmax()))
    return Draft(torch.tensor(toks))


def kseq_draft(rng, K: int) -> Draft:
    return merge_chains([_sampled_chain(rng) for _ in range(K)], iid=True)


def general_draft(rng, K: int) -> Draft:
    ranked = DRAFTER.probs([]).argsort(descending=True).tolist()
    return merge_chains([_greedy_chain(ranked[i]) for i in range(K - 1)] + [_sampled_chain(rng)])


def _round_logits(draft: Draft) -> torch.Tensor:
    parents = draft.parents.tolist()
    toks = draft.tokens.tolist()
    return torch.stack([TARGET.logits([])] + [TARGET.logits([toks[j] for j in root_path(parents, n)])
                                               for n in range(len(draft))])


def sample_blocks(make_draft, K: int, n: int, seed: int = 0) -> np.ndarray:
    """Counts of the first M tokens over ``n`` rounds (each completed by sampling the target)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(V ** M)
    for _ in range(n):
        d = make_draft(rng, K)
        out = vt.verify_tree(_round_logits(d), d, CFG, gen).tokens[:M]
        while len(out) < M:
            p = TARGET.probs(out).double().numpy()
            out.append(int(rng.choice(V, p=p / p.sum())))
        counts[sum(t * V ** i for i, t in enumerate(out))] += 1
    return counts


def exact_law() -> np.ndarray:
    law = np.zeros(V ** M)
    for ys in itertools.product(range(V), repeat=M):
        pr = 1.0
        for i, y in enumerate(ys):
            pr *= float(TARGET.probs(ys[:i]).double()[y])
        law[sum(t * V ** i for i, t in enumerate(ys))] = pr
    return law / law.sum()


def pvalue(counts: np.ndarray) -> float:
    law, n = exact_law(), counts.sum()
    big = law * n >= 5  # pool the small cells so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(law[big] * n, law[~big].sum() * n)
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


# ------------------------------------------------------------------------------------------- mutants

def _rho_one(p, q, k):
    return 1.0


def _residual_without_factor(p, q, rho, k):
    return (q.double() - torch.minimum(p.double(), q.double() / rho)).clamp_min(0).float()


def _sibling_keeps_p(p, q):
    return p


MUTANTS = {"kseq_rho_one": ("kseq_rho", _rho_one, kseq_draft),
           "kseq_residual_without_pacc_beta": ("kseq_residual", _residual_without_factor, kseq_draft),
           "sibling_loop_without_updating_p": ("rrs_residual", _sibling_keeps_p, general_draft)}
N = 4000  # rounds per check (about 1 ms each)
N_MUTANT = 3000


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


@pytest.mark.parametrize("K,cfg", [(2, "T1"), (4, "T1"), (4, "topk")])
@pytest.mark.parametrize("make_draft", [kseq_draft, general_draft], ids=["kseq", "recursive"])
def test_emitted_block_follows_the_target(make_draft, K, cfg, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "CFG", CONFIGS[cfg])
    assert pvalue(sample_blocks(make_draft, K, N, seed=K)) > ALPHA


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_mutant_is_caught(mutant, monkeypatch):
    name, fn, make_draft = MUTANTS[mutant]
    monkeypatch.setattr(vt, name, fn)
    assert pvalue(sample_blocks(make_draft, 4, N_MUTANT, seed=7)) < ALPHA


if __name__ == "__main__":  # mutant p-values over a few seeds (how much power the checks have)
    for mutant, (name, fn, make_draft) in MUTANTS.items():
        orig = getattr(vt, name)
        setattr(vt, name, fn)
        print(mutant, [f"{pvalue(sample_blocks(make_draft, K, N, seed=s)):.1e}" for K in (2, 4) for s in range(3)])
        setattr(vt, name, orig)
