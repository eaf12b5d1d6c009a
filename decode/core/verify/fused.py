"""Fused Triton verifier: the same function as :func:`decode.core.verify.reference.verify_reference`.

Why: verification touches every (row × position × vocabulary) logit each round; the reference
reads them several times (processing, softmax, gathers, TV, residual, cumsum). Here the logits are
streamed once in blocks and everything else is derived from small per-chunk partials.

What runs (B rows, L draft positions, V vocabulary, each row's V split into chunks of
``chunk_blocks × BLOCK_V`` entries so that small batches still fill the GPU):

1. ``_stats_kernel``, grid (B·(L+1), chunks) — reads every target logit exactly once. Per chunk
   it applies temperature and the top-k/top-p cut, and keeps an online softmax (running max and
   rescaled sum, one exp per element), the sum excluding the draft token (one-hot residual
   mass), in greedy mode the first-index argmax, and a flag for NaN/+inf logits.
2. ``_q_pass_kernel``, grid (B·L, chunks) — only when ``draft_probs`` is given: the TV distance
   ½‖p − q‖₁ and the residual mass Σ[p − q]₊ need the normalised p, so positions 0..L−1 are read a
   second time together with the draft probabilities (read once).
3. ``_finish_kernel``, grid (B,) — merges the partials of all L positions at once (a
   [positions × chunks] tile), gathers p(x̃_i) and q(x̃_i) (two loads per position), runs the tests
   ``u_i < min(1, p/q)`` (greedy: ``x̃_i == argmax``), finds the first rejection, writes TV per
   position and the row's input-error status (the flags, and draft ids outside [0, V)), and draws
   the correction/bonus token by inverse CDF with ``u_L``: the chunk holding the draw is found
   from the partial masses, then only that one chunk of that one position is re-read and scanned
   with a block cumsum.

Bytes read per call (E = element size of the logits):
  * one-hot drafts (deterministic arms), greedy or sampling: B·(L+1)·V·E once — the logits are
    read exactly once; sampling adds one chunk (≤ 4 Ki entries) of one position per row for the
    draw, and every mode adds L scalar gathers per row.
  * with ``draft_probs``: the logits once, positions 0..L−1 a second time, the draft
    probabilities once — (2L+1)/(L+1) logit reads.
  * top-k / top-p: the per-row cut (a threshold logit plus a tie index) is computed by a PyTorch
    pre-pass (``torch.topk`` / ``torch.sort``) that reads the logits several more times; only
    temperature-only sampling and greedy are single-read. The cut reproduces ``process_logits``
    exactly, ties included: the threshold and the comparisons are on the scaled logits raw·(1/T)
    (``scale_logits``, bit-identical here), and both keep the lowest indices inside a run of equal
    values at a top-p cut (stable sort order).

Numerics: float32 throughout; greedy results equal the reference exactly; sampling results equal
it draw for draw except when a uniform lands within float rounding (~1e-7 relative) of a decision
boundary, where summation order (and the GPU's exp) can differ.

CPU: with TRITON_INTERPRET=1 set before ``import triton`` the kernels run in Triton's interpreter
(slow; for tests). Written for Triton 3.6 and 3.9 (no block pointers, no ``tl.dot``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...common.errors import UserError
from ..sampling import SamplingConfig, scale_logits
from .reference import BAD_LOGITS, BAD_PROBS, BAD_TOKEN, VerifyResult, raise_for_status

_BIG = tl.constexpr(2147483647)  # "no index yet" sentinel (int32 max)
_BAD_LOGITS, _BAD_PROBS, _BAD_TOKEN = tl.constexpr(BAD_LOGITS), tl.constexpr(BAD_PROBS), tl.constexpr(BAD_TOKEN)


@triton.jit
def _merge(m_ptr, s_ptr, row, n_chunks, S_PAD: tl.constexpr):
    """Combine per-chunk (max, rescaled sum) partials of one row into (M, 1/S)."""
    cs = tl.arange(0, S_PAD)
    cmask = cs < n_chunks
    m_c = tl.load(m_ptr + row * n_chunks + cs, mask=cmask, other=float("-inf"))
    s_c = tl.load(s_ptr + row * n_chunks + cs, mask=cmask, other=0.0)
    big_m = tl.max(m_c, axis=0)
    big_m = tl.where(big_m > float("-inf"), big_m, 0.0)
    scale = tl.exp(m_c - big_m)
    total = tl.sum(s_c * scale, axis=0)
    return big_m, 1.0 / total, scale


@triton.jit
def _scaled_logits(row, idx, valid, thr, tie, inv_temp, HAS_THR: tl.constexpr):
    """(logits[idx] · (1/T), NaN-or-+inf flags) with process_logits' semantics: NaN, out-of-range and the
    top-k/top-p cut → -inf. The cut compares the scaled values, exactly as process_logits does (raw
    logits that round to one scaled value are cut alike): above ``thr``, or equal to it up to index ``tie``."""
    raw = tl.load(row + idx, mask=valid, other=float("-inf")).to(tl.float32)
    x = raw * inv_temp
    keep = valid & (x == x)
    if HAS_THR:
        keep = keep & ((x > thr) | ((x == thr) & (idx <= tie)))
    return tl.where(keep, x, float("-inf")), (raw != raw) | (raw == float("inf"))


@triton.jit
def _stats_kernel(logits_ptr, tokens_ptr, thr_ptr, tie_ptr,
                  m_ptr, s_ptr, sx_ptr, bv_ptr, bi_ptr, flag_ptr,
                  V, L, chunk, n_chunks, inv_temp,
                  BLOCK_V: tl.constexpr, GREEDY: tl.constexpr, HAS_THR: tl.constexpr, EXCL: tl.constexpr):
    r = tl.program_id(0)  # b * (L + 1) + j
    c = tl.program_id(1)
    b = r // (L + 1)
    j = r - b * (L + 1)
    tok = tl.load(tokens_ptr + b * L + j, mask=j < L, other=-1)
    row = logits_ptr + r.to(tl.int64) * V
    thr = 0.0
    tie = 0
    if HAS_THR:
        thr = tl.load(thr_ptr + r)
        tie = tl.load(tie_ptr + r)
    start = c * chunk
    end = tl.minimum(start + chunk, V)
    lanes = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    sx = s
    bv = m
    bi = tl.full([], _BIG, tl.int32)
    bad = tl.full([], 0, tl.int32)
    for off in range(start, end, BLOCK_V):
        idx = off + lanes
        valid = idx < end
        x, nan = _scaled_logits(row, idx, valid, thr, tie, inv_temp, HAS_THR)
        bad = tl.maximum(bad, tl.max(nan.to(tl.int32), axis=0))
        bmax = tl.max(x, axis=0)
        m_new = tl.maximum(m, bmax)
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # exp(-inf - m_ref) = 0, never NaN
        alpha = tl.exp(m - m_ref)
        e = tl.exp(x - m_ref)
        s = s * alpha + tl.sum(e, axis=0)
        if EXCL:
            sx = sx * alpha + tl.sum(tl.where(idx != tok, e, 0.0), axis=0)
        if GREEDY:
            first = tl.min(tl.where(valid & (x == bmax), idx, _BIG), axis=0)
            better = (bmax > bv) | (bi == _BIG)
            bi = tl.where(better, first, bi)
            bv = tl.where(better, bmax, bv)
        m = m_new
    out = r * n_chunks + c
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    tl.store(flag_ptr + out, bad * _BAD_LOGITS)
    if EXCL:
        tl.store(sx_ptr + out, sx)
    if GREEDY:
        tl.store(bv_ptr + out, bv)
        tl.store(bi_ptr + out, bi)


@triton.jit
def _q_pass_kernel(logits_ptr, q_ptr, thr_ptr, tie_ptr, m_ptr, s_ptr, tvp_ptr, rp_ptr, flag_ptr,
                   V, L, chunk, n_chunks, inv_temp,
                   BLOCK_V: tl.constexpr, S_PAD: tl.constexpr, HAS_THR: tl.constexpr):
    rq = tl.program_id(0)  # b * L + j
    c = tl.program_id(1)
    b = rq // L
    j = rq - b * L
    r = b * (L + 1) + j
    big_m, inv_s, _ = _merge(m_ptr, s_ptr, r, n_chunks, S_PAD)
    row = logits_ptr + r.to(tl.int64) * V
    qrow = q_ptr + rq.to(tl.int64) * V
    thr = 0.0
    tie = 0
    if HAS_THR:
        thr = tl.load(thr_ptr + r)
        tie = tl.load(tie_ptr + r)
    start = c * chunk
    end = tl.minimum(start + chunk, V)
    lanes = tl.arange(0, BLOCK_V)
    tv = tl.full([], 0.0, tl.float32)
    rp = tv
    bad = tl.full([], 0, tl.int32)
    for off in range(start, end, BLOCK_V):
        idx = off + lanes
        valid = idx < end
        x, nan = _scaled_logits(row, idx, valid, thr, tie, inv_temp, HAS_THR)
        p = tl.exp(x - big_m) * inv_s
        q = tl.load(qrow + idx, mask=valid, other=0.0).to(tl.float32)
        bad = tl.maximum(bad, tl.max((q != q).to(tl.int32), axis=0))
        d = p - q
        tv += tl.sum(tl.abs(d), axis=0)
        rp += tl.sum(tl.maximum(d, 0.0), axis=0)
    out = rq * n_chunks + c
    tl.store(tvp_ptr + out, tv)
    tl.store(rp_ptr + out, rp)
    # this (position, chunk)'s flag slot was written by _stats_kernel; add the draft-probability bit
    f = r * n_chunks + c
    tl.store(flag_ptr + f, tl.load(flag_ptr + f) | (bad * _BAD_PROBS))


@triton.jit
def _finish_kernel(logits_ptr, tokens_ptr, q_ptr, thr_ptr, tie_ptr, u_ptr,
                   m_ptr, s_ptr, sx_ptr, bv_ptr, bi_ptr, tvp_ptr, rp_ptr, flag_ptr,
                   acc_ptr, next_ptr, aprob_ptr, tv_ptr, status_ptr,
                   V, L, chunk, n_chunks, inv_temp,
                   BLOCK_V: tl.constexpr, S_PAD: tl.constexpr, L_PAD: tl.constexpr, GREEDY: tl.constexpr,
                   HAS_THR: tl.constexpr, HAS_Q: tl.constexpr):
    b = tl.program_id(0)
    cs = tl.arange(0, S_PAD)
    cmask = cs < n_chunks
    # all L acceptance tests at once, [L_PAD ≥ L+1] positions × [S_PAD] chunk partials: one round of
    # independent loads instead of a dependent chain per position
    js = tl.arange(0, L_PAD)
    jmask = js < L
    rows = b * (L + 1) + js
    # input errors: the flags of all L+1 positions' chunks, and draft ids outside [0, V) (their loads
    # below are masked, so a bad id never reads outside the row)
    fl = tl.load(flag_ptr + rows[:, None] * n_chunks + cs[None, :], mask=(js <= L)[:, None] & cmask[None, :], other=0)
    status = tl.max(tl.max(fl & _BAD_LOGITS, axis=1), axis=0) | tl.max(tl.max(fl & _BAD_PROBS, axis=1), axis=0)
    tok = tl.load(tokens_ptr + b * L + js, mask=jmask, other=0)
    tok_in = jmask & (tok >= 0) & (tok < V)
    status = status | tl.max((jmask & ((tok < 0) | (tok >= V))).to(tl.int32), axis=0) * _BAD_TOKEN
    tl.store(status_ptr + b, status)
    part = rows[:, None] * n_chunks + cs[None, :]
    pmask = jmask[:, None] & cmask[None, :]
    m2 = tl.load(m_ptr + part, mask=pmask, other=float("-inf"))
    s2 = tl.load(s_ptr + part, mask=pmask, other=0.0)
    big_m = tl.max(m2, axis=1)
    big_m = tl.where(big_m > float("-inf"), big_m, 0.0)
    total = tl.sum(s2 * tl.exp(m2 - big_m[:, None]), axis=1)
    inv_s = 1.0 / tl.where(total > 0, total, 1.0)
    raw_tok = tl.load(logits_ptr + rows.to(tl.int64) * V + tok, mask=tok_in, other=0.0).to(tl.float32)
    x_tok = raw_tok * inv_temp
    kept = tok_in & (x_tok == x_tok)
    if HAS_THR:
        thr_j = tl.load(thr_ptr + rows, mask=jmask, other=0.0)
        tie_j = tl.load(tie_ptr + rows, mask=jmask, other=0)
        kept = kept & ((x_tok > thr_j) | ((x_tok == thr_j) & (tok <= tie_j)))
    p_tok = tl.where(kept, tl.exp(x_tok - big_m) * inv_s, 0.0)
    if HAS_Q:
        q_tok = tl.load(q_ptr + (b * L + js).to(tl.int64) * V + tok, mask=tok_in, other=1.0).to(tl.float32)
        qpart = (b * L + js)[:, None] * n_chunks + cs[None, :]
        tv = 0.5 * tl.sum(tl.load(tvp_ptr + qpart, mask=pmask, other=0.0), axis=1)
    else:
        tv = 1.0 - p_tok  # ½‖p − onehot‖₁
    if GREEDY:
        bv2 = tl.load(bv_ptr + part, mask=pmask, other=float("-inf"))
        bi2 = tl.load(bi_ptr + part, mask=pmask, other=_BIG)
        best = tl.min(tl.where(bv2 == tl.max(bv2, axis=1)[:, None], bi2, _BIG), axis=1)
        ok = tok == best
        prob = ok.to(tl.float32)
    else:
        if HAS_Q:  # min(1, p/q); q = 0: 1 if p > 0, and a p = 0 token is never accepted
            prob = tl.where(q_tok > 0, tl.minimum(p_tok / tl.where(q_tok > 0, q_tok, 1.0), 1.0),
                            tl.where(p_tok > 0, 1.0, 0.0))
        else:
            prob = tl.minimum(p_tok, 1.0)  # q(x̃) = 1
        # strict: P(u < prob) = prob for u ~ U[0, 1), and prob = 0 is never accepted, even at u = 0
        ok = tl.load(u_ptr + b * (L + 1) + js, mask=jmask, other=0.0) < prob
    tl.store(aprob_ptr + b * L + js, prob, mask=jmask)
    tl.store(tv_ptr + b * L + js, tv, mask=jmask)
    a = tl.min(tl.where(ok | (js >= L), L, js), axis=0)  # first rejection, L when all accepted
    tl.store(acc_ptr + b, a.to(tl.int64))
    r = b * (L + 1) + a
    if GREEDY:
        bv = tl.load(bv_ptr + r * n_chunks + cs, mask=cmask, other=float("-inf"))
        bi = tl.load(bi_ptr + r * n_chunks + cs, mask=cmask, other=_BIG)
        best = tl.min(tl.where(bv == tl.max(bv, axis=0), bi, _BIG), axis=0)
        tl.store(next_ptr + b, best.to(tl.int64))
    else:
        # final distribution: residual [p − q]₊ at a rejection (p itself if that has no mass), p for the bonus
        big_m, inv_s, scale = _merge(m_ptr, s_ptr, r, n_chunks, S_PAD)
        s_c = tl.load(s_ptr + r * n_chunks + cs, mask=cmask, other=0.0)
        p_c = s_c * scale * inv_s
        # (scalar & block boolean ops are avoided: Triton's interpreter mis-types them)
        rejected = a < L
        if HAS_Q:
            a_q = tl.maximum(tl.minimum(a, L - 1), 0)  # a row that exists even when a == L
            res_c = tl.load(rp_ptr + (b * L + a_q) * n_chunks + cs, mask=cmask, other=0.0)
        else:
            res_c = tl.load(sx_ptr + r * n_chunks + cs, mask=cmask, other=0.0) * scale * inv_s
        res_c = res_c * rejected.to(tl.float32)
        use_res = tl.sum(res_c, axis=0) > 0
        w_c = tl.where(use_res, res_c, p_c)
        target = tl.load(u_ptr + b * (L + 1) + L) * tl.sum(w_c, axis=0)
        # the chunk holding the draw; when u·total rounds up to the total, the last chunk with mass
        last_c = tl.max(tl.where(cmask & (w_c > 0), cs, 0), axis=0)
        c_star = tl.minimum(tl.sum(((tl.cumsum(w_c, axis=0) <= target) & cmask).to(tl.int32), axis=0), last_c)
        running = tl.sum(tl.where(cs < c_star, w_c, 0.0), axis=0)
        tok_a = tl.load(tokens_ptr + b * L + a, mask=rejected, other=-1)
        row = logits_ptr + r.to(tl.int64) * V
        qrow = q_ptr + (b * L + a).to(tl.int64) * V
        thr = 0.0
        tie = 0
        if HAS_THR:
            thr = tl.load(thr_ptr + r)
            tie = tl.load(tie_ptr + r)
        start = c_star * chunk
        end = tl.minimum(start + chunk, V)
        lanes = tl.arange(0, BLOCK_V)
        found = tl.full([], _BIG, tl.int32)
        last = tl.full([], -1, tl.int32)
        for off in range(start, end, BLOCK_V):
            idx = off + lanes
            valid = idx < end
            x, nan = _scaled_logits(row, idx, valid, thr, tie, inv_temp, HAS_THR)
            p = tl.exp(x - big_m) * inv_s
            if HAS_Q:
                q = tl.load(qrow + idx, mask=idx < tl.where(use_res, end, 0), other=0.0).to(tl.float32)
            else:
                q = (idx == tok_a).to(tl.float32)
            w = tl.where(use_res, tl.maximum(p - q, 0.0), p)
            cdf = tl.cumsum(w, axis=0) + running
            found = tl.minimum(found, tl.min(tl.where(valid & (cdf > target), idx, _BIG), axis=0))
            last = tl.maximum(last, tl.max(tl.where(valid & (w > 0), idx, -1), axis=0))
            running += tl.sum(w, axis=0)
        # not found only through rounding: past the row's total, the last token with mass (c_star is
        # the last chunk with mass), as in sample_from; inside the row the nearest draw. V - 1 only
        # for a chunk without a positive entry (underflow), as sample_from does for a row without mass
        fallback = tl.where(last < 0, V - 1, last)
        tl.store(next_ptr + b, tl.where(found < _BIG, found, fallback).to(tl.int64))


INTERPRETED = type(_stats_kernel).__name__ == "InterpretedFunction"
# tl.sum, tl.max, ... are themselves @jit functions, fixed when triton was imported
_LIBRARY_INTERPRETED = type(tl.sum).__name__ == "InterpretedFunction"


def _thresholds(logits: torch.Tensor, cfg: SamplingConfig):
    """Per-row cut equivalent to ``process_logits``' top-k/top-p mask, or None when neither is on.

    Returns (thr, tie) over rows [R]: a scaled logit x = ``scale_logits(raw)`` (the kernels compute the
    same product) is kept iff ``x > thr`` or (``x == thr`` and its index ``<= tie``). Comparing scaled
    values, not raw ones, keeps exactly process_logits' tokens even where distinct raw logits round to
    one scaled value. The tie index reproduces top-p's cut inside a run of equal values in stable
    (index) order.
    """
    V = logits.shape[-1]
    use_k = bool(cfg.top_k) and cfg.top_k < V
    use_p = cfg.top_p < 1.0
    if not (use_k or use_p):
        return None
    scaled = scale_logits(logits.reshape(-1, V), cfg)
    x = scaled
    if use_k:
        vals, kidx = torch.topk(x, cfg.top_k, dim=-1)
        x = x.masked_fill(x < vals[:, -1:], float("-inf"))
        cut_idx = kidx[:, -1]
        tie = torch.full_like(cut_idx, V)
    if use_p:
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        kept = (before < cfg.top_p) & (sorted_x > float("-inf"))
        last = (kept.sum(-1) - 1).clamp_min(0)
        cut_idx = order.gather(-1, last.unsqueeze(-1)).squeeze(-1)
        tie = cut_idx
    thr = scaled.gather(-1, cut_idx.unsqueeze(-1)).squeeze(-1)
    return thr.contiguous(), tie.to(torch.int32).contiguous()


def _tuning(device: torch.device, rows: int, V: int):
    """(BLOCK_V, chunk_blocks): enough programs to fill every SM (16 each); chunks of ≤ 4 blocks keep
    the finishing kernel's single-chunk scan short (it runs one program per row, after the stream)."""
    block_v = 1024 if V >= 1024 else triton.next_power_of_2(V)
    blocks = triton.cdiv(V, block_v)
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = max(1, min(blocks, triton.cdiv(16 * n_sm, max(rows, 1))))
    return block_v, max(1, min(4, triton.cdiv(blocks, wanted)))


def verify_fused(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                 draft_probs: torch.Tensor | None, cfg: SamplingConfig,
                 uniforms: torch.Tensor | None = None, check: bool = True) -> VerifyResult:
    """Drop-in for :func:`verify_reference` (same arguments, same result) using the fused kernels.

    Invalid inputs are found inside the kernels (the logits stream sees every value; draft ids are
    range-checked before any load they index) and returned in ``status``; check=True raises them,
    which reads ``status`` back (one sync). check=False leaves that to the caller, e.g.
    ``Verifier.verify``, which reads it with the result it needs anyway.
    """
    return _verify(target_logits, draft_tokens, draft_probs, cfg, uniforms, check=check)


def _verify(target_logits, draft_tokens, draft_probs, cfg, uniforms, block_v=None, chunk_blocks=None,
            num_warps=4, check=True) -> VerifyResult:
    dev = target_logits.device
    if dev.type != "cuda" and not INTERPRETED:
        raise UserError("the fused verifier needs a CUDA device; use --verifier torch, or set TRITON_INTERPRET=1 "
                        "before starting Python to run the kernel in Triton's (slow) CPU interpreter")
    if INTERPRETED != _LIBRARY_INTERPRETED:
        raise UserError("TRITON_INTERPRET was changed between `import triton` and importing decode.core.verify.fused; "
                        "set TRITON_INTERPRET=1 in the environment before starting Python")
    B, L1, V = target_logits.shape
    L = L1 - 1
    if tuple(draft_tokens.shape) != (B, L):
        raise ValueError(f"draft_tokens has shape {tuple(draft_tokens.shape)}, expected {(B, L)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (B, L, V):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected {(B, L, V)}")
    greedy = cfg.greedy
    if not greedy and uniforms is None:
        raise ValueError("sampling verification needs explicit uniforms [B, L+1]")
    logits = target_logits.contiguous()
    f32 = dict(device=dev, dtype=torch.float32)
    tokens = draft_tokens.to(device=dev, dtype=torch.long).contiguous()
    if L == 0:
        tokens = torch.zeros(1, device=dev, dtype=torch.long)  # never read; avoids a null pointer
    q = logits if draft_probs is None or L == 0 else draft_probs.to(dev).contiguous()
    u = logits if greedy else uniforms.to(**f32).contiguous()
    cut = None if greedy else _thresholds(logits, cfg)
    thr, tie = cut if cut is not None else (logits, logits)
    inv_temp = 1.0 if greedy else 1.0 / cfg.temperature

    R = B * L1
    if block_v is None:
        block_v, chunk_blocks = _tuning(dev, R, V)
    chunk = block_v * chunk_blocks
    n_chunks = triton.cdiv(V, chunk)
    s_pad = max(16, triton.next_power_of_2(n_chunks))
    excl = not greedy and draft_probs is None
    m = torch.empty(R, n_chunks, **f32)
    s = torch.empty(R, n_chunks, **f32)
    sx = torch.empty(R, n_chunks, **f32) if excl else m
    bv = torch.empty(R, n_chunks, **f32) if greedy else m
    bi = torch.empty(R, n_chunks, device=dev, dtype=torch.int32) if greedy else m
    flags = torch.empty(R, n_chunks, device=dev, dtype=torch.int32)
    if R:
        _stats_kernel[(R, n_chunks)](logits, tokens, thr, tie, m, s, sx, bv, bi, flags, V, L, chunk, n_chunks, inv_temp,
                                     BLOCK_V=block_v, GREEDY=greedy, HAS_THR=cut is not None, EXCL=excl,
                                     num_warps=num_warps)
    tvp = rp = m
    if draft_probs is not None and B * L:
        tvp = torch.empty(B * L, n_chunks, **f32)
        rp = torch.empty(B * L, n_chunks, **f32)
        _q_pass_kernel[(B * L, n_chunks)](logits, q, thr, tie, m, s, tvp, rp, flags, V, L, chunk, n_chunks, inv_temp,
                                          BLOCK_V=block_v, S_PAD=s_pad, HAS_THR=cut is not None,
                                          num_warps=num_warps)
    accepted = torch.empty(B, device=dev, dtype=torch.long)
    next_token = torch.empty(B, device=dev, dtype=torch.long)
    accept_prob = torch.empty(B, L, **f32)
    tv = torch.empty(B, L, **f32)
    status = torch.empty(B, device=dev, dtype=torch.int32)
    if B:
        _finish_kernel[(B,)](logits, tokens, q, thr, tie, u, m, s, sx, bv, bi, tvp, rp, flags,
                             accepted, next_token, accept_prob, tv, status, V, L, chunk, n_chunks, inv_temp,
                             BLOCK_V=block_v, S_PAD=s_pad, L_PAD=triton.next_power_of_2(L + 1),
                             GREEDY=greedy, HAS_THR=cut is not None,
                             HAS_Q=draft_probs is not None, num_warps=num_warps)
    if check:
        raise_for_status(status, V, draft_tokens)
    return VerifyResult(accepted, next_token, accept_prob, tv, status)


__all__ = ["verify_fused", "INTERPRETED"]
