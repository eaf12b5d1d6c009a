"""scripts/bench_tree_values.py: a tree's nodes marked against the target's greedy text, the tokens a round a node
budget keeps, re-ranking that keeps every prefix a tree, and, end to end on a tiny target, marks that accept exactly
what the engine's own verification of the whole tree accepted."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from decode.choose.arms.eagle import EagleArm
from decode.choose.arms.eagle.tree import EagleTreeArm
from decode.choose.heads import EagleHead
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.verify import Verifier
from decode.engine.loop import SpecEngine
from helpers import tiny_llama, train_eagle_briefly

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_tree_values", REPO / "scripts" / "bench_tree_values.py")
bench = sys.modules["bench_tree_values"] = importlib.util.module_from_spec(_spec)  # its dataclass looks itself up
_spec.loader.exec_module(bench)
GREEDY = SamplingConfig()

# root children 5 (on the path) and 6; 5's children 7 (on the path) and 8; 7's child 9 (on the path)
TOKENS, PARENTS, VALUES = [5, 6, 7, 8, 9], [-1, -1, 0, 0, 2], [0.6, 0.3, 0.3, 0.2, 0.15]


def _round(greedy=(5, 7, 9), prompt=0):
    return bench.mark(prompt, TOKENS, PARENTS, VALUES, list(greedy))


def test_marks_depth_rank_confidence_and_path():
    r = _round()
    assert r.depth == [1, 1, 2, 2, 3]
    assert r.rank == [0, 1, 0, 1, 0]
    assert r.on_path == [True, False, True, False, True]
    assert [r.confidence(i) for i in range(5)] == pytest.approx([0.6, 0.3, 0.5, 1 / 3, 0.5])
    # the text ends after two tokens: the third node cannot be on it; a wrong first token takes the whole path
    assert _round(greedy=(5, 7)).on_path == [True, False, True, False, False]
    assert _round(greedy=(6, 7, 9)).on_path == [False, True, False, False, False]


def test_accepted_depth_needs_every_ancestor_kept():
    r = _round()
    order = list(range(5))
    assert [bench.accepted_depth(r, order, n) for n in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]
    assert bench.accepted_depth(r, [0, 4, 1], 3) == 1  # node 4 kept without its parent 2: not reachable
    assert bench.tokens_per_round([r, _round(greedy=(6, 1, 1))], [1, 3, 5]) == {1: 1.5, 3: 2.5, 5: 3.0}


def test_mark_refuses_a_parent_after_its_child():
    with pytest.raises(ValueError, match="topological"):
        bench.mark(0, [1, 2], [1, -1], [0.5, 0.5], [1, 2])


def test_reranking_keeps_every_prefix_a_tree():
    g = torch.Generator().manual_seed(0)
    parents = [-1, -1, -1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(3, 30)]
    values = []
    for p in parents:
        values.append(float(torch.rand(1, generator=g)) * (1.0 if p < 0 else values[p]))
    r = bench.mark(0, list(range(30)), parents, values, [0])
    estimate = lambda r, i: float(torch.rand(1, generator=g))  # noqa: E731 any factor in [0, 1]
    order = bench.reranked(r, estimate)
    assert sorted(order) == list(range(30))
    for n in range(1, 31):
        kept = set(order[:n])
        assert all(parents[i] < 0 or parents[i] in kept for i in kept)


def test_fit_acceptance_learns_what_the_rounds_did():
    rounds = [_round()] * 20 + [_round(greedy=(6, 1, 1))] * 20
    estimate = bench.fit_acceptance(rounds, prior=1.0)
    r = rounds[0]
    # root children: 5 on the path in half the rounds, 6 in the other half; node 2 whenever its parent was
    assert estimate(r, 0) == pytest.approx((20 + 0.6) / 41)
    assert estimate(r, 1) == pytest.approx((20 + 0.3) / 41)
    assert estimate(r, 2) == pytest.approx((20 + 0.5) / 21)


@pytest.fixture(scope="module")
def tiny(one_thread):
    model = tiny_llama(layers=2, seed=5, peaked=3.0)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, train_eagle_briefly(model, EagleHead(model))


def _engine(model, head, arm_cls=EagleTreeArm, **kw):
    target = Target(model, want_hidden=True, cache="prefix")
    arm = arm_cls(head, model, GREEDY, target=target, cache="prefix", **kw)
    return SpecEngine(target, [arm], Verifier(GREEDY), step_time=1.0)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 64, (6 + i,), generator=g).tolist() for i in range(3)]


def test_collect_marks_accept_what_the_engine_verified(tiny, monkeypatch):
    model, head = tiny
    engine = _engine(model, head, L=3, nodes=9, topk=3, expand=1)
    rounds = bench.collect(engine, _prompts(), 24, progress=False)
    assert rounds and all(len(r.tokens) == len(r.values) for r in rounds)
    assert all(r.values == sorted(r.values, reverse=True) for r in rounds)  # the draft's order is the value order
    full = [bench.accepted_depth(r, list(range(len(r.tokens))), len(r.tokens)) for r in rounds]
    assert sum(full) > len(rounds) // 2  # the trained head's trees are accepted: the check below has teeth
    by_budget = bench.tokens_per_round(rounds, [1, 3, 9])
    assert by_budget[1] <= by_budget[3] <= by_budget[9] == pytest.approx(1 + sum(full) / len(rounds))
    # marks read one token off against the text: collect's own check against the engine fails
    real = bench.mark
    monkeypatch.setattr(bench, "mark", lambda k, t, p, v, greedy: real(k, t, p, v, greedy[1:]))
    with pytest.raises(RuntimeError, match="engine's verification accepted"):
        bench.collect(_engine(model, head, L=3, nodes=9, topk=3, expand=1), _prompts(), 24, progress=False)


def test_collect_refuses_an_arm_that_is_not_a_dynamic_tree(tiny):
    model, head = tiny
    with pytest.raises(RuntimeError, match="not a dynamic tree"):
        bench.collect(_engine(model, head, arm_cls=EagleArm, L=3), _prompts()[:1], 8, progress=False)
