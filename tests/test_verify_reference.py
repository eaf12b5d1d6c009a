"""Reference verifier against hand-worked cases, input validation and the Verifier's Outcome."""
import pytest
import torch

from decode.core.draft import Draft
from decode.common.errors import UserError
from decode.core.sampling import SamplingConfig, process_logits, sample_from
from decode.core.verify import Verifier, verify_reference
from decode.core.verify.reference import BAD_LOGITS, BAD_PROBS, BAD_TOKEN


def test_greedy_accept_prefix_then_correction():
    logits = torch.full((1, 4, 5), -5.0)
    for pos, tok in enumerate([1, 2, 3, 4]):
        logits[0, pos, tok] = 5.0
    res = verify_reference(logits, torch.tensor([[1, 2, 0]]), None, SamplingConfig())
    assert res.accepted.item() == 2 and res.next_token.item() == 3
    assert res.accept_prob[0].tolist() == [1.0, 1.0, 0.0]
    res = verify_reference(logits, torch.tensor([[1, 2, 3]]), None, SamplingConfig())
    assert res.accepted.item() == 3 and res.next_token.item() == 4  # bonus


def test_sampling_hand_computed():
    # p = [0.5, 0.5, 0, 0] everywhere, q = one-hot; draft token 0: ratio 0.5
    logits = torch.log(torch.tensor([0.5, 0.5, 1e-12, 1e-12])).expand(1, 2, 4).clone()
    cfg = SamplingConfig(1.0)
    res = verify_reference(logits, torch.tensor([[0]]), None, cfg, torch.tensor([[0.4, 0.9]]))
    assert res.accepted.item() == 1 and abs(res.accept_prob.item() - 0.5) < 1e-6
    assert abs(res.tv.item() - 0.5) < 1e-6
    # rejected: u=0.6 > 0.5; residual [p - onehot(0)]_+ = [0, .5, 0, 0] → token 1 whatever the draw
    res = verify_reference(logits, torch.tensor([[0]]), None, cfg, torch.tensor([[0.6, 0.01]]))
    assert res.accepted.item() == 0 and res.next_token.item() == 1


def test_top_k_top_p_processing():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    k = process_logits(x, SamplingConfig(1.0, top_k=2))
    assert torch.isinf(k[0, [0, 3]]).all() and torch.isfinite(k[0, [1, 2]]).all()
    p = torch.softmax(x, -1)[0]  # ≈ [.087, .644, .237, .032]
    keep = process_logits(x, SamplingConfig(1.0, top_p=0.7))
    assert torch.isfinite(keep[0]).tolist() == [False, True, True, False]
    assert p[1] < 0.7 < p[1] + p[2]


def test_inverse_cdf_sampling():
    p = torch.tensor([[0.2, 0.0, 0.5, 0.3]])
    draws = [sample_from(p, torch.tensor([u])).item() for u in (0.0, 0.19, 0.21, 0.69, 0.71, 0.999)]
    assert draws == [0, 0, 2, 2, 3, 3]


def test_sample_from_falls_back_to_the_last_token_with_mass():
    """u·total at/above the total (u = 1, or rounding): the last token with mass, never a zero-probability tail."""
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert sample_from(p, torch.tensor([1.0, 1.0])).tolist() == [1, 3]  # a row without mass: V - 1
    # through the verifier: the bonus row's top-2 keeps tokens 0, 1 of 4
    logits = torch.tensor([[[0.0, 0.0, 0.0, 5.0], [2.0, 1.0, 0.0, -1.0]]])
    cfg = SamplingConfig(1.0, top_k=2)
    res = verify_reference(logits, torch.tensor([[3]]), None, cfg, torch.tensor([[0.0, 1.0]]))
    assert res.accepted.item() == 1 and res.next_token.item() == 1


@pytest.mark.parametrize("cfg", [SamplingConfig(0.0), SamplingConfig(1.0), SamplingConfig(0.7, top_k=3)])
def test_invalid_inputs_are_user_errors(cfg):
    """NaN/+inf logits, draft ids outside [0, V) and NaN draft probabilities: a clear error, never garbage."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 3, 8, generator=g)
    tokens = torch.tensor([[1, 2], [3, 4], [5, 6]])
    q = torch.softmax(torch.randn(3, 2, 8, generator=g), -1)
    u = torch.rand(3, 3, generator=g)
    cases = []
    for pos, value in [(2, float("nan")), (0, float("inf"))]:  # the bonus row is checked too
        bad = logits.clone()
        bad[1, pos, 5] = value
        cases.append((bad, tokens, None, "logits contain NaN or \\+inf \\(batch rows \\[1\\]\\)", [0, BAD_LOGITS, 0]))
    for value in (8, -1):
        bad = tokens.clone()
        bad[2, 1] = value
        cases.append((logits, bad, None, f"draft token ids \\[{value}\\] are outside .*\\[0, 8\\)", [0, 0, BAD_TOKEN]))
    bad_q = q.clone()
    bad_q[0, 1, 2] = float("nan")
    cases.append((logits, tokens, bad_q, "draft probabilities contain NaN \\(batch rows \\[0\\]\\)", [BAD_PROBS, 0, 0]))
    for lg, tk, dq, match, status in cases:
        with pytest.raises(UserError, match=match):
            verify_reference(lg, tk, dq, cfg, u)
        res = verify_reference(lg, tk, dq, cfg, u, check=False)  # reported, no raise, no out-of-range read
        assert res.status.tolist() == status
    assert verify_reference(logits, tokens, q, cfg, u).status.tolist() == [0, 0, 0]


def test_verifier_outcome_covers_every_drafted_position():
    """The target scored all L draft positions: tv and accept_prob have L entries even after an early rejection."""
    cfg = SamplingConfig(1.0, top_k=2)
    logits = torch.tensor([[0.0, 0.0, 1.0, 2.0]] * 4)  # top-2: tokens 2, 3; token 0 has p = 0
    draft = Draft(torch.tensor([0, 3, 2]))
    out = Verifier(cfg, "torch", torch.Generator().manual_seed(0)).verify(logits, draft)
    assert out.accepted == 0 and len(out.tokens) == 1
    ref = verify_reference(logits[None], draft.tokens[None], None, cfg, torch.zeros(1, 4))
    assert out.accept_prob == pytest.approx(ref.accept_prob[0].tolist()) and len(out.accept_prob) == 3
    assert out.tv == pytest.approx(ref.tv[0].tolist()) and len(out.tv) == 3
    assert out.accept_prob[0] == 0.0 and out.accept_prob[1] > 0


def test_verifier_raises_invalid_inputs():
    logits = torch.randn(3, 8)
    logits[2, 0] = float("nan")
    with pytest.raises(UserError, match="NaN"):
        Verifier(SamplingConfig(1.0), "torch").verify(logits, Draft(torch.tensor([1, 2])))
    with pytest.raises(UserError, match="outside"):
        Verifier(SamplingConfig(0.0), "torch").verify(torch.randn(3, 8), Draft(torch.tensor([1, 9])))


def test_greedy_next_is_what_verify_returns_for_an_empty_draft():
    """A batched round's rows that drafted nothing take their greedy tokens in one argmax: the tokens verify gives
    row by row, ties included (the first maximum), and the same error for NaN or +inf logits."""
    from decode.core.verify import greedy_next
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[2, [7, 31]] = logits[2].max() + 1.0  # a tie: the first index wins, as argmax in verify
    v = Verifier(SamplingConfig(), "torch")
    assert greedy_next(logits) == [v.verify(row[None], Draft.empty()).tokens[0] for row in logits]
    assert greedy_next(logits)[2] == 7
    logits[4, 3] = float("nan")
    with pytest.raises(UserError, match="NaN or \\+inf"):
        greedy_next(logits)
    with pytest.raises(UserError, match="NaN or \\+inf"):
        v.verify(logits[4][None], Draft.empty())
