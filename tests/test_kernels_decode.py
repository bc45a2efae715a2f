"""GPU tests of the split-KV HieraSparse decode kernel (``sglang_hs.kernels.decode``).

The oracle is ``sglang_hs.reference.paged_attention`` (float32, small shapes); larger shapes are checked
against dense attention and FlashInfer over the decompressed (pruned) KV of the same requests. Every
test is marked ``gpu`` (skipped without CUDA by the conftest); importing this module needs neither a
GPU nor TileLang.
"""

import pytest
import torch

from sglang_hs import reference as R
from sglang_hs.kernels import cases
from sglang_hs.kernels import decode as decode_module
from sglang_hs.format import FP8_DTYPE
from sglang_hs.kernels.decode import SPLIT_CAPACITY, HieraSparseDecode, choose_num_splits, min_splits

# (q_heads, kv_heads, head_dim, dtype, S_K, S_V): GQA groups 4, 8, 1, 2; head_dim 128 and 64; fp16/bf16.
SMALL = [
    (32, 8, 128, torch.float16, 0.5, 0.5),
    (16, 2, 128, torch.bfloat16, 1.0, 1.0),
    (4, 4, 64, torch.float16, 1.0, 0.0),
    (8, 4, 128, torch.float16, 0.0, 1.0),
    # Groups that pad to 8 columns: 3 (SmolLM2, Llama-3.2-3B), 5 (Qwen3-14B), 6 (Qwen2.5-1.5B), 7 (Qwen2.5-7B).
    (9, 3, 64, torch.float16, 1.0, 0.5),
    (10, 2, 128, torch.bfloat16, 0.5, 0.5),
    (12, 2, 64, torch.float16, 0.0, 1.0),
    (14, 2, 128, torch.bfloat16, 1.0, 1.0),
    # ... and each at the other head_dim.
    (9, 3, 128, torch.bfloat16, 0.5, 1.0),
    (10, 2, 64, torch.float16, 1.0, 0.0),
    (12, 2, 128, torch.float16, 1.0, 1.0),
    (14, 2, 64, torch.bfloat16, 0.0, 1.0),
]
SMALL_LENS = [1000, 64 * 7, 300, 64 * 12 + 1]  # partial and full last pages, a request of cache pages only
SMALL_MAX_BLOCKS = 20
SMALL_SPLITS = 4  # > blocks of the 300-token request per split: some splits are empty
MID_LENS = [4096, 2500, 8192, 77]
MID_MAX_BLOCKS = 128


def _id(shape):
    hq, hkv, d, dt, sk, sv = shape
    return f"G{hq // hkv}-d{d}-{str(dt).split('.')[-1]}-sk{sk:g}-sv{sv:g}"


def _plan(case, num_splits=None, **kw):
    q = case["q"]
    return HieraSparseDecode(q.shape[0], q.shape[1], case["k_cache"].shape[1], q.shape[2], case["block_size"],
                             case["max_blocks"], q.dtype, q.device, num_splits=num_splits, **kw)


def _reference(case):
    pools = cases.pools_of(case, "cpu")
    bs = case["q"].shape[0]
    out, lse = R.paged_attention(case["q"].cpu(), list(range(bs + 1)), case["k_cache"].cpu(), case["v_cache"].cpu(),
                                 pools, case["k_index"].cpu(), case["v_index"].cpu(), case["block_table"].cpu(),
                                 case["seq_lens_list"], case["sm_scale"])
    return out, lse


def _tol(dtype):
    return 1e-2 if dtype == torch.bfloat16 else 3e-3


def _run_against_reference(plan, case, oracle=None):
    """One launch of ``plan`` on ``case`` into a NaN-filled ``out``: written in place, every output finite,
    each request within its dtype's tolerance of the oracle over ``oracle`` (default: the case), the LSE
    within 2e-2. Returns the output."""
    out = torch.full_like(case["q"], float("nan"))
    got, lse = plan.run(*cases.run_args(case), out=out, return_lse=True)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(got).all(), "unwritten or non-finite outputs"
    ref_out, ref_lse = _reference(oracle if oracle is not None else case)
    for r in range(len(SMALL_LENS)):
        err = cases.rel_err(got[r].cpu(), ref_out[r])
        assert err < _tol(case["q"].dtype), f"request {r}: rel err {err:.2e}"
    assert (lse.cpu() - ref_lse).abs().max().item() < 2e-2
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SMALL, ids=_id)
def test_matches_reference(shape):
    hq, hkv, d, dtype, sk, sv = shape
    case = cases.make_case(SMALL_LENS, hq, hkv, d, sk, sv, dtype, "cuda", max_blocks=SMALL_MAX_BLOCKS, seed=1)
    plan = _plan(case, num_splits=SMALL_SPLITS)
    got = _run_against_reference(plan, case)
    again = plan.run(*cases.run_args(case))  # repeated calls: scratch and split tickets are reusable
    assert torch.equal(again, got) and not plan.counter.any()


# FP8 store values (the kernel's store_fp8 variant, ``decode.FP8_PRECOMPILE``): (q_heads, kv_heads, head_dim,
# dtype, S_K, S_V): GQA groups 1, 3, 4 and 8 at head_dim 64 and 128, fp16 and bf16, S in {0, 1} and mixed.
FP8_SMALL = [
    (4, 4, 64, torch.float16, 0.0, 0.0),
    (9, 3, 64, torch.bfloat16, 1.0, 1.0),
    (8, 2, 64, torch.bfloat16, 0.5, 1.0),
    (8, 1, 64, torch.float16, 1.0, 0.5),
    (8, 8, 128, torch.bfloat16, 0.0, 1.0),
    (12, 4, 128, torch.float16, 0.5, 0.5),
    (16, 4, 128, torch.float16, 1.0, 0.0),
    (32, 4, 128, torch.bfloat16, 1.0, 1.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", FP8_SMALL, ids=_id)
def test_fp8_store_matches_reference(shape):
    """FP8 pool rows (dense and 2:4, each row with its own scale) beside 16-bit cache pages: the kernel
    equals the oracle over the same FP8 pools (which scales them back in float32), as does the per-block
    LSE of the decode modes' anchor layers (the same launch with block_lse)."""
    hq, hkv, d, dtype, sk, sv = shape
    case = cases.quantize_case(cases.make_case(SMALL_LENS, hq, hkv, d, sk, sv, dtype, "cuda",
                                               max_blocks=SMALL_MAX_BLOCKS, seed=7))  # fmt: skip
    assert case["k_dense"].dtype == FP8_DTYPE and cases.pools_of(case).quantized
    plan = _plan(case, num_splits=SMALL_SPLITS, store_dtype=FP8_DTYPE, block_lse=True)
    got = _run_against_reference(plan, case)
    again, block_lse = plan.run(*cases.run_args(case), return_block_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(again, got) and not plan.counter.any()
    # Each block's own LSE: the oracle over a table of that block alone (its tokens only).
    table = case["block_table"].cpu()
    for r, length in enumerate(SMALL_LENS):
        for j in (0, 1, -(-length // 64) - 1):
            tokens = min(64, length - j * 64)
            one = dict(case, q=case["q"][r:r + 1], block_table=table[r:r + 1, j:j + 1].to(table.device),
                       seq_lens_list=[tokens])
            _, ref_block = _reference(one)
            assert (block_lse[r, :, j].cpu() - ref_block[0]).abs().max().item() < 2e-2, (r, j)


# FP8 cache pages beside an FP8 store (the kernel's cache_fp8 variant, ``decode.FP8_PRECOMPILE``'s "fp8kv").
FP8_PAGES_SMALL = [
    (4, 4, 64, torch.float16, 0.0, 0.0),
    (9, 3, 64, torch.bfloat16, 1.0, 1.0),
    (8, 1, 64, torch.float16, 1.0, 0.5),
    (12, 4, 128, torch.float16, 0.5, 0.5),
    (32, 8, 128, torch.bfloat16, 0.5, 1.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", FP8_PAGES_SMALL, ids=_id)
def test_fp8_pages_match_reference(shape):
    """SGLang's FP8 pages (unit scales) and FP8 pool rows: the kernel equals the oracle over the same
    values, and refuses 16-bit pages."""
    hq, hkv, d, dtype, sk, sv = shape
    case = cases.quantize_case(cases.make_case(SMALL_LENS, hq, hkv, d, sk, sv, dtype, "cuda",
                                               max_blocks=SMALL_MAX_BLOCKS, seed=9))  # fmt: skip
    fp8, oracle = cases.fp8_pages(case)
    plan = _plan(fp8, num_splits=SMALL_SPLITS, store_dtype=FP8_DTYPE, cache_dtype=FP8_DTYPE)
    _run_against_reference(plan, fp8, oracle)
    with pytest.raises(ValueError, match="cache pages of"):
        plan.run(*cases.run_args(case))


@pytest.mark.gpu
def test_fp8_store_mid_context_matches_decompressed():
    """FP8 pools at a few thousand tokens on the Llama-3.1-8B decode shape (mixed dense / 2:4 rows):
    dense attention over the pools' dequantized (pruned) KV."""
    case = cases.quantize_case(cases.make_case(MID_LENS, 32, 8, 128, 0.5, 1.0, torch.bfloat16, "cuda",
                                               max_blocks=MID_MAX_BLOCKS, seed=8))  # fmt: skip
    plan = _plan(case, store_dtype=FP8_DTYPE)
    out = plan.run(*cases.run_args(case))
    torch.cuda.synchronize()
    deq = dict(case, **{name: case[name].float() * case[f"{name}_scale"].view(-1, 1, 1)
                        for name in ("k_dense", "k_values", "v_dense", "v_values")})  # fmt: skip
    for name in cases.SCALE_KEYS:
        deq.pop(name)
    deq.update(k_cache=case["k_cache"].float(), v_cache=case["v_cache"].float())
    paged = cases.paged_dense(deq)
    for r in range(len(MID_LENS)):
        k, v = cases.dense_kv(deq, paged, r)
        ref, _ = R.dense_attention(case["q"][r:r + 1].float(), k, v, sm_scale=case["sm_scale"])
        assert cases.rel_err(out[r:r + 1].float(), ref) < 1e-2, f"request {r}"


@pytest.mark.gpu
def test_dense_equals_dense_attention_and_flashinfer():
    """S_K = S_V = 0 (cache pages + dense pool rows): dense attention to fp16 rounding."""
    _check_mid_case_against_dense(seed=2, sk=0.0, sv=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("sk,sv", [(1.0, 1.0), (0.0, 1.0), (0.5, 0.5)])
def test_sparse_matches_decompressed(sk, sv):
    """Mixed dense/sparse blocks at a few thousand tokens: dense attention over the pruned KV."""
    _check_mid_case_against_dense(seed=3, sk=sk, sv=sv)


def _check_mid_case_against_dense(seed: int, sk: float, sv: float) -> None:
    """The kernel on the Llama-3.1-8B decode shape at a few thousand tokens equals dense attention
    over the (pruned, decompressed) KV, and FlashInfer's paged decode over it when installed."""
    case = cases.make_case(MID_LENS, 32, 8, 128, sk, sv, torch.float16, "cuda", max_blocks=MID_MAX_BLOCKS, seed=seed)
    plan = _plan(case)
    out = plan.run(*cases.run_args(case))
    paged = cases.paged_dense(case)
    for r in range(len(MID_LENS)):
        k, v = cases.dense_kv(case, paged, r)
        ref, _ = R.dense_attention(case["q"][r:r + 1], k, v, sm_scale=case["sm_scale"])
        assert cases.rel_err(out[r:r + 1], ref) < 3e-3, f"request {r}"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return
    fi = cases.flashinfer_decode(case, paged)()
    assert cases.rel_err(out, fi) < 3e-3


def _captured(call) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``call`` (run once outside it first, as SGLang warms up before capture)."""
    call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


@pytest.mark.gpu
def test_cuda_graph_replay_follows_inputs():
    """Captured once, replayed after q, seq_lens and block-table contents change in place."""
    case = cases.make_case(MID_LENS, 32, 8, 128, 0.5, 1.0, torch.float16, "cuda", max_blocks=MID_MAX_BLOCKS, seed=4)
    plan = _plan(case)
    args = cases.run_args(case)
    out = torch.empty_like(case["q"])
    graph = _captured(lambda: plan.run(*args, out=out))
    case["q"].copy_(torch.randn_like(case["q"]))
    new_lens = [L - 100 if L > 200 else L for L in MID_LENS]
    case["seq_lens"].copy_(torch.tensor(new_lens, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    case["seq_lens_list"] = new_lens
    eager = plan.run(*args)
    assert torch.equal(out, eager)
    paged = cases.paged_dense(case)
    for r in range(len(MID_LENS)):
        k, v = cases.dense_kv(case, paged, r)
        ref, _ = R.dense_attention(case["q"][r:r + 1], k, v, sm_scale=case["sm_scale"])
        assert cases.rel_err(out[r:r + 1], ref) < 3e-3


@pytest.mark.gpu
def test_empty_request_and_default_scale():
    """A padded request (seq_len 0) gives zeros and LSE -inf; the others are unaffected."""
    hq, hkv, d, dtype, sk, sv = SMALL[0]
    case = cases.make_case(SMALL_LENS, hq, hkv, d, sk, sv, dtype, "cuda", max_blocks=SMALL_MAX_BLOCKS, seed=5)
    ref_out, _ = _reference(case)
    case["seq_lens"][2] = 0
    plan = _plan(case, num_splits=SMALL_SPLITS)
    out, lse = plan.run(*cases.run_args(case), return_lse=True)
    torch.cuda.synchronize()
    assert torch.count_nonzero(out[2]) == 0 and torch.isneginf(lse[2]).all()
    for r in (0, 1, 3):
        assert cases.rel_err(out[r].cpu(), ref_out[r]) < _tol(dtype)


@pytest.mark.gpu
def test_num_splits_heuristic_fills_the_gpu():
    """bs 8 x 8 KV heads at 32K on 132 SMs with 2 CTAs/SM uses every slot at least once; the plan's
    own choice on this GPU gives at least one CTA per SM."""
    s = choose_num_splits(8, 8, 512, 132, 2)
    assert 8 * 8 * s >= 132 * 2 * 0.9
    assert choose_num_splits(64, 8, 64, 132, 2) == 1
    plan = HieraSparseDecode(8, 32, 8, 128, 64, 512, torch.float16, "cuda")
    assert 8 * 8 * plan.num_splits >= torch.cuda.get_device_properties(0).multi_processor_count


def test_shared_prefix_case_reads_each_groups_blocks():
    """The benchmark's shared-prefix batch (CPU): request r reads request r % G's blocks in both
    layouts, ours (block table) and FlashInfer's (page indices), with a query of its own."""
    case = cases.make_case([300, 64 * 5 + 7], 8, 4, 64, 1.0, 1.0, torch.float16, "cpu", window_blocks=1)
    paged = cases.paged_dense(case)
    shared, shared_paged = cases.share_prefixes(case, paged, 5)
    assert shared["q"].shape[0] == 5 and not torch.equal(shared["q"][0], shared["q"][2])
    indptr, shared_indptr = paged["indptr"].tolist(), shared_paged["indptr"].tolist()
    for r in range(5):
        g = r % 2
        assert torch.equal(shared["block_table"][r], case["block_table"][g])
        assert shared["seq_lens_list"][r] == case["seq_lens_list"][g] == int(shared["seq_lens"][r])
        assert torch.equal(shared_paged["indices"][shared_indptr[r]:shared_indptr[r + 1]],
                           paged["indices"][indptr[g]:indptr[g + 1]])
        assert int(shared_paged["last_page_len"][r]) == int(paged["last_page_len"][g])
    # The oracle over the shared batch gives request r its query's attention over group r % G's KV.
    out, _ = _reference(shared)
    alone, _ = _reference({**case, "q": shared["q"][3:4], "block_table": case["block_table"][1:2],
                           "seq_lens_list": case["seq_lens_list"][1:2]})
    torch.testing.assert_close(out[3:4], alone)


def test_split_count_respects_the_capacity():
    """CPU: a CTA's index maps hold SPLIT_CAPACITY blocks, so no plan uses fewer splits than its block
    table needs; shared memory no longer grows with the width (two CTAs per SM at d 128 for every GQA
    group the server takes); the benchmark and server shapes at 32K keep their 4 splits."""
    from sglang_hs.kernels.common import SMEM_PER_SM
    from sglang_hs.kernels.decode import plan_num_splits, smem_bytes

    for group in range(1, 9):
        assert SMEM_PER_SM // (smem_bytes(128, 64, 2, group) + 1024) == 2
        assert SMEM_PER_SM // (smem_bytes(128, 64, 2, group, store_fp8=True) + 1024) == 1  # FP8 landing tiles
    assert min_splits(SPLIT_CAPACITY) == 1 and min_splits(SPLIT_CAPACITY + 1) == 2 and min_splits(2049) == 5
    for width in (512, 529):
        assert plan_num_splits(8, 32, 8, 128, 64, width, 2, 132) == 4
    for bs in (1, 8, 16, 32, 64, 256, 1000):
        for width in (20, 257, 512, 513, 1025, 2049):
            s = plan_num_splits(bs, 32, 8, 128, 64, width, 2, 132)
            assert s >= min_splits(width) and -(-width // s) <= SPLIT_CAPACITY, (bs, width, s)


class RecordingKernel:
    """Stands in for the compiled kernel on CPU: checks and records each launch's arguments."""

    def __init__(self, key):
        self.key, self.launches = key, []

    def __call__(self, q, k_cache, v_cache, *rest):
        fp8 = len(self.key) > 8 and self.key[8]  # store_fp8: the four row scales follow the six pools
        self.scales = rest[6:10] if fp8 else None
        self.pools = rest[:6]
        args = list(rest[12 if fp8 else 8:])
        block_table, seq_lens, sm_scale, o_part, lse_part, out, lse, tickets, want_block_lse, block_lse = args
        n, hq, s, d = o_part.shape
        assert want_block_lse in (0, 1) and block_lse.shape == ((n * hq, block_table.shape[1]) if want_block_lse else (1, 1))
        assert q.shape == out.shape == (n, hq, d) and block_table.shape[0] == seq_lens.shape[0] == n
        assert lse_part.shape == (n, hq, s) and lse.shape == (n, hq) and tickets.shape[0] == n
        assert all(t.is_contiguous() for t in (q, block_table, seq_lens, o_part, lse_part, out, lse, tickets))
        self.launches.append(dict(n=n, splits=s, width=block_table.shape[1], o_part=o_part.data_ptr(),
                                  lse_part=lse_part.data_ptr(), tickets=tickets.data_ptr(), out=out.data_ptr()))
        out.fill_(1.0)


@pytest.fixture
def recording_builder(monkeypatch):
    """``build_decode_kernel`` replaced by a recorder: {the kernel's cache key (``decode_kernel_args``):
    kernel}."""
    built = {}

    def record(*args, split_capacity=SPLIT_CAPACITY, min_split_blocks=1, store_fp8=False, cache_fp8=False,
               compact=None):  # fmt: skip
        key = decode_module.decode_kernel_args(*args, split_capacity, min_split_blocks, store_fp8, cache_fp8, compact)
        return built.setdefault(key, RecordingKernel(key))

    monkeypatch.setattr(decode_module, "build_decode_kernel", record)
    return built


CAPTURE_SIZES = [1, 2, 4, 8, 12, 16, 24, 32] + list(range(40, 257, 8))  # SGLang's default decode graphs


def test_one_kernel_for_every_batch_size_and_context(recording_builder):
    """CPU: plans for every CUDA-graph batch size and context length of a model shape build one kernel."""
    for width in (20, 257, 513, 2049):
        for bs in CAPTURE_SIZES[::5] + [256, 300]:
            HieraSparseDecode(bs, 32, 8, 128, 64, width, torch.float16, "cpu", num_sms=132)
    assert list(recording_builder) == [(32, 8, 128, 64, "float16", 2)]


def test_fp8_store_plan_runs_the_fp8_kernel_with_the_row_scales(recording_builder):
    """CPU: a plan for FP8 store values builds the kernel's store_fp8 variant (its own cache key; the
    16-bit plan keeps its key) and launches it with the e4m3 pools and their row scales after them (an
    empty pool and its scales as one-row stand-ins: e4m3, scale 1); pools of the other kind are refused.
    Its landing tiles leave one CTA an SM at d 128 (two at d 64), which the split count follows."""
    from sglang_hs.kernels.decode import ctas_per_sm, smem_bytes

    case = cases.quantize_case(cases.make_case([300, 64 * 5 + 7], 8, 2, 64, 0.5, 1.0, torch.float16, "cpu",
                                               window_blocks=1))  # fmt: skip
    assert case["v_dense"].shape[0] == 0 and case["k_dense"].shape[0] and case["k_values"].shape[0]
    plan = _plan(case, store_dtype=FP8_DTYPE, num_sms=132)
    assert plan.store_fp8 and list(recording_builder) == [(8, 2, 64, 64, "float16", 2, SPLIT_CAPACITY, 1, True)]
    plan.run(*cases.run_args(case))
    kernel = plan.kernel
    assert len(kernel.launches) == 1
    k_dense, k_values, k_meta, v_dense, v_values, v_meta = kernel.pools
    assert k_dense is case["k_dense"] and k_values is case["k_values"] and v_values is case["v_values"]
    assert v_dense.dtype == FP8_DTYPE and v_dense.shape == (1, 64, 64)  # the empty pool's stand-in
    assert kernel.scales[0] is case["k_dense_scale"] and kernel.scales[1] is case["k_values_scale"]
    assert kernel.scales[3] is case["v_values_scale"] and kernel.scales[2].tolist() == [1.0]
    assert all(t.dtype == torch.float32 for t in kernel.scales)
    plain = _plan(case, num_sms=132)
    assert not plain.store_fp8 and (8, 2, 64, 64, "float16", 2) in recording_builder
    with pytest.raises(ValueError, match="FP8 pools given to a decode plan for 16-bit"):
        plain.run(*cases.run_args(case))
    with pytest.raises(ValueError, match="16-bit pools given to a decode plan for FP8"):
        plan.run(*cases.run_args(cases.make_case([300], 8, 2, 64, 0.5, 1.0, torch.float16, "cpu", window_blocks=1)))
    with pytest.raises(ValueError, match="store values"):
        _plan(case, store_dtype=torch.float8_e5m2, num_sms=132)
    for group in (1, 3, 4, 8):
        assert ctas_per_sm(group, 1, 128, 64, 2, store_fp8=True) == 1 and ctas_per_sm(group, 1, 64, 64, 2, store_fp8=True) == 2
        assert smem_bytes(128, 64, 2, group, store_fp8=True) - smem_bytes(128, 64, 2, group) == 2 * 2 * 3 * 64 * 128 // 2 + 2 * 512 * 4


def _cpu_run(plan, bs, width, out=None):
    case = dict(k_cache=torch.zeros(64, plan.kv_heads, plan.head_dim, dtype=plan.dtype),
                k_index=torch.zeros(plan.kv_heads, 0, dtype=torch.int32))
    pools = cases.BlockPools(*(torch.zeros(0) for _ in range(6)))
    q = torch.zeros(bs, plan.q_heads, plan.head_dim, dtype=plan.dtype)
    table, seq_lens = torch.zeros(bs, width, dtype=torch.int32), torch.ones(bs, dtype=torch.int32)
    return plan.run(q, case["k_cache"], case["k_cache"], pools, case["k_index"], case["k_index"], table, seq_lens,
                    0.125, out=out)


def test_scratch_views_fixed_addresses_and_large_batches(recording_builder):
    """CPU: every batch size views the same scratch (CUDA graphs keep their addresses) with at least the
    width's minimum split count; a batch above the plan's size grows the scratch until a graph has
    captured the plan, and runs in chunks of the plan's size after."""
    plan = HieraSparseDecode(16, 8, 2, 64, 64, 513, torch.float16, "cpu", num_sms=132)
    kernel, base = plan.kernel, (plan.o_part.data_ptr(), plan.lse_part.data_ptr(), plan.counter.data_ptr())
    for bs in range(1, 17):
        for width in (20, 513):
            _cpu_run(plan, bs, width)
            launch = kernel.launches[-1]
            assert (launch["o_part"], launch["lse_part"], launch["tickets"]) == base
            assert launch["n"] == bs and launch["splits"] >= min_splits(width)
            assert bs * launch["splits"] <= plan.part_capacity
            if width == 513:
                assert launch["splits"] == plan.splits(bs, 513)  # the cost model's choice, not clipped
    plan.captured = True
    kernel.launches.clear()
    out = _cpu_run(plan, 40, 513)
    assert [launch["n"] for launch in kernel.launches] == [16, 16, 8] and plan.batch_size == 16
    assert [launch["out"] for launch in kernel.launches] == [out[i].data_ptr() for i in (0, 16, 32)]
    assert (plan.o_part.data_ptr(), plan.lse_part.data_ptr()) == base[:2] and bool((out == 1).all())
    eager = HieraSparseDecode(2, 8, 2, 64, 64, 513, torch.float16, "cpu", num_sms=132)
    assert eager.kernel is kernel
    kernel.launches.clear()
    _cpu_run(eager, 40, 513)
    assert eager.batch_size == 40 and [launch["n"] for launch in eager.kernel.launches] == [40]
    with pytest.raises(ValueError, match="wide"):
        _cpu_run(plan, 2, 514)
    with pytest.raises(ValueError, match="num_splits"):
        HieraSparseDecode(2, 8, 2, 64, 64, 513, torch.float16, "cpu", num_splits=1)


def _check_against_reference(case, out, lse=None) -> None:
    ref_out, ref_lse = _reference(case)
    for r in range(case["q"].shape[0]):
        assert cases.rel_err(out[r].cpu(), ref_out[r]) < _tol(case["q"].dtype), f"request {r}"
    if lse is not None:
        assert (lse.cpu() - ref_lse).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_one_kernel_serves_batch_sizes_widths_and_graphs():
    """One plan (one compiled kernel) over batches of 1, 3 and 6 requests with block tables 20, 64 and
    129 wide and ragged lengths; CUDA graphs captured at two batch sizes share its scratch and replay
    right; once a graph holds the plan, an eager batch larger than the plan runs in chunks."""
    hq, hkv, d, dtype = 8, 2, 64, torch.float16
    plan = HieraSparseDecode(6, hq, hkv, d, 64, 129, dtype, "cuda")
    other = HieraSparseDecode(2, hq, hkv, d, 64, 20, dtype, "cuda")
    assert other.kernel is plan.kernel
    batches = [([1000], 20), ([64 * 7, 300, 64 * 60 + 5], 64), ([77, 4096, 2500, 64, 1, 8000], 129)]
    made = [cases.make_case(lens, hq, hkv, d, 0.5, 1.0, dtype, "cuda", max_blocks=width, seed=30 + i)
            for i, (lens, width) in enumerate(batches)]
    for case in made:
        out, lse = plan.run(*cases.run_args(case), return_lse=True)
        torch.cuda.synchronize()
        _check_against_reference(case, out, lse)
    graphs, outs = [], []
    stream = torch.cuda.Stream()
    for case in made[1:]:
        args, out = cases.run_args(case), torch.empty_like(case["q"])
        plan.run(*args, out=out)
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            plan.run(*args, out=out)
        torch.cuda.current_stream().wait_stream(stream)
        graphs.append(graph)
        outs.append(out)
    assert plan.captured and plan.batch_size == 6
    for case, graph, out in zip(made[1:], graphs, outs):
        case["q"].copy_(torch.randn_like(case["q"]))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plan.run(*cases.run_args(case)))
        _check_against_reference(case, out)
    big = cases.make_case([3000 + 97 * r for r in range(9)], hq, hkv, d, 1.0, 1.0, dtype, "cuda", max_blocks=129,
                          seed=40)
    out, lse = plan.run(*cases.run_args(big), return_lse=True)  # 9 requests: chunks of 6 and 3
    torch.cuda.synchronize()
    assert plan.batch_size == 6 and not plan.counter.any()
    _check_against_reference(big, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [SPLIT_CAPACITY - 1, SPLIT_CAPACITY, SPLIT_CAPACITY + 1])
def test_split_capacity_edges(blocks):
    """Block tables just below, at and just above a CTA's capacity (the tiny model's shape at TP 2):
    the fewest splits the width allows walk every block; one split fewer is refused."""
    hq, hkv, d, dtype = 4, 1, 64, torch.float16
    lens = [blocks * 64, blocks * 64 - 37, 64 * 3 + 1]  # the whole table, a partial last page, a short one
    case = cases.make_case(lens, hq, hkv, d, 0.0, 1.0, dtype, "cuda", max_blocks=blocks, seed=50 + blocks % 7)
    fewest = min_splits(blocks)
    assert fewest == (1 if blocks <= SPLIT_CAPACITY else 2)
    if fewest > 1:
        with pytest.raises(ValueError, match="num_splits"):
            _plan(case, num_splits=fewest - 1)
    for splits in (fewest, None):
        plan = _plan(case, num_splits=splits)
        out, lse = plan.run(*cases.run_args(case), return_lse=True)
        torch.cuda.synchronize()
        assert plan.last_num_splits >= fewest
        _check_against_reference(case, out, lse)


# The compact kernel (``HieraSparseDecode(compact=...)``, ``decode.COMPACT_PRECOMPILE``) at S_K = S_V = 1;
# shuffled cases, so compressed and dense blocks interleave in every split.
COMPACT_SMALL = [(hq, hkv, d, getattr(torch, dt), 1.0, 1.0) for hq, hkv, d, dt in decode_module.COMPACT_PRECOMPILE]
SS = ("sparse", "sparse")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [SMALL_SPLITS, None])
@pytest.mark.parametrize("shape", COMPACT_SMALL, ids=_id)
def test_compact_matches_reference(shape, splits):
    """The compact kernel (the compressed blocks of a split on small stages, the cache pages dealt over the
    splits and read a head_dim half at a time) gives the oracle's output and LSE, with empty splits;
    repeated calls give the same output and leave the tickets at zero."""
    hq, hkv, d, dtype, sk, sv = shape
    case = cases.make_case(SMALL_LENS, hq, hkv, d, sk, sv, dtype, "cuda", max_blocks=SMALL_MAX_BLOCKS, seed=61)
    plan = _plan(case, num_splits=splits, compact=SS)
    assert plan.forms == SS
    got = _run_against_reference(plan, case)
    again = plan.run(*cases.run_args(case))
    assert torch.equal(again, got) and not plan.counter.any()


@pytest.mark.gpu
def test_compact_dense_pool_rows():
    """Dense pool rows (S below 1 leaves some compressed blocks dense) take the compact kernel's dense
    path like cache pages: its output matches the oracle's."""
    case = cases.make_case(SMALL_LENS, 32, 8, 128, 0.5, 0.5, torch.float16, "cuda", max_blocks=SMALL_MAX_BLOCKS,
                           seed=64)
    _run_against_reference(_plan(case, num_splits=SMALL_SPLITS, compact=SS), case)


@pytest.mark.gpu
def test_compact_mid_context_block_lse_and_graph():
    """The Llama-3.1-8B decode shape at a few thousand tokens: the compact kernel equals the any-form
    kernel's output, LSE and per-block LSE (dense blocks written by the split they were dealt to), and a
    CUDA graph of it replays right after q and the lengths change in place."""
    case = cases.make_case(MID_LENS, 32, 8, 128, 1.0, 1.0, torch.float16, "cuda", max_blocks=MID_MAX_BLOCKS, seed=62)
    args = cases.run_args(case)
    plain = _plan(case, block_lse=True)
    compact = _plan(case, block_lse=True, compact=SS)
    assert compact.num_splits > plain.num_splits  # smaller stages: more CTAs an SM, more splits
    want, want_lse, want_blocks = (t.clone() for t in plain.run(*args, return_lse=True, return_block_lse=True))
    got, got_lse, got_blocks = compact.run(*args, return_lse=True, return_block_lse=True)
    torch.cuda.synchronize()
    assert cases.rel_err(got, want) < 3e-3
    assert (got_lse - want_lse).abs().max().item() < 1e-3
    for r, n in enumerate(case["seq_lens_list"]):
        blocks = -(-n // 64)
        assert (got_blocks[r, :, :blocks] - want_blocks[r, :, :blocks]).abs().max().item() < 1e-3, f"request {r}"
    out = torch.empty_like(case["q"])
    graph = _captured(lambda: compact.run(*args, out=out))
    case["q"].copy_(torch.randn_like(case["q"]))
    case["seq_lens"].copy_(torch.tensor([L - 100 if L > 200 else L for L in MID_LENS], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert cases.rel_err(out, plain.run(*args)) < 3e-3 and not compact.counter.any()


@pytest.mark.gpu
def test_compact_empty_request_and_reach_edge():
    """A padded request (seq_len 0) gives zeros and LSE -inf through the compact kernel; a table one block
    past a split's reach (half the maps) takes more splits, and a request of cache pages only (no
    compressed block) spreads its pages over them."""
    hq, hkv, d, dtype = 8, 2, 128, torch.float16
    blocks = SPLIT_CAPACITY // 2 + 1
    lens = [blocks * 64 - 37, 64 * 3 + 1, 1000, blocks * 64]
    case = cases.make_case(lens, hq, hkv, d, 1.0, 1.0, dtype, "cuda", max_blocks=blocks, seed=63,
                           prefix_lens=lens[:3] + [0])  # request 3: cache pages only
    ref_out, ref_lse = _reference(case)
    plan = _plan(case, compact=SS)
    case["seq_lens"][1] = 0
    out, lse = plan.run(*cases.run_args(case), return_lse=True)
    torch.cuda.synchronize()
    assert torch.count_nonzero(out[1]) == 0 and torch.isneginf(lse[1]).all()
    assert plan.last_num_splits >= 2
    for r in (0, 2, 3):
        assert cases.rel_err(out[r].cpu(), ref_out[r]) < _tol(dtype), f"request {r}"
        assert (lse[r].cpu() - ref_lse[r]).abs().max().item() < 2e-2


def test_compact_plan_builds_one_kernel_and_refuses_fp8(recording_builder):
    """A compact plan builds one kernel (keyed apart from the any-form one), sizes its splits for the CTAs
    its stages fit and for a split's reach (half the maps), and refuses FP8 stores, split floors and
    head_dim 64."""
    ss = ("sparse", "sparse")
    plan = HieraSparseDecode(8, 32, 8, 128, 64, 512, torch.float16, "cpu", num_sms=132, compact=ss)
    shape = (32, 8, 128, 64, "float16", 2, SPLIT_CAPACITY, 1, False, False)
    assert list(recording_builder) == [shape + (ss,)] and plan.kernel.key == shape + (ss,)
    _cpu_run(plan, 8, 512)
    (main,) = plan.kernel.launches
    assert main["splits"] == 8 and plan.num_splits == 8
    assert decode_module.ctas_per_sm(32, 8, 128, 64, 2, forms=ss) == 4
    assert decode_module.ctas_per_sm(32, 8, 128, 64, 2, forms=("dense", "sparse")) == 3
    assert decode_module.split_reach(SPLIT_CAPACITY, ss) == SPLIT_CAPACITY // 2
    assert decode_module.split_reach(SPLIT_CAPACITY) == SPLIT_CAPACITY
    with pytest.raises(ValueError, match="num_splits"):  # 513 blocks need 3 splits of at most 256
        HieraSparseDecode(1, 32, 8, 128, 64, 513, torch.float16, "cpu", num_splits=2, compact=ss)
    for bs in (1, 8, 64):
        for width in (257, 1025, 2049):
            assert plan.splits(bs, width) >= -(-width // (SPLIT_CAPACITY // 2)), (bs, width)
    assert decode_module.decode_kernel_args(32, 8, 128, 64, "float16", 2) == (32, 8, 128, 64, "float16", 2)
    with pytest.raises(ValueError, match="compact"):
        HieraSparseDecode(8, 32, 8, 128, 64, 512, torch.bfloat16, "cpu", num_sms=132, compact=ss, store_dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="compact"):  # dense K with 2:4 V: slower (decode.COMPACT_FORMS)
        HieraSparseDecode(8, 32, 8, 128, 64, 512, torch.float16, "cpu", num_sms=132, compact=("dense", "sparse"))
    with pytest.raises(ValueError, match="head_dim"):
        HieraSparseDecode(8, 4, 1, 64, 64, 512, torch.float16, "cpu", num_sms=132, compact=ss)
    assert decode_module.decode_compact(("dense", "sparse"), 128) is None and decode_module.decode_compact(ss, 128) == ss
    assert decode_module.decode_compact(ss, 64) is None


@pytest.mark.parametrize("bad", ["1:2", "x", "1", "0.5:1:0", ""])
def test_bench_rejects_malformed_points(bad):
    """``--points`` takes S_K:S_V pairs in [0, 1]; anything else is a usage error before any GPU work."""
    from sglang_hs.kernels import bench

    with pytest.raises(SystemExit) as err:
        bench.main(["--kernel", "decode", "--points", bad])
    assert err.value.code == 2
