"""The kernel benchmarks' warm-up (``--kernel warm``, ``sglang_hs.kernels.bench_warm``): what it builds (CPU)."""

from __future__ import annotations

import pytest

from sglang_hs.kernels import bench, bench_warm
from sglang_hs.kernels.decode import STAGES, decode_kernel_args


def test_warm_builds_the_benchmarks_kernels_and_flashinfer_baselines():
    """The 8B shape's TileLang kernels (the fp16 decode kernel and compact one, both extend tiles with and without 2:4 K rows,
    the compressor, and the bf16 FP8 decode variant the FP8 benchmark runs) and FlashInfer's decode and
    paged-prefill modules for both backends the benchmarks time, over the page dtypes they read."""
    jobs = bench_warm.tilelang_jobs()
    assert jobs[0] == ("decode", decode_kernel_args(32, 8, 128, 64, "float16", STAGES))
    assert jobs[1] == ("decode", decode_kernel_args(32, 8, 128, 64, "float16", STAGES,
                                                    compact=("sparse", "sparse")))  # S_K = S_V = 1's compact kernel
    assert jobs[-1] == ("decode", decode_kernel_args(32, 8, 128, 64, "bfloat16", STAGES, store_fp8=True,
                                                     cache_fp8=True))  # fmt: skip
    extend = [args for kind, args in jobs if kind == "extend"]
    assert {(args[5], args[7]) for args in extend} == {("n64", False), ("n64", True), ("n128", False), ("n128", True)}
    assert {kind for kind, _ in jobs} == {"decode", "extend", "pack", "loss"} and len(jobs) == len(set(jobs))
    modules = bench_warm.FLASHINFER_MODULES
    assert {(kind, backend) for kind, backend, _, _ in modules} == {(k, b) for k in ("decode", "extend")
                                                                     for b in ("fa2", "fa3")}
    assert ("decode", "fa2", "bfloat16", "float8_e4m3fn") in modules  # --kv-dtype fp8_e4m3's baseline


def test_warm_is_a_kernel_choice_of_the_benchmark_cli(monkeypatch):
    called = []
    monkeypatch.setattr(bench, "warm_main", lambda args: called.append(args.jobs))
    bench.main(["--kernel", "warm", "--jobs", "3"])
    assert called == [3]
    with pytest.raises(SystemExit):
        bench.main(["--kernel", "nope"])
