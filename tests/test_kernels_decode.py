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
from sglang_hs.kernels.decode import HieraSparseDecode, choose_num_splits

# (q_heads, kv_heads, head_dim, dtype, S_K, S_V): GQA groups 4, 8, 1, 2; head_dim 128 and 64; fp16/bf16.
SMALL = [
    (32, 8, 128, torch.float16, 0.5, 0.5),
    (16, 2, 128, torch.bfloat16, 1.0, 1.0),
    (4, 4, 64, torch.float16, 1.0, 0.0),
    (8, 4, 128, torch.float16, 0.0, 1.0),
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


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SMALL, ids=_id)
def test_matches_reference(shape):
    hq, hkv, d, dtype, sk, sv = shape
    case = cases.make_case(SMALL_LENS, hq, hkv, d, sk, sv, dtype, "cuda", max_blocks=SMALL_MAX_BLOCKS, seed=1)
    plan = _plan(case, num_splits=SMALL_SPLITS)
    out = torch.full_like(case["q"], float("nan"))
    got, lse = plan.run(*cases.run_args(case), out=out, return_lse=True)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(got).all(), "unwritten or non-finite outputs"
    ref_out, ref_lse = _reference(case)
    for r in range(len(SMALL_LENS)):
        err = cases.rel_err(got[r].cpu(), ref_out[r])
        assert err < _tol(dtype), f"request {r}: rel err {err:.2e}"
    assert (lse.cpu() - ref_lse).abs().max().item() < 2e-2
    again = plan.run(*cases.run_args(case))  # repeated calls: scratch and split tickets are reusable
    assert torch.equal(again, got) and not plan.counter.any()


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


@pytest.mark.gpu
def test_cuda_graph_replay_follows_inputs():
    """Captured once, replayed after q, seq_lens and block-table contents change in place."""
    case = cases.make_case(MID_LENS, 32, 8, 128, 0.5, 1.0, torch.float16, "cuda", max_blocks=MID_MAX_BLOCKS, seed=4)
    plan = _plan(case)
    args = cases.run_args(case)
    out = torch.empty_like(case["q"])
    plan.run(*args, out=out)  # warm-up outside the graph
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        plan.run(*args, out=out)
    torch.cuda.current_stream().wait_stream(stream)
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


def test_split_count_counts_occupancy_per_split():
    """CPU: at a 32K server context (529 blocks), an unsplit CTA's index maps make it too large for two
    CTAs per SM; the plan must see that two splits fit two (it chose one split, one CTA per SM, before)."""
    from sglang_hs.kernels.common import SMEM_PER_SM
    from sglang_hs.kernels.decode import plan_num_splits, smem_bytes

    def ctas(blocks_per_split):
        return SMEM_PER_SM // (smem_bytes(128, 64, 2, 4, blocks_per_split) + 1024)

    assert ctas(529) == 1 and ctas(265) == 2
    for bs in (8, 16, 32):
        s = plan_num_splits(bs, 32, 8, 128, 64, 529, 2, 132)
        assert ctas(-(-529 // s)) == 2, (bs, s)
        assert bs * 8 * s <= 2 * 132 * 2  # at most two waves of CTAs
