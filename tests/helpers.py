"""Tiny randomly initialised models and a tokenizer stand-in for fast CPU tests."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


SERVE_ARMS = "pld:L=4;suffix:L=6"  # the model-free pool the server tests serve


class TinyTokenizer:
    """Just enough of a tokenizer for vocab checks: an id map over ``vocab`` symbols."""

    def __init__(self, vocab: int, prefix: str = "t"):
        self._vocab = {f"{prefix}{i}": i for i in range(vocab)}
        self.eos_token_id = None

    def get_vocab(self):
        return dict(self._vocab)


def tiny_llama(vocab: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0, peaked: float = 1.0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    if peaked != 1.0:
        with torch.no_grad():
            m.lm_head.weight.mul_(peaked)
    return m


def tiny_qwen(vocab: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return Qwen2ForCausalLM(cfg).eval()


@torch.inference_mode()
def plain_greedy(model, prompt: list[int], n: int, eos: set[int] = frozenset()) -> list[int]:
    """Reference: HF generate, greedy, no cache tricks."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=0,
                         eos_token_id=list(eos) or None, pad_token_id=0)
    toks = out[0, len(prompt):].tolist()
    return toks


def run_main(main, argv: list[str]):
    """A CLI run in this process (``main(argv)`` of decode/toolkit): what ``subprocess.run`` of ``python -m ...``
    gives — returncode, stdout, stderr — without paying a fresh interpreter's torch/transformers import per
    call. An exception that escapes the command (a traceback in a real run) fails the calling test."""
    import contextlib
    import io
    from types import SimpleNamespace

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's usage errors and --help
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def save_tiny_target(folder, tokenizer_source: str, layers: int = 2, seed: int = 3) -> str:
    """A tiny random Llama saved as an HF folder with the tokenizer of ``tokenizer_source``: CLI runs with real
    text I/O in seconds."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_source)
    m = tiny_llama(vocab=len(tok), hidden=32, layers=layers, seed=seed)
    m.config.eos_token_id = tok.eos_token_id
    m.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def model_costs_only(monkeypatch):
    """A batched round's cost as the engine's model says, with no correction from wall-clock rounds (on a tiny model
    mostly noise): for tests that pin or check the model itself (tests/test_cost_calibration.py tests the
    correction). Autouse wherever a test module imports it: ``from helpers import model_costs_only  # noqa: F401``."""
    monkeypatch.setattr("decode.engine.batch.BatchEngine.calibration", lambda self, B, kind: 1.0)


def train_eagle_briefly(model, head, steps=200, lr=1e-2, batch=8, length=24):
    """Adam steps of the recipe's own loss (toolkit/train/eagle.py ``make_loss``) on random token texts (the head
    learns the target's feature map from any text): agreement well above chance in about a second."""
    from toolkit.train.eagle import EagleSection, EagleTrainModule, make_loss

    module = EagleTrainModule(model, head)
    loss_fn = make_loss(EagleSection(noise=0.0))
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    module.train()
    for _ in range(steps):
        ids = torch.randint(1, vocab, (batch, length), generator=g)
        labels = torch.cat([torch.full((batch, 4), -100), ids[:, 4:]], 1)
        loss, _ = loss_fn(module, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()
