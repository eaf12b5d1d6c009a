"""Draft-length controllers: Beta-TS / Cali-TS formulas, callbacks, and greedy losslessness."""
import math

import numpy as np
import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.arms.base import Arm
from decode.choose.arms.model import DrafterModelArm
from decode.core.draft import Outcome
from decode.engine.loop import SpecEngine
from decode.common.errors import UserError
from decode.choose.length import BetaTS, CaliContext, CaliTS, LengthController, build_length, length_names
from decode.choose.policies import build_policy
from decode.core.sampling import SamplingConfig
from decode.core.target import Target
from decode.core.verify import Verifier
from helpers import TinyTokenizer, plain_greedy, tiny_llama


def out(accepted):
    return Outcome(accepted, [0] * (accepted + 1))


def test_registry():
    assert length_names() == ["beta-ts", "cali-ts", "cost", "fixed"]
    assert type(build_length(None)) is LengthController and build_length("fixed").keep_going() is None
    c = build_length("beta-ts:alpha=2,beta=3", seed=4)
    assert (c.alpha0, c.beta0, c.seed) == (2.0, 3.0, 4) and c.params(0) == (2.0, 3.0)
    with pytest.raises(UserError, match="known"):
        build_length("greedy-ts")
    with pytest.raises(UserError, match="bad parameters"):
        build_length("cali-ts:foo=1")
    with pytest.raises(UserError, match="sigma"):
        build_length("cali-ts:sigma_m=0")


def test_beta_ts_update_convention():
    c = BetaTS(1, 1)
    c.update(4, out(2))  # 2 accepted, position 3 rejected: α += 2, β += 1
    assert c.params() == (3.0, 2.0)
    c.update(3, out(3))  # all accepted: no failure
    assert c.params() == (6.0, 2.0)
    c.update(0, out(0))  # nothing drafted: no evidence
    assert c.params() == (6.0, 2.0)
    c.reset()
    assert c.params() == (1.0, 1.0)
    k = BetaTS(1, 1, carry=True)
    k.update(2, out(0))
    k.reset()
    assert k.params() == (1.0, 2.0)


def test_beta_ts_keeps_one_posterior_per_arm():
    """A pool has one drafter per arm: evidence about arm 1 must not move arm 0's posterior."""
    c = BetaTS(1, 1, seed=3)
    c.update(4, out(2), arm=1)
    assert c.params(0) == (1.0, 1.0) and c.params(1) == (3.0, 2.0)
    for _ in range(300):
        c.update(4, out(4), arm=1)  # arm 1 always fully accepted
        c.update(4, out(0), arm=0)  # arm 0 always rejected at once
    go, stop = c.keep_going(1), c.keep_going(0)
    assert sum(go(1, None) for _ in range(200)) > 190 and sum(stop(1, None) for _ in range(200)) < 10
    c.reset()
    assert c.params(0) == c.params(1) == (1.0, 1.0)


def test_beta_ts_callback_samples_theta_then_bernoulli():
    c = BetaTS(3, 5, seed=7)
    cb = c.keep_going()
    rng = np.random.default_rng(7)
    for i in range(1, 20):
        theta = rng.beta(3, 5)
        assert cb(i, None) == bool(rng.random() < theta)
    # a posterior piled on failures almost always stops; on successes almost never
    stop = BetaTS(1, 1000).keep_going()
    go = BetaTS(1000, 1).keep_going()
    assert sum(stop(1, None) for _ in range(200)) < 10 and sum(go(1, None) for _ in range(200)) > 190


def test_cali_ts_posterior_by_hand():
    c = CaliTS(sigma_m=0.2, sigma_s=0.5, theta0=0.6)
    assert c.posterior(0.9) == pytest.approx((0.9, 0.2))  # n = 0: the predictor alone
    c.update(4, out(1))  # scored 2 positions, 1 accepted
    c.update(2, out(2))  # scored 2, 2 accepted → θ̂ = 3/4, n = 2
    vm, vs = 0.04, 0.25
    mu = vs / (2 * vm + vs) * 0.9 + 2 * vm / (2 * vm + vs) * 0.75
    assert c.theta_hat() == 0.75 and c.counts() == (2, 3, 4)
    assert c.posterior(0.9) == pytest.approx((mu, math.sqrt(vm * vs / (vs + 2 * vm))))


def test_cali_ts_keeps_one_posterior_per_arm():
    c = CaliTS(sigma_m=0.2, sigma_s=0.5, theta0=0.6)
    c.update(4, out(1), arm=2)
    c.update(2, out(2), arm=2)
    assert c.counts(2) == (2, 3, 4) and c.theta_hat(2) == 0.75
    assert c.counts(0) == (0, 0, 0) and c.theta_hat(0) == 0.6
    assert c.posterior(0.9, arm=0) == pytest.approx((0.9, 0.2))  # arm 0 has no evidence yet
    vm, vs = 0.04, 0.25
    assert c.posterior(0.9, arm=2)[0] == pytest.approx(vs / (2 * vm + vs) * 0.9 + 2 * vm / (2 * vm + vs) * 0.75)


def test_cali_ts_predictor_context_and_defaults():
    seen = []

    def predictor(ctx: CaliContext):
        seen.append(ctx)
        return 1.0

    c = CaliTS(sigma_m=1e-6, sigma_s=1.0, predictor=predictor)
    c.observe_target(torch.ones(3))
    row = torch.tensor([0.1, 0.9])
    assert all(c.keep_going()(2, row, hidden=torch.zeros(2)) for _ in range(20))  # θ ≈ 1 → always continue
    assert seen[0].i == 2 and seen[0].dist_row is row and seen[0].draft_hidden.shape == (2,)
    assert torch.equal(seen[0].target_hidden, torch.ones(3))
    # default predictor: the drafter's top-1 probability of the previous token; θ̂_0 without a distribution
    low = CaliTS(sigma_m=1e-6, sigma_s=1.0, theta0=0.0).keep_going()
    assert not any(low(1, None) for _ in range(20))
    assert not any(low(1, torch.tensor([0.0, 0.0])) for _ in range(20))
    assert all(low(1, torch.tensor([0.0, 1.0])) for _ in range(20))


def _engine(model, drafter):
    g = SamplingConfig()
    env = ArmEnv(model, TinyTokenizer(64), g)
    arms = [build_arm("pld:L=4", env), DrafterModelArm(drafter, g, 4), DrafterModelArm(model, g, 6)]
    return SpecEngine(Target(model), arms, Verifier(g))


def test_greedy_lossless_with_controllers():
    model, drafter = tiny_llama(seed=1), tiny_llama(seed=2)
    eng = _engine(model, drafter)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    ref = plain_greedy(model, prompt, 24)
    for spec in ("beta-ts:alpha=1,beta=5", "cali-ts:theta0=0.1,sigma_m=0.05"):
        short = 0
        for policy in ("fixed:arm=2", "ucbspec"):
            ctl = build_length(spec, seed=3)
            gen = eng.generate(prompt, build_policy(policy, 3, eng.max_len, seed=0), 24, length=ctl)
            assert gen.tokens == ref, (spec, policy)
            short += sum(1 for r in gen.rounds[:-1] if 0 < r.drafted < r.max_len)
        assert short > 0, spec  # the controller really stopped some drafts early


def test_engine_passes_the_arm_index_to_the_length_controller():
    class Recorder(LengthController):
        def _init_state(self):
            self.calls = []

        def keep_going(self, arm=None, **_):
            self.calls.append(("keep_going", arm))
            return None

        def update(self, drafted, outcome, arm=None):
            self.calls.append(("update", arm))

    model, drafter = tiny_llama(seed=1), tiny_llama(seed=2)
    eng = _engine(model, drafter)
    ctl = Recorder(carry=True)
    gen = eng.generate([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], build_policy("random", 3, eng.max_len, seed=1), 24,
                       length=ctl)
    arms = [r.arm for r in gen.rounds]
    assert len(set(arms)) > 1
    assert ctl.calls == [(kind, a) for a in arms for kind in ("keep_going", "update")]


def test_cali_ts_predictor_from_spec_string(tmp_path):
    from decode.choose.length import CaliTS, top1_predictor
    ctl = build_length("cali-ts:predictor=top1")
    assert isinstance(ctl, CaliTS) and ctl.predictor is top1_predictor and not ctl.needs_target_hidden
    with pytest.raises(UserError, match="make train-calibrator"):
        build_length(f"cali-ts:predictor={tmp_path / 'missing'}")


class GreedyTreeArm(Arm):
    """A deterministic tree arm: at each depth the target's own greedy token, then a wrong sibling after it, so
    greedy verification accepts the whole depth; ``nodes`` = 2 · depth."""

    name = "greedy-tree"

    def __init__(self, model, L):
        super().__init__(L)
        self.model, self.max_nodes = model, 2 * L

    def propose(self, context, max_len, keep_going=None):
        from decode.core.draft import Draft

        tokens, parents, prev = [], [], -1
        for tok in plain_greedy(self.model, list(context), min(self.L, max_len)):
            tokens += [tok, (tok + 1) % self.model.config.vocab_size]
            parents += [prev, prev]
            prev = len(tokens) - 2
        return Draft(torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))


@pytest.mark.parametrize("spec", ["beta-ts", "cali-ts", "cost"])
def test_tree_drafts_report_their_depth_to_the_length_controller(spec):
    """A tree's 'drafted' for a length controller is its depth (the draft positions along a root path), not its
    node count: a fully accepted depth-3 tree is a success at depths 1..3 and nothing at depth 4, which was never
    drafted (the node count, 6, would record a rejection there)."""
    model = tiny_llama(seed=1)
    L = 3
    arm = GreedyTreeArm(model, L)
    seen = []

    ctl = build_length(spec, seed=0)
    update = ctl.update

    def record(drafted, outcome, arm=0):
        seen.append((drafted, outcome.accepted))
        update(drafted, outcome, arm=arm)

    ctl.update = record
    eng = SpecEngine(Target(model), [arm], Verifier(SamplingConfig()))
    prompt = [1, 2, 3, 4, 5, 1, 2]
    gen = eng.generate(prompt, build_policy("fixed:arm=0", 1, eng.max_len, seed=0), 12, length=ctl)
    assert gen.tokens == plain_greedy(model, prompt, 12)
    assert [r.drafted for r in gen.rounds] == [2 * L, 2 * L, 2 * L]  # the record keeps the node count
    if spec == "beta-ts":
        assert ctl.params(0) == (1.0 + 3 * L, 1.0)  # no failure recorded
    elif spec == "cali-ts":
        assert ctl.counts(0) == (3, 3 * L, 3 * L)  # positions up to the first rejection = the accepted ones
    else:
        assert ctl.reached[0] == ctl.accepted[0] == [3] * L  # nothing reached at depth L + 1
    assert seen == [(L, L)] * 3  # every round: depth 3 drafted, depth 3 accepted


def test_a_pools_length_is_what_eval_and_generate_run_unless_length_names_one(tmp_path):
    """A pool file's ``length`` (the shipped pool's ``cost``) is the run's controller when no --length is given;
    an explicit --length wins; batched rounds (``--batch``) keep choosing lengths from the batch's cost."""
    import argparse

    import yaml

    from decode.commands import generate
    from decode.evaluation import evaluate
    from decode.evaluation.eval_config import EvalConfig

    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"arms": ["pld:L=4", "suffix:L=3"], "length": "cost:prior=2"}))

    def eval_config(*extra):
        p = argparse.ArgumentParser()
        evaluate.add_arguments(p)
        return EvalConfig.from_args(p.parse_args(["--arms", "", "--pool", str(pool), "--out",
                                                  str(tmp_path / "r.json"), *extra]))

    assert eval_config().length == "cost:prior=2"
    assert eval_config("--length", "beta-ts").length == "beta-ts"
    assert eval_config("--batch", "2").length is None
    assert eval_config().arms == ["pld:L=4", "suffix:L=3"]

    def generate_args(*extra):
        p = argparse.ArgumentParser()
        generate.add_arguments(p)
        args = p.parse_args(["hi", "--arms", "", "--pool", str(pool), *extra])
        generate.check_args(args)
        return args

    assert generate_args().length == "cost:prior=2"
    assert generate_args("--length", "fixed").length == "fixed"
    assert build_length(generate_args().length).name == "cost"
