"""The extend plan's time on the benchmark's case for another ``kernels/`` tree, to set a branch's kernels
beside the installed ones without installing the branch (GPU).

    git worktree add /tmp/wt BRANCH
    python lab/time_extend_kernels.py --label main --stages 2
    python lab/time_extend_kernels.py --label branch --kernels /tmp/wt/kernels --stages 2

Batch 8 x 32K prefix + n new tokens for n in ``--tokens``, Llama-3.1-8B heads, fp16, ``--sk``/``--sv``
(default 1/1), natural pool order, tile n128 at ``--stages``. ``--kernels DIR`` imports
``sglang_hs.kernels`` from DIR in this process (its kernels compile into, or load from, TileLang's cache
under their own source digest). Each time: ``--settle-ms`` of untimed calls (the power limiter's
state, ``power_settle.py``), then the median of 5 stretches of back-to-back calls. One JSON line per
size with the mean SM clock and board power of a further 200 ms of calls. Run the trees in turn, the
first again last, to see the drift; there is no FlashInfer baseline here (``sglang_hs.kernels.bench``).
"""

import argparse
import json
import sys
import time
import types


def use_kernels_tree(path: str) -> None:
    """Make ``sglang_hs.kernels`` the package at ``path`` for this process (before any of it is imported)."""
    import sglang_hs

    package = types.ModuleType("sglang_hs.kernels")
    package.__path__ = [path]
    sys.modules["sglang_hs.kernels"] = package
    sglang_hs.kernels = package


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=None, help="a kernels/ tree to import instead of the installed one")
    ap.add_argument("--label", default="installed")
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--tokens", default="128,256,2048")
    ap.add_argument("--sk", type=float, default=1.0)
    ap.add_argument("--sv", type=float, default=1.0)
    ap.add_argument("--settle-ms", type=float, default=300.0)
    args = ap.parse_args(argv)
    if args.kernels:
        use_kernels_tree(args.kernels)
    import torch

    from profile_extend import benchmark_case  # after use_kernels_tree: it imports sglang_hs.kernels
    from sglang_hs.kernels.cases import extend_run_args
    from sglang_hs.kernels.timing import ClockSampler, run_for, time_stream

    for n in [int(x) for x in args.tokens.split(",")]:
        case, plan = benchmark_case(n, args.sk, args.sv, tile="n128", stages=args.stages)
        run_args = extend_run_args(case)

        def call():
            plan.run(*run_args)

        call()
        torch.cuda.synchronize()
        run_for(call, args.settle_ms)
        us = time_stream(call, iters=20 if n <= 256 else 5, reps=5)
        clock = ClockSampler()
        t0 = time.time()
        run_for(call, 200)
        mhz, watts = clock.mean([(t0, time.time())])
        clock.stop()
        print(json.dumps(dict(label=args.label, kernels=args.kernels, device=torch.cuda.get_device_name(),
                              new_tokens=n, S_K=args.sk, S_V=args.sv, us=round(us, 1), sm_mhz=mhz, watts=watts,
                              config=str(plan.last_config))), flush=True)
        del case, plan, run_args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
