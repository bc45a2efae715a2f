"""``--kernel decode`` of :mod:`sglang_hs.kernels.bench`: the split-KV decode kernel against FlashInfer.

Workload: batch 8, 32K tokens per request, Llama-3.1-8B attention (32 query heads, 8 KV heads,
head_dim 128, fp16), block size 64, a case of :func:`sglang_hs.kernels.cases.make_case` (1 sink page,
compressed blocks, 4 window pages). Layout ``natural``: cache pages, virtual blocks and pool rows in
allocation order; ``shuffled``: all in random order (a fragmented store). FlashInfer
(``BatchDecodeWithPagedKVCacheWrapper``, tensor cores, NHD, page 64) runs over the decompressed
(pruned) KV of the same requests, so it is also the full-size correctness reference (checked on the
first and the last timed call). Both are timed as replays of a CUDA graph of ``--iters`` back-to-back
calls (CUDA events, median of 7 replays), ours in rounds beside the fastest FlashInfer backend only
(:func:`sglang_hs.kernels.timing.time_beside_fastest` says why), and also as single plain launches (``*_plain_us``, which
include host launch overhead). ``--kv-dtype fp8_e4m3``: FP8 KV (an FP8 store with its row scales and SGLang's
unit-scale FP8 pages); FlashInfer runs over the same values as 16-bit pages (the correctness reference) and
cast to e4m3 pages (backends ``fa2-fp8``, ``fa3-fp8``: a speed baseline), and ``ideal_speedup_vs_fp8`` is FP8
dense bytes over ours.
"""

import json
import os
import time

import torch

from sglang_hs.format import compression_ratio
from sglang_hs.format import FP8_DTYPE
from sglang_hs.kernels.cases import (flashinfer_decode, fp8_pages, kv_bytes, make_case, paged_dense, quantize_case, rel_err,
                                     run_args, share_prefixes)  # fmt: skip
from sglang_hs.kernels.common import ANY_FORMS
from sglang_hs.kernels.timing import device_tag, time_beside_fastest, time_graph, time_graphs, time_plain
from sglang_hs.plotting import pyplot

VARIANT_STAGES = (3,)
"""``--variants``: the pipeline depths timed besides the default plan's (and, where the default is the compact
kernel, the any-form one)."""


def bench_decode(args):
    from sglang_hs.kernels.decode import HieraSparseDecode, decode_compact
    from sglang_hs.kernels.decode_shared import compressed_forms

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    bs, L = args.batch, args.context
    Hq, Hkv, D = 32, 8, 128
    dtype = getattr(torch, args.dtype)
    distinct = min(args.groups or bs, bs)  # requests with their own KV; the others share it
    seq_lens = [L - (37 * r) % 64 if args.ragged else L for r in range(distinct)]
    points = [(0.0, 0.0), (0.0, 1.0), (0.5, 1.0), (1.0, 1.0)] if not args.quick else [(0.0, 1.0), (1.0, 1.0)]
    points = getattr(args, "points", None) or points
    variants = [dict()]  # the default plan first: its time is the record's ours_us
    if args.variants:
        variants += [dict(stages=stages) for stages in VARIANT_STAGES]
    records, lines = [], []
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    k_note = "" if args.k_sparse_heads is None else f" (on {args.k_sparse_heads} of {Hkv} KV heads)"
    fp8 = getattr(args, "kv_dtype", "auto") == "fp8_e4m3"
    if fp8 and (distinct < bs or args.modes):
        raise SystemExit("error: --kv-dtype fp8_e4m3 times plain decode only (no --groups, no --modes)")
    fp8_plan = dict(store_dtype=FP8_DTYPE, cache_dtype=FP8_DTYPE) if fp8 else {}
    runs = [(layout, sk, sv) for layout in args.layouts.split(",") for sk, sv in points]
    for layout, sk, sv in runs:
        t0 = time.time()
        case = make_case(seq_lens, Hq, Hkv, D, sk, sv, dtype, dev, seed=int(sk * 10 + sv), magnitude=False,
                         shuffle=layout == "shuffled", max_blocks=args.max_blocks, k_sparse_heads=args.k_sparse_heads)
        var_list = variants if layout == runs[0][0] else [dict()]
        oracle = case
        if fp8:  # FlashInfer reads the same values: 16-bit pages from the oracle's view, and e4m3 pages
            case, oracle = fp8_pages(quantize_case(case))
        nbytes = kv_bytes(case)  # distinct bytes: a shared prefix counts once
        dense_fp8_bytes = sum(-(-n // 64) for n in case["seq_lens_list"]) * 64 * 2 * Hkv * D
        paged = paged_dense(oracle)
        if distinct < bs:
            case, paged = share_prefixes(case, paged, bs, seed=int(sk * 10 + sv))
        fis = {}  # FlashInfer backend -> run(); fa2 (SGLang's) first: the reference
        fi_pages = {"": paged}
        if fp8:
            fi_pages["-fp8"] = dict(paged, k=paged["k"].to(FP8_DTYPE), v=paged["v"].to(FP8_DTYPE))
        for suffix, pages in fi_pages.items():
            for backend in args.fi_backends.split(","):
                try:
                    fis[backend + suffix] = flashinfer_decode(case, pages, workspace, backend)
                    fis[backend + suffix]()
                except Exception as e:  # a backend this FlashInfer build lacks is reported, not fatal
                    lines.append(f"FlashInfer {backend + suffix}: failed: {str(e).splitlines()[-1][:200]}")
                    fis.pop(backend + suffix, None)
        ref = next(iter(fis.values()))().clone()
        fi_plain = {b: time_plain(fn) for b, fn in fis.items()}
        del paged, fi_pages, oracle
        results, fi_us = [], {}
        # The server's plan for these settings: the compact kernel where decode_compact takes the store's forms.
        forms = compressed_forms((sk,), (sv,), k_head_map=args.k_sparse_heads is not None)
        compact = None if fp8 else decode_compact(forms, D)
        if compact and args.variants and layout == runs[0][0]:
            var_list = var_list + [dict(compact=None)]  # the any-form kernel
        for var in var_list:
            try:
                plan = HieraSparseDecode(bs, Hq, Hkv, D, 64, case["max_blocks"], dtype, dev,
                                         **{"num_splits": args.num_splits, "compact": compact, **fp8_plan, **var})
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
            if not fi_us:  # the default plan: timed side by side with the fastest FlashInfer backend
                fi_us, (g,) = time_beside_fastest(fis, [fn], args.iters)
            else:
                g = time_graph(fn, args.iters)
            p = time_plain(fn)
            err = max(err, rel_err(out, ref))  # the output of the last timed call too
            fast = min(fi_us, key=fi_us.get)
            desc = dict(stages=plan.stages, num_splits=plan.num_splits, compact=plan.compact and "/".join(plan.compact))
            results.append(dict(variant=desc, default=not var, ours_us=round(g, 2), ours_plain_us=round(p, 2),
                                speedup=round(fi_us[fast] / g, 4), rel_err_vs_flashinfer=err))
            lines.append(f"{layout} S_K={sk}{k_note} S_V={sv} {desc}{' (default)' if not var else ''}: ours {g:.1f} us "
                         f"(plain {p:.1f}) FI " + ", ".join(f"{b} {t:.1f} us" for b, t in fi_us.items()) +
                         f" speedup {fi_us[fast] / g:.3f} vs {fast} err {err:.2e} GB/s {nbytes / g / 1e3:.0f}")
            print(lines[-1], flush=True)
        if not fi_us:
            fi_us = dict(zip(fis, time_graphs(list(fis.values()), args.iters)))
        fast = min(fi_us, key=fi_us.get)
        case_for_modes, fis_for_modes = (case, fis) if args.modes else (None, None)
        shared_rec = None
        if distinct < bs:
            forms = compressed_forms((sk,), (sv,), k_head_map=args.k_sparse_heads is not None)
            shared_rec = bench_shared_prefix(case, ref, fis, args.iters, args.shared_splits, forms)
        if shared_rec:
            for r in [shared_rec, *shared_rec.get("variants", [])]:
                lines.append(f"{layout} S_K={sk} S_V={sv} shared-prefix decode ({shared_rec['column_sets']} column sets, "
                             f"{r['tile']} tile, forms {'/'.join(r['forms'])}, {r['shared_splits']} shared splits): {r['us']:.1f} us, "
                             f"FI {r['flashinfer_us']:.1f} us "
                             f"({shared_rec['flashinfer_backend']}), speedup {r['speedup']:.3f}, err {r['rel_err_vs_flashinfer']:.2e}")
                print(lines[-1], flush=True)
        del case
        torch.cuda.empty_cache()
        k_heads = Hkv if args.k_sparse_heads is None else args.k_sparse_heads
        ideal = compression_ratio(sk * k_heads / Hkv, sv)
        record = dict(kernel="decode", S_K=sk, S_V=sv, k_sparse_heads=args.k_sparse_heads,
                      effective_S_K=sk * k_heads / Hkv, batch=bs, context=L, head_dim=D, dtype=args.dtype, layout=layout,
                      shared_prefixes=distinct if distinct < bs else None,
                      q_heads=Hq, kv_heads=Hkv, block_size=64, ours_us=None, flashinfer_us=round(fi_us[fast], 2),
                      flashinfer_plain_us=round(fi_plain[fast], 2), flashinfer_backend=f"{fast} (tensor-core decode)",
                      flashinfer_us_by_backend={b: round(t, 2) for b, t in fi_us.items()}, speedup=None,
                      speedup_vs_fa2=None, ideal_speedup=round(ideal, 4), kv_dtype=getattr(args, "kv_dtype", "auto"),
                      ideal_speedup_vs_fp8=round(dense_fp8_bytes / nbytes, 4) if fp8 else None,
                      kv_bytes=nbytes, device=name,
                      timing=f"CUDA-graph replays of {args.iters} calls, ours alternating with the fastest FlashInfer "
                             f"backend (the others timed after), median of 7",
                      setup_s=round(time.time() - t0, 1))
        default = [r for r in results if r["default"] and r["rel_err_vs_flashinfer"] < 2e-2]
        if default:
            d0 = default[0]
            if "fa2" in fi_us:
                record["speedup_vs_fa2"] = round(fi_us["fa2"] / d0["ours_us"], 4)
            record.update(ours_us=d0["ours_us"], ours_plain_us=d0["ours_plain_us"], speedup=d0["speedup"],
                          variant=d0["variant"], rel_err_vs_flashinfer=d0["rel_err_vs_flashinfer"],
                          ours_GBps=round(nbytes / d0["ours_us"] / 1e3, 1))
        if len(results) > 1:
            record["variants"] = [{k: v for k, v in r.items() if k != "default"} for r in results]
        if shared_rec:
            record["shared_prefix_decode"] = shared_rec
        record["mode"] = "full"
        records.append(record)
        for mode in [m for m in (args.modes or "").split(",") if m]:
            rec = bench_mode(case_for_modes, mode, args, ref_full=record, fis=fis_for_modes)
            lines.append(f"{layout} S_K={sk} S_V={sv} mode {mode} (top {args.decode_topk}, tau {args.decode_tau}, "
                         f"anchors 1 in {args.anchor_every}): anchor layer {rec['anchor_us']:.1f} us (kernel "
                         f"{rec['anchor_kernel_us']:.1f}, choice {rec['choose_us']:.1f}), other layers "
                         f"{rec['selected_us']:.1f} us ({rec['selected_splits']} splits) reading "
                         f"{rec['blocks_read_per_request']:.1f} of "
                         f"{rec['blocks_per_request']:.0f} blocks; per layer {rec['ours_us']:.1f} us, "
                         f"{rec['speedup']:.3f}x FI {rec['flashinfer_backend'].split()[0]}, "
                         f"{rec['speedup_vs_full']:.3f}x our full decode")
            print(lines[-1], flush=True)
            records.append(rec)
        del case_for_modes, fis_for_modes
    return records, lines


def bench_mode(case: dict, mode: str, args, ref_full: dict, fis: dict) -> dict:
    """A decode mode (``sglang_hs.decode_modes``) on the case: an anchor layer (every block read, with
    the per-block LSE, then the choice and the table compaction) and a layer between anchors (the
    compacted table), each timed as CUDA-graph replays beside FlashInfer's backends; the per-layer time
    is their mix at one anchor in ``--anchor-every`` layers. ``ref_full``: the case's full-decode record."""
    from sglang_hs.decode_modes import BlockSelection
    from sglang_hs.kernels.decode import HieraSparseDecode

    q = case["q"]
    bs, hq, d = q.shape
    a = run_args(case)
    plan = HieraSparseDecode(bs, hq, case["k_cache"].shape[1], d, 64, case["max_blocks"], q.dtype, q.device,
                             block_lse=True)  # fmt: skip
    rule = BlockSelection(mode, frozenset({0}), args.decode_topk, args.decode_tau)
    chosen = {}
    counts = torch.zeros(2, dtype=torch.int64, device=q.device)

    def anchor():
        _, block_lse = plan.run(*a, return_block_lse=True)
        chosen["table"], chosen["lens"] = rule.apply(block_lse, case["block_table"], case["seq_lens"], 64, counts)

    anchor()
    table, lens = chosen["table"].clone(), chosen["lens"].clone()
    read = ((lens.long() + 63) // 64).float().mean().item()
    selected = lambda: plan.run(*a[:6], table, lens, case["sm_scale"])  # noqa: E731
    anchor_kernel = lambda: plan.run(*a, return_block_lse=True)  # noqa: E731
    fi_us, (anchor_us, selected_us, kernel_us) = time_beside_fastest(fis, [anchor, selected, anchor_kernel],
                                                                     args.iters)  # fmt: skip
    fast = min(fi_us, key=fi_us.get)
    per_layer = (anchor_us + (args.anchor_every - 1) * selected_us) / args.anchor_every
    blocks = ((case["seq_lens"].long() + 63) // 64).float().mean().item()
    return dict(
        kernel="decode", mode=mode, S_K=ref_full["S_K"], S_V=ref_full["S_V"], batch=bs, context=ref_full["context"],
        layout=ref_full["layout"], q_heads=hq, kv_heads=case["k_cache"].shape[1], head_dim=d, dtype=ref_full["dtype"],
        block_size=64, decode_topk=args.decode_topk, decode_tau=args.decode_tau if mode == "psa" else None,
        anchor_every=args.anchor_every, blocks_per_request=round(blocks, 1), blocks_read_per_request=round(read, 1),
        anchor_us=round(anchor_us, 2), anchor_kernel_us=round(kernel_us, 2), choose_us=round(anchor_us - kernel_us, 2),
        selected_us=round(selected_us, 2), selected_splits=plan.splits(bs, case["block_table"].shape[1]),
        ours_us=round(per_layer, 2),
        full_us=ref_full["ours_us"], speedup_vs_full=round(ref_full["ours_us"] / per_layer, 4)
        if ref_full["ours_us"] else None,
        flashinfer_us=round(fi_us[fast], 2), flashinfer_backend=f"{fast} (tensor-core decode)",
        flashinfer_us_by_backend={b: round(t, 2) for b, t in fi_us.items()}, speedup=round(fi_us[fast] / per_layer, 4),
        device=ref_full["device"],
        timing=f"CUDA-graph replays of {args.iters} calls, the fastest FlashInfer backend, the anchor layer and a "
               f"layer between anchors side by side; per layer = (anchor + {args.anchor_every - 1} others) / "
               f"{args.anchor_every}; random keys, so the attention is flat and the top-k / budget, not the "
               f"data, sets the blocks read",
    )


def bench_shared_prefix(case: dict, ref: torch.Tensor, fis: dict, iters: int, splits: str | None = None,
                        forms: tuple[str, str] = ANY_FORMS) -> dict | None:  # fmt: skip
    """The shared-prefix decode (:mod:`sglang_hs.kernels.decode_shared`) of a batch whose requests share
    prefixes, each keeping its last block to its own pass (a request's own tokens), timed side by side
    with FlashInfer's backends (``fis``: backend -> run()) as CUDA-graph replays, per layer (the step's
    tables are built once, as a server builds them once per decode step). ``forms``: the shared pass's
    block forms (the compressed blocks' forms, as a server plans them); with fewer than every form the
    every-form kernel is timed too (a variant). ``splits``: comma list of shared-pass split counts to
    time besides the plan's own (``variants``)."""
    from sglang_hs.kernels.decode_shared import SharedPrefixDecode
    from sglang_hs.kernels.shared_pass_extend import SHARED_TILE

    q = case["q"]
    bs, hq, d = q.shape
    q, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale = run_args(case)
    results = []
    runs = [(None, tuple(forms)), *((int(x), tuple(forms)) for x in (splits or "").split(",") if x)]
    if tuple(forms) != ANY_FORMS:
        runs.append((None, ANY_FORMS))
    for forced, run_forms in runs:
        plan = SharedPrefixDecode(bs, hq, k_cache.shape[1], d, case["block_size"], case["max_blocks"], q.dtype,
                                  q.device, shared_splits=forced, forms=run_forms)  # fmt: skip
        step = plan.plan_step(block_table, seq_lens, k_index, v_index, min_own_blocks=1)  # once per step, not per layer
        sets = int((step.members[:, 0] >= 0).sum())
        if not sets:
            return None
        out = torch.empty_like(q)
        fn = lambda: out.copy_(plan.run(q, k_cache, v_cache, pools, k_index, v_index, step, sm_scale))  # noqa: E731
        fn()
        torch.cuda.synchronize()
        err = rel_err(out, ref)
        fi_us, (g,) = time_beside_fastest(fis, [fn], iters)
        err = max(err, rel_err(out, ref))
        fast = min(fi_us, key=fi_us.get)
        results.append(dict(us=round(g, 2), flashinfer_us=round(fi_us[fast], 2), speedup=round(fi_us[fast] / g, 4),
                            flashinfer_us_by_backend={b: round(t, 2) for b, t in fi_us.items()},
                            flashinfer_backend=f"{fast} (tensor-core decode)", rel_err_vs_flashinfer=err,
                            shared_splits=int(step.shared_splits[0]), forms=list(run_forms),
                            tile=SHARED_TILE))  # fmt: skip
        if len(results) == 1:
            first = dict(sets=sets, shared_blocks=(step.shared_lens[:sets] // case["block_size"]).tolist())
    record = dict(results[0], column_sets=first["sets"], fold=plan.fold, shared_blocks=first["shared_blocks"],
                  own_blocks_per_request=1)
    if len(results) > 1:
        record["variants"] = results[1:]
    return record


def plot_decode(records: list[dict], path: str) -> bool:
    """Times and speedups of the decode records (their first layout) as bars."""
    plt = pyplot()
    records = [r for r in records if r.get("kernel", "decode") == "decode" and r.get("mode", "full") == "full"]
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
    # Records of requests sharing prefixes also carry the shared-prefix decode: a third bar where present.
    shared = [(i, r["shared_prefix_decode"]) for i, r in enumerate(recs) if r.get("shared_prefix_decode")]
    w = 0.27 if shared else 0.4
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(4 + 1.1 * len(recs), 4.4))
    a1.bar([i - w / 2 for i in x], [r["flashinfer_us"] for r in recs], w, label="FlashInfer (dense)")
    a1.bar([i + w / 2 for i in x], [r["ours_us"] for r in recs], w, label="HieraSparse (TileLang)")
    a2.bar([i - w / 2 for i in x], [r["speedup"] for r in recs], w, label="measured")
    if shared:
        a1.bar([i + 1.5 * w for i, _ in shared], [d["us"] for _, d in shared], w, label="shared-prefix decode")
        a2.bar([i + 1.5 * w for i, _ in shared], [d["speedup"] for _, d in shared], w,
               label="shared-prefix decode (its own FlashInfer time)")  # fmt: skip
    a1.set_xticks(list(x), labels)
    a1.set_ylabel("decode attention time (us)")
    a1.set_ylim(0, 1.3 * max([r["flashinfer_us"] for r in recs] + [1]))
    a1.legend(loc="upper left", ncol=3)
    a2.bar([i + w / 2 for i in x], [r["ideal_speedup"] for r in recs], w, label="ideal (byte ratio)")
    a2.axhline(1.0, color="k", lw=0.8)
    a2.set_xticks(list(x), labels)
    a2.set_ylabel("speedup vs FlashInfer")
    a2.set_ylim(0, 1.3 * max([r["ideal_speedup"] for r in recs] + [d["speedup"] for _, d in shared] + [1]))
    a2.legend(loc="upper left", ncol=3)
    fig.suptitle(f"Decode, batch {r0.get('batch')} (unless noted), {r0.get('context')} tokens, 32/8 heads, d=128, "
                 f"{r0.get('dtype', 'float16')} "
                 f"- {r0.get('device', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def decode_main(args) -> None:
    """Run, then write ``OUT/kernels_<gpu>.json`` (``<gpu>``: h100 or h200, from the device's name),
    ``OUT/bench_decode.log`` and ``OUT/kernels_<gpu>.png``."""
    os.makedirs(args.out, exist_ok=True)
    records, lines = bench_decode(args)
    tag = device_tag(torch.cuda.get_device_name())
    with open(os.path.join(args.out, f"kernels_{tag}.json"), "w") as f:
        json.dump(records, f, indent=1)
    with open(os.path.join(args.out, "bench_decode.log"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot_decode(records, os.path.join(args.out, f"kernels_{tag}.png"))
    print(f"{'layout':>9} {'mode':>8} {'S_K':>4} {'S_V':>4} {'ours_us':>9} {'FI_us':>8} {'speedup':>8} {'ideal':>6}")
    for r in records:
        print(f"{r.get('layout', ''):>9} {r['mode']:>8} {r['S_K']:4g} {r['S_V']:4g} {r['ours_us'] or float('nan'):9.1f} "
              f"{r['flashinfer_us']:8.1f} {r['speedup'] or float('nan'):8.3f} {r.get('ideal_speedup', float('nan')):6.3f}")
