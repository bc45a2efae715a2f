"""Ahead-of-time kernel list of a server (``sglang_hs.launch.warm_kernels``): CPU-side pieces."""

from __future__ import annotations

import json

import pytest

from sglang_hs.launch import warm_kernels as W


def test_decode_batch_sizes_follow_sglang_capture_and_padding():
    # SGLang's capture list up to 32, then the power of two that eager batches of 33..64 are padded to.
    assert W.decode_batch_sizes(32, 64) == [1, 2, 4, 8, 12, 16, 24, 32, 64]
    assert W.decode_batch_sizes(4, 4) == [1, 2, 4]
    assert W.decode_batch_sizes(8, 100) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_model_shape_and_jobs(tmp_path):
    config = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = W.model_shape(str(tmp_path), tp_size=2)
    assert shape == {"q_heads": 16, "kv_heads": 4, "head_dim": 128, "dtype": "bfloat16"}
    jobs = W.kernel_jobs(shape, max_blocks=257, batch_sizes=[1, 8], num_sms=132)
    kinds = [kind for kind, _ in jobs]
    # Two extend tiles (n64, n128), each with and without 2:4 K rows.
    assert kinds == ["decode", "decode"] + ["extend"] * 4 + ["pack", "loss", "loss"]
    assert {args[5] for kind, args in jobs if kind == "extend"} == {"n64", "n128"}
    decode_args = jobs[1][1]
    assert decode_args[:6] == (8, 16, 4, 128, 64, 257) and decode_args[6] >= 1 and decode_args[7] == "bfloat16"
    smollm2 = {"q_heads": 9, "kv_heads": 3, "head_dim": 64, "dtype": "float16"}  # group 3: compressor only
    assert [kind for kind, _ in W.kernel_jobs(smollm2, 129, [1, 2, 4], 132)] == ["pack", "loss", "loss"]
    with pytest.raises(SystemExit, match="does not divide"):
        W.model_shape(str(tmp_path), tp_size=3)
    (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    with pytest.raises(SystemExit, match="float16 or bfloat16"):
        W.model_shape(str(tmp_path), tp_size=1)
