"""The compact decode kernel by parts at the benchmark's shape (batch 8 x 32K, Llama-3.1-8B heads, fp16,
S_K = S_V = 1): the any-form kernel and the compact one, and both with their split merge skipped (tickets
started far from the count that merges: a timing, not an output), side by side as CUDA-graph replays (GPU).

    python lab/profile_decode_compact.py [--out FILE.json] [--layouts natural,shuffled]
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the records here (JSON)")
    ap.add_argument("--layouts", default="natural,shuffled")
    args = ap.parse_args()

    from sglang_hs.kernels.cases import kv_bytes, make_case, rel_err, run_args
    from sglang_hs.kernels.decode import COMPACT_FORMS, HieraSparseDecode
    from sglang_hs.kernels.timing import time_graphs

    dev = torch.device("cuda")
    bs, length, hq, hkv, d = 8, 32768, 32, 8, 128
    records = []
    for layout in args.layouts.split(","):
        case = make_case([length] * bs, hq, hkv, d, 1.0, 1.0, torch.float16, dev, seed=11, magnitude=False,
                         shuffle=layout == "shuffled")  # fmt: skip
        width = case["max_blocks"]

        def plan(**kw):
            return HieraSparseDecode(bs, hq, hkv, d, 64, width, torch.float16, dev, **kw)

        compact = COMPACT_FORMS[0]
        plans = {"plain": plan(), "compact": plan(compact=compact), "plain, no merge (timing)": plan(),
                 "compact, no merge (timing)": plan(compact=compact)}  # fmt: skip
        for name in ("plain, no merge (timing)", "compact, no merge (timing)"):
            plans[name].counter.fill_(1 << 24)  # no CTA draws the last ticket: nobody merges
        inputs = run_args(case)
        outs = {name: torch.empty_like(case["q"]) for name in plans}
        fns = [(lambda p=p, o=outs[name]: p.run(*inputs, out=o)) for name, p in plans.items()]
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        times = time_graphs(fns, iters=20)
        for (name, p), t in zip(plans.items(), times):
            records.append(dict(S_K=1.0, S_V=1.0, layout=layout, plan=name, splits=p.num_splits, us=round(t, 2),
                                GBps=round(kv_bytes(case) / t / 1e3),
                                err_vs_plain=None if "timing" in name else rel_err(outs[name], outs["plain"]),
                                vs_plain=round(times[0] / t, 3), device=torch.cuda.get_device_name(dev)))
            print(records[-1], flush=True)
        del case, plans
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
