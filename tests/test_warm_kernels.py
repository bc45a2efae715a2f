"""Ahead-of-time kernel list of a server (``sglang_hs.launch.warm_kernels``): CPU-side pieces."""

from __future__ import annotations

import json

import pytest

from sglang_hs.launch import warm_kernels as W


def test_model_shape_and_jobs(tmp_path):
    config = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = W.model_shape(str(tmp_path), tp_size=2)
    assert shape == {"q_heads": 16, "kv_heads": 4, "head_dim": 128, "dtype": "bfloat16"}
    jobs = W.kernel_jobs(shape)
    kinds = [kind for kind, _ in jobs]
    # One decode kernel, two extend tiles (n64, n128) each with and without 2:4 K rows, the compressor; the
    # compact decode kernel of S_K = S_V = 1; then shared-prefix decode's own pass (a split floor) and its shared pass
    # (the n32 tile) for three settings' forms (dense K: no 2:4 K rows; 2:4 K: with them; any: both).
    assert kinds == ["decode"] + ["extend"] * 4 + ["pack", "loss", "loss"] + ["decode"] * 2 + ["extend"] * 4
    assert {args[5] for kind, args in jobs[:8] if kind == "extend"} == {"n64", "n128"}
    assert {args[5] for kind, args in jobs[8:] if kind == "extend"} == {"n32"}
    assert jobs[0] == ("decode", (16, 4, 128, 64, "bfloat16", 2))
    assert jobs[8][1][10:] == (("sparse", "sparse"),) and jobs[9][1][6:] == (512, 4)
    shared = [args for kind, args in jobs[8:] if kind == "extend"]
    assert [(args[7], args[8]) for args in shared] == [(False, ("dense", "sparse")), (True, ("sparse", "sparse")),
                                                       (False, ("any", "any")), (True, ("any", "any"))]
    assert all(args[0] == 128 and args[-1] is True for args in shared)  # G = 4: 8 requests a set, 4 x 8 x 4 heads
    smollm2 = {"q_heads": 9, "kv_heads": 3, "head_dim": 64, "dtype": "float16"}  # group 3: every kernel but
    assert [kind for kind, _ in W.kernel_jobs(smollm2)] == kinds[:8] + kinds[9:]  # the compact one (d 64)
    group9 = {"q_heads": 18, "kv_heads": 2, "head_dim": 64, "dtype": "float16"}  # beyond 8: compressor only
    assert [kind for kind, _ in W.kernel_jobs(group9)] == ["pack", "loss", "loss"]
    with pytest.raises(SystemExit, match="does not divide"):
        W.model_shape(str(tmp_path), tp_size=3)
    (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    with pytest.raises(SystemExit, match="float16 or bfloat16"):
        W.model_shape(str(tmp_path), tp_size=1)


def test_kernel_set_ignores_context_and_batch_flags(tmp_path, monkeypatch):
    """The old flags are accepted; the kernels compiled are the same whatever they say."""
    config = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    seen = []
    monkeypatch.setattr(W, "compile_missing", lambda jobs, log, workers: seen.append(jobs) or 0)
    monkeypatch.setattr(W, "cache_dir", lambda: str(tmp_path))
    base = ["--model-path", str(tmp_path), "--jobs", "2"]
    assert W.main(base) == 0
    assert W.main(base + ["--context-length", "131072", "--cuda-graph-max-bs", "256", "--max-running-requests",
                          "4096", "--num-sms", "114"]) == 0
    assert W.main(base + ["--context-length", "4096", "--cuda-graph-max-bs", "4"]) == 0
    assert seen[0] == seen[1] == seen[2] and len(seen[0]) == 13  # 8 and shared-prefix decode's 5 (d 64: no compact kernel)
