"""Simulator: eq. 10 streams, stopping times, counterfactual traces and exact replays, the CLI."""
import json

import numpy as np
import pytest

from decode.choose.arms import ArmEnv, build_arm
from decode.commands.cli import main
from decode.engine.loop import SpecEngine
from decode.choose.policies import build_policy
from decode.choose.policies.simple import Fixed
from decode.core.sampling import SamplingConfig
from decode.simulation.simulate import ReplayInstance, SyntheticInstance, run_policy, stopping_times
from decode.core.target import Target
from decode.simulation.traces import load_traces, record_trace, write_traces
from decode.core.verify import Verifier
from helpers import TinyTokenizer, plain_greedy, tiny_llama

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]


@pytest.mark.parametrize("kappa", [0.0, 4.0])
def test_synthetic_tokens_per_round_is_truncated_geometric(kappa):
    p, L, n = 0.7, 4, 40_000
    inst = SyntheticInstance([p], [L], n, seed=1, kappa=kappa)
    ys = np.array([inst.step(0, 0, k, 10).accepted + 1 for k in range(n)])
    expected = [p ** (x - 1) * (1 - p) for x in range(1, L + 1)] + [p ** L]  # eq. 10
    freq = np.bincount(ys, minlength=L + 2)[1:] / n
    np.testing.assert_allclose(freq, expected, atol=0.01)
    r = inst.step(0, 0, 3, 10)
    assert len(r.tv) == L and all(0 <= t <= 1 for t in r.tv)  # every drafted position is scored


def test_switch_changes_the_regime_at_the_given_position():
    inst = SyntheticInstance([0.0, 0.99], [3, 3], 1000, seed=0, kappa=0, switch_at=50, p_after=[0.99, 0.0])
    assert inst.step(0, 49, 0, 100).accepted == 0 and inst.step(1, 49, 0, 100).accepted >= 2
    assert inst.step(0, 50, 0, 100).accepted >= 2 and inst.step(1, 50, 0, 100).accepted == 0


def test_stopping_times_from_cumulative_tokens():
    cum = np.array([2, 3, 7, 10])
    assert stopping_times(cum, np.array([1, 2, 3, 4, 7, 8, 10])).tolist() == [1, 1, 2, 3, 3, 4, 4]
    inst = SyntheticInstance([0.5, 0.9], [4, 4], 500, seed=2)
    arms, cum, _ = run_policy(Fixed(2, 4, arm=1), inst)
    assert cum[-1] == 500 and set(arms.tolist()) == {1}


def _engine(model):
    g = SamplingConfig()
    env = ArmEnv(model, TinyTokenizer(64), g)
    arms = [build_arm(s, env) for s in ("pld:L=0", "pld:L=3,n=2", "suffix:L=6,min_match=1")]
    return SpecEngine(Target(model), arms, Verifier(g))


def test_traced_runs_match_untraced_and_replay_fixed_arms_exactly(tmp_path):
    model = tiny_llama(seed=1, peaked=3.0)
    eng = _engine(model)
    N = 24
    ref = plain_greedy(model, PROMPT, N)
    K = len(eng.arms)
    live = {}
    for i in range(K):
        plain = eng.generate(PROMPT, Fixed(K, eng.max_len, arm=i), N)
        traced = record_trace(eng, PROMPT, Fixed(K, eng.max_len, arm=i), N, "rounds")
        assert plain.tokens == traced.tokens == ref
        assert [(r.accepted, r.drafted) for r in plain.rounds] == [(r.accepted, r.drafted) for r in traced.rounds]
        live[i] = (len(plain.rounds), traced.trace)
    assert len({st for st, _ in live.values()}) == K  # the arms really differ on this prompt
    gen = record_trace(eng, PROMPT, build_policy("ucbspec", K, eng.max_len), N, "dense")
    assert gen.tokens == ref and gen.trace.mismatches == 0 and len(gen.trace.steps) == N
    path = tmp_path / "traces.json"
    write_traces(path, [gen.trace] + [t for _, t in live.values()])
    dense, *rounds = load_traces(path)
    assert dense.to_dict() == gen.trace.to_dict()
    for i in range(K):
        st = live[i][0]
        # a round-mode trace replays its own fixed arm exactly; a dense trace replays every fixed arm
        assert len(run_policy(Fixed(K, eng.max_len, arm=i), ReplayInstance(rounds[i]))[0]) == st
        assert len(run_policy(Fixed(K, eng.max_len, arm=i), ReplayInstance(dense))[0]) == st
        # the other arms' counterfactual Y at live positions match the dense record at the same positions
        for step in rounds[i].steps:
            assert [a.y for a in step.arms] == [a.y for a in dense.steps[step.pos].arms]
    # and a policy replayed on the dense trace reproduces its own live run
    replayed, _, _ = run_policy(build_policy("ucbspec", K, eng.max_len), ReplayInstance(dense))
    assert replayed.tolist() == [r.arm for r in gen.rounds]


def test_cli_synthetic_writes_json_markdown_and_plot(tmp_path, capsys):
    out = tmp_path / "sim" / "report.json"
    rc = main(["simulate", "--length", "300", "--seeds", "3", "--points", "3", "--no-progress",
               "--switch-at", "150", "--p-after", "0.8,0.7,0.6,0.5,0.3", "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    pols = rep["summary"]["policies"]
    assert {"ucbspec", "exp3spec", "metasd_ucb", "exp3", "sh", "ducb", "swucb", "thompson", "random"} <= set(pols)
    assert rep["summary"]["lengths"] == [100, 173, 300]
    for d in pols.values():
        assert len(d["regret"]) == 4 and 0 <= d["best_arm_ratio"] <= 1  # 3 grid lengths + full length
        assert d["regret"][-1] == d["regret"][-2]  # the full length is the last grid length here
    assert out.with_suffix(".md").read_text().count("|") > 20
    assert out.with_suffix(".png").stat().st_size > 1000


def test_cli_replay_and_errors(tmp_path, capsys):
    model = tiny_llama(seed=1, peaked=3.0)
    eng = _engine(model)
    gen = record_trace(eng, PROMPT, build_policy("random", 3, eng.max_len), 12, "dense")
    path = tmp_path / "t.json"
    write_traces(path, [gen.trace])
    out = tmp_path / "r.json"
    assert main(["simulate", "--traces", str(path), "--seeds", "2", "--policies", "ucbspec;metasd_ucb:c=0.1",
                 "--no-plot", "--no-progress", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["summary"]["policies"]) == {"ucbspec", "metasd_ucb:c=0.1"} and rep["summary"]["approx_steps"] == 0
    capsys.readouterr()
    assert main(["simulate", "--p", "0.5,1.5", "--out", str(out)]) == 2
    assert "--p" in capsys.readouterr().err
    assert main(["simulate", "--traces", str(tmp_path / "missing.json"), "--out", str(out)]) == 2
    assert main(["simulate", "--policies", "fixed:arm=1", "--out", str(out)]) == 2


def test_sampled_traced_run_leaves_the_live_output_unchanged():
    """Counterfactual drafting and verification must not consume the live run's random numbers."""
    import torch
    from decode.choose.arms.model import DrafterModelArm
    s = SamplingConfig(temperature=1.0)
    model, drafter = tiny_llama(seed=1, peaked=3.0), tiny_llama(seed=2)
    gen = torch.Generator()
    env = ArmEnv(model, TinyTokenizer(64), s, gen)
    arms = [build_arm("pld:L=3", env), DrafterModelArm(drafter, s, 3, gen), DrafterModelArm(model, s, 4, gen)]
    eng = SpecEngine(Target(model), arms, Verifier(s, generator=gen))
    outs = []
    for mode in (None, "rounds", "dense"):
        gen.manual_seed(5)
        pol = build_policy("ucbspec", 3, 4, seed=1)
        g = eng.generate(PROMPT[:8], pol, 16) if mode is None else record_trace(eng, PROMPT[:8], pol, 16, mode)
        outs.append((g.tokens, [(r.arm, r.accepted) for r in g.rounds]))
    assert outs[0] == outs[1] == outs[2]


def test_time_measure_counts_drafting_cost_and_throughput_reward_learns_it():
    """--measure time: without costs a round takes 1 unit (time == rounds); with a drafting cost the
    best γ-arm moves from the longest to a middle length, and the throughput reward finds it better
    than tokens-per-round does (BanditSpec §6.2)."""
    from decode.simulation.simulate import simulate
    lengths = np.array([500, 2000])
    Ls = [0, 1, 2, 4, 8]

    def make(cost):
        return [lambda s: SyntheticInstance([0.7] * 5, Ls, 2000, 1_000_003 * s + 17, 4.0, None, None, cost, 0.0)]

    free = simulate((make(0.0), [0, 1]), ["ucbspec"], 5, 8, lengths, progress=False, measure="time")
    rounds = simulate((make(0.0), [0, 1]), ["ucbspec"], 5, 8, lengths, progress=False, measure="rounds")
    assert np.array_equal(free["st"]["ucbspec"], rounds["st"]["ucbspec"])
    specs = ["ucbspec", "ucbspec:reward=throughput"]
    res = simulate((make(0.15), list(range(6))), specs, 5, 8, lengths, progress=False, measure="time")
    fixed = [float(np.mean(res["st"][f"fixed:arm={i}"][..., -1])) for i in range(5)]
    assert int(np.argmin(fixed)) == 3  # L=4 beats L=8 once each drafted token costs 0.15 verifications
    assert np.mean(res["st"]["ucbspec:reward=throughput"][..., -1]) < np.mean(res["st"]["ucbspec"][..., -1])


def test_full_information_beats_bandit_feedback_and_the_round_oracle_bounds_everything(tmp_path):
    out = tmp_path / "fi.json"
    assert main(["simulate", "--length", "1500", "--seeds", "3", "--points", "2", "--no-progress", "--no-plot",
                 "--policies", "ucbspec;hedge;normalhedge;ftl:floor=0;router;ucbspec:fullinfo=true",
                 "--out", str(out)]) == 0
    s = json.loads(out.read_text())["summary"]
    pols = s["policies"]
    oracle = s["round_oracle"]["mean_st"][-1]
    assert oracle < min(d["mean_st"][-1] for d in s["fixed"].values())  # per-round choice beats any fixed arm
    for name in ("hedge", "normalhedge", "ftl:floor=0", "router", "ucbspec:fullinfo=true"):
        # every arm's reward every round: far less regret than learning from the played arm only
        assert pols[name]["regret"][-1] < 0.25 * pols["ucbspec"]["regret"][-1], name
        assert pols[name]["regret_vs_round_oracle"][-1] > 0
    assert "per-round oracle" in out.with_suffix(".md").read_text()


def test_round_oracle_on_a_dense_trace_picks_the_most_tokens_each_round():
    from decode.simulation.simulate import RoundOracle
    model = tiny_llama(seed=1, peaked=3.0)
    eng = _engine(model)
    gen = record_trace(eng, PROMPT, build_policy("random", 3, eng.max_len), 16, "dense")
    inst = ReplayInstance(gen.trace)
    arms, cum, _ = run_policy(RoundOracle(3), inst)
    pos = 0
    for a, c in zip(arms, cum):
        ys = [s.y for s in gen.trace.steps[pos].arms]
        assert min(ys[a], 16 - pos) == min(max(ys), 16 - pos)
        pos = int(c)
    fixed_rounds = [len(run_policy(Fixed(3, eng.max_len, arm=i), inst)[0]) for i in range(3)]
    assert len(arms) <= min(fixed_rounds)
    hedge_rounds = len(run_policy(build_policy("hedge", 3, eng.max_len), inst)[0])
    assert hedge_rounds >= len(arms)
