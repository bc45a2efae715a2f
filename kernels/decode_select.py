"""The decode modes' block choice and table compaction as one Triton kernel (one program per request).

An anchor layer's choice (``sglang_hs.decode_modes``) written as ~50 small PyTorch ops costs 150-290 us
a layer at batch 8 (32K-128K tokens) on an H100, mostly launch gaps inside the CUDA graph: more than
the compacted layers save. This kernel does the same work in one launch: per request it pools the
anchor's per-block LSE into each compressed block's attention mass (each query head normalised over the
request's compressed blocks, then summed), sorts the masses, keeps the top ``topk`` (``kascade``) or the
fewest whose share reaches ``tau`` (``psa``, at most ``topk``), ties to the lower block, and writes the
compacted block table and lengths. ``sglang_hs.decode_modes.BlockSelection.choose`` + ``compact`` is the
oracle (``tests/test_decode_modes.py``).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _select_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def select_kernel(block_lse, lse_row_stride, lse_head_stride, table, table_stride, seq_lens, out_table, out_lens,
                      counts, width, tau, HQ: tl.constexpr, BLOCK: tl.constexpr, WP: tl.constexpr,
                      TOPK: tl.constexpr, PSA: tl.constexpr):  # fmt: skip
        r = tl.program_id(0)
        cols = tl.arange(0, WP)
        in_table = cols < width
        seq = tl.load(seq_lens + r).to(tl.int32)
        blocks = (seq + BLOCK - 1) // BLOCK
        entry = tl.load(table + r * table_stride + cols, mask=in_table, other=0)
        in_range = cols < blocks
        cand = (entry < 0) & in_range & (cols != blocks - 1)
        mass = tl.zeros([WP], dtype=tl.float32)
        for h in range(HQ):  # each query head's mass over the request's compressed blocks, summed
            x = tl.load(block_lse + r * lse_row_stride + h * lse_head_stride + cols, mask=cand, other=float("-inf"))
            top = tl.max(x, axis=0)
            e = tl.exp(x - tl.where(top == float("-inf"), 0.0, top))
            mass += e / tl.maximum(tl.sum(e, axis=0), 1e-30)
        ranked = tl.where(cand, mass, -1.0)
        ordered = tl.sort(ranked, descending=True)
        n_cand = tl.sum(cand.to(tl.int32), axis=0)
        if PSA:  # the fewest blocks, in decreasing mass, whose share reaches tau (at most TOPK)
            share = tl.maximum(ordered, 0.0) / tl.maximum(tl.sum(mass, axis=0), 1e-30)
            before = tl.cumsum(share, axis=0) - share
            n_take = tl.sum(((before < tau - 1e-6) & (share > 0) & (cols < TOPK)).to(tl.int32), axis=0)
        else:
            n_take = tl.minimum(n_cand, TOPK)
        # The n_take-th largest mass is the threshold; blocks tied with it are taken from the lowest.
        threshold = tl.sum(tl.where(cols == n_take - 1, ordered, 0.0), axis=0)
        above = cand & (ranked > threshold)
        tied = cand & (ranked == threshold)
        allowed = n_take - tl.sum(above.to(tl.int32), axis=0)
        chosen = (above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= allowed))) & (n_take > 0)
        keep = in_range & ((~cand) | chosen)
        kept = tl.sum(keep.to(tl.int32), axis=0)
        place = tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(out_table + r * table_stride + place, entry, mask=keep)
        tl.store(out_table + r * table_stride + cols, tl.zeros_like(entry), mask=in_table & (cols >= kept))
        tl.store(out_lens + r, tl.where(kept > 0, seq - (blocks - kept) * BLOCK, 0))
        tl.atomic_add(counts, tl.sum(chosen.to(tl.int64), axis=0))
        tl.atomic_add(counts + 1, n_cand.to(tl.int64))

    return select_kernel


def select_blocks(block_lse: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                  topk: int, tau: float | None, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(table [bs, W] int32, seq_lens [bs] int32)``: the compacted block table of the blocks each request
    keeps, from an anchor layer's ``block_lse [bs, Hq, >= W]`` (fp32, last dim contiguous) over
    ``block_table [bs, W]`` (int32, ``< 0`` compressed) and ``seq_lens [bs]``; ``tau`` None: top
    ``topk`` (kascade), else PSA's budget. Adds the compressed blocks kept and offered to ``counts``
    (int64 ``[2]``). One launch, no host synchronisation (CUDA-graph capturable)."""
    import triton

    bs, width = block_table.shape
    table = torch.empty_like(block_table)
    lengths = torch.empty(bs, dtype=torch.int32, device=block_table.device)
    if bs == 0:
        return table, lengths
    wp = triton.next_power_of_2(width)
    _select_kernel()[(bs,)](
        block_lse, block_lse.stride(0), block_lse.stride(1), block_table, block_table.stride(0), seq_lens, table,
        lengths, counts, width, float(tau or 0.0), HQ=block_lse.shape[1], BLOCK=block_size, WP=wp, TOPK=topk,
        PSA=tau is not None, num_warps=8 if wp >= 2048 else 4,
    )  # fmt: skip
    return table, lengths
