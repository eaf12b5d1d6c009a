"""A policy's learnt state as JSON, so a long-lived decoder (``decode serve``) keeps what it learnt across a
restart.

Every policy keeps its state in plain attributes (numpy arrays, counters, dicts keyed by context tuples, a
deque, its numpy ``Generator``, its reward object). ``policy_state`` writes them all as tagged JSON;
``load_policy_state`` writes them back into a policy built from the same spec for the same arms. JSON, not
pickle: a state file is data a server reads at start, and unpickling a file runs code.
"""
from __future__ import annotations

from collections import defaultdict, deque

import numpy as np

from ...common.errors import UserError

FORMAT = "adaspec-policy-state/1"
_FACTORIES = {"int": int, "float": float, "list": list}


def _encode(v):
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v)
    if isinstance(v, np.ndarray):
        return {"__ndarray__": v.tolist(), "dtype": str(v.dtype)}
    if isinstance(v, np.random.Generator):
        return {"__rng__": v.bit_generator.state}
    if isinstance(v, tuple):
        return {"__tuple__": [_encode(x) for x in v]}
    if isinstance(v, deque):
        return {"__deque__": [_encode(x) for x in v], "maxlen": v.maxlen}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        out = {"__dict__": [[_encode(k), _encode(x)] for k, x in v.items()]}
        if isinstance(v, defaultdict):
            name = getattr(v.default_factory, "__name__", None)
            if name not in _FACTORIES:
                raise TypeError(f"defaultdict({name}) has no JSON form")
            out["default"] = name
        return out
    if hasattr(v, "__dict__"):  # a component object (the reward): its attributes, loaded into the rebuilt one
        return {"__object__": type(v).__name__, "attrs": {k: _encode(x) for k, x in vars(v).items()}}
    raise TypeError(f"{type(v).__name__} has no JSON form")


def _decode(v, into=None):
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if not isinstance(v, dict):
        return v
    if "__ndarray__" in v:
        return np.asarray(v["__ndarray__"], dtype=v["dtype"])
    if "__rng__" in v:
        rng = np.random.default_rng()
        rng.bit_generator.state = v["__rng__"]
        return rng
    if "__tuple__" in v:
        return tuple(_decode(x) for x in v["__tuple__"])
    if "__deque__" in v:
        return deque((_decode(x) for x in v["__deque__"]), maxlen=v["maxlen"])
    if "__dict__" in v:
        d = defaultdict(_FACTORIES[v["default"]]) if "default" in v else {}
        for k, x in v["__dict__"]:
            d[_decode(k)] = _decode(x)
        return d
    if "__object__" in v:
        if into is None or type(into).__name__ != v["__object__"]:
            raise ValueError(f"a saved {v['__object__']} cannot load into {type(into).__name__}")
        for k, x in v["attrs"].items():
            setattr(into, k, _decode(x, getattr(into, k, None)))
        return into
    raise ValueError(f"unknown tagged value {sorted(v)}")


def policy_state(policy) -> dict:
    """Everything ``policy`` holds, as JSON-able data (its hyper-parameters too: a load checks they agree)."""
    return {"format": FORMAT, "policy": type(policy).__name__,
            "attrs": {k: _encode(v) for k, v in vars(policy).items() if not k.startswith("_")}}  # _: runtime links


def load_policy_state(policy, state: dict, source: str = "the state") -> None:
    """Put a ``policy_state`` back into ``policy`` (built from the same spec for the same number of arms)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{source}: not a policy state ({FORMAT}); delete it or pass another file")
    if state["policy"] != type(policy).__name__:
        raise UserError(f"{source} holds a {state['policy']} policy, this one is a {type(policy).__name__}; "
                        f"pass the policy it was saved with, or another state file")
    saved_k = state["attrs"].get("K")
    if saved_k != policy.K:
        raise UserError(f"{source} was learnt over {saved_k} arms, this policy has {policy.K}; pass the arms it "
                        f"was saved with, or another state file")
    try:
        for k, v in state["attrs"].items():
            setattr(policy, k, _decode(v, getattr(policy, k, None)))
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{source}: a damaged policy state ({exc}); delete it to start learning afresh") from None
