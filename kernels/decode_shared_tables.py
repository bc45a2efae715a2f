"""Shared-prefix decode's step tables in four Triton launches (:func:`step_tables_fused`).

:func:`.decode_shared.step_tables` (PyTorch) groups a decode batch in about 110 small kernels: at the
benchmark's shape on an H200 they took 267.7 us a decode step under a CUDA graph
(``lab/profile_shared_decode.py``), 2% of a regime-1 step. Here the same tables come from
two passes of a CTA per request (its group's leader and common blocks, then the blocks it would
give the shared pass), one CTA for the column sets, and a CTA per output row for the stable
compactions into the shared and own tables: four launches and four fills. The PyTorch form
(:func:`.decode_shared.step_tables_pytorch`) stays: it runs off the GPU, and it is the oracle of the
tests (Triton's interpreter runs these kernels on the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_hs.kernels.common import ANY_FORMS

FORM_CODES = {"any": 0, "sparse": 1, "dense": 2}
"""A shared pass's operand form as the kernels take it (``conforming_blocks``' rule per code)."""
ROW_CHUNK = 128
"""Block-table columns a loop step reads."""
MIN_ROWS = 64
"""The kernels' row bound (``BS``, a power of two) is at least this: batches up to 64 requests (every
CUDA-graph batch of a default server) share one compile of each kernel."""


@triton.jit
def _form_ok(entries, index_ptr, index_s0, index_s1, num_virtual, mask, HEADS: tl.constexpr, FORM: tl.constexpr):
    # conforming_blocks for one operand: a cache page (entry >= 0) is dense; a virtual block's form per KV
    # head is the sign of its index-map entry (< 0: a 2:4 row). FORM 1 (sparse): a virtual block 2:4 in
    # every head; 2 (dense): a page, or a virtual block dense in every head; 0: any entry.
    virtual = entries < 0
    if FORM == 0:
        ok = entries == entries
    else:
        stored = virtual & (num_virtual > 0)
        vb = tl.minimum(tl.maximum(-entries - 1, 0), tl.maximum(num_virtual - 1, 0))
        all_sparse = stored
        all_dense = stored
        for h in tl.static_range(HEADS):
            row = tl.load(index_ptr + h * index_s0 + vb * index_s1, mask=mask & stored, other=0)
            all_sparse = all_sparse & (row < 0)
            all_dense = all_dense & (row >= 0)
        if FORM == 1:
            ok = all_sparse
        else:
            ok = (entries >= 0) | all_dense
    return ok


@triton.jit
def _conforming(entries, mask, k_ptr, k_s0, k_s1, v_ptr, v_s0, v_s1, num_virtual, HEADS: tl.constexpr,
                K_FORM: tl.constexpr, V_FORM: tl.constexpr):
    k_ok = _form_ok(entries, k_ptr, k_s0, k_s1, num_virtual, mask, HEADS, K_FORM)
    v_ok = _form_ok(entries, v_ptr, v_s0, v_s1, num_virtual, mask, HEADS, V_FORM)
    return k_ok & v_ok


_RUNTIME_INTS = ["table_s0", "num_virtual", "k_s0", "k_s1", "v_s0", "v_s1", "bs", "width", "block_size", "fold",
                 "max_sets", "min_shared", "min_own", "lone_min", "split_cap"]
"""Integer arguments Triton must not specialise on (a value of 1 or a multiple of 16 would compile
another variant): one compile per kernel and row bound serves every batch."""


def _jit(fn):
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return triton.jit(fn, do_not_specialize=[name for name in _RUNTIME_INTS if name in names])


@_jit
def _row_kernel(table_ptr, table_s0, lens_ptr, k_ptr, k_s0, k_s1, v_ptr, v_s0, v_s1, num_virtual, bs, width,
                block_size, min_shared, min_own, scratch_ptr, PHASE: tl.constexpr, BS: tl.constexpr,
                BW: tl.constexpr, HEADS: tl.constexpr, K_FORM: tl.constexpr, V_FORM: tl.constexpr):
    # One CTA a request r. scratch rows (int32, BS each): 0 leader, 1 leading run equal to the leader's
    # row within r's limit, 2 common, 3 eligible (written by _set_kernel), 4 blocks r would give the
    # shared pass. PHASE 0 writes rows 0 and 1; PHASE 1 (after every row's run is known) rows 2 and 4.
    r = tl.program_id(0)
    i = tl.arange(0, BS)
    live = i < bs
    if PHASE == 0:
        lens = tl.load(lens_ptr + i, mask=live, other=0)
        first = tl.load(table_ptr + i * table_s0, mask=live, other=0)
        valid = (tl.maximum(lens // block_size - min_own, 0) >= tl.maximum(min_shared, 1)) & live
        mine = tl.sum(tl.where(i == r, first, 0), axis=0)
        valid_r = tl.sum(tl.where((i == r) & valid, 1, 0), axis=0) > 0
        lead = tl.where(valid_r, tl.min(tl.where(valid & (first == mine), i, BS), axis=0), r)
        lim = tl.maximum(tl.load(lens_ptr + r) // block_size - min_own, 0)
        run = width
        for c0 in range(0, width, BW):
            c = c0 + tl.arange(0, BW)
            inside = c < width
            a = tl.load(table_ptr + r * table_s0 + c, mask=inside, other=0)
            b = tl.load(table_ptr + lead * table_s0 + c, mask=inside, other=0)
            run = tl.minimum(run, tl.min(tl.where(((a != b) | (c >= lim)) & inside, c, width), axis=0))
        tl.store(scratch_ptr + r, lead)
        tl.store(scratch_ptr + BS + r, run)
    else:
        leader = tl.load(scratch_ptr + i, mask=live, other=-1)
        runs = tl.load(scratch_ptr + BS + i, mask=live, other=0)
        lead = tl.load(scratch_ptr + r)
        com = tl.min(tl.where((leader == lead) & live, runs, width), axis=0)  # the group's common blocks
        taken = 0
        for c0 in range(0, com, BW):
            c = c0 + tl.arange(0, BW)
            inside = c < com
            e = tl.load(table_ptr + r * table_s0 + c, mask=inside, other=0)
            ok = _conforming(e, inside, k_ptr, k_s0, k_s1, v_ptr, v_s0, v_s1, num_virtual, HEADS, K_FORM, V_FORM)
            taken += tl.sum(tl.where(ok & inside, 1, 0), axis=0)
        tl.store(scratch_ptr + 2 * BS + r, com)
        tl.store(scratch_ptr + 4 * BS + r, taken)


@_jit
def _set_kernel(table_ptr, table_s0, lens_ptr, by_sets_ptr, bs, block_size, fold, max_sets, min_shared, min_own,
                lone_min, split_cap, scratch_ptr, members_ptr, shared_lens_ptr, own_lens_ptr, pick_ptr, splits_ptr,
                BS: tl.constexpr, MS: tl.constexpr, LONE: tl.constexpr, SPLITS: tl.constexpr):
    # One CTA: the batch's column sets from every request's leader and shared blocks (step_tables' rules).
    i = tl.arange(0, BS)
    j = tl.arange(0, BS)
    live = i < bs
    lens = tl.load(lens_ptr + i, mask=live, other=0)
    first = tl.load(table_ptr + i * table_s0, mask=live, other=0)
    min_take = tl.maximum(min_shared, 1)
    valid = (tl.maximum(lens // block_size - min_own, 0) >= min_take) & live
    same = (first[:, None] == first[None, :]) & valid[:, None] & valid[None, :]
    leader = tl.load(scratch_ptr + i, mask=live, other=-1)
    shared = tl.load(scratch_ptr + 4 * BS + i, mask=live, other=0)
    size = tl.sum(tl.where((leader[:, None] == leader[None, :]) & valid[None, :], 1, 0), axis=1)
    position = tl.sum(tl.where(same & (j[None, :] < i[:, None]), 1, 0), axis=1)
    chunk = position // fold
    slot = position % fold
    group_ok = valid & (size >= 2) & (shared >= min_take) & (fold >= 2)
    per_leader = tl.where((leader == i) & group_ok, (size + fold - 1) // fold, 0)
    before = tl.cumsum(per_leader, axis=0) - per_leader
    set_id = tl.sum(tl.where(j[None, :] == leader[:, None], before[None, :], 0), axis=1) + chunk
    if LONE:  # a request alone on its prefix: a set of its own after the groups' (when the batch has one)
        has_group = tl.max(tl.where(group_ok, 1, 0), axis=0) > 0
        lone = valid & (size == 1) & (shared >= tl.maximum(lone_min, min_take)) & has_group
        set_id = tl.where(lone, tl.sum(per_leader, axis=0) + tl.cumsum(tl.where(lone, 1, 0), axis=0) - 1, set_id)
        group_ok = group_ok | lone
    eligible = group_ok & (set_id < max_sets) & live
    flat = set_id * fold + slot
    tl.store(scratch_ptr + 3 * BS + i, tl.where(eligible, 1, 0), mask=live)
    tl.store(members_ptr + flat, i.to(tl.int64), mask=eligible)
    tl.store(shared_lens_ptr + set_id, shared * block_size, mask=eligible & (slot == 0))
    tl.store(own_lens_ptr + i, lens - tl.where(eligible, shared, 0) * block_size, mask=live)
    tl.store(pick_ptr + i, tl.where(eligible, flat, -1), mask=live)
    s = tl.arange(0, MS)
    first_of_set = eligible & (slot == 0)  # the request that wrote its set's shared_lens
    live_set = tl.sum(tl.where(first_of_set[None, :] & (set_id[None, :] == s[:, None]), 1, 0), axis=1) > 0
    if SPLITS:  # every set's split count: the rule's for the sets that have blocks to share, 0 for the others
        real = tl.sum(tl.where(first_of_set, 1, 0), axis=0)
        splits = tl.minimum(tl.load(by_sets_ptr + real), split_cap)
    else:
        splits = 1
    tl.store(splits_ptr + s, tl.where(live_set, splits, 0).to(tl.int32), mask=s < max_sets)


@_jit
def _pack_kernel(table_ptr, table_s0, k_ptr, k_s0, k_s1, v_ptr, v_s0, v_s1, num_virtual, bs, width, fold,
                 scratch_ptr, members_ptr, own_table_ptr, shared_table_ptr,
                 BS: tl.constexpr, BW: tl.constexpr, HEADS: tl.constexpr, K_FORM: tl.constexpr,
                 V_FORM: tl.constexpr):
    # Program p < bs: request p's own table (its entries the shared pass does not take, in order);
    # p >= bs: set p - bs's shared table (the entries its first member gives the shared pass; an empty
    # set's first member is -1: request 0's, as the PyTorch form does). Outputs start zeroed.
    p = tl.program_id(0)
    own = p < bs
    first_member = tl.load(members_ptr + (p - bs) * fold, mask=p >= bs, other=0).to(tl.int32)
    row = tl.where(own, p, tl.maximum(first_member, 0))
    com = tl.where(tl.load(scratch_ptr + 3 * BS + row) != 0, tl.load(scratch_ptr + 2 * BS + row), 0)
    written = 0
    for c0 in range(0, width, BW):
        c = c0 + tl.arange(0, BW)
        inside = c < width
        e = tl.load(table_ptr + row * table_s0 + c, mask=inside, other=0)
        take = (c < com) & _conforming(e, inside & (c < com), k_ptr, k_s0, k_s1, v_ptr, v_s0, v_s1, num_virtual,
                                       HEADS, K_FORM, V_FORM)
        keep = tl.where(own, ~take, take) & inside
        flags = tl.where(keep, 1, 0)
        slots = written + tl.cumsum(flags, axis=0) - 1
        tl.store(own_table_ptr + p * width + slots, e, mask=keep & own)
        tl.store(shared_table_ptr + (p - bs) * width + slots, e, mask=keep & (p >= bs))
        written += tl.sum(flags, axis=0)


def step_tables_fused(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, fold: int, max_sets: int,
                      min_shared_blocks: int = 1, min_own_blocks: int = 0, forms: tuple[str, str] = ANY_FORMS,
                      k_index: torch.Tensor | None = None, v_index: torch.Tensor | None = None,
                      lone_min_blocks: int | None = None, splits_by_sets: torch.Tensor | None = None,
                      split_cap: int = 1) -> dict[str, torch.Tensor]:  # fmt: skip
    """:func:`.decode_shared.step_tables_pytorch` (:func:`.decode_shared.step_tables` over the blocks of
    ``forms``, with :func:`.decode_shared.split_limits` given ``splits_by_sets``) in four Triton
    launches: the fields of the same :class:`.decode_shared.StepTables`, entry for entry (a dict: this
    module does not import ``decode_shared``, which imports it). ``k_index`` and ``v_index`` (``[Hkv,
    n_virtual]``) are needed unless ``forms`` is every form."""
    bs, width = block_table.shape
    device = block_table.device
    codes = tuple(FORM_CODES[form] for form in forms)
    if any(codes) and (k_index is None or v_index is None):
        raise ValueError(f"step tables for forms {tuple(forms)} need the index maps")
    if k_index is None:
        k_index = v_index = torch.zeros(1, 0, dtype=torch.int32, device=device)
    heads, num_virtual = k_index.shape
    block_table = block_table.contiguous()
    int32 = dict(dtype=torch.int32, device=device)
    BS = max(MIN_ROWS, triton.next_power_of_2(bs))
    rows = max(max_sets, 1)  # a call with no set row still passes the kernels non-empty buffers
    scratch = torch.empty(5 * BS, **int32)  # the five rows _row_kernel names
    members = torch.full((rows * fold,), -1, dtype=torch.long, device=device)
    shared_lens = torch.zeros(rows, **int32)
    own_lens, pick = torch.empty(bs, **int32), torch.empty(bs, **int32)
    shared_splits = torch.empty(rows, **int32)
    own_table = torch.zeros(bs, width, dtype=block_table.dtype, device=device)
    shared_table = torch.zeros(rows, width, dtype=block_table.dtype, device=device)
    maps = (k_index, k_index.stride(0), k_index.stride(1), v_index, v_index.stride(0), v_index.stride(1), num_virtual)
    by_sets = splits_by_sets if splits_by_sets is not None else shared_splits
    common = (block_table, block_table.stride(0), seq_lens, *maps, bs, width, block_size, min_shared_blocks,
              min_own_blocks, scratch)
    for phase in (0, 1):
        _row_kernel[(bs,)](*common, PHASE=phase, BS=BS, BW=ROW_CHUNK, HEADS=heads, K_FORM=codes[0], V_FORM=codes[1])
    _set_kernel[(1,)](block_table, block_table.stride(0), seq_lens, by_sets, bs, block_size, fold, max_sets,
                      min_shared_blocks, min_own_blocks, lone_min_blocks or 0, split_cap, scratch, members, shared_lens,
                      own_lens, pick, shared_splits, BS=BS, MS=max(BS, triton.next_power_of_2(max_sets)),
                      LONE=lone_min_blocks is not None, SPLITS=splits_by_sets is not None)  # fmt: skip
    _pack_kernel[(bs + rows,)](block_table, block_table.stride(0), *maps, bs, width, fold, scratch, members,
                                   own_table, shared_table, BS=BS, BW=ROW_CHUNK, HEADS=heads, K_FORM=codes[0],
                                   V_FORM=codes[1])  # fmt: skip
    return dict(members=members.view(rows, fold)[:max_sets], shared_table=shared_table[:max_sets],
                shared_lens=shared_lens[:max_sets], own_table=own_table, own_lens=own_lens, pick=pick,
                shared_splits=shared_splits[:max_sets])
