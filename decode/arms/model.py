"""Independent small drafter model (any HF causal LM with the target's vocabulary).

It keeps its own KV cache and the list of tokens in it. Before drafting it rolls its cache back to
the longest common prefix with the committed context and feeds whatever it missed (tokens other
arms produced while it was idle); that catch-up happens inside ``propose`` so it counts as this
arm's draft time — the switching cost MetaSD describes.

The cache is a ``decode.target.KVCache`` of the run's kind (``ArmEnv.cache``): with "static" it is
allocated once (prompt + 256 slots, grown by re-allocation when a long generation needs more) and
rolling back to the common prefix moves a pointer.
"""
from __future__ import annotations

from typing import Annotated

import torch

from ..draft import Draft
from ..errors import UserError
from ..models import check_vocab_compatible, load_model
from ..sampling import SamplingConfig, choose_token
from ..specs import Range
from ..target import KVCache, check_tree_support
from ..tree import sample_chains, tree_attention
from .base import Arm, ArmEnv, register


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DrafterModelArm(Arm):
    name = "drafter"

    def __init__(self, model, sampling: SamplingConfig, L: int = 4, generator: torch.Generator | None = None,
                 label: str | None = None, cache: str = "dynamic", K: int = 1):
        super().__init__(L)
        if K < 1:
            raise UserError(f"drafter: K (sampled chains per draft) must be >= 1, got {K}")
        self.K = int(K)
        self.model = model.eval()
        self.sampling = sampling
        self.generator = generator
        self.device = next(model.parameters()).device
        self._label = label
        # the HF config of the stack that owns the cache (a head module keeps its stack in .model)
        config = getattr(model, "config", None) or model.model.config
        if self.K > 1:
            check_tree_support(config)  # its K chains are fed as trees
        self.cache = KVCache.for_model(model, cache, config=config)
        self.cache_tokens: list[int] = []

    @property
    def label(self) -> str:
        return self._label or f"drafter@{self.L}"

    def reset(self, prompt_ids):
        self.cache.start(minimum=len(prompt_ids))
        self.cache_tokens = []

    @torch.inference_mode()
    def _run(self, ids: list[int]):
        """One forward of ``ids`` on top of the cache (explicit positions, pointer advanced)."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        pos = self.cache.positions(len(ids))
        out = self.model(input_ids=x, position_ids=pos, past_key_values=self.cache.hf, use_cache=True)
        self.cache.advance(len(ids))
        self.cache_tokens.extend(ids)
        return out

    def _feed(self, ids: list[int]) -> torch.Tensor:
        return self._run(ids).logits[0, -1].float()

    @property
    def max_nodes(self) -> int:
        """The most nodes one draft has (K chains of L tokens; the target scores max_nodes + 1 positions)."""
        return self.K * self.L

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        """Roll the cache back to the common prefix with ``context``, feed the rest; the logits after it."""
        keep = min(_common_prefix(self.cache_tokens, context), len(context) - 1)
        self.cache.crop(keep)
        del self.cache_tokens[keep:]
        return self._feed(context[keep:])  # catch-up + first draft position in one forward

    def propose(self, context, max_len, keep_going=None) -> Draft:
        L = min(self.L, max_len)
        if L <= 0:
            return Draft.empty()
        if self.K > 1:
            return self._propose_chains(context, L, keep_going)
        logits = self._catch_up(context)
        tokens, dists = [], []
        for i in range(L):
            if i > 0:
                if keep_going is not None and not keep_going(i, dists[-1]):
                    break
                logits = self._feed([tokens[-1]])
            tok, dist = choose_token(logits, self.sampling, self.generator)
            tokens.append(int(tok))
            dists.append(dist)
        return Draft(torch.tensor(tokens), q=torch.stack(dists))

    @torch.inference_mode()
    def _propose_chains(self, context, L, keep_going) -> Draft:
        """K i.i.d. chains as one merged tree (decode/tree.py ``sample_chains``): each depth is one tree
        forward on top of the context; the tree's entries are cropped from the drafter's cache afterwards
        (it keeps only the committed context)."""
        base = len(context)
        first = self._catch_up(context)  # the cache now holds the whole context
        draft = sample_chains(first, self.K, L, lambda ids, parents: self._run_tree(ids, parents, base),
                              self.sampling, self.generator, keep_going)
        self.cache.crop(base)  # cache_tokens already == context
        return draft

    def _run_tree(self, ids: list[int], parents: list[int], base: int) -> torch.Tensor:
        """Feed the last len(ids) nodes of the tree ``parents`` (the earlier ones are cached after the
        ``base`` context entries); logits [len(ids), V]."""
        n = len(ids)
        self.cache.reserve(n)
        pos, mask = tree_attention(torch.tensor(parents), base, self.cache.key_length(n), self.cache.dtype, self.device,
                                   queries=n)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, position_ids=pos, attention_mask=mask, past_key_values=self.cache.hf,
                         use_cache=True)
        self.cache.advance(n)
        return out.logits[0].float()


@register("drafter")
def _make(env: ArmEnv, path: str, L: Annotated[int, Range(1)] = 4, name: str | None = None,
          K: Annotated[int, Range(1)] = 1):
    """K > 1: K i.i.d. sampled chains per draft, merged into a tree and verified with SpecTr's k-Seq."""
    try:
        weight = env.target_model.get_output_embeddings().weight  # the drafter lives where the target does
        model, tok = load_model(path, device=weight.device, dtype=weight.dtype,
                                trust_remote_code=env.trust_remote_code)
    except UserError as exc:
        raise UserError(f"arm drafter:path={path}: {exc}") from None
    check_vocab_compatible(env.target_tokenizer, tok, target_name=env.target_name, drafter_name=path,
                           target_vocab_size=env.target_model.get_output_embeddings().weight.shape[0],
                           drafter_vocab_size=model.get_output_embeddings().weight.shape[0])
    return DrafterModelArm(model, env.sampling, L, env.generator,
                           label=name or f"drafter[{path}]@{L}" + (f"x{K}" if K > 1 else ""), cache=env.cache, K=K)
