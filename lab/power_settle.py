"""How long the GPU's power limiter takes to settle between kernels, and what that does to side-by-side
extend timings (GPU).

    python lab/power_settle.py [--new-tokens 128,256] [--settle-ms 0,50,200,500] [--out FILE.json]

The extend benchmark's case (batch 8 x 32K prefix + n new tokens, Llama-3.1-8B heads, fp16, S_V = 1 and
S_K = S_V = 1), our default plan against FlashInfer's fa3 paged prefill. For each ``--settle-ms``: rounds
of the benchmark's alternation (``timing.time_interleaved``), each timed stretch after that long of untimed
calls of the same function, with the SM clock and board power sampled (NVML, else ``nvidia-smi``)
and averaged over each function's timed stretches. Then each function alone after a second of calls: the
steady state a server running that backend sees. A settle is long enough when the alternated times match
the alone times.
"""

import argparse
import json
import subprocess
import sys
import threading
import time

import torch

from sglang_hs.kernels.cases import extend_run_args, flashinfer_extend, make_extend_case, paged_dense
from sglang_hs.kernels.extend import HieraSparseExtend
from sglang_hs.kernels.timing import device_tag, run_for, time_stream


class ClockSampler:
    """(wall time, SM MHz, W) samples every ~10 ms on a thread."""

    def __init__(self):
        self.samples, self._stop = [], threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._read = lambda: (pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                                  pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)  # fmt: skip
            self.source = "nvml"
        except Exception:  # noqa: BLE001 (no pynvml: poll nvidia-smi instead)
            self._read = None
            self.source = "nvidia-smi"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        if self._read is not None:
            while not self._stop.is_set():
                self.samples.append((time.time(), *self._read()))
                time.sleep(0.01)
            return
        proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                 "-lms", "10"], stdout=subprocess.PIPE, text=True)  # fmt: skip
        for line in proc.stdout:
            if self._stop.is_set():
                break
            try:
                mhz, watts = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.time(), mhz, watts))
        proc.kill()

    def mean(self, windows):
        """Mean (MHz, W) of the samples inside any of ``windows`` [(t0, t1)]."""
        got = [(m, w) for t, m, w in self.samples if any(a <= t <= b for a, b in windows)]
        if not got:
            return None, None
        return round(sum(m for m, _ in got) / len(got)), round(sum(w for _, w in got) / len(got))

    def stop(self):
        self._stop.set()


def alternate(fns, iters, rounds, settle_ms):
    """``time_interleaved`` with each timed stretch's wall-time window recorded."""
    times, windows = [[] for _ in fns], [[] for _ in fns]
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            run_for(fn, settle_ms)
            t0 = time.time()
            times[k].append(time_stream(fn, iters, reps=1, warmup=1))
            windows[k].append((t0, time.time()))
    return [sorted(t)[len(t) // 2] for t in times], windows


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
            case = make_extend_case([32768] * 8, [n] * 8, 32, 8, 128, sk, sv, torch.float16, dev, seed=n,
                                    magnitude=False, shuffle=False)  # fmt: skip
            fa3 = flashinfer_extend(case, paged_dense(case), workspace, "fa3")
            plan = HieraSparseExtend(32, 8, 128, 64, case["max_blocks"], torch.float16, dev)
            run_args = extend_run_args(case)
            ours = lambda: plan.run(*run_args)  # noqa: E731
            fns = {"fa3": fa3, "ours": ours}
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            for settle in (float(x) for x in args.settle_ms.split(",")):
                us, windows = alternate(list(fns.values()), args.iters, args.rounds, settle)
                rec = dict(new_tokens=n, S_K=sk, S_V=sv, mode="alternated", settle_ms=settle)
                for (name, _), t, w in zip(fns.items(), us, windows):
                    mhz, watts = sampler.mean(w)
                    rec[name] = dict(us=round(t, 1), sm_mhz=mhz, watts=watts)
                rec["speedup_vs_fa3"] = round(rec["fa3"]["us"] / rec["ours"]["us"], 4)
                records.append(rec)
                print(json.dumps(rec), flush=True)
            rec = dict(new_tokens=n, S_K=sk, S_V=sv, mode="alone", settle_ms=1000.0)
            for name, fn in fns.items():
                run_for(fn, 1000.0)
                t0 = time.time()
                t = time_stream(fn, args.iters)
                mhz, watts = sampler.mean([(t0, time.time())])
                rec[name] = dict(us=round(t, 1), sm_mhz=mhz, watts=watts)
            rec["speedup_vs_fa3"] = round(rec["fa3"]["us"] / rec["ours"]["us"], 4)
            records.append(rec)
            print(json.dumps(rec), flush=True)
            del case, plan, fa3, fns
            torch.cuda.empty_cache()
    sampler.stop()
    name = torch.cuda.get_device_name(dev)
    out = dict(what="extend beside FlashInfer fa3: alternated timings by settle time, and each alone",
               device=name, device_tag=device_tag(name), clock_source=sampler.source, records=records,
               command="python lab/power_settle.py " + " ".join(sys.argv[1:] if argv is None else argv))  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
