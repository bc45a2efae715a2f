"""Benchmark of the HieraSparse kernels against FlashInfer (one module per kernel, this one the CLI).

    python -m sglang_hs.kernels.bench --kernel decode --out DIR [--quick] [--variants] [--layouts ...]
        [--batch N] [--groups G] [--dtype bfloat16] [--max-blocks W] [--num-splits S]

writes ``DIR/kernels_<gpu>.json`` (``<gpu>``: h100 or h200) (one record per layout and (S_K, S_V): the default plan vs FlashInfer,
same process, same timing method; ``--variants`` adds the other kernel options under ``variants``)
and ``DIR/kernels_<gpu>.png`` (first layout). ``--plot JSON`` only redraws the PNG from a JSON.
``--groups G``: only G requests have their own KV and request r reads request r % G's, as requests
sharing prefixes do in a serving batch (``share_prefixes``); ``--max-blocks``: a server's block-table
width (``ceil((context length + 4) / 64)``); ``--num-splits``: force the plan's split count. The
workload and the timing: :mod:`sglang_hs.kernels.bench_decode`.

    python -m sglang_hs.kernels.bench --kernel extend --out DIR [--quick] [--variants | --variant TILE:STAGES ...]
        [--new-tokens 16,64,...]
    python -m sglang_hs.kernels.bench --kernel prefill --out DIR [--quick] [--variants] [--context L] [--batch N]

Extend over a cached prefix and full prefill over compressed KV (:mod:`sglang_hs.kernels.bench_extend`).
Write ``DIR/kernels_<gpu>.json`` (the committed results' other records plus one record per point),
``DIR/kernels_<gpu>_<kernel>.png`` and ``DIR/bench_<kernel>.log``. ``--variants`` also times the
kernel's other tiles and pipeline depths; ``--variant TILE:STAGES`` (repeatable, e.g. ``n128:3``)
times just the ones named.

    python -m sglang_hs.kernels.bench --kernel compress --out DIR [--merge JSON] [--flashinfer-us US]

The fused prune + compress of a ``--context``-token prefix (:mod:`sglang_hs.kernels.bench_compress`).

    python -m sglang_hs.kernels.bench --kernel warm [--jobs J]

Builds, in parallel, the TileLang kernels and FlashInfer JIT modules the other kernels' runs load
(:mod:`sglang_hs.kernels.bench_warm`), so that their first timed call does not wait minutes for them.

The synthetic inputs are those of the GPU tests (:mod:`sglang_hs.kernels.cases`).
"""

import argparse
import json
import os

from sglang_hs.kernels.bench_compress import compress_main
from sglang_hs.kernels.bench_decode import decode_main, plot_decode
from sglang_hs.kernels.bench_extend import SETTLE_MS, extend_main
from sglang_hs.kernels.bench_warm import warm_main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="decode", choices=["decode", "compress", "extend", "prefill", "warm"])
    ap.add_argument("--out", default="out")
    ap.add_argument("--batch", type=int, default=None, help="requests (default 8; prefill: 1)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--settle-ms", type=float, default=SETTLE_MS,
                    help="extend, prefill: untimed calls before each timed stretch (the power limiter's lag)")
    ap.add_argument("--quick", action="store_true", help="only S_K,S_V in {(0,1), (1,1)}")
    ap.add_argument("--points", default=None, metavar="SK:SV,...",
                    help="decode: the S_K:S_V points to time (e.g. 1:0 for K alone), instead of the default grid")
    ap.add_argument("--variants", action="store_true", help="also time the kernel's other tiles / pipeline depths")
    ap.add_argument("--variant", action="append", default=None, metavar="TILE:STAGES",
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
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                    help="decode: fp8_e4m3 = an FP8 store and FP8 cache pages (the kernel's cache_fp8 variant), "
                         "FlashInfer timed over the same values in --dtype and in e4m3 pages (backends '-fp8')")
    ap.add_argument("--layouts", default="natural,shuffled",
                    help="pool/page layouts to time: natural (allocation order) and/or shuffled (random rows)")
    ap.add_argument("--plot", metavar="JSON", help="only redraw the PNG of an existing JSON")
    ap.add_argument("--new-tokens", default="64,16,256,1024,2048",
                    help="extend: new tokens per request (64, the headline point, first)")
    ap.add_argument("--fi-backends", default="fa2,fa3",
                    help="FlashInfer backends timed side by side (decode: tensor-core decode; extend, prefill: paged "
                    "prefill); ratios are against the fastest. SGLang's FlashInfer backend uses fa2 for both")
    ap.add_argument("--shared-splits", default=None,
                    help="decode with --groups: shared-pass split counts to time besides the plan's (comma list)")
    ap.add_argument("--flashinfer-us", type=float, help="compress: dense prefill time (us, all layers) to use "
                    "instead of measuring FlashInfer")
    ap.add_argument("--k-sparse-heads", type=int, default=None, metavar="N",
                    help="decode: S_K applies to N of the 8 KV heads of the layer (a K head map), the others keep K dense")
    ap.add_argument("--k-head-share", type=float, default=None, metavar="SHARE",
                    help="compress: also time S_K = 1 and 0.5 (S_V = 1) with a K head map of this share (a "
                         "seeded random map: the time does not depend on which heads)")
    ap.add_argument("--modes", default=None, metavar="kascade,psa",
                    help="decode: also time these decode modes (records with mode; 'full' is the plain decode)")
    ap.add_argument("--decode-topk", type=int, default=64, help="decode modes: compressed blocks read (at most, psa)")
    ap.add_argument("--decode-tau", type=float, default=0.9, help="psa: attention-mass share to reach")
    ap.add_argument("--anchor-every", type=int, default=4, help="decode modes: one anchor layer in this many")
    ap.add_argument("--jobs", type=int, default=None, help="warm: TileLang compile processes (default: CPUs)")
    ap.add_argument("--merge", default=None, help="extend, prefill, compress: results JSON whose other records are "
                    "kept (default: the committed launch/results/kernels_<gpu>.json)")
    args = ap.parse_args(argv)
    if args.batch is None:
        args.batch = 1 if args.kernel == "prefill" else 8
    for flag in ("batch", "groups", "max_blocks", "num_splits"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    variants = []  # --variant, parsed once into (tile, stages)
    for v in args.variant or ():
        parts = v.split(":")
        if len(parts) != 2 or not parts[1].isdigit():
            ap.error(f"--variant {v!r}: expected TILE:STAGES, e.g. n128:3")
        variants.append((parts[0], int(parts[1])))
    args.variant = variants
    if args.points is not None:
        text = args.points
        try:
            args.points = [tuple(float(x) for x in p.split(":")) for p in text.split(",")]
        except ValueError:
            args.points = []
        if not args.points or any(len(p) != 2 or not all(0 <= x <= 1 for x in p) for p in args.points):
            ap.error(f"--points {text!r}: expected S_K:S_V pairs in [0, 1], e.g. 1:0,0:1")
    if args.plot:
        with open(args.plot) as f:
            plot_decode(json.load(f), os.path.splitext(args.plot)[0] + ".png")
        return
    if args.kernel == "warm":
        return warm_main(args)
    if args.kernel == "compress":
        return compress_main(args)
    if args.kernel in ("extend", "prefill"):
        return extend_main(args)
    return decode_main(args)


if __name__ == "__main__":
    main()
