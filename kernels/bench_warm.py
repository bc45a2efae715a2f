"""``python -m sglang_hs.kernels.bench --kernel warm``: build what the kernel benchmarks load, in parallel, before
they run: the TileLang kernels of their shape (into TileLang's disk cache, as a server's start-up does) and
FlashInfer's JIT modules of the baselines they time. FlashInfer compiles a module on its first call, one
after the other inside a benchmark (a minute or more each); here they build side by side, beside TileLang.

The benchmarks' shape is Llama-3.1-8B's attention (32 query / 8 KV heads, d 128): fp16 for decode, extend
and prefill, bf16 with FP8 KV for ``--kv-dtype fp8_e4m3``. Needs a GPU (FlashInfer's modules are built by
calling them).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading
import time

from sglang_hs.kernels import decode
from sglang_hs.kernels.jobs import compile_missing, model_jobs

# (kind, FlashInfer backend, query dtype, page dtype): the modules bench_decode and bench_extend call.
FLASHINFER_MODULES = (
    *(("decode", backend, dtype, pages) for backend in ("fa2", "fa3")
      for dtype, pages in (("float16", "float16"), ("bfloat16", "bfloat16"), ("bfloat16", "float8_e4m3fn"))),
    *(("extend", backend, "float16", "float16") for backend in ("fa2", "fa3")),
)


def tilelang_jobs() -> list:
    """The benchmarks' TileLang kernels: the 8B shape's decode (the any-form kernel and the S_K = S_V = 1
    compact kernel), extend tiles (with and without 2:4 K rows), compressor, and the decode kernel's FP8-store,
    FP8-page variant in bf16."""
    jobs = model_jobs(32, 8, 128, "float16")
    compact = model_jobs(32, 8, 128, "float16", decode_compact=decode.COMPACT_FORMS[0])
    jobs[1:1] = [job for job in compact if job[0] == "decode"]
    jobs.append(("decode", decode.decode_kernel_args(32, 8, 128, 64, "bfloat16", decode.STAGES, store_fp8=True,
                                                     cache_fp8=True)))  # fmt: skip
    return list(dict.fromkeys(jobs))


def build_flashinfer_module(module: tuple) -> str:
    """Call one FlashInfer wrapper once on a small case (its JIT module is built then); returns a line for
    the log (a backend this FlashInfer build lacks for the dtypes is reported, not fatal)."""
    import torch

    from sglang_hs.kernels import cases

    kind, backend, dtype, pages = module
    t0 = time.time()
    try:
        case = cases.make_extend_case([256], [1 if kind == "decode" else 64], 32, 8, 128, 0.0, 0.0,
                                      getattr(torch, dtype), "cuda", seed=0)  # fmt: skip
        paged = cases.paged_dense(case)
        paged = dict(paged, k=paged["k"].to(getattr(torch, pages)), v=paged["v"].to(getattr(torch, pages)))
        run = (cases.flashinfer_decode if kind == "decode" else cases.flashinfer_extend)(case, paged, backend=backend)
        run()
        torch.cuda.synchronize()
        status = "ready"
    except Exception as e:  # noqa: BLE001 (reported)
        status = f"failed: {str(e).splitlines()[-1][:120] if str(e) else type(e).__name__}"
    return f"flashinfer {kind} {backend} q={dtype} pages={pages}: {status} ({time.time() - t0:.0f} s)"


def warm_main(args) -> None:
    """TileLang's kernels in ``--jobs`` processes (GPUs hidden) on one thread, FlashInfer's modules in
    spawned processes (one each) meanwhile. A module this FlashInfer build cannot make for its dtypes
    (fa3 over e4m3 pages with bf16 queries, in 0.6.15) is logged as failed, as the benchmarks report it."""
    t0 = time.time()
    log = lambda line: print(f"[warm {time.time() - t0:5.0f} s] {line}", flush=True)  # noqa: E731
    compiled = []
    tilelang = threading.Thread(target=lambda: compiled.append(compile_missing(tilelang_jobs(), log, args.jobs)))
    tilelang.start()
    with concurrent.futures.ProcessPoolExecutor(len(FLASHINFER_MODULES),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(build_flashinfer_module, FLASHINFER_MODULES):
            log(line)
    tilelang.join()
    log(f"TileLang: {compiled[0] if compiled else 0} kernels compiled, the rest cached")
