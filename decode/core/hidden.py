"""The target's hidden states as they travel from a forward to the arms and length controllers.

Layer ids index HF's ``hidden_states`` tuple: 0 = embeddings, i = output of layer i, and ``FINAL`` (-1) =
the post-norm final state (the LM head's input). Every forward that computes hidden states yields a
:class:`HiddenStates`: ``final`` always, and ``extra`` holding the other layers arms asked for
(``Target.request_hidden``; EAGLE-3 fuses low/mid/high layers) side by side — its own field, so nobody
slices "the first d columns" to find the final state. An arm reads its layers through the
:class:`LayerSelector` its request returned.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.errors import UserError

FINAL = -1  # a hidden-state layer id: the post-norm final hidden state (the LM head's input)


def check_hidden_layers(layers, n_layers: int, what: str) -> tuple[int, ...]:
    """Validated layer ids into HF's ``hidden_states`` (0 = embeddings, i = output of layer i, ``n_layers`` =
    the last layer's output before the final norm; ``FINAL`` = -1 the post-norm final state)."""
    layers = tuple(int(i) for i in layers)
    bad = [i for i in layers if not (i == FINAL or 0 <= i <= n_layers)]
    if not layers or bad:
        raise UserError(f"{what}: hidden-state layers must be -1 (post-norm final) or 0..{n_layers} (0 = embeddings, "
                        f"i = output of layer i) for this {n_layers}-layer target, got {list(layers)}")
    return layers


def layer_features(hidden_states, layers: tuple[int, ...]) -> torch.Tensor:
    """The requested entries of an HF ``hidden_states`` tuple side by side on the last dim ([..., d·len])."""
    if len(layers) == 1:
        return hidden_states[layers[0]]
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def find_run(have: tuple[int, ...], run: tuple[int, ...]) -> int | None:
    """Where ``run`` starts as consecutive entries of ``have`` (None: it does not)."""
    return next((k for k in range(len(have) - len(run) + 1) if have[k:k + len(run)] == run), None)


def layer_runs(layers: tuple[int, ...]) -> list[tuple[int, ...] | None]:
    """``layers`` cut at its FINAL entries: None for each FINAL, a tuple for each maximal run of other layers
    (the runs are what ``HiddenStates.extra`` must hold)."""
    out: list[tuple[int, ...] | None] = []
    cur: list[int] = []
    for i in layers:
        if i == FINAL:
            if cur:
                out.append(tuple(cur))
            out.append(None)
            cur = []
        else:
            cur.append(i)
    if cur:
        out.append(tuple(cur))
    return out


@dataclass
class HiddenStates:
    """Hidden states at n positions: ``final`` [n, d] the post-norm final state; ``extra``
    [n, d·len(extra_layers)] the requested other layers side by side (None when none were requested)."""
    final: torch.Tensor
    extra: torch.Tensor | None = None

    @classmethod
    def from_hf(cls, hidden_states, extra_layers: tuple[int, ...]) -> "HiddenStates":
        """From an HF forward's ``hidden_states`` (batch row 0)."""
        extra = layer_features(hidden_states, extra_layers)[0] if extra_layers else None
        return cls(hidden_states[FINAL][0], extra)

    def __len__(self) -> int:
        return self.final.shape[0]

    def cat(self, more: "HiddenStates") -> "HiddenStates":
        """These positions followed by ``more``'s (the same layers)."""
        return HiddenStates.concat([self, more])

    @staticmethod
    def concat(parts: list["HiddenStates"]) -> "HiddenStates":
        """The positions of ``parts`` (the same layers), in order."""
        return HiddenStates(torch.cat([p.final for p in parts]),
                            None if parts[0].extra is None else torch.cat([p.extra for p in parts]))

    def rows(self, index) -> "HiddenStates":
        """The states at the positions ``index`` selects (a slice or a list of row numbers)."""
        return HiddenStates(self.final[index], None if self.extra is None else self.extra[index])


class LayerSelector:
    """Reads the rows of ``layers`` (in that order, side by side) out of :class:`HiddenStates` whose ``extra``
    holds ``extra_layers``: ``FINAL`` comes from ``final``, every other layer from its d columns of ``extra``
    (consecutive layers are read as one slice)."""

    def __init__(self, layers: tuple[int, ...], extra_layers: tuple[int, ...], hidden_size: int):
        self.layers = tuple(layers)
        self.parts: list[slice | None] = []  # None = ``final``; a slice = columns of ``extra``
        d = hidden_size
        for run in layer_runs(self.layers):
            if run is None:
                self.parts.append(None)
                continue
            start = find_run(extra_layers, run)
            if start is None:
                raise ValueError(f"layers {list(run)} are not a run of the extra layers {list(extra_layers)}")
            self.parts.append(slice(start * d, (start + len(run)) * d))
        self.needs_extra = any(p is not None for p in self.parts)

    def __call__(self, hidden: HiddenStates) -> torch.Tensor:
        if self.needs_extra and hidden.extra is None:
            raise UserError(f"hidden states for layers {list(self.layers)} were not computed: the target was not "
                            "asked for them (Target.request_hidden)")
        cols = [hidden.final if p is None else hidden.extra[:, p] for p in self.parts]
        return cols[0] if len(cols) == 1 else torch.cat(cols, dim=-1)
