"""Compile the TileLang kernels of a model shape into TileLang's disk cache, e.g. to ship a cache to
other machines or to bake it into an image.

    python -m sglang_hs.launch.warm_kernels --model-path DIR [--tp-size T] [--jobs J]

A hierasparse server needs no such step: at start-up it compiles, in parallel processes, the kernels
its model shape lacks in the cache (``sglang_hs.kernels.jobs``) and logs ``hierasparse: compiling N
kernels (k/N)`` lines. This command compiles the same kernels, plus the variants another setting would
use (the extend tiles with and without 2:4 K rows, both loss kernels), on any machine with TileLang and
nvcc (no GPU needed), into ``TILELANG_CACHE_DIR`` (default ``~/.tilelang/cache``). The kernel set
depends only on the model shape per tensor-parallel rank (heads, head_dim, dtype): not on the context
length, the CUDA-graph batch sizes or the running requests, so the flags that named them
(``--context-length``, ``--cuda-graph-max-bs``, ``--max-running-requests``, ``--num-sms``) are still
accepted and ignored. A model at TP 1 and at TP 2 are two shapes: warm each ``--tp-size`` you serve.
"""

from __future__ import annotations

import argparse
import json
import os

from sglang_hs.kernels.decode import COMPACT_FORMS, decode_compact
from sglang_hs.kernels.jobs import Job, cache_dir, compile_missing, default_workers, model_jobs

BLOCK_SIZE = 64
H100_SMS = 132  # H100 SXM and H200


def model_shape(model_path: str, tp_size: int) -> dict:
    """Query heads, KV heads (per tensor-parallel rank, as SGLang splits them), head_dim, dtype."""
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    q_heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", q_heads)
    if q_heads % tp_size:
        raise SystemExit(f"error: --tp-size {tp_size} does not divide the model's {q_heads} query heads")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if dtype not in ("float16", "bfloat16"):
        raise SystemExit(f"error: the model's dtype is {dtype!r}; hierasparse serves float16 or bfloat16 models")
    return {
        "q_heads": q_heads // tp_size,
        "kv_heads": max(1, kv_heads // tp_size),
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // q_heads,
        "dtype": dtype,
    }


SHARED_DECODE_FORMS = (("dense", "sparse"), ("sparse", "sparse"), ("any", "any"))
"""The shared-prefix decode forms warmed: those of S_V = 1 (the default), of S_K = S_V = 1, and of
every fractional setting (``decode_shared.compressed_forms``); a store whose blocks all have another
pair of forms (e.g. S_V = 0) compiles its shared pass at start-up."""


def kernel_jobs(shape: dict) -> list[Job]:
    """Every kernel a server of this shape may use, whatever its settings: the decode kernel and the
    compact decode kernel of S_K = S_V = 1 stores (head_dim >= 128), the extend tiles with and without
    2:4 K rows, the pack kernel and both loss kernels, and shared-prefix decode's own-pass and
    shared-pass kernels for :data:`SHARED_DECODE_FORMS`. A model whose GQA group the attention kernels do not take serves with the
    compressor alone."""
    args = (shape["q_heads"], shape["kv_heads"], shape["head_dim"], shape["dtype"])
    jobs = model_jobs(*args)
    for forms in COMPACT_FORMS:
        compact = decode_compact(forms, shape["head_dim"])
        if compact:
            jobs += [job for job in model_jobs(*args, decode_compact=compact) if job not in jobs]
    for forms in SHARED_DECODE_FORMS:
        jobs += [job for job in model_jobs(*args, shared_decode_forms=forms) if job not in jobs]
    return jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=default_workers(), help="compile processes (default: CPUs)")
    ignored = "accepted for old command lines; the kernel set no longer depends on it"
    parser.add_argument("--context-length", type=int, default=None, help=ignored)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None, help=ignored)
    parser.add_argument("--max-running-requests", type=int, default=None, help=ignored)
    parser.add_argument("--num-sms", type=int, default=H100_SMS, help=ignored)
    args = parser.parse_args(argv)
    if not os.path.exists(os.path.join(args.model_path, "config.json")):
        raise SystemExit(f"error: --model-path {args.model_path} has no config.json")
    if args.jobs < 1:
        raise SystemExit("error: --jobs must be positive")
    shape = model_shape(args.model_path, args.tp_size)
    jobs = kernel_jobs(shape)
    print(f"[warm] {len(jobs)} kernels for {shape}, cache {cache_dir()}", flush=True)
    compiled = compile_missing(jobs, lambda line: print(f"[warm] {line}", flush=True), args.jobs)
    print(f"[warm] {compiled} compiled, {len(jobs) - compiled} already in the cache", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
