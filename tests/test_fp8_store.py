"""FP8 (e4m3) values in the compressed store: a float32 scale per pool row (block, KV head, layer), the
compressor quantizing after pruning, and every PyTorch reader (the oracle, the serving fallback, the block
copies of the host tier) scaling back. CPU only."""

from __future__ import annotations

import pytest
import torch

from sglang_hs import reference as ref
from sglang_hs.format import (FP8_DTYPE, FP8_MAX, compressed_fraction, decompress_blocks, dense_block_bytes,
                              dequantize_rows, quantize_rows, sparse_block_bytes)  # fmt: skip
from sglang_hs.pools import CompressedStore, StoreCapacity, compress_prefix
from sglang_hs.pruner import make_pruner
from sglang_hs.transfer import copy_blocks, plan_block_copy

PRUNER = make_pruner("magnitude")
B, H, D, LAYERS = 64, 3, 64, 2


def test_rows_quantize_to_their_absolute_maximum():
    torch.manual_seed(0)
    x = torch.randn(5, B, D, dtype=torch.bfloat16) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 500.0]).view(5, 1, 1).bfloat16()
    values, scale = quantize_rows(x)
    assert values.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (5,)
    assert scale[3] == 1.0  # an all-zero row
    peak = values.float().abs().amax(dim=(1, 2))[[0, 1, 2, 4]]  # a power-of-two scale puts it in (FP8_MAX / 2, FP8_MAX]
    assert ((peak > FP8_MAX / 2) & (peak <= FP8_MAX)).all()
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    back = dequantize_rows(values, scale)
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 of each element (normal range).
    big = x.float().abs() > x.float().abs().amax(dim=(1, 2), keepdim=True) / 64
    assert ((back - x.float()).abs()[big] <= x.float().abs()[big] / 16 + 1e-6).all()


def test_rows_that_hold_e4m3_values_are_stored_exactly():
    """The compressor reads SGLang's FP8 pages (unit scale) into 16-bit rows: storing them again must not
    round them a second time."""
    torch.manual_seed(1)
    x = torch.randn(4, B, D) * torch.tensor([1e-3, 0.2, 3.0, 100.0]).view(4, 1, 1)
    pages = x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.bfloat16)  # exact: e4m3 fits in bf16
    values, scale = quantize_rows(pages)
    assert torch.equal(dequantize_rows(values, scale), pages.float())


def test_byte_accounting_counts_values_metadata_and_scales():
    assert dense_block_bytes(B, D, 1) == B * D + 4 and sparse_block_bytes(B, D, 1) == B * D // 2 + B * D // 8 + 4
    assert compressed_fraction(0, 0, 2) == 1.0 and compressed_fraction(1, 1, 2) == pytest.approx(0.5625)
    assert compressed_fraction(0, 0, 1) == pytest.approx((B * D + 4) / (2 * B * D))
    assert compressed_fraction(1, 1, 1) == pytest.approx((B * D * 5 // 8 + 4) / (2 * B * D))
    store = make_store(torch.float8_e4m3fn, StoreCapacity(4, 4, 4, 4, 4))
    allocated = sum(t.numel() * t.element_size() for name in ("k_dense", "k_values", "k_meta", "v_dense", "v_values",
                    "v_meta", "k_dense_scale", "k_values_scale", "v_dense_scale", "v_values_scale")
                    for t in getattr(store, name))  # fmt: skip
    assert allocated == store.capacity.nbytes(LAYERS, H, D, B, elem_bytes=1)
    store.allocate([True, False, True], [False, True, True])  # K and V: two 2:4 blocks and one dense each
    per_operand = 2 * sparse_block_bytes(B, D, 1) + dense_block_bytes(B, D, 1)
    assert store.stored_bytes() == LAYERS * H * 2 * per_operand


def make_store(value_dtype, capacity=StoreCapacity(6, 6, 6, 6, 6), k_sparse_heads=None) -> CompressedStore:
    return CompressedStore(capacity, LAYERS, H, D, B, torch.bfloat16, "cpu", k_sparse_heads=k_sparse_heads,
                           value_dtype=value_dtype)  # fmt: skip


def compress(store: CompressedStore, sk: float, sv: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(8 * B, H, D, generator=gen).bfloat16() for _ in range(LAYERS)]
    v = [torch.randn(8 * B, H, D, generator=gen).bfloat16() for _ in range(LAYERS)]
    slots = torch.arange(B, 5 * B)
    vbs = compress_prefix(store, PRUNER, k, v, slots, [(torch.ones(4, dtype=torch.bool), sk, sv)])
    return k, v, slots, vbs


@pytest.mark.parametrize("sk, sv", [(0.0, 0.0), (1.0, 1.0), (0.5, 1.0)])
def test_the_store_holds_what_the_oracle_compresses(sk, sv):
    """The serving store's FP8 rows are the oracle's: prune, then quantize each kept row; read back by
    the fallback's gather they equal the oracle's decompression, bit for bit."""
    fp8, bf16 = make_store(FP8_DTYPE), make_store(None)
    k, v, slots, vbs = compress(fp8, sk, sv)
    compress(bf16, sk, sv)
    for layer in range(LAYERS):
        pools = fp8.layer_pools(layer)
        assert pools.quantized and pools.k_dense.dtype == FP8_DTYPE
        for op, buffer in (("k", k), ("v", v)):
            index = (fp8.k_index_of(layer) if op == "k" else fp8.v_index)[:, vbs]
            got = decompress_blocks(pools, index, op)  # float32
            exact = decompress_blocks(bf16.layer_pools(layer), index, op).float()  # 16-bit pruned blocks
            mask = exact != 0
            assert torch.equal(mask, got != 0) or (got[~mask] == 0).all()
            assert ((got - exact).abs() <= exact.abs() / 16 + 1e-3).all()
        if 0 < sk < 1:
            continue  # the oracle ranks blocks per head and layer, the store over all of them: other choices
        # The oracle's compressor, one sequence per layer: same pruned, quantized blocks.
        blocks = lambda x: x[slots].reshape(4, B, H, D).permute(2, 0, 1, 3)  # noqa: E731
        k_result = PRUNER(blocks(k[layer]), "k", sk, torch.ones(4, dtype=torch.bool))
        v_result = PRUNER(blocks(v[layer]), "v", sv, torch.ones(4, dtype=torch.bool))
        oracle, k_index, v_index = ref.compress_blocks(blocks(k[layer]), blocks(v[layer]), k_result, v_result, FP8_DTYPE)
        for op, index in (("k", k_index), ("v", v_index)):
            store_index = (fp8.k_index_of(layer) if op == "k" else fp8.v_index)[:, vbs]
            assert torch.equal(decompress_blocks(oracle, index, op), decompress_blocks(pools, store_index, op))


@pytest.mark.parametrize("sk, sv", [(0.0, 0.0), (1.0, 1.0), (0.0, 1.0)])
def test_fp8_attention_stays_near_16_bit_and_reads_what_decompress_gives(sk, sv):
    """The oracle over FP8 blocks: near attention over the same 16-bit pruned blocks, and the same as
    dense attention over its own decompression (the fallback against the oracle: test_reference.py)."""
    gen = torch.Generator().manual_seed(8)
    k, v = (torch.randn(6 * B, 2, D, generator=gen).half() for _ in range(2))
    q = torch.randn(5, 8, D, generator=gen).half()
    seq = ref.compress_sequence(k, v, PRUNER, sk, sv, B, sink_tokens=0, window_tokens=0, value_dtype=FP8_DTYPE)
    seq16 = ref.compress_sequence(k, v, PRUNER, sk, sv, B, sink_tokens=0, window_tokens=0)
    out, _ = ref.attention(q, seq)
    assert (out.float() - ref.attention(q, seq16)[0].float()).abs().max() < 0.05
    pruned_k, pruned_v = ref.decompress(seq)
    assert torch.allclose(out.float(), ref.dense_attention(q, pruned_k, pruned_v)[0].float(), atol=1e-3)


def test_block_copies_move_the_scales_with_the_rows():
    """The host tier's copies: a block's FP8 rows and their scales arrive together."""
    head_map = torch.tensor([[True, False, True], [False, False, True]])
    src, dst = make_store(FP8_DTYPE, k_sparse_heads=head_map), make_store(FP8_DTYPE, k_sparse_heads=head_map)
    _, _, _, vbs = compress(src, 0.5, 1.0)
    placements = [src.placement(vb) for vb in vbs]
    dst_vbs = dst.allocate([p.k_sparse for p in placements], [p.v_sparse for p in placements])
    copy_blocks(src, dst, plan_block_copy(src, vbs, dst, dst_vbs))
    names = {name for pool in ("k_dense", "k_sparse", "v_dense", "v_sparse") for name, _, _ in src.slot_rows(pool)}
    assert {"k_dense_scale", "k_values_scale", "v_values_scale"} <= names
    for layer in range(LAYERS):
        for op in "kv":
            src_index = (src.k_index_of(layer) if op == "k" else src.v_index)[:, vbs]
            dst_index = (dst.k_index_of(layer) if op == "k" else dst.v_index)[:, dst_vbs]
            assert torch.equal(decompress_blocks(src.layer_pools(layer), src_index, op),
                               decompress_blocks(dst.layer_pools(layer), dst_index, op))  # fmt: skip
    with pytest.raises(ValueError, match="dtypes"):
        plan_block_copy(src, vbs, make_store(None, k_sparse_heads=head_map), dst_vbs)


def test_fp8_pages_are_read_as_unit_scaled_values():
    """SGLang's FP8 pages (``--kv-cache-dtype fp8_e4m3``, unit scales): the compressor and the fallback
    read them cast to the compute dtype; a checkpoint with other KV scales is refused."""
    from types import SimpleNamespace

    from sglang_hs.config import HieraSparseConfigError
    from sglang_hs.fallback import dense_view
    from sglang_hs.pools import prefix_blocks
    from sglang_hs.runtime import check_unit_kv_scales

    cache = torch.randn(4 * B, H, D).to(FP8_DTYPE)
    blocks = prefix_blocks(cache, torch.arange(B, 3 * B), B, H)
    assert blocks.dtype == torch.float32 and torch.equal(blocks, cache[B:3 * B].float().reshape(2, B, H, D).permute(2, 0, 1, 3))
    store = make_store(FP8_DTYPE)
    k, v = dense_view(cache, cache, store.layer_pools(0), store.k_index_of(0), store.v_index,
                      torch.tensor([2, 3], dtype=torch.int32), 2 * B - 5, B, torch.bfloat16)  # fmt: skip
    assert k.dtype == torch.bfloat16 and torch.equal(k, cache[2 * B:4 * B - 5].bfloat16())
    check_unit_kv_scales(torch.nn.Module())
    model = torch.nn.Sequential(torch.nn.Linear(1, 1))
    model[0].k_scale_float, model[0].v_scale_float = 1.0, None
    check_unit_kv_scales(model)
    model[0].k_scale_float = 0.25
    with pytest.raises(HieraSparseConfigError, match="KV scales"):
        check_unit_kv_scales(model)


@pytest.mark.parametrize("sk,sv", [(0.0, 0.0), (1.0, 0.5)])
def test_batch_copies_for_the_extend_kernel_equal_each_requests_dense_view(sk, sv):
    """An extend over FP8 KV reads 16-bit copies of its batch's blocks as cache pages: the copies behind a
    request's row of the new table are that request's KV as the fallback reads it (FP8 pages and rows
    scaled back, 2:4 rows unpacked), and chunks of requests bound the copies."""
    from sglang_hs.fallback import batch_chunks, batch_pages, dense_view
    from sglang_hs.kernels import cases

    lens = [1000, 300, 64 * 7, 5]
    case = cases.quantize_case(cases.make_case(lens, 6, 3, D, sk, sv, torch.bfloat16, "cpu", max_blocks=20, seed=3))
    fp8, _ = cases.fp8_pages(case)
    pools = cases.pools_of(fp8)
    assert fp8["k_cache"].dtype == FP8_DTYPE and pools.quantized
    width = -(-max(lens) // B)
    k_pages, v_pages, table = batch_pages(fp8["k_cache"], fp8["v_cache"], pools, fp8["k_index"], fp8["v_index"],
                                          fp8["block_table"], fp8["seq_lens"], width, B, torch.bfloat16)  # fmt: skip
    assert k_pages.dtype == torch.bfloat16 and k_pages.shape == (len(lens) * width * B, 3, D)
    assert torch.equal(table.flatten(), torch.arange(len(lens) * width, dtype=torch.int32))
    for r, length in enumerate(lens):
        k, v = dense_view(fp8["k_cache"], fp8["v_cache"], pools, fp8["k_index"], fp8["v_index"], fp8["block_table"][r],
                          length, B, torch.bfloat16)  # fmt: skip
        got_k, got_v = dense_view(k_pages, v_pages, pools, fp8["k_index"], fp8["v_index"], table[r], length, B)
        assert torch.equal(got_k, k) and torch.equal(got_v, v), r
    assert batch_chunks(lens, B, 10**6) == [(0, 4, width)]
    assert batch_chunks(lens, B, 20) == [(0, 1, 16), (1, 3, 7), (3, 4, 1)]  # the first alone is 16 blocks
