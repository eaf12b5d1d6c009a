"""The goodput gate of batched rounds (decode/engine/batch.py, SpeculationGate): per batch size, rounds the cost model
lets speculate are compared with plain ones on their own tokens per second, and closed where speculating loses."""
import random

import torch

from decode.choose.arms import ArmEnv, build_arm
from decode.choose.policies import build_policy
from decode.core.sampling import SamplingConfig
from decode.core.verify import Verifier
from decode.engine.batch import BatchEngine, SpeculationGate
from helpers import TinyTokenizer, plain_greedy, tiny_llama

GREEDY = SamplingConfig()
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [3, 3, 8, 3, 3, 8, 3, 3, 8, 3], [7, 9, 11, 7, 9],
           [12, 40, 7, 12, 40, 7, 12, 40, 7, 12, 40, 7, 12, 40]]


def _feed(gate, B, speculative, mean, n, rng, spread=0.1):
    for _ in range(n):
        gate.observe(B, speculative, 16, 16 / (mean * (1 + rng.uniform(-spread, spread))))


def test_the_model_decides_until_speculating_rounds_are_measured_then_plain_ones_are_measured_too():
    gate = SpeculationGate(random.Random(0), least=3)
    assert not gate.closes(16)  # nothing measured at this B: the cost model decides
    _feed(gate, 16, True, 100.0, 3, random.Random(1))
    assert gate.closes(16)  # speculating rounds measured, plain ones not yet: play plain ones
    _feed(gate, 16, False, 80.0, 3, random.Random(2))
    assert not gate.closes(8)  # other batch sizes keep their own record


def test_the_gate_closes_where_speculating_rounds_lose_and_stays_open_where_they_win_or_tie():
    rng = random.Random(3)
    lose, win, tie = (SpeculationGate(random.Random(s), least=3) for s in (4, 5, 6))
    _feed(lose, 16, True, 85.0, 32, rng)
    _feed(lose, 16, False, 100.0, 32, rng)
    _feed(win, 4, True, 60.0, 32, rng)
    _feed(win, 4, False, 50.0, 32, rng)
    _feed(tie, 8, True, 100.0, 32, rng, spread=0.3)
    _feed(tie, 8, False, 100.0, 32, rng, spread=0.3)
    assert all(lose.closes(16) for _ in range(200))
    assert not any(win.closes(4) for _ in range(200))
    closed = sum(tie.closes(8) for _ in range(400))
    assert 40 < closed < 360  # a tie keeps both kinds played (draws from each mean's standard error)


def test_an_engine_stops_speculating_where_its_speculating_rounds_are_slow():
    """The cost model says drafting pays (its costs pinned cheap), but every speculating round is made 30 ms slower:
    the gate measures that and plays plain rounds instead. Lossless either way."""
    model = tiny_llama(vocab=64, layers=2, seed=3, peaked=4.0).double()
    env = ArmEnv(model, TinyTokenizer(64), GREEDY)
    seeds = iter(range(10_000))
    eng = BatchEngine(model, lambda: [build_arm("pld:L=3", env)], lambda K: build_policy("fixed:arm=0", K, 3,
                      seed=next(seeds)), Verifier(GREEDY, "torch", torch.Generator().manual_seed(0)), (),
                      length="cost")
    eng.block_steps = lambda B, W, context: 1.0 + 0.01 * (W - 1)
    eng.overhead_steps = lambda B, w, one: 0.0
    eng.acceptance.rng = None
    eng.acceptance.shared = {0: [50.0, 5.0]}  # well accepted: the model always lets rows draft
    slow = eng._free_pieces

    def free_pieces(row, i, cap):
        import time
        if cap:  # a plain round asks no row for a draft
            time.sleep(0.03 / 4)  # 30 ms over a round of 4 rows
        return slow(row, i, cap)
    eng._free_pieces = free_pieces
    rows = eng.generate(PROMPTS * 3, 24, max_batch=4)
    for p, r in zip(PROMPTS * 3, rows):
        assert r.tokens == plain_greedy(model, p, 24), p
    at4 = [h for h in eng.history if len(h.rows) == 4]
    assert not at4[0].plain  # the model let the first round speculate
    later = at4[len(at4) // 2:]
    assert sum(h.plain for h in later) > 0.8 * len(later)
