"""Shared-prefix (cascade) decode (``sglang_hs.kernels.decode_shared``) against the oracle.

The oracle is ``sglang_hs.reference.paged_attention`` over each request's whole block table. The CPU
tests run the grouping, the query fold, the gathers and the merge with the oracle standing in for the
decode kernel (so they check the cascade's own arithmetic); the ``gpu`` tests run the real kernels.
Batches cover groups of 1 (no set), uneven groups, a group larger than one column set, prefixes of
different lengths, a member whose own pass is empty, and fp16/bf16.
"""

import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from sglang_hs import reference as R
from sglang_hs.kernels import cases
from sglang_hs.kernels.common import ANY_FORMS
from sglang_hs.kernels.decode_shared import (
    GPU_FORMS, GPU_SHAPES, MIN_SHARED_BATCH, SharedPrefixDecode, compressed_forms, conforming_blocks, fold_of,
    merge_states, shared_heads, step_tables,
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


@dataclass(frozen=True)
class PrefixGroups:
    """The oracle's grouping of one decode batch (host lists, as :func:`find_shared_prefixes` returns them).

    ``sets``: per column set, its member requests (1 to ``fold``); ``taken``: per set, the block-table
    columns its shared pass reads (the same for every member)."""

    sets: list[list[int]]
    taken: list[list[int]]

    @property
    def any_shared(self) -> bool:
        return bool(self.sets)


def find_shared_prefixes(block_table: torch.Tensor, seq_lens: list[int], block_size: int, fold: int,
                         min_shared_blocks: int = 1, min_own_blocks: int = 0,
                         conforming: torch.Tensor | None = None,
                         lone_min_blocks: int | None = None) -> PrefixGroups:  # fmt: skip
    """The oracle of :func:`step_tables`: the same grouping by a host loop over ``block_table [bs, W]``.

    Requests with the same first entry form a group; its common blocks are the leading columns equal
    in every member, at most each member's full blocks (``seq_len // block_size``) minus
    ``min_own_blocks`` (the benchmark uses 1 so that every request keeps a block of its own, as a
    request's question and generated tokens would be). The shared pass takes the common columns that
    ``conforming`` (``[bs, W]`` bool, a function of the block) marks, all without it. Groups of one, or
    with fewer than ``min_shared_blocks`` (at least 1) such columns, stay out; larger groups are cut into
    column sets of ``fold`` members, in batch order. With ``lone_min_blocks``, a request alone on its
    first entry with at least that many such columns is a set of one, after every group's sets, if
    there is a group."""
    table = block_table.cpu()
    if fold < 2:  # the GQA group fills the kernel's columns: nothing to fold
        return PrefixGroups([], [])
    by_first: dict[int, list[int]] = {}
    for r in range(table.shape[0]):
        if seq_lens[r] // block_size - min_own_blocks >= max(min_shared_blocks, 1):  # long enough to share
            by_first.setdefault(int(table[r, 0]), []).append(r)
    def shared_columns(members: list[int]) -> list[int]:
        rows = table[members]
        limit = min(seq_lens[r] // block_size for r in members) - min_own_blocks
        common = 0
        while common < limit and bool((rows[:, common] == rows[0, common]).all()):
            common += 1
        return [c for c in range(common) if conforming is None or bool(conforming[members[0], c])]

    sets, taken, lone = [], [], []
    for members in by_first.values():
        columns = shared_columns(members)
        if len(members) < 2:
            if lone_min_blocks is not None and len(columns) >= max(lone_min_blocks, min_shared_blocks, 1):
                lone.append((members, columns))
            continue
        if len(columns) < max(min_shared_blocks, 1):
            continue
        for start in range(0, len(members), fold):  # a remainder of one is a set too
            sets.append(members[start : start + fold])
            taken.append(columns)
    if sets:
        for members, columns in sorted(lone):
            sets.append(members)
            taken.append(columns)
    return PrefixGroups(sets, taken)


def _case(q_heads, kv_heads, dtype, device, sk=1.0, sv=1.0, seed=3, head_dim=64):
    base = cases.make_case(SOURCE_LENS, q_heads, kv_heads, head_dim, sk, sv, dtype, device, seed=seed)
    return cases.share_with_tails(base, REQUESTS, seed=seed)


def _reference(case):
    pools = cases.pools_of(case, "cpu")
    bs = case["q"].shape[0]
    return R.paged_attention(case["q"].cpu(), list(range(bs + 1)), case["k_cache"].cpu(), case["v_cache"].cpu(),
                             pools, case["k_index"].cpu(), case["v_index"].cpu(), case["block_table"].cpu(),
                             case["seq_lens_list"], case["sm_scale"])  # fmt: skip


def _run(plan, case, sets: bool = True):
    q, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale = cases.run_args(case)
    step = plan.plan_step(block_table, seq_lens, k_index, v_index)
    assert bool((step.members[:, 0] >= 0).any()) == sets  # whether the batch has column sets
    return plan.run(q, k_cache, v_cache, pools, k_index, v_index, step, sm_scale)


def _distinct_case(q_heads: int = 32, kv_heads: int = 8):
    """10 requests, each on a prefix of its own (a batch large enough for the shared pass, with no set)."""
    return cases.make_case([300 + 37 * i for i in range(10)], q_heads, kv_heads, 64, 1.0, 1.0, torch.float32, "cpu",
                           seed=4)  # fmt: skip


def test_a_batch_without_sets_never_reads_the_skipped_shared_rows():
    """CPU: a call of 10 distinct requests runs the shared pass over 5 empty set rows, which a kernel
    skips (their output rows are never written: NaN here); the merge must not read them."""
    case = _distinct_case()
    plan = SharedPrefixDecode(10, 32, 8, 64, B, case["max_blocks"], torch.float32, "cpu",
                              plans=(ReferencePlan(float("nan")), ReferencePlan()))  # fmt: skip
    assert plan.sets_for(10) == 5
    out = _run(plan, case, sets=False)
    assert torch.allclose(out, _reference(case)[0], atol=2e-5, rtol=1e-4)


class ReferencePlan:
    """Stands in for ``HieraSparseDecode`` (same ``run`` signature) with the oracle, per request.
    ``empty``: the output of a request with no tokens (NaN stands for rows a kernel skips and never
    writes, as the shared pass skips an empty set)."""

    def __init__(self, empty: float = 0.0):
        self.empty = empty

    def run(self, q, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale, out=None,
            return_lse=False, split_limit=None):  # fmt: skip
        out = torch.full_like(q, self.empty)
        lse = torch.full(q.shape[:2], -torch.inf if self.empty == 0 else self.empty)
        for r, length in enumerate(seq_lens.tolist()):
            if length > 0:
                o, l = R.paged_attention(q[r : r + 1], [0, 1], k_cache, v_cache, pools, k_index, v_index,
                                         block_table[r : r + 1], [length], sm_scale)  # fmt: skip
                out[r], lse[r] = o[0], l[0]
        return (out, lse) if return_lse else out


def test_grouping_finds_sets_and_leaves_lone_requests_out():
    case = _case(32, 8, torch.float32, "cpu")
    assert fold_of(32, 8) == 8 and fold_of(16, 2) == 4 and fold_of(64, 1) == 1  # 32 columns a set
    fold = 4
    groups = find_shared_prefixes(case["block_table"], case["seq_lens_list"], B, fold)
    # Source 0's group: requests 0, 2, 3, 5, 7 -> a set of 4 and a set of its remainder (7); requests 4
    # and 8, alone on their tables, stay out.
    assert groups.sets == [[0, 2, 3, 5], [7], [1, 6]]
    assert groups.taken == [list(range(18)), list(range(18)), list(range(10))]
    # With a fold of 2 the same group makes three sets, the last of one.
    two = find_shared_prefixes(case["block_table"], case["seq_lens_list"], B, 2)
    assert two.sets == [[0, 2], [3, 5], [7], [1, 6]]
    # min_own_blocks keeps a block of every member out of the shared pass; a fold of 1 has no sets.
    kept = find_shared_prefixes(case["block_table"], case["seq_lens_list"], B, fold, min_own_blocks=1)
    assert [len(t) for t in kept.taken] == [17, 17, 10]  # request 5 has 18 full blocks and keeps one
    assert not find_shared_prefixes(case["block_table"], case["seq_lens_list"], B, 1).any_shared


def test_shared_blocks_stop_at_the_first_difference_and_at_full_blocks():
    table = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 1, 2], [5, 6, 7, 8, 3]], dtype=torch.int32)
    groups = find_shared_prefixes(table, [5 * B, 5 * B, 3 * B + 1], B, 4)
    assert groups.sets == [[0, 1, 2]] and groups.taken == [[0, 1, 2]]
    # Request 2 has 3 full blocks: with one block kept for its own pass only 2 are shared.
    assert find_shared_prefixes(table, [5 * B, 5 * B, 3 * B + 1], B, 4, min_own_blocks=1).taken == [[0, 1]]


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
    plan = SharedPrefixDecode(6, 16, 2, 16, B, 4, torch.float32, "cpu", plans=(None, None))
    assert plan.fold == 4  # G = 8: 4 requests fill the 32 columns
    q = torch.randn(6, 16, 16)
    members = torch.tensor([[0, 3, 5, -1], [1, 2, -1, -1]])
    folded = plan.fold_queries(q, members)
    assert folded.shape == (2, 2 * 4 * 8, 16)
    # KV head 1 of set 0 holds request 3's query heads 8..15 as its second group of columns.
    assert torch.equal(folded[0, 32 + 8 : 32 + 16], q[3, 8:16])
    back = plan.unfold(folded)
    assert torch.equal(back[1], q[3]) and torch.equal(back[4], q[1]) and torch.equal(back[5], q[2])


@pytest.mark.parametrize("q_heads, kv_heads", [(32, 8), (8, 4), (16, 2), (9, 3), (14, 2)])
@pytest.mark.parametrize("sk, sv", [(0.5, 1.0), (1.0, 1.0), (0.0, 1.0), (0.0, 0.0)])
def test_cascade_matches_reference_with_the_oracle_as_kernel(q_heads, kv_heads, sk, sv):
    """With the shared pass restricted to the forms of the case's compressed blocks (its dense sink and
    window pages go to the own pass) as with every form."""
    case = _case(q_heads, kv_heads, torch.float32, "cpu", sk=sk, sv=sv)
    bs = case["q"].shape[0]
    ref, _ = _reference(case)
    for forms in {ANY_FORMS, compressed_forms((sk,), (sv,))}:
        plan = SharedPrefixDecode(bs, q_heads, kv_heads, 64, B, case["max_blocks"], torch.float32, "cpu",
                                  plans=(ReferencePlan(), ReferencePlan()), forms=forms)  # fmt: skip
        out = _run(plan, case)
        assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), forms


def test_the_shared_pass_runs_over_the_sets_a_call_can_have():
    """A server's plan is built for its largest captured batch (max_sets = half of it); a call of bs
    requests hands the shared pass bs // 2 set rows, so its split count is planned for those (the
    shared pass over a plan for 256 requests took the 2 splits of 128 sets at 16 requests: slower than
    the per-request kernel in a server, docs/results.md), and the output is unchanged."""
    case = _case(32, 8, torch.float32, "cpu", sk=1.0, sv=1.0)
    bs = case["q"].shape[0]
    rows = []

    class Recording(ReferencePlan):
        def run(self, q, *args, **kw):
            rows.append(q.shape[0])
            return super().run(q, *args, **kw)

    plan = SharedPrefixDecode(64, 32, 8, 64, B, case["max_blocks"], torch.float32, "cpu",
                              plans=(Recording(), ReferencePlan()))  # fmt: skip
    assert plan.max_sets == 32 and plan.sets_for(bs) == bs // 2 == 4 and plan.sets_for(1) == 0
    out = _run(plan, case)
    ref, _ = _reference(case)
    assert rows == [bs // 2] and torch.allclose(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bs", [1, 4, 7])
def test_small_calls_run_the_per_request_kernel(bs):
    """A call of fewer than MIN_SHARED_BATCH requests forms no sets (the shared pass cost more than it
    saved there): neither pass runs, the per-request plan reads every request's whole table."""
    case = _case(32, 8, torch.float32, "cpu", sk=1.0, sv=1.0)
    assert bs < MIN_SHARED_BATCH <= case["q"].shape[0]
    small = {**case, "q": case["q"][:bs], "block_table": case["block_table"][:bs], "seq_lens": case["seq_lens"][:bs],
             "seq_lens_list": case["seq_lens_list"][:bs]}
    calls = []

    class Recording(ReferencePlan):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def run(self, q, *args, **kw):
            calls.append(self.name)
            return super().run(q, *args, **kw)

    plan = SharedPrefixDecode(64, 32, 8, 64, B, case["max_blocks"], torch.float32, "cpu",
                              plans=(Recording("shared"), Recording("own"), Recording("per-request")))  # fmt: skip
    q, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale = cases.run_args(small)
    step = plan.plan_step(block_table, seq_lens, k_index, v_index)
    assert plan.sets_for(bs) == 0 and step.members.shape[0] == 0 and bool((step.pick < 0).all())
    assert torch.equal(step.own_table[:, : block_table.shape[1]], block_table)
    out = plan.run(q, k_cache, v_cache, pools, k_index, v_index, step, sm_scale)
    ref, _ = _reference(small)
    assert calls == ["per-request"] and torch.allclose(out, ref, atol=2e-5, rtol=1e-4)


def test_compressed_forms_follow_the_settings():
    assert compressed_forms((1.0, 1.0), (1.0, 1.0)) == ("sparse", "sparse")
    assert compressed_forms((0.0, 0.0), (1.0, 1.0)) == ("dense", "sparse")
    assert compressed_forms((1.0, 0.0), (1.0, 1.0)) == ("any", "sparse")  # prefill and decode blocks differ
    assert compressed_forms((0.5, 0.5), (0.0, 0.0)) == ("any", "dense")
    assert compressed_forms((1.0, 1.0), (1.0, 1.0), k_head_map=True) == ("any", "sparse")  # some heads keep K dense


@pytest.mark.parametrize("sk, sv", [(1.0, 1.0), (0.0, 1.0), (0.5, 1.0), (0.0, 0.0)])
def test_conforming_blocks_are_the_blocks_of_the_forms(sk, sv):
    """The case's compressed blocks are the virtual ones; its sink and window are cache pages. A kernel
    for the forms of the settings takes exactly the virtual blocks, or every block when the forms are
    all dense; a block sparse on some heads only is taken by neither a sparse nor a dense form."""
    case = _case(32, 8, torch.float32, "cpu", sk=sk, sv=sv)
    table, k_index, v_index = case["block_table"], case["k_index"], case["v_index"]
    forms = compressed_forms((sk,), (sv,))
    ok = conforming_blocks(table, k_index, v_index, forms)
    lens = torch.tensor(case["seq_lens_list"])
    inside = torch.arange(table.shape[1])[None, :] < (lens[:, None] + B - 1) // B
    want = inside if forms == ("dense", "dense") else (table < 0) & inside
    assert torch.equal(ok & inside, want)
    assert conforming_blocks(table, k_index, v_index, ANY_FORMS) is None
    if sk == 0.5:  # K sparse on some heads of a block: a single K form takes the block only if all agree
        for k_form in ("sparse", "dense"):
            ok = conforming_blocks(table, k_index, v_index, (k_form, "any"))
            for r, c in (table < 0).logical_and(inside).nonzero().tolist():
                sparse_heads = sum(int(k_index[h, -int(table[r, c]) - 1]) < 0 for h in range(k_index.shape[0]))
                assert bool(ok[r, c]) == (sparse_heads == (k_index.shape[0] if k_form == "sparse" else 0))


def test_a_restricted_shared_pass_leaves_the_dense_sink_to_the_own_pass():
    case = _case(32, 8, torch.float32, "cpu", sk=1.0, sv=1.0)
    table, k_index, v_index = case["block_table"], case["k_index"], case["v_index"]
    plan = SharedPrefixDecode(table.shape[0], 32, 8, 64, B, case["max_blocks"], torch.float32, "cpu",
                              plans=(None, None), forms=("sparse", "sparse"))  # fmt: skip
    step = plan.plan_step(table, case["seq_lens"], k_index, v_index)
    # Source 0: a sink page, 15 compressed blocks, 4 window pages; its group (one set of 5) shares 18
    # blocks, of which the 15 compressed ones go to the shared pass. Source 1 (12 blocks + 10 tokens): 8
    # of its 10.
    assert step.shared_lens.tolist()[:2] == [15 * B, 8 * B]
    assert step.shared_table[0, :15].tolist() == table[0, 1:16].tolist()
    assert step.own_table[0, :5].tolist() == [table[0, 0].item(), *table[0, 16:20].tolist()]
    with pytest.raises(ValueError, match="index maps"):
        plan.plan_step(table, case["seq_lens"])


def _oracle_tables(groups: PrefixGroups, bs: int, fold: int, max_sets: int) -> dict:
    members = [[-1] * fold for _ in range(max_sets)]
    shared, pick, taken = [0] * max_sets, [-1] * bs, [[] for _ in range(bs)]
    for i, (group, columns) in enumerate(list(zip(groups.sets, groups.taken))[:max_sets]):  # the rest: own pass
        members[i][: len(group)] = group
        shared[i] = len(columns)
        for position, r in enumerate(group):
            pick[r] = i * fold + position
            taken[r] = columns
    return dict(members=members, shared=shared, pick=pick, taken=taken)


@pytest.mark.parametrize("fold", [1, 2, 4, 16])
@pytest.mark.parametrize("min_own_blocks", [0, 1])
@pytest.mark.parametrize("conform", [False, True])
@pytest.mark.parametrize("lone_min_blocks", [None, 2])
def test_step_tables_group_as_the_host_oracle(fold, min_own_blocks, conform, lone_min_blocks):
    """CPU: the GPU-side grouping equals the host loop on the case above and on random batches (shared
    runs of random length, padding requests of length 0, first entries shared by unrelated rows);
    ``conform``: with a mask of the blocks the shared pass takes (a function of the block, as the
    forms of a block are: here its parity, and every block of the case but the cache pages);
    ``lone_min_blocks``: lone requests with that many blocks to take are sets of one; sets past
    ``max_sets`` fall back to the own pass."""
    case = _case(32, 8, torch.float32, "cpu")
    batches = [(case["block_table"], case["seq_lens_list"])]
    rng = random.Random(fold * 10 + min_own_blocks + 100 * conform)
    for _ in range(60):
        bs, width = rng.randint(1, 12), rng.randint(1, 9)
        prefixes = [[rng.randint(0, 3)] + [rng.randint(0, 50) for _ in range(width - 1)] for _ in range(3)]
        rows, lens = [], []
        for _ in range(bs):
            row = list(rng.choice(prefixes))
            cut = rng.randint(0, width)
            row[cut:] = [rng.randint(100, 200) for _ in range(width - cut)]
            rows.append(row)
            lens.append(rng.choice([0, width * B, width * B, width * B - 1, rng.randint(1, width * B)]))
        batches.append((torch.tensor(rows, dtype=torch.int32), lens))
    for table, lens in batches:
        bs, width = table.shape
        max_sets = max(1, bs // 2)
        mask = None
        if conform:
            mask = table < 0 if table is case["block_table"] else table % 2 == 0
        groups = find_shared_prefixes(table, lens, B, fold, min_own_blocks=min_own_blocks, conforming=mask,
                                      lone_min_blocks=lone_min_blocks)  # fmt: skip
        want = _oracle_tables(groups, bs, fold, max_sets)
        step = step_tables(table, torch.tensor(lens, dtype=torch.int32), B, fold, max_sets,
                           min_own_blocks=min_own_blocks, conforming=mask, lone_min_blocks=lone_min_blocks)  # fmt: skip
        assert step.members.tolist() == want["members"], (table, lens)
        assert step.shared_lens.tolist() == [b * B for b in want["shared"]]
        assert step.pick.tolist() == want["pick"]
        assert step.own_lens.tolist() == [n - len(t) * B for n, t in zip(lens, want["taken"])]
        for r, columns in enumerate(want["taken"]):
            own = [table[r, c].item() for c in range(width) if c not in columns]
            assert step.own_table[r, : len(own)].tolist() == own
        for i, (group, columns) in enumerate(list(zip(groups.sets, groups.taken))[:max_sets]):
            assert step.shared_table[i, : len(columns)].tolist() == [table[group[0], c].item() for c in columns]


def test_every_compressed_run_of_a_chunked_prefix_is_shared():
    """A prefix that entered the radix tree in chunks keeps dense blocks (each chunk's window) between
    its compressed runs: the shared pass takes every compressed run, the own pass the dense blocks
    and the request's own blocks, in table order."""
    # virtual (compressed) blocks are negative, cache pages non-negative; two requests share 7 blocks
    prefix = [5, -1, -2, 6, -3, -4, 7]
    table = torch.tensor([prefix + [8, 9], prefix + [10, 11]], dtype=torch.int32)
    step = step_tables(table, torch.tensor([9 * B, 8 * B + 3], dtype=torch.int32), B, 4, max_sets=1,
                       conforming=table < 0)  # fmt: skip
    assert step.members.tolist() == [[0, 1, -1, -1]] and step.shared_lens.tolist() == [4 * B]
    assert step.shared_table[0, :4].tolist() == [-1, -2, -3, -4]
    assert step.own_table[:, :5].tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11]]
    assert step.own_lens.tolist() == [5 * B, 4 * B + 3]


def test_a_short_request_does_not_cut_its_groups_run():
    """A CUDA graph pads a batch with requests of length 1 that may share the first entry of a real
    group: they join no group, so the group still shares its whole run."""
    table = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 9]], dtype=torch.int32)
    step = step_tables(table, torch.tensor([3 * B, 3 * B, 1], dtype=torch.int32), B, 4, max_sets=1)
    assert step.members.tolist() == [[0, 1, -1, -1]] and step.shared_lens.tolist() == [3 * B]
    assert step.own_lens.tolist() == [0, 0, 1]


def test_sets_beyond_max_sets_fall_back_to_the_own_pass():
    table = torch.tensor([[1, 2], [1, 2], [3, 4], [3, 4]], dtype=torch.int32)
    step = step_tables(table, torch.tensor([2 * B] * 4, dtype=torch.int32), B, 4, max_sets=1)
    assert step.members.tolist() == [[0, 1, -1, -1]] and step.pick.tolist() == [0, 1, -1, -1]
    assert step.own_lens.tolist() == [0, 0, 2 * B, 2 * B]


def test_the_shared_pass_fits_three_ctas_per_sm_for_the_compressed_forms():
    """CPU: the shared pass's n32 tile at d 128 fits three CTAs an SM when its stages hold one form per
    operand (2:4 K and V, where shared memory would fit four but the registers do not; dense K and 2:4
    V), and one with every form."""
    from sglang_hs.kernels.shared_pass_extend import ctas_per_sm

    assert [ctas_per_sm(128, B, forms) for forms in (("sparse", "sparse"), ("dense", "sparse"), ANY_FORMS)] == [3, 3, 1]


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
                              plans=(t.ReferencePlan(float("nan")), t.ReferencePlan()))
    by_torch = t._run(plan, case)
    plan.merge_kernel = _merge_kernel_factory()
    by_triton = t._run(plan, case)
    ref, _ = t._reference(case)
    assert torch.allclose(by_triton, by_torch, atol=1e-6) and torch.allclose(by_triton, ref, atol=2e-5), hq
    distinct = t._distinct_case(hq, hkv)  # no set: every shared row skipped (NaN), none read
    by_triton = t._run(plan, distinct, sets=False)
    assert torch.allclose(by_triton, t._reference(distinct)[0], atol=2e-5)
print("ok")
""".format(tests=os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


TABLE_FORMS = (ANY_FORMS, ("sparse", "sparse"), ("dense", "sparse"), ("any", "sparse"))


def _random_batch(seed: int, bs: int, width: int, groups: int, heads: int = 2, num_virtual: int = 40, device="cpu"):
    """A decode batch for the step tables: requests over ``groups`` prefixes, each cut at a random
    column (their own blocks after it, or the prefix's), lengths from 0 (padding) to the whole table;
    pages and virtual blocks mixed, index maps with 2:4 and dense rows per head."""
    gen, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    prefixes = [torch.randint(-num_virtual, 100, (width,), generator=gen, dtype=torch.int32) for _ in range(groups)]
    table, lens = torch.empty(bs, width, dtype=torch.int32), torch.empty(bs, dtype=torch.int32)
    for r in range(bs):
        row, cut = prefixes[rnd.randrange(groups)].clone(), rnd.randrange(1, width)
        if rnd.random() < 0.7:
            row[cut:] = torch.randint(200, 300, (width - cut,), generator=gen, dtype=torch.int32)
        table[r], lens[r] = row, rnd.randrange(0, width * 4 + 1) if rnd.random() < 0.9 else 0
    k_index = torch.randint(-3, 3, (heads, num_virtual), generator=gen, dtype=torch.int32)
    v_index = torch.where(torch.rand(heads, num_virtual, generator=gen) < 0.7, -1, 1).to(torch.int32)
    return [x.to(device) for x in (table, lens, k_index, v_index)]


def _fused_tables_match(device: str, cases_: list[tuple]) -> int:
    """Compare ``step_tables_fused`` with its PyTorch form (``step_tables_pytorch``: ``step_tables``,
    ``conforming_blocks``, ``split_limits``) entry for entry over ``cases_`` of ``(seed, bs, width,
    groups, fold, max_sets, forms, lone, min_own)``; returns how many requests were in column sets (the
    cases must form some)."""
    from sglang_hs.kernels.decode_shared import step_tables_pytorch
    from sglang_hs.kernels.decode_shared_tables import step_tables_fused

    grouped = 0
    for seed, bs, width, groups, fold, max_sets, forms, lone, min_own in cases_:
        table, lens, k_index, v_index = _random_batch(seed, bs, width, groups, device=device)
        by_sets = (torch.arange(max_sets + 1, dtype=torch.int32, device=device) % 5 + 1)
        args = (table, lens, 4, fold, max_sets)
        kw = dict(min_own_blocks=min_own, forms=forms, k_index=k_index, v_index=v_index, lone_min_blocks=lone,
                  splits_by_sets=by_sets, split_cap=3)
        want, got = step_tables_pytorch(*args, **kw), step_tables_fused(*args, **kw)
        for name in ("members", "shared_table", "shared_lens", "own_table", "own_lens", "pick", "shared_splits"):
            a, b = getattr(want, name), got[name]
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), (name, seed, bs, fold, forms)
        assert torch.equal(want.shared_splits > 0, want.shared_lens > 0)  # an empty set is skipped
        grouped += int((want.pick >= 0).sum())
    return grouped


def _table_cases(n: int, seed: int = 0) -> list[tuple]:
    rnd = random.Random(seed)
    out = [(0, 5, 7, 1, 4, 0, ANY_FORMS, None, 0)]  # no set row (a batch under MIN_SHARED_BATCH)
    for k in range(n):
        bs = rnd.choice((1, 5, 16, 33))
        out.append((k, bs, rnd.choice((7, 130)), rnd.choice((1, 3)), rnd.choice((4, 16)), max(1, bs // 2),
                    TABLE_FORMS[k % 4], rnd.choice((None, 2)), rnd.choice((0, 1))))
    return out


def test_fused_step_tables_in_tritons_interpreter():
    """CPU: the Triton step tables (run by Triton's interpreter in a fresh process) equal the PyTorch
    ones entry for entry: groups, lone requests, padding rows, every shared-pass form, split counts,
    and a call with no set row."""
    pytest.importorskip("triton")
    script = """
import sys
sys.path.insert(0, {tests!r})
import test_decode_shared as t
grouped = t._fused_tables_match("cpu", t._table_cases(40))
assert grouped > 50, grouped
print("ok", grouped)
""".format(tests=os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TRITON_INTERPRET": "1"})  # fmt: skip
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("q_heads, kv_heads, head_dim, dtype", [(hq, hkv, d, getattr(torch, dt)) for hq, hkv, d, dt in GPU_SHAPES],
                         ids=lambda v: str(v).split(".")[-1])  # fmt: skip
@pytest.mark.parametrize("splits", ["plan", "one"])
@pytest.mark.parametrize("forms", GPU_FORMS, ids=lambda f: "-".join(f))
def test_kernels_match_reference(q_heads, kv_heads, head_dim, dtype, splits, forms):
    """The shared pass at the plan's split counts and at one split a set, for every form the tests
    build (a restricted kernel on a case whose compressed blocks are of its forms)."""
    sk = 0.0 if forms[0] == "dense" else 1.0
    case = _case(q_heads, kv_heads, dtype, "cuda", head_dim=head_dim, sk=sk)
    bs = case["q"].shape[0]
    forced = 1 if splits == "one" else None
    plan = SharedPrefixDecode(bs, q_heads, kv_heads, head_dim, B, case["max_blocks"], dtype, "cuda",
                              shared_splits=forced, forms=forms)  # fmt: skip
    out = _run(plan, case)
    ref, _ = _reference(case)
    err = (out.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()
    assert float(err) < (1e-2 if dtype == torch.bfloat16 else 3e-3)



def test_a_dense_window_inside_the_shared_prefix_matches_reference_with_the_oracle_as_kernel():
    """CPU twin of the GPU test below: the packed shared and own tables cover every block once."""
    case = _case(32, 8, torch.float32, "cpu")
    table = case["block_table"]
    table[table[:, 0] == table[0, 0], 8] = table[0, 16]
    plan = SharedPrefixDecode(16, 32, 8, 64, B, case["max_blocks"], torch.float32, "cpu",
                              plans=(ReferencePlan(), ReferencePlan()), forms=("sparse", "sparse"))  # fmt: skip
    out = _run(plan, case)
    ref, _ = _reference(case)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4)


def _lone_run(device, dtype, head_dim, plans=None):
    """The case with lone requests made sets of one (``lone_min_blocks=1``): its groups' two sets
    first (8 requests a set), then request 4's (2 full blocks) and request 8's (1). Returns the
    output and the reference."""
    case = _case(32, 8, dtype, device, head_dim=head_dim)
    bs = case["q"].shape[0]
    plan = SharedPrefixDecode(bs, 32, 8, head_dim, B, case["max_blocks"], dtype, device, plans=plans)
    q, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale = cases.run_args(case)
    step = plan.plan_step(block_table, seq_lens, k_index, v_index, lone_min_blocks=1)
    assert step.members[:, 0].tolist() == [0, 1, 4, 8] and step.pick[8].item() == 3 * plan.fold
    assert step.shared_lens[2:].tolist() == [2 * B, B]
    out = plan.run(q, k_cache, v_cache, pools, k_index, v_index, step, sm_scale)
    return out, _reference(case)[0]


def test_lone_requests_as_sets_of_one_match_reference_with_the_oracle_as_kernel():
    out, ref = _lone_run("cpu", torch.float32, 64, plans=(ReferencePlan(), ReferencePlan()))
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4)


def test_a_lone_request_joins_only_a_batch_with_a_group():
    """A batch of requests each alone on its prefix keeps the per-request path (no sets): a set of one
    only pays off beside a shared pass that runs anyway."""
    table = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.int32)
    lens = torch.tensor([3 * B] * 3, dtype=torch.int32)
    assert (step_tables(table, lens, B, 4, max_sets=2, lone_min_blocks=1).members < 0).all()
    table[1] = table[0]
    step = step_tables(table, lens, B, 4, max_sets=2, lone_min_blocks=1)
    assert step.members.tolist() == [[0, 1, -1, -1], [2, -1, -1, -1]] and step.own_lens.tolist() == [0, 0, 0]
    step = step_tables(table, lens, B, 4, max_sets=2, lone_min_blocks=4)  # too short to join
    assert step.members[1].tolist() == [-1] * 4 and step.own_lens.tolist() == [0, 0, 3 * B]


@pytest.mark.gpu
def test_lone_requests_as_sets_of_one_match_reference_on_the_gpu():
    out, ref = _lone_run("cuda", torch.float16, 128)
    assert float((out.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()) < 3e-3


def _replayed(run) -> torch.Tensor:
    """``run()``'s output replayed from a CUDA graph that captured it (after a warm-up off the capture,
    as ``torch.cuda.graph`` asks; the output is zeroed before the replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run()
    replayed.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return replayed


def test_a_column_set_folds_32_columns_with_the_oracle_as_kernel():
    """The shared pass folds 32 // G requests a set (8 at G = 4): the case's group of 5 is one set;
    the output equals the reference."""
    case = _case(32, 8, torch.float32, "cpu")
    plan = SharedPrefixDecode(case["q"].shape[0], 32, 8, 64, B, case["max_blocks"], torch.float32, "cpu",
                              plans=(ReferencePlan(), ReferencePlan()))  # fmt: skip
    assert plan.fold == 8 and not plan.dynamic_splits
    step = plan.plan_step(*cases.run_args(case)[6:8], case["k_index"], case["v_index"])
    assert step.members[0, :5].tolist() == [0, 2, 3, 5, 7] and step.members[1, :2].tolist() == [1, 6]
    assert torch.allclose(_run(plan, case), _reference(case)[0], atol=2e-5, rtol=1e-4)


class ReferenceExtend:
    """Stands in for ``HieraSparseExtend`` (same ``run`` signature) with the oracle: causal attention of
    each request's queries at the last positions of its ``seq_lens`` tokens; a request whose
    ``split_limit`` is 0 is skipped, as the kernel skips it: its rows are NaN (never to be merged)."""

    def run(self, q, qo_indptr, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale, out=None,
            return_lse=False, split_limit=None):  # fmt: skip
        skipped = (split_limit == 0).tolist()
        self.skipped = skipped
        lens = [max(n, 1) for n in seq_lens.tolist()]  # the oracle's queries need a position
        o, lse = R.paged_attention(q, qo_indptr.tolist(), k_cache, v_cache, pools, k_index, v_index, block_table,
                                   lens, sm_scale)  # fmt: skip
        starts = qo_indptr.tolist()
        for r, skip in enumerate(skipped):
            if skip:
                o[starts[r] : starts[r + 1]] = float("nan")
                lse[starts[r] : starts[r + 1]] = float("nan")
        return (o, lse) if return_lse else o


def test_the_extend_shared_pass_maps_a_set_to_one_query_token_over_its_shared_blocks():
    """CPU: ``ExtendSharedPass`` hands the extend kernel one query token a set, at the last position of
    the set's shared tokens (so every shared key is visible), and skips empty sets (split limit 0);
    with the extend oracle in place of the kernel, shared-prefix decode equals the reference."""
    from sglang_hs.kernels.shared_pass_extend import ExtendSharedPass

    case = _case(32, 8, torch.float32, "cpu")
    bs = case["q"].shape[0]
    shared = ExtendSharedPass(bs // 2, 8 * 8 * 4, 8, 64, B, case["max_blocks"], torch.float16, "cpu")
    assert shared.extend.group == 32 and shared.extend.tile == "n32" and shared.indptr.tolist() == list(range(bs // 2 + 1))
    shared.extend = ReferenceExtend()
    plan = SharedPrefixDecode(bs, 32, 8, 64, B, case["max_blocks"], torch.float32, "cpu",
                              plans=(shared, ReferencePlan()))  # fmt: skip
    q, k_cache, v_cache, pools, k_index, v_index, table, lens, sm_scale = cases.run_args(case)
    for lone, empty_rows in ((None, 2), (1, 0)):  # lone requests in the own pass (two empty set rows), or sets
        step = plan.plan_step(table, lens, k_index, v_index, lone_min_blocks=lone)
        assert int((step.shared_lens == 0).sum()) == empty_rows
        out = plan.run(q, k_cache, v_cache, pools, k_index, v_index, step, sm_scale)
        assert sum(shared.extend.skipped) == empty_rows
        assert torch.allclose(out, _reference(case)[0], atol=2e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("sk, restricted", [(1.0, False), (1.0, True), (0.0, True)])
def test_an_extend_shared_pass_matches_reference_eager_and_in_a_cuda_graph(sk, restricted):
    """The extend kernel as the shared pass (G = 32 folded heads, one query token a set, fixed splits),
    with the own pass beside it, its stages holding every form or only the case's compressed forms
    (2:4 K and V; dense K and 2:4 V): the output equals the reference, and a CUDA graph's replay
    equals the eager call (its scratch is sized before the capture)."""
    case = _case(32, 8, torch.bfloat16, "cuda", head_dim=128, sk=sk)
    q, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale = cases.run_args(case)
    forms = compressed_forms((sk,), (1.0,)) if restricted else ANY_FORMS
    plan = SharedPrefixDecode(q.shape[0], 32, 8, 128, B, case["max_blocks"], torch.bfloat16, "cuda", forms=forms)
    assert plan.shared_plan.extend.forms == forms
    step = plan.plan_step(block_table, seq_lens, k_index, v_index, lone_min_blocks=1)
    run = lambda: plan.run(q, k_cache, v_cache, pools, k_index, v_index, step, sm_scale)  # noqa: E731
    eager = run().clone()
    ref, _ = _reference(case)
    assert float((eager.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()) < 1e-2
    assert torch.equal(_replayed(run), eager)


@pytest.mark.gpu
def test_fused_step_tables_match_on_the_gpu():
    """The Triton step tables, compiled for the GPU, equal the PyTorch ones (the same cases and more),
    also at a batch of 256 requests and a 600-block table, and replayed from a CUDA graph."""
    assert _fused_tables_match("cuda", _table_cases(200, seed=1)) > 300
    # 68 of the 256 requests form sets here (groups of 6 prefixes cut at random columns, lone ones kept out)
    assert _fused_tables_match("cuda", [(9, 256, 600, 6, 16, 128, ("sparse", "sparse"), 64, 1)]) > 32
    from sglang_hs.kernels.decode_shared_tables import step_tables_fused

    table, lens, k_index, v_index = _random_batch(3, 16, 130, 3, device="cuda")
    run = lambda: step_tables_fused(table, lens, 4, 16, 8, forms=("sparse", "sparse"), k_index=k_index,  # noqa: E731
                                    v_index=v_index, lone_min_blocks=2)["own_table"].clone()  # fmt: skip
    assert torch.equal(_replayed(run), run())


@pytest.mark.gpu
def test_the_own_pass_beside_the_shared_pass_matches_eager_and_in_a_cuda_graph():
    """``overlap``: the own pass on a side stream gives the output of the two passes in turn, bit for bit, eagerly and
    replayed from a CUDA graph (the side stream joins the capture), with lone requests as column sets;
    and it equals the reference."""
    case = _case(32, 8, torch.float16, "cuda", head_dim=128)
    q, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale = cases.run_args(case)
    outs = []
    for overlap in (False, True):
        plan = SharedPrefixDecode(q.shape[0], 32, 8, 128, B, case["max_blocks"], torch.float16, "cuda",
                                  overlap=overlap)  # fmt: skip
        assert (plan.own_stream is not None) == overlap
        step = plan.plan_step(block_table, seq_lens, k_index, v_index, lone_min_blocks=1)
        run = lambda: plan.run(q, k_cache, v_cache, pools, k_index, v_index, step, sm_scale)  # noqa: E731
        eager = run().clone()
        assert torch.equal(_replayed(run), eager)
        outs.append(eager)
    assert torch.equal(outs[0], outs[1])
    ref, _ = _reference(case)
    assert float((outs[1].float().cpu() - ref.float()).abs().max() / ref.float().abs().max()) < 3e-3


@pytest.mark.gpu
def test_a_dense_window_inside_the_shared_prefix_matches_reference_on_the_gpu():
    """A prefix cached in chunks keeps a dense window after each chunk: with one inside source 0's
    compressed run, the restricted shared pass takes the compressed blocks on both sides of it and the
    own pass the window, and the output still equals the reference over the whole tables."""
    case = _case(32, 8, torch.float16, "cuda", head_dim=128)
    table = case["block_table"]
    group = table[:, 0] == table[0, 0]
    table[group, 8] = table[0, 16]  # a dense window page (source 0: sink, 15 compressed blocks, 4 window pages)
    plan = SharedPrefixDecode(16, 32, 8, 128, B, case["max_blocks"], torch.float16, "cuda", forms=("sparse", "sparse"))
    q, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale = cases.run_args(case)
    step = plan.plan_step(block_table, seq_lens, k_index, v_index)
    assert step.shared_lens[0].item() == 14 * B  # 15 compressed blocks, one replaced by the window page
    out = plan.run(q, k_cache, v_cache, pools, k_index, v_index, step, sm_scale)
    ref, _ = _reference(case)
    assert float((out.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()) < 3e-3


def test_split_limits_follow_the_sets_with_blocks_to_share():
    """CPU: every set of a step that has blocks to share gets the split count of the number of such sets
    (a gather on the device), at most the launch's grid; an empty set gets 0 (the shared pass skips it)."""
    from sglang_hs.kernels.decode_shared import split_limits

    by_sets = torch.tensor([1, 16, 16, 16, 16, 13, 11, 9, 8], dtype=torch.int32)
    lens = torch.tensor([512, 512, 0, 320, 0, 0, 0, 0], dtype=torch.int32) * B
    assert split_limits(lens, by_sets, 16).tolist() == [16, 16, 0, 16, 0, 0, 0, 0]  # 3 sets with blocks
    assert split_limits(lens, by_sets, 12).tolist() == [12, 12, 0, 12, 0, 0, 0, 0]  # the grid holds 12
    lens[4:] = B  # 7 sets with blocks
    assert split_limits(lens, by_sets, 16).tolist() == [9, 9, 0, 9, 9, 9, 9, 9]
    assert split_limits(lens, by_sets, 16).dtype == torch.int32


def test_the_shared_pass_plans_splits_for_the_sets_a_step_has(monkeypatch):
    """CPU (kernels stubbed): the shared pass's grid holds 8 splits per set row and its table of split
    counts by live sets keeps them in one wave of two CTAs an SM (SPLIT_WAVE_CTAS, though three fit),
    at most 8: at the regime-1 server's shape on 132 SMs, 8 splits for up to 4 sets, 6 at 5, 5 at 6, 2
    at 16 (measured on an H100: 5 and 6 sets 8-12 us faster at 5-6 splits than at 8; 3 sets fastest at
    8, against up to 60 us slower at 11 and 16)."""
    from types import SimpleNamespace

    from sglang_hs.kernels import decode

    monkeypatch.setattr(decode, "build_decode_kernel", lambda *a, **kw: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    plan = SharedPrefixDecode(32, 32, 8, 128, B, 529, torch.bfloat16, "cpu", forms=("sparse", "sparse"))
    by_sets = plan.splits_by_sets.tolist()
    assert len(by_sets) == plan.max_sets + 1 == 17 and by_sets[:5] == [8] * 5  # (0 sets: never launched)
    assert by_sets[5:9] == [6, 5, 4, 4] and by_sets[16] == 2
    assert plan.shared_plan.num_splits == 8


@pytest.mark.gpu
def test_small_calls_match_reference_on_the_gpu():
    """A call of fewer than MIN_SHARED_BATCH requests runs the per-request kernel over the whole tables."""
    case = _case(32, 8, torch.float16, "cuda", head_dim=128)
    small = {**case, "q": case["q"][:4], "block_table": case["block_table"][:4], "seq_lens": case["seq_lens"][:4],
             "seq_lens_list": case["seq_lens_list"][:4]}
    plan = SharedPrefixDecode(16, 32, 8, 128, B, case["max_blocks"], torch.float16, "cuda", forms=("sparse", "sparse"))
    q, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale = cases.run_args(small)
    out = plan.run(q, k_cache, v_cache, pools, k_index, v_index, plan.plan_step(block_table, seq_lens, k_index,
                                                                                 v_index), sm_scale)  # fmt: skip
    ref, _ = _reference(small)
    assert float((out.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()) < 3e-3


def test_the_own_pass_plans_splits_for_the_whole_batch_with_a_floor_of_blocks(monkeypatch):
    """CPU (kernels stubbed): the own pass's split count is the per-request rule's for every request of
    the call (requests alone on a long prefix are sets of one, so the own pass holds tails; planning for
    ceil(bs / 4) was 7-10 us a layer slower, docs/kernels.md), and its kernel keeps a floor of
    OWN_MIN_SPLIT_BLOCKS blocks a split where the per-request plan keeps 1."""
    from types import SimpleNamespace

    from sglang_hs.kernels import decode
    from sglang_hs.kernels.decode import STAGES, plan_num_splits
    from sglang_hs.kernels.decode_shared import OWN_MIN_SPLIT_BLOCKS

    floors = []
    monkeypatch.setattr(decode, "build_decode_kernel", lambda *a, **kw: floors.append(kw["min_split_blocks"]))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    plan = SharedPrefixDecode(32, 32, 8, 128, B, 529, torch.float16, "cpu")
    assert plan.fold == 8 and sorted(floors) == [1, OWN_MIN_SPLIT_BLOCKS]

    def rule(batch):
        return plan_num_splits(batch, 32, 8, 128, B, 529, STAGES, 132, 512)

    for bs in (8, 16, 17, 32):
        assert plan.own_plan.splits(bs, 529) == plan.per_request_plan.splits(bs, 529) == rule(bs)
    assert rule(16) < rule(4)  # the old ceil(bs / 4) plan gave more splits


PROFILE_MODES = ["--server-shape", "--batches", "--short", "--chunked", "--splits", "--ncu"]


@pytest.mark.gpu
@pytest.mark.parametrize("argv", [[]] + [[mode] for mode in PROFILE_MODES],
                         ids=["bench-shape"] + [mode[2:] for mode in PROFILE_MODES])
def test_profile_script_runs(argv, capsys):
    """``lab/profile_shared_decode.py`` (the breakdown quoted in docs/results.md) runs and times every
    part it names."""
    import profile_shared_decode

    profile_shared_decode.main(argv)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.endswith(" us")]
    assert len(lines) >= 5 and all(float(line.rsplit(": ", 1)[1][:-3]) > 0 for line in lines)
