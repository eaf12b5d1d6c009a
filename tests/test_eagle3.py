"""EAGLE-3's two ideas as options (decode/choose/heads/eagle.py, toolkit/train/eagle.py): fused low/mid/high target
features with a recurrent head state, and training-time test (TTT). The key check: a TTT step-s output and loss
equal what the decode arm computes by literally drafting (true entries, then s draft steps on its own output)."""
import json

import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.eagle import EagleArm
from decode.choose.arms.eagle.tree import EagleTreeArm
from decode.engine.loop import SpecEngine
from decode.common.errors import UserError
from decode.choose.heads import EagleHead, load_head, save_head
from decode.choose.heads.eagle import eagle3_layers
from decode.choose.policies import build_policy
from decode.core.lean import glue_unusable
from decode.core.sampling import SamplingConfig
from decode.core.target import KVCache, Target
from decode.core.tree import tree_attention
from decode.core.verify import Verifier
from helpers import plain_greedy, tiny_llama
from test_heads import tiny_distilled  # noqa: F401  (the tiny distilled set, a module fixture)
from toolkit.train.eagle import (EagleSection, EagleTrainModule, make_loss, target_hidden_states, ttt_mask,
                                 unroll)

GREEDY = SamplingConfig()
LAYERS = (1, 2, 3)  # low/mid/high of a 4-layer tiny target


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def _perturbed(head: EagleHead, scale: float = 0.3, seed: int = 0) -> EagleHead:
    """A head whose every trained tensor matters (the identity init would hide wrong wiring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.trainable_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g) * (p.abs().mean() + 0.05))
    return head.eval()


def _head(model, fused: bool, seed: int = 0, **kw) -> EagleHead:
    return _perturbed(EagleHead(model, init="last_layer", feature_layers=LAYERS if fused else None, **kw), seed=seed)


# --------------------------------------------------------------------------- head options


def test_fused_head_layout_and_eagle3_default_layers():
    model = tiny_llama(layers=4, seed=1)
    head = EagleHead(model, feature_layers=LAYERS)
    d = model.config.hidden_size
    assert head.fused and head.target_layers == LAYERS
    assert head.fuse.weight.shape == (d, 3 * d) and head.fuse.bias is None
    assert torch.equal(head.norm.weight, model.model.norm.weight) and head.norm.weight is not model.model.norm.weight
    assert {"fuse.weight", "norm.weight"} <= set(head.trainable_state_dict())
    # fuse starts as "take the high layer"; logits go through the head's norm
    rows = torch.randn(5, 3 * d)
    assert torch.allclose(head.input_features(rows), rows[:, 2 * d:])
    h = torch.randn(5, d)
    assert torch.allclose(head.logits(h), model.lm_head(head.norm(h)))
    assert not EagleHead(model).fused and EagleHead(model).target_layers == (-1,)
    assert eagle3_layers(30) == (2, 15, 27) and eagle3_layers(32) == (2, 16, 29)
    with pytest.raises(UserError, match="N//2"):
        eagle3_layers(3)
    with pytest.raises(UserError, match="feature_layers"):
        EagleHead(model, feature_layers=(1, 2, 9))


def test_fused_head_round_trip_and_old_head_json_loads(tmp_path):
    model = tiny_llama(layers=4, seed=1)
    head = _head(model, fused=True)
    save_head(head, tmp_path / "e3")
    meta = json.loads((tmp_path / "e3" / "head.json").read_text())
    assert meta["feature_layers"] == list(LAYERS)
    back = load_head(tmp_path / "e3", model, expect="eagle")
    assert back.feature_layers == LAYERS
    rows, t = torch.randn(1, 4, 3 * model.config.hidden_size), torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(back.logits(back(back.input_features(rows), t)),
                              head.logits(head(head.input_features(rows), t)), atol=1e-6)
    # an EAGLE-1 folder writes no new key and loads as before (a head.json from before the option)
    old = _head(model, fused=False)
    save_head(old, tmp_path / "e1")
    meta = json.loads((tmp_path / "e1" / "head.json").read_text())
    assert "feature_layers" not in meta
    again = load_head(tmp_path / "e1", model)
    assert not again.fused and torch.equal(again.fc.weight, old.fc.weight)


def test_eagle3_layer_is_eagle3s_first_layer(tmp_path):
    """layer=eagle3: no fc; the layer normalises embedding and feature apart, q/k/v read their 2d concat, the
    residual is the feature; identity init starts as logit lens on g; head.json round trip; bad combinations."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = tiny_llama(layers=4, seed=1)
    d = model.config.hidden_size
    head = EagleHead(model, feature_layers=LAYERS, layer="eagle3")
    layer = head.model.layers[0]
    assert not hasattr(head, "fc") and isinstance(layer, LlamaDecoderLayer)
    assert layer.self_attn.q_proj.weight.shape[1] == 2 * d and layer.self_attn.k_proj.weight.shape[1] == 2 * d
    assert "model.layers.0.hidden_norm.weight" in head.trainable_state_dict()
    g, t = torch.randn(1, 5, d), torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(head(g, t), g, atol=1e-6)  # o_proj/down_proj zero: output = residual = g
        _perturbed(head, seed=3)
        # the layer's forward written out: cat[input_norm(e), hidden_norm(g)] → attention (2d q/k/v); residual g
        e = model.model.embed_tokens(t)
        x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(g)], -1)
        pos = torch.arange(5)[None]
        rope = head.model.rotary_emb(g, pos)
        mask = torch.full((5, 5), float("-inf")).triu(1)[None, None]
        a, _ = layer.self_attn(hidden_states=x, attention_mask=mask, position_embeddings=rope)
        h = g + a
        want = h + layer.mlp(layer.post_attention_layernorm(h))
        assert torch.allclose(head(g, t), want, atol=1e-5)
    save_head(head, tmp_path / "e3")
    assert json.loads((tmp_path / "e3" / "head.json").read_text())["layer"] == "eagle3"
    back = load_head(tmp_path / "e3", model)
    with torch.no_grad():
        assert back.layer == "eagle3" and torch.allclose(back(g, t), head(g, t), atol=1e-6)
    with pytest.raises(UserError, match="features=fused"):
        EagleHead(model, layer="eagle3")
    with pytest.raises(UserError, match="layer must be one of"):
        EagleHead(model, feature_layers=LAYERS, layer="eagle2")
    with pytest.raises(UserError, match="head.features=fused"):
        EagleSection(layer="eagle3")


# --------------------------------------------------------------------------- Target: union of hidden layers


def test_target_hidden_layers_union_and_selectors():
    """The target computes the union of the requested layers once; each request's selector reads its own
    layers, in its order, whatever was requested before or after it."""
    model = tiny_llama(layers=4, seed=2)
    t = Target(model)
    assert t.extra_layers == () and not t.want_hidden
    sel = {LAYERS: t.request_hidden(LAYERS)}
    assert t.want_hidden and t.extra_layers == LAYERS
    sel[(-1,)] = t.request_hidden((-1,))  # the post-norm final state is HiddenStates.final, never in extra
    sel[(2, 3)] = t.request_hidden((2, 3))  # a run already there is reused
    assert t.extra_layers == LAYERS
    sel[(3, 1)] = t.request_hidden((3, 1))  # else appended: earlier selectors stay valid
    sel[(2, -1, 1)] = t.request_hidden((2, -1, 1))  # FINAL between layers
    assert t.extra_layers == (1, 2, 3, 3, 1)
    with pytest.raises(UserError, match="0..4"):
        t.request_hidden((5,))
    prompt = [3, 1, 4, 1, 5, 9]
    t.prefill(prompt)
    res = t.score(prompt[-1], torch.tensor([2, 6]))
    with torch.no_grad():
        hs = model(torch.tensor([prompt + [2, 6]]), output_hidden_states=True).hidden_states
    assert res.hidden.final.shape == (3, d := model.config.hidden_size) and res.hidden.extra.shape == (3, 5 * d)
    assert len(t.prefill_hidden) == 5
    for layers, select in sel.items():
        want = torch.cat([hs[i][0] for i in layers], -1)
        assert torch.allclose(select(t.prefill_hidden), want[:5], atol=1e-5), layers
        assert torch.allclose(select(res.hidden), want[5:], atol=1e-5), layers
    assert torch.allclose(res.hidden.final, hs[-1][0, 5:], atol=1e-5)


# --------------------------------------------------------------------------- training-time test


def _batch(T: int = 12, seed: int = 0, vocab: int = 64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (1, T), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _decode_reference(model, head, ids: list[int], steps: int):
    """What decoding computes: for each slot j, the arm's true entries over ids[:j+2] (the draft's first step),
    then ``steps``-1 draft steps feeding the head's own output with the true next tokens. Returns
    {(s, j): head output} and the target's distribution for each (s, j) (position j+s+1)."""
    arm = EagleArm(head, model, GREEDY, L=steps)
    out = {}
    T = len(ids)
    for j in range(T - 1):
        arm.reset(ids[:j + 2])
        h = arm._true_step(ids[:j + 2])
        for s in range(steps):
            if j + s + 2 >= T:
                break
            out[s, j] = h
            h = arm._step(h.unsqueeze(0), [ids[j + s + 2]])
        arm.cache.crop(arm.entries)
    return out


@pytest.mark.parametrize("fused,layer", [(True, "eagle1"), (False, "eagle1"), (True, "eagle3")])
def test_ttt_steps_equal_literal_decoding(fused, layer):
    """Step s at slot j of the unrolled batch == draft step s+1 of the arm after the context ids[:j+2]: same head
    output, same target distribution, same loss."""
    model = tiny_llama(layers=4, seed=3)
    head = _head(model, fused, seed=1, layer=layer)
    steps = 3
    inputs = _batch(T=10, seed=2)
    module = EagleTrainModule(model, head).eval()
    with torch.no_grad():
        got = unroll(module, inputs, 0.0, steps)
        ref = _decode_reference(model, head, inputs["input_ids"][0].tolist(), steps)
        logits = model(inputs["input_ids"]).logits[0]
    T = inputs["input_ids"].shape[1]
    section = EagleSection(features="fused" if fused else "final", feature_layers=list(LAYERS) if fused else None,
                           ttt_steps=steps, noise=0.0, layer=layer)
    with torch.no_grad():
        _, logs = make_loss(section)(module, inputs)
    for s, step in enumerate(got):
        slots = list(range(T - s - 2))  # slot j predicts position j+s+1 (token j+s+2 must exist)
        assert step.pred.shape[0] == len(slots)
        want = torch.stack([ref[s, j] for j in slots])
        assert torch.allclose(step.pred, want, atol=1e-5), (s, (step.pred - want).abs().max())
        p_ref = logits[[j + s + 1 for j in slots]]
        assert torch.allclose(step.p_logits, p_ref, atol=1e-4)
        # the loss the trainer logs for this step, from the arm's literal outputs
        ce = -(torch.softmax(p_ref, -1) * torch.log_softmax(head.logits(want), -1)).sum(-1).mean()
        assert logs["ce" if s == 0 else f"ce@{s}"] == pytest.approx(ce.item(), rel=1e-5, abs=1e-6)


def test_unroll_runs_the_targets_lm_head_once_per_batch():
    """Every step's target logits come from one LM-head pass over the positions some step predicts with a loss
    (token p+1 a label), whatever the TTT depth: per step it ran once per step over nearly the same positions."""
    model = tiny_llama(layers=4, seed=3)
    module = EagleTrainModule(model, _head(model, fused=True, seed=1)).eval()
    inputs = _batch(T=10, seed=2)
    inputs["labels"][0, :4] = -100  # a prompt: positions 0..2 predict no label
    calls = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: calls.append(a[0].shape[0]))
    try:
        with torch.no_grad():
            steps = unroll(module, inputs, 0.0, 3)
    finally:
        hook.remove()
    assert calls == [6]  # positions 3..8 (token 4..9 is a label); position 9 has no next token
    assert all(s.target_logits is steps[0].target_logits for s in steps)
    assert [s.rows.tolist() for s in steps] == [list(range(6))] * 3  # each step predicts positions 3..8 too


@pytest.mark.parametrize("fused", [True, False])
def test_loss_over_a_draft_vocabulary_equals_the_restricted_full_target(fused):
    """The loss reads the target's logits over the draft vocabulary only (its LM head's rows): the CE and the
    logged top-1 equal those computed from the full target logits restricted to the subset, at every step."""
    from decode.core.vocab import DraftVocab

    model = tiny_llama(layers=4, seed=3)
    V = model.config.vocab_size
    head = _head(model, fused, seed=1, draft_vocab=DraftVocab(torch.arange(0, V, 3), V))
    module = EagleTrainModule(model, head).eval()
    inputs = _batch(T=12, seed=6)
    section = EagleSection(features="fused" if fused else "final", feature_layers=list(LAYERS) if fused else None,
                           ttt_steps=3, noise=0.0)
    with torch.no_grad():
        _, logs = make_loss(section)(module, inputs)
        for s, step in enumerate(unroll(module, inputs, 0.0, 3)):  # full-vocabulary logits, as held-out reads
            p = head.restrict(step.p_logits)
            q = head.logits(step.pred)
            ce = -(torch.softmax(p, -1) * torch.log_softmax(q, -1)).sum(-1).mean()
            top1 = (q.argmax(-1) == p.argmax(-1)).float().mean()
            assert logs["ce" if s == 0 else f"ce@{s}"] == pytest.approx(ce.item(), rel=1e-5, abs=1e-6)
            assert logs["top1" if s == 0 else f"top1@{s}"] == pytest.approx(top1.item())


def test_ttt_is_padding_invariant_and_its_mask_is_diagonal():
    """Right-padded batches give each sequence what it gets alone (padding keys masked at every step)."""
    model = tiny_llama(layers=4, seed=3)
    head = _head(model, fused=True, seed=2)
    module = EagleTrainModule(model, head).eval()
    a, b = _batch(T=11, seed=4), _batch(T=7, seed=5)
    pad = 11 - 7
    batch = {k: torch.cat([a[k], torch.cat([b[k], torch.full((1, pad), -100 if k == "labels" else 0)], 1)])
             for k in a}
    with torch.no_grad():
        both = unroll(module, batch, 0.0, 3)
        alone = [unroll(module, x, 0.0, 3) for x in (a, b)]
    for s in range(3):
        assert torch.allclose(both[s].pred, torch.cat([alone[0][s].pred, alone[1][s].pred]), atol=1e-5)
    m = ttt_mask(torch.tensor([[1, 1, 1, 0]]), 2, torch.float32)[0, 0] == 0
    assert m.shape == (4, 12)
    assert torch.equal(m[:, :4], torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]).bool())
    eye = torch.eye(4, dtype=torch.bool)
    assert torch.equal(m[:, 4:8], eye) and torch.equal(m[:, 8:], eye)


def test_cached_target_features_contract():
    """A feature cache hands ``target_hidden`` (+ ``target_final`` for fused heads); the target is not run."""
    model = tiny_llama(layers=4, seed=3)
    inputs = _batch(T=8)
    feats, final = target_hidden_states(model, inputs, LAYERS)
    assert feats.shape == (1, 8, 3 * 32) and final.shape == (1, 8, 32)

    class NoTarget:
        def __getattr__(self, name):
            raise AssertionError("the target must not run when features are cached")

    cached = {**inputs, "target_hidden": feats, "target_final": final}
    f2, g2 = target_hidden_states(NoTarget(), cached, LAYERS)
    assert torch.equal(f2, feats) and torch.equal(g2, final)
    with pytest.raises(UserError, match="target_final"):
        target_hidden_states(NoTarget(), {**inputs, "target_hidden": feats}, LAYERS)
    f1, g1 = target_hidden_states(NoTarget(), {**inputs, "target_hidden": final}, (-1,))
    assert f1 is g1
    head = _head(model, fused=True)
    module = EagleTrainModule(model, head).eval()
    with torch.no_grad():
        a, b = unroll(module, inputs, 0.0, 2), unroll(module, cached, 0.0, 2)
    assert all(torch.allclose(x.pred, y.pred) for x, y in zip(a, b))


@pytest.mark.parametrize("fused", [True, False])
def test_ttt_training_reduces_every_steps_loss(fused):
    model = tiny_llama(layers=4, seed=3, peaked=3.0)
    torch.manual_seed(0)
    head = EagleHead(model, init="identity", feature_layers=LAYERS if fused else None)
    module = EagleTrainModule(model, head).train()
    section = EagleSection(features="fused" if fused else "final", feature_layers=list(LAYERS) if fused else None,
                           ttt_steps=3, noise=0.0)
    loss_fn = make_loss(section)
    batch = {k: torch.cat([_batch(T=16, seed=i)[k] for i in range(4)]) for k in ("input_ids", "attention_mask",
                                                                                "labels")}
    with torch.no_grad():  # the floor of each step's CE: the target's entropy (a near-uniform tiny target)
        H = [-(torch.softmax(s.p_logits, -1) * torch.log_softmax(s.p_logits, -1)).sum(-1).mean().item()
             for s in unroll(module, batch, 0.0, 3)]
    opt = torch.optim.Adam(head.trainable_parameters(), lr=3e-3)
    first, logs0 = loss_fn(module, batch)
    for _ in range(40):
        loss, logs = loss_fn(module, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert {"ce", "ce@1", "ce@2"} <= set(logs0) and ("reg" in logs0) != fused
    assert loss.item() < first.item()
    for k, h in zip(("ce", "ce@1", "ce@2"), H):  # KL to the target at least halves at every unrolled step
        assert logs[k] - h < 0.5 * (logs0[k] - h), (k, logs0[k], logs[k], h)
    assert all(logs[k] > logs0[k] + 0.1 for k in ("top1", "top1@1", "top1@2")), (logs0, logs)


def test_recipe_section_validation_and_eagle3_recipe():
    from toolkit.config import load_recipe
    from toolkit.train.eagle import EagleRecipe

    r = load_recipe(EagleRecipe, "recipes/heads/eagle3.yaml", [])
    assert r.head.features == "fused" and r.head.ttt_steps == 3 and r.head.ttt_decay == 0.8 and r.head.layer == "eagle3"
    assert r.head.layers(30) == (2, 15, 27) and EagleSection().layers(30) is None
    assert EagleSection(features="fused", feature_layers=[1, 2, 3]).layers(30) == (1, 2, 3)
    from toolkit.train.eagle import _fingerprint
    assert set(_fingerprint(EagleSection())) == {"init", "ce_weight", "noise", "input_norm", "fc_bias"}  # resumable
    assert _fingerprint(r.head)["ttt_steps"] == 3 and _fingerprint(r.head)["features"] == "fused"
    with pytest.raises(UserError, match="features=fused"):
        EagleSection(feature_layers=[1, 2, 3])
    with pytest.raises(UserError, match="ttt_steps"):
        EagleSection(ttt_steps=0)
    with pytest.raises(UserError, match="ttt_decay"):
        EagleSection(ttt_decay=0.0)


@pytest.mark.parametrize("layers,why", [([3, 1, 2], "must be ascending"), ([1, 1, 2], "must be distinct"),
                                        ([1, 2], "exactly 3"), ([0, 1, 2, 3], "exactly 3"),
                                        ([-1, 1, 2], "0..N-1")])
def test_eagle3_layer_feature_layers_are_checked_at_config_time(layers, why):
    """head.layer=eagle3 exists to export to speculators' EAGLE-3, which vLLM reads by collecting the aux states
    of 3 distinct decoder-layer inputs in ascending order: anything else fails when the recipe is read, naming the
    field and the fix."""
    from toolkit.config import load_recipe
    from toolkit.train.eagle import EagleRecipe

    with pytest.raises(UserError, match="head.feature_layers") as err:
        load_recipe(EagleRecipe, "recipes/heads/eagle3.yaml", [f"head.feature_layers={layers}".replace(" ", "")])
    assert why in str(err.value) and "e.g. head.feature_layers=[" in str(err.value)
    # the EAGLE-1 layer is a runtime-only style (no serving format reads it): any layers, in any order
    assert EagleSection(features="fused", feature_layers=layers, layer="eagle1").feature_layers == layers


def test_eagle3_layer_feature_layers_must_be_below_the_targets_layer_count():
    """The range depends on the target: ids 0..N-1 (vLLM never collects N, the last layer's output); EAGLE-3's
    default (2, N//2, N-3) is checked too (on a 4-layer target it is (2, 2, 1))."""
    section = EagleSection(features="fused", feature_layers=[1, 2, 4], layer="eagle3")
    with pytest.raises(UserError, match=r"head.feature_layers.*0\.\.N-1"):
        section.layers(4)
    assert section.layers(5) == (1, 2, 4)
    with pytest.raises(UserError, match="set head.feature_layers explicitly"):
        EagleSection(features="fused", layer="eagle3").layers(4)
    assert EagleSection(features="fused", layer="eagle3").layers(30) == (2, 15, 27)
    assert EagleSection(features="fused", feature_layers=[1, 2, 4]).layers(4) == (1, 2, 4)  # eagle1: unchecked


# --------------------------------------------------------------------------- decoding with fused heads


def _engine(model, arms, target):
    return SpecEngine(target, arms, Verifier(GREEDY))


@pytest.mark.parametrize("cache,layer", [("dynamic", "eagle1"), ("static", "eagle1"), ("static", "eagle3"),
                                         ("prefix", "eagle3")])
def test_fused_head_greedy_lossless_and_true_entries(cache, layer):
    model = tiny_llama(layers=4, seed=5)
    target = Target(model, cache=cache)
    arm = EagleArm(_head(model, fused=True, layer=layer), model, GREEDY, L=4, target=target, cache=cache)
    eng = _engine(model, [arm], target)
    target.want_hidden = True
    for prompt in ([1, 2, 3, 4, 5, 1, 2, 3], [7, 9, 11]):
        gen = eng.generate(prompt, build_policy("fixed:arm=0", 1, eng.max_len, seed=0), 24)
        assert gen.tokens == plain_greedy(model, prompt, 24)
        assert arm.target_forwards == 0  # rows came with the engine's forwards
    ctx = prompt + gen.tokens
    with torch.no_grad():
        hs = model(torch.tensor([ctx]), output_hidden_states=True).hidden_states
    ref = torch.cat([hs[i][0] for i in LAYERS], -1)
    n = arm.feats.shape[0]
    assert n >= len(ctx) - 2 and torch.allclose(arm.feats, ref[:n], atol=1e-4)


def _head_steps(head: EagleHead, cache: str) -> list[torch.Tensor]:
    """A decode arm's head calls (decode/choose/arms/eagle): a true step over several tokens, a one-token step, a
    tree of nodes under its mask; every output and the head cache's entries."""
    g = torch.Generator().manual_seed(0)
    kv = KVCache.for_model(head, cache, config=head.model.config)
    kv.start(64)
    width = head.model.config.hidden_size  # features: input_features of target rows, or the head's own outputs
    outs = []
    for n in (5, 1):
        pos = kv.positions(n)
        outs.append(head(torch.randn(1, n, width, generator=g), torch.randint(0, 64, (1, n), generator=g),
                         past_key_values=kv.hf, use_cache=True, position_ids=pos))
        kv.advance(n)
    prefix, parents = kv.length, torch.tensor([-1, -1, 0, 2])
    kv.reserve(4)
    pos, mask = tree_attention(parents, prefix, kv.key_length(4), kv.dtype, "cpu", queries=4)
    outs.append(head(torch.randn(1, 4, width, generator=g),
                     torch.randint(0, 64, (1, 4), generator=g), past_key_values=kv.hf, attention_mask=mask,
                     use_cache=True, position_ids=pos))
    kv.advance(4)
    keys, values = kv.export(kv.length)
    return outs + keys + values


@pytest.mark.parametrize("layer,fused", [("eagle1", False), ("eagle1", True), ("eagle3", True)])
@pytest.mark.parametrize("cache", ["dynamic", "prefix"])
def test_head_steps_on_the_lean_loop_equal_transformers(layer, fused, cache):
    """``EagleHead.run_lean``: decoding steps through decode/core/lean.py's loop compute what the head's
    transformers stack computes (fused layer ops or PyTorch's), and its training forward stays transformers'."""
    model = tiny_llama(layers=4, seed=6)
    head = _head(model, fused=fused, layer=layer)
    with torch.inference_mode():
        want = _head_steps(head, cache)
        assert head.run_lean(cache) is None and head.lean is not None
        for ops in (True, False):
            head.lean.fused = ops and glue_unusable(head.model) is None
            got = _head_steps(head, cache)
            for a, b in zip(want, got, strict=True):
                torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert "static cache" in head.run_lean("static") and head.lean is None


def test_fused_head_without_engine_rows_computes_its_layers():
    model = tiny_llama(layers=4, seed=5)
    head = _head(model, fused=True)
    arm = EagleArm(head, model, GREEDY, L=3)  # no Target: the arm runs the target for its layers
    ctx = [4, 8, 15, 16, 23]
    draft = arm.propose(ctx, 3)
    assert len(draft) == 3 and arm.target_forwards == 1 and arm.feats.shape == (4, 3 * 32)


def test_pool_of_eagle1_and_eagle3_arms_shares_one_target():
    """Both styles on one Target: the union of their layers, each arm reading its own columns."""
    model = tiny_llama(layers=4, seed=6)
    target = Target(model)
    e1 = EagleArm(_head(model, fused=False, seed=3), model, GREEDY, L=3, target=target, label="e1")
    e3 = EagleArm(_head(model, fused=True, seed=4), model, GREEDY, L=4, target=target, label="e3")
    tree = EagleTreeArm(_head(model, fused=True, seed=5, layer="eagle3"), model, GREEDY, L=3, nodes=8, topk=2,
                        target=target)
    suffix = build_arm("suffix:L=3,min_match=1", ArmEnv(model, None, GREEDY))
    assert target.extra_layers == LAYERS
    assert e1.select.parts == [None] and e3.select.parts == tree.select.parts == [slice(0, 96)]
    eng = _engine(model, [e1, e3, tree, suffix], target)
    assert target.want_hidden
    for prompt in ([1, 2, 3, 4, 5, 1, 2, 3], [7, 9, 11]):
        gen = eng.generate(prompt, build_policy("random", 4, eng.max_len, seed=1), 30)
        assert gen.tokens == plain_greedy(model, prompt, 30)
        assert {r.arm for r in gen.rounds} >= {0, 1, 2}
    assert e1.target_forwards == e3.target_forwards == tree.target_forwards == 0
    # Cali-TS reads H_t^(T) = the post-norm final state from every arm, whatever layers it drafts from
    ctx = prompt + gen.tokens
    with torch.no_grad():
        final = model(torch.tensor([ctx]), output_hidden_states=True).hidden_states[-1][0]
    e1.propose(ctx, 2)
    e3.propose(ctx, 2)
    h1, h3 = e1.calibration_features(1)[0], e3.calibration_features(1)[0]
    assert h3.shape == (32,) and torch.equal(h1, h3)
    assert any(torch.allclose(h3, row, atol=1e-4) for row in final[-2:])  # the last scored committed position


def test_eagle_factory_builds_fused_heads_from_a_folder(tmp_path):
    model = tiny_llama(layers=4, seed=6)
    save_head(_head(model, fused=True), tmp_path / "e3")
    target = Target(model)
    env = ArmEnv(model, None, GREEDY, target=target)
    arm = build_arm(f"eagle:path={tmp_path / 'e3'},L=3,tree=dynamic,nodes=6,topk=2", env)
    assert arm.head.fused and target.extra_layers == LAYERS and target.want_hidden
    eng = _engine(model, [arm], target)
    prompt = [2, 4, 6, 8, 2, 4]
    assert eng.generate(prompt, build_policy("fixed:arm=0", 1, eng.max_len, seed=0), 20).tokens == \
        plain_greedy(model, prompt, 20)


@pytest.mark.parametrize("layer", ["eagle1", "eagle3"])
def test_fused_head_sampling_follows_the_target(layer):
    """Sampled decoding with a fused head keeps the target's law (chi-square on the first two tokens)."""
    from test_sampling_lossless import V, _assert_first_two_tokens_follow_target

    cfg = SamplingConfig(1.0)
    model = tiny_llama(vocab=V, hidden=16, layers=4, seed=4, peaked=4.0)
    gen = torch.Generator().manual_seed(0)
    wrapped = Target(model)
    head = EagleHead(model, init="last_layer", feature_layers=(1, 2, 3), layer=layer)
    arm = EagleArm(head, model, cfg, L=2, generator=gen, target=wrapped)
    eng = SpecEngine(wrapped, [arm], Verifier(cfg, generator=gen))
    _assert_first_two_tokens_follow_target(eng, model, cfg)


# --------------------------------------------------------------------------- the recipe end to end

@pytest.fixture(scope="module")
def tiny4_dir(tmp_path_factory, tiny_target_dir):
    """A 4-layer tiny Llama with the tiny target's tokenizer (the distilled text reads the same): head.layer=eagle3
    needs 3 distinct feature layers below N, which the 2-layer tiny target does not have."""
    from helpers import save_tiny_target
    return save_tiny_target(tmp_path_factory.mktemp("tiny4"), tiny_target_dir, layers=4)


def test_eagle3_recipe_trains_from_the_cli_then_decodes_losslessly(tiny_distilled, tiny4_dir):
    from decode.core.models import load_model
    from toolkit.train import eagle

    d, _, common = tiny_distilled
    tiny = tiny4_dir
    # EAGLE-3's default (2, N//2, N-3) is (2, 2, 1) on a 4-layer target: name three of its states
    argv = ["--recipe", "recipes/heads/eagle3.yaml", *common, f"target={tiny}", f"out_dir={d}/eagle3",
            "head.feature_layers=[0,1,2]", "open_text.fraction=0.3"]
    assert eagle.main(argv) == 0
    report = json.loads((d / "eagle3" / "eval.json").read_text())
    assert report["feature"] == "fused target layers [0, 1, 2]"
    assert len(report["heldout"]["by_step"]) == 3
    assert report["recipe"]["head"]["ttt_steps"] == 3 and report["recipe"]["head"]["layer"] == "eagle3"
    target, _ = load_model(tiny)
    wrapped = Target(target)
    arm = build_arm(f"eagle:path={d / 'eagle3'},L=3", ArmEnv(target, None, GREEDY, target=wrapped))
    assert arm.head.fused and arm.head.feature_layers == (0, 1, 2) and arm.head.layer == "eagle3"
    eng = _engine(target, [arm], wrapped)
    prompt = [1, 5, 9, 5, 1, 5]
    assert eng.generate(prompt, build_policy("fixed:arm=0", 1, eng.max_len, seed=0), 20).tokens == \
        plain_greedy(target, prompt, 20)


def test_cali_ts_and_early_exit_read_the_final_state_beside_a_fused_arm():
    """A fused EAGLE-3 arm widens the Target's hidden rows; the length controller (Cali-TS) and the early-exit
    arm keep reading the post-norm final state (HiddenStates.final), and decoding stays lossless."""
    from decode.choose.heads import EarlyExitDrafter
    from decode.choose.arms.early_exit import EarlyExitArm
    from decode.choose.length import build_length

    model = tiny_llama(layers=4, seed=2)
    head = EagleHead(model, feature_layers=(1, 2, 3))
    target = Target(model, want_hidden=True)
    arms = [EagleArm(head, model, GREEDY, L=3, target=target),
            EarlyExitArm(EarlyExitDrafter(model, 1), GREEDY, L=3, target=target)]
    assert target.extra_layers != ()
    eng = SpecEngine(target, arms, Verifier(GREEDY))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    gen = eng.generate(prompt, build_policy("random", 2, eng.max_len, seed=0), 24,
                       length=build_length("cali-ts:predictor=top1"))
    assert gen.tokens == plain_greedy(model, prompt, 24)
    assert arms[1].target_hidden.shape == (model.config.hidden_size,)


@pytest.mark.parametrize("style", ["eagle1", "eagle3"])
def test_cached_features_train_the_same_head_as_on_the_fly(tiny_distilled, tiny4_dir, style):
    """feature_cache.enabled=true (float32) reads back exactly what the target computes on the fly: the same
    data, the same steps, the same trained weights; a rerun reuses the cache."""
    from safetensors.torch import load_file

    from toolkit.train import eagle

    d, tiny, common = tiny_distilled
    extra = [f"target={tiny4_dir}", "head.features=fused", "head.feature_layers=[0,1,2]", "head.ttt_steps=2",
             "head.layer=eagle3"] if style == "eagle3" else []
    args = common + ["train.max_steps=2", "open_text.fraction=0", *extra]
    assert eagle.main(args + [f"out_dir={d}/fly_{style}"]) == 0
    cached = args + [f"out_dir={d}/cached_{style}", "feature_cache.enabled=true", "feature_cache.dtype=float32"]
    assert eagle.main(cached) == 0
    names = json.loads((d / f"cached_{style}" / "feature_cache" / "meta.json").read_text())["names"]
    assert names == (["target_final", "target_hidden"] if style == "eagle3" else ["target_hidden"])
    fly = load_file(str(d / f"fly_{style}" / "head.safetensors"))
    got = load_file(str(d / f"cached_{style}" / "head.safetensors"))
    assert fly.keys() == got.keys()
    for k in fly:
        torch.testing.assert_close(got[k], fly[k], atol=1e-5, rtol=1e-4)
