"""Batched speculative rounds (decode/engine/batch.py, issue 32 §1): every row's output is its own plain decoding
whatever its batch-mates do — mixed prompt lengths, different arms and lengths per row, EOS at different rounds,
rows joining mid-flight — and sampled rows follow the target's distribution."""
import collections
import statistics
from collections import deque

import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.policies import build_policy
from decode.common.errors import UserError
from decode.core.attention import our_attention_model
from decode.core.sampling import SamplingConfig
from decode.core.verify import Verifier
from decode.engine.batch import CLOSED, DRAFTING, PLAIN, Acceptance, BatchEngine, RowCache, fill_holes, joint_length
from helpers import model_costs_only  # noqa: F401  (autouse)
from helpers import TinyTokenizer, plain_greedy, tiny_llama

GREEDY = SamplingConfig()
POOL = ["none", "pld:L=3", "suffix:L=4", "pld:L=1"]
# repetitive prompts (lookup arms find matches, so drafts get accepted and rejected), one of length 1
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9], [5], [3, 3, 8, 3, 3, 8, 3, 3, 8, 3],
           [12, 40, 7, 12, 40, 7, 12, 40, 7, 12, 40, 7, 12, 40], [2, 4]]


def _engine(model, pool=POOL, policy="random", sampling=GREEDY, eos=(), seed=0, **kw):
    env = ArmEnv(model, TinyTokenizer(model.config.vocab_size), sampling)
    seeds = iter(range(seed, seed + 10_000))
    return BatchEngine(model, lambda: [build_arm(s, env) for s in pool],
                       lambda K: build_policy(policy, K, 4, seed=next(seeds)),
                       Verifier(sampling, "torch", torch.Generator().manual_seed(seed)), eos, **kw)


def _pin_cost(eng: BatchEngine, steps=lambda W: 1.0 + 0.05 * (W - 1)) -> None:
    """The cost model pinned for tests of what the rounds do with it: a block of W positions costs ``steps(W)``
    one-row steps (default: extra positions cheap), nothing beside the block. A tiny model's measured round work and
    feedback outweigh its forwards, so whether its rows drafted at all otherwise followed the machine's timing (a
    clean clone's run drafted nothing where the local ones did)."""
    eng.block_steps = lambda B, W, context, n=None: steps(W)
    eng.overhead_steps = lambda B, w, one, **_: 0.0
    eng.calibration = lambda B, kind: 1.0
    eng.counterfactual_seconds = lambda: 0.0


@pytest.fixture(scope="module")
def model():  # the engine feeds padded blocks ragged with our attention (decode/core/ragged.py), as a CPU run
    # float64: no near-tie flips between shapes
    return our_attention_model(tiny_llama(vocab=64, layers=2, seed=3, peaked=4.0).double())


@pytest.mark.parametrize("max_batch", [None, 1, 2, 4])
def test_batched_greedy_rows_equal_their_plain_greedy_decoding(model, max_batch):
    eng = _engine(model)
    rows = eng.generate(PROMPTS, 24, max_batch=max_batch)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 24), p
    pulled = collections.Counter(rec.arm for r in rows for rec in r.rounds)
    assert len(pulled) == len(POOL)  # every arm played somewhere, rows mixed them
    assert any(rec.accepted for r in rows for rec in r.rounds)  # drafts were accepted ...
    assert any(rec.accepted < rec.drafted for r in rows for rec in r.rounds)  # ... and rejected
    if max_batch in (None, 4):  # rows of different widths shared rounds
        assert any(len(set(h.drafted)) > 1 for h in eng.history)
    assert not eng.rows and eng.cache.rows == 0


def test_rows_stop_at_their_own_eos_and_rows_join_mid_flight(model):
    refs = [plain_greedy(model, p, 30) for p in PROMPTS]
    eos = {refs[0][6], refs[3][2]}  # two rows stop early at different rounds
    eng = _engine(model, eos=eos)
    first = [eng.add(p, 30) for p in PROMPTS[:3]]
    done = {}
    for _ in range(3):
        for r in eng.step():
            done[r.rid] = r
    late = [eng.add(p, 12) for p in PROMPTS[3:]]  # join after three rounds, with another budget
    while eng.rows:
        for r in eng.step():
            done[r.rid] = r
    for rid, p in zip(first + late, PROMPTS):
        n = 30 if rid in first else 12
        ref = plain_greedy(model, p, n)
        cut = next((j + 1 for j, t in enumerate(ref) if t in eos), len(ref))
        assert done[rid].tokens == ref[:cut], p
        assert done[rid].stopped_by == ("eos" if cut < len(ref) or (ref and ref[-1] in eos) else "length")
    assert done[first[0]].stopped_by == "eos"


def test_the_cache_compacts_without_changing_outputs(model):
    eng = _engine(model, pool=["pld:L=4", "suffix:L=4"], policy="random", compact_slack=4)
    for p in PROMPTS:
        eng.add(p, 40)
    compactions = 0
    rows = {}
    while eng.rows:
        before = eng.cache.slots
        for r in eng.step():
            rows[r.rid] = r
        compactions += eng.cache.rows > 0 and eng.cache.slots < before
        if eng.cache.rows:  # after a compaction the longest row fills its slots exactly
            assert eng.cache.slots >= max(eng.cache.lengths())
    assert compactions >= 1
    for rid, p in enumerate(PROMPTS):
        assert rows[rid].tokens == plain_greedy(model, p, 40)


def test_row_cache_mask_sees_own_valid_slots_and_causal_block():
    c = RowCache()
    c.valid = torch.tensor([[True, False, True], [False, True, True]])
    m = c.attention(torch.tensor([[True, True], [True, False]]), torch.float32, "cpu")
    seen = m[:, 0] == 0
    assert seen[0].tolist() == [[True, False, True, True, False], [True, False, True, True, True]]
    assert seen[1].tolist() == [[False, True, True, True, False], [False, True, True, True, True]]  # pad: finite


def test_rows_join_into_the_caches_room_and_keep_their_slots(model):
    """A row joining writes its own slots into the allocation's spare rows (room doubles when there is none), a row
    leaving moves the kept rows within it, and a later join reuses that room without a new allocation: every row's
    slots stay its own, and a joining row's unfilled slots hold nothing of a row that left."""
    from transformers import DynamicCache

    def prefill(ids):
        cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        return cache

    def keys(c, row, n):
        return c.hf.layers[0].keys[row, :, :n].clone()

    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]]
    own = [prefill(p).layers[0].keys[0] for p in prompts]
    c = RowCache(model.config)
    for p in prompts[:3]:
        c.add(prefill(p), len(p))
    assert c.rows == 3 and c.row_room == 4  # 1, 2, then doubled to 4
    base = c._base[0][0].data_ptr()
    c.select([2, 0])  # the second row leaves; the third moves up
    assert c.lengths() == [4, 5] and c._base[0][0].data_ptr() == base
    c.add(prefill(prompts[3]), 2)
    assert c.rows == 3 and c._base[0][0].data_ptr() == base  # into the room: no new allocation
    for row, (i, n) in enumerate([(2, 4), (0, 5), (3, 2)]):
        torch.testing.assert_close(keys(c, row, n), own[i])
    assert not c.hf.layers[0].keys[2, :, 2:5].any()  # cleared, not the slots of the row that sat there before
    c.add(prefill(prompts[1]), 3)
    c.add(None, 0)
    assert c.rows == 5 and c.row_room == 8 and c._base[0][0].data_ptr() != base
    torch.testing.assert_close(keys(c, 3, 3), own[1])
    assert c.lengths() == [4, 5, 2, 3, 0] and c.hf.layers[0].keys.shape[0] == 5
    assert fill_holes(5, {1, 4}) == [0, 3, 2] and fill_holes(5, {0, 1}) == [3, 4, 2]
    assert fill_holes(3, set()) == [0, 1, 2]
    c.select(fill_holes(5, {1, 4}))  # the row after the kept count moves alone into the free place
    assert c.lengths() == [4, 3, 2]
    for row, (i, n) in enumerate([(2, 4), (1, 3), (3, 2)]):
        torch.testing.assert_close(keys(c, row, n), own[i])


def test_neural_arms_are_refused_clearly(model):
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    with pytest.raises(UserError, match="model-free arms"):
        BatchEngine(model, lambda: [build_arm("pld:L=2", env), _FakeNeural()], lambda K: build_policy("random", K, 4),
                    Verifier(GREEDY, "torch"))


class _FakeNeural:
    name, label, L, uses_target_hidden = "eagle", "eagle@2", 2, True

    @property
    def parts(self):
        return (self,)


@pytest.mark.parametrize("spec", ["router:carry=true", "router:cost=true,carry=true",
                                  "ucbspec:fullinfo=true,carry=true"])
def test_full_information_and_cost_policies_learn_per_row_and_stay_lossless(model, spec):
    """The router batched: each row's arms propose from its prefix before its choice (the features it reads), and
    the drafts it did not play are scored against what the row emits; one policy object shared by every row (a
    server's carried policy) learns from all of them."""
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    shared = build_policy(spec, len(POOL), 4)
    updates = []
    update = shared.update
    shared.update = lambda arm, rec: updates.append(rec) or update(arm, rec)
    eng = BatchEngine(model, lambda: [build_arm(s, env) for s in POOL], lambda K: shared,
                      Verifier(GREEDY, "torch"), length="cost" if "cost" in spec else "fixed")
    if eng.length == "cost":
        _pin_cost(eng)
    rows = eng.generate(PROMPTS, 20, max_batch=4)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 20), p
        assert r.pending == []  # every counterfactual round resolved by the end
        assert all(rec.feedback is None or len(rec.feedback) == len(POOL) for rec in r.rounds)
    played = sum(len(r.rounds) for r in rows)
    plain = sum(len(h.rows) for h in eng.history if h.plain)  # rounds that could not speculate: no counterfactuals
    assert sum(rec.feedback is not None for r in rows for rec in r.rounds) == played - plain
    # each other round taught every arm it did not play, and the played one unless the engine let it draft nothing
    assert 0 < len(updates) <= played - plain
    assert all(rec.feedback is not None for rec in updates)  # no plain round taught the arm it named
    assert shared.n_obs.sum() == (played - plain) * (len(POOL) - 1) + len(updates)


@pytest.mark.slow
def test_sampled_rows_follow_the_targets_distribution():
    """Rejection sampling per row: the first two sampled tokens of a row whose lookup draft is usually wrong must
    follow the target's own distribution (chi-square against the exact probabilities), batch-mates present."""
    from scipy.stats import chisquare

    m = tiny_llama(vocab=8, hidden=16, layers=1, seed=5).double()
    cfg = SamplingConfig(temperature=1.0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # pld proposes 3, 1, 2, ...
    with torch.inference_mode():
        p1 = torch.softmax(m(torch.tensor([prompt])).logits[0, -1].float(), -1)
    counts = collections.Counter()
    n = 0
    for seed in range(150):
        eng = _engine(m, pool=["pld:L=3"], policy="fixed:arm=0", sampling=cfg, seed=seed)
        rows = eng.generate([prompt] * 8 + [[4, 5, 6, 4, 5]], 2)
        for r in rows[:8]:
            counts[r.tokens[0]] += 1
            n += 1
    obs = torch.tensor([counts[t] for t in range(8)], dtype=torch.float64)
    exp = p1.double() * n
    keep = exp >= 5
    pval = chisquare(obs[keep].numpy(), (exp[keep] / exp[keep].sum() * obs[keep].sum()).numpy()).pvalue
    assert pval > 1e-3, (obs.tolist(), exp.tolist())


def test_joint_length_backs_off_when_the_block_gets_expensive():
    from decode.engine.batch import expected_tokens, joint_length

    assert expected_tokens(0.5, 0) == 1 and expected_tokens(0.5, 2) == 1.75
    flat = lambda n, _=None: 1.0 + 0.02 * (n - 1)  # noqa: E731  (a small batch on a CPU: positions nearly free)
    steep = lambda n, _=None: float(n)  # noqa: E731  (a large batch: every position costs a full forward)
    assert joint_length([0.6] * 4, [4] * 4, flat) == 4
    assert joint_length([0.6] * 4, [4] * 4, steep) == 0
    assert joint_length([0.9, 0.1], [4, 4], lambda n, _: 1 + 0.3 * (n - 1)) in (2, 3, 4)  # one good row carries it
    assert joint_length([0.6, 0.6], [0, 0], flat) == 0  # nothing to draft (the none arm, or no budget left)


def test_a_trees_cut_is_valued_by_what_its_first_K_nodes_yield_per_node_rank():
    """A tree cut to its first K nodes yields 1 + Σ_{i ≤ K} p_i (p_i: its i-th node's acceptance rate), learnt per
    rank; the joint length cuts where the next nodes stop paying: a level's second node accepted in 1 of 10 rounds
    is not worth a position, though one α per level (what the tree's depth reaches) credited it with the level's."""
    from types import SimpleNamespace
    from decode.engine.batch import joint_length
    acc = Acceptance()
    for r in range(1000):  # node 0 accepted 60%, node 1 (a sibling) 10%, node 2 (node 0's child) 40%
        first = r % 10 < 6
        acc.observe_nodes(0, 3, [0, 2] if first and r % 10 < 4 else [0] if first else [1] if r % 10 == 6 else [])
    row = SimpleNamespace(acceptance={})
    acc.shared[0] = [1.0, 1.0]  # α = 0.5 (a row with no rounds of its own reads the shared mean: no scaling)
    gains = acc.tree_gains(row, 0, (2, 1))  # two root chains: nodes 0 and 1 at depth 1, node 2 at depth 2
    assert gains == pytest.approx([1.0, 1.6, 1.7, 2.1], abs=2e-3)
    assert acc.tree_gains(row, 0, (2, 2, 1))[4] > gains[3]  # ranks never drafted: their optimistic prior, so tried
    # a rank no round reached is priced at α^d, d the shallowest depth it can have (breadth-first), not α^rank: a
    # union's 6th node at depth 2 is worth α² = 0.25 until its rounds say otherwise (α^6 = 0.016 kept cuts short)
    fresh = Acceptance()
    fresh.shared[0] = [1.0, 1.0]
    steps = [b - a for a, b in zip(fresh.tree_gains(row, 0, (3, 3, 4)), fresh.tree_gains(row, 0, (3, 3, 4))[1:])]
    assert steps == pytest.approx([0.5] * 3 + [0.25] * 3 + [0.125] * 3 + [0.0625])
    cost = lambda w, n=None: 1.0 + 0.3 * (w - 1)  # noqa: E731  (one row: each position 0.3 of a step)
    assert joint_length([gains], [(2, 2)], cost) == 1  # 1.6 / 1.3 beats 1.7 / 1.6 and 2.1 / 1.9
    assert joint_length([gains], [(2, 2)], lambda w, n=None: 1.0 + 0.05 * (w - 1)) == 3  # flat: every node pays
    own = SimpleNamespace(acceptance={0: [30.0, 10.0]})  # a row whose own rounds accept more than the shared α
    assert all(a > b for a, b in zip(acc.tree_gains(own, 0, (2, 1))[1:], gains[1:]))


@pytest.mark.parametrize("max_batch", [None, 2])
def test_cost_lengths_stay_lossless_and_learn_shared_acceptance(model, max_batch):
    eng = _engine(model, pool=["none", "pld:L=4", "suffix:L=4"], policy="ucbspec", length="cost")
    _pin_cost(eng)
    rows = eng.generate(PROMPTS, 24, max_batch=max_batch)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 24), p
    assert len(eng.cost.sizes()) > 4  # probed, then measured by the rounds (rows × widths)
    assert set(eng.acceptance.shared) - {0}  # drafting arms' acceptance pooled over the rows
    widths = {h.width for h in eng.history}
    assert len(widths) > 1  # K moved with what was learnt


def test_acceptance_draws_one_posterior_sample_per_arm_per_round_and_concentrate_with_data():
    """Thompson draws (Acceptance with rng): every row reads the same draw of an arm's shared mean within a round,
    a new round draws afresh, few observations spread the draws widely and many concentrate them on the mean."""
    import random
    from types import SimpleNamespace
    acc = Acceptance(rng=random.Random(0))
    acc.shared = {0: [0.0, 3.0], 1: [900.0, 100.0]}
    a, b = SimpleNamespace(acceptance={}), SimpleNamespace(acceptance={})
    few, many = [], []
    for _ in range(400):
        acc.new_round()
        assert acc.alpha(a, 0) == acc.alpha(b, 0)
        few.append(acc.shared_mean(0))
        many.append(acc.shared_mean(1))
    assert len(set(few)) == 400 and max(few) > 0.5 and min(few) < 0.05  # Beta(1, 4): P(> 0.5) = 1/16
    assert all(0.85 < m < 0.95 for m in many) and abs(sum(many) / 400 - 0.9) < 0.01
    assert Acceptance().shared_mean(0) == 0.5 and Acceptance().alpha(a, 0) == 0.5  # no rng: the posterior mean


@pytest.mark.parametrize("draws", [False, True])
def test_an_arm_whose_first_drafts_failed_is_tried_again(model, draws):
    """An arm's acceptance is learnt only from rounds that draft with it: with posterior means, a few rejections
    pushed it below break-even for good (no round drafted again); with Thompson draws a draw exceeds break-even now
    and then, so the arm drafts again and its estimate keeps learning. Lossless either way."""
    eng = _engine(model, pool=["pld:L=4"], policy="fixed:arm=0", length="cost")
    if not draws:
        eng.acceptance.rng = None
    eng.acceptance.shared = {0: [0.0, 6.0]}  # six rejections, no accepted position: mean 1/8
    eng.block_steps = lambda B, W, context, n=None: 1.0 + 0.3 * (W - 1)  # pinned: break-even α is ~0.3
    eng.overhead_steps = lambda B, w, one, **_: 0.0
    eng.cost.sizes = lambda: {1, 2}  # a measured curve: the gate before choosing decides
    rows = eng.generate(PROMPTS, 24, max_batch=2)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 24), p
    assert any(h.width > 1 for h in eng.history) == draws
    assert (sum(eng.acceptance.shared[0]) > 6) == draws


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_lone_rows_policy_learns_that_the_engine_would_not_draft_its_arm(model, max_batch):
    """The cost controller lets a row's chosen arm draft nothing when its acceptance is below break-even. A row alone
    learns that as the arm's round (one token, nothing drafted), as the serial engine's policy does; otherwise a
    policy that favoured the arm kept choosing it and the engine kept drafting nothing. With other rows the joint
    length is the batch's, not the arm's: the policy learns nothing from such a round. Lossless either way."""
    updates = []

    def make_policy(K):
        policy = build_policy("fixed:arm=0", K, 4)
        policy.update = lambda arm, rec: updates.append(rec)
        return policy
    env = ArmEnv(model, TinyTokenizer(model.config.vocab_size), GREEDY)
    eng = BatchEngine(model, lambda: [build_arm(s, env) for s in ["pld:L=4", "suffix:L=4"]], make_policy,
                      Verifier(GREEDY, "torch"), length="cost")
    _pin_cost(eng, lambda W: 1.0 + 0.3 * (W - 1))  # break-even α ~0.3
    eng._nothing_pays = lambda context: False  # the gate open: rows choose, and the chosen arm is cut to 0
    eng.acceptance.rng = None
    eng.acceptance.shared = {0: [0.0, 60.0]}  # the chosen arm never pays
    prompts = [PROMPTS[0], PROMPTS[3]]
    rows = eng.generate(prompts, 12, max_batch=max_batch)
    for p, r in zip(prompts, rows):
        assert r.tokens == plain_greedy(model, p, 12), p
        assert all(rec.drafted == 0 and rec.arm == 0 for rec in r.rounds)
    assert not any(h.plain for h in eng.history) and {len(h.rows) for h in eng.history} == {max_batch}
    # a row's last round has no room for a draft (one token left): a round like any, learnt at every batch size
    assert len(updates) == (24 if max_batch == 1 else 2)
    assert all(rec.drafted == 0 and rec.new_tokens == 1 for rec in updates)


@pytest.mark.parametrize("steps, drafts", [(lambda W: float(W), False), (lambda W: 1.0 + 0.01 * (W - 1), True)])
def test_no_row_drafts_when_no_length_can_pay_even_at_its_cap(model, steps, drafts):
    """When every position costs a full forward, K = 0 is decided before drafting: no arm is asked for a draft
    (its lookups would be pure loss); when positions are nearly free they are. Lossless either way."""
    env = ArmEnv(model, TinyTokenizer(model.config.vocab_size), GREEDY)
    asked = []

    def make_arms():
        arms = [build_arm(s, env) for s in ["pld:L=4", "suffix:L=4"]]
        for a in arms:
            def propose(ctx, max_len, keep_going=None, _orig=a.propose):
                asked.append(max_len)
                return _orig(ctx, max_len, keep_going)
            a.propose = propose
        return arms
    seeds = iter(range(10_000))
    eng = BatchEngine(model, make_arms, lambda K: build_policy("ucbspec", K, 4, seed=next(seeds)),
                      Verifier(GREEDY, "torch", torch.Generator().manual_seed(0)), (), length="cost")
    eng.block_steps = lambda B, W, context, n=None: steps(W)  # the block's cost in one-row-block steps, fixed
    eng.overhead_steps = lambda B, w, one, **_: 0.0  # and no round work beside it (a tiny model's is a forward's size)
    rows = eng.generate(PROMPTS, 16, max_batch=4)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 16), p
    assert any(m > 0 for m in asked) == drafts
    assert ({h.width for h in eng.history} == {1}) != drafts


@pytest.mark.parametrize("spec_seconds, drafts", [(0.05, False), (0.0, True)])
def test_cost_lengths_count_a_rounds_own_work_per_row(model, spec_seconds, drafts):
    """length=cost weighs a round's own work outside its forwards (per row, measured apart for rounds that speculate
    and rounds that do not): with the block's extra positions nearly free but a speculative round's work pinned at
    50 one-position forwards a row, no row drafts once a speculative round has been measured; with that work equal
    to a plain round's, rows draft. Lossless either way."""
    eng = _engine(model, pool=["pld:L=4", "suffix:L=4"], policy="ucbspec", length="cost")
    eng.block_steps = lambda B, W, context, n=None: 1.0 + 0.01 * (W - 1)
    eng.cost.seconds_at = lambda n, context: 1e-3  # a one-position forward of the batch: 1 ms
    ids = [eng.add(p, 16) for p in PROMPTS[:4]]
    done = {}
    while eng.rows:
        done.update({r.rid: r for r in eng.step()})
        # what the rounds measured, pinned for the test: per row, no fixed part
        eng.round_work = lambda B, kind: B * (spec_seconds if kind == DRAFTING else 0.0)
    for rid, p in zip(ids, PROMPTS):
        assert done[rid].tokens == plain_greedy(model, p, 16), p
    assert eng.overhead_steps(4, 2, 1e-3) == pytest.approx(4 * spec_seconds / 1e-3)
    assert eng.overhead_steps(4, 1, 1e-3) == 0
    speculated = [h.width > 1 for h in eng.history]
    assert any(speculated[1:]) == drafts  # the first round is chosen before anything is measured


def test_block_cost_is_a_ratio_read_where_both_widths_were_measured(model):
    """c_B(W) of the engine: t(B·W) / t(B) from a bucket that measured around both (CostCurve.growth); where none
    did, the absolute times' ratio; W itself before anything is measured."""
    eng = _engine(model, pool=["none"], policy="fixed:arm=0", length="cost")
    assert eng.block_steps(4, 3, 100) == 3.0
    for n, t in ((4, 0.010), (8, 0.012), (16, 0.020)):
        eng.cost.observe(n, 100, t)
    eng.cost.observe(8, 900, 0.030)  # a long context where only blocks of 4 rows × 2 ran
    assert eng.block_steps(4, 2, 900) == pytest.approx(1.2)  # the short context's ratio, not 0.030 / 0.030
    assert eng.block_steps(4, 1, 900) == 1.0
    assert eng.block_steps(4, 8, 900) == pytest.approx(eng.cost.seconds_at(32, 900) / eng.cost.seconds_at(4, 900))


def test_block_cost_is_read_at_its_own_batch_size_where_that_size_measured_it(model):
    """c_B(W) = t_B(B·W) / t_B(B) where batch size B measured both sizes (16 rows × 2 positions read the KV of 16
    rows, not of the 8 rows whose 4-wide blocks measured the shared t(32)); the shared curve where it did not."""
    eng = _engine(model, pool=["none"], policy="fixed:arm=0", length="cost")
    for B, W, t in ((8, 1, 0.080), (8, 2, 0.096), (8, 4, 0.125), (16, 1, 0.100)):
        eng._observe_cost(B, B * W, 300, t)
    # shared: t(32) / t(16), the latter the median of 8 rows × 2 and 16 rows × 1
    assert eng.block_steps(16, 2, 300) == pytest.approx(0.125 / 0.098)
    eng._observe_cost(16, 32, 300, 0.137)
    assert eng.block_steps(16, 2, 300) == pytest.approx(1.37)  # its own measurement
    assert eng.block_steps(8, 2, 300) == pytest.approx(1.2)
    assert eng.cost.seconds(32, 300) == pytest.approx(0.131) and eng.cost_at[16].seconds(32, 300) == 0.137  # both


def test_a_ragged_block_costs_its_real_positions_a_padded_one_every_rows_width(model):
    """An engine that feeds blocks ragged (decode/core/ragged.py) costs a block 3 wide in which 4 of 16 rows draft
    two tokens at its 24 real positions, not at 48; one that feeds them padded (another attention) at 48. The joint
    length then lets a few rows draft as long as they pay, where a padded block would have charged every row."""
    eng = _engine(model, pool=["none"], policy="fixed:arm=0", length="cost")
    assert eng.ragged  # our attention: blocks go ragged
    for n, t in ((16, 0.100), (24, 0.102), (32, 0.117), (48, 0.150)):
        eng._observe_cost(16, n, 300, t)
    assert eng.block_steps(16, 3, 300, 24) == pytest.approx(1.02)
    assert eng.block_steps(16, 3, 300) == pytest.approx(1.5)  # every row 3 wide
    eng.rows = [None] * 16  # modelled_steps reads the batch size only
    eng.overhead_steps = lambda B, w, one, **_: 0.0
    steps = eng.modelled_steps(300, 0)
    alphas, caps = [0.3] * 4 + [0.0] * 12, [2] * 4 + [0] * 12  # four rows may draft two tokens, twelve none
    assert joint_length(alphas, caps, steps) == 2  # 16 + 4 × 1.39 tokens for 1.02 steps
    eng.ragged = False
    assert eng.block_steps(16, 3, 300, 24) == pytest.approx(1.5)
    assert joint_length(alphas, caps, steps) == 0  # padded: 17.6 tokens for 1.5 steps (17.2 for 1.17) lose to 16
    eng.rows = []


def test_a_modules_forward_is_costed_at_the_number_of_rows_drafting_with_it(model):
    """A module forward's seconds are kept per number of rows that drafted with it and read at the nearest count
    measured (one figure for all read 6.7 ms where 16 rows took 10), and so is its share of a round's cost."""
    eng = _engine(model, pool=["none"], policy="fixed:arm=0", length="cost")
    assert eng.module_seconds_at(4) is None
    eng.module_seconds = {2: 0.005, 16: 0.010}
    assert [eng.module_seconds_at(n) for n in (16, 12, 3, 9)] == [0.010, 0.010, 0.005, 0.005]
    eng.block_steps = lambda B, W, context, n=None: 1.0
    eng.overhead_steps = lambda B, w, one, **_: 0.0
    eng._one_seconds = lambda B, context: 0.1
    assert eng._steps(300, 16)(3) == pytest.approx(1 + 3 * 0.010 / 0.1)
    assert eng._steps(300, 2)(3) == pytest.approx(1 + 3 * 0.005 / 0.1)
    assert eng._steps(300, 0)(3) == 1.0 and eng._steps(300, 16)(1) == 1.0


def test_a_rounds_own_work_has_a_fixed_part_and_a_part_per_row(model):
    """A round's own work is fitted as a + b·B to each batch size's median (what a batch's tail measures, with few
    rows sharing the fixed part, no longer says what 16 rows cost); one batch size measured: per row × B."""
    eng = _engine(model, pool=["none"], policy="fixed:arm=0", length="cost")
    assert eng.round_work(16, PLAIN) is None and eng.overhead_steps(16, 1, 0.1) == 0.0
    eng._own_work[PLAIN] = deque([(2, 0.0031), (2, 0.0029), (2, 0.0030)])  # 1.5 ms a row
    assert eng.round_work(16, PLAIN) == pytest.approx(16 * 0.0015)
    eng._own_work[PLAIN].extend([(4, 0.004), (8, 0.006), (8, 0.0061), (8, 0.0059), (1, 0.0025)])
    assert eng.round_work(16, PLAIN) == pytest.approx(0.002 + 0.0005 * 16)  # 2 ms a round, 0.5 ms a row
    assert eng.round_work(16, DRAFTING) is None
    assert eng.overhead_steps(16, 2, 0.1) == pytest.approx(eng.round_work(16, PLAIN) / 0.1)  # not yet measured
    eng._own_work[DRAFTING] = deque([(4, 0.004), (8, 0.004)])  # more rows, no more work: flat
    assert eng.round_work(16, DRAFTING) == pytest.approx(0.004)
    eng._own_work[DRAFTING] = deque([(2, 0.001), (4, 0.004)])  # a negative fixed part: per row through the origin
    assert eng.round_work(6, DRAFTING) == pytest.approx(6 * (2 * 0.001 + 4 * 0.004) / 20)
    # a steep line through small sizes: past the largest size measured (4 rows, 8 ms a row) a row costs no more than
    # there, so 16 rows read 16 × 8 ms, not the line's 140 ms; within the sizes measured the line stands
    eng._own_work[DRAFTING] = deque([(1, 0.002), (2, 0.030), (4, 0.032)])
    slope, a = statistics.linear_regression([1, 2, 4], [0.002, 0.030, 0.032])
    assert a + slope * 16 > 16 * 0.008
    assert eng.round_work(16, DRAFTING) == pytest.approx(16 * 0.008)
    assert eng.round_work(3, DRAFTING) == pytest.approx(a + slope * 3)


def test_a_rounds_own_work_leaves_out_the_caches_one_off_copies(model, monkeypatch):
    """The cache's one-off work (its capacity growing, rows leaving, compaction) is not a round's own work per row:
    a 60 ms copy in one round once raised a plain round's figure sixfold, and plain rounds then looked dear. Rows
    leaving and compaction are timed after the round's figure; a slow capacity growth inside a forward is taken out
    of it."""
    import time as _time
    eng = _engine(model, pool=["none"], policy="fixed:arm=0")
    grow = eng.cache.reserve

    def slow_reserve(*a, **k):
        _time.sleep(0.06)
        return grow(*a, **k)
    monkeypatch.setattr(eng.cache, "reserve", slow_reserve)
    eng.generate(PROMPTS[:4], 6, max_batch=4)
    assert eng.row_overhead[PLAIN] < 0.01  # per row: a copy left in would read 15 ms at least
    assert sum(h.verify_time > 0.06 for h in eng.history) >= 1  # the copies happened inside rounds


def test_counterfactual_feedback_is_measured_apart_from_a_rounds_own_work(model, monkeypatch):
    """A router's plain rounds settle the counterfactual drafts of the speculative rounds before them: that time is
    the feedback's, per row that drafted counterfactually (charged where the gate would let rows make them), not a
    plain round's own work, which would otherwise look dear beside a block of two positions."""
    import time as _time
    from decode.choose.feedback import CounterfactualScorer

    settle = CounterfactualScorer.settle
    monkeypatch.setattr(CounterfactualScorer, "settle", lambda *a, **k: (_time.sleep(0.2), settle(*a, **k))[1])
    env = ArmEnv(model, TinyTokenizer(model.config.vocab_size), GREEDY)
    shared = build_policy("router:carry=true", len(POOL), 4)
    eng = BatchEngine(model, lambda: [build_arm(s, env) for s in POOL], lambda K: shared, Verifier(GREEDY, "torch"),
                      length="cost")
    eng.block_steps = lambda B, W, context, n=None: float(W)  # after the first rounds nothing pays: plain rounds settle
    eng.overhead_steps = lambda B, w, one, **_: 0.0
    eng.generate(PROMPTS, 16, max_batch=4)
    assert sum(h.plain for h in eng.history) > 3
    # rounds the gate closed, and rounds whose rows looked up but drafted nothing: a settle left in would read 50 ms
    # a row at least (the sleep is long so that a slow machine's own work, a few ms a row, stays far below it)
    assert all(eng.row_overhead[kind] < 0.025 for kind in (CLOSED, PLAIN) if kind in eng.row_overhead)
    assert CLOSED in eng.row_overhead
    assert eng.counterfactual_seconds() >= 0.2  # every row that drafted counterfactually settled once at least


@pytest.mark.parametrize("steps, speculates", [(lambda W: float(W), False), (lambda W: 1.0 + 0.01 * (W - 1), True)])
def test_rounds_that_cannot_speculate_make_no_counterfactual_drafts(model, monkeypatch, steps, speculates):
    """The router batched under cost lengths: once the curve says no row could pay even with its best arm at its
    longest cap (a lookup's: what it finds), the round is plain: no counterfactual drafts (every row's lookups would
    be pure loss at large B), while the rounds queued before still settle; lossless, and every pending round resolved
    by the end."""
    from decode.choose.feedback import CounterfactualScorer

    before = CounterfactualScorer.before_round
    calls = []
    monkeypatch.setattr(CounterfactualScorer, "before_round",
                        lambda self, *a, **k: calls.append(1) or before(self, *a, **k))
    env = ArmEnv(model, TinyTokenizer(model.config.vocab_size), GREEDY)
    shared = build_policy("router:carry=true", len(POOL), 4)
    updates = []
    update = shared.update
    shared.update = lambda arm, rec: updates.append(rec) or update(arm, rec)
    eng = BatchEngine(model, lambda: [build_arm(s, env) for s in POOL], lambda K: shared, Verifier(GREEDY, "torch"),
                      length="cost")
    _pin_cost(eng, steps)
    gate, found_nothing = eng._nothing_pays, []
    eng._nothing_pays = lambda context: gate(context) and (
        found_nothing.append(max(eng._best_case(False, looked_up=True)[1]) == 0) or True)
    rows = eng.generate(PROMPTS, 16, max_batch=4)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 16), p
        assert r.pending == []
    plain = [h for h in eng.history if h.plain]
    assert all(h.width == 1 for h in plain)
    assert len(calls) == sum(len(h.rows) for h in eng.history if not h.plain)
    # a plain round plays no arm: the policy chooses none and learns nothing from it
    assert len(updates) <= sum(len(h.rows) for h in eng.history if not h.plain)
    if speculates:  # plain only where every row had one token left, or no row's lookups found a draft
        assert len(plain) - sum(found_nothing) <= 2 and any(h.width > 1 for h in eng.history)
    else:  # only the first rounds, before the curve was measured, proposed counterfactually
        assert len(plain) >= len(eng.history) - 2


def test_the_gate_charges_the_counterfactual_drafts_it_would_let_rows_make(model, monkeypatch):
    """Drafting nearly free in the block, but each row's lookups for the router dear (20 ms against a tiny
    forward): once measured, the gate counts them on the speculative side and the rounds go plain (no row looks
    up); lossless, every pending round resolved."""
    import time as _time
    from decode.choose.feedback import CounterfactualScorer

    before = CounterfactualScorer.before_round
    monkeypatch.setattr(CounterfactualScorer, "before_round",
                        lambda self, *a, **k: (_time.sleep(0.02), before(self, *a, **k))[1])
    env = ArmEnv(model, TinyTokenizer(model.config.vocab_size), GREEDY)
    shared = build_policy("router:carry=true", len(POOL), 4)
    eng = BatchEngine(model, lambda: [build_arm(s, env) for s in POOL], lambda K: shared, Verifier(GREEDY, "torch"),
                      length="cost")
    eng.block_steps = lambda B, W, context, n=None: 1.0 + 0.01 * (W - 1)
    eng.overhead_steps = lambda B, w, one, **_: 0.0
    rows = eng.generate(PROMPTS, 16, max_batch=4)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 16), p
        assert r.pending == []
    assert eng.counterfactual_seconds() >= 0.02
    assert sum(h.plain for h in eng.history) >= len(eng.history) - 3  # looked up until the first were measured


def test_schedules_people_use_as_baselines(model):
    from decode.engine.batch import parse_schedule, scheduled_length

    sched = parse_schedule("1-2=4,3-4=2,5-=0")
    assert [scheduled_length(sched, B) for B in (1, 2, 3, 4, 5, 64)] == [4, 4, 2, 2, 0, 0]
    for bad in ("schedule:1-2", "schedule:x=1", "ema:", "ema:a", "tree"):
        with pytest.raises(UserError, match="length"):
            _engine(model, length=bad)
    eng = _engine(model, pool=["pld:L=4"], policy="fixed:arm=0", length="schedule:1-3=4,4-=1")
    rows = eng.generate(PROMPTS, 16)
    assert all(max(h.drafted) <= (4 if len(h.rows) <= 3 else 1) for h in eng.history)
    assert any(max(h.drafted) > 1 for h in eng.history) and any(len(h.rows) >= 4 for h in eng.history)
    eng2 = _engine(model, pool=["pld:L=4", "suffix:L=4"], policy="ucbspec", length="ema:1,2,4")
    rows2 = eng2.generate(PROMPTS, 16)
    assert eng2.ema_accepted is not None and all(max(h.drafted) <= 4 for h in eng2.history)
    for p, r, r2 in zip(PROMPTS, rows, rows2):
        assert r.tokens == r2.tokens == plain_greedy(model, p, 16)


def test_an_empty_row_is_filled_with_its_own_slots(model):
    """RowCache.fill gives a row that has no slot yet (a drafter's row that drafts for the first time) a one-row
    cache's slots as its first ones, widening every row's slots when that cache is longer than they are; the other
    rows keep theirs, and a row that holds slots is refused."""
    from transformers import DynamicCache

    def prefill(ids):
        cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        return cache

    c = RowCache(model.config)
    c.add(None, 0)
    c.add(prefill([1, 2, 3]), 3)
    c.add(None, 0)
    c.fill(2, prefill([4, 5]), 2)  # shorter than the slots: none added
    assert c.lengths() == [0, 3, 2] and c.slots == 3
    long = [6, 7, 8, 9, 10, 11, 12]
    c.fill(0, prefill(long), 7)  # longer: every row's slots widen
    assert c.lengths() == [7, 3, 2] and c.slots == 7
    for row, ids in [(0, long), (1, [1, 2, 3]), (2, [4, 5])]:
        torch.testing.assert_close(c.hf.layers[0].keys[row, :, :len(ids)], prefill(ids).layers[0].keys[0])
        assert c.valid[row].tolist() == [True] * len(ids) + [False] * (7 - len(ids))
    with pytest.raises(ValueError, match="already holds slots"):
        c.fill(1, prefill([1]), 1)
