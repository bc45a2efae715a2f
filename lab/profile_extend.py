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


def benchmark_case(new_tokens: int, sk: float, sv: float, seed: int = 11, device="cuda", batch: int = 8,
                   prefix: int = 32768, **plan_kw):
    """``(case, plan)``: the extend benchmark's shape (batch 8 x 32K prefix + ``new_tokens``, 32/8 heads,
    d 128, fp16, natural pool order; or ``batch`` x ``prefix``) and a ``HieraSparseExtend`` over it
    (``plan_kw``: tile, stages, num_splits)."""
    case = make_extend_case([prefix] * batch, [new_tokens] * batch, 32, 8, 128, sk, sv, torch.float16, device,
                            seed=seed, magnitude=False, shuffle=False)
    return case, HieraSparseExtend(32, 8, 128, 64, case["max_blocks"], torch.float16, device, **plan_kw)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tile", default="n128", choices=sorted(TILES))
    ap.add_argument("--stages", type=int, default=None, help=f"per tile: {STAGES}")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--sk", type=float, default=1.0)
    ap.add_argument("--sv", type=float, default=1.0)
    args = ap.parse_args(argv)
    case, plan = benchmark_case(args.new_tokens, args.sk, args.sv, tile=args.tile, stages=args.stages)
    run_args = extend_run_args(case)
    for _ in range(3):
        plan.run(*run_args)
    torch.cuda.synchronize()
    print(plan.last_config)


if __name__ == "__main__":
    main()
