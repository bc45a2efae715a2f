"""Decode modes (``sglang_hs.decode_modes``): the batched block choice against the CPU references in
``sglang_hs.reference``, the table compaction, the PyTorch serving path, and on the GPU the decode
kernel's per-block LSE and its run over a compacted table (``gpu`` tests skip without CUDA)."""

import math

import pytest
import torch

from sglang_hs import reference as R
from sglang_hs.config import HieraSparseConfig, HieraSparseConfigError
from sglang_hs.decode_modes import BlockSelection, compact, parse_anchors
from sglang_hs.fallback import block_logsumexp, decompressed_paged_attention
from sglang_hs.kernels import cases

LENS = [64 * 30, 64 * 22 + 17, 64 * 9, 64 * 40 - 5]  # full and partial last pages; one short request
SINK, WINDOW = 1, 4


def _case(device="cpu", seed=0, lens=LENS, dtype=torch.float16):
    return cases.make_case(lens, 8, 2, 64, 1.0, 1.0, dtype, device, sink_blocks=SINK, window_blocks=WINDOW,
                           max_blocks=48, seed=seed)  # fmt: skip


def _dense_kv(case):
    paged = cases.paged_dense(case)
    return [cases.dense_kv(case, paged, r) for r in range(len(case["seq_lens_list"]))]


def _block_lse(case, kv):
    width = case["block_table"].shape[1]
    out = torch.full((len(kv), case["q"].shape[1], width), -math.inf)
    for r, (k, _) in enumerate(kv):
        lse = block_logsumexp(case["q"][r].cpu(), k.cpu(), case["block_size"], case["sm_scale"])
        out[r, :, : lse.shape[1]] = lse
    return out


def _reference_keep(case, kv, rule: BlockSelection) -> torch.Tensor:
    """Per request, the reference's rule on the exact masses of the compressible region (the blocks
    between sink and window), pooled over the KV heads."""
    width, block = case["block_table"].shape[1], case["block_size"]
    keep = torch.zeros(len(kv), width, dtype=torch.bool)
    for r, (k, _) in enumerate(kv):
        n = -(-case["seq_lens_list"][r] // block)
        keep[r, :n] = True
        lo, hi = SINK, n - WINDOW
        if hi <= lo:
            continue
        mass = R.exact_block_mass(case["q"][r].cpu(), k[lo * block : hi * block].cpu(), block,
                                             case["sm_scale"]).sum(0, keepdim=True)  # fmt: skip
        none = torch.zeros(hi - lo, dtype=torch.bool)
        if rule.mode == "kascade":
            chosen = R.select_topk(mass, rule.topk, none)[0]
        else:
            chosen = R.select_mass(mass.log(), rule.tau, none, cap=rule.topk)[0]
        keep[r, lo:hi] = chosen
    return keep


@pytest.mark.parametrize("mode,topk,tau", [("kascade", 4, 1.0), ("kascade", 100, 1.0), ("psa", 100, 0.5),
                                           ("psa", 100, 0.95), ("psa", 3, 0.95)])  # fmt: skip
def test_choice_matches_the_reference(mode, topk, tau):
    case = _case(dtype=torch.float32)
    kv = _dense_kv(case)
    rule = BlockSelection(mode, frozenset({0}), topk, tau)
    keep, counts = rule.choose(_block_lse(case, kv), case["block_table"], case["seq_lens"], case["block_size"])
    expected = _reference_keep(case, kv, rule)
    assert torch.equal(keep, expected)
    compressed = (case["block_table"] < 0) & keep  # poison past a request's blocks is never kept
    offered = sum(max(0, -(-n // 64) - SINK - WINDOW) for n in LENS)
    assert counts.tolist() == [int(compressed.sum()), offered]
    if mode == "psa" and tau == 0.95 and topk == 100:  # the budget adapts: requests read different counts
        assert len(set(keep.sum(1).tolist())) > 1


def test_compact_moves_kept_blocks_forward():
    table = torch.tensor([[5, ~0, ~1, ~2, 6, 7], [8, ~3, 9, -(1 << 30), -(1 << 30), -(1 << 30)]], dtype=torch.int32)
    seq_lens = torch.tensor([64 * 5 + 10, 64 * 2 + 64])
    keep = torch.tensor([[1, 0, 1, 0, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    got, lengths = compact(table, seq_lens, keep, 64)
    assert got[0, :4].tolist() == [5, ~1, 6, 7] and lengths[0].item() == 64 * 3 + 10
    assert got[1, :3].tolist() == [8, ~3, 9] and lengths[1].item() == 64 * 3
    assert got.dtype == torch.int32 and lengths.dtype == torch.int32


def test_fallback_over_compacted_table_reads_only_the_chosen_blocks():
    """The serving path without kernels: the anchor's per-block LSE equals the per-request reference,
    and attention over the compacted table equals attention over the chosen blocks' tokens."""
    case = _case(seed=3, dtype=torch.float32)
    kv = _dense_kv(case)
    args = (case["k_cache"], case["v_cache"], cases.pools_of(case), case["k_index"], case["v_index"])
    bs = len(LENS)
    out, block_lse = decompressed_paged_attention(case["q"], list(range(bs + 1)), *args, case["block_table"],
                                                  case["seq_lens_list"], 64, case["sm_scale"], return_block_lse=True)
    assert torch.allclose(block_lse, _block_lse(case, kv), atol=1e-4)
    rule = BlockSelection("kascade", frozenset({0}), 5)
    keep, _ = rule.choose(block_lse, case["block_table"], case["seq_lens"], 64)
    table, lengths = compact(case["block_table"], case["seq_lens"], keep, 64)
    got = decompressed_paged_attention(case["q"], list(range(bs + 1)), *args, table, lengths.tolist(), 64,
                                       case["sm_scale"])  # fmt: skip
    for r, (k, v) in enumerate(kv):
        tokens = keep[r].repeat_interleave(64)[: k.shape[0]]
        ref, _ = R.dense_attention(case["q"][r : r + 1], k[tokens], v[tokens], sm_scale=case["sm_scale"])
        assert cases.rel_err(got[r : r + 1], ref) < 1e-4, f"request {r}"
    assert (lengths < case["seq_lens"]).any()


def test_anchors_and_settings():
    assert parse_anchors("", 10) == (0, 4, 8)
    assert parse_anchors("0,3,11", 12) == (0, 3, 11)
    for bad in ("3,5", "0,5,5", "0,7,3", "0,12", "0,x"):
        with pytest.raises(ValueError, match="decode-anchors"):
            parse_anchors(bad, 12)
    assert BlockSelection.from_config(HieraSparseConfig(), 12) is None
    rule = BlockSelection.from_config(HieraSparseConfig(decode_mode="psa", decode_anchors="0,6", decode_tau=0.8), 12)
    assert rule.is_anchor(6) and not rule.is_anchor(5) and rule.tau == 0.8
    for kwargs in ({"decode_mode": "topk"}, {"decode_topk": 0}, {"decode_tau": 0.0}, {"decode_anchors": "1,2"},
                   {"decode_mode": "kascade", "shared_prefix_decode": "on"}):  # fmt: skip
        with pytest.raises(HieraSparseConfigError):
            HieraSparseConfig(**kwargs)


# ----------------------------------------------------------------------------------------------- GPU
def _gpu_plan(case, **kw):
    from sglang_hs.kernels.decode import HieraSparseDecode

    q = case["q"]
    return HieraSparseDecode(q.shape[0], q.shape[1], case["k_cache"].shape[1], q.shape[2], case["block_size"],
                             case["max_blocks"], q.dtype, q.device, **kw)  # fmt: skip


GPU_SHAPES = [(32, 8, 128, torch.float16, 1.0, 1.0), (16, 2, 128, torch.bfloat16, 0.0, 1.0),
              (4, 4, 64, torch.float16, 0.5, 0.5), (8, 4, 128, torch.float16, 1.0, 0.0)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"G{s[0] // s[1]}-d{s[2]}-{str(s[3])[6:]}")
@pytest.mark.parametrize("splits", [None, 3])
def test_kernel_block_lse_and_compacted_decode(shape, splits):
    """The kernel's per-block LSE equals the reference's, the output is unchanged by asking for it, and
    the decode over the compacted table equals attention over the chosen blocks' tokens."""
    hq, hkv, d, dtype, sk, sv = shape
    lens = [64 * 60, 64 * 33 + 9, 64 * 7, 64 * 90 - 3]
    case = cases.make_case(lens, hq, hkv, d, sk, sv, dtype, "cuda", max_blocks=96, seed=5)
    plan = _gpu_plan(case, block_lse=True, num_splits=splits)
    args = cases.run_args(case)
    plain = plan.run(*args).clone()
    out, block_lse = plan.run(*args, return_block_lse=True)
    assert torch.equal(out, plain)
    paged = cases.paged_dense(case)
    kv = [cases.dense_kv(case, paged, r) for r in range(len(lens))]
    for r, (k, _) in enumerate(kv):
        ref = block_logsumexp(case["q"][r], k, 64, case["sm_scale"])
        assert (block_lse[r, :, : ref.shape[1]] - ref).abs().max().item() < 2e-2, f"request {r}"
    rule = BlockSelection("psa", frozenset({0}), 12, 0.9)
    keep, _ = rule.choose(block_lse, case["block_table"], case["seq_lens"], 64)
    table, lengths = rule.apply(block_lse, case["block_table"], case["seq_lens"], 64, torch.zeros(2, dtype=torch.int64,
                                                                                                  device="cuda"))
    assert torch.equal(table[:, :20], compact(case["block_table"], case["seq_lens"], keep, 64)[0][:, :20])
    got = plan.run(*args[:6], table, lengths, case["sm_scale"])
    for r, (k, v) in enumerate(kv):
        tokens = keep[r].repeat_interleave(64)[: k.shape[0]]
        ref, _ = R.dense_attention(case["q"][r : r + 1], k[tokens], v[tokens], sm_scale=case["sm_scale"])
        assert cases.rel_err(got[r : r + 1], ref) < (1e-2 if dtype == torch.bfloat16 else 3e-3), f"request {r}"
    read, blocks = keep.sum(1).tolist(), ((case["seq_lens"] + 63) // 64).tolist()
    assert [r < b for r, b in zip(read, blocks)] == [True, True, False, True]  # request 2: 2 compressed blocks, both read


@pytest.mark.gpu
def test_choice_and_compaction_replay_in_a_cuda_graph():
    """Anchor decode, choice, compaction and the compacted decode captured once, replayed after the
    queries change in place: the same results as eager calls."""
    case = cases.make_case([64 * 80, 64 * 50 + 3, 64 * 20], 32, 8, 128, 1.0, 1.0, torch.float16, "cuda",
                           max_blocks=96, seed=6)  # fmt: skip
    plan = _gpu_plan(case, block_lse=True)
    args = cases.run_args(case)
    rule = BlockSelection("kascade", frozenset({0}), 8)
    counts = torch.zeros(2, dtype=torch.int64, device="cuda")

    def step():
        out, block_lse = plan.run(*args, return_block_lse=True)
        table, lengths = rule.apply(block_lse, case["block_table"], case["seq_lens"], 64, counts)
        return out.clone(), plan.run(*args[:6], table, lengths, case["sm_scale"]), table, lengths

    step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = step()
    torch.cuda.current_stream().wait_stream(stream)
    case["q"].copy_(torch.randn_like(case["q"]))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [96, 517, 2053])
@pytest.mark.parametrize("mode,topk,tau", [("kascade", 8, 1.0), ("kascade", 64, 1.0), ("psa", 64, 0.9),
                                           ("psa", 6, 0.5)])  # fmt: skip
def test_triton_choice_equals_the_pytorch_choice(width, mode, topk, tau):
    """``BlockSelection.apply`` on a GPU (one Triton launch) writes the table, lengths and counts that
    ``choose`` + ``compact`` give, over requests of every length, compressed or not."""
    gen = torch.Generator(device="cuda").manual_seed(width)
    bs, hq = 6, 32
    lens = torch.tensor([width * 64, width * 64 - 100, 64 * 9 + 1, 64, width * 32, 0], dtype=torch.int32, device="cuda")
    table = torch.randint(0, 1 << 20, (bs, width), generator=gen, device="cuda", dtype=torch.int32)
    compressed = torch.rand(bs, width, generator=gen, device="cuda") < 0.9
    compressed[4] = False  # a request without compressed blocks
    table = torch.where(compressed, ~table, table)
    block_lse = torch.randn(bs, hq, width, generator=gen, device="cuda") * 3
    rule = BlockSelection(mode, frozenset({0}), topk, tau)
    counts = torch.zeros(2, dtype=torch.int64, device="cuda")
    got_table, got_lens = rule.apply(block_lse, table, lens, 64, counts)
    keep, expected_counts = rule.choose(block_lse, table, lens, 64)
    want_table, want_lens = compact(table, lens, keep, 64)
    assert torch.equal(got_lens, want_lens) and counts.tolist() == expected_counts.tolist()
    assert torch.equal(got_table, want_table)


@pytest.mark.gpu
def test_triton_choice_breaks_ties_toward_the_lower_block():
    """Equal masses at the top-k boundary: the lower blocks are kept, as the reference (stable) does."""
    table = torch.tensor([[5, ~0, ~1, ~2, ~3, ~4, 6]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([64 * 7], dtype=torch.int32, device="cuda")
    block_lse = torch.zeros(1, 4, 7, device="cuda")
    block_lse[0, :, 4] = 1.0  # block ~3 first; ~0, ~1, ~2, ~4 tie
    counts = torch.zeros(2, dtype=torch.int64, device="cuda")
    table_out, lens_out = BlockSelection("kascade", frozenset({0}), 3).apply(block_lse, table, lens, 64, counts)
    assert table_out[0, :5].tolist() == [5, ~0, ~1, ~3, 6] and lens_out.tolist() == [64 * 5]
    assert counts.tolist() == [3, 5]
