"""The retrieval (REST) arm: its index against brute force, its drafts, and greedy/sampled losslessness."""
import gzip
import json
import random
from collections import Counter

import numpy as np
import pytest

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.retrieval import RetrievalArm, TokenStore, load_store
from decode.common.answers import FORMAT, RECORD
from decode.common.errors import UserError
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.tree import leaf_chains
from decode.core.verify import Verifier
from decode.choose.policies import build_policy
from decode.engine.loop import SpecEngine
from helpers import TinyTokenizer, plain_greedy, tiny_llama


def _occurrences(docs, query):
    """Every (doc, start) where ``query`` occurs."""
    m = len(query)
    return [(i, s) for i, d in enumerate(docs) for s in range(len(d) - m + 1) if d[s:s + m] == query]


def _brute_longest(docs, context, max_match, min_match):
    for m in range(min(max_match, len(context)), min_match - 1, -1):
        if _occurrences(docs, context[len(context) - m:]):
            return m
    return 0


def _brute_chain(docs, context, L, max_match, min_match):
    """REST's chain by definition: the most frequent next token over every occurrence (ties: the smaller token)."""
    m = _brute_longest(docs, context, max_match, min_match)
    if m == 0:
        return m, []
    occ = [(i, s + m) for i, s in _occurrences(docs, context[len(context) - m:])]
    chain = []
    for _ in range(L):
        nxt = Counter(docs[i][p] for i, p in occ if p < len(docs[i]))
        if not nxt:
            break
        tok = min(nxt, key=lambda t: (-nxt[t], t))
        chain.append(tok)
        occ = [(i, p + 1) for i, p in occ if p < len(docs[i]) and docs[i][p] == tok]
    return m, chain


def test_store_and_chain_match_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        docs = [[rng.randrange(4) for _ in range(rng.randrange(0, 30))] for _ in range(rng.randrange(1, 5))]
        store = TokenStore(docs, depth=10)
        assert len(store) == sum(map(len, docs))
        arm = RetrievalArm(store, L=3, max_match=6, min_match=1)
        for _ in range(5):
            ctx = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]  # token 4 never occurs in the store
            m, chain = _brute_chain(docs, ctx, 3, 6, 1)
            assert store.longest_suffix(ctx, 6, 1)[0] == m, (docs, ctx)
            assert arm.propose(ctx, 3).tokens.tolist() == chain, (docs, ctx)
            assert arm.last_match == m


def test_continuations_never_cross_documents_and_respect_budgets():
    store = TokenStore([[1, 2, 3], [1, 2, 9, 9, 9]])
    arm = RetrievalArm(store, L=4, min_match=2)
    # "1 2" is followed by 3 (then the end of its answer) once and by 9 9 9 once: the tie goes to the smaller
    # token, and the chain stops where that answer ends instead of running into the next one
    assert arm.propose([5, 1, 2], 4).tokens.tolist() == [3]
    assert arm.propose([5, 2, 9], 4).tokens.tolist() == [9, 9]
    assert arm.propose([5, 2, 9], 1).tokens.tolist() == [9]
    assert len(arm.propose([7, 7], 4)) == 0 and arm.last_match == 0
    assert len(RetrievalArm(store, L=0).propose([1, 2], 4)) == 0


def test_tree_keeps_the_most_frequent_trie_nodes():
    docs = [[1, 2, 3, 4]] * 5 + [[1, 2, 3, 5]] * 3 + [[1, 2, 6, 7]] * 2 + [[1, 2, 8]]
    store = TokenStore(docs)
    tree = RetrievalArm(store, L=3, nodes=5, min_match=2).propose([0, 1, 2], 8)
    # counts: 3 (8), 3-4 (5), 3-5 (3), 6 (2), 6-7 (2), 8 (1): the five most frequent nodes, a tree
    assert sorted(c.tokens.tolist() for c in leaf_chains(tree)) == [[3, 4], [3, 5], [6, 7]]
    assert len(tree) == 5 and tree.q is None
    assert tree.tokens[0].item() == 3  # the most frequent chain leads (a cut keeps the chain's draft)
    chain = RetrievalArm(store, L=3, nodes=1, min_match=2).propose([0, 1, 2], 8)
    assert chain.tokens.tolist() == [3, 4]
    shallow = RetrievalArm(store, L=3, nodes=5, min_match=2).propose([0, 1, 2], 1)  # max_len caps the depth
    assert shallow.tokens.tolist() == [3, 6, 8]


def test_bad_settings_fail_fast(tmp_path):
    store = TokenStore([[1, 2, 3]], depth=8)
    with pytest.raises(UserError, match="max_match"):
        RetrievalArm(store, L=4, max_match=6)
    with pytest.raises(UserError, match="min_match"):
        RetrievalArm(store, L=2, max_match=2, min_match=3)
    with pytest.raises(UserError, match="holds no answers"):
        load_store(str(tmp_path))
    env = ArmEnv(tiny_llama(seed=1), TinyTokenizer(64), SamplingConfig())
    with pytest.raises(UserError, match="store"):
        build_arm("rest:L=4", env)


def _answers_folder(folder, docs):
    folder.mkdir(exist_ok=True)
    (folder / RECORD).write_text(json.dumps({"format": FORMAT, "tasks": {"chat": {}}}))
    with gzip.open(folder / "chat.jsonl.gz", "wt") as fh:
        for d in docs:
            fh.write(json.dumps({"response_ids": d}) + "\n")
    return str(folder)


def test_greedy_lossless_and_drafts_the_targets_own_answers(tmp_path):
    """A store of the target's own greedy answers to other prompts: drafts are accepted, and the output is plain
    greedy decoding token for token."""
    model = tiny_llama(seed=1)
    rng = random.Random(1)
    own = [plain_greedy(model, [rng.randrange(64) for _ in range(4)], 40) for _ in range(20)]
    noise = [[rng.randrange(64) for _ in range(40)] for _ in range(20)]
    env = ArmEnv(model, TinyTokenizer(64), SamplingConfig())
    path = _answers_folder(tmp_path / "answers", own + noise)
    arms = [build_arm(f"rest:store={path},L=4", env), build_arm(f"rest:store={path},L=4,nodes=6", env)]
    assert arms[0].store is arms[1].store  # loaded once per process
    eng = SpecEngine(Target(model), arms, Verifier(SamplingConfig()))
    accepted = 0
    for seed in range(4):
        prompt = [random.Random(100 + seed).randrange(64) for _ in range(4)]
        ref = plain_greedy(model, prompt, 40)
        for arm in range(2):
            gen = eng.generate(prompt, build_policy(f"fixed:arm={arm}", 2, 6), 40)
            assert gen.tokens == ref
            accepted += sum(r.accepted for r in gen.rounds)
    assert accepted > 0


def test_sampled_output_follows_the_target(tmp_path):
    """Deterministic drafts (one-hot q) under sampling: the first two tokens follow the target's joint law."""
    from test_sampling_lossless import V, _assert_first_two_tokens_follow_target
    target = tiny_llama(vocab=V, hidden=16, layers=1, seed=4, peaked=4.0)
    cfg = SamplingConfig(1.0)
    rng = np.random.default_rng(0)
    docs = [[0, 2, 4, *rng.integers(0, V, 6).tolist()] for _ in range(12)]  # continuations of the test's prompt
    store = TokenStore(docs, depth=8)
    import torch
    gen = torch.Generator().manual_seed(0)
    eng = SpecEngine(Target(target), [RetrievalArm(store, L=2, nodes=3, max_match=4, min_match=1)],
                     Verifier(cfg, generator=gen))
    _assert_first_two_tokens_follow_target(eng, target, cfg)


def test_batched_rows_with_retrieval_arms_equal_their_plain_greedy_decoding(tmp_path):
    """Batched rounds take the arm (model-free: each row holds its own instance, all sharing one index), alone, as
    a tree, and inside a union with lookup."""
    import torch

    from decode.core.attention import our_attention_model
    from decode.engine.batch import BatchEngine, check_batch_arm_specs

    model = our_attention_model(tiny_llama(vocab=64, layers=2, seed=3, peaked=4.0).double())
    rng = random.Random(2)
    prompts = [[rng.randrange(64) for _ in range(rng.randrange(1, 6))] for _ in range(5)]
    path = _answers_folder(tmp_path / "answers", [plain_greedy(model, p, 30) for p in prompts[:3]])
    pool = [f"rest:store={path},L=3", f"rest:store={path},L=3,nodes=4,min_match=1",
            f"union:arms=rest:store={path}:L=3+pld:L=3,nodes=6"]
    check_batch_arm_specs(pool)
    env = ArmEnv(model, TinyTokenizer(64), SamplingConfig())
    eng = BatchEngine(model, lambda: [build_arm(s, env) for s in pool], lambda K: build_policy("random", K, 4, seed=0),
                      Verifier(SamplingConfig(), "torch", torch.Generator().manual_seed(0)), ())
    rows = eng.generate(prompts, 20)
    for p, r in zip(prompts, rows):
        assert r.tokens == plain_greedy(model, p, 20), p
    assert any(rec.accepted for r in rows for rec in r.rounds)
