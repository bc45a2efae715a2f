"""2:4 packing, metadata layout, index-map convention and byte accounting (eq. 6)."""

from __future__ import annotations

import pytest
import torch

from sglang_hs import format as fmt
from sglang_hs.pruner import make_pruner, top2_of_4
from sglang_hs.reference import compress_sequence


def test_metadata_nibbles_are_tilelang_natural_layout():
    # Groups keep positions (0,1), (1,3), (0,2), (2,3): nibbles 0b0100, 0b1101, 0b1000, 0b1110,
    # first group in the lowest bits -> 0xE8D4.
    keep = torch.tensor([[1, 1, 0, 0, 0, 1, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    x = torch.arange(1, 17, dtype=torch.float16)[None]
    values, meta = fmt.pack_2to4(x, keep)
    assert values.tolist() == [[1, 2, 6, 8, 9, 11, 15, 16]]
    assert meta.dtype == torch.int16
    assert int(meta[0, 0]) & 0xFFFF == 0xE8D4
    assert fmt.meta_to_positions(meta).tolist() == [[0, 1, 5, 7, 8, 10, 14, 15]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pack_unpack_is_exact_inverse_on_pruned_data(dtype):
    torch.manual_seed(1)
    x = torch.randn(3, 64, 128, dtype=dtype)
    keep = top2_of_4(x.abs(), axis=-1)
    values, meta = fmt.pack_2to4(x, keep)
    assert values.shape == (3, 64, 64) and meta.shape == (3, 64, 8)
    assert torch.equal(fmt.unpack_2to4(values, meta), x * keep)
    again_values, again_meta = fmt.pack_2to4(fmt.unpack_2to4(values, meta), keep)
    assert torch.equal(again_values, values) and torch.equal(again_meta, meta)


def test_pack_rejects_bad_masks():
    x = torch.ones(1, 16)
    with pytest.raises(ValueError, match="exactly 2 of every 4"):
        fmt.pack_2to4(x, torch.ones(1, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple of 16"):
        fmt.pack_2to4(torch.ones(1, 8), torch.ones(1, 8, dtype=torch.bool))


def test_index_map_sign_convention():
    entries = torch.tensor([0, 5, fmt.sparse_entry(0), fmt.sparse_entry(7)])
    is_sparse, offset = fmt.decode_entry(entries)
    assert is_sparse.tolist() == [False, False, True, True]
    assert offset.tolist() == [0, 5, 0, 7]
    assert fmt.decode_entry(-1) == (True, 0) and fmt.decode_entry(3) == (False, 3)


@pytest.mark.parametrize("sk, sv", [(0, 0), (0, 1), (1, 0), (0.5, 0.5), (0.5, 1), (0.25, 0.75), (1, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_store_bytes_equal_eq6_and_ratio(sk, sv, head_dim):
    torch.manual_seed(2)
    heads, block, n_blocks = 2, 64, 8
    k = torch.randn(n_blocks * block, heads, head_dim, dtype=torch.float16)
    v = torch.randn_like(k)
    # No sink or window: every block is prunable, so S·n blocks are sparse exactly.
    seq = compress_sequence(k, v, make_pruner("magnitude"), sk, sv, block, sink_tokens=0, window_tokens=0)
    n_sk, n_sv = fmt.sparse_count(n_blocks, sk), fmt.sparse_count(n_blocks, sv)
    assert int((seq.k_index < 0).sum()) == heads * n_sk and int((seq.v_index < 0).sum()) == heads * n_sv
    expected = heads * fmt.store_bytes(n_blocks, block, head_dim, n_sk, n_sv)
    assert seq.pools.nbytes() == expected
    dense = heads * 2 * n_blocks * fmt.dense_block_bytes(block, head_dim)
    assert dense / expected == pytest.approx(fmt.compression_ratio(sk, sv), rel=1e-12)
    assert fmt.compression_ratio(1, 1) == pytest.approx(1.0 / 0.5625)


def test_sparse_count_uses_ceiling():
    assert fmt.sparse_count(3, 0.5) == 2
    assert fmt.sparse_count(10, 0.3) == 3  # 0.3 * 10 is 3.0000000000000004 in floating point
    assert fmt.sparse_count(10, 0.0) == 0 and fmt.sparse_count(10, 1.0) == 10
