"""Split-KV decode attention over mixed dense / 2:4-sparse KV blocks (TileLang 0.1.11, Hopper sm_90a).

One decode step of one layer: every request has one query token (``q [bs, Hq, D]``) that attends to
all ``seq_len`` tokens of its KV. The KV of a request is a row of ``block_table`` whose entries are
either SGLang cache pages (dense, read from ``k_cache``/``v_cache``) or compressed virtual blocks,
resolved per KV head through the signed index maps into the HieraSparse pools of
``sglang_hs.format`` (dense pool rows or 2:4 values + int16 metadata). ``sglang_hs.reference.
paged_attention`` is the oracle; ``HieraSparseDecode`` is the plan/run API the backend calls.

Design (and why)
----------------
* **Trans-Both GEMMs.** Only the A operand of ``wgmma.sp`` may be sparse, so the block loop computes
  ``S^T = K·Q^T`` (``[B, N]``, A = K, sparse along head_dim) and ``O^T += V^T·P^T`` (``[D, N]``,
  A = V^T, sparse along tokens, stored K-major as ``v_values [D, B/2]``). Dense blocks use the same
  shapes with ``T.gemm`` (``wgmma``), sparse blocks ``T.gemm_sp`` (``wgmma.sp``); the accumulators are
  shared, so both paths fold into one online softmax.
* **GQA as the GEMM N dim.** One CTA serves the ``G = Hq/Hkv`` query heads of one KV head, so every KV
  byte is read once. N is padded to 8 for G in {1, 2, 4, 8} (16 up to G = 16): ``m64n8`` is a legal
  wgmma shape and avoids the N = 24/40 bug (#2603) and wasted accumulator registers.
* **Split-KV.** Grid ``(num_splits, Hkv, bs)``: each CTA walks a contiguous range of its request's
  blocks and writes a partial ``O`` (fp32) and base-2 LSE to plan-owned scratch. The last CTA of a
  (request, KV head) to finish (an acq_rel atomic ticket per pair, reset by that CTA) merges the
  splits into ``out`` and the natural-log LSE, so a call is one kernel launch (``fused_combine=False``
  keeps a second merge kernel in the same ``prim_func``). bs = 8 gives only 64 (request, KV head)
  pairs for 132 SMs, so splitting is what fills the GPU; ``num_splits`` is chosen at plan time from
  the SM count and the CTAs that fit per SM (4 for bs 8 x 32K on an H100: 256 CTAs, one wave).
* **Data-dependent dispatch without losing the pipeline.** Decode is memory bound; the win is reading
  0.5625x the bytes of a sparse block, so what matters is bytes in flight. TileLang's ``T.Pipelined``
  does not pipeline copies whose shape depends on a runtime branch, so the loop is software-pipelined
  by hand: ``stages`` shared-memory stages with their own mbarriers; one elected thread
  (``T.tma_copy``) issues the TMA loads of block ``j + stages - 1`` *before* the CTA waits on block
  ``j``, choosing per block between a cache page (a strided 3-D TMA box), a dense pool row, or values +
  metadata of a sparse row, with an ``expect_tx`` that matches the branch; the consumers branch on
  the same per-block mode to ``gemm`` or ``gemm_sp``. A prologue resolves the block-table and
  index-map entries of all the CTA's blocks at once (128 threads in parallel) into shared memory, so
  the two dependent index loads are paid once per CTA, not once per block.
* **Stage buffers and occupancy.** A stage holds the dense tiles and the sparse values + metadata of
  K and V (50 KB at D = 128); only one form per operand is filled per block. Aliasing them (the
  paper's trick) does not survive TileLang 0.1.11's layout inference, which gives buffers that share
  storage one (reshaped) layout and rejects unequal sizes. Measured on the H100 (bs 8 x 32K): 2
  stages with 2 CTAs per SM (up to 4 blocks in flight per SM) beat 3 or 4 stages with 1 CTA per SM
  by 1.2-1.5x (e.g. 213 vs 295-320 us at S_K = S_V = 1): one CTA's block step is a serial chain
  (issue, wait, wgmma, softmax, wgmma) of ~1.2 us, and a second resident CTA hides it.
* **Softmax.** ``softmax="lane"`` (default) stages ``S^T`` in shared memory and gives each query head
  (column) to 16 consecutive lanes, so the block max is 4 shuffles, the row sums stay per lane until
  the end, and a block step has 3 CTA barriers; ``"tile"`` uses TileLang's fragment reductions (a
  cross-warp AllReduce per column, 16 named barriers per block). Both measure the same (within 1%),
  which says the step is bound by the memory pipeline, not by the reductions.
* **Metadata by TMA.** The int16 metadata tile of a block is contiguous (1 KB); it is moved as a
  ``[E/16, 16]`` box (TMA needs an inner box of >= 16 bytes; a V tile's rows are 8 bytes) and
  re-viewed as the ``[M, K/16]`` tile that ``T.gemm_sp`` reads (metadata in shared memory has no swizzle).
* **Bug work-arounds (0.1.11).** ``T.fence_proxy_async()`` after ``P^T`` is written to shared memory and
  after ``Q`` is staged, before any (sparse) wgmma reads them (#2634). TileLang's automatic
  thread-sync pass puts ``__syncthreads`` inside the elected-thread TMA branches of this kernel (a
  deadlock), so it is disabled (``tl.disable_thread_storage_sync``) and the kernel places its own
  barriers: one at the top of each block step (WAR on the refilled stage, ``P_s`` and ``S_sh``), one
  after ``S^T`` is staged and one after ``P^T`` is written.
* **CUDA graphs.** ``run`` is one launch of a compiled TileLang kernel with fixed shapes per plan;
  scratch is allocated in ``__init__``; no host synchronisation (seq_lens stay on the GPU: block
  ranges, masks and empty splits are computed in the kernel); TileLang launches on torch's current
  stream. Empty pools are replaced by one-row dummies (never read) because a TMA descriptor cannot
  describe a zero-length tensor. A plan's scratch and tickets are per plan: one call at a time per plan.

Measured (H100 80GB HBM3, bs 8 x 32K, 32/8 heads, d 128, fp16; CUDA-graph replays in the same process
as FlashInfer 0.6.15's tensor-core paged decode, which takes ~357 us = 3.0 TB/s; pool rows in
allocation order; ``launch/results/kernels_h100.json``): S_K = S_V = 1 210 us (1.71x; ideal 1.78x),
S_K = 0.5, S_V = 1 250 us (1.43x; 1.49x), S_K = 0, S_V = 1 288 us (1.24x; 1.28x), dense 360 us
(0.99x). The kernel moves 2.90-2.99 TB/s; what it leaves is the per-block step latency of one CTA
(~1.2 us) that 2 resident CTAs per SM hide only in part when a block is small (18 KB at
S_K = S_V = 1 against 32 KB dense). With pool rows in random order, 0.98x / 1.23x / 1.40x / 1.66x.
At the server's shape (bf16, block table 529 wide for a 32K context, 16 requests): 1.73x at
S_K = S_V = 1 for distinct requests, but **0.77x when the 16 requests share 6 prefixes**
(``--groups 6``): FlashInfer then reads the repeated pages from L2 (713 -> 297 us) while this kernel,
bound by its block step rather than by bytes, barely moves (411 -> 384 us).

The module imports neither TileLang nor a GPU at import time; ``build_decode_kernel`` does.
"""


import functools
from typing import Callable

import torch

from sglang_hs.kernels.common import (  # noqa: F401 (re-exported: tests and tools build with them)
    LN2, LOG2E, PASS_CONFIGS, SM90_TARGET, SMEM_PER_SM, PoolArgs, check_plan_shape, split_count,
)


def _n_pad(group: int) -> int:
    if group > 16:
        raise ValueError(f"GQA group {group} > 16 is not supported")
    return 8 if group <= 8 else 16


def smem_bytes(head_dim: int, block_size: int, stages: int, group: int, blocks_per_split: int) -> int:
    """Shared memory of one CTA (bytes), matching the buffers of :func:`build_decode_prim_func`."""
    n = _n_pad(group)
    elems = block_size * head_dim
    stage = 2 * (elems * 2 + elems + elems // 8)  # K and V: dense tile, 2:4 values, int16 metadata
    other = n * head_dim * 2 + block_size * n * 6 + 3 * blocks_per_split * 4 + 4 * 512  # Q, P, S^T, maps
    return stages * stage + other


def build_decode_prim_func(
    batch: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks: int,
    num_splits: int,
    dtype: str = "float16",
    stages: int = 2,
    threads: int = 128,
    softmax: str = "lane",
    split_barriers: bool = False,
    fused_combine: bool = True,
):
    """The TileLang ``prim_func`` (split kernel + combine kernel) for one plan.

    ``softmax="tile"`` uses TileLang's fragment reductions (a cross-warp AllReduce per column, 16
    named barriers per block); ``"lane"`` stages S^T in shared memory and gives each column to 16
    consecutive lanes (one half-warp), so the block max is 4 shuffles, the row sums stay per lane
    until the end, and a block costs 3 barriers.
    ``split_barriers``: K and V of a stage complete on separate mbarriers, so ``S^T`` and the softmax
    run while V is still landing. ``fused_combine``: the last CTA of a (request, KV head) to finish
    (an acq_rel atomic ticket) merges the splits, instead of a second kernel.
    """
    import tilelang.language as T

    B, D, S = block_size, head_dim, num_splits
    G = q_heads // kv_heads
    NH = _n_pad(G)
    accum = "float32"
    bps = -(-max_blocks // S)  # static upper bound of blocks per split
    e_rows = B * D // 16 // 16  # metadata tile as [e_rows, 16] int16 (contiguous 2*B*D/16 bytes)
    assert q_heads % kv_heads == 0 and D % 32 == 0 and B % 32 == 0 and stages >= 2
    assert threads == 128, "one warpgroup: wgmma M = 64 per instruction"
    assert softmax in ("tile", "lane")
    TPC = threads // NH  # lane softmax: threads per column (a power of two dividing 32)
    RPT = B // TPC  # rows per thread
    SHUF = [TPC >> k for k in range(1, TPC.bit_length()) if TPC >> k]  # xor offsets TPC/2 .. 1
    num_slots, nd, ns, nd2, ns2, nv = T.dynamic("num_slots, nd, ns, nd2, ns2, nv")

    def alloc_stage_buffers():
        out = []
        for _ in range(stages):
            kd = T.alloc_shared([B, D], dtype)
            ks = T.alloc_shared([B, D // 2], dtype)
            ke = T.alloc_shared([e_rows, 16], "int16")
            vd = T.alloc_shared([B, D], dtype)
            vs = T.alloc_shared([D, B // 2], dtype)
            ve = T.alloc_shared([e_rows, 16], "int16")
            bar = T.alloc_barrier([threads, threads]) if split_barriers else T.alloc_barrier(threads)
            out.append((kd, ks, ke, vd, vs, ve, bar))
        return out

    @T.macro
    def issue(i, h, mode_s, krow_s, vrow_s, kd, ks, ke, vd, vs, ve, bar, KC, VC, KD, KV, KM, VD, VV, VM):
        md = mode_s[i]
        kr = krow_s[i]
        vr = vrow_s[i]
        if split_barriers:
            if (md & 3) == 0:
                T.tma_copy(KC[kr * B:(kr + 1) * B, h, :], kd, barrier=bar[0])
            elif (md & 3) == 1:
                T.tma_copy(KD[kr, :, :], kd, barrier=bar[0])
            else:
                T.tma_copy(KV[kr, :, :], ks, barrier=bar[0])
                T.tma_copy(KM[kr, :, :], ke, barrier=bar[0])
            T.barrier_arrive(bar[0])
            if (md >> 2) == 0:
                T.tma_copy(VC[vr * B:(vr + 1) * B, h, :], vd, barrier=bar[1])
            elif (md >> 2) == 1:
                T.tma_copy(VD[vr, :, :], vd, barrier=bar[1])
            else:
                T.tma_copy(VV[vr, :, :], vs, barrier=bar[1])
                T.tma_copy(VM[vr, :, :], ve, barrier=bar[1])
            T.barrier_arrive(bar[1])
        else:
            if (md & 3) == 0:
                T.tma_copy(KC[kr * B:(kr + 1) * B, h, :], kd, barrier=bar)
            elif (md & 3) == 1:
                T.tma_copy(KD[kr, :, :], kd, barrier=bar)
            else:
                T.tma_copy(KV[kr, :, :], ks, barrier=bar)
                T.tma_copy(KM[kr, :, :], ke, barrier=bar)
            if (md >> 2) == 0:
                T.tma_copy(VC[vr * B:(vr + 1) * B, h, :], vd, barrier=bar)
            elif (md >> 2) == 1:
                T.tma_copy(VD[vr, :, :], vd, barrier=bar)
            else:
                T.tma_copy(VV[vr, :, :], vs, barrier=bar)
                T.tma_copy(VM[vr, :, :], ve, barrier=bar)
            T.barrier_arrive(bar)

    @T.macro
    def compute(j, tok0, seq, scale2, mode_s, Q_s, P_s, kd, ks, ke, vd, vs, ve, bar, parity,
                sT, oT, m, m_prev, l, rs, ssum):
        md = mode_s[j]
        if split_barriers:
            T.barrier_wait(bar[0], parity)
        if (md & 3) == 2:
            T.gemm_sp(ks, T.view(ke, [B, D // 16]), Q_s, sT,
                      transpose_B=True, clear_accum=True)
        else:
            T.gemm(kd, Q_s, sT, transpose_B=True, clear_accum=True)
        for i, hh in T.Parallel(B, NH):
            sT[i, hh] = T.if_then_else(tok0 + i < seq, sT[i, hh], -T.infinity(accum))
        T.copy(m, m_prev)
        T.reduce_max(sT, m, dim=0, clear=False)
        for hh in T.Parallel(NH):
            rs[hh] = T.exp2(m_prev[hh] * scale2 - m[hh] * scale2)
        for i, hh in T.Parallel(B, NH):
            sT[i, hh] = T.exp2(sT[i, hh] * scale2 - m[hh] * scale2)
        T.reduce_sum(sT, ssum, dim=0)
        for hh in T.Parallel(NH):
            l[hh] = l[hh] * rs[hh] + ssum[hh]
        for d, hh in T.Parallel(D, NH):
            oT[d, hh] *= rs[hh]
        T.copy(sT, P_s)
        T.fence_proxy_async()
        T.sync_threads()
        if split_barriers:
            T.barrier_wait(bar[1], parity)
        if (md >> 2) == 2:
            T.gemm_sp(vs, T.view(ve, [D, B // 16]), P_s, oT)
        else:
            T.gemm(vd, P_s, oT, transpose_A=True)

    @T.macro
    def compute_lane(j, tok0, seq, scale2, mode_s, Q_s, P_s, kd, ks, ke, vd, vs, ve, bar, parity,
                     sT, oT, S_sh, rs_sh, vals, m_run, l_run):
        md = mode_s[j]
        if split_barriers:
            T.barrier_wait(bar[0], parity)
        if (md & 3) == 2:
            T.gemm_sp(ks, T.view(ke, [B, D // 16]), Q_s, sT, transpose_B=True, clear_accum=True)
        else:
            T.gemm(kd, Q_s, sT, transpose_B=True, clear_accum=True)
        T.copy(sT, S_sh)
        T.sync_threads()
        tx = T.get_thread_binding()
        c = tx // TPC
        r0 = (tx % TPC) * RPT
        mx = T.alloc_local([1], accum)
        mx[0] = -T.infinity(accum)
        for i in T.unroll(RPT):
            vals[i] = T.if_then_else(tok0 + r0 + i < seq, S_sh[r0 + i, c], -T.infinity(accum))
            mx[0] = T.max(mx[0], vals[i])
        for k in T.unroll(len(SHUF)):
            mx[0] = T.max(mx[0], T.shfl_xor(mx[0], TPC >> (k + 1)))
        m_new = T.max(m_run[0], mx[0])
        rs = T.exp2(m_run[0] * scale2 - m_new * scale2)
        m_run[0] = m_new
        l_run[0] = l_run[0] * rs
        for i in T.unroll(RPT):
            pv = T.exp2(vals[i] * scale2 - m_new * scale2)
            l_run[0] = l_run[0] + pv
            P_s[r0 + i, c] = T.cast(pv, dtype)
        if tx % TPC == 0:
            rs_sh[c] = rs
        T.fence_proxy_async()
        T.sync_threads()
        for d, hh in T.Parallel(D, NH):
            oT[d, hh] *= rs_sh[hh]
        if split_barriers:
            T.barrier_wait(bar[1], parity)
        if (md >> 2) == 2:
            T.gemm_sp(vs, T.view(ve, [D, B // 16]), P_s, oT)
        else:
            T.gemm(vd, P_s, oT, transpose_A=True)

    compute_fn = compute_lane if softmax == "lane" else compute

    @T.macro
    def guarded_issue(i, n, h, mode_s, krow_s, vrow_s, kd, ks, ke, vd, vs, ve, bar, KC, VC, KD, KV, KM, VD, VV, VM):
        if i < n:
            issue(i, h, mode_s, krow_s, vrow_s, kd, ks, ke, vd, vs, ve, bar, KC, VC, KD, KV, KM, VD, VV, VM)

    @T.macro
    def step(j, parity, n, start, seq, scale2, h, mode_s, krow_s, vrow_s, Q_s, P_s,
             kd, ks, ke, vd, vs, ve, bar, kd2, ks2, ke2, vd2, vs2, ve2, bar2,
             KC, VC, KD, KV, KM, VD, VV, VM, sT, oT, m, m_prev, l, rs, ssum):
        if j < n:
            T.sync_threads()
            if j + stages - 1 < n:
                issue(j + stages - 1, h, mode_s, krow_s, vrow_s, kd2, ks2, ke2, vd2, vs2, ve2, bar2,
                      KC, VC, KD, KV, KM, VD, VV, VM)
            if not split_barriers:
                T.barrier_wait(bar, parity)
            compute_fn(j, (start + j) * B, seq, scale2, mode_s, Q_s, P_s, kd, ks, ke, vd, vs, ve, bar, parity,
                       sT, oT, m, m_prev, l, rs, ssum)

    # Plain Python helpers (not parsed by TileLang): unroll the stage ring.
    def emit_prologue(n, h, mode_s, krow_s, vrow_s, st, gl):
        for s in range(stages - 1):
            guarded_issue(s, n, h, mode_s, krow_s, vrow_s, *st[s], *gl)

    def emit_ring(it, n, start, seq, scale2, h, mode_s, krow_s, vrow_s, Q_s, P_s, st, gl, frags):
        for s in range(stages):
            nxt = (s + stages - 1) % stages
            step(it * stages + s, it & 1, n, start, seq, scale2, h, mode_s, krow_s, vrow_s, Q_s, P_s,
                 *st[s], *st[nxt], *gl, *frags)

    @T.prim_func
    def main(
        Q: T.Tensor([batch, q_heads, D], dtype),
        KC: T.Tensor([num_slots, kv_heads, D], dtype),
        VC: T.Tensor([num_slots, kv_heads, D], dtype),
        KD: T.Tensor([nd, B, D], dtype),
        KV: T.Tensor([ns, B, D // 2], dtype),
        KM: T.Tensor([ns, e_rows, 16], "int16"),
        VD: T.Tensor([nd2, B, D], dtype),
        VV: T.Tensor([ns2, D, B // 2], dtype),
        VM: T.Tensor([ns2, e_rows, 16], "int16"),
        KI: T.Tensor([kv_heads, nv], "int32"),
        VI: T.Tensor([kv_heads, nv], "int32"),
        BT: T.Tensor([batch, max_blocks], "int32"),
        SL: T.Tensor([batch], "int32"),
        sm_scale: T.float32,
        OP: T.Tensor([batch, q_heads, S, D], accum),
        LP: T.Tensor([batch, q_heads, S], accum),
        O: T.Tensor([batch, q_heads, D], dtype),
        LSE: T.Tensor([batch, q_heads], accum),
        CNT: T.Tensor([batch, kv_heads], "int32"),
    ):
        with T.Kernel(S, kv_heads, batch, threads=threads) as (sid, h, r):
            Q_s = T.alloc_shared([NH, D], dtype)
            P_s = T.alloc_shared([B, NH], dtype)
            mode_s = T.alloc_shared([bps], "int32")
            if fused_combine:
                tk_sh = T.alloc_shared([1], "int32")
                cm = T.alloc_local([4], accum)
            krow_s = T.alloc_shared([bps], "int32")
            vrow_s = T.alloc_shared([bps], "int32")
            st = alloc_stage_buffers()
            sT = T.alloc_fragment([B, NH], accum)
            oT = T.alloc_fragment([D, NH], accum)
            if softmax == "tile":
                m = T.alloc_fragment([NH], accum)
                m_prev = T.alloc_fragment([NH], accum)
                l = T.alloc_fragment([NH], accum)
                rs = T.alloc_fragment([NH], accum)
                ssum = T.alloc_fragment([NH], accum)
            else:
                S_sh = T.alloc_shared([B, NH], accum)
                rs_sh = T.alloc_shared([NH], accum)
                ml_sh = T.alloc_shared([2, NH], accum)
                vals = T.alloc_local([RPT], accum)
                m_run = T.alloc_local([1], accum)
                l_run = T.alloc_local([1], accum)

            seq = SL[r]
            nblk = T.ceildiv(seq, B)
            per = T.ceildiv(nblk, S)
            start = sid * per
            n = T.max(T.min(per, nblk - start), 0)
            scale2 = sm_scale * LOG2E

            # Resolve this CTA's blocks: mode = kmode | vmode << 2 (0 cache page, 1 dense row, 2 sparse row).
            for i in T.Parallel(bps):
                if i < n:
                    e = BT[r, start + i]
                    if e >= 0:
                        mode_s[i] = 0
                        krow_s[i] = e
                        vrow_s[i] = e
                    else:
                        ke_ = KI[h, -e - 1]
                        ve_ = VI[h, -e - 1]
                        mode_s[i] = T.if_then_else(ke_ >= 0, 1, 2) + T.if_then_else(ve_ >= 0, 4, 8)
                        krow_s[i] = T.if_then_else(ke_ >= 0, ke_, -ke_ - 1)
                        vrow_s[i] = T.if_then_else(ve_ >= 0, ve_, -ve_ - 1)
            for hh, d in T.Parallel(NH, D):
                Q_s[hh, d] = T.if_then_else(hh < G, Q[r, h * G + hh, d], T.cast(0, dtype))
            T.fill(oT, 0)
            if softmax == "tile":
                T.fill(l, 0)
                T.fill(m, -T.infinity(accum))
            else:
                m_run[0] = -T.infinity(accum)
                l_run[0] = 0.0
            T.fence_proxy_async()
            T.sync_threads()

            gl = (KC, VC, KD, KV, KM, VD, VV, VM)
            frags = (sT, oT, m, m_prev, l, rs, ssum) if softmax == "tile" else (sT, oT, S_sh, rs_sh, vals, m_run, l_run)
            emit_prologue(n, h, mode_s, krow_s, vrow_s, st, gl)
            for it in T.serial(T.ceildiv(n, stages)):
                emit_ring(it, n, start, seq, scale2, h, mode_s, krow_s, vrow_s, Q_s, P_s, st, gl, frags)

            if softmax == "tile":
                for hh in T.Parallel(NH):
                    if hh < G:
                        LP[r, h * G + hh, sid] = T.if_then_else(
                            l[hh] > 0, T.log2(l[hh]) + m[hh] * scale2, -T.infinity(accum))
                for d, hh in T.Parallel(D, NH):
                    if hh < G:
                        OP[r, h * G + hh, sid, d] = T.if_then_else(l[hh] > 0, oT[d, hh] / l[hh], 0.0)
            else:
                tx = T.get_thread_binding()
                for k in T.unroll(len(SHUF)):
                    l_run[0] = l_run[0] + T.shfl_xor(l_run[0], TPC >> (k + 1))
                if tx % TPC == 0:
                    ml_sh[0, tx // TPC] = m_run[0]
                    ml_sh[1, tx // TPC] = l_run[0]
                T.sync_threads()
                for hh in T.Parallel(NH):
                    if hh < G:
                        LP[r, h * G + hh, sid] = T.if_then_else(
                            ml_sh[1, hh] > 0, T.log2(ml_sh[1, hh]) + ml_sh[0, hh] * scale2, -T.infinity(accum))
                for d, hh in T.Parallel(D, NH):
                    if hh < G:
                        OP[r, h * G + hh, sid, d] = T.if_then_else(ml_sh[1, hh] > 0, oT[d, hh] / ml_sh[1, hh], 0.0)

            if fused_combine:
                # Split-KV merge by the last CTA of this (request, KV head): release our partials,
                # take a ticket (acq_rel, device scope), and merge if we are the S-th.
                tid = T.get_thread_binding()
                T.sync_threads()
                if tid == 0:
                    tk_sh[0] = T.atomic_add(CNT[r, h], 1, memory_order="acq_rel", return_prev=True)
                T.sync_threads()
                if tk_sh[0] == S - 1:
                    for it2 in T.serial(T.ceildiv(G * D, threads)):
                        g = (it2 * threads + tid) // D
                        d = (it2 * threads + tid) % D
                        if g < G:
                            cm[0] = -T.infinity(accum)
                            for s2 in T.serial(S):
                                cm[0] = T.max(cm[0], LP[r, h * G + g, s2])
                            cm[1] = 0.0
                            cm[2] = 0.0
                            for s2 in T.serial(S):
                                cm[3] = T.if_then_else(LP[r, h * G + g, s2] == -T.infinity(accum), 0.0,
                                                       T.exp2(LP[r, h * G + g, s2] - cm[0]))
                                cm[1] = cm[1] + cm[3]
                                cm[2] = cm[2] + cm[3] * OP[r, h * G + g, s2, d]
                            O[r, h * G + g, d] = T.if_then_else(cm[1] > 0, cm[2] / cm[1], 0.0)
                            if d == 0:
                                LSE[r, h * G + g] = T.if_then_else(
                                    cm[1] > 0, (T.log2(cm[1]) + cm[0]) * LN2, -T.infinity(accum))
                    if tid == 0:
                        CNT[r, h] = 0

        if not fused_combine:
            with T.Kernel(q_heads, batch, threads=D) as (qh, r):
                tx = T.get_thread_binding()
                lmax = T.alloc_var(accum)
                tot = T.alloc_var(accum)
                acc = T.alloc_var(accum)
                w = T.alloc_var(accum)
                lmax = -T.infinity(accum)
                for s in T.serial(S):
                    lmax = T.max(lmax, LP[r, qh, s])
                tot = 0.0
                acc = 0.0
                for s in T.serial(S):
                    w = T.if_then_else(LP[r, qh, s] == -T.infinity(accum), 0.0, T.exp2(LP[r, qh, s] - lmax))
                    tot = tot + w
                    acc = acc + w * OP[r, qh, s, tx]
                O[r, qh, tx] = T.if_then_else(tot > 0, acc / tot, 0.0)
                if tx == 0:
                    LSE[r, qh] = T.if_then_else(tot > 0, (T.log2(tot) + lmax) * LN2, -T.infinity(accum))

    return main


@functools.lru_cache(maxsize=None)
def build_decode_kernel(batch, q_heads, kv_heads, head_dim, block_size, max_blocks, num_splits,
                        dtype="float16", stages=2, softmax="lane", split_barriers=False, fused_combine=True,
                        target=None):
    """Compile (or load from TileLang's cache) the kernel of one plan. Needs TileLang, not a GPU."""
    import tilelang

    func = build_decode_prim_func(batch, q_heads, kv_heads, head_dim, block_size, max_blocks, num_splits,
                                  dtype=dtype, stages=stages, softmax=softmax, split_barriers=split_barriers,
                                  fused_combine=fused_combine)
    return tilelang.compile(func, target=target or SM90_TARGET, pass_configs=PASS_CONFIGS)


def choose_num_splits(batch: int, kv_heads: int, max_blocks: int, num_sms: int,
                      ctas_per_sm: int | Callable[[int], int], max_splits: int = 128) -> int:
    """Splits per (request, KV head): the fewest that keep every resident CTA slot busy
    (:func:`sglang_hs.kernels.common.split_count`; a CTA costs just its ``ceil(max_blocks / S)`` blocks).
    ``ctas_per_sm`` may depend on ``S`` (a callable): a CTA's index maps hold its ``ceil(max_blocks / S)``
    blocks."""
    return split_count(batch * kv_heads, max_blocks, num_sms, ctas_per_sm, max_splits)


def plan_num_splits(batch: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int, max_blocks: int,
                    stages: int, num_sms: int) -> int:
    """The split count a plan uses by default (a plan's kernel is compiled for it, so ahead-of-time
    compilation needs it without a GPU: pass the target GPU's SM count).

    Occupancy is counted per candidate split count: at a 32K context (529 blocks) the index maps of an
    unsplit CTA push it just past half an SM's shared memory, so one split would leave one CTA per SM
    where two halves of the range fit two (and one CTA per SM hides less of a block step's latency)."""

    def ctas_per_sm(splits: int) -> int:
        per_cta = smem_bytes(head_dim, block_size, stages, q_heads // kv_heads, -(-max_blocks // splits)) + 1024
        return max(1, min(SMEM_PER_SM // per_cta, 8))

    return choose_num_splits(batch, kv_heads, max_blocks, num_sms, ctas_per_sm)


class HieraSparseDecode:
    """Plan + run of the mixed dense/2:4-sparse split-KV decode kernel (see the module docstring).

    ``__init__`` compiles or loads the kernel for the given batch size and ``max_blocks`` (the width of
    ``block_table``) and allocates the split-KV scratch. ``run`` is CUDA-graph capturable.
    """

    def __init__(self, batch_size: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
                 max_blocks: int, dtype: torch.dtype, device, num_splits: int | None = None,
                 stages: int = 2, softmax: str = "lane", split_barriers: bool = False,
                 fused_combine: bool = True):
        check_plan_shape(q_heads, kv_heads, head_dim, block_size, dtype)
        self.batch_size, self.q_heads, self.kv_heads = batch_size, q_heads, kv_heads
        self.head_dim, self.block_size, self.max_blocks = head_dim, block_size, max_blocks
        self.dtype, self.device, self.stages, self.softmax = dtype, torch.device(device), stages, softmax
        self.split_barriers, self.fused_combine = split_barriers, fused_combine
        if num_splits is None:
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            num_splits = plan_num_splits(batch_size, q_heads, kv_heads, head_dim, block_size, max_blocks, stages,
                                         num_sms)
        self.num_splits = int(num_splits)
        dt = "float16" if dtype == torch.float16 else "bfloat16"
        self.kernel = build_decode_kernel(batch_size, q_heads, kv_heads, head_dim, block_size, max_blocks,
                                          self.num_splits, dt, stages, softmax, split_barriers, fused_combine)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.o_part = torch.empty(batch_size, q_heads, self.num_splits, head_dim, **f32)
        self.lse_part = torch.empty(batch_size, q_heads, self.num_splits, **f32)
        self.lse = torch.empty(batch_size, q_heads, **f32)
        # Split tickets of the fused merge; the merging CTA resets its entry, so it stays zero between calls.
        self.counter = torch.zeros(batch_size, kv_heads, dtype=torch.int32, device=self.device)
        self.pools = PoolArgs(kv_heads, head_dim, block_size, dtype, self.device)

    def run(self, q, k_cache, v_cache, k_dense, k_values, k_meta, v_dense, v_values, v_meta,
            k_index, v_index, block_table, seq_lens, sm_scale, out=None, return_lse=False):
        """Decode attention; returns ``out [bs, Hq, D]`` (and the natural-log LSE ``[bs, Hq]``, a
        plan-owned buffer overwritten by the next call, when ``return_lse``)."""
        if out is None:
            out = torch.empty_like(q)
        self.kernel(
            q, k_cache, v_cache,
            *self.pools(k_dense, k_values, k_meta, v_dense, v_values, v_meta, k_index, v_index),
            block_table, seq_lens, float(sm_scale),
            self.o_part, self.lse_part, out, self.lse, self.counter,
        )
        return (out, self.lse) if return_lse else out
