"""Tree drafts: prefix trees from chains (decode/core/tree.py), one-forward tree scoring and KV compaction
(decode/core/target.py), greedy tree verification and the verifier's dispatch (decode/core/verify)."""
import pytest
import torch

from decode.core.draft import Draft
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.tree import ancestor_matrix, chain_parents, children, depths, merge_chains, root_path, tree_attention
from decode.core.verify import Verifier
from decode.core.verify.tree import kseq_beta, kseq_residual, kseq_rho, verify_tree
from helpers import plain_greedy, tiny_llama

GREEDY = SamplingConfig()
CTX = [3, 1, 4, 1, 5, 9, 2, 6]
CHAINS = [[10, 11, 12], [10, 11, 13], [10, 14], [15, 16, 17, 18]]


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def _tree(chains=CHAINS, **kw) -> Draft:
    return merge_chains([Draft(torch.tensor(c)) for c in chains], **kw)


def _node(d: Draft, path_tokens: list[int]) -> int:
    node = -1
    for tok in path_tokens:
        node = next(i for i in range(len(d)) if int(d.parents[i]) == node and int(d.tokens[i]) == tok)
    return node


# ------------------------------------------------------------------------------------------ structure

def test_merge_chains_builds_a_breadth_first_prefix_tree():
    d = _tree()
    assert d.tokens.tolist() == [10, 15, 11, 14, 16, 12, 13, 17, 18]
    assert d.parents.tolist() == [-1, -1, 0, 0, 1, 2, 2, 4, 7]
    assert d.is_tree and d.q is None and d.chain_ends is None
    assert depths(d.parents).tolist() == [1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert children(d.parents)[0] == [0, 1] and children(d.parents)[3] == [5, 6]  # node 2's children
    for c in CHAINS:  # every chain is a root path
        assert [int(d.tokens[i]) for i in root_path(d.parents, _node(d, c))] == c
    anc = ancestor_matrix(d.parents)
    assert anc[6].nonzero().flatten().tolist() == [0, 2, 6] and not anc[6, 5]
    one = merge_chains([Draft(torch.tensor([5, 6, 7]))])
    assert one.parents.tolist() == chain_parents(3).tolist() and not one.is_tree


def test_merge_chains_truncates_breadth_first_and_keeps_sampled_nodes_apart():
    d = _tree(max_nodes=5)
    assert d.tokens.tolist() == [10, 15, 11, 14, 16] and d.parents.tolist() == [-1, -1, 0, 0, 1]
    # a sampled chain repeating a deterministic one is an independent draw: its own branch
    q = torch.softmax(torch.randn(2, 20), -1)
    d = merge_chains([Draft(torch.tensor([10, 11])), Draft(torch.tensor([10, 11]), q=q)])
    assert d.parents.tolist() == [-1, -1, 0, 1]
    assert torch.equal(d.q[0], torch.nn.functional.one_hot(torch.tensor(10), 20).float())
    assert torch.equal(d.q[1], q[0])
    # i.i.d. chains of one drafter merge fully; chain_ends keeps each chain, in sampling order
    d = merge_chains([Draft(torch.tensor([10, 11]), q=q), Draft(torch.tensor([10, 12]), q=q),
                      Draft(torch.tensor([10, 11]), q=q)], iid=True)
    assert d.tokens.tolist() == [10, 11, 12] and d.chain_ends.tolist() == [1, 2, 1]
    with pytest.raises(ValueError, match="max_nodes"):
        merge_chains([Draft(torch.tensor([1]), q=q[:1])], max_nodes=3, iid=True)


def test_draft_rejects_bad_parents():
    with pytest.raises(ValueError, match=r"parents\[1\] = 1"):
        Draft(torch.tensor([1, 2]), parents=torch.tensor([-1, 1]))
    with pytest.raises(ValueError, match="3 entries for 2 tokens"):
        Draft(torch.tensor([1, 2]), parents=torch.tensor([-1, 0, 0]))
    with pytest.raises(ValueError, match="needs the draft distributions"):
        Draft(torch.tensor([1, 2]), parents=torch.tensor([-1, -1]), chain_ends=torch.tensor([0, 1]))


def test_tree_attention_mask_and_positions():
    pos, mask = tree_attention(torch.tensor([-1, 0, 0, 1]), prefix=3, kv_len=10, dtype=torch.float32, device="cpu")
    assert pos.tolist() == [[3, 4, 4, 5]]
    seen = (mask[0, 0] == 0).int().tolist()
    assert seen == [[1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
                    [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
                    [1, 1, 1, 1, 0, 1, 0, 0, 0, 0],
                    [1, 1, 1, 1, 1, 0, 1, 0, 0, 0]]
    pos, mask = tree_attention(torch.tensor([-1, 0, 0, 1]), 3, 7, torch.float32, "cpu", queries=2)
    assert pos.tolist() == [[4, 5]] and mask.shape == (1, 1, 2, 7)


# --------------------------------------------------------------------------------- scoring and caches

@torch.inference_mode()
def _chain_logits(model, ctx, chain):
    return model(torch.tensor([ctx + chain])).logits[0, len(ctx) - 1:].float()


def _check_tree_forward(model, target, chains, atol):
    d = _tree(chains)
    target.prefill(CTX, capacity=64)
    r = target.score_tree(CTX[-1], d)
    assert r.logits.shape[0] == len(d) + 1 and target.cached == len(CTX) + len(d)
    for c in chains:
        rows = [0] + [i + 1 for i in root_path(d.parents, _node(d, c))]
        torch.testing.assert_close(r.logits[rows], _chain_logits(model, CTX, c), atol=atol, rtol=0)
    return d


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["dynamic", "static", "prefix"])
def test_tree_forward_equals_separate_chain_forwards_then_compacts(kind, attn):
    model = tiny_llama(seed=1)
    model.config._attn_implementation = attn
    t = Target(model, cache=kind)
    d = _check_tree_forward(model, t, CHAINS, atol=1e-5)
    # keep the path 10 11 13, then go on from context + path + a bonus token: as if nothing else was scored
    t.keep_path(len(CTX), root_path(d.parents, _node(d, [10, 11, 13])))
    assert t.cached == len(CTX) + 3
    ctx = CTX + [10, 11, 13, 7]
    r = t.score(ctx[-1], torch.tensor([20, 21]))
    torch.testing.assert_close(r.logits, _chain_logits(model, ctx, [20, 21]), atol=1e-5, rtol=0)
    # a second tree on top of the compacted cache
    d2 = _tree([[30, 31], [32]])
    t.rollback(len(ctx) - 1)
    r = t.score_tree(ctx[-1], d2)
    torch.testing.assert_close(r.logits[[0, _node(d2, [32]) + 1]], _chain_logits(model, ctx, [32]), atol=1e-5, rtol=0)


def test_score_tree_handles_1_to_64_nodes_and_grows_a_static_cache():
    model = tiny_llama(seed=4)
    t = Target(model, cache="static", max_cache_len=None)
    g = torch.Generator().manual_seed(0)
    for n in (1, 64):
        chains = [torch.randint(0, 64, (8,), generator=g).tolist() for _ in range(8)]
        d = merge_chains([Draft(torch.tensor(c)) for c in chains], max_nodes=n)
        assert len(d) == n
        t.prefill(CTX, capacity=len(CTX) + 2)  # too small: the tree forward grows the allocation
        r = t.score_tree(CTX[-1], d)
        leaf = len(d) - 1
        path = root_path(d.parents, leaf)
        rows = [0] + [i + 1 for i in path]
        torch.testing.assert_close(r.logits[rows], _chain_logits(model, CTX, [int(d.tokens[i]) for i in path]),
                                   atol=1e-5, rtol=0)


@pytest.mark.slow
def test_tree_forward_on_the_default_target(smol):
    model, _ = smol
    t = Target(model)
    chains = [[198, 504, 282], [198, 504, 314, 29], [216, 2530], [198, 1070]]
    _check_tree_forward(model, t, chains, atol=1e-4)


# --------------------------------------------------------------------------------------- verification

def _greedy_tree_decode(model, prompt, n, kind, chains_for):
    """Our own round loop over tree drafts: score_tree → verify → keep_path → commit."""
    t, v = Target(model, cache=kind), Verifier(GREEDY)
    t.prefill(prompt)
    ctx, accepted = list(prompt), []
    while len(ctx) - len(prompt) < n:
        d = merge_chains([Draft(torch.tensor(c)) for c in chains_for(ctx)])
        o = v.verify(t.score_tree(ctx[-1], d).logits, d)
        t.keep_path(len(ctx), o.path)
        ctx += o.tokens
        accepted.append(o.accepted)
    return ctx[len(prompt):len(prompt) + n], accepted


@pytest.mark.parametrize("kind", ["dynamic", "static", "prefix"])
def test_greedy_tree_decoding_equals_plain_greedy(kind):
    model = tiny_llama(seed=2, peaked=4.0)
    prompt, n = [1, 2, 3, 4, 5, 1, 2, 3], 24
    ref = plain_greedy(model, prompt, n)
    g = torch.Generator().manual_seed(0)

    def chains_for(ctx):  # random branches, plus one that follows the reference for two tokens
        done = len(ctx) - len(prompt)
        noise = [torch.randint(0, 64, (3,), generator=g).tolist() for _ in range(3)]
        return noise[:1] + [ref[done:done + 2] + [7]] + noise[1:]

    out, accepted = _greedy_tree_decode(model, prompt, n, kind, chains_for)
    assert out == ref
    assert max(accepted) == 2  # the reference branch was found behind a random sibling


def test_greedy_tree_verifier_hand_case():
    d = _tree()  # nodes: 10 15 11 14 16 12 13 17 18
    V = 32
    logits = torch.zeros(len(d) + 1, V)
    want = {0: 10, 1: 11, 3: 13, 7: 5}  # argmax at root → 10, at node 0 → 11, at node 2 → 13, at node 6 → 5
    for row, tok in want.items():
        logits[row, tok] = 5.0
    o = Verifier(GREEDY).verify(logits, d)
    assert o.path == [0, 2, 6] and o.accepted == 3 and o.tokens == [10, 11, 13, 5]
    assert o.accept_prob == [1.0, 1.0, 1.0] and len(o.tv) == 3  # node 6 is a leaf: nothing rejected
    logits[1] = 0.0
    logits[1, 12] = 5.0  # at node 0 the target wants 12: a correction after one node
    o = verify_tree(logits, d, GREEDY)
    assert o.path == [0] and o.tokens == [10, 12] and o.accept_prob == [1.0, 0.0]


def test_verifier_sends_chains_to_the_chain_path_and_trees_to_the_reference():
    V = 16
    logits = torch.randn(4, V)
    chain = Draft(torch.tensor([1, 2, 3]), parents=chain_parents(3))
    o = Verifier(GREEDY).verify(logits, chain)
    assert o.path is None and o.note == ""
    o = Verifier(SamplingConfig(1.0), generator=torch.Generator().manual_seed(0)).verify(
        torch.randn(3, V), _tree([[1], [2]]))
    assert o.path is not None and o.note.startswith("tree drafts: PyTorch reference")
    # i.i.d. chains that all coincide are still k-Seq (the tree path), never plain speculative sampling
    q = torch.softmax(torch.randn(2, V), -1)
    same = merge_chains([Draft(torch.tensor([1, 2]), q=q)] * 3, iid=True)
    assert not same.is_tree
    o = Verifier(SamplingConfig(1.0), generator=torch.Generator().manual_seed(0)).verify(torch.randn(3, V), same)
    assert o.path is not None


def test_kseq_rho_solves_its_equation_and_the_residual_completes_the_target():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, generator=g) * 2, -1).double()  # draft
    q = torch.softmax(torch.randn(50, generator=g) * 2, -1).double()  # target
    for k in (2, 4, 8):
        rho = kseq_rho(p, q, k)
        beta = float(kseq_beta(p, q, rho))
        assert 1.0 <= rho <= k
        assert abs(1 - (1 - beta) ** k - rho * beta) < 1e-5
        p_acc = 1 - (1 - beta) ** k
        res = kseq_residual(p, q, rho, k).double()
        # accepted mass + rejected mass × normalised residual = the target, exactly
        law = torch.minimum(p, q / rho) * p_acc / beta + (1 - p_acc) * res / res.sum()
        torch.testing.assert_close(law, q, atol=1e-5, rtol=0)
    assert kseq_rho(p, q, 1) == 1.0 and abs(kseq_rho(p, p, 4) - 1.0) < 1e-5


def test_trees_refuse_models_with_other_than_full_attention():
    from types import SimpleNamespace
    from decode.common.errors import UserError
    from decode.core.target import check_tree_support
    check_tree_support(SimpleNamespace(layer_types=["full_attention"] * 2))
    check_tree_support(SimpleNamespace())  # Llama configs have no layer_types: full attention
    with pytest.raises(UserError, match="sliding_attention"):
        check_tree_support(SimpleNamespace(layer_types=["full_attention", "sliding_attention"]))
