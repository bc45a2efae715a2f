"""Head-adaptive K sparsity (sglang_hs/head_map.py) and its variants in the quality evaluation.

CPU only: the map and masks on synthetic scores, the calibration's separation from the
evaluation, the scoring and the error compensation against direct computations, and end to end
on the 2-layer random model (``make_model.write_tiny``): the head-adaptive path with an all-dense
map equals S_K = 0 bit for bit, with an all-sparse map S_K = 1.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import write_essays

from sglang_hs import head_map as hm
from sglang_hs.channel_order import ChannelOrder
from sglang_hs.launch import eval_quality as eq
from sglang_hs.launch import quality_reference as qref
from sglang_hs.launch import quality_inputs as qi
from sglang_hs.launch import quality_report as qr
from sglang_hs.launch import quality_variants as qv
from sglang_hs.pruner import MagnitudePruner

GEOMETRY = qi.PrefixGeometry(block=64, sink=64, window=128)
TINY_SPEC = hm.CalibrationSpec(needle_lengths=(448, 640), needle_depths=(0.3, 0.7), copy_lengths=(576,),
                               copy_depths=(0.5,), copy_tokens=40, quote_tokens=6)  # fmt: skip


# ------------------------------------------------------------------------------------------ map
@pytest.mark.parametrize("sk", [0.0, 0.1, 0.33, 0.5, 0.75, 0.9, 1.0])
def test_budget_map_meets_the_budget_exactly(sk):
    scores = torch.rand(30, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    f = hm.budget_map(scores, sk)
    assert f.shape == (30, 3) and f.dtype == torch.float64
    assert abs(float(f.sum()) - sk * 90) < 1e-9 and abs(float(f.mean()) - sk) < 1e-12
    assert int(((f > 0) & (f < 1)).sum()) <= 1  # one boundary head at most
    # Lower scores are pruned first: every sparse head scores no higher than every dense one.
    sparse, dense = scores[f > 0], scores[f == 0]
    if len(sparse) and len(dense):
        assert float(sparse.max()) <= float(dense.min())
    assert torch.equal(f, hm.budget_map(scores.clone(), sk))  # deterministic


def test_budget_map_is_nested_and_breaks_ties_by_index():
    scores = torch.zeros(4, 2, dtype=torch.float64)
    assert hm.budget_map(scores, 0.25).flatten().tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert hm.budget_map(scores, 0.3).flatten().tolist() == pytest.approx([1, 1, 0.4, 0, 0, 0, 0, 0])
    scores = torch.rand(10, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    maps = [hm.budget_map(scores, s) for s in (0.2, 0.5, 0.75, 0.9)]
    assert all(bool((a <= b).all()) for a, b in zip(maps, maps[1:]))
    with pytest.raises(ValueError):
        hm.budget_map(scores, 1.5)


def test_head_masks_follow_the_map_and_the_losses():
    g = torch.Generator().manual_seed(3)
    layers, heads, n = 6, 3, 11
    losses = torch.rand(layers, heads, n, generator=g)
    prunable = torch.ones(n, dtype=torch.bool)
    prunable[[0, 10]] = False  # e.g. blocks the caller keeps dense
    scores = torch.rand(layers, heads, generator=g, dtype=torch.float64)
    for sk in (0.0, 0.5, 0.75, 0.9, 1.0):
        f = hm.budget_map(scores, sk)
        mask = hm.head_sparse_masks(f, losses, prunable)
        assert mask.shape == (layers, heads, n) and not mask[..., ~prunable].any()
        per_head = mask.sum(-1)
        assert torch.equal(per_head[f == 1], torch.full_like(per_head[f == 1], 9))
        assert not per_head[f == 0].any()
        effective = float(mask.sum()) / (layers * heads * 9)
        assert sk <= effective < sk + 1 / (layers * heads)  # ceil on the boundary head only
        assert torch.equal(mask, hm.head_sparse_masks(f, losses, prunable))
    # A fractional head keeps its highest-loss blocks dense.
    f = torch.full((1, 1), 1 / 3, dtype=torch.float64)
    loss = torch.tensor([[[5.0, 1.0, 4.0, 2.0, 3.0, 0.5]]])
    assert hm.head_sparse_masks(f, loss, torch.ones(6, dtype=torch.bool)).flatten().tolist() == [0, 1, 0, 0, 0, 1]


# ------------------------------------------------------------------------------------------ calibration
def test_calibration_is_disjoint_from_the_evaluation():
    spec = hm.CalibrationSpec()
    eval_lengths = set(eq.parse_args([]).lengths) | {3072, 6144}  # the default and the study's held-out lengths
    calib_lengths = set(spec.needle_lengths) | set(spec.copy_lengths)
    assert not calib_lengths & eval_lengths
    # The evaluation's single-needle depths for 1..4 samples never equal a calibration depth.
    eval_depths = {round(0.05 + 0.9 * (i + 0.5) / n, 6) for n in range(1, 5) for i in range(n)}
    assert not eval_depths & {round(d, 6) for d in spec.needle_depths + spec.copy_depths}
    # Random streams: the evaluation keys its by "<seed>/<task>/..." and "<seed>/fidelity/...".
    key = spec.seed_key("needle", 1536, 0)
    assert key.startswith(hm.SEED_NAMESPACE + "/") and not re.match(r"^\d+/", key)
    eval_keys = {f"{s}/{t}/{n}/{i}" for s in range(3) for t in qi.TASKS for n in (1024, 1536) for i in range(4)}
    assert not eval_keys & {spec.seed_key(k, n, i) for k in ("needle", "copy") for n in (1024, 1536) for i in range(4)}


def test_calibration_text_shares_no_sentence_with_the_essays():
    try:
        essays = qi.load_corpus()
        licences = qv.load_calibration_texts(None)
    except qi.MissingInput as exc:
        pytest.skip(str(exc))
    norm = lambda texts: {s for t in texts for s in re.split(r"(?<=[.!?])\s+", " ".join(t.split())) if len(s) > 40}  # noqa: E731
    assert not norm(essays.values()) & norm(licences)


def test_eval_refuses_calibration_lengths(tiny_model, corpus_dir, capsys):
    code = eq.main(["--backend", "reference", "--model-path", tiny_model, "--corpus-dir", corpus_dir,
                    "--calib-corpus", corpus_dir, "--lengths", "1536", "--settings", "headmap-needle:sk=0.5,sv=1"])  # fmt: skip
    assert code == 2 and "calibration lengths" in capsys.readouterr().err


def test_attention_mass_matches_a_direct_computation():
    g = torch.Generator().manual_seed(4)
    query, key = torch.randn(6, 40, 64, generator=g), torch.randn(2, 40, 64, generator=g)
    probe = hm.Probe("needle", tuple(range(40)), (30, 35, 39), ((5, 9), (5, 9), (20, 21)), 30, 40, 0.5, "k")
    got = hm.attention_mass(query, key, 0.125, probe)
    want = torch.zeros(2, dtype=torch.float64)
    for h in range(6):
        for (pos, (a, b)) in zip(probe.queries, probe.targets):
            p = torch.softmax(query[h, pos] @ key[h // 3, : pos + 1].T * 0.125, -1)
            want[h // 3] += float(p[a:b].sum()) / 3
    assert torch.allclose(got, want, atol=1e-6)


def test_compressible_range_follows_the_geometry():
    for length in (300, 700, 1000, 2048):
        blocks = GEOMETRY.compressed_blocks(length, GEOMETRY.node_end(length))
        lo, hi = hm.compressible_range(length, 64, 64, 128)
        assert (lo, hi) == ((blocks.start * 64, blocks.stop * 64) if len(blocks) else (lo, lo))


# ------------------------------------------------------------------------------------------ channel order
def test_channel_permutation_spreads_the_important_channels():
    g = torch.Generator().manual_seed(6)
    energy = torch.rand(3, 2, 64, generator=g, dtype=torch.float64)
    perms = hm.channel_permutations(energy)
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
    keep = hm.permuted_keep(blocks, hm.channel_permutations(e)[0])
    assert keep[..., 0:3].all() and int(keep.sum()) == 2 * 32
    assert not MagnitudePruner().element_mask(blocks, "k")[..., 0:3].all()


def test_variant_names_parse():
    assert qv.parse_variant("magnitude") is None and qv.parse_variant("output_aware") is None
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


# ------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> str:
    return write_essays(tmp_path_factory.mktemp("essays"), seed=100)


@pytest.fixture(scope="module")
def calibrated(tiny_model, corpus_dir) -> qref.ReferenceBackend:
    backend = qref.ReferenceBackend(tiny_model, GEOMETRY)
    backend.calibrate(qv.load_calibration_texts(corpus_dir), TINY_SPEC)
    return backend


def test_calibration_scores_every_head(calibrated):
    scores = calibrated.head_scores
    assert set(scores.scores) == set(hm.SCORE_NAMES)
    for name, s in scores.scores.items():
        assert s.shape == (2, 2) and torch.isfinite(s).all(), name
    assert ((scores.scores["needle"] >= 0) & (scores.scores["needle"] <= 4 + 1e-9)).all()  # 4 query heads per KV head
    assert scores.query_moment.shape == (2, 2, 64, 64)
    assert len(scores.meta["probes"]) == 5 and all(p["seed_key"].startswith(hm.SEED_NAMESPACE) for p in scores.meta["probes"])


def test_all_dense_map_equals_sk0_bit_for_bit_and_all_sparse_equals_sk1(calibrated):
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (900,)).tolist()
    state = calibrated.prefix_state(ids, GEOMETRY.reused(900, 900), calibrate=False)
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
    mapped = hm.budget_map(calibrated.head_scores.scores["needle"], 0.5) >= 1.0
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


def test_v_compensation_keeps_the_store_support_and_the_group_sums(calibrated):
    torch.manual_seed(3)
    ids = torch.randint(5, 1000, (900,)).tolist()
    state = calibrated.prefix_state(ids, GEOMETRY.reused(900, 900), calibrate=False)
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
    state = calibrated.prefix_state(ids, GEOMETRY.reused(900, 900), calibrate=False)
    blocks = GEOMETRY.compressed_blocks(900, state.reused)
    perms = calibrated.permutations()
    for layer, k in enumerate(calibrated._permuted(state, blocks)):
        dense = state.k[layer][blocks.start * 64 : blocks.stop * 64]
        keep = hm.permuted_keep(dense.transpose(0, 1), perms[layer]).transpose(0, 1)
        assert torch.equal(k, torch.where(keep, dense, 0))


def test_file_permutation_goes_through_the_store(calibrated, tmp_path):
    torch.manual_seed(2)
    ids = torch.randint(5, 1000, (900,)).tolist()
    state = calibrated.prefix_state(ids, GEOMETRY.reused(900, 900), calibrate=False)
    blocks = GEOMETRY.compressed_blocks(900, state.reused)
    order = ChannelOrder(calibrated.permutations().flip(-1))  # any valid order, not the calibrated one
    order.save(str(tmp_path / "order.pt"))
    calibrated.channel_order = ChannelOrder.load(str(tmp_path / "order.pt"))
    for layer, k in enumerate(calibrated._permuted(state, blocks, "file")):
        dense = state.k[layer][blocks.start * 64 : blocks.stop * 64]
        keep = hm.permuted_keep(dense.transpose(0, 1), order.perm[layer]).transpose(0, 1)
        assert torch.equal(k, torch.where(keep, dense, 0))
    assert not torch.equal(calibrated._permuted(state, blocks, "file")[0], calibrated._permuted(state, blocks)[0])


def test_evaluation_rows_report_effective_sparsity(calibrated, corpus_dir):
    hay, held = qi.split_corpus(qi.load_corpus(corpus_dir))
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
