"""Pre-allocated KV caches (decode/core/target.py KVCache, kinds static and prefix): pointer rollback never reads
stale entries, every kind gives the dynamic cache's logits (prefix: bit for bit), capacity rules, and greedy
losslessness of every arm kind on every cache kind."""
import os

import pytest
import torch
from transformers import Qwen2Config

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.eagle import EagleArm
from decode.choose.arms.early_exit import EarlyExitArm
from decode.choose.arms.model import DrafterModelArm
from decode.engine.loop import SpecEngine
from decode.common.errors import UserError
from decode.choose.heads import EagleHead, EarlyExitDrafter, save_head
from decode.choose.policies import build_policy
from decode.core.sampling import SamplingConfig
from decode.core.target import KVCache, Target
from decode.core.verify import Verifier
from helpers import TinyTokenizer, plain_greedy, tiny_llama, tiny_qwen

GREEDY = SamplingConfig()
KINDS = ["dynamic", "static", "prefix"]
PREALLOCATED = ["static", "prefix"]
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9], [5]]


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


@torch.inference_mode()
def _fresh(model, ids, n):
    """Logits and final hidden states of the last ``n`` positions of ``ids``, no cache at all."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0, -n:].float(), out.hidden_states[-1][0, -n:]


@pytest.mark.parametrize("kind", PREALLOCATED)
def test_stale_entries_beyond_the_pointer_are_never_read(kind):
    """Score a draft, roll back to fewer tokens, score a different (shorter) draft: every logit equals
    a fresh no-cache computation, although slots past the pointer still hold the rejected draft."""
    model = tiny_llama(seed=1)
    t = Target(model, cache=kind, want_hidden=True)
    ctx = [3, 1, 4, 1, 5, 9, 2, 6]
    t.prefill(ctx, capacity=64)
    t.score(ctx[-1], torch.tensor([10, 11, 12, 13, 14, 15]))
    layer = t.cache.layers[0]
    written = layer.keys[0, :, len(ctx) + 5].clone()
    t.rollback(len(ctx))  # no draft token accepted; the context becomes ctx + [10]
    pointer = layer.filled if kind == "prefix" else int(layer.cumulative_length)
    assert t.cached == len(ctx) and pointer == len(ctx)
    assert torch.equal(layer.keys[0, :, len(ctx) + 5], written)  # nothing was cleared: a pointer moved
    ctx2 = ctx + [10]
    r = t.score(ctx2[-1], torch.tensor([20, 21]))
    logits, hidden = _fresh(model, ctx2 + [20, 21], 3)
    torch.testing.assert_close(r.logits, logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r.hidden.final, hidden, atol=1e-5, rtol=1e-5)
    # roll back below the prefix the last rounds started from (traces do this), then go on
    t.rollback(len(ctx) - 3)
    ctx3 = ctx[:len(ctx) - 2]
    r = t.score(ctx3[-1], torch.tensor([30]))
    torch.testing.assert_close(r.logits, _fresh(model, ctx3 + [30], 2)[0], atol=1e-5, rtol=1e-5)
    # a new, shorter sequence on the same allocation: the old one's slots are stale, never read
    t.prefill([8, 8, 9], capacity=64)
    assert t.kv.allocations == 1
    r = t.score(9, torch.tensor([1, 2, 3]))
    torch.testing.assert_close(r.logits, _fresh(model, [8, 8, 9, 1, 2, 3], 4)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen], ids=["llama", "qwen"])
def test_every_cache_kind_gives_the_same_logits_round_after_round(make):
    model = make(seed=2)
    ts = {k: Target(model, cache=k, want_hidden=True) for k in KINDS}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 64, (20,), generator=g).tolist()
    ctx = list(prompt)
    for t in ts.values():
        t.prefill(ctx)
    torch.testing.assert_close(ts["static"].prefill_hidden.final, ts["dynamic"].prefill_hidden.final,
                               atol=1e-5, rtol=1e-5)
    for L in [0, 4, 2, 6, 1, 3, 0, 5]:
        draft = torch.randint(0, 64, (L,), generator=g)
        rs = {k: t.score(ctx[-1], draft) for k, t in ts.items()}
        torch.testing.assert_close(rs["static"].logits, rs["dynamic"].logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rs["static"].hidden.final, rs["dynamic"].hidden.final, atol=1e-5, rtol=1e-5)
        # prefix: the same attention inputs as dynamic (views of the filled prefix), so the same bits
        assert torch.equal(rs["prefix"].logits, rs["dynamic"].logits)
        assert torch.equal(rs["prefix"].hidden.final, rs["dynamic"].hidden.final)
        acc = int(torch.randint(0, L + 1, (1,), generator=g))
        new = draft[:acc].tolist() + [int(rs["dynamic"].logits[acc].argmax())]
        n = len(ctx)
        for t in ts.values():
            t.rollback(n + acc)
        ctx += new
        assert all(t.cached == len(ctx) - 1 for t in ts.values())
        assert int(ts["dynamic"].cache.get_seq_length()) == ts["prefix"].cache.get_seq_length() == len(ctx) - 1
    torch.testing.assert_close(rs["static"].logits, _fresh(model, ctx[:n] + draft.tolist(), len(draft) + 1)[0],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", PREALLOCATED)
def test_capacity_fixed_allocation_is_a_hard_limit_with_clear_errors(kind):
    model = tiny_llama(seed=1)
    t = Target(model, cache=kind, max_cache_len=16)
    with pytest.raises(UserError, match=r"needs a KV cache of 20 tokens but max_cache_len is 16"):
        t.prefill(list(range(10)), capacity=20)
    t.prefill(list(range(10)))  # undeclared capacity: fine until the context overflows
    assert t.kv.capacity == 16
    t.score(9, torch.tensor([1, 2, 3, 4]))  # 9 + 5 = 14 slots
    t.rollback(12)
    with pytest.raises(UserError, match=r"reached 17 tokens .* max_cache_len=16"):
        t.score(5, torch.tensor([1, 2, 3, 4]))
    t2 = Target(model, cache=kind, max_cache_len=16)
    t2.prefill(list(range(10)), capacity=16)  # exactly the limit is fine
    assert t2.kv.allocations == 1
    with pytest.raises(UserError, match="max_cache_len must be >= 1"):
        Target(model, cache="static", max_cache_len=0)
    with pytest.raises(UserError, match="cache must be one of dynamic, static, prefix"):
        Target(model, cache="paged")
    with pytest.raises(UserError, match="compile=True needs cache=static"):
        Target(model, compile=True)
    with pytest.raises(UserError, match="compile=True needs cache=static .a prefix cache changes shape"):
        Target(model, cache="prefix", compile=True)


@pytest.mark.parametrize("kind", PREALLOCATED)
def test_capacity_grows_by_reallocation_keeping_the_prefix(kind):
    model = tiny_llama(seed=1)
    t = Target(model, cache=kind)
    prompt = list(range(1, 40))
    t.prefill(prompt, capacity=40)
    assert t.kv.capacity == 256 and t.kv.allocations == 1
    ctx = list(prompt)
    while len(ctx) < 300:  # outgrow 256 slots while decoding: one re-allocation copies the kept prefix
        r = t.score(ctx[-1], torch.tensor([5, 6, 7]))
        t.rollback(len(ctx) + 1)
        ctx += [5, int(r.logits[1].argmax())]
    assert t.kv.capacity == 512 and t.kv.allocations == 2
    torch.testing.assert_close(r.logits[1], _fresh(model, ctx[:-1], 1)[0][0], atol=1e-4, rtol=1e-4)
    t.prefill(prompt, capacity=100)  # big enough already: reused
    assert t.kv.allocations == 2


@pytest.mark.parametrize("kind", PREALLOCATED)
def test_preallocated_caches_refuse_sliding_window_layers(kind):
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                      max_window_layers=0, layer_types=["sliding_attention"] * 2)
    kv = KVCache(cfg, kind)
    with pytest.raises(UserError, match=f"cache={kind} supports full-attention .*sliding-window .* use cache=dynamic"):
        kv.start(10)


def test_static_cache_uses_the_models_dtype():
    model = tiny_llama(seed=1).to(torch.bfloat16)
    ts = {k: Target(model, cache=k) for k in KINDS}
    for t in ts.values():
        t.prefill([3, 1, 4, 1, 5])
    assert ts["static"].cache.layers[0].keys.dtype == ts["prefix"].cache.layers[0].keys.dtype == torch.bfloat16
    a, b, c = (ts[k].score(5, torch.tensor([9, 2, 6])).logits for k in KINDS)
    torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)
    assert torch.equal(a, c)


# --------------------------------------------------------------------------- every arm kind, every cache

def _heads(model):
    ee = EarlyExitDrafter(model, n_layers=1)
    eagle = EagleHead(model, init="last_layer")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for head in (ee, eagle):
            for p in head.trainable_parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g) * p.abs().mean())
    return ee, eagle


@pytest.fixture(scope="module")
def saved_heads(tmp_path_factory):
    model = tiny_llama(layers=3, seed=1)
    ee, eagle = _heads(model)
    d = tmp_path_factory.mktemp("heads")
    save_head(ee, d / "ee")
    save_head(eagle, d / "eagle")
    return model, d


def _all_arms_engine(model, heads_dir, kind):
    target = Target(model, cache=kind)
    env = ArmEnv(model, TinyTokenizer(64), GREEDY, target=target, cache=kind)
    arms = [build_arm(s, env) for s in ("pld:L=4", "suffix:L=5,min_match=1", f"early_exit:path={heads_dir / 'ee'},L=4",
                                        f"eagle:path={heads_dir / 'eagle'},L=3")]
    arms.append(DrafterModelArm(tiny_llama(layers=1, seed=5), GREEDY, 3, cache=kind))  # a weak drafter
    arms.append(DrafterModelArm(model, GREEDY, 5, cache=kind))  # a perfect drafter (the target itself)
    return SpecEngine(target, arms, Verifier(GREEDY))


@pytest.mark.parametrize("kind", KINDS)
def test_every_arm_kind_is_greedy_lossless_on_every_cache(saved_heads, kind):
    model, d = saved_heads
    eng = _all_arms_engine(model, d, kind)
    owners = [a for a in eng.arms if hasattr(a, "cache")]
    assert eng.target.kv.kind == kind and len(owners) == 4 and all(a.cache.kind == kind for a in owners)
    refs = {i: plain_greedy(model, p, 40) for i, p in enumerate(PROMPTS)}
    K = len(eng.arms)
    for policy in [f"fixed:arm={i}" for i in range(K)] + ["random"]:
        for i, prompt in enumerate(PROMPTS):
            gen = eng.generate(prompt, build_policy(policy, K, eng.max_len, seed=3), 40)
            assert gen.tokens == refs[i], (policy, prompt)
            if policy == "fixed:arm=5":  # the perfect drafter: any KV slip in its cache shows up here
                assert all(r.accepted == r.drafted for r in gen.rounds)
            elif policy.startswith("fixed:arm=") and int(policy[-1]) in (2, 3, 4) and len(prompt) > 1:
                assert any(r.accepted < r.drafted for r in gen.rounds)  # rejections were rolled back


@pytest.mark.parametrize("kind", KINDS)
def test_full_depth_early_exit_accepts_everything_on_every_cache(kind):
    """Exit layer = copy of the last layer over all other layers: the drafter is the target."""
    model = tiny_qwen(layers=3, seed=1)
    target = Target(model, cache=kind, want_hidden=True)
    arm = EarlyExitArm(EarlyExitDrafter(model, n_layers=2), GREEDY, L=4, target=target, cache=kind)
    eng = SpecEngine(target, [arm], Verifier(GREEDY))
    for prompt in PROMPTS[:2]:
        gen = eng.generate(prompt, build_policy("fixed", 1, 4), 30)
        assert gen.tokens == plain_greedy(model, prompt, 30)
        assert all(r.accepted == r.drafted == 4 for r in gen.rounds[:-1])


def test_arm_caches_give_the_dynamic_caches_drafts():
    """Same rounds on every cache kind: the drafts and their distributions agree (fp32 tolerance)."""
    model = tiny_llama(layers=3, seed=1)
    ee, eagle = _heads(model)
    out = {}
    for kind in KINDS:
        target = Target(model, cache=kind, want_hidden=True)
        arms = [EarlyExitArm(ee, GREEDY, L=4, target=target, cache=kind),
                EagleArm(eagle, model, GREEDY, L=4, target=target, cache=kind),
                DrafterModelArm(tiny_llama(layers=1, seed=5), GREEDY, 4, cache=kind)]
        eng = SpecEngine(target, arms, Verifier(GREEDY), step_time=1.0)
        gen = eng.generate(PROMPTS[0], build_policy("random", 3, 4, seed=1), 30)
        ctx = PROMPTS[0] + gen.tokens
        out[kind] = [a.propose(ctx, 4) for a in arms]
    for kind in PREALLOCATED:
        for a, b in zip(out[kind], out["dynamic"]):
            assert a.tokens.tolist() == b.tokens.tolist()
            torch.testing.assert_close(a.q, b.q, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # inductor compiles three small graphs on a CPU
def test_compiled_verification_forward_matches_eager_with_one_graph_per_size(tmp_path, monkeypatch):
    """Target(compile=True): chain verification forwards run through one static-shape graph per number of
    positions (decode/core/compiled.py). Logits equal the eager dynamic-cache ones for every draft length, a size
    seen before reuses its graph (the pointer moves, nothing recompiles), and greedy decoding through the
    compiled target is plain greedy decoding token for token."""
    pytest.importorskip("torch._inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = tiny_llama(layers=1, hidden=16, seed=1)
    ref, comp = Target(model), Target(model, cache="static", compile=True)
    comp.reserve_capacity(64)
    assert comp.warm_up(3, show=False) > 0 and comp.compiled.graphs == 3
    ctx = [3, 1, 4, 1, 5]
    for t in (ref, comp):
        t.prefill(ctx, capacity=64)  # fits the reserved allocation: the same cache shape
    for i, L in enumerate([0, 2, 1, 0, 2, 1]):
        d = torch.arange(L) + i
        a, b = ref.score(ctx[-1], d).logits, comp.score(ctx[-1], d).logits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for t in (ref, comp):
            t.rollback(len(ctx))
        ctx.append(int(a[0].argmax()))
    assert comp.compiled.graphs == 3 and comp.kv.allocations == 1  # no new shape, no new allocation
    assert os.listdir(tmp_path / "inductor")  # compiled artifacts reach the on-disk cache

    arm = build_arm("pld:L=2,n=1", ArmEnv(model, TinyTokenizer(64), GREEDY, torch.Generator()))
    eng = SpecEngine(comp, [arm], Verifier(GREEDY), step_time=1.0)
    for prompt in PROMPTS:
        gen = eng.generate(prompt, build_policy("fixed", 1, 2), 24)
        assert gen.tokens == plain_greedy(model, prompt, 24)
    assert comp.compiled.graphs == 3


def test_auto_cache_is_static_on_cuda_or_compiled_and_prefix_on_a_cpu():
    from decode.core.target import auto_cache_kind
    assert auto_cache_kind("cpu") == "prefix"  # measured fastest on a CPU (bench-round --cache all)
    assert auto_cache_kind("cpu", compile=True) == "static"
    assert auto_cache_kind(torch.device("cuda")) == "static"


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_runs_the_lm_head_on_the_last_position_only(kind):
    """A prefill needs no logits (the first round scores the last prompt token itself): the LM head multiplies
    one row, not one per prompt token, and the cached prefix still equals a fresh computation."""
    model = tiny_llama(seed=1)
    rows = []
    model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    t = Target(model, cache=kind, want_hidden=True)
    ctx = list(range(1, 30))
    t.prefill(ctx)
    assert rows == [1] and t.prefill_hidden.final.shape[0] == len(ctx) - 1
    r = t.score(ctx[-1], torch.tensor([3, 4]))
    assert rows[-1] == 3
    torch.testing.assert_close(r.logits, _fresh(model, ctx + [3, 4], 3)[0], atol=1e-5, rtol=1e-5)
