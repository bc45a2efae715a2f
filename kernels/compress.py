"""Fused 2:4 prune + compress of cached prefix blocks into the HieraSparse store (TileLang 0.1.11, sm_90a).

What it replaces: :func:`sglang_hs.pools.compress_prefix`, which the radix hook calls when a prefix
enters the tree. :class:`FusedCompressor` is called with the same arguments and gives bit-identical
pools, index maps and virtual block ids when the pruner is the magnitude pruner and the data is on a
CUDA device; otherwise it calls the PyTorch version. ``HieraSparseCompress`` is the plan/run API of
the two kernels:

1. **Loss pass** (``loss``): for ``n`` whole blocks given by their SGLang page ids, the L1 magnitude
   that 2:4 pruning drops from each block's K (groups of 4 along head_dim) or V (groups of 4 along
   tokens), summed over all layers and KV heads (K: the heads a K head map maps): float32 ``[n]``.
2. **Pack pass** (``pack``): for every layer and KV head, each block's K goes to ``k_dense[row]``
   (``[B, D]``) or, if the block's K is sparse, to ``k_values[row]`` (``[B, D/2]``) and ``k_meta[row]``
   (``[B, D/16]`` int16); V likewise, sparse V transposed (``v_values [D, B/2]``, ``v_meta [D, B/16]``),
   with ``row = slot * Hkv + h`` for the slot the store gave the block (see :mod:`sglang_hs.format`),
   except in a K-sparse block under a K head map, where each (layer, head) finds its K row and pool
   (2:4 or dense) in the store's ``k_sparse_block_rows`` table (:mod:`sglang_hs.pools`). The
   top-2-of-4 choice is made in the kernel; nothing else reads the dense KV.

Design (and why)
----------------
* **Bandwidth is the whole budget.** Both passes are pure streaming: no tensor cores, a few integer
  ops per element. For the benchmark shape (Llama-3.1-8B, 32 layers x 8 KV heads x d 128, fp16,
  32K tokens) the KV is 4.29 GB; packing reads it once and writes 2.42 GB at S_K = S_V = 1 (every
  block sparse: 0.5625 of the bytes) or 3.36 GB at S_K = 0, S_V = 1. At the H100's measured 3.04
  TB/s device-to-device copy rate that is 2.2 ms and 2.5 ms, against ~440 ms of dense causal prefill
  attention for the same tokens (32 layers x 13.76 ms, FlashInfer at ~639 TFLOP/s): 0.50% and
  0.57%. The 0.5% target is therefore at the bandwidth floor; the 1% minimum has room.
* **No loss pass when the choice is known.** ``rank_sparse`` makes ``ceil(S * n)`` of a group's
  prunable blocks sparse. When that count is 0 or all of them (S = 0 or S = 1, the server's default
  S_K = 0, S_V = 1 in both phases) the choice does not depend on the loss, so the wrapper decides on
  the host from the group masks and skips the loss pass and the read-back: one read of the KV, no
  host sync. Only a group with a fractional count needs the loss pass of that operand (a second
  read of that operand's KV; K and V are separate launches, so an S_K = 0.5, S_V = 1 prefix reads
  K twice and V once) and one small read-back of the ranked mask, which the store's host-side
  allocator needs anyway.
* **One launch for all layers.** SGLang allocates every layer's ``k_buffer``/``v_buffer`` and the
  store every layer's pools as separate tensors. A launch per layer costs ~4-8 us of host time per
  layer and pass (tvm-ffi call plus driver launch), more than the GPU time of a short prefix's
  layer (a 2K-token prefix moves 8 MB per layer: ~3 us). So each kernel takes an int64 table of the
  tensors' addresses (``[8, L]``: k_buffer, v_buffer, k_dense, k_values, k_meta, v_dense, v_values,
  v_meta per layer, built once per set of tensors and cached on the device) and builds its tile
  views with ``T.make_tensor_from_addr`` at ``table[row, layer] + offset``: a grid of
  ``(Hkv, n, L)`` CTAs (pack) or ``(n, L)`` (loss) in one launch, and all 64-bit address arithmetic
  happens once per CTA, so the per-element indices are small int32 expressions.
* **Pack: one CTA per (KV head, block, layer), 128 threads.** A K or V tile of one head is 64 rows of
  ``2*D`` contiguous bytes (stride ``Hkv*D*2``). Dense tiles and sparse K are read as 16-element
  chunks of a row (two 16-byte loads per thread and chunk, all of a thread's loads issued before
  its first store, since the compiler cannot move loads above stores through these untyped
  pointers); a sparse-K chunk becomes one 16-byte store of 8 kept values and one int16 of metadata
  (consecutive threads write consecutive bytes). Sparse V is read by channel: a thread owns one
  channel (d = 128) or half of one (d = 64) and loads its 64 (32) tokens as 2-byte loads that a warp
  coalesces into 64 contiguous bytes per token, then writes its transposed row of values (4 x 16 B)
  and metadata (one 8-byte store) contiguously. The kernel moves raw 16-bit words, so fp16 and bf16
  share one binary.
* **Top-2 of 4 exactly like ``sglang_hs.pruner.top2_of_4``.** For fp16/bf16 (sign-magnitude formats),
  ``|x|`` orders like the integer ``bits & 0x7FFF``, so the pack kernel compares integers: with
  ``c_ij = |x_j| > |x_i|`` for the six pairs ``i < j`` (``j`` outranks ``i``; otherwise ``i`` outranks
  ``j``, which is the tie rule "lower index wins"), element ``i`` is kept iff fewer than two elements
  outrank it; ``idx0`` is the lowest kept position, ``idx1`` the highest. The loss kernel needs only
  the two smallest magnitudes of each group (the dropped ones, whichever of tied elements is
  dropped), summed in float32: a min/max network of 8 operations.
* **Loss: one CTA per (block, layer), all heads.** The block's page is one contiguous chunk of
  ``B*Hkv*D`` elements, so K groups are any 4 aligned consecutive elements of it and V groups are
  4 rows apart; a thread reads 16-byte vectors (4 in flight) and accumulates in float32; a warp
  shuffle tree and a shared-memory sum (in warp order) give the (block, layer) loss, and a second
  kernel of the same call sums the layers in order (as ``compress_prefix``'s ``loss += layer_loss``
  does). The result is deterministic; it differs from the PyTorch sum only by float32 summation
  order (relative ~1e-7), which could flip the ranking of two blocks only if their losses agree to
  that precision (see the tests' comment).
* **TileLang, not Triton.** The project's kernels are TileLang; this one needs no tensor core, but
  TileLang expresses it directly (per-thread code, ``T.vectorized`` 16-byte accesses,
  ``T.make_tensor_from_addr`` for the address tables), and the generated CUDA is plain and easy to
  check (``HieraSparseCompress.sources()``).

Preconditions (what ``compress_prefix``'s callers guarantee): ``slots`` is page aligned (block ``i`` is
the whole page ``slots[i*B] // B``, as SGLang's paged allocator hands them out); the KV buffers and
pools are contiguous; no NaN in the KV (the PyTorch path raises on NaN: its keep mask then has not
exactly 2 of 4; this kernel keeps some 2). With infinite KV values PyTorch's loss is NaN and a
fractional ranking may differ.

The module imports neither TileLang nor a GPU at import time; ``build_*_kernel`` and
``HieraSparseCompress`` do.
"""

from __future__ import annotations

import functools
import logging

import torch

from sglang_hs.format import sparse_count
from sglang_hs.kernels.common import compile_cached, pin_source
from sglang_hs.pools import compress_prefix
from sglang_hs.pruner import MagnitudePruner, Pruner

pin_source(__file__)
logger = logging.getLogger(__name__)

SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
PASS_CONFIGS = {"tl.disable_warp_specialized": True}
PACK_THREADS = 128
LOSS_THREADS = 256
LOSS_UNROLL = 4  # 16-byte loads in flight per thread in the loss kernel

ADDR_ROWS = ("k_buffer", "v_buffer", "k_dense", "k_values", "k_meta", "v_dense", "v_values", "v_meta")
"""Rows of the address table: per layer, the data pointers of these tensors."""


# ------------------------------------------------------------------------------------------ kernels
def _check_shape(kv_heads: int, head_dim: int, block_size: int, threads: int = PACK_THREADS) -> None:
    if head_dim % 16 or block_size % 16:
        raise ValueError("head_dim and block_size must be multiples of 16")
    if threads % head_dim or (block_size // 16) % (threads // head_dim):
        raise ValueError(f"head_dim {head_dim} does not tile {threads} threads (64 and 128 do)")
    if (block_size * head_dim // 16) % threads:
        raise ValueError(f"block_size * head_dim / 16 must be a multiple of {threads}")


def build_pack_prim_func(kv_heads: int, head_dim: int, block_size: int, threads: int = PACK_THREADS):
    """The pack kernel: grid ``(Hkv, n, L)``; see the module docstring.

    Arguments: ``ADDR [8, L]`` int64 (see ``ADDR_ROWS``), ``PAGES [n]`` int64,
    ``INFO [n, 4]`` int32 = (K sparse, K slot, V sparse, V slot) per block, ``KROW [L, H, 3]`` int32 =
    the store's ``k_sparse_block_rows``: where a K-sparse block's K goes per (layer, head) (stored 2:4,
    slot stride, row offset; without a K head map ``(1, H, h)``). A K-dense block's row is ``slot*H + h``.
    """
    import tilelang.language as T

    _check_shape(kv_heads, head_dim, block_size, threads)
    H, D, B = kv_heads, head_dim, block_size
    u16 = "uint16"
    KCH = D // 16  # 16-element chunks of a token row
    ROW_IT = B * KCH // threads  # chunks per thread
    TPC = threads // D  # threads per channel (sparse V)
    GPT = (B // 16) // TPC  # 16-token groups per thread (sparse V)
    PAGE_BYTES = B * H * D * 2
    DENSE_BYTES, VALUES_BYTES, META_BYTES = B * D * 2, B * D, B * D // 8
    n, L = T.dynamic("n, L")

    @T.macro
    def top2(x, o, mag, kp, nib, v0, v1):
        """Keep flags of the quad ``x[o:o+4]`` (ties to the lower index), its metadata nibble and the
        two kept words, in order."""
        for j in T.unroll(4):
            mag[j] = T.cast(x[o + j], "int32") & 0x7FFF
        c01 = T.if_then_else(mag[1] > mag[0], 1, 0)
        c02 = T.if_then_else(mag[2] > mag[0], 1, 0)
        c03 = T.if_then_else(mag[3] > mag[0], 1, 0)
        c12 = T.if_then_else(mag[2] > mag[1], 1, 0)
        c13 = T.if_then_else(mag[3] > mag[1], 1, 0)
        c23 = T.if_then_else(mag[3] > mag[2], 1, 0)
        # rank_i = number of elements that outrank i; keep iff rank_i < 2.
        kp[0] = T.if_then_else(c01 + c02 + c03 < 2, 1, 0)
        kp[1] = T.if_then_else(1 - c01 + c12 + c13 < 2, 1, 0)
        kp[2] = T.if_then_else(2 - c02 - c12 + c23 < 2, 1, 0)
        kp[3] = T.if_then_else(3 - c03 - c13 - c23 < 2, 1, 0)
        nib[0] = T.if_then_else(kp[0] == 1, 0, T.if_then_else(kp[1] == 1, 1, 2)) | (
            T.if_then_else(kp[3] == 1, 3, T.if_then_else(kp[2] == 1, 2, 1)) << 2)
        v0[0] = T.if_then_else(kp[0] == 1, x[o], T.if_then_else(kp[1] == 1, x[o + 1], x[o + 2]))
        v1[0] = T.if_then_else(kp[3] == 1, x[o + 3], T.if_then_else(kp[2] == 1, x[o + 2], x[o + 1]))

    @T.macro
    def load_rows(src, h, tx, x):
        for it in T.unroll(ROW_IT):
            for j in T.vectorized(16):
                x[it * 16 + j] = src[(it * threads + tx) // KCH, h, ((it * threads + tx) % KCH) * 16 + j]

    @T.macro
    def store_rows(dst, tx, x):
        for it in T.unroll(ROW_IT):
            for j in T.vectorized(16):
                dst[(it * threads + tx) // KCH, ((it * threads + tx) % KCH) * 16 + j] = x[it * 16 + j]

    @T.prim_func
    def main(
        ADDR: T.Tensor([8, L], "int64"),
        PAGES: T.Tensor([n], "int64"),
        INFO: T.Tensor([n, 4], "int32"),
        KROW: T.Tensor([L, H, 3], "int32"),
    ):
        with T.Kernel(H, n, L, threads=threads) as (h, i, l):
            tx = T.get_thread_binding()
            x = T.alloc_local([ROW_IT * 16], u16)  # a thread's 16-bit words of one tile
            vals = T.alloc_local([8 * GPT], u16)
            meta = T.alloc_local([GPT], "int16")
            mag = T.alloc_local([4], "int32")
            kp = T.alloc_local([4], "int32")
            nib = T.alloc_local([1], "int32")
            word = T.alloc_local([1], "int32")
            v0 = T.alloc_local([1], u16)
            v1 = T.alloc_local([1], u16)
            page_off = PAGES[i] * PAGE_BYTES
            k_sparse = INFO[i, 0] * KROW[l, h, 0]  # 1: this head's K of this block is stored 2:4
            k_row = T.if_then_else(INFO[i, 0] == 0, T.cast(INFO[i, 1], "int64") * H + h,
                                   T.cast(INFO[i, 1], "int64") * KROW[l, h, 1] + KROW[l, h, 2])
            v_row = T.cast(INFO[i, 3], "int64") * H + h

            # ---- K: rows of 16-element chunks, sparse along head_dim.
            k_src = T.make_tensor_from_addr(ADDR[0, l] + page_off, [B, H, D], u16)
            load_rows(k_src, h, tx, x)
            if k_sparse == 0:
                k_dense = T.make_tensor_from_addr(ADDR[2, l] + k_row * DENSE_BYTES, [B, D], u16)
                store_rows(k_dense, tx, x)
            else:
                k_values = T.make_tensor_from_addr(ADDR[3, l] + k_row * VALUES_BYTES, [B, D // 2], u16)
                k_meta = T.make_tensor_from_addr(ADDR[4, l] + k_row * META_BYTES, [B, D // 16], "int16")
                for it in T.unroll(ROW_IT):
                    word[0] = 0
                    for g in T.unroll(4):
                        top2(x, it * 16 + g * 4, mag, kp, nib, v0, v1)
                        word[0] = word[0] | (nib[0] << (g * 4))
                        vals[g * 2] = v0[0]
                        vals[g * 2 + 1] = v1[0]
                    for j in T.vectorized(8):
                        k_values[(it * threads + tx) // KCH, ((it * threads + tx) % KCH) * 8 + j] = vals[j]
                    k_meta[(it * threads + tx) // KCH, (it * threads + tx) % KCH] = T.cast(word[0], "int16")

            # ---- V: dense as rows; sparse by channel (groups of 4 along tokens), stored transposed.
            v_src = T.make_tensor_from_addr(ADDR[1, l] + page_off, [B, H, D], u16)
            if INFO[i, 2] == 0:
                load_rows(v_src, h, tx, x)
                v_dense = T.make_tensor_from_addr(ADDR[5, l] + v_row * DENSE_BYTES, [B, D], u16)
                store_rows(v_dense, tx, x)
            else:
                d = tx % D
                t0 = (tx // D) * (GPT * 16)
                for k in T.unroll(GPT * 16):
                    x[k] = v_src[t0 + k, h, d]
                v_values = T.make_tensor_from_addr(ADDR[6, l] + v_row * VALUES_BYTES, [D, B // 2], u16)
                v_meta = T.make_tensor_from_addr(ADDR[7, l] + v_row * META_BYTES, [D, B // 16], "int16")
                for gg in T.unroll(GPT):
                    word[0] = 0
                    for g in T.unroll(4):
                        top2(x, gg * 16 + g * 4, mag, kp, nib, v0, v1)
                        word[0] = word[0] | (nib[0] << (g * 4))
                        vals[gg * 8 + g * 2] = v0[0]
                        vals[gg * 8 + g * 2 + 1] = v1[0]
                    meta[gg] = T.cast(word[0], "int16")
                for j in T.vectorized(GPT * 8):
                    v_values[d, t0 // 2 + j] = vals[j]
                for j in T.vectorized(GPT):
                    v_meta[d, t0 // 16 + j] = meta[j]

    return main


def _tiling_threads(items: int, most: int) -> int:
    """The most threads (whole warps, at most ``most``) that share ``items`` equally: 256 for the
    common shapes, fewer where the heads' row does not split into 256 (3 KV heads of 64: 192)."""
    for threads in range(min(most, items) // 32 * 32, 0, -32):
        if items % threads == 0:
            return threads
    raise ValueError(f"{items} work items do not tile whole warps")


def build_loss_prim_func(operand: str, kv_heads: int, head_dim: int, block_size: int, dtype: str = "float16",
                         threads: int = LOSS_THREADS, unroll: int = LOSS_UNROLL):
    """The loss kernel of one operand: grid ``(n, L)`` writes per-(layer, block) losses to ``LP [L, n]``,
    then a second kernel sums them over layers in order into ``OUT [n]``.

    Arguments: ``ADDR [L]`` int64 (the operand's k_buffer or v_buffer addresses), ``PAGES [n]`` int64,
    ``HW [L, H]`` float32 head weights (the store's ``loss_head_weights``: 1 for a head whose loss
    counts, 0 for one that a K head map keeps dense; each magnitude is multiplied by its head's weight
    before the min/max network, so weights of 1 change no bit), ``LP [L, n]`` float32 (scratch),
    ``OUT [n]`` float32.
    """
    import tilelang.language as T

    assert operand in ("k", "v")
    H, D, B = kv_heads, head_dim, block_size
    if D % 8 or B % 4:
        raise ValueError("head_dim must be a multiple of 8 and block_size of 4")
    C = H * D  # elements of one token row of the page (all heads)
    items = (B * C // 8) if operand == "k" else (B // 4) * (C // 8)
    threads = _tiling_threads(items, threads)
    per_thread = items // threads
    unroll = max(1, min(unroll, per_thread))
    while per_thread % unroll:
        unroll -= 1
    outer = per_thread // unroll
    ROWS = 1 if operand == "k" else 4  # rows (tokens) per item
    PAGE_BYTES = B * C * 2
    warps = threads // 32
    acc_t = "float32"
    n, L = T.dynamic("n, L")

    @T.macro
    def min2(a, b, c, d, acc):
        """acc += the two smallest of a, b, c, d (the magnitudes 2:4 pruning drops)."""
        lo1 = T.min(a, b)
        hi1 = T.max(a, b)
        lo2 = T.min(c, d)
        hi2 = T.max(c, d)
        acc[0] = acc[0] + (T.min(lo1, lo2) + T.min(T.max(lo1, lo2), T.min(hi1, hi2)))

    @T.prim_func
    def main(
        ADDR: T.Tensor([L], "int64"),
        PAGES: T.Tensor([n], "int64"),
        HW: T.Tensor([L, C // D], acc_t),  # [L, H]
        LP: T.Tensor([L, n], acc_t),
        OUT: T.Tensor([n], acc_t),
    ):
        with T.Kernel(n, L, threads=threads) as (i, l):
            tx = T.get_thread_binding()
            x = T.alloc_local([unroll * ROWS * 8], dtype)
            a = T.alloc_local([ROWS * 8], acc_t)
            acc = T.alloc_local([1], acc_t)
            wt = T.alloc_local([1], acc_t)
            red = T.alloc_shared([warps], acc_t)
            src = T.make_tensor_from_addr(ADDR[l] + PAGES[i] * PAGE_BYTES, [B * C // 8, 8], dtype)
            acc[0] = 0.0
            for o in T.serial(outer):
                for u in T.unroll(unroll):
                    for r in T.unroll(ROWS):
                        for j in T.vectorized(8):
                            if operand == "k":
                                x[(u * ROWS + r) * 8 + j] = src[(o * unroll + u) * threads + tx, j]
                            else:  # item = (token quad, 8-column vector): rows 4q .. 4q+3
                                x[(u * ROWS + r) * 8 + j] = src[
                                    (((o * unroll + u) * threads + tx) // (C // 8) * 4 + r) * (C // 8)
                                    + ((o * unroll + u) * threads + tx) % (C // 8), j]
                for u in T.unroll(unroll):
                    # an item's 8 columns lie in one head (head_dim is a multiple of 8)
                    wt[0] = HW[l, (((o * unroll + u) * threads + tx) % (C // 8)) // (D // 8)]
                    for j in T.unroll(ROWS * 8):
                        a[j] = T.abs(T.cast(x[u * ROWS * 8 + j], acc_t)) * wt[0]
                    if operand == "k":
                        min2(a[0], a[1], a[2], a[3], acc)
                        min2(a[4], a[5], a[6], a[7], acc)
                    else:
                        for j in T.unroll(8):
                            min2(a[j], a[8 + j], a[16 + j], a[24 + j], acc)
            for k in T.unroll(5):
                acc[0] = acc[0] + T.shfl_xor(acc[0], 16 >> k)
            if tx % 32 == 0:
                red[tx // 32] = acc[0]
            T.sync_threads()
            if tx == 0:
                acc[0] = 0.0
                for w in T.serial(warps):
                    acc[0] = acc[0] + red[w]
                LP[l, i] = acc[0]

        with T.Kernel(T.ceildiv(n, 128), threads=128) as bx:
            tx = T.get_thread_binding()
            tot = T.alloc_local([1], acc_t)
            if bx * 128 + tx < n:
                tot[0] = 0.0
                for layer in T.serial(L):
                    tot[0] = tot[0] + LP[layer, bx * 128 + tx]
                OUT[bx * 128 + tx] = tot[0]

    return main


@functools.lru_cache(maxsize=None)
def build_pack_kernel(kv_heads: int, head_dim: int, block_size: int, target=None):
    """Compile (or load from TileLang's cache) the pack kernel. Needs TileLang, not a GPU."""
    args = (kv_heads, head_dim, block_size)
    return compile_cached("pack", args, lambda: build_pack_prim_func(*args), PASS_CONFIGS, target or SM90_TARGET)


@functools.lru_cache(maxsize=None)
def build_loss_kernel(operand: str, kv_heads: int, head_dim: int, block_size: int, dtype: str = "float16",
                      target=None):
    """Compile (or load from TileLang's cache) the loss kernel of one operand. Needs TileLang, not a GPU."""
    args = (operand, kv_heads, head_dim, block_size, dtype)
    return compile_cached("loss", args, lambda: build_loss_prim_func(*args), PASS_CONFIGS, target or SM90_TARGET)


# --------------------------------------------------------------------------------------- plan / run
def _pinned_to(t: torch.Tensor, device) -> torch.Tensor:
    """Copy a small host tensor to ``device`` without a host sync (pinned, non-blocking; PyTorch's host
    allocator keeps the pinned block alive until the copy has run)."""
    if not torch.cuda.is_available():
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HieraSparseCompress:
    """Plan/run of the loss and pack kernels for one (KV heads, head_dim, block size, dtype).

    ``__init__`` compiles (or loads from TileLang's cache) the pack kernel; the loss kernels are built
    on first use (only fractional sparsities need them; ``build_all()`` builds them now). Every call is
    asynchronous on torch's current stream. Inputs live on the GPU:

    * ``addr``: the int64 ``[8, L]`` address table of :func:`address_table` (rows ``ADDR_ROWS``);
    * ``pages``: int64 or int32 ``[n]`` SGLang page ids (block ``i`` = rows ``pages[i]*B .. +B-1``).
    """

    MAX_GRID_Y = 65535  # the pack grid's y extent is the block count: longer prefixes are chunked

    def __init__(self, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device=None):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}")
        _check_shape(kv_heads, head_dim, block_size)
        self.kv_heads, self.head_dim, self.block_size, self.dtype = kv_heads, head_dim, block_size, dtype
        self.device = torch.device(device if device is not None else "cuda")
        self._dt = "float16" if dtype == torch.float16 else "bfloat16"
        self.pack_kernel = build_pack_kernel(kv_heads, head_dim, block_size)
        self._loss_kernels = {}

    def loss_kernel(self, operand: str):
        if operand not in self._loss_kernels:
            self._loss_kernels[operand] = build_loss_kernel(operand, self.kv_heads, self.head_dim, self.block_size,
                                                            self._dt)
        return self._loss_kernels[operand]

    def build_all(self) -> "HieraSparseCompress":
        self.loss_kernel("k")
        self.loss_kernel("v")
        return self

    def sources(self) -> dict[str, str]:
        """Generated CUDA of the kernels built so far (for inspection)."""
        out = {"pack": self.pack_kernel.get_kernel_source()}
        out.update({f"loss_{op}": k.get_kernel_source() for op, k in self._loss_kernels.items()})
        return out

    def loss(self, addr: torch.Tensor, pages: torch.Tensor, operand: str, head_weights: torch.Tensor) -> torch.Tensor:
        """float32 ``[n]``: per block, the L1 magnitude 2:4 pruning drops from ``operand`` ("k": groups
        along head_dim, "v": along tokens), summed over all layers of ``addr`` and the KV heads whose
        ``head_weights [L, H]`` (float32, 0 or 1) is 1."""
        row = ADDR_ROWS.index(f"{operand}_buffer")
        pages = pages.to(torch.int64)
        n, num_layers = pages.numel(), addr.shape[1]
        out = torch.empty(n, dtype=torch.float32, device=pages.device)
        if n == 0:
            return out
        if num_layers == 0:
            return out.zero_()
        scratch = torch.empty(num_layers, n, dtype=torch.float32, device=pages.device)
        self.loss_kernel(operand)(addr[row], pages, head_weights, scratch, out)
        return out

    def pack(self, addr: torch.Tensor, pages: torch.Tensor, info: torch.Tensor, k_rows: torch.Tensor) -> None:
        """Write every layer's blocks into the pools. ``info`` int32 ``[n, 4]``: per block (K sparse,
        K slot, V sparse, V slot); pool rows are ``slot * kv_heads + h``, except a K-sparse block's K,
        which goes where ``k_rows [L, H, 3]`` (the store's ``k_sparse_block_rows``) says."""
        pages = pages.to(torch.int64)
        info = info.to(torch.int32).contiguous()
        n = pages.numel()
        if n == 0 or addr.shape[1] == 0:
            return
        for s in range(0, n, self.MAX_GRID_Y):
            self.pack_kernel(addr, pages[s:s + self.MAX_GRID_Y], info[s:s + self.MAX_GRID_Y], k_rows)


def address_table(k_buffers, v_buffers, store) -> torch.Tensor:
    """int64 ``[8, L]`` on the store's device: per layer the data pointers of ``ADDR_ROWS`` (a pinned
    non-blocking upload). :class:`FusedCompressor` caches it per set of tensors."""
    rows = [k_buffers, v_buffers, store.k_dense, store.k_values, store.k_meta, store.v_dense, store.v_values,
            store.v_meta]
    ptrs = [[t.data_ptr() for t in row] for row in rows]
    return _pinned_to(torch.tensor(ptrs, dtype=torch.int64).reshape(len(rows), -1), store.device)


# ------------------------------------------------------------------------------ host-side decisions
def page_ids(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 ``[n]``: the SGLang page of each block of page-aligned token ``slots`` (on their device)."""
    n = slots.numel() // block_size
    return torch.div(slots.reshape(n, block_size)[:, 0].to(torch.int64), block_size, rounding_mode="floor")


def plan_choice(groups, n: int, operand: str) -> tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]:
    """The part of ``compress_prefix``'s block choice that needs no loss, decided on the host.

    ``rank_sparse`` makes the ``ceil(S·c)`` lowest-loss blocks of a group's ``c`` prunable blocks
    sparse: none when that count is 0, all of them when it is ``c``, whatever the losses. Returns
    (bool ``[n]`` CPU mask of blocks known to be sparse, ``[(CPU mask, count)]`` of the groups that
    must be ranked by loss). Masks on a GPU are read back (a sync; the radix hook passes CPU masks).
    """
    fixed = torch.zeros(n, dtype=torch.bool)
    ranked = []
    for mask, sk, sv in groups:
        mask = mask.detach().to("cpu", torch.bool).reshape(-1)
        count = int(mask.sum())
        k = sparse_count(count, sk if operand == "k" else sv)
        if k == 0:
            continue
        if k == count:
            fixed |= mask
        else:
            ranked.append((mask, k))
    return fixed, ranked


def rank_on_device(loss: torch.Tensor, ranked: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """bool ``[n]`` on ``loss``'s device: per group, its ``count`` lowest-loss blocks, with the exact ops
    of ``sglang_hs.pruner.rank_sparse`` (stable argsort of the loss, +inf outside the group), but with
    the counts known on the host (no sync)."""
    sparse = torch.zeros(loss.shape, dtype=torch.bool, device=loss.device)
    for mask, count in ranked:
        mask = _pinned_to(mask, loss.device) if loss.is_cuda else mask
        order = torch.where(mask, loss, torch.inf).argsort(dim=-1, stable=True)
        sparse.scatter_(-1, order[:count], True)
    return sparse


def block_info(store, vbs: list[int]) -> torch.Tensor:
    """int32 ``[n, 4]`` (host): per virtual block (K sparse, K slot, V sparse, V slot) as the store
    allocated them."""
    rows = [tuple(store.placement(vb)) for vb in vbs]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(vbs), 4)


def is_magnitude(pruner) -> bool:
    """True if ``pruner`` keeps the top-2 |x| of each group and ranks blocks by the L1 of the rest."""
    cls = type(pruner)
    return (isinstance(pruner, MagnitudePruner) and cls.element_scores is MagnitudePruner.element_scores
            and cls.element_mask is Pruner.element_mask and cls.block_loss is Pruner.block_loss
            and cls.operand_loss is Pruner.operand_loss)


def unsupported_reason(store, pruner, k_buffers, v_buffers, slots) -> str | None:
    """Why the fused kernels cannot serve this call (None if they can)."""
    if not is_magnitude(pruner):
        return f"pruner {type(pruner).__name__} is not the magnitude pruner"
    if not (slots.is_cuda and store.device.type == "cuda"):
        return "not on a CUDA device"
    if store.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {store.dtype}"
    if torch.cuda.get_device_capability(store.device)[0] != 9:
        return "the kernels are built for sm_90a (Hopper)"
    try:
        _check_shape(store.kv_heads, store.head_dim, store.block_size)
    except ValueError as exc:
        return str(exc)
    if len(k_buffers) != store.num_layers or len(v_buffers) != store.num_layers:
        return "buffer count differs from the store's layers"
    shape = (store.kv_heads, store.head_dim)
    for t in (*k_buffers, *v_buffers):
        if (t.device != store.device or t.dtype != store.dtype or tuple(t.shape[1:]) != shape
                or not t.is_contiguous() or t.data_ptr() % 16):
            return "a KV buffer is not a contiguous [slots, Hkv, D] tensor of the store's dtype and device"
    try:
        import tilelang  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"TileLang unavailable: {exc}"
    return None


# ------------------------------------------------------------------------------- FusedCompressor
class FusedCompressor:
    """:func:`sglang_hs.pools.compress_prefix` on the fused kernels: same arguments, same result
    (virtual block ids, pools, index maps), bit for bit. Falls back to the PyTorch version when the
    kernels do not apply (see :func:`unsupported_reason`).

    One instance serves one process (the runtime owns it): it keeps the kernel plans and the address
    tables it builds, so that a call after the first costs launches only.
    """

    MAX_ADDRESS_TABLES = 16
    """Address tables kept (one per set of KV buffers and pools; a server has one)."""

    def __init__(self):
        self._plans: dict[tuple, HieraSparseCompress] = {}
        self._address_tables: dict[tuple, torch.Tensor] = {}
        self._reported: set[str] = set()

    def plan(self, store) -> HieraSparseCompress:
        """The kernels for the store's shape and dtype (compiled, or loaded from TileLang's cache, once)."""
        key = (store.kv_heads, store.head_dim, store.block_size, store.dtype, str(store.device))
        if key not in self._plans:
            self._plans[key] = HieraSparseCompress(*key)
        return self._plans[key]

    def address_table(self, k_buffers, v_buffers, store) -> torch.Tensor:
        """:func:`address_table`, built once per set of tensors and kept by their data pointers."""
        rows = [k_buffers, v_buffers, store.k_dense, store.k_values, store.k_meta, store.v_dense,
                store.v_values, store.v_meta]
        key = (str(store.device), tuple(tuple(t.data_ptr() for t in row) for row in rows))
        table = self._address_tables.get(key)
        if table is None:
            if len(self._address_tables) >= self.MAX_ADDRESS_TABLES:
                self._address_tables.pop(next(iter(self._address_tables)))
            table = self._address_tables[key] = address_table(k_buffers, v_buffers, store)
        return table

    def __call__(self, store, pruner, k_buffers, v_buffers, slots, groups, *, backend=None,
                 reduce_losses=None) -> list[int]:
        """Steps: page ids from ``slots`` (device op); the block choice that needs no loss, on the host
        (:func:`plan_choice`); for groups with a fractional count only, the loss pass of that operand
        and a ranking on the GPU, read back once; ``store.allocate``; one pack launch for all layers.
        ``backend``: an object with :class:`HieraSparseCompress`'s ``loss(addr, pages, operand,
        head_weights)`` / ``pack(addr, pages, info, k_rows)``, and optionally ``address_table(k_buffers, v_buffers, store)``
        (default: the TileLang plan; the tests pass :class:`TorchEmulation` on CPU). ``reduce_losses``:
        as in :func:`sglang_hs.pools.compress_prefix` (tensor parallelism)."""
        if backend is None:
            reason = unsupported_reason(store, pruner, k_buffers, v_buffers, slots)
            if reason is not None:
                if reason not in self._reported:
                    self._reported.add(reason)
                    logger.info("hierasparse: fused compression not used (%s); PyTorch path", reason)
                return compress_prefix(store, pruner, k_buffers, v_buffers, slots, groups,
                                       reduce_losses=reduce_losses)
            backend = self.plan(store)
        n = slots.numel() // store.block_size
        if n == 0:
            return compress_prefix(store, pruner, k_buffers, v_buffers, slots, groups, reduce_losses=reduce_losses)
        device = slots.device
        pages = page_ids(slots, store.block_size)
        own_table = getattr(backend, "address_table", None)
        addr = (own_table or self.address_table)(k_buffers, v_buffers, store)
        choice = {op: plan_choice(groups, n, op) for op in ("k", "v")}
        losses = {op: backend.loss(addr, pages, op, store.loss_head_weights[op]) for op, (_, rk) in choice.items()
                  if rk}  # fmt: skip
        if losses and reduce_losses is not None:
            losses = dict(zip(losses, reduce_losses(torch.stack(list(losses.values()))).unbind(0)))
        ranked = {op: rank_on_device(losses[op], choice[op][1]) for op in losses}
        if ranked:
            back = torch.stack(list(ranked.values())).cpu()  # the one host sync: the allocator needs the choice
            ranked = dict(zip(ranked, back))
        sparse = {op: fixed | ranked[op] if op in ranked else fixed for op, (fixed, _) in choice.items()}
        vbs = store.allocate(sparse["k"].tolist(), sparse["v"].tolist())
        info = block_info(store, vbs)
        backend.pack(addr, pages, _pinned_to(info, device) if device.type == "cuda" else info,
                     store.k_sparse_block_rows)
        return vbs


# ---------------------------------------------------------------------------- PyTorch emulation
def top2_network(bits: torch.Tensor) -> torch.Tensor:
    """bool keep mask of the pack kernel's compare network, groups of 4 along the last axis.

    ``bits``: the 16-bit words of fp16/bf16 values (any integer dtype holding them); ``|x|`` is
    compared as the integer ``bits & 0x7FFF``; ``c_ij = |x_j| > |x_i|`` for ``i < j``; element ``i`` is
    kept iff fewer than two elements outrank it (ties go to the lower index).
    """
    mag = (bits.to(torch.int32) & 0x7FFF).reshape(*bits.shape[:-1], -1, 4)
    m0, m1, m2, m3 = mag.unbind(-1)
    c01, c02, c03 = (m1 > m0).int(), (m2 > m0).int(), (m3 > m0).int()
    c12, c13, c23 = (m2 > m1).int(), (m3 > m1).int(), (m3 > m2).int()
    keep = torch.stack([c01 + c02 + c03 < 2, 1 - c01 + c12 + c13 < 2, 2 - c02 - c12 + c23 < 2,
                        3 - c03 - c13 - c23 < 2], dim=-1)
    return keep.reshape(bits.shape)


def pack_words(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pack kernel's output for 16-bit ``x`` with ``keep`` (2 of 4 along the last axis): values
    ``[..., N/2]`` and int16 metadata ``[..., N/16]`` (nibble ``idx0 | idx1 << 2`` per group, lowest
    group in the lowest bits), built from ``idx0 = lowest kept, idx1 = highest kept``."""
    g = keep.reshape(*keep.shape[:-1], -1, 4)
    k0, k1, k2, k3 = g.unbind(-1)
    idx0 = torch.where(k0, 0, torch.where(k1, 1, 2))
    idx1 = torch.where(k3, 3, torch.where(k2, 2, 1))
    xg = x.reshape(g.shape)
    values = torch.stack([xg.gather(-1, idx0[..., None])[..., 0], xg.gather(-1, idx1[..., None])[..., 0]], -1)
    nib = (idx0 | (idx1 << 2)).to(torch.int32).reshape(*keep.shape[:-1], -1, 4)
    word = nib[..., 0] | (nib[..., 1] << 4) | (nib[..., 2] << 8) | (nib[..., 3] << 12)
    word = torch.where(word >= 1 << 15, word - (1 << 16), word).to(torch.int16)
    return values.reshape(*x.shape[:-1], x.shape[-1] // 2), word


def dropped_l1(a: torch.Tensor) -> torch.Tensor:
    """float32 sum of the two smallest of each group of 4 along the last axis of magnitudes ``a`` (what
    the loss kernel adds per group): ``[..., N] -> [..., N/4]``."""
    g = a.reshape(*a.shape[:-1], -1, 4)
    lo1, hi1 = torch.minimum(g[..., 0], g[..., 1]), torch.maximum(g[..., 0], g[..., 1])
    lo2, hi2 = torch.minimum(g[..., 2], g[..., 3]), torch.maximum(g[..., 2], g[..., 3])
    return torch.minimum(lo1, lo2) + torch.minimum(torch.maximum(lo1, lo2), torch.minimum(hi1, hi2))


class TorchEmulation:
    """The kernels' arithmetic in plain PyTorch on any device (a ``backend`` for :class:`FusedCompressor`):
    the integer compare network, the metadata built from kept positions, the min/max loss network,
    pool rows ``slot * Hkv + h``, pages as whole tiles. The CPU tests run the wrapper on it; the GPU
    tests compare the kernels with the PyTorch path directly."""

    def address_table(self, k_buffers, v_buffers, store):
        return (list(k_buffers), list(v_buffers), store)

    @staticmethod
    def _tiles(buffer: torch.Tensor, pages: torch.Tensor, block_size: int) -> torch.Tensor:
        rows = pages.to(buffer.device, torch.int64)[:, None] * block_size + torch.arange(block_size, device=buffer.device)
        return buffer[rows]  # [n, B, H, D]

    def loss(self, addr, pages, operand, head_weights):
        k_buffers, v_buffers, store = addr
        B = store.block_size
        total = torch.zeros(pages.numel(), dtype=torch.float32, device=pages.device)
        for layer, buffer in enumerate(k_buffers if operand == "k" else v_buffers):
            a = self._tiles(buffer, pages, B).float().abs() * head_weights[layer].to(pages.device)[:, None]
            if operand == "v":  # groups along tokens
                a = a.movedim(1, -1)
            total = total + dropped_l1(a).sum(dim=(1, 2, 3))
        return total

    def pack(self, addr, pages, info, k_rows):
        k_buffers, v_buffers, store = addr
        B, H = store.block_size, store.kv_heads
        info = info.to(pages.device, torch.int64)
        k_rows = k_rows.to(pages.device, torch.int64)
        heads = torch.arange(H, device=pages.device)
        for layer, (kb, vb) in enumerate(zip(k_buffers, v_buffers)):
            for op, buffer in (("k", kb), ("v", vb)):
                tiles = self._tiles(buffer, pages, B).transpose(1, 2)  # [n, H, B, D]
                block_sparse, slot = info[:, 0 if op == "k" else 2] != 0, info[:, 1 if op == "k" else 3]
                rows = slot[:, None] * H + heads[None, :]  # [n, H]
                sparse = block_sparse[:, None].expand(-1, H)
                if op == "k":  # a K-sparse block's heads go where the store's K row table says
                    mapped, stride, offset = k_rows[layer].unbind(-1)
                    rows = torch.where(block_sparse[:, None], slot[:, None] * stride + offset, rows)
                    sparse = sparse & (mapped != 0)
                dense_pool = getattr(store, f"{op}_dense")[layer]
                dense_pool[rows[~sparse]] = tiles[~sparse]
                if bool(sparse.any()):
                    x = tiles[sparse]  # [m, B, D]
                    if op == "v":
                        x = x.transpose(-1, -2)  # V^T: tokens become the last axis
                    bits = x.contiguous().view(torch.int16)
                    values, meta = pack_words(bits, top2_network(bits))
                    getattr(store, f"{op}_values")[layer][rows[sparse]] = values.view(x.dtype)
                    getattr(store, f"{op}_meta")[layer][rows[sparse]] = meta
