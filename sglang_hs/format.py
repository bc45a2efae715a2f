"""The HieraSparse storage layout: 2:4 packing, the signed block index map and byte accounting.

This module is the single source of truth for the layout; the reference, the TileLang kernels and
the radix hook all follow it.

Block layouts (one block = ``B`` tokens of one KV head, head dimension ``D``):

=========  =======================  ====================================================
operand    dense block              2:4 sparse block
=========  =======================  ====================================================
K          ``[B, D]``               values ``[B, D/2]``, metadata ``[B, D/16]`` int16
V          ``[B, D]``               values ``[D, B/2]``, metadata ``[D, B/16]`` int16 (V^T)
=========  =======================  ====================================================

K is the sparse operand A of ``S^T = K·Q^T``, whose reduction runs along head_dim, so K keeps 2 of
every 4 consecutive channels of a token. V enters ``O^T = V^T·P^T`` as ``A = V^T``, whose reduction
runs along tokens, so V keeps 2 of every 4 consecutive tokens of a channel and is stored transposed.
Both sparse layouts are therefore "row-major A, sparse along its last axis", the form TileLang's
``T.gemm_sp`` reads on Hopper.

Metadata (TileLang's natural int16 layout): for each group of 4 along the sparse axis, the kept
positions ``idx0 < idx1`` (0..3) form the nibble ``idx0 | idx1 << 2``; four consecutive groups share
one int16, the first group in the lowest 4 bits. One int16 thus covers 16 dense elements (8 kept).

Index map: one int32 per (KV head, block). ``i >= 0`` means dense block ``i`` of the dense pool;
``i < 0`` means sparse block ``~i`` (that is ``-i - 1``) of the sparse pools.

Value dtype: 16-bit (the model's dtype), or FP8 e4m3 (``--hierasparse-store-dtype fp8_e4m3``) with one
float32 scale per pool row, i.e. per block, KV head and layer: a row's values are its 16-bit values
divided by the smallest power of two at or above ``amax / 448`` (a 2:4 row: of its kept values, pruned
first), read back as ``value * scale`` (:func:`quantize_rows`).
The metadata and the index maps do not change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GROUP = 4
"""Elements per 2:4 group along the sparse axis."""
KEEP = 2
"""Elements kept per group."""
NIBBLES_PER_META = 4
"""Groups described by one int16 metadata word."""
ELEMS_PER_META = GROUP * NIBBLES_PER_META
"""Dense elements covered by one int16 metadata word (16)."""

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""e4m3's largest finite value: a row's scale maps its absolute maximum there."""
SCALE_BYTES = 4
"""One float32 scale per pool row of an FP8 store."""

SPARSE_BLOCK_FRACTION = 0.5 + 1 / ELEMS_PER_META
"""Bytes of a 2:4 block relative to its dense block at 16-bit values: half the values plus one
int16 (the size of one value) per 16 elements, i.e. 0.5 + 1/16 = 0.5625."""
SAVING_PER_SPARSE_SIDE = (1.0 - SPARSE_BLOCK_FRACTION) / 2
"""Bytes saved, as a fraction of dense K+V, per unit of S_K or S_V: 0.4375 / 2 = 0.21875."""


# --------------------------------------------------------------------------------------- pools
@dataclass
class BlockPools:
    """One layer's compressed blocks: a dense and a 2:4 pool per operand, one row per (block, KV head).

    Index-map entries (see the module docstring) address rows of these pools; the kernels, the
    serving fallback and the reference all take one layer's blocks in this form.
    """

    k_dense: torch.Tensor  # [Nd_k, B, D]
    k_values: torch.Tensor  # [Ns_k, B, D/2]
    k_meta: torch.Tensor  # [Ns_k, B, D/16] int16
    v_dense: torch.Tensor  # [Nd_v, B, D]
    v_values: torch.Tensor  # [Ns_v, D, B/2]   (V^T, sparse along tokens)
    v_meta: torch.Tensor  # [Ns_v, D, B/16] int16
    # FP8 values: float32 [rows] scales of the four value pools; None for 16-bit values.
    k_dense_scale: torch.Tensor | None = None
    k_values_scale: torch.Tensor | None = None
    v_dense_scale: torch.Tensor | None = None
    v_values_scale: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if t is not None)

    @property
    def quantized(self) -> bool:
        return self.k_dense_scale is not None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> "BlockPools":
        """The same blocks with ``dtype`` values (``value * scale``; 16-bit pools are only cast): for
        readers that take 16-bit or float32 rows, such as the reference and its gathers."""
        def read(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
            return values.to(dtype) if scale is None else dequantize_rows(values, scale, dtype)

        return BlockPools(read(self.k_dense, self.k_dense_scale), read(self.k_values, self.k_values_scale), self.k_meta,
                          read(self.v_dense, self.v_dense_scale), read(self.v_values, self.v_values_scale), self.v_meta)


# --------------------------------------------------------------------------------------- FP8 values
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and float32 ``[N]`` scales of ``N`` rows ``x [N, ...]``: each row's scale is the
    smallest power of two that brings the row's absolute maximum within :data:`FP8_MAX` (an all-zero
    row gets scale 1).

    Why powers of two: dividing by one only shifts exponents, so rows that already hold e4m3 values
    (SGLang's FP8 pages, which the compressor reads) are stored exactly instead of rounded a second
    time; for 16-bit rows e4m3's relative precision is the same at any scale."""
    rows = x.float().reshape(x.shape[0], max(1, x[0].numel()) if x.shape[0] else 0)
    amax = rows.abs().amax(dim=1) if rows.numel() else rows.new_zeros(rows.shape[0])
    mantissa, exponent = torch.frexp(amax / FP8_MAX)  # amax / FP8_MAX = mantissa * 2^exponent, mantissa in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(amax), exponent - (mantissa == 0.5).int())  # 2^ceil(log2(amax / FP8_MAX))
    scale = torch.where(amax > 0, scale, torch.ones_like(amax))
    values = (rows / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values.reshape(x.shape), scale


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``values [*rows, ...] * scale [*rows]`` in ``dtype`` (the product is formed in float32): ``scale``
    holds one entry per row, over ``values``' leading dimensions."""
    shape = (*scale.shape, *(1,) * (values.dim() - scale.dim()))
    return (values.float() * scale.reshape(shape)).to(dtype)


# --------------------------------------------------------------------------------------- 2:4 packing
def pack_2to4(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``x`` (last axis sparse) into values ``[..., N/2]`` and int16 metadata ``[..., N/16]``.

    ``keep`` has the shape of ``x`` and exactly two True entries in every group of 4 along the last
    axis. Values keep their order along the axis.
    """
    n = x.shape[-1]
    if n % ELEMS_PER_META:
        raise ValueError(f"sparse axis length {n} is not a multiple of {ELEMS_PER_META}")
    groups = keep.reshape(*keep.shape[:-1], n // GROUP, GROUP)
    if not bool((groups.sum(-1) == KEEP).all()):
        raise ValueError("keep mask must select exactly 2 of every 4 elements")
    positions = torch.arange(GROUP, device=x.device).expand_as(groups)
    # The two kept positions of each group, ascending: sort puts dropped slots (marked 4) last.
    kept_pos = torch.where(groups, positions, GROUP).sort(dim=-1).values[..., :KEEP]
    values = torch.gather(x.reshape(groups.shape), -1, kept_pos).reshape(*x.shape[:-1], n // 2)
    nibbles = kept_pos[..., 0] | (kept_pos[..., 1] << 2)  # [..., n/4]
    nibbles = nibbles.reshape(*x.shape[:-1], n // ELEMS_PER_META, NIBBLES_PER_META).to(torch.int32)
    shifts = torch.arange(0, 4 * NIBBLES_PER_META, 4, device=x.device, dtype=torch.int32)
    words = (nibbles << shifts).sum(-1)  # 0 .. 65535
    words = torch.where(words >= 1 << 15, words - (1 << 16), words)  # reinterpret as signed int16
    return values, words.to(torch.int16)


def meta_to_positions(meta: torch.Tensor) -> torch.Tensor:
    """Dense positions (int64) along the sparse axis of every packed value: ``[..., N/16] -> [..., N/2]``."""
    words = meta.to(torch.int32) & 0xFFFF
    shifts = torch.arange(0, 4 * NIBBLES_PER_META, 4, device=meta.device, dtype=torch.int32)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [..., N/16, 4]
    within = torch.stack([nibbles & 0x3, nibbles >> 2], dim=-1)  # [..., N/16, 4, 2]
    group_index = torch.arange(meta.shape[-1] * NIBBLES_PER_META, device=meta.device)
    group_base = (group_index * GROUP).reshape(meta.shape[-1], NIBBLES_PER_META, 1)
    return (within + group_base).reshape(*meta.shape[:-1], meta.shape[-1] * ELEMS_PER_META // 2).long()


def unpack_2to4(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_2to4`: the dense tensor with zeros at the pruned positions."""
    positions = meta_to_positions(meta)
    dense = values.new_zeros(*values.shape[:-1], values.shape[-1] * 2)
    return dense.scatter_(-1, positions, values)


# --------------------------------------------------------------------------------------- index map
def sparse_entry(offset: torch.Tensor | int) -> torch.Tensor | int:
    """Index-map entry for sparse block ``offset`` (always negative)."""
    return -offset - 1


def decode_entry(entry):
    """Split index-map entries (an int or a tensor) into (is_sparse, offset in its pool)."""
    if isinstance(entry, int):
        return entry < 0, (-entry - 1 if entry < 0 else entry)
    is_sparse = entry < 0
    return is_sparse, torch.where(is_sparse, -entry - 1, entry)


def decompress_blocks(pools: BlockPools, index: torch.Tensor, operand: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[H, n, B, D]`` blocks of one operand (``"k"`` or ``"v"``) for index-map entries ``[H, n]``:
    dense rows as stored, 2:4 rows unpacked (zeros at the pruned positions, V^T transposed back), FP8
    rows scaled back. ``dtype``: of the result (default: the pools', float32 for FP8 pools).
    Vectorized, no host synchronisation."""
    dense, values, meta = (getattr(pools, f"{operand}_{kind}") for kind in ("dense", "values", "meta"))
    dense_scale, values_scale = getattr(pools, f"{operand}_dense_scale"), getattr(pools, f"{operand}_values_scale")
    dtype = dtype or (torch.float32 if pools.quantized else dense.dtype)

    def gather(pool: torch.Tensor, scale: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        return pool[rows].to(dtype) if scale is None else dequantize_rows(pool[rows], scale[rows], dtype)

    parts = []
    if dense.shape[0]:
        parts.append((index >= 0, gather(dense, dense_scale, index.clamp(min=0))))
    if values.shape[0]:
        row = (-index - 1).clamp(min=0)
        unpacked = unpack_2to4(gather(values, values_scale, row), meta[row])
        parts.append((index < 0, unpacked.transpose(-1, -2) if operand == "v" else unpacked))
    if len(parts) == 1:
        return parts[0][1]
    (dense_mask, dense_blocks), (_, sparse_blocks) = parts
    return torch.where(dense_mask[..., None, None], dense_blocks, sparse_blocks)


# --------------------------------------------------------------------------------------- accounting
def sparse_count(num_blocks: int, sparsity: float) -> int:
    """Blocks stored sparse out of ``num_blocks`` prunable ones: ceil(S·n), robust to float error."""
    return min(num_blocks, math.ceil(round(sparsity * num_blocks, 9)))


def dense_block_bytes(block_size: int, head_dim: int, elem_bytes: int = 2) -> int:
    """Values, plus a float32 scale for 1-byte (FP8) values."""
    return block_size * head_dim * elem_bytes + (SCALE_BYTES if elem_bytes == 1 else 0)


def sparse_block_bytes(block_size: int, head_dim: int, elem_bytes: int = 2) -> int:
    """Values (half the elements) plus one int16 of metadata per 16 elements, plus a float32 scale for
    1-byte (FP8) values."""
    elems = block_size * head_dim
    return elems // 2 * elem_bytes + elems // ELEMS_PER_META * 2 + (SCALE_BYTES if elem_bytes == 1 else 0)


def store_bytes(num_blocks: int, block_size: int, head_dim: int, n_sparse_k: int, n_sparse_v: int) -> int:
    """Bytes of one KV head's K and V blocks when ``n_sparse_k``/``n_sparse_v`` of them are sparse
    (the paper's eq. 6 for fp16/bf16, without the index map)."""
    dense = dense_block_bytes(block_size, head_dim)
    sparse = sparse_block_bytes(block_size, head_dim)
    k = (num_blocks - n_sparse_k) * dense + n_sparse_k * sparse
    v = (num_blocks - n_sparse_v) * dense + n_sparse_v * sparse
    return k + v


def compressed_fraction(sk: float, sv: float, elem_bytes: int = 2, block_size: int = 64, head_dim: int = 64) -> float:
    """Bytes of compressed blocks (values at ``elem_bytes``, metadata, FP8 scales) against the same
    blocks dense at 16 bits, when fractions ``sk`` / ``sv`` of their K / V rows are 2:4."""
    dense16 = dense_block_bytes(block_size, head_dim)
    dense, sparse = dense_block_bytes(block_size, head_dim, elem_bytes), sparse_block_bytes(block_size, head_dim, elem_bytes)
    return ((1 - sk) * dense + sk * sparse + (1 - sv) * dense + sv * sparse) / (2 * dense16)


def compression_ratio(sk: float, sv: float) -> float:
    """r_comp = dense bytes / compressed bytes = 1 / (1 - 0.21875·(S_K + S_V))."""
    return 1.0 / (1.0 - SAVING_PER_SPARSE_SIDE * (sk + sv))
