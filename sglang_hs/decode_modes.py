"""Decode modes that read only some of a request's compressed blocks (``--hierasparse-decode-mode``).

Both modes follow Kascade's structure: on a few *anchor* layers (layer 0 always among them) decode reads
every block, and the decode kernel also returns each block's own log-sum-exp per query head; from those
exact attention masses each request chooses the compressed blocks that the layers up to the next anchor
read. Only a request's compressed (virtual) blocks are candidates: its SGLang pages (the prefix's sink
and window, the request's own tokens) are always read.

- ``kascade``: the ``topk`` candidates with the most attention mass, pooled over the query heads
  (each head's mass normalised over the candidates, then summed: one choice for all heads, so a choice
  is a shorter block table that the unchanged decode kernel reads).
- ``psa``: PSA's adaptive budget over the same pooled mass: the fewest candidates whose share of it
  reaches ``tau``, at most ``topk`` of them.

Why exact masses on anchors and not a per-block key summary: on SmolLM2 a Quest bound from each block's
channel-wise key min/max chose blocks that halved retrieval (top 8: 0.363 against 0.476 for exact
masses; a 0.9 mass budget from the bounds: 0.185), while the pooled exact top 8 on 8 placed anchors kept
it (0.506 against 0.470 reading every block; ``docs/quality.md``). The CPU references of both rules
are ``sglang_hs.reference.select_topk`` / ``select_mass`` on ``exact_block_mass`` pooled over heads.

A choice is applied by *compacting* the block table: the kept blocks move to the front in their order
and the length shrinks by the skipped blocks' tokens (every block but a request's last is full, and K
is stored after RoPE, so a block's place in the table does not matter). Everything here is fixed-shape
tensor work without host synchronisation, so it runs inside CUDA graphs; on a GPU one Triton kernel
does the choice and the compaction together (``sglang_hs.kernels.decode_select``: the ~50 small ops
here cost more than the layers between anchors save).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("full", "kascade", "psa")


def parse_anchors(text: str, num_layers: int | None) -> tuple[int, ...]:
    """Anchor layers from ``--hierasparse-decode-anchors`` (a comma list, or empty: every 4th layer from
    0). ValueError with one line when a layer is repeated, unsorted, 0 is missing or (given the model's
    ``num_layers``) a layer is out of range."""
    if not text:
        return tuple(range(0, num_layers or 1, 4))
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        layers = ()
    bound = f", below the model's {num_layers} layers" if num_layers is not None else ""
    if (not layers or layers[0] != 0 or list(layers) != sorted(set(layers))
            or (num_layers is not None and layers[-1] >= num_layers)):  # fmt: skip
        raise ValueError(f"hierasparse: --hierasparse-decode-anchors={text!r} is invalid; allowed: increasing "
                         f"layer numbers from 0{bound}, e.g. 0,3,11,14")
    return layers


@dataclass(frozen=True)
class BlockSelection:
    """A decode mode's rule: which layers measure (``anchors``) and how requests choose blocks."""

    mode: str  # "kascade" or "psa"
    anchors: frozenset[int]
    topk: int
    tau: float = 1.0

    @classmethod
    def from_config(cls, config, num_layers: int) -> "BlockSelection | None":
        """The rule of the settings (None for ``full``)."""
        if config.decode_mode == "full":
            return None
        return cls(config.decode_mode, frozenset(parse_anchors(config.decode_anchors, num_layers)),
                   config.decode_topk, config.decode_tau)  # fmt: skip

    def is_anchor(self, layer: int) -> bool:
        return layer in self.anchors

    def apply(self, block_lse: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
              counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The compacted ``(block_table, seq_lens)`` (int32) the layers up to the next anchor read, and the
        compressed blocks kept and offered added to ``counts`` (int64 ``[2]``). On a GPU one Triton
        launch (``sglang_hs.kernels.decode_select``), elsewhere :meth:`choose` and :func:`compact`."""
        if block_table.is_cuda:
            from sglang_hs.kernels.decode_select import select_blocks

            tau = self.tau if self.mode == "psa" else None
            return select_blocks(block_lse, block_table, seq_lens, block_size, self.topk, tau, counts)
        keep, kept_offered = self.choose(block_lse, block_table, seq_lens, block_size)
        counts += kept_offered.to(counts.device)
        return compact(block_table, seq_lens, keep, block_size)

    def choose(self, block_lse: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(keep, counts)``: bool ``keep [bs, W]``, the blocks each request reads until the next anchor,
        from an anchor layer's per-block natural-log LSE ``block_lse [bs, Hq, >= W]`` over ``block_table
        [bs, W]`` (``< 0``: compressed block) and int ``seq_lens [bs]``; int64 ``counts [2]``, the
        compressed blocks kept and all of them (the batch log line's share)."""
        width = block_table.shape[1]
        in_range, last = request_blocks(seq_lens, width, block_size)
        candidates = (block_table < 0) & in_range & ~last
        mass = pooled_mass(block_lse[..., :width], candidates)
        chosen = top_mass(mass, candidates, self.topk, self.tau if self.mode == "psa" else None)
        counts = torch.stack([chosen.sum(), candidates.sum()])
        return (in_range & ~candidates) | chosen, counts


def request_blocks(seq_lens: torch.Tensor, width: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bool ``[bs, W]`` masks of each request's blocks and of its last block."""
    blocks = (seq_lens.long() + block_size - 1) // block_size
    cols = torch.arange(width, device=seq_lens.device)[None, :]
    return cols < blocks[:, None], cols == (blocks[:, None] - 1)


def pooled_mass(block_lse: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """float ``[bs, W]``: each candidate block's attention mass, normalised per query head over the
    request's candidates and summed over the heads (0 elsewhere; ``block_lse [bs, Hq, W]``)."""
    logits = block_lse.float().masked_fill(~candidates[:, None, :], -torch.inf)
    total = torch.logsumexp(logits, dim=-1, keepdim=True)
    share = torch.exp(logits - total.clamp_min(torch.finfo(torch.float32).min))
    return torch.nan_to_num(share, nan=0.0).sum(1) * candidates


def top_mass(mass: torch.Tensor, candidates: torch.Tensor, k: int, tau: float | None = None) -> torch.Tensor:
    """bool ``[bs, W]``: each request's ``k`` candidates of most mass (all of them if fewer); with ``tau``
    (PSA's budget) only the fewest of those, in decreasing mass, whose share of all the candidates'
    mass reaches ``tau``. One ``topk`` per call, no full sort (blocks of equal mass: either may be kept)."""
    masked = torch.where(candidates, mass, -torch.inf)
    top, cols = masked.topk(min(k, mass.shape[1]), dim=-1)  # sorted, largest first
    take = top > -torch.inf
    if tau is not None:
        share = top.clamp_min(0) / mass.sum(-1, keepdim=True).clamp_min(1e-30)
        before = share.cumsum(-1) - share  # share taken before each block
        take &= (before < tau - 1e-6) & (share > 0)
    return torch.zeros_like(candidates).scatter_(1, cols, take)


def compact(block_table: torch.Tensor, seq_lens: torch.Tensor, keep: torch.Tensor,
            block_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(table [bs, W] int32, seq_lens [bs] int32)``: each request's kept blocks moved to the front in
    their order, and its length less the skipped blocks' tokens (a request's last block must be kept:
    it is the only one that may be partial). Columns past the kept ones are left 0 (never read)."""
    bs, width = block_table.shape
    place = torch.where(keep, keep.long().cumsum(1) - 1, width)
    table = torch.zeros(bs, width + 1, dtype=block_table.dtype, device=block_table.device)
    table.scatter_(1, place, block_table)
    kept = keep.sum(1)
    blocks = (seq_lens.long() + block_size - 1) // block_size
    lengths = torch.where(kept > 0, seq_lens.long() - (blocks - kept) * block_size, 0)
    return table[:, :width].contiguous(), lengths.to(torch.int32)
