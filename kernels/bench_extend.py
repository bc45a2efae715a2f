"""``--kernel extend`` and ``--kernel prefill`` of :mod:`sglang_hs.kernels.bench`: the extend kernel
against FlashInfer's paged prefill.

Extend: batch 8, each request a 32K-token cached prefix (1 sink page, compressed blocks, 4 window
pages; natural order) plus n new tokens in cache pages for n in ``--new-tokens``; S in {(0,0), (0,1),
(1,1)}; ``HieraSparseExtend`` against FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (causal,
NHD, page 64, each backend of ``--fi-backends``: fa2, as SGLang, and fa3) over the same pruned KV, timed
in alternation: 7 rounds, each ``--iters`` back-to-back eager calls of each FlashInfer backend, then of the default
plan, each stretch after ``--settle-ms`` of untimed calls of the same function (CUDA events, medians; a
quarter of the calls above 256 new tokens; the other variants afterwards, median of 5). ``speedup_by_round``: the
default plan's ratio to the fastest backend in each round, so that a median near 1.0 can be read against its spread.

Prefill: N (default 1) sequences of L tokens whose KV has the compressed layout over the whole
sequence, every position a query (causal), as a chunked prefill that prunes its chunks would see;
the same kernel and baselines, plus FlashInfer's ragged prefill over contiguous K and V (backend
``auto``, which is what SGLang's FlashInfer backend runs for a prompt without a cached prefix). Speedups
are against the fastest baseline (``flashinfer_backend``); ``speedup_vs_fa2`` is against paged fa2.
"""

import functools
import json
import os
import time

import torch

from sglang_hs.format import compression_ratio
from sglang_hs.kernels.cases import (
    extend_flops, extend_run_args, flashinfer_extend, flashinfer_ragged_prefill, kv_bytes, make_extend_case, paged_dense,
    rel_err,
)
from sglang_hs.kernels.timing import (
    ClockSampler, device_tag, run_for, time_beside_fastest, time_interleaved, time_stream,
)
from sglang_hs.plotting import pyplot

SETTLE_MS = 300.0
"""Untimed calls (ms) before each timed stretch: long enough for the GPU's power limiter to settle on the
kernel being timed (``lab/power_settle.py``: on an H200 the settled times of 200 and 500 ms agree)."""

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "results")
"""The committed results, whose other kernels' records a run keeps."""


def results_json(tag: str) -> str:
    """The committed kernel record of a device tag (``kernels_h100.json``, ``kernels_h200.json``)."""
    return os.path.join(RESULTS_DIR, f"kernels_{tag}.json")


def bench_extend(args, on_record=None):
    """The extend regime: ``--batch`` requests, each a ``--context``-token cached prefix (1 sink
    page, compressed blocks, 4 window pages) plus n new tokens for n in ``--new-tokens``; Llama-3.1-8B
    heads (32/8, d 128, fp16); against FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (causal, page
    64, backends ``--fi-backends``) over the same pruned KV, in one process, same timing method.
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
    named = args.variant or (BENCH_VARIANTS if args.variants else [])  # (tile, stages)
    variants += [dict(tile=tile, stages=stages) for tile, stages in named]
    records, lines = [], []

    def log(msg):
        lines.append(msg)
        print(msg, flush=True)

    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    clocks = ClockSampler(dev.index or 0)
    for n in new_list:
        iters = args.iters if n <= 256 else max(3, args.iters // 4)
        for sk, sv in points:
            t0 = time.time()
            case = make_extend_case([P] * bs, [n] * bs, Hq, Hkv, D, sk, sv, dtype, dev, seed=int(sk * 10 + sv) + n,
                                    magnitude=False, shuffle=False, compress_new=prefill)
            paged = paged_dense(case)
            fis = {}  # baseline name -> run(); the first (fa2, SGLang's paged prefill) is the reference
            for backend in args.fi_backends.split(","):
                fis[f"paged {backend}"] = flashinfer_extend(case, paged, workspace, backend)
            if prefill:  # what SGLang's FlashInfer backend runs for a prompt without a cached prefix
                ragged, chosen = flashinfer_ragged_prefill(case, paged, workspace)
                fis[f"ragged {chosen}"] = ragged
            t1 = time.time()
            ref = None
            for label, fi in list(fis.items()):
                try:
                    o = fi()
                    ref = o.clone() if ref is None else ref
                    if rel_err(o, ref) > 2e-2:
                        raise RuntimeError(f"differs from {next(iter(fis))}: rel. error {rel_err(o, ref):.2e}")
                except Exception as e:  # a backend this FlashInfer build lacks is reported, not fatal
                    log(f"n={n} S_K={sk} S_V={sv} FlashInfer {label}: failed: {str(e).splitlines()[-1][:200]}")
                    fis.pop(label)
            torch.cuda.synchronize()
            fi_first_s = time.time() - t1  # includes FlashInfer's JIT compile on first use
            fi_us, fi_mhz = None, {}  # baseline -> us (timed with the default plan, in alternation), its SM clock
            by_round = {}  # fn -> its time in each round of the alternation
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
                windows = {}  # fn -> wall-time spans of its timed stretches (for the clock beside each time)
                if fi_us is None:
                    timer = functools.partial(time_interleaved, settle_ms=args.settle_ms, windows=windows,
                                              by_round=by_round)
                    fi_us, (g,) = time_beside_fastest(fis, [fn], iters, timer=timer)
                    fi_mhz = {b: clocks.mean_mhz(windows.get(fi)) for b, fi in fis.items()}
                else:
                    run_for(fn, args.settle_ms)
                    t2 = time.time()
                    g = time_stream(fn, iters)
                    windows[fn] = [(t2, time.time())]
                mhz = clocks.mean_mhz(windows[fn])
                err = max(err, rel_err(out, ref))  # the output of the last timed call too
                desc = dict(plan.last_config)
                fast = min(fi_us, key=fi_us.get)
                rounds = [round(f / o, 4) for f, o in zip(by_round.get(fis[fast], []), by_round.get(fn, []))]
                per_clock = round(fi_us[fast] * fi_mhz[fast] / (g * mhz), 4) if mhz and fi_mhz[fast] else None
                results.append(dict(variant=desc, default=not var, ours_us=round(g, 2), sm_mhz=mhz,
                                    speedup=round(fi_us[fast] / g, 4), speedup_per_clock=per_clock,
                                    rel_err_vs_flashinfer=err, **({"speedup_by_round": rounds} if rounds else {})))
                log(f"n={n} S_K={sk} S_V={sv} {desc}{' (default)' if not var else ''}: ours {g:.1f} us FI "
                    + ", ".join(f"{b} {t:.1f} us" for b, t in fi_us.items())
                    + f" speedup {fi_us[fast] / g:.3f} vs {fast}"
                    + (f" (rounds {min(rounds):.3f}-{max(rounds):.3f})" if rounds else "")
                    + f" (per clock {per_clock}: {mhz} against {fi_mhz[fast]} MHz)"
                    f" err {err:.2e} TFLOP/s {flops / g / 1e6:.0f} (FI {flops / fi_us[fast] / 1e6:.0f}) "
                    f"GB/s {nbytes / g / 1e3:.0f}")
            if fi_us is None:  # no variant ran
                fi_us = {b: time_stream(fi, iters) for b, fi in fis.items()}
            fast = min(fi_us, key=fi_us.get)
            del case, paged, ref
            torch.cuda.empty_cache()
            s = sk + sv
            ideal_compute = round(4.0 / (4.0 - s), 4)  # the GEMMs' ratio: 2:4 halves an operand's work
            # prefill: the queries are the whole sequence, so its length (context) says it all
            record = dict(kernel=args.kernel, S_K=sk, S_V=sv, batch=bs, context=n if prefill else P,
                          **({} if prefill else {"new_tokens": n}), head_dim=D,
                          dtype="float16", q_heads=Hq, kv_heads=Hkv, block_size=64, ours_us=None,
                          flashinfer_us=round(fi_us[fast], 2), speedup=None, flashinfer_backend=fast,
                          flashinfer_us_by_backend={b: round(t, 2) for b, t in fi_us.items()}, speedup_vs_fa2=None,
                          ideal_speedup_bytes=round(compression_ratio(sk, sv), 4),
                          ideal_speedup_compute=ideal_compute,
                          # at these sizes the kernels are compute-bound: the ideal is the GEMMs' ratio
                          ideal_speedup=ideal_compute, kv_bytes=nbytes, flops=flops,
                          flashinfer_sm_mhz=fi_mhz.get(fast), sm_mhz=None, speedup_per_clock=None,
                          device=name, timing=f"{iters} back-to-back eager calls, CUDA events, median of 7 rounds "
                                              "alternating the fastest FlashInfer backend and the default plan, the other "
                                              f"backends after them (variants: median of 5); each timed stretch after "
                                              f"{args.settle_ms:g} ms of untimed calls of its function (its own power "
                                              "state); speedup_per_clock scales each time by its mean SM clock (NVML)",
                          flashinfer_first_call_s=round(fi_first_s, 1), setup_s=round(t1 - t0, 1))
            default = [r for r in results if r["default"] and r["rel_err_vs_flashinfer"] < 2e-2]
            if default:
                d0 = default[0]
                if "paged fa2" in fi_us:
                    record["speedup_vs_fa2"] = round(fi_us["paged fa2"] / d0["ours_us"], 4)
                record.update(ours_us=d0["ours_us"], speedup=d0["speedup"], variant=d0["variant"],
                              sm_mhz=d0["sm_mhz"], speedup_per_clock=d0["speedup_per_clock"],
                              rel_err_vs_flashinfer=d0["rel_err_vs_flashinfer"],
                              ours_TFLOPs=round(flops / d0["ours_us"] / 1e6, 1),
                              flashinfer_TFLOPs=round(flops / fi_us[fast] / 1e6, 1))
                if "speedup_by_round" in d0:  # the variants (timed after, alone) have no rounds
                    record["speedup_by_round"] = d0["speedup_by_round"]
            elif results:
                record["rel_err_vs_flashinfer"] = results[0]["rel_err_vs_flashinfer"]  # wrong: no speedup recorded
            if len(results) > 1:
                record["variants"] = [{k: v for k, v in r.items() if k != "default"} for r in results]
            records.append(record)
            if on_record is not None:
                on_record(records, lines)
    clocks.stop()
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
        line, = a1.plot(x, [r["speedup"] for r in rs], marker="o", label=f"S_K={sk:g}, S_V={sv:g}")
        per_clock = [(r[key], r["speedup_per_clock"]) for r in rs if r.get("speedup_per_clock")]
        if per_clock:  # the same speedup with each time scaled by its SM clock
            a1.plot(*zip(*per_clock), ls=":", marker=".", color=line.get_color(), label="  per clock")
        a2.plot(x, [r["ours_us"] for r in rs], marker="o", label=f"ours S_K={sk:g}, S_V={sv:g}")
    # FlashInfer's time over the (0, 0) points when there are some, else over the last setting's points.
    rs = sorted([r for r in recs if (r["S_K"], r["S_V"]) == (0.0, 0.0)] or rs, key=lambda r: r[key])
    a2.plot([r[key] for r in rs], [r["flashinfer_us"] for r in rs], "k--", marker="x", label="FlashInfer")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xlabel("sequence length (queries = keys)" if kernel == "prefill" else "new tokens per request")
        a.legend(loc="best", fontsize=8)
    a1.axhline(1.0, color="k", lw=0.8)
    a1.set_ylabel("speedup vs FlashInfer (dotted: per clock)")
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
    """``--kernel extend`` (or ``prefill``): run, then write ``OUT/kernels_<gpu>.json`` (``<gpu>``: h100 or h200,
    from the device's name) = the records of the results JSON (``--merge`` when given, else the committed
    ``launch/results/kernels_<gpu>.json``) other than this kernel's, plus these; ``OUT/kernels_<gpu>_<kernel>.png``
    and ``OUT/bench_<kernel>.log``."""
    os.makedirs(args.out, exist_ok=True)
    tag = device_tag(torch.cuda.get_device_name())
    merge = getattr(args, "merge", None) or results_json(tag)
    base = []
    if os.path.exists(merge):
        with open(merge) as f:
            base = [r for r in json.load(f) if r.get("kernel") != args.kernel]

    def save(records, lines):
        with open(os.path.join(args.out, f"kernels_{tag}.json"), "w") as f:
            json.dump(base + records, f, indent=1)
        with open(os.path.join(args.out, f"bench_{args.kernel}.log"), "w") as f:
            f.write("\n".join(lines) + "\n")

    records, lines = bench_extend(args, on_record=save)
    save(records, lines)
    plot_extend(records, os.path.join(args.out, f"kernels_{tag}_{args.kernel}.png"), args.kernel)
    print(f"{'tokens':>6} {'S_K':>4} {'S_V':>4} {'ours_us':>9} {'FI_us':>9} {'speedup':>8} {'/clock':>7} {'MHz':>5} "
          f"{'FI_MHz':>6} {'ideal_B':>7} {'ideal_C':>7}")
    for r in records:
        print(f"{r.get('new_tokens', r['context']):6d} {r['S_K']:4g} {r['S_V']:4g} {r['ours_us'] or float('nan'):9.1f} "
              f"{r['flashinfer_us']:9.1f} {r['speedup'] or float('nan'):8.3f} {r['speedup_per_clock'] or float('nan'):7.3f} "
              f"{r['sm_mhz'] or 0:5d} {r['flashinfer_sm_mhz'] or 0:6d} {r['ideal_speedup_bytes']:7.3f} "
              f"{r['ideal_speedup_compute']:7.3f}")
