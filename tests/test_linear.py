"""decode/core/linear.py: the target's linears packed once for oneDNN — the stock model is untouched and shares
every weight, outputs match ``nn.Linear`` to float32 rounding, greedy decoding through packed target and arms
equals plain greedy decoding, and ``--linear`` resolves or refuses with the reason."""
import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.eagle import EagleArm
from decode.engine.loop import SpecEngine, build_engine
from decode.common.errors import UserError
from decode.choose.heads import EagleHead
from decode.core.linear import (PackedLinear, kernel_usable, onednn_linear, onednn_usable, pack_arm_linears,
                               pack_linears, probe_linear, resolve_linear)
from decode.choose.policies import build_policy
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.verify import Verifier
from decode.core.vocab import DraftVocab
from helpers import plain_greedy, tiny_llama

GREEDY = SamplingConfig()
PROMPTS = [[1, 5, 9, 2, 5, 9, 2, 5], [3, 3, 7, 1, 8, 2, 8, 2, 8, 4, 6]]
pytestmark = pytest.mark.skipif(onednn_usable("cpu", torch.float32) is not None,
                                reason=f"oneDNN unusable here: {onednn_usable('cpu', torch.float32)}")


def test_packed_copy_shares_weights_leaves_the_stock_model_alone_and_matches_it():
    model = tiny_llama(layers=2, seed=1)
    fast = pack_linears(model)
    stock_linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    packed = [n for n, m in fast.named_modules() if isinstance(m, PackedLinear)]
    assert stock_linears and packed == stock_linears  # every linear, and the stock model still has its own
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    for (n, p), (n2, q) in zip(model.named_parameters(), fast.named_parameters()):
        assert n == n2 and p.data_ptr() == q.data_ptr(), n  # shared, not copied
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        a, b = model(ids).logits, fast(ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4) and not torch.equal(a, torch.zeros_like(a))
    assert fast.get_output_embeddings().weight is model.get_output_embeddings().weight


@pytest.mark.parametrize("cache,kernel", [("dynamic", "onednn"), ("static", "onednn"), ("prefix", "onednn"),
                                          ("prefix", "stream")])
def test_greedy_through_packed_target_and_eagle_equals_plain_greedy(cache, kernel):
    if (why := kernel_usable(kernel, "cpu", torch.float32)) is not None:
        pytest.skip(why)
    model = tiny_llama(layers=2, seed=2)
    V = model.config.vocab_size
    head = EagleHead(model, draft_vocab=DraftVocab(torch.arange(0, V, 2), V, {"coverage": 0.5}))
    target = Target(pack_linears(model, kernel), want_hidden=True, cache=cache)
    arms = [EagleArm(head, model, GREEDY, L=4, cache=cache, target=target),
            build_arm("pld:L=3", ArmEnv(model, None, GREEDY))]
    n = pack_arm_linears(arms, model, kernel)
    assert n == 9 and isinstance(head.fc, PackedLinear) and head.draft_projection.kernel == kernel
    assert not any(isinstance(m, PackedLinear) for m in model.modules())  # the stock target is untouched
    eng = SpecEngine(target, arms, Verifier(GREEDY))
    for prompt in PROMPTS:
        gen = eng.generate(prompt, build_policy("random", len(arms), eng.max_len), 30)
        assert gen.tokens == plain_greedy(model, prompt, 30)
    with torch.no_grad():  # the packed draft projection equals the float32 one it replaces
        x = torch.randn(3, model.config.hidden_size)
        packed = head.logits(x)
        head.draft_projection = None
        assert torch.allclose(packed, head.logits(x), atol=1e-4, rtol=1e-4)


def test_build_engine_packs_the_arms_as_the_target_runs(tiny_target_dir, tmp_path):
    """The serial engine packs an EAGLE head's linears (its layer, fc, draft projection) with the kernel and row split
    the target's linears run (``mixed`` too: stock below the same ``packed_from``); a stock target leaves them."""
    from decode.choose.heads import save_head
    from decode.core.models import load_model
    model, tok = load_model(tiny_target_dir)
    save_head(EagleHead(model, init="last_layer"), tmp_path / "head", {"kind": "eagle"})
    spec = f"eagle:path={tmp_path / 'head'},L=3"
    for linear in ("stock", "onednn", "auto"):
        eng = build_engine(model, tok, [spec], GREEDY, torch.Generator(), cache="dynamic", linear=linear)
        target = {(m.kernel, m.packed_from) for m in eng.target.model.modules() if isinstance(m, PackedLinear)}
        arm = {(m.kernel, m.packed_from) for m in eng.arms[0].head.modules() if isinstance(m, PackedLinear)}
        assert arm == target and bool(arm) == (eng.target.linear != "stock")
        ids = tok("def add(a, b):").input_ids
        out = eng.generate(ids, build_policy("fixed:arm=0", 1, eng.max_len), 12)
        assert out.tokens == plain_greedy(model, ids, 12)


def test_a_unions_eagle_sub_arm_is_packed_and_stays_lossless():
    """A union reaches its sub-arms' modules (before, its EAGLE head ran stock linears: the BLAS cliff at 2-3 rows)."""
    from decode.choose.arms.union import UnionArm
    model = tiny_llama(layers=2, seed=3)
    head = EagleHead(model)
    target = Target(pack_linears(model), want_hidden=True, cache="dynamic")
    union = UnionArm([EagleArm(head, model, GREEDY, L=3, target=target),
                      build_arm("pld:L=3", ArmEnv(model, None, GREEDY))],
                     nodes=6)
    assert [a.name for a in union.parts] == ["eagle", "pld"]
    assert pack_arm_linears([union], model) == 8 and isinstance(head.fc, PackedLinear)  # no draft vocabulary
    eng = SpecEngine(target, [union], Verifier(GREEDY))
    for prompt in PROMPTS:
        out = eng.generate(prompt, build_policy("fixed:arm=0", 1, eng.max_len), 30)
        assert out.tokens == plain_greedy(model, prompt, 30)


def test_build_engine_packs_only_its_own_copy(tiny_target_dir):
    from decode.core.models import load_model
    model, tok = load_model(tiny_target_dir)
    eng = build_engine(model, tok, ["pld:L=2"], GREEDY, torch.Generator(), cache="dynamic", linear="onednn")
    assert eng.target.linear == "onednn" and eng.target.model is not model
    assert isinstance(eng.target.model.get_output_embeddings(), PackedLinear)
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    ids = tok("def add(a, b):").input_ids
    assert eng.generate(ids, build_policy("fixed:arm=0", 1, eng.max_len), 12).tokens == plain_greedy(model, ids, 12)


def test_compiled_graph_calls_the_packed_op():
    lin = torch.nn.Linear(16, 24)
    packed = PackedLinear(lin)
    x = torch.randn(3, 16)
    compiled = torch.compile(packed, dynamic=False)
    with torch.no_grad():
        assert torch.allclose(compiled(x), lin(x), atol=1e-5)
        assert torch.allclose(onednn_linear(x, lin.weight, lin.bias, packed.key), lin(x), atol=1e-5)


def test_resolve_linear_picks_or_refuses_with_the_reason():
    assert resolve_linear("auto", "cpu", torch.float32) == "auto"  # measured once the model is loaded
    assert resolve_linear("onednn", "cpu", torch.float32) == "onednn"
    assert resolve_linear("stock", "cpu", torch.float32) == "stock"
    assert resolve_linear("auto", "cpu", torch.float16) == "stock"  # not packable: the stock path, recorded as such
    with pytest.raises(UserError, match="dtype float16.*--linear stock"):
        resolve_linear("onednn", "cpu", torch.float16)
    with pytest.raises(UserError, match="on cuda"):
        resolve_linear("onednn", "cuda", torch.bfloat16)
    assert resolve_linear("auto", "cuda", torch.bfloat16) == "stock"
    with pytest.raises(UserError, match="--linear must be one of auto, onednn, stream, stock"):
        resolve_linear("fast", "cpu", torch.float32)
    with pytest.raises(UserError, match="dtype bfloat16 .the stream kernel is float32.*--linear stock"):
        resolve_linear("stream", "cpu", torch.bfloat16)
    with pytest.raises(UserError, match="on cuda"):
        resolve_linear("stream", "cuda", torch.float32)


def _kind(m) -> str:
    head = m.get_output_embeddings()
    return head.kernel if isinstance(head, PackedLinear) else "stock"


@pytest.mark.parametrize("faster", ["stock", "onednn", "stream"])
def test_auto_keeps_the_linears_that_measured_faster(faster, tiny_target_dir, capsys, monkeypatch):
    model = tiny_llama(layers=2, seed=3)
    calls = []

    def measure(m, n):  # a fake clock: the chosen kind is 2 ms a position, the others 3 ms
        calls.append((_kind(m), n))
        m(input_ids=torch.tensor([list(range(1, n + 1))]), use_cache=False)  # it still runs the model
        return n * (0.002 if _kind(m) == faster else 0.003)

    kind, run_model, info = probe_linear(model, positions=(1, 3), reps=2, measure=measure)
    assert kind == faster and info["chosen"] == faster
    assert info["ms"][faster] == {"1": 2.0, "3": 6.0}
    assert all(info["ms"][k]["3"] == 9.0 for k in ("stock", "onednn", "stream") if k != faster)
    assert info["packed_from"] == (None if faster == "stock" else 1)
    assert info["kernel"] == (None if faster == "stock" else faster)
    assert len(calls) == 3 * 2 * 3  # three kinds × two sizes × (warm-up + two reps), interleaved
    assert (run_model is model) == (faster == "stock") and not any(isinstance(m, PackedLinear) for m in model.modules())
    assert _kind(run_model) == faster
    assert f"--linear auto: {faster} linears" in capsys.readouterr().err
    # through build_engine: the measured kind is recorded on the target and decoding stays exact
    from decode.core.models import load_model
    import decode.engine.loop as loop
    m, tok = load_model(tiny_target_dir)
    monkeypatch.setattr(loop, "probe_linear", lambda mm, real=loop.probe_linear: real(mm, reps=1, measure=measure))
    eng = build_engine(m, tok, ["pld:L=2"], GREEDY, torch.Generator(), cache="dynamic", linear="auto")
    assert eng.target.linear == faster and eng.target.linear_probe["chosen"] == faster
    ids = tok("def add(a, b):").input_ids
    assert eng.generate(ids, build_policy("fixed:arm=0", 1, eng.max_len), 12).tokens == plain_greedy(m, ids, 12)


def test_auto_says_which_kernel_it_left_out_and_why(capsys, monkeypatch):
    import decode.core.linear as linear
    monkeypatch.setattr(linear, "stream_usable", lambda: "building stream_linear.cpp failed (no compiler)")
    model = tiny_llama(layers=2, seed=3)
    kind, _, info = probe_linear(model, positions=(1, 2), reps=1,
                                 measure=lambda m, n: 0.001 * n * (2 if _kind(m) == "stock" else 1))
    assert kind == "onednn" and set(info["ms"]) == {"stock", "onednn"}
    assert "--linear auto: stream left out: building stream_linear.cpp failed (no compiler)" in capsys.readouterr().err


@pytest.mark.parametrize("kernel", ["onednn", "stream"])
def test_auto_packs_from_the_size_where_packing_starts_to_pay(kernel, capsys, monkeypatch):
    """Stock faster for 1-2 positions, the kernel from 3 on: ``mixed`` — one packed model whose linears run stock
    below 3 rows — and its logits are the stock model's at every size."""
    model = tiny_llama(layers=2, seed=3)

    def measure(m, n):
        packed = _kind(m) != "stock"
        return 0.001 * n * ((1.0 if n < 3 else 3.0) if not packed else (1.5 if n < 3 else 2.0))

    kind, run_model, info = probe_linear(model, positions=(1, 2, 3, 4), reps=1, measure=measure, kernels=(kernel,))
    assert (kind, info["chosen"], info["kernel"], info["packed_from"]) == ("mixed", "mixed", kernel, 3)
    assert f"{kernel} from 3 positions on, stock below" in capsys.readouterr().err
    packed = [m for m in run_model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.packed_from == 3 and m.kernel == kernel for m in packed)
    calls = []
    import decode.core.linear as linear
    name = "packed_linear" if kernel == "onednn" else "stream_linear"
    real = getattr(linear, name)
    monkeypatch.setattr(linear, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        for n in (1, 2, 3, 5):
            ids = torch.tensor([list(range(1, n + 1))])
            before = len(calls)
            a, b = model(input_ids=ids).logits, run_model(input_ids=ids).logits
            assert (len(calls) > before) == (n >= 3)  # packed kernels only from 3 rows
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
