"""Token trees (ALGORITHMS.md §7): parent arrays, the tree attention inputs, and prefix trees merged
from several chains.

A tree of N nodes is a ``parents`` tensor [N]: ``parents[n]`` is node n's parent, -1 = a child of the
last context token (the root), and ``parents[n] < n`` (topological order). A chain of L tokens is
``parents = [-1, 0, 1, ..., L-2]``. Node n's depth is 1 + its number of ancestors; scored after
``prefix`` cached tokens its position id is ``prefix + depth - 1`` when the root itself is fed first
(see :func:`tree_attention`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft import Draft


def chain_parents(n: int) -> torch.Tensor:
    """The parents of a chain of ``n`` tokens: [-1, 0, ..., n-2]."""
    return torch.arange(-1, n - 1)


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: entry (i, j) is True when node j is node i or one of its ancestors.

    One vectorised step per tree level (walks every node up by one parent at a time)."""
    parents = torch.as_tensor(parents, dtype=torch.long).cpu()
    n = parents.numel()
    anc = torch.eye(n, dtype=torch.bool)
    rows = torch.arange(n)
    cur = parents.clone()
    while bool((cur >= 0).any()):
        up = cur >= 0
        anc[rows[up], cur[up]] = True
        cur = torch.where(up, parents[cur.clamp(min=0)], cur)
    return anc


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[N] depth of each node (1 = child of the root)."""
    return ancestor_matrix(parents).sum(1)


def draft_depth(draft: Draft) -> int:
    """Draft positions along the longest root path: ``len(draft)`` for a chain, the depth for a tree."""
    return int(depths(draft.parents).max()) if draft.is_tree else len(draft)


def children(parents: torch.Tensor | list[int]) -> list[list[int]]:
    """Children lists indexed by node + 1 (entry 0 = the root's children), in sibling (index) order."""
    parents = [int(p) for p in parents]
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for n, p in enumerate(parents):
        out[p + 1].append(n)
    return out


def root_path(parents: torch.Tensor | list[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (inclusive); [] for node -1."""
    parents = [int(p) for p in parents]
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_attention(parents: torch.Tensor, prefix: int, kv_len: int, dtype: torch.dtype,
                   device: torch.device | str, queries: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [1, q] and an additive attention mask [1, 1, q, kv_len] for a forward over a tree.

    The keys are ``prefix`` plain context slots followed by the tree's N nodes (slots prefix..prefix+N-1);
    the forward feeds the last ``queries`` nodes (default: all N), so the cache holds prefix + N - q
    entries before it. Each query sees the context, its ancestors and itself; every other slot (other
    branches, and a static cache's slots past the tree) is masked. ``kv_len`` is the key length the model
    attends over: prefix + N for a dynamic cache, the allocation for a static one. The mask is additive
    (0 / dtype min), which HF's eager and sdpa attention both take as a ready-made 4-D mask.
    """
    anc = ancestor_matrix(parents)
    n = anc.shape[0]
    q = n if queries is None else int(queries)
    if not 0 < q <= n or prefix + n > kv_len:
        raise ValueError(f"tree_attention: {q} queries of a {n}-node tree after {prefix} slots do not fit "
                         f"{kv_len} keys")
    pos = prefix + anc.sum(1) - 1
    visible = torch.zeros(q, kv_len, dtype=torch.bool)
    visible[:, :prefix] = True
    visible[:, prefix:prefix + n] = anc[n - q:]
    mask = torch.zeros(q, kv_len, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return pos[n - q:].unsqueeze(0).to(device), mask[None, None].to(device)


def leaf_chains(draft: Draft) -> list[Draft]:
    """A draft as chains: itself for a chain, else one chain per root-to-leaf path (per entry of
    ``chain_ends`` when set, duplicates included: each is its own draw), with their q rows. A tree's paths
    come in the order of their nodes (compared from the root): in a tree numbered by value, best first, the
    chain of the best nodes leads, so chains merged again (:func:`merge_chains`, a union) keep each depth's
    nodes best first. In the order of their leaves, an EAGLE tree's runner-up at depth 1 (a leaf numbered
    before the chain's deeper ones) became a union's first node, which a batched round cut to one node kept."""
    if not draft.is_tree and draft.chain_ends is None:
        return [draft] if len(draft) else []
    parents = draft.parents.tolist()
    paths = [root_path(parents, e) for e in draft.chain_ends.tolist()] if draft.chain_ends is not None else \
        sorted(root_path(parents, n) for n, kids in enumerate(children(parents)[1:]) if not kids)
    out = []
    for path in paths:
        idx = torch.tensor(path, dtype=torch.long)
        out.append(Draft(draft.tokens[idx], q=None if draft.q is None else draft.q[idx.to(draft.q.device)]))
    return out


def sample_chains(first: torch.Tensor, K: int, L: int, feed, sampling, generator=None, keep_going=None) -> Draft:
    """K i.i.d. chains of up to L tokens from one drafter (SpecTr's setting), as a merged tree with
    ``chain_ends``.

    first: the drafter's logits [V] after the context. feed(tokens, parents): run the drafter on the
    new nodes ``tokens`` = the last len(tokens) entries of the fed tree ``parents`` (this module's
    convention, -1 = after the context) and return their logits [len(tokens), V]. Chains sharing a prefix
    share its forward (each depth feeds only the new distinct nodes), and every chain draws its next
    token independently from its node's distribution. A length controller (``keep_going``) is asked
    once per depth with the first chain's distribution; all chains stop together.
    """
    from .sampling import choose_token
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}
    at = [-1] * K  # each chain's current node
    rows = first.unsqueeze(0).expand(K, -1)  # each chain's next-token logits
    toks: list[list[int]] = [[] for _ in range(K)]
    dists: list[list[torch.Tensor]] = [[] for _ in range(K)]
    for i in range(L):
        if i > 0:
            if keep_going is not None and not keep_going(i, dists[0][-1]):
                break
            new = []
            for k in range(K):  # each chain's last token, once per distinct node
                key = (at[k], toks[k][-1])
                if key not in index:
                    index[key] = len(parents)
                    parents.append(at[k])
                    new.append(key[1])
                at[k] = index[key]
            logits = feed(new, parents)
            rows = logits[torch.tensor(at) - (len(parents) - len(new))]  # every at[k] is one of the new nodes
        tok, dist = choose_token(rows, sampling, generator)  # K independent draws
        for k in range(K):
            toks[k].append(int(tok[k]))
            dists[k].append(dist[k])
    return merge_chains([Draft(torch.tensor(t), q=torch.stack(d)) for t, d in zip(toks, dists)], iid=True)


@dataclass
class _Node:
    token: int
    parent: int  # creation id of the parent, -1 = root
    depth: int
    q: torch.Tensor | None


def merge_chains(chains: list[Draft], max_nodes: int | None = None, iid: bool = False) -> Draft:
    """Merge chain drafts into one prefix tree (a Draft with ``parents``).

    Nodes are numbered breadth-first (depth, then the order the chains are given), so siblings are
    tried in chain order and one chain gives back itself. Two nodes with the same parent and token are
    merged only when that keeps verification exact:
      * ``iid=False`` (recursive rejection sampling over siblings): only deterministic nodes (chains
        without ``q``) merge. A sampled node is an independent draw that the sampler must test on its
        own even when its token repeats a sibling's (skipping that test changes the residual), so it
        keeps its own branch.
      * ``iid=True``: the chains are i.i.d. samples of one drafter (SpecTr); everything with a shared
        prefix merges and ``chain_ends`` records each chain for k-Seq. Every chain needs ``q``.
    Greedy verification ignores ``q``: callers in greedy mode may drop it to merge everything.
    max_nodes: keep the first ``max_nodes`` nodes breadth-first (shallow nodes first: a kept node's
    ancestors are kept); not with ``iid`` (cutting chains by how much they overlap would make their
    lengths depend on their tokens, which k-Seq's guarantee does not allow).
    Empty chains are skipped. With some chains sampled and some not, deterministic nodes get one-hot
    q rows.
    """
    if iid and max_nodes is not None:
        raise ValueError("merge_chains: max_nodes cannot truncate i.i.d. chains (k-Seq needs whole chains)")
    chains = [c for c in chains if len(c)]
    vocab = next((c.q.shape[-1] for c in chains if c.q is not None), None)
    if iid and any(c.q is None for c in chains):
        raise ValueError("merge_chains: i.i.d. chains need their draft distributions q")
    nodes: list[_Node] = []
    index: dict[tuple[int, int], int] = {}
    ends: list[int] = []
    for c in chains:
        parent = -1
        toks = c.tokens.tolist()
        for i, tok in enumerate(toks):
            row = None if c.q is None else c.q[i]
            key = (parent, tok)
            hit = index.get(key)
            if hit is not None and (iid or (row is None and nodes[hit].q is None)):
                parent = hit
                continue
            nodes.append(_Node(tok, parent, i + 1, row))
            parent = len(nodes) - 1
            if iid or row is None:
                index.setdefault(key, parent)
        ends.append(parent)
    order = sorted(range(len(nodes)), key=lambda k: (nodes[k].depth, k))
    if max_nodes is not None:
        order = order[:max(0, int(max_nodes))]
    new = {old: i for i, old in enumerate(order)}
    tokens = torch.tensor([nodes[k].token for k in order], dtype=torch.long)
    parents = torch.tensor([-1 if nodes[k].parent < 0 else new[nodes[k].parent] for k in order], dtype=torch.long)
    q = None
    if vocab is not None and order:
        ref = next(c.q for c in chains if c.q is not None)
        q = torch.stack([nodes[k].q.to(ref.device, ref.dtype) if nodes[k].q is not None
                         else torch.nn.functional.one_hot(torch.tensor(nodes[k].token), vocab).to(ref.device, ref.dtype)
                         for k in order])
    chain_ends = torch.tensor([new[e] for e in ends], dtype=torch.long) if iid else None
    return Draft(tokens, q=q, parents=parents, chain_ends=chain_ends)
