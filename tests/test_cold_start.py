"""The cold-start timer (``sglang_hs.launch.cold_start``): log parsing and server arguments, on CPU."""

from __future__ import annotations

import argparse

from sglang_hs.launch import cold_start as C

LOG = """[2026-11-26 TP0] hierasparse: compiling 4 kernels (0/4) in 4 processes into /tmp/c (the first start ...)
[2026-11-26 TP0] hierasparse: compiling 4 kernels (1/4) pack(2, 64, 64) done at 31 s
[2026-11-26 TP1] hierasparse: waiting for another process compiling 4 kernels into /tmp/c
[2026-11-26 TP0] hierasparse: compiling 4 kernels (2/4) extend(8, 2, 64, 64, 'float16', 'n64', 2, False) done at 52 s
[2026-11-26 TP0] hierasparse: compiling 4 kernels (3/4) extend(...) done at 60 s
[2026-11-26 TP0] hierasparse: compiling 4 kernels (4/4) decode(8, 2, 64, 64, 'float16', 2) done at 64 s
[2026-11-26 TP0] hierasparse: compiled 4 and loaded 4 kernels in 70 s
[2026-11-26 TP1] hierasparse: 4 kernels loaded from TileLang's cache in 1.2 s
"""


def test_kernels_compiled_counts_progress_lines():
    assert C.kernels_compiled(LOG) == 4
    assert C.kernels_compiled("hierasparse: 4 kernels loaded from TileLang's cache in 0.6 s") == 0


def test_server_arguments():
    args = argparse.Namespace(model="llama8b", server_arg=["--tp-size=2"], hs_dense_backend="triton",
                              dense_backend="triton")
    assert C.server_args("hierasparse", args) == [
        "--attention-backend", "hierasparse", "--hierasparse-dense-backend=triton", "--tp-size=2", "--load-format=dummy"]
    assert C.server_args("dense", args) == ["--attention-backend", "triton", "--tp-size=2", "--load-format=dummy"]
    args.model = "tiny"
    assert C.server_args("dense", args) == ["--attention-backend", "triton", "--tp-size=2"]
