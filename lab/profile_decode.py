"""Three launches of the decode kernel on the benchmark's shape, for Nsight Compute.

    ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:hs_decode --section SpeedOfLight \
        --section WarpStateStats python3 lab/profile_decode.py --sk 1 --sv 1

Batch 8 x 32K (``--sk``, ``--sv``; natural pool order), 32/8 heads, d 128, fp16, the plan's split count
(or ``--num-splits``). The first two calls load or compile the kernel and warm the caches; profile the
third. Where a server runs the compact kernel (S_K = S_V = 1: ``hs_decode_ss``), ``--plain`` runs the
any-form one (``hs_decode``) instead.
"""

import argparse

import torch

from sglang_hs.kernels.cases import make_case, run_args
from sglang_hs.kernels.decode import HieraSparseDecode, decode_compact
from sglang_hs.kernels.decode_shared import compressed_forms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sk", type=float, default=1.0)
    ap.add_argument("--sv", type=float, default=1.0)
    ap.add_argument("--num-splits", type=int, default=None)
    ap.add_argument("--plain", action="store_true", help="the any-form kernel even where a server runs the compact one")
    args = ap.parse_args(argv)
    case = make_case([32768] * 8, 32, 8, 128, args.sk, args.sv, torch.float16, "cuda", seed=11, magnitude=False,
                     shuffle=False)
    compact = None if args.plain else decode_compact(compressed_forms((args.sk,), (args.sv,)), 128)
    plan = HieraSparseDecode(8, 32, 8, 128, 64, case["max_blocks"], torch.float16, "cuda", num_splits=args.num_splits,
                             compact=compact)  # fmt: skip
    a = run_args(case)
    for _ in range(3):
        plan.run(*a)
    torch.cuda.synchronize()
    print(f"splits {plan.num_splits}, compact {plan.compact}")


if __name__ == "__main__":
    main()
