"""Benchmark of the HieraSparse kernels against FlashInfer, plus the input builders the GPU tests share.

    python -m sglang_hs.kernels.bench --kernel decode --out DIR [--quick] [--variants] [--layouts ...]
        [--batch N] [--groups G] [--dtype bfloat16] [--max-blocks W] [--num-splits S]

writes ``DIR/kernels_h100.json`` (one record per layout and (S_K, S_V): the default plan vs FlashInfer,
same process, same timing method; ``--variants`` adds the other kernel options under ``variants``)
and ``DIR/kernels_h100.png`` (first layout). ``--plot JSON`` only redraws the PNG from a JSON.
``--groups G``: only G requests have their own KV and request r reads request r % G's, as requests
sharing prefixes do in a serving batch (``share_prefixes``); ``--max-blocks``: a server's block-table
width (``ceil((context length + 4) / 64)``); ``--num-splits``: force the plan's split count.

Decode workload (the paper's and anchors.md's): batch 8, 32K tokens per request, Llama-3.1-8B
attention (32 query heads, 8 KV heads, head_dim 128, fp16), block size 64. A request's block table
is 1 sink cache page, then compressed virtual blocks, then 4 dense window cache pages (the last one
partial when the length is not a multiple of 64); a fraction S_K (S_V) of the compressed blocks is
2:4 sparse per KV head. Layout ``natural``: cache pages, virtual blocks and pool rows in allocation
order (pool rows in (KV head, block) order, as ``sglang_hs.reference.compress_blocks`` writes them);
``shuffled``: all in random order (a fragmented store). FlashInfer
(``BatchDecodeWithPagedKVCacheWrapper``, tensor cores, NHD, page 64) runs over the decompressed
(pruned) KV of the same requests, so it is also the full-size correctness reference of the sparse kernel (checked on the first and the last timed call). Both are
timed as replays of a CUDA graph of ``--iters`` back-to-back calls (CUDA events, median of 5
replays), and also as single plain launches (``*_plain_us``, which include host launch overhead).

    python -m sglang_hs.kernels.bench --kernel extend --out DIR [--quick] [--variants | --variant T:S:SYNC ...] [--new-tokens 16,64,...]

Extend workload (issue 3's second regime): batch 8, each request a 32K-token cached prefix (the decode
layout: 1 sink page, compressed blocks, 4 window pages; natural order) plus n new tokens in cache pages
for n in ``--new-tokens``; S in {(0,0), (0,1), (1,1)}; ``HieraSparseExtend`` against FlashInfer's
``BatchPrefillWithPagedKVCacheWrapper`` (causal, NHD, page 64, ``--fi-backend``, default fa2 as in
SGLang) over the same pruned KV, timed in alternation: 7 rounds, each ``--iters`` back-to-back eager
calls of FlashInfer, then of the default plan (CUDA events, medians; a quarter of the calls above 256
new tokens; the other variants afterwards, median of 5). Writes ``DIR/kernels_h100.json`` (the
committed results' other records plus one extend record per (n, S)), ``DIR/kernels_h100_extend.png``
and ``DIR/bench_extend.log``. ``--variants`` also times the other tiles, stages and synchronisations;
``--variant TILE:STAGES:SYNC`` (repeatable, e.g. ``n256:2:warp``) times just the ones named.

    python -m sglang_hs.kernels.bench --kernel prefill --out DIR [--quick] [--variants] [--context L] [--batch N]

Full-prefill workload (issue 3's third regime): N (default 1) sequences of L tokens whose KV has the
compressed layout over the whole sequence (1 sink page, compressed blocks, 4 window pages), every
position a query (causal), as a chunked prefill that prunes its chunks would see; the same kernel
(``HieraSparseExtend``) and the same FlashInfer baseline as extend. Records ``kernel: "prefill"``;
``kernels_h100_prefill.png`` and ``bench_prefill.log``.
"""

import argparse
import itertools
import json
import math
import os
import time

import torch

from sglang_hs.format import BlockPools, pack_2to4, sparse_count, unpack_2to4
from sglang_hs.plotting import pyplot

CHUNK = 2048  # blocks per chunk when packing / unpacking large pools


# ------------------------------------------------------------------------------------------- inputs
def random_keep(shape, device, gen, x=None):
    """A 2:4 keep mask along the last axis: top-2 |x| of every group of 4 (or random if x is None)."""
    n = shape[-1]
    groups = (*shape[:-1], n // 4, 4)
    score = x.reshape(groups).abs().float() if x is not None else torch.rand(groups, device=device, generator=gen)
    idx = score.topk(2, dim=-1).indices
    keep = torch.zeros(groups, dtype=torch.bool, device=device).scatter_(-1, idx, True)
    return keep.reshape(shape)


def _pack_chunked(x, magnitude, gen):
    vals, metas = [], []
    for i in range(0, x.shape[0], CHUNK):
        xi = x[i:i + CHUNK]
        keep = random_keep(xi.shape, x.device, gen, xi if magnitude else None)
        v, m = pack_2to4(xi, keep)
        vals.append(v)
        metas.append(m)
    return torch.cat(vals), torch.cat(metas)


def _unpack_chunked(values, meta):
    return torch.cat([unpack_2to4(values[i:i + CHUNK], meta[i:i + CHUNK]) for i in range(0, values.shape[0], CHUNK)])


def make_case(seq_lens, q_heads=32, kv_heads=8, head_dim=128, sk=0.0, sv=0.0, dtype=torch.float16,
              device="cuda", block_size=64, sink_blocks=1, window_blocks=4, max_blocks=None, seed=0,
              magnitude=True, extra_pages=3, shuffle=True, prefix_lens=None):
    """Inputs of ``HieraSparseDecode.run`` for requests of ``seq_lens`` tokens (see the module doc).

    ``shuffle``: cache pages, virtual blocks and pool rows are assigned in random order, so that every
    indirection is exercised (tests); otherwise in allocation order, pool rows in (KV head, block)
    order as ``sglang_hs.reference.compress_blocks`` writes them (the benchmark's default layout).
    ``magnitude``: sparse blocks keep the top-2 of each group of a random dense block (else a random
    2 of 4). ``prefix_lens`` (extend): the sink/window/compressed layout covers only each request's
    first ``prefix_lens[r]`` tokens; the blocks after them (the new tokens) are cache pages. Returns a dict.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    B, D, H = block_size, head_dim, kv_heads
    bs = len(seq_lens)
    nblk = [-(-L // B) for L in seq_lens]
    max_blocks = max_blocks or max(max(nblk), 1)
    kinds = []  # per request: list of "c" (cache page) / "v" (virtual)
    for r, (L, n) in enumerate(zip(seq_lens, nblk)):
        P = L if prefix_lens is None else prefix_lens[r]  # tokens the sink/compressed/window layout covers
        nP = -(-P // B)
        k = ["v"] * n
        for j in range(n):
            if j < sink_blocks or j >= nP - window_blocks or (j == nP - 1 and P % B):
                k[j] = "c"
        kinds.append(k)
    n_cache = sum(k.count("c") for k in kinds)
    n_virtual = sum(k.count("v") for k in kinds)
    n_pages = n_cache + extra_pages
    perm = (lambda n: torch.randperm(n, generator=cpu_gen)) if shuffle else torch.arange
    page_perm = perm(n_pages).tolist()
    vb_perm = perm(max(n_virtual, 1)).tolist()
    table = torch.full((bs, max_blocks), -(1 << 30), dtype=torch.int32)  # poison beyond each row's blocks
    pi = vi = 0
    for r, k in enumerate(kinds):
        for j, kind in enumerate(k):
            if kind == "c":
                table[r, j] = page_perm[pi]
                pi += 1
            else:
                table[r, j] = ~vb_perm[vi]
                vi += 1

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen, dtype=torch.float32).to(dtype)

    k_cache = randn(n_pages * B, H, D)
    v_cache = randn(n_pages * B, H, D)
    q = randn(bs, q_heads, D)

    def operand(s, transpose):
        n_sp = sparse_count(n_virtual, s) if n_virtual else 0
        sparse = torch.zeros(H, n_virtual, dtype=torch.bool)
        for h in range(H):
            sparse[h, torch.randperm(n_virtual, generator=cpu_gen)[:n_sp]] = True
        nd, ns = int((~sparse).sum()), int(sparse.sum())
        dense_rows = perm(nd)
        sparse_rows = perm(ns)
        index = torch.empty(H, n_virtual, dtype=torch.int32)
        index[~sparse] = dense_rows.to(torch.int32)
        index[sparse] = (-sparse_rows - 1).to(torch.int32)
        dense_pool = randn(nd, B, D)
        blocks = randn(ns, B, D)
        if transpose:
            blocks = blocks.transpose(-1, -2).contiguous()  # V^T: tokens become the sparse axis
        if ns:
            values, meta = _pack_chunked(blocks, magnitude, gen)
        else:
            values = torch.empty(0, *blocks.shape[1:-1], blocks.shape[-1] // 2, dtype=dtype, device=device)
            meta = torch.empty(0, *blocks.shape[1:-1], blocks.shape[-1] // 16, dtype=torch.int16, device=device)
        return dense_pool, values, meta, index.to(device)

    k_dense, k_values, k_meta, k_index = operand(sk, False)
    v_dense, v_values, v_meta, v_index = operand(sv, True)
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, k_dense=k_dense, k_values=k_values, k_meta=k_meta,
        v_dense=v_dense, v_values=v_values, v_meta=v_meta, k_index=k_index, v_index=v_index,
        block_table=table.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        sm_scale=1.0 / math.sqrt(D), seq_lens_list=list(seq_lens), kinds=kinds, block_size=B,
        max_blocks=max_blocks, sk=sk, sv=sv,
    )


RUN_KEYS = ("q", "k_cache", "v_cache", "k_dense", "k_values", "k_meta", "v_dense", "v_values", "v_meta",
            "k_index", "v_index", "block_table", "seq_lens", "sm_scale")


def run_args(case):
    return [case[k] for k in RUN_KEYS]


def virtual_blocks(dense, values, meta, index, transpose):
    """All virtual blocks of one operand, decompressed: ``[H, n_virtual, B, D]`` (pruned entries 0)."""
    H, nv = index.shape
    if dense.numel():
        shape = tuple(dense.shape[1:])
    else:
        shape = (values.shape[2] * 2, values.shape[1]) if transpose else (values.shape[1], values.shape[2] * 2)
    src = dense if dense.numel() else values
    out = src.new_zeros(H, nv, *shape)
    is_dense = index >= 0
    if bool(is_dense.any()):
        out[is_dense] = dense[index[is_dense].long()]
    if bool((~is_dense).any()):
        rows = (-index[~is_dense] - 1).long()
        blk = _unpack_chunked(values[rows], meta[rows])
        out[~is_dense] = blk.transpose(-1, -2) if transpose else blk
    return out


def paged_dense(case):
    """The case's KV as a dense FlashInfer paged cache (NHD, page = block; request r's block j is page
    ``r * max_blocks + j``) plus ``indptr, indices, last_page_len``."""
    B, mb = case["block_size"], case["max_blocks"]
    k_cache, v_cache, table = case["k_cache"], case["v_cache"], case["block_table"]
    H, D = k_cache.shape[1], k_cache.shape[2]
    bs = table.shape[0]
    kv = virtual_blocks(case["k_dense"], case["k_values"], case["k_meta"], case["k_index"], False)
    vv = virtual_blocks(case["v_dense"], case["v_values"], case["v_meta"], case["v_index"], True)
    fk = k_cache.new_zeros(bs * mb, B, H, D)
    fv = k_cache.new_zeros(bs * mb, B, H, D)
    ck, cv = k_cache.view(-1, B, H, D), v_cache.view(-1, B, H, D)
    indices, indptr, last = [], [0], []
    tab = table.cpu()
    for r, L in enumerate(case["seq_lens_list"]):
        n = -(-L // B)
        ents = tab[r, :n]
        pages = r * mb + torch.arange(n)
        c = ents >= 0
        dev_pages = pages.to(k_cache.device)
        if c.any():
            fk[dev_pages[c.to(k_cache.device)]] = ck[ents[c].long().to(k_cache.device)]
            fv[dev_pages[c.to(k_cache.device)]] = cv[ents[c].long().to(k_cache.device)]
        if (~c).any():
            vb = (-ents[~c] - 1).long().to(k_cache.device)
            fk[dev_pages[(~c).to(k_cache.device)]] = kv[:, vb].permute(1, 2, 0, 3)
            fv[dev_pages[(~c).to(k_cache.device)]] = vv[:, vb].permute(1, 2, 0, 3)
        indices.append(pages)
        indptr.append(indptr[-1] + n)
        last.append(L - (n - 1) * B if n else 0)
    i32 = dict(dtype=torch.int32, device=k_cache.device)
    return dict(k=fk, v=fv, indptr=torch.tensor(indptr, **i32), indices=torch.cat(indices).to(**i32),
                last_page_len=torch.tensor(last, **i32))


def dense_kv(case, paged, r):
    """Request ``r``'s dense ``[L, H, D]`` K and V from :func:`paged_dense`."""
    B, mb, L = case["block_size"], case["max_blocks"], case["seq_lens_list"][r]
    H, D = paged["k"].shape[2], paged["k"].shape[3]
    k = paged["k"][r * mb:(r + 1) * mb].reshape(-1, H, D)[:L]
    v = paged["v"][r * mb:(r + 1) * mb].reshape(-1, H, D)[:L]
    return k, v


def flashinfer_decode(case, paged, workspace=None):
    """A planned FlashInfer tensor-core decode wrapper over ``paged``; returns ``run() -> out``."""
    import flashinfer

    q = case["q"]
    H, D = paged["k"].shape[2], paged["k"].shape[3]
    workspace = workspace if workspace is not None else torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    w.plan(paged["indptr"], paged["indices"], paged["last_page_len"], q.shape[1], H, D, case["block_size"],
           q_data_type=q.dtype, kv_data_type=paged["k"].dtype, sm_scale=case["sm_scale"])
    out = torch.empty_like(q)
    kv = (paged["k"], paged["v"])
    return lambda: w.run(q, kv, out=out)


def share_prefixes(case, paged, bs, seed=0):
    """Expand a case of G requests to ``bs`` requests where request ``r`` reads the KV of request
    ``r % G`` (G shared prefixes, arrivals interleaved, as in a shared-prefix serving batch), with its
    own query. Both kernels read the same blocks for requests of one group (ours through the block
    table, FlashInfer through its page indices), so both can reuse them from L2."""
    groups = case["block_table"].shape[0]
    idx = torch.arange(bs, device=case["block_table"].device) % groups
    shared = dict(case)
    shared["block_table"] = case["block_table"][idx].contiguous()
    shared["seq_lens"] = case["seq_lens"][idx].contiguous()
    shared["seq_lens_list"] = [case["seq_lens_list"][g] for g in idx.tolist()]
    gen = torch.Generator(device=case["q"].device).manual_seed(seed + 1)
    q = case["q"]
    shared["q"] = torch.randn(bs, *q.shape[1:], device=q.device, generator=gen, dtype=torch.float32).to(q.dtype)
    indptr = paged["indptr"].tolist()
    pages = [paged["indices"][indptr[g]:indptr[g + 1]] for g in idx.tolist()]
    i32 = dict(dtype=torch.int32, device=q.device)
    shared_paged = dict(paged, indices=torch.cat(pages).to(**i32),
                        indptr=torch.tensor([0, *itertools.accumulate(len(p) for p in pages)], **i32),
                        last_page_len=paged["last_page_len"][idx].contiguous())
    return shared, shared_paged


# ------------------------------------------------------------------------------------------- timing
def time_graph(fn, iters=20, reps=5, warmup=3):
    """Median time (us) of one call, from CUDA-graph replays of ``iters`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(iters):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / iters)
    times.sort()
    return times[len(times) // 2]


def time_stream(fn, iters=20, reps=5, warmup=2):
    """Median time (us) of one call, from CUDA events around ``iters`` back-to-back eager calls (the host
    runs ahead of the GPU when a call takes longer on the GPU than to launch)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / iters)
    times.sort()
    return times[len(times) // 2]


def time_interleaved(fns, iters=20, rounds=7):
    """Median times (us) of one call of each of ``fns``, measured in turn: each round times ``iters``
    back-to-back eager calls of every function, one after the other, so that clock and thermal drift
    over the run reach all of them alike (a ratio of two such medians is side by side)."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            times[k].append(time_stream(fn, iters, reps=1, warmup=1))
    return [sorted(t)[len(t) // 2] for t in times]


def time_plain(fn, iters=30, warmup=5):
    """Median time (us) of single launches timed with CUDA events."""
    return time_stream(fn, iters=1, reps=iters, warmup=warmup)


def kv_bytes(case):
    """Bytes of K and V that one decode step must read (pools as stored, cache pages, index maps)."""
    B, H = case["block_size"], case["k_cache"].shape[1]
    D = case["k_cache"].shape[2]
    esz = case["k_cache"].element_size()
    total = 0
    for r, L in enumerate(case["seq_lens_list"]):
        for j, kind in enumerate(case["kinds"][r]):
            if kind == "c":
                total += 2 * B * H * D * esz
    for idx in ("k_index", "v_index"):
        index = case[idx]
        n_sp = int((index < 0).sum())
        n_d = index.numel() - n_sp
        total += n_d * B * D * esz + n_sp * (B * D // 2 * esz + B * D // 16 * 2)
    return total


def rel_err(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------- decode
def bench_decode(args):
    from sglang_hs.kernels.decode import HieraSparseDecode

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    bs, L = args.batch, args.context
    Hq, Hkv, D = 32, 8, 128
    dtype = getattr(torch, args.dtype)
    distinct = min(args.groups or bs, bs)  # requests with their own KV; the others share it
    seq_lens = [L - (37 * r) % 64 if args.ragged else L for r in range(distinct)]
    points = [(0.0, 0.0), (0.0, 1.0), (0.5, 1.0), (1.0, 1.0)] if not args.quick else [(0.0, 1.0), (1.0, 1.0)]
    variants = [dict()]  # the default plan first: its time is the record's ours_us
    if args.variants:
        variants += [dict(split_barriers=True), dict(fused_combine=False), dict(softmax="tile")]
    records, lines = [], []
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    runs = [(layout, sk, sv) for layout in args.layouts.split(",") for sk, sv in points]
    for layout, sk, sv in runs:
        t0 = time.time()
        case = make_case(seq_lens, Hq, Hkv, D, sk, sv, dtype, dev, seed=int(sk * 10 + sv), magnitude=False,
                         shuffle=layout == "shuffled", max_blocks=args.max_blocks)
        var_list = variants if layout == runs[0][0] else [dict()]
        nbytes = kv_bytes(case)  # distinct bytes: a shared prefix counts once
        paged = paged_dense(case)
        if distinct < bs:
            case, paged = share_prefixes(case, paged, bs, seed=int(sk * 10 + sv))
        fi = flashinfer_decode(case, paged, workspace)
        ref = fi().clone()
        fi_graph, fi_plain = time_graph(fi, args.iters), time_plain(fi)
        del paged
        results = []
        for var in var_list:
            try:
                plan = HieraSparseDecode(bs, Hq, Hkv, D, 64, case["max_blocks"], dtype, dev,
                                         **{"num_splits": args.num_splits, **var})
            except Exception as e:  # a variant that does not build is reported, not fatal
                lines.append(f"S_K={sk} S_V={sv} {var}: build failed: {str(e).splitlines()[-1][:200]}")
                continue
            out = torch.empty_like(case["q"])
            a = run_args(case)
            fn = lambda: plan.run(*a, out=out)
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = rel_err(out, ref)
            g, p = time_graph(fn, args.iters), time_plain(fn)
            err = max(err, rel_err(out, ref))  # the output of the last timed call too
            desc = dict(stages=plan.stages, num_splits=plan.num_splits, softmax=plan.softmax,
                        split_barriers=plan.split_barriers, fused_combine=plan.fused_combine)
            results.append(dict(variant=desc, default=not var, ours_us=round(g, 2), ours_plain_us=round(p, 2),
                                speedup=round(fi_graph / g, 4), rel_err_vs_flashinfer=err))
            lines.append(f"{layout} S_K={sk} S_V={sv} {desc}{' (default)' if not var else ''}: ours {g:.1f} us "
                         f"(plain {p:.1f}) FI {fi_graph:.1f} us (plain {fi_plain:.1f}) speedup {fi_graph / g:.3f} "
                         f"err {err:.2e} GB/s {nbytes / g / 1e3:.0f}")
            print(lines[-1], flush=True)
        del case
        torch.cuda.empty_cache()
        ideal = 1.0 / (1.0 - 0.21875 * (sk + sv))
        record = dict(kernel="decode", S_K=sk, S_V=sv, batch=bs, context=L, head_dim=D, dtype=args.dtype, layout=layout,
                      shared_prefixes=distinct if distinct < bs else None,
                      q_heads=Hq, kv_heads=Hkv, block_size=64, ours_us=None, flashinfer_us=round(fi_graph, 2),
                      flashinfer_plain_us=round(fi_plain, 2), speedup=None, ideal_speedup=round(ideal, 4),
                      kv_bytes=nbytes, device=name, timing="CUDA-graph replay of 20 calls, median of 5",
                      setup_s=round(time.time() - t0, 1))
        default = [r for r in results if r["default"] and r["rel_err_vs_flashinfer"] < 2e-2]
        if default:
            d0 = default[0]
            record.update(ours_us=d0["ours_us"], ours_plain_us=d0["ours_plain_us"], speedup=d0["speedup"],
                          variant=d0["variant"], rel_err_vs_flashinfer=d0["rel_err_vs_flashinfer"],
                          ours_GBps=round(nbytes / d0["ours_us"] / 1e3, 1))
        if len(results) > 1:
            record["variants"] = [{k: v for k, v in r.items() if k != "default"} for r in results]
        records.append(record)
    return records, lines


# ------------------------------------------------------------------------------------------- compress
COMPRESS_JSON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "results",
                             "kernels_h100.json")


def _store_equal(a, b):
    """True if two compressed stores hold the same blocks, slots, index maps and pool bytes."""
    if a._k_slot != b._k_slot or a._v_slot != b._v_slot:
        return False
    if not (torch.equal(a.k_index, b.k_index) and torch.equal(a.v_index, b.v_index)):
        return False
    for name in ("k_dense", "k_values", "k_meta", "v_dense", "v_values", "v_meta"):
        for x, y in zip(getattr(a, name), getattr(b, name)):
            if not torch.equal(x.view(torch.int16), y.view(torch.int16)):
                return False
    return True


def bench_compress(args):
    """Fused prune + compress (``sglang_hs.kernels.compress``) of a ``--context``-token prefix, all 32
    layers of Llama-3.1-8B's KV (8 KV heads, d 128, fp16, block 64), against FlashInfer's dense causal
    prefill attention of the same tokens (``single_prefill_with_kv_cache``, 32 query heads, one layer
    timed, times 32 layers) and the PyTorch ``pools.compress_prefix`` it replaces.

    ``ours_us``: GPU time of the kernels (CUDA-graph replay: the loss pass of each operand whose
    sparsity is fractional, then the pack pass); ``ours_e2e_us``: wall time of the whole
    ``compress_prefix`` call (host-side choice, the store's allocation, uploads, launches, the
    read-back when there is one). Each point also checks that the kernels' store equals the PyTorch
    path's, bit for bit (``bit_identical``)."""
    from sglang_hs.kernels import compress as C
    from sglang_hs.pools import CompressedStore, StoreCapacity
    from sglang_hs.pools import compress_prefix as torch_compress_prefix
    from sglang_hs.pruner import MagnitudePruner

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    layers, Hq, Hkv, D, B = 32, 32, 8, 128, 64
    dtype, ctx = torch.float16, args.context
    n = ctx // B
    points = [(1.0, 1.0), (0.0, 1.0)] + ([] if args.quick else [(0.5, 1.0), (0.5, 0.5)])
    lines = []

    def log(msg):
        lines.append(msg)
        print(msg, flush=True)

    gen = torch.Generator(device=dev).manual_seed(0)
    # SGLang's per-layer buffers: page 0 is SGLang's padding page, the prefix sits on pages 1..n.
    k_buffers = [torch.randn((n + 1) * B, Hkv, D, generator=gen, device=dev, dtype=dtype) for _ in range(layers)]
    v_buffers = [torch.randn((n + 1) * B, Hkv, D, generator=gen, device=dev, dtype=dtype) for _ in range(layers)]
    slots = torch.arange(B, (n + 1) * B, device=dev)
    pages = C.page_ids(slots, B)

    # Dense prefill attention of the same tokens (one layer, times the layer count).
    fi_layer, fi_measured = None, False
    if args.flashinfer_us is None:
        try:
            import flashinfer

            q = torch.randn(ctx, Hq, D, generator=gen, device=dev, dtype=dtype)
            k, v = k_buffers[0][B:], v_buffers[0][B:]
            t0 = time.time()
            flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True)  # JIT-compiles on first use
            torch.cuda.synchronize()
            log(f"FlashInfer prefill warm-up (JIT) {time.time() - t0:.1f} s")
            fi_layer = time_plain(lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True),
                                  iters=10, warmup=2)
            fi_measured = True
            del q
        except Exception as exc:  # reported; --flashinfer-us gives the figure instead
            log(f"FlashInfer prefill unavailable: {str(exc).splitlines()[-1][:200]}")
    else:
        fi_layer = args.flashinfer_us / layers
    fi_total = fi_layer * layers if fi_layer else None
    if fi_layer:
        flops = 4 * ctx * ctx / 2 * D * Hq
        log(f"dense prefill attention: {fi_layer:.0f} us/layer ({flops / fi_layer / 1e6:.0f} TFLOP/s), "
            f"{fi_total / 1e3:.1f} ms for {layers} layers{'' if fi_measured else ' (given)'}")

    plan = C.get_plan(Hkv, D, B, dtype, str(dev)).build_all()
    cap = StoreCapacity(n, n, n, n, n)
    ours = CompressedStore(cap, layers, Hkv, D, B, dtype, dev)
    theirs = CompressedStore(cap, layers, Hkv, D, B, dtype, dev)
    pruner = MagnitudePruner()
    kv_bytes_total = 2 * layers * n * B * Hkv * D * 2
    records = []
    for sk, sv in points:
        groups = [(torch.ones(n, dtype=torch.bool), sk, sv)]
        for store in (ours, theirs):
            store.clear()
            for pool in ("k_dense", "k_values", "k_meta", "v_dense", "v_values", "v_meta"):
                for t in getattr(store, pool):
                    t.zero_()
        # PyTorch path: one warm-up, one timed call (it takes seconds).
        torch_compress_prefix(theirs, pruner, k_buffers, v_buffers, slots, groups)
        theirs.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        vbs_theirs = torch_compress_prefix(theirs, pruner, k_buffers, v_buffers, slots, groups)
        torch.cuda.synchronize()
        torch_us = (time.perf_counter() - t0) * 1e6
        # Ours, end to end (median of --iters calls; the store is emptied between calls).
        e2e = []
        for it in range(args.iters + 2):
            ours.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            vbs_ours = C.compress_prefix(ours, pruner, k_buffers, v_buffers, slots, groups)
            torch.cuda.synchronize()
            if it >= 2:
                e2e.append((time.perf_counter() - t0) * 1e6)
        e2e.sort()
        identical = vbs_ours == vbs_theirs and _store_equal(ours, theirs)
        # Ours, kernels only: the passes this point needs, replayed from a CUDA graph.
        addr = C.address_table(k_buffers, v_buffers, ours)
        info = C.block_info(ours, vbs_ours).to(dev)
        need_loss = [op for op in ("k", "v") if C.plan_choice(groups, n, op)[1]]
        pack_us = time_graph(lambda: plan.pack(addr, pages, info), iters=5)
        loss_us = {op: time_graph(lambda op=op: plan.loss(addr, pages, op), iters=5) for op in need_loss}
        ours_us = pack_us + sum(loss_us.values())
        moved = kv_bytes_total * (1 + len(need_loss) / 2) + ours.stored_bytes()  # reads + writes
        e2e_us = e2e[len(e2e) // 2]
        rec = dict(kernel="compress", S_K=sk, S_V=sv, batch=1, context=ctx, head_dim=D, dtype="float16",
                   layers=layers, q_heads=Hq, kv_heads=Hkv, block_size=B,
                   ours_us=round(ours_us, 1), ours_pack_us=round(pack_us, 1),
                   ours_loss_us={op: round(t, 1) for op, t in loss_us.items()},
                   ours_e2e_us=round(e2e_us, 1), pytorch_us=round(torch_us, 1),
                   flashinfer_us=round(fi_total, 1) if fi_total else None,
                   flashinfer_layer_us=round(fi_layer, 2) if fi_layer else None, flashinfer_measured=fi_measured,
                   speedup=round(fi_total / ours_us, 1) if fi_total else None,
                   e2e_speedup=round(fi_total / e2e_us, 1) if fi_total else None,
                   percent_of_prefill=round(100 * ours_us / fi_total, 3) if fi_total else None,
                   vs_pytorch=round(torch_us / ours_us, 1), bit_identical=identical,
                   bytes_moved=int(moved), ours_GBps=round(moved / ours_us / 1e3, 1), device=name,
                   timing="kernels: CUDA-graph replay of 5 calls, median of 5; e2e: wall time, median")
        records.append(rec)
        log(f"S_K={sk} S_V={sv}: kernels {ours_us:.0f} us (pack {pack_us:.0f}, loss {loss_us}) "
            f"= {rec['ours_GBps']} GB/s; e2e {rec['ours_e2e_us']:.0f} us; PyTorch {torch_us / 1e3:.0f} ms; "
            f"{rec['percent_of_prefill']}% of dense prefill; bit-identical {identical}")
    return records, lines


def compress_main(args):
    """``--kernel compress``: run, then write ``OUT/kernels_h100.json`` = the records of ``--merge`` (the
    committed results by default) other than compress ones, plus these; and ``OUT/bench_compress.log``."""
    os.makedirs(args.out, exist_ok=True)
    records, lines = bench_compress(args)
    base = []
    if args.merge and os.path.exists(args.merge):
        with open(args.merge) as f:
            base = [r for r in json.load(f) if r.get("kernel") != "compress"]
    with open(os.path.join(args.out, "kernels_h100.json"), "w") as f:
        json.dump(base + records, f, indent=1)
    with open(os.path.join(args.out, "bench_compress.log"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{'S_K':>4} {'S_V':>4} {'ours_us':>9} {'e2e_us':>9} {'FI_us':>10} {'%prefill':>9} {'speedup':>8} {'exact':>6}")
    for r in records:
        print(f"{r['S_K']:4g} {r['S_V']:4g} {r['ours_us']:9.1f} {r['ours_e2e_us']:9.1f} {r['flashinfer_us'] or 0:10.1f} "
              f"{r['percent_of_prefill'] or float('nan'):9.3f} {r['speedup'] or float('nan'):8.1f} {str(r['bit_identical']):>6}")


# ------------------------------------------------------------------------------------------- extend
EXTEND_RESULTS_JSON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch",
                                   "results", "kernels_h100.json")
EXTEND_RUN_KEYS = ("q", "qo_indptr", "k_cache", "v_cache", "k_dense", "k_values", "k_meta", "v_dense", "v_values",
                   "v_meta", "k_index", "v_index", "block_table", "seq_lens", "sm_scale")


def make_extend_case(prefix_lens, new_lens, q_heads=32, kv_heads=8, head_dim=128, sk=0.0, sv=0.0,
                     dtype=torch.float16, device="cuda", max_blocks=None, seed=0, magnitude=True, shuffle=True,
                     compress_new=False, **kw):
    """Inputs of ``HieraSparseExtend.run``: request r has a cached prefix of ``prefix_lens[r]`` tokens (1 sink
    page, compressed virtual blocks, 4 window pages: :func:`make_case`'s layout over the prefix) and
    ``new_lens[r]`` new tokens in cache pages after it; ``q`` is packed ``[sum(new_lens), Hq, D]`` with
    ``qo_indptr``. ``compress_new`` (full prefill over compressed KV, as chunked prefill with pruning
    sees it): the layout covers the whole sequence, new tokens included. Returns :func:`make_case`'s
    dict plus ``qo_indptr`` (GPU int32), ``qo_indptr_list``, ``new_lens`` and ``prefix_lens``."""
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    layout = seq_lens if compress_new else prefix_lens
    case = make_case(seq_lens, q_heads, kv_heads, head_dim, sk, sv, dtype, device, max_blocks=max_blocks,
                     seed=seed, magnitude=magnitude, shuffle=shuffle, prefix_lens=list(layout), **kw)
    gen = torch.Generator(device=device).manual_seed(seed + 7919)
    total = sum(new_lens)
    case["q"] = torch.randn(total, q_heads, head_dim, device=device, generator=gen, dtype=torch.float32).to(dtype)
    indptr = [0]
    for n in new_lens:
        indptr.append(indptr[-1] + n)
    case.update(qo_indptr=torch.tensor(indptr, dtype=torch.int32, device=device), qo_indptr_list=indptr,
                new_lens=list(new_lens), prefix_lens=list(prefix_lens))
    return case


def extend_run_args(case):
    return [case[k] for k in EXTEND_RUN_KEYS]


def extend_reference(case, device=None):
    """The oracle (``sglang_hs.reference.paged_attention``, float32 arithmetic) on ``device`` (default: where
    the case lives; on a GPU its many small products run in seconds instead of a minute): ``(out, lse)``."""
    from sglang_hs import reference as R

    dev = torch.device(device) if device is not None else case["q"].device
    t = {k: case[k].to(dev) for k in ("q", "k_cache", "v_cache", "k_dense", "k_values", "k_meta", "v_dense",
                                      "v_values", "v_meta", "k_index", "v_index", "block_table")}
    pools = BlockPools(*(t[k] for k in ("k_dense", "k_values", "k_meta", "v_dense", "v_values", "v_meta")))
    return R.paged_attention(t["q"], case["qo_indptr_list"], t["k_cache"], t["v_cache"], pools, t["k_index"],
                             t["v_index"], t["block_table"], case["seq_lens_list"], case["sm_scale"])


def flashinfer_extend(case, paged, workspace=None, backend="fa2"):
    """A planned FlashInfer ``BatchPrefillWithPagedKVCacheWrapper`` (causal, NHD, page 64) over ``paged``
    (:func:`paged_dense`, the pruned KV of the same requests); returns ``run() -> out``. ``fa2`` is the
    backend SGLang's FlashInfer attention backend uses for paged prefill."""
    import flashinfer

    q = case["q"]
    H, D = paged["k"].shape[2], paged["k"].shape[3]
    workspace = workspace if workspace is not None else torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    w.plan(case["qo_indptr"], paged["indptr"], paged["indices"], paged["last_page_len"], q.shape[1], H, D,
           case["block_size"], causal=True, sm_scale=case["sm_scale"], q_data_type=q.dtype,
           kv_data_type=paged["k"].dtype)
    out = torch.empty_like(q)
    kv = (paged["k"], paged["v"])
    return lambda: w.run(q, kv, out=out)


def extend_flops(case):
    """Causal attention FLOPs of the case (both GEMMs, dense equivalent)."""
    Hq, D = case["q"].shape[1], case["q"].shape[2]
    keys = sum(n * p + n * (n + 1) // 2 for p, n in zip(case["prefix_lens"], case["new_lens"]))
    return 4 * D * Hq * keys


def bench_extend(args, on_record=None):
    """The extend regime of issue 3: ``--batch`` requests, each a ``--context``-token cached prefix (1 sink
    page, compressed blocks, 4 window pages) plus n new tokens for n in ``--new-tokens``; Llama-3.1-8B
    heads (32/8, d 128, fp16); against FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (causal, page
    64, backend ``--fi-backend``) over the same pruned KV, in one process, same timing method.
    ``--kernel prefill``: the full-prefill regime instead: ``--batch`` sequences of ``--context`` tokens, each
    query attending causally to the whole sequence, whose KV has the compressed layout (1 sink page,
    compressed blocks, 4 window pages). ``on_record(records, lines)`` runs after every point (partial
    results survive a time limit)."""
    from sglang_hs.kernels.extend import BENCH_VARIANTS, HieraSparseExtend

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    prefill = args.kernel == "prefill"
    bs, P = args.batch, (0 if prefill else args.context)
    Hq, Hkv, D = 32, 8, 128
    dtype = torch.float16
    new_list = [args.context] if prefill else [int(x) for x in args.new_tokens.split(",")]
    points = [(0.0, 0.0), (0.0, 1.0), (1.0, 1.0)] if not args.quick else [(0.0, 1.0), (1.0, 1.0)]
    variants = [dict()]  # the default plan first: its time is the record's ours_us
    named = args.variant or (BENCH_VARIANTS if args.variants else [])  # (tile, stages, sync)
    variants += [dict(tile=t, stages=st, sync=sy) for t, st, sy in named]
    records, lines = [], []

    def log(msg):
        lines.append(msg)
        print(msg, flush=True)

    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    for n in new_list:
        iters = args.iters if n <= 256 else max(3, args.iters // 4)
        for sk, sv in points:
            t0 = time.time()
            case = make_extend_case([P] * bs, [n] * bs, Hq, Hkv, D, sk, sv, dtype, dev, seed=int(sk * 10 + sv) + n,
                                    magnitude=False, shuffle=False, compress_new=prefill)
            paged = paged_dense(case)
            fi = flashinfer_extend(case, paged, workspace, args.fi_backend)
            t1 = time.time()
            ref = fi().clone()
            torch.cuda.synchronize()
            fi_first_s = time.time() - t1  # includes FlashInfer's JIT compile on first use
            fi_us = None  # timed with the default plan, in alternation
            nbytes, flops = kv_bytes(case), extend_flops(case)
            results = []
            for var in variants:
                try:
                    plan = HieraSparseExtend(Hq, Hkv, D, 64, case["max_blocks"], dtype, dev,
                                             **{"num_splits": args.num_splits, **var})
                    out = torch.empty_like(case["q"])
                    a = extend_run_args(case)
                    fn = lambda: plan.run(*a, out=out)  # noqa: E731
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                except Exception as e:  # a variant that does not build or run is reported, not fatal
                    log(f"n={n} S_K={sk} S_V={sv} {var}: failed: {str(e).splitlines()[-1][:200]}")
                    continue
                err = rel_err(out, ref)
                if fi_us is None:
                    fi_us, g = time_interleaved([fi, fn], iters)
                else:
                    g = time_stream(fn, iters)
                err = max(err, rel_err(out, ref))  # the output of the last timed call too
                desc = dict(plan.last_config)
                results.append(dict(variant=desc, default=not var, ours_us=round(g, 2), speedup=round(fi_us / g, 4),
                                    rel_err_vs_flashinfer=err))
                log(f"n={n} S_K={sk} S_V={sv} {desc}{' (default)' if not var else ''}: ours {g:.1f} us "
                    f"FI {fi_us:.1f} us speedup {fi_us / g:.3f} err {err:.2e} "
                    f"TFLOP/s {flops / g / 1e6:.0f} (FI {flops / fi_us / 1e6:.0f}) GB/s {nbytes / g / 1e3:.0f}")
            if fi_us is None:  # no variant ran
                fi_us = time_stream(fi, iters)
            del case, paged, ref
            torch.cuda.empty_cache()
            s = sk + sv
            # prefill: the queries are the whole sequence, so its length (context) says it all
            record = dict(kernel=args.kernel, S_K=sk, S_V=sv, batch=bs, context=n if prefill else P,
                          **({} if prefill else {"new_tokens": n}), head_dim=D,
                          dtype="float16", q_heads=Hq, kv_heads=Hkv, block_size=64, ours_us=None,
                          flashinfer_us=round(fi_us, 2), speedup=None, flashinfer_backend=args.fi_backend,
                          ideal_speedup_bytes=round(1.0 / (1.0 - 0.21875 * s), 4),
                          ideal_speedup_compute=round(4.0 / (4.0 - s), 4), kv_bytes=nbytes, flops=flops,
                          device=name, timing=f"{iters} back-to-back eager calls, CUDA events, median of 7 rounds "
                                              "alternating FlashInfer and the default plan (variants: median of 5)",
                          flashinfer_first_call_s=round(fi_first_s, 1), setup_s=round(t1 - t0, 1))
            default = [r for r in results if r["default"] and r["rel_err_vs_flashinfer"] < 2e-2]
            if default:
                d0 = default[0]
                record.update(ours_us=d0["ours_us"], speedup=d0["speedup"], variant=d0["variant"],
                              rel_err_vs_flashinfer=d0["rel_err_vs_flashinfer"],
                              ours_TFLOPs=round(flops / d0["ours_us"] / 1e6, 1),
                              flashinfer_TFLOPs=round(flops / fi_us / 1e6, 1))
            elif results:
                record["rel_err_vs_flashinfer"] = results[0]["rel_err_vs_flashinfer"]  # wrong: no speedup recorded
            if len(results) > 1:
                record["variants"] = [{k: v for k, v in r.items() if k != "default"} for r in results]
            records.append(record)
            if on_record is not None:
                on_record(records, lines)
    return records, lines


def plot_extend(records, path, kernel="extend"):
    """Speedup and times against the new tokens per request (extend) or the sequence length (prefill)."""
    plt = pyplot()
    recs = [r for r in records if r.get("kernel") == kernel and r.get("ours_us")]
    if not recs:
        return False
    key = "context" if kernel == "prefill" else "new_tokens"
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for sk, sv in sorted({(r["S_K"], r["S_V"]) for r in recs}):
        rs = sorted((r for r in recs if (r["S_K"], r["S_V"]) == (sk, sv)), key=lambda r: r[key])
        x = [r[key] for r in rs]
        a1.plot(x, [r["speedup"] for r in rs], marker="o", label=f"S_K={sk:g}, S_V={sv:g}")
        a2.plot(x, [r["ours_us"] for r in rs], marker="o", label=f"ours S_K={sk:g}, S_V={sv:g}")
    # FlashInfer's time over the (0, 0) points when there are some, else over the last setting's points.
    rs = sorted([r for r in recs if (r["S_K"], r["S_V"]) == (0.0, 0.0)] or rs, key=lambda r: r[key])
    a2.plot([r[key] for r in rs], [r["flashinfer_us"] for r in rs], "k--", marker="x", label="FlashInfer")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xlabel("sequence length (queries = keys)" if kernel == "prefill" else "new tokens per request")
        a.legend(loc="best", fontsize=8)
    a1.axhline(1.0, color="k", lw=0.8)
    a1.set_ylabel("speedup vs FlashInfer")
    a2.set_yscale("log")
    a2.set_ylabel(f"{kernel} attention time (us)")
    r0 = recs[0]
    what = (f"Full prefill over compressed KV, batch {r0['batch']}" if kernel == "prefill" else
            f"Extend over a cached prefix, batch {r0['batch']}, {r0['context']}-token prefix")
    fig.suptitle(f"{what}, 32/8 heads, d=128, fp16 - {r0.get('device', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def extend_main(args):
    """``--kernel extend`` (or ``prefill``): run, then write ``OUT/kernels_h100.json`` = the records of the
    results JSON (``--merge`` when given, else the committed ``launch/results/kernels_h100.json``) other
    than this kernel's, plus these; ``OUT/kernels_h100_<kernel>.png`` and ``OUT/bench_<kernel>.log``."""
    os.makedirs(args.out, exist_ok=True)
    merge = getattr(args, "merge", None) or EXTEND_RESULTS_JSON
    base = []
    if os.path.exists(merge):
        with open(merge) as f:
            base = [r for r in json.load(f) if r.get("kernel") != args.kernel]

    def save(records, lines):
        with open(os.path.join(args.out, "kernels_h100.json"), "w") as f:
            json.dump(base + records, f, indent=1)
        with open(os.path.join(args.out, f"bench_{args.kernel}.log"), "w") as f:
            f.write("\n".join(lines) + "\n")

    records, lines = bench_extend(args, on_record=save)
    save(records, lines)
    plot_extend(records, os.path.join(args.out, f"kernels_h100_{args.kernel}.png"), args.kernel)
    print(f"{'tokens':>6} {'S_K':>4} {'S_V':>4} {'ours_us':>9} {'FI_us':>9} {'speedup':>8} {'ideal_B':>7} {'ideal_C':>7}")
    for r in records:
        print(f"{r.get('new_tokens', r['context']):6d} {r['S_K']:4g} {r['S_V']:4g} {r['ours_us'] or float('nan'):9.1f} "
              f"{r['flashinfer_us']:9.1f} {r['speedup'] or float('nan'):8.3f} {r['ideal_speedup_bytes']:7.3f} "
              f"{r['ideal_speedup_compute']:7.3f}")


def plot(records, path):
    plt = pyplot()
    records = [r for r in records if r.get("kernel", "decode") == "decode"]
    recs = [r for r in records if r.get("ours_us") and r.get("layout", "natural") == records[0].get("layout", "natural")]
    r0 = recs[0] if recs else {}

    def label(r):
        text = f"S_K={r['S_K']:g}\nS_V={r['S_V']:g}"
        if (r["batch"], r.get("dtype"), r.get("shared_prefixes")) != (r0["batch"], r0.get("dtype"), None):
            text += f"\nbs {r['batch']} {'bf16' if r.get('dtype') == 'bfloat16' else 'fp16'}"
            text += f"\n{r['shared_prefixes']} prefixes" if r.get("shared_prefixes") else "\ndistinct"
        return text

    labels = [label(r) for r in recs]
    x = range(len(recs))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(4 + 1.1 * len(recs), 4.4))
    a1.bar([i - 0.2 for i in x], [r["flashinfer_us"] for r in recs], 0.4, label="FlashInfer (dense)")
    a1.bar([i + 0.2 for i in x], [r["ours_us"] for r in recs], 0.4, label="HieraSparse (TileLang)")
    a1.set_xticks(list(x), labels)
    a1.set_ylabel("decode attention time (us)")
    a1.set_ylim(0, 1.3 * max([r["flashinfer_us"] for r in recs] + [1]))
    a1.legend(loc="upper left", ncol=2)
    a2.bar([i - 0.2 for i in x], [r["speedup"] for r in recs], 0.4, label="measured")
    a2.bar([i + 0.2 for i in x], [r["ideal_speedup"] for r in recs], 0.4, label="ideal (byte ratio)")
    a2.axhline(1.0, color="k", lw=0.8)
    a2.set_xticks(list(x), labels)
    a2.set_ylabel("speedup vs FlashInfer")
    a2.set_ylim(0, 1.3 * max([r["ideal_speedup"] for r in recs] + [1]))
    a2.legend(loc="upper left", ncol=2)
    fig.suptitle(f"Decode, batch {r0.get('batch')} (unless noted), {r0.get('context')} tokens, 32/8 heads, d=128, "
                 f"{r0.get('dtype', 'float16')} "
                 f"- {r0.get('device', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="decode", choices=["decode", "compress", "extend", "prefill"])
    ap.add_argument("--out", default="out")
    ap.add_argument("--batch", type=int, default=None, help="requests (default 8; prefill: 1)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="only S_K,S_V in {(0,1), (1,1)}")
    ap.add_argument("--variants", action="store_true", help="also time other stages / splits / softmax variants")
    ap.add_argument("--variant", action="append", default=None, metavar="TILE:STAGES:SYNC",
                    help="extend, prefill: time this variant besides the default plan (repeatable; with "
                    "--variants instead of the built-in list)")
    ap.add_argument("--ragged", action="store_true", help="unequal lengths (last page partial)")
    ap.add_argument("--groups", type=int, default=None,
                    help="decode: only this many distinct requests' KV; request r reads request r %% G's (shared prefixes)")
    ap.add_argument("--max-blocks", type=int, default=None,
                    help="decode: block-table width (a server's: ceil((context length + 4) / 64)); default: the context's")
    ap.add_argument("--num-splits", type=int, default=None,
                    help="decode, extend, prefill: force the split count (default: the plan's)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"], help="decode: KV and query type")
    ap.add_argument("--layouts", default="natural,shuffled",
                    help="pool/page layouts to time: natural (allocation order) and/or shuffled (random rows)")
    ap.add_argument("--plot", metavar="JSON", help="only redraw the PNG of an existing JSON")
    ap.add_argument("--new-tokens", default="64,16,256,1024,2048",
                    help="extend: new tokens per request (the issue's goal point, 64, first)")
    ap.add_argument("--fi-backend", default="fa2", help="extend: FlashInfer prefill backend (SGLang uses fa2)")
    ap.add_argument("--flashinfer-us", type=float, help="compress: dense prefill time (us, all layers) to use "
                    "instead of measuring FlashInfer")
    ap.add_argument("--merge", default=COMPRESS_JSON, help="compress: results JSON whose other records are kept")
    args = ap.parse_args(argv)
    if args.batch is None:
        args.batch = 1 if args.kernel == "prefill" else 8
    for flag in ("batch", "groups", "max_blocks", "num_splits"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    variants = []  # --variant, parsed once into (tile, stages, sync)
    for v in args.variant or ():
        parts = v.split(":")
        if len(parts) != 3 or not parts[1].isdigit():
            ap.error(f"--variant {v!r}: expected TILE:STAGES:SYNC, e.g. n128:2:warp")
        variants.append((parts[0], int(parts[1]), parts[2]))
    args.variant = variants
    if args.plot:
        recs = json.load(open(args.plot))
        plot(recs, os.path.splitext(args.plot)[0] + ".png")
        return
    if args.kernel == "compress":
        return compress_main(args)
    if args.kernel in ("extend", "prefill"):
        return extend_main(args)
    os.makedirs(args.out, exist_ok=True)
    records, lines = bench_decode(args)
    path = os.path.join(args.out, "kernels_h100.json")
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    with open(os.path.join(args.out, "bench_decode.log"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(records, os.path.join(args.out, "kernels_h100.png"))
    print(f"{'layout':>9} {'S_K':>4} {'S_V':>4} {'ours_us':>9} {'FI_us':>8} {'speedup':>8} {'ideal':>6}")
    for r in records:
        print(f"{r.get('layout', ''):>9} {r['S_K']:4g} {r['S_V']:4g} {r['ours_us'] or float('nan'):9.1f} "
              f"{r['flashinfer_us']:8.1f} {r['speedup'] or float('nan'):8.3f} {r['ideal_speedup']:6.3f}")


if __name__ == "__main__":
    main()
