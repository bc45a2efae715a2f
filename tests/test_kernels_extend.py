"""GPU tests of the HieraSparse extend kernel (``sglang_hs.kernels.extend``).

The oracle is ``sglang_hs.reference.paged_attention`` (float32 arithmetic, run on the GPU, small ragged
batches); larger batches are checked against dense attention and FlashInfer's paged prefill over the
decompressed (pruned) KV of the same requests. Every shipped configuration (each tile of ``TILES`` with
each of its ``STAGES``, with and without 2:4 K buffers, fp16 and bf16, head_dim 64 and 128, GQA groups 1,
2, 4 and 8) runs against the oracle. Every test is marked ``gpu`` (skipped without CUDA by the conftest);
importing this module needs neither a GPU nor TileLang.
"""

import functools

import pytest
import torch

from sglang_hs import reference as R
from sglang_hs.kernels import bench, cases
from sglang_hs.kernels.extend import (
    BENCH_VARIANTS, PRECOMPILE, STAGES, TILES, HieraSparseExtend, choose_num_splits, default_stages, tile_count, tile_ids,
)

# Ragged batch: a partial last page, a block-aligned one, a request without compressed blocks (prefix
# 300 = sink + window only), a single new token, a request with no prefix at all, a long chunk whose
# causal diagonal spans several blocks and tiles.
PREFIX = [1000, 448, 300, 769, 0, 1500]
NEW = [37, 64, 150, 1, 100, 200]
SMALL_MAX_BLOCKS = 30  # > the longest request's 27 blocks: the table has unused (poisoned) columns

# (q_heads, kv_heads, head_dim, dtype, S_K, S_V, plan options): each tile with GQA groups 4, 8, 2 and 1;
# d 128 and 64; fp16 and bf16; S in {0, 0.5, 1} mixes; with (S_K > 0) and without (S_K = 0) the 2:4 K
# buffers.
SMALL = [
    # n128: a producer warpgroup and two ping-pong consumer warpgroups.
    (32, 8, 128, torch.float16, 1.0, 1.0, dict(tile="n128")),
    (32, 8, 128, torch.float16, 0.0, 1.0, dict(tile="n128")),
    (16, 2, 128, torch.bfloat16, 0.5, 1.0, dict(tile="n128")),
    (8, 4, 128, torch.float16, 0.0, 1.0, dict(tile="n128")),
    (4, 4, 64, torch.bfloat16, 0.0, 0.0, dict(tile="n128")),
    (8, 2, 64, torch.bfloat16, 0.5, 1.0, dict(tile="n128")),
    (8, 2, 64, torch.float16, 1.0, 0.5, dict(tile="n128")),  # the tiny server model's shape
    # n64: one warpgroup, the O^T GEMM of block j - 1 under block j's softmax.
    (32, 8, 128, torch.float16, 0.5, 0.5, dict(tile="n64")),
    (32, 8, 128, torch.float16, 1.0, 1.0, dict(tile="n64")),
    (16, 2, 128, torch.float16, 0.0, 1.0, dict(tile="n64")),
    (16, 2, 128, torch.bfloat16, 1.0, 0.5, dict(tile="n64")),
    (8, 4, 128, torch.float16, 0.5, 0.5, dict(tile="n64")),
    (4, 4, 64, torch.float16, 1.0, 0.0, dict(tile="n64")),
    (8, 2, 64, torch.float16, 0.0, 1.0, dict(tile="n64")),
    # Groups that leave columns of a tile idle: 3 (SmolLM2, Llama-3.2-3B), 5 (Qwen3-14B), 6 (Qwen2.5-1.5B),
    # 7 (Qwen2.5-7B), on both tiles.
    (9, 3, 64, torch.float16, 1.0, 0.5, dict(tile="n64")),
    (6, 2, 64, torch.bfloat16, 0.5, 1.0, dict(tile="n128")),
    (10, 2, 128, torch.bfloat16, 0.0, 1.0, dict(tile="n128")),
    (10, 2, 128, torch.float16, 1.0, 1.0, dict(tile="n64")),
    (12, 2, 64, torch.float16, 0.5, 0.5, dict(tile="n128")),
    (12, 2, 128, torch.bfloat16, 1.0, 0.0, dict(tile="n64")),
    (14, 2, 128, torch.float16, 1.0, 1.0, dict(tile="n128")),
    (28, 4, 64, torch.bfloat16, 0.0, 1.0, dict(tile="n64")),
    (9, 3, 128, torch.bfloat16, 0.5, 1.0, dict(tile="n128")),  # groups 3 and 5 at their other head_dim
    (10, 2, 64, torch.float16, 1.0, 0.5, dict(tile="n64")),
]
MID_PREFIX = [4096, 2500, 8192, 77]
MID_NEW = [64, 300, 129, 1000]
MID_MAX_BLOCKS = 160


def _id(v):
    hq, hkv, d, dt, sk, sv, opts = v
    extra = "".join(f"-{k}={x}" for k, x in opts.items())
    return f"G{hq // hkv}-d{d}-{str(dt).split('.')[-1]}-sk{sk:g}-sv{sv:g}{extra}"


def _plan(case, **kw):
    q = case["q"]
    return HieraSparseExtend(q.shape[1], case["k_cache"].shape[1], q.shape[2], case["block_size"],
                             case["max_blocks"], q.dtype, q.device, **kw)


@functools.lru_cache(maxsize=None)
def _small_case(hq, hkv, d, dtype, sk, sv):
    """The ragged batch for one shape and its oracle output (shared by the variants of a shape)."""
    case = cases.make_extend_case(PREFIX, NEW, hq, hkv, d, sk, sv, dtype, "cuda", max_blocks=SMALL_MAX_BLOCKS,
                                  seed=1)
    return case, cases.extend_reference(case)


def _tol(dtype):
    return 1e-2 if dtype == torch.bfloat16 else 3e-3


def _rows(case, r):
    return slice(case["qo_indptr_list"][r], case["qo_indptr_list"][r + 1])


def _check_reference(case, got, lse, ref_out, ref_lse, dtype, what=""):
    assert torch.isfinite(got).all(), f"{what}: unwritten or non-finite outputs"
    for r in range(len(case["new_lens"])):
        rows = _rows(case, r)
        err = cases.rel_err(got[rows], ref_out[rows].to(got.device))
        assert err < _tol(dtype), f"{what} request {r}: rel err {err:.2e}"
    if lse is not None:
        assert (lse - ref_lse.to(lse.device)).abs().max().item() < 2e-2, f"{what}: LSE"


def _dense_check(case, out, tol=3e-3):
    """Against dense causal attention over each request's decompressed (pruned) KV."""
    paged = cases.paged_dense(case)
    for r in range(len(case["new_lens"])):
        k, v = cases.dense_kv(case, paged, r)
        rows = _rows(case, r)
        ref, _ = R.dense_attention(case["q"][rows], k, v, sm_scale=case["sm_scale"])
        err = cases.rel_err(out[rows], ref)
        assert err < tol, f"request {r}: rel err {err:.2e} vs dense attention"
    return paged


def _flashinfer_check(case, paged, out, tol=3e-3):
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return
    fi = cases.flashinfer_extend(case, paged)()
    assert cases.rel_err(out, fi) < tol, "vs FlashInfer paged prefill"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", SMALL, ids=_id)
def test_matches_reference(variant):
    """Every shipped configuration, ragged batch, against the oracle; the split count of the plan's own
    choice (small batch: several splits), then one split (direct write) and 7 (uneven, empty splits)."""
    hq, hkv, d, dtype, sk, sv, opts = variant
    case, (ref_out, ref_lse) = _small_case(hq, hkv, d, dtype, sk, sv)
    plan = _plan(case, **opts)
    out = torch.full_like(case["q"], float("nan"))
    got, lse = plan.run(*cases.extend_run_args(case), out=out, return_lse=True)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert plan.last_config["tile"] == opts["tile"]
    assert plan.last_config["k_sparse"] == (sk > 0)
    _check_reference(case, got, lse, ref_out, ref_lse, dtype, f"auto splits ({plan.last_config['num_splits']})")
    again = plan.run(*cases.extend_run_args(case))  # repeated calls: scratch and split tickets are reusable
    torch.cuda.synchronize()
    assert torch.equal(again, got) and not plan._cnt.any()
    for splits in (1, 7):
        forced = _plan(case, num_splits=splits, **opts)
        out2, lse2 = forced.run(*cases.extend_run_args(case), return_lse=True)
        torch.cuda.synchronize()
        assert forced.last_config["num_splits"] == splits
        _check_reference(case, out2, lse2, ref_out, ref_lse, dtype, f"{splits} splits")
        assert not forced._cnt.any()


# FP8 KV through 16-bit copies: (q_heads, kv_heads, head_dim, dtype, S_K, S_V, plan options); the kernels
# are those without 2:4 K buffers whatever S_K (the copies are cache pages).
FP8_KV = [
    (32, 8, 128, torch.float16, 0.5, 1.0, dict(tile="n128")),
    (9, 3, 64, torch.bfloat16, 1.0, 1.0, dict(tile="n64")),
    (8, 2, 64, torch.float16, 0.0, 0.0, dict(tile="n128")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", FP8_KV, ids=_id)
def test_fp8_kv_through_16_bit_copies_matches_reference(variant):
    """FP8 KV (an FP8 store and SGLang's FP8 pages), as the backend runs it: the batch's blocks copied to
    16-bit pages (``fallback.batch_pages``), the kernel without 2:4 K buffers over them, in one call and
    in chunks of requests (``fallback.batch_chunks``), against the oracle over the same values."""
    from sglang_hs.fallback import batch_chunks, batch_pages

    hq, hkv, d, dtype, sk, sv, opts = variant
    case = cases.quantize_case(cases.make_extend_case(PREFIX, NEW, hq, hkv, d, sk, sv, dtype, "cuda",
                                                      max_blocks=SMALL_MAX_BLOCKS, seed=5))  # fmt: skip
    fp8, oracle = cases.fp8_pages(case)
    ref_out, ref_lse = cases.extend_reference(oracle)
    pools = cases.pools_of(fp8)
    no_pools = cases.pools_of(cases.make_case([64], hq, hkv, d, 0.0, 0.0, dtype, "cuda", sink_blocks=1, window_blocks=0))
    no_pools = type(no_pools)(*(t[:0] for t in vars(no_pools).values() if t is not None))
    no_index = torch.empty(hkv, 0, dtype=torch.int32, device="cuda")
    plan = _plan(case, **opts)
    seq_lens, indptr = case["seq_lens_list"], case["qo_indptr_list"]
    for max_blocks in (10**6, 30):  # one chunk; several
        chunks = batch_chunks(seq_lens, 64, max_blocks)
        assert (len(chunks) == 1) == (max_blocks > 10**5)
        out = torch.full_like(case["q"], float("nan"))
        for first, stop, width in chunks:
            k_pages, v_pages, table = batch_pages(fp8["k_cache"], fp8["v_cache"], pools, fp8["k_index"],
                                                  fp8["v_index"], fp8["block_table"][first:stop],
                                                  fp8["seq_lens"][first:stop], width, 64, dtype)
            rows = slice(indptr[first], indptr[stop])
            qo = torch.tensor([n - indptr[first] for n in indptr[first:stop + 1]], dtype=torch.int32, device="cuda")
            plan.run(case["q"][rows], qo, k_pages, v_pages, no_pools, no_index, no_index, table,
                     case["seq_lens"][first:stop], case["sm_scale"], out=out[rows])
            assert plan.last_config["k_sparse"] is False
        torch.cuda.synchronize()
        _check_reference(case, out, None, ref_out, ref_lse, dtype, f"FP8 KV, {len(chunks)} chunks")


@pytest.mark.gpu
def test_dynamic_split_limits_match_reference():
    """``dynamic_splits`` (the shared-prefix decode's kernel, here over the ragged extend batch): each
    request uses its own split count, read on the GPU (1, the grid's, some between, more than the grid:
    clamped); a request whose limit is 0 is skipped and its rows stay as they were; the tickets reset."""
    case, (ref_out, ref_lse) = _small_case(32, 8, 128, torch.float16, 1.0, 1.0)
    plan = _plan(case, tile="n64", num_splits=8, dynamic_splits=True)
    for limits in ([1, 8, 3, 99, 5, 2], [0, 8, 0, 4, 1, 0]):
        out = torch.full_like(case["q"], float("nan"))
        limit = torch.tensor(limits, dtype=torch.int32, device="cuda")
        got, lse = plan.run(*cases.extend_run_args(case), out=out, return_lse=True, split_limit=limit)
        torch.cuda.synchronize()
        for r, n in enumerate(limits):
            rows = _rows(case, r)
            if n == 0:
                assert torch.isnan(got[rows]).all(), f"request {r} (limit 0) was written"
                continue
            assert cases.rel_err(got[rows], ref_out[rows].to(got.device)) < 3e-3, f"limits {limits}, request {r}"
            assert (lse[rows] - ref_lse[rows].to(lse.device)).abs().max().item() < 2e-2
        assert not plan._cnt.any()
    with pytest.raises(ValueError, match="split_limit"):
        plan.run(*cases.extend_run_args(case))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(TILES))
def test_dense_equals_dense_attention_and_flashinfer(tile):
    """S_K = S_V = 0 (cache pages + dense pool rows): dense attention and FlashInfer to fp16 rounding."""
    case = cases.make_extend_case(MID_PREFIX, MID_NEW, 32, 8, 128, 0.0, 0.0, torch.float16, "cuda",
                                  max_blocks=MID_MAX_BLOCKS, seed=2)
    out = _plan(case, tile=tile).run(*cases.extend_run_args(case))
    paged = _dense_check(case, out)
    _flashinfer_check(case, paged, out)


@pytest.mark.gpu
@pytest.mark.parametrize("sk,sv,tile", [(1.0, 1.0, "n128"), (0.0, 1.0, "n128"), (0.5, 0.5, "n128"),
                                        (1.0, 1.0, "n64"), (0.0, 1.0, "n64")])
def test_sparse_matches_decompressed(sk, sv, tile):
    """Mixed dense/sparse blocks at a few thousand tokens: dense attention and FlashInfer over the pruned
    KV. One split, so that a CTA walks up to 130 blocks: past the index ring's first pass (128 entries at
    n128, 64 at n64), where the ring's next half is resolved."""
    case = cases.make_extend_case(MID_PREFIX, MID_NEW, 32, 8, 128, sk, sv, torch.float16, "cuda",
                                  max_blocks=MID_MAX_BLOCKS, seed=3)
    out = _plan(case, tile=tile, num_splits=1).run(*cases.extend_run_args(case))
    paged = _dense_check(case, out)
    _flashinfer_check(case, paged, out)


@pytest.mark.gpu
@pytest.mark.parametrize("sk", [0.0, 1.0])  # dense K: the offset on S's rows (Q in registers); 2:4 K: on S^T's columns
@pytest.mark.parametrize("tile", sorted(TILES))
def test_lazy_offsets_move_with_sharp_scores(tile, sk):
    """The lazy softmax offset moves only when a score passes it by more than 2^8. At ten times the usual scale the scores have a standard deviation of about 14 in
    log2 units, so the running max of most columns passes the first block's max by more than that in
    later blocks: the offset moves (O^T and the sums rescaled) many times per CTA. Against the oracle,
    with the plan's splits and with one split (a CTA walks every block of its tile)."""
    case = cases.make_extend_case(PREFIX, NEW, 32, 8, 128, sk, 1.0, torch.float16, "cuda",
                                  max_blocks=SMALL_MAX_BLOCKS, seed=6)
    case["sm_scale"] *= 10.0
    ref_out, ref_lse = cases.extend_reference(case)
    for splits in (None, 1):
        plan = _plan(case, tile=tile, num_splits=splits)
        got, lse = plan.run(*cases.extend_run_args(case), return_lse=True)
        torch.cuda.synchronize()
        _check_reference(case, got, lse, ref_out, ref_lse, torch.float16, f"{tile}, splits {splits}")


@pytest.mark.gpu
def test_benchmark_shape_auto_plan():
    """The benchmark's shape (Llama-3.1-8B heads, natural pool order) with the default plan at a shorter
    prefix: batch 8 x (8K prefix + 64 new tokens), S_K = S_V = 1, against FlashInfer."""
    case = cases.make_extend_case([8192] * 8, [64] * 8, 32, 8, 128, 1.0, 1.0, torch.float16, "cuda", seed=4,
                                  magnitude=False, shuffle=False)
    plan = _plan(case)
    out = plan.run(*cases.extend_run_args(case))
    assert plan.last_config["tile"] == "n128" and plan.last_config["stages"] == 2
    paged = _dense_check(case, out)
    _flashinfer_check(case, paged, out)


@pytest.mark.gpu
def test_zero_new_tokens_and_strided_q():
    """A request with no new tokens writes nothing and disturbs nothing; a strided q (a view of a fused
    QKV buffer) and a non-contiguous out are accepted."""
    prefix, new = [1000, 500, 300], [37, 0, 90]
    case = cases.make_extend_case(prefix, new, 32, 8, 128, 0.5, 1.0, torch.float16, "cuda", max_blocks=20, seed=5)
    ref_out, ref_lse = cases.extend_reference(case)
    q = case["q"]
    fused = torch.randn(q.shape[0], q.shape[1] + 16, q.shape[2], device=q.device, dtype=q.dtype)
    fused[:, :q.shape[1]] = q
    case["q"] = fused[:, :q.shape[1]]
    assert not case["q"].is_contiguous()
    out_big = torch.full((q.shape[0], q.shape[1], 2 * q.shape[2]), float("nan"), device=q.device, dtype=q.dtype)
    out = out_big[..., :q.shape[2]]
    got = _plan(case, tile="n128").run(*cases.extend_run_args(case), out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    _check_reference(case, got, None, ref_out, ref_lse, torch.float16)


@pytest.mark.gpu
def test_tile_ids_and_split_heuristic():
    """Tile ids are disjoint, increasing and below the host's bound; the split heuristic fills the GPU
    for the benchmark's extend shape (bs 8 x 64 new tokens x 8 KV heads over 32K)."""
    for qo, tq in (([0, 37, 101, 251, 252, 352, 552], 32), ([0, 0, 5, 5, 70], 16), ([0, 2048] * 1, 8)):
        ids = tile_ids(qo, tq)
        got = [t for t, _, _ in ids]
        assert got == sorted(set(got)) and max(got) < tile_count(qo[-1], len(qo) - 1, tq)
        for t, r, t0 in ids:
            assert qo[r] + t0 < qo[r + 1]
    s = choose_num_splits(16, 8, 513, 132, 1)
    assert 16 * 8 * s >= 132 * 0.9
    assert choose_num_splits(512 * 8, 8, 544, 132, 1) == 1
    plan = HieraSparseExtend(32, 8, 128, 64, 544, torch.float16, "cuda")
    assert plan.pick_tile(8 * 16, 8) == "n64" and plan.pick_tile(8 * 17, 8) == "n128"
    assert plan.pick_tile(8 * 65, 8) == "n128" and plan.pick_tile(32768, 1) == "n128"


def _kernel_config(variant):
    hq, hkv, d, dtype, sk, sv, opts = variant
    dt = "float16" if dtype == torch.float16 else "bfloat16"
    return (hq, hkv, d, dt, opts["tile"], opts.get("stages", default_stages(opts["tile"])), sk > 0)


def test_tested_and_default_configurations_are_precompiled():
    """Every kernel the GPU tests build and every default plan of the benchmark's shape is in PRECOMPILE (a
    device run loads it from TileLang's cache), and PRECOMPILE holds nothing else; every shipped tile and
    stage count is tested with and without 2:4 K rows."""
    tested = {_kernel_config(v) for v in SMALL} | {_kernel_config(v)[:-1] + (False,) for v in FP8_KV}
    defaults = {(32, 8, 128, "float16", tile, default_stages(tile), ks) for tile in TILES for ks in (False, True)}
    bench_variants = {(32, 8, 128, "float16", tile, stages, ks) for tile, stages in BENCH_VARIANTS
                      for ks in (False, True)}
    assert set(PRECOMPILE) == tested | defaults | bench_variants
    assert len(PRECOMPILE) == len(set(PRECOMPILE))
    for tile in TILES:
        for stages in STAGES[tile]:
            assert {ks for *_, t, st, ks in tested if (t, st) == (tile, stages)} == {False, True}, (tile, stages)
    assert {default_stages(tile) for tile in TILES} == {2}


@pytest.mark.parametrize("bad", ["n128", "n128:two", "n128:2:producer"])
def test_bench_rejects_malformed_variant(bad):
    """``--variant`` takes TILE:STAGES; anything else is a usage error before any GPU work."""
    with pytest.raises(SystemExit) as err:
        bench.main(["--kernel", "extend", "--variant", bad])
    assert err.value.code == 2


def test_plan_rejects_stage_counts_a_tile_cannot_build():
    """A stage count a tile does not build (every tile builds 2) is refused up front (a one-line
    ValueError) instead of failing at the first call's compile."""
    for tile in ("n64", "n128"):
        for stages in (3, 4):
            with pytest.raises(ValueError, match=tile):
                HieraSparseExtend(32, 8, 128, 64, 544, torch.float16, "cpu", tile=tile, stages=stages)
    with pytest.raises(ValueError, match="stages in"):
        HieraSparseExtend(32, 8, 128, 64, 544, torch.float16, "cpu", stages=4)  # "auto" may pick either
    assert HieraSparseExtend(32, 8, 128, 64, 544, torch.float16, "cpu", tile="n128", stages=2).stages == 2


def test_every_tile_fits_its_shared_memory_with_its_p_buffers():
    """n128 takes two P^T (or P) buffers (block j's is stored while block j - 1's O^T GEMM reads the other),
    the one-warpgroup tiles one; every tile, stage count and head_dim fits a CTA's 227 KB, and n64 without
    2:4 K buffers still fits two CTAs an SM."""
    from sglang_hs.kernels.common import SMEM_PER_SM
    from sglang_hs.kernels.extend import smem_bytes
    from sglang_hs.kernels.extend_common import p_buffer_count

    assert p_buffer_count("n128", "sparse") == p_buffer_count("n128", "any") == p_buffer_count("n128", "dense") == 2
    assert p_buffer_count("n64", "any") == p_buffer_count("n32", "sparse") == 1
    for tile, stage_counts in STAGES.items():
        for stages in stage_counts:
            for k_sparse in (False, True):
                for head_dim in (64, 128):
                    assert smem_bytes(tile, head_dim, 64, stages, k_sparse) <= 227 * 1024, (tile, stages, k_sparse)
    p_tile = 64 * 128 * 2  # one P^T buffer of n128 (64 keys x 128 columns, 16-bit)
    k_sparse_stage = 64 * 64 * 2 + 64 * 128 // 8  # 2:4 K values and metadata of a stage
    assert smem_bytes("n128", 128, 64, 2, True) - smem_bytes("n128", 128, 64, 2, False) == 2 * k_sparse_stage + p_tile
    assert SMEM_PER_SM // (smem_bytes("n64", 128, 64, 2, False) + 1024) == 2


def test_a_plan_runs_the_split_cost_model_once_per_call_shape(monkeypatch):
    """CPU, with the kernel stubbed: every layer of a forward asks for the same split count, so the
    cost model (most of ``run``'s host time) runs once per shape, not once per layer."""
    import sglang_hs.kernels.extend as extend

    asked = []
    model = extend.split_count
    monkeypatch.setattr(extend, "split_count", lambda *args: asked.append(args) or model(*args))
    extend.choose_num_splits.cache_clear()  # answers kept from earlier tests would hide the calls
    plan = HieraSparseExtend(32, 8, 128, 64, 8, torch.float16, "cpu")
    plan._sms = 132
    plan.kernel = lambda tile, k_sparse: ((lambda *args: None), 2)
    case = cases.make_case([256, 200], 32, 8, 128, 1.0, 1.0, torch.float16, "cpu", seed=1)
    _, k_cache, v_cache, pools, k_index, v_index, table, lens, scale = cases.run_args(case)
    q = torch.zeros(64, 32, 128, dtype=torch.float16)
    qo = torch.tensor([0, 32, 64], dtype=torch.int32)
    for _ in range(3):  # three layers of one forward
        plan.run(q, qo, k_cache, v_cache, pools, k_index, v_index, table, lens, scale)
    plan.run(q[:32], qo[:2], k_cache, v_cache, pools, k_index, v_index, table[:1], lens[:1], scale)  # another shape
    assert len(asked) == 2
