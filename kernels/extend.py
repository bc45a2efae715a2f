"""Extend (prefill over a cached prefix) attention over mixed dense / 2:4-sparse KV blocks
(TileLang 0.1.11, Hopper sm_90a): the plan/run API and the kernel configurations.

One extend step of one layer: request ``r`` brings ``n_r`` new query tokens (rows
``qo_indptr[r]:qo_indptr[r+1]`` of the packed ``q``), the last ``n_r`` positions of its ``seq_lens[r]``
tokens; a query at position ``p`` attends to KV positions ``<= p`` (causal). The KV of a request is a
row of ``block_table`` as in the decode kernel: cache pages (entry ``e >= 0``: slots ``e*B .. e*B + B-1``
of ``k_cache``/``v_cache``; the new tokens' K/V are already there) and compressed virtual blocks
(``e < 0``: block ``-e - 1``, resolved per KV head through ``k_index``/``v_index`` into one layer's
``BlockPools``). Compressed blocks only occur in the cached prefix; the last block may be partial.
``sglang_hs.reference.paged_attention`` is the oracle; :class:`HieraSparseExtend` is the plan/run API
the backend calls. Measurements and the schedules tried are in ``docs/kernels.md``.

Files: this module (plan, run, configurations), ``extend_common.py`` (the kernel frame and the TIR
pieces both schedules share), ``extend_overlap.py`` (tile n64) and ``extend_producer.py`` (tile n128).

Design (and why)
----------------
* **GEMM orientation, query rows x GQA heads as N.** Only the A operand of ``wgmma.sp`` may be sparse,
  so a block step computes ``O^T += V^T·P^T`` (``[D, N]``, A = V^T, sparse along tokens) and, over
  2:4 K rows, ``S^T = K·Q^T`` (``[B, N]``, A = K, sparse along head_dim). Over dense K rows (S_K = 0,
  the recommended setting) the n64 and n128 tiles compute ``S = Q·K^T`` (``[N, B]``) with Q in
  registers (an RS ``wgmma``, as FA3), which reads no ``Q^T`` from shared memory a block and takes
  the row max in registers; 4-7% faster (``docs/kernels.md``). The N columns of a CTA are
  ``TQ = N // G`` consecutive query tokens of one request times the ``G`` query heads of one KV head,
  ordered (token, head): column ``c`` is token ``t0 + c // G``, head ``h*G + c % G``; a group that does
  not divide N (3, 5, 6, 7) leaves ``N - TQ*G`` columns idle (at most 4 of 64). Every KV byte a
  CTA reads serves N columns. Each warpgroup owns 64 columns of ``S^T`` (rows of ``S``) and of
  ``O^T``, so the softmax statistics of a column never leave its warpgroup. N is a multiple of 16 (no
  N = 24/40: TileLang issue #2603).
* **Two tiles** (``TILES``), picked per call by the average request's query columns
  (:meth:`HieraSparseExtend.pick_tile`): ``n64`` (one warpgroup) up to 64 columns a request, so that a
  short chunk does not leave half a tile empty; ``n128`` above (a producer warpgroup and two ping-pong
  consumer warpgroups). Each tile has one schedule, described in its file. A third, ``n32``
  (``NARROW_TILES``: the n64 schedule at 32 columns), only shared-prefix decode's shared pass asks for.
* **Per-block dispatch without losing the pipeline.** TileLang's ``T.Pipelined`` does not pipeline
  copies whose shape depends on a runtime branch, so the block loop is pipelined by hand over a ring
  of shared-memory stages with their own mbarriers. A stage item holds K of block j and V of block
  j - 1 (V loads run one block behind K), so the step that computes ``S^T(j)`` and the pending
  ``O^T`` GEMM of block j - 1 reads one stage, which is free when the step ends. One elected thread
  issues an item's TMA loads, choosing per block and operand between a cache page (a strided 3-D
  box), a dense pool row and values + metadata of a 2:4 row; the consumers branch on the same mode to
  ``wgmma`` or ``wgmma.sp``.
* **Index ring.** The block-table and index-map entries are resolved by many threads in parallel,
  ``resolve_chunk`` blocks a pass, into a two-half ring in shared memory, each pass well before its
  entries are issued. The two dependent index loads are paid once per pass, and a CTA can walk any
  number of blocks (long prefixes force no split).
* **Asynchronous block step** (FA3's intra-warpgroup overlap): ``S^T(j)`` and block j - 1's
  ``O^T`` GEMM are issued as asynchronous ``wgmma`` groups and only the first is waited for, so the
  ``O^T`` GEMM runs under block j's softmax. The phases of a step meet on a named barrier per
  warpgroup, never the CTA.
* **Lazy softmax offset** (FA4's conditional rescale): a block's scores are taken against the
  columns' current offsets; only when a score passes its offset by more than 2^8 (one
  ``barrier.cta.red.or`` vote over the warpgroup), or on the CTA's first block, does the column max
  go through shared memory (over ``S``'s rows: a reduction in registers) and the offsets, ``O^T`` and
  the row sums move. Any offset is exact for softmax as long as P, the sums and ``O^T`` share it, and
  ``P <= 2^8`` stays far inside fp16. The common step has no max reduction and no ``O^T`` rescale; the
  row sums stay per thread until the end.
* **Causal masking** only in blocks that reach past the tile's first query position; the mask
  ``kv_pos <= q_pos`` also hides the rows of a partial last page. Columns past the request's last
  token (a partial tile) get a zero query and are never stored; blocks after the tile's last query
  position are not visited.
* **Tiles without host work.** Request ``r``'s tiles get the ids ``qo_indptr[r] // TQ + r + i`` for
  ``i < ceil(n_r / TQ)``: increasing, disjoint and below ``total // TQ + bs + 1``, so the grid is
  known on the host from shapes alone (no device sync, no tile table). A CTA finds its request by a
  parallel scan of ``qo_indptr``; ids in the gaps exit at once. CTAs take the ids in descending order,
  so in a long causal prefill the longest CTAs start first.
* **Split-KV** over the blocks a tile sees (grid ``(tile ids, Hkv, splits)``; consecutive CTAs are the
  tiles of one request for the same KV head and split, so the KV they share is read from L2). The
  split count is chosen per call from shapes and passed as a dynamic grid extent: one compiled kernel
  serves every batch. With one split a CTA writes ``out`` and the LSE directly; otherwise each split
  writes a normalised partial ``O`` (fp32) and base-2 LSE, and the last CTA of a (tile, KV head) to
  finish (an acq_rel atomic ticket, reset by that CTA) merges them, adding whole splits into ``O^T``'s
  registers with loads that do not wait on each other. Outputs are bitwise those of a fixed split
  order, whichever CTA merges.
* **Specialisation**: ``k_sparse=False`` drops the 2:4 K buffers (9 KB a stage at d 128) when the
  call's K values pool is empty (S_K = 0, the recommended setting), so that more CTAs fit an SM. The
  backend decides nothing: ``run`` picks the kernel from the pool shapes. ``forms`` (a plan's, fixed)
  goes further: stages, loads and GEMMs of those block forms only, for callers that give the kernel
  blocks of one form per operand (shared-prefix decode's shared pass, ``shared_pass_extend.py``).
* **The new tokens are cache pages like the window's**, so they are read in the same launch and the
  same block loop (no second kernel, no LSE merge); only the blocks on a tile's diagonal are masked.
* **Fast math** (``tl.enable_fast_math``): ``exp2f`` is one ``MUFU.EX2``.
* **TileLang 0.1.11 work-arounds**: ``T.fence_proxy_async()`` after ``P^T`` and ``Q`` are written to
  shared memory (TileLang issue #2634), and one after each index resolve (TileLang's proxy-fence pass
  would otherwise put a ``fence.proxy.async`` before every TMA issue); automatic thread-sync insertion
  is disabled (it deadlocks in the elected-thread TMA branches) and the kernel places its barriers.
* **One launch per call, no host synchronisation**: tile ids, splits, masks and empty splits are
  computed in the kernel from ``qo_indptr`` and ``seq_lens`` on the GPU; scratch grows on demand.
  Empty pools are replaced by one-row stand-ins (a TMA descriptor cannot describe a zero-length
  tensor). The grid and scratch views follow ``q.shape`` and ``bs``, so a CUDA graph holds for one
  batch shape only; one call at a time per plan.

The module imports neither TileLang nor a GPU at import time; ``build_extend_kernel`` does.
"""

import functools

import torch

from sglang_hs.format import BlockPools
from sglang_hs.kernels.common import (
    ANY_FORMS, PASS_CONFIGS, SMEM_PER_SM, PoolArgs, check_plan_shape, compile_cached, precompile_main, split_count,
    stage_form_bytes,
)
from sglang_hs.kernels.extend_common import TILE_SHAPES, TILES, p_buffer_count, resolve_chunk

# Stage counts each tile builds, its default first. The n64 schedule refills the stage that item
# j - 1 held with item j + 1; a third stage (two items of loads in flight) did not speed up
# shared-prefix decode's shared pass (``docs/kernels.md``). The n128 producer refills any stage its
# consumers released.
STAGES = {"n32": (2,), "n64": (2,), "n128": (2,)}
# Fast math: exp2f becomes one MUFU.EX2.
EXTEND_PASS_CONFIGS = {**PASS_CONFIGS, "tl.enable_fast_math": True}


def default_stages(tile: str) -> int:
    return STAGES[tile][0]


def smem_bytes(tile: str, head_dim: int, block_size: int = 64, stages: int = 2, k_sparse: bool = True,
               forms: tuple[str, str] = ANY_FORMS) -> int:
    """Shared memory of one CTA (bytes), an upper bound of the kernel's buffers (``forms``: the block
    forms its stages hold, as :class:`~sglang_hs.kernels.extend_common.ExtendParts` takes them)."""
    n, threads = TILE_SHAPES[tile]
    k_form = forms[0] if k_sparse else "dense"
    k_stage = stage_form_bytes(k_form, block_size, head_dim)
    v_stage = stage_form_bytes(forms[1], block_size, head_dim)
    maps = 3 * 2 * resolve_chunk(tile) * 4
    p_bytes = p_buffer_count(tile, k_form) * block_size * n * 2
    other = n * head_dim * 2 + p_bytes + maps + 3 * n * 4 + threads * 4 + 1024  # Q, P, maps, stats
    return stages * (k_stage + v_stage) + other


def build_extend_prim_func(q_heads: int, kv_heads: int, head_dim: int, block_size: int = 64,
                           dtype: str = "float16", tile: str = "n128", stages: int = 2, k_sparse: bool = True,
                           forms: tuple[str, str] = ANY_FORMS, dynamic_splits: bool = False):  # fmt: skip
    """The TileLang ``prim_func`` of one configuration (every batch dimension is dynamic).
    ``dynamic_splits``: request ``r`` uses ``qo_indptr[bs + 1 + r]`` (at most the grid's) splits and the
    CTAs of the others exit at once; tile ids go in ascending order (shared-prefix decode's shared pass:
    its live column sets come first, and how many there are is known only on the GPU)."""
    if stages not in STAGES[tile]:
        raise ValueError(f"tile {tile!r} builds with stages in {STAGES[tile]}, got {stages}")
    from sglang_hs.kernels.extend_common import ExtendParts

    producer = tile == "n128"  # n128: a producer warpgroup; n64 and n32: the overlap schedule
    if producer:
        from sglang_hs.kernels.extend_producer import ProducerSchedule as Schedule
    else:
        from sglang_hs.kernels.extend_overlap import OverlapSchedule as Schedule
    parts = ExtendParts(q_heads, kv_heads, head_dim, block_size, dtype, tile, stages, k_sparse, producer=producer,
                        forms=tuple(forms), dynamic_splits=dynamic_splits)
    return parts.prim_func(Schedule(parts))


def extend_kernel_args(q_heads, kv_heads, head_dim, block_size=64, dtype="float16", tile="n128", stages=2,
                       k_sparse=True, forms=ANY_FORMS, dynamic_splits=False) -> tuple:  # fmt: skip
    """The arguments that key an extend kernel in TileLang's cache (and a compile job): ``forms`` and
    ``dynamic_splits`` up to the last that is not its default (so the other kernels keep their keys)."""
    extra = (tuple(forms), dynamic_splits)
    defaults = (ANY_FORMS, False)
    kept = max((i + 1 for i in range(len(extra)) if extra[i] != defaults[i]), default=0)
    return (q_heads, kv_heads, head_dim, block_size, dtype, tile, stages, k_sparse) + extra[:kept]


@functools.lru_cache(maxsize=None)
def build_extend_kernel(q_heads, kv_heads, head_dim, block_size=64, dtype="float16", tile="n128", stages=2,
                        k_sparse=True, forms=ANY_FORMS, dynamic_splits=False, target=None):
    """Compile (or load from TileLang's cache) the kernel of one configuration. Needs TileLang, not a GPU."""
    args = extend_kernel_args(q_heads, kv_heads, head_dim, block_size, dtype, tile, stages, k_sparse, forms,
                              dynamic_splits)  # fmt: skip
    # Traces tell the shared-prefix decode's shared pass (the dynamic-splits variant) from prefill.
    return compile_cached("extend", args, lambda: build_extend_prim_func(*args), EXTEND_PASS_CONFIGS, target,
                          name="hs_extend_shared" if dynamic_splits else None)


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


@functools.lru_cache(maxsize=4096)  # every layer of a forward asks for the same shape's answer
def choose_num_splits(tiles: int, kv_heads: int, blocks: int, num_sms: int, ctas_per_sm: int,
                      max_splits: int = 64, cta_overhead_blocks: float = 8.0) -> int:
    """Splits per (tile, KV head): the fewest that keep every resident CTA slot busy
    (:func:`sglang_hs.kernels.common.split_count`, decode's cost model).

    A CTA costs ``ceil(blocks / S)`` block steps plus ``cta_overhead_blocks`` (its query tile, the
    pipeline fill, the partial output and the merge). ``tiles`` and ``blocks`` are the host's estimates
    from shapes alone (tiles: ``ceil(total / TQ)``; blocks: the block table's width), so no device value
    is read.
    """
    return split_count(max(1, tiles * kv_heads), max(1, blocks), num_sms, ctas_per_sm, max_splits, cta_overhead_blocks)


class HieraSparseExtend:
    """Plan + run of the mixed dense/2:4-sparse extend kernel (see the module docstring).

    ``tile``: ``"auto"`` (:meth:`pick_tile` per call) or a key of ``TILE_SHAPES``. ``stages``: pipeline depth
    (default per tile, ``STAGES``). ``num_splits``: force a split count (else chosen per call from the
    shapes). ``max_blocks`` is only advisory (block tables of any width are accepted). Kernels are
    compiled, or loaded from TileLang's disk cache, on first use of a configuration (tile, stages,
    whether the call has 2:4 K rows). ``forms``: the block forms its kernels hold
    (:class:`~sglang_hs.kernels.extend_common.ExtendParts`; every form by default); a plan for fewer
    must only be given blocks of those forms. ``dynamic_splits`` (with ``num_splits``, the grid's):
    every call passes ``split_limit``, each request's split count, read on the GPU
    (:func:`build_extend_prim_func`).

    One plan can serve every layer and every batch of a model: scratch and split tickets are reused
    call after call on one stream (never two calls of one plan concurrently).
    """

    def __init__(self, q_heads: int, kv_heads: int, head_dim: int, block_size: int, max_blocks: int,
                 dtype: torch.dtype, device, tile: str = "auto", stages: int | None = None,
                 num_splits: int | None = None, forms: tuple[str, str] = ANY_FORMS, dynamic_splits: bool = False):
        check_plan_shape(q_heads, kv_heads, head_dim, block_size, dtype)
        if dynamic_splits and num_splits is None:
            raise ValueError("dynamic splits need num_splits, the grid's split count")
        group = q_heads // kv_heads
        if tile != "auto" and tile not in TILE_SHAPES:
            raise ValueError(f"tile must be 'auto' or one of {sorted(TILE_SHAPES)}")
        columns = min(TILE_SHAPES[t][0] for t in (TILES if tile == "auto" else (tile,)))
        if group > columns:  # the shared pass's folded column sets reach 32 on its n32 tile
            raise ValueError(f"GQA group {group} exceeds the {columns} query columns of a tile")
        for t in TILES if tile == "auto" else (tile,):
            if stages is not None and stages not in STAGES[t]:
                raise ValueError(f"tile {t!r} builds with stages in {STAGES[t]}, got {stages}")
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.block_size, self.max_blocks, self.group = block_size, max_blocks, group
        self.dtype, self.device = dtype, torch.device(device)
        self.tile, self.stages, self.num_splits, self.forms = tile, stages, num_splits, tuple(forms)
        self.dynamic_splits = dynamic_splits
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
        self.last_config = None  # tile, stages, k_sparse, num_splits and tile ids of the last call

    # ------------------------------------------------------------------------------ configuration
    def pick_tile(self, total_tokens: int, batch: int) -> str:
        """The tile of a call by the average request's query columns (tokens x GQA group): n64 up to 64
        (one tile a request), n128 above, with or without 2:4 K rows."""
        if self.tile != "auto":
            return self.tile
        cols = -(-total_tokens // max(batch, 1)) * self.group
        return "n64" if cols <= 64 else "n128"

    def kernel(self, tile: str, k_sparse: bool):
        """``(kernel, stages)`` of a call's configuration."""
        stages = self.stages or default_stages(tile)
        k = build_extend_kernel(self.q_heads, self.kv_heads, self.head_dim, self.block_size, self._dt, tile, stages,
                                k_sparse, self.forms, self.dynamic_splits)
        return k, stages

    def splits(self, tile: str, stages: int, k_sparse: bool, tiles: int, blocks: int) -> int:
        if self.num_splits is not None:
            return max(1, int(self.num_splits))
        if self._sms is None:
            self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        per_cta = smem_bytes(tile, self.head_dim, self.block_size, stages, k_sparse, self.forms) + 1024
        ctas_per_sm = max(1, min(SMEM_PER_SM // per_cta, 2048 // TILE_SHAPES[tile][1]))
        return choose_num_splits(tiles, self.kv_heads, blocks, self._sms, ctas_per_sm)

    def reserve(self, total: int, batch: int, splits: int, tile: str) -> None:
        """Size the scratch now for calls of up to ``total`` tokens over ``batch`` requests at ``splits``
        splits on ``tile``, so that it never moves under a CUDA graph captured later."""
        hq, d = self.q_heads, self.head_dim
        self._lse = self._grow(self._lse, max(total, 1) * hq)
        self._cnt = self._grow(self._cnt, tile_count(total, batch, TILE_SHAPES[tile][0] // self.group) * self.kv_heads,
                               zero=True)  # fmt: skip
        if splits > 1:
            self._op = self._grow(self._op, total * hq * splits * d)
            self._lp = self._grow(self._lp, total * hq * splits)

    @staticmethod
    def _grow(buf: torch.Tensor, n: int, zero: bool = False) -> torch.Tensor:
        if buf.numel() >= n:
            return buf
        n = max(n, 2 * buf.numel())
        return (torch.zeros if zero else torch.empty)(n, dtype=buf.dtype, device=buf.device)

    # ------------------------------------------------------------------------------ run
    def run(self, q: torch.Tensor, qo_indptr: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            pools: BlockPools, k_index: torch.Tensor, v_index: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, sm_scale: float, out: torch.Tensor | None = None, return_lse: bool = False,
            split_limit: torch.Tensor | None = None):  # fmt: skip
        """Extend attention of one layer. No host synchronisation: only tensor shapes are read on the host.

        Shapes (``B`` = ``block_size``, ``D`` = ``head_dim``, ``Hq``/``Hkv`` query/KV heads, all on the
        plan's device; 16-bit tensors in the plan's dtype):

        * ``q``: ``[total, Hq, D]``, the new tokens of all requests, packed (may be a strided view).
        * ``qo_indptr``: ``[bs + 1]`` int32, request ``r``'s rows are ``qo_indptr[r]:qo_indptr[r + 1]``.
        * ``k_cache``, ``v_cache``: ``[slots, Hkv, D]``, SGLang's buffers of the layer (page ``e`` = slots
          ``e*B .. e*B + B - 1``).
        * ``pools``: the layer's :class:`~sglang_hs.format.BlockPools`: ``k_dense [Nd_k, B, D]``,
          ``k_values [Ns_k, B, D/2]``, ``k_meta [Ns_k, B, D/16]`` int16, ``v_dense [Nd_v, B, D]``,
          ``v_values [Ns_v, D, B/2]``, ``v_meta [Ns_v, D, B/16]`` int16 (any of them may be empty;
          an empty ``k_values`` selects the kernel without 2:4 K buffers).
        * ``k_index``, ``v_index``: ``[Hkv, n_virtual]`` int32, virtual block -> pool row (``>= 0``
          dense row, ``< 0`` 2:4 row ``-i - 1``).
        * ``block_table``: ``[bs, max_blocks]`` int32, a request's blocks in order (``>= 0`` cache page,
          ``< 0`` virtual block ``-e - 1``); columns past a request's blocks are never read.
        * ``seq_lens``: ``[bs]`` int32, tokens of each request including its new ones.
        * ``out``: ``[total, Hq, D]``, written if given (any strides).
        * ``split_limit``: ``[bs]`` int32, each request's splits (at most the plan's ``num_splits``; 0: the
          request is skipped and its rows of ``out`` are not written). Only with ``dynamic_splits``.

        Returns ``out [total, Hq, D]``, and with ``return_lse`` also the natural-log LSE ``[total, Hq]``
        fp32 (a plan-owned buffer, overwritten by the next call).
        """
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
        k_sparse = pools.k_values.numel() > 0
        tile = self.pick_tile(total, bs)
        kernel, stages = self.kernel(tile, k_sparse)
        tq = TILE_SHAPES[tile][0] // self.group
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
        if self.dynamic_splits:  # the kernel reads request r's limit at qo_indptr[bs + 1 + r]
            if split_limit is None or split_limit.shape[0] != bs:
                raise ValueError("a plan with dynamic splits needs split_limit [bs]")
            qo_indptr = torch.cat([qo_indptr[: bs + 1], split_limit.to(torch.int32)])
        kernel(
            q, k_cache, v_cache, *self.pools(pools, k_index, v_index),
            qo_indptr, block_table, seq_lens, float(sm_scale),
            op, lp, out, lse, cnt,
        )
        self.last_config = dict(tile=tile, stages=stages, k_sparse=k_sparse, num_splits=s, tile_ids=nt)
        if target is not None and target is not out:
            target.copy_(out)
            out = target
        return (out, lse) if return_lse else out


# (tile, stages) that the benchmark's ``--variants`` time besides the default plan.
BENCH_VARIANTS = [("n64", 2), ("n128", 2)]

# The configurations the GPU tests and the benchmark compile: (q_heads, kv_heads, head_dim, dtype, tile,
# stages, k_sparse). ``python -m sglang_hs.kernels.extend [--jobs N]`` compiles them into TileLang's cache
# (``TILELANG_CACHE_DIR``) on any machine, GPU or not, so that a device run only loads them.
PRECOMPILE = [
    # The benchmark's shape (Llama-3.1-8B heads, fp16), every tile and stage count, with and without 2:4 K rows.
    (32, 8, 128, "float16", "n64", 2, True), (32, 8, 128, "float16", "n64", 2, False),
    (32, 8, 128, "float16", "n128", 2, True), (32, 8, 128, "float16", "n128", 2, False),
    # The tests' other shapes: GQA groups 1, 2, 4, 8; head_dim 64 and 128; fp16 and bf16.
    (16, 2, 128, "bfloat16", "n128", 2, True), (8, 2, 64, "float16", "n128", 2, True),
    (8, 4, 128, "float16", "n128", 2, False), (4, 4, 64, "bfloat16", "n128", 2, False),
    (8, 2, 64, "bfloat16", "n128", 2, True),
    (8, 2, 64, "float16", "n64", 2, False), (16, 2, 128, "float16", "n64", 2, False),
    (4, 4, 64, "float16", "n64", 2, True), (16, 2, 128, "bfloat16", "n64", 2, True),
    (8, 4, 128, "float16", "n64", 2, True),
    # GQA groups 3, 5, 6 and 7 (columns of a tile idle), both tiles.
    (9, 3, 64, "float16", "n64", 2, True), (6, 2, 64, "bfloat16", "n128", 2, True),
    (10, 2, 128, "bfloat16", "n128", 2, False), (10, 2, 128, "float16", "n64", 2, True),
    (12, 2, 64, "float16", "n128", 2, True), (12, 2, 128, "bfloat16", "n64", 2, True),
    (14, 2, 128, "float16", "n128", 2, True), (28, 4, 64, "bfloat16", "n64", 2, False),
    (9, 3, 128, "bfloat16", "n128", 2, True), (10, 2, 64, "float16", "n64", 2, True),
    # FP8 KV through 16-bit copies (no 2:4 K buffers).
    (9, 3, 64, "bfloat16", "n64", 2, False), (8, 2, 64, "float16", "n128", 2, False),
]


def _precompile_one(cfg):
    hq, hkv, d, dt, tile, stages, k_sparse = cfg
    build_extend_kernel(hq, hkv, d, 64, dt, tile, stages, k_sparse)
    return cfg


if __name__ == "__main__":
    precompile_main("compile the extend kernels of the tests and the benchmark", _precompile_one, PRECOMPILE)
