"""``--kernel compress`` of :mod:`sglang_hs.kernels.bench`: the fused prune + compress kernels against
the dense prefill attention of the same tokens and the PyTorch compressor they replace."""

import json
import os
import time

import torch

from sglang_hs.kernels import compress as C
from sglang_hs.kernels.bench_extend import results_json
from sglang_hs.kernels.timing import device_tag, time_graph, time_plain
from sglang_hs.k_head_map import KHeadMap
from sglang_hs.pools import CompressedStore, StoreCapacity
from sglang_hs.pools import compress_prefix as torch_compress_prefix
from sglang_hs.pruner import MagnitudePruner


def _store_equal(a, b):
    """True if two compressed stores hold the same blocks, slots, index maps and pool bytes."""
    if a.placements() != b.placements():
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
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    layers, Hq, Hkv, D, B = 32, 32, 8, 128, 64
    dtype, ctx = torch.float16, args.context
    n = ctx // B
    points = [(sk, sv, None) for sk, sv in [(1.0, 1.0), (0.0, 1.0)] + ([] if args.quick else [(0.5, 1.0), (0.5, 0.5)])]
    share = getattr(args, "k_head_share", None)
    if share is not None:  # with a K head map: the pack kernel splits each layer's heads between pools
        points += [(1.0, 1.0, share), (0.5, 1.0, share)]
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

    cap = StoreCapacity(n, n, n, n, n)
    stores = {}

    def stores_for(map_share):
        """(ours, theirs) with a seeded random K head map of ``map_share`` (None: no map), made once."""
        if map_share not in stores:
            stores.clear()  # one pair at a time: a store for 32K tokens of Llama-3.1-8B is ~8 GB
            torch.cuda.empty_cache()  # near a full GPU the allocator would free and retry inside timed calls
            heads = None
            if map_share is not None:
                scores = torch.rand(layers, Hkv, generator=torch.Generator().manual_seed(0))
                heads = KHeadMap.from_scores(scores, map_share).sparse
            stores[map_share] = tuple(CompressedStore(cap, layers, Hkv, D, B, dtype, dev, k_sparse_heads=heads)
                                      for _ in range(2))  # fmt: skip
        return stores[map_share]

    compressor = C.FusedCompressor()
    plan = compressor.plan(stores_for(None)[0]).build_all()
    pruner = MagnitudePruner()
    kv_bytes_total = 2 * layers * n * B * Hkv * D * 2
    records = []
    for sk, sv, map_share in points:
        ours, theirs = stores_for(map_share)
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
            vbs_ours = compressor(ours, pruner, k_buffers, v_buffers, slots, groups)
            torch.cuda.synchronize()
            if it >= 2:
                e2e.append((time.perf_counter() - t0) * 1e6)
        e2e.sort()
        identical = vbs_ours == vbs_theirs and _store_equal(ours, theirs)
        # Ours, kernels only: the passes this point needs, replayed from a CUDA graph.
        addr = compressor.address_table(k_buffers, v_buffers, ours)
        info = C.block_info(ours, vbs_ours).to(dev)
        need_loss = [op for op in ("k", "v") if C.plan_choice(groups, n, op)[1]]
        pack_us = time_graph(lambda: plan.pack(addr, pages, info, ours.k_sparse_block_rows), iters=5)
        loss_us = {op: time_graph(lambda op=op: plan.loss(addr, pages, op, ours.loss_head_weights[op]), iters=5)
                   for op in need_loss}
        ours_us = pack_us + sum(loss_us.values())
        moved = kv_bytes_total * (1 + len(need_loss) / 2) + ours.stored_bytes()  # reads + writes
        e2e_us = e2e[len(e2e) // 2]
        rec = dict(kernel="compress", S_K=sk, S_V=sv, k_head_share=map_share, effective_S_K=sk * ours.k_sparse_share,
                   batch=1, context=ctx, head_dim=D, dtype="float16",
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
        mapped = "" if map_share is None else f" K head map {map_share}"
        log(f"S_K={sk} S_V={sv}{mapped}: kernels {ours_us:.0f} us (pack {pack_us:.0f}, loss {loss_us}) "
            f"= {rec['ours_GBps']} GB/s; e2e {rec['ours_e2e_us']:.0f} us; PyTorch {torch_us / 1e3:.0f} ms; "
            f"{rec['percent_of_prefill']}% of dense prefill; bit-identical {identical}")
        del ours, theirs  # a point with another map makes a new pair: hold one at a time
    return records, lines


def compress_main(args):
    """``--kernel compress``: run, then write ``OUT/kernels_<gpu>.json`` (``<gpu>``: h100 or h200) = the records
    of ``--merge`` (the committed ``launch/results/kernels_<gpu>.json`` by default) other than compress ones,
    plus these; and ``OUT/bench_compress.log``."""
    os.makedirs(args.out, exist_ok=True)
    records, lines = bench_compress(args)
    tag = device_tag(torch.cuda.get_device_name())
    merge = args.merge or results_json(tag)
    base = []
    if os.path.exists(merge):
        with open(merge) as f:
            base = [r for r in json.load(f) if r.get("kernel") != "compress"]
    with open(os.path.join(args.out, f"kernels_{tag}.json"), "w") as f:
        json.dump(base + records, f, indent=1)
    with open(os.path.join(args.out, "bench_compress.log"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{'S_K':>4} {'S_V':>4} {'map':>5} {'ours_us':>9} {'e2e_us':>9} {'FI_us':>10} {'%prefill':>9} {'speedup':>8} {'exact':>6}")
    for r in records:
        print(f"{r['S_K']:4g} {r['S_V']:4g} {r['k_head_share'] or 0:5.2f} {r['ours_us']:9.1f} {r['ours_e2e_us']:9.1f} {r['flashinfer_us'] or 0:10.1f} "
              f"{r['percent_of_prefill'] or float('nan'):9.3f} {r['speedup'] or float('nan'):8.1f} {str(r['bit_identical']):>6}")
