"""decode/core/kernels/glue.py: the fused layer ops compute what PyTorch's and transformers' ops compute — RMSNorm,
the gated SiLU and attention to float32 rounding, rotary embedding bit for bit — for the shapes a round gives them
(one to a few dozen queries, grouped heads, head dims off the vector width, the cache's strided views, bool and
additive masks), and refuse bad input with a message."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from decode.core.kernels import glue

WHY = glue.glue_usable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the fused layer ops cannot run here: {WHY}")


@pytest.mark.parametrize("hidden", [16, 24, 576])
@pytest.mark.parametrize("rows", [1, 5, 12, 300])
def test_rms_norm_is_transformers_rmsnorm(hidden, rows):
    g = torch.Generator().manual_seed(hidden + rows)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
    x = torch.randn(1, rows, hidden, generator=g) * 3
    out = glue.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, norm(x), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("shape", [(1, 1, 1536), (1, 12, 1536), (1, 3, 37), (1, 400, 64)])
def test_silu_mul_is_the_gated_activation(shape):
    g = torch.Generator().manual_seed(shape[1] * shape[2])
    gate, up = torch.randn(shape, generator=g) * 6, torch.randn(shape, generator=g)
    gate[0, 0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])  # exp's ends: overflow and underflow
    torch.testing.assert_close(glue.silu_mul(gate, up), F.silu(gate) * up, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("head_dim", [8, 64, 80])
@pytest.mark.parametrize("n", [1, 12])
def test_rope_is_transformers_rotary_bit_for_bit(head_dim, n):
    g = torch.Generator().manual_seed(head_dim + n)
    q, k = torch.randn(1, n, 9 * head_dim, generator=g), torch.randn(1, n, 3 * head_dim, generator=g)
    angle = (torch.rand(1, n, head_dim // 2, generator=g) * 40).repeat(1, 1, 2)
    cos, sin = angle.cos(), angle.sin()
    shape = (1, n, -1, head_dim)
    want_q, want_k = apply_rotary_pos_emb(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), cos, sin)
    glue.rope_(q, k, cos, sin)
    assert torch.equal(q.view(shape).transpose(1, 2), want_q) and torch.equal(k.view(shape).transpose(1, 2), want_k)


def _masks(n: int, keys: int, g: torch.Generator):
    allowed = torch.rand(1, 1, n, keys, generator=g) < 0.6
    allowed[..., -n:] |= torch.eye(n, dtype=torch.bool)  # a query always sees itself
    return [None, allowed, torch.where(allowed, 0.0, torch.finfo(torch.float32).min),
            torch.where(allowed, 0.0, float("-inf"))]


@pytest.mark.parametrize("head_dim", [8, 24, 64, 80, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("n,keys", [(1, 1), (1, 300), (7, 40), (12, 33), (32, 64)])
def test_attention_matches_sdpa(head_dim, heads, kv_heads, n, keys):
    g = torch.Generator().manual_seed(head_dim * 100 + heads * 10 + n + keys)
    # the cache's views: the filled prefix of a larger allocation
    k = torch.randn(1, kv_heads, keys + 5, head_dim, generator=g)[:, :, :keys]
    v = torch.randn(1, kv_heads, keys + 5, head_dim, generator=g)[:, :, :keys]
    q = torch.randn(1, n, heads * head_dim, generator=g).view(1, n, heads, head_dim).transpose(1, 2)
    for mask in _masks(n, keys, g):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=head_dim ** -0.5, enable_gqa=True)
        out = glue.attention(q, k, v, mask, head_dim ** -0.5)
        assert out.shape == (1, n, heads * head_dim)
        torch.testing.assert_close(out, want.transpose(1, 2).reshape(1, n, -1), rtol=1e-5, atol=2e-6)


def test_attention_reads_a_wider_mask_up_to_its_keys():
    """A tree's additive mask may be wider than the keys attended (the engine slices nothing)."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 2, 20, 16, generator=g)
    q = torch.randn(1, 4, 3, 16, generator=g)
    allowed = torch.rand(1, 1, 3, 24, generator=g) < 0.5
    allowed[..., 17:20] = torch.eye(3, dtype=torch.bool)
    mask = torch.where(allowed, 0.0, float("-inf"))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., :20], scale=0.25, enable_gqa=True)
    torch.testing.assert_close(glue.attention(q, k, v, mask, 0.25), want.transpose(1, 2).reshape(1, 3, -1),
                               rtol=1e-5, atol=2e-6)


def test_bad_input_is_refused_with_the_reason():
    x = torch.randn(1, 2, 16)
    with pytest.raises(RuntimeError, match="glue rms_norm: x must be a float32 CPU tensor"):
        glue.rms_norm(x.double(), torch.ones(16), 1e-5)
    with pytest.raises(RuntimeError, match=r"glue rms_norm: weight must be \[16\]"):
        glue.rms_norm(x, torch.ones(8), 1e-5)
    q, k = torch.randn(1, 2, 32), torch.randn(1, 2, 16)
    with pytest.raises(RuntimeError, match="glue silu_mul: gate and up must have the same shape"):
        glue.silu_mul(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="glue rope_: cos and sin must be contiguous"):
        glue.rope_(q, k, torch.randn(1, 2, 16), torch.randn(1, 2, 8))
    qh, kv = torch.randn(1, 2, 2, 16), torch.randn(1, 1, 5, 16)
    with pytest.raises(RuntimeError, match=r"glue attention: mask must be \[2, >= 5\]"):
        glue.attention(qh, kv, kv, torch.ones(1, 1, 2, 4, dtype=torch.bool), 0.25)
    with pytest.raises(RuntimeError, match="glue attention: mask must be bool or float32"):
        glue.attention(qh, kv, kv, torch.ones(1, 1, 2, 5, dtype=torch.int32), 0.25)
    with pytest.raises(RuntimeError, match="glue attention: 2 query heads over 3 kv heads"):
        glue.attention(qh, torch.randn(1, 3, 5, 16), torch.randn(1, 3, 5, 16), None, 0.25)
