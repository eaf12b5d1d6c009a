"""Neural arms drafted batched per module (decode/choose/arms/batched.py, issue 32 §1): EAGLE heads (EAGLE-1 and -3)
and drafter models (full vocabulary and a draft vocabulary). Every row's draft is the serial arm's from the same
context, token for token, whatever its batch-mates do; rows stay lossless; a module is loaded once for all rows;
what cannot batch is refused before a model loads."""
import collections

import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.eagle import EagleArm, EagleTreeArm
from decode.choose.arms.eagle.batched import EagleBatch
from decode.choose.arms.early_exit import EarlyExitArm
from decode.choose.arms.model import DrafterModelArm
from decode.choose.arms.union import UnionArm
from decode.choose.heads import EagleHead, EarlyExitDrafter, save_head
from decode.choose.policies import build_policy
from decode.common.errors import UserError
from decode.core import ragged
from decode.core.attention import NAME as ATTENTION
from decode.core.attention import our_attention_model
from decode.core.sampling import SamplingConfig
from decode.core.vocab import DraftVocab
from decode.core.verify import Verifier
from decode.engine.batch import (DRAFTING, BatchEngine, _draft_lengths, _module_depth, best_length,
                                 check_batch_arm_specs, check_batchable)
from helpers import model_costs_only  # noqa: F401  (autouse)
from helpers import TinyTokenizer, plain_greedy, tiny_llama

GREEDY = SamplingConfig()
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9], [5], [3, 3, 8, 3, 3, 8, 3, 3, 8, 3],
           [12, 40, 7, 12, 40, 7, 12, 40, 7, 12, 40, 7, 12, 40], [2, 4]]


@pytest.fixture(scope="module")
def model():  # the engine feeds padded blocks ragged with our attention (decode/core/ragged.py), as a CPU run
    # float64: no near-tie flips between shapes
    return our_attention_model(tiny_llama(vocab=64, layers=4, seed=3, peaked=4.0).double())


def _head(model, fused: bool) -> EagleHead:
    """A head whose every tensor matters (the identity init would hide wrong wiring)."""
    head = EagleHead(model, init="last_layer", feature_layers=(1, 2, 3) if fused else None).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in head.trainable_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype) * (p.abs().mean() + 0.05))
    return head.eval()


def _neural(model, module, sampling, seed=0, L=3):
    """The serial arm of ``module`` (an EAGLE head, or a drafter LM / (LM, draft vocabulary) pair)."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(module, EagleHead):
        return EagleArm(module, model, sampling, L, generator=g, label=f"eagle@{L}")
    if isinstance(module, EarlyExitDrafter):
        return EarlyExitArm(module, sampling, L, g, label=f"early_exit@{L}")
    lm, vocab = module if isinstance(module, tuple) else (module, None)
    return DrafterModelArm(lm, sampling, L, g, vocab=vocab, label=f"drafter@{L}")


def _tree(model, head, sampling, seed=0, L=3):
    """The head's ``expand=1`` dynamic tree: its greedy chain with each depth's runner-up token (6 nodes at L 3)."""
    return EagleTreeArm(head, model, sampling, L, nodes=2 * L, topk=2, expand=1,
                        generator=torch.Generator().manual_seed(seed))


def _engine(model, module, sampling=GREEDY, pool=("neural", "pld:L=3", "none"), policy="random", seed=0, **kw):
    env = ArmEnv(model, TinyTokenizer(64), sampling)
    shared = _neural(model, module, sampling, seed)  # one module for every row (what ArmEnv.once gives built arms)
    if isinstance(module, tuple) and module[1] is not None:
        module = (module[0], shared.pruned)

    def make(s):  # "neural" = L 3, "neural@2": another arm of the same module; "union": it + pld + suffix, 6 nodes;
        # "tree": the head's expand=1 tree (L 3, topk 2: the chain and each depth's runner-up); "tree_union": it + pld
        if s == "union":
            return UnionArm([make("neural"), build_arm("pld:L=2", env), build_arm("suffix:L=3", env)], nodes=6,
                            greedy=sampling.greedy)
        if s == "tree":
            return _tree(model, module, sampling, seed)
        if s == "tree_union":
            return UnionArm([make("tree"), build_arm("pld:L=2", env)], nodes=8, greedy=sampling.greedy)
        if s.startswith("neural"):
            return _neural(model, module, sampling, seed, L=int(s[7:] or 3))
        return build_arm(s, env)

    def make_arms():
        return [make(s) for s in pool]

    seeds = iter(range(seed, seed + 10_000))
    return BatchEngine(model, make_arms, lambda K: build_policy(policy, K, 4, seed=next(seeds)),
                       Verifier(sampling, "torch", torch.Generator().manual_seed(seed)), **kw)


def _spy(monkeypatch) -> list:
    """Record (context, cap, draft) of every draft the batched engine's module makes for arm 0 (a union's: its first
    sub-arm's chain)."""
    seen = []
    propose = BatchEngine._propose_batched

    def spy(self, picks, caps, pieces):
        mine = [b for b, (i, ps) in enumerate(zip(picks, pieces)) if i == 0 and ps[0] is None]
        propose(self, picks, caps, pieces)
        seen.extend((list(self.rows[b].ctx), caps[b], pieces[b][0]) for b in mine)

    monkeypatch.setattr(BatchEngine, "_propose_batched", spy)
    return seen


def _module(model, kind: str):
    if kind in ("eagle1", "eagle3"):
        return _head(model, fused=kind == "eagle3")
    if kind == "early_exit":  # the target's first 2 layers + an exit layer, a draft vocabulary
        return EarlyExitDrafter(model, n_layers=2, draft_vocab=DraftVocab(torch.arange(0, 64, 2), 64)).eval()
    lm = tiny_llama(vocab=64, layers=1, seed=8, peaked=4.0).double()  # a drafter LM of the target's vocabulary
    if kind == "drafter":
        return lm
    return lm, DraftVocab(torch.tensor([i for i in range(64) if i % 3]), 64)  # drafts 2/3 of the ids


KINDS = ["eagle1", "eagle3", "drafter", "drafter-vocab", "early_exit"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_batch", [None, 2])
def test_batched_drafts_are_the_serial_chains_and_rows_stay_lossless(model, monkeypatch, kind, max_batch):
    module = _module(model, kind)
    seen = _spy(monkeypatch)
    fed = []  # per forward of an EAGLE head's batch drafter: whether its block went ragged
    run = EagleBatch._run

    def spy_run(self, *args):
        fed.append(ragged.active() is not None)
        return run(self, *args)

    monkeypatch.setattr(EagleBatch, "_run", spy_run)
    eng = _engine(model, module)
    rows = eng.generate(PROMPTS, 20, max_batch=max_batch)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 20), p
    if kind.startswith("eagle"):  # the head's blocks with padding went ragged, as the target's do
        assert sum(fed) > 5 and not all(fed)
    assert len(eng.drafters) == 1 and not next(iter(eng.drafters.values())).rows  # one drafter, rows all left
    drafted = [s for s in seen if len(s[2])]
    assert len(drafted) > 10 and any(len(s[2]) > 1 for s in drafted)
    assert any(rec.arm == 0 and rec.accepted for r in rows for rec in r.rounds)  # some drafts were accepted
    for ctx, cap, draft in seen:  # the serial arm from the same context (EAGLE: its features from a full forward)
        serial = _neural(model, module, GREEDY).propose(ctx, cap)
        assert draft.tokens.tolist() == serial.tokens.tolist(), ctx
        if len(draft) and kind.startswith("eagle"):
            torch.testing.assert_close(draft.hidden, serial.hidden.to(draft.hidden.dtype))


@pytest.mark.parametrize("kind", ["eagle3", "drafter"])
def test_one_engine_decodes_batch_after_batch(model, kind):
    """An engine kept across batches (a server's; an evaluation's method across its segments): after every row of
    one batch has left, the next batch's rows draft and stay lossless on the same drafters."""
    eng = _engine(model, _module(model, kind))
    for prompts in (PROMPTS, PROMPTS[::-1][:3]):
        rows = eng.generate(prompts, 12, max_batch=2)
        for p, r in zip(prompts, rows):
            assert r.tokens == plain_greedy(model, p, 12), p
        assert not next(iter(eng.drafters.values())).rows and not eng.rows
    assert any(len(h.rows) and max(h.drafted) for h in eng.history[-5:])  # the second batch drafted too


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "drafter"])
@pytest.mark.parametrize("length", ["fixed", "cost"])
def test_union_rows_draft_the_serial_unions_trees_and_stay_lossless(model, monkeypatch, kind, length):
    """A union of a module's chain with lookups, batched: the module drafts its chain with every row's, the row's
    lookups draft theirs, and the tree they merge into is verified in the batch's one forward (per-node positions,
    ancestor masks, the accepted path kept); what the module drafted is the serial arm's chain, and rows stay their
    plain greedy decoding (length=cost: trees cut to the joint number of positions)."""
    module = _module(model, kind)
    seen = _spy(monkeypatch)
    trees = []
    combine = UnionArm.combine
    monkeypatch.setattr(UnionArm, "combine", lambda self, drafts, cut=None: trees.append(combine(self, drafts, cut))
                        or trees[-1])
    eng = _engine(model, module, pool=("union", "pld:L=3", "none"), policy="ucbspec" if length == "cost" else "random",
                  length=length)
    if length == "cost":  # positions nearly free, so K > 0 and trees get cut (a tiny model's own costs are noise)
        eng._steps = lambda context, modules, **_: (lambda w, n=None: 1.0 + 0.01 * (w - 1))
    rows = eng.generate(PROMPTS, 20, max_batch=4)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 20), p
    assert any(t.is_tree for t in trees) and all(len(t) <= 6 for t in trees)
    assert any(rec.arm == 0 and rec.accepted for r in rows for rec in r.rounds)
    if length == "fixed":  # a tree wider than its depth went through one forward
        assert any(h.width > 4 for h in eng.history)
    for ctx, cap, draft in seen:
        assert draft.tokens.tolist() == _neural(model, module, GREEDY).propose(ctx, min(3, cap)).tokens.tolist(), ctx


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("pool, length", [(("tree", "pld:L=3", "none"), "fixed"), (("tree", "pld:L=3", "none"), "cost"),
                                          (("tree_union", "neural", "none"), "fixed")])
def test_expand_one_trees_draft_batched_as_the_serial_tree_and_rows_stay_lossless(model, monkeypatch, kind, pool,
                                                                                   length):
    """An EAGLE tree that expands one node a depth (the chain and its runner-ups) drafts with the head's other rows:
    the tree is the serial arm's from the same context (tokens and shape), alone or in a union, and rows stay their
    plain greedy decoding (length=cost: 2 positions pay, so the trees, drafted 2 deep, are cut to their 2 most
    valuable nodes, and what each node rank yields is learnt: every accepted node counted once at its rank)."""
    head = _module(model, kind)
    seen = _spy(monkeypatch)
    eng = _engine(model, head, pool=pool, policy="ucbspec" if length == "cost" else "random", length=length)
    if length == "cost":  # up to 2 draft positions cost what 1 does, more cost 10 (a tiny model's own costs are noise)
        eng._steps = lambda context, modules, **_: (lambda w, n=None: 1.0 if w <= 3 else 10.0)
    rows = eng.generate(PROMPTS, 20, max_batch=4)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 20), p
    assert len(eng.drafters) == 1  # the tree and the chain (tree_union's pool) share the head's drafter
    trees = [s for s in seen if s[2].is_tree]
    assert len(trees) > 5 and any(len(s[2]) == (4 if length == "cost" else 6) for s in trees)
    assert any(rec.arm == 0 and rec.accepted for r in rows for rec in r.rounds)
    if length == "cost":  # every draft cut to 2 positions, trees 4 nodes wide among them
        assert max(max(h.drafted) for h in eng.history) == 2
        ranks, (accepted, _) = eng.acceptance.ranks[0], eng.acceptance.shared[0]
        assert len(ranks) == 2 and sum(hits for _, hits in ranks) == accepted > 0
        assert all(0 <= hits <= drafted for drafted, hits in ranks) and ranks[0][0] >= ranks[1][0]
    for ctx, cap, draft in seen:
        serial = _tree(model, head, GREEDY).propose(ctx, min(3, cap))
        assert draft.tokens.tolist() == serial.tokens.tolist(), ctx
        assert (draft.parents is None) == (serial.parents is None), ctx  # None: an empty draft
        if draft.parents is not None:
            assert draft.parents.tolist() == serial.parents.tolist(), ctx


@pytest.mark.parametrize("kind", ["eagle1", "drafter-vocab"])
def test_sampled_draft_distributions_are_the_serial_chains(model, monkeypatch, kind):
    """Under sampling a draft's first-position distribution (what the verifier divides by) is the serial arm's."""
    cfg = SamplingConfig(temperature=0.9, top_k=20)
    module = _module(model, kind)
    seen = _spy(monkeypatch)
    rows = _engine(model, module, sampling=cfg, seed=5).generate(PROMPTS, 16)
    assert all(len(r.tokens) == 16 for r in rows)
    drafted = [s for s in seen if len(s[2])]
    assert len(drafted) > 5
    for ctx, cap, draft in drafted:
        serial = _neural(model, module, cfg).propose(ctx, cap)
        torch.testing.assert_close(draft.q[0], serial.q[0])


@pytest.mark.parametrize("kind", ["eagle1", "drafter"])
def test_joint_lengths_cut_module_drafts_before_they_are_drafted(model, monkeypatch, kind):
    """length=cost: the module drafts min(its cap, the joint K) tokens (never more, to be cut afterwards), and does
    not run at all in a round whose K is 0; rows stay lossless."""
    module = _module(model, kind)
    seen = _spy(monkeypatch)
    eng = _engine(model, module, policy="ucbspec", length="cost")
    rows = eng.generate(PROMPTS, 20, max_batch=4)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 20), p
    played = [(h, b) for h in eng.history for b, rid in enumerate(h.rows)]
    assert any(h.width == 1 for h, _ in played) and any(h.width > 1 for h, _ in played)  # K moved, 0 included
    for ctx, cap, draft in seen:
        assert cap <= 3 and len(draft) == (0 if kind == "eagle1" and len(ctx) == 1 else cap)  # EAGLE needs 2 tokens
        assert draft.tokens.tolist() == _neural(model, module, GREEDY).propose(ctx, cap).tokens.tolist(), ctx


@pytest.mark.parametrize("kind", ["eagle1", "drafter"])
def test_two_arms_of_one_module_share_its_drafter(model, monkeypatch, kind):
    """eagle@3 and eagle@2 of one head (or two lengths of one drafter): one batch drafter, fed once per round."""
    module = _module(model, kind)
    seen = _spy(monkeypatch)
    eng = _engine(model, module, pool=("neural", "neural@2", "pld:L=3"))
    rows = eng.generate(PROMPTS, 20)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 20), p
    assert len(eng.drafters) == 1
    assert {rec.arm for r in rows for rec in r.rounds} == {0, 1, 2}
    for ctx, cap, draft in seen:
        assert draft.tokens.tolist() == _neural(model, module, GREEDY).propose(ctx, cap).tokens.tolist(), ctx


@pytest.mark.parametrize("kind", ["eagle1", "drafter"])
def test_rows_without_the_module_and_rows_joining_mid_flight(model, kind):
    """A server row may serve an arm subset without the module (its drafter keeps an empty row for it), and rows
    join between rounds; everything stays each row's plain greedy decoding."""
    eng = _engine(model, _module(model, kind))
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    done = {}
    first = [eng.add(p, 20) for p in PROMPTS[:2]]
    plain = eng.add(PROMPTS[2], 20, arms=[build_arm("pld:L=2", env)], policy=build_policy("random", 1, 4))
    for _ in range(3):
        done.update({r.rid: r for r in eng.step()})
    late = [eng.add(p, 12) for p in PROMPTS[3:]]
    while eng.rows:
        done.update({r.rid: r for r in eng.step()})
        d = next(iter(eng.drafters.values()))
        assert d.rows == len(eng.rows) == d.cache.rows
    for rid, p in zip(first + [plain] + late, PROMPTS):
        assert done[rid].tokens == plain_greedy(model, p, 12 if rid in late else 20), p


@pytest.mark.parametrize("kind", ["eagle3", "drafter"])
def test_a_module_runs_for_the_rows_that_draft_with_it_only(model, monkeypatch, kind):
    """Nothing is fed to a module before a row drafts with it: rows whose policy never plays it leave it idle (their
    entries wait), a row's first draft feeds its prompt and the tokens since in a forward of its own, and the
    catch-ups after it hold the drafting rows' entries only; drafts are the serial chains and rows stay lossless."""
    module = _module(model, kind)
    seen = _spy(monkeypatch)
    eng = _engine(model, module)
    calls = []  # per forward of the module: (rows, width) of a row fed alone, the rows with real entries else
    drafter_cls = type(eng._drafter(eng.make_arms()[0]))
    run, forward = drafter_cls._run, drafter_cls._forward
    monkeypatch.setattr(drafter_cls, "_run", lambda self, ids, extra, pos, cache, mask: (
        mask is None and calls.append(tuple(ids.shape))) or run(self, ids, extra, pos, cache, mask))
    monkeypatch.setattr(drafter_cls, "_forward", lambda self, ids, extra, pos, valid: calls.append(
        valid.any(1).nonzero().flatten().tolist()) or forward(self, ids, extra, pos, valid))
    idle = [eng.add(p, 12, policy=build_policy("fixed:arm=2", 3, 4)) for p in PROMPTS[:3]]  # arm 2: none
    for _ in range(4):
        eng.step()
    assert not calls  # no row drafted with the module: it never ran
    late = eng.add(PROMPTS[4], 12, policy=build_policy("fixed:arm=0", 3, 4))  # plays the module from its first round
    done = {r.rid: r for r in eng.step()}
    off = 0 if kind == "drafter" else 1  # EAGLE's entries start at the prompt's second token
    assert calls[0] == (1, len(PROMPTS[4]) - off)  # its prompt alone, no other row padded in
    d = next(iter(eng.drafters.values()))
    assert d.entries[:3] == [0, 0, 0] and all(d.pending[:3])  # the idle rows' entries wait
    while eng.rows:
        done.update({r.rid: r for r in eng.step()})
    assert len(calls) > 3 and all(len(c) == 1 for c in calls[1:])  # catch-ups and draft steps: the late row's only
    for rid, p in zip(idle + [late], PROMPTS[:3] + [PROMPTS[4]]):
        assert done[rid].tokens == plain_greedy(model, p, 12), p
    assert seen and all(ctx[:len(PROMPTS[4])] == PROMPTS[4] for ctx, _, _ in seen)
    for ctx, cap, draft in seen:
        assert draft.tokens.tolist() == _neural(model, module, GREEDY).propose(ctx, cap).tokens.tolist(), ctx


def test_a_rows_first_feed_is_not_counted_as_the_modules_drafting_cost(model, monkeypatch):
    """length=cost learns what a module's forward costs from the rounds that draft with it; a row's first draft also
    feeds its prompt alone, one-off work that must not enter that estimate (it is the round's housekeeping). With
    that feed made to take 0.3 s, the estimate stays at the forwards' own time."""
    import time
    run = EagleBatch._run  # a forward without a mask is a row fed alone
    monkeypatch.setattr(EagleBatch, "_run", lambda self, ids, extra, pos, cache, mask: (
        mask is None and time.sleep(0.3)) or run(self, ids, extra, pos, cache, mask))
    eng = _engine(model, _module(model, "eagle3"), policy="fixed:arm=0", length="cost")
    # drafting pays: the module runs
    eng._steps = lambda context, modules, **_: (lambda w, n=None: 1.0 + 0.01 * (w - 1))
    rows = eng.generate(PROMPTS[:3], 8)
    for p, r in zip(PROMPTS[:3], rows):
        assert r.tokens == plain_greedy(model, p, 8), p
    d = next(iter(eng.drafters.values()))
    assert d.fed_seconds >= 0.9  # three rows' prompts, each fed once
    assert eng.module_seconds and max(eng.module_seconds.values()) < 0.03  # (with the feeds: > 0.05)


def test_modules_load_once_per_env_and_what_cannot_batch_is_refused(tmp_path, tiny_target_dir):
    from decode.core.models import load_model

    model, tok = load_model(tiny_target_dir)
    save_head(EagleHead(model), tmp_path / "h")
    env = ArmEnv(model, tok, GREEDY)
    a, b = (build_arm(f"eagle:path={tmp_path / 'h'},L=2", env) for _ in range(2))
    assert a.head is b.head and a.cache is not b.cache  # one module, a cache per arm instance
    c, d = (build_arm(f"drafter:path={tiny_target_dir},L=2", env) for _ in range(2))
    assert c.model is d.model and c.cache is not d.cache
    save_head(EarlyExitDrafter(model, n_layers=1), tmp_path / "x")
    e, f = (build_arm(f"early_exit:path={tmp_path / 'x'},L=2", env) for _ in range(2))
    assert e.model is f.model
    check_batchable([a, c, e, build_arm("pld:L=2", env)])
    check_batch_arm_specs([f"early_exit:path={tmp_path / 'x'}"])
    check_batch_arm_specs([f"eagle:path={tmp_path / 'h'},L=2", "suffix:L=3", f"drafter:path={tiny_target_dir}"])
    tree = f"eagle:path={tmp_path / 'h'},L=3,tree=dynamic,topk=2,expand=1"  # the chain and its runner-ups batch
    check_batch_arm_specs([tree, f"union:arms={tree.replace(',', ':')}+pld:L=4,nodes=10"])
    check_batchable([build_arm(tree, env)])
    assert _draft_lengths(build_arm(tree, env), 2) == (2, 2)  # two nodes a depth: counted as two chains
    assert _draft_lengths(build_arm(f"union:arms={tree.replace(',', ':')}+pld:L=4", env), 4) == (3, 3, 4)
    for spec in (f"eagle:path={tmp_path / 'h'},tree=dynamic", f"eagle:path={tmp_path / 'h'},K=2",
                 f"eagle:path={tmp_path / 'h'},tree=dynamic,expand=2",
                 f"eagle:path={tmp_path / 'h'},counterfactual=true", f"drafter:path={tiny_target_dir},K=2"):
        with pytest.raises(UserError, match="chains of EAGLE heads, drafter models and early-exit layers"):
            check_batch_arm_specs([spec])
    with pytest.raises(UserError, match="serially only"):
        check_batchable([build_arm(f"eagle:path={tmp_path / 'h'},tree=dynamic", env)])
    union = f"union:arms=eagle:path={tmp_path / 'h'}:L=2+pld:L=3+drafter:path={tiny_target_dir}"
    check_batch_arm_specs([union])  # a union batches when each of its arms does
    check_batchable([build_arm(union, env)])
    with pytest.raises(UserError, match="a union batches when each of its arms does.*serially only"):
        check_batch_arm_specs([f"union:arms=eagle:path={tmp_path / 'h'}:tree=dynamic+pld"])
    with pytest.raises(UserError, match=r"eagle_tree.*\(in union"):
        check_batchable([build_arm(f"union:arms=eagle:path={tmp_path / 'h'}:tree=dynamic+pld", env)])
    with pytest.raises(UserError, match="drafts twice with one module"):
        check_batchable([build_arm(f"union:arms=eagle:path={tmp_path / 'h'}:L=2+eagle:path={tmp_path / 'h'}:L=3", env)])


@pytest.mark.parametrize("fused", [False, True])
def test_a_head_in_bfloat16_stays_lossless_serially_and_batched_and_leaves_the_target_alone(tmp_path, fused):
    """eagle:...,dtype=bfloat16: its own head object in that dtype (the target's shared embedding and LM head keep
    theirs); serial and batched decoding with it equal plain greedy."""
    from decode.choose.policies.simple import Fixed
    from decode.engine.loop import SpecEngine
    from decode.core.target import Target

    model = tiny_llama(vocab=64, layers=4, seed=3, peaked=4.0)  # float32, as a CPU target runs
    save_head(_head(model.double(), fused).float(), tmp_path / "h")
    model.float()
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    spec = f"eagle:path={tmp_path / 'h'},L=3"
    a, b = build_arm(spec + ",dtype=bfloat16", env), build_arm(spec, env)
    assert a.head is not b.head and a.batch_key != b.batch_key
    assert {p.dtype for p in a.head.parameters()} == {torch.bfloat16} and a.dtype == torch.bfloat16
    assert model.get_input_embeddings().weight.dtype == model.get_output_embeddings().weight.dtype == torch.float32
    target = Target(model, TinyTokenizer(64), want_hidden=True)
    a.target = target
    eng = SpecEngine(target, [a], Verifier(GREEDY, "torch"), set())
    for p in PROMPTS[:3]:
        g = eng.generate(p, Fixed(1, eng.max_len), 12)
        assert g.tokens == plain_greedy(model, p, 12), p
        assert sum(r.drafted for r in g.rounds) > 0
    seeds = iter(range(10_000))
    batched = BatchEngine(model, lambda: [build_arm(spec + ",dtype=bfloat16", env)],
                          lambda K: build_policy("fixed:arm=0", K, 3, seed=next(seeds)), Verifier(GREEDY, "torch"))
    for p, r in zip(PROMPTS, batched.generate(PROMPTS, 12, max_batch=4)):
        assert r.tokens == plain_greedy(model, p, 12), p
    with pytest.raises(UserError, match="dtype must be auto"):
        build_arm(spec + ",dtype=int8", env)


def test_a_ragged_head_drafter_runs_our_attention_on_a_copy_sharing_the_heads_weights():
    """Where the engine feeds ragged blocks, an EAGLE head's batch drafter does too: its stack runs our attention
    (which unpacks them) on a copy; the head the serial arm runs keeps its attention, and no weight is copied."""
    target = tiny_llama(vocab=64, layers=4, seed=3)
    head = _head(target.double(), fused=True)
    drafter = EagleBatch(head)
    assert not drafter.ragged and drafter.feed_ragged() and drafter.ragged
    assert drafter.head.model.layers[0].self_attn.config._attn_implementation == ATTENTION
    assert head.model.layers[0].self_attn.config._attn_implementation != ATTENTION
    ours = dict(drafter.head.named_parameters())
    assert {n: p.data_ptr() for n, p in head.named_parameters()} == {n: p.data_ptr() for n, p in ours.items()}
    assert drafter.head.embed is head.embed and drafter.head.lm_head is head.lm_head


@pytest.mark.parametrize("kernel,packed_from", [("onednn", 1), ("stream", 1), ("stream", 3)])
def test_packed_linears_reach_the_arms_modules_never_the_stock_target(kernel, packed_from):
    """With a target running packed linears (either kernel, alone or ``mixed``: stock below ``packed_from`` rows), a
    batch drafter's own modules are packed as the serial engine packs them, the same way; the stock target's layers,
    which an early-exit stack runs, stay as loaded."""
    from decode.core.linear import PackedLinear, kernel_usable, linear_model

    model = tiny_llama(vocab=64, layers=4, seed=3)
    why = kernel_usable(kernel, "cpu", torch.float32)
    if why is not None:
        pytest.skip(why)
    head = EarlyExitDrafter(model, n_layers=2).eval()
    run = linear_model(model, kernel)
    for m in run.modules():
        if isinstance(m, PackedLinear):
            m.packed_from = packed_from
    eng = BatchEngine(run, lambda: [EarlyExitArm(head, GREEDY, 2)], lambda K: build_policy("fixed:arm=0", K, 2),
                      Verifier(GREEDY, "torch"), stock_model=model)
    rows = eng.generate(PROMPTS[:3], 8)
    assert [r.tokens for r in rows] == [plain_greedy(model, p, 8) for p in PROMPTS[:3]]
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    for linear in (head.lm_head, head.model.layers[2].mlp.down_proj):
        assert isinstance(linear, PackedLinear) and (linear.kernel, linear.packed_from) == (kernel, packed_from)
    assert head.model.layers[0] is model.model.layers[0]  # the shared target layer, not packed in place


@pytest.mark.slow
def test_sampled_union_rows_follow_the_targets_distribution():
    """Recursive rejection sampling over a batched row's tree (a sampled EAGLE chain merged with a lookup chain that
    is usually wrong): the row's first two tokens follow the target's own joint distribution (chi-square against the
    exact probabilities), batch-mates present."""
    from scipy.stats import chisquare

    m = tiny_llama(vocab=8, hidden=16, layers=1, seed=5).double()
    head = EagleHead(m, init="last_layer").double().eval()
    cfg = SamplingConfig(temperature=1.0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # pld proposes 3, 1, 2
    with torch.inference_mode():
        p1 = torch.softmax(m(torch.tensor([prompt])).logits[0, -1], -1)
        p2 = torch.softmax(m(torch.tensor([prompt + [t] for t in range(8)])).logits[:, -1], -1)
    exact = (p1[:, None] * p2).reshape(-1)  # P(t1, t2)
    env = ArmEnv(m, TinyTokenizer(8), cfg)
    counts = collections.Counter()
    n = 0
    for seed in range(150):
        g = torch.Generator().manual_seed(seed)
        eng = BatchEngine(m, lambda: [UnionArm([EagleArm(head, m, cfg, 2, generator=g), build_arm("pld:L=3", env)],
                                               nodes=5, greedy=False)],
                          lambda K: build_policy("fixed:arm=0", K, 4),
                          Verifier(cfg, "torch", torch.Generator().manual_seed(seed)))
        rows = eng.generate([prompt] * 8 + [[4, 5, 6, 4, 5]], 3)  # the first round drafts 2 deep (1 token left)
        assert eng.history[0].width > 3  # trees went through the batch
        for r in rows[:8]:
            counts[r.tokens[0] * 8 + r.tokens[1]] += 1
            n += 1
    obs = torch.tensor([counts[k] for k in range(64)], dtype=torch.float64)
    exp = exact * n
    keep = exp >= 5
    pval = chisquare(obs[keep].numpy(), (exp[keep] / exp[keep].sum() * obs[keep].sum()).numpy()).pvalue
    assert pval > 1e-3, (obs.tolist(), exp.tolist())


@pytest.mark.parametrize("module_seconds, eagle_drafts", [(1.0, False), (0.0, True)])
def test_cost_lengths_count_the_modules_own_forwards(model, monkeypatch, module_seconds, eagle_drafts):
    """length=cost weighs a module's chain with its own forwards (a catch-up and one per draft position, at their
    measured seconds): when those cost far more than the block's extra positions, the head's rows do not draft while
    a lookup's rows still do; when they are free, the head drafts. Lossless either way."""
    seen = _spy(monkeypatch)
    eng = _engine(model, _module(model, "eagle1"), pool=("neural", "pld:L=3"), policy="random", length="cost")
    eng.block_steps = lambda B, W, context, n=None: 1.0 + 0.05 * (W - 1)  # extra positions nearly free
    eng.overhead_steps = lambda B, w, one, **_: 0.0  # and no round work beside the forwards
    ids = [eng.add(p, 16) for p in PROMPTS[:4]]
    done = {}
    while eng.rows:
        eng.module_seconds = {n: module_seconds for n in range(1, 5)}  # what the rounds measure, pinned
        done.update({r.rid: r for r in eng.step()})
    for rid, p in zip(ids, PROMPTS):
        assert done[rid].tokens == plain_greedy(model, p, 16), p
    assert any(len(d) for _, _, d in seen) == eagle_drafts
    assert any(rec.arm == 1 and rec.drafted for rid in ids for rec in done[rid].rounds)  # the lookup drafts


def test_a_tree_cut_to_k_nodes_costs_its_module_the_forwards_of_its_heads_chain(model):
    """A union's draft (or an EAGLE tree's) cut to K positions has its head draft a chain to depth min(K, L), so
    length=cost charges the module 1 + min(K, L) forwards, not 1 + K: with a head forward at 0.3 of a step and
    extra positions free, the union (head chain of 3 + pld:L=2 + suffix:L=3) drafts all its nodes, where 1 + K
    forwards stopped it at 3."""
    eng = _engine(model, _module(model, "eagle1"), pool=("union", "tree", "neural@2", "pld:L=3", "none"),
                  policy="fixed:arm=0", length="cost")
    eng.add(PROMPTS[0], 16)
    row = eng.rows[0]
    assert [_module_depth(row, i, 6) for i in range(5)] == [3, 3, 2, 0, 0]  # a part drafts up to its own L
    assert [_module_depth(row, i, 1) for i in range(5)] == [1, 1, 1, 0, 0]
    eng.block_steps = lambda B, W, context, n=None: 1.0
    eng.overhead_steps = lambda B, w, one, **_: 0.0
    eng._one_seconds = lambda B, context: 0.1
    eng.module_seconds = {1: 0.03}
    assert eng._steps(300, 1, depth=3)(7) == pytest.approx(1 + 4 * 0.3)  # a catch-up and 3 draft steps
    assert eng._steps(300, 1)(7) == pytest.approx(1 + 7 * 0.3)  # a chain: one per position
    eng.acceptance.rng = None  # posterior means: no data, α = 1/2, so a node at depth d is worth 2^-d
    shape = _draft_lengths(row.arms[0], 6)
    assert shape == (3, 2, 3)
    gains = eng._gains([0], [shape])
    assert best_length(gains, [shape], eng._steps(300, 1))[0] == 3  # charged 1 + K forwards
    caps, _, K = eng._module_rows_draft([6], [0], 300)
    assert caps == [6] and K == 8  # every node: past the head's depth more nodes cost it nothing
    eng.rows = []


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_a_prefix_cache_prefills_only_what_is_new_and_the_head_drafts_as_without(model, kind):
    """Batched rows whose prompts repeat or extend an earlier request's prompt *and answer* take those positions'
    keys, values and head features from the prefix cache (decode/core/prefix_cache.py; a finished row is kept whole):
    every row equals plain greedy and drafts exactly what an engine without the cache drafts, so the head read the
    same features."""
    from decode.core.prefix_cache import PrefixCache

    module = _module(model, kind)
    plain, cached = (_engine(model, module, policy="fixed:arm=0") for _ in range(2))
    cached.prefix_cache = PrefixCache(2 ** 24)
    base = PROMPTS[0]
    answer = plain_greedy(model, base, 12)
    other = (answer[0] + 1) % 64  # a continuation of the prompt that is not its answer
    cases = [(base, 0), (base, len(base) - 1),  # a repeat: the first request's prompt and answer are kept
             (base + [other, 9, 11, 7], len(base)),  # an extension: the whole prompt, not the answer
             (base + answer + [5, 6], len(base) + len(answer) - 1),  # a chat's next turn: the prompt and answer
             (PROMPTS[3], 0), (base[:6], 5)]  # another prompt; one sharing the first 5 of its 5 positions
    for p, reused in cases:  # one at a time, as requests join
        want, got = plain.generate([p], 12)[0], cached.generate([p], 12)[0]
        assert cached.prefix_reused == reused, p
        assert got.tokens == want.tokens == plain_greedy(model, p, 12), p
        assert [(r.drafted, r.accepted) for r in got.rounds] == [(r.drafted, r.accepted) for r in want.rounds], p
        assert sum(r.drafted for r in got.rounds) > 0


def test_a_row_that_ends_early_is_kept_only_when_it_ended_not_when_cancelled(model):
    """A row the server removes at a stop string (``remove(rid, remember=True)``) is kept in the prefix cache with
    what it generated so far; a cancelled one (``remove(rid)``) is not. The next turn is still plain greedy."""
    from decode.core.prefix_cache import PrefixCache

    eng = _engine(model, _module(model, "eagle3"), policy="fixed:arm=0")
    eng.prefix_cache = PrefixCache(2 ** 24)
    ended = []
    for p, remember in ((PROMPTS[1], True), (PROMPTS[2], False)):
        rid = eng.add(p, 12)
        eng.step()
        eng.step()
        ended.append(eng.remove(rid, remember=remember).ctx)
    for ctx, reused in ((ended[0], len(ended[0]) - 1), (ended[1], len(PROMPTS[2]) - 1)):  # the prompt's entry only
        nxt = ctx + [5, 6]
        got = eng.generate([nxt], 8)[0]
        assert eng.prefix_reused == reused
        assert got.tokens == plain_greedy(model, nxt, 8)


@pytest.mark.parametrize("cache,kind", [("dynamic", "eagle1"), ("prefix", "eagle3"), ("static", "eagle3")])
def test_the_serial_engine_reuses_a_cached_prompt_prefix_and_drafts_as_without(model, cache, kind):
    """The one-at-a-time engine (``decode serve --max-batch 1``) takes a prompt's cached positions into each kind of
    KV cache and the head's features from the prefix cache, a finished request's answer too: outputs equal plain
    greedy and the rounds are those of an engine without it."""
    from decode.choose.policies.simple import Fixed
    from decode.core.prefix_cache import PrefixCache
    from decode.core.target import Target
    from decode.engine.loop import SpecEngine

    head = _module(model, kind)
    engines = []
    for _ in range(2):
        arm = _neural(model, head, GREEDY)
        arm.target = target = Target(model, TinyTokenizer(64), want_hidden=True, cache=cache)
        engines.append(SpecEngine(target, [arm], Verifier(GREEDY, "torch"), set(), step_time=1.0))
    plain, cached = engines
    cached.target.prefix_cache = PrefixCache(2 ** 24)
    base = PROMPTS[4]
    answer = plain_greedy(model, base, 12)
    other = (answer[0] + 1) % 64  # a continuation of the prompt that is not its answer
    for p, reused in ((base, 0), (base, len(base) - 1), (base + [other, 3, 8], len(base)),
                      (base + answer + [5, 6], len(base) + len(answer) - 1),  # the next turn: prompt and answer
                      (PROMPTS[1], 0), (base[:4] + [9, 9], 4)):
        want, got = (e.generate(p, Fixed(1, e.max_len), 12) for e in engines)
        assert got.tokens == want.tokens == plain_greedy(model, p, 12), p
        assert cached.target.prefix_reused == reused
        assert [(r.drafted, r.accepted) for r in got.rounds] == [(r.drafted, r.accepted) for r in want.rounds], p
        # the head read the features a prefill of the whole prompt gives (float64: summation order only)
        assert torch.allclose(cached.arms[0].feats, plain.arms[0].feats, rtol=0, atol=1e-9), p


def test_a_backlogs_catch_up_is_not_counted_as_the_modules_drafting_cost(model, monkeypatch):
    """A row that drafted otherwise for a while (here: no draft) has a backlog of entries the module has not read; the
    catch-up that feeds them pays off those rounds. Counted as a module forward's cost it made the module dearer the
    longer rows had not drafted with it, so they drafted with it less and the backlogs grew. With catch-ups wider than
    BACKLOG made to take 1 s, the estimate stays at the forwards' own time, and the second stays the round's: its
    cost correction reads it."""
    import time
    from decode.choose.arms.batched import BACKLOG
    eng = _engine(model, _module(model, "eagle3"), length="cost")
    eng._steps = lambda context, modules, **_: (lambda w, n=None: 1.0 + 0.01 * (w - 1))  # drafting pays
    drafter_cls = type(eng._drafter(eng.make_arms()[0]))
    forward, widths = drafter_cls._forward, []

    def slow(self, ids, extra, pos, valid):
        widths.append(ids.shape[1])
        if ids.shape[1] > BACKLOG:
            time.sleep(1.0)
        return forward(self, ids, extra, pos, valid)
    monkeypatch.setattr(drafter_cls, "_forward", slow)
    rid = eng.add(PROMPTS[0], 40, policy=build_policy("fixed:arm=0", 3, 4))
    eng.step()  # drafts with the module: its prompt fed alone
    row = eng.rows[0]
    row.policy = build_policy("fixed:arm=2", 3, 4)  # none: one token a round, each waiting for the module
    for _ in range(BACKLOG + 2):
        eng.step()
    row.policy = build_policy("fixed:arm=0", 3, 4)
    done = {}
    while eng.rows:
        done.update({r.rid: r for r in eng.step()})
    assert max(widths) > BACKLOG  # the backlog was caught up in one forward
    assert done[rid].tokens == plain_greedy(model, PROMPTS[0], 40)
    d = next(iter(eng.drafters.values()))
    assert d.backlog_seconds >= 1.0 and d.fed_seconds < 1.0  # not a first feed's one-off work
    assert eng.module_seconds and max(eng.module_seconds.values()) < 0.03  # (with the backlog: > 0.05)
    assert max(eng._calibration[(1, DRAFTING)]) > 5  # the round that caught up: 1 s against a modelled few ms
