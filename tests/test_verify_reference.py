"""Reference verifier against hand-worked cases."""
import torch

from decode.sampling import SamplingConfig, process_logits, sample_from
from decode.verify import verify_reference


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
    assert [sample_from(p, torch.tensor([u])).item() for u in (0.0, 0.19, 0.21, 0.69, 0.71, 0.999)] == [0, 0, 2, 2, 3, 3]
