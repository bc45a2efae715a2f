"""Block copies between two compressed stores of one shape: the GPU store and a host-tier store.

A virtual block's K sits in one slot of one K pool (dense, or 2:4 values + metadata) and its V in one
slot of one V pool, the same slot in every layer; per layer and pool tensor the slot's rows are
consecutive (``H`` of them from ``slot·H``; with a K head map a sparse-K slot's rows per layer are its
mapped heads in the 2:4 tensors and the others in the tail of ``k_dense``:
``CompressedStore.slot_rows``). A block therefore moves as one *item* of its rows per pool tensor and
layer, from its slot in one store to a slot of the same kind in the other: a 2:4 block
stays 2:4 and its metadata travels with it, so the rows arrive bit-identical and nothing is
decompressed or recompressed.

On a GPU the items move with SGLang's own HiCache copy kernels (``sgl_kernel.kvcacheio``, the MLA
variants: one buffer, ``item_size`` bytes at ``base + index·item_size``), which read and write pinned
host memory directly; elsewhere (the CPU tests) with ``torch`` indexing. Both follow the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_hs.pools import CompressedStore

POOLS = ("k_dense", "k_sparse", "v_dense", "v_sparse")
"""The store's pools, as ``free_counts`` names them; ``CompressedStore.slot_rows`` says which rows of
which tensors a slot of each owns."""


@dataclass
class BlockCopy:
    """Slots to copy per pool: ``slots[pool] = (source slots, destination slots)``, int64 tensors on
    the device that runs the copy (the GPU when either store is on one)."""

    slots: dict[str, tuple[torch.Tensor, torch.Tensor]]
    blocks: int

    @classmethod
    def merge(cls, copies: Sequence["BlockCopy"]) -> "BlockCopy | None":
        """One copy doing the work of ``copies`` (SGLang merges the queued loads into one transfer)."""
        if not copies:
            return None
        if len(copies) == 1:
            return copies[0]
        slots = {}
        for pool in POOLS:
            parts = [c.slots[pool] for c in copies if pool in c.slots]
            if parts:
                slots[pool] = (torch.cat([s for s, _ in parts]), torch.cat([d for _, d in parts]))
        return cls(slots, sum(c.blocks for c in copies))


def copy_device(src: CompressedStore, dst: CompressedStore) -> torch.device:
    """Where a copy between the two stores runs: the GPU if either store is on one."""
    return src.device if src.device.type != "cpu" else dst.device


def plan_block_copy(src: CompressedStore, src_vbs: Sequence[int], dst: CompressedStore,
                    dst_vbs: Sequence[int]) -> BlockCopy:  # fmt: skip
    """The slot pairs that move virtual blocks ``src_vbs`` of ``src`` into the (allocated) blocks
    ``dst_vbs`` of ``dst``. Each pair must have the same placement kinds (sparse or dense K and V)."""
    if (src.num_layers, src.kv_heads, src.head_dim, src.block_size, src.dtype, src.value_dtype) != (
        dst.num_layers, dst.kv_heads, dst.head_dim, dst.block_size, dst.dtype, dst.value_dtype,
    ):  # fmt: skip
        raise ValueError("block copies need two stores of the same layers, heads, head_dim, block size and dtypes")
    maps = (src.k_sparse_heads, dst.k_sparse_heads)  # CPU tensors, or None without a map
    if (maps[0] is None) != (maps[1] is None) or (maps[0] is not None and not torch.equal(*maps)):
        raise ValueError("block copies need two stores of the same K head map")
    pairs: dict[str, tuple[list[int], list[int]]] = {pool: ([], []) for pool in POOLS}
    for a, b in zip(src_vbs, dst_vbs, strict=True):
        ps, pd = src.placement(a), dst.placement(b)
        if (ps.k_sparse, ps.v_sparse) != (pd.k_sparse, pd.v_sparse):
            raise ValueError(f"block {a} -> {b}: placement kinds differ ({ps} vs {pd})")
        for pool, s, d in (("k_sparse" if ps.k_sparse else "k_dense", ps.k_slot, pd.k_slot),
                           ("v_sparse" if ps.v_sparse else "v_dense", ps.v_slot, pd.v_slot)):  # fmt: skip
            pairs[pool][0].append(s)
            pairs[pool][1].append(d)
    device = copy_device(src, dst)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

    slots = {pool: (tensor(s), tensor(d)) for pool, (s, d) in pairs.items() if s}
    return BlockCopy(slots, len(src_vbs))


def copy_blocks(src: CompressedStore, dst: CompressedStore, copy: BlockCopy, layer: int | None = None) -> None:
    """Copy the planned blocks' rows of one ``layer`` (None: every layer) from ``src`` to ``dst``, on
    the current stream (SGLang's transfer stream, inside its start and finish events)."""
    on_gpu = copy_device(src, dst).type == "cuda"
    layers = range(src.num_layers) if layer is None else (layer,)
    for pool, (src_slots, dst_slots) in copy.slots.items():
        if on_gpu:
            stream = torch.cuda.current_stream()
            src_slots.record_stream(stream)  # built on the scheduler's stream; freed after this copy
            dst_slots.record_stream(stream)
        for (name, src_first, rows), (_, dst_first, _) in zip(src.slot_rows(pool), dst.slot_rows(pool)):
            if on_gpu:
                _kernel_copy(src, dst, name, (src_first, dst_first), rows, src_slots, dst_slots, layer)
                continue
            for index in layers:
                if rows[index]:
                    src_rows, dst_rows = getattr(src, name)[index][src_first:], getattr(dst, name)[index][dst_first:]
                    per_slot = rows[index] * math.prod(src_rows.shape[1:])
                    dst_rows.view(-1, per_slot)[dst_slots] = src_rows.view(-1, per_slot)[src_slots]


def _kernel_copy(src: CompressedStore, dst: CompressedStore, name: str, first_rows: tuple[int, int], rows: list[int],
                 src_slots: torch.Tensor, dst_slots: torch.Tensor, layer: int | None) -> None:  # fmt: skip
    """SGLang's HiCache item-copy kernels, one item per block slot (all multiples of 8 bytes): one
    all-layer launch per distinct rows-per-slot count (one launch without a K head map)."""
    from sgl_kernel.kvcacheio import transfer_kv_all_layer_mla, transfer_kv_per_layer_mla

    sample = getattr(src, name)[0]
    row_bytes = math.prod(sample.shape[1:]) * sample.element_size()
    if layer is None:
        for count in sorted(set(rows) - {0}):
            group = tuple(i for i, r in enumerate(rows) if r == count)
            transfer_kv_all_layer_mla(
                src_layers=src.pointer_table(name, src_slots.device, group, first_rows[0]),
                dst_layers=dst.pointer_table(name, src_slots.device, group, first_rows[1]),
                src_indices=src_slots, dst_indices=dst_slots, item_size=count * row_bytes, num_layers=len(group),
            )  # fmt: skip
    elif rows[layer]:
        transfer_kv_per_layer_mla(
            src=getattr(src, name)[layer][first_rows[0]:], dst=getattr(dst, name)[layer][first_rows[1]:],
            src_indices=src_slots, dst_indices=dst_slots, item_size=rows[layer] * row_bytes,
        )  # fmt: skip
