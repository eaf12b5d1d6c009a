"""Ragged blocks (decode/core/ragged.py): a batched round's block fed as its real slots only scores every real slot
as the padded block does, writes the same keys and values into each row's slots, and is what the engine feeds where
the target runs our attention."""
import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.policies import build_policy
from decode.core.attention import our_attention_model
from decode.core.ragged import RaggedBlock
from decode.core.sampling import SamplingConfig
from decode.core.verify import Verifier
from decode.engine.batch import BatchEngine
from helpers import TinyTokenizer, tiny_llama


@pytest.fixture(scope="module")
def model():
    return our_attention_model(tiny_llama(vocab=64, layers=2, seed=3, peaked=4.0).double())


def _engine(model, **kw):
    env = ArmEnv(model, TinyTokenizer(64), SamplingConfig())
    return BatchEngine(model, lambda: [build_arm("none", env)], lambda K: build_policy("fixed:arm=0", K, 1),
                       Verifier(SamplingConfig(), "torch"), **kw)


def test_packing_round_trips_a_blocks_real_slots():
    valid = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    p = RaggedBlock.of(valid)
    x = torch.arange(9.0).view(3, 3, 1)
    ragged = p.gather(x)
    assert p.n == 6 and ragged.flatten().tolist() == [0, 1, 3, 6, 7, 8]  # row-major, real slots only
    assert torch.equal(p.scatter(ragged)[valid], x[valid]) and not p.scatter(ragged)[~valid].any()
    heads = torch.arange(2 * 6 * 4.0).view(1, 2, 6, 4)  # [1, heads, N, dim] → [B, heads, W, dim]
    assert torch.equal(p.scatter_heads(heads)[2, :, 1], heads[0, :, 4])


@pytest.mark.parametrize("hidden", [False, True])
def test_a_ragged_forward_scores_and_caches_the_real_slots_as_the_padded_one(model, hidden):
    eng = _engine(model)
    assert eng.ragged
    for p in ([1, 2, 3, 4, 5], [7, 9], [3, 3, 8, 3, 3, 8, 3], [12, 40]):
        eng.add(p, 8)
    eng.step()  # every row holds its prompt in the cache
    B, W = len(eng.rows), 3
    valid = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    ids = torch.randint(1, 64, (B, W), generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([len(r.ctx) - 1 for r in eng.rows])[:, None] + torch.arange(W)
    out, slots = {}, {}
    for ragged in (False, True):
        eng.ragged = ragged
        start = eng.cache.slots
        logits, _, states = eng._forward(ids, pos, valid, hidden=hidden)
        layer = eng.cache.hf.layers[1]
        slots[ragged] = (layer.keys[:, :, start:start + W][valid.nonzero(as_tuple=True)[0], :,
                                                            valid.nonzero(as_tuple=True)[1]].clone(),
                         layer.values[:, :, start:start + W].transpose(1, 2)[valid].clone())
        out[ragged] = (logits[valid], None if states is None else states[-1][valid])
        eng.cache.commit(torch.zeros(B, W, dtype=torch.bool))  # neither block's slots stay visible
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-10)
    if hidden:
        torch.testing.assert_close(out[True][1], out[False][1], rtol=0, atol=1e-10)
    for a, b in zip(slots[True], slots[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_the_engine_feeds_padded_blocks_where_the_target_runs_another_attention_or_when_told(model):
    m = tiny_llama(vocab=64, layers=1, seed=3)
    m.set_attn_implementation("eager")
    assert not _engine(m).ragged
    assert _engine(model).ragged and not _engine(model, ragged=False).ragged
