"""PyTorch reference (the oracle): compress, decompress, and attention over mixed dense/sparse blocks.

Everything here is plain PyTorch in float32 arithmetic and runs on CPU or GPU. The attention follows
the Trans-Both formulation of the kernels: ``S^T = K·Q^T`` and ``O^T = V^T·P^T``, where a sparse K
block or V^T block is used straight from its packed values and metadata (a gather by the metadata's
positions, which is what a 2:4 sparse tensor core does), never decompressed first.

It also holds the references of the decode modes' block choice (``sglang_hs.decode_modes``, whose
batched, fixed-shape rules the tests check against these): the exact attention mass of each block, and
the two rules from the literature, top-k (Kascade) and the attention-mass threshold (PSA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sglang_hs.format import (FP8_DTYPE, BlockPools, decode_entry, meta_to_positions, pack_2to4, quantize_rows,
                               sparse_entry, unpack_2to4)  # fmt: skip
from sglang_hs.pruner import PruneResult, Pruner, prunable_mask


@dataclass
class CompressedSequence:
    """One sequence's KV for one layer: full blocks in pools (via index maps) plus a dense tail."""

    pools: BlockPools
    k_index: torch.Tensor  # [H, n_blocks] int32, signed (see sglang_hs.format)
    v_index: torch.Tensor  # [H, n_blocks] int32
    tail_k: torch.Tensor  # [L_tail, H, D], tokens after the last full block
    tail_v: torch.Tensor  # [L_tail, H, D]

    @property
    def block_size(self) -> int:
        return self.pools.k_dense.shape[1] if self.pools.k_dense.numel() else self.pools.k_values.shape[1]

    @property
    def seq_len(self) -> int:
        return self.k_index.shape[1] * self.block_size + self.tail_k.shape[0]


# ----------------------------------------------------------------------------------------- compress
def _pack_operand(blocks: torch.Tensor, result: PruneResult, transpose: bool):
    """Split one operand's blocks into (dense pool, values, metadata, signed index map).

    Pool rows follow (head, block) order; the index map is built with a prefix sum over the block
    mask, so no serial walk over blocks is needed.
    """
    heads, n = result.sparse.shape
    flat_sparse = result.sparse.reshape(-1)
    flat_blocks = blocks.reshape(heads * n, *blocks.shape[2:])
    flat_keep = result.keep.reshape(heads * n, *blocks.shape[2:])
    dense_offset = torch.cumsum(~flat_sparse, 0) - 1
    sparse_offset = torch.cumsum(flat_sparse, 0) - 1
    index = torch.where(flat_sparse, sparse_entry(sparse_offset), dense_offset).to(torch.int32)
    dense_pool = flat_blocks[~flat_sparse]
    chosen, chosen_keep = flat_blocks[flat_sparse], flat_keep[flat_sparse]
    if transpose:  # V is stored as V^T so that tokens become the sparse (last) axis
        chosen, chosen_keep = chosen.transpose(-1, -2), chosen_keep.transpose(-1, -2)
    values, meta = pack_2to4(chosen, chosen_keep)
    return dense_pool, values, meta, index.reshape(heads, n)


def compress_blocks(
    k_blocks: torch.Tensor, v_blocks: torch.Tensor, k_result: PruneResult, v_result: PruneResult,
    value_dtype: torch.dtype | None = None,
) -> tuple[BlockPools, torch.Tensor, torch.Tensor]:
    """Compress ``[H, n, B, D]`` K and V blocks by their prune results into pools + index maps;
    ``value_dtype`` FP8: the kept values quantized with a scale per pool row (``sglang_hs.format``)."""
    k_dense, k_values, k_meta, k_index = _pack_operand(k_blocks, k_result, transpose=False)
    v_dense, v_values, v_meta, v_index = _pack_operand(v_blocks, v_result, transpose=True)
    if value_dtype is None or value_dtype == k_blocks.dtype:
        return BlockPools(k_dense, k_values, k_meta, v_dense, v_values, v_meta), k_index, v_index
    if value_dtype != FP8_DTYPE:
        raise ValueError(f"values of {value_dtype}; allowed: the blocks' dtype or {FP8_DTYPE}")
    (k_dense, k_dense_scale), (k_values, k_values_scale), (v_dense, v_dense_scale), (v_values, v_values_scale) = (
        quantize_rows(x) for x in (k_dense, k_values, v_dense, v_values))  # fmt: skip
    pools = BlockPools(k_dense, k_values, k_meta, v_dense, v_values, v_meta,
                       k_dense_scale, k_values_scale, v_dense_scale, v_values_scale)  # fmt: skip
    return pools, k_index, v_index


def compress_sequence(
    k: torch.Tensor,
    v: torch.Tensor,
    pruner: Pruner,
    sk: float,
    sv: float,
    block_size: int = 64,
    sink_tokens: int = 64,
    window_tokens: int = 256,
    value_dtype: torch.dtype | None = None,
) -> CompressedSequence:
    """Prune and compress one sequence's ``[L, H, D]`` K and V (one layer); ``value_dtype`` as in
    :func:`compress_blocks` (the dense tail keeps the cache's dtype)."""
    seq_len, heads, dim = k.shape
    n_blocks = seq_len // block_size
    full = n_blocks * block_size

    def as_blocks(x: torch.Tensor) -> torch.Tensor:
        return x[:full].reshape(n_blocks, block_size, heads, dim).permute(2, 0, 1, 3)

    k_blocks, v_blocks = as_blocks(k), as_blocks(v)
    prunable = prunable_mask(n_blocks, seq_len, block_size, sink_tokens, window_tokens, device=k.device)
    k_result = pruner(k_blocks, "k", sk, prunable)
    v_result = pruner(v_blocks, "v", sv, prunable)
    pools, k_index, v_index = compress_blocks(k_blocks, v_blocks, k_result, v_result, value_dtype)
    return CompressedSequence(pools, k_index, v_index, k[full:], v[full:])


# ----------------------------------------------------------------------------------------- decompress
def _block(index_entry: int, dense: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, transpose: bool):
    is_sparse, offset = decode_entry(index_entry)
    if not is_sparse:
        return dense[offset]
    block = unpack_2to4(values[offset], meta[offset])
    return block.transpose(-1, -2) if transpose else block


def decompress(seq: CompressedSequence) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense ``[L, H, D]`` K and V the compressed sequence represents (pruned elements are 0; FP8
    values scaled back, in float32)."""
    p = seq.pools.dequantized() if seq.pools.quantized else seq.pools
    heads, n = seq.k_index.shape

    def operand(index, dense, values, meta, transpose, tail):
        rows = [
            torch.stack([_block(int(index[h, i]), dense, values, meta, transpose) for h in range(heads)], 1)
            for i in range(n)
        ]
        return torch.cat(rows + [tail.to(dense.dtype)], 0) if rows else tail

    k = operand(seq.k_index, p.k_dense, p.k_values, p.k_meta, False, seq.tail_k)
    v = operand(seq.v_index, p.v_dense, p.v_values, p.v_meta, True, seq.tail_v)
    return k, v


# ----------------------------------------------------------------------------------------- attention
def sparse_rows_times(values: torch.Tensor, meta: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``A @ rhs`` for a 2:4 sparse ``A`` given as packed ``values [M, K/2]`` and ``meta [M, K/16]``;
    ``rhs`` is ``[K, N]``. Each kept value multiplies the rhs row its metadata names."""
    positions = meta_to_positions(meta)  # [M, K/2]
    return torch.einsum("mj,mjn->mn", values.float(), rhs.float()[positions])


def attention(
    q: torch.Tensor,
    seq: CompressedSequence,
    q_offset: int | None = None,
    causal: bool = True,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [Lq, Hq, D]`` over a compressed sequence (GQA: Hq is a multiple of H).

    Query ``i`` sits at position ``q_offset + i`` (default: the last ``Lq`` positions); with
    ``causal`` it sees KV positions ``<= q_offset + i``. Decode is ``Lq = 1``. Returns the output in
    ``q.dtype`` and the natural-log log-sum-exp ``[Lq, Hq]`` in float32.
    """
    n_q, q_heads, dim = q.shape
    heads = seq.k_index.shape[0]
    group = q_heads // heads
    q_offset = seq.seq_len - n_q if q_offset is None else q_offset
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    p = seq.pools.dequantized() if seq.pools.quantized else seq.pools  # FP8: value * scale, exact in float32
    kv_pos = torch.arange(seq.seq_len, device=q.device)
    q_pos = (q_offset + torch.arange(n_q, device=q.device)).repeat_interleave(group)
    out = torch.empty(n_q, q_heads, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(n_q, q_heads, dtype=torch.float32, device=q.device)
    for h in range(heads):
        # Columns are the group's queries, ordered (query, head-in-group): [D, Lq·G].
        q_t = q[:, h * group : (h + 1) * group].reshape(n_q * group, dim).float().t()
        scores_t = []  # S^T blocks [B, Lq·G]
        for entry in seq.k_index[h].tolist():
            is_sparse, offset = decode_entry(entry)
            if is_sparse:
                scores_t.append(sparse_rows_times(p.k_values[offset], p.k_meta[offset], q_t))
            else:
                scores_t.append(p.k_dense[offset].float() @ q_t)
        scores_t.append(seq.tail_k[:, h].float() @ q_t)
        s_t = torch.cat(scores_t, 0) * sm_scale
        if causal:
            s_t = s_t.masked_fill(kv_pos[:, None] > q_pos[None, :], -torch.inf)
        col_lse = torch.logsumexp(s_t, dim=0)
        p_t = torch.exp(s_t - col_lse[None, :])
        o_t = torch.zeros(dim, n_q * group, dtype=torch.float32, device=q.device)
        block = seq.block_size
        for i, entry in enumerate(seq.v_index[h].tolist()):
            p_block = p_t[i * block : (i + 1) * block]
            is_sparse, offset = decode_entry(entry)
            if is_sparse:
                o_t += sparse_rows_times(p.v_values[offset], p.v_meta[offset], p_block)
            else:
                o_t += p.v_dense[offset].float().t() @ p_block
        o_t += seq.tail_v[:, h].float().t() @ p_t[seq.k_index.shape[1] * block :]
        out[:, h * group : (h + 1) * group] = o_t.t().reshape(n_q, group, dim).to(q.dtype)
        lse[:, h * group : (h + 1) * group] = col_lse.reshape(n_q, group)
    return out, lse


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offset: int | None = None,
    causal: bool = True,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention over dense ``[L, H, D]`` K/V with the same conventions as :func:`attention`."""
    n_q, q_heads, dim = q.shape
    group = q_heads // k.shape[1]
    q_offset = k.shape[0] - n_q if q_offset is None else q_offset
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * sm_scale
    if causal:
        q_pos = q_offset + torch.arange(n_q, device=q.device)
        s = s.masked_fill(torch.arange(k.shape[0], device=q.device)[None, None, :] > q_pos[None, :, None], -torch.inf)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vf)
    return out.to(q.dtype), lse.t().contiguous()


def merge_partial(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint KV sets by their log-sum-exp (natural log)."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).unsqueeze(-1)
    wb = torch.exp(lse_b - lse).unsqueeze(-1)
    out = (out_a.float() * wa + out_b.float() * wb).to(out_a.dtype)
    return out, lse


# ----------------------------------------------------------------------------------------- serving layout
def gather_paged_sequence(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pools: BlockPools,
    k_index: torch.Tensor,
    v_index: torch.Tensor,
    block_row: torch.Tensor,
    seq_len: int,
) -> CompressedSequence:
    """One request's KV in the serving layout, as a :class:`CompressedSequence`.

    In the server a request's tokens are cut into blocks of ``B`` (= SGLang's page size). Its block
    table row ``block_row`` has one int32 per block: ``e >= 0`` is SGLang KV page ``e`` (dense; rows
    ``e*B .. e*B+B-1`` of the layer's ``k_cache``/``v_cache`` ``[slots, H, D]``); ``e < 0`` is compressed
    block ``~e``, resolved per KV head through this layer's index maps ``k_index``/``v_index``
    ``[H, n_compressed]`` into ``pools``. Only the last block may be partial (``seq_len``).
    """
    block = pools.k_dense.shape[1] if pools.k_dense.numel() else pools.k_values.shape[1]
    if pools.quantized:  # the view's dense pool takes cache pages too: FP8 rows scaled back to float32 first
        pools = pools.dequantized()
    heads = k_cache.shape[1]
    n_full = seq_len // block
    pages = block_row[: -(-seq_len // block)].tolist()
    cache_k = k_cache.reshape(-1, block, heads, k_cache.shape[-1])
    cache_v = v_cache.reshape(-1, block, heads, v_cache.shape[-1])
    # Dense pool of the view: the store's dense blocks, then every full cache page of the row per head.
    cache_pages = [p for p in pages[:n_full] if p >= 0]
    extra_k = [cache_k[p, :, h] for p in cache_pages for h in range(heads)]
    extra_v = [cache_v[p, :, h] for p in cache_pages for h in range(heads)]
    k_dense = torch.cat([pools.k_dense, torch.stack(extra_k).to(pools.k_dense.dtype)]) if extra_k else pools.k_dense
    v_dense = torch.cat([pools.v_dense, torch.stack(extra_v).to(pools.v_dense.dtype)]) if extra_v else pools.v_dense
    view_k = torch.empty(heads, n_full, dtype=torch.int32)
    view_v = torch.empty(heads, n_full, dtype=torch.int32)
    next_cache = 0
    for j, entry in enumerate(pages[:n_full]):
        if entry >= 0:
            for h in range(heads):
                view_k[h, j] = pools.k_dense.shape[0] + next_cache * heads + h
                view_v[h, j] = pools.v_dense.shape[0] + next_cache * heads + h
            next_cache += 1
        else:
            view_k[:, j] = k_index[:, ~entry].cpu()
            view_v[:, j] = v_index[:, ~entry].cpu()
    tail_page = pages[n_full] if seq_len % block else None
    if tail_page is not None and tail_page < 0:
        raise ValueError("a partial last block must be a dense cache page")
    tail = slice(0, seq_len - n_full * block)
    tail_k = cache_k[tail_page, tail] if tail_page is not None else k_cache[:0]
    tail_v = cache_v[tail_page, tail] if tail_page is not None else v_cache[:0]
    view_pools = BlockPools(k_dense, pools.k_values, pools.k_meta, v_dense, pools.v_values, pools.v_meta)
    return CompressedSequence(view_pools, view_k, view_v, tail_k, tail_v)


def paged_attention(
    q: torch.Tensor,
    qo_indptr: list[int],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pools: BlockPools,
    k_index: torch.Tensor,
    v_index: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: list[int],
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched causal attention in the serving layout (the kernels' oracle).

    Request ``r`` owns queries ``q[qo_indptr[r]:qo_indptr[r+1]]``, the last positions of its
    ``seq_lens[r]`` tokens; decode is one query per request. Returns outputs and natural-log LSE.
    """
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    for r, seq_len in enumerate(seq_lens):
        rows = slice(qo_indptr[r], qo_indptr[r + 1])
        seq = gather_paged_sequence(k_cache, v_cache, pools, k_index, v_index, block_table[r], seq_len)
        out[rows], lse[rows] = attention(q[rows], seq, sm_scale=sm_scale)
    return out, lse


# ----------------------------------------------------------------------------------------- block choice
# ``n`` blocks of ``B`` tokens, ``H`` KV heads, ``Hq`` query heads (a KV head's query heads are
# consecutive), ``D`` head_dim; the ``always`` blocks (a request's SGLang pages: sink, window, its own
# tokens) are always read.
def _real(x: torch.Tensor) -> torch.Tensor:
    """fp32 for 16-bit inputs (scores are compared, not stored); fp64 stays fp64."""
    return x if x.dtype == torch.float64 else x.float()


def exact_block_mass(q: torch.Tensor, k: torch.Tensor, block: int, scale: float) -> torch.Tensor:
    """float ``[H, n]``: the softmax attention mass of each block, summed over a KV head's query heads
    (``q [Hq, D]``, ``k [n*B, H, D]``): what an anchor layer measures exactly."""
    heads = k.shape[1]
    qg = _real(q).unflatten(0, (heads, -1))  # [H, G, D]
    logits = scale * torch.einsum("hgd,thd->hgt", qg, _real(k))
    probs = logits.softmax(-1)
    return probs.unflatten(-1, (-1, block)).sum(-1).sum(1)


def select_topk(scores: torch.Tensor, k: int, always: torch.Tensor) -> torch.Tensor:
    """bool ``[H, n]``: the ``always`` blocks (bool ``[n]``) plus the ``k`` highest-scoring other blocks
    of each head (ties to the lower block): Kascade's rule."""
    masked = scores.masked_fill(always, -math.inf)
    k = min(k, int((~always).sum()))
    order = masked.argsort(dim=-1, descending=True, stable=True)[:, :k]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)
    return chosen | always


def select_mass(log_mass: torch.Tensor, tau: float, always: torch.Tensor, cap: int | None = None) -> torch.Tensor:
    """bool ``[H, n]``: per head the ``always`` blocks plus the fewest highest blocks whose mass
    (``softmax`` of ``log_mass [H, n]``, e.g. the log of :func:`exact_block_mass`) brings the selected
    share to at least ``tau`` in ``(0, 1]``; at most ``cap`` blocks besides the ``always`` ones (PSA's rule)."""
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau={tau} is not in (0, 1]")
    mass = _real(log_mass).softmax(-1)
    base = (mass * always).sum(-1, keepdim=True)
    other = mass.masked_fill(always, 0.0)
    order = other.argsort(dim=-1, descending=True, stable=True)
    before = other.gather(-1, order).cumsum(-1) - other.gather(-1, order)  # mass chosen before each block
    take = (base + before < tau - 1e-6) & (other.gather(-1, order) > 0)
    if cap is not None:
        take &= torch.arange(take.shape[-1], device=take.device) < cap
    chosen = torch.zeros_like(take).scatter_(-1, order, take)
    return chosen | always


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor, block: int,
                       scale: float) -> torch.Tensor:  # fmt: skip
    """float ``[Hq, D]``: decode attention of ``q [Hq, D]`` over ``k``, ``v [n*B, H, D]`` reading only the
    blocks ``selected [H, n]`` of each KV head."""
    heads = k.shape[1]
    qg = _real(q).unflatten(0, (heads, -1))
    logits = scale * torch.einsum("hgd,thd->hgt", qg, _real(k))
    keep = selected.repeat_interleave(block, dim=-1)[:, None]  # [H, 1, n*B]
    probs = logits.masked_fill(~keep, -math.inf).softmax(-1)
    return torch.einsum("hgt,thd->hgd", probs, _real(v)).flatten(0, 1)
