"""The extend kernel's n128 schedule: a producer warpgroup and two ping-pong consumer warpgroups
(384 threads, 128 query columns), FA3's warp specialization (TileLang 0.1.11, Hopper sm_90a).

* The producer warpgroup (threads 256-383) resolves the block-table entries into the index ring
  (its own named barrier 7) and its first warp issues every TMA load: for stage item i (K of block
  i, V of block i - 1) it waits for the stage's release by item i - stages (``empty``, one arrival
  per consumer warp), issues the loads and arrives once on ``full``. Over 2:4 K rows (``k_expand``)
  the whole warpgroup then waits for the item's loads, writes block i's 2:4 K rows into the stage's
  dense K tile (zeros at the pruned channels) and arrives once on ``expanded``.
* The two consumer warpgroups (threads 0-255, 64 columns each) only wait, compute and release. Each
  block step is ``extend_common``'s overlapped step (``S(j)`` and block j - 1's ``O^T`` GEMM as
  asynchronous ``wgmma``, the softmax under the O^T GEMM), and the two warpgroups take turns to issue
  their GEMMs (named barriers 10 + wg): warpgroup wg hands the turn over once its ``S`` is ready,
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
        def produce_item(i, empty_parity, prev_full_parity, num_blocks, request, first_block, h, ring, stage, prev_stage,
                         src):
            # Stage item i (K of block i, V of block i - 1). Its first warp waits for the stage's release
            # (item i - stages). The next chunk of index entries is resolved at item c * HALF + stages + 1
            # of chunk c: the consumers have then released item c * HALF + 1, so no consumer reads the
            # entries of chunk c - 1, whose ring half it overwrites. k_expand: once the item's loads
            # land, the warpgroup expands block i's 2:4 K rows into the stage's dense K tile and arrives
            # on ``expanded`` (for a dense block at once), which the consumers wait for besides ``full``.
            if i < num_blocks + 1:
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
            if parts.k_expand:
                # Warps 1-3 expand item i - 1 (landed while warp 0 issued item i), so the loads never wait
                # for an expansion; the last item (V only) expands nothing.
                if i >= 1:
                    if i < num_blocks + 1:
                        if T.get_thread_binding() >= threads + 32:
                            T.barrier_wait(prev_stage.full, prev_full_parity)
                            parts.expand_k(ring.mode[(i - 1) % RB], prev_stage)
                            T.fence_proxy_async()  # the generic writes to k_dense before the consumers' wgmma
                            T.sync_threads(14, 96)  # the expanders (named barriers 8-13 are the consumers')
                            if T.get_thread_binding() == threads + 32:
                                T.barrier_arrive(prev_stage.expanded)

        @T.macro
        def step(j, parity, num_blocks, first_block, first_masked, last_pos, tile_tokens, scale_log2, ring, Q_s, P_s,
                 stage, sm):
            if j < num_blocks:
                T.barrier_wait(stage.full, parity)
                if parts.k_expand:
                    T.barrier_wait(stage.expanded, parity)
                parts.block_step(j == 0, first_block + j, first_masked, last_pos, tile_tokens, scale_log2,
                                 ring.mode[j % RB], j, Q_s, P_s, stage, sm, True)

        # Plain Python (not parsed by TileLang): the stage ring unrolled.
        def produce_items(it, tile, ring, ring_stages, src):
            for s in range(stages):
                # Item it * stages + s waits for the release of item (it - 1) * stages + s.
                # k_expand: item it * stages + s - 1 is the previous stage's, of turn it - 1 when s = 0.
                produce_item(it * stages + s, (it + 1) & 1, (it + (s > 0) + 1) & 1, tile.num_blocks, tile.request,
                             tile.first_block, tile.h, ring, ring_stages[s], ring_stages[(s - 1) % stages], src)

        def ring_steps(it, tile, ring, Q_s, P_s, ring_stages, sm):
            for s in range(stages):
                step(it * stages + s, it & 1, tile.num_blocks, tile.first_block, tile.first_masked, tile.last_pos,
                     tile.tile_tokens, tile.scale_log2, ring, Q_s, P_s, ring_stages[s], sm)

        @T.macro
        def block_loop(tile, Q_s, P_s, ring, ring_stages, src, sm, outputs):
            tid = T.get_thread_binding()
            if tid >= threads:
                T.set_max_nreg(REGISTERS[0], 0)
                for it in T.serial(T.ceildiv(tile.num_blocks + 1, stages)):
                    produce_items(it, tile, ring, ring_stages, src)
            else:
                T.set_max_nreg(REGISTERS[1], 1)
                parts.init_fragments(sm.oT, sm.row_sums, sm.offsets)
                parts.load_q(Q_s, sm)
                if tid >= 128:
                    if tile.num_blocks >= 1:
                        T.named_barrier_arrive(10, 256)  # warpgroup 0 takes the first turn
                for it in T.serial(T.ceildiv(tile.num_blocks, stages)):
                    ring_steps(it, tile, ring, Q_s, P_s, ring_stages, sm)
                parts.final_gemms(tile, P_s, ring_stages, sm)
                if tid < 128:
                    if tile.num_blocks >= 1:
                        T.sync_threads(10, 256)  # warpgroup 1's last hand-over: no arrival left pending
                parts.consumer_sync()  # the warpgroups meet again before the CTA-wide reduction
                parts.write_output(tile, sm, outputs)

        self.block_loop = block_loop

    @staticmethod
    def alloc_state(parts: ExtendParts):
        """Nothing besides the shared state."""

