"""Shared-prefix (cascade) decode (``sglang_hs.kernels.decode_shared``) against the oracle.

The oracle is ``sglang_hs.reference.paged_attention`` over each request's whole block table. The CPU
tests run the grouping, the query fold, the gathers and the merge with the oracle standing in for the
decode kernel (so they check the cascade's own arithmetic); the ``gpu`` tests run the real kernels.
Batches cover groups of 1 (no set), uneven groups, a group larger than one column set, prefixes of
different lengths, a member whose own pass is empty, and fp16/bf16.
"""

import os
import subprocess
import sys

import pytest
import torch

from sglang_hs import reference as R
from sglang_hs.kernels import cases
from sglang_hs.kernels.decode_shared import (
    GPU_SHAPES, PrefixGroups, SharedPrefixDecode, find_shared_prefixes, fold_of, merge_states,
)

B = 64
# Case sources: 0 and 1 are prefixes (20 and 12 blocks), 2..5 lend their blocks as own tails.
SOURCE_LENS = [20 * B, 12 * B + 10, 3 * B, 2 * B + 5, 5 * B, 4 * B]
# (prefix source, shared blocks, tail source, tail tokens): a group of 5 on source 0 (a set of 4 and a
# lone remainder when fold = 4), a group of 2 on source 1 with a shorter shared prefix, a member whose
# own pass is empty (tail 0), and two requests alone.
REQUESTS = [
    (0, 18, 2, 100), (1, 10, 3, 64), (0, 18, 4, 1), (0, 18, 5, 200), (2, 0, 2, 150),
    (0, 18, 3, 0), (1, 10, 4, 130), (0, 18, 2, 64 * 3), (3, 0, 3, 70),
]


def _case(q_heads, kv_heads, dtype, device, sk=1.0, sv=1.0, seed=3, head_dim=64):
    base = cases.make_case(SOURCE_LENS, q_heads, kv_heads, head_dim, sk, sv, dtype, device, seed=seed)
    return cases.share_with_tails(base, REQUESTS, seed=seed)


def _reference(case):
    pools = cases.pools_of(case, "cpu")
    bs = case["q"].shape[0]
    return R.paged_attention(case["q"].cpu(), list(range(bs + 1)), case["k_cache"].cpu(), case["v_cache"].cpu(),
                             pools, case["k_index"].cpu(), case["v_index"].cpu(), case["block_table"].cpu(),
                             case["seq_lens_list"], case["sm_scale"])  # fmt: skip


def _run(plan, case, groups):
    q, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale = cases.run_args(case)
    step = plan.plan_step(block_table, seq_lens, groups)
    return plan.run(q, k_cache, v_cache, pools, k_index, v_index, step, sm_scale)


class ReferencePlan:
    """Stands in for ``HieraSparseDecode`` (same ``run`` signature) with the oracle, per request."""

    def run(self, q, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale, out=None,
            return_lse=False):  # fmt: skip
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], -torch.inf)
        for r, length in enumerate(seq_lens.tolist()):
            if length > 0:
                o, l = R.paged_attention(q[r : r + 1], [0, 1], k_cache, v_cache, pools, k_index, v_index,
                                         block_table[r : r + 1], [length], sm_scale)  # fmt: skip
                out[r], lse[r] = o[0], l[0]
        return (out, lse) if return_lse else out


def test_grouping_finds_sets_and_leaves_lone_requests_out():
    case = _case(32, 8, torch.float32, "cpu")
    fold = fold_of(32, 8)
    assert fold == 4
    groups = find_shared_prefixes(case["block_table"], case["seq_lens_list"], B, fold)
    # Source 0's group: requests 0, 2, 3, 5, 7 -> a set of 4 and a lone remainder (7) left to its own pass.
    assert groups.sets == [[0, 2, 3, 5], [1, 6]]
    assert groups.shared_blocks == [18, 10]
    assert groups.own_start == [18, 10, 18, 18, 0, 18, 10, 0, 0]
    # With a fold of 2 the same group makes three sets, the last of two.
    two = find_shared_prefixes(case["block_table"], case["seq_lens_list"], B, 2)
    assert two.sets == [[0, 2], [3, 5], [1, 6]] and two.own_start[7] == 0
    # min_own_blocks keeps a block of every member out of the shared pass; a fold of 1 has no sets.
    kept = find_shared_prefixes(case["block_table"], case["seq_lens_list"], B, fold, min_own_blocks=1)
    assert kept.shared_blocks == [17, 10]  # request 5 has 18 full blocks and keeps one
    assert not find_shared_prefixes(case["block_table"], case["seq_lens_list"], B, 1).any_shared


def test_shared_blocks_stop_at_the_first_difference_and_at_full_blocks():
    table = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 1, 2], [5, 6, 7, 8, 3]], dtype=torch.int32)
    groups = find_shared_prefixes(table, [5 * B, 5 * B, 3 * B + 1], B, 4)
    assert groups.sets == [[0, 1, 2]] and groups.shared_blocks == [3]
    # Request 2 has 3 full blocks: with one block kept for its own pass only 2 are shared.
    assert find_shared_prefixes(table, [5 * B, 5 * B, 3 * B + 1], B, 4, min_own_blocks=1).shared_blocks == [2]


def test_merge_states_is_attention_over_the_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 16, generator=g), torch.randn(40, 2, 16, generator=g), torch.randn(40, 2, 16, generator=g)
    full, _ = R.dense_attention(q, k, v, causal=False)
    a, la = R.dense_attention(q, k[:25], v[:25], causal=False)
    b, lb = R.dense_attention(q, k[25:], v[25:], causal=False)
    assert torch.allclose(merge_states(a, la, b, lb), full, atol=1e-5)
    empty = torch.full_like(lb, -torch.inf)
    assert torch.allclose(merge_states(a, la, torch.zeros_like(b), empty), a)


def test_fold_and_unfold_are_inverse():
    plan = SharedPrefixDecode(6, 8, 2, 16, B, 4, torch.float32, "cpu", plans=(None, None))
    assert plan.fold == 4
    q = torch.randn(6, 8, 16)
    members = torch.tensor([[0, 3, 5, -1], [1, 2, -1, -1]])
    folded = plan.fold_queries(q, members)
    assert folded.shape == (2, 2 * 4 * 4, 16)
    # KV head 1 of set 0 holds request 3's query heads 4..7 as its second group of columns.
    assert torch.equal(folded[0, 16 + 4 : 16 + 8], q[3, 4:8])
    back = plan.unfold(folded)
    assert torch.equal(back[1], q[3]) and torch.equal(back[4], q[1]) and torch.equal(back[5], q[2])


@pytest.mark.parametrize("q_heads, kv_heads", [(32, 8), (8, 4), (16, 2)])
def test_cascade_matches_reference_with_the_oracle_as_kernel(q_heads, kv_heads):
    case = _case(q_heads, kv_heads, torch.float32, "cpu", sk=0.5, sv=1.0)
    bs = case["q"].shape[0]
    plan = SharedPrefixDecode(bs, q_heads, kv_heads, 64, B, case["max_blocks"], torch.float32, "cpu",
                              plans=(ReferencePlan(), ReferencePlan()))  # fmt: skip
    groups = plan.groups(case["block_table"], case["seq_lens_list"])
    assert groups.any_shared
    out = _run(plan, case, groups)
    ref, _ = _reference(case)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4)


def test_too_many_sets_for_the_plan_is_an_error():
    with pytest.raises(ValueError, match="max_sets"):
        PrefixGroups([[0, 1], [2, 3]], [1, 1], [1] * 4).tensors(2, 1, "cpu")


def test_the_shared_pass_kernel_keeps_two_ctas_per_sm():
    """CPU: the 16-column kernel of a d-128 model gets index maps small enough for two CTAs an SM."""
    from sglang_hs.kernels.decode import SMEM_PER_SM, fitting_split_capacity, smem_bytes

    assert fitting_split_capacity(32, 8, 128, 64, 2) == 512  # the model's own kernel is unchanged
    capacity = fitting_split_capacity(128, 8, 128, 64, 2)
    assert capacity < 512 and 2 * (smem_bytes(128, 64, 2, 16, capacity) + 1024) <= SMEM_PER_SM


def test_fused_merge_kernel_in_tritons_interpreter():
    """CPU: the Triton gather-and-merge kernel (run by Triton's interpreter in a fresh process, as
    TRITON_INTERPRET must be set before Triton loads) equals the PyTorch merge and the oracle."""
    pytest.importorskip("triton")
    script = """
import os, sys, torch
sys.path.insert(0, {tests!r})
import test_decode_shared as t
from sglang_hs.kernels.decode_shared import SharedPrefixDecode, _merge_kernel_factory
for hq, hkv in [(32, 8), (8, 2)]:
    case = t._case(hq, hkv, torch.float32, "cpu", sk=0.5, sv=1.0)
    plan = SharedPrefixDecode(case["q"].shape[0], hq, hkv, 64, 64, case["max_blocks"], torch.float32, "cpu",
                              plans=(t.ReferencePlan(), t.ReferencePlan()))
    groups = plan.groups(case["block_table"], case["seq_lens_list"])
    by_torch = t._run(plan, case, groups)
    plan.merge_kernel = _merge_kernel_factory()
    by_triton = t._run(plan, case, groups)
    ref, _ = t._reference(case)
    assert torch.allclose(by_triton, by_torch, atol=1e-6) and torch.allclose(by_triton, ref, atol=2e-5), hq
print("ok")
""".format(tests=os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("q_heads, kv_heads, head_dim, dtype", [(hq, hkv, d, getattr(torch, dt)) for hq, hkv, d, dt in GPU_SHAPES],
                         ids=lambda v: str(v).split(".")[-1])  # fmt: skip
def test_kernels_match_reference(q_heads, kv_heads, head_dim, dtype):
    case = _case(q_heads, kv_heads, dtype, "cuda", head_dim=head_dim)
    bs = case["q"].shape[0]
    plan = SharedPrefixDecode(bs, q_heads, kv_heads, head_dim, B, case["max_blocks"], dtype, "cuda")
    groups = plan.groups(case["block_table"], case["seq_lens_list"])
    out = _run(plan, case, groups)
    ref, _ = _reference(case)
    err = (out.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()
    assert float(err) < (1e-2 if dtype == torch.bfloat16 else 3e-3)

