"""PyTorch reference verification of tree drafts (ALGORITHMS.md §1 k-Seq, §7 trees).

Input: target logits [N+1, V] from ``Target.score_tree`` (row 0 at the last context token, row n+1
at node n) and a tree ``Draft`` (decode/core/tree.py). Output: an ``Outcome`` whose ``path`` is the
accepted root path (the target keeps only those KV entries) and whose tokens are that path plus one
token from the target (correction or bonus).

* Greedy: from the root, move to the child whose token is the target's argmax; stop when none is;
  emit the path + the argmax there. Equal to plain greedy decoding.
* Sampling, general trees: recursive rejection sampling over siblings (SpecInfer, EAGLE-2). At a node,
  p = the target's distribution; for each child c (index order) drawn from q_c: accept with
  probability min(1, p(c)/q_c(c)) and descend, else p ← norm([p − q_c]_+). All rejected: emit a sample
  of the current p. A leaf reached: the bonus from the target there. Exact when each q row is the
  distribution its node was drawn from given its earlier siblings (one-hot for deterministic ones).
* Sampling, ``draft.chain_ends`` set (K i.i.d. chains of one drafter): SpecTr's k-Seq at each level
  over the chains still alive (in sampling order), recursing on the chains whose token equals the
  selected one.

The pieces a wrong implementation would typically get wrong (ρ*, the k-Seq residual, the sibling
residual) are module-level functions, so tests can swap in mutants and check they are caught.
The whole walk runs on the host, reading small per-node numbers from the logits' device; nothing of
size V is moved.
"""
from __future__ import annotations

import torch

from ..draft import Draft, Outcome
from ..sampling import SamplingConfig, probs, sample_from
from ..tree import children, root_path
from .reference import acceptance_ratio, input_status, raise_for_status

RHO_TOL = 1e-6  # bracket width at which the search for ρ* stops
RHO_GRID = 16  # points per pass of that search


def kseq_beta(p: torch.Tensor, q: torch.Tensor, rho) -> torch.Tensor:
    """β(ρ) = Σ_x min(p(x), q(x)/ρ) (p: draft, q: target)."""
    return torch.minimum(p, q / rho).sum(-1)


def kseq_rho(p: torch.Tensor, q: torch.Tensor, k: int) -> float:
    """ρ* ∈ [1, k] solving 1 − (1 − β(ρ))^k = ρ·β(ρ) (p: draft, q: target).

    f(ρ) = lhs − rhs decreases in ρ, f(1) ≥ 0 ≥ f(k): a bracketing search evaluating ``RHO_GRID`` + 1
    points per pass (one batched op, one host read) until the bracket is narrower than ``RHO_TOL``.
    Returns the upper end of the bracket, where f ≤ 0, i.e. p_acc ≤ ρβ: the residual is then
    non-negative (a ρ below the root would make it negative somewhere)."""
    if k <= 1:
        return 1.0
    p64, q64 = p.double().unsqueeze(0), q.double().unsqueeze(0)
    lo, hi = 1.0, float(k)
    while hi - lo > RHO_TOL:
        grid = torch.linspace(lo, hi, RHO_GRID + 1, dtype=torch.float64, device=p.device)
        beta = kseq_beta(p64, q64, grid.unsqueeze(1))
        f = 1 - (1 - beta) ** k - grid * beta
        j = min(int((f > 0).sum()), RHO_GRID)  # f decreasing: grid[j] is the first point with f <= 0
        if j == 0:
            return lo
        lo, hi = float(grid[j - 1]), float(grid[j])
    return hi


def kseq_residual(p: torch.Tensor, q: torch.Tensor, rho: float, k: int) -> torch.Tensor:
    """p_res ∝ q − min(p, q/ρ)·p_acc/β(ρ) with p_acc = 1 − (1 − β)^k (unnormalised; ≥ 0)."""
    p64, q64 = p.double(), q.double()
    beta = kseq_beta(p64, q64, rho)
    p_acc = 1 - (1 - beta) ** k
    res = (q64 - torch.minimum(p64, q64 / rho) * (p_acc / beta.clamp_min(1e-300))).clamp_min(0.0)
    return torch.where(res.sum() > 0, res, q64).float()  # p_acc = 1 (p == q): the residual is never used


def rrs_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The target's distribution after rejecting a sibling drawn from q: norm([p − q]_+)."""
    res = (p - q).clamp_min(0.0)
    mass = res.sum()
    return torch.where(mass > 0, res / mass.clamp_min(1e-30), p)  # p == q: rejection has probability 0


class _Draws:
    """Uniforms consumed in order: explicit ones (tests) or drawn from ``generator`` in one block."""

    def __init__(self, n: int, uniforms: torch.Tensor | None, generator: torch.Generator | None):
        self.u = (uniforms if uniforms is not None else torch.rand(n, generator=generator)).double().cpu().tolist()
        self.i = 0

    def __call__(self) -> float:
        if self.i >= len(self.u):
            raise ValueError(f"tree verification needs more than the {len(self.u)} uniforms given")
        self.i += 1
        return self.u[self.i - 1]


def verify_tree(target_logits: torch.Tensor, draft: Draft, cfg: SamplingConfig,
                generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None) -> Outcome:
    """Verify a tree draft (see the module docstring). ``uniforms``: explicit randomness (sampling):
    at least N + 1 values, or K·depth + 1 with ``chain_ends``; default: drawn from ``generator``."""
    N, V = len(draft), target_logits.shape[-1]
    if target_logits.shape[0] != N + 1:
        raise ValueError(f"tree verification needs logits for [last token] + {N} nodes, "
                         f"got {target_logits.shape[0]} rows")
    dev = target_logits.device
    tokens = draft.tokens.to(dev)
    parents = draft.parents if draft.parents is not None else torch.arange(-1, N - 1)
    q = None if draft.q is None else draft.q.to(dev).float()
    raise_for_status(input_status(target_logits[None], tokens[None], None if q is None else q[None]), V, draft.tokens)
    P = probs(target_logits, cfg)  # [N+1, V]
    rows = (parents + 1).to(dev)
    p_tok = P[rows, tokens]  # target probability of each node's token at its parent
    if q is None:
        q_tok, tv = torch.ones_like(p_tok), 1.0 - p_tok
    else:
        q_tok = q[torch.arange(N, device=dev), tokens]
        tv = 0.5 * (P[rows] - q).abs().sum(-1)
    ratio = acceptance_ratio(p_tok, q_tok)
    best = target_logits.argmax(-1)
    f64 = torch.float64
    flat = torch.cat([best.to(f64), tokens.to(f64), ratio.to(f64), tv.to(f64)]).tolist()  # one host read
    best_h, tok_h = [int(x) for x in flat[:N + 1]], [int(x) for x in flat[N + 1:2 * N + 1]]
    ratio_h, tv_h = flat[2 * N + 1:3 * N + 1], flat[3 * N + 1:]
    parents_h = parents.tolist()
    kids = children(parents_h)

    if cfg.greedy:
        node, path = -1, []
        while True:
            nxt = next((c for c in kids[node + 1] if tok_h[c] == best_h[node + 1]), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        stop = kids[node + 1][:1]  # the first child compared where it stopped (none at a leaf)
        stats = path + stop
        return Outcome(len(path), [tok_h[i] for i in path] + [best_h[node + 1]], [1.0] * len(path) + [0.0] * len(stop),
                       [tv_h[i] for i in stats], path=path)

    if draft.chain_ends is not None:
        path, final, u_final = _kseq_walk(P, q, tok_h, parents_h, draft.chain_ends.tolist(),
                                          _Draws(N * len(draft.chain_ends) + 1, uniforms, generator))
    else:
        path, final, u_final = _rrs_walk(P, q, tokens, kids, ratio_h, _Draws(N + 1, uniforms, generator))
    token = int(sample_from(final, torch.tensor(u_final, dtype=final.dtype, device=dev)))
    stats = path + kids[(path[-1] if path else -1) + 1][:1]  # + the first child tested where it stopped
    return Outcome(len(path), [tok_h[i] for i in path] + [token], [ratio_h[i] for i in stats],
                   [tv_h[i] for i in stats], path=path)


def _rrs_walk(P, q, tokens, kids, ratio_h, draws):
    """Recursive rejection sampling over siblings: (accepted path, final distribution, its uniform)."""
    V = P.shape[-1]
    node, path = -1, []
    while True:
        p = P[node + 1]
        for j, c in enumerate(kids[node + 1]):
            q_c = q[c] if q is not None else torch.nn.functional.one_hot(tokens[c], V).to(P.dtype)
            # the first child is tested against the target itself (its ratio was read already)
            r = ratio_h[c] if j == 0 else float(acceptance_ratio(p[tokens[c]], q_c[tokens[c]]))
            if draws() < r:
                path.append(c)
                node = c
                break
            p = rrs_residual(p, q_c)
        else:  # every child rejected (or a leaf: the bonus from the target there)
            return path, p, draws()


def _kseq_walk(P, q, tok_h, parents, chain_ends, draws):
    """SpecTr Alg. 3 over the chains of a merged tree: (accepted path, final distribution, its uniform)."""
    chains = [root_path(parents, e) for e in chain_ends]
    alive = list(range(len(chains)))
    node, path, d = -1, [], 0
    while True:
        target = P[node + 1]
        cand = [chains[k][d] for k in alive if len(chains[k]) > d]  # each alive chain's next node, in order
        if not cand:
            return path, target, draws()  # every alive chain ended here: the bonus
        draft = q[cand[0]]  # the one distribution every alive chain drew its next token from
        rho = kseq_rho(draft, target, len(cand))
        toks = torch.tensor([tok_h[c] for c in cand], device=P.device)
        ratios = acceptance_ratio(target[toks], rho * draft[toks]).tolist()  # min(1, q/(ρ p))
        hit = next((c for c, r in zip(cand, ratios) if draws() < r), None)
        if hit is None:
            return path, kseq_residual(draft, target, rho, len(cand)), draws()
        path.append(hit)
        node = hit
        alive = [k for k in alive if len(chains[k]) > d and tok_h[chains[k][d]] == tok_h[hit]]
        d += 1
