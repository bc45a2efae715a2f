"""The dense delegate's paged prefill: FlashInfer fa2 against fa3 as SGLang's FlashInfer backend runs it.

    python3 lab/bench_dense_prefill.py [--out FILE.json] [--points NEW:PREFIX:BATCH,...]

SGLang attends a prefill batch's new tokens over its cached dense prefix with a paged prefill wrapper:
page size 1 (one KV index a token, in pool order), non-causal, the LSE returned for the merge with the
ragged part. It builds that wrapper on fa2; ``sglang_hs.dense_prefill`` switches it to fa3 from
``FA3_MIN_NEW_TOKENS`` new tokens a request. This times both on the same inputs (Llama-3.1-8B heads:
32 query / 8 KV heads, d 128, bf16, pool indices shuffled as in a used pool), in eager rounds that
alternate them, and checks fa3's output and LSE against fa2's. Default points: short extends over an
8K prefix (batch 8), and a 32K prompt's later 8K chunks (batch 1).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from sglang_hs.kernels.cases import rel_err
from sglang_hs.kernels.timing import time_interleaved

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DEFAULT_POINTS = "64:8192:8,128:8192:8,256:8192:8,512:8192:8,1024:8192:8,8192:8192:1,8192:24576:1"


def delegate_case(new_tokens: int, prefix_lens: list[int], dtype=torch.bfloat16, device="cuda", seed=0) -> dict:
    """Inputs of the delegate's paged part: queries of ``new_tokens`` a request and a page-size-1 pool
    holding each request's prefix at shuffled slots. Returns q, k and v buffers, and the indptr/indices
    SGLang's indices updater builds."""
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(prefix_lens)
    pool = total + 1024
    slots = torch.randperm(pool, generator=gen, device=device)[:total].to(torch.int32)
    kv_indptr = torch.zeros(len(prefix_lens) + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(torch.tensor(prefix_lens, device=device), 0)
    qo_indptr = torch.arange(len(prefix_lens) + 1, dtype=torch.int32, device=device) * new_tokens
    def randn(*shape):  # noqa: E306
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return dict(q=randn(new_tokens * len(prefix_lens), Q_HEADS, HEAD_DIM), k=randn(pool, KV_HEADS, HEAD_DIM),
                v=randn(pool, KV_HEADS, HEAD_DIM), qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=slots,
                last_page_len=torch.ones(len(prefix_lens), dtype=torch.int32, device=device), sm_scale=HEAD_DIM**-0.5)


def paged_prefix_attention(case: dict, backend: str, workspace: torch.Tensor):
    """A planned paged wrapper on ``backend`` as SGLang plans and runs it; returns ``run() -> (o, lse)``."""
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    w = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    w.plan(case["qo_indptr"], case["kv_indptr"], case["kv_indices"], case["last_page_len"], Q_HEADS, KV_HEADS,
           HEAD_DIM, 1, q_data_type=case["q"].dtype, kv_data_type=case["k"].dtype, non_blocking=True)  # fmt: skip
    return lambda: w.forward_return_lse(case["q"], (case["k"], case["v"]), causal=False, sm_scale=case["sm_scale"])


def reference(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sglang_hs.reference.dense_attention` of every request's queries over its whole prefix
    (non-causal), with the LSE in base 2 (FlashInfer's)."""
    from sglang_hs.reference import dense_attention

    outs, lses = [], []
    qo, kv = case["qo_indptr"].tolist(), case["kv_indptr"].tolist()
    for r in range(len(qo) - 1):
        idx = case["kv_indices"][kv[r] : kv[r + 1]].long()
        out, lse = dense_attention(case["q"][qo[r] : qo[r + 1]], case["k"][idx], case["v"][idx], causal=False,
                                   sm_scale=case["sm_scale"])  # fmt: skip
        outs.append(out.float())
        lses.append(lse / math.log(2.0))
    return torch.cat(outs), torch.cat(lses)


def bench_point(new_tokens: int, prefix: int, batch: int, workspace: torch.Tensor, iters: int = 10) -> dict:
    case = delegate_case(new_tokens, [prefix] * batch)
    runs = {b: paged_prefix_attention(case, b, workspace) for b in ("fa2", "fa3")}
    (o2, s2), (o3, s3) = runs["fa2"](), runs["fa3"]()
    torch.cuda.synchronize()
    t2, t3 = time_interleaved([runs["fa2"], runs["fa3"]], iters)
    flops = 4 * batch * new_tokens * prefix * Q_HEADS * HEAD_DIM
    return dict(new_tokens=new_tokens, prefix=prefix, batch=batch, fa2_us=round(t2, 1), fa3_us=round(t3, 1),
                fa3_speedup=round(t2 / t3, 3), fa3_tflops=round(flops / t3 / 1e6, 1),
                rel_err_fa3_vs_fa2=rel_err(o3, o2), lse_max_abs_diff=float((s3 - s2).abs().max()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=DEFAULT_POINTS, help="NEW:PREFIX:BATCH,... (new tokens a request)")
    ap.add_argument("--out", default=None, help="JSON file for the records")
    args = ap.parse_args(argv)
    workspace = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")
    records = []
    for point in args.points.split(","):
        n, p, b = (int(x) for x in point.split(":"))
        r = bench_point(n, p, b, workspace)
        r["device"] = torch.cuda.get_device_name()
        records.append(r)
        print(f"{n:5d} new x {b} over {p:6d}: fa2 {r['fa2_us']:9.1f} us  fa3 {r['fa3_us']:9.1f} us  "
              f"fa3 {r['fa3_speedup']:.2f}x  ({r['fa3_tflops']} TFLOP/s)  err {r['rel_err_fa3_vs_fa2']:.1e} "
              f"lse diff {r['lse_max_abs_diff']:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
