"""The extend kernel's n64 schedule: one warpgroup of 128 threads, 64 query columns, FA3's
intra-warpgroup overlap (TileLang 0.1.11, Hopper sm_90a). The n32 tile (shared-prefix decode's shared
pass) is the same schedule at 32 columns.

A CTA's block loop, step j (the frame around it, the GEMMs and the softmax are in
``extend_common``):

* warp 0 refills the stage that item j - 1 held with stage item j + 1 (K of block j + 1, V of block
  j), once every warp has released it (the stage's ``empty`` barrier, one arrival per warp); it
  reads the item's index entries into registers a step ahead, so the issue is not a chain of
  dependent shared-memory loads;
* the warpgroup waits for stage item j (``full``), issues ``S^T(j)`` and the pending
  ``O^T += V^T·P^T`` of block j - 1 as asynchronous ``wgmma`` groups, and waits for the first only:
  the O^T GEMM runs under block j's softmax;
* every ``resolve_chunk`` steps the CTA resolves the next pass of block-table entries into the
  index ring between two CTA barriers.

A stage holds K of block j and V of block j - 1, so both GEMMs of a step read one stage and it is
free when the step ends: step j refills the stage item j - 1 held, with item j + stages - 1: one
stage item of loads is in flight while a step computes (a third stage, two in flight, did not speed
up shared-prefix decode's shared pass, which is bound by its block steps: ``docs/kernels.md``).
"""

from __future__ import annotations

from sglang_hs.kernels.common import pin_source
from sglang_hs.kernels.extend_common import ExtendParts

pin_source(__file__)


class OverlapSchedule:
    """The block loop of the n64 and n32 tiles (see the module docstring)."""

    extra_threads = 0
    init_early = True

    def __init__(self, parts: ExtendParts):
        T = parts.T
        HALF, RB, stages = parts.HALF, parts.RB, parts.stages
        assert stages >= 2
        AHEAD = stages - 1  # step j issues stage item j + AHEAD

        @T.macro
        def guarded_issue(i, num_blocks, h, ring, stage, src):
            # Prologue: warp 0 issues stage item i if it is one of the CTA's (items 0 .. num_blocks).
            if i < num_blocks + 1:
                if T.get_thread_binding() < 32:
                    parts.load(i, num_blocks, h, ring, stage, src)
                    parts.issuer_arrive(stage.full)

        @T.macro
        def step(j, parity, empty_parity, num_blocks, request, first_block, first_masked, last_pos, tile_tokens,
                 scale_log2, h, ring, Q_s, P_s, stage, refill, src, sm, entries):
            if j < num_blocks:
                if j % HALF == 0:
                    # The ring half resolved below was last read at step j - HALF - 1 or before: the first
                    # barrier waits for every thread to be past it, the second publishes the entries to
                    # the issuing warp (first issued HALF - stages + 1 steps from now).
                    T.sync_threads()
                    parts.resolve(j // HALF + 1, num_blocks, request, first_block, h, ring)
                    T.fence_proxy_async()  # resets TileLang's proxy state: no fence at the TMA issue
                    T.sync_threads()
                if j + AHEAD < num_blocks + 1:
                    # Warp 0 refills the stage of item j + AHEAD - stages once every warp has released it.
                    if T.get_thread_binding() < 32:
                        if j + AHEAD >= stages:
                            T.barrier_wait(refill.empty, empty_parity)
                        parts.load_fetched(j + AHEAD, num_blocks, h, refill, src, entries)
                        parts.fetch_entries(j + AHEAD + 1, ring, entries)  # used by the next step
                        parts.issuer_arrive(refill.full)
                T.barrier_wait(stage.full, parity)
                parts.block_step(j == 0, first_block + j, first_masked, last_pos, tile_tokens, scale_log2,
                                 ring.mode[j % RB], j, Q_s, P_s, P_s, stage, sm, False, False)

        # Plain Python (not parsed by TileLang): the stage ring unrolled.
        def issue_prologue(tile, ring, ring_stages, src):
            for s in range(AHEAD):
                guarded_issue(s, tile.num_blocks, tile.h, ring, ring_stages[s], src)

        def ring_steps(it, tile, ring, Q_s, P_s, ring_stages, src, sm):
            for s in range(stages):
                # Step j = it * stages + s refills the stage of item j + AHEAD - stages: the release of that
                # item is completion it - 1 + (s + AHEAD) // stages of the stage's empty barrier.
                step(it * stages + s, it & 1, (it + 1 + (s + AHEAD) // stages) & 1, tile.num_blocks, tile.request,
                     tile.first_block, tile.first_masked, tile.last_pos, tile.tile_tokens, tile.scale_log2, tile.h,
                     ring, Q_s, P_s, ring_stages[s], ring_stages[(s + AHEAD) % stages], src, sm, self.entries)

        @T.macro
        def block_loop(tile, Q_s, P_bufs, ring, ring_stages, src, sm, outputs):
            P_s = P_bufs[0]  # the one buffer of these tiles (p_buffer_count)
            parts.load_q(Q_s, sm)
            issue_prologue(tile, ring, ring_stages, src)
            parts.fetch_entries(AHEAD, ring, self.entries)
            for it in T.serial(T.ceildiv(tile.num_blocks, stages)):
                ring_steps(it, tile, ring, Q_s, P_s, ring_stages, src, sm)
            parts.final_gemms(tile, P_bufs, ring_stages, sm)
            parts.consumer_sync()
            parts.write_output(tile, sm, outputs)

        self.block_loop = block_loop

    def alloc_state(self, parts: ExtendParts):
        """The issuing warp's copy of the next stage item's index entries (K mode, K row, V mode, V row)."""
        self.entries = parts.T.alloc_local([4], "int32")

