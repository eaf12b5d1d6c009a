import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # parallel workers (`make test`: one per core) each keep to one thread, and so do the commands they start:
    # two OpenMP pools spinning on the same cores slow each other down many times over
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and spinning OpenMP threads crawl on a shared 2-core CPU."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smol_path():
    """Local folder of the default target (GGUF converted once into the user cache)."""
    from decode.core.models import DEFAULT_TARGET, resolve_path
    return resolve_path(DEFAULT_TARGET)


@pytest.fixture(scope="session")
def smol(smol_path):
    from decode.core.models import load_model
    return load_model(smol_path)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smol_path):
    """A tiny random Llama with the default target's tokenizer: fast CLI runs with real text I/O."""
    from helpers import save_tiny_target
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"), smol_path)


@pytest.fixture(scope="module")
def tiny_server(tiny_target_dir, tmp_path_factory):
    """`decode serve` on the tiny target with the model-free arms (helpers.SERVE_ARMS), a state file of its own, one
    thread, one request at a time (tests/test_serve_batch.py serves batched): one per test module that serves."""
    from decode.commands.serve.command import RunningServer
    from helpers import SERVE_ARMS

    state = tmp_path_factory.mktemp("serve") / "state.json"
    with RunningServer(["--target", tiny_target_dir, "--arms", SERVE_ARMS, "--state-file", str(state),
                        "--max-batch", "1", "--threads", "1"]) as s:
        yield s
