"""Split-KV decode attention over mixed dense / 2:4-sparse KV blocks (TileLang 0.1.11, Hopper sm_90a).

One decode step of one layer: every request has one query token (``q [bs, Hq, D]``) that attends to
all ``seq_len`` tokens of its KV. The KV of a request is a row of ``block_table`` whose entries are
either SGLang cache pages (dense, read from ``k_cache``/``v_cache``) or compressed virtual blocks,
resolved per KV head through the signed index maps into the HieraSparse pools of
``sglang_hs.format`` (dense pool rows or 2:4 values + int16 metadata). ``sglang_hs.reference.
paged_attention`` is the oracle.

Design (and why)
----------------
* **Trans-Both GEMMs.** Only the A operand of ``wgmma.sp`` may be sparse, so the block loop computes
  ``S^T = K·Q^T`` (``[B, N]``, A = K, sparse along head_dim) and ``O^T += V^T·P^T`` (``[D, N]``,
  A = V^T, sparse along tokens, stored K-major as ``v_values [D, B/2]``). Dense blocks use the same
  shapes with ``T.gemm`` (``wgmma``), sparse blocks ``T.gemm_sp`` (``wgmma.sp``); the accumulators are
  shared, so both paths fold into one online softmax.
* **GQA as the GEMM N dim.** One CTA serves the ``G = Hq/Hkv`` query heads of one KV head, so every KV
  byte is read once per CTA. N is padded to 8 (G in {1, 2, 4, 8}): ``m64n8`` is a legal wgmma shape and
  avoids the N = 24/40 bug (#2603) and wasted accumulator registers.
* **Split-KV.** Grid ``(num_splits, Hkv, bs)``: each CTA walks a contiguous range of its request's
  blocks, writes a partial ``O`` (fp32) and a base-2 LSE to plan-owned scratch, and a second kernel in
  the same ``prim_func`` merges the splits (LSE-weighted) into ``out`` and the natural-log LSE. Decode
  with bs = 8 has only 64 (request, KV head) pairs for 132 SMs, so splitting is what fills the GPU;
  ``num_splits`` is chosen at plan time from the SM count and the resident CTAs per SM.
* **Data-dependent dispatch without losing the pipeline.** Decode is memory bound; the win is reading
  0.5625x the bytes of a sparse block, so what matters is bytes in flight. TileLang's ``T.Pipelined``
  does not pipeline copies whose shape depends on a runtime branch, so the loop is software-pipelined
  by hand: ``stages`` shared-memory stages, each with its own mbarrier; the producer (one elected
  thread, ``T.tma_copy``) issues the TMA loads of block ``j + stages - 1`` *before* waiting on block
  ``j``, choosing per block between a cache page (strided 3-D TMA box), a dense pool row, or values +
  metadata of a sparse row, with an ``expect_tx`` that matches the branch. The consumers then branch
  on the same per-block mode to ``gemm`` or ``gemm_sp``. A prologue resolves the CTA's block-table
  entries and index-map entries for all its blocks at once (128 threads in parallel) into shared
  memory, so the two dependent index loads are paid once per CTA, not once per block.
* **Stage buffers.** A stage holds the dense tiles and the sparse values + metadata of K and V
  (50 KB at D = 128); only one form per operand is filled. Aliasing them (the paper's trick) does
  not survive TileLang 0.1.11's layout inference, which links buffers that share storage and
  requires equal sizes, so the default is 2 stages (~105 KB) with 2 CTAs per SM: up to 4 blocks
  (72-100 KB) in flight per SM, above the ~25 KB per SM that 3 TB/s needs at ~1 us latency.
* **Metadata by TMA.** The int16 metadata tile of a block is contiguous (1 KB); it is moved as a
  ``[E/16, 16]`` box (a 32-byte inner box, as TMA requires >= 16 B) and re-viewed as the
  ``[M, K/16]`` tile that ``T.gemm_sp`` reads (metadata in shared memory has no swizzle).
* **Bug work-arounds (0.1.11).** ``T.fence_proxy_async()`` after ``P^T`` is written to shared memory
  (stmatrix) and after ``Q`` is staged, before any (sparse) wgmma reads them (#2634). TileLang's
  automatic thread-sync pass puts ``__syncthreads`` inside the elected-thread TMA branches of this
  kernel (a deadlock), so it is disabled (``tl.disable_thread_storage_sync``) and the kernel places
  its own barriers: one at the top of each block step (WAR on the stage being refilled and on
  ``P_s``) and one between writing ``P^T`` and the second GEMM; reductions synchronise internally.
* **CUDA graphs.** ``run`` launches one compiled TileLang kernel (split + combine) with fixed shapes for
  a given plan; scratch is allocated in ``__init__``; no host synchronisation (seq_lens stay on the
  GPU: block ranges, masks and empty splits are computed in the kernel). Empty pools are replaced by
  one-row dummies (never read) because a TMA descriptor cannot describe a zero-length tensor.

The module imports neither TileLang nor a GPU at import time; ``build_decode_kernel`` does.
"""


import functools
import math

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
SMEM_PER_SM = 228 * 1024  # H100/H200: 228 KB per SM, 227 KB usable per CTA, 1 KB reserved per CTA

PASS_CONFIGS = {
    "tl.disable_warp_specialized": True,
    "tl.disable_thread_storage_sync": True,
}


def _n_pad(group: int) -> int:
    if group > 16:
        raise ValueError(f"GQA group {group} > 16 is not supported")
    return 8 if group <= 8 else 16


def smem_bytes(head_dim: int, block_size: int, stages: int, group: int, blocks_per_split: int) -> int:
    """Shared memory of one CTA (bytes), matching the buffers of :func:`build_decode_prim_func`."""
    n = _n_pad(group)
    elems = block_size * head_dim
    stage = 2 * (elems * 2 + elems + elems // 8)  # K and V: dense tile, 2:4 values, int16 metadata
    other = n * head_dim * 2 + block_size * n * 2 + 3 * blocks_per_split * 4 + 4 * 512
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
):
    """The TileLang ``prim_func`` (split kernel + combine kernel) for one plan."""
    import tilelang.language as T

    B, D, S = block_size, head_dim, num_splits
    G = q_heads // kv_heads
    NH = _n_pad(G)
    accum = "float32"
    bps = -(-max_blocks // S)  # static upper bound of blocks per split
    e_rows = B * D // 16 // 16  # metadata tile as [e_rows, 16] int16 (contiguous 2*B*D/16 bytes)
    assert q_heads % kv_heads == 0 and D % 32 == 0 and B % 32 == 0 and stages >= 2
    assert threads == 128, "one warpgroup: wgmma M = 64 per instruction"
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
            bar = T.alloc_barrier(threads)
            out.append((kd, ks, ke, vd, vs, ve, bar))
        return out

    @T.macro
    def issue(i, h, mode_s, krow_s, vrow_s, kd, ks, ke, vd, vs, ve, bar, KC, VC, KD, KV, KM, VD, VV, VM):
        md = mode_s[i]
        kr = krow_s[i]
        vr = vrow_s[i]
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
    def compute(j, tok0, seq, scale2, mode_s, Q_s, P_s, kd, ks, ke, vd, vs, ve, sT, oT, m, m_prev, l, rs, ssum):
        md = mode_s[j]
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
        if (md >> 2) == 2:
            T.gemm_sp(vs, T.view(ve, [D, B // 16]), P_s, oT)
        else:
            T.gemm(vd, P_s, oT, transpose_A=True)

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
            T.barrier_wait(bar, parity)
            compute(j, (start + j) * B, seq, scale2, mode_s, Q_s, P_s, kd, ks, ke, vd, vs, ve,
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
    ):
        with T.Kernel(S, kv_heads, batch, threads=threads) as (sid, h, r):
            Q_s = T.alloc_shared([NH, D], dtype)
            P_s = T.alloc_shared([B, NH], dtype)
            mode_s = T.alloc_shared([bps], "int32")
            krow_s = T.alloc_shared([bps], "int32")
            vrow_s = T.alloc_shared([bps], "int32")
            st = alloc_stage_buffers()
            sT = T.alloc_fragment([B, NH], accum)
            oT = T.alloc_fragment([D, NH], accum)
            m = T.alloc_fragment([NH], accum)
            m_prev = T.alloc_fragment([NH], accum)
            l = T.alloc_fragment([NH], accum)
            rs = T.alloc_fragment([NH], accum)
            ssum = T.alloc_fragment([NH], accum)

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
            T.fill(l, 0)
            T.fill(m, -T.infinity(accum))
            T.fence_proxy_async()
            T.sync_threads()

            gl = (KC, VC, KD, KV, KM, VD, VV, VM)
            frags = (sT, oT, m, m_prev, l, rs, ssum)
            emit_prologue(n, h, mode_s, krow_s, vrow_s, st, gl)
            for it in T.serial(T.ceildiv(n, stages)):
                emit_ring(it, n, start, seq, scale2, h, mode_s, krow_s, vrow_s, Q_s, P_s, st, gl, frags)

            for hh in T.Parallel(NH):
                if hh < G:
                    LP[r, h * G + hh, sid] = T.if_then_else(
                        l[hh] > 0, T.log2(l[hh]) + m[hh] * scale2, -T.infinity(accum))
            for d, hh in T.Parallel(D, NH):
                if hh < G:
                    OP[r, h * G + hh, sid, d] = T.if_then_else(l[hh] > 0, oT[d, hh] / l[hh], 0.0)

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
                        dtype="float16", stages=2, target=None):
    """Compile (or load from TileLang's cache) the kernel of one plan. Needs TileLang, not a GPU."""
    import tilelang

    func = build_decode_prim_func(batch, q_heads, kv_heads, head_dim, block_size, max_blocks, num_splits,
                                  dtype=dtype, stages=stages)
    return tilelang.compile(func, target=target or SM90_TARGET, pass_configs=PASS_CONFIGS)


def choose_num_splits(batch: int, kv_heads: int, max_blocks: int, num_sms: int, ctas_per_sm: int,
                      max_splits: int = 128) -> int:
    """Splits per (request, KV head): the fewest that keep every resident CTA slot busy.

    Cost model: a CTA walks ``ceil(max_blocks / S)`` blocks; CTAs run in waves of
    ``num_sms * ctas_per_sm``; the combine pass adds a little per split. The smallest ``S`` within 2% of
    the best modelled time wins (fewer splits: less scratch, cheaper combine).
    """
    slots = max(1, num_sms * ctas_per_sm)
    pairs = batch * kv_heads
    best = []
    for s in range(1, min(max_splits, max_blocks) + 1):
        waves = -(-pairs * s // slots)
        cost = waves * -(-max_blocks // s) + 0.05 * s
        best.append((cost, s))
    lo = min(c for c, _ in best)
    return min(s for c, s in best if c <= lo * 1.02)


class HieraSparseDecode:
    """Plan + run of the mixed dense/2:4-sparse split-KV decode kernel (see the module docstring).

    ``__init__`` compiles or loads the kernel for the given batch size and ``max_blocks`` (the width of
    ``block_table``) and allocates the split-KV scratch. ``run`` is CUDA-graph capturable.
    """

    def __init__(self, batch_size: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
                 max_blocks: int, dtype: torch.dtype, device, num_splits: int | None = None,
                 stages: int = 2):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}")
        if q_heads % kv_heads:
            raise ValueError("q_heads must be a multiple of kv_heads")
        if head_dim not in (64, 128) or block_size != 64:
            raise ValueError("head_dim must be 64 or 128 and block_size 64")
        self.batch_size, self.q_heads, self.kv_heads = batch_size, q_heads, kv_heads
        self.head_dim, self.block_size, self.max_blocks = head_dim, block_size, max_blocks
        self.dtype, self.device, self.stages = dtype, torch.device(device), stages
        group = q_heads // kv_heads
        if num_splits is None:
            props = torch.cuda.get_device_properties(self.device)
            per_cta = smem_bytes(head_dim, block_size, stages, group, max_blocks) + 1024  # bound: bps <= max_blocks
            ctas_per_sm = max(1, min(SMEM_PER_SM // per_cta, 8))
            num_splits = choose_num_splits(batch_size, kv_heads, max_blocks, props.multi_processor_count,
                                           ctas_per_sm)
        self.num_splits = int(num_splits)
        dt = "float16" if dtype == torch.float16 else "bfloat16"
        self.kernel = build_decode_kernel(batch_size, q_heads, kv_heads, head_dim, block_size, max_blocks,
                                          self.num_splits, dt, stages)
        f32 = dict(dtype=torch.float32, device=self.device)
        self.o_part = torch.empty(batch_size, q_heads, self.num_splits, head_dim, **f32)
        self.lse_part = torch.empty(batch_size, q_heads, self.num_splits, **f32)
        self.lse = torch.empty(batch_size, q_heads, **f32)
        e_rows = block_size * head_dim // 256
        kw = dict(device=self.device)
        # One-row stand-ins for empty pools / index maps (never read: no entry points at them).
        self._dummy = {
            "dense": torch.zeros(1, block_size, head_dim, dtype=dtype, **kw),
            "k_values": torch.zeros(1, block_size, head_dim // 2, dtype=dtype, **kw),
            "v_values": torch.zeros(1, head_dim, block_size // 2, dtype=dtype, **kw),
            "meta": torch.zeros(1, e_rows, 16, dtype=torch.int16, **kw),
            "index": torch.zeros(kv_heads, 1, dtype=torch.int32, **kw),
        }

    def _or_dummy(self, t: torch.Tensor, key: str) -> torch.Tensor:
        return t if t.numel() else self._dummy[key]

    def run(self, q, k_cache, v_cache, k_dense, k_values, k_meta, v_dense, v_values, v_meta,
            k_index, v_index, block_table, seq_lens, sm_scale, out=None, return_lse=False):
        """Decode attention; returns ``out [bs, Hq, D]`` (and the natural-log LSE ``[bs, Hq]``, a
        plan-owned buffer overwritten by the next call, when ``return_lse``)."""
        bs, e_rows = self.batch_size, self.block_size * self.head_dim // 256
        if out is None:
            out = torch.empty_like(q)
        k_meta = self._or_dummy(k_meta, "meta").reshape(-1, e_rows, 16)
        v_meta = self._or_dummy(v_meta, "meta").reshape(-1, e_rows, 16)
        k_index = self._or_dummy(k_index, "index")
        v_index = self._or_dummy(v_index, "index")
        if k_index.shape[1] != v_index.shape[1]:  # one of them empty: both must be dummies then
            k_index = v_index = self._dummy["index"]
        self.kernel(
            q, k_cache, v_cache,
            self._or_dummy(k_dense, "dense"), self._or_dummy(k_values, "k_values"), k_meta,
            self._or_dummy(v_dense, "dense"), self._or_dummy(v_values, "v_values"), v_meta,
            k_index, v_index, block_table, seq_lens, float(sm_scale),
            self.o_part, self.lse_part, out, self.lse,
        )
        return (out, self.lse) if return_lse else out
