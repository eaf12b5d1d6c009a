import pytest
import torch

from decode.common.device import resolve_device, resolve_dtype, synchronize
from decode.common.errors import UserError


def test_auto_picks_cuda_bf16_only_with_a_gpu():
    dev = resolve_device("auto")
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    synchronize(torch.device("cpu"))  # a no-op off CUDA


@pytest.mark.parametrize("spec", ["tpu", "gpu", "cuda:x"])
def test_bad_device_names_the_flag_and_choices(spec):
    with pytest.raises(UserError, match=r"--device must be auto\|cpu\|cuda"):
        resolve_device(spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(UserError, match="no CUDA device"):
        resolve_device("cuda")


def test_bad_dtype_names_the_flag_and_choices():
    with pytest.raises(UserError, match=r"--dtype must be auto\|float32\|bfloat16\|float16, got 'fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))
