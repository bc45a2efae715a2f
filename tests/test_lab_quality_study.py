"""The lab's quality study (``lab/quality_variants.py``, ``lab/eval_study.py``): the K-pruning variants and
the decode-time block selection rules on the reference backend.

CPU only: the head map's budget and masks and the channel permutation on synthetic data, and end to
end on the 2-layer random model (``make_model.write_tiny``): the head-adaptive path with an all-dense
map equals S_K = 0 bit for bit, with an all-sparse map S_K = 1. The lab is not installed; ``conftest``
puts ``lab/`` on ``sys.path`` as ``python lab/eval_study.py`` does.
"""

from __future__ import annotations

import json

import eval_study as es
import pytest
import quality_variants as qv
import torch

from sglang_hs.channel_order import ChannelOrder
from sglang_hs.k_head_map import KHeadMap
from sglang_hs.launch import head_calibration as hc
from sglang_hs.launch import quality_inputs as qi
from sglang_hs.launch import quality_report as qr
from sglang_hs.pruner import MagnitudePruner

GEOMETRY = qi.PrefixGeometry(block=64, sink=64, window=128)
TINY_SPEC = hc.CalibrationSpec(needle_lengths=(448, 640), needle_depths=(0.3, 0.7), copy_lengths=(576,),
                               copy_depths=(0.5,), copy_tokens=40, quote_tokens=6)  # fmt: skip


# ------------------------------------------------------------------------------------------ map
@pytest.mark.parametrize("sk", [0.0, 0.1, 0.33, 0.5, 0.75, 0.9, 1.0])
def test_budget_map_meets_the_budget_exactly(sk):
    scores = torch.rand(30, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    f = qv.budget_map(scores, sk)
    assert f.shape == (30, 3) and f.dtype == torch.float64
    assert abs(float(f.sum()) - sk * 90) < 1e-9 and abs(float(f.mean()) - sk) < 1e-12
    assert int(((f > 0) & (f < 1)).sum()) <= 1  # one boundary head at most
    # Lower scores are pruned first: every sparse head scores no higher than every dense one.
    sparse, dense = scores[f > 0], scores[f == 0]
    if len(sparse) and len(dense):
        assert float(sparse.max()) <= float(dense.min())
    assert torch.equal(f, qv.budget_map(scores.clone(), sk))  # deterministic


def test_budget_map_is_nested_and_breaks_ties_by_index():
    scores = torch.zeros(4, 2, dtype=torch.float64)
    assert qv.budget_map(scores, 0.25).flatten().tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert qv.budget_map(scores, 0.3).flatten().tolist() == pytest.approx([1, 1, 0.4, 0, 0, 0, 0, 0])
    scores = torch.rand(10, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    maps = [qv.budget_map(scores, s) for s in (0.2, 0.5, 0.75, 0.9)]
    assert all(bool((a <= b).all()) for a, b in zip(maps, maps[1:]))
    with pytest.raises(ValueError):
        qv.budget_map(scores, 1.5)


def test_head_masks_follow_the_map_and_the_losses():
    g = torch.Generator().manual_seed(3)
    layers, heads, n = 6, 3, 11
    losses = torch.rand(layers, heads, n, generator=g)
    prunable = torch.ones(n, dtype=torch.bool)
    prunable[[0, 10]] = False  # e.g. blocks the caller keeps dense
    scores = torch.rand(layers, heads, generator=g, dtype=torch.float64)
    for sk in (0.0, 0.5, 0.75, 0.9, 1.0):
        f = qv.budget_map(scores, sk)
        mask = qv.head_sparse_masks(f, losses, prunable)
        assert mask.shape == (layers, heads, n) and not mask[..., ~prunable].any()
        per_head = mask.sum(-1)
        assert torch.equal(per_head[f == 1], torch.full_like(per_head[f == 1], 9))
        assert not per_head[f == 0].any()
        effective = float(mask.sum()) / (layers * heads * 9)
        assert sk <= effective < sk + 1 / (layers * heads)  # ceil on the boundary head only
        assert torch.equal(mask, qv.head_sparse_masks(f, losses, prunable))
    # A fractional head keeps its highest-loss blocks dense.
    f = torch.full((1, 1), 1 / 3, dtype=torch.float64)
    loss = torch.tensor([[[5.0, 1.0, 4.0, 2.0, 3.0, 0.5]]])
    assert qv.head_sparse_masks(f, loss, torch.ones(6, dtype=torch.bool)).flatten().tolist() == [0, 1, 0, 0, 0, 1]


# ------------------------------------------------------------------------------------------ channel order
def test_channel_permutation_spreads_the_important_channels():
    g = torch.Generator().manual_seed(6)
    energy = torch.rand(3, 2, 64, generator=g, dtype=torch.float64)
    perms = qv.channel_permutations(energy)
    assert perms.shape == (3, 2, 64)
    assert all(sorted(p.tolist()) == list(range(64)) for p in perms.view(-1, 64))
    rank = energy.argsort(-1, descending=True).argsort(-1)  # rank of every channel
    quarter = rank.gather(-1, perms).view(3, 2, 16, 4) // 16  # per group of 4: the quarters of its channels
    assert (quarter.sort(-1).values == torch.arange(4)).all()
    # Two large channels side by side: plain 2:4 drops one of them, the permuted mask keeps both.
    blocks = torch.ones(2, 1, 1, 64)
    blocks[..., 0:3] = 10.0
    e = torch.ones(1, 2, 64, dtype=torch.float64)
    e[..., 0:3] = 100.0
    keep = qv.permuted_keep(blocks, qv.channel_permutations(e)[0])
    assert keep[..., 0:3].all() and int(keep.sum()) == 2 * 32
    assert not MagnitudePruner().element_mask(blocks, "k")[..., 0:3].all()


def test_variant_names_parse():
    assert qv.parse_variant("magnitude") is None and qv.parse_variant("output_aware") is None
    assert es.known_pruner("magnitude") and es.known_pruner("headmap-copy+perm") and not es.known_pruner("output_aware")
    assert qv.parse_variant("headmap-needle") == qv.Variant("needle")
    assert qv.parse_variant("headmap-copy+perm") == qv.Variant("copy", True)
    assert qv.parse_variant("headmap-needle+fperm") == qv.Variant("needle", True, "file")
    assert qv.parse_variant("fperm") == qv.Variant(None, True, "file")
    assert qv.parse_variant("headmap-needle+fperm+vmap") == qv.Variant("needle", True, "file", True)
    assert qv.parse_variant("vcomp-50") == qv.Variant(None, v_comp=0.5)
    assert not qv.needs_calibration(["fperm"]) and qv.needs_calibration(["perm"])
    for name in ("headmap-nope", "perm+refit", "headmap-copy+mustafar", "fperm+vmap", "fperm+vcomp-x"):  # unknown parts (incl. removed variants), vmap without a map
        with pytest.raises(ValueError):
            qv.parse_variant(name)
    assert qv.needs_calibration(["magnitude", "headmap-needle"]) and not qv.needs_calibration(["headmap-random"])
    assert qv.parse_variant("headmap-random+stream-50") == qv.Variant("random", stream=0.5)
    assert qv.needs_calibration(["stream-25"]) and not qv.needs_calibration(["headmap-random+stream-25"])
    with pytest.raises(ValueError):
        qv.parse_variant("headmap-needle+stream-101")


# ------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def calibrated(tiny_model, calibration_corpus) -> es.StudyBackend:
    backend = es.StudyBackend(tiny_model, GEOMETRY)
    backend.calibrate(hc.load_calibration_texts(calibration_corpus), TINY_SPEC)
    return backend


def test_all_dense_map_equals_sk0_bit_for_bit_and_all_sparse_equals_sk1(calibrated):
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (900,)).tolist()
    state = calibrated.prefix_state(ids, GEOMETRY.reused(900, 900))
    n = len(GEOMETRY.compressed_blocks(900, state.reused))
    for score in ("needle", "copy_drop", "random"):
        for sv in (0.0, 1.0):
            for sk in (0.0, 1.0):
                k1, v1, s1 = calibrated.fast_kv(state, qi.Setting(f"headmap-{score}", sk, sv))
                k2, v2, s2 = calibrated.fast_kv(state, qi.Setting("magnitude", sk, sv))
                assert all(torch.equal(a, b) for a, b in zip(k1 + v1, k2 + v2)), (score, sk, sv)
                assert s1 == s2 == {"compressed_blocks": n, "sparse_k_blocks": sk * n, "sparse_v_blocks": sv * n}
    # A budget in between: K differs from both ends, V is the magnitude pruner's, the stats count rows.
    k, v, stats = calibrated.fast_kv(state, qi.Setting("headmap-needle", 0.5, 1.0))
    k0, v0, _ = calibrated.fast_kv(state, qi.Setting("magnitude", 0.0, 1.0))
    assert all(torch.equal(a, b) for a, b in zip(v, v0)) and not all(torch.equal(a, b) for a, b in zip(k, k0))
    assert stats["sparse_k_blocks"] == 0.5 * n
    # vmap: V is 2:4 exactly on the heads whose K the map prunes, dense on the heads that retrieve.
    k2, v2, stats = calibrated.fast_kv(state, qi.Setting("headmap-needle+vmap", 0.5, 1.0))
    mapped = qv.budget_map(calibrated.head_scores.scores["needle"], 0.5) >= 1.0
    assert all(torch.equal(a, b) for a, b in zip(k2, k)) and stats["sparse_v_blocks"] == 0.5 * n
    for layer in range(2):
        for head in range(2):
            want = v0 if mapped[layer, head] else state.v
            assert torch.equal(v2[layer][:, head], want[layer][:, head]), (layer, head)
    # The channel-order variants at S_K = 0 are dense too; at S_K = 1 they prune every compressible K row.
    for name in ("perm", "headmap-needle+perm"):
        k1, v1, _ = calibrated.fast_kv(state, qi.Setting(name, 0.0, 1.0))
        assert all(torch.equal(a, b) for a, b in zip(k1 + v1, k0 + v0)), name
        k1, _, s1 = calibrated.fast_kv(state, qi.Setting(name, 1.0, 1.0))
        assert s1["sparse_k_blocks"] == n and not torch.equal(k1[0], k0[0]), name


def test_streaming_heads_never_read_their_compressed_blocks(calibrated):
    """A streaming head's compressed blocks are hidden from every query: with every head streaming, what
    those blocks hold cannot move the logits; with half of them streaming, the lowest-scored half is
    hidden there, and the logits differ from both ends."""
    torch.manual_seed(4)
    ids = torch.randint(5, 1000, (900,)).tolist()
    state = calibrated.prefix_state(ids, GEOMETRY.reused(900, 900))
    blocks = GEOMETRY.compressed_blocks(900, state.reused)
    chunk = [qi.Setting("headmap-needle+stream-100", 0.0, 0.0), qi.Setting("headmap-needle+stream-100", 1.0, 1.0),
             qi.Setting("headmap-needle+stream-50", 0.0, 0.0), qi.Setting("headmap-needle", 0.0, 0.0)]  # fmt: skip
    views = [calibrated.fast_kv(state, s) for s in chunk]
    assert views[2][2]["streaming_heads"] == 0.5 and "streaming_heads" not in views[3][2]
    assert not torch.equal(views[0][0][0], views[1][0][0])  # the hidden blocks hold different K
    hide = calibrated.hidden_keys(chunk, blocks)
    suffix = ids[state.reused :] + [7, 8, 9]
    logits = calibrated.logits([v[:2] for v in views], suffix, 0, len(suffix), hide)
    assert torch.equal(logits[0], logits[1])
    assert not torch.equal(logits[2], logits[3]) and not torch.equal(logits[0], logits[2])
    assert calibrated.hidden_keys(chunk[3:], blocks) is None and calibrated.capture.hide is None
    streamed = qv.budget_map(calibrated.head_scores.scores["needle"], 0.5) >= 1.0
    mask = hide.key_mask(torch.zeros(4, 4, 1, 16), torch.zeros(4, 2, 1000, 16), 0.25, layer=1)
    lo, hi = blocks.start * 64, blocks.stop * 64
    assert (~mask[2, :, 0, lo:hi]).all(-1).tolist() == streamed[1].tolist() and mask[3].all()
    assert mask[2, :, 0, :lo].all() and mask[2, :, 0, hi:].all()  # sink, window and the question stay visible


def test_v_compensation_keeps_the_store_support_and_the_group_sums(calibrated):
    torch.manual_seed(3)
    ids = torch.randint(5, 1000, (900,)).tolist()
    state = calibrated.prefix_state(ids, GEOMETRY.reused(900, 900))
    blocks = GEOMETRY.compressed_blocks(900, state.reused)
    lo, hi = blocks.start * 64, blocks.stop * 64
    _, v0, _ = calibrated.fast_kv(state, qi.Setting("magnitude", 0.0, 1.0))
    _, v1, stats = calibrated.fast_kv(state, qi.Setting("vcomp-100", 0.0, 1.0))
    assert stats["sparse_v_blocks"] == len(blocks)
    for layer in range(2):
        assert torch.equal(qv.compensated_v(state.v[layer][lo:hi], 0.0), v0[layer][lo:hi])  # the store's 2:4 V
        assert torch.equal(v1[layer][:lo], state.v[layer][:lo]) and torch.equal(v1[layer][hi:], state.v[layer][hi:])
        groups = lambda x: x[lo:hi].float().unflatten(0, (-1, 4)).sum(1)  # noqa: E731
        assert torch.allclose(groups(v1[layer]), groups(state.v[layer]), atol=2e-2)
        assert not torch.allclose(groups(v0[layer]), groups(state.v[layer]), atol=2e-2)


def test_permuted_k_through_the_store_is_the_permuted_2to4_of_k(calibrated):
    torch.manual_seed(1)
    ids = torch.randint(5, 1000, (900,)).tolist()
    state = calibrated.prefix_state(ids, GEOMETRY.reused(900, 900))
    blocks = GEOMETRY.compressed_blocks(900, state.reused)
    perms = calibrated.permutations()
    for layer, k in enumerate(calibrated._permuted(state, blocks)):
        dense = state.k[layer][blocks.start * 64 : blocks.stop * 64]
        keep = qv.permuted_keep(dense.transpose(0, 1), perms[layer]).transpose(0, 1)
        assert torch.equal(k, torch.where(keep, dense, 0))


def test_file_permutation_goes_through_the_store(calibrated, tmp_path):
    torch.manual_seed(2)
    ids = torch.randint(5, 1000, (900,)).tolist()
    state = calibrated.prefix_state(ids, GEOMETRY.reused(900, 900))
    blocks = GEOMETRY.compressed_blocks(900, state.reused)
    order = ChannelOrder(calibrated.permutations().flip(-1))  # any valid order, not the calibrated one
    order.save(str(tmp_path / "order.pt"))
    calibrated.channel_order = ChannelOrder.load(str(tmp_path / "order.pt"))
    for layer, k in enumerate(calibrated._permuted(state, blocks, "file")):
        dense = state.k[layer][blocks.start * 64 : blocks.stop * 64]
        keep = qv.permuted_keep(dense.transpose(0, 1), order.perm[layer]).transpose(0, 1)
        assert torch.equal(k, torch.where(keep, dense, 0))
    assert not torch.equal(calibrated._permuted(state, blocks, "file")[0], calibrated._permuted(state, blocks)[0])


def test_evaluation_rows_report_effective_sparsity(calibrated, calibration_corpus):
    hay, held = qi.split_corpus(qi.load_corpus(calibration_corpus))
    samples = qi.make_samples(qi.TaskBuilder(calibrated.tokenizer, hay), ["single"], [1024], 1)
    windows = qi.make_windows(calibrated.tokenizer, held, [1024], 1, 64)
    names = ["dense", "magnitude:sk=0,sv=1", "headmap-needle:sk=0,sv=0", "headmap-needle:sk=0,sv=1",
             "headmap-needle:sk=0.75,sv=1", "fperm:sk=1,sv=1"]  # fmt: skip
    settings = [qi.setting_from_name(s) for s in names]
    calibrated.channel_order = ChannelOrder(calibrated.permutations())
    records = calibrated.evaluate(settings, samples, windows)  # raises if an S=0 row differs from dense
    rows = {r["setting"]: r for r in qr.summarize(records, settings, GEOMETRY)}
    assert rows["headmap-needle:sk=0,sv=1"]["kl"] == rows["magnitude:sk=0,sv=1"]["kl"]
    assert rows["headmap-needle:sk=0,sv=1"]["top1"] == rows["magnitude:sk=0,sv=1"]["top1"]
    row = rows["headmap-needle:sk=0.75,sv=1"]
    assert row["sk_setting"] == 0.75 and 0.75 <= row["sk"] < 0.76 and row["sv"] == 1.0
    assert row["bytes_saved"] == pytest.approx(0.21875 * (row["sk"] + 1.0))
    assert rows["fperm:sk=1,sv=1"]["sk"] == 1.0 and "sk" in rows["dense"] and "bytes_saved" not in rows["dense"]
    assert "effective S_K" in qr.markdown_report({"model": "m", "backend": "reference", "lengths": [1024], "tasks": [],
        "samples": 1, "questions": 1, "fidelity_windows": 1, "fidelity_tokens": 64, "fidelity_tokens_total": 64,
        "block": 64, "sink": 64, "window": 128, "kv_dtype": "float16", "seconds": 1.0}, list(rows.values()))  # fmt: skip


# ------------------------------------------------------------------------------------------ the study's command line
def test_eval_refuses_calibration_lengths(tiny_model, calibration_corpus, capsys):
    code = es.main(["--backend", "reference", "--model-path", tiny_model, "--corpus-dir", calibration_corpus,
                    "--calib-corpus", calibration_corpus, "--lengths", "1536", "--settings", "headmap-needle:sk=0.5,sv=1"])  # fmt: skip
    assert code == 2 and "calibration lengths" in capsys.readouterr().err


def test_decode_selection_reads_fewer_blocks_only_where_asked(tiny_model, calibration_corpus, tmp_path):
    """``--decode-select``: with K above the blocks every block is read, so S = 0 still answers as dense;
    the rules choose per KV head (exact), per layer (pooled) or on anchors (panchor); a bad rule is
    refused with one line."""
    common = ["--backend", "reference", "--model-path", tiny_model, "--out", str(tmp_path), "--corpus-dir", calibration_corpus,
              "--lengths", "1024", "--samples", "1", "--tasks", "single", "multikey", "--fidelity-windows", "0",
              "--window-tokens", "128", "--settings", "magnitude:sk=0,sv=0"]  # fmt: skip
    assert es.main([*common, "--tag", "all", "--decode-select", "pooled:1000"]) == 0
    data = json.loads((tmp_path / "quality_all.json").read_text())
    assert data["meta"]["decode_select"] == "pooled:1000"
    assert all(r["agrees_with_dense"] for r in data["records"] if r["setting"] == "magnitude:sk=0,sv=0")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 2, 400, 16, generator=g)
    exact = es.DecodeSelection("exact:2", 64, 64 * 5, 64, [True, False]).key_mask(q, k, 0.25)
    assert (exact[0, :, 0, 64:320].sum(-1) == 128).all() and exact[1].all()
    assert exact[0, :, 0, :64].all() and exact[0, :, 0, 320:].all()  # sink and window always read
    pooled = es.DecodeSelection("pooled:2", 64, 64 * 5, 64, [True, False]).key_mask(q, k, 0.25)
    assert (pooled[0, :, 0, 64:320].sum(-1) == 128).all() and torch.equal(pooled[0, 0], pooled[0, 1])  # one choice
    panchors = es.DecodeSelection("panchor:2:2", 64, 64 * 5, 64, [True, False])
    assert torch.equal(panchors.key_mask(q, k, 0.25, layer=0), pooled)
    assert torch.equal(panchors.key_mask(-q, k, 0.25, layer=1), pooled)  # reused by the next layer
    assert not torch.equal(panchors.key_mask(-q, k, 0.25, layer=2), pooled)  # a new anchor chooses again
    assert es.main([*common, "--decode-select", "pooled:0"]) == 2


def test_k_head_map_with_a_variant_or_a_bad_decode_mode_stops_the_run(tiny_model, calibration_corpus, tmp_path, capsys):
    """The reference's K variants choose their own K rows, so ``--k-head-map`` beside one is refused
    (it used to be ignored silently); a setting's decode mode must be kascade or psa and needs servers."""
    with open(f"{tiny_model}/config.json") as f:
        config = json.load(f)
    path = str(tmp_path / "map.pt")
    KHeadMap(torch.ones(config["num_hidden_layers"], config["num_key_value_heads"], dtype=torch.bool)).save(path)
    common = ["--model-path", tiny_model, "--out", str(tmp_path), "--corpus-dir", calibration_corpus]
    assert es.main(["--backend", "reference", *common, "--k-head-map", path, "--settings", "headmap-needle+fperm:sk=1,sv=1"]) == 2
    assert "prunes K its own way" in capsys.readouterr().err
    assert es.main(["--backend", "server", *common, "--settings", "magnitude:sk=0,sv=1,mode=topk"]) == 2
    assert "unknown decode mode" in capsys.readouterr().err
    assert es.main(["--backend", "reference", *common, "--settings", "magnitude:sk=0,sv=1,mode=kascade"]) == 2
    assert "need --backend server" in capsys.readouterr().err


def test_decode_select_rules_parse_with_one_line_errors():
    for rule in ("exact:8", "pooled:8", "panchor:8:4", "canchor:8:8", "canchor:8:0-3-11"):
        assert es.parse_decode_select(rule) == rule
    for bad in ("canchor:8:3-11", "canchor:8:0-11-3", "canchor:8:0", "canchor:0:4", "panchor:8", "topk:8", "mass:0.9"):
        with pytest.raises(ValueError, match="expected") as info:
            es.parse_decode_select(bad)
        assert "\n" not in str(info.value)


def test_fp8_round_trip_quantizes_only_its_tokens():
    """The FP8 variants' round trip: tokens outside [lo, hi) untouched, pruned zeros kept, e4m3's 3
    mantissa bits (relative error at most 2^-4 of each block and head's scale), unit scale saturating."""
    torch.manual_seed(0)
    x = (torch.randn(300, 3, 64) * 5).half()
    x[70:80, 1] = 0
    y = qv.fp8_round_trip(x, 64, 300, 64)
    assert torch.equal(y[:64], x[:64]) and torch.equal(y[70:80, 1], x[70:80, 1])
    blocks = torch.nn.functional.pad(x[64:].float(), (0, 0, 0, 0, 0, 20)).view(-1, 64, 3, 64)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True) / qv.FP8_MAX
    err = torch.nn.functional.pad((y[64:] - x[64:]).float(), (0, 0, 0, 0, 0, 20)).view(-1, 64, 3, 64).abs()
    assert (err <= blocks.abs() * 2**-4 + scale * 2**-9 + 1e-2).all() and err.max() > 0
    assert qv.fp8_round_trip(x * 200, 0, 300, 64, unit_scale=True).float().abs().max() == qv.FP8_MAX
    assert qv.parse_variant("fp8store").fp8 == "store" and qv.parse_variant("headmap-copy+fp8unit").fp8 == "unit"


def test_byte_accounting_of_the_study_variants():
    import fp8_frontier as ff

    rec = {"prefix_tokens": 2048, "compressed_blocks": 26, "sparse_k_blocks": 0, "sparse_v_blocks": 26}
    c = 26 * 64
    assert ff.bytes_vs_bf16("dense", rec) == 1.0 and ff.bytes_vs_bf16("fp8unit:sk=0,sv=0", rec) == 0.5
    sparse_24, scale = 0.5 + 0.0625, 4 / (64 * 64 * 2)  # 2:4 values + metadata; an fp32 scale a block and head
    assert ff.bytes_vs_bf16("magnitude:sk=0,sv=1", rec) == pytest.approx(1 - c * (1 - sparse_24) / (2 * 2048))
    streamed = dict(rec, sparse_v_blocks=0, streaming_heads=0.5)  # half the heads drop the compressed blocks
    assert ff.bytes_vs_bf16("headmap-needle+stream-50:sk=0,sv=0", streamed) == pytest.approx(1 - 0.5 * c / 2048)
    fp8 = ff.bytes_vs_bf16("headmap-needle+stream-50+fp8prefix:sk=0,sv=0", streamed)
    assert fp8 == pytest.approx((0.5 + scale) * (1 - 0.5 * c / 2048))
