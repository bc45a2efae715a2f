"""Block copies between two compressed stores of one shape: the GPU store and a host-tier store.

A virtual block's K sits in one slot of one K pool (dense, or 2:4 values + metadata) and its V in one
slot of one V pool, the same slot in every layer; per layer and pool tensor its ``H`` rows
``slot·H .. slot·H + H − 1`` are consecutive. A block therefore moves as one *item* of ``H`` rows per
pool tensor and layer, from its slot in one store to a slot of the same kind in the other: a 2:4 block
stays 2:4 and its metadata travels with it, so the rows arrive bit-identical and nothing is
decompressed or recompressed.

On a GPU the items move with SGLang's own HiCache copy kernels (``sgl_kernel.kvcacheio``, the MLA
variants: one buffer, ``item_size`` bytes at ``base + index·item_size``), which read and write pinned
host memory directly; elsewhere (the CPU tests) with ``torch`` indexing. Both follow the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_hs.pools import CompressedStore

POOL_TENSORS = {
    "k_dense": ("k_dense",),
    "k_sparse": ("k_values", "k_meta"),
    "v_dense": ("v_dense",),
    "v_sparse": ("v_values", "v_meta"),
}
"""The store's pools (as ``free_counts`` names them) and the per-layer tensors each one consists of."""


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
        for pool in POOL_TENSORS:
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
    if (src.num_layers, src.kv_heads, src.head_dim, src.block_size, src.dtype) != (
        dst.num_layers, dst.kv_heads, dst.head_dim, dst.block_size, dst.dtype,
    ):  # fmt: skip
        raise ValueError("block copies need two stores of the same layers, heads, head_dim, block size and dtype")
    pairs: dict[str, tuple[list[int], list[int]]] = {pool: ([], []) for pool in POOL_TENSORS}
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
    for pool, (src_slots, dst_slots) in copy.slots.items():
        if on_gpu:
            stream = torch.cuda.current_stream()
            src_slots.record_stream(stream)  # built on the scheduler's stream; freed after this copy
            dst_slots.record_stream(stream)
        for name in POOL_TENSORS[pool]:
            if on_gpu:
                _kernel_copy(src, dst, name, src_slots, dst_slots, layer)
            else:
                for index in range(src.num_layers) if layer is None else (layer,):
                    src_rows, dst_rows = getattr(src, name)[index], getattr(dst, name)[index]
                    per_slot = src.kv_heads * src_rows[0].numel()
                    dst_rows.view(-1, per_slot)[dst_slots] = src_rows.view(-1, per_slot)[src_slots]


def _kernel_copy(src: CompressedStore, dst: CompressedStore, name: str, src_slots: torch.Tensor,
                 dst_slots: torch.Tensor, layer: int | None) -> None:  # fmt: skip
    """SGLang's HiCache item-copy kernels, one item per block slot (all multiples of 8 bytes)."""
    from sgl_kernel.kvcacheio import transfer_kv_all_layer_mla, transfer_kv_per_layer_mla

    sample = getattr(src, name)[0]
    item_size = src.kv_heads * sample[0].numel() * sample.element_size()
    if layer is None:
        transfer_kv_all_layer_mla(
            src_layers=src.pointer_table(name, src_slots.device), dst_layers=dst.pointer_table(name, src_slots.device),
            src_indices=src_slots, dst_indices=dst_slots, item_size=item_size, num_layers=src.num_layers,
        )  # fmt: skip
    else:
        transfer_kv_per_layer_mla(
            src=getattr(src, name)[layer], dst=getattr(dst, name)[layer],
            src_indices=src_slots, dst_indices=dst_slots, item_size=item_size,
        )  # fmt: skip
