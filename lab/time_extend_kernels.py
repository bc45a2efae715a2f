"""The extend plan's time on the benchmark's case for another ``kernels/`` tree, to set a branch's kernels
beside the installed ones without installing the branch (GPU).

    git worktree add /tmp/wt BRANCH
    python lab/time_extend_kernels.py --label main --stages 2
    python lab/time_extend_kernels.py --label branch --kernels /tmp/wt/kernels --stages 2

Batch 8 x 32K prefix (``--batch`` x ``--prefix``) + n new tokens for n in ``--tokens``, Llama-3.1-8B heads,
fp16, ``--sk``/``--sv`` (default 1/1), natural pool order, tile n128 at ``--stages``. ``--kernels DIR`` imports
``sglang_hs.kernels`` from DIR in this process (its kernels compile into, or load from, TileLang's cache
under their own source digest). Each time: ``--settle-ms`` of untimed calls (the power limiter's
state, ``power_settle.py``), then the median of 5 stretches of back-to-back calls. One JSON line per
size with the mean SM clock and board power of a further 200 ms of calls (``--clock-reasons``: and what
holds the clock, NVML's clock event reasons over 300 ms more). Run the trees in turn, the
first again last, to see the drift; there is no FlashInfer baseline here (``sglang_hs.kernels.bench``).

``--forms K,V`` builds the kernel whose stages hold only those block forms (``ExtendParts``);
``--all-compressed`` then replaces every cache-page entry of the block table with the first compressed
block, so that such a kernel may take the table (its results are wrong; times only).
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


def clock_event_reasons(call, ms: float = 300.0) -> dict:
    """NVML's clock event reasons while ``call`` runs back to back for ``ms``: each reason's share of the
    samples (one every three calls), ``{}`` without NVML. Says what holds the SM clock below its maximum
    (``SwPowerCap``: the board's power limiter; it is reported at mean powers far below the cap, so it
    answers power above the mean NVML shows, inferred in ``docs/kernels.md``)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        read = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    except Exception:  # noqa: BLE001 (no NVML)
        return {}
    prefix = "nvmlClocksThrottleReason"
    bits = {getattr(pynvml, n): n[len(prefix):] for n in dir(pynvml)
            if n.startswith(prefix) and n[len(prefix):] not in ("None", "All") and isinstance(getattr(pynvml, n), int)}
    counts, samples, t0 = {}, 0, time.time()
    while time.time() - t0 < ms / 1000.0:
        for _ in range(3):
            call()
        mask = read(handle)
        samples += 1
        for bit, name in bits.items():
            if bit and mask & bit == bit:
                counts[name] = counts.get(name, 0) + 1
    return {name: round(c / samples, 2) for name, c in sorted(counts.items())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=None, help="a kernels/ tree to import instead of the installed one")
    ap.add_argument("--label", default="installed")
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--tokens", default="128,256,2048")
    ap.add_argument("--sk", type=float, default=1.0)
    ap.add_argument("--sv", type=float, default=1.0)
    ap.add_argument("--settle-ms", type=float, default=300.0)
    ap.add_argument("--forms", default=None, help="K,V forms of the stages (any, dense, sparse); default any,any")
    ap.add_argument("--all-compressed", action="store_true",
                    help="cache-page entries replaced by a compressed block (times only; for --forms)")
    ap.add_argument("--splits", type=int, default=None, help="force the split count")
    ap.add_argument("--batch", type=int, default=8, help="requests")
    ap.add_argument("--prefix", type=int, default=32768, help="cached tokens a request")
    ap.add_argument("--clock-reasons", action="store_true",
                    help="also NVML's clock event reasons over 300 ms more of calls (their shares of the samples)")
    args = ap.parse_args(argv)
    if args.kernels:
        use_kernels_tree(args.kernels)
    import torch

    from profile_extend import benchmark_case  # after use_kernels_tree: it imports sglang_hs.kernels
    from sglang_hs.kernels.cases import extend_run_args
    from sglang_hs.kernels.timing import ClockSampler, run_for, time_stream

    for n in [int(x) for x in args.tokens.split(",")]:
        plan_kw = dict(tile="n128", stages=args.stages, num_splits=args.splits)
        if args.forms:
            plan_kw["forms"] = tuple(args.forms.split(","))
        case, plan = benchmark_case(n, args.sk, args.sv, batch=args.batch, prefix=args.prefix, **plan_kw)
        if args.all_compressed:
            table = case["block_table"]
            case["block_table"] = torch.where(table >= 0, table[table < 0][0], table)
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
        reasons = clock_event_reasons(call) if args.clock_reasons else None
        print(json.dumps(dict(label=args.label, kernels=args.kernels, device=torch.cuda.get_device_name(),
                              batch=args.batch, prefix=args.prefix, new_tokens=n, S_K=args.sk, S_V=args.sv,
                              forms=args.forms or "any,any", all_compressed=args.all_compressed, us=round(us, 1),
                              sm_mhz=mhz, watts=watts,
                              config=str(plan.last_config),
                              **({"clock_reasons": reasons} if reasons is not None else {}))), flush=True)
        del case, plan, run_args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
