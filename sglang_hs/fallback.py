"""The serving fallback: attention over the mixed block table in PyTorch, for the batches the TileLang
kernels do not serve (kernels turned off, no TileLang, no Hopper GPU).

Compressed blocks are decompressed with vectorized gathers, then ``scaled_dot_product_attention``
runs over each request's dense K/V. Mathematically this is the oracle's function
(``sglang_hs.reference.paged_attention``: attention over the pruned K/V) and the tests check it
against the oracle; it trades the oracle's per-block Trans-Both loop for speed.
"""

from __future__ import annotations

import torch

from sglang_hs.format import BlockPools, decompress_blocks


def dense_view(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pools: BlockPools,
    k_index: torch.Tensor,
    v_index: torch.Tensor,
    block_row: torch.Tensor,
    seq_len: int,
    block_size: int,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's ``[seq_len, H, D]`` K and V in ``dtype`` (default: the cache's), compressed blocks
    decompressed, FP8 pages and blocks scaled back; no host syncs.

    ``block_row`` is the request's block-table row: ``e >= 0`` is SGLang KV page ``e`` of the layer's
    ``k_cache``/``v_cache`` ``[slots, H, D]``; ``e < 0`` is compressed block ``~e``, resolved per KV
    head through the index maps ``k_index``/``v_index`` ``[H, n_compressed]`` into ``pools``.
    """
    width = -(-seq_len // block_size)
    k, v, _ = batch_pages(k_cache, v_cache, pools, k_index, v_index, block_row[None, :width], None, width, block_size,
                          dtype or k_cache.dtype)  # fmt: skip
    return k[:seq_len], v[:seq_len]


def decompressed_paged_attention(
    q: torch.Tensor,
    qo_indptr: list[int],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pools: BlockPools,
    k_index: torch.Tensor,
    v_index: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: list[int],
    block_size: int,
    sm_scale: float,
    return_block_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batched causal attention in the serving layout: request ``r`` owns queries
    ``q[qo_indptr[r]:qo_indptr[r+1]]``, the last positions of its ``seq_lens[r]`` tokens (decode is
    one query per request). Returns the outputs ``[total, Hq, D]``; with ``return_block_lse`` (decode
    only) also each block's own natural-log LSE per query head, float32 ``[bs, Hq, W]`` (``-inf`` past a
    request's blocks): what the decode kernel returns for the decode modes' anchor layers."""
    out = torch.empty_like(q)
    width = block_table.shape[1]
    block_lse = torch.full((len(seq_lens), q.shape[1], width), -torch.inf, device=q.device) if return_block_lse else None
    for r, seq_len in enumerate(seq_lens):
        rows = slice(qo_indptr[r], qo_indptr[r + 1])
        n_q = rows.stop - rows.start
        k, v = dense_view(k_cache, v_cache, pools, k_index, v_index, block_table[r], seq_len, block_size, q.dtype)
        mask = None
        if n_q > 1:
            mask = torch.arange(seq_len, device=q.device)[None, :] <= (seq_len - n_q + torch.arange(n_q, device=q.device))[:, None]
        attended = torch.nn.functional.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=sm_scale, enable_gqa=True
        )
        out[rows] = attended.transpose(0, 1)
        if block_lse is not None:
            if n_q != 1:
                raise ValueError("return_block_lse is for decode batches (one query per request)")
            blocks = -(-seq_len // block_size)
            block_lse[r, :, :blocks] = block_logsumexp(q[rows][0], k, block_size, sm_scale)
    return out if block_lse is None else (out, block_lse)


def block_logsumexp(q: torch.Tensor, k: torch.Tensor, block_size: int, sm_scale: float) -> torch.Tensor:
    """float32 ``[Hq, ceil(T / B)]``: the log-sum-exp of ``sm_scale * q . k`` over each block of ``k
    [T, H, D]`` on its own, per query head of ``q [Hq, D]`` (a KV head's query heads consecutive)."""
    heads = k.shape[1]
    logits = sm_scale * torch.einsum("hgd,thd->hgt", q.float().unflatten(0, (heads, -1)), k.float()).flatten(0, 1)
    pad = -logits.shape[-1] % block_size
    logits = torch.nn.functional.pad(logits, (0, pad), value=-torch.inf)
    return torch.logsumexp(logits.unflatten(-1, (-1, block_size)), dim=-1)


def batch_pages(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pools: BlockPools,
    k_index: torch.Tensor,
    v_index: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor | None,
    width: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """16-bit copies of a batch's blocks as cache pages, for the extend kernel over FP8 KV (an FP8 store,
    FP8 pages): ``(k_pages, v_pages, table)``, ``[bs * width * B, H, D]`` each in ``dtype`` and the int32
    block table ``[bs, width]`` that reads them (request ``r``'s block ``j`` is page ``r * width + j``).

    Blocks are copied whole (FP8 scaled back, 2:4 rows unpacked with zeros where pruned), so attention
    over the copies equals attention over the batch's blocks; entries past a request's ``seq_lens``
    (``[bs]``, on the table's device; None: every one of the first ``width`` columns is a block) and columns
    from ``width`` on are not read. Vectorized, no host synchronisation (:func:`dense_view` is one request of it)."""
    bs, heads, dim = block_table.shape[0], k_cache.shape[1], k_cache.shape[2]
    table = block_table[:, :width].long()
    if seq_lens is not None:
        columns = torch.arange(width, device=block_table.device)
        read = columns[None, :] < (seq_lens.to(block_table.device)[:, None] + block_size - 1) // block_size
        table = torch.where(read, table, 0)
    compressed = (table < 0)[..., None, None, None]
    pages = table.clamp(min=0)
    virtual = (-table - 1).clamp(min=0).flatten()

    def operand(cache: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
        from_cache = cache.reshape(-1, block_size, heads, dim)[pages].to(dtype)  # [bs, W, B, H, D]; FP8: unit scale
        if not index.numel():
            return from_cache.reshape(-1, heads, dim)
        from_store = decompress_blocks(pools, index[:, virtual], name, dtype)  # [H, bs * W, B, D]
        from_store = from_store.permute(1, 2, 0, 3).reshape(bs, width, block_size, heads, dim)
        return torch.where(compressed, from_store, from_cache).reshape(-1, heads, dim).contiguous()  # as the kernel reads

    order = torch.arange(bs * width, dtype=torch.int32, device=block_table.device).view(bs, width)
    return operand(k_cache, k_index, "k"), operand(v_cache, v_index, "v"), order


def batch_chunks(seq_lens: list[int], block_size: int, max_blocks: int) -> list[tuple[int, int, int]]:
    """Consecutive requests ``(first, stop, width)`` whose copies (:func:`batch_pages`, ``stop - first``
    rows ``width`` blocks wide) hold at most ``max_blocks`` blocks, or one request that alone needs more:
    bounds the memory the copies take."""
    chunks: list[tuple[int, int, int]] = []
    first, width = 0, 0
    for r, seq_len in enumerate(seq_lens):
        blocks = max(1, -(-seq_len // block_size))
        if r > first and (r + 1 - first) * max(width, blocks) > max_blocks:
            chunks.append((first, r, width))
            first, width = r, 0
        width = max(width, blocks)
    if seq_lens:
        chunks.append((first, len(seq_lens), width))
    return chunks
