"""EAGLE arm: chain drafting in feature space with a trained EAGLE head (ALGORITHMS.md §5).

Feature f_j = the target's post-norm final hidden state at position j (the LM head's input), as
returned by the verification forward (``observe``) and the prefill (``Target.prefill_hidden``).
Head cache entry j = layer(fc([emb(x_{j+1}), f_j])) and predicts f_{j+1}. The head's own KV cache
holds only entries built from TRUE target features; entries built from predicted features while
drafting are cropped after every draft (EAGLE recomputes them once the target's features arrive).
The head cache is a ``decode.core.target.KVCache`` of the run's kind (``ArmEnv.cache``); with "static"
that crop moves a pointer.

Per draft with m committed tokens: feed the missing true entries up to j = m-2 in one forward
(its last output predicts f_{m-1} → draft token 1), then one head step per further token.

EAGLE-3 heads (``EagleHead.fused``): the arm asks the Target for the head's layers (``Target.request_hidden``,
whose selector reads them from the HiddenStates the engine hands ``observe``), stores those raw
rows, and builds true entries from g = ``head.input_features(rows)``; draft steps feed the head's own output h
back, exactly as the EAGLE-1 path feeds its predicted feature (the head's ``logits`` applies its norm).

Counterfactual feedback (decode/choose/feedback.py; ``counterfactual=True``, off by default): in greedy runs the
chain's draft is a deterministic function of the context, so full-information policies and the router can score
it every round (``greedy_counterfactual``): the catch-up forward over the newly verified tokens is work the arm
owes anyway, and the would-be draft adds L-1 head steps (timed as the round's feedback). When the arm is then
played from the same context, the catch-up is not repeated (``_true_step`` keeps the prediction after the
context). Not free, though: with the shipped head (L=2) and the router it measured ~10% slower per token at
the same MAT (Spec-Bench dev 13 × 1, 96 tokens), so it is opt-in.

A head saved with a draft vocabulary (decode/core/vocab.py) drafts only its tokens: logits from the [N, d]
rows of the target's LM head cached on the head at load, mapped back to target ids before sampling.
"""
from __future__ import annotations

import torch

from ....core.draft import Draft
from ....common.errors import UserError
from ...heads import EagleHead
from ....core.sampling import SamplingConfig, choose_token
from ....core.hidden import FINAL, HiddenStates, LayerSelector, layer_features
from ....core.target import KVCache
from ..base import Arm


class EagleArm(Arm):
    name = "eagle"
    uses_target_hidden = True
    FEATS_MIN_ROWS = 256  # first capacity of the true-feature buffer (it doubles when full)

    def __init__(self, head: EagleHead, target_model, sampling: SamplingConfig, L: int = 4,
                 generator: torch.Generator | None = None, label: str | None = None, target=None,
                 cache: str = "dynamic", counterfactual: bool = False):
        super().__init__(L)
        self.greedy_counterfactual = bool(counterfactual)  # scored unplayed in greedy runs (module docstring)
        self.head = head.eval()
        self.target_model = target_model
        self.layers = head.target_layers
        self.target = target  # requests the head's layers from it (the ``target`` setter)
        self.sampling = sampling
        self.generator = generator
        self._label = label
        self.device, self.dtype = next(head.parameters()).device, next(head.parameters()).dtype
        self.target_forwards = 0  # target forwards this arm ran itself (the engine counts them in MAT)
        self.cache = KVCache.for_model(self.head, cache, config=self.head.model.config)
        self.reset([])

    @property
    def target(self):
        return self._target

    @target.setter
    def target(self, target) -> None:
        """Linking a Target (here or later) asks it for the head's layers; ``select`` reads them from the
        HiddenStates it yields. Without a Target, whoever calls ``observe`` passes HiddenStates whose ``extra``
        holds exactly the head's layers other than FINAL, in order."""
        self._target = target
        if target is not None:
            self.select = target.request_hidden(self.layers)
        else:
            d = self.target_model.get_input_embeddings().weight.shape[1]
            self.select = LayerSelector(self.layers, tuple(i for i in self.layers if i != FINAL), d)

    @property
    def label(self) -> str:
        return self._label or f"eagle@{self.L}"

    @property
    def batch_key(self):
        """Batched rounds draft the rows of one head together (decode/choose/arms/batched.py): a plain chain only
        (trees, sampled chains and counterfactual drafts are serial)."""
        return None if type(self) is not EagleArm or self.greedy_counterfactual else ("eagle", id(self.head))

    def batch_drafter(self, rows: int, compact_slack: int):
        from .batched import EagleBatch
        return EagleBatch(self.head, rows, compact_slack)

    def reset(self, prompt_ids):
        self.cache.start(minimum=len(prompt_ids))
        self.entries = 0  # head-cache entries built from true features (positions 0..entries-1)
        self.feats = None  # [P, d·len(layers)] true target rows for positions 0..P-1 (a view of _feats_buf)
        self._feats_buf = None  # grows by doubling: appending a round's rows does not copy the whole history
        self.tokens: list[int] = []  # committed tokens the features belong to
        self.prev_len = self.prompt_len = len(prompt_ids)
        self.draft_hidden: list[torch.Tensor] = []
        self.target_hidden = None
        self.after = None  # the head's prediction after self.tokens (the last _true_step's result)

    # -- true features ------------------------------------------------------------------------------
    @torch.inference_mode()  # the buffer may be an inference tensor (_fill_missing): written in place only here
    def _append_feats(self, start: int, rows: torch.Tensor) -> None:
        have = 0 if self.feats is None else self.feats.shape[0]
        if start > have:
            return  # a gap: _fill_missing recomputes the features on the next propose
        rows = rows[have - start:].to(self.device, torch.float32)
        if not len(rows):
            return
        size = have + len(rows)
        if self._feats_buf is None or size > len(self._feats_buf):
            buf = rows.new_empty(max(2 * size, self.FEATS_MIN_ROWS), rows.shape[1])
            if have:
                buf[:have] = self.feats
            self._feats_buf = buf
        self._feats_buf[have:size] = rows
        self.feats = self._feats_buf[:size]

    def _take_prefill(self) -> None:
        """The prompt's features come free with the engine's prefill (Target.prefill_hidden)."""
        pf = getattr(self.target, "prefill_hidden", None) if self.target is not None else None
        if self.feats is None and pf is not None and len(pf) == self.prompt_len - 1:
            self._append_feats(0, self.select(pf))

    @torch.inference_mode()
    def _fill_missing(self, context: list[int]) -> None:
        """Features for positions 0..m-2 are needed; else run the target once over the context."""
        need = len(context) - 1
        self._take_prefill()
        have = 0 if self.feats is None else self.feats.shape[0]
        if have < need:  # no hidden states from the engine's target: compute them (draft-time cost)
            x = torch.tensor([context[:need]], device=self.device)
            out = self.target_model(input_ids=x, output_hidden_states=True)
            self.target_forwards += 1
            self.feats = self._feats_buf = layer_features(out.hidden_states, self.layers)[0].float()

    def observe(self, context, hidden: HiddenStates | None = None):
        if hidden is None:
            raise UserError("the eagle arm needs the target's hidden states: build the Target with "
                            "want_hidden=True (or pass it as ArmEnv.target so the arm can switch it on)")
        self._take_prefill()
        n = self.prev_len
        keep = max(0, min(len(hidden), len(context) - n + 1))
        if keep:
            self._append_feats(n - 1, self.select(hidden.rows(slice(0, keep))))
            self.target_hidden = hidden.final[keep - 1].float()  # Cali-TS's H_t^(T): the post-norm final state
        self.prev_len = len(context)

    # -- drafting -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _step(self, feats: torch.Tensor, next_tokens: list[int]) -> torch.Tensor:
        x = torch.tensor([next_tokens], device=self.device)
        pos = self.cache.positions(len(next_tokens))
        # the true features are kept in float32; the head runs in its own dtype (bfloat16 on a GPU, float64 in tests)
        pred = self.head(feats.unsqueeze(0).to(self.dtype), x, past_key_values=self.cache.hf, use_cache=True,
                         position_ids=pos)
        self.cache.advance(len(next_tokens))
        return pred[0, -1]

    def _true_step(self, context: list[int]) -> torch.Tensor:
        """Bring the head cache's true entries (those built from the target's own features) up to the
        context and return the predicted feature after it: the first step of every draft, chain or tree."""
        m = len(context)
        if self.after is not None and self.entries == m - 1 and self.tokens == context:
            self.cache.crop(self.entries)  # proposed from this context already (a counterfactual draft)
            return self.after
        self._fill_missing(context)
        # entries must sit on the committed text; a different history (new query) rebuilds them
        if self.tokens[:self.entries + 1] != context[:self.entries + 1]:
            self.entries = 0
        self.cache.crop(self.entries)
        f = self._step(self.head.input_features(self.feats[self.entries:m - 1]), context[self.entries + 1:m])
        self.entries = m - 1
        self.tokens = list(context)
        self.after = f
        return f

    def _start(self, context: list[int], max_len: int) -> tuple[int, torch.Tensor | None]:
        """(draft length, predicted feature after the context); the feature is None when nothing can be
        drafted. Every draft, chain or tree, starts here."""
        L = min(self.L, max_len)
        self.draft_hidden = []
        if L <= 0 or len(context) < 2:
            return L, None
        return L, self._true_step(context)

    @torch.inference_mode()
    def propose(self, context, max_len, keep_going=None) -> Draft:
        L, f = self._start(context, max_len)
        if f is None:
            return Draft.empty()
        tokens, dists = [], []
        for i in range(L):
            if i > 0:
                if keep_going is not None and not keep_going(i, dists[-1], hidden=self.draft_hidden[-1]):
                    break
                f = self._step(f.unsqueeze(0), [tokens[-1]])
            self.draft_hidden.append(f.float())
            # over the head's draft vocabulary, -inf elsewhere: q = 0 outside it (decode/core/vocab.py)
            tok, dist = choose_token(self.head.draft_logits(f).float(), self.sampling, self.generator)
            tokens.append(int(tok))
            dists.append(dist)
        self.cache.crop(self.entries)  # drop entries built from predicted features
        return Draft(torch.tensor(tokens), q=torch.stack(dists), hidden=torch.stack(self.draft_hidden))

    def calibration_features(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(H_t^(T) = the target's post-norm final state at the last verified position, the drafter's state
        behind draft token i) for a Cali-TS predictor; fused heads give their recurrent state h."""
        if self.target_hidden is None:  # first round: the prompt's last row
            pf = getattr(self.target, "prefill_hidden", None) if self.target is not None else None
            if pf is not None:
                self.target_hidden = pf.final[-1].float()
            elif not self.head.fused and self.feats is not None:  # EAGLE-1's features are that final state
                self.target_hidden = self.feats[-1]
        if self.target_hidden is None:
            raise UserError("Cali-TS needs the target's hidden states (Target(want_hidden=True))")
        return self.target_hidden, self.draft_hidden[i - 1]
