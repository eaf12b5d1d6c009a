"""Target: the verifier model behind a KV cache, with prefill, scoring and rollback.

Cache invariant: for a context of n tokens the cache holds the first n-1; each round feeds
``[last token] + draft`` so every round (also the first) is one forward pass of L+1 positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class ScoreResult:
    logits: torch.Tensor  # [L+1, V] at [last token] + draft
    hidden: torch.Tensor | None  # [L+1, d] final-layer hidden states (post-norm), when requested


def crop_cache(cache, keep: int) -> None:
    """Crop an HF cache to its first ``keep`` tokens.

    ``DynamicCache.crop`` changed meaning across transformers versions (older: positive = final
    length; 5.x: only negative = number of tokens to remove). A negative count means "remove this
    many" in both, so always pass that.
    """
    remove = cache.get_seq_length() - keep
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {keep}")
    if remove:
        cache.crop(-remove)


class Target:
    def __init__(self, model, tokenizer=None, *, want_hidden: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.want_hidden = want_hidden
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.cache = DynamicCache()
        self.forwards = 0
        self.prefill_hidden = None

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def _forward(self, ids: list[int] | torch.Tensor, hidden: bool):
        x = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(1, -1)
        out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True, output_hidden_states=hidden)
        return out

    def prefill(self, prompt_ids: list[int]) -> None:
        """Start a new sequence: cache all prompt tokens but the last."""
        if len(prompt_ids) == 0:
            raise ValueError("empty prompt")
        self.cache = DynamicCache()
        self.forwards = 0
        self.prefill_hidden = None  # [len(prompt)-1, d] final-layer hidden states when want_hidden
        if len(prompt_ids) > 1:
            out = self._forward(prompt_ids[:-1], hidden=self.want_hidden)
            self.prefill_hidden = out.hidden_states[-1][0] if self.want_hidden else None

    def score(self, last_token: int, draft_tokens: torch.Tensor) -> ScoreResult:
        """Verification forward over ``[last_token] + draft`` (one target forward pass)."""
        ids = torch.cat([torch.tensor([last_token]), draft_tokens.to(torch.long).cpu()])
        out = self._forward(ids, hidden=self.want_hidden)
        self.forwards += 1
        hidden = out.hidden_states[-1][0] if self.want_hidden else None
        return ScoreResult(out.logits[0].float(), hidden)

    def rollback(self, keep: int) -> None:
        """Keep the first ``keep`` cached tokens (the accepted prefix)."""
        crop_cache(self.cache, keep)
