"""The prefix benchmark's CPU-side pieces: server specs, hit rate and KV budget from logs."""

from __future__ import annotations

import pytest

from sglang_hs.launch.bench_prefix import ServerSpec, hit_rate, kv_budget_gib


def test_server_specs():
    hs = ServerSpec.parse("hs:0.5:1", store_fraction=0.9)
    assert hs.backend == "hierasparse" and (hs.sk, hs.sv) == (0.5, 1.0)
    assert "--hierasparse-sk-decode=0.5" in hs.args and "--hierasparse-store-fraction=0.9" in hs.args
    assert ServerSpec.parse("hicache", 0.9).args[-2:] == ["--page-size", "64"]
    assert "--hierasparse-store-fraction=0.6" in ServerSpec.parse("hs:1:1:0.6", store_fraction=0.9).args
    with pytest.raises(SystemExit, match="allowed"):
        ServerSpec.parse("hs:one", 0.9)


def test_hit_rate_and_kv_budget_from_logs():
    log = (
        "[t] Prefill batch, #new-seq: 1, #new-token: 300, #cached-token: 700, token usage: 0.1\n"
        "[t] Prefill batch, #new-seq: 2, #new-token: 100, #cached-token: 900, token usage: 0.2\n"
    )
    assert hit_rate(log) == pytest.approx(1600 / 2000)
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    assert kv_budget_gib(log, 2**20, config) == pytest.approx(128.0)  # 128 KiB per token
    assert kv_budget_gib("hierasparse: KV budget 53.61 GiB = dense pool", 0, config) == 53.61


def test_regimes_and_groups():
    from sglang_hs.launch.bench_prefix import load_shape, parse_regimes

    assert parse_regimes("1,g10,3,g10x20") == [1, "g10", 3, "g10x20"]
    assert parse_regimes("") == []
    for bad in ("4", "g0", "gx", "two", "g10x0", "g10x"):
        with pytest.raises(SystemExit, match="allowed"):
            parse_regimes(bad)
    assert load_shape("g10", 0, 8192, 8) == (10, 8)
    assert load_shape("g10x20", 0, 8192, 8) == (10, 20)
    assert load_shape(2, 100_000, 8192, 8) == (round(1.4 * 100_000 / 8192), 8)


def test_metrics_and_request_fields():
    from sglang_hs.launch.bench_prefix import metrics_fields, parse_metrics, request_fields

    page = (
        "# HELP sglang:cache_hit_rate The prefix cache hit rate.\n"
        "# TYPE sglang:cache_hit_rate gauge\n"
        'sglang:cache_hit_rate{engine_type="unified",model_name="m"} 0.875\n'
        'sglang:hierasparse_compressed_tokens{cache_type="HieraSparseRadixCache"} 78720.0\n'
        'sglang:hierasparse_store_used_blocks{cache_type="HieraSparseRadixCache"} 1230.0\n'
        "python_gc_objects_collected_total 12.0\n"
    )
    metrics = parse_metrics(page)
    assert metrics == {"sglang:cache_hit_rate": 0.875, "sglang:hierasparse_compressed_tokens": 78720.0,
                       "sglang:hierasparse_store_used_blocks": 1230.0}
    fields = metrics_fields(metrics)
    assert fields["metrics_cache_hit_rate"] == 0.875 and fields["hs_compressed_tokens"] == 78720.0
    assert fields["hs_bytes_saved"] is None  # absent gauges stay None (a dense server has none)
    result = {"completed": 2, "errors": ["", "HTTP 500: boom"], "cached_tokens": [0, 900], "input_lens": [1000, 1000]}
    assert request_fields(result) == {"num_prompts": 2, "completed": 2, "errors": 1, "first_error": "HTTP 500: boom",
                                      "cached_token_rate": 0.45}
