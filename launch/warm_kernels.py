"""Compile the TileLang kernels a hierasparse server will use, before the server starts.

    python -m sglang_hs.launch.warm_kernels --model-path DIR [--context-length N] [--tp-size T] \\
        [--cuda-graph-max-bs B] [--max-running-requests R] [--jobs J]

A hierasparse server compiles its kernels on first use, one after the other in the scheduler
process: one decode plan per batch size it captures in a CUDA graph or pads an eager batch to (the
plan is specialised to the batch size and the ``req_to_token`` width), every tile of the extend
kernel and the compressor. Each takes about 20 s. TileLang keeps compiled kernels in its disk cache
(``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``), so a later start only loads them. This
command fills that cache with the same kernels in parallel processes, on any machine that has
TileLang and nvcc (no GPU needed: ``--num-sms`` stands in for the GPU's SM count, which the decode
plans' split counts depend on). Pass the flags the server will get; the kernels are the same for
every ``S_K``/``S_V`` setting.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import time
from types import SimpleNamespace

from sglang_hs.config import KERNEL_GQA_GROUPS

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


def context_length(model_path: str) -> int:
    """The model's context length as SGLang derives it from the config."""
    from sglang.srt.configs.model_config import get_context_length
    from transformers import AutoConfig

    return get_context_length(AutoConfig.from_pretrained(model_path))


def decode_batch_sizes(cuda_graph_max_bs: int, max_running_requests: int) -> list[int]:
    """The batch sizes of the server's decode plans: SGLang's CUDA-graph sizes, then the powers of
    two that eager batches beyond them are padded to (``HieraSparseAttnBackend``)."""
    from sglang.srt.server_args import ServerArgs

    args = SimpleNamespace(disable_cuda_graph_padding=False, speculative_algorithm=None)
    sizes = ServerArgs._generate_decode_cuda_graph_batch_sizes(args, cuda_graph_max_bs)
    padded = 1 << (max(sizes) - 1).bit_length()
    padded = padded if padded > max(sizes) else padded * 2
    while padded // 2 < max_running_requests:
        sizes.append(padded)
        padded *= 2
    return sizes


def kernel_jobs(shape: dict, max_blocks: int, batch_sizes: list[int], num_sms: int) -> list[tuple]:
    """``(kind, args)`` of every kernel: the decode plans, the extend tiles (each with and without 2:4 K
    rows), the compressor. A model whose GQA group the decode and extend kernels do not take serves
    with the compressor alone."""
    from sglang_hs.kernels.decode import STAGES as DECODE_STAGES
    from sglang_hs.kernels.decode import plan_num_splits
    from sglang_hs.kernels.extend import TILES, default_stages

    hq, hkv, d, dt = shape["q_heads"], shape["kv_heads"], shape["head_dim"], shape["dtype"]
    jobs = []
    if hq // hkv in KERNEL_GQA_GROUPS:
        jobs += [
            ("decode", (bs, hq, hkv, d, BLOCK_SIZE, max_blocks,
                        plan_num_splits(bs, hq, hkv, d, BLOCK_SIZE, max_blocks, DECODE_STAGES, num_sms), dt))
            for bs in batch_sizes
        ]  # fmt: skip
        jobs += [
            ("extend", (hq, hkv, d, BLOCK_SIZE, dt, tile, default_stages(tile), k_sparse))
            for tile in TILES
            for k_sparse in (False, True)
        ]
    jobs += [("pack", (hkv, d, BLOCK_SIZE)), ("loss", ("k", hkv, d, BLOCK_SIZE, dt)), ("loss", ("v", hkv, d, BLOCK_SIZE, dt))]
    return jobs


def build(job: tuple) -> tuple:
    from sglang_hs.kernels import compress, decode, extend

    kind, args = job
    builder = {
        "decode": decode.build_decode_kernel,
        "extend": extend.build_extend_kernel,
        "pack": compress.build_pack_kernel,
        "loss": compress.build_loss_kernel,
    }[kind]
    builder(*args)
    return job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--context-length", type=int, default=None, help="as given to the server (default: the model's)")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--cuda-graph-max-bs", type=int, required=True, help="as given to the server")
    parser.add_argument("--max-running-requests", type=int, default=None,
                        help="largest eager decode batch (default: --cuda-graph-max-bs, no eager plans)")
    parser.add_argument("--num-sms", type=int, default=H100_SMS, help="SMs of the serving GPU (H100/H200: 132)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    if not os.path.exists(os.path.join(args.model_path, "config.json")):
        raise SystemExit(f"error: --model-path {args.model_path} has no config.json")
    if args.cuda_graph_max_bs < 1 or args.jobs < 1:
        raise SystemExit("error: --cuda-graph-max-bs and --jobs must be positive")
    shape = model_shape(args.model_path, args.tp_size)
    context = args.context_length or context_length(args.model_path)
    # req_to_token rows hold context + 4 slots (SGLang's decode headroom); one block-table entry per page.
    max_blocks = -(-(context + 4) // BLOCK_SIZE)
    batch_sizes = decode_batch_sizes(args.cuda_graph_max_bs, args.max_running_requests or args.cuda_graph_max_bs)
    jobs = kernel_jobs(shape, max_blocks, batch_sizes, args.num_sms)
    print(f"[warm] {len(jobs)} kernels for {shape}, context {context} ({max_blocks} blocks), decode batch sizes "
          f"{batch_sizes}, {args.jobs} processes, cache {os.environ.get('TILELANG_CACHE_DIR', '~/.tilelang/cache')}",
          flush=True)  # fmt: skip
    start = time.time()
    with concurrent.futures.ProcessPoolExecutor(min(args.jobs, len(jobs))) as pool:
        for i, (kind, job_args) in enumerate(pool.map(build, jobs)):
            print(f"[warm] {i + 1}/{len(jobs)} {kind}{job_args} ({time.time() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
