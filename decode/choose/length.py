"""Draft-length controllers (within a round, ALGORITHMS.md §4). They compose with any arm and any
arm-selection policy: the engine asks for a fresh ``keep_going(arm)`` callback before each draft, the
arm calls it before drafting token i ≥ 1 (token 0 is always drafted, the arm's L is the hard cap), and
the engine reports the verification outcome with ``update(drafted, outcome, arm)``; ``drafted`` counts draft
positions along a path: a chain's length, a tree's (or K merged chains') depth, never its node count.

Learnt state is kept PER ARM (keyed by the arm's index in the engine): EESD has one drafter, a pool
has several whose acceptance rates differ, and one shared posterior would mix them.

Callback: ``keep_going(i, dist_row, hidden=None) -> bool``; ``dist_row`` is the drafter's
distribution that produced token i−1 (None for deterministic arms such as PLD), ``hidden`` the
drafter's hidden state for token i−1 when the arm has one.

Specs: ``fixed``, ``beta-ts:alpha=1,beta=1,seed=0``, ``cali-ts:sigma_m=0.2,sigma_s=0.5,theta0=0.6``,
``cost:prior=1,confidence=false`` (not EESD's: chooses the length that maximises expected tokens per unit of cost on the
device's measured verification curve, decode/core/cost.py).
State resets per query unless ``carry=true``. Randomness comes from a seeded numpy Generator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..core.cost import DraftCost
from ..core.draft import Outcome
from ..common.errors import UserError
from ..common.registry import Registry
from ..common.specs import parse_spec


class LengthController:
    """Fixed L: draft up to the arm's speculation length (no early stop)."""

    name = "fixed"
    needs_target_hidden = False  # True: observe_target() must receive the target's hidden states
    uses_cost = False  # True: the engine hands it its verification cost curve (use_cost) and probes it first

    def __init__(self, seed: int = 0, carry: bool = False):
        if seed < 0:
            raise UserError(f"length controller {self.name}: seed must be an integer >= 0, got {seed}")
        self.seed = seed
        self.carry = bool(carry)
        self.rng = np.random.default_rng(seed)
        self._init_state()

    def _init_state(self) -> None:
        """(Re)initialise learnt state."""

    def reset(self) -> None:
        """New query: forget what was learnt unless ``carry``."""
        if not self.carry:
            self.rng = np.random.default_rng(self.seed)
            self._init_state()

    def keep_going(self, arm: int = 0, *, max_len: int | None = None, context: int = 0):
        """Callback for ``Arm.propose`` of arm ``arm`` (None = never stop early); ``max_len``: the most tokens
        this round may draft, ``context``: tokens of context (what the cost of a position depends on)."""
        return None

    def use_cost(self, curve) -> None:
        """The engine's :class:`~decode.core.cost.CostCurve` (only called when ``uses_cost``)."""

    def observe_round(self, record) -> None:
        """The engine's :class:`~decode.core.draft.RoundRecord` of the round just played (draft time and step time)."""

    def take_plans(self) -> list[tuple[float, float]]:
        """(E[tokens], planned cost in steps) of every round planned since the last call, then forgets them
        (what a report sets against the tokens and cost the rounds realised); [] for controllers that plan
        nothing."""
        return []

    def update(self, drafted: int, outcome: Outcome, arm: int = 0) -> None:
        """Learn from the round arm ``arm`` just had verified. ``drafted``: the draft's positions along a path (a
        tree's depth, not its nodes). ``outcome`` is the verifier's, before any EOS truncation: an accepted token
        after an EOS is still evidence about the drafter."""

    def observe_target(self, hidden) -> None:
        """Target's last-layer hidden state at the last verified position (only when the target
        computes hidden states); Cali-TS passes it to its predictor."""


class BetaTS(LengthController):
    """EESD Alg. 2: before each further draft token sample θ ~ Beta(α, β), χ ~ Bernoulli(θ); stop
    when χ = 0.

    Update convention: |Q_d| = drafted tokens, |Q_v| = accepted + 1 (tokens the round yields,
    bonus included). Successes r = |Q_v| − 1 = accepted; trials n = min(|Q_v|, |Q_d|) = the positions
    up to the first rejection (Alg. 2's Bernoulli trials; the target also scores later positions, but
    drafting stops at a failure); so α += accepted and β += n − r = 1{a draft token was rejected}.
    """

    name = "beta-ts"

    def __init__(self, alpha: float = 1.0, beta: float = 1.0, seed: int = 0, carry: bool = False):
        if alpha <= 0 or beta <= 0:
            raise UserError(f"beta-ts: alpha and beta must be > 0, got {alpha}, {beta}")
        self.alpha0, self.beta0 = float(alpha), float(beta)
        super().__init__(seed, carry)

    def _init_state(self):
        self.post: dict[int, list[float]] = {}  # arm -> [α, β]

    def params(self, arm: int = 0) -> tuple[float, float]:
        """(α, β) of arm ``arm``'s posterior."""
        a, b = self.post.get(arm, (self.alpha0, self.beta0))
        return a, b

    def keep_going(self, arm=0, **_):
        def cb(i, row=None, hidden=None):
            theta = self.rng.beta(*self.params(arm))
            return bool(self.rng.random() < theta)
        return cb

    def update(self, drafted, outcome, arm=0):
        if drafted <= 0:
            return
        ab = self.post.setdefault(arm, [self.alpha0, self.beta0])
        ab[0] += outcome.accepted
        ab[1] += 1.0 if outcome.accepted < drafted else 0.0


@dataclass
class CaliContext:
    """What a calibration predictor may look at for the i-th draft token (i ≥ 1)."""

    i: int
    dist_row: object | None  # drafter distribution that produced token i−1 ([V] tensor) or None
    draft_hidden: object | None  # drafter hidden state for token i−1, when the arm provides it
    target_hidden: object | None  # target last-layer hidden at the last verified position, if computed


Predictor = Callable[[CaliContext], float]


def top1_predictor(ctx: CaliContext) -> float | None:
    """Default θ_M: the drafter's own top-1 probability for the previous draft token (None when the
    arm is deterministic and has no distribution; Cali-TS then uses θ̂_0)."""
    if ctx.dist_row is None:
        return None
    return float(ctx.dist_row.max())


class CaliTS(LengthController):
    """EESD Alg. 3: Gaussian posterior mixing a predictor's θ_M with the observed acceptance rate.

    Per arm: n = its verified rounds so far (rounds that drafted ≥ 1 token), θ̂ = accepted / draft
    positions up to the first rejection over those rounds (θ̂_0 before any):
      μ = σ_S²/(nσ_M² + σ_S²)·θ_M + nσ_M²/(nσ_M² + σ_S²)·θ̂,  σ² = σ_M²σ_S²/(σ_S² + nσ_M²);
      θ ~ N(μ, σ²), χ ~ Bernoulli(clip(θ, 0, 1)); stop when χ = 0.
    ``predictor`` is any callable CaliContext → θ_M (or None = fall back to θ̂_0); from a spec
    string: ``predictor=top1`` (the drafter's own top-1 probability, the default) or
    ``predictor=<folder>`` (a calibrator trained by ``make train-calibrator``; it reads the target's
    hidden states, so the evaluator turns them on when ``needs_target_hidden``).
    """

    name = "cali-ts"

    def __init__(self, sigma_m: float = 0.2, sigma_s: float = 0.5, theta0: float = 0.6,
                 predictor: Predictor | str | None = None, seed: int = 0, carry: bool = False):
        if sigma_m <= 0 or sigma_s <= 0:
            raise UserError(f"cali-ts: sigma_m and sigma_s must be > 0, got {sigma_m}, {sigma_s}")
        if not 0 <= theta0 <= 1:
            raise UserError(f"cali-ts: theta0 must be in [0, 1], got {theta0}")
        self.sigma_m, self.sigma_s, self.theta0 = float(sigma_m), float(sigma_s), float(theta0)
        if isinstance(predictor, str):
            predictor = top1_predictor if predictor == "top1" else _load_trained_predictor(predictor)
        self.predictor = predictor or top1_predictor
        self.needs_target_hidden = getattr(self.predictor, "needs_target_hidden", False)
        super().__init__(seed, carry)

    def _init_state(self):
        self.stats: dict[int, list[int]] = {}  # arm -> [n, accepted, positions up to the first rejection]
        self.target_hidden = None

    def counts(self, arm: int = 0) -> tuple[int, int, int]:
        """(n, accepted, positions) of arm ``arm``."""
        n, acc, scored = self.stats.get(arm, (0, 0, 0))
        return n, acc, scored

    def theta_hat(self, arm: int = 0) -> float:
        _, acc, scored = self.counts(arm)
        return acc / scored if scored else self.theta0

    def posterior(self, theta_m: float, arm: int = 0) -> tuple[float, float]:
        """(μ, σ) of arm ``arm``'s Gaussian posterior given the predictor's θ_M."""
        vm, vs, n = self.sigma_m ** 2, self.sigma_s ** 2, self.counts(arm)[0]
        mu = vs / (n * vm + vs) * theta_m + n * vm / (n * vm + vs) * self.theta_hat(arm)
        return mu, math.sqrt(vm * vs / (vs + n * vm))

    def keep_going(self, arm=0, **_):
        def cb(i, row=None, hidden=None):
            theta_m = self.predictor(CaliContext(i, row, hidden, self.target_hidden))
            mu, sigma = self.posterior(self.theta0 if theta_m is None else float(theta_m), arm)
            theta = min(1.0, max(0.0, self.rng.normal(mu, sigma)))
            return bool(self.rng.random() < theta)
        return cb

    def update(self, drafted, outcome, arm=0):
        if drafted <= 0:
            return
        st = self.stats.setdefault(arm, [0, 0, 0])
        st[0] += 1
        st[1] += outcome.accepted
        st[2] += min(outcome.accepted + 1, drafted)

    def observe_target(self, hidden):
        self.target_hidden = hidden


class CostAware(LengthController):
    """Draft the length that pays most on this device: per round, k* = argmax over k = 1 … max_len of

        E[tokens | k] / cost(k),  E[tokens | k] = 1 + Σ_{m=1..k} Π_{i≤m} a_i,  cost(k) = c(k + 1) + k · d

    in one-token steps, where c is the engine's measured verification curve at this context length
    (decode/core/cost.py), d the arm's measured cost of one drafted token (draft seconds per drafted token over the
    step time, the median of its last drafting rounds: ``DraftCost``) and a_i the arm's acceptance rate at position
    i given positions < i were accepted, (accepted_i + 2·prior·a_{i−1}) / (reached_i + 2·prior) with a_0 = 1/2: a
    Beta posterior mean whose 2·prior pseudo-observations sit at the rate of the position before. A position the
    arm's drafts never reached is thus expected to do as the last one did, not to fall back to 1/2: with a flat
    prior, an arm whose copies were accepted whole at positions 1–2 (prompt lookup on an extraction prompt) looked
    worse at 3 than it was, and where a third position costs a jump (4 positions 1.44 steps against 3 at 1.20 on an
    AMX Xeon) the controller never drafted it, so never learnt otherwise. The arm drafts k* tokens (fewer when it
    runs out; token 0 is always drafted, so a pool that may not speculate at all holds ``none`` for the policy to
    pick). Per arm, reset per query unless ``carry``. ``plans`` records every round's choice (k*, expected tokens,
    expected cost) per arm for reports.

    Confidence stopping (``confidence=true``; off by default: with the shipped EAGLE head it measured no faster than
    the k* plan, 23.9 vs 24.4 tokens/s at L=5 on Spec-Bench dev, 13 × 1 prompts, interleaved; with the fifth head
    over the shipped pool on dev 13 × 2, the router 35.8 against 36.1 tokens/s): an arm that drafts from a
    distribution (EAGLE, early exit, drafter models) shows the controller each token's distribution before the next
    one is drafted, so the plan is revised token by token. Drafted token j's acceptance is then â(q_j), its
    confidence q_j (the distribution's top probability) calibrated on what this arm's tokens of that confidence
    actually did: per arm and confidence decile, (accepted + s·q) / (reached + s) with s = ``prior_weight``
    pseudo-observations at q itself (the drafter's own word until the data speak). Before drafting token i the
    controller compares E_i / cost(i) — tokens expected from the i tokens already drafted — with the best E_k /
    cost(k) over k = i+1 … max_len (tokens beyond i at the arm's position rates a); it drafts on only when some
    longer draft pays more per step of cost on the curve. The round's recorded plan is the one it finally stopped
    at. Deterministic arms (prompt lookup, suffix) show no distribution and keep k*.

    Tree budget (EAGLE-2's dynamic tree, ``eagle:tree=dynamic``): once the tree is drafted, its candidate nodes
    ranked by value v (the product of the head's confidences along the node's path, EAGLE-2's estimate of the
    path's acceptance) are cut to the n* that maximises

        E[tokens | n] / (c(n + 1) + D),  E[tokens | n] = 1 + Σ_{i≤n} min(1, s·v_i)

    (every prefix of the ranking is a tree: a node's value never exceeds its parent's), D = this round's
    drafting time in steps (spent whatever n is). Σ v over the verified nodes is the expected accepted depth;
    s calibrates it per arm on what happened, (accepted + w) / (Σ v + w) with w = ``prior_weight``
    pseudo-observations at s = 1 (the head's confidence taken at its word until the data speak). Before each
    further head forward the tree asks whether it can pay (``deeper_pays``): if no budget over the nodes so far
    plus the deepest growth they allow — every new node valued at the best node it can grow from — beats the best
    budget over the nodes so far once the forwards are paid, it stops drafting (on an AMX Xeon whose curve jumps at
    4 positions the head's 8-node tree was cut to ~2 nodes a round after drafting all 4 depths: 0.32 steps of
    drafting a round, for nodes no round verified)."""

    name = "cost"
    uses_cost = True

    BINS = 10  # confidence deciles of the calibration

    def __init__(self, prior: float = 1.0, confidence: bool = False, prior_weight: float = 4.0, seed: int = 0,
                 carry: bool = False):
        if not prior > 0:
            raise UserError(f"cost: prior must be > 0, got {prior}")
        if not prior_weight > 0:
            raise UserError(f"cost: prior_weight must be > 0 pseudo-observations, got {prior_weight}")
        if not isinstance(confidence, bool):
            raise UserError(f"cost: confidence must be true or false, got {confidence!r}")
        self.prior, self.confidence, self.prior_weight = float(prior), confidence, float(prior_weight)
        self.curve = None
        super().__init__(seed, carry)

    def _init_state(self):
        self.reached: dict[int, list[int]] = {}  # arm -> rounds whose draft reached position i (index i-1)
        self.accepted: dict[int, list[int]] = {}  # arm -> ... of which position i was accepted
        self.draft_cost = DraftCost()  # arm -> a drafted token in steps
        self.plans: dict[int, list[tuple[int, float, float]]] = {}  # arm -> [(k*, E[tokens], cost)]
        self.pending: list[list[float]] = []  # [E[tokens], cost] of the rounds since take_plans()
        # confidence calibration: arm -> per decile [reached, accepted]; this round's confidences
        self.calib: dict[int, np.ndarray] = {}
        self.round_conf: dict[int, list[float]] = {}
        # tree budget: arm -> [Σ v over verified nodes, Σ accepted depth]; this round's Σ v; one step in seconds
        self.tree_stats: dict[int, list[float]] = {}
        self.round_tree: dict[int, float] = {}
        self.step_seconds = 0.0

    def use_cost(self, curve) -> None:
        self.curve = curve

    def _cost(self, k: int, d: float, context: int) -> float:
        """cost(k) = c(k + 1) + k·d in steps: verifying k drafted tokens and the bonus, plus drafting them."""
        return (self.curve.steps(k + 1, context) if self.curve is not None else k + 1) + k * d

    def _bin(self, q: float) -> int:
        return min(int(q * self.BINS), self.BINS - 1)

    def rates(self, arm: int, L: int) -> list[float]:
        """a_1 … a_L of arm ``arm``, each shrunk towards the one before (class docstring)."""
        reached, acc = self.reached.get(arm, []), self.accepted.get(arm, [])
        out, before = [], 0.5
        for i in range(L):
            hits, n = (acc[i] if i < len(acc) else 0), (reached[i] if i < len(reached) else 0)
            before = (hits + 2 * self.prior * before) / (n + 2 * self.prior)
            out.append(before)
        return out

    def plan(self, arm: int, max_len: int, context: int) -> tuple[int, float, float]:
        """(k*, E[tokens | k*], cost(k*)) for a round of arm ``arm`` of at most ``max_len`` drafted tokens."""
        d = self.draft_cost[arm]
        best, expected, prefix = (1, 0.0, 0.0), 1.0, 1.0
        for k, a in enumerate(self.rates(arm, max(1, max_len)), start=1):
            prefix *= a
            expected += prefix
            c = self._cost(k, d, context)
            if k == 1 or expected / c > best[1] / best[2]:
                best = (k, expected, c)
        return best

    def calibrated(self, arm: int, q: float) -> float:
        """â(q): P(a token drafted with confidence q is accepted | its predecessors were), for arm ``arm``."""
        reached, accepted = self.calib[arm][self._bin(q)] if arm in self.calib else (0.0, 0.0)
        return (accepted + self.prior_weight * q) / (reached + self.prior_weight)

    def revise(self, arm: int, confs: list[float], max_len: int, context: int) -> tuple[bool, float, float]:
        """With ``len(confs)`` = i tokens drafted (their confidences): (draft token i?, E_i, cost(i))."""
        i, d = len(confs), self.draft_cost[arm]
        expected, prefix = 1.0, 1.0
        for q in confs:  # E_i = 1 + Σ_{m ≤ i} Π_{j ≤ m} â(q_j)
            prefix *= self.calibrated(arm, q)
            expected += prefix
        cost = self._cost(i, d, context)
        now, e = expected / cost, expected
        for k, a in enumerate(self.rates(arm, max_len)[i:], start=i + 1):
            prefix *= a
            e += prefix
            c = self._cost(k, d, context)
            if e / c > now:
                return True, expected, cost
        return False, expected, cost

    def tree_scale(self, arm: int) -> float:
        """s: the arm's accepted depth per unit of Σ v (1 until rounds say otherwise)."""
        expected, accepted = self.tree_stats.get(arm, (0.0, 0.0))
        return (accepted + self.prior_weight) / (expected + self.prior_weight)

    def node_budget(self, arm: int, values: list[float], context: int,
                    draft_seconds: float) -> tuple[int, float, float, float]:
        """(n*, E[tokens | n*], cost(n*), Σ v of the n* nodes) for tree nodes of ``values`` (sorted, best first)."""
        n, expected, cost = self._best_budget(arm, values, context, self._in_steps(draft_seconds, context))
        return n, expected, cost, float(sum(values[:n]))

    def _in_steps(self, seconds: float, context: int) -> float:
        one = (self.curve.seconds(1, context) if self.curve is not None else None) or self.step_seconds
        return seconds / one if one else 0.0

    def _best_budget(self, arm: int, values: list[float], context: int, spent: float) -> tuple[int, float, float]:
        scale = self.tree_scale(arm)
        best, expected = (1, 0.0, 1.0), 1.0
        for n, v in enumerate(values, start=1):
            expected += min(1.0, scale * v)
            c = self._cost(n, 0.0, context) + spent
            if n == 1 or expected / c > best[1] / best[2]:
                best = (n, expected, c)
        return best

    def deeper_pays(self, arm: int, values: list[float], context: int, draft_seconds: float, step_seconds: float,
                    bound: float, width: int, depths: int, cap: int) -> bool:
        """Whether a tree that has drafted nodes of ``values`` (best first) should spend another head forward
        (``step_seconds``): only if some budget over them plus, optimistically, ``width`` new nodes of value
        ``bound`` (no descendant is worth more than the node it grows from) at each of the ``depths`` depths still
        allowed, each depth one more forward, at most ``cap`` nodes in all, pays more per step than the best budget
        over the nodes drafted so far (the tree budget's own objective, the drafting so far spent either way)."""
        spent, step = self._in_steps(draft_seconds, context), self._in_steps(step_seconds, context)
        _, expected, cost = self._best_budget(arm, values, context, spent)
        for j in range(1, depths + 1):
            grown = sorted([*values, *[bound] * (width * j)], reverse=True)[:cap]
            _, e, c = self._best_budget(arm, grown, context, spent + j * step)
            if e / c > expected / cost:
                return True
        return False

    def keep_going(self, arm=0, *, max_len=None, context=0):
        # a round that may draft nothing (the budget's last token) plans exactly that: the bonus token for c(1)
        if max_len == 0:
            k, expected, cost = 0, 1.0, self._cost(0, 0.0, context)
        else:
            k, expected, cost = self.plan(arm, max_len or 1, context)
        self.plans.setdefault(arm, []).append((k, expected, cost))
        plan = [expected, cost]
        self.pending.append(plan)
        confs = self.round_conf[arm] = []

        def go(i, row=None, hidden=None):
            if row is None or not self.confidence:
                return i < k
            confs.append(float(row.max()))
            more, plan[0], plan[1] = self.revise(arm, confs, max_len or 1, context)
            return more

        def budget(values: list[float], draft_seconds: float) -> int:
            """A tree arm's node budget (class docstring); this round's recorded plan becomes the tree's."""
            n, plan[0], plan[1], self.round_tree[arm] = self.node_budget(arm, values, context, draft_seconds)
            self.plans[arm][-1] = (n, plan[0], plan[1])
            return n

        def deeper(values: list[float], draft_seconds: float, step_seconds: float, bound: float, width: int,
                   depths: int, cap: int) -> bool:
            """A tree arm's test before another head forward (:meth:`deeper_pays`)."""
            return self.deeper_pays(arm, values, context, draft_seconds, step_seconds, bound, width, depths, cap)
        go.node_budget, go.deeper = budget, deeper
        return go

    def take_plans(self) -> list[tuple[float, float]]:
        out, self.pending = [tuple(p) for p in self.pending], []
        return out

    def update(self, drafted, outcome, arm=0):
        if drafted <= 0:
            return
        reached, acc = self.reached.setdefault(arm, []), self.accepted.setdefault(arm, [])
        upto = min(outcome.accepted + 1, drafted)  # positions reached: accepted ones and the first rejection
        for lst in (reached, acc):
            lst.extend([0] * (upto - len(lst)))
        for i in range(upto):
            reached[i] += 1
        for i in range(outcome.accepted):
            acc[i] += 1
        if arm in self.round_tree:  # a tree round: calibrate s on its accepted depth
            stats = self.tree_stats.setdefault(arm, [0.0, 0.0])
            stats[0] += self.round_tree.pop(arm)
            stats[1] += outcome.accepted
        confs = self.round_conf.pop(arm, [])
        if confs:  # the confidences seen this round: calibrate â(q) on what happened to those tokens
            table = self.calib.setdefault(arm, np.zeros((self.BINS, 2)))
            for j, q in enumerate(confs[:upto]):
                table[self._bin(q)] += (1.0, float(j < outcome.accepted))

    def observe_round(self, record) -> None:
        if record.drafted <= 0 or not record.step_time > 0:
            return
        self.step_seconds = record.step_time
        self.draft_cost.observe(record)


def _load_trained_predictor(folder: str) -> Predictor:
    if not Path(folder).is_dir():
        raise UserError(f"cali-ts: predictor '{folder}' is neither 'top1' nor a calibrator folder; train one "
                        "with `make train-calibrator TASK=...` and pass predictor=<its output folder>")
    from .heads.calibrator import load_predictor
    return load_predictor(folder)


LENGTHS = Registry("length controller")
for _name, _cls in (("fixed", LengthController), ("beta-ts", BetaTS), ("cali-ts", CaliTS), ("cost", CostAware)):
    LENGTHS.add(_name, _cls)


def length_names() -> list[str]:
    return LENGTHS.names()


def build_length(spec: str | None, seed: int = 0) -> LengthController:
    """``"beta-ts:alpha=2"`` → a controller (None/"" → fixed). ``seed`` is used unless the spec sets one."""
    if not spec:
        return LengthController(seed)
    name, params = parse_spec(spec)
    params.setdefault("seed", seed)
    return LENGTHS.build(name, spec, **params)
