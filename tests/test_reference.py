"""The oracle: attention over mixed dense/sparse blocks against dense attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sglang_hs import reference as ref
from sglang_hs.fallback import decompressed_paged_attention
from sglang_hs.pruner import make_pruner

PRUNER = make_pruner("magnitude")


def sdpa(q, k, v, q_offset):
    """torch's scaled_dot_product_attention with a causal mask shifted by the query offset."""
    n_q, n_kv = q.shape[0], k.shape[0]
    mask = torch.arange(n_kv)[None, :] <= (q_offset + torch.arange(n_q))[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, enable_gqa=True,
    )
    return out.transpose(0, 1).to(q.dtype)


def random_kv(seq_len, heads, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(seq_len, heads, dim, generator=gen).to(dtype)
    v = torch.randn(seq_len, heads, dim, generator=gen).to(dtype)
    return k, v


CASES = [
    # (seq_len, n_queries, kv heads, q heads): ragged lengths, not multiples of the block size,
    # decode (1 query), a query chunk after a cached prefix, and full prefill.
    (700, 1, 2, 8),
    (1000, 37, 1, 4),
    (513, 513, 2, 4),
    (960, 64, 4, 4),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dense_store_matches_sdpa(dtype, head_dim):
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    for i, (seq_len, n_q, heads, q_heads) in enumerate(CASES):
        k, v = random_kv(seq_len, heads, head_dim, dtype, seed=i)
        q = torch.randn(n_q, q_heads, head_dim).to(dtype)
        seq = ref.compress_sequence(k, v, PRUNER, 0.0, 0.0)
        assert (seq.k_index >= 0).all() and (seq.v_index >= 0).all()
        out, lse = ref.attention(q, seq)
        expected = sdpa(q, k, v, seq_len - n_q)
        assert torch.allclose(out.float(), expected.float(), atol=tol, rtol=tol), (seq_len, n_q)
        _, dense_lse = ref.dense_attention(q, k, v)
        assert torch.allclose(lse, dense_lse, atol=1e-4)


@pytest.mark.parametrize("sk, sv", [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.5, 0.5)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sparse_store_matches_dense_attention_over_pruned_kv(sk, sv, dtype):
    for i, (seq_len, n_q, heads, q_heads) in enumerate(CASES):
        head_dim = 64 if i % 2 else 128
        k, v = random_kv(seq_len, heads, head_dim, dtype, seed=10 + i)
        q = torch.randn(n_q, q_heads, head_dim).to(dtype)
        seq = ref.compress_sequence(k, v, PRUNER, sk, sv, sink_tokens=64, window_tokens=128)
        pruned_k, pruned_v = ref.decompress(seq)
        out, lse = ref.attention(q, seq)
        expected, expected_lse = ref.dense_attention(q, pruned_k, pruned_v)
        # Same values, same fp32 arithmetic, different summation order: rounding only.
        assert torch.allclose(out.float(), expected.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-3)
        assert torch.allclose(lse, expected_lse, atol=1e-4)
        if sk or sv:
            assert not torch.equal(pruned_k, k) or not torch.equal(pruned_v, v)


def test_decompress_inverts_compress_on_pruned_data():
    k, v = random_kv(640, 2, 64, torch.float16, seed=3)
    seq = ref.compress_sequence(k, v, PRUNER, 1.0, 1.0, sink_tokens=64, window_tokens=64)
    pruned_k, pruned_v = ref.decompress(seq)
    sparse_k_blocks = (seq.k_index < 0).any(0)
    for b in range(10):
        rows = slice(b * 64, (b + 1) * 64)
        if sparse_k_blocks[b]:
            assert ((pruned_k[rows] == 0).float().mean() - 0.5).abs() < 0.01
        else:
            assert torch.equal(pruned_k[rows], k[rows])
    again = ref.compress_sequence(pruned_k, pruned_v, PRUNER, 1.0, 1.0, sink_tokens=64, window_tokens=64)
    assert torch.equal(ref.decompress(again)[0], pruned_k) and torch.equal(ref.decompress(again)[1], pruned_v)


def test_merge_partial_equals_attention_over_union():
    torch.manual_seed(4)
    q = torch.randn(5, 4, 64)
    k, v = torch.randn(300, 2, 64), torch.randn(300, 2, 64)
    full, full_lse = ref.dense_attention(q, k, v, causal=False)
    a, a_lse = ref.dense_attention(q, k[:120], v[:120], causal=False)
    b, b_lse = ref.dense_attention(q, k[120:], v[120:], causal=False)
    merged, merged_lse = ref.merge_partial(a, a_lse, b, b_lse)
    assert torch.allclose(merged, full, atol=1e-5) and torch.allclose(merged_lse, full_lse, atol=1e-5)
    assert math.isfinite(float(merged_lse.sum()))


def test_paged_attention_over_cache_pages_and_compressed_blocks():
    """Serving layout: a block table mixing SGLang cache pages and compressed blocks."""
    torch.manual_seed(5)
    heads, dim, q_heads, block = 2, 64, 8, 64
    k, v = random_kv(6 * block, heads, dim, torch.float16, seed=6)
    store = ref.compress_sequence(k, v, PRUNER, 1.0, 0.5, block, sink_tokens=0, window_tokens=0)
    cache_k = torch.randn(10 * block, heads, dim).half()
    cache_v = torch.randn_like(cache_k)
    # Two requests: [page 3, compressed 0..5, page 5, partial page 7 (20 tokens)] and [page 2, compressed 4].
    table = torch.tensor([[3, -1, -2, -3, -4, -5, -6, 5, 7], [2, -5, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    seq_lens = [8 * block + 20, 2 * block]
    q = torch.randn(6, q_heads, dim).half()  # 5 extend queries for request 0, one decode query for request 1
    out, lse = ref.paged_attention(q, [0, 5, 6], cache_k, cache_v, store.pools, store.k_index, store.v_index, table, seq_lens)
    pruned_k, pruned_v = ref.decompress(store)
    page = lambda x, p, n=block: x[p * block : p * block + n]
    k0 = torch.cat([page(cache_k, 3), pruned_k, page(cache_k, 5), page(cache_k, 7, 20)])
    v0 = torch.cat([page(cache_v, 3), pruned_v, page(cache_v, 5), page(cache_v, 7, 20)])
    k1 = torch.cat([page(cache_k, 2), pruned_k[4 * block : 5 * block]])
    v1 = torch.cat([page(cache_v, 2), pruned_v[4 * block : 5 * block]])
    for rows, kk, vv in ((slice(0, 5), k0, v0), (slice(5, 6), k1, v1)):
        expected, expected_lse = ref.dense_attention(q[rows], kk, vv)
        assert torch.allclose(out[rows].float(), expected.float(), atol=1e-3)
        assert torch.allclose(lse[rows], expected_lse, atol=1e-4)


@pytest.mark.parametrize("value_dtype, dim", [(None, 64), (torch.float8_e4m3fn, 64), (None, 96), (None, 256)],
                         ids=["16bit", "fp8", "d96", "d256"])  # fmt: skip
@pytest.mark.parametrize("sk, sv", [(0.0, 0.0), (1.0, 1.0), (0.0, 1.0), (0.5, 0.5)])
def test_decompressed_fallback_matches_oracle(sk, sv, value_dtype, dim):
    """The fallback (16-bit gathers) against the oracle (float32): 16-bit and FP8 store values, and the
    head_dims only the PyTorch paths take (96, 256)."""
    torch.manual_seed(7)
    heads, q_heads, block = 2, 8, 64
    k, v = random_kv(6 * block, heads, dim, torch.float16, seed=8)
    store = ref.compress_sequence(k, v, PRUNER, sk, sv, block, sink_tokens=0, window_tokens=0, value_dtype=value_dtype)
    cache_k, cache_v = torch.randn(10 * block, heads, dim).half(), torch.randn(10 * block, heads, dim).half()
    table = torch.tensor([[3, -1, -2, -3, -4, -5, -6, 5, 7], [2, -5, 4, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    seq_lens, qo_indptr = [8 * block + 20, 2 * block + 33], [0, 5, 6]
    q = torch.randn(6, q_heads, dim).half()
    args = (store.pools, store.k_index, store.v_index, table, seq_lens)
    expected, _ = ref.paged_attention(q, qo_indptr, cache_k, cache_v, *args, sm_scale=0.125)
    got = decompressed_paged_attention(q, qo_indptr, cache_k, cache_v, *args, block_size=block, sm_scale=0.125)
    assert torch.allclose(got.float(), expected.float(), atol=2e-3)
