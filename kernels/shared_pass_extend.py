"""Shared-prefix decode's shared pass (:mod:`.decode_shared`) on the extend kernel's n32 tile.

The n32 tile is the n64 tile's schedule (asynchronous GEMMs under the softmax, the lazy softmax
offset) at 32 query columns a CTA. A column set of ``32 // G`` requests is one extend "request" of
one query token whose ``Hkv * fold * G`` query heads are the folded queries
(:meth:`~sglang_hs.kernels.decode_shared.SharedPrefixDecode.fold_queries` layout: the extend kernel
maps column ``c`` of KV head ``h`` to query head ``h * fold * G + c``), over the set's shared blocks:
a token at the last position of ``seq_len`` keys sees all of them, so no mask applies. Each set's
split count is read on the GPU (the kernel's ``dynamic_splits``); an empty set gets 0, its CTAs exit
at once and its output rows are never written (nor merged).

Why this tile (it replaced a shared pass on the decode kernel, then the n64 tile) and the rules'
measurements: ``docs/kernels.md``, "Shared-prefix decode: the plan's rules".
"""

from __future__ import annotations

import torch

from sglang_hs.format import BlockPools
from sglang_hs.kernels.common import ANY_FORMS, SMEM_PER_SM
from sglang_hs.kernels.extend_common import NARROW_TILES

SHARED_TILE = "n32"
"""The shared pass's tile (the n64 schedule at 32 columns, ``extend_common.NARROW_TILES``)."""
SHARED_COLUMNS = NARROW_TILES[SHARED_TILE][0]
"""Query columns of a shared-pass CTA: ``32 // G`` requests a column set (8 at G = 4)."""
SHARED_REGISTER_CTAS = 3
"""CTAs of the shared pass an SM's registers hold: ptxas gives its kernel (128 threads, d 128, 2:4 K
and V) 156 registers a thread (the n64 tile: 246, two CTAs), so shared memory, which would fit more
with one form an operand, does not decide."""


def ctas_per_sm(head_dim: int, block_size: int, forms: tuple[str, str]) -> int:
    """CTAs of the shared pass an SM holds: by shared memory, at most :data:`SHARED_REGISTER_CTAS`."""
    from sglang_hs.kernels.extend import default_stages, smem_bytes

    per_cta = smem_bytes(SHARED_TILE, head_dim, block_size, default_stages(SHARED_TILE), forms[0] != "dense",
                         forms) + 1024  # fmt: skip
    return max(1, min(SMEM_PER_SM // per_cta, SHARED_REGISTER_CTAS))


SPLIT_WAVE_CTAS = 2
"""CTAs an SM that :meth:`ExtendSharedPass.rule_splits` fills in one wave, though three fit: with five
or more live sets a wave of three an SM was slower on an H100. An H200 may prefer three (at the
benchmark shape 8 splits beat 4 there); the rule is tuned for the H100 and not yet timed on an H200."""

SHARED_SPLITS = 8
"""The grid's splits per (set row, KV head), and the most a set uses: each step's live sets use
:meth:`ExtendSharedPass.rule_splits` of them, read on the GPU (the host does not know how many of a
step's set rows are live); a plan of many set rows gets fewer (``SharedPrefixDecode`` keeps the scratch
within ``SHARED_MAX_PARTS`` partials). 11 and 16 splits were up to 60 us a call slower than 8, or
within 4 us of it: a wave left part empty is the own pass's room beside it."""


class ExtendSharedPass:
    """The shared pass with ``HieraSparseDecode.run``'s signature, on the extend kernel's n32 tile
    (:data:`SHARED_TILE`).

    ``max_sets`` set rows of ``heads = Hkv * fold * G`` folded query heads; the scratch for all of them
    at ``num_splits`` is allocated here, before any CUDA graph captures the plan. ``forms``: the block
    forms of the shared blocks (the plan's; 2:4 K and V only at S_K = S_V = 1 or dense K and 2:4 V at
    S_K = 0: the stages are small enough for three CTAs an SM, :data:`SHARED_REGISTER_CTAS`; with every
    form, one)."""

    def __init__(self, max_sets: int, heads: int, kv_heads: int, head_dim: int, block_size: int, max_blocks: int,
                 dtype: torch.dtype, device, num_splits: int = SHARED_SPLITS,
                 forms: tuple[str, str] = ANY_FORMS):  # fmt: skip
        from sglang_hs.kernels.extend import HieraSparseExtend

        self.extend = HieraSparseExtend(heads, kv_heads, head_dim, block_size, max_blocks, dtype, device, tile=SHARED_TILE,
                                        num_splits=num_splits, forms=forms, dynamic_splits=True)  # fmt: skip
        self.extend.reserve(max_sets, max_sets, num_splits, SHARED_TILE)
        self.num_splits, self.kv_heads = num_splits, kv_heads
        self.ctas_per_sm = ctas_per_sm(head_dim, block_size, forms)
        self.indptr = torch.arange(max_sets + 1, dtype=torch.int32, device=device)  # one query token a set
        self.batch_size = max_sets
        self.captured = False

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pools: BlockPools,
            k_index: torch.Tensor, v_index: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
            sm_scale: float, out: torch.Tensor | None = None, return_lse: bool = False,
            split_limit: torch.Tensor | None = None):  # fmt: skip
        """``q [sets, heads, D]`` (folded), ``block_table [sets, W]`` (shared blocks), ``seq_lens [sets]``
        (shared tokens, 0 for an empty set); ``split_limit [sets]``: each set's splits, at most the
        plan's ``num_splits`` and 0 for an empty set (the step tables' ``shared_splits``); if None, all
        of them for every set with tokens."""
        sets = q.shape[0]
        if sets > self.batch_size:
            raise ValueError(f"{sets} set rows > the plan's {self.batch_size}")
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self.captured = True
        if split_limit is None:  # an empty set (limit 0) is skipped; its rows of out are never merged
            split_limit = torch.where(seq_lens > 0, self.num_splits, 0).to(torch.int32)
        return self.extend.run(q, self.indptr[: sets + 1], k_cache, v_cache, pools, k_index, v_index, block_table,
                               seq_lens, sm_scale, out=out, return_lse=return_lse, split_limit=split_limit)  # fmt: skip

    def rule_splits(self, sets: int, num_sms: int) -> int:
        """Splits per live set at ``sets`` live sets: the most that keep every CTA in one wave (the pass
        is bound by each SM's block steps, so a second wave only adds a tail), at most the grid's."""
        wave = num_sms * min(self.ctas_per_sm, SPLIT_WAVE_CTAS)
        return max(1, min(self.num_splits, wave // max(1, sets * self.kv_heads)))
