"""The kernel frame and the TIR pieces both extend schedules share (``extend_overlap``, ``extend_producer``).

:class:`ExtendParts` holds one configuration's constants and builds the kernel around a schedule's
block loop: the CTA finds its request and query tokens, resolves block-table entries into the index
ring and stages its queries; the block loop (the schedule's) walks the split's blocks with the
shared macros here (the TMA loads of a stage item, the two GEMMs, the causal mask, the lazy-offset
softmax, the asynchronous block step); :meth:`ExtendParts.write_output` writes the columns or
merges the splits. The design is described in ``kernels/extend.py``; measurements in
``docs/kernels.md``.

Names: ``B`` block size, ``D`` head_dim, ``N`` query columns of a CTA, ``G`` query heads per KV head,
``TQ = N / G`` query tokens of a tile; ``sT`` is the ``S^T`` (then ``P^T``) accumulator ``[B, N]``,
``oT`` the ``O^T`` accumulator ``[D, N]``; ``h`` the CTA's KV head.

Importing this module needs neither TileLang nor a GPU; constructing :class:`ExtendParts` does.
"""

import math
from typing import NamedTuple

from sglang_hs.kernels.common import (
    ANY_FORMS, KV_FORMS, LN2, LOG2E, KvSources, Stage, entry_mode, entry_row, pin_source, tma_loads,
)

pin_source(__file__)

# name -> (N query columns per CTA, threads of the consumer warpgroups): the tiles an extend call picks from.
TILES = {"n64": (64, 128), "n128": (128, 256)}
# The n64 schedule at 32 columns, for shared-prefix decode's shared pass only (never picked by a call).
NARROW_TILES = {"n32": (32, 128)}
TILE_SHAPES = {**NARROW_TILES, **TILES}


def p_buffer_count(tile: str, k_form: str) -> int:
    """P^T buffers of a tile: n128's ping-pong over 2:4 K rows (S^T) takes two in turn, so that no
    warpgroup barrier stands either side of a block's P^T store; dense K rows (S = Q·K^T) measured
    slower so (``docs/kernels.md``) and keep one, as do the one-warpgroup tiles."""
    return 2 if tile == "n128" and k_form != "dense" else 1


def resolve_chunk(tile: str) -> int:
    """Blocks whose index entries one parallel pass resolves (one entry per thread, at most)."""
    return TILE_SHAPES[tile][1] // 2


# Any of a warpgroup's threads (a warpgroup barrier that also ORs a predicate: bar.red.or, PTX ISA).
WARPGROUP_ANY_SRC = r"""
__device__ __forceinline__ int hs_warpgroup_any(int pred, int bar_id) {
  int out;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n barrier.cta.red.or.pred q, %2, 128, p;\n"
               " selp.s32 %0, 1, 0, q;\n}\n" : "=r"(out) : "r"(pred), "r"(bar_id) : "memory");
  return out;
}
"""


class TileVars(NamedTuple):
    """A CTA's coordinates and per-tile scalars as the macros read them (the scalars are loads of
    register variables)."""

    tile_id: object
    request: object
    h: object  # the KV head
    split: object
    first_row: object  # the request's first row in q / out
    first_token: object  # the tile's first query token within the request
    tile_tokens: object  # valid query tokens in the tile
    last_pos: object  # position of the tile's last valid query
    first_masked: object  # blocks >= first_masked reach past the tile's first query position
    first_block: object  # the split's first block
    num_blocks: object  # blocks of the split
    scale_log2: object  # sm_scale * log2(e)
    live_splits: object  # the request's splits (the grid's, or its split limit with dynamic splits)


class IndexRing(NamedTuple):
    """The index inputs and the resolved entries of two passes (``2 * resolve_chunk`` blocks) in shared
    memory: ``mode = k_mode | v_mode << 2`` (0 cache page, 1 dense pool row, 2 2:4 pool row) and the
    row of each operand (cache page or pool row)."""

    block_table: object
    k_index: object
    v_index: object
    mode: object
    k_row: object
    v_row: object


class Softmax(NamedTuple):
    """A consumer thread's block-step state."""

    sT: object  # S^T, then P^T: fragment [B, N]
    oT: object  # O^T: fragment [D, N]
    row_sums: object  # [B, N] per thread, reduced over the tokens once at the end
    offsets: object  # [N] the columns' offsets, scaled (log2 units)
    rescale: object  # [N] O^T and row-sum factors of an offset move
    move_sh: object  # [N] shared: the offset move of each column
    block_max: object  # [1] local: the block max of the thread's column
    lane_max: object  # [8] local: the thread's largest scores, in independent chains
    pending_mode: object  # [1] local int32: the mode of the block whose O^T GEMM is pending
    step_mode: object  # [1] local int32: the mode of the step's block
    q_frag: object = None  # q_rows: Q [N, D] in registers (the S GEMM's A)
    rescale_cols: object = None  # q_rows: [N] O^T's factors of an offset move, in O^T's column layout
    row_max: object = None  # q_rows: [N] the block's row max


class Outputs(NamedTuple):
    """The merge's scratch and the kernel's outputs."""

    column_sh: object  # [N] shared: the columns' offsets (natural units), then the merge's weight sums
    weight_sh: object  # [N] shared: the merge's weights of one split
    ticket_sh: object  # [1] shared: the split ticket
    row_sum: object  # [N] fragment: the row sums, reduced
    merge_stat: object  # [2] local: a column's largest split LSE and sum of weights
    out: object
    lse: object
    o_part: object
    lse_part: object
    tickets: object
    sum_sh: object = None  # q_rows: [N] shared: the reduced row sums, for O^T's column layout
    part: object = None  # [D, N] fragment: one split's partial O^T as the merge loads it


class ExtendParts:
    """Constants and shared macros of one extend configuration.

    ``producer``: the CTA has a producer warpgroup after the consumers (threads ``[threads,
    threads + 128)``), which issues the loads; otherwise warp 0 of the consumers issues them.
    ``forms`` = ``(k_form, v_form)`` (:data:`~sglang_hs.kernels.common.KV_FORMS`): the block forms the
    stages hold (``k_sparse=False`` makes K dense); a kernel for fewer forms must only be given blocks
    of those forms (shared-prefix decode's shared pass on the extend kernel), and its smaller stages
    fit more CTAs an SM.
    """

    def __init__(self, q_heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: str, tile: str,
                 stages: int, k_sparse: bool, producer: bool, forms: tuple[str, str] = ANY_FORMS,
                 dynamic_splits: bool = False):
        import tilelang.language as T

        self.T = T
        B, D = block_size, head_dim
        N, threads = TILE_SHAPES[tile]
        G = q_heads // kv_heads
        # A group that does not divide N leaves the last N - TQ * G columns idle: their token index c // G
        # is TQ, past every tile's tokens, so they get a zero query and are never stored.
        assert q_heads % kv_heads == 0 and G <= N, "the GQA group must fit the tile's N"
        assert D % 32 == 0 and B % 32 == 0 and stages >= 2
        HALF = resolve_chunk(tile)  # index entries resolved per pass; the ring holds two passes
        RB = 2 * HALF
        assert HALF >= stages and RB & (RB - 1) == 0
        TPC = threads // N  # lane max: threads per column (consecutive lanes)
        assert threads % N == 0 and 32 % TPC == 0
        self.q_heads, self.kv_heads, self.B, self.D, self.N, self.G = q_heads, kv_heads, B, D, N, G
        self.threads, self.stages, self.k_sparse, self.dtype, self.producer = threads, stages, k_sparse, dtype, producer
        assert forms[0] in KV_FORMS and forms[1] in KV_FORMS and (k_sparse or forms[0] != "sparse")
        self.k_form, self.v_form = ("dense" if not k_sparse else forms[0]), forms[1]
        self.dynamic_splits = dynamic_splits
        self.p_buffers = p_buffer_count(tile, self.k_form)
        # q_rows (dense K at n64 and n128): S = Q·K^T with Q in registers (rows = query columns), as FA3:
        # no Q^T read from shared memory per block, the row max by quad shuffles; P lands as [N, B] for
        # O^T's GEMM. 2:4 K rows must be the sparse GEMM's A (S^T = K·Q^T), and n32's 32 columns per
        # warpgroup are fewer than a wgmma's 64 rows: both keep S^T.
        self.q_rows = self.k_form == "dense" and tile in TILES
        self.s_shape = [N, B] if self.q_rows else [B, N]  # S^T (and P^T), or with q_rows S (rows = query columns)
        # The block loop unrolls ring_length items, so that each item's stage and P^T buffer are static.
        self.ring_length = math.lcm(stages, self.p_buffers)
        self.TQ = N // G  # query tokens per tile (TQ * G <= N columns in use)
        self.HALF, self.RB = HALF, RB
        self.accum = "float32"
        self.e_rows = B * D // 16 // 16  # metadata tile as [e_rows, 16] int16 (contiguous 2*B*D/16 bytes)
        self.NEG = -T.infinity(self.accum)
        self.CLAMP = 6.0e4 if dtype == "float16" else 1.0e30  # finite in the 16-bit type
        self.LAZY = 8.0  # a column's offset moves once one of its P would exceed 2^LAZY
        self.TPC = TPC
        self.RPT = B // TPC  # rows per thread (interleaved: row i * TPC + lane % TPC)
        self.SHUF = [TPC >> k for k in range(1, TPC.bit_length()) if TPC >> k]  # xor offsets TPC/2 .. 1
        self.LANE_CHAINS = 8  # lazy offset: independent chains of a thread's largest score
        # The call's dynamic extents (bound from the arguments' shapes).
        (self.total, self.num_slots, self.k_dense_rows, self.k_sparse_rows, self.v_dense_rows, self.v_sparse_rows,
         self.num_virtual, self.indptr_len, self.batch, self.max_blocks, self.part_rows, self.num_splits,
         self.num_tiles) = T.dynamic("total, num_slots, k_dense_rows, k_sparse_rows, v_dense_rows, v_sparse_rows, "
                                     "num_virtual, indptr_len, batch, max_blocks, part_rows, num_splits, num_tiles")
        self._define_macros()

    def alloc_stages(self) -> list[Stage]:
        """The stage ring (plain Python: called inside the kernel)."""
        T, B, D = self.T, self.B, self.D

        def shared(form, kind, shape, dt):  # a buffer of a form the stage holds, else None
            return T.alloc_shared(shape, dt) if form in ("any", kind) else None

        out = []
        for _ in range(self.stages):
            out.append(Stage(
                shared(self.k_form, "dense", [B, D], self.dtype),
                shared(self.k_form, "sparse", [B, D // 2], self.dtype),
                shared(self.k_form, "sparse", [self.e_rows, 16], "int16"),
                shared(self.v_form, "dense", [B, D], self.dtype),
                shared(self.v_form, "sparse", [D, B // 2], self.dtype),
                shared(self.v_form, "sparse", [self.e_rows, 16], "int16"),
                # One arrival per issue (full) and one per consumer warp (empty), not one per thread.
                T.alloc_barrier(1),
                T.alloc_barrier(self.threads // 32),
            ))  # fmt: skip
        return out

    def alloc_p_buffers(self) -> list:
        """The P^T (q_rows: P) buffers, :func:`p_buffer_count` of them (plain Python: called inside the kernel)."""
        return [self.T.alloc_shared(self.s_shape, self.dtype) for _ in range(self.p_buffers)]

    def _define_macros(self):  # noqa: C901 (one closure per macro)
        T = self.T
        B, D, N, G = self.B, self.D, self.N, self.G
        HALF, RB, TPC, RPT, SHUF = self.HALF, self.RB, self.TPC, self.RPT, self.SHUF
        threads, stages, dtype, producer = self.threads, self.stages, self.dtype, self.producer
        ring_length, p_buffers = self.ring_length, self.p_buffers
        accum, NEG, CLAMP, LAZY, CHAINS = self.accum, self.NEG, self.CLAMP, self.LAZY, self.LANE_CHAINS
        POL = T.GemmWarpPolicy.Square  # each warpgroup owns 64 columns of both S^T and O^T
        rows = self.q_rows
        ROWPOL = T.GemmWarpPolicy.FullRow  # q_rows: each warpgroup owns 64 rows of S (its O^T columns)

        @T.macro
        def resolve(chunk, num_blocks, request, first_block, h, ring):
            # Index entries of blocks [chunk*HALF, (chunk+1)*HALF) of this CTA into ring half chunk % 2.
            for i in T.Parallel(HALF):
                if chunk * HALF + i < num_blocks:
                    entry = ring.block_table[request, first_block + chunk * HALF + i]
                    slot = (chunk % 2) * HALF + i
                    if entry >= 0:
                        ring.mode[slot] = 0
                        ring.k_row[slot] = entry
                        ring.v_row[slot] = entry
                    else:
                        k_entry = ring.k_index[h, -entry - 1]
                        v_entry = ring.v_index[h, -entry - 1]
                        ring.mode[slot] = entry_mode(T, k_entry, v_entry)
                        ring.k_row[slot] = entry_row(T, k_entry)
                        ring.v_row[slot] = entry_row(T, v_entry)

        k_form, v_form = self.k_form, self.v_form
        load_k, load_v = tma_loads(T, B, k_form, v_form)

        @T.macro
        def load(i, num_blocks, h, ring, stage, src):
            # The loads of stage item i: K of block i and V of block i - 1, those that are blocks of the
            # CTA (items 0 .. num_blocks; issued by one elected thread, the caller arrives).
            if i < num_blocks:
                load_k(ring.mode[i % RB], ring.k_row[i % RB], h, stage, src)
            if i >= 1:
                load_v(ring.mode[(i - 1) % RB], ring.v_row[(i - 1) % RB], h, stage, src)

        @T.macro
        def fetch_entries(i, ring, entries):
            # The entries of stage item i (K of block i, V of block i - 1) into the issuing warp's registers,
            # so that its loads need no shared-memory read after the wait that precedes them.
            entries[0] = ring.mode[i % RB]
            entries[1] = ring.k_row[i % RB]
            entries[2] = ring.mode[(i - 1) % RB]
            entries[3] = ring.v_row[(i - 1) % RB]

        @T.macro
        def load_fetched(i, num_blocks, h, stage, src, entries):
            # The loads of stage item i from the entries fetch_entries read (as load does from the ring).
            if i < num_blocks:
                load_k(entries[0], entries[1], h, stage, src)
            if i >= 1:
                load_v(entries[2], entries[3], h, stage, src)

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
        def turn(pingpong):
            # With ping-pong, the warpgroup's turn to issue its GEMMs: named barrier 10 + wg.
            if pingpong:
                T.sync_threads(10 + T.get_thread_binding() // 128, 256)

        @T.macro
        def gemm_s_sparse(stage, Q_s, sT, pingpong):
            turn(pingpong)
            T.wgmma_gemm_sp(stage.k_values, T.view(stage.k_meta, [B, D // 16]), Q_s, sT, transpose_B=True,
                            clear_accum=True, policy=POL)

        @T.macro
        def gemm_s_dense(stage, Q_s, sT, pingpong):
            turn(pingpong)
            T.wgmma_gemm(stage.k_dense, Q_s, sT, transpose_B=True, clear_accum=True, policy=POL)

        @T.macro
        def gemm_s(mode, Q_s, stage, sT, q_frag, pingpong):
            # S^T = K·Q^T for one block, dense or 2:4 by the block's K mode (or the one K form the stages
            # hold); issued without a wait. q_rows: S = Q·K^T with Q in registers. pingpong: each branch
            # first takes the warpgroup's turn, so that ptxas computes the branch's operand addresses (the
            # 2:4 metadata's) before the barrier rather than on the turn's critical path after it.
            if rows:
                turn(pingpong)
                T.wgmma_gemm(q_frag, stage.k_dense, sT, transpose_B=True, clear_accum=True, policy=ROWPOL)
            elif k_form == "sparse":
                gemm_s_sparse(stage, Q_s, sT, pingpong)
            elif k_form == "dense":
                gemm_s_dense(stage, Q_s, sT, pingpong)
            elif (mode & 3) == 2:
                gemm_s_sparse(stage, Q_s, sT, pingpong)
            else:
                gemm_s_dense(stage, Q_s, sT, pingpong)

        @T.macro
        def gemm_o(v_mode, P_s, stage, oT, dense, sparse):
            # O^T += V^T·P^T for one block, dense or 2:4 by the block's V mode (or the one V form the
            # stages hold).
            if v_form == "sparse":
                sparse(stage.v_values, T.view(stage.v_meta, [D, B // 16]), P_s, oT, transpose_B=rows, policy=POL)
            elif v_form == "dense":
                dense(stage.v_dense, P_s, oT, transpose_A=True, transpose_B=rows, policy=POL)
            elif v_mode == 2:
                sparse(stage.v_values, T.view(stage.v_meta, [D, B // 16]), P_s, oT, transpose_B=rows, policy=POL)
            else:
                dense(stage.v_dense, P_s, oT, transpose_A=True, transpose_B=rows, policy=POL)

        @T.macro
        def lane_column_max(P_s, sT, block_max):
            # Column max over the block's tokens: S^T goes through P_s (in the kernel's 16-bit type,
            # clamped to +-CLAMP so that masked keys are finite there and fp16 cannot overflow), then
            # TPC consecutive lanes own a column and hold its max in block_max[0]. Returns the thread
            # index and its column.
            for i, c in T.Parallel(B, N):
                P_s[i, c] = T.cast(T.max(T.min(sT[i, c], CLAMP), -CLAMP), dtype)
            group_barrier()
            tid = T.get_thread_binding()
            col = tid // TPC
            block_max[0] = -CLAMP
            for i in T.unroll(RPT):
                block_max[0] = T.max(block_max[0], T.cast(P_s[i * TPC + tid % TPC, col], accum))
            for k in T.unroll(len(SHUF)):
                block_max[0] = T.max(block_max[0], T.shfl_xor(block_max[0], TPC >> (k + 1)))
            return tid, col

        @T.macro
        def causal_mask(block, first_masked, last_pos, tile_tokens, sT):
            if block >= first_masked:  # the block reaches past the tile's first query position
                if rows:
                    for c, i in T.Parallel(N, B):
                        sT[c, i] = T.if_then_else(
                            block * B + i <= last_pos - T.max(tile_tokens - 1 - c // G, 0), sT[c, i], NEG)
                else:
                    for i, c in T.Parallel(B, N):
                        sT[i, c] = T.if_then_else(
                            block * B + i <= last_pos - T.max(tile_tokens - 1 - c // G, 0), sT[i, c], NEG)

        @T.macro
        def lazy_scores(is_first, scale_log2, sT, offsets, lane_max):
            # The scores against the columns' current (scaled) offsets, and the thread's largest of them
            # in lane_max[0] (kept in CHAINS independent chains; LAZY + LAZY on the CTA's first block, so
            # that its offsets are always set).
            for k in T.unroll(CHAINS):
                lane_max[k] = T.if_then_else(is_first, LAZY + LAZY, NEG)
            if rows:
                for c, i in T.Parallel(N, B):
                    sT[c, i] = sT[c, i] * scale_log2 - offsets[c]  # masked keys stay -inf
                    lane_max[i // 8 % (CHAINS // 2) * 2 + i % 2] = T.max(lane_max[i // 8 % (CHAINS // 2) * 2 + i % 2],
                                                                         sT[c, i])
            else:
                for i, c in T.Parallel(B, N):
                    sT[i, c] = sT[i, c] * scale_log2 - offsets[c]  # masked keys stay -inf
                    lane_max[c // 8 % (CHAINS // 2) * 2 + c % 2] = T.max(
                        lane_max[c // 8 % (CHAINS // 2) * 2 + c % 2], sT[i, c])
            for k in T.unroll(1, CHAINS):
                lane_max[0] = T.max(lane_max[0], lane_max[k])

        @T.macro
        def softmax_rows(is_first, sm):
            # q_rows: the lazy offset on S's rows. On a move (the warpgroup's vote), the row max comes from
            # quad shuffles (no P_s round trip); the offsets and row sums move in S's row layout, O^T's
            # columns take their factors through move_sh.
            sT, oT, row_sums, offsets, rescale, move_sh, block_max, lane_max = sm[:8]
            if T.call_extern("int32", "hs_warpgroup_any", T.if_then_else(lane_max[0] > LAZY, 1, 0),
                             12 + T.get_thread_binding() // 128) != 0:
                T.reduce_max(sT, sm.row_max, dim=1)
                for c in T.Parallel(N):
                    # The move: up to the block max (the first block sets the offset there, kept >= -CLAMP
                    # so that a fully masked row stays finite).
                    sm.row_max[c] = T.if_then_else(is_first, T.max(sm.row_max[c], -CLAMP), T.max(sm.row_max[c], 0.0))
                    move_sh[c] = sm.row_max[c]
                    rescale[c] = T.if_then_else(is_first, 1.0, T.exp2(-sm.row_max[c]))
                    offsets[c] = offsets[c] + sm.row_max[c]
                for c, i in T.Parallel(N, B):
                    sT[c, i] = T.exp2(sT[c, i] - sm.row_max[c])
                    row_sums[c, i] = row_sums[c, i] * rescale[c] + sT[c, i]
                T.wait_wgmma(0)  # the pending O^T GEMM, before O^T is rescaled
                group_barrier()
                for c in T.Parallel(N):
                    sm.rescale_cols[c] = T.if_then_else(is_first, 1.0, T.exp2(-move_sh[c]))
                for d, c in T.Parallel(D, N):
                    oT[d, c] *= sm.rescale_cols[c]
            else:
                for c, i in T.Parallel(N, B):
                    sT[c, i] = T.exp2(sT[c, i])
                    row_sums[c, i] = row_sums[c, i] + sT[c, i]

        @T.macro
        def softmax(is_first, block, first_masked, last_pos, tile_tokens, scale_log2, P_s, sm):
            # Turn S^T into the block's unnormalised P^T (in place) and update the row sums. Lazy offset
            # (FA4's conditional rescale): the scores are taken against the columns' current offsets;
            # only when one of the warpgroup passes its offset by more than 2^LAZY (a bar.red.or vote
            # over the warpgroup), or on the CTA's first block, does the column max go through P_s
            # (lane_column_max) and the offsets, O^T and the sums move. The move waits for the pending
            # O^T GEMM first (it rescales O^T and reuses P_s).
            sT, oT, row_sums, offsets, rescale, move_sh, block_max, lane_max = sm[:8]
            causal_mask(block, first_masked, last_pos, tile_tokens, sT)
            lazy_scores(is_first, scale_log2, sT, offsets, lane_max)
            if rows:
                softmax_rows(is_first, sm)
            elif T.call_extern("int32", "hs_warpgroup_any", T.if_then_else(lane_max[0] > LAZY, 1, 0),
                               12 + T.get_thread_binding() // 128) != 0:
                T.wait_wgmma(0)
                group_barrier()
                tid, col = lane_column_max(P_s, sT, block_max)
                if tid % TPC == 0:
                    # The offset's move: up to the block max (the first block sets the offset there, kept
                    # >= -CLAMP so that a fully masked column stays finite).
                    move_sh[col] = T.if_then_else(is_first, block_max[0], T.max(block_max[0], 0.0))
                group_barrier()
                for c in T.Parallel(N):
                    rescale[c] = T.if_then_else(is_first, 1.0, T.exp2(-move_sh[c]))  # O^T, sums are 0 first
                    offsets[c] = offsets[c] + move_sh[c]
                for i, c in T.Parallel(B, N):
                    sT[i, c] = T.exp2(sT[i, c] - move_sh[c])
                    row_sums[i, c] = row_sums[i, c] * rescale[c] + sT[i, c]
                for d, c in T.Parallel(D, N):
                    oT[d, c] *= rescale[c]
            else:
                for i, c in T.Parallel(B, N):
                    sT[i, c] = T.exp2(sT[i, c])
                    row_sums[i, c] = row_sums[i, c] + sT[i, c]

        @T.macro
        def release(stage):
            # The stage's release once this warp's GEMMs on it are complete (one arrival per warp).
            T.wait_wgmma(0)
            T.sync_warp()
            if T.get_thread_binding() % 32 == 0:
                T.barrier_arrive(stage.empty)

        @T.macro
        def block_step(is_first, block, first_masked, last_pos, tile_tokens, scale_log2, mode, j, Q_s, P_r, P_w,
                       stage, sm, pingpong):
            # Block step j (FA3's intra-warpgroup overlap): issue S^T(j), then O^T += V^T·P^T of block
            # j - 1 (P^T(j - 1) is in P_r, its mode in pending_mode, its V in this stage), and wait for
            # S^T only, so that the O^T GEMM runs under block j's softmax. Then the O^T GEMM is waited for,
            # the stage released and P^T(j) written to P_w (with one buffer: released, then written).
            # pingpong (FA3's ping-pong of two consumer warpgroups): warpgroup wg issues its GEMMs on its
            # turn (named barrier 10 + wg) and hands the turn to the other once its S^T is ready, so that
            # one warpgroup's softmax runs while the other's GEMMs have the tensor cores. With P_r not
            # P_w (two buffers taken in turn, ping-pong only), P^T(j) lands beside the P^T(j - 1) that
            # the pending GEMM reads, and the next step's turn barrier (all 128 threads of the
            # warpgroup) orders its writes before the GEMM that reads them: no barrier either side of
            # the store. With one buffer, one barrier before the store (WAR) and one after.
            two_buffers = P_r is not P_w  # plain Python: the schedule's choice
            assert pingpong or not two_buffers
            sm.step_mode[0] = mode  # read before the turn barrier, off the turn's critical path
            if two_buffers:
                # TileLang issue #2634: the last step's P^T (generic writes) before a (sparse) wgmma reads
                # it, fenced here rather than at the store, so that its wait for the store does not hold
                # up the stage's release.
                T.fence_proxy_async()
            gemm_s(sm.step_mode[0], Q_s, stage, sm.sT, sm.q_frag, pingpong)
            if j >= 1:
                gemm_o(sm.pending_mode[0] >> 2, P_r, stage, sm.oT, T.wgmma_gemm, T.wgmma_gemm_sp)
                T.wait_wgmma(1)
            else:
                T.wait_wgmma(0)
            if pingpong:
                T.named_barrier_arrive(11 - T.get_thread_binding() // 128, 256)
            softmax(is_first, block, first_masked, last_pos, tile_tokens, scale_log2, P_w, sm)
            if two_buffers:
                release(stage)  # before the store, which touches no stage: the producer refills it sooner
                T.copy(sm.sT, P_w)  # fenced at the next step's (or the final GEMM's) barrier
            else:
                release(stage)
                group_barrier()  # WAR: every warp's O^T GEMM of block j - 1 has read P_w
                T.copy(sm.sT, P_w)
                T.fence_proxy_async()  # TileLang issue #2634: P^T's generic writes before a (sparse) wgmma reads it
                group_barrier()
            sm.pending_mode[0] = sm.step_mode[0]

        @T.macro
        def final_gemm_if(num_blocks, u, P_s, stage, sm):
            # After the loop: the O^T GEMM of the last block, whose V is stage item num_blocks (here when
            # num_blocks is u modulo the unrolled ring's length). With P^T in two buffers (ping-pong turns)
            # the warpgroup first meets: its warps wrote the last P^T with no barrier after.
            if num_blocks >= 1:
                if num_blocks % ring_length == u:
                    if p_buffers == 2:
                        T.fence_proxy_async()  # the last P^T's writes (block_step)
                        group_barrier()
                    T.barrier_wait(stage.full, num_blocks // stages % 2)
                    gemm_o(sm.pending_mode[0] >> 2, P_s, stage, sm.oT, T.gemm, T.gemm_sp)

        def final_gemms(tile, P_bufs, ring_stages, sm):
            # Plain Python: final_gemm_if for each item of the unrolled ring (the one that holds the last
            # block runs); block j's P^T is in P_bufs[j % p_buffers].
            for u in range(ring_length):
                final_gemm_if(tile.num_blocks, u, P_bufs[(u - 1) % p_buffers], ring_stages[u % stages], sm)

        @T.macro
        def load_q(Q_s, sm):
            # q_rows: Q into the registers the S GEMM reads (after the CTA barrier that publishes Q_s).
            if rows:
                T.copy(Q_s, sm.q_frag)

        @T.macro
        def init_fragments(oT, row_sums, offsets):
            T.fill(oT, 0)
            T.fill(row_sums, 0)
            T.fill(offsets, 0)  # scaled offsets; the first block step sets them

        # Plain Python (expressions, no TIR variables): the q / out row and the query head of column c.
        def q_row(tile, c):
            return tile.first_row + tile.first_token + c // G

        def q_head(tile, c):
            return tile.h * G + c % G

        @T.macro
        def merge_splits(tile, oT, move_sh, outputs):
            # First per column (thread c): the largest split LSE (move_sh) and the sum of the splits'
            # weights (column_sh); then every element of O^T at once, with O^T's registers as the
            # accumulator, so that a thread's loads do not wait on each other. Splits are added in index
            # order whichever CTA merges (deterministic). Empty splits wrote an LSE of -inf and no partial O.
            tid = T.get_thread_binding()
            column_sh, weight_sh, merge_stat = outputs.column_sh, outputs.weight_sh, outputs.merge_stat
            if tid < N:
                if tid // G < tile.tile_tokens:
                    row = q_row(tile, tid)
                    merge_stat[0] = NEG
                    for s2 in T.serial(tile.live_splits):
                        merge_stat[0] = T.max(merge_stat[0], outputs.lse_part[row, q_head(tile, tid), s2])
                    merge_stat[1] = 0.0
                    for s2 in T.serial(tile.live_splits):
                        if outputs.lse_part[row, q_head(tile, tid), s2] != NEG:
                            merge_stat[1] = merge_stat[1] + T.exp2(
                                outputs.lse_part[row, q_head(tile, tid), s2] - merge_stat[0])
                    move_sh[tid] = merge_stat[0]
                    column_sh[tid] = merge_stat[1]
                    outputs.lse[row, q_head(tile, tid)] = T.if_then_else(
                        merge_stat[1] > 0, (T.log2(merge_stat[1]) + merge_stat[0]) * LN2, NEG)
            T.fill(oT, 0)
            for s2 in T.serial(tile.live_splits):
                # The split's weight per column (0 for an empty split), then its partial O for every
                # element: unconditional loads (an empty split's rows hold stale values, which the select
                # drops).
                consumer_sync()
                if tid < N:
                    weight_sh[tid] = 0.0
                    if tid // G < tile.tile_tokens:
                        if outputs.lse_part[q_row(tile, tid), q_head(tile, tid), s2] != NEG:
                            weight_sh[tid] = T.exp2(
                                outputs.lse_part[q_row(tile, tid), q_head(tile, tid), s2] - move_sh[tid])
                # The loads in a loop of their own: inside the select each load waited for its weight and
                # for the load before it (ptxas hoists no global load above a branch).
                for d, c in T.Parallel(D, N):
                    outputs.part[d, c] = outputs.o_part[
                        tile.first_row + tile.first_token + T.min(c // G, tile.tile_tokens - 1), q_head(tile, c), s2, d]
                consumer_sync()
                for d, c in T.Parallel(D, N):
                    oT[d, c] = T.if_then_else(weight_sh[c] > 0, oT[d, c] + weight_sh[c] * outputs.part[d, c], oT[d, c])

        SUM_DIM = 1 if rows else 0  # the row sums' token dimension

        def sums_of(outputs):  # (plain Python) the reduced row sums where O^T's columns read them
            return outputs.sum_sh if rows else outputs.row_sum

        @T.macro
        def write_output(tile, sm, outputs):
            # The CTA's columns: with one split the normalised O and the LSE; otherwise the split's partial
            # O and base-2 LSE, then the last CTA of this (tile, KV head) to finish merges the splits.
            tid = T.get_thread_binding()
            oT, offsets, move_sh = sm.oT, sm.offsets, sm.move_sh
            column_sh, ticket_sh, row_sum = outputs.column_sh, outputs.ticket_sh, outputs.row_sum
            T.reduce_sum(sm.row_sums, row_sum, dim=SUM_DIM)  # once per CTA (scalar AllReduce: right for 2 warpgroups)
            for c in T.Parallel(N):
                column_sh[c] = offsets[c] / tile.scale_log2  # the LSE below scales it back
                if rows:
                    outputs.sum_sh[c] = row_sum[c]  # for O^T's column layout
            consumer_sync()
            if self.num_splits == 1:
                for d, c in T.Parallel(D, N):
                    if c // G < tile.tile_tokens:
                        outputs.out[q_row(tile, c), q_head(tile, c), d] = T.cast(
                            T.if_then_else(sums_of(outputs)[c] > 0, oT[d, c] / sums_of(outputs)[c], 0.0), dtype)
                for c in T.Parallel(N):
                    if c // G < tile.tile_tokens:
                        outputs.lse[q_row(tile, c), q_head(tile, c)] = T.if_then_else(
                            sums_of(outputs)[c] > 0, (T.log2(sums_of(outputs)[c]) + column_sh[c] * tile.scale_log2) * LN2, NEG)
            else:
                for c in T.Parallel(N):
                    if c // G < tile.tile_tokens:
                        outputs.lse_part[q_row(tile, c), q_head(tile, c), tile.split] = T.if_then_else(
                            sums_of(outputs)[c] > 0, T.log2(sums_of(outputs)[c]) + column_sh[c] * tile.scale_log2, NEG)
                if tile.num_blocks > 0:
                    for d, c in T.Parallel(D, N):
                        if c // G < tile.tile_tokens:
                            outputs.o_part[q_row(tile, c), q_head(tile, c), tile.split, d] = T.if_then_else(
                                sums_of(outputs)[c] > 0, oT[d, c] / sums_of(outputs)[c], 0.0)
                # Split-KV merge by the last CTA of this (tile, KV head): release our partials, take a
                # ticket (acq_rel, device scope), and merge if we are the last.
                consumer_sync()
                if tid == 0:
                    ticket_sh[0] = T.atomic_add(outputs.tickets[tile.tile_id, tile.h], 1, memory_order="acq_rel",
                                                return_prev=True)
                consumer_sync()
                if ticket_sh[0] == tile.live_splits - 1:
                    merge_splits(tile, oT, move_sh, outputs)
                    for d, c in T.Parallel(D, N):
                        if c // G < tile.tile_tokens:
                            outputs.out[q_row(tile, c), q_head(tile, c), d] = T.cast(
                                T.if_then_else(column_sh[c] > 0, oT[d, c] / column_sh[c], 0.0), dtype)
                    if tid == 0:
                        outputs.tickets[tile.tile_id, tile.h] = 0

        self.load_k, self.load_v = load_k, load_v
        self.resolve, self.load, self.issuer_arrive, self.consumer_sync = resolve, load, issuer_arrive, consumer_sync
        self.fetch_entries, self.load_fetched = fetch_entries, load_fetched
        self.block_step, self.final_gemms, self.init_fragments = block_step, final_gemms, init_fragments
        self.load_q = load_q
        self.write_output = write_output

    def prim_func(self, schedule):
        """The kernel of this configuration with ``schedule``'s block loop (every batch dimension is
        dynamic). ``schedule`` gives ``extra_threads`` (threads after the consumer warpgroups),
        ``init_early`` (the consumers' fragments are zeroed before the CTA barrier that publishes Q,
        else by the schedule's block loop), ``alloc_state(parts)`` (plain Python: what its block loop
        keeps besides the shared state) and the macro ``block_loop(tile, Q_s, P_bufs, ring, ring_stages,
        src, sm, outputs)`` (``P_bufs``: :attr:`p_buffers` buffers), which ends with :meth:`write_output`
        on the consumers.

        Arguments, in order (``S`` = ``num_splits``, bound from ``o_part``'s shape; with one split
        ``o_part``/``lse_part`` may be one-row stand-ins): ``q [total, Hq, D]``, ``k_cache, v_cache
        [slots, Hkv, D]``, ``k_dense [rows, B, D]``, ``k_values [rows, B, D/2]``, ``k_meta [rows,
        B*D/256, 16]`` int16, ``v_dense [rows, B, D]``, ``v_values [rows, D, B/2]``, ``v_meta [rows,
        B*D/256, 16]`` int16, ``k_index, v_index [Hkv, n_virtual]``, ``qo_indptr [bs + 1]``, ``block_table
        [bs, max_blocks]``, ``seq_lens [bs]``, ``sm_scale``, ``o_part [rows, Hq, S, D]`` and ``lse_part
        [rows, Hq, S]`` (fp32 split partials), ``out [total, Hq, D]``, ``lse [total, Hq]`` (fp32, natural
        log), ``tickets [tile ids, Hkv]`` (int32, zero between calls; the grid's x extent is bound from it).
        """
        T = self.T
        B, D, N, G, TQ, RB = self.B, self.D, self.N, self.G, self.TQ, self.RB
        q_heads, kv_heads, dtype, accum, e_rows = self.q_heads, self.kv_heads, self.dtype, self.accum, self.e_rows
        threads = self.threads
        total, num_slots, num_virtual = self.total, self.num_slots, self.num_virtual
        k_dense_rows, k_sparse_rows = self.k_dense_rows, self.k_sparse_rows
        v_dense_rows, v_sparse_rows = self.v_dense_rows, self.v_sparse_rows
        indptr_len, batch, max_blocks = self.indptr_len, self.batch, self.max_blocks
        part_rows, num_splits, num_tiles = self.part_rows, self.num_splits, self.num_tiles
        parts = self
        dynamic = self.dynamic_splits
        rows = self.q_rows
        S_SHAPE = self.s_shape
        all_threads = threads + schedule.extra_threads
        Q_PIECES = N * D // 8  # Q_s's 16-byte pieces
        Q_LOADS = -(-Q_PIECES // all_threads)  # pieces a thread loads

        # Plain Python helpers (not parsed by TileLang): without dynamic splits they emit exactly the
        # expressions of a kernel without them.
        def live_splits(qo_indptr, batch, request):  # the request's splits: the grid's, or its limit
            return T.min(qo_indptr[batch + 1 + request], num_splits) if dynamic else num_splits

        @T.prim_func
        def main(
            q: T.Tensor([total, q_heads, D], dtype),
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
            qo_indptr: T.Tensor([indptr_len], "int32"),
            block_table: T.Tensor([batch, max_blocks], "int32"),
            seq_lens: T.Tensor([batch], "int32"),
            sm_scale: T.float32,
            o_part: T.Tensor([part_rows, q_heads, num_splits, D], accum),
            lse_part: T.Tensor([part_rows, q_heads, num_splits], accum),
            out: T.Tensor([total, q_heads, D], dtype),
            lse: T.Tensor([total, q_heads], accum),
            tickets: T.Tensor([num_tiles, kv_heads], "int32"),
        ):
            with T.Kernel(num_tiles, kv_heads, num_splits, threads=all_threads) as (bx, h, split):
                T.import_source(WARPGROUP_ANY_SRC)
                # Tile ids in descending order: a request's later tiles see more blocks (causal), so in a
                # long prefill the longest CTAs start first instead of forming the last wave. With dynamic
                # splits (one-token requests of equal length, live ones first) in ascending order.
                tile_id = bx if dynamic else num_tiles - 1 - bx
                Q_s = T.alloc_shared([N, D], dtype)
                P_bufs = parts.alloc_p_buffers()  # S^T (for the column max) then P^T, or P: GEMM2's B
                ring_mode = T.alloc_shared([RB], "int32")
                ring_k_row = T.alloc_shared([RB], "int32")
                ring_v_row = T.alloc_shared([RB], "int32")
                request_sh = T.alloc_shared([1], "int32")
                ticket_sh = T.alloc_shared([1], "int32")
                move_sh = T.alloc_shared([N], accum)
                weight_sh = T.alloc_shared([N], accum)
                column_sh = T.alloc_shared([N], accum)
                merge_stat = T.alloc_local([2], accum)
                ring_stages = parts.alloc_stages()
                sT = T.alloc_fragment(S_SHAPE, accum)
                oT = T.alloc_fragment([D, N], accum)
                part = T.alloc_fragment([D, N], accum)
                row_sums = T.alloc_fragment(S_SHAPE, accum)
                row_sum = T.alloc_fragment([N], accum)
                rescale = T.alloc_fragment([N], accum)
                offsets = T.alloc_fragment([N], accum)
                block_max = T.alloc_local([1], accum)
                lane_max = T.alloc_local([parts.LANE_CHAINS], accum)
                pending_mode = T.alloc_local([1], "int32")
                step_mode = T.alloc_local([1], "int32")
                q_frag = T.alloc_fragment([N, D], dtype) if rows else None
                rescale_cols = T.alloc_fragment([N], accum) if rows else None
                row_max = T.alloc_fragment([N], accum) if rows else None
                sum_sh = T.alloc_shared([N], accum) if rows else None
                schedule.alloc_state(parts)
                q_pieces = T.alloc_local([Q_LOADS * 8], dtype)
                tid = T.get_thread_binding()
                # Per-CTA scalars live in registers (plain Python bindings of loads would be re-inlined,
                # with their bounds checks, at every use).
                first_row = T.alloc_var("int32")
                new_tokens = T.alloc_var("int32")
                first_token = T.alloc_var("int32")
                tile_tokens = T.alloc_var("int32")
                last_pos = T.alloc_var("int32")
                first_masked = T.alloc_var("int32")
                first_block = T.alloc_var("int32")
                num_blocks = T.alloc_var("int32")
                scale_log2 = T.alloc_var(accum)

                # Which request owns this tile id? Request r's ids start at qo_indptr[r] // TQ + r.
                if tid == 0:
                    request_sh[0] = -1
                T.sync_threads()
                for it0 in T.serial(T.ceildiv(batch, threads)):
                    req = it0 * threads + tid
                    if req < batch:
                        first_row = qo_indptr[req]
                        new_tokens = qo_indptr[req + 1] - first_row
                        first_token = first_row // TQ + req  # here: the first tile id of request req
                        if first_token <= tile_id and tile_id < first_token + T.ceildiv(new_tokens, TQ):
                            request_sh[0] = req
                T.sync_threads()
                if dynamic:  # a split past its request's limit exits as a tile id in a gap does
                    if tid == 0:
                        if request_sh[0] >= 0:
                            if split >= qo_indptr[batch + 1 + request_sh[0]]:
                                request_sh[0] = -1
                    T.sync_threads()
                request = request_sh[0]
                if request >= 0:
                    first_row = qo_indptr[request]
                    new_tokens = qo_indptr[request + 1] - first_row
                    first_token = (tile_id - first_row // TQ - request) * TQ  # within the request
                    tile_tokens = T.min(TQ, new_tokens - first_token)  # valid query tokens in the tile
                    last_pos = seq_lens[request] - new_tokens + first_token + tile_tokens - 1
                    first_masked = (last_pos - tile_tokens + 2) // B  # blocks from here reach past the first query
                    visible = last_pos // B + 1  # blocks the tile sees
                    per_split = T.ceildiv(visible, live_splits(qo_indptr, batch, request))
                    first_block = split * per_split
                    num_blocks = T.max(T.min(per_split, visible - first_block), 0)
                    scale_log2 = sm_scale * LOG2E

                    ring = IndexRing(block_table, k_index, v_index, ring_mode, ring_k_row, ring_v_row)
                    parts.resolve(0, num_blocks, request, first_block, h, ring)
                    # Q in 16-byte pieces, every load of a thread issued before the first store (a load whose
                    # store follows it at once is waited for before the next one issues). A partial tile's idle
                    # columns repeat its last query; their outputs are never written.
                    for i in T.unroll(Q_LOADS):
                        piece = T.min(i * all_threads + tid, Q_PIECES - 1)  # past the end: the last piece again
                        column = piece // (D // 8)
                        for e in T.vectorized(8):
                            q_pieces[i * 8 + e] = q[first_row + first_token + T.min(column // G, tile_tokens - 1),
                                                    h * G + column % G, piece % (D // 8) * 8 + e]
                    for i in T.unroll(Q_LOADS):
                        piece = i * all_threads + tid
                        if piece < Q_PIECES:
                            for e in T.vectorized(8):
                                Q_s[piece // (D // 8), piece % (D // 8) * 8 + e] = q_pieces[i * 8 + e]
                    if schedule.init_early:
                        parts.init_fragments(oT, row_sums, offsets)
                    T.fence_proxy_async()  # TileLang issue #2634: Q_s's generic writes before wgmma reads it
                    T.sync_threads()

                    tile = TileVars(tile_id, request, h, split, first_row, first_token, tile_tokens, last_pos,
                                    first_masked, first_block, num_blocks, scale_log2,
                                    live_splits(qo_indptr, batch, request))
                    sm = Softmax(sT, oT, row_sums, offsets, rescale, move_sh, block_max, lane_max, pending_mode,
                                 step_mode, q_frag, rescale_cols, row_max)
                    src = KvSources(k_cache, v_cache, k_dense, k_values, k_meta, v_dense, v_values, v_meta)
                    outputs = Outputs(column_sh, weight_sh, ticket_sh, row_sum, merge_stat, out, lse, o_part, lse_part,
                                      tickets, sum_sh, part)
                    schedule.block_loop(tile, Q_s, P_bufs, ring, ring_stages, src, sm, outputs)

        return main
