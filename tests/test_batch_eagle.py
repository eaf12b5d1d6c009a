"""EAGLE chains drafted batched per head (decode/choose/arms/eagle/batched.py, issue 32 §1): every row's draft is
the serial chain's from the same context, token for token, whatever its batch-mates do; rows stay lossless; the
head is loaded once for all rows; what cannot batch is refused before a model loads."""
import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.eagle import EagleArm
from decode.choose.heads import EagleHead, save_head
from decode.choose.policies import build_policy
from decode.common.errors import UserError
from decode.core.sampling import SamplingConfig
from decode.core.verify import Verifier
from decode.engine.batch import BatchEngine, check_batch_arm_specs, check_batchable
from helpers import TinyTokenizer, plain_greedy, tiny_llama

GREEDY = SamplingConfig()
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9], [5], [3, 3, 8, 3, 3, 8, 3, 3, 8, 3],
           [12, 40, 7, 12, 40, 7, 12, 40, 7, 12, 40, 7, 12, 40], [2, 4]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=64, layers=4, seed=3, peaked=4.0).double()  # float64: no near-tie flips between shapes


def _head(model, fused: bool) -> EagleHead:
    """A head whose every tensor matters (the identity init would hide wrong wiring)."""
    head = EagleHead(model, init="last_layer", feature_layers=(1, 2, 3) if fused else None).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in head.trainable_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype) * (p.abs().mean() + 0.05))
    return head.eval()


def _engine(model, head, sampling=GREEDY, pool=("eagle", "pld:L=3", "none"), policy="random", seed=0, **kw):
    env = ArmEnv(model, TinyTokenizer(64), sampling)

    def make_arms():
        return [EagleArm(head, model, sampling, 3, generator=torch.Generator().manual_seed(seed)) if s == "eagle"
                else build_arm(s, env) for s in pool]

    seeds = iter(range(seed, seed + 10_000))
    return BatchEngine(model, make_arms, lambda K: build_policy(policy, K, 4, seed=next(seeds)),
                       Verifier(sampling, "torch", torch.Generator().manual_seed(seed)), **kw)


def _spy(monkeypatch) -> list:
    """Record (context, cap, draft) of every EAGLE draft the batched engine makes (arm 0)."""
    seen = []
    propose = BatchEngine._propose

    def spy(self, picks, caps):
        drafts = propose(self, picks, caps)
        seen.extend((list(r.ctx), c, d) for r, i, c, d in zip(self.rows, picks, caps, drafts) if i == 0)
        return drafts

    monkeypatch.setattr(BatchEngine, "_propose", spy)
    return seen


@pytest.mark.parametrize("fused", [False, True], ids=["eagle1", "eagle3"])
@pytest.mark.parametrize("max_batch", [None, 2])
def test_batched_drafts_are_the_serial_chains_and_rows_stay_lossless(model, monkeypatch, fused, max_batch):
    head = _head(model, fused)
    seen = _spy(monkeypatch)
    eng = _engine(model, head)
    rows = eng.generate(PROMPTS, 20, max_batch=max_batch)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 20), p
    assert len(eng.drafters) == 1 and not eng.drafters[id(head)].rows  # one drafter for the head, rows all left
    drafted = [s for s in seen if len(s[2])]
    assert len(drafted) > 10 and any(len(s[2]) > 1 for s in drafted)
    assert any(rec.arm == 0 and rec.accepted for r in rows for rec in r.rounds)  # some EAGLE drafts were accepted
    for ctx, cap, draft in seen:  # the serial chain from the same context, its features from a full forward
        serial = EagleArm(head, model, GREEDY, 3).propose(ctx, cap)
        assert draft.tokens.tolist() == serial.tokens.tolist(), ctx
        if len(draft):
            torch.testing.assert_close(draft.hidden, serial.hidden.to(draft.hidden.dtype))


def test_sampled_draft_distributions_are_the_serial_chains(model, monkeypatch):
    """Under sampling a draft's first-position distribution (what the verifier divides by) is the serial arm's."""
    cfg = SamplingConfig(temperature=0.9, top_k=20)
    head = _head(model, fused=False)
    seen = _spy(monkeypatch)
    rows = _engine(model, head, sampling=cfg, seed=5).generate(PROMPTS, 16)
    assert all(len(r.tokens) == 16 for r in rows)
    drafted = [s for s in seen if len(s[2])]
    assert len(drafted) > 5
    for ctx, cap, draft in drafted:
        serial = EagleArm(head, model, cfg, 3, generator=torch.Generator().manual_seed(0)).propose(ctx, cap)
        torch.testing.assert_close(draft.q[0], serial.q[0])


def test_rows_without_the_head_and_rows_joining_mid_flight(model):
    """A server row may serve an arm subset without the head (the drafter keeps an empty row for it), and rows join
    between rounds; everything stays each row's plain greedy decoding."""
    head = _head(model, fused=False)
    eng = _engine(model, head)
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    done = {}
    first = [eng.add(p, 20) for p in PROMPTS[:2]]
    plain = eng.add(PROMPTS[2], 20, arms=[build_arm("pld:L=2", env)], policy=build_policy("random", 1, 4))
    for _ in range(3):
        done.update({r.rid: r for r in eng.step()})
    late = [eng.add(p, 12) for p in PROMPTS[3:]]
    while eng.rows:
        done.update({r.rid: r for r in eng.step()})
        d = eng.drafters[id(head)]
        assert d.rows == len(eng.rows) == d.cache.rows
    for rid, p in zip(first + [plain] + late, PROMPTS):
        assert done[rid].tokens == plain_greedy(model, p, 12 if rid in late else 20), p


def test_the_head_loads_once_per_env_and_what_cannot_batch_is_refused(tmp_path):
    model = tiny_llama(vocab=64, layers=4, seed=3)
    save_head(EagleHead(model), tmp_path / "h")
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    a, b = (build_arm(f"eagle:path={tmp_path / 'h'},L=2", env) for _ in range(2))
    assert a.head is b.head and a.cache is not b.cache  # one module, a cache per arm instance
    check_batchable([a, build_arm("pld:L=2", env)])
    check_batch_arm_specs([f"eagle:path={tmp_path / 'h'},L=2", "suffix:L=3"])
    for spec in (f"eagle:path={tmp_path / 'h'},tree=dynamic", f"eagle:path={tmp_path / 'h'},K=2",
                 f"eagle:path={tmp_path / 'h'},counterfactual=true"):
        with pytest.raises(UserError, match="EAGLE chains"):
            check_batch_arm_specs([spec])
    with pytest.raises(UserError, match="EAGLE chains"):
        check_batchable([build_arm(f"eagle:path={tmp_path / 'h'},tree=dynamic", env)])
