"""Retrieval-head calibration (``sglang_hs.launch.head_calibration``) and ``calibrate_heads`` over a model.

CPU only: the calibration's separation from the evaluation, the scoring against direct computations,
and end to end on the 2-layer random model (``make_model.write_tiny``).
"""

from __future__ import annotations

import re

import pytest
import torch

from sglang_hs.k_head_map import KHeadMap
from sglang_hs.launch import eval_quality as eq
from sglang_hs.launch import head_calibration as hc
from sglang_hs.launch import quality_inputs as qi
from sglang_hs.launch import quality_reference as qref

GEOMETRY = qi.PrefixGeometry(block=64, sink=64, window=128)
TINY_SPEC = hc.CalibrationSpec(needle_lengths=(448, 640), needle_depths=(0.3, 0.7), copy_lengths=(576,),
                               copy_depths=(0.5,), copy_tokens=40, quote_tokens=6)  # fmt: skip


def test_calibration_is_disjoint_from_the_evaluation():
    spec = hc.CalibrationSpec()
    eval_lengths = set(eq.parse_args([]).lengths) | {3072, 6144}  # the default and the study's held-out lengths
    calib_lengths = set(spec.needle_lengths) | set(spec.copy_lengths)
    assert not calib_lengths & eval_lengths
    # The evaluation's single-needle depths for 1..4 samples never equal a calibration depth.
    eval_depths = {round(0.05 + 0.9 * (i + 0.5) / n, 6) for n in range(1, 5) for i in range(n)}
    assert not eval_depths & {round(d, 6) for d in spec.needle_depths + spec.copy_depths}
    # Random streams: the evaluation keys its by "<seed>/<task>/..." and "<seed>/fidelity/...".
    key = spec.seed_key("needle", 1536, 0)
    assert key.startswith(hc.SEED_NAMESPACE + "/") and not re.match(r"^\d+/", key)
    eval_keys = {f"{s}/{t}/{n}/{i}" for s in range(3) for t in qi.TASKS for n in (1024, 1536) for i in range(4)}
    assert not eval_keys & {spec.seed_key(k, n, i) for k in ("needle", "copy") for n in (1024, 1536) for i in range(4)}


def test_calibration_text_shares_no_sentence_with_the_essays():
    try:
        essays = qi.load_corpus()
        licences = hc.load_calibration_texts(None)
    except qi.MissingInput as exc:
        pytest.skip(str(exc))
    norm = lambda texts: {s for t in texts for s in re.split(r"(?<=[.!?])\s+", " ".join(t.split())) if len(s) > 40}  # noqa: E731
    assert not norm(essays.values()) & norm(licences)


def test_attention_mass_matches_a_direct_computation():
    g = torch.Generator().manual_seed(4)
    query, key = torch.randn(6, 40, 64, generator=g), torch.randn(2, 40, 64, generator=g)
    probe = hc.Probe("needle", tuple(range(40)), (30, 35, 39), ((5, 9), (5, 9), (20, 21)), 30, 40, 0.5, "k")
    got = hc.attention_mass(query, key, 0.125, probe)
    want = torch.zeros(2, dtype=torch.float64)
    for h in range(6):
        for (pos, (a, b)) in zip(probe.queries, probe.targets):
            p = torch.softmax(query[h, pos] @ key[h // 3, : pos + 1].T * 0.125, -1)
            want[h // 3] += float(p[a:b].sum()) / 3
    assert torch.allclose(got, want, atol=1e-6)


def test_compressible_range_follows_the_geometry():
    for length in (300, 700, 1000, 2048):
        blocks = GEOMETRY.compressed_blocks(length, GEOMETRY.node_end(length))
        lo, hi = hc.compressible_range(length, 64, 64, 128)
        assert (lo, hi) == ((blocks.start * 64, blocks.stop * 64) if len(blocks) else (lo, lo))


# ------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def calibrated(tiny_model, calibration_corpus) -> hc.HeadScores:
    backend = qref.ReferenceBackend(tiny_model, GEOMETRY)
    return hc.calibrate_model(backend, hc.load_calibration_texts(calibration_corpus), TINY_SPEC)


def test_calibration_scores_every_head(calibrated):
    scores = calibrated
    assert set(scores.scores) == set(hc.SCORE_NAMES)
    for name, s in scores.scores.items():
        assert s.shape == (2, 2) and torch.isfinite(s).all(), name
    assert ((scores.scores["needle"] >= 0) & (scores.scores["needle"] <= 4 + 1e-9)).all()  # 4 query heads per KV head
    assert scores.query_moment.shape == (2, 2, 64, 64)
    assert len(scores.meta["probes"]) == 5 and all(p["seed_key"].startswith(hc.SEED_NAMESPACE) for p in scores.meta["probes"])


def test_calibrate_heads_runs_the_model_and_writes_the_map(tiny_model, calibration_corpus, tmp_path):
    """``calibrate_heads`` over the model (the calibration's default prompt lengths) writes a map of the
    share, and the scores it caches give the same map without a forward."""
    from sglang_hs.launch import calibrate_heads

    out, scores = str(tmp_path / "map.pt"), str(tmp_path / "scores.pt")
    argv = ["--model-path", tiny_model, "--share", "0.5", "--calib-corpus", calibration_corpus, "--out", out]
    assert calibrate_heads.main([*argv, "--head-scores", scores]) == 0
    first = KHeadMap.load(out)
    assert first.sparse.shape == (2, 2) and first.share == 0.5
    assert calibrate_heads.main([*argv, "--head-scores", scores]) == 0  # from the cache
    assert torch.equal(KHeadMap.load(out).sparse, first.sparse)
