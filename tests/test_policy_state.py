"""A policy's learnt state round-trips through JSON (decode/choose/policies/state.py): after loading, every policy
chooses exactly as the one that was saved would have, random draws included; mismatches are refused."""
import json

import numpy as np
import pytest

from decode.core.draft import RoundRecord
from decode.common.errors import UserError
from decode.choose.policies import build_policy, policy_names
from decode.choose.policies.state import load_policy_state, policy_state

K, L = 3, 4
MEANS = (0.2, 0.7, 0.45)  # P(a drafted token is accepted) per arm


def _play(policy, rounds: int, rng: np.random.Generator) -> list[int]:
    """``rounds`` rounds against fixed arms; every draw comes from ``rng`` (so two runs given equal rngs see the
    same outcomes for the same choices)."""
    chosen = []
    for _ in range(rounds):
        feats = {j: (int(rng.integers(0, 5)), int(rng.integers(0, 9))) for j in range(K)}
        if hasattr(policy, "see"):
            policy.see(feats)
        i = policy.select()
        chosen.append(i)
        recs = {}
        for j in range(K):
            acc = int((rng.random(L) < MEANS[j]).cumprod().sum())
            recs[j] = RoundRecord(arm=j, drafted=L, accepted=acc, new_tokens=acc + 1, draft_time=1e-3 * (j + 1),
                                  verify_time=0.01, max_len=L, step_time=0.01, tv=[0.1] * L, accept_prob=[0.5] * L,
                                  counterfactual=j != i)
        policy.update(i, recs[i])
        if policy.fullinfo:
            policy.update_full(i, recs, feats)
    return chosen


@pytest.mark.parametrize("name", [n for n in policy_names()])
def test_a_loaded_policy_chooses_as_the_saved_one_would_have(name):
    spec = name if name != "fixed" else "fixed:arm=1"
    a = build_policy(spec + (":carry=true" if name != "fixed" else ",carry=true"), K, L, seed=3)
    _play(a, 40, np.random.default_rng(0))
    saved = json.loads(json.dumps(policy_state(a)))  # through text, as the state file holds it
    b = build_policy(spec + (":carry=true" if name != "fixed" else ",carry=true"), K, L, seed=99)  # another seed
    load_policy_state(b, saved)
    assert _play(a, 60, np.random.default_rng(1)) == _play(b, 60, np.random.default_rng(1))


def test_a_cost_aware_router_round_trips_without_its_runtime_links():
    """router:cost=true holds the engine's cost curve (a runtime link, not saved) and learnt drafting costs (saved)."""
    curve = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.6, 5: 1.7}
    a = build_policy("router:carry=true,cost=true", K, L, seed=3)
    a.use_cost(curve.__getitem__, [L] * K)
    _play(a, 40, np.random.default_rng(0))
    saved = json.loads(json.dumps(policy_state(a)))
    assert "_steps" not in saved["attrs"] and "draft_steps" in saved["attrs"]
    b = build_policy("router:carry=true,cost=true", K, L, seed=99)
    load_policy_state(b, saved)
    b.use_cost(curve.__getitem__, [L] * K)  # the engine links it again at the next query
    assert [a.draft_steps[j] for j in range(K)] == [b.draft_steps[j] for j in range(K)] != [0.0] * K
    assert _play(a, 60, np.random.default_rng(1)) == _play(b, 60, np.random.default_rng(1))


def test_a_cost_aware_router_state_from_before_the_windowed_drafting_cost_still_loads():
    """Those files saved the drafting cost as a running-mean array (``draft_cost``, ``draft_n``): they load, and the
    router relearns the costs in its own field."""
    a = build_policy("router:carry=true,cost=true", K, L, seed=3)
    _play(a, 10, np.random.default_rng(0))
    saved = json.loads(json.dumps(policy_state(a)))
    del saved["attrs"]["draft_steps"]
    saved["attrs"]["draft_cost"] = {"__ndarray__": [0.1] * K, "dtype": "float64"}
    saved["attrs"]["draft_n"] = {"__ndarray__": [3] * K, "dtype": "int64"}
    b = build_policy("router:carry=true,cost=true", K, L, seed=3)
    load_policy_state(b, saved)
    b.use_cost({n: 1.0 for n in range(1, L + 2)}.__getitem__, [L] * K)
    _play(b, 10, np.random.default_rng(1))
    assert b.draft_steps[0] == pytest.approx(0.1 / L)  # 1 ms per draft of L tokens, 10 ms a step


def test_a_state_for_other_arms_or_another_policy_is_refused():
    a = build_policy("ucbspec:carry=true", K, L)
    _play(a, 5, np.random.default_rng(0))
    saved = policy_state(a)
    with pytest.raises(UserError, match="over 3 arms"):
        load_policy_state(build_policy("ucbspec", K + 1, L), saved)
    with pytest.raises(UserError, match="UCBSpec policy"):
        load_policy_state(build_policy("router", K, L), saved)
    with pytest.raises(UserError, match="not a policy state"):
        load_policy_state(build_policy("ucbspec", K, L), {"format": "something else"})
