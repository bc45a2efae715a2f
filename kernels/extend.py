"""Extend (prefill over a cached prefix) attention over mixed dense / 2:4-sparse KV blocks
(TileLang 0.1.11, Hopper sm_90a).

One extend step of one layer: request ``r`` brings ``n_r`` new query tokens (rows
``qo_indptr[r]:qo_indptr[r+1]`` of the packed ``q [total, Hq, D]``), the last ``n_r`` positions of its
``seq_lens[r]`` tokens; a query at position ``p`` attends to KV positions ``<= p`` (causal). The KV of a
request is a row of ``block_table`` exactly as in the decode kernel: cache pages (``e >= 0``, read from
``k_cache``/``v_cache``; the new tokens' K/V are already there) and compressed virtual blocks (``e < 0``,
resolved per KV head through ``k_index``/``v_index`` into the pools of ``sglang_hs.format``). Compressed
blocks only occur in the cached prefix; the last block may be partial. ``sglang_hs.reference.
paged_attention`` is the oracle; ``HieraSparseExtend`` is the plan/run API the backend calls.

Design (and why)
----------------
Built from the decode kernel's pieces (``kernels/decode.py``, verified on the H100), kept self-contained
here so that the decode kernel is untouched:

* **Trans-Both GEMMs, query rows x GQA heads as N.** ``S^T = K·Q^T`` (``[B, N]``, A = K, sparse along
  head_dim) and ``O^T += V^T·P^T`` (``[D, N]``, A = V^T, sparse along tokens). The N columns of a CTA are
  ``TQ = N / G`` consecutive query tokens of one request times the ``G`` query heads of one KV head,
  ordered (token, head): column ``c`` is token ``t0 + c // G``, head ``h*G + c % G``. Every KV byte a
  CTA reads serves N columns. Tile configurations (``TILES``): ``"n64"`` = N 64, 128 threads (one
  warpgroup: ``wgmma m64n64``); ``"n128"`` = N 128, 256 threads (two warpgroups; TileLang's default
  (Square) warp partition gives both GEMMs ``m_warp = 4, n_warp = 2``: each warpgroup owns 64 columns
  of ``S^T`` *and* of ``O^T``, so the softmax statistics of a column never leave its warpgroup);
  ``"n256"`` = N 256, 256 threads, warp schedule only (below): 8 warps of 32 columns. N is a multiple
  of 16 in all (no N = 24/40, bug #2603).
* **Per-block dispatch without losing the pipeline** (as decode): ``stages`` shared-memory stages with
  their own mbarriers; one elected thread issues the TMA loads of block ``j + stages - 1`` before the
  CTA waits on block ``j``, choosing per block between a cache page (3-D TMA box), a dense pool row and
  values + metadata of a 2:4 row; consumers branch on the same mode to ``T.gemm`` (``wgmma``) or
  ``T.gemm_sp`` (``wgmma.sp``). The block-table and index-map entries are resolved by all threads in
  parallel, ``threads / 2`` blocks per pass, into a two-half ring in shared memory: the prologue
  resolves the first pass, and step ``j`` with ``j % (threads/2) == 0`` resolves the next one, which is
  first issued several steps later (after a barrier). The two dependent index loads are paid once per
  pass, and a CTA can walk any number of blocks (no split is forced by long prefixes).
* **Softmax (CTA schedule): lane max, fragment exponentials.** TileLang's fragment reductions over
  the token (M) axis of ``S^T`` cost two CTA barriers per column held by a thread (16 columns at
  N = 64 per warpgroup), and their batched form indexes its workspace wrongly with two warpgroups
  (``workspace_stride`` = 128 for a 256-thread CTA: warpgroup 1's slot i is warpgroup 0's slot i + 1).
  So each block step stores
  ``S^T`` in ``P_s`` (the kernel's 16-bit type, clamped to +-6e4 (fp16) / 1e30 (bf16): masked keys stay
  finite there, fp16 cannot overflow), two consecutive lanes own a column and take its max (32 rows
  each + one shuffle, decode's lane softmax), and publish the scaled offset and the rescale factor in
  shared memory; the exponentials, the rescale of ``O^T`` and the row sums (kept per thread in a
  ``[B, N]`` fragment, reduced once at the end) stay in registers, then ``P^T`` overwrites ``P_s``
  (``stmatrix``) for ``O^T += V^T·P^T``. Any offset within rounding of the true max is exact for
  softmax: the same offset scales ``P``, the sums and the rescale. 4 CTA barriers per block step.
* **Causal masking** only in blocks that reach past the tile's first query position
  (``j >= (p_first + 1) // B``); the mask ``kv_pos <= q_pos`` also hides the rows of a partial last
  page (query positions never exceed ``seq_len - 1``). Columns past the request's last token (a partial
  tile) get a zero query and the last token's position, and are never stored. Blocks after the tile's
  last query position are not visited at all.
* **Tiles without host work.** Request ``r``'s tiles get the ids
  ``qo_indptr[r] // TQ + r + i`` for ``i < ceil(n_r / TQ)``: increasing, disjoint, and all below
  ``total // TQ + bs + 1``, so the grid's x extent is known on the host from shapes alone (no device
  sync, no tile table). A CTA finds its request by a parallel scan of ``qo_indptr`` (each thread checks
  some requests); ids that fall in the gaps (at most one per request) exit at once. CTAs take the ids
  in descending order (``tile_id = nt - 1 - blockIdx.x``): a request's later tiles see more blocks, so
  in a long causal prefill the longest CTAs start first and the last wave is of short ones.
* **Split-KV** over the blocks a tile sees (grid ``(tile ids, Hkv, splits)``; consecutive CTAs are the
  tiles of one request for the same KV head and split, so the KV they share is read from L2). The split
  count is chosen per call from shapes (tiles, KV heads, SMs, CTAs per SM) and passed as a dynamic grid
  extent: one compiled kernel serves every batch. With one split the CTA writes ``out`` (and the LSE)
  directly; otherwise every split writes a partial ``O`` (fp32, normalised) and base-2 LSE, and the last
  CTA of a (tile, KV head) to finish (an acq_rel atomic ticket, reset by that CTA: decode's fused
  combine) merges them: one thread a column takes the largest split LSE and the sum of the weights;
  then, split by split in index order, the split's weight per column goes to shared memory and every
  thread adds that split's partial O to all of its O^T elements at once, in O^T's registers, with
  loads that do not wait on each other (the merge of one output element at a time, each waiting on its
  loads, cost ~9% of the 64-token extend: ``bench_extend_merge_h100.log``). Outputs are bitwise those of
  a fixed split order, whichever CTA merges. Splits that get no block write only ``-inf`` LSEs.
* **Specialisation**: ``k_sparse=False`` drops the 2:4 K buffers (9 KB a stage at d 128) when the call's
  K values pool is empty (known from its shape), e.g. S_K = 0, the recommended setting, so that more
  CTAs fit per SM. The backend decides nothing: ``run`` picks the kernel from the pool shapes.
* **Why not merge the new tokens separately**: the new tokens' K/V are cache pages like the window's,
  so they are read in the same launch and the same block loop (no second kernel, no LSE merge); only
  the blocks on the tile's causal diagonal are masked.
* **Synchronisation schedules** (``sync``; ``HieraSparseExtend`` picks with ``default_sync``):

  - ``"cta"``: the description above; 4 CTA barriers a block step.
  - ``"warpgroup"``: the phases meet on a named barrier per warpgroup (``bar.sync 8 + wg, 128``: a
    warpgroup owns its columns, so no other warpgroup needs to wait); the stages are released through
    per-stage "empty" mbarriers that every thread arrives on after its O^T GEMM, and warp 0 waits on
    one before it refills the stage; CTA barriers only every ``threads / 2`` steps, around the index
    resolve. One warpgroup may run up to a step ahead of the other, so one's softmax can overlap the
    other's GEMMs. Its softmax keeps the warp schedule's *lazy offset* (below) although a column's 64
    tokens are spread over the 4 warps of the warpgroup (``wgmma``): each thread takes the largest of
    its scores against the offsets, and one ``barrier.cta.red.or`` over the warpgroup (a named barrier
    that also ORs a predicate, ``hs_warpgroup_any``) decides whether any passed its offset by more
    than 2^8; only then (and on the CTA's first block) does the column max go through ``P_s`` (the
    lane max above, 2 more warpgroup barriers) and the offsets, ``O^T`` and the sums move. The common
    block step has 2 warpgroup barriers (the vote, ``P^T`` written) and no ``S^T`` round trip through
    shared memory, against 4 barriers and the round trip before (0.79x -> 1.05x at 64 new tokens,
    S = 1/1, same process, ``bench_extend_lazy_wg_ab_h100.log``).
  - ``"warp"``: all warps side by side along the query columns (``GemmWarpPolicy.FullCol``), so each
    warp holds all 64 tokens of its columns (16 at n64/n128, 32 at n256), ``P^T`` is written and read
    back by the same warp (``__syncwarp``), and the block loop has no CTA or warpgroup barrier at all.
    Its softmax keeps a *lazy offset* per column (FA4's conditional rescale): a block's scores are
    taken against the current offsets, and only when one of the warp's passes its offset by more than
    2^8 (a warp vote), or on the CTA's first block, does the warp reduce the column max (shuffles, no
    shared memory) and move its offsets, rescaling O^T and the sums. Any offset works for softmax as
    long as P, the sums and O^T share it; P <= 2^8 stays far inside fp16. The row sums stay per lane
    (``[8, N]``: the mma accumulator gives a lane the rows ``i % 8 == g`` of its columns) and are summed
    over the lanes once, at the end. So the common block step has no reduction across lanes at all
    (``test_lazy_offsets_move_with_sharp_scores`` makes the offsets move). wgmma cannot split M = 64
    over one warp, so this schedule compiles with ``tl.disable_wgmma`` to ``mma.sp.sync`` (m16n8k32) /
    ``mma.sync``: the paper's Ada design. Same 2:4 metadata layout as ``wgmma.sp``. 32 columns a warp
    halve the per-column cost of what a warp does once per block whatever its width (the A operand and
    2:4 metadata loads, the stage wait, the step's control): n256 issued 1073 instructions a warp per block step
    for 32 columns where n128 issued 728 for 16 (both before the lazy offset; n256 now issues 861).
  - ``"overlap"`` (the default at n64, 2 stages): the lazy warpgroup schedule with FA3's
    intra-warpgroup overlap. Block step j issues ``S^T(j)`` and then block j - 1's ``O^T`` GEMM as
    asynchronous ``wgmma`` groups (``T.wgmma_gemm(_sp)``) and waits for the first only
    (``wgmma.wait_group 1``), so the ``O^T`` GEMM runs under block j's softmax; a rare offset move
    waits for it first. ``P^T(j)`` overwrites ``P_s`` once every warp's ``O^T`` GEMM has read it (one
    more warpgroup barrier). The stage of step j holds K of block j and V of block j - 1 (V loads run
    one block behind K), so both GEMMs of a step read one stage, which is free when the step ends: S
    stages keep S - 1 steps of loads in flight. The last block's V is a stage item of its own, read by
    one more ``O^T`` GEMM after the loop. (Holding K and V of a block in one stage kept the stage until
    step j + 1, so 3 stages were needed for one step of loads in flight; with 2 stages now the kernel
    is smaller and faster, see "What bounds it" below.)
    The issue path is kept short, because warp 0's issue delays its warpgroup's next GEMM (wgmma is
    warpgroup-wide) and the other warpgroup's data with it (``timeline_extend_h100.log``): warp 0 reads
    the next stage item's index entries into registers one step ahead (read at issue time, the chain of
    dependent shared-memory loads cost ~500 cycles a step while the other warpgroup's wgmma kept shared
    memory busy: 1.078x); the full barriers take one arrival, by the issuing warp after its
    expected-byte counts (count 1), and the empty barriers one per warp (count 8), not 256 atomics
    each. With 3 or more stages, step j refills the stage of item j - 2, released a step earlier, so
    that the issue never waits on the other warpgroup (``AHEAD = stages - 2``); it measured slower
    than 2 stages (0.976-0.987x in alternated A/B runs, ``bench_extend_stages_ab_h100.log``).
  - ``"producer"`` (the default at n128, 2 stages): the overlap schedule's block step with FA3's warp
    specialization and ping-pong. A third warpgroup (384 threads) resolves the index entries (its own
    named barrier) and issues every TMA load: its first warp waits for a stage's release (the empty
    barrier, one arrival per consumer warp) and issues the next stage item into it (the full barrier,
    count 1). The two consumer warpgroups only wait, compute and release, and they take turns to issue
    their GEMMs: warpgroup wg issues on its turn (named barrier 10 + wg) and hands the turn over once
    its S^T is ready, so that its softmax runs while the other's GEMMs hold the tensor cores.
    ``setmaxnreg``: 40 registers for the producer, 232 for the consumers (the CTA holds 384 x 168).
    The producer warpgroup alone measured equal to the overlap schedule (700.5 against 700.2 us at 64
    new tokens, S = 1/1), and neither moved with every pool row remapped into L2-resident rows: the
    step is bound on the SM, not by its loads. The ping-pong then gave 1.16x (1.17x at 256 new tokens;
    handing the turn over before the issue instead: 0.98x; ``bench_extend_pingpong_ab_h100.log``).
    n64 has one consumer warpgroup, so no ping-pong: it stays overlapped.
* **Fast math** (``tl.enable_fast_math``): ``exp2f`` is then one ``MUFU.EX2``; the IEEE path added a
  range test and two multiplies to every exponential (96 of 728 instructions a warp issued per step).
* **Bug work-arounds (0.1.11)**, as decode: ``T.fence_proxy_async()`` after ``P^T`` and ``Q`` are written
  to shared memory (#2634; not after ``P^T`` in the warp schedule, whose ``mma.sync`` reads it with
  ``ldmatrix``, in the generic proxy), and one after each index resolve: TileLang's proxy-fence pass
  counts the resolve's shared-memory stores as generic-proxy traffic and would otherwise put a
  ``fence.proxy.async`` before every TMA issue (the ring is never read by the async proxy; removing those
  fences alone measured 1.007x); automatic thread-sync insertion is disabled (it deadlocks in the elected-
  thread TMA branches) and the kernel places its barriers itself: at the top of each block step (WAR on
  the refilled stage, ``P_s`` and the index ring), after ``S^T`` is stored, after the column statistics
  are published, after ``P^T`` is written (the other schedules: see above).
* **Occupancy** (shared memory, d 128): n128 with 2 stages ~154 KB (~136 KB without 2:4 K buffers),
  with 3 ~204 KB (one CTA, 8 warps per SM; 202 registers, no spills; 222 in the warp schedule, 234
  per warpgroup, 254 overlapped; the producer schedule: 384 threads, 40 / 232 registers by
  ``setmaxnreg``); n256 with 2 stages ~196 KB (one CTA, 8 warps; 255 registers, no
  spills); n64 with 2 stages ~127 KB, or ~109 KB without 2:4 K buffers (two CTAs per SM). Registers
  hold n128 and n256 to one CTA per SM in every schedule.
* One launch per call, no host synchronisation: tile ids, splits, masks and empty splits are computed in
  the kernel from ``qo_indptr`` and ``seq_lens`` on the GPU; scratch grows on demand (``torch.empty`` /
  ``torch.zeros`` only). Empty pools are replaced by one-row dummies (a TMA descriptor cannot describe a
  zero-length tensor). Not CUDA-graph safe across changing batch shapes (the grid and scratch views
  follow ``q.shape`` and ``bs``); one call at a time per plan (scratch and tickets are per plan).

Measured (H100 80GB HBM3; ``tests/test_kernels_extend.py``: 67/67 on the GPU; ``python -m
sglang_hs.kernels.bench --kernel extend --quick`` (and ``--kernel prefill``), batch 8 x 32K prefix,
32/8 heads, d 128, fp16, against FlashInfer's paged prefill (fa2) over the same pruned KV in the same
process, the two timed in alternation; ``launch/results/kernels_h100.json``), with the default plans
(``HieraSparseExtend.pick_tile``, ``default_sync``, ``default_stages``: n64 up to 64 query columns a
request, overlapped; n128 above, the producer schedule; 2 stages). S_K = 0, S_V = 1: 1.01x at 16 new
tokens, 1.41x at 64, 1.39x at 256, 1.40x at 1024, 1.41x at 2048; S_K = S_V = 1: 1.10x, 1.37x, 1.31x,
1.33x, 1.36x (a second run at 64: 1.42x / 1.35x, ``bench_extend_64_rerun2_h100.log``); full prefill
of 32K tokens over compressed KV 1.36x / 1.30-1.32x (two runs;
``bench_extend_h100.log``, ``bench_prefill_h100.log``). With the overlap schedule at n128 the same runs
gave 1.02 / 1.19 / 1.09 / 1.09 / 1.13x and 1.09 / 1.20 / 1.13 / 1.14 / 1.17x, prefill 1.10x / 1.15x.
The n128 kernel is now a little faster with dense K rows than with 2:4 K rows (601 against 610 us at
64 new tokens, 2389 against 2434 us at 256): at this step rate the sparse S^T GEMM's metadata loads
cost more than the halved K bytes save. Earlier schedules and stage counts were chosen
from ``--variant`` runs that time them side by side (``bench_extend_variants_overlap_h100.log``:
at 64 new tokens, S = 1/1, the overlapped n128 went from 1.07x (two runs) with K and V of a block in
one stage and 3 stages to 1.13-1.15x (three runs) with V one block behind K and 2 stages; variants are
medians of 5 and differ by a few percent between runs).
Earlier steps, with the figures before each, are in ``bench_extend_tiles_h100.log``,
``bench_extend_merge_h100.log``, ``bench_extend_lazy_wg_ab_h100.log`` and
``bench_extend_overlap_ab_h100.log``.

**What bounds it.** The producer schedule before its ping-pong (ncu, 64 new tokens, S = 1/1, at ncu's
1.44 GHz; ``ncu_extend_h100.txt``): ~2390 cycles a block step, tensor pipe active 21.9%, 0.32
instructions issued a cycle per scheduler with 68% of cycles having no eligible warp; the same kernel
with L2-resident pools ran no faster. So the step is a latency chain on the SM (S^T GEMM, softmax,
P^T store, O^T GEMM), which the ping-pong shortens by running one warpgroup's softmax under the other's
GEMMs; the ping-pong kernel has not been profiled. The paragraphs below are about the kernels before
it.

The overlap kernel before its issue path was shortened (ncu, 64 new tokens, S = 1/1,
``launch/results/ncu_extend_h100.txt``): ~2500 cycles a block step (at ncu's 1.44 GHz). By our count
the step's shared-memory traffic (~134 KB: ``wgmma`` reads ``Q^T`` and ``P^T`` from shared memory for
every block, as the sparse operand must be A, plus the P^T stores and the TMA writes) needs ~1050
cycles at 128 bytes a cycle, and its 2:4 tensor work ~512; SM compute throughput is 28%. 8 warps a
SM (one CTA: registers, 240 a thread) wait on each step's chain: for their stage's TMA loads (17.6% of the warps' stall
samples: one stage of loads in flight), on the ``wgmma`` issue (11.6%), the exponentials (11.1%), and
on instruction fetch (6.1%). With 3 stages (two items of loads in flight) the stage waits stay at
16.8%, so they are not load latency that a deeper ring hides (what they wait for is open: the full
barrier needs both warpgroups' arrivals, and all CTAs load at once); instruction-fetch stalls rise to
11.0% (the ring is unrolled once per stage; 15,424 SASS instructions against 13,344) and the kernel
is 9% slower. With the ring indexed at run time (one loop body whatever the stage count) 3 stages
were still slower than 2 (1.06x against 1.10x in one A/B, ``bench_extend_ring_ab_h100.log``;
reverted).
An L2 prefetch of the next stage's pool rows made the kernel 0.84x
(``bench_extend_prefetch_ab_h100.log``). Tried and measured slower before: n256 per warp as 16 warps
of 16 columns (0.81x against 0.88x); FA3's ping-pong in the warp schedule (0.88x against 0.96x); S^T
half a block at a time in the warp schedule (0.934x against 0.996x, ``bench_extend_halfblock_h100.log``);
an earlier overlap schedule that refilled a stage from the last warpgroup to release it (0.59x, commit
49860d9); n64 tiles with 2:4 K rows (one CTA per SM by shared memory). On the ``mma.sync`` path of the
warp schedule 2:4 buys 1.49x, not 2x (``launch/mma_rate.cu``, ``mma_rate_h100.log``). Also slower, each
against the default plan in the same process (commits 432e705 and acdd6ab, both reverted): the overlap
schedule with the stage refilled by the last warpgroup to release it through a shared-memory counter
(count-1 full barriers, so no warp waits for the other warpgroup's release) 1.03x against 1.12x, plus
FA3's ping-pong of the two warpgroups' GEMM issue 1.05x (the ping-pong that won later hands over the
turns in the producer schedule, where no consumer issues loads), 3 stages of either slower still
(``bench_extend_decoupled_pingpong_h100.log``); N 128 over four warpgroups of 32 columns (16 warps a SM,
128 registers) 1.07x against 1.14x (``bench_extend_n128w4_h100.log``).

A timeline of the step (``timeline_extend_h100.log``: a session copy of the kernel that adds up, per
warp, the clock cycles between fixed points of the step) found the largest single wait: warp 0 spent
~580-740 of a ~2500-cycle step issuing the next stage's loads, its warpgroup's GEMM waited for it, and
the other warpgroup waited ~850-940 cycles for data issued that late. The issue path is now short (the
overlap bullet above: 1.05-1.08x in A/B runs); warp 0 still spends ~410 cycles a step in it, ~370 of
them in the TMA issue instructions themselves (~40 with the copies knocked out; halving their count
changed nothing: the first one waits), and the other warpgroup still waits ~800 cycles a step for its
data. The producer schedule takes the issue off the consumers; alone it measured no faster, with the
consumers' ping-pong 1.16x (above).

A knockout profile of the kernel before that change says where the step's time goes (``knockouts_extend_h100.log``: the same kernel built
with parts of the step removed behind never-taken branches; 64 new tokens, S = 1/1): the whole step
714-732 us; without loads (stale stages) 638 us, so the loads cost 11%; without loads, the two GEMMs alone
371 us and the softmax with the P^T store alone 363 us, which add up to more than the 638 us of both:
on an SM the GEMM phases of one warpgroup and the softmax phases of the other overlap by only ~100 us of
~365 each, and each phase alone runs at ~40% of its unit's rate (the GEMMs' sparse tensor work is
~150 us, the exponentials' MUFU work ~150 us, at 1.75 GHz). A 1.3x extend (~640 us) needed that overlap,
not fewer bytes; the producer schedule's ping-pong gives it (610 us).

The module imports neither TileLang nor a GPU at import time; ``build_extend_kernel`` does.
"""

import functools

import torch

from sglang_hs.kernels.common import (  # noqa: F401 (re-exported: tests and tools build with them)
    LN2, LOG2E, PASS_CONFIGS, SM90_TARGET, SMEM_PER_SM, PoolArgs, check_plan_shape, split_count,
)

# name -> (N columns per CTA, threads). Every shipped configuration is covered by the GPU tests.
# n256 only with the warp schedule: 8 warps of 32 columns each (255 registers a thread, no spills).
TILES = {"n64": (64, 128), "n128": (128, 256), "n256": (256, 256)}
# How the phases of a block step synchronise (see the module docstring): CTA barriers, per warpgroup,
# or per warp (mma.sync).
SYNCS = ("cta", "warpgroup", "warp", "overlap", "producer")


def default_sync(tile: str) -> str:
    """The schedule ``sync="auto"`` takes, the fastest measured on the H100: n128 with a producer
    warpgroup and ping-pong consumers (``bench_extend_pingpong_ab_h100.log``), n64 overlapped (one
    consumer warpgroup: no ping-pong; ``bench_extend_variants_overlap_h100.log``), n256 per warp (its
    only schedule)."""
    return "warp" if tile == "n256" else ("producer" if tile == "n128" else "overlap")


def default_stages(tile: str, sync: str = "cta") -> int:
    """n128 with CTA barriers: 3 stages (one CTA per SM is all that fits at d 128 anyway); every other
    schedule: 2. Overlapped n128 measured 1.22x against FlashInfer with 2 stages, 1.08x with 3 and
    1.12x with 4 (S_K = 0, 64 new tokens, one run; ``bench_extend_variants_overlap_h100.log``), and 3
    stages were slower in every run, also with the ring indexed at run time (one loop body,
    ``bench_extend_ring_ab_h100.log``). n64: two CTAs per SM fit when the call has no 2:4 K rows, as
    decode found best."""
    return 3 if tile == "n128" and sync == "cta" else 2


def resolve_chunk(tile: str) -> int:
    """Blocks whose index entries one parallel pass resolves (one entry per thread, at most)."""
    return TILES[tile][1] // 2


def smem_bytes(tile: str, head_dim: int, block_size: int = 64, stages: int = 2, k_sparse: bool = True) -> int:
    """Shared memory of one CTA (bytes), matching the buffers of :func:`build_extend_prim_func`."""
    n, threads = TILES[tile]
    elems = block_size * head_dim
    k_stage = elems * 2 + ((elems + elems // 8) if k_sparse else 0)  # dense tile [+ 2:4 values + metadata]
    v_stage = elems * 2 + elems + elems // 8
    maps = 3 * 2 * resolve_chunk(tile) * 4
    other = n * head_dim * 2 + block_size * n * 2 + maps + 3 * n * 4 + threads * 4 + 1024  # Q, P, maps, stats
    return stages * (k_stage + v_stage) + other


# Any of a warpgroup's threads (a warpgroup barrier that also ORs a predicate: bar.red.or, PTX ISA).
WARPGROUP_ANY_SRC = r"""
__device__ __forceinline__ int hs_warpgroup_any(int pred, int bar_id) {
  int out;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n barrier.cta.red.or.pred q, %2, 128, p;\n"
               " selp.s32 %0, 1, 0, q;\n}\n" : "=r"(out) : "r"(pred), "r"(bar_id) : "memory");
  return out;
}
"""


def build_extend_prim_func(
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int = 64,
    dtype: str = "float16",
    tile: str = "n128",
    stages: int = 3,
    k_sparse: bool = True,
    sync: str = "cta",
):
    """The TileLang ``prim_func`` of one configuration (every batch dimension is dynamic).

    Arguments, in order: ``Q [total, Hq, D]``, ``KC, VC [slots, Hkv, D]``, the six pools, ``KI, VI
    [Hkv, n_virtual]``, ``QI [bs + 1]`` (qo_indptr), ``BT [bs, max_blocks]``, ``SL [bs]``, ``sm_scale``,
    ``OP [rows, Hq, S, D]`` and ``LP [rows, Hq, S]`` (split partials; the split count ``S`` is bound from
    their shape, and with ``S = 1`` they may be one-row dummies), ``O [total, Hq, D]``, ``LSE [total, Hq]``
    (natural log), ``CNT [tile ids, Hkv]`` (zeroed tickets; the grid's x extent is bound from it).
    """
    import tilelang.language as T

    assert sync in SYNCS, sync
    assert tile != "n256" or sync == "warp", "n256 has one warp per 32 columns: sync='warp' only"
    wg_sync = sync != "cta"  # phases meet per warpgroup (per warp with "warp")
    lazy = sync in ("warpgroup", "overlap", "producer")  # wgmma with the lazy softmax offset, voted per warpgroup
    overlap = sync in ("overlap", "producer")  # the O^T GEMM of block j - 1 runs under block j's softmax
    # producer: the overlap schedule with one more warpgroup that resolves the index entries and issues
    # every TMA load (FA3's warp specialization), and the two consumer warpgroups taking turns to issue
    # their GEMMs (FA3's ping-pong; see compute_overlap). Register limits: REGS below. Named barriers of
    # the producer schedule: 1 the consumers (256 threads), 7 the producer warpgroup, 8 + wg a consumer
    # warpgroup, 10 + wg its turn to issue, 12 + wg its vote.
    producer = sync == "producer"
    PTHREADS = 128 if producer else 0  # the producer warpgroup: threads [threads, threads + 128)
    pingpong = producer and TILES[tile][1] == 256  # two consumer warpgroups take turns (compute_overlap)
    # Producer schedule, register limits (producer, consumers) with two consumer warpgroups (as pingpong).
    # Every thread starts with 168 registers (65536 / 384, rounded down to 8), and the consumers' increase
    # takes only what the producer gave back: 128 x 40 + 256 x 232 = 384 x 168. (A first version asked for
    # 32 / 240, 1K registers more than the CTA holds, and hung on the H100; 24 / 240 spill in the producer.)
    # With one consumer warpgroup (n64, 256 threads) every thread already has up to 255: no limits.
    REGS = (40, 232) if pingpong else None
    # Overlap: the stage of step j holds K of block j and V of block j - 1 (V one block behind), so that
    # both GEMMs of a step read one stage and the stage is free when the step ends; n + 1 stage items.
    items_extra = 1 if overlap else 0
    # Step j issues stage item j + AHEAD into the stage of item j + AHEAD - stages. AHEAD = stages - 1: that
    # stage held item j - 1, which the other warpgroup may still be reading, so the issuing warp (warp 0)
    # waits for its release, and its warpgroup's next GEMM with it. The overlap schedule with 3 or more
    # stages refills the stage of item j - 2 instead (AHEAD = stages - 2), released a step earlier:
    # the issue does not wait on the other warpgroup.
    AHEAD = stages - 2 if overlap and stages >= 3 else stages - 1
    warp = sync == "warp"  # each warp owns its columns across all of a block's tokens (mma.sync)
    # warp: all warps side by side along the N (query) columns, so that a column's softmax never leaves
    # its warp; wgmma cannot split M = 64 across one warp, so this schedule compiles to mma(.sp).sync.
    POL = T.GemmWarpPolicy.FullCol if warp else T.GemmWarpPolicy.Square
    B, D = block_size, head_dim
    N, threads = TILES[tile]
    G = q_heads // kv_heads
    assert q_heads % kv_heads == 0 and N % G == 0, "GQA group must divide the tile's N"
    assert D % 32 == 0 and B % 32 == 0 and stages >= 2
    TQ = N // G  # query tokens per tile
    WC = N // (threads // 32)  # warp schedule: the columns of one warp
    PCH = WC // 4  # warp schedule: columns of one lane
    PCHW = 8  # lazy warpgroup schedule: max chains a lane keeps

    def lane_col(c):
        # Warp schedule: which of its PCH columns column c is for the lane that holds it (the mma.sync
        # accumulator gives a lane column pairs 8 apart: c % 8 // 2 == lane % 4).
        return c % WC // 8 * 2 + c % 2
    HALF = resolve_chunk(tile)  # index entries resolved per pass; the ring holds two passes
    RB = 2 * HALF
    assert HALF >= stages and RB & (RB - 1) == 0
    accum = "float32"
    e_rows = B * D // 16 // 16  # metadata tile as [e_rows, 16] int16 (contiguous 2*B*D/16 bytes)
    NEG = -T.infinity(accum)
    CLAMP = 6.0e4 if dtype == "float16" else 1.0e30  # finite in the 16-bit type
    LAZY = 8.0  # warp schedule: a column's offset moves once one of its P would exceed 2^LAZY (softmax)
    TPC = threads // N  # lane max: threads per column (consecutive lanes)
    RPT = B // TPC  # rows per thread (interleaved: row i * TPC + lane % TPC)
    SHUF = [TPC >> k for k in range(1, TPC.bit_length()) if TPC >> k]  # xor offsets TPC/2 .. 1
    assert threads % N == 0 and 32 % TPC == 0
    (total, num_slots, nd, ns, nd2, ns2, nv, bs1, bs, mb, prow, S, nt) = T.dynamic(
        "total, num_slots, nd, ns, nd2, ns2, nv, bs1, bs, mb, prow, S, nt")

    def alloc_stage_buffers():
        out = []
        for _ in range(stages):
            kd = T.alloc_shared([B, D], dtype)
            ks = T.alloc_shared([B, D // 2], dtype) if k_sparse else None
            ke = T.alloc_shared([e_rows, 16], "int16") if k_sparse else None
            vd = T.alloc_shared([B, D], dtype)
            vs = T.alloc_shared([D, B // 2], dtype)
            ve = T.alloc_shared([e_rows, 16], "int16")
            # full: the block's loads landed; empty: every thread is done with it. The overlap schedule
            # arrives once per issue (full) and once per warp (empty), not 256 shared-memory atomics each
            # a step (its arrive and barrier waits went from ~105 to ~55 cycles a step,
            # timeline_extend_h100.log).
            bar = T.alloc_barrier(1 if overlap else threads)
            ebar = T.alloc_barrier(threads // 32 if overlap else threads) if wg_sync else None
            out.append((kd, ks, ke, vd, vs, ve, bar, ebar))
        return out

    @T.macro
    def resolve(chunk, n, r, start, h, BT, KI, VI, mode_s, krow_s, vrow_s):
        # Index entries of blocks [chunk*HALF, (chunk+1)*HALF) of this CTA into ring half chunk % 2:
        # mode = kmode | vmode << 2 (0 cache page, 1 dense pool row, 2 sparse pool row).
        for i in T.Parallel(HALF):
            if chunk * HALF + i < n:
                e = BT[r, start + chunk * HALF + i]
                slot = (chunk % 2) * HALF + i
                if e >= 0:
                    mode_s[slot] = 0
                    krow_s[slot] = e
                    vrow_s[slot] = e
                else:
                    ke_ = KI[h, -e - 1]
                    ve_ = VI[h, -e - 1]
                    mode_s[slot] = T.if_then_else(ke_ >= 0, 1, 2) + T.if_then_else(ve_ >= 0, 4, 8)
                    krow_s[slot] = T.if_then_else(ke_ >= 0, ke_, -ke_ - 1)
                    vrow_s[slot] = T.if_then_else(ve_ >= 0, ve_, -ve_ - 1)

    @T.macro
    def load_k(md, kr, h, kd, ks, ke, bar, KC, KD, KV, KM):
        # The TMA loads of a block's K (mode md & 3, row kr) into one stage: a cache page, a dense pool
        # row, or 2:4 values and metadata.
        if k_sparse:
            if (md & 3) == 0:
                T.tma_copy(KC[kr * B:(kr + 1) * B, h, :], kd, barrier=bar)
            elif (md & 3) == 1:
                T.tma_copy(KD[kr, :, :], kd, barrier=bar)
            else:
                T.tma_copy(KV[kr, :, :], ks, barrier=bar)
                T.tma_copy(KM[kr, :, :], ke, barrier=bar)
        else:
            if (md & 3) == 0:
                T.tma_copy(KC[kr * B:(kr + 1) * B, h, :], kd, barrier=bar)
            else:
                T.tma_copy(KD[kr, :, :], kd, barrier=bar)

    @T.macro
    def load_v(md, vr, h, vd, vs, ve, bar, VC, VD, VV, VM):
        # The same for a block's V (mode md >> 2, row vr).
        if (md >> 2) == 0:
            T.tma_copy(VC[vr * B:(vr + 1) * B, h, :], vd, barrier=bar)
        elif (md >> 2) == 1:
            T.tma_copy(VD[vr, :, :], vd, barrier=bar)
        else:
            T.tma_copy(VV[vr, :, :], vs, barrier=bar)
            T.tma_copy(VM[vr, :, :], ve, barrier=bar)

    @T.macro
    def load(i, n, h, mode_s, krow_s, vrow_s, kd, ks, ke, vd, vs, ve, bar, KC, VC, KD, KV, KM, VD, VV, VM):
        # The loads of stage item i (issued by one elected thread; the caller arrives): K and V of block
        # i, or in the overlap schedule K of block i and V of block i - 1, those that are blocks of the
        # CTA (items 0 .. n).
        if overlap:
            if i < n:
                load_k(mode_s[i % RB], krow_s[i % RB], h, kd, ks, ke, bar, KC, KD, KV, KM)
            if i >= 1:
                load_v(mode_s[(i - 1) % RB], vrow_s[(i - 1) % RB], h, vd, vs, ve, bar, VC, VD, VV, VM)
        else:
            # (One load of each index entry for both halves, as before the split into load_k / load_v:
            # these schedules' compiled kernels stay the ones measured.)
            md = mode_s[i % RB]
            kr = krow_s[i % RB]
            vr = vrow_s[i % RB]
            load_k(md, kr, h, kd, ks, ke, bar, KC, KD, KV, KM)
            load_v(md, vr, h, vd, vs, ve, bar, VC, VD, VV, VM)

    # Overlap schedule: the issuing warp's copy of the next stage item's index entries (K mode, K row, V mode,
    # V row), read from the ring one step before their loads are issued. Read at issue time, the chain of
    # dependent shared-memory loads held the issuing warp, and with it its warpgroup's next GEMM, for ~500
    # cycles a step while the other warpgroup's GEMMs kept shared memory busy. Set in main.
    ISSUE = {}

    @T.macro
    def fetch_entries(i, mode_s, krow_s, vrow_s):
        # The entries of overlap stage item i (K of block i, V of block i - 1; i >= 1) into ISSUE["pre"].
        ISSUE["pre"][0] = mode_s[i % RB]
        ISSUE["pre"][1] = krow_s[i % RB]
        ISSUE["pre"][2] = mode_s[(i - 1) % RB]
        ISSUE["pre"][3] = vrow_s[(i - 1) % RB]

    @T.macro
    def load_fetched(i, n, h, kd, ks, ke, vd, vs, ve, bar, KC, VC, KD, KV, KM, VD, VV, VM):
        # load() of overlap stage item i from the entries fetch_entries read a step before.
        if i < n:
            load_k(ISSUE["pre"][0], ISSUE["pre"][1], h, kd, ks, ke, bar, KC, KD, KV, KM)
        load_v(ISSUE["pre"][2], ISSUE["pre"][3], h, vd, vs, ve, bar, VC, VD, VV, VM)

    @T.macro
    def issuer_arrive(bar):
        # Overlap schedule: the one arrival on a full barrier (count 1), by lane 0 of the issuing warp once
        # the elected lane's expected-byte counts are registered (__syncwarp orders them).
        T.sync_warp()
        if T.get_thread_binding() == (threads if producer else 0):
            T.barrier_arrive(bar)

    @T.macro
    def consumer_sync():
        # A barrier of the threads that hold the fragments: the CTA, or in the producer schedule its first
        # `threads` (barrier 1 with that count, as TileLang's own reductions over them use).
        if producer:
            T.sync_threads(1, threads)
        else:
            T.sync_threads()

    @T.macro
    def produce_item(i, eparity, n, r, start, h, BT, KI, VI, mode_s, krow_s, vrow_s, kd, ks, ke, vd, vs, ve, bar,
                     ebar, KC, VC, KD, KV, KM, VD, VV, VM):
        # Producer schedule: stage item i (K of block i, V of block i - 1). Its first warp waits for the
        # stage's release (item i - stages). The next chunk of index entries is resolved at item
        # c * HALF + stages + 1 of chunk c: the consumers have then released item c * HALF + 1, so no
        # consumer reads the entries of chunk c - 1, whose ring half it overwrites.
        if i < n + items_extra:
            if T.get_thread_binding() < threads + 32:
                if i >= stages:
                    T.barrier_wait(ebar, eparity)
            if i % HALF == stages + 1:
                if (i // HALF + 1) * HALF < n:
                    T.sync_threads(7, 128)
                    resolve(i // HALF + 1, n, r, start, h, BT, KI, VI, mode_s, krow_s, vrow_s)
                    T.fence_proxy_async()  # resets TileLang's proxy state: no fence at the TMA issue
                    T.sync_threads(7, 128)
            if T.get_thread_binding() < threads + 32:
                load(i, n, h, mode_s, krow_s, vrow_s, kd, ks, ke, vd, vs, ve, bar, KC, VC, KD, KV, KM, VD, VV, VM)
                issuer_arrive(bar)

    @T.macro
    def group_barrier():
        # Between the phases of one block step, only the threads that share columns must meet: the
        # whole CTA, or (warpgroup sync) the warpgroup that owns the columns, on its own named barrier.
        if warp:
            T.sync_warp()
        elif wg_sync:
            T.sync_threads(8 + T.get_thread_binding() // 128, 128)
        else:
            T.sync_threads()

    # The GEMM operators of a block: synchronous (T.gemm / T.gemm_sp), or issued without a wait (the
    # overlap schedule: T.wgmma_gemm / T.wgmma_gemm_sp, one wgmma group each).
    SYNC_GEMMS = (T.gemm, T.gemm_sp)
    ASYNC_GEMMS = (T.wgmma_gemm, T.wgmma_gemm_sp)

    @T.macro
    def gemm_s(md, Q_s, kd, ks, ke, sT, dense, sparse):
        # S^T = K·Q^T for one block, dense or 2:4 by the block's K mode.
        if k_sparse:
            if (md & 3) == 2:
                sparse(ks, T.view(ke, [B, D // 16]), Q_s, sT, transpose_B=True, clear_accum=True, policy=POL)
            else:
                dense(kd, Q_s, sT, transpose_B=True, clear_accum=True, policy=POL)
        else:
            dense(kd, Q_s, sT, transpose_B=True, clear_accum=True, policy=POL)

    @T.macro
    def gemm_o(vmode, P_s, vd, vs, ve, oT, dense, sparse):
        # O^T += V^T·P^T for one block, dense or 2:4 by the block's V mode.
        if vmode == 2:
            sparse(vs, T.view(ve, [D, B // 16]), P_s, oT, policy=POL)
        else:
            dense(vd, P_s, oT, transpose_A=True, policy=POL)

    @T.macro
    def lane_column_max(P_s, sT, mx):
        # Column max over the block's tokens: S^T goes through P_s (in the kernel's 16-bit type,
        # clamped to +-CLAMP so that masked keys are finite there and fp16 cannot overflow), then TPC
        # consecutive lanes own a column (decode's lane softmax) and hold its max in mx[0]. Any offset
        # close to the max is exact for the softmax: the same offset scales P, the row sums and the
        # rescale. Returns the thread index and its column.
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
    def lane_max_stats(scale2, P_s, sT, msc, rs, msc_sh, rs_sh, m_run, mx):
        # CTA schedule: the column max (lane_column_max) joins the running max, and the scaled offset
        # and the O^T rescale factor of each column are published through shared memory.
        tx, cc = lane_column_max(P_s, sT, mx)
        m_new = T.max(m_run[0], mx[0])  # finite (>= -CLAMP); m_run starts at -inf, so rs = 0 first
        if tx % TPC == 0:
            rs_sh[cc] = T.exp2(m_run[0] * scale2 - m_new * scale2)
            msc_sh[cc] = m_new * scale2
        m_run[0] = m_new
        group_barrier()
        for c in T.Parallel(N):
            msc[c] = msc_sh[c]
            rs[c] = rs_sh[c]

    @T.macro
    def causal_mask(jj, jm, qlast, tv, sT):
        if jj >= jm:  # the block reaches past the tile's first query position: causal mask
            for i, c in T.Parallel(B, N):
                sT[i, c] = T.if_then_else(jj * B + i <= qlast - T.max(tv - 1 - c // G, 0), sT[i, c], NEG)

    @T.macro
    def lazy_scores(first, scale2, sT, msc, pmax, chains, chain_of):
        # Lazy offset, first half: the scores against the columns' current (scaled) offsets msc, and
        # the lane's largest of them in pmax[0] (kept in ``chains`` independent chains, chain_of(c) for
        # column c; LAZY + LAZY on the CTA's first block, so that its offsets are always set).
        for k in T.unroll(chains):
            pmax[k] = T.if_then_else(first, LAZY + LAZY, NEG)
        for i, c in T.Parallel(B, N):
            sT[i, c] = sT[i, c] * scale2 - msc[c]  # masked keys stay -inf
            pmax[chain_of(c)] = T.max(pmax[chain_of(c)], sT[i, c])
        for k in T.unroll(1, chains):
            pmax[0] = T.max(pmax[0], pmax[k])

    @T.macro
    def softmax(first, jj, jm, qlast, tv, scale2, P_s, sT, oT, lacc, msc, rs, msc_sh, rs_sh, m_run, mx, pmax):
        # Turn S^T into the block's unnormalised P^T (in sT) and update the row sums (lacc). The O^T
        # rescale factors go to rs: the lazy schedules (warp, warpgroup) apply them here, when their
        # offsets move; the CTA schedule in rescale_store_p.
        causal_mask(jj, jm, qlast, tv, sT)
        if warp:
            # A column's tokens are all in one warp. Lazy offset (FA4's conditional rescale): the scores
            # are first taken against the columns' current (scaled) offsets msc; only when one of the warp
            # passes its offset by more than LAZY (log2 units), and on the CTA's first block, does the warp
            # reduce the block's column max (shuffles) and move the offsets. Exact for softmax (P, the sums
            # and O^T share the offset), P <= 2^LAZY stays far inside fp16, and the common block step has
            # no max reduction, no per-column statistics and no O^T rescale.
            # The largest score of the lane, in PCH independent chains (one per column of the lane).
            lazy_scores(first, scale2, sT, msc, pmax, PCH, lane_col)
            if T.any_sync(T.if_then_else(pmax[0] > LAZY, 1, 0)) != 0:
                T.reduce_max(sT, mx, dim=0, clear=True)
                for c in T.Parallel(N):
                    # mx becomes the offset's move: up to the block max (the first block sets the offset
                    # there, kept >= -CLAMP so that a fully masked column stays finite).
                    mx[c] = T.if_then_else(first, T.max(mx[c], -CLAMP * scale2 - msc[c]), T.max(mx[c], 0.0))
                    rs[c] = T.if_then_else(first, 1.0, T.exp2(-mx[c]))  # O^T and the sums are still 0 first
                    msc[c] = msc[c] + mx[c]
                for g, c in T.Parallel(8, N):
                    lacc[g, c] = lacc[g, c] * rs[c]
                for i, c in T.Parallel(B, N):
                    sT[i, c] = T.exp2(sT[i, c] - mx[c])
                for d, c in T.Parallel(D, N):
                    oT[d, c] *= rs[c]
            else:
                for i, c in T.Parallel(B, N):
                    sT[i, c] = T.exp2(sT[i, c])
            # Row sums: each lane adds its own rows of a column (row group i % 8, see lacc) into its
            # partial; the lanes' partials are summed once, at the end.
            for i, c in T.Parallel(B, N):
                lacc[i % 8, c] = lacc[i % 8, c] + sT[i, c]
        elif lazy:
            # The warp schedule's lazy offset, with a column's tokens spread over the 4 warps of a
            # warpgroup: the vote is a warpgroup barrier reduction (bar.red.or), and the rare move takes
            # the column max through P_s (lane_column_max).
            lazy_scores(first, scale2, sT, msc, pmax, PCHW, lambda c: c // 8 % (PCHW // 2) * 2 + c % 2)
            if T.call_extern("int32", "hs_warpgroup_any", T.if_then_else(pmax[0] > LAZY, 1, 0),
                             12 + T.get_thread_binding() // 128) != 0:
                if overlap:
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
        else:
            lane_max_stats(scale2, P_s, sT, msc, rs, msc_sh, rs_sh, m_run, mx)
            for i, c in T.Parallel(B, N):
                sT[i, c] = T.exp2(sT[i, c] * scale2 - msc[c])  # masked keys: exp2(-inf) = 0
                lacc[i, c] = lacc[i, c] * rs[c] + sT[i, c]  # row sums stay per thread until the end

    @T.macro
    def rescale_store_p(P_s, sT, oT, rs):
        # O^T *= rescale (the lazy schedules rescale in softmax, only when their offsets move), then P^T
        # to shared memory as the B operand of the next O^T GEMM.
        if not warp and not lazy:
            for d, c in T.Parallel(D, N):
                oT[d, c] *= rs[c]
        T.copy(sT, P_s)
        if not warp:  # (the warp schedule's mma.sync reads P^T with ldmatrix: no async proxy involved)
            T.fence_proxy_async()  # #2634: generic writes of P^T before the (sparse) wgmma reads them
        group_barrier()

    @T.macro
    def compute(first, jj, jm, qlast, tv, scale2, md, Q_s, P_s, kd, ks, ke, vd, vs, ve, sT, oT, lacc, msc, rs,
                msc_sh, rs_sh, m_run, mx, pmax):
        gemm_s(md, Q_s, kd, ks, ke, sT, *SYNC_GEMMS)
        softmax(first, jj, jm, qlast, tv, scale2, P_s, sT, oT, lacc, msc, rs, msc_sh, rs_sh, m_run, mx, pmax)
        rescale_store_p(P_s, sT, oT, rs)
        gemm_o(md >> 2, P_s, vd, vs, ve, oT, *SYNC_GEMMS)

    @T.macro
    def compute_overlap(first, jj, jm, qlast, tv, scale2, md, j, Q_s, P_s, kd, ks, ke, vd, vs, ve, ebar,
                        sT, oT, lacc, msc, rs, msc_sh, rs_sh, m_run, mx, pmax, mdp):
        # Overlap schedule (FA3's intra-warpgroup overlap), step j: issue S^T(j), then O^T += V^T·P^T of
        # block j - 1 (P^T(j - 1) is in P_s, its mode in mdp, its V in this stage), and wait for S^T only,
        # so that the O^T GEMM runs under block j's softmax; the softmax's rare offset move waits for it
        # first (it rescales O^T and reuses P_s). Then the O^T GEMM is waited for, the stage released,
        # and P^T(j) written once every warp's GEMM has read P_s. The last block's O^T GEMM follows the
        # loop.
        # Producer schedule, FA3's ping-pong: warpgroup wg issues its GEMMs on its turn (barrier 10 + wg)
        # and hands the turn to the other once its S^T is ready, so one warpgroup's softmax runs while
        # the other's GEMMs have the tensor cores: 1.16x at 64 new tokens, S = 1/1, against the same
        # schedule without the turns (bench_extend_pingpong_ab_h100.log). Handing the turn over right
        # after the issue instead measured 0.98x.
        if pingpong:
            T.sync_threads(10 + T.get_thread_binding() // 128, 256)
        gemm_s(md, Q_s, kd, ks, ke, sT, *ASYNC_GEMMS)
        if j >= 1:
            gemm_o(mdp[0] >> 2, P_s, vd, vs, ve, oT, *ASYNC_GEMMS)
            T.wait_wgmma(1)
        else:
            T.wait_wgmma(0)
        if pingpong:
            T.named_barrier_arrive(11 - T.get_thread_binding() // 128, 256)
        softmax(first, jj, jm, qlast, tv, scale2, P_s, sT, oT, lacc, msc, rs, msc_sh, rs_sh, m_run, mx, pmax)
        T.wait_wgmma(0)
        T.sync_warp()
        if T.get_thread_binding() % 32 == 0:
            T.barrier_arrive(ebar)  # this warp's GEMMs on the stage are complete
        group_barrier()  # WAR: every warp's O^T GEMM of block j - 1 has read P_s
        rescale_store_p(P_s, sT, oT, rs)
        mdp[0] = md

    @T.macro
    def final_gemm_if(n, s, P_s, vd, vs, ve, bar, oT, mdp):
        # After the loop: the O^T GEMM of the last block, whose V is stage item n (stage s).
        if n >= 1:
            if n % stages == s:
                T.barrier_wait(bar, n // stages % 2)
                gemm_o(mdp[0] >> 2, P_s, vd, vs, ve, oT, *SYNC_GEMMS)

    @T.macro
    def guarded_issue(i, n, h, mode_s, krow_s, vrow_s, kd, ks, ke, vd, vs, ve, bar, ebar,
                      KC, VC, KD, KV, KM, VD, VV, VM):
        if i < n + items_extra:
            if overlap:
                if T.get_thread_binding() < 32:
                    load(i, n, h, mode_s, krow_s, vrow_s, kd, ks, ke, vd, vs, ve, bar, KC, VC, KD, KV, KM, VD, VV,
                         VM)
                    issuer_arrive(bar)
            else:
                load(i, n, h, mode_s, krow_s, vrow_s, kd, ks, ke, vd, vs, ve, bar, KC, VC, KD, KV, KM, VD, VV, VM)
                T.barrier_arrive(bar)

    @T.macro
    def step(j, parity, eparity, n, r, start, jm, qlast, tv, scale2, h, BT, KI, VI, mode_s, krow_s, vrow_s,
             Q_s, P_s, kd, ks, ke, vd, vs, ve, bar, ebar, kd2, ks2, ke2, vd2, vs2, ve2, bar2, ebar2,
             KC, VC, KD, KV, KM, VD, VV, VM, sT, oT, lacc, msc, rs, msc_sh, rs_sh, m_run, mx, pmax, mdp):
        if producer:
            if j < n:
                T.barrier_wait(bar, parity)
                compute_overlap(j == 0, start + j, jm, qlast, tv, scale2, mode_s[j % RB], j, Q_s, P_s, kd, ks, ke,
                                vd, vs, ve, ebar, sT, oT, lacc, msc, rs, msc_sh, rs_sh, m_run, mx, pmax, mdp)
        else:
            if j < n:
                if wg_sync:
                    if j % HALF == 0:
                        # The ring half resolved below was last read at step j - HALF - 1 or before: the
                        # first barrier waits for every thread to be past it, the second publishes the
                        # entries to the issuing warp (first issued HALF - stages + 1 steps from now).
                        T.sync_threads()
                        resolve(j // HALF + 1, n, r, start, h, BT, KI, VI, mode_s, krow_s, vrow_s)
                        T.fence_proxy_async()  # resets TileLang's proxy state: no fence at the TMA issue
                        T.sync_threads()
                else:
                    # WAR: the stage refilled below, P_s and the ring half resolved below were read before.
                    T.sync_threads()
                    if j % HALF == 0:
                        # Next chunk of index entries; first issued >= HALF - stages + 1 steps from now, after
                        # that step's barrier (the half it overwrites was last read before this step's barrier).
                        resolve(j // HALF + 1, n, r, start, h, BT, KI, VI, mode_s, krow_s, vrow_s)
                        T.fence_proxy_async()  # resets TileLang's proxy state: no fence at the TMA issue
                if j + AHEAD < n + items_extra:
                    if wg_sync:
                        # Warp 0 refills the stage of item j + AHEAD - stages once every thread has released
                        # it; the other warps go on (a warpgroup may run up to a step ahead of the other).
                        if T.get_thread_binding() < 32:
                            if j + AHEAD >= stages:
                                T.barrier_wait(ebar2, eparity)
                            if overlap:
                                load_fetched(j + AHEAD, n, h, kd2, ks2, ke2, vd2, vs2, ve2, bar2,
                                             KC, VC, KD, KV, KM, VD, VV, VM)
                                fetch_entries(j + AHEAD + 1, mode_s, krow_s, vrow_s)  # used by the next step
                                issuer_arrive(bar2)
                            else:
                                load(j + AHEAD, n, h, mode_s, krow_s, vrow_s, kd2, ks2, ke2, vd2, vs2, ve2,
                                     bar2, KC, VC, KD, KV, KM, VD, VV, VM)
                    else:
                        load(j + AHEAD, n, h, mode_s, krow_s, vrow_s, kd2, ks2, ke2, vd2, vs2, ve2, bar2,
                             KC, VC, KD, KV, KM, VD, VV, VM)
                    if not overlap:
                        T.barrier_arrive(bar2)
                T.barrier_wait(bar, parity)
                # First argument: the CTA's first block (only the lazy schedules' softmax asks).
                if overlap:
                    compute_overlap(j == 0, start + j, jm, qlast, tv, scale2, mode_s[j % RB], j, Q_s, P_s,
                                    kd, ks, ke, vd, vs, ve, ebar, sT, oT, lacc, msc, rs, msc_sh, rs_sh, m_run,
                                    mx, pmax, mdp)
                else:
                    compute((j == 0) if warp or lazy else None, start + j, jm, qlast, tv, scale2, mode_s[j % RB],
                            Q_s, P_s, kd, ks, ke, vd, vs, ve, sT, oT, lacc, msc, rs, msc_sh, rs_sh, m_run, mx, pmax)
                    if wg_sync:
                        T.barrier_arrive(ebar)  # this thread's GEMMs on the stage are complete

    # Plain Python helpers (not parsed by TileLang): unroll the stage ring.
    def emit_prologue(n, h, mode_s, krow_s, vrow_s, st, gl):
        for s in range(AHEAD):
            guarded_issue(s, n, h, mode_s, krow_s, vrow_s, *st[s], *gl)

    def emit_ring(it, n, r, start, jm, qlast, tv, scale2, h, idx, Q_s, P_s, st, gl, frags):
        for s in range(stages):
            nxt = (s + AHEAD) % stages
            # Step j = it * stages + s refills stage nxt, which held item j + AHEAD - stages: the release of
            # that item is completion it - 1 + (s + AHEAD) // stages of the stage's empty barrier.
            eparity = (it + 1 + (s + AHEAD) // stages) & 1
            step(it * stages + s, it & 1, eparity, n, r, start, jm, qlast, tv, scale2, h, *idx, Q_s, P_s,
                 *st[s], *st[nxt], *gl, *frags)

    @T.macro
    def init_fragments(oT, lacc, msc, m_run):
        T.fill(oT, 0)
        T.fill(lacc, 0)
        if warp or lazy:
            T.fill(msc, 0)  # scaled offsets; the first block step sets them
        else:
            m_run[0] = NEG

    def emit_producer(it, n, r, start, h, idx, st, gl):
        for s in range(stages):
            # Item it * stages + s waits for the release of item (it - 1) * stages + s (completion it - 1).
            produce_item(it * stages + s, (it + 1) & 1, n, r, start, h, *idx, *st[s], *gl)

    def emit_final(n, P_s, st, oT, mdp):
        for s in range(stages):
            final_gemm_if(n, s, P_s, *st[s][3:7], oT, mdp)

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
        with T.Kernel(nt, kv_heads, S, threads=threads + PTHREADS) as (bx, h, sid):
            if lazy:
                T.import_source(WARPGROUP_ANY_SRC)
            # Tile ids in descending order: a request's later tiles see more blocks (causal), so in a long
            # prefill the longest CTAs start first instead of forming the last wave.
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
            st = alloc_stage_buffers()
            sT = T.alloc_fragment([B, N], accum)
            oT = T.alloc_fragment([D, N], accum)
            # Row sums, per thread (reduced once at the end): [B, N] like S^T, or in the warp schedule
            # [8, N]: the mma.sync accumulator gives lane (row group g, column pair) the rows i with
            # i % 8 == g of its columns, and lacc[g, c] is that lane's partial sum.
            lacc = T.alloc_fragment([8, N] if warp else [B, N], accum)
            if warp:
                T.annotate_layout({lacc: T.Fragment(
                    [8, N], forward_fn=lambda g, c: (c // WC * 32 + g * 4 + c % 8 // 2, lane_col(c)))})
            l = T.alloc_fragment([N], accum)
            rs = T.alloc_fragment([N], accum)
            msc = T.alloc_fragment([N], accum)
            # The running column max (not kept by the warp schedule: its offsets, msc, are the max at their
            # last move) and the block's: per column fragments in the warp schedule, else the one column of
            # each lane's pair.
            m_run = None if warp or lazy else T.alloc_local([1], accum)
            mx = T.alloc_fragment([N], accum) if warp else T.alloc_local([1], accum)
            # Lazy offsets: this lane's largest scores, in independent chains.
            pmax = T.alloc_local([PCH], accum) if warp else (T.alloc_local([PCHW], accum) if lazy else None)
            # Overlap schedule: the mode of the block whose O^T GEMM is pending.
            mdp = T.alloc_local([1], "int32") if overlap else None
            if overlap and not producer:
                ISSUE["pre"] = T.alloc_local([4], "int32")
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

                idx = (BT, KI, VI, mode_s, krow_s, vrow_s)
                resolve(0, n, r, start, h, *idx)
                for c, d in T.Parallel(N, D):
                    Q_s[c, d] = T.if_then_else(
                        c // G < tv, Q[q0 + t0 + T.min(c // G, tv - 1), h * G + c % G, d], T.cast(0, dtype))
                if not producer:
                    init_fragments(oT, lacc, msc, m_run)
                T.fence_proxy_async()  # #2634: Q_s written by generic stores before wgmma reads it
                T.sync_threads()

                gl = (KC, VC, KD, KV, KM, VD, VV, VM)
                if producer and tid >= threads:
                    if REGS is not None:
                        T.set_max_nreg(REGS[0], 0)
                    for it in T.serial(T.ceildiv(n + items_extra, stages)):
                        emit_producer(it, n, r, start, h, idx, st, gl)
                else:
                    if producer:
                        if REGS is not None:
                            T.set_max_nreg(REGS[1], 1)
                        init_fragments(oT, lacc, msc, m_run)
                    if pingpong:
                        if tid >= 128:
                            if n >= 1:
                                T.named_barrier_arrive(10, 256)  # warpgroup 0 takes the first turn
                    frags = (sT, oT, lacc, msc, rs, msc_sh, rs_sh, m_run, mx, pmax, mdp)
                    if not producer:
                        emit_prologue(n, h, mode_s, krow_s, vrow_s, st, gl)
                        if overlap:
                            fetch_entries(AHEAD, mode_s, krow_s, vrow_s)
                    for it in T.serial(T.ceildiv(n, stages)):
                        emit_ring(it, n, r, start, jm, qlast, tv, scale2, h, idx, Q_s, P_s, st, gl, frags)
                    if overlap:
                        emit_final(n, P_s, st, oT, mdp)
                    if pingpong:
                        if tid < 128:
                            if n >= 1:
                                T.sync_threads(10, 256)  # warpgroup 1's last hand-over: no arrival left pending
                    if wg_sync:
                        consumer_sync()  # the warpgroups meet again before the CTA-wide reduction

                    T.reduce_sum(lacc, l, dim=0)  # once per CTA (scalar AllReduce: correct for 2 warpgroups)
                    if warp or lazy:
                        for c in T.Parallel(N):
                            m_sh[c] = msc[c] / scale2  # the LSE below scales it back
                    else:
                        if tid % TPC == 0:
                            m_sh[tid // TPC] = m_run[0]
                    consumer_sync()
                    if S == 1:
                        for d, c in T.Parallel(D, N):
                            if c // G < tv:
                                O[q0 + t0 + c // G, h * G + c % G, d] = T.cast(
                                    T.if_then_else(l[c] > 0, oT[d, c] / l[c], 0.0), dtype)
                        for c in T.Parallel(N):
                            if c // G < tv:
                                LSE[q0 + t0 + c // G, h * G + c % G] = T.if_then_else(
                                    l[c] > 0, (T.log2(l[c]) + m_sh[c] * scale2) * LN2, NEG)
                    else:
                        for c in T.Parallel(N):
                            if c // G < tv:
                                LP[q0 + t0 + c // G, h * G + c % G, sid] = T.if_then_else(
                                    l[c] > 0, T.log2(l[c]) + m_sh[c] * scale2, NEG)
                        if n > 0:
                            for d, c in T.Parallel(D, N):
                                if c // G < tv:
                                    OP[q0 + t0 + c // G, h * G + c % G, sid, d] = T.if_then_else(
                                        l[c] > 0, oT[d, c] / l[c], 0.0)
                        # Split-KV merge by the last CTA of this (tile, KV head): release our partials,
                        # take a ticket (acq_rel, device scope), and merge if we are the S-th.
                        consumer_sync()
                        if tid == 0:
                            tk_sh[0] = T.atomic_add(CNT[tile_id, h], 1, memory_order="acq_rel", return_prev=True)
                        consumer_sync()
                        if tk_sh[0] == S - 1:
                            # First per column (thread c): the largest split LSE (msc_sh) and the sum of the
                            # splits' weights (m_sh); then every element of O^T at once, with O^T's registers
                            # as the accumulator, so that a thread's loads do not wait on each other. Splits
                            # are added in index order whichever CTA merges (deterministic). Empty splits
                            # wrote an LSE of -inf and no partial O.
                            if tid < N:
                                if tid // G < tv:
                                    row_c = q0 + t0 + tid // G
                                    cm[0] = NEG
                                    for s2 in T.serial(S):
                                        cm[0] = T.max(cm[0], LP[row_c, h * G + tid % G, s2])
                                    cm[1] = 0.0
                                    for s2 in T.serial(S):
                                        if LP[row_c, h * G + tid % G, s2] != NEG:
                                            cm[1] = cm[1] + T.exp2(LP[row_c, h * G + tid % G, s2] - cm[0])
                                    msc_sh[tid] = cm[0]
                                    m_sh[tid] = cm[1]
                                    LSE[row_c, h * G + tid % G] = T.if_then_else(
                                        cm[1] > 0, (T.log2(cm[1]) + cm[0]) * LN2, NEG)
                            T.fill(oT, 0)
                            for s2 in T.serial(S):
                                # The split's weight per column (0 for an empty split), then its partial O
                                # for every element: unconditional loads (an empty split's rows hold stale
                                # values, which the select drops).
                                consumer_sync()
                                if tid < N:
                                    rs_sh[tid] = 0.0
                                    if tid // G < tv:
                                        if LP[q0 + t0 + tid // G, h * G + tid % G, s2] != NEG:
                                            rs_sh[tid] = T.exp2(LP[q0 + t0 + tid // G, h * G + tid % G, s2] - msc_sh[tid])
                                consumer_sync()
                                for d, c in T.Parallel(D, N):
                                    oT[d, c] = T.if_then_else(
                                        rs_sh[c] > 0,
                                        oT[d, c] + rs_sh[c] * OP[q0 + t0 + T.min(c // G, tv - 1), h * G + c % G, s2, d],
                                        oT[d, c])
                            for d, c in T.Parallel(D, N):
                                if c // G < tv:
                                    O[q0 + t0 + c // G, h * G + c % G, d] = T.cast(
                                        T.if_then_else(m_sh[c] > 0, oT[d, c] / m_sh[c], 0.0), dtype)
                            if tid == 0:
                                CNT[tile_id, h] = 0

    return main


@functools.lru_cache(maxsize=None)
def build_extend_kernel(q_heads, kv_heads, head_dim, block_size=64, dtype="float16", tile="n128", stages=3,
                        k_sparse=True, sync="cta", target=None):
    """Compile (or load from TileLang's cache) the kernel of one configuration. Needs TileLang, not a GPU."""
    import tilelang

    func = build_extend_prim_func(q_heads, kv_heads, head_dim, block_size, dtype, tile, stages, k_sparse, sync)
    # Fast math: exp2f becomes one MUFU.EX2 (the IEEE path adds a range test and two multiplies to each of a
    # block step's exponentials: 96 of ~730 instructions a warp issued per step, ncu source counters).
    configs = {**PASS_CONFIGS, "tl.enable_fast_math": True}
    if sync == "warp":
        configs["tl.disable_wgmma"] = True
        # The row-sum partials lacc[i % 8, c] are added to by each of a lane's rows in turn: a per-lane
        # accumulation, which the data-race check reports as several iterations writing one element.
        configs["tl.disable_data_race_check"] = True
    return tilelang.compile(func, target=target or SM90_TARGET, pass_configs=configs)


def tile_count(total_tokens: int, batch: int, tokens_per_tile: int) -> int:
    """Tile ids of a call (the grid's x extent): request r's ids start at ``qo_indptr[r] // TQ + r``."""
    return total_tokens // tokens_per_tile + batch + 1


def tile_ids(qo_indptr: list[int], tokens_per_tile: int) -> list[tuple[int, int, int]]:
    """``(tile id, request, first token)`` of every tile, as the kernel assigns them (for tests)."""
    out = []
    for r in range(len(qo_indptr) - 1):
        first = qo_indptr[r] // tokens_per_tile + r
        n = qo_indptr[r + 1] - qo_indptr[r]
        for i in range(-(-n // tokens_per_tile)):
            out.append((first + i, r, i * tokens_per_tile))
    return out


def choose_num_splits(tiles: int, kv_heads: int, blocks: int, num_sms: int, ctas_per_sm: int,
                      max_splits: int = 64, cta_overhead_blocks: float = 8.0) -> int:
    """Splits per (tile, KV head): the fewest that keep every resident CTA slot busy
    (:func:`sglang_hs.kernels.common.split_count`, decode's cost model).

    A CTA costs ``ceil(blocks / S)`` block steps plus ``cta_overhead_blocks`` (its query tile, the
    pipeline fill, the partial output and the merge: at 18 splits over 32K the extend kernel ran 2.5x
    slower than at one, where decode's model, with no per-CTA cost, predicted a tie). ``tiles`` and
    ``blocks`` are the host's estimates from shapes alone (tiles: ``ceil(total / TQ)``; blocks: the block
    table's width), so no device value is read.
    """
    return split_count(max(1, tiles * kv_heads), max(1, blocks), num_sms, ctas_per_sm, max_splits, cta_overhead_blocks)


class HieraSparseExtend:
    """Plan + run of the mixed dense/2:4-sparse extend kernel (see the module docstring).

    ``tile``: ``"auto"`` (n64 when the batch averages at most 64 query columns (tokens x GQA group) per
    request, n128 up to 128, else n256, or n128 when ``sync`` names a schedule other than the warp one:
    :meth:`pick_tile`), or a key of ``TILES``. ``stages``: pipeline depth (default per tile).
    ``num_splits``: force a split count (else chosen per call from the shapes). ``sync``: how a block
    step's phases meet (``SYNCS``, see the module docstring), or ``"auto"``: :func:`default_sync` of the
    call's tile and K pools. ``max_blocks`` is only advisory (block tables of any width are accepted).
    Kernels are compiled, or loaded from TileLang's disk cache, on first use of a configuration (tile,
    stages, sync, whether the call has 2:4 K rows).

    For the backend: ``qo_indptr``, ``block_table``, ``seq_lens`` and the index maps are int32 on the
    GPU; ``q`` may be a strided view (it is packed here); nothing else is needed (no tile table, no
    host copy of the lengths). One plan can serve every layer and every batch of a model: scratch and
    tickets are reused call after call on one stream (never two calls of one plan concurrently).
    """

    def __init__(self, q_heads: int, kv_heads: int, head_dim: int, block_size: int, max_blocks: int,
                 dtype: torch.dtype, device, tile: str = "auto", stages: int | None = None,
                 num_splits: int | None = None, sync: str = "auto"):
        check_plan_shape(q_heads, kv_heads, head_dim, block_size, dtype)
        group = q_heads // kv_heads
        if group not in (1, 2, 4, 8, 16):
            raise ValueError(f"GQA group {group} is not supported")
        if tile != "auto" and tile not in TILES:
            raise ValueError(f"tile must be 'auto' or one of {sorted(TILES)}")
        if sync != "auto" and sync not in SYNCS:
            raise ValueError(f"sync must be 'auto' or one of {SYNCS}, got {sync!r}")
        if tile == "n256" and sync not in ("auto", "warp"):
            raise ValueError(f"tile 'n256' runs only with sync='warp' (or 'auto'), got sync={sync!r}")
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.block_size, self.max_blocks, self.group = block_size, max_blocks, group
        self.dtype, self.device = dtype, torch.device(device)
        self.tile, self.stages, self.num_splits, self.sync = tile, stages, num_splits, sync
        self._dt = "float16" if dtype == torch.float16 else "bfloat16"
        self._sms = None
        f32 = dict(dtype=torch.float32, device=self.device)
        self._op = torch.empty(0, **f32)
        self._lp = torch.empty(0, **f32)
        self._lse = torch.empty(0, **f32)
        # Split tickets of the fused merge; the merging CTA resets its entry, so it stays zero between calls.
        self._cnt = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._op_dummy = torch.zeros(1, q_heads, 1, head_dim, **f32)
        self._lp_dummy = torch.zeros(1, q_heads, 1, **f32)
        self.pools = PoolArgs(kv_heads, head_dim, block_size, dtype, self.device)
        self.last_config = None  # tile, stages, k_sparse, num_splits, tile ids and sync of the last call

    # ------------------------------------------------------------------------------ configuration
    def pick_tile(self, total_tokens: int, batch: int) -> str:
        """The tile of a call, by the average request's query columns (tokens x GQA group), as measured
        fastest on the H100 (``--variant`` runs of the extend and prefill benchmarks): n64 up to 64
        columns (one tile a request), n128 above, with or without 2:4 K rows (overlapped, it beat n256
        per warp and n64 per warpgroup from 256 columns to a 32K prefill). A forced ``sync="warp"``
        takes n256 above 128 columns."""
        if self.tile != "auto":
            return self.tile
        cols = -(-total_tokens // max(batch, 1)) * self.group
        if cols <= 64:
            return "n64"
        return "n256" if self.sync == "warp" and cols > 128 else "n128"

    def pick_sync(self, tile: str) -> str:
        return default_sync(tile) if self.sync == "auto" else self.sync

    def kernel(self, tile: str, k_sparse: bool):
        """``(kernel, stages, sync)`` of a call's configuration."""
        sync = self.pick_sync(tile)
        stages = self.stages or default_stages(tile, sync)
        k = build_extend_kernel(self.q_heads, self.kv_heads, self.head_dim, self.block_size, self._dt, tile,
                                stages, k_sparse, sync)
        return k, stages, sync

    def splits(self, tile: str, stages: int, k_sparse: bool, tiles: int, blocks: int) -> int:
        if self.num_splits is not None:
            return max(1, int(self.num_splits))
        if self._sms is None:
            self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        per_cta = smem_bytes(tile, self.head_dim, self.block_size, stages, k_sparse) + 1024
        ctas_per_sm = max(1, min(SMEM_PER_SM // per_cta, 2048 // TILES[tile][1]))
        return choose_num_splits(tiles, self.kv_heads, blocks, self._sms, ctas_per_sm)

    @staticmethod
    def _grow(buf: torch.Tensor, n: int, zero: bool = False) -> torch.Tensor:
        if buf.numel() >= n:
            return buf
        n = max(n, 2 * buf.numel())
        return (torch.zeros if zero else torch.empty)(n, dtype=buf.dtype, device=buf.device)

    # ------------------------------------------------------------------------------ run
    def run(self, q, qo_indptr, k_cache, v_cache, k_dense, k_values, k_meta, v_dense, v_values, v_meta,
            k_index, v_index, block_table, seq_lens, sm_scale, out=None, return_lse=False):
        """Extend attention; returns ``out [total, Hq, D]`` (and the natural-log LSE ``[total, Hq]``, a
        plan-owned buffer overwritten by the next call, when ``return_lse``). No host synchronisation:
        only tensor shapes are read on the host."""
        total, bs = q.shape[0], seq_lens.shape[0]
        hq, d = self.q_heads, self.head_dim
        q = q.contiguous()
        target = out
        if out is None or not out.is_contiguous():
            out = torch.empty_like(q)
        self._lse = self._grow(self._lse, max(total, 1) * hq)
        lse = self._lse[:total * hq].view(total, hq)
        if total == 0 or bs == 0:
            return (out, lse) if return_lse else out
        k_sparse = k_values.numel() > 0
        tile = self.pick_tile(total, bs)
        kernel, stages, sync = self.kernel(tile, k_sparse)
        tq = TILES[tile][0] // self.group
        nt = tile_count(total, bs, tq)
        s = self.splits(tile, stages, k_sparse, -(-total // tq), block_table.shape[1])
        self._cnt = self._grow(self._cnt, nt * self.kv_heads, zero=True)
        cnt = self._cnt[:nt * self.kv_heads].view(nt, self.kv_heads)
        if s > 1:
            self._op = self._grow(self._op, total * hq * s * d)
            self._lp = self._grow(self._lp, total * hq * s)
            op = self._op[:total * hq * s * d].view(total, hq, s, d)
            lp = self._lp[:total * hq * s].view(total, hq, s)
        else:
            op, lp = self._op_dummy, self._lp_dummy
        kernel(
            q, k_cache, v_cache,
            *self.pools(k_dense, k_values, k_meta, v_dense, v_values, v_meta, k_index, v_index),
            qo_indptr, block_table, seq_lens, float(sm_scale),
            op, lp, out, lse, cnt,
        )
        self.last_config = dict(tile=tile, stages=stages, k_sparse=k_sparse, num_splits=s, tile_ids=nt, sync=sync)
        if target is not None and target is not out:
            target.copy_(out)
            out = target
        return (out, lse) if return_lse else out


# (tile, stages, sync) of the extend kernel that the benchmark's ``--variants`` time besides the default
# plan (whose choices are among them).
BENCH_VARIANTS = [("n64", 2, "cta"), ("n128", 3, "cta"), ("n128", 2, "cta"), ("n64", 2, "warpgroup"),
                  ("n128", 3, "warpgroup"), ("n128", 2, "warpgroup"), ("n64", 2, "warp"),
                  ("n128", 3, "warp"), ("n128", 2, "warp"), ("n256", 2, "warp"), ("n64", 2, "overlap"),
                  ("n128", 2, "overlap"), ("n128", 3, "overlap"), ("n128", 2, "producer")]

# The configurations the GPU tests and the benchmark compile: (q_heads, kv_heads, head_dim, dtype, tile,
# stages, k_sparse, sync): the benchmark's shape (Llama-3.1-8B heads, fp16) in every variant, with and
# without 2:4 K rows, then the tests' other shapes. ``python -m sglang_hs.kernels.extend [--jobs N]``
# compiles them into TileLang's cache (``TILELANG_CACHE_DIR``) on any machine, GPU or not, so that a
# device run only loads them.
PRECOMPILE = [
    (32, 8, 128, "float16", tile, stages, k_sparse, sync)
    for tile, stages, sync in BENCH_VARIANTS
    for k_sparse in (True, False)
] + [
    (16, 2, 128, "float16", "n64", 2, False, "cta"),
    (16, 2, 128, "bfloat16", "n128", 3, True, "cta"), (16, 2, 128, "bfloat16", "n128", 2, True, "warpgroup"),
    (16, 2, 128, "bfloat16", "n128", 2, True, "warp"),
    (8, 4, 128, "float16", "n128", 3, False, "cta"), (4, 4, 64, "float16", "n64", 2, True, "cta"),
    (4, 4, 64, "bfloat16", "n128", 3, False, "cta"), (8, 2, 64, "bfloat16", "n128", 3, True, "cta"),
    (8, 2, 64, "bfloat16", "n128", 2, True, "warp"),
    (16, 2, 128, "bfloat16", "n256", 2, True, "warp"), (8, 2, 64, "bfloat16", "n256", 2, True, "warp"),
    (8, 2, 64, "float16", "n64", 2, False, "warpgroup"), (8, 2, 64, "bfloat16", "n128", 2, True, "warpgroup"),
    (16, 2, 128, "bfloat16", "n128", 2, True, "overlap"), (8, 2, 64, "float16", "n128", 2, False, "overlap"),
    (8, 2, 64, "float16", "n128", 2, True, "overlap"), (8, 2, 64, "float16", "n64", 2, False, "overlap"),
    (32, 8, 128, "float16", "n128", 3, True, "producer"), (8, 2, 64, "float16", "n64", 2, False, "producer"),
    (16, 2, 128, "bfloat16", "n128", 2, True, "producer"), (8, 2, 64, "float16", "n128", 2, True, "producer"),
    (32, 8, 128, "float16", "n64", 2, False, "producer"),
]


def _precompile_one(cfg):
    hq, hkv, d, dt, tile, stages, k_sparse, sync = cfg
    build_extend_kernel(hq, hkv, d, 64, dt, tile, stages, k_sparse, sync)
    return cfg


if __name__ == "__main__":
    import argparse
    import concurrent.futures
    import time

    ap = argparse.ArgumentParser(description="compile the extend kernels of the tests and the benchmark")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    t0 = time.time()
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        for cfg in pool.map(_precompile_one, PRECOMPILE):
            print(f"{cfg} ready ({time.time() - t0:.0f} s)", flush=True)
