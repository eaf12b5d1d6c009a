"""Independent small drafter model (any HF causal LM with the target's vocabulary).

It keeps its own KV cache and the list of tokens in it. Before drafting it rolls its cache back to
the longest common prefix with the committed context and feeds whatever it missed (tokens other
arms produced while it was idle); that catch-up happens inside ``propose`` so it counts as this
arm's draft time — the switching cost MetaSD describes.

The cache is a ``decode.core.target.KVCache`` of the run's kind (``ArmEnv.cache``): with "static" it is
allocated once (prompt + 256 slots, grown by re-allocation when a long generation needs more) and
rolling back to the common prefix moves a pointer.

Draft vocabulary (FR-Spec, decode/core/vocab.py): a drafter folder trained with ``draft_vocab`` holds
``draft_vocab.safetensors``; with ``vocab=auto`` (the default) the arm drafts from it. Its forward then
runs the drafter's decoder stack and multiplies the last hidden state by the [N, d] kept rows of the
drafter's output embedding (cached once) instead of the [V, d] LM head — on a MetaSD-shaped drafter
the LM head is most of a drafted token's cost — and maps the N logits back to target ids with ``-inf``
elsewhere: q = 0 outside the subset under sampling, greedy drafts the best subset token. The saving
shows up where every arm's cost does: in its measured ``propose`` time (decode/bench/draft_cost.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ...core.draft import Draft
from ...common.errors import UserError
from ..heads.common import DraftVocabMixin, base_model
from ...core.models import ALIASES, check_vocab_compatible, load_model, resolve_path
from ...core.sampling import SamplingConfig, choose_token
from ...common.specs import Range
from ...core.target import KVCache, check_tree_support
from ...core.tree import sample_chains, tree_attention
from ...core.vocab import VOCAB_FILE, DraftVocab
from .base import Arm, ArmEnv, register
from .batched import BatchDrafter

VOCAB_CHOICES = "auto|none|PATH"
# config fields of LM heads that are more than a matrix product (soft-capping, scaling): the pruned
# forward would not reproduce them, so a drafter that has one is refused rather than drafted wrongly
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def logit_transforms(config) -> list[str]:
    """The config fields by which an LM's logits are more than its hidden state times the LM head (empty: none)."""
    return [k for k in _LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1, 1.0)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def load_drafter_vocab(folder, vocab_size: int, option: str = "auto") -> DraftVocab | None:
    """The draft vocabulary a drafter drafts from: ``auto`` = ``<folder>/draft_vocab.safetensors`` when
    present (else the full vocabulary), ``none`` = the full vocabulary, anything else = a folder holding
    that file or the file itself. Checked against the target's ``vocab_size``."""
    option = (option or "auto").strip()
    if option == "none":
        return None
    if option == "auto":
        if not (Path(folder) / VOCAB_FILE).is_file():
            return None
        where = Path(folder)
    else:
        p = Path(option)
        where = p.parent if p.is_file() and p.name == VOCAB_FILE else p
        if not (where / VOCAB_FILE).is_file():
            raise UserError(f"vocab={option}: no {VOCAB_FILE} there; pass vocab={VOCAB_CHOICES} (a folder "
                            f"holding {VOCAB_FILE}, or the file itself)")
    try:
        return DraftVocab.load(where, vocab_size)
    except UserError as exc:
        raise UserError(f"{exc} (or draft from the full vocabulary with vocab=none)") from None


class DraftVocabLM(DraftVocabMixin, nn.Module):
    """A causal LM that drafts from a draft vocabulary: ``forward`` takes the LM's own arguments (cache,
    positions, masks) and returns logits over the target vocabulary, finite on the subset only.

    The logits are the LM's decoder stack's last hidden state times the kept rows of its output
    embedding (and bias), i.e. exactly the LM's logits on the subset, without the [V, d] product; the
    subset's rows and the mapping back to target ids are the self-drafting heads' (``DraftVocabMixin``).
    ``logits_to_keep=k`` scores only the last k positions (a catch-up forward needs one)."""

    def __init__(self, model: nn.Module, vocab: DraftVocab):
        super().__init__()
        head = model.get_output_embeddings()
        V = head.weight.shape[0]
        if vocab.vocab_size != V:
            raise UserError(f"the draft vocabulary indexes {vocab.vocab_size} tokens but the drafter has {V}; "
                            f"build it for this drafter's target (or pass vocab=none)")
        config = getattr(model, "config", None)
        odd = logit_transforms(config)
        if odd:
            raise UserError(f"this drafter transforms its logits beyond the LM head ({', '.join(odd)}); a draft "
                            f"vocabulary would change its distribution: pass vocab=none")
        self.model = model
        self.decoder = base_model(model)
        self._set_draft_vocab(vocab, model)
        self.register_buffer("rows", self.draft_rows(head.weight), persistent=False)
        bias = getattr(head, "bias", None)
        self.register_buffer("bias", None if bias is None else self.draft_rows(bias), persistent=False)

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids, logits_to_keep: int = 0, **kwargs):
        out = self.decoder(input_ids=input_ids, **kwargs)
        h = out.last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.full_logits(F.linear(h, self.rows, self.bias)),
                                      past_key_values=out.past_key_values)


class DrafterModelArm(Arm):
    name = "drafter"

    def __init__(self, model, sampling: SamplingConfig, L: int = 4, generator: torch.Generator | None = None,
                 label: str | None = None, cache: str = "dynamic", K: int = 1,
                 vocab: "DraftVocab | DraftVocabLM | None" = None):
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
        # what its forwards run: the model, or the model's stack + the draft vocabulary's rows (same cache)
        self.pruned = vocab if vocab is None or isinstance(vocab, DraftVocabLM) else DraftVocabLM(self.model, vocab)

    @property
    def draft_vocab(self) -> DraftVocab | None:
        """The subset it drafts from (None: the full vocabulary), as on the self-drafting heads."""
        return None if self.pruned is None else self.pruned.draft_vocab

    @property
    def label(self) -> str:
        return self._label or f"drafter@{self.L}"

    @property
    def batch_key(self):
        """Batched rounds draft the rows of one drafter model together (decode/choose/arms/batched.py): chains only
        (K sampled chains are serial), and LM heads that are a matrix product (no soft-capping or scaling)."""
        if self.K > 1 or logit_transforms(getattr(self.model, "config", None)):
            return None
        return "drafter", id(self.model), id(self.pruned)

    def batch_drafter(self, rows: int, compact_slack: int):
        return DrafterBatch(self.model, self.pruned, rows, compact_slack)

    def reset(self, prompt_ids):
        self.cache.start(minimum=len(prompt_ids))
        self.cache_tokens = []

    def _forward(self, last_only: bool = False, **kwargs):
        """The model's forward, or the pruned one (scoring only the last position when that is all the
        caller reads: a catch-up of a whole prompt then costs no [len, N] product)."""
        if self.pruned is None:
            return self.model(**kwargs)
        return self.pruned(logits_to_keep=1 if last_only else 0, **kwargs)

    @torch.inference_mode()
    def _run(self, ids: list[int], last_only: bool = False):
        """One forward of ``ids`` on top of the cache (explicit positions, pointer advanced)."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        pos = self.cache.positions(len(ids))
        out = self._forward(last_only, input_ids=x, position_ids=pos, past_key_values=self.cache.hf, use_cache=True)
        self.cache.advance(len(ids))
        self.cache_tokens.extend(ids)
        return out

    def _feed(self, ids: list[int]) -> torch.Tensor:
        return self._run(ids, last_only=True).logits[0, -1].float()

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
        """K i.i.d. chains as one merged tree (decode/core/tree.py ``sample_chains``): each depth is one tree
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
        out = self._forward(input_ids=x, position_ids=pos, attention_mask=mask, past_key_values=self.cache.hf,
                            use_cache=True)
        self.cache.advance(n)
        return out.logits[0].float()


class DrafterBatch(BatchDrafter):
    """One drafter model's drafting for every row of a batched engine (decode/choose/arms/batched.py). Its cache
    holds the committed tokens (positions 0..m-1); the output kept per row is the decoder's last hidden state, and
    logits come from the LM head (or the draft vocabulary's rows) for the rows that draft only."""

    def __init__(self, model, pruned: "DraftVocabLM | None", rows: int = 0, compact_slack: int = 32):
        self.model, self.pruned = model, pruned
        self.decoder = base_model(model)
        super().__init__(model, getattr(model, "config", None) or model.model.config, rows, compact_slack)

    def _prefill(self, prompt, feats):
        return list(prompt), None

    def _run(self, ids, extra, pos, cache, mask):
        return self.decoder(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                            use_cache=True).last_hidden_state

    def _logits(self, out):
        if self.pruned is None:
            return self.model.get_output_embeddings()(out)
        return self.pruned.full_logits(F.linear(out, self.pruned.rows, self.pruned.bias))


def _check(typed: dict) -> None:
    """The drafter's folder or hub id resolves (an alias is converted only when it loads)."""
    if str(typed["path"]) not in ALIASES:
        resolve_path(str(typed["path"]))


@register("drafter", check=_check)
def _make(env: ArmEnv, path: str, L: Annotated[int, Range(1)] = 4, name: str | None = None,
          K: Annotated[int, Range(1)] = 1, vocab: str = "auto"):
    """K > 1: K i.i.d. sampled chains per draft, merged into a tree and verified with SpecTr's k-Seq.
    ``vocab``: the draft vocabulary, auto (the folder's draft_vocab.safetensors when present) | none (the
    full vocabulary) | PATH (a folder holding that file, or the file)."""
    model, pruned = env.once(("drafter", path, vocab), lambda: _load(env, path, vocab), path=path)
    try:
        return DrafterModelArm(model, env.sampling, L, env.generator,
                               label=name or f"drafter[{path}]@{L}" + (f"x{K}" if K > 1 else ""), cache=env.cache,
                               K=K, vocab=pruned)
    except UserError as exc:
        raise UserError(f"arm drafter:path={path}: {exc}") from None


def _load(env: ArmEnv, path: str, vocab: str) -> tuple[nn.Module, DraftVocabLM | None]:
    """The drafter model (checked against the target's vocabulary) and its draft-vocabulary forward, if any."""
    try:
        weight = env.target_model.get_output_embeddings().weight  # the drafter lives where the target does
        model, tok = load_model(path, device=weight.device, dtype=weight.dtype,
                                trust_remote_code=env.trust_remote_code)
    except UserError as exc:
        raise UserError(f"arm drafter:path={path}: {exc}") from None
    check_vocab_compatible(env.target_tokenizer, tok, target_name=env.target_name, drafter_name=path,
                           target_vocab_size=env.target_model.get_output_embeddings().weight.shape[0],
                           drafter_vocab_size=model.get_output_embeddings().weight.shape[0])
    try:
        draft_vocab = load_drafter_vocab(path, model.get_output_embeddings().weight.shape[0], vocab)
        return model.eval(), None if draft_vocab is None else DraftVocabLM(model, draft_vocab)
    except UserError as exc:
        raise UserError(f"arm drafter:path={path}: {exc}") from None
