"""Tree drafts from an EAGLE head (ALGORITHMS.md §7): EAGLE-2 dynamic trees, and K i.i.d. sampled
chains (SpecTr's setting). Specs (built by the ``eagle`` arm's factory, decode/choose/arms/eagle/__init__.py):
``eagle:path=HEAD,tree=dynamic,L=4,nodes=16,topk=4`` or ``eagle:path=HEAD,L=4,K=4``.

Dynamic tree (EAGLE-2): the tree grows layer by layer; a node's value is the product of the head's
confidences along its path; at each depth the ``expand`` (default ``topk``) most valuable nodes of the newest
layer are expanded (fed to the head in one forward with a tree attention mask, decode/core/tree.py
``tree_attention``) into their ``topk`` most likely children; finally the ``nodes`` most valuable
nodes are kept (a child is never worth more than its parent, so a kept node's ancestors are kept) and
numbered by value, best first: every prefix of the draft is then the tree of its most valuable nodes, so a
batched round that cuts it to K positions keeps its K best (decode/engine/batch.py; siblings stay in value order,
which the verifier tries them in).
``expand=1`` (a deviation from EAGLE-2, which expands ``topk``) is the greedy chain with each position's
``topk - 1`` runner-up tokens as leaves: one head row per depth, so it drafts at the chain's cost, and the
runner-ups cover a first-position miss (the chain's most frequent loss) for the price of verifying them.
Children are deterministic top-k choices, so the draft is one-hot (``q`` None) and verification is
exact in sampling mode too (recursive rejection sampling with one-hot q).

Everything else (true features, the head cache holding only true entries) is the chain arm's
(decode/choose/arms/eagle/chain.py); the tree's head-cache entries are cropped after drafting like the chain's.
Length controllers do not shape the dynamic tree, except the cost controller (``--length cost``), which cuts the
kept nodes to the budget that pays most on the verification curve (``keep_going.node_budget``,
decode/choose/length.py ``CostAware``) and stops the growth before a head forward no kept node could pay for
(``keep_going.deeper``); depth L and ``nodes`` (the most it may keep) are the knobs. K chains:
decode/core/tree.py ``sample_chains``, one head forward per depth.
EAGLE-3 (fused) heads need nothing else: tree nodes feed the head's recurrent output back exactly as they feed
an EAGLE-1 head's predicted feature (tests/test_eagle3.py).
"""
from __future__ import annotations

import time

import torch

from ....core.draft import Draft
from ....core.sampling import probs
from ....core.target import check_tree_support
from ....core.tree import sample_chains, tree_attention
from .chain import EagleArm


class _EagleTreeBase(EagleArm):
    """What both tree sources add to the chain arm: head forwards over tree nodes (the first, true step is
    the chain arm's ``_true_step``)."""

    name = "eagle_tree"

    def __init__(self, head, target_model, sampling, L: int = 4, **kw):
        super().__init__(head, target_model, sampling, L, **kw)
        check_tree_support(self.head.model.config)
        self.greedy_counterfactual = False  # a tree is not one chain a verified path can score

    def _step_tree(self, feats: torch.Tensor, tokens: list[int], parents: list[int], prefix: int) -> torch.Tensor:
        """Feed the last len(tokens) nodes of the fed tree ``parents`` on top of ``prefix`` true entries."""
        n = len(tokens)
        self.cache.reserve(n)
        pos, mask = tree_attention(torch.tensor(parents), prefix, self.cache.key_length(n), self.cache.dtype,
                                   self.device, queries=n)
        x = torch.tensor([tokens], device=self.device)
        pred = self.head(feats.unsqueeze(0), x, past_key_values=self.cache.hf, attention_mask=mask, use_cache=True,
                         position_ids=pos)
        self.cache.advance(n)
        return pred[0]


class EagleTreeArm(_EagleTreeBase):
    """EAGLE-2's dynamic tree (see the module docstring)."""

    def __init__(self, head, target_model, sampling, L: int = 4, nodes: int = 16, topk: int = 4,
                 expand: int | None = None, **kw):
        super().__init__(head, target_model, sampling, L, **kw)
        self.nodes, self.topk = int(nodes), int(topk)
        self.expand = self.topk if expand is None else int(expand)
        self._step_seconds: float | None = None  # the last head forward over tree nodes (what one more depth costs)

    @property
    def label(self) -> str:
        wide = "" if self.expand == self.topk else f"/expand{self.expand}"
        return self._label or f"eagle_tree@{self.L}x{self.topk}{wide}/{self.nodes}nodes"

    @property
    def max_nodes(self) -> int:
        return self.nodes

    def _confidence(self, feats: torch.Tensor) -> torch.Tensor:
        """The head's distribution over target ids after the shared logits processing ([n, V])."""
        return probs(self.head.draft_logits(feats).float(), self.sampling)

    @property
    def width(self) -> int:
        """Nodes a depth of an ``expand=1`` tree holds (the chain's and its runner-ups): a batched round's cost model
        counts such a tree as that many chains (decode/engine/batch.py ``_draft_lengths``)."""
        return self.topk if self.expand == 1 else 1

    def chain_tree(self) -> "ChainTree | None":
        """A tree to grow along the greedy chain, one head distribution per depth, where the tree is one (``expand=1``):
        how a batched engine's drafter drafts it (decode/choose/arms/batched.py); None otherwise."""
        return ChainTree(self.topk, self.nodes) if self.expand == 1 else None

    @property
    def batch_key(self):
        """``expand=1`` trees draft in batched rounds like chains (one head row per depth: :meth:`chain_tree`)."""
        return ("eagle", id(self.head)) if self.expand == 1 else None

    @torch.inference_mode()
    def propose(self, context, max_len, keep_going=None) -> Draft:
        """The tree's top ``nodes`` nodes by value; with a controller that budgets nodes (``--length cost``:
        ``keep_going.node_budget``) the best prefix of them on the device's verification curve."""
        t0 = time.perf_counter()
        L, f = self._start(context, max_len)  # predicted feature after the context (the chain arm's first step)
        if f is None:
            return Draft.empty()
        prefix = self.cache.length
        tree = TreeNodes()
        fed: list[int] = []  # nodes fed to the head, in feed order; their parents among fed nodes:
        fed_par: list[int] = []
        out_feat: dict[int, torch.Tensor] = {}  # fed node -> the head's predicted feature after it
        layer = list(tree.add_children(-1, self._confidence(f.unsqueeze(0))[0], self.topk))
        deeper = getattr(keep_going, "deeper", None)
        for depth in range(1, L):
            expand = sorted(layer, key=lambda n: -tree.val[n])[:self.expand]
            if not expand:
                break
            if deeper is not None and self._step_seconds is not None and not deeper(
                    [tree.val[n] for n in tree.ranked(self.nodes)], time.perf_counter() - t0, self._step_seconds,
                    tree.val[expand[0]], len(expand) * self.topk, L - depth, self.nodes):
                break  # no node a further forward could add would pay on the verification curve
            t_step = time.perf_counter()
            slot = {n: i for i, n in enumerate(fed)}
            feats = torch.stack([f if tree.par[n] < 0 else out_feat[tree.par[n]] for n in expand])
            fed_par += [-1 if tree.par[n] < 0 else slot[tree.par[n]] for n in expand]
            fed += expand
            pred = self._step_tree(feats, [tree.tok[n] for n in expand], fed_par, prefix)
            dists = self._confidence(pred)
            self._step_seconds = time.perf_counter() - t_step
            layer = []
            for n, feat, dist in zip(expand, pred, dists):
                out_feat[n] = feat
                layer += tree.add_children(n, dist, self.topk)
        self.cache.crop(self.entries)  # drop the tree's entries (built from predicted features)
        keep = tree.ranked(self.nodes)
        budget = getattr(keep_going, "node_budget", None)
        if budget is not None and keep:  # a prefix of the ranking is a tree (a child never outranks its parent)
            keep = keep[:budget([tree.val[n] for n in keep], time.perf_counter() - t0)]
        return tree.draft(keep)


class TreeNodes:
    """Every node a dynamic tree made: its token, parent (-1: a root child), value (the product of the head's
    confidences along its path)."""

    def __init__(self):
        self.tok: list[int] = []
        self.par: list[int] = []
        self.val: list[float] = []

    def add_children(self, parent: int, dist: torch.Tensor, topk: int) -> range:
        """The ``topk`` most likely tokens of ``dist`` as children of ``parent``; returns the new nodes."""
        top = torch.topk(dist, min(topk, dist.shape[-1]))
        base = 1.0 if parent < 0 else self.val[parent]
        first = len(self.tok)
        for p, t in zip(top.values.tolist(), top.indices.tolist()):
            if p > 0:  # a token the processed distribution excludes (top-k/top-p) is never drafted
                self.tok.append(t)
                self.par.append(parent)
                self.val.append(base * p)
        return range(first, len(self.tok))

    def ranked(self, nodes: int) -> list[int]:
        """The ``nodes`` most valuable nodes, best first (a prefix of the ranking is a tree)."""
        return sorted(range(len(self.tok)), key=lambda n: (-self.val[n], n))[:nodes]

    def draft(self, keep: list[int]) -> Draft:
        """The nodes ``keep`` (a prefix of :meth:`ranked`) as a draft in that order: by value, best first (a
        topological order, as a draft's must be)."""
        new = {n: i for i, n in enumerate(keep)}
        return Draft(torch.tensor([self.tok[n] for n in keep], dtype=torch.long),
                     parents=torch.tensor([-1 if self.par[n] < 0 else new[self.par[n]] for n in keep],
                                          dtype=torch.long))


class ChainTree:
    """An ``expand=1`` dynamic tree grown one depth at a time from the head's distributions along its greedy chain
    (``grow``: the chain's next token, to feed the head), then cut to its ``nodes`` most valuable nodes: the draft
    :meth:`EagleTreeArm.propose` makes for the same distributions (the one node it expands per depth is the newest
    layer's most valuable, the chain's next token)."""

    def __init__(self, topk: int, nodes: int):
        self.topk, self.nodes = topk, nodes
        self.tree = TreeNodes()
        self.parent = -1

    def grow(self, dist: torch.Tensor) -> int:
        """Add the children of the chain's last node from its distribution ``dist``; returns the chain's next token."""
        new = self.tree.add_children(self.parent, dist, self.topk)
        self.parent = min(new, key=lambda n: (-self.tree.val[n], n))
        return self.tree.tok[self.parent]

    def draft(self) -> Draft:
        return self.tree.draft(self.tree.ranked(self.nodes))


class EagleChainsArm(_EagleTreeBase):
    """K i.i.d. sampled chains from the head, verified with k-Seq (SpecTr)."""

    def __init__(self, head, target_model, sampling, L: int = 4, K: int = 4, **kw):
        super().__init__(head, target_model, sampling, L, **kw)
        self.K = int(K)

    @property
    def label(self) -> str:
        return self._label or f"eagle_tree@{self.L}x{self.K}chains"

    @property
    def max_nodes(self) -> int:
        return self.K * self.L

    @torch.inference_mode()
    def propose(self, context, max_len, keep_going=None) -> Draft:
        L, root = self._start(context, max_len)
        if root is None:
            return Draft.empty()
        prefix = self.cache.length
        out_feat: list[torch.Tensor] = []  # fed node -> the head's predicted feature after it

        def feed(ids, parents):
            new = parents[len(parents) - len(ids):]
            pred = self._step_tree(torch.stack([root if p < 0 else out_feat[p] for p in new]), ids, parents, prefix)
            out_feat.extend(pred)
            return self.head.draft_logits(pred).float()

        draft = sample_chains(self.head.draft_logits(root).float(), self.K, L, feed, self.sampling, self.generator,
                              keep_going)
        self.cache.crop(self.entries)  # drop the tree's entries (built from predicted features)
        return draft
