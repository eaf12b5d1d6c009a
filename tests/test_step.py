"""One round as a unit: SpecEngine.step is the round; generate and trace recording drive it."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.model import DrafterModelArm
from decode.engine.loop import DecodeState, SpecEngine, StepResult, StepTimes
from decode.choose.policies import build_policy
from decode.choose.policies.simple import Fixed
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.simulation.traces import record_trace
from decode.core.verify import Verifier
from helpers import TinyTokenizer, plain_greedy, tiny_llama

GREEDY = SamplingConfig()
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]


@pytest.fixture(scope="module")
def models(one_thread):
    return tiny_llama(seed=1, peaked=3.0), tiny_llama(seed=2)


def _engine(model, drafter, sampling=GREEDY, gen=None, eos=()):
    gen = gen or torch.Generator()
    env = ArmEnv(model, TinyTokenizer(64), sampling, gen)
    arms = [build_arm("pld:L=3", env), build_arm("suffix:L=6,min_match=1", env),
            DrafterModelArm(drafter, sampling, 3, gen), DrafterModelArm(model, sampling, 4, gen)]
    return SpecEngine(Target(model), arms, Verifier(sampling, generator=gen), eos, step_time=1.0)


def _rounds(rounds):
    return [(r.arm, r.drafted, r.accepted, r.new_tokens, r.tv, r.accept_prob, r.max_len, r.extra_target_forwards)
            for r in rounds]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_equals_a_manual_loop_of_steps(models, temperature):
    model, drafter = models
    s = SamplingConfig(temperature=temperature)
    gen = torch.Generator()
    eng = _engine(model, drafter, s, gen)
    gen.manual_seed(3)
    ref = eng.generate(PROMPT, build_policy("ucbspec", 4, eng.max_len, seed=1), 30)
    gen.manual_seed(3)
    state = eng.begin(PROMPT, build_policy("ucbspec", 4, eng.max_len, seed=1), 30)
    assert isinstance(state, DecodeState) and state.ctx == PROMPT and eng.target.cached == len(PROMPT) - 1
    results = []
    while not state.done:
        res = eng.step(state)
        assert isinstance(res, StepResult) and isinstance(res.times, StepTimes)
        assert eng.target.cached == len(state.ctx) - 1  # the cache invariant after every round
        results.append(res)
    out = eng.finish(state)
    assert out.tokens == ref.tokens == [t for r in results for t in r.tokens]
    assert _rounds(out.rounds) == _rounds(ref.rounds) == _rounds([r.record for r in results])
    assert out.stopped_by == ref.stopped_by == "length" and len(out.tokens) == 30
    assert len(out.step_times) == len(out.rounds) and 0 < out.setup_time < out.wall_time
    for r in results:
        assert r.record.arm == r.arm and r.outcome.tokens[:len(r.tokens)] == r.tokens
        assert r.record.drafted == len(r.draft) == len(r.outcome.tv)
        t = r.times
        parts = [t.select, t.draft, t.score, t.verify, t.rollback, t.update]
        assert all(p >= 0 for p in parts) and sum(parts) <= t.total + 1e-9 and t.other >= -1e-9
        assert r.record.draft_time == t.draft and r.record.verify_time == pytest.approx(t.score + t.verify + t.rollback)
    if temperature == 0:
        assert ref.tokens == plain_greedy(model, PROMPT, 30)
    with pytest.raises(ValueError, match="finished"):
        eng.step(state)


def test_step_with_a_forced_arm_and_eos(models):
    model, _ = models
    ref = plain_greedy(model, PROMPT, 30)
    j = next(j for j in range(4, 30) if ref.index(ref[j]) == j)
    eng = _engine(model, models[1], eos=[ref[j]])
    state = eng.begin(PROMPT, Fixed(4, eng.max_len, arm=0), 30)
    while not state.done:
        assert eng.step(state, arm=3).arm == 3  # a forced arm overrides the policy
    assert state.tokens == ref[:j + 1] and state.stopped_by == "eos"
    assert {r.arm for r in state.rounds} == {3}


def test_counterfactual_step_changes_nothing_but_reports_the_arm(models):
    model, drafter = models
    eng = _engine(model, drafter)
    pol = build_policy("ucbspec", 4, eng.max_len)
    state = eng.begin(PROMPT, pol, 20)
    eng.step(state)

    def snapshot():
        return (list(state.ctx), list(state.tokens), len(state.rounds), eng.target.cached, pol.t,
                pol.pulls.tolist(), pol.sum_y.tolist())

    before = snapshot()
    probe = eng.step(state, 3, counterfactual=True)
    assert probe.record is None and probe.tokens == [] and probe.outcome.accepted == 4  # the target drafts itself
    assert snapshot() == before
    live = eng.step(state, 3)
    assert live.outcome.tokens == probe.outcome.tokens  # greedy: the probe is what the round then does
    with pytest.raises(ValueError, match="counterfactual"):
        eng.step(state, 0, keep=3)


def test_dense_trace_counts_are_what_each_arm_gives_from_that_prefix(models):
    """A dense trace recorded through step equals, position by position, a fresh query started at that
    prefix and played one round with each arm (the pre-refactor trace's definition)."""
    model, drafter = models
    eng = _engine(model, drafter)
    N = 14
    g = record_trace(eng, PROMPT, build_policy("ucbspec", 4, eng.max_len), N, "dense")
    assert g.tokens == plain_greedy(model, PROMPT, N) and g.trace.mismatches == 0
    assert len(g.trace.steps) == N and g.trace.step_time == 1.0 and g.wall_time > 0
    assert g.tokens == eng.generate(PROMPT, build_policy("ucbspec", 4, eng.max_len), N).tokens
    starts = [s.pos for s in g.trace.steps if s.live >= 0]
    assert starts == [sum(r.new_tokens for r in g.rounds[:k]) for k in range(len(g.rounds))]
    for m, step in enumerate(g.trace.steps):
        assert step.pos == m
        for j in range(len(eng.arms)):
            state = eng.begin(PROMPT + g.tokens[:m], Fixed(4, eng.max_len, arm=j), N - m)
            res = eng.step(state)
            a = step.arms[j]
            assert (a.accepted, a.drafted, a.y) == (res.outcome.accepted, len(res.draft), res.outcome.accepted + 1)
            # a fresh prefill of the longer prompt differs from the incremental cache in float rounding only
            assert a.tv == pytest.approx(res.outcome.tv, abs=1e-5) and a.accept_prob == res.outcome.accept_prob


def test_rounds_trace_live_entries_are_the_live_rounds(models):
    model, drafter = models
    eng = _engine(model, drafter)
    g = record_trace(eng, PROMPT, build_policy("ucbspec", 4, eng.max_len), 16, "rounds")
    assert [s.live for s in g.trace.steps] == [r.arm for r in g.rounds]
    for s, r in zip(g.trace.steps, g.rounds):
        live = s.arms[s.live]
        assert (live.accepted >= r.accepted, live.drafted, live.tv) == (True, r.drafted, r.tv)
        assert all(a is not None for a in s.arms)
    with pytest.raises(Exception, match="trace mode"):
        record_trace(eng, PROMPT, build_policy("ucbspec", 4, eng.max_len), 4, "sparse")


def test_engine_does_not_import_traces_and_generate_has_no_trace_parameter():
    root = Path(__file__).resolve().parents[1]
    code = ("import sys, decode.engine.loop; "
            "assert 'decode.simulation.traces' not in sys.modules, 'engine imports traces'")
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)
    src = (root / "decode" / "engine" / "loop.py").read_text()
    assert "traces" not in "".join(line for line in src.splitlines() if line.lstrip().startswith(("import", "from")))
    import inspect
    assert "trace" not in inspect.signature(SpecEngine.generate).parameters


def test_verify_reads_the_device_once_per_round(models, monkeypatch):
    """Verifier.verify hands the host one small vector (no logits): one .tolist(), no other reads."""
    model, _ = models
    t = Target(model)
    t.prefill(PROMPT)
    draft_tokens = torch.tensor(plain_greedy(model, PROMPT, 4)[:2] + [7, 9])
    logits = t.score(PROMPT[-1], draft_tokens).logits
    from decode.core.draft import Draft
    calls = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(self.numel()) or real(self))
    for name in ("item", "cpu", "numpy", "__int__", "__float__", "__bool__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=orig, _n=name, **k: calls.append(_n) or _o(self, *a, **k))
    out = Verifier(GREEDY).verify(logits, Draft(draft_tokens))
    monkeypatch.undo()
    assert calls == [3 + 3 * 4]  # accepted, next, status + tv, accept_prob, draft ids for L = 4
    assert out.accepted >= 2 and all(type(x) is int for x in out.tokens)
    assert out.tokens[:2] == draft_tokens[:2].tolist()
