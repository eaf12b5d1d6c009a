"""What an EAGLE head's tree buys per round, without a clock: tokens a round at each node budget, and whether the
head's confidences are what its nodes' acceptance is (issue 31).

    .venv/bin/python scripts/bench_tree_values.py [--head pretrained/smollm2-135m-instruct/eagle] [--limit 2]
        [--max-new-tokens 96] [--L 7] [--topk 6] [--budgets 1,2,4,6,8,11,12,16,24] [--out FILE.json]

The head drafts its whole ``expand=1`` tree every round (its greedy chain to depth ``--L`` and each depth's
``--topk - 1`` runner-ups; nothing cut) while the engine decodes the suite (default Spec-Bench dev, ``--limit``
prompts per category) greedily, so its output is the target's greedy text and every drafted node is known to lie
on the target's greedy path or not. Printed:

* tokens a round at node budget n: the mean over rounds of 1 + the accepted depth of the tree cut to its n most
  valuable nodes (EAGLE-2's value, the product of the head's confidences along the path: what the shipped pool's
  trees keep). That is the MAT a pool of this head alone would make at a fixed n, whatever the machine; the cost
  controller picks n per round from the machine's verification curve. Rounds start where the whole tree's rounds
  started, after more accepted tokens than a cut tree's would, so the small budgets read slightly high;
* the same with the nodes re-ranked by the acceptance measured on the other half of the prompts (2-fold by prompt)
  for their depth, sibling rank and confidence decile: whether ranking by the head's own value leaves tokens behind;
* per depth and sibling rank: the nodes whose parent lay on the path, the share of them on it, and their mean
  confidence (a calibrated head has the two equal).

Timing plays no part, so it may run beside other work; it takes the decode of the suite with a tree of
``L × topk`` nodes a round (~3 minutes for dev 13 × 2 on a 2-core CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from decode.choose.length import LengthController  # noqa: E402
from decode.core.tree import root_path  # noqa: E402

CONFIDENCE_BINS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # upper edges; the last decile to 1


@dataclass
class TreeRound:
    """One round's whole tree, its nodes in the head's value order: token, parent (-1: a root child), value (the
    product of confidences along the path), and what the target's greedy text made of it."""
    prompt: int  # index of the prompt (the cross-validation folds split by prompt)
    tokens: list[int]
    parents: list[int]
    values: list[float]
    depth: list[int]  # 1 = a root child
    rank: list[int]  # among its siblings, by value (0 = the best)
    on_path: list[bool]  # the node and its ancestors are the target's next greedy tokens

    def confidence(self, i: int) -> float:
        """The head's probability of node i given its parent (its value over its parent's)."""
        p = self.parents[i]
        return self.values[i] if p < 0 else self.values[i] / self.values[p]


def mark(prompt: int, tokens: list[int], parents: list[int], values: list[float], greedy: list[int]) -> TreeRound:
    """A tree drafted after some context, against ``greedy``: the target's greedy tokens that followed it."""
    depth, rank, on = [], [], []
    children: dict[int, int] = defaultdict(int)
    for i, (t, p) in enumerate(zip(tokens, parents, strict=True)):
        if p >= i:
            raise ValueError(f"node {i}'s parent {p} does not come before it (a draft is in topological order)")
        d = 1 if p < 0 else depth[p] + 1
        depth.append(d)
        rank.append(children[p])
        children[p] += 1
        on.append((p < 0 or on[p]) and d <= len(greedy) and greedy[d - 1] == t)
    return TreeRound(prompt, list(tokens), list(parents), list(values), depth, rank, on)


def accepted_depth(r: TreeRound, order: list[int], n: int) -> int:
    """Greedy verification of the tree cut to the first ``n`` nodes of ``order``: the deepest on-path node whose
    ancestors were all kept."""
    kept = set(order[:n])
    return max((r.depth[i] for i in kept if r.on_path[i] and kept.issuperset(root_path(r.parents, i))), default=0)


def _cell(r: TreeRound, i: int) -> tuple[int, int, int]:
    q = r.confidence(i)
    return min(r.depth[i], 6), min(r.rank[i], 3), sum(q > edge for edge in CONFIDENCE_BINS)


def fit_acceptance(rounds: list[TreeRound], prior: float = 4.0):
    """P(node on the path | its parent on it) per (depth, sibling rank, confidence decile), shrunk towards the
    node's own confidence with ``prior`` pseudo-observations; returns node -> that estimate."""
    seen: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rounds:
        for i, p in enumerate(r.parents):
            if p < 0 or r.on_path[p]:
                c = seen[_cell(r, i)]
                c[0] += 1
                c[1] += r.on_path[i]

    def estimate(r: TreeRound, i: int) -> float:
        n, hits = seen.get(_cell(r, i), (0.0, 0.0))
        return (hits + prior * r.confidence(i)) / (n + prior)
    return estimate


def reranked(r: TreeRound, estimate) -> list[int]:
    """The nodes ordered by the product of ``estimate`` along their paths (each factor ≤ 1, so every prefix of the
    order is a tree)."""
    score: list[float] = []
    for i, p in enumerate(r.parents):
        score.append(estimate(r, i) * (1.0 if p < 0 else score[p]))
    return sorted(range(len(score)), key=lambda i: (-score[i], i))


def tokens_per_round(rounds: list[TreeRound], budgets: list[int], estimate=None) -> dict[int, float]:
    """Mean of 1 + accepted depth over ``rounds`` at each node budget; nodes in the head's value order, or re-ranked
    by ``estimate``."""
    orders = [list(range(len(r.tokens))) if estimate is None else reranked(r, estimate) for r in rounds]
    return {n: sum(1 + accepted_depth(r, order, n) for r, order in zip(rounds, orders)) / len(rounds)
            if rounds else float("nan") for n in budgets}


def cross_validated(rounds: list[TreeRound], budgets: list[int]) -> dict[int, float]:
    """:func:`tokens_per_round` re-ranked, each half of the prompts by the acceptance fitted on the other half."""
    folds = [[r for r in rounds if r.prompt % 2 == k] for k in (0, 1)]
    total = {n: 0.0 for n in budgets}
    for k in (0, 1):
        got = tokens_per_round(folds[k], budgets, fit_acceptance(folds[1 - k]))
        for n in budgets:
            total[n] += got[n] * len(folds[k])
    return {n: total[n] / len(rounds) for n in budgets}


def calibration(rounds: list[TreeRound]) -> list[dict]:
    """Per depth and sibling rank (rank ≥ 2 pooled): nodes whose parent lay on the path, the share on it, the mean
    confidence."""
    cells: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for r in rounds:
        for i, p in enumerate(r.parents):
            if p < 0 or r.on_path[p]:
                c = cells[(r.depth[i], min(r.rank[i], 2))]
                c[0] += 1
                c[1] += r.on_path[i]
                c[2] += r.confidence(i)
    return [{"depth": d, "rank": k, "nodes": n, "on_path": hits / n, "confidence": q / n}
            for (d, k), (n, hits, q) in sorted(cells.items())]


class KeepWholeTree(LengthController):
    """Draft every depth and keep every node; remembers the kept nodes' values, which the tree arm hands to a
    controller's node budget (decode/choose/arms/eagle/tree.py) in its draft's order."""

    def _init_state(self):
        self.values: list[float] | None = None

    def keep_going(self, arm=0, *, max_len=None, context=0):
        self.values = None

        def go(i, row=None, hidden=None):
            return True

        def budget(values, draft_seconds):
            self.values = list(values)
            return len(values)
        go.node_budget = budget
        return go


def collect(engine, prompts: list[list[int]], max_new_tokens: int, progress: bool = True) -> list[TreeRound]:
    """Decode ``prompts`` with the engine's one tree arm, its whole tree kept, and mark every round's tree against
    the output (the target's greedy text: the engine is lossless); each round's marks must accept what the engine's
    verification of that whole tree accepted."""
    from tqdm.auto import tqdm

    from decode.choose.policies.simple import Fixed

    rounds = []
    keep = KeepWholeTree()
    for k, ids in enumerate(tqdm(prompts, desc="prompts", disable=not progress)):
        state = engine.begin(ids, Fixed(1, engine.max_len), max_new_tokens, keep)
        drafted = []
        while not state.done:
            start = len(state.ctx)
            res = engine.step(state)
            if len(res.draft):
                if keep.values is None or len(keep.values) != len(res.draft):
                    raise RuntimeError("the arm did not hand its node values to the controller: not a dynamic tree?")
                parents = res.draft.parents.tolist() if res.draft.is_tree else list(range(-1, len(res.draft) - 1))
                drafted.append((start, res.draft.tokens.tolist(), parents, keep.values, res.record.accepted))
        text = list(ids) + list(engine.finish(state).tokens)
        for start, tokens, parents, values, accepted in drafted:
            r = mark(k, tokens, parents, values, text[start:])
            got = accepted_depth(r, list(range(len(tokens))), len(tokens))
            if got != accepted:  # the engine verified the whole tree
                raise RuntimeError(f"prompt {k}: a round's tree, marked against the output, accepts {got} tokens "
                                   f"where the engine's verification accepted {accepted}")
            rounds.append(r)
    return rounds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--head", default=str(REPO / "pretrained/smollm2-135m-instruct/eagle"))
    ap.add_argument("--suite", default=str(REPO.parent / "shared/data/spec_bench/question_dev.jsonl"))
    ap.add_argument("--limit", type=int, default=2, help="prompts per category (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--L", type=int, default=7, help="tree depth (default %(default)s)")
    ap.add_argument("--topk", type=int, default=6, help="tokens a depth (default %(default)s)")
    ap.add_argument("--expand", type=int, default=1,
                    help="nodes a depth expanded (1: the greedy chain and its runner-ups, as the shipped pool drafts; "
                         "EAGLE-2 expands topk)")
    ap.add_argument("--budgets", default="1,2,4,6,8,11,12,16,24", help="node budgets to score")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", help="also write the figures as JSON here")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from decode.core.models import load_model
    from decode.core.sampling import SamplingConfig
    from decode.engine.loop import build_engine
    from decode.evaluation.suites import encode_prompt, load_jsonl_suite, select

    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = sorted({int(b) for b in args.budgets.split(",")})
    if budgets[0] < 1:
        raise SystemExit(f"--budgets: node budgets are >= 1, got {budgets[0]}")
    model, tok = load_model(args.target)
    suite = select(load_jsonl_suite(args.suite), None, args.limit)
    nodes = args.topk + (args.L - 1) * args.expand * args.topk  # every node the tree can grow
    spec = f"eagle:path={args.head},L={args.L},tree=dynamic,topk={args.topk},expand={args.expand},nodes={nodes}"
    engine = build_engine(model, tok, [spec], SamplingConfig(), torch.Generator(), cache="prefix", linear="stock",
                          target_name=args.target)
    rounds = collect(engine, [encode_prompt(tok, p.text) for p in suite], args.max_new_tokens,
                     progress=not args.no_progress)
    by_value, by_fit = tokens_per_round(rounds, budgets), cross_validated(rounds, budgets)
    table = calibration(rounds)
    print(f"{len(suite)} prompts, {args.max_new_tokens} tokens, {len(rounds)} rounds; tree {spec}")
    print(f"{'nodes':>5}  {'tokens/round by value':>22}  {'re-ranked by acceptance (2-fold)':>33}")
    for n in budgets:
        print(f"{n:>5}  {by_value[n]:>22.3f}  {by_fit[n]:>33.3f}")
    print(f"\n{'depth':>5} {'rank':>5} {'nodes':>6} {'on path':>8} {'confidence':>11}")
    for c in table:
        rank = f"{c['rank']}+" if c["rank"] == 2 else str(c["rank"])
        print(f"{c['depth']:>5} {rank:>5} {c['nodes']:>6} {c['on_path']:>8.3f} {c['confidence']:>11.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "head": args.head, "suite": args.suite, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
            "tree": spec, "rounds": len(rounds), "tokens_per_round": by_value, "reranked_2fold": by_fit,
            "calibration": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
