"""The lean forward (decode/core/lean.py) computes what transformers' forward computes, and says why where it cannot
run."""
import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

from decode.choose.policies import build_policy
from decode.common.errors import UserError
from decode.core.attention import gqa_attention_model
from decode.core.draft import Draft
from decode.core.lean import LeanForward, glue_unusable, lean_unusable, resolve_forward
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.engine.loop import build_engine
from helpers import plain_greedy, tiny_llama, tiny_qwen

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingConfig(temperature=0.0)


def _run(model, forward: str, cache: str, fused: bool = True) -> list[torch.Tensor]:
    """Every output the engines read, over a prefill, a chain, a tree, its accepted path and a one-token step
    (``fused``: the lean loop on decode/core/kernels/glue.py's ops, else on PyTorch's)."""
    target = Target(model, forward=forward, cache=cache)
    if forward == "lean":
        assert target.run.layers.fused == (glue_unusable(model) is None)
        target.run.layers.fused = fused and target.run.layers.fused
    target.request_hidden((0, 1, -1))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 64, (9,), generator=g).tolist()
    target.prefill(prompt)
    out = [target.prefill_hidden.final, target.prefill_hidden.extra]
    chain = target.score(prompt[-1], torch.randint(0, 64, (3,), generator=g))
    target.rollback(len(prompt) - 1)
    tree = target.score_tree(prompt[-1], Draft(torch.randint(0, 64, (5,), generator=g),
                                               parents=torch.tensor([-1, 0, 0, 2, -1])))
    target.keep_path(len(prompt), [2, 3])
    step = target.score(7, torch.tensor([], dtype=torch.long))
    out += [r.logits for r in (chain, tree, step)] + [r.hidden.extra for r in (chain, tree, step)]
    keys, values = target.kv.export(target.kv.length)
    return out + keys + values


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen], ids=["llama", "qwen2"])
@pytest.mark.parametrize("cache", ["dynamic", "prefix"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-ops", "torch-ops"])
def test_lean_target_equals_transformers_forward(make, cache, fused):
    model = gqa_attention_model(make(layers=3, seed=1))  # the engines' attention, as their run model has
    hf, lean = _run(model, "hf", cache), _run(model, "lean", cache, fused)
    assert len(hf) == len(lean)
    for a, b in zip(hf, lean):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_lean_hidden_states_tuple_is_transformers_own():
    """Every entry of HF's ``hidden_states`` (embeddings, each layer's output, the normed final state last), in a
    prefill from an empty cache and a chain after it, with every position's logits or only the last one's."""
    from transformers import DynamicCache
    model = tiny_llama(layers=3, seed=2)
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    lean, caches = LeanForward(model), (DynamicCache(), DynamicCache())
    with torch.inference_mode():
        for part, keep in ((ids[:, :5], 1), (ids[:, 5:], 0)):
            pos = torch.arange(caches[0].get_seq_length(), caches[0].get_seq_length() + part.shape[1])[None]
            a = model(input_ids=part, position_ids=pos, past_key_values=caches[0], use_cache=True,
                      output_hidden_states=True, logits_to_keep=keep)
            b = lean(input_ids=part, position_ids=pos, past_key_values=caches[1], output_hidden_states=True,
                     logits_to_keep=keep)
            assert len(b.hidden_states) == len(a.hidden_states) == 4
            for x, y in zip(a.hidden_states, b.hidden_states):
                torch.testing.assert_close(y, x, rtol=0, atol=1e-5)
            torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-ops", "torch-ops"])
def test_lean_batched_block_equals_transformers_forward(fused):
    """A batched round's block (decode/engine/batch.py): B rows over a shared cache under a per-row 4-D mask, every
    hidden state and the logits as transformers computes them (the fused ops row-wise, the engine's attention)."""
    from transformers import DynamicCache
    model = gqa_attention_model(tiny_llama(layers=3, seed=4))
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 64, (2, 6), generator=g)
    block = torch.randint(0, 64, (2, 3), generator=g)
    allowed = torch.ones(2, 1, 3, 9, dtype=torch.bool)
    allowed[..., 6:] = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    allowed[1, :, :, 2] = False  # row 1's padding slot
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    lean = LeanForward(model)
    lean.layers.fused = fused and lean.layers.fused
    outs = []
    with torch.inference_mode():
        for run in (model, lean):
            cache = DynamicCache()
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
            pos = torch.arange(6, 9)[None].expand(2, 3)
            outs.append(run(input_ids=block, position_ids=pos, attention_mask=mask, past_key_values=cache,
                            use_cache=True, output_hidden_states=True))
    hf, ours = outs
    torch.testing.assert_close(ours.logits, hf.logits, rtol=0, atol=1e-5)
    for a, b in zip(hf.hidden_states, ours.hidden_states, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "prefix"])
def test_engine_on_the_lean_forward_decodes_like_plain_greedy(cache):
    model = tiny_llama(layers=2, seed=3, peaked=4.0)
    for spec in ("pld:L=3", "suffix:L=3"):
        eng = build_engine(model, None, [spec], GREEDY, torch.Generator(), cache=cache, forward="lean")
        assert eng.target.forward_kind == "lean"
        for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 5, 9, 5]):
            out = eng.generate(prompt, build_policy("fixed:arm=0", 1, eng.max_len), 24)
            assert out.tokens == plain_greedy(model, prompt, 24)


def _qwen3():
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8)
    return Qwen3ForCausalLM(cfg)


def _mistral_windowed():
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    return MistralForCausalLM(cfg)


def test_lean_unusable_says_why():
    llama = tiny_llama(layers=1)
    assert lean_unusable(llama, "prefix") is None and lean_unusable(llama, "dynamic") is None
    assert "static" in lean_unusable(llama, "static")
    assert "compile" in lean_unusable(llama, "dynamic", compile=True)
    assert "qwen3" in lean_unusable(_qwen3(), "prefix")
    assert "mistral" in lean_unusable(_mistral_windowed(), "prefix")
    eager = tiny_llama(layers=1)
    eager.config._attn_implementation = "eager"
    assert "eager" in lean_unusable(eager, "prefix")


def test_fused_ops_only_for_float32_cpu_targets():
    llama = tiny_llama(layers=1)
    assert glue_unusable(llama) is None or "building" in glue_unusable(llama)
    assert "float32 CPU kernels (the target is torch.bfloat16 on cpu)" in glue_unusable(llama.to(torch.bfloat16))
    assert LeanForward(llama).layers.fused is False


def test_resolve_forward_picks_refuses_or_announces(capsys):
    llama = tiny_llama(layers=1)
    assert resolve_forward("auto", llama, "prefix") == "lean"
    assert resolve_forward("hf", llama, "prefix") == "hf"
    assert resolve_forward("auto", llama, "static") == "hf"
    assert "--forward auto: transformers' forward (the static cache" in capsys.readouterr().err
    with pytest.raises(UserError, match="--forward lean cannot run this target: model type 'qwen3'"):
        resolve_forward("lean", _qwen3(), "prefix")
    with pytest.raises(UserError, match="--forward must be one of auto, lean, hf"):
        resolve_forward("fast", llama, "prefix")
    with pytest.raises(UserError, match="lean forward cannot run this target: the static cache"):
        Target(llama, cache="static", forward="lean")
