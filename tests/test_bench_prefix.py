"""The prefix benchmark's CPU-side pieces: server specs, hit rate and KV budget from logs."""

from __future__ import annotations

import pytest

from sglang_hs.format import dense_block_bytes, sparse_block_bytes
from sglang_hs.launch.bench_prefix import ServerSpec, auto_store_fraction, decode_log_stats, hit_rate, kv_budget_gib
from sglang_hs.pools import StoreCapacity


def test_server_specs():
    hs = ServerSpec.parse("hs:0.5:1", store_fraction=0.9)
    assert hs.backend == "hierasparse" and (hs.sk, hs.sv) == (0.5, 1.0)
    args = hs.server_args(None, 8192, 128)
    assert "--hierasparse-sk-decode=0.5" in args and "--hierasparse-store-fraction=0.9" in args
    assert ServerSpec.parse("hicache", 0.9).args[-2:] == ["--page-size", "64"]
    assert "--hierasparse-store-fraction=0.6" in ServerSpec.parse("hs:1:1:0.6", 0.9).server_args(None, 8192, 128)
    auto = ServerSpec.parse("hs:1:1:auto", 0.9)
    with pytest.raises(SystemExit, match="dense capacity"):
        auto.server_args(None, 8192, 128)
    assert 0.85 < float(auto.server_args(400_000, 8192, 128)[-1].split("=")[1]) < 0.95
    with pytest.raises(SystemExit, match="allowed"):
        ServerSpec.parse("hs:one", 0.9)


def test_k_head_map_reaches_hierasparse_servers_and_their_store_fraction(tmp_path):
    """``--k-head-map``: hierasparse servers get the flag, dense ones do not; the auto store fraction is
    sized at the effective S_K (S_K on the map's share: more bytes per block, fewer blocks), which
    lies between S_K = 0 and S_K = 1 at the same S_V."""
    import torch

    from sglang_hs.k_head_map import KHeadMap
    from sglang_hs.launch.bench_prefix import apply_k_head_map

    path = str(tmp_path / "map.pt")
    KHeadMap(torch.arange(32 * 8).view(32, 8) % 4 != 0).save(path)  # share 0.75
    specs = [ServerSpec.parse(text, 0.5) for text in ("triton", "hs:1:1:auto", "hs+hicache:1:1:auto")]
    apply_k_head_map(specs, path)
    assert not any("k-head-map" in a for a in specs[0].args)
    assert all(any(a.startswith("--hierasparse-k-head-map=") for a in spec.args) for spec in specs[1:])
    assert specs[1].effective_sk == pytest.approx(0.75) and specs[0].effective_sk is None

    def fraction(spec):
        return float(spec.server_args(400_000, 8192, 128)[-1].split("=")[1])

    mapped, full, no_k = fraction(specs[1]), fraction(ServerSpec.parse("hs:1:1:auto", 0.5)), fraction(
        ServerSpec.parse("hs:0:1:auto", 0.5))  # fmt: skip
    assert (mapped, full, no_k) != (full, full, full) and min(full, no_k) <= mapped <= max(full, no_k)
    with pytest.raises(SystemExit, match="--k-head-map"):
        apply_k_head_map(specs, str(tmp_path / "missing.pt"))


def test_hierarchical_server_specs():
    """``hs+hicache[:SK:SV[:F]]``: hierasparse with SGLang's hierarchical cache, compared with the
    ``hicache`` server at the same host memory."""
    plain = ServerSpec.parse("hs+hicache", store_fraction=0.5)
    assert plain.backend == "hierasparse" and plain.hicache and (plain.sk, plain.sv) == (0.0, 1.0)
    args = plain.server_args(None, 8192, 128)
    assert args[:3] == ["--attention-backend", "hierasparse", "--enable-hierarchical-cache"]
    assert "--hierasparse-sv-prefill=1.0" in args and "--hierasparse-store-fraction=0.5" in args
    full = ServerSpec.parse("hs+hicache:1:1:0.7", store_fraction=0.5)
    assert (full.sk, full.sv, full.label) == (1.0, 1.0, "hs+hicache:1:1:0.7")
    assert "--hierasparse-store-fraction=0.7" in full.server_args(None, 8192, 128)
    auto = ServerSpec.parse("hs+hicache:0:1:auto", 0.5)
    assert 0.5 < float(auto.server_args(400_000, 8192, 128)[-1].split("=")[1]) < 0.95
    assert ServerSpec.parse("hicache", 0.5).hicache and not ServerSpec.parse("hs:0:1", 0.5).hicache
    for bad in ("hs+hicache:1", "hs+hicache:1:1:x", "hs+hicachex", "hs:hicache"):
        with pytest.raises(SystemExit, match=r"hs\+hicache\[:SK:SV\[:F\]\]"):
            ServerSpec.parse(bad, 0.5)


def test_hierarchical_ratio_needs_the_same_host_memory():
    from sglang_hs.launch.bench_prefix import host_tier, ratio_lines

    assert host_tier(ServerSpec.parse("hs+hicache", 0.5), 40) == "40 GB"
    assert host_tier(ServerSpec.parse("hicache", 0.5), None) == "hicache-ratio default"
    assert host_tier(ServerSpec.parse("hs:0:1", 0.5), 40) is None
    common = {"context": 8192, "api": "sglang", "mem_fraction_static": 0.5, "tp_size": 1, "regime": 3}
    hicache = {**common, "server": "hicache", "backend": "flashinfer+hicache", "req_throughput": 4.0,
               "host_tier": "40 GB"}  # fmt: skip
    ours = {**common, "server": "hs+hicache:0:1", "backend": "hierasparse", "req_throughput": 6.0,
            "host_tier": "40 GB"}  # fmt: skip
    no_host = {**common, "server": "hs:0:1", "backend": "hierasparse", "req_throughput": 2.0, "host_tier": None}
    assert ratio_lines([hicache, ours, no_host]) == ["regime 3, hs+hicache:0:1 vs hicache: req/s 1.50x",
                                                     "regime 3, hs:0:1 vs hicache: req/s 0.50x"]  # fmt: skip
    assert ratio_lines([hicache, {**ours, "host_tier": "20 GB"}]) == []


@pytest.mark.parametrize("dense_tokens", [262_144, 400_000, 811_000])
@pytest.mark.parametrize("context", [8192, 32768])
@pytest.mark.parametrize("fp8", [False, True])
def test_auto_store_fraction_fits_the_most_prefixes(dense_tokens, context, fp8):
    """The store built from the fraction (the server's own sizing) holds the compressed blocks of the
    prefixes it promises, the dense pool their sinks and windows plus one prompt in flight, and one
    more prefix would not fit at any split (``fp8``: FP8 store values, and FP8 pages that hold twice
    the tokens of 16-bit ones in the same bytes)."""
    layers, heads, d, block = 32, 8, 128, 64
    fraction, prefixes = auto_store_fraction(dense_tokens, context, 1.0, 1.0, d, fp8=fp8)
    token_bytes = 2 * dense_block_bytes(block, d) // block * heads * layers
    store = StoreCapacity.from_budget(int(dense_tokens * token_bytes * fraction), layers, heads, d, block, 1.0, 1.0,
                                      elem_bytes=1 if fp8 else 2)  # fmt: skip
    blocks_per_prefix = context // block - 5  # sink 64 = 1 block, window 256 = 4 blocks
    assert store.virtual_blocks >= prefixes * blocks_per_prefix
    page = 0.5 if fp8 else 1.0
    dense_pool = int(dense_tokens * (1 - fraction) / page)
    assert dense_pool >= prefixes * 5 * block + context + block
    stored = sparse_block_bytes(block, d, 1 if fp8 else 2) / dense_block_bytes(block, d)
    if fraction < 0.95:
        one_more = ((prefixes + 1) * (5 * block * page + blocks_per_prefix * block * stored) + (context + block) * page)
        assert one_more > dense_tokens
    else:  # the store's cap (the dense pool keeps a twentieth) binds: one more prefix's blocks do not fit
        assert (prefixes + 1) * blocks_per_prefix > store.virtual_blocks


def test_hit_rate_and_kv_budget_from_logs():
    log = (
        "[t] Prefill batch, #new-seq: 1, #new-token: 300, #cached-token: 700, token usage: 0.1\n"
        "[t] Prefill batch, #new-seq: 2, #new-token: 100, #cached-token: 900, token usage: 0.2\n"
    )
    assert hit_rate(log) == pytest.approx(1600 / 2000)
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    assert kv_budget_gib(log, 2**20, config) == pytest.approx(128.0)  # 128 KiB per token
    assert kv_budget_gib("hierasparse: KV budget 53.61 GiB = dense pool", 0, config) == 53.61
    # Tensor parallelism: each rank logs its own budget; a dense rank holds its share of the heads.
    assert kv_budget_gib("hierasparse: KV budget 20.5 GiB = dense pool", 0, config, tp_size=2) == 41.0
    assert kv_budget_gib(log, 2**20, config, tp_size=2) == pytest.approx(128.0)


def test_decode_log_stats_from_sglang_lines():
    """SGLang 0.5.17's decode log line (metrics_reporter): running requests, CUDA graph, generation rate."""
    line = ("[2026-11-27 02:00:00] Decode batch, #running-req: {n}, #token: 1000, token usage: 0.10, "
            "cuda graph: {g}, gen throughput (token/s): {r}, #queue-req: 0\n")
    log = "".join(line.format(n=n, g=g, r=r) for n, g, r in
                  [(16, True, 700.0), (16, True, 900.5), (12, False, 300.0), (16, True, 800.0)])  # fmt: skip
    stats = decode_log_stats(log)
    assert stats == {"decode_log_lines": 4, "decode_cuda_graph_share": 0.75, "decode_max_running": 16,
                     "decode_tok_s_p50_at_max_running": 800.0, "decode_running_mean": 15.0,
                     "shared_decode_grouped": None, "retractions": 0}
    retracted = log + "[t] KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 640\n"
    assert decode_log_stats(retracted)["retractions"] == 1
    # With shared-prefix decode the plugin adds its grouping share to the line's usage parts.
    grouped = line.replace("token usage: 0.10,", "token usage: 0.10, hs shared-decode grouped: {s},")
    log = "".join(grouped.format(n=16, g=True, r=900.0, s=s) for s in ("0.40", "0.85"))
    assert decode_log_stats(log)["shared_decode_grouped"] == 0.85
    assert decode_log_stats(log)["decode_log_lines"] == 2
    assert decode_log_stats("[t] Prefill batch, #new-token: 3, #cached-token: 4") == {"decode_log_lines": 0}


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


def test_itl_fields_split_steps_from_prefill_stalls():
    """The median streamed gap is the decode step, the mean adds the stalls; the share is their ratio."""
    from sglang_hs.launch.bench_prefix import itl_fields

    result = {"itls": [[0.010, 0.011, 0.090], [0.012, 0.010, 0.010, 0.050], []]}
    fields = itl_fields(result)
    assert fields["itl_p50_ms"] == pytest.approx(11.0)
    assert fields["itl_mean_ms"] == pytest.approx(193 / 7)
    assert fields["itl_step_share"] == pytest.approx(11.0 / (193 / 7))
    assert itl_fields({"completed": 0}) == {}


def test_calibrated_prompt_len_gives_the_servers_token_count(tmp_path):
    """bench_serving's random prompts re-encode to more tokens with the benchmark model's tokenizer;
    asking for the calibrated count gives about the wanted count."""
    from sglang.benchmark.datasets.common import gen_prompt
    from transformers import AutoTokenizer

    from sglang_hs.launch.bench_prefix import calibrated_prompt_lens
    from sglang_hs.launch.make_model import LLAMA_31_8B, write_llama_config

    write_llama_config(str(tmp_path), LLAMA_31_8B)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    asked, asked_question = calibrated_prompt_lens(str(tmp_path), 8192, 256)
    assert asked < 8192 * 0.9  # the expansion is real for this tokenizer
    got = len(tokenizer.encode(gen_prompt(tokenizer, asked), add_special_tokens=False))
    assert abs(got - 8192) < 8192 * 0.03
    assert asked_question == round(256 * asked / 8192)  # one expansion for every length


def test_ratios_pair_each_hierasparse_record_with_its_dense_load():
    from sglang_hs.launch.bench_prefix import ratio_lines

    common = {"context": 8192, "api": "sglang-oai", "mem_fraction_static": 0.85, "tp_size": 1}
    dense = {**common, "server": "triton", "backend": "triton", "regime": 2, "req_throughput": 2.0,
             "ttft_p50_ms": 900.0, "cache_hit_rate": 0.5}  # fmt: skip
    ours = {**common, "server": "hs:1:1:0.8", "backend": "hierasparse", "regime": 2, "req_throughput": 3.0,
            "ttft_p50_ms": 300.0, "cache_hit_rate": 0.8}  # fmt: skip
    other_memory = {**ours, "mem_fraction_static": 0.6}
    lines = ratio_lines([dense, ours, other_memory])
    assert lines == ["regime 2, hs:1:1:0.8 vs triton: req/s 1.50x, TTFT p50 3.00x (cache hit rate 0.80 vs 0.50)"]
    # Every baseline kind of the same load gets its own line, the latest record of each.
    hicache = {**dense, "server": "hicache", "backend": "flashinfer+hicache", "req_throughput": 4.0}
    flashinfer = {**dense, "server": "flashinfer", "backend": "flashinfer", "req_throughput": 2.5}
    newer = {**flashinfer, "req_throughput": 1.0}
    lines = ratio_lines([dense, flashinfer, newer, hicache, ours])
    assert [line.split(", TTFT")[0] for line in lines] == [
        "regime 2, hs:1:1:0.8 vs flashinfer: req/s 3.00x", "regime 2, hs:1:1:0.8 vs triton: req/s 1.50x",
        "regime 2, hs:1:1:0.8 vs hicache: req/s 0.75x"]


def test_the_profile_starts_after_the_loads_first_prefill():
    """``--profile-steps``: the trace is asked for ``delay`` seconds after the load's first prefill line
    (bench_serving builds long prompts for tens of seconds first), and not at all once the load ended."""
    import threading

    from sglang_hs.launch.bench_prefix import start_profile

    class Server:
        def __init__(self):
            self.text, self.posts = "[t] Prefill batch, #new-token: 9, #cached-token: 0\n", []

        def log_text(self):
            return self.text

        def post(self, path, payload):
            assert payload["with_stack"] is False  # stacks only when asked (they slow the host)
            self.posts.append((path, payload["num_steps"], len(self.text)))

    server = Server()
    start = len(server.text)  # an earlier load's prefill does not count
    thread = threading.Thread(target=start_profile, args=(server, "/tmp/t", 7, 0.05, start))
    thread.start()
    thread.join(0.8)
    assert thread.is_alive() and server.posts == []  # waiting for this load's first prefill
    server.text += "[t] Prefill batch, #new-token: 5, #cached-token: 3\n"
    thread.join(5)
    assert not thread.is_alive() and server.posts == [("/start_profile", 7, len(server.text))]
    stop = threading.Event()
    stop.set()
    start_profile(server, "/tmp/t", 7, 0.05, len(server.text), stop)  # the load ended first
    assert len(server.posts) == 1


def test_sigterm_stops_the_run_like_ctrl_c(tmp_path):
    """``timeout`` sends SIGTERM: the command line turns it into KeyboardInterrupt, so the running
    server's context stops the server (here a stand-in: the run is waiting, the handler ends it)."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "run.py"
    script.write_text(
        "import signal, sys, time\n"
        "from sglang_hs.launch import bench_prefix as b\n"
        "signal.signal(signal.SIGTERM, b._interrupt)\n"
        "try:\n"
        "    print('ready', flush=True); time.sleep(30)\n"
        "except KeyboardInterrupt:\n"
        "    print('stopped', flush=True); sys.exit(130)\n"
    )  # fmt: skip
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 130 and proc.stdout.read().strip() == "stopped"


def test_fp8_servers_take_fp8_pages_and_the_kernels_that_read_them():
    """``flashinfer-fp8``/``triton-fp8``: SGLang's FP8 pages, compared with but not sizing the regimes;
    ``hs-fp8:SK:SV``: an FP8 store, FP8 pages and the decode and extend kernels."""
    from sglang_hs.launch.bench_prefix import BASELINES, CAPACITY_SERVERS

    fi = ServerSpec.parse("flashinfer-fp8", 0.5)
    assert fi.backend == "flashinfer" and fi.fp8 and fi.args[-2:] == ["--kv-cache-dtype", "fp8_e4m3"]
    assert "flashinfer-fp8" in BASELINES and "flashinfer-fp8" not in CAPACITY_SERVERS
    hs = ServerSpec.parse("hs-fp8:1:0:auto", 0.5)
    assert hs.fp8 and (hs.sk, hs.sv, hs.store_fraction) == (1.0, 0.0, "auto")
    assert hs.args[-4:] == ["--hierasparse-store-dtype=fp8_e4m3", "--kv-cache-dtype", "fp8_e4m3",
                            "--hierasparse-kernels=decode,extend"]  # fmt: skip
    assert not ServerSpec.parse("hs:1:0", 0.5).fp8
    with pytest.raises(SystemExit, match="hs-fp8:SK:SV"):
        ServerSpec.parse("hs-fp4:1:0", 0.5)
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    assert kv_budget_gib("", 2**20, config, elem_bytes=1) == pytest.approx(64.0)
