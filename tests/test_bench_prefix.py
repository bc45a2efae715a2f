"""The prefix benchmark's CPU-side pieces: server specs, hit rate and KV budget from logs."""

from __future__ import annotations

import pytest

from sglang_hs.launch.bench_prefix import ServerSpec, hit_rate, kv_budget_gib


def test_server_specs():
    hs = ServerSpec.parse("hs:0.5:1", store_fraction=0.9)
    assert hs.backend == "hierasparse" and (hs.sk, hs.sv) == (0.5, 1.0)
    assert "--hierasparse-sk-decode=0.5" in hs.args and "--hierasparse-store-fraction=0.9" in hs.args
    assert ServerSpec.parse("hicache", 0.9).args[-2:] == ["--page-size", "64"]
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
