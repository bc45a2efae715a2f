"""The extend kernel's n128 schedule: a producer warpgroup and two ping-pong consumer warpgroups
(384 threads, 128 query columns), FA3's warp specialization (TileLang 0.1.11, Hopper sm_90a).

* The producer warpgroup (threads 256-383) resolves the block-table entries into the index ring
  (its own named barrier 7) and its first warp issues every TMA load: for stage item i (K of block
  i, V of block i - 1) it waits for the stage's release by item i - stages (``empty``, one arrival
  per consumer warp), issues the loads and arrives once on ``full``.
* The two consumer warpgroups (threads 0-255, 64 columns each) only wait, compute and release. Each
  block step is ``extend_common``'s overlapped step (``S^T(j)`` and block j - 1's ``O^T`` GEMM as
  asynchronous ``wgmma``, the softmax under the O^T GEMM), and the two warpgroups take turns to issue
  their GEMMs (named barriers 10 + wg): warpgroup wg hands the turn over once its ``S^T`` is ready,
  so that its softmax runs while the other's GEMMs hold the tensor cores.
* ``setmaxnreg``: every thread starts with 168 registers (65536 / 384, rounded down to 8); the
  producer gives 128 of them back (40 each) and the consumers take them (232 each):
  128 x 40 + 256 x 232 = 384 x 168.

Named barriers: 1 the consumers (256 threads), 7 the producer warpgroup, 8 + wg a consumer
warpgroup's block-step phases, 10 + wg its turn to issue, 12 + wg its softmax vote.
"""

from __future__ import annotations

from sglang_hs.kernels.common import pin_source
from sglang_hs.kernels.extend_common import ExtendParts

pin_source(__file__)

PRODUCER_THREADS = 128
REGISTERS = (40, 232)  # setmaxnreg of the producer and of the consumers


class ProducerSchedule:
    """The block loop of the n128 tile (see the module docstring)."""

    extra_threads = PRODUCER_THREADS
    init_early = False

    def __init__(self, parts: ExtendParts):
        T = parts.T
        HALF, RB, stages, threads = parts.HALF, parts.RB, parts.stages, parts.threads

        @T.macro
        def produce_item(i, empty_parity, num_blocks, request, first_block, h, ring, stage, src):
            # Stage item i (K of block i, V of block max(i - 2, 0): item 1 carries block 0's V for step 0). Its first warp waits for the stage's release
            # (item i - stages). The next chunk of index entries is resolved at item c * HALF + stages + 1
            # of chunk c: the consumers have then released item c * HALF + 1 (at step c * HALF + 1), so
            # they read no entry below c * HALF again, nor does this warp (item i reads entries i and i - 2):
            # the ring half of chunk c - 1 is free.
            if i < num_blocks + 2:
                if T.get_thread_binding() < threads + 32:
                    if i >= stages:
                        T.barrier_wait(stage.empty, empty_parity)
                if i % HALF == stages + 1:
                    if (i // HALF + 1) * HALF < num_blocks:
                        T.sync_threads(7, 128)
                        parts.resolve(i // HALF + 1, num_blocks, request, first_block, h, ring)
                        T.fence_proxy_async()  # resets TileLang's proxy state: no fence at the TMA issue
                        T.sync_threads(7, 128)
                if T.get_thread_binding() < threads + 32:
                    parts.load(i, num_blocks, h, ring, stage, src)
                    parts.issuer_arrive(stage.full)

        assert stages == 2 and parts.p_buffers == 2 and parts.ring_length == 2

        @T.macro
        def take_turn():
            # This warpgroup's turn to issue GEMMs (named barrier 10 + wg, which the other arrives on).
            T.sync_threads(10 + T.get_thread_binding() // 128, 256)

        @T.macro
        def hand_over():
            T.named_barrier_arrive(11 - T.get_thread_binding() // 128, 256)

        @T.macro
        def first_gemm(num_blocks, ring, Q_s, stage, sT, sm):
            # S(0) from stage item 0, on the warpgroup's first turn.
            if num_blocks >= 1:
                T.barrier_wait(stage.full, 0)
                sm.step_mode[0] = ring.mode[0]
                take_turn()
                parts.gemm_s(sm.step_mode[0], Q_s, stage, sT, sm.q_frag)
                hand_over()

        @T.macro
        def step(j, next_parity, num_blocks, first_block, first_masked, last_pos, tile_tokens, scale_log2, ring, Q_s,
                 P_prev, P_cur, stage_next, stage_cur, sT_next, sm_cur):
            # Block step j: S(j) is in sm_cur.sT (issued a step ago). On the turn: S(j + 1) into sT_next and
            # O^T += V^T·P^T of block j - 1 (P_prev), both from stage item j + 1 (K of block j + 1, V of
            # block j - 1). Then wait for S(j) (and block j - 2's O^T GEMM, committed after it), release
            # item j, and turn S(j) into P(j) (P_cur) while the two GEMMs run. Both GEMMs are issued on
            # every step, so that ptxas keeps the wgmma pipeline (C7514/C7515 otherwise): step 0's O^T
            # GEMM adds P_prev = 0 (zeroed by block_loop) times block 0's V, and a step j = num_blocks
            # (the ring's last step when num_blocks is odd) issues the last block's O^T GEMM, its S
            # (stale shared memory) fully masked.
            T.barrier_wait(stage_next.full, next_parity)
            sm_cur.step_mode[0] = ring.mode[(j + 1) % RB]  # read before the turn, off its critical path
            sm_cur.pending_mode[0] = ring.mode[T.max(j - 1, 0) % RB]
            T.fence_proxy_async()  # TileLang issue #2634: P(j - 1)'s generic writes before a wgmma reads it
            take_turn()
            parts.gemm_s(sm_cur.step_mode[0], Q_s, stage_next, sT_next, sm_cur.q_frag)
            parts.gemm_o(sm_cur.pending_mode[0] >> 2, P_prev, stage_next, sm_cur.oT, T.wgmma_gemm, T.wgmma_gemm_sp)
            hand_over()
            T.wait_wgmma(2)  # S(j) and O^T(j - 2) were committed before this turn's two groups
            parts.arrive_empty(stage_cur)  # item j: K of block j, V of block j - 2
            live = j < num_blocks
            parts.softmax(j == 0, first_block + j, T.if_then_else(live, first_masked, 0),
                          T.if_then_else(live, last_pos, -1 - tile_tokens), tile_tokens, scale_log2, P_cur, sm_cur)
            T.copy(sm_cur.sT, P_cur)  # fenced before the next turn; O^T(j - 2) has read this buffer

        @T.macro
        def drain():
            T.wait_wgmma(0)

        @T.macro
        def last_gemm(num_blocks, ring, P_s, stage, sm):
            # After the loop, when num_blocks is even: O^T += V^T·P^T of the last block (V in stage item
            # num_blocks + 1), on a turn of its own, so that both warpgroups take num_blocks + 2 turns
            # (an odd num_blocks issued it on the ring's last step).
            if num_blocks >= 1:
                if num_blocks % 2 == 0:
                    T.barrier_wait(stage.full, (num_blocks + 1) // 2 % 2)
                    sm.pending_mode[0] = ring.mode[(num_blocks - 1) % RB]
                    T.fence_proxy_async()  # the last P's writes
                    take_turn()
                    parts.gemm_o(sm.pending_mode[0] >> 2, P_s, stage, sm.oT, T.wgmma_gemm, T.wgmma_gemm_sp)
                    hand_over()
                    T.wait_wgmma(0)

        # Plain Python (not parsed by TileLang): the stage ring unrolled.
        def produce_items(it, tile, ring, ring_stages, src):
            for s in range(stages):
                # Item it * stages + s waits for the release of item (it - 1) * stages + s.
                produce_item(it * stages + s, (it + 1) & 1, tile.num_blocks, tile.request, tile.first_block, tile.h,
                             ring, ring_stages[s], src)

        def ring_steps(it, tile, ring, Q_s, P_bufs, ring_stages, sm):
            # Blocks j = 2 * it and 2 * it + 1: S(j) in S[j % 2], P(j) into P_bufs[j % 2], stage item j + 1 in
            # stage (j + 1) % 2, filled for the ((j + 1) // 2)-th time.
            S = (sm.sT, self.s_next)
            for u in range(2):
                step(it * 2 + u, (it + (u + 1) // 2) & 1, tile.num_blocks, tile.first_block, tile.first_masked,
                     tile.last_pos, tile.tile_tokens, tile.scale_log2, ring, Q_s, P_bufs[1 - u], P_bufs[u],
                     ring_stages[1 - u], ring_stages[u], S[1 - u], sm._replace(sT=S[u]))
            drain()  # nothing in flight across the loop's back edge (ptxas C7514 otherwise)

        @T.macro
        def block_loop(tile, Q_s, P_bufs, ring, ring_stages, src, sm, outputs):
            tid = T.get_thread_binding()
            if tid >= threads:
                T.set_max_nreg(REGISTERS[0], 0)
                for it in T.serial(T.ceildiv(tile.num_blocks + 2, stages)):
                    produce_items(it, tile, ring, ring_stages, src)
            else:
                T.set_max_nreg(REGISTERS[1], 1)
                parts.init_fragments(sm.oT, sm.row_sums, sm.offsets)
                T.copy(sm.row_sums, P_bufs[1])  # zeros: step 0's O^T GEMM adds nothing
                parts.load_q(Q_s, sm)
                if tid >= 128:
                    if tile.num_blocks >= 1:
                        T.named_barrier_arrive(10, 256)  # warpgroup 0 takes the first turn
                first_gemm(tile.num_blocks, ring, Q_s, ring_stages[0], sm.sT, sm)
                for it in T.serial(T.ceildiv(tile.num_blocks, 2)):
                    ring_steps(it, tile, ring, Q_s, P_bufs, ring_stages, sm)
                T.wait_wgmma(0)
                last_gemm(tile.num_blocks, ring, P_bufs[1], ring_stages[1], sm)
                if tid < 128:
                    if tile.num_blocks >= 1:
                        T.sync_threads(10, 256)  # warpgroup 1's last hand-over: no arrival left pending
                parts.consumer_sync()  # the warpgroups meet again before the CTA-wide reduction
                parts.write_output(tile, sm, outputs)

        self.block_loop = block_loop

    def alloc_state(self, parts: ExtendParts):
        """The second S accumulator: S(j + 1) is computed while block j's softmax runs."""
        self.s_next = parts.T.alloc_fragment(parts.s_shape, parts.accum)

