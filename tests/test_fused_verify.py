"""Fused Triton verifier (decode/core/verify/fused.py) against the PyTorch reference.

Greedy: identical results. Sampling: identical draws on shared uniforms, and the emitted token
follows the target distribution (chi-square). On a GPU the ``test_kernel_*`` tests run the compiled
kernels in-process. Without one they need Triton's interpreter, which only works when
TRITON_INTERPRET=1 was set before ``import triton`` (triton's own tl.sum/tl.max are ``@jit``
functions, built as interpreted or compiled at import) — in a normal pytest run other modules have
imported triton long before, so ``test_interpreter_suite`` re-runs the ``test_kernel_*`` tests in a
fresh ``python -m pytest`` with the variable set (they show as skipped in the outer run). Shapes are
tiny: the interpreter costs milliseconds per program.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decode.common.errors import UserError
from decode.core.sampling import SamplingConfig, probs, process_logits, scale_logits
from decode.core.verify import Verifier
from decode.core.verify.reference import BAD_LOGITS, BAD_PROBS, BAD_TOKEN, verify_reference
from test_verify_power import hand_case_failures, p_zero_accepted

triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
ROOT = Path(__file__).resolve().parents[1]
INTERPRETER = type(triton.language.sum).__name__ == "InterpretedFunction"  # env set before import triton


def _load_fused(interpret: bool):
    """A private copy of decode/core/verify/fused.py whose kernels are interpreted or compiled."""
    name = f"decode.core.verify._fused_{'interpreted' if interpret else 'compiled'}"
    if name in sys.modules:
        return sys.modules[name]
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "decode" / "core" / "verify" / "fused.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod


@pytest.fixture(scope="module")
def fused():
    if not (CUDA or INTERPRETER):
        pytest.skip("no GPU: runs in a fresh interpreter process (test_interpreter_suite)")
    mod = _load_fused(interpret=not CUDA)
    assert mod.INTERPRETED == (not CUDA)
    return mod


def test_interpreter_suite():
    if CUDA or INTERPRETER:
        pytest.skip("the test_kernel_* tests run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "-k", "test_kernel_ and not large_vocab", __file__]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail


def _case(seed, B, L, V, dtype, cfg, with_q, ties=False):
    """Target logits, drafts (sampled from the draft distribution, as a real drafter does), uniforms."""
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: ties at the argmax and at the top-k / top-p cut
        logits = torch.randint(-4, 5, (B, L + 1, V), generator=g).float() / 2
    else:
        logits = 2.5 * torch.randn(B, L + 1, V, generator=g)
    logits = logits.to(dtype)
    q = None
    if with_q:
        q_logits = logits[:, :L].float() + 1.5 * torch.randn(B, L, V, generator=g)
        q = torch.softmax(q_logits, -1) if cfg.greedy else probs(q_logits, cfg)
    if cfg.greedy:
        best = logits[:, :L].float().argmax(-1)
        tokens = torch.where(torch.rand(B, L, generator=g) < 0.7, best, torch.randint(0, V, (B, L), generator=g))
    elif L:
        src = q if with_q else probs(logits[:, :L], cfg)
        tokens = torch.multinomial(src.reshape(-1, V), 1, generator=g).reshape(B, L)
    else:
        tokens = torch.empty(B, 0, dtype=torch.long)
    return logits, tokens, q, torch.rand(B, L + 1, generator=g)


def _run(mod, logits, tokens, q, cfg, u, tuning, check=True):
    args = (logits.to(DEV), tokens.to(DEV), None if q is None else q.to(DEV), cfg, None if u is None else u.to(DEV))
    res = (mod.verify_fused(*args, check=check) if tuning is None
           else mod._verify(*args, block_v=tuning[0], chunk_blocks=tuning[1], check=check))
    return type(res)(*(t.cpu() for t in (res.accepted, res.next_token, res.accept_prob, res.tv, res.status)))


def _assert_same(res, ref):
    assert res.accepted.dtype == torch.long and res.next_token.dtype == torch.long
    assert torch.equal(res.accepted, ref.accepted), (res.accepted, ref.accepted)
    assert torch.equal(res.next_token, ref.next_token), (res.next_token, ref.next_token)
    torch.testing.assert_close(res.accept_prob, ref.accept_prob.float(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(res.tv, ref.tv.float(), atol=2e-6, rtol=1e-5)


# (BLOCK_V, chunk_blocks): V=37 → 3 chunks (16, 16, 5); V=300 → 3 chunks (128, 128, 44); None = default
SMALL, MID = (16, 1), (64, 2)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

GREEDY_CASES = [
    # dtype, L, draft_probs, V, tuning, ties
    (F32, 0, False, 37, SMALL, False),
    (BF16, 1, True, 300, MID, False),
    (F32, 4, False, 300, MID, False),
    (BF16, 4, True, 37, SMALL, False),
    (F16, 4, False, 300, None, False),
    (BF16, 4, False, 300, MID, True),
]


@pytest.mark.parametrize("dtype,L,with_q,V,tuning,ties", GREEDY_CASES)
def test_kernel_greedy_identical_to_reference(fused, dtype, L, with_q, V, tuning, ties):
    cfg = SamplingConfig(0.0)
    logits, tokens, q, u = _case(10 + L + V, 5, L, V, dtype, cfg, with_q, ties)
    res = _run(fused, logits, tokens, q, cfg, None, tuning)
    ref = verify_reference(logits, tokens, q, cfg)
    _assert_same(res, ref)
    if L:
        assert len(set(ref.accepted.tolist())) > 1  # the case exercises different rejection points


T1 = SamplingConfig(1.0)
T07 = SamplingConfig(0.7)
TOPK = SamplingConfig(0.8, top_k=10)
TOPP = SamplingConfig(1.2, top_p=0.85)
TOPKP = SamplingConfig(1.0, top_k=20, top_p=0.9)

SAMPLING_CASES = [
    # dtype, L, draft_probs, V, cfg, tuning, ties
    (F32, 0, False, 37, T1, SMALL, False),
    (F32, 1, True, 300, TOPK, MID, False),
    (F32, 4, False, 300, TOPP, MID, False),
    (BF16, 4, True, 300, T07, MID, False),
    (BF16, 1, False, 37, TOPKP, SMALL, False),
    (F16, 4, True, 37, TOPP, SMALL, False),
    (F16, 0, False, 300, TOPK, None, False),
    (F32, 4, True, 300, TOPKP, MID, False),
    (BF16, 4, False, 300, TOPK, MID, True),  # ties at the top-k cut (top-p ties: test_thresholds_*)
    (F32, 1, False, 300, T1, None, False),
]


@pytest.mark.parametrize("dtype,L,with_q,V,cfg,tuning,ties", SAMPLING_CASES)
def test_kernel_sampling_draw_for_draw(fused, dtype, L, with_q, V, cfg, tuning, ties):
    logits, tokens, q, u = _case(100 + L + V, 5, L, V, dtype, cfg, with_q, ties)
    res = _run(fused, logits, tokens, q, cfg, u, tuning)
    ref = verify_reference(logits, tokens, q, cfg, u)
    _assert_same(res, ref)


def test_kernel_residual_draws_across_chunks(fused):
    """Every draft token rejected: residual draws land in every chunk and match draw for draw."""
    cfg = SamplingConfig(1.0)
    B, L, V = 12, 1, 300
    g = torch.Generator().manual_seed(5)
    logits = 2 * torch.randn(B, L + 1, V, generator=g)
    tokens = logits[:, :L].argmax(-1)  # the most likely token: removing it shifts the residual's CDF most
    u = torch.rand(B, L + 1, generator=g)
    u[:, 0] = 1.0  # reject every draft token: next_token is always a residual draw
    res = _run(fused, logits, tokens, None, cfg, u, MID)
    ref = verify_reference(logits, tokens, None, cfg, u)
    _assert_same(res, ref)
    assert (ref.accepted == 0).all()
    assert len(set((ref.next_token // 128).tolist())) == 3


def test_kernel_hand_cases(fused):
    """The hand-worked L = 2 cases of test_verify_power: explicit q and uniforms, p = 0 tokens at u = 0
    (never accepted), q = 0 with p = 0 (rejected) and with p > 0 (ratio 1)."""
    def fn(*args):
        return _run(fused, *args, (4, 1))
    assert hand_case_failures(fn) == []
    assert p_zero_accepted(fn) == []


# consecutive float32 logits that round to one value after scaling by 1/1.3 (process_logits keeps both)
_TIED_AFTER_SCALING = (1.7000006437301636, 1.7000007629394531)


def test_kernel_cut_compares_scaled_logits(fused):
    """top-k = 1, T = 1.3: two raw logits that are equal after scaling are both kept, as in process_logits."""
    cfg = SamplingConfig(1.3, top_k=1)
    lo, hi = _TIED_AFTER_SCALING
    logits = torch.full((2, 2, 8), -1.0)
    logits[0, :, 2], logits[0, :, 5] = hi, lo  # the larger raw value first, then the other way round
    logits[1, :, 2], logits[1, :, 5] = lo, hi
    kept = torch.isfinite(process_logits(logits, cfg))
    assert kept[..., 2].all() and kept[..., 5].all() and kept.sum() == 8
    tokens = torch.tensor([[5], [2]])  # the smaller raw value of the tie: p = 1/2
    u = torch.tensor([[0.25, 0.3], [0.75, 0.6]])
    res = _run(fused, logits, tokens, None, cfg, u, SMALL)
    ref = verify_reference(logits, tokens, None, cfg, u)
    _assert_same(res, ref)
    assert ref.accept_prob[:, 0].tolist() == [0.5, 0.5] and ref.accepted.tolist() == [1, 0]


def test_kernel_draw_fallback_is_last_token_with_mass(fused):
    """u_L = 1 (u·total reaching the total): the last token with mass, though the last chunk has none."""
    cfg = SamplingConfig(1.0, top_k=5)
    g = torch.Generator().manual_seed(3)
    V = 37  # SMALL: chunks of 16, 16, 5
    logits = torch.randn(4, 2, V, generator=g) - 10
    for b, top in enumerate([[1, 3, 7, 20, 30], [0, 2, 4, 6, 8], [16, 17, 18, 19, 31], [5, 9, 22, 23, 24]]):
        logits[b, :, top] = torch.arange(5.0)  # the top-5 sits in chunks 0-1: chunk 2 has no mass
    tokens = torch.tensor([[3], [4], [17], [22]])
    u = torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])  # bonus, residual, bonus, residual
    res = _run(fused, logits, tokens, None, cfg, u, SMALL)
    ref = verify_reference(logits, tokens, None, cfg, u)
    _assert_same(res, ref)
    assert ref.accepted.tolist() == [1, 0, 1, 0] and ref.next_token.tolist() == [30, 8, 31, 24]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN/inf rows
def test_kernel_invalid_inputs_are_user_errors(fused):
    """NaN/+inf logits, draft ids outside [0, V), NaN draft probabilities: the reference's error, and
    the same status without check (the kernel never reads through a bad id)."""
    V, L = 20, 2  # SMALL: two chunks
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, L + 1, V, generator=g)
    tokens = torch.randint(0, V, (3, L), generator=g)
    q = torch.softmax(torch.randn(3, L, V, generator=g), -1)
    u = torch.rand(3, L + 1, generator=g)
    cases = []
    for pos, idx, value in [(L, 17, float("nan")), (0, 3, float("inf"))]:  # the bonus row, either chunk
        bad = logits.clone()
        bad[1, pos, idx] = value
        cases.append((bad, tokens, q, [0, BAD_LOGITS, 0]))
    for value in (V, -1):
        bad = tokens.clone()
        bad[2, 1] = value
        cases.append((logits, bad, None, [0, 0, BAD_TOKEN]))
    bad_q = q.clone()
    bad_q[0, 1, 18] = float("nan")
    cases.append((logits, tokens, bad_q, [BAD_PROBS, 0, 0]))
    for cfg in (SamplingConfig(0.0), SamplingConfig(1.1, top_k=9, top_p=0.9)):
        u_ = None if cfg.greedy else u
        for lg, tk, dq, status in cases:
            assert _run(fused, lg, tk, dq, cfg, u_, SMALL, check=False).status.tolist() == status
            assert verify_reference(lg, tk, dq, cfg, u_, check=False).status.tolist() == status
    for lg, tk, dq, status in cases[1:]:  # +inf logits, id V, id -1, NaN probs
        with pytest.raises(UserError) as ref_err:
            verify_reference(lg, tk, dq, cfg, u)
        with pytest.raises(UserError) as err:
            _run(fused, lg, tk, dq, cfg, u, SMALL)
        assert str(err.value) == str(ref_err.value)


@pytest.mark.skipif(not CUDA, reason="real vocabulary sizes need the compiled kernel")
@pytest.mark.parametrize("dtype,with_q,cfg", [(BF16, False, T1), (F32, True, TOPKP),
                                              (BF16, False, SamplingConfig(0.0))])
def test_kernel_large_vocab_default_tuning(fused, dtype, with_q, cfg):
    """152k vocabulary, default blocks/chunks. The GPU's exp differs from the CPU reference's in the
    last bits, so over 152k inverse-CDF boundaries a draw may flip rarely: allow one of 16."""
    B, L, V = 16, 4, 152064
    logits, tokens, q, u = _case(7, B, L, V, dtype, cfg, with_q)
    res = _run(fused, logits, tokens, q, cfg, None if cfg.greedy else u, None)
    ref = verify_reference(logits, tokens, q, cfg, None if cfg.greedy else u)
    assert torch.equal(res.accepted, ref.accepted)
    assert int((res.next_token != ref.next_token).sum()) <= (0 if cfg.greedy else 1)
    torch.testing.assert_close(res.accept_prob, ref.accept_prob.float(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(res.tv, ref.tv.float(), atol=1e-4, rtol=1e-4)


def test_thresholds_match_process_logits(monkeypatch):
    """The per-row cut the kernel applies keeps exactly process_logits' tokens, ties included.

    Inside a run of equal logits top-p keeps a prefix in sort order; the kernel uses index order
    (a stable sort), so process_logits is checked here with a stable sort too. Raw logits that round
    to one value after scaling are a tie as well.
    """
    sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda x, dim=-1, descending=False, stable=False:
                        sort(x, dim=dim, descending=descending, stable=True))
    mod = _load_fused(interpret=False)  # host-side pre-pass only; no kernel runs
    g = torch.Generator().manual_seed(0)
    split_ties = 0
    for trial in range(40):
        V = int(torch.randint(5, 200, (1,), generator=g))
        tied = trial % 2 == 0
        x = (torch.randint(-3, 4, (7, V), generator=g).float() / 2) if tied else torch.randn(7, V, generator=g)
        x = x.to(BF16 if trial % 3 == 0 else F32)
        temp = float(torch.rand(1, generator=g)) + 0.3
        if trial % 5 == 1:  # a run of distinct raw logits that are equal after scaling, on top (float32)
            x = torch.randn(7, V, generator=g) - 2
            lo, hi = _TIED_AFTER_SCALING
            x[:, :4] = torch.tensor([hi, lo, lo, hi])
            temp = 1.3
        cfg = SamplingConfig(temp, top_k=int(torch.randint(0, V + 3, (1,), generator=g)),
                             top_p=[1.0, 0.5, 0.9, 0.99][trial % 4])
        want = torch.isfinite(process_logits(x, cfg))
        cut = mod._thresholds(x, cfg)
        if cut is None:
            assert want.all() and not (cfg.top_k and cfg.top_k < V) and cfg.top_p == 1.0
            continue
        thr, tie = cut
        scaled = scale_logits(x, cfg)
        at_cut = scaled == thr[:, None]
        got = (scaled > thr[:, None]) | (at_cut & (torch.arange(V)[None] <= tie[:, None].long()))
        assert torch.equal(got, want), (trial, cfg)
        split_ties += int(((at_cut & want).any(-1) & (at_cut & ~want).any(-1)).sum())
    assert split_ties > 0  # some cuts fell inside a run of equal logits


def test_kernel_emitted_token_follows_target_distribution(fused):
    """Speculative sampling is lossless: the first emitted token ~ p(·|prefix), whatever was drafted.

    Deterministic (one-hot) drafts picked from a distribution that disagrees with p: most are
    rejected, so the residual draws carry the distribution. Draft probabilities are covered draw for
    draw against the reference above.
    """
    from scipy.stats import chisquare
    cfg = SamplingConfig(1.0)
    N, L, V = 100, 1, 4
    g = torch.Generator().manual_seed(11)
    base = torch.tensor([[1.5, 1.0, 0.5, 0.0], [0.0, 0.3, 0.6, 0.9]])  # p0 ≈ (.46, .28, .17, .10)
    q_row = torch.tensor([[0.05, 0.15, 0.3, 0.5]])
    logits = base.expand(N, L + 1, V).contiguous()
    tokens = torch.multinomial(q_row.expand(N, V), 1, replacement=True, generator=g)
    u = torch.rand(N, L + 1, generator=g)
    res = _run(fused, logits, tokens, None, cfg, u, (4, 1))
    first = torch.where(res.accepted > 0, tokens[:, 0], res.next_token)
    counts = torch.bincount(first, minlength=V).double()
    p0 = torch.softmax(base[0], -1).double()
    assert {0, 1} <= set(res.accepted.tolist())  # both acceptances and residual draws happened
    assert chisquare(counts.numpy(), (N * p0 / p0.sum()).numpy()).pvalue > 1e-3
    # the same sample clearly rejects the draft's own distribution: the test has power
    q0 = q_row[0].double()
    assert chisquare(counts.numpy(), (N * q0 / q0.sum()).numpy()).pvalue < 1e-6


def test_auto_uses_reference_off_cuda():
    assert Verifier(SamplingConfig(0.0), "auto")._fn(torch.device("cpu")) is verify_reference


def test_triton_backend_on_cpu_without_interpreter_is_a_user_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    v = Verifier(SamplingConfig(0.0), "triton")
    with pytest.raises(UserError, match="TRITON_INTERPRET=1"):
        v.verify_batch(torch.randn(1, 2, 8), torch.zeros(1, 1, dtype=torch.long), None)


def test_kernel_verifier_dispatches_to_fused(fused):
    """Verifier(backend="triton") runs the kernel (interpreted on CPU) and agrees with backend="torch"."""
    import decode.core.verify.fused as dispatched
    assert dispatched.INTERPRETED == (not CUDA)
    from decode.core.draft import Draft
    g = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(4, 40, generator=g)).to(DEV)
    draft = Draft(logits[:3].argmax(-1).cpu())
    for cfg in (SamplingConfig(0.0), SamplingConfig(0.9, top_k=8)):
        outs = [Verifier(cfg, b, torch.Generator().manual_seed(3)).verify(logits, draft) for b in ("triton", "torch")]
        assert (outs[0].accepted, outs[0].tokens) == (outs[1].accepted, outs[1].tokens)
        assert outs[0].tv == pytest.approx(outs[1].tv, abs=1e-5)
        assert outs[0].accept_prob == pytest.approx(outs[1].accept_prob, abs=1e-5)
        assert Verifier(cfg, "triton")._fn(DEV) is dispatched.verify_fused


@pytest.mark.skipif(CUDA or INTERPRETER, reason="on a GPU the kernels are compiled and run by the tests above")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernels_compile_for_hopper():
    """The interpreter does not type-check like the compiler: build every kernel variant for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    mod = _load_fused(interpret=False)
    assert not mod.INTERPRETED
    fp, i32, i64 = "*fp32", "*i32", "*i64"
    scalars = {"V": "i32", "L": "i32", "chunk": "i32", "n_chunks": "i32", "inv_temp": "fp32"}

    def build(fn, ptrs, consts):
        sig = {**ptrs, **scalars, **{k: "constexpr" for k in consts}}
        assert list(sig) == list(fn.arg_names), (list(sig), fn.arg_names)
        div = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, "V", "chunk")}
        try:
            kernel = triton.compile(ASTSource(fn, sig, consts, div), target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": 4})
        except RuntimeError as exc:  # no ptxas in this triton build: nothing to check against
            if "ptxas" in str(exc).lower():
                pytest.skip(str(exc))
            raise
        return kernel

    stats = {"logits_ptr": "*bf16", "tokens_ptr": i64, "thr_ptr": fp, "tie_ptr": i32, "m_ptr": fp, "s_ptr": fp,
             "sx_ptr": fp, "bv_ptr": fp, "bi_ptr": i32, "flag_ptr": i32}
    qpass = {"logits_ptr": "*fp16", "q_ptr": fp, "thr_ptr": fp, "tie_ptr": i32, "m_ptr": fp, "s_ptr": fp,
             "tvp_ptr": fp, "rp_ptr": fp, "flag_ptr": i32}
    finish = {"logits_ptr": "*bf16", "tokens_ptr": i64, "q_ptr": fp, "thr_ptr": fp, "tie_ptr": i32, "u_ptr": fp,
              "m_ptr": fp, "s_ptr": fp, "sx_ptr": fp, "bv_ptr": fp, "bi_ptr": i32, "tvp_ptr": fp, "rp_ptr": fp,
              "flag_ptr": i32, "acc_ptr": i64, "next_ptr": i64, "aprob_ptr": fp, "tv_ptr": fp, "status_ptr": i32}
    streams = [build(mod._stats_kernel, stats, {"BLOCK_V": 1024, "GREEDY": greedy, "HAS_THR": thr, "EXCL": excl})
               for greedy, thr, excl in [(True, False, False), (False, True, True), (False, False, False)]]
    streams.append(build(mod._q_pass_kernel, qpass, {"BLOCK_V": 1024, "S_PAD": 256, "HAS_THR": True}))
    assert all("ld.global.v4" in k.asm["ptx"] for k in streams)  # 16-byte vector loads of the vocab stream
    for greedy, thr, has_q in [(True, False, True), (False, True, False), (False, False, True)]:
        build(mod._finish_kernel, finish, {"BLOCK_V": 1024, "S_PAD": 64, "L_PAD": 8, "GREEDY": greedy,
                                           "HAS_THR": thr, "HAS_Q": has_q})


def test_bench_verify_cli_writes_reports(tmp_path):
    """The benchmark's plumbing (timings themselves are not asserted)."""
    import json
    from decode.commands.cli import main
    out = tmp_path / "bench.json"
    argv = ["bench-verify", "--device", "cpu", "--vocab", "500", "--draft-len", "0,2", "--batch", "2",
            "--dtypes", "bf16", "--reps", "1", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [(p["L"], p["bytes"]) for p in report["points"]] == [(0, 2 * 1 * 500 * 2), (2, 2 * 3 * 500 * 2)]
    assert all(p["ref_ms"] > 0 and p["fused_ms"] is None for p in report["points"])
    assert "| 500 | 2 | 2 | bf16 |" in out.with_suffix(".md").read_text()
    if not CUDA:  # the kernel is GPU-only outside the interpreter: a clean error, exit code 2
        assert main(argv + ["--backends", "fused"]) == 2
