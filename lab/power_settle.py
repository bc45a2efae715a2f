"""How long the GPU's power limiter takes to settle between kernels, and what that does to side-by-side
extend timings (GPU).

    python lab/power_settle.py [--new-tokens 128,256] [--settle-ms 0,50,200,500] [--out FILE.json]

The extend benchmark's case (batch 8 x 32K prefix + n new tokens, Llama-3.1-8B heads, fp16, S_V = 1 and
S_K = S_V = 1), our default plan against FlashInfer's fa3 paged prefill. For each ``--settle-ms``: rounds
of the benchmark's alternation (``timing.time_interleaved``), each timed stretch after that long of
untimed calls of the same function, with the SM clock and board power sampled (NVML,
``timing.ClockSampler``) and averaged over each function's timed stretches. Then each function alone
after a second of calls: the steady state of attention alone holding the GPU at its power cap. A settle
is long enough when the alternated times match the alone times; ``speedup_per_clock`` scales each time
by its clock.
"""

import argparse
import json
import sys
import time

import torch

from profile_extend import benchmark_case
from sglang_hs.kernels.cases import extend_run_args, flashinfer_extend, paged_dense
from sglang_hs.kernels.timing import ClockSampler, device_tag, run_for, time_interleaved, time_stream


def per_clock(rec: dict) -> dict:
    """The time ratio, and the ratio of cycles (each time scaled by its mean SM clock)."""
    fa3, ours = rec["fa3"], rec["ours"]
    cycles = fa3["sm_mhz"] and ours["sm_mhz"] and fa3["us"] * fa3["sm_mhz"] / (ours["us"] * ours["sm_mhz"])
    return dict(speedup_vs_fa3=round(fa3["us"] / ours["us"], 4),
                speedup_per_clock=round(cycles, 4) if cycles else None)  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", default="128,256")
    ap.add_argument("--settle-ms", default="0,50,200,500")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    sampler = ClockSampler()
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    records = []
    for n in (int(x) for x in args.new_tokens.split(",")):
        for sk, sv in ((0.0, 1.0), (1.0, 1.0)):
            case, plan = benchmark_case(n, sk, sv, seed=n, device=dev)
            fa3 = flashinfer_extend(case, paged_dense(case), workspace, "fa3")
            run_args = extend_run_args(case)
            ours = lambda: plan.run(*run_args)  # noqa: E731
            fns = {"fa3": fa3, "ours": ours}
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            for settle in (float(x) for x in args.settle_ms.split(",")):
                windows = {}
                us = time_interleaved(list(fns.values()), args.iters, args.rounds, settle, windows)
                rec = dict(new_tokens=n, S_K=sk, S_V=sv, mode="alternated", settle_ms=settle)
                for (name, fn), t in zip(fns.items(), us):
                    mhz, watts = sampler.mean(windows[fn])
                    rec[name] = dict(us=round(t, 1), sm_mhz=mhz, watts=watts)
                rec.update(per_clock(rec))
                records.append(rec)
                print(json.dumps(rec), flush=True)
            rec = dict(new_tokens=n, S_K=sk, S_V=sv, mode="alone", settle_ms=1000.0)
            for name, fn in fns.items():
                run_for(fn, 1000.0)
                t0 = time.time()
                t = time_stream(fn, args.iters)
                mhz, watts = sampler.mean([(t0, time.time())])
                rec[name] = dict(us=round(t, 1), sm_mhz=mhz, watts=watts)
            rec.update(per_clock(rec))
            records.append(rec)
            print(json.dumps(rec), flush=True)
            del case, plan, fa3, fns
            torch.cuda.empty_cache()
    sampler.stop()
    name = torch.cuda.get_device_name(dev)
    out = dict(what="extend beside FlashInfer fa3: alternated timings by settle time, and each alone",
               device=name, device_tag=device_tag(name), records=records,
               command="python lab/power_settle.py " + " ".join(sys.argv[1:] if argv is None else argv))  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
