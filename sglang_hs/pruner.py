"""Pruners: which elements of a block survive 2:4 pruning, and which blocks are stored sparse.

A pruner takes the K or V blocks of a sequence, ``[H, n_blocks, B, D]`` (H = KV heads), and returns
an element mask (2 of every 4 along the operand's reduction axis, see :mod:`sglang_hs.format`) and a
block mask. Blocks are ranked per head by the L1 magnitude pruning would remove (the paper's
``L_i = ||X_i ⊙ (1 - m_i)||_1``); the ``ceil(S·n)`` prunable blocks that lose least become sparse.
Blocks outside ``prunable`` (sink, local window, partial blocks) are never sparse.

Any ranking rule can be plugged in by subclassing :class:`Pruner` and adding it to ``PRUNERS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch

from sglang_hs.format import GROUP, KEEP, sparse_count

Operand = Literal["k", "v"]


@dataclass
class PruneResult:
    keep: torch.Tensor
    """bool ``[H, n, B, D]``: the elements a sparse block keeps (computed for every block)."""
    sparse: torch.Tensor
    """bool ``[H, n]``: blocks stored 2:4 sparse."""
    loss: torch.Tensor
    """float32 ``[H, n]``: L1 magnitude each block would lose if stored sparse."""


def group_axis(operand: Operand) -> int:
    """Axis of a ``[..., B, D]`` block along which 2:4 groups run: head_dim for K, tokens for V."""
    return -1 if operand == "k" else -2


def top2_of_4(score: torch.Tensor, axis: int) -> torch.Tensor:
    """Keep the two largest scores of every 4 consecutive entries along ``axis``.

    Ties go to the lower index, so the kernels' compare network and this reference agree bit for bit.
    """
    moved = score.movedim(axis, -1)
    groups = moved.reshape(*moved.shape[:-1], moved.shape[-1] // GROUP, GROUP)
    a = groups.unsqueeze(-1)  # element i
    b = groups.unsqueeze(-2)  # element j
    index = torch.arange(GROUP, device=score.device)
    lower = index.unsqueeze(0) < index.unsqueeze(1)  # [i, j]: j < i
    beats = (b > a) | ((b == a) & lower)  # j outranks i
    keep = beats.sum(-1) < KEEP
    return keep.reshape(moved.shape).movedim(-1, axis)


def rank_sparse(loss: torch.Tensor, prunable: torch.Tensor, sparsity: float) -> torch.Tensor:
    """bool mask like ``loss [..., n]``: per row, the ``ceil(S·n_prunable)`` prunable blocks that
    lose least (stable: ties go to the earlier block). Other blocks are never chosen."""
    n_sparse = sparse_count(int(prunable.sum()), sparsity)
    ranked = torch.where(prunable, loss, torch.inf).argsort(dim=-1, stable=True)
    sparse = torch.zeros(loss.shape, dtype=torch.bool, device=loss.device)
    return sparse.scatter_(-1, ranked[..., :n_sparse], True)


class Pruner(ABC):
    """Element masks plus block ranking; subclasses choose the element scores."""

    name: str

    @abstractmethod
    def element_scores(self, blocks: torch.Tensor, operand: Operand) -> torch.Tensor:
        """Importance of every element (same shape as ``blocks``); the top 2 of 4 survive."""

    def element_mask(self, blocks: torch.Tensor, operand: Operand) -> torch.Tensor:
        """bool like ``blocks``: the elements a sparse block keeps."""
        return top2_of_4(self.element_scores(blocks, operand), group_axis(operand))

    @staticmethod
    def block_loss(blocks: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., n]``: the L1 magnitude each ``[B, D]`` block loses when pruned."""
        return (blocks.float().abs() * ~keep).sum(dim=(-1, -2))

    def operand_loss(self, blocks: torch.Tensor, operand: Operand, keep: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., n]``: the ranking key of each block (here its L1 loss, ``block_loss``)."""
        return self.block_loss(blocks, keep)

    def __call__(
        self,
        blocks: torch.Tensor,
        operand: Operand,
        sparsity: float,
        prunable: torch.Tensor | None = None,
    ) -> PruneResult:
        """Masks and per-head ranking for ``[H, n, B, D]`` blocks."""
        keep = self.element_mask(blocks, operand)
        loss = self.operand_loss(blocks, operand, keep)
        if prunable is None:
            prunable = torch.ones(blocks.shape[1], dtype=torch.bool, device=blocks.device)
        return PruneResult(keep=keep, sparse=rank_sparse(loss, prunable, sparsity), loss=loss)


class MagnitudePruner(Pruner):
    """The paper's default (eq. 2): keep the largest |x| of each group of 4."""

    name = "magnitude"

    def element_scores(self, blocks: torch.Tensor, operand: Operand) -> torch.Tensor:
        return blocks.float().abs()


PRUNERS: dict[str, type[Pruner]] = {
    MagnitudePruner.name: MagnitudePruner,
}


def make_pruner(name: str) -> Pruner:
    return PRUNERS[name]()


def prunable_mask(
    num_blocks: int,
    seq_len: int,
    block_size: int,
    sink_tokens: int,
    window_tokens: int,
    first_block: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """bool ``[num_blocks]``: blocks ``first_block + i`` that lie wholly between the sink and the
    local window of a sequence of ``seq_len`` tokens, and so may be stored sparse."""
    start = (torch.arange(num_blocks, device=device) + first_block) * block_size
    return (start >= sink_tokens) & (start + block_size <= seq_len - window_tokens)
