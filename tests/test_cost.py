"""The verification cost curve (decode/core/cost.py) and the cost-aware length controller (decode/choose/length.py
``cost``): medians over a window, ratios to the one-token forward of the same context bucket, fallbacks,
the argmax of expected tokens per cost, and greedy losslessness through the engine."""
import itertools

import numpy as np

import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.core.cost import CostCurve, curve_summary, markdown_curve, probe, verification_forwards
from decode.core.draft import Outcome, RoundRecord, StepTimes
from decode.engine.loop import SpecEngine
from decode.common.errors import UserError
from decode.choose.length import CostAware, build_length
from decode.choose.policies import build_policy
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.verify import Verifier
from helpers import TinyTokenizer, plain_greedy, tiny_llama

GREEDY = SamplingConfig()


def _curve(points, context=100, bucket=256):
    c = CostCurve(bucket=bucket)
    for n, secs in points:
        for s in (secs if isinstance(secs, list) else [secs]):
            c.observe(n, context, s)
    return c


def test_curve_is_a_median_ratio_to_the_one_token_forward_of_the_same_bucket():
    c = _curve([(1, [0.030, 0.032, 0.031, 5.0]), (3, [0.040, 0.041, 0.039])])  # one 5 s outlier
    assert c.steps(1, 100) == 1.0
    assert c.steps(3, 100) == pytest.approx(0.040 / 0.0315)
    # a machine slowed down as a whole (another bucket, everything 10x) keeps its own ratio
    for s in (0.3, 0.32):
        c.observe(1, 600, s)
    c.observe(3, 600, 0.6)
    assert c.steps(3, 600) == pytest.approx(0.6 / 0.31)
    assert c.table() == {"0": {"1": 1.0, "3": round(0.040 / 0.0315, 3)}, "512": {"1": 1.0, "3": round(0.6 / 0.31, 3)}}


def test_curve_window_forgets_old_measurements():
    c = CostCurve(window=3)
    for s in (1.0, 1.0, 1.0, 2.0, 2.0, 2.0):
        c.observe(2, 0, s)
    assert c.seconds(2, 0) == 2.0 and c.samples() == 3


def test_a_runs_curve_is_rebuilt_from_its_rounds_forwards():
    """Reports rebuild c(n) from every round's [n, context, ms]: n = drafted + 1, context = prompt + tokens
    before the round; medians over the whole run (no window), in one-token steps per context bucket."""
    rounds = [RoundRecord(arm=0, drafted=d, accepted=0, new_tokens=k, draft_time=0, verify_time=0)
              for d, k in ((0, 1), (2, 3), (2, 1), (0, 1))]
    times = [StepTimes(0, 0, s, 0, 0) for s in (0.010, 0.012, 0.014, 0.0102)]
    fw = verification_forwards(250, rounds, times)
    assert fw == [[1, 250, 10.0], [3, 251, 12.0], [3, 254, 14.0], [1, 255, 10.2]]
    s = curve_summary(fw * 20)  # more forwards than a live curve's window: all count
    assert s["forwards"] == 80 and s["bucket_tokens"] == 256
    assert s["steps"] == {"0": {"1": 1.0, "3": round(13.0 / 10.1, 3)}} and s["one_token_ms"] == {"0": 10.1}
    s2 = curve_summary(fw + [[1, 300, 20.0], [2, 300, 30.0]])
    assert s2["steps"]["256"] == {"1": 1.0, "2": 1.5}
    md = markdown_curve(s2)
    assert "| context tokens | 1-token ms | c(1) | c(2) | c(3) |" in md
    assert "| 256–511 | 20.0 | 1.00 | 1.50 | — |" in md
    assert curve_summary([[3, 10, 5.0]]) is None  # no one-token forward: no unit to divide by


def test_curve_fallbacks_nearest_bucket_then_interpolation():
    c = _curve([(1, 0.03), (2, 0.033), (5, 0.045)], context=10)
    assert c.steps(2, 2000) == pytest.approx(1.1)  # nothing measured near 2000 tokens: the nearest bucket's
    assert c.steps(3, 10) == pytest.approx(1.1 + (1.5 - 1.1) / 3)  # between 2 and 5, linearly
    assert c.steps(7, 10) == pytest.approx(1.5 + 2 * (1.5 - 1.1) / 3)  # beyond 5: the last slope
    assert CostCurve().steps(4, 0) == 4.0  # nothing at all measured: n positions = n steps
    with pytest.raises(ValueError):
        CostCurve(bucket=0)


def test_absolute_times_beyond_a_buckets_sizes_borrow_another_buckets_growth():
    """A batch's rounds measure a cluster of nearby sizes in a new context bucket (14-16 rows × 1 position); a block
    of 32 there is read from the growth another bucket measured, not from the cluster's noisy last slope."""
    c = CostCurve()
    for n, t in ((16, 0.040), (32, 0.060), (64, 0.100)):  # the probe, at a short context
        c.observe(n, 10, t)
    for n, t in ((14, 0.0575), (15, 0.0570), (16, 0.0580)):  # rounds at a long context: flat within noise
        c.observe(n, 700, t)
    assert c.seconds_at(32, 700) == pytest.approx(0.058 * 0.060 / 0.040)
    assert c.seconds_at(48, 700) == pytest.approx(0.058 * 0.080 / 0.040)  # between the lender's 32 and 64
    assert c.seconds_at(15, 700) == pytest.approx(0.0570) and c.seconds_at(8, 700) == pytest.approx(0.0575)
    assert c.seconds_at(32, 10) == pytest.approx(0.060)
    alone = CostCurve()  # no other bucket to borrow from: the last slope, as before
    for n, t in ((14, 0.0575), (16, 0.0580)):
        alone.observe(n, 700, t)
    assert alone.seconds_at(32, 700) == pytest.approx(0.0580 + 16 * 0.0005 / 2)


def test_absolute_times_below_a_buckets_sizes_borrow_another_buckets_ratio():
    """A batch that reached a new context bucket with 14 rows, then played blocks of 2-3 positions there as rows
    finished: a plain round of 10 rows is read from the ratio t(10) / t(14) another bucket measured, not as what 14
    rows cost (which made every block look cheap beside it)."""
    c = CostCurve()
    for n, t in ((10, 0.040), (12, 0.044), (14, 0.048), (16, 0.052)):  # the rounds at a shorter context
        c.observe(n, 300, t)
    for n, t in ((14, 0.060), (20, 0.066), (30, 0.078)):  # the new bucket: 14 rows once, then 10 rows × 2 and × 3
        c.observe(n, 600, t)
    assert c.seconds_at(10, 600) == pytest.approx(0.060 * 0.040 / 0.048)
    assert c.seconds_at(11, 600) == pytest.approx(0.060 * 0.042 / 0.048)  # between the lender's 10 and 12
    assert c.seconds_at(10, 300) == pytest.approx(0.040)
    alone = CostCurve()  # nothing to borrow from: the smallest size's time (a smaller forward costs no more)
    for n, t in ((14, 0.060), (20, 0.066)):
        alone.observe(n, 600, t)
    assert alone.seconds_at(10, 600) == pytest.approx(0.060)


def test_growth_is_read_inside_the_nearest_bucket_that_spans_both_sizes():
    """t(m) / t(n) for a batch's block against its plain round: from one bucket whose sizes span both, not from
    absolute times of two buckets. A batch that reached a long context with blocks of 10 rows × 2 and × 3 only
    reads c_10(2) from the shorter context's plain rounds and probe, not t(20) / t(20)."""
    c = CostCurve()
    for n, t in ((10, 0.040), (12, 0.044), (16, 0.050), (32, 0.070)):  # plain rounds and the probe, short context
        c.observe(n, 300, t)
    for n, t in ((20, 0.060), (30, 0.075)):  # the long context: blocks only
        c.observe(n, 800, t)
    assert c.growth(10, 20, 800) == pytest.approx((0.050 + 4 * 0.020 / 16) / 0.040)  # 20 between 16 and 32
    assert c.growth(20, 30, 800) == pytest.approx(0.075 / 0.060)  # both measured at the long context: its own
    assert c.growth(10, 20, 300) == c.growth(10, 20, 800)
    assert c.growth(10, 64, 800) is None  # no bucket spans 64
    assert CostCurve().growth(1, 2, 0) is None


def _brute_force(rates, costs, d):
    best = None
    for k in range(1, len(rates) + 1):
        e = 1 + sum(float(torch.tensor(rates[:m]).prod()) for m in range(1, k + 1))
        v = e / (costs[k + 1] + k * d)
        if best is None or v > best[0] + 1e-12:
            best = (v, k)
    return best[1]


@pytest.mark.parametrize("accepts", [[0.1] * 4, [0.9] * 4, [0.95, 0.9, 0.2, 0.9], [0.6, 0.6, 0.6, 0.6]])
@pytest.mark.parametrize("curve", [{2: 1.10, 3: 1.25, 4: 1.64, 5: 1.68}, {2: 1.5, 3: 1.4, 4: 1.3, 5: 1.35}])
def test_cost_controller_picks_the_argmax_of_expected_tokens_per_cost(accepts, curve):
    """Rounds with known acceptance per position teach the controller a_i; its plan is the brute-force
    argmax of E[tokens | k] / (c(k+1) + k·d), and the callback drafts exactly k* tokens."""
    c = _curve([(1, 0.03)] + [(n, 0.03 * v) for n, v in curve.items()])
    ctl = build_length("cost:prior=1")
    assert isinstance(ctl, CostAware)
    ctl.use_cost(c)
    rng = torch.Generator().manual_seed(0)
    for _ in range(400):  # rounds of 4 drafted tokens, position i accepted with accepts[i] given i-1 was
        acc = 0
        while acc < 4 and torch.rand(1, generator=rng).item() < accepts[acc]:
            acc += 1
        ctl.update(4, Outcome(accepted=acc, tokens=[0] * (acc + 1), tv=[], accept_prob=[]), arm=3)
        ctl.observe_round(RoundRecord(arm=3, drafted=4, accepted=acc, new_tokens=acc + 1, draft_time=0.004 * 4,
                                      verify_time=0.05, step_time=0.04))
    assert ctl.draft_cost[3] == pytest.approx(0.1)
    rates = ctl.rates(3, 4)
    costs = {n: c.steps(n, 100) for n in range(2, 6)}
    k = ctl.plan(3, 4, context=100)[0]
    assert k == _brute_force(rates, costs, 0.1)
    cb = ctl.keep_going(3, max_len=4, context=100)
    drafted = next(i for i in itertools.count(1) if i == 4 or not cb(i))
    assert drafted == k and ctl.plans[3][-1][0] == k
    # an arm it knows nothing about: the prior's rates (0.5 each)
    assert ctl.rates(7, 2) == [0.5, 0.5]


def test_a_position_never_reached_is_expected_to_do_as_the_one_before():
    """An arm whose 2-token drafts were mostly accepted whole (a copy on an extraction prompt): its third position,
    never drafted, is expected at the second's rate, so where 4 positions cost a jump the controller still drafts
    past 2 (with a flat 1/2 prior there it planned 2 for ever: E(3)/c(4) < E(2)/c(3)); a position whose data say
    otherwise keeps its own rate."""
    c = _curve([(1, 0.03), (2, 0.03 * 1.07), (3, 0.03 * 1.20), (4, 0.03 * 1.44), (5, 0.03 * 1.49)])
    ctl = build_length("cost:prior=1")
    ctl.use_cost(c)
    for accepted in [2] * 40 + [1] * 5 + [0] * 5:
        ctl.update(2, Outcome(accepted=accepted, tokens=[0] * (accepted + 1), tv=[], accept_prob=[]), arm=0)
    a = ctl.rates(0, 4)
    assert a[0] == pytest.approx(46 / 52) and a[1] == pytest.approx((40 + 2 * a[0]) / 47)
    assert a[2] == a[3] == pytest.approx(a[1])  # never reached: the rate before
    flat = [a[0], a[1], 0.5, 0.5]
    costs = {n: c.steps(n, 100) for n in range(2, 6)}
    assert _brute_force(flat, costs, 0.0) == 2  # what the flat prior planned
    assert ctl.plan(0, 4, context=100)[0] == _brute_force(a, costs, 0.0) == 4
    for _ in range(200):  # drafted to 4: position 3 is now rejected every time
        ctl.update(4, Outcome(accepted=2, tokens=[0] * 3, tv=[], accept_prob=[]), arm=0)
    assert ctl.rates(0, 3)[2] < 0.05 and ctl.plan(0, 4, context=100)[0] == 2


def test_cost_controller_spec_errors():
    with pytest.raises(UserError, match="prior"):
        build_length("cost:prior=0")
    with pytest.raises(UserError):
        build_length("cost:pryor=1")


def test_probe_seeds_the_curve_without_changing_the_cache():
    model = tiny_llama(layers=1, hidden=16, seed=3)
    t = Target(model)
    c = CostCurve()
    probe(c, t, [1, 2, 3, 4], [1, 3], repeats=2)
    assert c.samples() == 4 and set(c.table()["0"]) == {"1", "3"}
    assert t.cached == 3  # the prompt minus its last token, as after a prefill


@pytest.mark.parametrize("cache", ["dynamic", "static", "prefix"])
def test_engine_with_cost_controller_is_greedy_lossless_and_feeds_the_curve(cache, one_thread):
    model = tiny_llama(layers=2, seed=1)
    env = ArmEnv(model, TinyTokenizer(64), GREEDY, torch.Generator(), cache=cache)
    arms = [build_arm("pld:L=4,n=1", env), build_arm("suffix:L=5,min_match=1", env)]
    eng = SpecEngine(Target(model, cache=cache), arms, Verifier(GREEDY), step_time=1.0)
    ctl = build_length("cost")
    for prompt in ([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9]):
        gen = eng.generate(prompt, build_policy("random", 2, 5, seed=2), 30, length=ctl)
        assert gen.tokens == plain_greedy(model, prompt, 30)
        for r in gen.rounds:
            assert r.drafted <= arms[r.arm].L
    assert eng.cost.samples() > 0 and ctl.curve is eng.cost
    assert sum(len(v) for v in ctl.plans.values()) == len(gen.rounds)  # one plan per round of the last query


def test_the_engine_probes_the_sizes_its_curve_lacks_before_a_cost_controller_plans(one_thread, monkeypatch):
    """decode eval's warm-up left rounds of 2 and 5 positions in the curve, never a one-token forward: probing only
    an empty curve left c(n) without its base (read as n), and the controller drafted one token a round."""
    import decode.engine.loop as loop
    calls = []
    monkeypatch.setattr(loop, "probe", lambda curve, target, ids, sizes, clock=None: (
        calls.append(list(sizes)), probe(curve, target, ids, sizes, clock=clock)))
    model = tiny_llama(layers=2, seed=1)
    env = ArmEnv(model, TinyTokenizer(64), GREEDY, torch.Generator())
    eng = SpecEngine(Target(model), [build_arm("pld:L=4,n=1", env)], Verifier(GREEDY))
    for n in (2, 5):
        eng.cost.observe(n, 10, 0.01)
    assert eng.cost.steps(3, 10) == 3.0  # no one-token forward: c(n) falls back to n
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    for _ in range(2):
        gen = eng.generate(prompt, build_policy("random", 1, 4), 12, length=build_length("cost"))
        assert gen.tokens == plain_greedy(model, prompt, 12)
    assert calls == [[1, 3, 4]]  # the missing sizes, once: the second query finds them measured
    assert {1, 2, 3, 4, 5} <= eng.cost.sizes() and eng.cost.steps(3, 10) != 3.0


def test_a_drafted_tokens_cost_is_a_windowed_median_so_a_rounds_one_off_work_does_not_linger():
    """A query's first round carries an EAGLE head's catch-up over the prompt: a running mean kept it all query."""
    from decode.core.cost import DraftCost

    def rec(arm, drafted, seconds):
        return RoundRecord(arm, drafted, 0, 1, seconds, 0.05, step_time=0.05)

    d = DraftCost(window=4)
    assert d[0] == 0.0
    d.observe(rec(0, 2, 0.030))  # the catch-up: 0.3 steps a token
    d.observe(rec(0, 0, 0.0))  # drafted nothing: no evidence
    for _ in range(2):
        d.observe(rec(0, 2, 0.007))  # 0.07 steps a token
    assert d[0] == pytest.approx(0.07) and d[1] == 0.0
    for _ in range(4):
        d.observe(rec(0, 1, 0.010))
    assert d[0] == pytest.approx(0.2)  # the window moved on
    # the controller and the router read it
    ctl, router = build_length("cost"), build_policy("router:cost=true", 2, 4)
    ctl.observe_round(rec(1, 2, 0.030))
    router.update(1, rec(1, 2, 0.030))
    assert ctl.draft_cost[1] == router.draft_steps[1] == pytest.approx(0.3)


def _row(q: float, V: int = 8) -> torch.Tensor:
    """A draft distribution whose top probability is ``q``."""
    row = torch.full((V,), (1 - q) / (V - 1))
    row[0] = q
    return row


def test_confidence_stopping_calibrates_the_drafters_confidence_and_stops_when_more_does_not_pay():
    """A drafter whose confidence q is also the true chance its token is accepted, but q is reported 0.3 too
    high: the calibration learns the truth per decile, and the callback drafts on exactly when some longer
    draft pays more tokens per step of cost than stopping now (checked by brute force)."""
    c = _curve([(1, 0.03), (2, 0.033), (3, 0.036), (4, 0.039), (5, 0.042)])  # each position costs 0.1 step
    ctl = build_length("cost:confidence=true")
    ctl.use_cost(c)
    rng = np.random.default_rng(0)
    for _ in range(3000):  # rounds of 4 tokens; token j is accepted w.p. true_j given j-1 was
        go = ctl.keep_going(2, max_len=4, context=100)
        true = rng.choice([0.05, 0.25, 0.55], size=4)
        for i in range(1, 4):
            go(i, _row(min(true[i - 1] + 0.3, 1.0)))
        acc = 0
        while acc < 4 and rng.random() < true[acc]:
            acc += 1
        ctl.update(4, Outcome(accepted=acc, tokens=[0] * (acc + 1), tv=[], accept_prob=[]), arm=2)
    for q, truth in ((0.35, 0.05), (0.55, 0.25), (0.85, 0.55)):
        assert ctl.calibrated(2, q) == pytest.approx(truth, abs=0.05)
    rates = ctl.rates(2, 4)

    def best_more(confs):  # brute force: E_k / cost(k) of every k > i against stopping at i
        a = [ctl.calibrated(2, q) for q in confs] + rates[len(confs):]
        value = [(1 + sum(np.prod(a[:m]) for m in range(1, k + 1))) / c.steps(k + 1, 100) for k in range(1, 5)]
        return max(value[len(confs):]) > value[len(confs) - 1]

    decisions = set()
    for confs in ([0.85], [0.35], [0.85, 0.85], [0.85, 0.35], [0.55, 0.55, 0.85], [0.35, 0.85, 0.85]):
        go = ctl.keep_going(2, max_len=4, context=100)
        for i, q in enumerate(confs, start=1):
            more = go(i, _row(q))
        assert more == best_more(confs), confs
        decisions.add(more)
    assert decisions == {True, False}  # both outcomes occur: the test discriminates
    plan = ctl.take_plans()[-1]  # the recorded plan is the revised one the round stopped at
    a = [ctl.calibrated(2, q) for q in (0.35, 0.85, 0.85)]
    assert plan[0] == pytest.approx(1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2])
    assert plan[1] == pytest.approx(c.steps(4, 100))
    fixed = build_length("cost")  # the default: the k* plan, whatever the drafter's confidence
    fixed.use_cost(c)
    go = fixed.keep_going(2, max_len=4, context=100)
    assert go(1, _row(0.01)) == go(1, _row(0.99)) and fixed.round_conf[2] == []
    with pytest.raises(UserError):
        build_length("cost:prior_weight=0")


def test_engine_with_confidence_stopping_is_greedy_lossless_and_varies_the_length(one_thread):
    from decode.choose.arms.model import DrafterModelArm
    model, drafter = tiny_llama(layers=2, seed=1), tiny_llama(layers=2, seed=2)
    arms = [DrafterModelArm(drafter, GREEDY, 5), DrafterModelArm(model, GREEDY, 5)]  # weak, and perfect
    eng = SpecEngine(Target(model), arms, Verifier(GREEDY), step_time=1.0)
    ctl = build_length("cost:confidence=true")
    lengths = set()
    for prompt in ([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9], [3, 3, 3]):
        gen = eng.generate(prompt, build_policy("random", 2, 5, seed=2), 40, length=ctl)
        assert gen.tokens == plain_greedy(model, prompt, 40)
        lengths |= {r.drafted for r in gen.rounds}
    assert len(lengths) > 1 and ctl.calib  # confidences were seen and the lengths vary


# --------------------------------------------------------------------------- tree node budget

@pytest.mark.parametrize("curve", [{2: 1.10, 3: 1.25, 4: 1.64, 5: 1.68, 6: 1.9, 7: 2.0},
                                   {2: 1.5, 3: 1.4, 4: 1.3, 5: 1.35, 6: 1.4, 7: 1.45}])
@pytest.mark.parametrize("values", [[0.9, 0.8, 0.5, 0.2, 0.1, 0.05], [0.3, 0.1, 0.1, 0.05, 0.01, 0.01]])
def test_node_budget_is_the_best_prefix_and_its_scale_learns_the_accepted_depth(curve, values):
    c = _curve([(1, 0.03)] + [(n, 0.03 * v) for n, v in curve.items()])
    ctl = build_length("cost:prior_weight=4")
    ctl.use_cost(c)
    spent = 0.3 * 0.03  # 0.3 steps of drafting

    def brute(scale):
        best = None
        for n in range(1, len(values) + 1):
            v = (1 + sum(min(1.0, scale * x) for x in values[:n])) / (c.steps(n + 1, 100) + 0.3)
            if best is None or v > best[0] + 1e-12:
                best = (v, n)
        return best[1]

    n, e, cost, raw = ctl.node_budget(5, values, 100, spent)
    assert n == brute(1.0) and raw == pytest.approx(sum(values[:n]))
    assert e == pytest.approx(1 + sum(min(1.0, x) for x in values[:n]))
    assert cost == pytest.approx(c.steps(n + 1, 100) + 0.3)
    # through the round's callback: the plan recorded is the tree's, and the outcome calibrates s
    promised = accepted = 0.0
    for r in range(30):  # the head over-promises: one round in six accepts one node, the rest none
        cb = ctl.keep_going(5, max_len=3, context=100)
        n = cb.node_budget(values, spent)
        assert ctl.plans[5][-1][0] == n
        promised, accepted = promised + sum(values[:n]), accepted + (r % 6 == 0)
        ctl.update(n, Outcome(accepted=int(r % 6 == 0), tokens=[0], tv=[], accept_prob=[]), arm=5)
        ctl.update(n, Outcome(accepted=1, tokens=[0, 0], tv=[], accept_prob=[]), arm=5)  # not a tree round: no-op
    assert ctl.tree_scale(5) == pytest.approx((accepted + 4) / (promised + 4)) and ctl.tree_scale(5) < 1
    assert ctl.node_budget(5, values, 100, spent)[0] == brute(ctl.tree_scale(5))


def test_a_tree_grows_only_where_some_budget_of_its_possible_nodes_pays():
    """deeper_pays against its definition: some budget over the nodes so far plus j depths of ``width`` nodes at the
    bound (each depth one more head forward) beats the best budget over the nodes so far."""
    steep = _curve([(1, 0.03), (2, 0.03 * 1.05), (3, 0.03 * 1.08), (4, 0.03 * 1.47), (5, 0.03 * 1.5),
                    (6, 0.03 * 1.55), (7, 0.03 * 1.6), (8, 0.03 * 1.65), (9, 0.03 * 1.7)])
    flat = _curve([(1, 0.03)] + [(n, 0.03 * (1 + 0.01 * n)) for n in range(2, 10)])
    for c in (steep, flat):
        ctl = build_length("cost")
        ctl.use_cost(c)

        def ratio(vals, spent):
            return max((1 + sum(vals[:n])) / (c.steps(n + 1, 100) + spent) for n in range(1, len(vals) + 1))

        for values, bound, depths in (([0.6, 0.15], 0.6, 3), ([0.6, 0.15, 0.2], 0.2, 2), ([0.9, 0.05], 0.9, 1),
                                      ([0.3, 0.2], 0.05, 3), ([0.5, 0.4], 0.02, 1)):
            values = sorted(values, reverse=True)
            spent, step = 0.2, 0.08  # steps of drafting so far, and one more head forward
            want = any(ratio(sorted(values + [bound] * (2 * j), reverse=True)[:8], spent + j * step)
                       > ratio(values, spent) for j in range(1, depths + 1))
            got = ctl.deeper_pays(0, values, 100, spent * 0.03, step * 0.03, bound, 2, depths, 8)
            assert got == want, (values, bound, depths)
    ctl = build_length("cost")
    ctl.use_cost(steep)  # 2 nodes verify for 1.08 steps, a third costs 0.39 more: a depth of weak nodes stops
    assert not ctl.deeper_pays(0, [0.6, 0.15], 100, 0.006, 0.0024, 0.1, 2, 3, 8)
    ctl.use_cost(flat)  # where positions are nearly free, it grows
    assert ctl.deeper_pays(0, [0.6, 0.15], 100, 0.006, 0.0024, 0.1, 2, 3, 8)


def test_a_budgeted_tree_stops_drafting_depths_that_cannot_pay(one_thread):
    """The tree asks the controller (``keep_going.deeper``) before each head forward over its nodes once one has
    been timed: told no, its rounds stay at depth 1 and stay lossless; told yes, they grow to depth L."""
    from decode.choose.arms.eagle.tree import EagleTreeArm
    from decode.choose.heads import EagleHead

    model = tiny_llama(layers=2, seed=1, peaked=4.0)
    head = EagleHead(model, init="identity").eval()
    target = Target(model, want_hidden=True)
    tree = EagleTreeArm(head, model, GREEDY, L=3, nodes=8, topk=3, target=target)
    eng = SpecEngine(target, [tree], Verifier(GREEDY), step_time=1.0)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    forwards = []
    step = tree._step_tree
    tree._step_tree = lambda *a: forwards.append(1) or step(*a)
    for answer in (False, True):
        forwards.clear()
        tree._step_seconds = None  # no forward timed yet
        ctl = build_length("cost")
        asked = []
        ctl.deeper_pays = lambda *a, answer=answer: asked.append(a) or answer
        gen = eng.generate(prompt, build_policy("fixed", 1, eng.max_len), 30, length=ctl)
        assert gen.tokens == plain_greedy(model, prompt, 30)
        depths = [r.drafted if r.depth is None else r.depth for r in gen.rounds if r.drafted]  # None: a chain
        # width (3 expanded nodes × top-3), depths left, the node cap: the first round timed its first forward
        # unasked and is asked before its second; every later round before its first
        assert asked[0][6:] == (3 * 3, 1, 8) and asked[1][6:] == (3 * 3, 2, 8)
        if answer:  # grown to L = 3: two forwards over tree nodes a round (the budget then cuts what pays)
            assert len(forwards) > len(depths)
        else:  # told no, the head ran one forward over tree nodes (the first round's, timed) and no more
            assert len(forwards) == 1 and max(depths[1:]) == 1


def test_engine_with_a_cost_budgeted_tree_is_greedy_lossless(one_thread):
    from decode.choose.arms.eagle.tree import EagleTreeArm
    from decode.choose.heads import EagleHead

    model = tiny_llama(layers=2, seed=1, peaked=4.0)
    head = EagleHead(model, init="identity").eval()
    target = Target(model, want_hidden=True)
    tree = EagleTreeArm(head, model, GREEDY, L=3, nodes=8, topk=3, target=target)
    eng = SpecEngine(target, [tree], Verifier(GREEDY), step_time=1.0)
    ctl = build_length("cost")
    sizes = set()
    for prompt in ([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 9, 11, 7, 9], [3, 3, 3]):
        gen = eng.generate(prompt, build_policy("fixed", 1, eng.max_len), 30, length=ctl)
        assert gen.tokens == plain_greedy(model, prompt, 30)
        sizes |= {r.drafted for r in gen.rounds}
        assert [p[0] for p in ctl.plans[0]] == [r.drafted for r in gen.rounds]  # the plan is what was verified
    assert max(sizes) <= 8 and ctl.tree_stats[0][0] > 0
