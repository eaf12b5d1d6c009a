"""Tree sources: the union arm (several arms' chains as one prefix tree) and the drafter's K i.i.d.
sampled chains (SpecTr), alone and through the engine (greedy equality, sampling law)."""
import numpy as np
import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.eagle import EagleArm
from decode.choose.arms.eagle.tree import EagleChainsArm, EagleTreeArm, TreeNodes
from decode.choose.arms.model import DrafterModelArm
from decode.choose.arms.union import UnionArm, sub_specs
from decode.engine.loop import SpecEngine
from decode.common.errors import UserError
from decode.choose.heads import EagleHead
from decode.choose.policies import build_policy
from decode.core.sampling import SamplingConfig, probs
from decode.common.specs import split_specs
from decode.core.target import Target
from decode.core.draft import Draft
from decode.core.tree import children, leaf_chains, merge_chains
from decode.core.verify import Verifier
from helpers import TinyTokenizer, plain_greedy, tiny_llama

GREEDY = SamplingConfig()
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9, 3, 7, 9], [5]]


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def _env(model, cfg=GREEDY, target=None, cache="dynamic"):
    return ArmEnv(model, TinyTokenizer(64), cfg, target=target, cache=cache)


# --------------------------------------------------------------------------------------------- union

def test_union_spec_syntax_and_errors():
    assert sub_specs("pld:L=2:n=3+suffix") == ["pld:L=2,n=3", "suffix"]
    assert split_specs("union:arms=pld:L=2+suffix:L=3,nodes=8 pld:L=4") == [
        "union:arms=pld:L=2+suffix:L=3,nodes=8", "pld:L=4"]
    env = _env(tiny_llama())
    arm = build_arm("union:arms=pld:L=2:n=3+suffix:L=3,nodes=8", env)
    assert isinstance(arm, UnionArm) and arm.L == 3 and arm.max_nodes == 8
    assert arm.arms[0].max_ngram == 3 and arm.label == "union[pld@2+suffix@3]@8nodes"
    for bad, msg in [("union:arms=pld+union:arms=pld", "another union"), ("union:arms=+pld", "empty arm"),
                     ("union:arms=pld:L=x", "L must be an integer"), ("union:arms=pld,nodes=0", "nodes must be"),
                     ("union:nodes=3", "missing required parameter 'arms'")]:
        with pytest.raises(UserError, match=msg):
            build_arm(bad, env)


def test_union_merges_its_arms_chains_into_one_tree():
    env = _env(tiny_llama())
    arm = build_arm("union:arms=pld:L=3+suffix:L=4:min_match=1,nodes=16", env)
    ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 8, 1, 2, 3]  # pld: latest "1 2 3" → 5 7 8; suffix too
    arm.reset(ctx)
    d = arm.propose(ctx, 10)
    chains = sorted(tuple(c.tokens.tolist()) for c in leaf_chains(d))
    assert chains == [(5, 7, 8, 1)]  # both arms agree: one chain, the shared prefix merged
    ctx2 = [7, 1, 2, 3, 10, 11, 12, 5, 1, 2, 3, 20, 21, 22, 7, 1, 2, 3]  # pld: 20 21 22; suffix: 10 11 12 5
    pld, suf = build_arm("pld:L=3", env), build_arm("suffix:L=4,min_match=1", env)
    want = {tuple(a.propose(ctx2, 10).tokens.tolist()) for a in (pld, suf)} - {()}
    arm.reset(ctx2)
    got = {tuple(c.tokens.tolist()) for c in leaf_chains(arm.propose(ctx2, 10))}
    assert got == want and len(got) == 2  # the two arms disagree here: two branches
    small = build_arm("union:arms=pld:L=3+suffix:L=4:min_match=1,nodes=2", env)
    small.reset(ctx2)
    assert len(small.propose(ctx2, 10)) == 2  # truncated breadth-first to the node budget


# -------------------------------------------------------------------------------------- drafter, K > 1

@pytest.mark.parametrize("kind", ["dynamic", "static", "prefix"])
def test_drafter_k_chains_carry_exact_distributions_and_leave_the_cache_clean(kind):
    dm = tiny_llama(seed=5, peaked=3.0)
    cfg = SamplingConfig(1.0)
    arm = DrafterModelArm(dm, cfg, L=3, generator=torch.Generator().manual_seed(0), cache=kind, K=4)
    ctx = [1, 2, 3, 4, 5]
    arm.reset(ctx)
    for _ in range(3):
        d = arm.propose(ctx, 3)
        assert d.chain_ends is not None and len(d.chain_ends) == 4 and len(d) <= 12
        assert arm.cache.length == len(ctx) and arm.cache_tokens == ctx  # the tree's entries are gone
        for c in leaf_chains(d):  # each chain's q rows = the drafter's own distributions along it
            assert len(c) == 3
            with torch.inference_mode():
                lg = dm(torch.tensor([ctx + c.tokens.tolist()])).logits[0, len(ctx) - 1:-1]
            torch.testing.assert_close(c.q, probs(lg, cfg), atol=1e-5, rtol=0)
        ctx = ctx + d.tokens[:2].tolist()


# ------------------------------------------------------------------------------------ through the engine

@pytest.mark.parametrize("cache", ["dynamic", "static", "prefix"])
def test_greedy_tree_arms_equal_plain_greedy(cache):
    model = tiny_llama(seed=1)
    t = Target(model, cache=cache, want_hidden=True)
    env = _env(model, target=t, cache=cache)
    head = _eagle_head(model)
    arms = [build_arm("union:arms=pld:L=3+suffix:L=5:min_match=1,nodes=6", env),
            build_arm("union:arms=pld:L=2:n=1+suffix:L=2:min_match=1+none,nodes=3", env),
            DrafterModelArm(tiny_llama(seed=2), GREEDY, 3, cache=cache, K=3),
            UnionArm([build_arm("pld:L=4", env), DrafterModelArm(model, GREEDY, 4, cache=cache)], nodes=8),
            EagleTreeArm(head, model, GREEDY, L=4, nodes=10, topk=3, target=t, cache=cache),
            EagleTreeArm(head, model, GREEDY, L=3, nodes=9, topk=3, expand=1, target=t, cache=cache),
            build_arm("union:arms=pld:L=3:n=1:K=3+suffix:L=4:min_match=1,nodes=9", env),
            EagleChainsArm(head, model, GREEDY, L=3, K=2, target=t, cache=cache)]
    eng = SpecEngine(t, arms, Verifier(GREEDY))
    trees = 0
    for arm in range(len(arms)):
        for prompt in PROMPTS:
            ref = plain_greedy(model, prompt, 30)
            gen = eng.generate(prompt, build_policy(f"fixed:arm={arm}", len(arms), eng.max_len), 30)
            assert gen.tokens == ref, (arms[arm].label, prompt)
            assert sum(r.new_tokens for r in gen.rounds) == 30
            trees += sum(r.drafted > r.max_len for r in gen.rounds)  # more nodes than depth: a branching tree
    assert trees > 10
    # a perfect drafter inside a union: its branch is found every round, beside PLD's
    perfect = eng.generate(PROMPTS[1], build_policy("fixed:arm=3", len(arms), eng.max_len), 30)
    assert all(r.accepted >= 4 for r in perfect.rounds[:-1])


def test_sampled_k_chains_through_the_engine_follow_the_target():
    """First two tokens of engine.generate with a K = 3 drafter (k-Seq) against the target's exact law."""
    from scipy.stats import chisquare
    V = 6
    model, drafter = tiny_llama(vocab=V, seed=1, peaked=3.0), tiny_llama(vocab=V, seed=2, peaked=3.0)
    cfg = SamplingConfig(1.0)
    gen = torch.Generator().manual_seed(0)
    t = Target(model)
    eng = SpecEngine(t, [DrafterModelArm(drafter, cfg, 2, generator=gen, K=3)], Verifier(cfg, generator=gen),
                     step_time=1.0)
    prompt, n = [0, 2, 4], 1500
    torch.manual_seed(0)
    counts = np.zeros(V * V)
    for _ in range(n):
        toks = eng.generate(prompt, build_policy("fixed:arm=0", 1, 2), 2).tokens
        counts[toks[0] * V + toks[1]] += 1
    with torch.inference_mode():
        p1 = probs(model(torch.tensor([prompt])).logits[0, -1], cfg).double()
        law = torch.stack([p1[a] * probs(model(torch.tensor([prompt + [a]])).logits[0, -1], cfg).double()
                           for a in range(V)]).flatten().numpy()
    big = law * n >= 5  # pool the small cells (if any) so the chi-square approximation holds
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(law[big], law[~big].sum()) * n
    keep = exp > 0
    assert chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue > 1e-3


# ------------------------------------------------------------------------------------------- EAGLE-2

def _eagle_head(model):
    head = EagleHead(model, init="last_layer")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a head that is neither the identity nor the target's last layer
        for p in head.trainable_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g) * p.abs().mean())
    return head


@pytest.mark.parametrize("kind", ["dynamic", "static", "prefix"])
def test_eagle_tree_holds_the_chain_arms_draft_and_respects_its_budget(kind):
    """The tree's best-child path is the chain arm's greedy draft (so the head's tree forward — mask,
    positions, features — computes what the chain computes), at most ``nodes`` nodes, and the head cache
    keeps only true entries afterwards."""
    model = tiny_llama(layers=2, seed=4)
    head = _eagle_head(model)
    t = Target(model, want_hidden=True, cache=kind)
    chain = EagleArm(head, model, GREEDY, L=4, target=t, cache=kind)
    tree = EagleTreeArm(head, model, GREEDY, L=4, nodes=40, topk=3, target=t, cache=kind)
    small = EagleTreeArm(head, model, GREEDY, L=4, nodes=7, topk=3, target=t, cache=kind)
    ctx = [1, 2, 3, 4, 5, 6, 7]
    t.prefill(ctx)
    for a in (chain, tree, small):
        a.reset(ctx)
    want = chain.propose(ctx, 4).tokens.tolist()
    d = tree.propose(ctx, 4)
    kids, node, best = children(d.parents), -1, []
    while kids[node + 1]:
        node = kids[node + 1][0]  # siblings are numbered by value: the first is the most likely
        best.append(int(d.tokens[node]))
    assert best == want and len(d) == 3 + 3 * 3 * 3  # top-3 expansion of 3 nodes per layer, depth 4
    assert tree.cache.length == len(ctx) - 1 and d.q is None
    assert len(small.propose(ctx, 4)) == 7
    # expand=1: the same chain, each position's runner-ups as leaves, one head row per depth
    alts = EagleTreeArm(head, model, GREEDY, L=4, nodes=40, topk=3, expand=1, target=t, cache=kind)
    alts.reset(ctx)
    d = alts.propose(ctx, 4)
    kids = children(d.parents)
    inner = [n for n in range(len(d)) if kids[n + 1]]
    assert [int(d.tokens[n]) for n in inner] == want[:3] and len(d) == 4 * 3  # only the chain's nodes branch
    assert [len(kids[n + 1]) for n in [-1] + inner] == [3, 3, 3, 3] and alts.cache.length == len(ctx) - 1
    with pytest.raises(UserError, match="nodes must be"):
        build_arm("eagle:path=x,tree=dynamic,nodes=0", _env(model))


@pytest.mark.slow
def test_union_greedy_equals_hf_generate_on_the_default_target(smol):
    from decode.evaluation.suites import BUILTIN, encode_prompt
    model, tok = smol
    t = Target(model)
    env = ArmEnv(model, tok, GREEDY, target=t)
    arms = [build_arm("union:arms=pld:L=4+suffix:L=5:min_match=1,nodes=8", env)]
    eng = SpecEngine(t, arms, Verifier(GREEDY), [tok.eos_token_id])
    ids = encode_prompt(tok, BUILTIN[3].text)
    gen = eng.generate(ids, build_policy("fixed:arm=0", 1, arms[0].L), 24)
    assert gen.tokens == plain_greedy(model, ids, 24, {tok.eos_token_id})


@pytest.mark.parametrize("kind", ["dynamic", "static", "prefix"])
def test_eagle_k_chains_follow_the_head(kind):
    """Greedy: the K chains coincide with the chain arm's draft and distributions (through the tree feed);
    sampling: K chains with chain_ends, the head cache back to its true entries."""
    model = tiny_llama(layers=2, seed=4)
    head = _eagle_head(model)
    t = Target(model, want_hidden=True, cache=kind)
    ctx = [1, 2, 3, 4, 5, 6, 7]
    t.prefill(ctx)
    chain = EagleArm(head, model, GREEDY, L=4, target=t, cache=kind)
    many = EagleChainsArm(head, model, GREEDY, L=4, K=3, target=t, cache=kind)
    for a in (chain, many):
        a.reset(ctx)
    want, got = chain.propose(ctx, 4), many.propose(ctx, 4)
    assert got.tokens.tolist() == want.tokens.tolist() and got.chain_ends.tolist() == [3, 3, 3]
    torch.testing.assert_close(got.q, want.q, atol=1e-5, rtol=0)
    sampled = EagleChainsArm(head, model, SamplingConfig(1.0), L=3, K=3, target=t, cache=kind,
                             generator=torch.Generator().manual_seed(0))
    sampled.reset(ctx)
    d = sampled.propose(ctx, 3)
    assert len(d.chain_ends) == 3 and len(leaf_chains(d)) == 3 and sampled.cache.length == len(ctx) - 1


def test_eagle_spec_builds_chains_k_chains_or_the_dynamic_tree(tmp_path):
    from decode.choose.heads import save_head
    model = tiny_llama(layers=2, seed=4)
    save_head(_eagle_head(model), tmp_path / "head")
    env = _env(model)
    path = tmp_path / "head"
    assert type(build_arm(f"eagle:path={path},L=3", env)) is EagleArm
    chains = build_arm(f"eagle:path={path},L=3,K=3", env)
    assert isinstance(chains, EagleChainsArm) and chains.K == 3
    tree = build_arm(f"eagle:path={path},L=3,tree=dynamic,nodes=9,topk=2", env)
    assert isinstance(tree, EagleTreeArm) and (tree.nodes, tree.topk, tree.expand) == (9, 2, 2)
    assert build_arm(f"eagle:path={path},tree=dynamic,topk=3,expand=1", env).expand == 1
    with pytest.raises(UserError, match="add tree=dynamic"):
        build_arm(f"eagle:path={path},expand=1", env)
    with pytest.raises(UserError, match="pick one"):
        build_arm(f"eagle:path={path},K=2,tree=dynamic", env)
    with pytest.raises(UserError, match="tree must be chain"):
        build_arm(f"eagle:path={path},tree=bushy", env)


def test_dynamic_tree_nodes_are_numbered_by_value_so_every_prefix_is_the_best_tree_of_its_size():
    """A dynamic tree's draft lists its nodes best first (a child is never worth more than its parent, so the order
    is topological): cut to its first K nodes, as a batched round cuts it, it keeps its K most valuable. Numbered
    breadth-first, the first 2 of these 4 nodes were both root children, the second worth 0.1 where the chain's
    next node is worth 0.72."""
    nodes = TreeNodes()
    a, b = nodes.add_children(-1, torch.tensor([0.9, 0.1, 0.0]), topk=2)  # tokens 0 (0.9) and 1 (0.1)
    c, d = nodes.add_children(a, torch.tensor([0.0, 0.2, 0.8]), topk=2)  # tokens 2 (0.72) and 1 (0.18)
    draft = nodes.draft(nodes.ranked(4))
    assert draft.tokens.tolist() == [0, 2, 1, 1] and draft.parents.tolist() == [-1, 0, 0, -1]
    assert draft.prefix(2).tokens.tolist() == [0, 2] and not draft.prefix(2).is_tree  # the chain, not a sibling
    # merged again with another chain (a union), each depth's nodes stay best first: the head's top token, then its
    # runner-up, then the lookup's. Taken in the order of their leaves, the runner-up at depth 1 (a leaf numbered
    # before the chain's deeper node) came first, and a cut to one node kept it
    nodes = TreeNodes()
    a, b = nodes.add_children(-1, torch.tensor([0.6, 0.4, 0.0]), topk=2)  # tokens 0 (0.6) and 1 (0.4)
    nodes.add_children(a, torch.tensor([0.0, 0.4, 0.6]), topk=1)  # token 2 (0.36)
    draft = nodes.draft(nodes.ranked(3))
    assert draft.tokens.tolist() == [0, 1, 2] and draft.parents.tolist() == [-1, -1, 0]
    assert [c.tokens.tolist() for c in leaf_chains(draft)] == [[0, 2], [1]]
    union = merge_chains(leaf_chains(draft) + [Draft(torch.tensor([3, 4]))])
    assert union.tokens.tolist() == [0, 1, 3, 2, 4] and union.prefix(1).tokens.tolist() == [0]
