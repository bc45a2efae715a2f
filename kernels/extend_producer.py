"""The extend kernel's n128 schedule: a producer warpgroup and two ping-pong consumer warpgroups
(384 threads, 128 query columns), FA3's warp specialization (TileLang 0.1.11, Hopper sm_90a).

* The producer warpgroup (threads 256-383) resolves the block-table entries into the index ring
  (its own named barrier 7) and its first warp issues every TMA load: for stage item i (K of block
  i, V of block i - 1) it reads the item's index entries into registers, waits for the stage's release
  by item i - stages (``empty``, one arrival per consumer warp), issues the loads and arrives once on
  ``full``. Reading the entries after the wait put a shared-memory load between the release and the
  loads, which are on the step's critical path (``docs/kernels.md``).
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
            # Stage item i (K of block i, V of block i - 1). Its first warp waits for the stage's release
            # (item i - stages). The next chunk of index entries is resolved at item c * HALF + stages + 1
            # of chunk c: the consumers have then released item c * HALF + 1, so no consumer reads the
            # entries of chunk c - 1, whose ring half it overwrites.
            if i < num_blocks + 1:
                if T.get_thread_binding() < threads + 32:
                    parts.fetch_entries(i, ring, self.entries)  # read while the stage is still in use
                    if i >= stages:
                        T.barrier_wait(stage.empty, empty_parity)
                if i % HALF == stages + 1:
                    if (i // HALF + 1) * HALF < num_blocks:
                        T.sync_threads(7, 128)
                        parts.resolve(i // HALF + 1, num_blocks, request, first_block, h, ring)
                        T.fence_proxy_async()  # resets TileLang's proxy state: no fence at the TMA issue
                        T.sync_threads(7, 128)
                if T.get_thread_binding() < threads + 32:
                    parts.load_fetched(i, num_blocks, h, stage, src, self.entries)
                    parts.issuer_arrive(stage.full)

        P_COUNT, RING = parts.p_buffers, parts.ring_length  # the consumers' unrolled ring (ExtendParts)

        @T.macro
        def step(j, parity, num_blocks, first_block, first_masked, last_pos, tile_tokens, scale_log2, ring, Q_s, P_r,
                 P_w, stage, sm):
            if j < num_blocks:
                T.barrier_wait(stage.full, parity)
                parts.block_step(j == 0, first_block + j, first_masked, last_pos, tile_tokens, scale_log2,
                                 ring.mode[j % RB], j, Q_s, P_r, P_w, stage, sm, True)

        # Plain Python (not parsed by TileLang): the stage ring unrolled.
        def produce_items(it, tile, ring, ring_stages, src):
            for s in range(stages):
                # Item it * stages + s waits for the release of item (it - 1) * stages + s.
                produce_item(it * stages + s, (it + 1) & 1, tile.num_blocks, tile.request, tile.first_block, tile.h,
                             ring, ring_stages[s], src)

        def ring_steps(it, tile, ring, Q_s, P_bufs, ring_stages, sm):
            # Block j = it * RING + u: stage u % stages, its fill parity (j // stages) & 1, its P^T in
            # P_bufs[u % P_COUNT] (block j - 1's in the other).
            for u in range(RING):
                step(it * RING + u, (it * (RING // stages) + u // stages) & 1, tile.num_blocks, tile.first_block,
                     tile.first_masked, tile.last_pos, tile.tile_tokens, tile.scale_log2, ring, Q_s,
                     P_bufs[(u - 1) % P_COUNT], P_bufs[u % P_COUNT], ring_stages[u % stages], sm)

        @T.macro
        def block_loop(tile, Q_s, P_bufs, ring, ring_stages, src, sm, outputs):
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
                for it in T.serial(T.ceildiv(tile.num_blocks, RING)):
                    ring_steps(it, tile, ring, Q_s, P_bufs, ring_stages, sm)
                parts.final_gemms(tile, P_bufs, ring_stages, sm)
                if tid < 128:
                    if tile.num_blocks >= 1:
                        T.sync_threads(10, 256)  # warpgroup 1's last hand-over: no arrival left pending
                parts.consumer_sync()  # the warpgroups meet again before the CTA-wide reduction
                parts.write_output(tile, sm, outputs)

        self.block_loop = block_loop

    def alloc_state(self, parts: ExtendParts):
        """The issuing warp's copy of its stage item's index entries (K mode, K row, V mode, V row)."""
        self.entries = parts.T.alloc_local([4], "int32")

