"""The TIR pieces both extend schedules share (``extend_overlap``, ``extend_producer``).

:class:`ExtendParts` holds one configuration's constants and the TileLang macros of a CTA's work
that do not depend on how the block loop is scheduled: finding the CTA's request and query tokens,
resolving block-table entries into the index ring, the TMA loads of a stage item, the two GEMMs,
the causal mask, the lazy-offset softmax, the asynchronous block step, and the output write with
the split-KV merge. The design is described in ``kernels/extend.py``; measurements in
``docs/kernels.md``.

Importing this module needs neither TileLang nor a GPU; constructing :class:`ExtendParts` does.
"""

from typing import NamedTuple

from sglang_hs.kernels.common import LN2, LOG2E, KvSources, Stage, tma_loads

# name -> (N query columns per CTA, threads of the consumer warpgroups).
TILES = {"n64": (64, 128), "n128": (128, 256)}


def resolve_chunk(tile: str) -> int:
    """Blocks whose index entries one parallel pass resolves (one entry per thread, at most)."""
    return TILES[tile][1] // 2


# Any of a warpgroup's threads (a warpgroup barrier that also ORs a predicate: bar.red.or, PTX ISA).
WARPGROUP_ANY_SRC = r"""
__device__ __forceinline__ int hs_warpgroup_any(int pred, int bar_id) {
  int out;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n barrier.cta.red.or.pred q, %2, 128, p;\n"
               " selp.s32 %0, 1, 0, q;\n}\n" : "=r"(out) : "r"(pred), "r"(bar_id) : "memory");
  return out;
}
"""


class Outputs(NamedTuple):
    """The merge's shared scratch and the kernel's outputs."""

    m_sh: object  # [N] shared: the columns' offsets, then the merge's sums of weights
    rs_sh: object  # [N] shared: the merge's weights of one split
    tk_sh: object  # [1] shared: the split ticket
    l: object  # [N] fragment: the row sums reduced
    cm: object  # [2] local: a column's largest split LSE and sum of weights
    O: object
    LSE: object
    OP: object
    LP: object
    CNT: object


class IndexRing(NamedTuple):
    """Resolved block-table entries of two passes (``2 * resolve_chunk`` blocks) in shared memory:
    ``mode = k_mode | v_mode << 2`` (0 cache page, 1 dense pool row, 2 2:4 pool row) and the row of
    each operand (cache page or pool row)."""

    block_table: object
    k_index: object
    v_index: object
    mode: object
    k_row: object
    v_row: object


class Softmax(NamedTuple):
    """A consumer thread's block-step state: ``S^T`` (then ``P^T``) and ``O^T`` accumulators, the row
    sums, the columns' scaled offsets and rescale factors, shared scratch of the offset move, the
    block's column max, the lane's largest scores, and the mode of the block whose O^T GEMM is
    pending."""

    scores: object  # S^T / P^T fragment [B, N]
    out: object  # O^T fragment [D, N]
    row_sums: object  # [B, N], reduced over the tokens once at the end
    offsets: object  # [N] scaled offsets (log2 units)
    rescale: object  # [N]
    move_sh: object  # [N] shared: an offset move per column
    block_max: object  # [1] local: the column max of the lane's column
    lane_max: object  # [8] local: the lane's largest scores, in independent chains
    pending_mode: object  # [1] local int32


class ExtendParts:
    """Constants and shared macros of one extend configuration.

    ``producer``: the CTA has a producer warpgroup after the consumers (threads ``[threads,
    threads + 128)``), which issues the loads; otherwise warp 0 of the consumers issues them.
    """

    def __init__(self, q_heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: str, tile: str,
                 stages: int, k_sparse: bool, producer: bool):
        import tilelang.language as T

        self.T = T
        B, D = block_size, head_dim
        N, threads = TILES[tile]
        G = q_heads // kv_heads
        assert q_heads % kv_heads == 0 and N % G == 0, "GQA group must divide the tile's N"
        assert D % 32 == 0 and B % 32 == 0 and stages >= 2
        HALF = resolve_chunk(tile)  # index entries resolved per pass; the ring holds two passes
        RB = 2 * HALF
        assert HALF >= stages and RB & (RB - 1) == 0
        TPC = threads // N  # lane max: threads per column (consecutive lanes)
        assert threads % N == 0 and 32 % TPC == 0
        self.q_heads, self.kv_heads, self.B, self.D, self.N, self.G = q_heads, kv_heads, B, D, N, G
        self.threads, self.stages, self.k_sparse, self.dtype, self.producer = threads, stages, k_sparse, dtype, producer
        self.TQ = N // G  # query tokens per tile
        self.HALF, self.RB = HALF, RB
        self.accum = "float32"
        self.e_rows = B * D // 16 // 16  # metadata tile as [e_rows, 16] int16 (contiguous 2*B*D/16 bytes)
        self.NEG = -T.infinity(self.accum)
        self.CLAMP = 6.0e4 if dtype == "float16" else 1.0e30  # finite in the 16-bit type
        self.LAZY = 8.0  # a column's offset moves once one of its P would exceed 2^LAZY
        self.TPC = TPC
        self.RPT = B // TPC  # rows per thread (interleaved: row i * TPC + lane % TPC)
        self.SHUF = [TPC >> k for k in range(1, TPC.bit_length()) if TPC >> k]  # xor offsets TPC/2 .. 1
        self.LANE_CHAINS = 8  # lazy offset: independent chains of a lane's largest score
        (self.total, self.num_slots, self.nd, self.ns, self.nd2, self.ns2, self.nv, self.bs1, self.bs, self.mb,
         self.prow, self.S, self.nt) = T.dynamic("total, num_slots, nd, ns, nd2, ns2, nv, bs1, bs, mb, prow, S, nt")
        self._define_macros()

    def alloc_stages(self) -> list[Stage]:
        """The stage ring (plain Python: called inside the kernel)."""
        T, B, D = self.T, self.B, self.D
        out = []
        for _ in range(self.stages):
            out.append(Stage(
                T.alloc_shared([B, D], self.dtype),
                T.alloc_shared([B, D // 2], self.dtype) if self.k_sparse else None,
                T.alloc_shared([self.e_rows, 16], "int16") if self.k_sparse else None,
                T.alloc_shared([B, D], self.dtype),
                T.alloc_shared([D, B // 2], self.dtype),
                T.alloc_shared([self.e_rows, 16], "int16"),
                # One arrival per issue (full) and one per consumer warp (empty), not one per thread.
                T.alloc_barrier(1),
                T.alloc_barrier(self.threads // 32),
            ))  # fmt: skip
        return out

    def _define_macros(self):  # noqa: C901 (one closure per macro)
        T = self.T
        B, D, N, G, TQ = self.B, self.D, self.N, self.G, self.TQ
        HALF, RB, TPC, RPT, SHUF = self.HALF, self.RB, self.TPC, self.RPT, self.SHUF
        threads, stages, k_sparse, dtype, producer = self.threads, self.stages, self.k_sparse, self.dtype, self.producer
        accum, NEG, CLAMP, LAZY, CHAINS = self.accum, self.NEG, self.CLAMP, self.LAZY, self.LANE_CHAINS
        POL = T.GemmWarpPolicy.Square  # each warpgroup owns 64 columns of both S^T and O^T

        @T.macro
        def resolve(chunk, n, r, start, h, ring):
            # Index entries of blocks [chunk*HALF, (chunk+1)*HALF) of this CTA into ring half chunk % 2.
            for i in T.Parallel(HALF):
                if chunk * HALF + i < n:
                    e = ring.block_table[r, start + chunk * HALF + i]
                    slot = (chunk % 2) * HALF + i
                    if e >= 0:
                        ring.mode[slot] = 0
                        ring.k_row[slot] = e
                        ring.v_row[slot] = e
                    else:
                        ke_ = ring.k_index[h, -e - 1]
                        ve_ = ring.v_index[h, -e - 1]
                        ring.mode[slot] = T.if_then_else(ke_ >= 0, 1, 2) + T.if_then_else(ve_ >= 0, 4, 8)
                        ring.k_row[slot] = T.if_then_else(ke_ >= 0, ke_, -ke_ - 1)
                        ring.v_row[slot] = T.if_then_else(ve_ >= 0, ve_, -ve_ - 1)

        load_k, load_v = tma_loads(T, B, k_sparse)

        @T.macro
        def load(i, n, h, ring, stage, src):
            # The loads of stage item i: K of block i and V of block i - 1, those that are blocks of the
            # CTA (items 0 .. n; issued by one elected thread, the caller arrives).
            if i < n:
                load_k(ring.mode[i % RB], ring.k_row[i % RB], h, stage, src)
            if i >= 1:
                load_v(ring.mode[(i - 1) % RB], ring.v_row[(i - 1) % RB], h, stage, src)

        @T.macro
        def issuer_arrive(full):
            # The one arrival on a full barrier (count 1), by lane 0 of the issuing warp once the
            # elected lane's expected-byte counts are registered (__syncwarp orders them).
            T.sync_warp()
            if T.get_thread_binding() == (threads if producer else 0):
                T.barrier_arrive(full)

        @T.macro
        def consumer_sync():
            # A barrier of the threads that hold the fragments: the CTA, or with a producer warpgroup
            # its first `threads` (barrier 1 with that count, as TileLang's own reductions over them use).
            if producer:
                T.sync_threads(1, threads)
            else:
                T.sync_threads()

        @T.macro
        def group_barrier():
            # Between the phases of a block step only the warpgroup that owns the columns meets, on its
            # own named barrier.
            T.sync_threads(8 + T.get_thread_binding() // 128, 128)

        @T.macro
        def gemm_s(md, Q_s, stage, sT):
            # S^T = K·Q^T for one block, dense or 2:4 by the block's K mode; issued without a wait.
            if k_sparse:
                if (md & 3) == 2:
                    T.wgmma_gemm_sp(stage.k_values, T.view(stage.k_meta, [B, D // 16]), Q_s, sT, transpose_B=True,
                                    clear_accum=True, policy=POL)
                else:
                    T.wgmma_gemm(stage.k_dense, Q_s, sT, transpose_B=True, clear_accum=True, policy=POL)
            else:
                T.wgmma_gemm(stage.k_dense, Q_s, sT, transpose_B=True, clear_accum=True, policy=POL)

        @T.macro
        def gemm_o(vmode, P_s, stage, oT, dense, sparse):
            # O^T += V^T·P^T for one block, dense or 2:4 by the block's V mode.
            if vmode == 2:
                sparse(stage.v_values, T.view(stage.v_meta, [D, B // 16]), P_s, oT, policy=POL)
            else:
                dense(stage.v_dense, P_s, oT, transpose_A=True, policy=POL)

        @T.macro
        def lane_column_max(P_s, sT, mx):
            # Column max over the block's tokens: S^T goes through P_s (in the kernel's 16-bit type,
            # clamped to +-CLAMP so that masked keys are finite there and fp16 cannot overflow), then
            # TPC consecutive lanes own a column and hold its max in mx[0]. Returns the thread index
            # and its column.
            for i, c in T.Parallel(B, N):
                P_s[i, c] = T.cast(T.max(T.min(sT[i, c], CLAMP), -CLAMP), dtype)
            group_barrier()
            tx = T.get_thread_binding()
            cc = tx // TPC
            mx[0] = -CLAMP
            for i in T.unroll(RPT):
                mx[0] = T.max(mx[0], T.cast(P_s[i * TPC + tx % TPC, cc], accum))
            for k in T.unroll(len(SHUF)):
                mx[0] = T.max(mx[0], T.shfl_xor(mx[0], TPC >> (k + 1)))
            return tx, cc

        @T.macro
        def causal_mask(jj, jm, qlast, tv, sT):
            if jj >= jm:  # the block reaches past the tile's first query position
                for i, c in T.Parallel(B, N):
                    sT[i, c] = T.if_then_else(jj * B + i <= qlast - T.max(tv - 1 - c // G, 0), sT[i, c], NEG)

        @T.macro
        def lazy_scores(first, scale2, sT, msc, pmax):
            # The scores against the columns' current (scaled) offsets msc, and the lane's largest of
            # them in pmax[0] (kept in CHAINS independent chains; LAZY + LAZY on the CTA's first block,
            # so that its offsets are always set).
            for k in T.unroll(CHAINS):
                pmax[k] = T.if_then_else(first, LAZY + LAZY, NEG)
            for i, c in T.Parallel(B, N):
                sT[i, c] = sT[i, c] * scale2 - msc[c]  # masked keys stay -inf
                pmax[c // 8 % (CHAINS // 2) * 2 + c % 2] = T.max(pmax[c // 8 % (CHAINS // 2) * 2 + c % 2], sT[i, c])
            for k in T.unroll(1, CHAINS):
                pmax[0] = T.max(pmax[0], pmax[k])

        @T.macro
        def softmax(first, jj, jm, qlast, tv, scale2, P_s, sm):
            # Turn S^T into the block's unnormalised P^T (in place) and update the row sums. Lazy offset
            # (FA4's conditional rescale): the scores are taken against the columns' current offsets;
            # only when one of the warpgroup passes its offset by more than 2^LAZY (a bar.red.or vote
            # over the warpgroup), or on the CTA's first block, does the column max go through P_s
            # (lane_column_max) and the offsets, O^T and the sums move. The move waits for the pending
            # O^T GEMM first (it rescales O^T and reuses P_s).
            sT, oT, lacc, msc, rs, msc_sh, mx, pmax = sm[:8]
            causal_mask(jj, jm, qlast, tv, sT)
            lazy_scores(first, scale2, sT, msc, pmax)
            if T.call_extern("int32", "hs_warpgroup_any", T.if_then_else(pmax[0] > LAZY, 1, 0),
                             12 + T.get_thread_binding() // 128) != 0:
                T.wait_wgmma(0)
                group_barrier()
                tx, cc = lane_column_max(P_s, sT, mx)
                if tx % TPC == 0:
                    # The offset's move: up to the block max (the first block sets the offset there, kept
                    # >= -CLAMP so that a fully masked column stays finite).
                    msc_sh[cc] = T.if_then_else(first, mx[0], T.max(mx[0], 0.0))
                group_barrier()
                for c in T.Parallel(N):
                    rs[c] = T.if_then_else(first, 1.0, T.exp2(-msc_sh[c]))  # O^T and the sums are 0 first
                    msc[c] = msc[c] + msc_sh[c]
                for i, c in T.Parallel(B, N):
                    sT[i, c] = T.exp2(sT[i, c] - msc_sh[c])
                    lacc[i, c] = lacc[i, c] * rs[c] + sT[i, c]
                for d, c in T.Parallel(D, N):
                    oT[d, c] *= rs[c]
            else:
                for i, c in T.Parallel(B, N):
                    sT[i, c] = T.exp2(sT[i, c])
                    lacc[i, c] = lacc[i, c] + sT[i, c]

        @T.macro
        def block_step(first, jj, jm, qlast, tv, scale2, md, j, Q_s, P_s, stage, sm, pingpong):
            # Block step j (FA3's intra-warpgroup overlap): issue S^T(j), then O^T += V^T·P^T of block
            # j - 1 (P^T(j - 1) is in P_s, its mode in pending_mode, its V in this stage), and wait for
            # S^T only, so that the O^T GEMM runs under block j's softmax. Then the O^T GEMM is waited
            # for, the stage released, and P^T(j) written once every warp's GEMM has read P_s.
            # pingpong (FA3's ping-pong of two consumer warpgroups): warpgroup wg issues its GEMMs on its
            # turn (named barrier 10 + wg) and hands the turn to the other once its S^T is ready, so that
            # one warpgroup's softmax runs while the other's GEMMs have the tensor cores.
            if pingpong:
                T.sync_threads(10 + T.get_thread_binding() // 128, 256)
            gemm_s(md, Q_s, stage, sm.scores)
            if j >= 1:
                gemm_o(sm.pending_mode[0] >> 2, P_s, stage, sm.out, T.wgmma_gemm, T.wgmma_gemm_sp)
                T.wait_wgmma(1)
            else:
                T.wait_wgmma(0)
            if pingpong:
                T.named_barrier_arrive(11 - T.get_thread_binding() // 128, 256)
            softmax(first, jj, jm, qlast, tv, scale2, P_s, sm)
            T.wait_wgmma(0)
            T.sync_warp()
            if T.get_thread_binding() % 32 == 0:
                T.barrier_arrive(stage.empty)  # this warp's GEMMs on the stage are complete
            group_barrier()  # WAR: every warp's O^T GEMM of block j - 1 has read P_s
            T.copy(sm.scores, P_s)
            T.fence_proxy_async()  # #2634: generic writes of P^T before the (sparse) wgmma reads them
            group_barrier()
            sm.pending_mode[0] = md

        @T.macro
        def final_gemm_if(n, s, P_s, stage, sm):
            # After the loop: the O^T GEMM of the last block, whose V is stage item n (stage s).
            if n >= 1:
                if n % stages == s:
                    T.barrier_wait(stage.full, n // stages % 2)
                    gemm_o(sm.pending_mode[0] >> 2, P_s, stage, sm.out, T.gemm, T.gemm_sp)

        @T.macro
        def init_fragments(oT, lacc, msc):
            T.fill(oT, 0)
            T.fill(lacc, 0)
            T.fill(msc, 0)  # scaled offsets; the first block step sets them

        @T.macro
        def merge_splits(tile, oT, msc_sh, out):
            # First per column (thread c): the largest split LSE (msc_sh) and the sum of the splits'
            # weights (m_sh); then every element of O^T at once, with O^T's registers as the accumulator,
            # so that a thread's loads do not wait on each other. Splits are added in index order whichever
            # CTA merges (deterministic). Empty splits wrote an LSE of -inf and no partial O.
            tx = T.get_thread_binding()
            m_sh, rs_sh, cm = out.m_sh, out.rs_sh, out.cm
            if tx < N:
                if tx // G < tile.tv:
                    row_c = tile.q0 + tile.t0 + tx // G
                    out.cm[0] = NEG
                    for s2 in T.serial(self.S):
                        out.cm[0] = T.max(out.cm[0], out.LP[row_c, tile.h * G + tx % G, s2])
                    out.cm[1] = 0.0
                    for s2 in T.serial(self.S):
                        if out.LP[row_c, tile.h * G + tx % G, s2] != NEG:
                            out.cm[1] = out.cm[1] + T.exp2(out.LP[row_c, tile.h * G + tx % G, s2] - out.cm[0])
                    msc_sh[tx] = out.cm[0]
                    m_sh[tx] = out.cm[1]
                    out.LSE[row_c, tile.h * G + tx % G] = T.if_then_else(out.cm[1] > 0, (T.log2(out.cm[1]) + out.cm[0]) * LN2, NEG)
            T.fill(oT, 0)
            for s2 in T.serial(self.S):
                # The split's weight per column (0 for an empty split), then its partial O for every
                # element: unconditional loads (an empty split's rows hold stale values, which the select
                # drops).
                consumer_sync()
                if tx < N:
                    rs_sh[tx] = 0.0
                    if tx // G < tile.tv:
                        if out.LP[tile.q0 + tile.t0 + tx // G, tile.h * G + tx % G, s2] != NEG:
                            rs_sh[tx] = T.exp2(out.LP[tile.q0 + tile.t0 + tx // G, tile.h * G + tx % G, s2] - msc_sh[tx])
                consumer_sync()
                for d, c in T.Parallel(D, N):
                    oT[d, c] = T.if_then_else(
                        rs_sh[c] > 0,
                        oT[d, c] + rs_sh[c] * out.OP[tile.q0 + tile.t0 + T.min(c // G, tile.tv - 1), tile.h * G + c % G, s2, d],
                        oT[d, c])

        @T.macro
        def write_output(tile, sm, out):
            # The CTA's columns: with one split the normalised O and the LSE; otherwise the split's partial
            # O and base-2 LSE, then the last CTA of this (tile, KV head) to finish merges the splits.
            tx = T.get_thread_binding()
            oT, msc, m_sh, msc_sh, tk_sh, l = sm.out, sm.offsets, out.m_sh, sm.move_sh, out.tk_sh, out.l
            T.reduce_sum(sm.row_sums, l, dim=0)  # once per CTA (scalar AllReduce: correct for 2 warpgroups)
            for c in T.Parallel(N):
                m_sh[c] = msc[c] / tile.scale2  # the LSE below scales it back
            consumer_sync()
            if self.S == 1:
                for d, c in T.Parallel(D, N):
                    if c // G < tile.tv:
                        out.O[tile.q0 + tile.t0 + c // G, tile.h * G + c % G, d] = T.cast(
                            T.if_then_else(l[c] > 0, oT[d, c] / l[c], 0.0), dtype)
                for c in T.Parallel(N):
                    if c // G < tile.tv:
                        out.LSE[tile.q0 + tile.t0 + c // G, tile.h * G + c % G] = T.if_then_else(
                            l[c] > 0, (T.log2(l[c]) + m_sh[c] * tile.scale2) * LN2, NEG)
            else:
                for c in T.Parallel(N):
                    if c // G < tile.tv:
                        out.LP[tile.q0 + tile.t0 + c // G, tile.h * G + c % G, tile.sid] = T.if_then_else(
                            l[c] > 0, T.log2(l[c]) + m_sh[c] * tile.scale2, NEG)
                if tile.n > 0:
                    for d, c in T.Parallel(D, N):
                        if c // G < tile.tv:
                            out.OP[tile.q0 + tile.t0 + c // G, tile.h * G + c % G, tile.sid, d] = T.if_then_else(
                                l[c] > 0, oT[d, c] / l[c], 0.0)
                # Split-KV merge by the last CTA of this (tile, KV head): release our partials, take a
                # ticket (acq_rel, device scope), and merge if we are the S-th.
                consumer_sync()
                if tx == 0:
                    tk_sh[0] = T.atomic_add(out.CNT[tile.tile_id, tile.h], 1, memory_order="acq_rel", return_prev=True)
                consumer_sync()
                if tk_sh[0] == self.S - 1:
                    merge_splits(tile, oT, msc_sh, out)
                    for d, c in T.Parallel(D, N):
                        if c // G < tile.tv:
                            out.O[tile.q0 + tile.t0 + c // G, tile.h * G + c % G, d] = T.cast(
                                T.if_then_else(m_sh[c] > 0, oT[d, c] / m_sh[c], 0.0), dtype)
                    if tx == 0:
                        out.CNT[tile.tile_id, tile.h] = 0

        def final_gemms(tile, P_s, st, sm):
            # Plain Python: final_gemm_if for each stage (the one that holds item n runs).
            for s in range(stages):
                final_gemm_if(tile.n, s, P_s, st[s], sm)

        self.write_output, self.final_gemms = write_output, final_gemms
        self.resolve, self.load_k, self.load_v, self.load = resolve, load_k, load_v, load
        self.issuer_arrive, self.consumer_sync, self.group_barrier = issuer_arrive, consumer_sync, group_barrier
        self.block_step, self.final_gemm_if, self.init_fragments = block_step, final_gemm_if, init_fragments

    def prim_func(self, schedule):
        """The kernel of this configuration with ``schedule``'s block loop (every batch dimension is
        dynamic). ``schedule`` gives ``extra_threads`` (threads after the consumers), ``init_early``
        (fragments zeroed before the CTA barrier that publishes Q, or by the consumers afterwards),
        ``alloc_state(parts)`` (plain Python: what its block loop keeps besides the shared state) and
        the macro ``block_loop(parts, tile, r, h, sid, tile_id, Q_s, P_s, ring, stages, src, sm, state,
        out_sh, l, cm, O, LSE, OP, LP, CNT)``, which ends with :meth:`write_output` on the consumers.

        Arguments, in order: ``Q [total, Hq, D]``, ``KC, VC [slots, Hkv, D]``, the six pools, ``KI, VI
        [Hkv, n_virtual]``, ``QI [bs + 1]`` (qo_indptr), ``BT [bs, max_blocks]``, ``SL [bs]``,
        ``sm_scale``, ``OP [rows, Hq, S, D]`` and ``LP [rows, Hq, S]`` (split partials; the split count
        ``S`` is bound from their shape, and with ``S = 1`` they may be one-row dummies), ``O [total, Hq,
        D]``, ``LSE [total, Hq]`` (natural log), ``CNT [tile ids, Hkv]`` (zeroed tickets; the grid's x
        extent is bound from it).
        """
        T = self.T
        B, D, N, G, TQ, RB = self.B, self.D, self.N, self.G, self.TQ, self.RB
        q_heads, kv_heads, dtype, accum, e_rows = self.q_heads, self.kv_heads, self.dtype, self.accum, self.e_rows
        threads = self.threads
        total, num_slots, nd, ns, nd2, ns2, nv = self.total, self.num_slots, self.nd, self.ns, self.nd2, self.ns2, self.nv
        bs1, bs, mb, prow, S, nt = self.bs1, self.bs, self.mb, self.prow, self.S, self.nt
        parts = self

        @T.prim_func
        def main(
            Q: T.Tensor([total, q_heads, D], dtype),
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
            QI: T.Tensor([bs1], "int32"),
            BT: T.Tensor([bs, mb], "int32"),
            SL: T.Tensor([bs], "int32"),
            sm_scale: T.float32,
            OP: T.Tensor([prow, q_heads, S, D], accum),
            LP: T.Tensor([prow, q_heads, S], accum),
            O: T.Tensor([total, q_heads, D], dtype),
            LSE: T.Tensor([total, q_heads], accum),
            CNT: T.Tensor([nt, kv_heads], "int32"),
        ):
            with T.Kernel(nt, kv_heads, S, threads=threads + schedule.extra_threads) as (bx, h, sid):
                T.import_source(WARPGROUP_ANY_SRC)
                # Tile ids in descending order: a request's later tiles see more blocks (causal), so in a
                # long prefill the longest CTAs start first instead of forming the last wave.
                tile_id = nt - 1 - bx
                Q_s = T.alloc_shared([N, D], dtype)
                P_s = T.alloc_shared([B, N], dtype)  # S^T (for the column max), then P^T (GEMM2's B)
                mode_s = T.alloc_shared([RB], "int32")
                krow_s = T.alloc_shared([RB], "int32")
                vrow_s = T.alloc_shared([RB], "int32")
                req_sh = T.alloc_shared([1], "int32")
                tk_sh = T.alloc_shared([1], "int32")
                msc_sh = T.alloc_shared([N], accum)
                rs_sh = T.alloc_shared([N], accum)
                m_sh = T.alloc_shared([N], accum)
                cm = T.alloc_local([2], accum)  # merge: a column's max and sum of weights
                st = parts.alloc_stages()
                sT = T.alloc_fragment([B, N], accum)
                oT = T.alloc_fragment([D, N], accum)
                lacc = T.alloc_fragment([B, N], accum)  # row sums, per thread (reduced once at the end)
                l = T.alloc_fragment([N], accum)
                rs = T.alloc_fragment([N], accum)
                msc = T.alloc_fragment([N], accum)
                mx = T.alloc_local([1], accum)
                pmax = T.alloc_local([parts.LANE_CHAINS], accum)
                mdp = T.alloc_local([1], "int32")
                schedule.alloc_state(parts)
                tid = T.get_thread_binding()
                # Per-CTA scalars live in registers (plain Python bindings of loads would be re-inlined,
                # with their bounds checks, at every use).
                q0 = T.alloc_var("int32")
                nq = T.alloc_var("int32")
                t0 = T.alloc_var("int32")
                tv = T.alloc_var("int32")
                qlast = T.alloc_var("int32")
                jm = T.alloc_var("int32")
                start = T.alloc_var("int32")
                n = T.alloc_var("int32")
                scale2 = T.alloc_var(accum)

                # Which request owns this tile id? Request r's ids start at qo_indptr[r] // TQ + r.
                if tid == 0:
                    req_sh[0] = -1
                T.sync_threads()
                for it0 in T.serial(T.ceildiv(bs, threads)):
                    rr = it0 * threads + tid
                    if rr < bs:
                        q0 = QI[rr]
                        nq = QI[rr + 1] - q0
                        t0 = q0 // TQ + rr  # first tile id of request rr
                        if t0 <= tile_id and tile_id < t0 + T.ceildiv(nq, TQ):
                            req_sh[0] = rr
                T.sync_threads()
                r = req_sh[0]
                if r >= 0:
                    q0 = QI[r]
                    nq = QI[r + 1] - q0
                    t0 = (tile_id - q0 // TQ - r) * TQ  # first query token (within the request) of the tile
                    tv = T.min(TQ, nq - t0)  # valid query tokens in the tile
                    qlast = SL[r] - nq + t0 + tv - 1  # position of the tile's last valid query
                    jm = (qlast - tv + 2) // B  # blocks >= jm reach past the first query's position
                    nvis = qlast // B + 1  # blocks the tile sees
                    per = T.ceildiv(nvis, S)
                    start = sid * per
                    n = T.max(T.min(per, nvis - start), 0)
                    scale2 = sm_scale * LOG2E

                    ring = IndexRing(BT, KI, VI, mode_s, krow_s, vrow_s)
                    parts.resolve(0, n, r, start, h, ring)
                    for c, d in T.Parallel(N, D):
                        Q_s[c, d] = T.if_then_else(
                            c // G < tv, Q[q0 + t0 + T.min(c // G, tv - 1), h * G + c % G, d], T.cast(0, dtype))
                    if schedule.init_early:
                        parts.init_fragments(oT, lacc, msc)
                    T.fence_proxy_async()  # #2634: Q_s written by generic stores before wgmma reads it
                    T.sync_threads()

                    tile = TileVars(tile_id, r, h, sid, q0, t0, tv, qlast, jm, start, n, scale2)
                    sm = Softmax(sT, oT, lacc, msc, rs, msc_sh, mx, pmax, mdp)
                    src = KvSources(KC, VC, KD, KV, KM, VD, VV, VM)
                    out = Outputs(m_sh, rs_sh, tk_sh, l, cm, O, LSE, OP, LP, CNT)
                    schedule.block_loop(tile, Q_s, P_s, ring, st, src, sm, out)

        return main


class TileVars(NamedTuple):
    """A CTA's per-tile scalars as the macros read them: its thread-block coordinates and request, and
    loads of its register variables."""

    tile_id: object
    r: object  # the request
    h: object  # the KV head
    sid: object  # the split
    q0: object  # the request's first row in q / out
    t0: object  # the tile's first query token within the request
    tv: object  # valid query tokens in the tile
    qlast: object  # position of the tile's last valid query
    jm: object  # blocks >= jm reach past the tile's first query position (causal mask)
    start: object  # the split's first block
    n: object  # blocks of the split
    scale2: object  # sm_scale * log2(e)
