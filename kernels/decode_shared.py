"""Shared-prefix (cascade) decode: a prefix shared by several requests of one decode batch is read once
for all of them.

A decode batch in shared-prefix serving holds many requests whose block tables start with the same
blocks (the radix tree hands every request of a document, few-shot bank or system prompt the same
cache pages and compressed virtual blocks). The split-KV decode kernel (:mod:`.decode`) walks each
request's blocks on its own, so a prefix shared by ``m`` requests is read, and stepped through, ``m``
times; FlashInfer then serves the repeats from L2 and wins (``docs/results.md``). Here the batch is
split in two passes over disjoint KV, merged by log-sum-exp:

* **Shared pass.** The requests of a prefix group are folded into the query-head axis: the decode
  kernel serves the ``G = Hq / Hkv`` query heads of one KV head as the GEMM's N columns (padded to 8,
  or 16), so ``fold = 16 // G`` requests' queries fit one CTA. A *column set* of up to ``fold``
  members is one request of a decode kernel compiled for ``Hkv * fold * G`` query heads, with the
  group's shared blocks as its block table: each shared block is loaded and stepped once per set, not
  once per request.
* **Own pass.** Every request then attends to the blocks after its group's shared ones (its question,
  its generated tokens) with the model's own decode kernel; a request without a group reads all of
  its blocks here.
* **Merge.** ``out = (e^(lse_s) o_s + e^(lse_o) o_o) / (e^(lse_s) + e^(lse_o))`` per query head (an
  empty pass has LSE ``-inf`` and weight 0).

Grouping is host work (:func:`find_shared_prefixes`): requests whose first block entries are equal
share a radix-tree path; the shared part is the run of leading block-table columns equal for all of
them, full blocks only. The passes take fixed shapes for a given batch size (``max_sets`` column sets,
padded with empty sets), so the run is CUDA-graph capturable once the grouping tensors are static
buffers updated before replay. ``sglang_hs.reference.paged_attention`` over each request's whole
block table is the oracle (``tests/test_decode_shared.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_hs.format import BlockPools

FOLD_COLUMNS = 16
"""The widest N the decode kernel takes (query heads of one KV head, padded): a column set holds
``FOLD_COLUMNS // G`` requests."""


def fold_of(q_heads: int, kv_heads: int) -> int:
    """Requests per column set for a model's GQA group (1 when the group fills the N columns)."""
    return max(1, FOLD_COLUMNS // (q_heads // kv_heads))


GPU_SHAPES = [(32, 8, 128, "float16"), (16, 2, 128, "bfloat16"), (8, 2, 64, "float16")]
"""The model shapes (q_heads, kv_heads, head_dim, dtype) of the GPU tests; their own-pass kernels are
:data:`sglang_hs.kernels.decode.PRECOMPILE` entries, their shared-pass kernels (``Hkv * 16`` query
heads) are compiled by ``python -m sglang_hs.kernels.decode_shared [--jobs N]``."""


def shared_kernel_shape(q_heads: int, kv_heads: int) -> tuple[int, int]:
    """(query heads, KV heads) of the shared pass's decode kernel for a model shape."""
    return kv_heads * fold_of(q_heads, kv_heads) * (q_heads // kv_heads), kv_heads


@dataclass(frozen=True)
class PrefixGroups:
    """One decode batch's grouping (host lists, as :func:`find_shared_prefixes` returns them).

    ``sets``: per column set, its member requests (1 to ``fold``); ``shared_blocks``: per set, the
    blocks its members share; ``own_start``: per request, the first block of its own pass (0 for a
    request in no set)."""

    sets: list[list[int]]
    shared_blocks: list[int]
    own_start: list[int]

    @property
    def any_shared(self) -> bool:
        return bool(self.sets)

    def tensors(self, fold: int, max_sets: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """GPU tensors of fixed shapes: ``members [max_sets, fold]`` int64 (``-1`` pads), ``shared_blocks
        [max_sets]`` int32 (0 for padding sets), ``own_start [bs]`` int32."""
        if len(self.sets) > max_sets:
            raise ValueError(f"{len(self.sets)} column sets > max_sets {max_sets}")
        members = torch.full((max_sets, fold), -1, dtype=torch.int64)
        shared = torch.zeros(max_sets, dtype=torch.int32)
        for i, (group, blocks) in enumerate(zip(self.sets, self.shared_blocks)):
            members[i, : len(group)] = torch.tensor(group)
            shared[i] = blocks
        own = torch.tensor(self.own_start, dtype=torch.int32)
        return members.to(device), shared.to(device), own.to(device)


def find_shared_prefixes(block_table: torch.Tensor, seq_lens: list[int], block_size: int, fold: int,
                         min_shared_blocks: int = 1, min_own_blocks: int = 0) -> PrefixGroups:  # fmt: skip
    """Group the requests of ``block_table [bs, W]`` (host int32) that share leading blocks.

    Requests with the same first entry form a group; its shared blocks are the leading columns equal
    in every member, at most each member's full blocks (``seq_len // block_size``) minus
    ``min_own_blocks`` (the benchmark uses 1 so that every request keeps a block of its own, as a
    request's question and generated tokens would be). Groups of one, or sharing fewer than
    ``min_shared_blocks`` blocks, stay out; larger groups are cut into column sets of ``fold``
    members, in batch order."""
    table = block_table.cpu()
    if fold < 2:  # the GQA group fills the kernel's columns: nothing to fold
        return PrefixGroups([], [], [0] * table.shape[0])
    by_first: dict[int, list[int]] = {}
    for r in range(table.shape[0]):
        if seq_lens[r] > 0:
            by_first.setdefault(int(table[r, 0]), []).append(r)
    sets, shared_blocks, own_start = [], [], [0] * table.shape[0]
    for members in by_first.values():
        if len(members) < 2:
            continue
        rows = table[members]
        limit = min(seq_lens[r] // block_size for r in members) - min_own_blocks
        equal = (rows == rows[0]).all(0)[: max(limit, 0)]
        shared = int(equal.long().cumprod(0).sum())  # leading columns equal in every member
        if shared < min_shared_blocks:
            continue
        for start in range(0, len(members), fold):
            chunk = members[start : start + fold]
            if len(chunk) < 2:  # a lone remainder reads its prefix in its own pass
                continue
            sets.append(chunk)
            shared_blocks.append(shared)
            for r in chunk:
                own_start[r] = shared
    return PrefixGroups(sets, shared_blocks, own_start)


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """``[bs, Hq, D]`` attention over the union of two disjoint KV sets from each set's output and
    natural-log LSE ``[bs, Hq]`` (``-inf``: an empty set, weight 0). In ``out_a``'s dtype."""
    top = torch.maximum(lse_a, lse_b).clamp(min=torch.finfo(torch.float32).min)  # both -inf: weights 0
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = (wa + wb).clamp(min=torch.finfo(torch.float32).tiny)
    out = out_a.float() * (wa / total)[..., None] + out_b.float() * (wb / total)[..., None]
    return out.to(out_a.dtype)


class SharedPrefixDecode:
    """Plan + run of shared-prefix decode (module docstring): two :class:`.decode.HieraSparseDecode`
    plans, the *shared* one for ``Hkv * fold * G`` query heads over ``max_sets`` column sets and the
    *own* one of the model's shape over ``batch_size`` requests, plus the fold, gather and merge.

    ``plans`` (tests): a ``(shared, own)`` pair of objects with ``HieraSparseDecode.run``'s signature
    (``return_lse`` included) to use instead of building the kernels."""

    def __init__(self, batch_size: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
                 max_blocks: int, dtype: torch.dtype, device, max_sets: int | None = None, plans=None):  # fmt: skip
        self.q_heads, self.kv_heads, self.head_dim, self.block_size = q_heads, kv_heads, head_dim, block_size
        self.group = q_heads // kv_heads
        self.fold = fold_of(q_heads, kv_heads)
        self.max_sets = max_sets or max(1, batch_size // 2)
        if plans is None:
            from sglang_hs.kernels.decode import STAGES, HieraSparseDecode, fitting_split_capacity

            shared_heads, _ = shared_kernel_shape(q_heads, kv_heads)
            capacity = fitting_split_capacity(shared_heads, kv_heads, head_dim, block_size, STAGES)
            plans = (HieraSparseDecode(self.max_sets, shared_heads, kv_heads, head_dim, block_size, max_blocks, dtype,
                                       device, split_capacity=capacity),
                     HieraSparseDecode(batch_size, q_heads, kv_heads, head_dim, block_size, max_blocks, dtype, device))  # fmt: skip
        self.shared_plan, self.own_plan = plans

    def groups(self, block_table: torch.Tensor, seq_lens: list[int], **kw) -> PrefixGroups:
        """:func:`find_shared_prefixes` with this plan's fold."""
        return find_shared_prefixes(block_table, seq_lens, self.block_size, self.fold, **kw)

    def fold_queries(self, q: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
        """``q [bs, Hq, D]`` -> ``[max_sets, Hkv * fold * G, D]``: column set ``s``'s KV head ``h`` holds
        the G query heads of ``h`` of each member in turn (padding members read request 0)."""
        sets, fold = members.shape
        folded = q[members.clamp(min=0)].view(sets, fold, self.kv_heads, self.group, self.head_dim)
        return folded.transpose(1, 2).reshape(sets, self.kv_heads * fold * self.group, self.head_dim)

    def unfold(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`fold_queries`' head layout for ``[sets, Hkv*fold*G, ...]`` -> ``[sets*fold, Hq, ...]``."""
        sets, tail = x.shape[0], x.shape[2:]
        x = x.view(sets, self.kv_heads, self.fold, self.group, *tail).transpose(1, 2)
        return x.reshape(sets * self.fold, self.q_heads, *tail)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pools: BlockPools,
            k_index: torch.Tensor, v_index: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
            sm_scale: float, grouping: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """Decode attention of one layer, ``[bs, Hq, D]``. Arguments as ``HieraSparseDecode.run``, plus
        ``grouping = PrefixGroups.tensors(fold, max_sets, device)``; no host synchronisation."""
        members, shared_blocks, own_start = grouping
        bs, width = block_table.shape
        kv = (k_cache, v_cache, pools, k_index, v_index)
        # Shared pass: one request per column set over its leader's first shared_blocks blocks.
        leader = members[:, 0].clamp(min=0)
        shared_table = block_table[leader].contiguous()
        shared_lens = shared_blocks * self.block_size
        out_s, lse_s = self.shared_plan.run(self.fold_queries(q, members), *kv, shared_table, shared_lens, sm_scale,
                                            return_lse=True)  # fmt: skip
        # Back to requests: rows of padding members land in a spare row that is dropped.
        slot = torch.where(members >= 0, members, bs).flatten()
        out_shared = q.new_zeros(bs + 1, self.q_heads, self.head_dim).index_copy_(0, slot, self.unfold(out_s))
        lse_shared = torch.full((bs + 1, self.q_heads), -torch.inf, device=q.device).index_copy_(
            0, slot, self.unfold(lse_s[..., None])[..., 0])
        # Own pass: each request's blocks from own_start on.
        columns = (torch.arange(width, device=q.device)[None, :] + own_start[:, None].long()).clamp(max=width - 1)
        own_table = block_table.gather(1, columns).contiguous()
        own_lens = seq_lens - own_start * self.block_size
        out_o, lse_o = self.own_plan.run(q, *kv, own_table, own_lens, sm_scale, return_lse=True)
        return merge_states(out_o, lse_o, out_shared[:bs], lse_shared[:bs])


def _precompile_one(cfg):
    from sglang_hs.kernels.decode import STAGES, build_decode_kernel, fitting_split_capacity

    hq, hkv, d, dt = cfg
    shape = shared_kernel_shape(hq, hkv)
    build_decode_kernel(*shape, d, 64, dt, STAGES, split_capacity=fitting_split_capacity(*shape, d, 64, STAGES))
    return cfg


if __name__ == "__main__":
    from sglang_hs.kernels.common import precompile_main

    precompile_main("compile the shared-pass decode kernels of the GPU tests", _precompile_one, GPU_SHAPES)
