"""Batched speculative rounds (issue 32 §1): B sequences advance per round, each with its own context, its own
policy and its own instances of the pool's arms; the target scores every row in ONE forward.

A round: every row's policy picks an arm, the arm drafts up to ``min(L, remaining - 1)`` tokens for that row
(``none`` drafts nothing: a plain step), the rows' blocks ``[last token] + draft`` are right-padded to the widest,
the target scores the ``[B, W]`` block with per-row position ids and a per-row additive mask, the verifier accepts
per row, and each row commits its tokens, rolls its cache back and updates its own policy. A block with padding is
fed ragged where the target runs our attention (decode/core/ragged.py): the row-wise layers (projections, MLP, LM
head) compute its real slots only, and only attention sees it padded; an EAGLE head's batched forwards go the same
way (``BatchDrafter.feed_ragged``).

Cache (:class:`~decode.core.row_cache.RowCache`): one pre-allocated KV cache ``[B, heads, T, dim]`` for all rows
and a validity mask ``[B, T]``. A forward appends W slots to every row (its block, padded); afterwards a row keeps
the slots of its last token and its accepted drafts and marks the rest invalid — rollback is a per-row mask, not
a crop. Rows join between rounds (their prompt is prefilled alone and padded into the batch) and leave:
continuous batching.

Lossless per row: a row's tokens are what the verifier accepts from that row's own logits, which depend only on
that row's visible slots; so its greedy output equals its plain greedy decoding whatever its batch-mates do, up to
the float rounding of another batch shape (tests/test_batch_engine.py checks it on a float64 target).

Lengths (``length="cost"``, issue 32 §2): the round's cost is its block's: B rows, n real positions in all (B·W for
a padded block; a ragged one scores its real slots only). One :class:`~decode.core.cost.CostCurve` holds t(n), the
seconds of a forward scoring n positions in all, per context bucket (on these models a forward's cost follows its
positions: linears multiply n rows), refined by every round at whatever B it runs, and seeded by one probe before
the first choice; c_B(W, n) = t(n) / t(B), so a batch size never seen reads what the others measured (a per-B curve
alone would need a probe each time a row finishes and B changes); where B itself measured both sizes, its own
t_B(n) / t_B(B) is read instead (the same n costs more over more rows, each row's KV read once). Each
row's chosen arm has an acceptance estimate α (per position; the pool's statistics are shared across rows, so what
request N learnt steers request N + 1, and a row's own rounds refine its estimate; the shared part is drawn from its
posterior each round, Thompson sampling, so an arm whose first drafts were unlucky is tried again:
:class:`Acceptance`). Before any row chooses, the round is made plain when no K could pay even if every row played
its most accepted arm at its longest cap (a lookup's: the draft it finds now), counting the lookups a
full-information policy's rows would then make for it: then no row drafts, no policy chooses or learns (no arm is
played), and a full-information policy (the router) gets no counterfactual drafts that round (every row's lookups
for it would be pure loss; the rounds queued before still settle, which counts as that policy's feedback). A row
whose arm could draft but to which the joint length gave nothing does not teach its policy either. First the
choice is made on every row's cap (its arm's L): when even that gives K = 0, no row drafts at all (a real draft is
at most its cap, so it could not pay either; at large B most rounds are such, and their lookups were pure loss).
Otherwise every row drafts up to its cap (model-free drafting is cheap), then all drafts are cut to one K chosen
jointly for the batch on the lengths d_r actually drafted, to maximise Σ_rows E_r(min(K, d_r)) / c_B(1 + K, n(K))
with n(K) = Σ_rows (1 + min(K, d_r)) (a few rows drafting long cost what they add) and E(k) = 1 + α + … + α^k (the
expected tokens of a chain whose positions each survive with α; a tree's, per node rank: below). When a row's arm
drafts with a module (an EAGLE head, a drafter, a union holding one), the cost adds that module's forwards (a
catch-up and one per position of the module's chain, at the seconds the rounds measured: a union's or an EAGLE tree's
cut to K nodes drafts its head's chain to depth min(K, L), not K), and the module's rows are left out of the
round when the others' cheap drafts alone expect more per unit of cost. The cost also counts the round's own work
per row outside the forwards (policies, lookups, verification, commits, compaction), measured apart for rounds in
which rows drafted, rounds in which rows chose and none drafted, and rounds the gate made plain (what drafting is
weighed against), as a fixed part and a part per row; a full-information policy's counterfactual drafts and their
scoring are measured apart again, per row, and charged to speculation only where the gate would let the rows make
them. A module's forward is costed at the number of rows drafting with it, and the whole is corrected per batch size
by what such rounds measured against it (:meth:`BatchEngine.calibration`). As B grows the block's cost rises with
its positions, and speculation backs off by itself; it returns when the batch shrinks.
``length="fixed"``: every row drafts its arm's L. The schedules production engines use, as baselines:
``length="schedule:1-2=4,3-4=2,5-=0"`` (vLLM's ``num_speculative_tokens_per_batch_size``, TensorRT-LLM's
``draft_len_schedule``: K from the batch size alone) and ``length="ema:1,2,4"`` (SGLang's ``--speculative-adaptive``
in spirit: an exponential moving average of the accepted draft length per row-round picks among prebuilt tiers
of K — the smallest tier above the average, so the draft reaches one token past what is usually accepted).

Policies: any. A policy with full-information feedback (the router) gets it per row: before the row's choice every
arm of the row proposes from its prefix (the features the router reads), and those drafts are scored against the
tokens the row goes on to emit (decode/choose/feedback.py), as in the serial engine. A policy that divides by cost
(``router:cost=true``) reads the batch's block cost. One policy object may serve every row (a server's carried
policy): it is shown a row's features again right before that row's update.

Arms: model-free ones (``MODEL_FREE``) draft per row from the row's own instances; EAGLE chains, drafter models and
early-exit layers draft batched per module (decode/choose/arms/batched.py: one :class:`BatchDrafter` per module keeps
every row's cache of it in its own RowCache; every row that plays it drafts in one forward per draft position;
an EAGLE head reads the target's features, which this engine's forwards then return). A union of such arms
(``union:arms=eagle:...+pld:...``) drafts each sub-arm the same way (its module's chain with every other row's) and
merges the row's chains into its tree (``UnionArm.combine``, as the serial union does); a tree row's block is its
nodes, each at its depth's position and seeing only the last token, its ancestors and itself (an ancestor mask in
the block part of the row's attention mask), and the row keeps the slots of its accepted root path (rollback is a
per-row mask, so any slots can be kept). An EAGLE ``expand=1`` tree (the chain with each depth's runner-ups)
drafts as its chain does, alone or in a union. With ``length="cost"`` a tree is cut to its first K nodes (the
block's K positions; a union's are numbered breadth-first, an EAGLE tree's by value, so its K best), and what a
tree-drafting arm's cut to K nodes yields is learnt per node rank (:meth:`Acceptance.tree_gains`: exact for a
prefix cut, where one α per level overrated a tree's first nodes). Arms that draft serially only (other EAGLE
trees, K sampled chains) are refused with a clear error (:func:`check_batchable`).
"""
from __future__ import annotations

import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator

import torch
from transformers import DynamicCache

from ..choose.arms.base import Arm
from ..choose.arms.batched import BatchDrafter, drafts_batched
from ..choose.feedback import CounterfactualScorer, PendingRound, show
from ..choose.policies.base import Policy
from ..common.device import synchronize
from ..common.errors import UserError
from ..core import ragged
from ..core.attention import NAME as GQA_ATTENTION
from ..core.cost import CostCurve
from ..core.draft import Draft, Outcome, RoundRecord
from ..core.lean import LeanForward, resolve_forward
from ..core.tree import ancestor_matrix, draft_depth
from ..core.linear import pack_arm_linears, packing_of
from ..core.prefix_cache import PrefixCache
from ..core.row_cache import RowCache
from ..core.target import crop_cache
from ..core.verify import Verifier, greedy_next
from .loop import TokenBudget

# arms that draft from the row's own tokens (no model, no cache of their own): a deterministic function of the context
# (``Arm.free_counterfactual``), so every row holds its own cheap instances and every one of them is scorable
MODEL_FREE = {"pld", "suffix", "rest", "none"}
OVERHEAD_WINDOW = 16  # rounds of each kind whose own work per row the cost's estimate is the median of
WORK_WINDOW = 96  # rounds of each kind whose own work, by batch size, gives its fixed and per-row parts
CALIBRATION_WINDOW, CALIBRATION_LEAST = 32, 3  # rounds a batch size's cost correction is the median of; fewest read
# a round's kind, for its own work and its cost correction (length=cost): the gate closed before any row chose an arm
# (CLOSED), rows chose and none drafted (PLAIN), some row drafted (DRAFTING). Drafting is weighed (at the gate and in
# the choice of K) against a closed round: what a round costs that speculates not at all, the rate plain decoding
# runs at. Read as one kind with the rounds whose rows chose and drafted nothing (their choices made), that
# alternative was 3-5% dearer than the closed rounds it stood for at B = 16 on the AMX Xeon (own work 5.6 ms modelled
# where closed rounds did ~3, corrected by the chosen rounds' 1.01-1.03), so the router drafted on a predicted +5%
# and was 4% slower than plain batching; and priced as such a round once rows had chosen, the K = 0 side carried their
# choices, which drafting pays as well, so the choice of K drafted below the rate of plain decoding
CLOSED, PLAIN, DRAFTING = "closed", "plain", "drafting"
# the kinds read for a kind's own work and correction, in order, while a kind has none measured (a drafting round's
# correction reads only its own: :meth:`BatchEngine.calibration`)
READ_AS = {CLOSED: (CLOSED, PLAIN), PLAIN: (PLAIN, CLOSED), DRAFTING: (DRAFTING, PLAIN, CLOSED)}
LENGTHS = ("fixed", "cost", "schedule:<B range>=<K>,...", "ema:<tier>,...")


def parse_schedule(spec: str) -> list[tuple[int, int | None, int]]:
    """``"1-2=4,3-4=2,5-=0"`` → [(1, 2, 4), (3, 4, 2), (5, None, 0)]: batch sizes lo..hi (hi None = and above)
    draft K."""
    out = []
    for part in spec.split(","):
        try:
            sizes, k = part.split("=")
            lo, _, hi = sizes.partition("-")
            out.append((int(lo), (int(hi) if hi else None) if "-" in sizes else int(lo), int(k)))
        except ValueError:
            raise UserError(f"length=schedule:{spec}: each entry is <lo>-<hi>=<K> or <lo>-=<K> (e.g. 1-2=4,3-=0), "
                            f"got {part!r}") from None
    return out


def parse_length(length: str) -> tuple[str, list | None, list[int] | None]:
    """A batched length spec → (kind, its schedule or None, its EMA tiers or None); a bad one is a UserError."""
    kind, _, arg = length.partition(":")
    if kind not in ("fixed", "cost", "schedule", "ema") or (kind in ("schedule", "ema")) != bool(arg):
        raise UserError(f"length must be one of {', '.join(LENGTHS)}, got {length!r}")
    tiers = None
    if kind == "ema":
        try:
            tiers = sorted({int(t) for t in arg.split(",")})
        except ValueError:
            raise UserError(f"length=ema:{arg}: tiers are draft lengths, e.g. ema:1,2,4") from None
    return kind, parse_schedule(arg) if kind == "schedule" else None, tiers


def scheduled_length(schedule: list[tuple[int, int | None, int]], B: int) -> int:
    for lo, hi, k in schedule:
        if lo <= B and (hi is None or B <= hi):
            return k
    return 0


def _not_batchable(what: str) -> UserError:
    return UserError(f"batched rounds take model-free arms ({', '.join(sorted(MODEL_FREE))}), chains of EAGLE "
                     f"heads, drafter models and early-exit layers (eagle without K= or counterfactual=true, and "
                     f"with tree=dynamic only with expand=1; drafter without K=) and unions of those; {what} drafts "
                     f"serially only (EAGLE trees that expand more than one node a depth and K sampled chains do)")


def check_batchable(arms: list[Arm]) -> None:
    """What batched rounds take: model-free arms (each row holds its own cheap instances, every one scorable, so a
    policy learning from every arm's reward gets it), arms with a ``batch_key`` (chains of EAGLE heads, drafters
    and early-exit layers: one forward per draft position for all rows, decode/choose/arms/batched.py), and unions
    whose sub-arms are each one of those, no two drafting with the same module (their chains are merged into the
    row's tree)."""
    for a in arms:
        keys = [p.batch_key for p in a.parts if drafts_batched(p)]
        if len(set(keys)) < len(keys):
            raise UserError(f"batched rounds: {a.label} drafts twice with one module (two sub-arms of one head or "
                            f"drafter); give the union one of them")
        for p in a.parts:
            if not (getattr(p, "free_counterfactual", False) or drafts_batched(p)):
                raise _not_batchable(a.label if p is a else f"{p.label} (in {a.label})")


def check_batch_arm_specs(specs: list[str]) -> None:
    """:func:`check_batchable` on arm specs, before any model loads (``decode eval --batch``)."""
    from ..choose.arms.base import ARMS
    from ..common.specs import parse_spec
    for spec in specs:
        name, params = parse_spec(spec)
        if name in MODEL_FREE:
            continue
        if name == "union":
            from ..choose.arms.union import sub_specs
            typed = ARMS.check(name, spec, 1, params)
            try:
                check_batch_arm_specs(sub_specs(str(typed["arms"])))
            except UserError as exc:
                raise UserError(f"--arms {spec}: a union batches when each of its arms does; {exc}") from None
            continue
        if name in ("eagle", "drafter", "early_exit"):  # chains (or a chain with its runner-ups: an EAGLE
            typed = ARMS.check(name, spec, 1, params)    # expand=1 tree), one chain, no counterfactual drafts
            chain = typed.get("tree", "chain") == "chain" or typed.get("expand") == 1
            if chain and typed.get("K", 1) == 1 and not typed.get("counterfactual"):
                continue
        raise UserError(f"--arms {spec}: {_not_batchable(name)}. Pass e.g. --arms 'pld:L=4;suffix:L=6'")


def probe_batch_size(model, context: int = 128, sizes=(1, 2, 4, 8, 16), gain: float = 1.15, repeats: int = 3,
                     seed: int = 0) -> tuple[int, dict[int, float]]:
    """How many rows to decode together on this machine (``decode serve --max-batch auto``): at each size, rows of
    ``context`` random tokens are prefilled, then one-token forwards over every row are timed (median of
    ``repeats`` after a warm-up). Returns the largest size whose throughput (rows per second) is at least ``gain``
    × that of the size before it, stopping at the first that is not (past it, more rows mostly add latency), and
    the seconds of one forward at each size measured."""
    p = next(model.parameters())
    vocab = int(model.config.get_text_config(decoder=True).vocab_size if hasattr(model.config, "get_text_config")
                else model.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    seconds: dict[int, float] = {}
    best = sizes[0]
    for B in sizes:
        cache = DynamicCache()
        ids = torch.randint(vocab, (B, context + 1), generator=g)
        with torch.inference_mode():
            model(input_ids=ids[:, :context].to(p.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
            times = []
            for k in range(repeats + 1):
                synchronize(p.device)
                t = time.perf_counter()
                model(input_ids=ids[:, context:].to(p.device), past_key_values=cache, use_cache=True)
                synchronize(p.device)
                if k:
                    times.append(time.perf_counter() - t)
                crop_cache(cache, context)
        seconds[B] = sorted(times)[len(times) // 2]
        if B != sizes[0]:
            prev = max(b for b in seconds if b < B)
            if B / seconds[B] < gain * prev / seconds[prev]:
                break
            best = B
    return best, seconds


# --------------------------------------------------------------------------- rows and the engine

@dataclass
class Row(TokenBudget):
    """One sequence in the batch."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    arms: list[Arm]
    policy: Policy
    ctx: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    stopped_by: str = "length"
    acceptance: dict = field(default_factory=dict)  # arm -> [accepted positions, rejections] of this row
    verifier: Verifier | None = None  # the row's own (its sampling and generator: a server's per-request ones)
    # full-information feedback (a policy with ``fullinfo``, e.g. the router): the row's scorer and the rounds whose
    # counterfactual drafts are not resolved yet; None when its policy learns from the played arm only
    scorer: CounterfactualScorer | None = None
    pending: list[PendingRound] | None = None
    last: list[int] = field(default_factory=list)  # the tokens its last round committed
    # (arm index, part index in the arm's ``parts``) -> the batch drafter drafting that part (a union's sub-arms
    # are parts; any other arm is its own single part)
    drafters: dict[tuple[int, int], BatchDrafter] = field(default_factory=dict)
    joined: float = 0.0  # perf_counter() when it joined
    finished: float = 0.0
    # with a prefix cache: per drafter key reading the target's features, those at the row's cached positions in
    # order (its prompt's, then each round's), so the finished row is kept whole (None for a key once a round
    # went without them); None without a prefix cache
    features: dict[Hashable, list[torch.Tensor] | None] | None = None


@dataclass
class BatchRound:
    """What one batched round did: rows (ids) in it, block width, each row's drafted/accepted, seconds."""

    rows: list[int]
    width: int
    drafted: list[int]
    accepted: list[int]
    draft_time: float
    verify_time: float
    plain: bool = False  # no row could speculate, so nothing drafted and no counterfactual draft was made


class Acceptance:
    """Per-position acceptance of each arm: shared counts over every row (Beta(1, 1) prior) and a row's own counts
    on top, weighted as ``prior`` pseudo-observations of the shared mean.

    With ``rng``, the shared mean is a draw from its Beta posterior, one per arm per round (:meth:`new_round`):
    Thompson sampling. An arm's acceptance is learnt only from the rounds that draft with it, and the joint length
    drafts only where the estimate pays, so posterior means made a few unlucky first drafts absorbing: on the AMX
    Xeon the carried UCBSpec saw 0 of 12 drafted tokens accepted in its first request at B = 1, its arms' means
    fell below break-even, and it never drafted again (MAT 1.00 for 13 segments, 0.84x the best baseline). A draw
    still exceeds break-even now and then while the counts are few, so such an arm is tried again; with many
    observations the draws concentrate on the mean. Without ``rng``: the posterior means (deterministic)."""

    def __init__(self, prior: float = 4.0, rng: random.Random | None = None):
        self.prior = prior
        self.rng = rng
        self.shared: dict[int, list[float]] = {}  # arm -> [accepted positions, rejections]
        self._draws: dict[int, float] = {}  # arm -> this round's draw of its shared mean
        # arms that draft trees: arm -> per node rank i (the draft's i-th node, in its order) [rounds whose draft held
        # it, rounds that accepted it] (:meth:`tree_gains`)
        self.ranks: dict[int, list[list[float]]] = {}

    def new_round(self) -> None:
        """Forget the round's draws: the next :meth:`alpha` of each arm draws afresh from its posterior."""
        self._draws.clear()

    def observe(self, row: "Row", arm: int, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        hit, miss = accepted, int(accepted < drafted)
        for counts in (self.shared.setdefault(arm, [0.0, 0.0]), row.acceptance.setdefault(arm, [0.0, 0.0])):
            counts[0] += hit
            counts[1] += miss

    def shared_mean(self, arm: int) -> float:
        """The arm's acceptance over every row: its posterior mean, or with ``rng`` this round's draw from the
        posterior Beta(1 + accepted, 1 + rejections)."""
        s, f = self.shared.get(arm, (0.0, 0.0))
        if self.rng is None:
            return (s + 1) / (s + f + 2)
        if arm not in self._draws:
            self._draws[arm] = self.rng.betavariate(s + 1, f + 1)
        return self._draws[arm]

    def alpha(self, row: "Row", arm: int) -> float:
        rs, rf = row.acceptance.get(arm, (0.0, 0.0))
        return (rs + self.prior * self.shared_mean(arm)) / (rs + rf + self.prior)

    def observe_nodes(self, arm: int, nodes: int, path: list[int]) -> None:
        """A tree-drafting arm's round: which of its draft's ``nodes`` nodes (by rank) the verifier accepted."""
        counts = self.ranks.setdefault(arm, [])
        counts.extend([0.0, 0.0] for _ in range(nodes - len(counts)))
        for i in range(nodes):
            counts[i][0] += 1
        for i in path:
            counts[i][1] += 1

    def tree_gains(self, row: "Row", arm: int, lengths: tuple[int, ...]) -> list[float]:
        """E[K]: the tokens a round of the row's tree-drafting arm expects with its draft cut to its first K nodes,
        for K = 0 … its nodes (the tree of the chains ``lengths``: :func:`_draft_lengths`). By linearity of expectation
        1 + Σ_{i ≤ K} p_i, p_i = P(the draft's i-th node is accepted): exact for a prefix cut, in whatever order the arm
        numbers its nodes (an EAGLE tree by value, a union breadth-first), because whether a node is accepted depends
        only on the nodes before it. One α per level of the tree (before) overrated a tree's first nodes: a level was
        counted as reached by its first node, so a cut at one node of a two-wide level was credited with what both buy.
        p_i is learnt over every row, shrunk by ``prior`` pseudo-rounds towards α^d, d the shallowest depth the i-th
        node can have (its depth in the tree's breadth-first order), α the arm's shared acceptance per position: the
        nodes of a depth are accepted together about as often as a chain's position there, so α^d bounds one of them
        from above, and a node rank no cut has reached yet is tried before the data say what it is worth. α^i (a chain's
        i-th position) was the prior before: a 10-node union's 6th node, at depth 2, was priced at α^6 ≈ 0.03, and its
        cuts stayed at 5 nodes. The row's own rounds scale p_i as they scale a chain's (its α's sum against the shared
        α's)."""
        shared, own = self.shared_mean(arm), self.alpha(row, arm)
        counts = self.ranks.get(arm, [])
        out, total, chain_shared, chain_own = [1.0], 0.0, 0.0, 0.0
        for K, d in enumerate(_breadth_first_depths(lengths), 1):
            reached, hits = counts[K - 1] if K <= len(counts) else (0.0, 0.0)
            total += (hits + self.prior * shared ** d) / (reached + self.prior)
            chain_shared, chain_own = chain_shared + shared ** d, chain_own + own ** d
            out.append(1 + total * (chain_own / chain_shared if chain_shared > 0 else 1.0))
        return out


def _breadth_first_depths(lengths: tuple[int, ...]) -> list[int]:
    """The depth of each node of the tree whose root chains have ``lengths``, in breadth-first order (chains that
    share a prefix merge into fewer nodes, so a draft's i-th node is at least this deep)."""
    return [d for d in range(1, max(lengths, default=0) + 1) for n in lengths if n >= d]


def fill_holes(n: int, leaving: set[int]) -> list[int]:
    """Which of ``n`` rows to keep when the rows ``leaving`` go, in their new order: a kept row in the first
    ``n - len(leaving)`` places stays there and the last rows move into the places left free, so the caches move
    those rows only (``RowCache.select``); keeping the order instead moved every row after the first to leave."""
    m = n - len(leaving)
    order = list(range(m))
    movers = (i for i in range(m, n) if i not in leaving)
    for hole in sorted(i for i in leaving if i < m):
        order[hole] = next(movers)
    return order


def _drafts_with_module(row: Row, arm: int) -> bool:
    """Whether the row's arm ``arm`` (or a part of it, in a union) drafts with a batch drafter's module."""
    return any((arm, j) in row.drafters for j in range(len(row.arms[arm].parts)))


def _module_depth(row: Row, arm: int, cap: int) -> int:
    """The draft positions the row's arm ``arm`` drafts with a module in a round whose drafts are cut to ``cap``
    positions: its module parts' longest chain (each part drafts up to its own L); 0 when no part drafts with one.
    A union's or an EAGLE tree's cut to K nodes costs its module this many forwards after the catch-up, not K."""
    return max((min(part.L, cap) for j, part in enumerate(row.arms[arm].parts) if (arm, j) in row.drafters), default=0)


def _needs_hidden(row: Row) -> bool:
    """Whether the row drafts with a module that reads the target's hidden states (an EAGLE head)."""
    return any(d.needs_hidden for d in row.drafters.values())


Lengths = int | tuple[int, ...]  # a row's draft: a chain of n tokens, or the lengths of the chains a union merges


def _branches(arm: Arm) -> bool:
    """Whether the arm's draft is a tree in a batched round (:func:`_draft_lengths` gives it as chains)."""
    return sum(part.width for part in arm.parts) > 1


def _draft_lengths(arm: Arm, cap: int, pieces: list[Draft | None] | None = None) -> Lengths:
    """What the row's arm drafts up to ``cap`` tokens, for the joint length: a chain's length (its cap, or the
    length of a model-free draft already made), a union's per part (a tuple: a tree, whose nodes are what count:
    :meth:`Acceptance.tree_gains`); a module's tree along its chain (an EAGLE ``expand=1`` tree: ``width`` nodes a
    depth) as that many chains; ``pieces``: the parts' drafts where made (None for a part a module drafts later)."""
    if not cap:
        return 0
    pieces = pieces or [None] * len(arm.parts)
    lengths = tuple(n for p, part in zip(pieces, arm.parts)
                    for n in ([min(part.L, cap)] * part.width if p is None else [len(p)]))
    return lengths[0] if len(lengths) == 1 else lengths


def expected_tokens(alpha: float, k: int) -> float:
    """1 + α + … + α^k: a chain of k drafts whose positions each survive with probability α, plus the bonus."""
    return float(sum(alpha ** i for i in range(k + 1)))


def _widest(lengths: Lengths) -> int:
    return lengths if isinstance(lengths, int) else max(lengths, default=0)


def _size(lengths: Lengths) -> int:
    """How many draft positions a row's draft holds (a union's: its chains' nodes)."""
    return lengths if isinstance(lengths, int) else sum(lengths)


def _nodes(K: int, lengths: Lengths) -> int:
    """How many draft positions a row's draft cut to its first K positions holds."""
    return min(K, _size(lengths))


# a round's cost in one-position forwards of the batch: of its block's width w and n real positions in it (None:
# every row fills the block)
Cost = Callable[[int, int | None], float]


# what a row's draft cut to K positions is expected to yield: a chain's acceptance α per position, or a tree's
# expected tokens for each K (learnt per node rank: :meth:`Acceptance.tree_gains`)
Gain = float | list[float]


def _curve(gain: Gain, lengths: Lengths) -> list[float]:
    """E_r(K) for K = 0 … the row's positions: a tree's list as it is; a chain's 1 + α + … + α^K, summed once (the
    joint length reads it at every K)."""
    if isinstance(gain, list):
        return gain
    if not isinstance(lengths, int):
        raise TypeError(f"a tree's draft {lengths} needs its expected tokens per node count, not one α ({gain})")
    out = [1.0]
    for k in range(1, lengths + 1):
        out.append(out[-1] + gain ** k)
    return out


def joint_length(gains: list[Gain], caps: list[Lengths], cost: Cost) -> int:
    """The number of draft positions K every row drafts (up to its cap) that maximises the batch's expected tokens
    per unit of cost: argmax_K Σ_r E_r(K) / cost(1 + K, n(K)), E_r(K) = :func:`_curve` (past its end, its last), n(K) =
    Σ_r (1 + the row's positions cut to K): a ragged block costs its real positions, so a few rows drafting long cost
    what they add, not a block that wide for every row; the shortest K among ties."""
    return best_length(gains, caps, cost)[0]


def best_length(gains: list[Gain], caps: list[Lengths], cost: Cost) -> tuple[int, float]:
    """:func:`joint_length`'s K and the expected tokens per unit of cost it gives."""
    best, best_value = 0, -1.0
    curves = [_curve(g, c) for g, c in zip(gains, caps)]
    for K in range(max(map(_size, caps), default=0) + 1):
        n = sum(1 + _nodes(K, c) for c in caps)
        value = sum(e[min(K, len(e) - 1)] for e in curves) / cost(1 + K, n)
        if value > best_value * (1 + 1e-9):
            best, best_value = K, value
    return best, best_value


class BatchEngine:
    """Continuous batching of speculative rounds over one target (module docstring).

    ``make_arms()`` builds one row's arm instances (every row gets its own: model-free arms keep per-sequence
    state); ``make_policy(K)`` one row's policy over them; ``length``: ``fixed``, ``cost`` (joint K),
    ``schedule:…`` or ``ema:…``;
    ``stock_model``: the target as loaded, when ``model`` runs packed linears (the arms' modules are then packed
    the same way, the stock target's never); ``seed``: the acceptance estimates' Thompson draws
    (:class:`Acceptance`); ``ragged``: blocks with padding are fed as their real slots where the target runs our
    attention (decode/core/ragged.py; False: always padded); ``forward``: how the blocks' forwards run, ``lean``
    (decode/core/lean.py's loop over the model's modules, its fused layer ops where a block is one row), ``hf`` or
    ``auto`` (lean where it can run)."""

    def __init__(self, model, make_arms: Callable[[], list[Arm]], make_policy: Callable[[int], Policy],
                 verifier: Verifier, eos_token_ids=(), pad_id: int = 0, compact_slack: int = 32,
                 length: str = "fixed", stock_model=None, seed: int = 0, ragged: bool = True, forward: str = "auto"):
        self.length, self.schedule, self.tiers = parse_length(length)
        self.ema_accepted: float | None = None  # accepted drafts per row-round, smoothed (length=ema)
        # seconds of one forward of the drafting modules (a catch-up, then one per draft position), smoothed over the
        # rounds that drafted with one, per number of rows that drafted with one: what a module's chain costs beside
        # the block (length=cost, :meth:`_steps`). Per rows: one figure for all read 6.7 ms where 16 rows took 10
        self.module_seconds: dict[int, float] = {}
        # (B, seconds) of the last rounds' own work outside the block's forward, the probe and the modules' drafting
        # (policies, lookups, verification, commits; not a full-information policy's feedback: ``_counterfactual``),
        # per kind of round (CLOSED, PLAIN, DRAFTING: where rows drafted, their lookups and drafting's bookkeeping): at
        # large B a speculative round's own work is a fair share of a forward, and a length blind to it speculated at
        # a loss (length=cost, :meth:`round_work`, :attr:`row_overhead`). The cache's one-off work (its capacity
        # doubling, rows leaving, compaction) is left out, and medians are read, not means: one such copy (~100 ms at
        # 16 rows) once raised a plain round's figure sixfold, and with plain rounds then looking dear none was played
        # to correct it
        self._own_work: dict[str, deque] = {}
        # (B, kind) -> realised ÷ modelled seconds of the last rounds of that kind (:meth:`calibration`)
        self._calibration: dict[tuple[int, str], deque] = {}
        # within a round, what round_work and calibration answered (the rounds' records change once a round, after
        # the choices; a round's choices ask each a dozen times: the fit alone was ~1% of a round at B = 2)
        self._round_memo: dict | None = None
        self._housekeeping = 0.0  # seconds of the current round spent on the cache's one-off work
        # (rows that drafted counterfactually, seconds) per round of a full-information policy's feedback: its
        # counterfactual drafts and their scoring, and the settling of earlier rounds' (a router's). Not a round's
        # own work of either kind: a round that drafted nothing after its rows' lookups for the router is a plain
        # round plus these, and counting it as speculative left plain rounds at B = 16 unmeasured (the router's
        # gate never closed there), so the model read their cost from other batch sizes, 5-7% too dear, and drafted
        # at a loss; settling, counted in plain rounds, read 1 ms a row at 16 rows. Charged apart where it is still
        # to be paid: when the gate lets the rows look up (:meth:`counterfactual_seconds`, :meth:`_nothing_pays`)
        self._counterfactual: deque = deque(maxlen=WORK_WINDOW)
        # t(n): seconds of a forward scoring n positions in all (B rows × W), per context bucket, learnt by every
        # round of the engine (a server's, an evaluation method's across its segments). c_B(W) = t(B·W) / t(B)
        # (:meth:`block_steps`)
        self.cost = CostCurve()
        # t_B(n) per batch size B (n positions scored in all): at the same n a block's forward differs with its rows
        # (each row's KV is read once per forward): on the AMX Xeon 16 rows × 2 positions took 135-139 ms where the
        # shared t(32), measured mostly on 8 rows × 4, read 117, and the router drafted at B = 16 at a loss. Read
        # first where this B measured both sizes (:meth:`block_steps`); the shared curve covers the rest
        self.cost_at: dict[int, CostCurve] = {}
        self.acceptance = Acceptance(rng=random.Random(seed))  # Thompson draws (:class:`Acceptance`)
        self.model = model
        self.forward_kind = resolve_forward(forward, model, "prefix")  # the row cache's layers are prefix layers
        self.run = LeanForward(model) if self.forward_kind == "lean" else model  # what the blocks' forwards call
        self.compact_slack = compact_slack  # compact once the cache holds > the longest row + this many slots
        self.make_arms = make_arms
        self.make_policy = make_policy
        self.verifier = verifier
        self.eos = {int(e) for e in eos_token_ids}
        self.pad_id = int(pad_id)
        self.cache = RowCache(model.config)
        # prompts' KV kept across rows (decode/core/prefix_cache.py; None: every prompt prefilled whole), and how
        # many positions of the last joining prompt came from it
        self.prefix_cache: PrefixCache | None = None
        self.prefix_reused = 0
        self.rows: list[Row] = []
        self.drafters: dict[object, BatchDrafter] = {}  # an arm's batch_key -> its module's drafting for every row
        self.history: list[BatchRound] = []
        self._next = 0
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # blocks with padding are fed ragged (their real slots only: decode/core/ragged.py) where the target runs
        # our attention, which unpacks them (the run model on a CPU: decode/engine/loop.py target_run_model); a
        # target on any other attention is fed padded blocks
        # (``ragged=False``: padded always, e.g. to compare the two on one machine)
        self.ragged = ragged and getattr(model.config, "_attn_implementation", None) == GQA_ATTENTION
        # the target runs packed linears: the arms' modules are packed the same way, never the stock target's own
        # (``stock_model``, whose layers an early-exit stack runs; unknown = arms' modules stay as they are)
        self.packing = packing_of(model) if stock_model is not None else None
        self.stock_model = stock_model
        check_batchable(make_arms())

    # ---- rows join and leave ------------------------------------------------------------------------------

    def add(self, prompt_ids: list[int], max_new_tokens: int, *, arms: list[Arm] | None = None,
            policy: Policy | None = None, verifier: Verifier | None = None) -> int:
        """A new row, prefilled now (alone) and padded into the batch; returns its id. By default the row gets
        ``make_arms()``, ``make_policy`` over them and the engine's verifier; a server passes its own: the
        request's arm subset, the policy shared across requests (``carry=true``) and a verifier with the
        request's sampling and seed."""
        if max_new_tokens <= 0:
            raise UserError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        if not prompt_ids:
            raise UserError("empty prompt: there is nothing to continue")
        arms = self.make_arms() if arms is None else arms
        policy = self.make_policy(len(arms)) if policy is None else policy
        check_batchable(arms)
        if policy.K != len(arms):
            raise ValueError(f"policy built for {policy.K} arms, the row has {len(arms)}")
        row = Row(self._next, list(prompt_ids), max_new_tokens, arms, policy, ctx=list(prompt_ids),
                  verifier=verifier or self.verifier, joined=time.perf_counter())
        if getattr(policy, "fullinfo", False):
            row.scorer, row.pending = CounterfactualScorer(arms, greedy=row.verifier.cfg.greedy), []
        if getattr(policy, "uses_cost", False):  # c(n) of this batch: its block cost, at its current size
            policy.use_cost(self._block_steps, [a.L for a in arms])
        self._next += 1
        row.policy.new_query()
        for i, a in enumerate(arms):
            for j, part in enumerate(a.parts):
                if drafts_batched(part):
                    row.drafters[(i, j)] = self._drafter(part)
                else:
                    part.reset(row.prompt)
        n = len(prompt_ids) - 1  # the cache holds every token but the last (fed by the first round)
        uses = set(map(id, row.drafters.values()))
        wanted = [key for key, d in self.drafters.items() if id(d) in uses and d.needs_hidden]
        cache, feats = self._prefill(prompt_ids[:n], wanted) if n else (None, {})
        for key, d in self.drafters.items():  # every drafter keeps a row for every row, in order
            mine = id(d) in uses
            d.add_row(row.prompt if mine else None, feats.get(key) if mine else None)
        self.cache.add(cache, n)
        if self.prefix_cache is not None:
            row.features = {key: [feats[key]] if n else [] for key in wanted}
        self.rows.append(row)
        return row.rid

    def _prefill(self, ids: list[int], wanted: list) -> tuple[DynamicCache, dict]:
        """A joining row's prompt positions ``ids`` run alone through the target: (their one-row cache, the
        features of each drafter key in ``wanted`` at them). With a :attr:`prefix_cache`, the longest cached prefix
        holding those features is taken from it and only the rest runs; what ran is kept in it."""
        store, need = self.prefix_cache, [("features", key) for key in wanted]
        hit = store.longest(ids, need) if store is not None else None
        m = len(hit.tokens) if hit is not None else 0
        self.prefix_reused = m
        cache = DynamicCache()
        for i, (k, v) in enumerate(zip(hit.keys, hit.values) if hit is not None else ()):
            cache.update(k[None], v[None], i)  # not written to: the rest's forward concatenates new tensors
        feats = {key: hit.states[f] for key, f in zip(wanted, need)} if hit is not None else {}
        if m < len(ids):
            x = torch.tensor([ids[m:]], dtype=torch.long, device=self.device)
            pos = torch.arange(m, len(ids), device=self.device)[None]
            with torch.inference_mode():
                out = self.model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True,
                                 logits_to_keep=1, output_hidden_states=bool(wanted))
            for key in wanted:
                new = self.drafters[key].features(out.hidden_states)[0]
                feats[key] = torch.cat([feats[key], new]) if m else new
            if store is not None:
                layers = cache.layers
                store.put(ids, [layer.keys[0] for layer in layers], [layer.values[0] for layer in layers],
                          {f: feats[key] for key, f in zip(wanted, need)})
        return cache, feats

    def _drafter(self, arm) -> BatchDrafter:
        """The batch drafter of ``arm``'s module (made on first use, with an empty row for each row already here).
        Where the engine feeds ragged blocks, so does the drafter if its module can (``BatchDrafter.feed_ragged``).
        When the target runs packed linears the module's are packed the same way, as the serial engine does."""
        key = arm.batch_key
        if key not in self.drafters:
            drafter = arm.batch_drafter(len(self.rows), self.compact_slack)
            if self.ragged:
                drafter.feed_ragged()
            if self.packing is not None:  # the modules it drafts with (a head, a drafter LM)
                pack_arm_linears([drafter], self.stock_model, *self.packing)
            self.drafters[key] = drafter
        return self.drafters[key]

    def _select(self, keep: list[int]) -> None:
        """Keep the rows at ``keep`` (in that order), in the cache and every drafter."""
        self.cache.select(keep)
        for d in self.drafters.values():
            d.select(keep)
        self.rows = [self.rows[i] for i in keep]

    def remove(self, rid: int, remember: bool = False) -> Row:
        """Drop the row ``rid`` now, between rounds (a cancelled request; ``remember``: one that ended, e.g. at a
        stop sequence, kept in the prefix cache as a finished row is); its slots leave the cache."""
        at = next((i for i, r in enumerate(self.rows) if r.rid == rid), None)
        if at is None:
            raise KeyError(f"no row {rid} in the batch")
        row = self.rows[at]
        if remember:
            self._remember(at)
        self._select(fill_holes(len(self.rows), {at}))
        row.finished = time.perf_counter()
        return row

    def _drop_finished(self) -> list[Row]:
        done = [i for i, r in enumerate(self.rows) if r.done]
        rows = [self.rows[i] for i in done]
        for i in done:
            self._remember(i)
        if done:
            self._select(fill_holes(len(self.rows), set(done)))
        return rows

    def _remember(self, b: int) -> None:
        """Keep row ``b`` in the prefix cache (if any): its cached positions (its context but the last token) with
        the features its drafters read at them, so a chat's next turn, which re-sends this prompt and answer,
        prefills only its new message (decode/core/prefix_cache.py)."""
        r = self.rows[b]
        m = len(r.ctx) - 1
        if self.prefix_cache is None or r.features is None or m < 1:
            return
        keys, values = self.cache.export(b, m)
        states = {}
        for key, parts in r.features.items():
            feats = torch.cat(parts) if parts else None
            if feats is None or feats.shape[0] != m:  # a round went without them: the entry serves rows without
                continue
            states[("features", key)] = feats
        self.prefix_cache.put(r.ctx[:m], keys, values, states)

    # ---- one round ------------------------------------------------------------------------------------------

    def step(self) -> list[Row]:
        """One round for every row in the batch; returns the rows that finished in it (removed)."""
        if not self.rows:
            return []
        t0 = time.perf_counter()
        self._round_memo = {}
        probe = module_time = self._housekeeping = 0.0
        self.acceptance.new_round()
        context = max(len(r.ctx) for r in self.rows)
        plain = self.length == "cost" and self._nothing_pays(context)
        seen: dict[int, tuple] = {}  # row id -> its counterfactual drafts, their times and the features shown
        feedback = 0.0  # seconds of the full-information feedback's work (``_counterfactual``)
        picks = []
        for r in self.rows:
            if plain:  # no row may draft, so no arm is chosen (the round's record names the row's last arm)
                picks.append(r.rounds[-1].arm if r.rounds else 0)
                continue
            if r.pending is not None:  # every scorable arm proposes from its prefix (the router reads it)
                tf = time.perf_counter()
                seen[r.rid] = r.scorer.before_round(r.policy, r.ctx, r.remaining)
                feedback += time.perf_counter() - tf
            picks.append(r.policy.select())
        own = [max(0, min(r.arms[i].L, r.remaining - 1)) for r, i in zip(self.rows, picks)]  # the arms' own caps
        caps = [0] * len(own) if plain else list(own)
        if self.length == "schedule":
            caps = [min(c, scheduled_length(self.schedule, len(self.rows))) for c in caps]
        elif self.length == "ema":
            ema = self.ema_accepted
            K = self.tiers[-1] if ema is None else next((t for t in self.tiers if t > ema), self.tiers[-1])
            caps = [min(c, K) for c in caps]
        if self.length == "cost" and max(caps):
            tp, housekeeping = time.perf_counter(), self._housekeeping
            self._seed_cost(max(caps) + 1, context)
            probe, self._housekeeping = time.perf_counter() - tp, housekeeping  # the probe's is in its own time
            caps, steps, K = self._module_rows_draft(caps, picks, context)
            # if no K pays even when every row drafts its cap, none can once they have drafted (a draft is at most
            # its cap, and a shorter one only lowers what K buys): no row drafts, so no lookup or module forward
            # is spent on a round that verifies one position per row
            if K == 0:
                caps = [0] * len(caps)
        # the round's kind: the gate closed, some row drafts (a lookup may find nothing: still a drafting round's work),
        # or rows chose and none drafts
        kind = CLOSED if plain else DRAFTING if max(caps, default=0) > 0 else PLAIN
        # model-free parts draft first (cheap, and what they find decides their length: a lookup with no match
        # drafts nothing, however long its L); a module's chain always drafts its cap, so it drafts after K is known
        pieces = [self._free_pieces(r, i, c) for r, i, c in zip(self.rows, picks, caps)]
        cut = None  # the jointly chosen number of draft positions per row (length=cost)
        if self.length == "cost" and max(caps) and any(p is None or len(p) for ps in pieces for p in ps):
            # K is chosen jointly on the lengths the rows would draft (a union's per chain), then every draft is cut
            # to K positions (a tree to its first K nodes, breadth-first)
            would = [_draft_lengths(r.arms[i], c, ps) for r, i, ps, c in zip(self.rows, picks, pieces, caps)]
            cut = joint_length(self._gains(picks, would), would, steps)
            pieces = [[p if p is None else p.prefix(cut) for p in ps] for ps in pieces]
            caps = [min(c, cut) for c in caps]
        module_rows = [b for b, ps in enumerate(pieces) if any(p is None for p in ps) and caps[b]]
        depth = max((_module_depth(self.rows[b], picks[b], caps[b]) for b in module_rows), default=0)
        ta, (fed, backlog) = time.perf_counter(), self._drafter_seconds()
        self._propose_batched(picks, caps, pieces)
        if module_rows:  # a catch-up forward, then one per draft position (the drafts are on the host: synchronised)
            # a row's first draft feeds its prompt alone first: one-off work of the row, like a cache's growth, not
            # what a module's forward costs (it made the next rounds' chains look dearer after every join); a backlog's
            # catch-up (rounds the row drafted otherwise) is not a forward's cost either (the head looked dearer the
            # longer it had been idle), but stays this round's: the drafting rounds' cost correction reads it
            fed_now, backlog_now = self._drafter_seconds()
            joins = fed_now - fed
            self._housekeeping += joins
            module_time = time.perf_counter() - ta - joins - (backlog_now - backlog)
            per = module_time / (1 + depth)
            last = self.module_seconds.get(len(module_rows))
            self.module_seconds[len(module_rows)] = per if last is None else 0.8 * last + 0.2 * per
        drafts = [r.arms[i].combine(ps, cut) for r, i, ps in zip(self.rows, picks, pieces)]
        lens = [1 + len(d) for d in drafts]
        W = max(lens)
        B = len(self.rows)
        # what the model charges for this round as it is played, in seconds (before the forward updates the curve)
        one = self._one_seconds(B, context) if self.length == "cost" else None
        n = sum(lens)  # the block's real positions (a ragged block's forward scores these only)
        modelled = (self.modelled_steps(context, len(module_rows), closed=plain, depth=depth)(W, n) * one if one
                    else None)  # as played
        ids = torch.full((B, W), self.pad_id, dtype=torch.long)
        pos = torch.zeros(B, W, dtype=torch.long)
        block_valid = torch.zeros(B, W, dtype=torch.bool)
        trees = [d.is_tree for d in drafts]
        within = torch.tril(torch.ones(W, W, dtype=torch.bool)).repeat(B, 1, 1) if any(trees) else None
        for b, (r, d) in enumerate(zip(self.rows, drafts)):
            ids[b, 0] = r.ctx[-1]
            if len(d):
                ids[b, 1:lens[b]] = d.tokens.to(torch.long).cpu()
            pos[b] = len(r.ctx) - 1 + torch.arange(W)
            block_valid[b, :lens[b]] = True
            if trees[b]:  # a node sits at its depth and sees the last token, its ancestors and itself
                anc = ancestor_matrix(torch.cat([torch.tensor([-1]), d.parents + 1]))  # the last token is the root
                pos[b, :lens[b]] = len(r.ctx) - 2 + anc.sum(1)
                within[b, :lens[b], :lens[b]] = anc
        t1 = time.perf_counter()
        logits, seconds, hidden = self._forward(ids, pos, block_valid, hidden=any(map(_needs_hidden, self.rows)),
                                                within=within)
        self._observe_cost(B, self._scored(B, W, n), context, seconds)
        keep = torch.zeros(B, W, dtype=torch.bool)
        accepted = []
        step = self._one_step_seconds(B, context, seconds / W)
        # each EAGLE head's rows of the target's hidden states, read out once for the batch
        feats = {id(d): d.features(hidden) for d in self.drafters.values() if d.needs_hidden and hidden is not None}
        # rows that drafted nothing under greedy decoding: their next tokens in one argmax (what verify returns)
        bare = [b for b, (r, d) in enumerate(zip(self.rows, drafts)) if not len(d) and r.verifier.cfg.greedy]
        nxt = dict(zip(bare, greedy_next(logits[bare, 0]))) if bare else {}
        for b, (r, d, i) in enumerate(zip(self.rows, drafts, picks)):
            remaining = r.remaining
            outcome = Outcome(0, [nxt[b]], [], []) if b in nxt else r.verifier.verify(logits[b, :lens[b]].float(), d)
            # the block slots that produced the row's tokens: the last token's, then the accepted drafts' (a
            # tree's accepted root path)
            kept = (list(range(outcome.accepted + 1)) if outcome.path is None
                    else [0] + [1 + int(n) for n in outcome.path])
            keep[b, kept] = True
            new = outcome.tokens[:r.remaining]
            for j, tok in enumerate(new):
                if tok in self.eos:
                    new = new[:j + 1]
                    r.stopped_by = "eos"
                    break
            r.ctx.extend(new)
            r.tokens.extend(new)
            r.last = new
            for j, a in enumerate(r.arms):
                for k, part in enumerate(a.parts):
                    if (j, k) not in r.drafters:
                        part.observe(r.ctx, None)
            for drafter in {id(d): d for d in r.drafters.values()}.values():  # once each, however many arms use it
                # (an EAGLE head: the target's features at the positions that produced the new tokens)
                f = feats.get(id(drafter))
                drafter.observe(b, None if f is None else f[b, kept[:len(new)]], new)
            if r.features is not None:  # the features at the positions that produced the new tokens, kept
                for key, parts in r.features.items():
                    f = feats.get(id(self.drafters[key]))
                    if parts is not None and f is not None:
                        parts.append(f[b, kept[:len(new)]])
                    else:
                        r.features[key] = None
            # a row's share of the round: its part of the drafting and of the block's forward; its step the
            # batch's one-token forward per row (so a throughput reward sees what a token costs at this load)
            rec = RoundRecord(arm=i, drafted=len(d), accepted=min(outcome.accepted, len(new)), new_tokens=len(new),
                              draft_time=(t1 - t0) / B, verify_time=seconds / B, tv=outcome.tv,
                              accept_prob=outcome.accept_prob, max_len=r.arms[i].L, step_time=step)
            r.rounds.append(rec)
            if r.rid in seen:
                show(r.policy, seen[r.rid][2])  # a policy shared by the rows learns under this row's features
            # a row the engine let draft nothing though its arm could (a plain round, a joint length of 0) played no
            # arm: its one token says nothing of the arm, and learning it as the arm's reward (under whatever
            # features were shown last) taught the policy that every arm it picked in plain rounds yields 1 token.
            # Unless the row was alone: a joint length of 0 was then this arm's own verdict, as the serial engine's
            # length controller's is, and the round is what choosing it yields. Left unlearnt, a router at B = 1 kept
            # choosing an arm whose first drafts (a hard prompt's) had put its acceptance below break-even, and the
            # engine kept drafting nothing for it (65 of 238 rounds in one run over six Spec-Bench dev prompts)
            refused = own[b] and not caps[b]  # its arm could draft; the joint length let it draft nothing
            if not plain and (not refused or B == 1):
                r.policy.update(i, rec)
            tf = time.perf_counter()
            if r.rid in seen:
                r.scorer.after_round(r.policy, rec, seen[r.rid], getattr(r.arms[i], "last_match", 0), r.pending,
                                     r.rounds, r.tokens, remaining, finished=r.done)
            elif r.pending is not None:  # no counterfactual drafts this round: only the earlier rounds settle
                r.scorer.settle(r.policy, r.pending, r.rounds, r.tokens, finished=r.done)
            feedback += time.perf_counter() - tf
            self.acceptance.observe(r, i, draft_depth(d), outcome.accepted)
            if len(d) and _branches(r.arms[i]):  # its tree's nodes by rank (a chain's when nothing branched)
                path = range(outcome.accepted) if outcome.path is None else outcome.path
                self.acceptance.observe_nodes(i, len(d), path)
            if len(d):
                a_ = float(rec.accepted)
                self.ema_accepted = a_ if self.ema_accepted is None else 0.9 * self.ema_accepted + 0.1 * a_
            accepted.append(rec.accepted)
        self.cache.commit(keep)
        t2 = time.perf_counter()
        self.history.append(BatchRound([r.rid for r in self.rows], W, [len(d) for d in drafts], accepted,
                                       t1 - t0, t2 - t1, plain))
        finished = self._drop_finished()
        for r in finished:
            r.finished = t2
        self.cache.tidy(self.compact_slack)  # padding and rejected drafts piled up: attend over what is valid only
        own_work = t2 - t0 - probe - seconds - module_time - self._housekeeping - feedback
        self._round_memo = None  # the records change now (and a round left by an error starts a new memo)
        self._own_work.setdefault(kind, deque(maxlen=WORK_WINDOW)).append((B, max(0.0, own_work)))
        if seen or feedback:
            self._counterfactual.append((len(seen), feedback))
        # the model's error at this B per kind (a round whose lookups all found nothing is none: it did a drafting
        # round's work for a plain round's block)
        if modelled and (W > 1 or kind != DRAFTING):
            real = t2 - t0 - probe - self._housekeeping - feedback
            self._calibration.setdefault((B, kind), deque(maxlen=CALIBRATION_WINDOW)).append(real / modelled)
        return finished

    def _nothing_pays(self, context: int) -> bool:
        """Before any row chooses (length=cost): whether no draft could pay for this batch even if every row played
        its most accepted arm at its longest cap (a lookup's: what it finds now; or no row has room for one); arms
        that draft with a module are weighed with their module's forwards (:meth:`_steps`), model-free ones without,
        and both with the counterfactual drafts a full-information policy's rows would make if let
        (:meth:`counterfactual_seconds`). Then the round is a plain step: no row drafts and no counterfactual draft is
        made for a full-information policy (at large B most rounds are such, and every row's lookups for the router
        were pure loss). Needs a measured curve (two sizes); until then the round goes on as usual."""
        if all(r.remaining <= 1 for r in self.rows):  # no row has room for a draft (each has one token left)
            return True
        if len(self.cost.sizes()) < 2:
            return False
        scoring = sum(r.pending is not None for r in self.rows)  # rows whose lookups for the router it would cost
        for modules in (False, True):  # the arms that draft with a module pay its forwards too (:meth:`_steps`)
            alphas, caps, depth = self._best_case(modules)
            drafting = sum(map(bool, caps)) if modules else 0  # rows drafting with a module
            steps = self._steps(context, drafting, counterfactual=scoring, depth=depth)
            if max(caps) and joint_length(alphas, caps, steps) > 0:
                if modules:
                    return False
                # a lookup drafts only where it finds a match: at their L, lookups that find nothing in most rows
                # (α per drafted position ~0.8 at B = 16) kept the gate open in nearly every round there, and each
                # such round paid its rows' choices and lookups for K = 0. What the rows' lookups find now decides
                alphas, caps, _ = self._best_case(modules, looked_up=True)
                if max(caps) and joint_length(alphas, caps, steps) > 0:
                    return False
        return True

    def _best_case(self, modules: bool, looked_up: bool = False) -> tuple[list[float], list[int], int]:
        """Per row, over its arms that draft with a module (``modules``) or without: the highest acceptance estimate
        and the longest draft (each arm's L, room permitting; with ``looked_up``, what each model-free arm drafts
        from the row's context now), of the arms that would draft at all; and the longest chain a module drafts for
        them (:func:`_module_depth`; 0 without modules)."""
        alphas, caps, depth = [], [], 0
        for r in self.rows:
            reach = {}
            for i, arm in enumerate(r.arms):
                if _drafts_with_module(r, i) != modules:
                    continue
                cap = max(0, min(arm.L, r.remaining - 1))
                if looked_up and cap:
                    cap = _widest(_draft_lengths(arm, cap, self._free_pieces(r, i, cap)))
                reach[i] = cap
                depth = max(depth, _module_depth(r, i, cap))
            alphas.append(max((self.acceptance.alpha(r, i) for i, c in reach.items() if c), default=0.0))
            caps.append(max(reach.values(), default=0))
        return alphas, caps, depth

    def _gains(self, picks: list[int], shapes: list[Lengths]) -> list[Gain]:
        """What each row's draft of that shape is expected to yield (:data:`Gain`): a chain's α, a tree's expected
        tokens per node count (:meth:`Acceptance.tree_gains`)."""
        return [self.acceptance.alpha(r, i) if isinstance(c, int) else
                self.acceptance.tree_gains(r, i, c) for r, i, c in zip(self.rows, picks, shapes)]

    def _module_rows_draft(self, caps: list[int], picks: list[int], context: int) -> tuple[list[int], Cost, int]:
        """(caps, cost, the joint K on those caps) for this round: with the rows whose arm drafts with a module
        drafting, their module's forwards counted (:meth:`_steps`), or those rows not drafting at all, whichever
        expects more tokens per unit of cost; the other rows' cheap drafts stay possible either way."""
        modules = [_drafts_with_module(r, i) for r, i in zip(self.rows, picks)]
        depth = max((_module_depth(r, i, c) for r, i, c in zip(self.rows, picks, caps)), default=0)
        steps = self._steps(context, sum(bool(m and c) for m, c in zip(modules, caps)), depth=depth)
        shapes = [_draft_lengths(r.arms[i], c) for r, i, c in zip(self.rows, picks, caps)]
        gains = self._gains(picks, shapes)
        K, value = best_length(gains, shapes, steps)
        if not any(m and c for m, c in zip(modules, caps)):
            return caps, steps, K
        without = [0 if m else c for m, c in zip(modules, caps)]
        plain = self._steps(context, 0)
        K_without, value_without = best_length(gains, [0 if m else s for m, s in zip(modules, shapes)], plain)
        return (without, plain, K_without) if value_without >= value else (caps, steps, K)

    def _steps(self, context: int, modules: int, counterfactual: int = 0, depth: int | None = None) -> Cost:
        """:meth:`modelled_steps`, corrected by what rounds at this batch size cost against it (:meth:`calibration`):
        for w > 1 a drafting round's, for w = 1 a closed round's (what drafting is weighed against: ``CLOSED``),
        each with its own work and correction; with ``counterfactual`` rows whose full-information feedback a
        drafting round would still make, w > 1 adds its seconds for them
        (:meth:`counterfactual_seconds`; once the rows have looked up, the choice of K leaves it out: paid either
        way); ``depth``: :meth:`modelled_steps`'."""
        model = self.modelled_steps(context, modules, closed=True, depth=depth)
        B = len(self.rows)
        plain, spec = self.calibration(B, CLOSED), self.calibration(B, DRAFTING)
        one = self._one_seconds(B, context) if counterfactual else None
        extra = counterfactual * self.counterfactual_seconds() / one if one else 0.0
        return lambda w, n=None: model(w, n) * spec + extra if w > 1 else model(w, n) * plain

    def estimates(self) -> dict:
        """What the cost controller's choices rest on now, for the record (``decode eval --batch`` keeps it after each
        segment, so a run whose adaptive method stopped drafting shows which estimate closed it): per arm index the
        shared acceptance counts [accepted, rejections] (a tree-drafting arm's also per node rank [drafted, accepted]),
        a module forward's seconds per number of drafting rows, per
        (B, kind) the cost correction (median, rounds), a round's own seconds per row per kind, and a full-information
        policy's feedback seconds per row. Each of them is refreshed only by rounds of the kind it prices."""
        return {"acceptance": {str(a): list(c) for a, c in self.acceptance.shared.items()},
                "node_ranks": {str(a): [list(c) for c in counts] for a, counts in self.acceptance.ranks.items()},
                "module_seconds": {str(n): s for n, s in self.module_seconds.items()},
                "calibration": {f"{B}/{k}": [statistics.median(d), len(d)] for (B, k), d in self._calibration.items()
                                if d},
                "row_overhead": self.row_overhead, "counterfactual_seconds": self.counterfactual_seconds()}

    def counterfactual_seconds(self) -> float:
        """Seconds of a full-information policy's feedback per row that drafts counterfactually: the proposals of
        every scorable arm, their scoring, the settling of the rounds before (over the last WORK_WINDOW rounds that
        did any; 0 before any)."""
        rows = sum(n for n, _ in self._counterfactual)
        return sum(seconds for _, seconds in self._counterfactual) / rows if rows else 0.0

    def calibration(self, B: int, kind: str) -> float:
        """Realised ÷ modelled seconds of the last rounds of a ``kind`` (CLOSED, PLAIN, DRAFTING) at batch size B, their
        median; where B has fewer than CALIBRATION_LEAST such rounds, the median over every batch size; for a closed or
        plain round where no size has, the same of the other (``READ_AS``); 1.0 before that. The model adds up what it
        measures apart (the block's forward, the modules' forwards, a round's own work per row); what escapes it — the
        block's forward over more rows than the curve measured it with, a head's features for the rows, verification row
        by row — made drafting rounds at B = 16 cost ~1.2× their model on the AMX Xeon (before t_B(W), the modules' cost
        per rows and :meth:`round_work`), and the router drafted there at what the model called break-even and was ~15%
        slower. Corrected by this ratio, a round's cost is what such rounds cost; unlike a comparison of rounds' goodput
        (tried and reverted: its record of drafting rounds dated from while acceptance was still being learnt and only
        refreshed when it let rows draft, so it closed for good), the ratio is a property of the machine and the batch,
        not of what the arms have learnt."""
        return self._memoised(("calibration", B, kind), lambda: self._calibration_ratio(B, kind))

    def _memoised(self, key: tuple, compute: Callable[[], object]):
        """``compute()``, answered once per round while a round is choosing (outside a round: every time)."""
        memo = self._round_memo
        if memo is None:
            return compute()
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def _calibration_ratio(self, B: int, kind: str) -> float:
        for read in (DRAFTING,) if kind == DRAFTING else READ_AS[kind]:  # a drafting round's model differs in kind
            own = self._calibration.get((B, read))
            if own is not None and len(own) >= CALIBRATION_LEAST:
                return statistics.median(own)
            pooled = [x for (_, k), d in self._calibration.items() if k == read for x in d]
            if len(pooled) >= CALIBRATION_LEAST:
                return statistics.median(pooled)
        return 1.0

    def modelled_steps(self, context: int, modules: int, closed: bool = False, depth: int | None = None) -> Cost:
        """The modelled cost of a round whose block is w positions per row, n of them real (None: every row fills
        the block), in one-position forwards of the batch: the block's c_B(w, n), plus, when ``modules`` rows draft with
        a module (an EAGLE head, a drafter), the module's forwards (a catch-up and one per position its chain drafts: w
        - 1, at most ``depth``, the longest module chain the rows draft, e.g. an EAGLE tree's L or a union's head
        part's; None: w - 1) at their measured seconds for that many rows (:meth:`module_seconds_at`): at large B a
        head's steps cost as much as the block's extra positions, and a length that ignored them speculated at a loss. A
        tree cut to K nodes drafts its head's chain to depth min(K, depth), not K: charged 1 + K forwards, a 6-node
        union of a 2-token head chain looked 4 head forwards (~0.2 steps at B = 1 on the EPYC) dearer than it was. Plus
        the round's own work (:meth:`round_work`: a drafting round's when w > 1, else a plain round's, or with
        ``closed`` a closed round's), which at B = 16 on the EPYC was 1.7 ms a row in drafting rounds against 0.45 ms in
        plain ones, a third of a forward."""
        B = len(self.rows)
        one = self._one_seconds(B, context)
        module = self.module_seconds_at(modules) if modules else None

        work = {w > 1: self.overhead_steps(B, w, one, closed=closed) for w in (1, 2)}

        def steps(w: int, n: int | None = None) -> float:
            total = self.block_steps(B, w, context, n) + work[w > 1]
            if module and w > 1 and one:
                total += module * (w if depth is None else 1 + min(w - 1, depth)) / one
            return total
        return steps

    def module_seconds_at(self, rows: int) -> float | None:
        """Seconds of a module forward with ``rows`` rows drafting: measured at that many rows, else at the nearest
        count measured (None before any)."""
        if not self.module_seconds:
            return None
        return self.module_seconds[min(self.module_seconds, key=lambda n: (abs(n - rows), n))]

    def _one_seconds(self, B: int, context: int) -> float | None:
        """Seconds of a one-position forward of B rows near ``context``: this batch size's own t_B(1) where measured,
        else the shared t(B)."""
        own = self.cost_at.get(B)
        t = None if own is None else own.seconds(B, context)
        return t if t is not None else self.cost.seconds_at(B, context)

    def overhead_steps(self, B: int, w: int, one: float | None, closed: bool = False) -> float:
        """A round's own work outside its forwards for B rows (:meth:`round_work`: a drafting round's when w > 1,
        else a plain round's, or with ``closed`` a closed round's; a kind not yet measured reads the next of
        ``READ_AS``), in forwards of one position per row (``one`` seconds); 0 while nothing is measured."""
        kind = DRAFTING if w > 1 else CLOSED if closed else PLAIN
        work = next((x for k in READ_AS[kind] if (x := self.round_work(B, k)) is not None), None)
        return work / one if work is not None and one else 0.0

    @property
    def row_overhead(self) -> dict[str, float]:
        """Seconds of a round's own work per row, per kind (CLOSED, PLAIN, DRAFTING): the median over the last
        OVERHEAD_WINDOW such rounds."""
        return {kind: statistics.median(s / b for b, s in list(d)[-OVERHEAD_WINDOW:])
                for kind, d in self._own_work.items() if d}

    def round_work(self, B: int, kind: str) -> float | None:
        """Seconds of a round's own work at B rows: a + b·B, fitted (least squares, a and b ≥ 0) to the median own
        work of each batch size among the last WORK_WINDOW rounds of that kind; with one batch size measured, its
        median per row × B (``row_overhead``); None before any. A figure per row alone, measured mostly in a batch's
        tail where few rows share a round's fixed work, charged 16 rows 0.95 ms each where such rounds did 0.45 on
        the AMX Xeon, and plain rounds looked dearer than drafting ones. Past the largest size measured, the line is
        capped at that size's median per row × B (a round's fixed work only spreads over more rows): a line fitted to
        smaller sizes alone once read 0.87 s for a 16-row drafting round whose own work measured 60–82 ms."""
        return self._memoised(("work", B, kind), lambda: self._fit_round_work(B, kind))

    def _fit_round_work(self, B: int, kind: str) -> float | None:
        samples = self._own_work.get(kind)
        if not samples:
            return None
        by: dict[int, list[float]] = {}
        for b, seconds in samples:
            by.setdefault(b, []).append(seconds)
        if len(by) == 1:
            return B * self.row_overhead[kind]
        xs = list(by)
        ys = [statistics.median(by[b]) for b in xs]
        slope, a = statistics.linear_regression(xs, ys)
        if slope < 0:  # more rows never cost less: a flat round cost
            return statistics.fmean(ys)
        if a < 0:  # through the origin: per row only
            fit = B * statistics.linear_regression(xs, ys, proportional=True).slope
        else:
            fit = a + slope * B
        top = max(xs)
        if B > top:  # past the sizes measured, a row costs at most what one did at the largest (fixed work shares)
            fit = min(fit, B * ys[xs.index(top)] / top)
        return fit

    def _observe_cost(self, B: int, n: int, context: int, seconds: float) -> None:
        """A forward of B rows scoring n positions in all took ``seconds``: the shared t(n) and this batch size's
        t_B(n) (n = B·W for a padded block of W; a ragged one's real positions)."""
        self.cost.observe(n, context, seconds)
        self.cost_at.setdefault(B, CostCurve()).observe(n, context, seconds)

    def _scored(self, B: int, W: int, n: int | None) -> int:
        """The positions a forward of a block W wide over B rows, n of them real, scores: n where blocks go ragged,
        else B·W (the padding too; ``n`` None: every row fills the block)."""
        return B * W if n is None or not self.ragged else n

    def block_steps(self, B: int, W: int, context: int, n: int | None = None) -> float:
        """c_B(W, n): a forward of a block W wide over B rows, ``n`` of its positions real, in forwards of one
        position per row. A ragged block (decode/core/ragged.py) costs what its n real positions cost, a padded one
        B·W (``n`` None: every row fills the block; an engine feeding padded blocks reads B·W whatever ``n``):
        t_B(n) / t_B(B) where this batch size measured sizes around both in one context bucket, else t(n) / t(B) of
        the shared curve from the nearest context bucket that measured sizes around both
        (:meth:`CostCurve.growth`), else from absolute times each read where they were measured (n / B while
        nothing is measured: every position a full forward)."""
        n = self._scored(B, W, n)
        if n <= B:
            return 1.0
        own = self.cost_at.get(B)
        ratio = None if own is None else own.growth(B, n, context)
        if ratio is not None:
            return ratio
        ratio = self.cost.growth(B, n, context)
        if ratio is not None:
            return ratio
        one = self.cost.seconds_at(B, context)
        return self.cost.seconds_at(n, context) / one if one else n / B

    def _block_steps(self, n: int) -> float:
        """c(n) for a policy with ``uses_cost``: a block n wide over the current batch (1.0 while nothing is
        measured: the policy then ranks by expected tokens alone)."""
        if not self.cost.samples():
            return 1.0
        return self.block_steps(len(self.rows) or 1, n, max((len(r.ctx) for r in self.rows), default=0))

    def _one_step_seconds(self, B: int, context: int, fallback: float) -> float:
        """Seconds of a one-position forward over this batch, per row: the round's step unit for throughput rewards
        (``fallback``, per row, while no such forward is measured at this size)."""
        return (self._one_seconds(B, context) or fallback) / B

    def _seed_cost(self, widest: int, context: int) -> None:
        """Before the first length choice of a curve that has measured fewer than two sizes: a probe at this batch, one
        forward per width up to ``widest`` over dummy blocks (the rows' last tokens repeated) whose slots are then
        dropped. After it the rounds keep the curve current: every forward, at any batch size, is a measurement of
        t(B·W), so a batch size never seen reads what others measured (rows finish one by one, so B changes every few
        rounds: a probe per B would cost more than it saves)."""
        if len(self.cost.sizes()) >= 2:  # a slope to read wider blocks from
            return
        B = len(self.rows)
        last = torch.tensor([r.ctx[-1] for r in self.rows], dtype=torch.long)
        for w in range(1, widest + 1):
            block = torch.ones(B, w, dtype=torch.bool)
            pos = torch.tensor([len(r.ctx) - 1 for r in self.rows])[:, None] + torch.arange(w)
            _, seconds, _ = self._forward(last[:, None].expand(B, w), pos, block)
            self._observe_cost(B, B * w, context, seconds)
            self.cache.commit(torch.zeros(B, w, dtype=torch.bool))  # the probe's slots are never visible again

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, block_valid: torch.Tensor,
                 hidden: bool = False, within: torch.Tensor | None = None) -> tuple[torch.Tensor, float, tuple | None]:
        """One target forward of a ``[B, W]`` block over the batch cache (created by the first one): its logits,
        its seconds (the device synchronised) and, with ``hidden``, its HF ``hidden_states`` (what the EAGLE
        drafters read). ``within``: the block's own visibility when some row's block is a tree (RowCache.attention).
        The caller commits the block's slots it keeps."""
        mask = self.cache.attention(block_valid, self.dtype, self.device, within)
        t = time.perf_counter()
        self.cache.reserve(block_valid.shape[1], self.dtype, self.device)  # one-off when it grows: not the round's own
        self._housekeeping += time.perf_counter() - t
        t = time.perf_counter()
        block = ragged.RaggedBlock.of_padded(block_valid) if self.ragged else None
        if block is not None:  # the real slots only, row-major (decode/core/ragged.py)
            ids, pos = block.gather(ids), block.gather(pos)
        with torch.inference_mode(), ragged.running(None if block is None else block.to(self.device)):
            out = self.run(input_ids=ids.to(self.device), position_ids=pos.to(self.device), attention_mask=mask,
                           past_key_values=self.cache.hf, use_cache=True, output_hidden_states=hidden)
            logits, states = out.logits, out.hidden_states if hidden else None
            if block is not None:  # nothing reads a padding slot's logits; hidden states are scattered when read
                logits = block.scatter(logits, fill=False)
                states = None if states is None else ragged.ScatteredStates(states, block)
        synchronize(self.device)
        return logits, time.perf_counter() - t, states

    def _drafter_seconds(self) -> tuple[float, float]:
        """Seconds the drafters have spent feeding rows' prompts alone and catching up rows' backlogs
        (``BatchDrafter.fed_seconds``, ``BatchDrafter.backlog_seconds``)."""
        ds = self.drafters.values()
        return sum(d.fed_seconds for d in ds), sum(d.backlog_seconds for d in ds)

    def _free_pieces(self, row: Row, i: int, cap: int) -> list[Draft | None]:
        """The drafts of arm ``i``'s parts for ``row`` up to ``cap`` tokens (each part up to its own L too): a
        model-free part's now, None for a part a batch drafter drafts (:meth:`_propose_batched`)."""
        return [None if (i, j) in row.drafters else self._lookup(row, i, j, min(part.L, cap)) if cap
                else Draft.empty() for j, part in enumerate(row.arms[i].parts)]

    def _lookup(self, row: Row, i: int, j: int, n: int) -> Draft:
        """Part ``j`` of the row's arm ``i`` (model-free: a function of the context) drafting up to ``n`` tokens from
        the row's context, once per round: the gate's lookups (:meth:`_best_case`) are the round's drafts when the
        rows go on to draft."""
        return self._memoised(("lookup", row.rid, i, j, n), lambda: row.arms[i].parts[j].propose(row.ctx, n, None))

    def _propose_batched(self, picks: list[int], caps: list[int], pieces: list[list[Draft | None]]) -> None:
        """Fill the pieces (None) that batch drafters draft: one call per module, every row drafting with it
        together (a part drafts up to its own L and the row's cap)."""
        groups: dict[int, tuple[BatchDrafter, list[tuple[int, int]]]] = {}  # id(drafter) -> it, (row, part)s
        for b, (r, i) in enumerate(zip(self.rows, picks)):
            for j, p in enumerate(pieces[b]):
                if p is None:
                    d = r.drafters[(i, j)]
                    groups.setdefault(id(d), (d, []))[1].append((b, j))
        for d, at in groups.values():
            parts = [self.rows[b].arms[picks[b]].parts[j] for b, j in at]
            out = d.propose([b for b, _ in at], [min(p.L, caps[b]) for p, (b, _) in zip(parts, at)], parts)
            for (b, j), draft in zip(at, out):
                pieces[b][j] = draft

    def generate(self, prompts: list[list[int]], max_new_tokens: int, max_batch: int | None = None) -> list[Row]:
        """Decode every prompt, at most ``max_batch`` rows at a time (None = all at once); a finished row's place
        is taken by the next prompt before the next round. Returns the rows in prompt order."""
        out: dict[int, Row] = {}
        for finished in self.decoding(prompts, max_new_tokens, max_batch):
            out.update(finished)
        return [out[k] for k in range(len(prompts))]

    def decoding(self, prompts: list[list[int]], max_new_tokens: int,
                 max_batch: int | None = None) -> Iterator[list[tuple[int, Row]]]:
        """:meth:`generate` a round at a time: the rows that join, then one round, then the (prompt index, row)
        pairs that finished in it are yielded, so a caller can run several engines in turn, round by round, and
        time each one's own work (``decode eval --batch``: decode/evaluation/batched.py)."""
        cap = max_batch or len(prompts)
        if cap < 1:
            raise UserError(f"max_batch must be >= 1, got {max_batch}")
        queue = list(enumerate(prompts))
        by_rid: dict[int, int] = {}
        while queue or self.rows:
            while queue and len(self.rows) < cap:
                k, p = queue.pop(0)
                by_rid[self.add(p, max_new_tokens)] = k
            yield [(by_rid[r.rid], r) for r in self.step()]
