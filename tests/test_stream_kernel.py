"""decode/core/kernels/stream.py: the stream linear equals ``F.linear`` to float32 rounding for every shape a round
can give it (rows past the 12 of one pass, output columns past the 32 of a block, batched and strided inputs, a bias),
runs inside a compiled graph, and greedy decoding through a target on it equals plain greedy decoding."""
import pytest
import torch

from decode.choose.policies import build_policy
from decode.core.kernels.stream import pack_stream, stream_linear, stream_usable
from decode.core.linear import STREAM_MAX_ROWS, PackedLinear, pack_linears
from decode.core.sampling import SamplingConfig
from decode.engine.loop import build_engine
from helpers import plain_greedy, tiny_llama

WHY = stream_usable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the stream kernel cannot run here: {WHY}")


@pytest.mark.parametrize("n,k", [(576, 576), (100, 37), (33, 64), (1, 130), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 12, 13, 17])
def test_matches_f_linear(n, k, rows):
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w, b = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    packed = pack_stream(w)
    assert packed.shape == (-(-n // 32), k, 32)
    ref = x.double() @ w.double().T
    for bias in (None, b):
        out = stream_linear(x, packed, bias, n)
        want = ref if bias is None else ref + bias.double()
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        # float32 rounding of stock's size (chunked sums), not a looser tolerance
        stock = torch.nn.functional.linear(x, w, bias).double()
        assert (out.double() - want).abs().max() <= 4 * (stock - want).abs().max() + 1e-6


def test_batched_and_strided_inputs():
    w = torch.randn(70, 48)
    x = torch.randn(2, 5, 96)[..., ::2]  # [2, 5, 48], not contiguous
    out = stream_linear(x, pack_stream(w), None, 70)
    assert out.shape == (2, 5, 70)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)


def test_refuses_what_it_cannot_multiply():
    packed = pack_stream(torch.randn(64, 16))
    with pytest.raises(RuntimeError, match="x has 8 features, the weight 16"):
        stream_linear(torch.randn(2, 8), packed, None, 64)
    with pytest.raises(RuntimeError, match="n does not match"):
        stream_linear(torch.randn(2, 16), packed, None, 20)
    with pytest.raises(RuntimeError, match="float32"):
        stream_linear(torch.randn(2, 16, dtype=torch.float64), packed, None, 64)


def test_packed_linear_runs_stock_past_its_row_limit(monkeypatch):
    import decode.core.linear as linear
    lin = torch.nn.Linear(16, 40)
    packed = PackedLinear(lin, "stream")
    calls = []
    real = linear.stream_linear
    monkeypatch.setattr(linear, "stream_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.no_grad():
        for rows in (1, STREAM_MAX_ROWS, STREAM_MAX_ROWS + 1):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(packed(x), lin(x), atol=1e-5, rtol=1e-5)
    assert [s[0] for s in calls] == [1, STREAM_MAX_ROWS]  # the long prefill ran stock


def test_compiled_graph_calls_the_stream_op():
    lin = torch.nn.Linear(16, 24)
    packed = PackedLinear(lin, "stream")
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(packed, dynamic=False)(x), lin(x), atol=1e-5, rtol=1e-5)


def test_stream_target_decodes_exactly_like_plain_greedy(tiny_target_dir):
    """A tree arm scores up to 11 positions a round (one pass of 11 rows; with AVX2 four passes), pld a chain: both
    lossless."""
    from decode.core.models import load_model
    model, tok = load_model(tiny_target_dir)
    eng = build_engine(model, tok, ["pld:L=4", "union:arms=pld:L=4+suffix:L=6,nodes=10"], SamplingConfig(),
                       torch.Generator(), cache="dynamic", linear="stream")
    assert eng.target.linear == "stream" and eng.target.model is not model
    assert type(model.get_output_embeddings()) is torch.nn.Linear  # the stock model is untouched
    assert all(m.kernel == "stream" for m in eng.target.model.modules() if isinstance(m, PackedLinear))
    for text in ("def add(a, b):\n    return a + b\n\ndef add(a, b):", "one two three one two three one"):
        ids = tok(text).input_ids
        for arm in (0, 1):
            out = eng.generate(ids, build_policy(f"fixed:arm={arm}", 2, eng.max_len), 24)
            assert out.tokens == plain_greedy(model, ids, 24)


def test_logits_of_a_stream_model_match_stock_at_every_round_size():
    model = tiny_llama(layers=2, seed=5)
    fast = pack_linears(model, "stream")
    with torch.inference_mode():
        for n in (1, 2, 4, 8, 9, 12, 13, 16):
            ids = torch.tensor([list(range(3, 3 + n))])
            torch.testing.assert_close(fast(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
