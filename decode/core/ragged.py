"""Ragged blocks: a batched forward that runs the target's row-wise layers on the block's real slots only.

A batched round's block is ``[B, W]``: every row padded to the widest row's draft. Run as it is, every linear layer
(the projections, the MLP, the LM head: nearly all of a forward's work) computes the padding too, so at 16 rows a
round in which four rows draft two tokens each ran 48 positions through the linears for 24 real ones. Measured on
the AMX Xeon (2 threads, default target, forwards of n one-position rows): 16 rows 103 ms, 24 rows 102–108, 32 rows
115–119, 48 rows 137–158 — a few rows drafting cost nearly nothing if the padding is not computed.

So the block is fed ragged: ``[1, N]`` tokens (its N real slots, row-major, :meth:`RaggedBlock.gather`) with their
own positions, and only what is not row-wise sees the padded shape. Two places of our own do that while a
:func:`running` context is active:

* the row cache's layers (:class:`~decode.core.target.PrefixLayer`) write the N keys and values into each row's
  slots of the block (:meth:`RaggedBlock.write`): the cache keeps its ``[B, heads, slots, dim]`` layout, and the
  block's padding slots stay invisible, as they always were (``RowCache.attention``);
* the attention (:func:`~decode.core.attention.gqa_sdpa_attention`) scatters the queries to ``[B, heads, W, dim]``
  (:meth:`RaggedBlock.scatter_heads`), attends under the block's mask as before, and gathers the outputs back.

Everything else (embedding, rotary at the slots' positions, norms, projections, MLP, LM head) is row-wise and runs
on the N rows as it would on B × W. A real slot's logits are those of the padded forward up to float summation
order (another matrix shape, as between any two batch sizes); the tests check equality in float64 and greedy
losslessness. Needs our attention (the target's run model on a CPU with grouped key/value heads:
:func:`~decode.core.attention.gqa_attention_model`); elsewhere the engine feeds the padded block.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

import torch

_ACTIVE: ContextVar["RaggedBlock | None"] = ContextVar("adaspec_ragged_block", default=None)


@dataclass(frozen=True)
class RaggedBlock:
    """Where the N real slots of a ``[B, W]`` block sit: row ``rows[i]``, block slot ``cols[i]`` (row-major)."""

    rows: torch.Tensor  # [N] long
    cols: torch.Tensor  # [N] long
    B: int
    W: int

    @classmethod
    def of(cls, block_valid: torch.Tensor) -> "RaggedBlock":
        rows, cols = block_valid.nonzero(as_tuple=True)
        return cls(rows, cols, *block_valid.shape)

    @classmethod
    def of_padded(cls, block_valid: torch.Tensor) -> "RaggedBlock | None":
        """The block's real slots where it has padding; None where every row fills it (fed as it is)."""
        return None if bool(block_valid.all()) else cls.of(block_valid)

    @property
    def n(self) -> int:
        return int(self.rows.numel())

    def to(self, device) -> "RaggedBlock":
        return RaggedBlock(self.rows.to(device), self.cols.to(device), self.B, self.W)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, W, ...]`` → its real slots ``[1, N, ...]``."""
        return x[self.rows, self.cols][None]

    def scatter(self, x: torch.Tensor, fill: bool = True) -> torch.Tensor:
        """Ragged ``[1, N, ...]`` → ``[B, W, ...]``, padding slots zero (``fill=False``: left unset, for outputs
        whose padding nobody reads, e.g. the logits)."""
        make = x.new_zeros if fill else x.new_empty
        out = make(self.B, self.W, *x.shape[2:])
        out[self.rows, self.cols] = x[0]
        return out

    def scatter_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Ragged per-head states ``[1, heads, N, dim]`` → ``[B, heads, W, dim]`` (padding zero)."""
        return self.scatter(x.transpose(1, 2)).transpose(1, 2)

    def write(self, cache: torch.Tensor, start: int, x: torch.Tensor) -> None:
        """Write ragged keys or values ``x`` ``[1, heads, N, dim]`` into block slots ``start``.. of a row cache's
        layer ``cache`` ``[B, heads, slots, dim]`` (each slot at its row and its block column)."""
        cache[self.rows, :, start + self.cols] = x[0].transpose(0, 1)


def active() -> RaggedBlock | None:
    """The block of the forward running now (None: the block is fed padded, as every other forward is)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def running(block: RaggedBlock | None):
    """Within: the row cache's layers and our attention read the forward as ``block``'s real slots (None: as the
    padded block it is)."""
    token = _ACTIVE.set(block)
    try:
        yield block
    finally:
        _ACTIVE.reset(token)


class ScatteredStates:
    """An HF ``hidden_states`` tuple of a ragged forward, read as the padded forward's: each entry scattered to
    ``[B, W, d]`` when read (an EAGLE head reads a few of ~30), once."""

    def __init__(self, states: tuple[torch.Tensor, ...], block: RaggedBlock):
        self._states, self._block = states, block
        self._done: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, i: int) -> torch.Tensor:
        i = i % len(self._states)
        if i not in self._done:
            self._done[i] = self._block.scatter(self._states[i])
        return self._done[i]
