"""Split-KV decode attention over mixed dense / 2:4-sparse KV blocks (TileLang 0.1.11, Hopper sm_90a).

One decode step of one layer: every request has one query token that attends to all ``seq_len``
tokens of its KV. The KV of a request is a row of ``block_table`` whose entries are either SGLang
cache pages (dense, read from ``k_cache``/``v_cache``) or compressed virtual blocks, resolved per KV
head through the signed index maps into one layer's ``BlockPools`` (dense pool rows or 2:4 values +
int16 metadata). ``sglang_hs.reference.paged_attention`` is the oracle; :class:`HieraSparseDecode` is
the plan/run API the backend calls (tensor shapes: :meth:`HieraSparseDecode.run`). Measurements and
the variants tried are in ``docs/kernels.md``.

Design (and why)
----------------
* **Trans-Both GEMMs.** Only the A operand of ``wgmma.sp`` may be sparse, so the block loop computes
  ``S^T = K·Q^T`` (``[B, N]``, A = K, sparse along head_dim) and ``O^T += V^T·P^T`` (``[D, N]``,
  A = V^T, sparse along tokens, stored K-major as ``v_values [D, B/2]``). Dense blocks use the same
  shapes with ``T.gemm`` (``wgmma``), sparse blocks ``T.gemm_sp`` (``wgmma.sp``); the accumulators are
  shared, so both paths fold into one online softmax.
* **GQA as the GEMM N dim.** One CTA (one warpgroup) serves the ``G = Hq/Hkv`` query heads of one KV
  head, so every KV byte is read once. N is padded to 8 for G up to 8 (16 up to G = 16):
  ``m64n8`` is a legal wgmma shape and avoids TileLang's N = 24/40 bug (issue #2603) and wasted
  accumulator registers.
* **Split-KV.** Grid ``(num_splits, Hkv, bs)``: each CTA walks a contiguous range of its request's
  blocks and writes a partial ``O`` (fp32) and base-2 LSE to plan-owned scratch. The last CTA of a
  (request, KV head) to finish (an acq_rel atomic ticket per pair, reset by that CTA) merges the
  splits into ``out`` and the natural-log LSE, so a call is one kernel launch. A decode batch has few
  (request, KV head) pairs for 132 SMs, so splitting is what fills the GPU; the split count is chosen
  per call shape on the host from the SM count and the CTAs that fit an SM (:func:`plan_num_splits`).
* **One kernel per model shape.** The batch size, the block table's width and the split count are
  dynamic (``T.dynamic``; the split count is ``o_part``'s third extent and the grid's x extent), so a
  server compiles one decode kernel whatever its CUDA-graph batch sizes and context length. A CTA's
  index maps have a fixed capacity (:data:`SPLIT_CAPACITY` blocks) and plans use at least
  ``ceil(width / SPLIT_CAPACITY)`` splits, so shared memory, and the CTAs per SM, do not depend on
  the context either.
* **Data-dependent dispatch without losing the pipeline.** Decode is memory bound; the win is reading
  0.5625x the bytes of a sparse block, so what matters is bytes in flight. TileLang's ``T.Pipelined``
  does not pipeline copies whose shape depends on a runtime branch, so the loop is software-pipelined
  by hand: ``stages`` shared-memory stages with their own mbarriers; one elected thread issues the TMA
  loads of block ``j + stages - 1`` *before* the CTA waits on block ``j``, choosing per block between
  a cache page (a strided 3-D TMA box), a dense pool row, or values + metadata of a sparse row; the
  consumers branch on the same per-block mode to ``gemm`` or ``gemm_sp``. A prologue resolves the
  block-table and index-map entries of all the CTA's blocks at once (128 threads in parallel) into
  shared memory, so the two dependent index loads are paid once per CTA, not once per block.
* **Stage buffers and occupancy.** A stage holds the dense tiles and the sparse values + metadata of
  K and V (50 KB at D = 128); only one form per operand is filled per block. Aliasing them does not
  survive TileLang 0.1.11's layout inference (buffers that share storage get one layout, and unequal
  sizes are rejected). Two stages with two CTAs per SM: one CTA's block step is a serial chain
  (issue, wait, wgmma, softmax, wgmma), and a second resident CTA hides it.
* **Compact stages for 2:4 K and V stores** (:func:`decode_compact`). The any-form stages hold every form
  for the few cache pages and dense rows a request has, which caps the kernel at two CTAs an SM, and its
  block step is a dependent chain that only more resident CTAs hide. A store whose compressed blocks all
  have 2:4 K and V decodes with a build whose stages hold only those (18 KB at d 128 against 50: four
  CTAs an SM). It takes the compressed blocks of its split and, dealt by place modulo the split count,
  the request's other blocks (sink, windows, tail): their K and V pass through the stage's 2:4 values
  tile a head_dim half at a time (``[B, D/2]``, the tile's shape), as dense GEMMs, so a split's range is
  at most half its maps (:func:`split_reach`). A CTA keeps its blocks in order (a warp ballot per 32),
  each with its place for the mask and the block LSE. Needs d >= 128 (a half is the V GEMM's M).
* **Lane softmax.** ``S^T`` is staged in shared memory and each query head (column) belongs to
  ``128 / N`` consecutive lanes, so the block max is a few shuffles, the row sums stay per lane until
  the end, and a block step has 3 CTA barriers.
* **Metadata by TMA.** The int16 metadata tile of a block is contiguous (1 KB at d 128); it is moved
  as a ``[E/16, 16]`` box and re-viewed as the ``[M, K/16]`` tile that ``T.gemm_sp`` reads.
* **TileLang 0.1.11 work-arounds.** ``T.fence_proxy_async()`` after ``P^T`` is written to shared
  memory and after ``Q`` is staged, before any (sparse) wgmma reads them (TileLang issue #2634). The
  automatic thread-sync pass puts ``__syncthreads`` inside the elected-thread TMA branches (a
  deadlock), so it is disabled and the kernel places its own barriers: one at the top of each block
  step (WAR on the refilled stage, ``P_s`` and ``scores_sh``), one after ``S^T`` is staged and one
  after ``P^T`` is written.
* **Per-block LSE for the decode modes.** A runtime flag (no second kernel) makes each block step also
  add its probabilities per query head across the column's lanes and store the block's own LSE, from
  which an anchor layer's choice is made (``sglang_hs.decode_modes``); the other layers read a
  compacted block table with the same kernel.
* **FP8 store values.** A compile-time variant (``store_fp8``) reads e4m3 pool rows and their float32
  row scales: the rows land by TMA in e4m3 tiles of the stage and the warpgroup converts them to the
  stage's 16-bit tiles before the GEMMs; the K scale multiplies the block's scores, the V scale the
  probabilities of the V GEMM (:func:`build_decode_prim_func`). Its landing tiles leave one CTA an SM at
  d 128 (two at d 64).
* **CUDA graphs.** ``run`` is one launch; scratch is allocated once, for the plan's largest batch,
  and every call views its prefix, so graphs captured at different batch sizes share it at fixed
  addresses; no host synchronisation (seq_lens stay on the GPU: block ranges, masks and empty splits
  are computed in the kernel); TileLang launches on torch's current stream. Empty pools are replaced
  by one-row stand-ins (never read) because a TMA descriptor cannot describe a zero-length tensor. A
  plan's scratch and tickets are its own: one call at a time.

The module imports neither TileLang nor a GPU at import time; ``build_decode_kernel`` does.
"""

import functools
from typing import Callable

import torch

from sglang_hs.format import FP8_DTYPE, BlockPools
from sglang_hs.kernels.common import (
    ANY_FORMS, LN2, LOG2E, PASS_CONFIGS, SMEM_PER_SM, KvSources, PoolArgs, Stage, check_plan_shape,
    compile_cached, entry_mode, entry_row, fp8_landing_bytes, pin_source, precompile_main, split_count,
    stage_form_bytes, tma_loads,
)

pin_source(__file__)

STAGES = 2
THREADS = 128  # one warpgroup: wgmma M = 64 per instruction
SPLIT_CAPACITY = 512
"""Blocks one CTA can walk (its index maps in shared memory, 6 KB): plans use at least
``ceil(max_blocks / SPLIT_CAPACITY)`` splits. At d 128 two CTAs still fit an SM (the 32K benchmark's
CTAs take 128-133 blocks)."""
MAX_SPLITS = 128


MAX_COLUMNS = 16
"""The widest N (query heads of one KV head, padded) the kernel takes: a model's GQA group is at most 16."""


def _n_pad(group: int) -> int:
    """N of the block GEMMs: the group padded to 8 or 16 (legal wgmma N, 128 / N lanes a column)."""
    if group > MAX_COLUMNS:
        raise ValueError(f"{group} query heads per KV head > {MAX_COLUMNS} is not supported")
    return next(n for n in (8, 16) if group <= n)


def smem_bytes(head_dim: int, block_size: int, stages: int, group: int, blocks_per_split: int = SPLIT_CAPACITY,
               store_fp8: bool = False, forms: tuple[str, str] = ANY_FORMS) -> int:  # fmt: skip
    """Shared memory of one CTA (bytes), an upper bound of the buffers of :func:`build_decode_prim_func`
    (its index maps hold ``blocks_per_split`` entries: the kernel's :data:`SPLIT_CAPACITY`). ``store_fp8``:
    each stage also has the e4m3 landing tiles of K and V pool rows, and the maps the blocks' K and V
    scales (float32). ``forms``: the block forms the stages hold (K, V)."""
    n = _n_pad(group)
    stage = sum(stage_form_bytes(form, block_size, head_dim) for form in forms)
    other = n * head_dim * 2 + block_size * n * 6 + 3 * blocks_per_split * 4 + 4 * 512  # Q, P, S^T, maps
    if tuple(forms) in COMPACT_FORMS:
        other += n * head_dim * 2  # the compact kernel's Q halves (dense blocks)
    if store_fp8:
        stage += 2 * fp8_landing_bytes("any", block_size, head_dim)
        other += 2 * blocks_per_split * 4
    return stages * stage + other


def min_splits(max_blocks: int, capacity: int = SPLIT_CAPACITY) -> int:
    """The fewest splits that fit a block table ``max_blocks`` wide: a CTA resolves at most
    ``capacity`` (:data:`SPLIT_CAPACITY`) blocks."""
    return max(1, -(-max_blocks // capacity))


def build_decode_prim_func(q_heads: int, kv_heads: int, head_dim: int, block_size: int = 64, dtype: str = "float16",
                           stages: int = STAGES, split_capacity: int = SPLIT_CAPACITY,
                           min_split_blocks: int = 1, store_fp8: bool = False, cache_fp8: bool = False,
                           compact: tuple[str, str] | None = None):  # fmt: skip
    """The TileLang ``prim_func`` of one model shape. The batch size, the block table's width and the
    split count are dynamic (bound from the arguments' shapes), so one kernel serves every plan.
    ``min_split_blocks`` > 1 gives every split of a request at least that many blocks and lets the
    splits past its blocks exit at once (the merge takes only the splits with blocks): a plan for long
    requests then costs a short one a CTA per few blocks, not one per split (the shared-prefix decode's
    own pass, whose requests are mostly a short tail).

    Arguments, in order (``S`` = the split count, bound from ``o_part``'s shape; it must be at least
    ``min_splits(max_blocks)``): ``q [bs, Hq, D]``, ``k_cache, v_cache [slots, Hkv, D]``, the six pools
    as :class:`sglang_hs.kernels.common.PoolArgs` gives them (``k_dense [rows, B, D]``, ``k_values
    [rows, B, D/2]``, ``k_meta [rows, B*D/256, 16]`` int16, ``v_dense [rows, B, D]``, ``v_values [rows,
    D, B/2]``, ``v_meta [rows, B*D/256, 16]`` int16), ``k_index, v_index [Hkv, n_virtual]``,
    ``block_table [bs, max_blocks]``, ``seq_lens [bs]``, ``sm_scale``, ``o_part [bs, Hq, S, D]`` and
    ``lse_part [bs, Hq, S]`` (fp32 split partials), ``out [bs, Hq, D]``, ``lse [bs, Hq]`` (fp32,
    natural log), ``tickets [bs, Hkv]`` (int32 split tickets, zero between calls), ``want_block_lse``
    (int32: non-zero also writes each block's own LSE), ``block_lse [bs*Hq, W]`` (fp32, natural log:
    row ``r*Hq + head``, column = the block's place in the request's table; a ``[1, 1]`` stand-in when
    not wanted). Every tensor is contiguous.

    ``store_fp8``: the pools' values (``k_dense``, ``k_values``, ``v_dense``, ``v_values``) are e4m3
    (:data:`sglang_hs.format.FP8_DTYPE`) and their float32 row scales follow ``v_meta``
    (``k_dense_scale [k_dense_rows]``, ``k_values_scale [k_sparse_rows]``, ``v_dense_scale
    [v_dense_rows]``, ``v_values_scale [v_sparse_rows]``, as ``PoolArgs(..., scales=True)`` gives them);
    cache pages stay 16-bit. Pool rows land by TMA in e4m3 tiles of the stage and are converted to its
    16-bit tiles after the stage's barrier (exact: every e4m3 value is a 16-bit value); the K scale
    multiplies the block's scores before the softmax, the V scale the probabilities written for the V
    GEMM (the row sums take them unscaled). Cache pages have scale 1.

    ``cache_fp8`` (with ``store_fp8``): ``k_cache``/``v_cache`` are e4m3 too (SGLang's FP8 pages, unit
    scales); they land in the e4m3 dense tiles and are converted like dense pool rows.

    ``compact`` (one of :data:`COMPACT_FORMS`, 16-bit, d >= 128, no split floor): the stages hold those forms
    only; the CTA takes the compressed blocks of its split's range (at most ``split_capacity / 2``) and the
    request's other blocks whose place is its split modulo ``S``, which it reads a head_dim half at a time
    through the stage's values tile.
    """
    import tilelang.language as T

    B, D = block_size, head_dim
    G = q_heads // kv_heads
    NH = _n_pad(G)
    accum = "float32"
    threads = THREADS
    bps = split_capacity  # index-map entries a CTA holds: the most blocks a split may have
    e_rows = B * D // 16 // 16  # metadata tile as [e_rows, 16] int16 (contiguous 2*B*D/16 bytes)
    assert q_heads % kv_heads == 0 and D % 32 == 0 and B % 32 == 0 and stages >= 2
    TPC = threads // NH  # threads per column (a power of two dividing 32)
    RPT = B // TPC  # rows per thread
    SHUF = [TPC >> k for k in range(1, TPC.bit_length()) if TPC >> k]  # xor offsets TPC/2 .. 1
    # The call's dynamic extents (bound from the arguments' shapes).
    (num_slots, k_dense_rows, k_sparse_rows, v_dense_rows, v_sparse_rows, num_virtual, batch, max_blocks,
     S, lse_rows, lse_cols) = T.dynamic("num_slots, k_dense_rows, k_sparse_rows, v_dense_rows, v_sparse_rows, "
                                       "num_virtual, batch, max_blocks, num_splits, lse_rows, lse_cols")
    assert store_fp8 or not cache_fp8
    pool_dtype = "float8_e4m3" if store_fp8 else dtype  # the pools' values
    cache_dtype = "float8_e4m3" if cache_fp8 else dtype  # the cache pages'
    fold = compact is not None
    k_form, v_form = compact if fold else ANY_FORMS  # the forms the stages hold
    # The compact kernel also takes the blocks its stages cannot hold (cache pages, dense rows): their K and V
    # go through its 2:4 values tile a head_dim half at a time, as dense GEMMs.
    HD = D // 2
    assert not fold or (tuple(compact) in COMPACT_FORMS and not store_fp8 and min_split_blocks == 1 and HD >= 64)
    load_k, load_v = tma_loads(T, B, k_form, v_form, store_fp8=store_fp8, cache_fp8=cache_fp8)

    def fp8_landing():  # e4m3 tiles that pool rows land in (store_fp8), converted to the 16-bit ones
        return (T.alloc_shared([B, D], pool_dtype), T.alloc_shared([B, D // 2], pool_dtype),
                T.alloc_shared([B, D], pool_dtype), T.alloc_shared([D, B // 2], pool_dtype)) if store_fp8 else ()

    def shared(form, kind, shape, dt):  # a buffer of a form the stages hold, else None
        return T.alloc_shared(shape, dt) if form in ("any", kind) else None

    def alloc_stages():  # the forms' tiles of K and V (every form: cache pages, dense and 2:4 rows)
        return [Stage(shared(k_form, "dense", [B, D], dtype), shared(k_form, "sparse", [B, D // 2], dtype),
                      shared(k_form, "sparse", [e_rows, 16], "int16"), shared(v_form, "dense", [B, D], dtype),
                      shared(v_form, "sparse", [D, B // 2], dtype), shared(v_form, "sparse", [e_rows, 16], "int16"),
                      T.alloc_barrier(threads), None, *fp8_landing()) for _ in range(stages)]

    # Plain Python helpers (store_fp8): the blocks' K and V scales (float32, shared, resolved with the
    # modes), appended to the maps; a 16-bit kernel has none and its expressions are unchanged.
    def alloc_scale_maps():
        return (T.alloc_shared([bps], accum), T.alloc_shared([bps], accum)) if store_fp8 else ()

    def make_maps(block_mode, block_k_row, block_v_row, scale_maps):
        return (block_mode, block_k_row, block_v_row) + tuple(scale_maps)

    # A compact kernel's maps hold only the blocks it takes, each mode packed with the block's place in
    # the split (``mode | place << 4``); a plain kernel's hold every block of the split in order.
    def mode_of(maps, j):
        return maps[0][j] & 15 if fold else maps[0][j]

    def place_of(maps, j):
        return maps[0][j] >> 4 if fold else j

    def fits(mode):  # 1 when the compact stages hold a block of this mode (k_mode | v_mode << 2)
        fit = 1
        for form, m in zip(compact or (), (mode & 3, mode >> 2)):
            if form != "any":
                fit = fit * T.if_then_else((m == 2) if form == "sparse" else (m != 2), 1, 0)
        return fit

    def k_scaled(x, maps, j):  # a score of block j times its K scale
        return x * maps[3][j] if store_fp8 else x

    def v_scaled(x, maps, j):  # a probability of block j times its V scale (for the V GEMM only)
        return x * maps[4][j] if store_fp8 else x

    @T.macro
    def convert_tiles(mode, stage):
        # The block's e4m3 tiles into its 16-bit ones (dense: a pool row, or a cache page with cache_fp8).
        if (mode & 3) != 2:
            for r, c in T.Parallel(B, D):
                stage.k_dense[r, c] = T.cast(T.cast(stage.k_dense8[r, c], accum), dtype)
        else:
            for r, c in T.Parallel(B, D // 2):
                stage.k_values[r, c] = T.cast(T.cast(stage.k_values8[r, c], accum), dtype)
        if (mode >> 2) != 2:
            for r, c in T.Parallel(B, D):
                stage.v_dense[r, c] = T.cast(T.cast(stage.v_dense8[r, c], accum), dtype)
        else:
            for r, c in T.Parallel(D, B // 2):
                stage.v_values[r, c] = T.cast(T.cast(stage.v_values8[r, c], accum), dtype)
        T.fence_proxy_async()
        T.sync_threads()

    @T.macro
    def convert_fp8(mode, stage):
        # store_fp8: the block's e4m3 pool rows (landed in the stage's e4m3 tiles) into its 16-bit tiles,
        # by every thread, then made visible to the wgmma (async proxy). 16-bit cache pages (mode 0) need
        # nothing; e4m3 ones (cache_fp8) are converted too (a compile-time True: every block converts).
        if cache_fp8 or mode != 0:
            convert_tiles(mode, stage)

    @T.macro
    def load_half(cache, pool, m, row, h, dh, tile, barrier):
        # Head_dim half dh of a dense block's K or V (m: 0 a cache page, 1 a dense pool row) into a
        # [B, D/2] tile.
        if m == 0:
            T.tma_copy(cache[row * B:(row + 1) * B, h, dh * HD:(dh + 1) * HD], tile, barrier=barrier)
        else:
            T.tma_copy(pool[row, :, dh * HD:(dh + 1) * HD], tile, barrier=barrier)

    @T.macro
    def issue(i, h, maps, stage, src):
        # The TMA loads of block i (K and V, by its resolved mode and rows) into a stage.
        mode = mode_of(maps, i)
        k_row = maps[1][i]
        v_row = maps[2][i]
        if fold:
            # A dense block's first K half lands in the values tile; the rest of it comes in the step.
            if (mode & 3) == 2:
                load_k(mode, k_row, h, stage, src)
            else:
                load_half(src.k_cache, src.k_dense, mode & 3, k_row, h, 0, stage.k_values, stage.full)
            if (mode >> 2) == 2:
                load_v(mode, v_row, h, stage, src)
        else:
            load_k(mode, k_row, h, stage, src)
            load_v(mode, v_row, h, stage, src)
        T.barrier_arrive(stage.full)

    @T.macro
    def fetch_half(cache, pool, m, row, h, dh, tile, dense_bar, dense_phase):
        # In a step of the compact kernel: one more head_dim half of a dense block into the values tile,
        # once every warp's GEMMs have read it (the GEMMs wait for their wgmma).
        T.sync_threads()
        load_half(cache, pool, m, row, h, dh, tile, dense_bar)
        T.barrier_arrive(dense_bar)
        T.barrier_wait(dense_bar, dense_phase[0])
        dense_phase[0] = dense_phase[0] ^ 1

    @T.macro
    def dense_v_half(m, row, h, dh, src, stage, P_s, oT, folded):
        # O^T rows of head_dim half dh += V_half^T·P^T (the half as the GEMM's transposed A).
        Q_lo, Q_hi, oT_half, dense_bar, dense_phase = folded
        fetch_half(src.v_cache, src.v_dense, m, row, h, dh, stage.k_values, dense_bar, dense_phase)
        T.gemm(stage.k_values, P_s, oT_half, transpose_A=True, clear_accum=True)
        for d, g in T.Parallel(HD, NH):
            oT[dh * HD + d, g] += oT_half[d, g]

    @T.macro
    def compute(j, first_pos, seq_len, scale_log2, maps, Q_s, P_s, stage, parity, sT, oT, scores_sh, rescale_sh,
                lane_scores, run_max, run_sum, block_sum, want_block_lse, block_lse, lse_row, h, src, folded):
        # Block j: S^T = K·Q^T, the lane softmax (TPC consecutive lanes own a column), O^T += V^T·P^T.
        mode = mode_of(maps, j)
        if store_fp8:
            convert_fp8(mode, stage)
        if fold:
            if (mode & 3) == 2:
                T.gemm_sp(stage.k_values, T.view(stage.k_meta, [B, D // 16]), Q_s, sT, transpose_B=True,
                          clear_accum=True)
            else:  # S^T = K_lo·Q_lo^T + K_hi·Q_hi^T
                T.gemm(stage.k_values, folded[0], sT, transpose_B=True, clear_accum=True)
                fetch_half(src.k_cache, src.k_dense, mode & 3, maps[1][j], h, 1, stage.k_values, folded[3],
                           folded[4])
                T.gemm(stage.k_values, folded[1], sT, transpose_B=True, clear_accum=False)
        elif k_form == "sparse":
            T.gemm_sp(stage.k_values, T.view(stage.k_meta, [B, D // 16]), Q_s, sT, transpose_B=True,
                      clear_accum=True)
        elif (mode & 3) == 2:
            T.gemm_sp(stage.k_values, T.view(stage.k_meta, [B, D // 16]), Q_s, sT, transpose_B=True,
                      clear_accum=True)
        else:
            T.gemm(stage.k_dense, Q_s, sT, transpose_B=True, clear_accum=True)
        T.copy(sT, scores_sh)
        T.sync_threads()
        tid = T.get_thread_binding()
        col = tid // TPC
        row0 = (tid % TPC) * RPT  # the thread's rows: row0 .. row0 + RPT - 1 of the block
        block_max = T.alloc_local([1], accum)
        block_max[0] = -T.infinity(accum)
        for i in T.unroll(RPT):
            lane_scores[i] = T.if_then_else(first_pos + row0 + i < seq_len, k_scaled(scores_sh[row0 + i, col], maps, j),
                                            -T.infinity(accum))
            block_max[0] = T.max(block_max[0], lane_scores[i])
        for k in T.unroll(len(SHUF)):
            block_max[0] = T.max(block_max[0], T.shfl_xor(block_max[0], TPC >> (k + 1)))
        new_max = T.max(run_max[0], block_max[0])
        rescale = T.exp2(run_max[0] * scale_log2 - new_max * scale_log2)
        run_max[0] = new_max
        run_sum[0] = run_sum[0] * rescale
        block_sum[0] = 0.0
        for i in T.unroll(RPT):
            p = T.exp2(lane_scores[i] * scale_log2 - new_max * scale_log2)
            block_sum[0] = block_sum[0] + p
            P_s[row0 + i, col] = T.cast(v_scaled(p, maps, j), dtype)
        run_sum[0] = run_sum[0] + block_sum[0]
        if tid % TPC == 0:
            rescale_sh[col] = rescale
        if want_block_lse != 0:
            # The block's own natural-log LSE per query head (the decode modes' anchor-layer masses):
            # the column's lanes add their rows' probabilities, one lane stores it.
            for k in T.unroll(len(SHUF)):
                block_sum[0] = block_sum[0] + T.shfl_xor(block_sum[0], TPC >> (k + 1))
            if tid % TPC == 0:
                if col < G:
                    block_lse[lse_row + col, first_pos // B] = (T.log2(block_sum[0]) + new_max * scale_log2) * LN2
        T.fence_proxy_async()
        T.sync_threads()
        for d, g in T.Parallel(D, NH):
            oT[d, g] *= rescale_sh[g]
        if fold:
            if (mode >> 2) == 2:
                T.gemm_sp(stage.v_values, T.view(stage.v_meta, [D, B // 16]), P_s, oT)
            else:
                dense_v_half(mode >> 2, maps[2][j], h, 0, src, stage, P_s, oT, folded)
                dense_v_half(mode >> 2, maps[2][j], h, 1, src, stage, P_s, oT, folded)
        elif v_form == "sparse":
            T.gemm_sp(stage.v_values, T.view(stage.v_meta, [D, B // 16]), P_s, oT)
        elif (mode >> 2) == 2:
            T.gemm_sp(stage.v_values, T.view(stage.v_meta, [D, B // 16]), P_s, oT)
        else:
            T.gemm(stage.v_dense, P_s, oT, transpose_A=True)

    WARPS = threads // 32
    ROUNDS = -(-bps // threads)

    @T.macro
    def resolve_kept(request, h, limit, block_table, k_index, v_index, maps, counts_sh, taken, own_lo, own_hi, split,
                     num_splits):
        # The compact kernel's prologue: of the request's limit blocks, resolve only its candidates, the
        # split's range [own_lo, own_hi) and then the places split, split + S, ... (candidate v is place
        # own_lo + v, then split + (v - range) * S), and keep the compressed blocks of the range and the
        # others of the dealt places, each mode packed with its place. Kept blocks are ranked by a warp
        # ballot per 32 (a rank counts the kept blocks before it: earlier chunks, earlier rounds and warps
        # of its chunk, lower lanes of its ballot); the block of rank k goes to slot k. The loads of a
        # chunk's rounds are independent; the warps' counts alternate between two halves of counts_sh, one
        # barrier a chunk.
        tid = T.get_thread_binding()
        lane = tid % 32
        r_mode = T.alloc_local([ROUNDS], "int32")
        r_k = T.alloc_local([ROUNDS], "int32")
        r_v = T.alloc_local([ROUNDS], "int32")
        r_rank = T.alloc_local([ROUNDS], "int32")
        r_place = T.alloc_local([ROUNDS], "int32")
        base = T.alloc_local([1], "int32")
        base[0] = 0
        in_range = own_hi - own_lo
        candidates = in_range + T.ceildiv(T.max(limit - split, 0), num_splits)
        for chunk in T.serial(T.ceildiv(candidates, threads * ROUNDS)):
            half = (chunk % 2) * ROUNDS * WARPS
            for r in T.unroll(ROUNDS):
                r_mode[r] = -1
                if (chunk * ROUNDS + r) * threads + tid < candidates:
                    v = (chunk * ROUNDS + r) * threads + tid
                    r_place[r] = T.if_then_else(v < in_range, own_lo + v, split + (v - in_range) * num_splits)
                    entry = block_table[request, r_place[r]]
                    if entry >= 0:
                        r_mode[r] = 0
                        r_k[r] = entry
                        r_v[r] = entry
                    else:
                        k_entry = k_index[h, -entry - 1]
                        v_entry = v_index[h, -entry - 1]
                        r_mode[r] = entry_mode(T, k_entry, v_entry)
                        r_k[r] = entry_row(T, k_entry)
                        r_v[r] = entry_row(T, v_entry)
                    if fits(r_mode[r]) == 1:
                        if v >= in_range:
                            r_mode[r] = -1
                    elif v < in_range:
                        r_mode[r] = -1
                vote = T.ballot(r_mode[r] >= 0)
                lower_lanes = (T.cast(1, "uint64") << T.cast(lane, "uint64")) - T.cast(1, "uint64")
                r_rank[r] = base[0] + T.cast(T.popcount(vote & lower_lanes), "int32")
                if lane == 0:
                    counts_sh[half + r * WARPS + tid // 32] = T.cast(T.popcount(vote), "int32")
            T.sync_threads()
            for r in T.unroll(ROUNDS):
                for q in T.unroll(ROUNDS * WARPS):
                    r_rank[r] = r_rank[r] + T.if_then_else(q < r * WARPS + tid // 32, counts_sh[half + q], 0)
                if r_mode[r] >= 0:
                    if r_rank[r] < bps:  # (split_reach keeps a CTA's blocks within its maps)
                        maps[0][r_rank[r]] = r_mode[r] | (r_place[r] << 4)
                        maps[1][r_rank[r]] = r_k[r]
                        maps[2][r_rank[r]] = r_v[r]
            for q in T.unroll(ROUNDS * WARPS):
                base[0] = base[0] + counts_sh[half + q]
        taken[0] = T.min(base[0], bps)
        T.sync_threads()

    @T.macro
    def guarded_issue(i, num_blocks, h, maps, stage, src):
        if i < num_blocks:
            issue(i, h, maps, stage, src)

    @T.macro
    def step(j, parity, num_blocks, first_block, seq_len, scale_log2, h, maps, Q_s, P_s, stage, refill, src, sT, oT,
             scores_sh, rescale_sh, lane_scores, run_max, run_sum, block_sum, want_block_lse, block_lse, lse_row,
             folded):
        if j < num_blocks:
            T.sync_threads()
            if j + stages - 1 < num_blocks:
                issue(j + stages - 1, h, maps, refill, src)
            T.barrier_wait(stage.full, parity)
            compute(j, (first_block + place_of(maps, j)) * B, seq_len, scale_log2, maps, Q_s, P_s, stage, parity, sT,
                    oT, scores_sh, rescale_sh, lane_scores, run_max, run_sum, block_sum, want_block_lse, block_lse, lse_row,
                    h, src, folded)

    # Plain Python helpers (not parsed by TileLang): unroll the stage ring.
    def emit_prologue(num_blocks, h, maps, st, src):
        for s in range(stages - 1):
            guarded_issue(s, num_blocks, h, maps, st[s], src)

    def emit_ring(it, num_blocks, first_block, seq_len, scale_log2, h, maps, Q_s, P_s, st, src, frags):
        for s in range(stages):
            step(it * stages + s, it & 1, num_blocks, first_block, seq_len, scale_log2, h, maps, Q_s, P_s, st[s],
                 st[(s + stages - 1) % stages], src, *frags)

    # The merge: each thread holds OUTS outputs (query head, d) of its (request, KV head) at once, so that a
    # split's loads for all of them are issued together; merged[0 / 1 / 2, k]: output k's largest split LSE,
    # sum of weights, weighted sum.
    OUTS = -(-G * D // threads)

    def out_head(k, tid):  # (plain Python) the query head (within the group) and the d of a thread's output k
        return (k * threads + tid) // D, (k * threads + tid) % D

    @T.macro
    def merge_max(lse_parts, num_splits, request, h, tid, merged):
        # (The parameters are named as the kernel's split count: binding it renames it in the kernel.)
        for s2 in T.serial(num_splits):
            for k in T.unroll(OUTS):
                if out_head(k, tid)[0] < G:
                    merged[0, k] = T.max(merged[0, k], lse_parts[request, h * G + out_head(k, tid)[0], s2])

    @T.macro
    def merge_add(o_parts, lse_parts, num_splits, request, h, tid, merged):
        for s2 in T.serial(num_splits):
            for k in T.unroll(OUTS):
                if out_head(k, tid)[0] < G:
                    x = lse_parts[request, h * G + out_head(k, tid)[0], s2]
                    w = T.if_then_else(x == -T.infinity(accum), 0.0, T.exp2(x - merged[0, k]))
                    merged[1, k] = merged[1, k] + w
                    merged[2, k] = merged[2, k] + w * o_parts[request, h * G + out_head(k, tid)[0], s2,
                                                              out_head(k, tid)[1]]

    # Plain Python helpers: with min_split_blocks = 1 (every plain decode) they emit exactly the split
    # arithmetic of a kernel without the floor (no guard, every split in the merge).
    every_split_live = min_split_blocks == 1

    def blocks_per_split(seq_blocks, limit):  # limit: S
        per_split = T.ceildiv(seq_blocks, limit)
        return per_split if every_split_live else T.max(per_split, max(min_split_blocks, 1))

    def splits_with_blocks(seq_blocks, per_split):  # at least 1: an empty request's split 0 writes its -inf LSE
        return S if every_split_live else T.max(T.ceildiv(seq_blocks, per_split), 1)

    def cta_guard(split, live_splits):  # (used inline: binding S to a new name would rename the kernel's argument)
        return True if every_split_live else split < live_splits

    @T.macro
    def kernel_body(q, k_cache, v_cache, k_dense, k_values, k_meta, v_dense, v_values, v_meta, scales, k_index, v_index,
                    block_table, seq_lens, sm_scale, o_part, lse_part, out, lse, tickets, want_block_lse, block_lse):
        # The kernel (``main``'s arguments; ``scales``: the four row-scale tensors with store_fp8, else None).
        with T.Kernel(S, kv_heads, batch, threads=threads) as (split, h, request):
            Q_s = T.alloc_shared([NH, D], dtype)
            P_s = T.alloc_shared([B, NH], dtype)
            block_mode = T.alloc_shared([bps], "int32")
            ticket_sh = T.alloc_shared([1], "int32")
            merged = T.alloc_local([3, OUTS], accum)
            block_k_row = T.alloc_shared([bps], "int32")
            block_v_row = T.alloc_shared([bps], "int32")
            ring_stages = alloc_stages()
            scale_maps = alloc_scale_maps()
            sT = T.alloc_fragment([B, NH], accum)
            oT = T.alloc_fragment([D, NH], accum)
            scores_sh = T.alloc_shared([B, NH], accum)
            rescale_sh = T.alloc_shared([NH], accum)
            stats_sh = T.alloc_shared([2, NH], accum)
            lane_scores = T.alloc_local([RPT], accum)
            run_max = T.alloc_local([1], accum)
            run_sum = T.alloc_local([1], accum)
            block_sum = T.alloc_local([1], accum)
            counts_sh = T.alloc_shared([2 * ROUNDS * WARPS], "int32") if fold else None  # kept a ballot
            taken = T.alloc_local([1], "int32") if fold else None
            # The compact kernel's dense blocks: Q's head_dim halves, an O^T half, the barrier and phase of
            # the loads within a step.
            folded = (T.alloc_shared([NH, HD], dtype), T.alloc_shared([NH, HD], dtype),
                      T.alloc_fragment([HD, NH], accum), T.alloc_barrier(threads),
                      T.alloc_local([1], "int32")) if fold else None

            # Plain bindings (inlined expressions, as before the split count was dynamic): the block loop's
            # generated code stays that of a static split count but for the (loop-invariant) division.
            seq_len = seq_lens[request]
            seq_blocks = T.ceildiv(seq_len, B)
            per_split = blocks_per_split(seq_blocks, S)
            first_block = split * per_split
            # The plan keeps S >= ceil(max_blocks / bps), so per_split <= bps; the bound only guards the maps.
            num_blocks = T.max(T.min(T.min(per_split, bps), seq_blocks - first_block), 0)
            scale_log2 = sm_scale * LOG2E

            # A split past its request's blocks has nothing to do (only with a split floor).
            if cta_guard(split, splits_with_blocks(seq_blocks, per_split)):
                # Resolve this CTA's blocks: mode = k_mode | v_mode << 2 (0 cache page, 1 dense row, 2 2:4 row).
                if fold:  # the compressed blocks of its split, dense blocks dealt by place over the splits
                    resolve_kept(request, h, seq_blocks, block_table, k_index, v_index,
                                 (block_mode, block_k_row, block_v_row), counts_sh, taken, first_block,
                                 first_block + num_blocks, split, S)
                else:
                    for i in T.Parallel(bps):
                        if i < num_blocks:
                            entry = block_table[request, first_block + i]
                            if entry >= 0:
                                block_mode[i] = 0
                                block_k_row[i] = entry
                                block_v_row[i] = entry
                                if store_fp8:  # a cache page: scale 1 (16-bit, or SGLang's unit-scale FP8)
                                    scale_maps[0][i] = 1.0
                                    scale_maps[1][i] = 1.0
                            else:
                                k_entry = k_index[h, -entry - 1]
                                v_entry = v_index[h, -entry - 1]
                                block_mode[i] = entry_mode(T, k_entry, v_entry)
                                block_k_row[i] = entry_row(T, k_entry)
                                block_v_row[i] = entry_row(T, v_entry)
                                if store_fp8:  # the rows' scales (both indices clamped into their pools)
                                    scale_maps[0][i] = T.if_then_else(k_entry >= 0, scales[0][T.max(k_entry, 0)],
                                                                      scales[1][T.max(-k_entry - 1, 0)])
                                    scale_maps[1][i] = T.if_then_else(v_entry >= 0, scales[2][T.max(v_entry, 0)],
                                                                      scales[3][T.max(-v_entry - 1, 0)])
                for g, d in T.Parallel(NH, D):
                    Q_s[g, d] = T.if_then_else(g < G, q[request, h * G + g, d], T.cast(0, dtype))
                if fold:
                    for g, d in T.Parallel(NH, HD):
                        folded[0][g, d] = T.if_then_else(g < G, q[request, h * G + g, d], T.cast(0, dtype))
                        folded[1][g, d] = T.if_then_else(g < G, q[request, h * G + g, HD + d], T.cast(0, dtype))
                    folded[4][0] = 0
                T.fill(oT, 0)
                run_max[0] = -T.infinity(accum)
                run_sum[0] = 0.0
                T.fence_proxy_async()
                T.sync_threads()

                src = KvSources(k_cache, v_cache, k_dense, k_values, k_meta, v_dense, v_values, v_meta)
                maps = make_maps(block_mode, block_k_row, block_v_row, scale_maps)
                frags = (sT, oT, scores_sh, rescale_sh, lane_scores, run_max, run_sum, block_sum, want_block_lse, block_lse,
                         request * q_heads + h * G, folded)
                count = taken[0] if fold else num_blocks  # the blocks the ring walks
                emit_prologue(count, h, maps, ring_stages, src)
                for it in T.serial(T.ceildiv(count, stages)):
                    emit_ring(it, count, 0 if fold else first_block, seq_len, scale_log2, h, maps, Q_s, P_s,
                              ring_stages, src, frags)

                tid = T.get_thread_binding()
                for k in T.unroll(len(SHUF)):
                    run_sum[0] = run_sum[0] + T.shfl_xor(run_sum[0], TPC >> (k + 1))
                if tid % TPC == 0:
                    stats_sh[0, tid // TPC] = run_max[0]
                    stats_sh[1, tid // TPC] = run_sum[0]
                T.sync_threads()
                for g in T.Parallel(NH):
                    if g < G:
                        lse_part[request, h * G + g, split] = T.if_then_else(
                            stats_sh[1, g] > 0, T.log2(stats_sh[1, g]) + stats_sh[0, g] * scale_log2, -T.infinity(accum))
                for d, g in T.Parallel(D, NH):
                    if g < G:
                        o_part[request, h * G + g, split, d] = T.if_then_else(
                            stats_sh[1, g] > 0, oT[d, g] / stats_sh[1, g], 0.0)

                # Split-KV merge by the last CTA of this (request, KV head): release our partials, take a
                # ticket (acq_rel, device scope), and merge if we are the last.
                tid = T.get_thread_binding()
                T.sync_threads()
                if tid == 0:
                    ticket_sh[0] = T.atomic_add(tickets[request, h], 1, memory_order="acq_rel", return_prev=True)
                T.sync_threads()
                if ticket_sh[0] == splits_with_blocks(seq_blocks, per_split) - 1:
                    for k in T.unroll(OUTS):
                        merged[0, k] = -T.infinity(accum)
                        merged[1, k] = 0.0
                        merged[2, k] = 0.0
                    merge_max(lse_part, splits_with_blocks(seq_blocks, per_split), request, h, tid, merged)
                    merge_add(o_part, lse_part, splits_with_blocks(seq_blocks, per_split), request, h, tid, merged)
                    for k in T.unroll(OUTS):
                        if out_head(k, tid)[0] < G:
                            out[request, h * G + out_head(k, tid)[0], out_head(k, tid)[1]] = T.if_then_else(
                                merged[1, k] > 0, merged[2, k] / merged[1, k], 0.0)
                            if out_head(k, tid)[1] == 0:
                                lse[request, h * G + out_head(k, tid)[0]] = T.if_then_else(
                                    merged[1, k] > 0, (T.log2(merged[1, k]) + merged[0, k]) * LN2, -T.infinity(accum))
                    if tid == 0:
                        tickets[request, h] = 0

    if store_fp8:
        @T.prim_func
        def main(
            q: T.Tensor([batch, q_heads, D], dtype),
            k_cache: T.Tensor([num_slots, kv_heads, D], cache_dtype),
            v_cache: T.Tensor([num_slots, kv_heads, D], cache_dtype),
            k_dense: T.Tensor([k_dense_rows, B, D], pool_dtype),
            k_values: T.Tensor([k_sparse_rows, B, D // 2], pool_dtype),
            k_meta: T.Tensor([k_sparse_rows, e_rows, 16], "int16"),
            v_dense: T.Tensor([v_dense_rows, B, D], pool_dtype),
            v_values: T.Tensor([v_sparse_rows, D, B // 2], pool_dtype),
            v_meta: T.Tensor([v_sparse_rows, e_rows, 16], "int16"),
            k_dense_scale: T.Tensor([k_dense_rows], accum),
            k_values_scale: T.Tensor([k_sparse_rows], accum),
            v_dense_scale: T.Tensor([v_dense_rows], accum),
            v_values_scale: T.Tensor([v_sparse_rows], accum),
            k_index: T.Tensor([kv_heads, num_virtual], "int32"),
            v_index: T.Tensor([kv_heads, num_virtual], "int32"),
            block_table: T.Tensor([batch, max_blocks], "int32"),
            seq_lens: T.Tensor([batch], "int32"),
            sm_scale: T.float32,
            o_part: T.Tensor([batch, q_heads, S, D], accum),
            lse_part: T.Tensor([batch, q_heads, S], accum),
            out: T.Tensor([batch, q_heads, D], dtype),
            lse: T.Tensor([batch, q_heads], accum),
            tickets: T.Tensor([batch, kv_heads], "int32"),
            want_block_lse: T.int32,
            block_lse: T.Tensor([lse_rows, lse_cols], accum),
        ):
            kernel_body(q, k_cache, v_cache, k_dense, k_values, k_meta, v_dense, v_values, v_meta,
                        (k_dense_scale, k_values_scale, v_dense_scale, v_values_scale), k_index, v_index,
                        block_table, seq_lens, sm_scale, o_part, lse_part, out, lse, tickets, want_block_lse,
                        block_lse)  # fmt: skip

        return main

    @T.prim_func
    def main(
        q: T.Tensor([batch, q_heads, D], dtype),
        k_cache: T.Tensor([num_slots, kv_heads, D], dtype),
        v_cache: T.Tensor([num_slots, kv_heads, D], dtype),
        k_dense: T.Tensor([k_dense_rows, B, D], dtype),
        k_values: T.Tensor([k_sparse_rows, B, D // 2], dtype),
        k_meta: T.Tensor([k_sparse_rows, e_rows, 16], "int16"),
        v_dense: T.Tensor([v_dense_rows, B, D], dtype),
        v_values: T.Tensor([v_sparse_rows, D, B // 2], dtype),
        v_meta: T.Tensor([v_sparse_rows, e_rows, 16], "int16"),
        k_index: T.Tensor([kv_heads, num_virtual], "int32"),
        v_index: T.Tensor([kv_heads, num_virtual], "int32"),
        block_table: T.Tensor([batch, max_blocks], "int32"),
        seq_lens: T.Tensor([batch], "int32"),
        sm_scale: T.float32,
        o_part: T.Tensor([batch, q_heads, S, D], accum),
        lse_part: T.Tensor([batch, q_heads, S], accum),
        out: T.Tensor([batch, q_heads, D], dtype),
        lse: T.Tensor([batch, q_heads], accum),
        tickets: T.Tensor([batch, kv_heads], "int32"),
        want_block_lse: T.int32,
        block_lse: T.Tensor([lse_rows, lse_cols], accum),
    ):
        kernel_body(q, k_cache, v_cache, k_dense, k_values, k_meta, v_dense, v_values, v_meta, None, k_index, v_index,
                    block_table, seq_lens, sm_scale, o_part, lse_part, out, lse, tickets, want_block_lse, block_lse)

    return main


def decode_kernel_args(q_heads, kv_heads, head_dim, block_size=64, dtype="float16", stages=STAGES,
                       split_capacity=SPLIT_CAPACITY, min_split_blocks=1, store_fp8=False,
                       cache_fp8=False, compact=None) -> tuple:  # fmt: skip
    """The arguments that key a decode kernel in TileLang's cache (and a compile job): the shape, then
    the split capacity, the split floor, ``store_fp8``, ``cache_fp8`` and ``compact`` up to the last that
    is not its default (so the default kernels keep their keys)."""
    extra = (split_capacity, min_split_blocks, bool(store_fp8), bool(cache_fp8), compact and tuple(compact))
    defaults = (SPLIT_CAPACITY, 1, False, False, None)
    kept = max((i + 1 for i in range(len(extra)) if extra[i] != defaults[i]), default=0)
    return (q_heads, kv_heads, head_dim, block_size, dtype, stages) + extra[:kept]


@functools.lru_cache(maxsize=None)
def build_decode_kernel(q_heads, kv_heads, head_dim, block_size=64, dtype="float16", stages=STAGES,
                        split_capacity=SPLIT_CAPACITY, min_split_blocks=1, store_fp8=False, cache_fp8=False,
                        compact=None, target=None):  # fmt: skip
    """Compile (or load from TileLang's cache) the kernel of one model shape (``store_fp8``: over e4m3
    pools, ``cache_fp8``: and e4m3 cache pages, see :func:`build_decode_prim_func`). Needs TileLang, not
    a GPU."""
    args = decode_kernel_args(q_heads, kv_heads, head_dim, block_size, dtype, stages, split_capacity, min_split_blocks,
                              store_fp8, cache_fp8, compact)  # fmt: skip
    suffix = ("_floor" if min_split_blocks > 1 else "") + ("_fp8" if store_fp8 else "") + ("kv" if cache_fp8 else "")
    suffix += "" if compact is None else f"_{compact[0][0]}{compact[1][0]}"
    return compile_cached("decode", args, lambda: build_decode_prim_func(*args), PASS_CONFIGS, target,
                          name="hs_decode" + suffix)


COMPACT_FORMS = (("sparse", "sparse"),)
"""The compressed forms a compact decode kernel is built for. Only 2:4 K and V stages (18 KB at d 128
against 50) fit twice the CTAs an SM, which the block step's instruction chain needs; dense K with 2:4 V
stages fit three instead of two, and a kernel pair of those ran 0.94-0.95x the any-form kernel (H200,
batch 8 x 32K; ``docs/kernels.md``)."""
COMPACT_MIN_HEAD_DIM = 128
"""A compact kernel reads dense blocks a head_dim half at a time, and a half is the V GEMM's M (64 at least)."""


def decode_compact(forms: tuple[str, str], head_dim: int) -> tuple[str, str] | None:
    """The compact stages a store's decode runs with, from the forms every compressed block has
    (``decode_shared.compressed_forms``), or None for the any-form kernel."""
    return tuple(forms) if tuple(forms) in COMPACT_FORMS and head_dim >= COMPACT_MIN_HEAD_DIM else None


def choose_num_splits(batch: int, kv_heads: int, max_blocks: int, num_sms: int,
                      ctas_per_sm: int | Callable[[int], int], max_splits: int = MAX_SPLITS,
                      capacity: int = SPLIT_CAPACITY) -> int:  # fmt: skip
    """Splits per (request, KV head): the fewest that keep every resident CTA slot busy
    (:func:`sglang_hs.kernels.common.split_count`; a CTA costs just its ``ceil(max_blocks / S)`` blocks),
    and at least :func:`min_splits`."""
    return split_count(batch * kv_heads, max_blocks, num_sms, ctas_per_sm, max_splits,
                       min_splits=min_splits(max_blocks, capacity))


@functools.lru_cache(maxsize=4096)
def plan_num_splits(batch: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int, max_blocks: int,
                    stages: int, num_sms: int, split_capacity: int = SPLIT_CAPACITY, store_fp8: bool = False,
                    forms: tuple[str, str] = ANY_FORMS) -> int:
    """The split count of a call with ``batch`` requests and a block table ``max_blocks`` wide on a GPU
    of ``num_sms`` SMs (host arithmetic on shapes only: no device value is read).

    A CTA's shared memory does not depend on the call (its index maps hold :data:`SPLIT_CAPACITY`
    blocks), so the CTAs per SM are fixed by the model shape: two at d 128 for the GQA groups the
    server takes. At a 32K context (512-529 blocks) and 8 requests of 8 KV heads that is 4 splits."""
    ctas = ctas_per_sm(q_heads, kv_heads, head_dim, block_size, stages, split_capacity, store_fp8, forms)
    return choose_num_splits(batch, kv_heads, max_blocks, num_sms, ctas, capacity=split_reach(split_capacity, forms))


def split_reach(split_capacity: int, forms: tuple[str, str] = ANY_FORMS) -> int:
    """The most blocks a split's range may span. A compact kernel (:func:`decode_compact`) also takes dense
    blocks dealt from the whole request (at most one a split in every ``S`` of them), so its range is half
    its maps' capacity."""
    return split_capacity // 2 if tuple(forms) in COMPACT_FORMS else split_capacity


def ctas_per_sm(q_heads: int, kv_heads: int, head_dim: int, block_size: int, stages: int,
                split_capacity: int = SPLIT_CAPACITY, store_fp8: bool = False,
                forms: tuple[str, str] = ANY_FORMS) -> int:
    """CTAs of the model shape's kernel that fit an SM (shared memory; fixed by the shape, not the call).
    The FP8 kernel's landing tiles leave one at d 128 (two at d 64; see :func:`smem_bytes`); stages of
    the compressed forms only fit four (2:4 K and V) or three (dense K, 2:4 V) at d 128."""
    per_cta = smem_bytes(head_dim, block_size, stages, q_heads // kv_heads, split_capacity, store_fp8, forms) + 1024
    return max(1, min(SMEM_PER_SM // per_cta, 8))


class HieraSparseDecode:
    """Plan + run of the mixed dense/2:4-sparse split-KV decode kernel (see the module docstring).

    One plan serves every batch size and block-table width: ``__init__`` loads (or compiles) the
    kernel of the model shape and allocates the split-KV scratch once, for ``batch_size`` requests
    and block tables up to ``max_blocks`` wide; each call views the prefix of it that its shape needs,
    so CUDA graphs captured at different batch sizes keep valid addresses. A larger batch grows the
    scratch while no CUDA graph has captured the plan, and runs in chunks of ``batch_size`` after.
    ``num_splits`` forces the split count (else :func:`plan_num_splits` per call shape, on
    ``num_sms`` SMs: this GPU's by default).
    ``block_lse``: also keep scratch for :meth:`run`'s per-block LSE (the decode modes' anchor layers).
    ``min_split_blocks``: the kernel's floor of blocks a split (:func:`build_decode_prim_func`).
    ``store_dtype``: the values of the pools the plan reads, the model's dtype (None, default) or
    :data:`~sglang_hs.format.FP8_DTYPE` (the kernel's ``store_fp8`` variant, given the pools' row
    scales); :meth:`run` refuses pools of the other kind. ``cache_dtype``: of the cache pages, the
    model's ``dtype`` (None, default) or FP8 (SGLang's ``--kv-cache-dtype fp8_e4m3``; with an FP8 store
    only). ``compact`` (:func:`decode_compact`'s forms; 16-bit, d >= 128, no split floor): the kernel
    whose stages hold only those forms, with at least ``ceil(max_blocks / (split_capacity / 2))`` splits
    (:func:`split_reach`). One call at a time per plan.
    """

    def __init__(self, batch_size: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
                 max_blocks: int, dtype: torch.dtype, device, num_splits: int | None = None, stages: int = STAGES,
                 num_sms: int | None = None, split_capacity: int = SPLIT_CAPACITY,
                 block_lse: bool = False,
                 min_split_blocks: int = 1, store_dtype: torch.dtype | None = None,
                 cache_dtype: torch.dtype | None = None, compact: tuple[str, str] | None = None):
        check_plan_shape(q_heads, kv_heads, head_dim, block_size, dtype)
        if store_dtype not in (None, dtype, FP8_DTYPE):
            raise ValueError(f"store values of {store_dtype}; allowed: the model's {dtype} or {FP8_DTYPE}")
        self.store_fp8 = store_dtype == FP8_DTYPE
        self.cache_dtype = cache_dtype or dtype
        if self.cache_dtype not in (dtype, FP8_DTYPE) or (self.cache_dtype == FP8_DTYPE and not self.store_fp8):
            raise ValueError(f"cache pages of {self.cache_dtype} with store values of {store_dtype or dtype}; allowed: "
                             f"the model's {dtype}, or {FP8_DTYPE} with an {FP8_DTYPE} store")
        self.q_heads, self.kv_heads = q_heads, kv_heads
        self.head_dim, self.block_size, self.max_blocks = head_dim, block_size, max_blocks
        self.dtype, self.device, self.stages = dtype, torch.device(device), stages
        self.split_capacity = split_capacity
        self.compact = None if compact is None or tuple(compact) == ANY_FORMS else tuple(compact)
        self.forms = self.compact or ANY_FORMS  # what the kernel's stages hold
        self.reach = split_reach(split_capacity, self.forms)
        if num_splits is not None and num_splits < min_splits(max_blocks, self.reach):
            raise ValueError(f"num_splits={num_splits} < {min_splits(max_blocks, self.reach)}: a split spans at "
                             f"most {self.reach} of the {max_blocks} blocks")
        self.forced_splits = num_splits
        if num_sms is None and num_splits is None:
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.num_sms = num_sms
        dt = "float16" if dtype == torch.float16 else "bfloat16"
        fp8 = {"store_fp8": True} if self.store_fp8 else {}  # (a 16-bit plan calls the builder as before)
        if self.cache_dtype == FP8_DTYPE:
            fp8["cache_fp8"] = True
        if self.compact is not None and (self.compact not in COMPACT_FORMS or self.store_fp8 or min_split_blocks != 1
                                         or head_dim < COMPACT_MIN_HEAD_DIM):
            raise ValueError(f"compact decode stages take the forms {COMPACT_FORMS} of 16-bit stores at head_dim >= "
                             f"{COMPACT_MIN_HEAD_DIM}, without a split floor; got {self.compact} at head_dim {head_dim}")
        compact_arg = {"compact": self.compact} if self.compact else {}
        self.kernel = build_decode_kernel(q_heads, kv_heads, head_dim, block_size, dt, stages,
                                          split_capacity=split_capacity, min_split_blocks=min_split_blocks,
                                          **fp8, **compact_arg)  # fmt: skip
        self.pools = PoolArgs(kv_heads, head_dim, block_size, dtype, self.device)
        self.captured = False  # set by a call under CUDA-graph capture: the scratch never moves after
        self.with_block_lse = block_lse
        self._no_block_lse = torch.empty(1, 1, dtype=torch.float32, device=self.device)
        self._allocate(batch_size)
        self.num_splits = self.splits(batch_size, max_blocks)  # at the plan's full shape (reported)
        self.last_num_splits = None

    def splits(self, batch: int, width: int) -> int:
        """The split count of a call of ``batch`` requests over a block table ``width`` wide: the forced
        one, else :func:`plan_num_splits` for this plan's kernel."""
        if self.forced_splits is not None:
            return self.forced_splits
        return plan_num_splits(batch, self.q_heads, self.kv_heads, self.head_dim, self.block_size, width,
                               self.stages, self.num_sms, self.split_capacity, self.store_fp8, self.forms)

    def call_splits(self, batch: int, width: int) -> int:
        """The split count a launch of ``batch`` requests (at most ``batch_size``) uses: the planned one,
        cut to the scratch, and at least the fewest the width needs."""
        return max(min(self.splits(batch, width), self.part_capacity // batch), min_splits(width, self.reach))

    def _allocate(self, batch_size: int) -> None:
        """Scratch for up to ``batch_size`` requests at the split counts their calls choose."""
        self.batch_size = batch_size
        parts = max(bs * self.splits(bs, self.max_blocks) for bs in range(1, batch_size + 1))
        hq, d = self.q_heads, self.head_dim
        f32 = dict(dtype=torch.float32, device=self.device)
        self.part_capacity = parts  # (request, split) pairs
        self.o_part = torch.empty(parts * hq * d, **f32)
        self.lse_part = torch.empty(parts * hq, **f32)
        self.lse = torch.empty(batch_size, hq, **f32)
        # Split tickets of the fused merge; the merging CTA resets its entry, so it stays zero between calls.
        self.counter = torch.zeros(batch_size, self.kv_heads, dtype=torch.int32, device=self.device)
        self.block_lse = (torch.empty(batch_size * hq * self.max_blocks, **f32) if self.with_block_lse
                          else self._no_block_lse)  # fmt: skip

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pools: BlockPools,
            k_index: torch.Tensor, v_index: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
            sm_scale: float, out: torch.Tensor | None = None, return_lse: bool = False,
            return_block_lse: bool = False):
        """Decode attention of one layer; one kernel launch per ``batch_size`` requests, no host
        synchronisation.

        Shapes (``bs`` = the call's requests, ``B`` = ``block_size``, ``D`` = ``head_dim``,
        ``Hq``/``Hkv`` query/KV heads, all on the plan's device; 16-bit tensors in the plan's dtype):

        * ``q``: ``[bs, Hq, D]``, contiguous, one query token per request.
        * ``k_cache``, ``v_cache``: ``[slots, Hkv, D]``, SGLang's buffers of the layer (page ``e`` = slots
          ``e*B .. e*B + B - 1``), in the plan's ``cache_dtype``.
        * ``pools``: the layer's :class:`~sglang_hs.format.BlockPools`: ``k_dense [Nd_k, B, D]``,
          ``k_values [Ns_k, B, D/2]``, ``k_meta [Ns_k, B, D/16]`` int16, ``v_dense [Nd_v, B, D]``,
          ``v_values [Ns_v, D, B/2]``, ``v_meta [Ns_v, D, B/16]`` int16 (any of them may be empty);
          for a plan of ``store_dtype=FP8_DTYPE`` e4m3 values with their float32 row scales.
        * ``k_index``, ``v_index``: ``[Hkv, n_virtual]`` int32, virtual block -> pool row (``>= 0``
          dense row, ``< 0`` 2:4 row ``-i - 1``).
        * ``block_table``: ``[bs, W]`` int32, contiguous, ``W <= max_blocks``: a request's blocks in
          order (``>= 0`` cache page, ``< 0`` virtual block ``-e - 1``); columns past a request's blocks
          are never read.
        * ``seq_lens``: ``[bs]`` int32, tokens of each request (0: a padded request, output 0, LSE -inf).
        * ``out``: ``[bs, Hq, D]``, contiguous, written if given.

        Returns ``out [bs, Hq, D]``, and with ``return_lse`` also the natural-log LSE ``[bs, Hq]`` fp32
        (a plan-owned buffer up to ``batch_size`` requests, overwritten by the next call); with
        ``return_block_lse`` (a plan built with ``block_lse=True``) last the natural-log LSE of each block
        on its own, ``[bs, Hq, W]`` fp32 (plan-owned; columns past a request's blocks are not written).
        """
        bs, width = q.shape[0], block_table.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"block table {width} wide > the plan's max_blocks {self.max_blocks}")
        if out is None:
            out = torch.empty_like(q)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self.captured = True
        if bs > self.batch_size and not self.captured:
            self._allocate(bs)
        lse = self.lse if bs <= self.batch_size else torch.empty(bs, self.q_heads, dtype=torch.float32,
                                                                 device=self.device)
        block_lse = None
        if return_block_lse:
            if not self.with_block_lse:
                raise ValueError("return_block_lse needs a plan built with block_lse=True")
            if bs > self.batch_size:
                raise ValueError(f"return_block_lse with {bs} requests > the plan's batch_size {self.batch_size}")
            block_lse = self.block_lse[: bs * self.q_heads * width].view(bs, self.q_heads, width)
        if pools.quantized != self.store_fp8:
            raise ValueError(f"{'FP8' if pools.quantized else '16-bit'} pools given to a decode plan for "
                             f"{'FP8' if self.store_fp8 else '16-bit'} store values (HieraSparseDecode(store_dtype=))")
        if k_cache.dtype != self.cache_dtype or v_cache.dtype != self.cache_dtype:
            raise ValueError(f"cache pages of {k_cache.dtype} given to a decode plan for {self.cache_dtype} pages "
                             "(HieraSparseDecode(cache_dtype=))")
        kv = (k_cache, v_cache, *self.pools(pools, k_index, v_index, scales=self.store_fp8))
        for start in range(0, bs, self.batch_size):
            stop = min(bs, start + self.batch_size)
            self._launch(q[start:stop], kv, block_table[start:stop], seq_lens[start:stop], float(sm_scale),
                         out[start:stop], lse[start:stop], block_lse)
        result = (out,) + ((lse[:bs],) if return_lse else ()) + ((block_lse,) if return_block_lse else ())
        return result if len(result) > 1 else out

    def _launch(self, q, kv: tuple, block_table, seq_lens, sm_scale: float, out, lse,
                block_lse: torch.Tensor | None) -> None:
        """One launch for at most ``batch_size`` requests, on views of the plan's scratch."""
        n, hq, d = q.shape[0], self.q_heads, self.head_dim
        width = block_table.shape[1]
        # The split count fits the scratch: at the plan's width it is the chosen one (the scratch was
        # sized for it); a narrower table never needs more than min_splits(max_blocks) <= what fits.
        s = self.call_splits(n, width)
        self.last_num_splits = s
        o_part = self.o_part[:n * hq * s * d].view(n, hq, s, d)
        lse_part = self.lse_part[:n * hq * s].view(n, hq, s)
        lse_out = self._no_block_lse if block_lse is None else block_lse.view(n * hq, width)
        tail = (out, lse[:n], self.counter[:n], int(block_lse is not None), lse_out)
        self.kernel(q, *kv, block_table, seq_lens, sm_scale, o_part, lse_part, *tail)


# The kernels the GPU tests build, as (q_heads, kv_heads, head_dim, dtype); every batch size, block-table
# width and split count runs on the one kernel of its shape. ``python -m sglang_hs.kernels.decode
# [--jobs N]`` compiles them into TileLang's cache on any machine.
PRECOMPILE = [
    (32, 8, 128, "float16"), (16, 2, 128, "bfloat16"), (4, 4, 64, "float16"), (8, 4, 128, "float16"),
    (8, 2, 64, "float16"), (4, 1, 64, "float16"),
    (9, 3, 64, "float16"), (10, 2, 128, "bfloat16"), (12, 2, 64, "float16"), (14, 2, 128, "bfloat16"),
    (28, 4, 128, "bfloat16"), (9, 3, 128, "bfloat16"), (10, 2, 64, "float16"), (12, 2, 128, "float16"),
    (14, 2, 64, "bfloat16"),
]
# The FP8 variants of the GPU tests (``tests/test_kernels_decode.py``): (q_heads, kv_heads, head_dim,
# dtype, "fp8" | "fp8kv"), GQA groups 1, 3, 4 and 8 at head_dim 64 and 128, fp16 and bf16; "fp8kv": FP8
# cache pages too.
FP8_PRECOMPILE = [
    (4, 4, 64, "float16", "fp8"), (9, 3, 64, "bfloat16", "fp8"), (8, 2, 64, "bfloat16", "fp8"),
    (8, 1, 64, "float16", "fp8"), (8, 8, 128, "bfloat16", "fp8"), (12, 4, 128, "float16", "fp8"),
    (16, 4, 128, "float16", "fp8"), (32, 4, 128, "bfloat16", "fp8"),
    (4, 4, 64, "float16", "fp8kv"), (9, 3, 64, "bfloat16", "fp8kv"), (8, 1, 64, "float16", "fp8kv"),
    (12, 4, 128, "float16", "fp8kv"), (32, 8, 128, "bfloat16", "fp8kv"),
]
PRECOMPILE += FP8_PRECOMPILE
FP8_VARIANTS = {"fp8": {"store_fp8": True}, "fp8kv": {"store_fp8": True, "cache_fp8": True}}
# The compact kernels of the GPU tests (2:4 K and V stores): (q_heads, kv_heads, head_dim, dtype), GQA groups
# 8, 7, 6, 4, 3 and 16.
COMPACT_PRECOMPILE = [(16, 2, 128, "bfloat16"), (14, 2, 128, "bfloat16"), (12, 2, 128, "float16"),
                      (32, 8, 128, "float16"), (6, 2, 128, "float16"), (16, 1, 128, "bfloat16")]
PRECOMPILE += [cfg + ("compact",) for cfg in COMPACT_PRECOMPILE]


def _precompile_one(cfg):
    hq, hkv, d, dt, *variant = cfg
    if variant and variant[0] == "compact":
        build_decode_kernel(hq, hkv, d, 64, dt, STAGES, compact=COMPACT_FORMS[0])
    else:
        build_decode_kernel(hq, hkv, d, 64, dt, STAGES, **(FP8_VARIANTS[variant[0]] if variant else {}))
    return cfg


if __name__ == "__main__":
    precompile_main("compile the decode kernels of the GPU tests", _precompile_one, PRECOMPILE)
