"""The batched engine's cost correction per batch size (decode/engine/batch.py, BatchEngine.calibration): what rounds
cost against what the cost model charged for them, applied to the model's cost of the next rounds."""
from collections import deque

import pytest
import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.policies import build_policy
from decode.core.sampling import SamplingConfig
from decode.core.verify import Verifier
from decode.engine.batch import CLOSED, DRAFTING, PLAIN, BatchEngine
from helpers import TinyTokenizer, plain_greedy, tiny_llama

GREEDY = SamplingConfig()
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [3, 3, 8, 3, 3, 8, 3, 3, 8, 3], [7, 9, 11, 7, 9],
           [12, 40, 7, 12, 40, 7, 12, 40, 7, 12, 40, 7, 12, 40]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=64, layers=2, seed=3, peaked=4.0).double()


def _engine(model):
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    return BatchEngine(model, lambda: [build_arm("pld:L=3", env)], lambda K: build_policy("fixed:arm=0", K, 3),
                       Verifier(GREEDY, "torch", torch.Generator().manual_seed(0)), (), length="cost")


def test_the_correction_is_read_at_its_batch_size_else_over_all_sizes_and_scales_the_models_cost(model):
    eng = _engine(model)
    assert eng.calibration(16, DRAFTING) == 1.0  # nothing measured: the model as it is
    eng._calibration[(16, DRAFTING)] = deque([1.2, 1.25, 1.18])
    eng._calibration[(4, DRAFTING)] = deque([0.9, 1.0])  # too few rounds at B = 4 to read its own
    eng._calibration[(16, PLAIN)] = deque([1.0, 1.02, 0.98])
    assert eng.calibration(16, DRAFTING) == 1.2
    assert eng.calibration(4, DRAFTING) == pytest.approx(1.18)  # the median over every batch size
    assert eng.calibration(8, PLAIN) == 1.0
    eng.modelled_steps = lambda context, modules, **_: (lambda w, n=None: 1.0 + 0.25 * (w - 1))
    eng.rows = [None] * 16
    steps = eng._steps(300, 0)
    assert steps(1) == pytest.approx(1.0) and steps(2) == pytest.approx(1.25 * 1.2)


def test_rounds_that_cost_more_than_modelled_stop_the_rows_drafting(model):
    """The model says drafting pays (its block and round costs pinned nearly free, acceptance high), but every
    drafting round is made 30 ms slower: the rounds measure that against the model and the rows stop drafting.
    Lossless either way."""
    eng = _engine(model)
    eng.block_steps = lambda B, W, context, n=None: 1.0 + 0.01 * (W - 1)
    eng.overhead_steps = lambda B, w, one, **_: 0.0
    eng.acceptance.rng = None
    eng.acceptance.shared = {0: [50.0, 5.0]}
    free = eng._free_pieces

    def slow(row, i, cap):
        if cap:  # a plain round asks no row for a draft
            import time
            time.sleep(0.03 / 4)  # 30 ms over a round of 4 rows
        return free(row, i, cap)
    eng._free_pieces = slow
    rows = eng.generate(PROMPTS * 3, 24, max_batch=4)
    for p, r in zip(PROMPTS * 3, rows):
        assert r.tokens == plain_greedy(model, p, 24), p
    at4 = [h for h in eng.history if len(h.rows) == 4]
    assert at4[0].width > 1  # nothing measured yet: the model let the rows draft
    later = at4[len(at4) // 2:]
    assert sum(h.width == 1 for h in later) > 0.8 * len(later)
    assert eng.calibration(4, DRAFTING) > 3  # 30 ms against a modelled few


def test_drafting_is_weighed_against_a_closed_rounds_work_and_correction(model):
    """Rounds the gate closed (no row chose) are their own kind: their own work and correction are what drafting is
    weighed against, apart from rounds whose rows chose and drafted nothing (their choices made, dearer: at B = 16
    counting both as one made the alternative 3-5% too dear, and the router drafted at a loss); each kind reads the
    other while it has none measured, a drafting round's correction only its own."""
    eng = _engine(model)
    eng._calibration[(16, PLAIN)] = deque([1.1, 1.1, 1.1])
    eng._own_work[PLAIN] = deque([(16, 0.0056)] * 3)
    assert eng.calibration(16, CLOSED) == pytest.approx(1.1) and eng.calibration(16, DRAFTING) == 1.0
    assert eng.overhead_steps(16, 1, 0.1, closed=True) == pytest.approx(0.056)
    eng._calibration[(16, CLOSED)] = deque([0.95, 0.95, 0.95])
    eng._own_work[CLOSED] = deque([(16, 0.003)] * 3)
    assert eng.calibration(16, CLOSED) == pytest.approx(0.95) and eng.calibration(16, PLAIN) == pytest.approx(1.1)
    assert eng.overhead_steps(16, 1, 0.1, closed=True) == pytest.approx(0.03)
    assert eng.overhead_steps(16, 1, 0.1) == pytest.approx(0.056)
    assert eng.overhead_steps(16, 2, 0.1, closed=True) == pytest.approx(0.056)  # no drafting round yet: a plain one's
    eng.block_steps = lambda B, W, context, n=None: 1.0 + 0.25 * (W - 1)
    eng._one_seconds = lambda B, context: 0.1
    eng.rows = [None] * 16
    assert eng._steps(300, 0)(1) == pytest.approx(1.03 * 0.95)
    assert eng._steps(300, 0)(2) == pytest.approx(1.25 + 0.056)  # a drafting round's: no correction measured yet


def test_rounds_are_recorded_by_kind(model):
    """What each round measured goes to its kind: the rounds the gate closed (``plain`` in the history) to CLOSED, a
    round whose rows chose and drafted nothing to PLAIN, a drafting round to DRAFTING. With extra positions priced at
    a full step each no draft can pay, so after the first round (chosen before the curve has two sizes) the gate
    closes. What the rounds measured is recorded but not read back (corrections 1, own work free): read back, the tiny
    model's Python-bound seconds made drafting look cheap in some runs and the gate open. Lossless."""
    eng = _engine(model)
    eng.block_steps = lambda B, W, context, n=None: float(W)
    eng.calibration = lambda B, kind: 1.0
    eng.overhead_steps = lambda B, w, one, **_: 0.0
    rows = eng.generate(PROMPTS, 12, max_batch=4)
    for p, r in zip(PROMPTS, rows):
        assert r.tokens == plain_greedy(model, p, 12), p
    closed = sum(h.plain for h in eng.history)
    assert closed > 0.8 * len(eng.history)
    assert len(eng._own_work[CLOSED]) == closed
    assert len(eng._own_work.get(PLAIN, ())) + len(eng._own_work.get(DRAFTING, ())) == len(eng.history) - closed
    assert sum(len(d) for (_, k), d in eng._calibration.items() if k == CLOSED) == closed
