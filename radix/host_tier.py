"""The host tier of compressed prefixes, inside SGLang's own HiCache host pool and cache controller.

SGLang's ``HiCacheController`` gives every token of a node one host slot and its host pool moves token
rows between SGLang's dense buffers. A compressed node's blocks instead go to a *host store* (a
:class:`~sglang_hs.pools.CompressedStore` in pinned CPU memory, sized from the host budget) in their
compressed form. Design: ``docs/hicache.md``.

- **Host virtual slots.** A compressed token's ``node.host_value`` entry is
  ``host_base + hvb·B + offset`` (above every dense host slot), as on the GPU, so SGLang's tree code
  (concatenation, splits by position, lengths, host hit lengths) works unchanged.
- :class:`HieraSparseCacheController`: ``write`` and ``load`` split a node's tokens into dense ones
  (SGLang's slots, SGLang's ``CacheOperation``) and compressed blocks (host-store or GPU-store blocks
  with the same placement kinds), all or nothing, and stage the block copies on the host pool.
- :class:`HieraSparseHostPool`: SGLang's transfer methods, which SGLang's ``start_writing`` /
  ``start_loading`` call inside the transfer stream, copy the staged blocks' rows (all layers, or
  layer ``i`` before SGLang records layer ``i``'s event) and then the dense rows; ``free`` and
  ``clear`` cover both kinds of host slot.

Both are installed by re-classing the objects ``HiRadixCache.__init__`` builds (it names their
classes itself), as :func:`sglang_hs.radix.hook.make_virtual_aware` does for the allocator.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang.srt.managers.cache_controller import CacheOperation, HiCacheController
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from sglang_hs.pools import CompressedStore, StoreCapacity, StoreFull, VirtualSlots
from sglang_hs.transfer import BlockCopy, copy_blocks, plan_block_copy

if TYPE_CHECKING:
    from sglang_hs.runtime import HieraSparseRuntime

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------- plans
@dataclass
class TierPlan:
    """How a node's tokens split between dense slots and compressed blocks, read on the CPU from
    the tier the tokens leave (device slots for a write, host slots for a load)."""

    num_tokens: int
    dense_positions: torch.Tensor
    """int64 CPU positions (within the node's tokens) of the dense tokens."""
    virtual_positions: torch.Tensor
    """int64 CPU positions of the compressed tokens, ``B`` per block, in block order."""
    blocks: list[int]
    """The source tier's virtual blocks, in token order."""
    sparse_k: list[bool]
    sparse_v: list[bool]

    @classmethod
    def of(cls, slots: torch.Tensor, virtual: VirtualSlots, store: CompressedStore) -> "TierPlan":
        """The plan of ``slots`` (CPU) whose virtual ones name blocks of ``store``."""
        mask = virtual.mask(slots)
        virtual_positions = torch.nonzero(mask).flatten()
        block = virtual.block_size
        if len(virtual_positions) % block:
            raise ValueError("compressed tokens must come in whole blocks")
        starts = slots[virtual_positions[::block]]
        blocks = ((starts - virtual.base) // block).tolist()
        placements = [store.placement(vb) for vb in blocks]
        return cls(
            len(slots), torch.nonzero(~mask).flatten(), virtual_positions, blocks,
            [p.k_sparse for p in placements], [p.v_sparse for p in placements],
        )  # fmt: skip

    @property
    def num_dense(self) -> int:
        return len(self.dense_positions)

    def demand(self) -> dict[str, int]:
        """Free slots the destination tier needs: ``dense`` slots and each store pool's."""
        k_sparse, v_sparse, n = sum(self.sparse_k), sum(self.sparse_v), len(self.blocks)
        return {"dense": self.num_dense, "virtual": n, "k_sparse": k_sparse, "k_dense": n - k_sparse,
                "v_sparse": v_sparse, "v_dense": n - v_sparse}  # fmt: skip

    def assemble(self, dense: torch.Tensor, virtual: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """The destination slot of every token: ``dense`` at the dense positions, ``virtual`` at the
        compressed ones (no host synchronisation on a GPU)."""
        out = torch.empty(self.num_tokens, dtype=torch.int64, device=device)
        if self.num_dense:
            out[self.dense_positions.to(device)] = dense.to(device)
        out[self.virtual_positions.to(device)] = virtual.to(device)
        return out


# --------------------------------------------------------------------------------------- host pool
class HieraSparseHostPool(MHATokenToKVPoolHost):
    """SGLang's MHA host pool plus the host store of compressed blocks (installed by
    :func:`make_host_tier`)."""

    hs_store: CompressedStore
    """The host store (pinned CPU memory)."""
    hs_virtual: VirtualSlots
    """Host virtual slots: above every dense host slot."""
    hs_device_store: CompressedStore
    """The GPU store the blocks come from and go to."""
    hs_staged_backups: list[BlockCopy]
    hs_staged_loads: list[BlockCopy]
    hs_loading: BlockCopy | None
    hs_generation: int
    """Bumped on every host allocation change: the idle ownership check runs only after a change."""

    def alloc(self, need_size: int) -> torch.Tensor | None:
        indices = super().alloc(need_size)
        if indices is not None:
            self.hs_generation += 1
        return indices

    def free(self, indices: torch.Tensor) -> int:
        """Free host slots of both kinds: host virtual slots go back to the host store."""
        with self.lock:
            indices = indices.cpu()
            virtual = self.hs_virtual.mask(indices)
            if bool(virtual.any()):
                self.hs_store.free(self.hs_virtual.blocks_of(indices[virtual]))
                super().free(indices[~virtual])
            else:
                super().free(indices)
            self.hs_generation += 1
            return len(indices)

    def clear(self) -> None:
        super().clear()
        if hasattr(self, "hs_store"):  # not on SGLang's first clear, before make_host_tier
            self.hs_store.clear()
            self.hs_staged_backups, self.hs_staged_loads, self.hs_loading = [], [], None
            self.hs_generation += 1

    def used_dense_slots(self) -> int:
        return self.size - self.available_size()

    # ----------------------------------------------------------------------------- transfers
    def stage_backup(self, block_copy: BlockCopy) -> None:
        """Blocks for the next ``backup_from_device_all_layer`` (SGLang starts every write at once)."""
        self.hs_staged_backups.append(block_copy)

    def stage_load(self, block_copy: BlockCopy) -> None:
        """Blocks for the next ``start_loading`` (which merges every load queued since the last one)."""
        self.hs_staged_loads.append(block_copy)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        staged, self.hs_staged_backups = BlockCopy.merge(self.hs_staged_backups), []
        if staged is not None:
            copy_blocks(self.hs_device_store, self.hs_store, staged)
        if host_indices.numel():
            super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend) -> None:
        if layer_id == 0:
            self.hs_loading, self.hs_staged_loads = BlockCopy.merge(self.hs_staged_loads), []
        if self.hs_loading is not None:
            copy_blocks(self.hs_store, self.hs_device_store, self.hs_loading, layer_id)
        if host_indices.numel():
            super().load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)
        if layer_id == self.layer_num - 1:
            self.hs_loading = None


def make_host_tier(host_pool, host_store: CompressedStore, device_store: CompressedStore) -> HieraSparseHostPool:
    """Turn the host pool ``HiRadixCache`` built into one that also holds compressed blocks."""
    if type(host_pool) is not MHATokenToKVPoolHost:
        raise TypeError(f"hierasparse needs SGLang's MHA host pool, got {type(host_pool).__name__}")
    block = device_store.block_size
    host_pool.__class__ = HieraSparseHostPool
    host_pool.hs_store, host_pool.hs_device_store = host_store, device_store
    host_pool.hs_virtual = VirtualSlots(base=-(-host_pool.size // block) * block, block_size=block)
    host_pool.hs_staged_backups, host_pool.hs_staged_loads, host_pool.hs_loading = [], [], None
    host_pool.hs_generation = 0
    return host_pool


# --------------------------------------------------------------------------------------- controller
class HieraSparseCacheController(HiCacheController):
    """SGLang's cache controller whose writes and loads move compressed blocks as they are (installed
    by :func:`make_tier_controller`). Streams, events, acknowledgements: SGLang's."""

    mem_pool_host: HieraSparseHostPool
    hs_device_virtual: VirtualSlots

    def backup_plan(self, device_indices: torch.Tensor) -> TierPlan:
        """The plan of a node's device slots (reads them to the CPU once)."""
        return TierPlan.of(device_indices.cpu(), self.hs_device_virtual, self.mem_pool_host.hs_device_store)

    def load_plan(self, host_indices: torch.Tensor) -> TierPlan:
        host = self.mem_pool_host
        return TierPlan.of(host_indices.cpu(), host.hs_virtual, host.hs_store)

    def write(self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1,
              plan: TierPlan | None = None) -> torch.Tensor | None:  # fmt: skip
        """Back a node up: dense tokens to SGLang's host slots, compressed blocks to host-store blocks
        of the same kinds. Returns the host slot of every token, or None (nothing reserved) when
        either part lacks room."""
        plan = plan or self.backup_plan(device_indices)
        if not plan.blocks:
            return super().write(device_indices, priority, node_id)
        host = self.mem_pool_host
        dense = host.alloc(plan.num_dense) if plan.num_dense else torch.empty(0, dtype=torch.int64)
        if dense is None:
            return None
        try:
            host_blocks = host.hs_store.allocate(plan.sparse_k, plan.sparse_v)
        except StoreFull:
            if plan.num_dense:
                host.free(dense)
            return None
        host.hs_generation += 1
        host.stage_backup(plan_block_copy(host.hs_device_store, plan.blocks, host.hs_store, host_blocks))
        host_indices = plan.assemble(dense, host.hs_virtual.slots_of(host_blocks, "cpu"), "cpu")
        dense_device = device_indices[plan.dense_positions.to(device_indices.device)]
        self.write_queue.append(CacheOperation(dense, dense_device, node_id, priority))
        self.start_writing()
        return host_indices

    def load(self, host_indices: torch.Tensor, priority: int | None = None, node_id: int = -1,
             plan: TierPlan | None = None) -> torch.Tensor | None:  # fmt: skip
        """Load a chain of host nodes: dense tokens to SGLang's device slots, compressed blocks to GPU
        store blocks of the same kinds (their index maps are written now, on the scheduler's stream).
        Returns the device slot of every token, or None (nothing reserved) when either part lacks room."""
        plan = plan or self.load_plan(host_indices)
        if not plan.blocks:
            return super().load(host_indices, priority, node_id)
        host, allocator = self.mem_pool_host, self.mem_pool_device_allocator
        store = host.hs_device_store
        dense = allocator.alloc(plan.num_dense) if plan.num_dense else torch.empty(0, dtype=torch.int64,
                                                                                    device=store.device)
        if dense is None:
            return None
        try:
            blocks = store.allocate(plan.sparse_k, plan.sparse_v)
        except StoreFull:
            if plan.num_dense:
                allocator.free(dense)
            return None
        host.stage_load(plan_block_copy(host.hs_store, plan.blocks, store, blocks))
        device = self.hs_device_virtual.slots_of(blocks, store.device)
        self.load_queue.append(CacheOperation(host_indices.cpu()[plan.dense_positions], dense, node_id, priority))
        return plan.assemble(dense, device, store.device)


def make_tier_controller(controller, device_virtual: VirtualSlots) -> HieraSparseCacheController:
    if type(controller) is not HiCacheController:
        raise TypeError(f"hierasparse needs SGLang's HiCacheController, got {type(controller).__name__}")
    if not isinstance(controller.mem_pool_host, HieraSparseHostPool):
        raise TypeError("install the host tier (make_host_tier) before the controller")
    controller.__class__ = HieraSparseCacheController
    controller.hs_device_virtual = device_virtual
    return controller


# --------------------------------------------------------------------------------------- sizing
@dataclass(frozen=True)
class HostBudget:
    """The host tier's bytes: SGLang's dense host pool gets ``dense_bytes`` (passed to SGLang as
    ``--hicache-size`` in GB), the host store ``store_capacity``."""

    total_bytes: int
    dense_bytes: int
    store_capacity: StoreCapacity


def host_budget(server_args, kv_pool, runtime: HieraSparseRuntime) -> HostBudget:
    """Split the host budget: ``--hicache-size`` GB, or ``--hicache-ratio`` times the device KV budget
    (dense pool + GPU store: what a dense server's pool would be), ``--hierasparse-host-store-fraction``
    of it for compressed blocks."""
    config = runtime.config
    token_bytes = kv_pool.head_num * kv_pool.head_dim * kv_pool.layer_num * 2 * kv_pool.dtype.itemsize
    if server_args.hicache_size > 0:
        total = int(server_args.hicache_size * 1e9)
    else:
        total = int(server_args.hicache_ratio * (kv_pool.size * token_bytes + runtime.store_budget_bytes))
    store_bytes = int(total * config.host_store_fraction)
    capacity = StoreCapacity.from_budget(store_bytes, kv_pool.layer_num, kv_pool.head_num, kv_pool.head_dim,
                                         config.block_size, config.sk_prefill, config.sv_prefill,
                                         k_sparse_share=runtime.store.k_sparse_share)  # fmt: skip
    return HostBudget(total, total - store_bytes, capacity)


def dense_host_args(server_args, budget: HostBudget):
    """A copy of ``server_args`` whose ``hicache_size`` makes SGLang size its dense host pool to the
    dense share (SGLang reads ``hicache_size · 1e9 // bytes per token``; a float is fine). SGLang's
    resolved ``ServerArgs`` refuse assignment, and ``override`` would also record the change in the
    shared provenance lists, so the field is set on the private copy only."""
    args = copy.copy(server_args)
    object.__setattr__(args, "hicache_size", budget.dense_bytes / 1e9)
    return args
