"""Grouped-query attention without repeated cache heads (decode/core/attention.py): the run model is a copy that
shares every weight, the reference model is untouched, the masked forwards really pass grouped heads (to the grouped
matmuls for a few positions, to SDPA for more), and logits and greedy decoding are the stock model's."""
import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.policies import build_policy
from decode.core import attention
from decode.core.attention import GROUPED_MATMUL_MAX, NAME, gqa_attention_model, grouped_attention
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.verify import Verifier
from decode.engine.loop import SpecEngine, build_engine
from helpers import TinyTokenizer, plain_greedy, tiny_llama, tiny_qwen

GREEDY = SamplingConfig()


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def _sdpa_calls(monkeypatch):
    """Record, for every SDPA call, whether it got a mask and whether its keys had fewer heads than its queries (a
    grouped-matmul call: masked and grouped)."""
    calls = []
    real, matmuls = torch.nn.functional.scaled_dot_product_attention, attention.grouped_attention

    def spy(query, key, value, *args, **kwargs):
        calls.append((kwargs.get("attn_mask") is not None, key.shape[1] < query.shape[1]))
        return real(query, key, value, *args, **kwargs)

    def spy_matmuls(query, key, value, mask, *args):
        calls.append((True, key.shape[1] < query.shape[1]))
        return matmuls(query, key, value, mask, *args)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention, "grouped_attention", spy_matmuls)
    return calls


@pytest.mark.parametrize("B, W, T", [(1, 2, 7), (3, 5, 40), (4, 8, 129), (2, 1, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_matmuls_compute_what_sdpa_computes(B, W, T, dtype):
    g = torch.Generator().manual_seed(B * 100 + W)
    q = torch.randn(B, 9, W, 16, generator=g, dtype=dtype)
    k, v = (torch.randn(B, 3, T, 16, generator=g, dtype=dtype) for _ in range(2))
    visible = torch.rand(B, 1, W, T, generator=g) < 0.7
    visible[..., -1] = True  # every query sees one key at least (its own slot, in the engines)
    additive = torch.zeros(B, 1, W, T, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive, enable_gqa=True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    for mask in (additive, visible):
        torch.testing.assert_close(grouped_attention(q, k, v, mask), want, **tol)
    torch.testing.assert_close(grouped_attention(q, k, v, additive, 0.3),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive,
                                                                                scale=0.3, enable_gqa=True), **tol)


def test_the_run_model_is_a_weight_sharing_copy_and_the_reference_is_untouched():
    model = tiny_llama(seed=1)
    fast = gqa_attention_model(model)
    assert fast is not model
    assert model.config._attn_implementation == "sdpa" and fast.config._attn_implementation == NAME
    assert all(a is b for a, b in zip(model.parameters(), fast.parameters()))
    same = gqa_attention_model(fast, in_place=True)
    assert same is fast


@pytest.mark.parametrize("why", ["eager", "no-groups"])
def test_models_it_does_not_help_are_returned_as_they_are(why):
    model = tiny_llama(seed=1)
    if why == "eager":
        model.config._attn_implementation = "eager"
    else:
        model.config.num_key_value_heads = model.config.num_attention_heads
    assert gqa_attention_model(model) is model


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen], ids=["llama", "qwen"])
@pytest.mark.parametrize("kind", ["dynamic", "prefix"])
def test_masked_verification_forwards_pass_grouped_heads_and_match_the_stock_logits(make, kind, monkeypatch):
    model = make(seed=2)
    ref, fast = Target(model, cache=kind), Target(gqa_attention_model(model), cache=kind)
    ctx = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for t in (ref, fast):
        t.prefill(ctx)
    calls = _sdpa_calls(monkeypatch)
    for draft in ([], [7, 8], [1, 2, 3, 4], list(range(1, GROUPED_MATMUL_MAX + 3))):  # the last: SDPA, grouped
        n = len(calls)
        a = ref.score(ctx[-1], torch.tensor(draft, dtype=torch.long)).logits
        ref_calls = calls[n:]
        n = len(calls)
        b = fast.score(ctx[-1], torch.tensor(draft, dtype=torch.long)).logits
        fast_calls = calls[n:]
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        if draft:  # several positions at an offset: a causal mask; stock repeats the heads, ours does not
            assert ref_calls and all(masked and not grouped for masked, grouped in ref_calls)
            assert fast_calls and all(masked and grouped for masked, grouped in fast_calls)
        for t in (ref, fast):
            t.rollback(len(ctx) - 1)


def test_engine_decodes_plain_greedy_through_it_and_hf_keeps_stock_attention():
    model = tiny_llama(seed=3)
    eng = build_engine(model, TinyTokenizer(64), ["pld:L=4,n=1", "suffix:L=3,min_match=1"], GREEDY,
                       torch.Generator().manual_seed(0), cache="prefix", linear="stock")
    assert eng.target.model.config._attn_implementation == NAME and model.config._attn_implementation == "sdpa"
    for prompt in ([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9], [5]):
        for arm in range(2):
            gen = eng.generate(prompt, build_policy(f"fixed:arm={arm}", 2, eng.max_len), 30)
            assert gen.tokens == plain_greedy(model, prompt, 30)
            assert any(r.drafted > 0 for r in gen.rounds)


def test_tree_drafts_through_it_decode_plain_greedy():
    model = tiny_llama(seed=4)
    fast = Target(gqa_attention_model(model), cache="prefix")
    arm = build_arm("union:arms=pld:L=2+suffix:L=3,nodes=8", ArmEnv(model, TinyTokenizer(64), GREEDY))
    eng = SpecEngine(fast, [arm], Verifier(GREEDY), step_time=1.0)
    for prompt in ([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2], [7, 9, 11, 7, 9, 11, 7]):
        gen = eng.generate(prompt, build_policy("fixed", 1, eng.max_len), 24)
        assert gen.tokens == plain_greedy(model, prompt, 24)
        assert any(r.drafted > 1 for r in gen.rounds)


def _fake_kernels(grouped_wins: set[int]):
    """A measurement where the grouped matmuls take 1 ms and SDPA 2 ms at the block sizes ``grouped_wins``, and the
    other way round at the others (per row)."""
    def measure(rows, heads, kv, dim, positions, context, dtype, reps):
        assert (heads, kv, dtype) == (4, 2, torch.float32) and context == 384 and reps == 15
        wins = positions in grouped_wins
        return {"grouped": 1e-3 if wins else 2e-3, "sdpa": 2e-3 if wins else 1e-3}
    return measure


@pytest.mark.parametrize("wins", [set(range(2, 9)), {3, 4, 8}, {2}, set()])
def test_the_probe_runs_the_matmuls_at_the_block_sizes_they_win(wins, monkeypatch, capsys):
    monkeypatch.setattr(attention, "GROUPED_SIZES", frozenset(range(2, 9)))
    monkeypatch.setattr(attention, "_PROBED", {})
    fast = gqa_attention_model(tiny_llama(seed=1))
    got = attention.probe_attention(fast, measure=_fake_kernels(wins))
    assert got["grouped_sizes"] == sorted(wins) and attention.GROUPED_SIZES == wins
    assert got["ms"]["grouped"]["2"] == (2.0 if 2 in wins else 4.0)  # summed over the 1- and 16-row blocks
    assert sorted(map(int, got["ms"]["sdpa"])) == list(range(2, 9))
    assert "attention probe: " in capsys.readouterr().err
    # once per process and shape: a second call measures nothing and sets the same
    attention.GROUPED_SIZES = frozenset()
    assert attention.probe_attention(fast, measure=None) == got and attention.GROUPED_SIZES == wins
    assert attention.probe_attention(tiny_llama(seed=1), measure=None) is None  # stock attention: nothing to choose


def test_verification_runs_the_kernel_the_probe_chose_and_matches_the_stock_logits(monkeypatch):
    model = tiny_llama(seed=2)
    ref, fast = Target(model, cache="prefix"), Target(gqa_attention_model(model), cache="prefix")
    ctx = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for t in (ref, fast):
        t.prefill(ctx)
    calls = []
    real, matmuls = torch.nn.functional.scaled_dot_product_attention, attention.grouped_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: (calls.append("sdpa"), real(*a, **kw))[1])
    monkeypatch.setattr(attention, "grouped_attention", lambda *a: (calls.append("grouped"), matmuls(*a))[1])
    for sizes in (set(), {3}, {2, 3, 4}):
        monkeypatch.setattr(attention, "GROUPED_SIZES", frozenset(sizes))
        for draft in ([7, 8], [1, 2, 3]):
            calls.clear()
            a = ref.score(ctx[-1], torch.tensor(draft, dtype=torch.long)).logits
            calls.clear()
            b = fast.score(ctx[-1], torch.tensor(draft, dtype=torch.long)).logits
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
            kernel = "grouped" if len(draft) + 1 in sizes else "sdpa"
            assert calls == [kernel] * model.config.num_hidden_layers
            for t in (ref, fast):
                t.rollback(len(ctx) - 1)


def test_the_engine_records_the_probe_it_ran():
    eng = build_engine(tiny_llama(seed=3), TinyTokenizer(64), ["pld:L=4,n=1"], GREEDY,
                       torch.Generator().manual_seed(0), cache="prefix", linear="stock")
    probe = eng.target.attention_probe
    assert attention.GROUPED_SIZES == set(probe["grouped_sizes"]) <= set(range(2, 9))
    assert set(probe["ms"]) == {"grouped", "sdpa"} and set(probe["ms"]["sdpa"]) == {str(n) for n in range(2, 9)}
