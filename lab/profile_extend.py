"""Three launches of the extend kernel on the benchmark's shape, for Nsight Compute.

    ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:hs_extend --section SpeedOfLight \
        --section WarpStateStats --section SourceCounters python3 lab/profile_extend.py --new-tokens 256

Batch 8 x 32K prefix (``--sk``, ``--sv``: default S_K = S_V = 1; natural pool order) plus
``--new-tokens`` per request, 32/8 heads, d 128, fp16, tile ``--tile`` (default n128: the producer
schedule) with ``--stages`` (default: the tile's). The first two launches load or compile the kernel and warm the caches; profile the third.
"""

import argparse

import torch

from sglang_hs.kernels.cases import extend_run_args, make_extend_case
from sglang_hs.kernels.extend import STAGES, TILES, HieraSparseExtend


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tile", default="n128", choices=sorted(TILES))
    ap.add_argument("--stages", type=int, default=None, help=f"per tile: {STAGES}")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--sk", type=float, default=1.0)
    ap.add_argument("--sv", type=float, default=1.0)
    args = ap.parse_args(argv)
    case = make_extend_case([32768] * 8, [args.new_tokens] * 8, 32, 8, 128, args.sk, args.sv, torch.float16, "cuda",
                            seed=11, magnitude=False, shuffle=False)
    plan = HieraSparseExtend(32, 8, 128, 64, case["max_blocks"], torch.float16, "cuda", tile=args.tile,
                             stages=args.stages)
    run_args = extend_run_args(case)
    for _ in range(3):
        plan.run(*run_args)
    torch.cuda.synchronize()
    print(plan.last_config)


if __name__ == "__main__":
    main()
