"""The compressed radix cache on SGLang's hierarchical cache: prefixes compressed on the GPU keep
their compressed form on the host tier (``--enable-hierarchical-cache``). Design: ``docs/hicache.md``.

:class:`HieraSparseHiRadixCache` is the radix hook's tree (compression, dense-token accounting,
eviction passes) over SGLang's ``HiRadixCache`` (device and host values per node, write-through /
write-back, load-back with layer-wise overlap). SGLang's methods run unchanged except where a
compressed node needs a different amount of room or accounting:

- ``write_backup``: room on the host for exactly what the node takes (dense host slots and each
  host-store pool), then SGLang's write through :class:`~sglang_hs.radix.host_tier.HieraSparseCacheController`.
- ``load_back``: room in the GPU store and the dense pool for exactly what the host chain takes, then
  SGLang's load-back; the loaded nodes' compressed tokens join the protected count.
- ``_remove_leaf`` (the hook's eviction passes): SGLang's device-eviction semantics (demote a backed-up
  leaf, back up under write-back, drop a subtree without a host copy, delete otherwise).
- accounting of demotions and dropped subtrees; the host tier's checks, log lines and gauges.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import psutil
import torch

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.pool_host.base import HICACHE_HOST_MEMORY_RESERVE_BYTES
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS, HostTensorAllocator, _cuda_host_unregister
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_hs.pools import CompressedStore, StoreCapacity
from sglang_hs.radix.hook import HieraSparseRadixCache, virtual_tokens
from sglang_hs.radix.host_tier import (HieraSparseCacheController, HieraSparseHostPool, make_host_tier,
                                       make_tier_controller)  # fmt: skip
from sglang_hs.runtime import HieraSparseRuntime
from sglang_hs.sglang_compat import hiradix_cache_class, record_remove_event

if TYPE_CHECKING:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

logger = logging.getLogger(__name__)

HiRadixCache = hiradix_cache_class()
"""SGLang's hierarchical tree (sglang 0.5.17; a later SGLang without it raises ImportError with one line)."""

STORE_POOLS = ("virtual", "k_dense", "k_sparse", "v_dense", "v_sparse")


class HieraSparseHiRadixCache(HieraSparseRadixCache, HiRadixCache):
    cache_controller: HieraSparseCacheController
    token_to_kv_pool_host: HieraSparseHostPool

    def __init__(
        self,
        params: CacheInitParams,
        server_args,
        runtime: HieraSparseRuntime,
        k_buffers: list[torch.Tensor],
        v_buffers: list[torch.Tensor],
        host_capacity: StoreCapacity,
    ):
        """``server_args`` sizes SGLang's dense host pool (its ``hicache_size`` is the dense share, see
        :func:`~sglang_hs.radix.host_tier.host_budget`); ``host_capacity`` sizes the host store."""
        self._staged_write_back: list[tuple[TreeNode, torch.Tensor]] = []
        self._host_checked: tuple | None = None
        super().__init__(params, runtime, k_buffers, v_buffers, server_args=server_args)
        store = self.store
        host_bytes = host_capacity.nbytes(store.num_layers, store.kv_heads, store.head_dim, store.block_size,
                                          store.k_sparse_share)  # fmt: skip
        available = psutil.virtual_memory().available - HICACHE_HOST_MEMORY_RESERVE_BYTES
        if host_bytes > available:  # SGLang checks its own (dense) host pool the same way
            raise ValueError(f"Not enough host memory for the compressed host store: {host_bytes / 1e9:.2f} GB "
                             f"requested, {available / 1e9:.2f} GB free; reduce --hicache-size or --hicache-ratio")
        self.host_store = CompressedStore(host_capacity, store.num_layers, store.kv_heads, store.head_dim,
                                          store.block_size, store.dtype, "cpu", allocate=self._host_allocation(),
                                          k_sparse_heads=store.k_sparse_heads)  # the GPU store's layout  # fmt: skip
        make_host_tier(self.token_to_kv_pool_host, self.host_store, store)
        make_tier_controller(self.cache_controller, self.virtual)
        self.host_virtual = self.token_to_kv_pool_host.hs_virtual
        logger.info(
            "hierasparse: host tier = SGLang's dense host pool (%d tokens) + compressed store (%d blocks, %.2f GB)",
            self.token_to_kv_pool_host.size, host_capacity.virtual_blocks, host_bytes / 1e9,
        )  # fmt: skip

    def _host_allocation(self):
        """The host store's tensors come from SGLang's host allocation, as its host pool's do: anonymous
        mmap, pinned with ``cudaHostRegister`` (exact sizes, unlike torch's pinned allocator, which
        rounds each tensor up to a power of two)."""
        host_pool = self.token_to_kv_pool_host
        alloc, allocator = ALLOC_MEMORY_FUNCS[host_pool.device_pool.device], HostTensorAllocator()

        def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return alloc(shape, dtype=dtype, device="cpu", pin_memory=host_pool.pin_memory, allocator=allocator)

        return allocate

    def release_host_resources(self) -> None:
        """SGLang unpins its host pool at shutdown; the host store's pinned buffers likewise."""
        super().release_host_resources()
        host_pool = self.token_to_kv_pool_host
        if hasattr(self, "host_store") and host_pool.pin_memory and torch.cuda.is_available():
            for name in ("k_dense", "k_values", "k_meta", "v_dense", "v_values", "v_meta"):
                for tensor in getattr(self.host_store, name):
                    if tensor.numel():
                        _cuda_host_unregister(tensor)

    # ----------------------------------------------------------------------------- host room
    def host_virtual_tokens(self, node: TreeNode) -> int:
        """Compressed tokens of ``node``'s host copy (counted on the CPU once per host value)."""
        if node.host_value is None or len(node.host_value) == 0:
            return 0
        counted = getattr(node, "hs_host_virtual", None)
        if counted is None:
            counted = node.hs_host_virtual = int(self.host_virtual.mask(node.host_value).sum())
        return counted

    def _split_node(self, key, child: TreeNode, split_len: int) -> TreeNode:
        new_node = super()._split_node(key, child, split_len)
        new_node.hs_host_virtual = child.hs_host_virtual = None  # both host values changed: count again
        return new_node

    def _host_shortage(self, demand: dict[str, int]) -> set[str]:
        host = self.token_to_kv_pool_host
        free = {"dense": host.available_size(), **self.host_store.free_counts()}
        return {pool for pool, need in demand.items() if need > free[pool]}

    def _make_host_room(self, demand: dict[str, int]) -> None:
        """Evict host leaves, least recently used first, until the host has ``demand`` free: first
        leaves that free what is short (mostly dense ones for dense host slots, ones holding
        compressed blocks for the store), then any."""
        while short := self._host_shortage(demand):
            wants_dense, wants_store = "dense" in short, bool(short - {"dense"})

            def frees_what_is_short(node: TreeNode) -> bool:
                virtual = self.host_virtual_tokens(node)
                dense = len(node.host_value) - virtual
                return (wants_store and virtual > 0) or (wants_dense and dense >= virtual)

            leaf = self._lru_host_leaf(frees_what_is_short) or self._lru_host_leaf(None)
            if leaf is None:
                return  # nothing left to evict: the write fails and the node stays on the device only
            self._evict_host_leaf(leaf)

    def _lru_host_leaf(self, eligible) -> TreeNode | None:
        candidates = [
            node for node in self.evictable_host_leaves
            if node.evicted and node.host_ref_counter == 0 and (eligible is None or eligible(node))
        ]  # fmt: skip
        return min(candidates, key=self.eviction_strategy.get_priority, default=None)

    def _evict_host_leaf(self, node: TreeNode) -> None:
        """Free a host leaf's host slots and drop it from the tree (SGLang's ``evict_host``, one node)."""
        self.stats.host_evicted_blocks += self.host_virtual_tokens(node) // self.config.block_size
        record_remove_event(self, node, medium=StorageMedium.CPU)
        self.cache_controller.evict_host(node.host_value)
        removed = node.parent.children.pop(node.key.child_key(self.page_size), None)
        assert removed is node, "parent does not hold the host leaf"
        self.evictable_host_leaves.discard(node)
        self._update_host_leaf_status(node.parent)

    # ----------------------------------------------------------------------------- write and load
    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """SGLang's ``write_backup``, with room made for exactly what the node takes on the host."""
        if not write_back and node.parent is not self.root_node and not node.parent.backuped:
            return 0  # write-through keeps backed-up nodes a prefix from the root (SGLang's rule)
        plan = self.cache_controller.backup_plan(node.value)
        self._make_host_room(plan.demand())
        host_indices = self.cache_controller.write(node.value, node_id=node.id, plan=plan)
        if host_indices is None:
            return 0
        node.host_value = host_indices.clone()
        node.hs_host_virtual = len(plan.virtual_positions)
        self._track_write_through_node(node, len(node.key))
        if not write_back:
            self.inc_lock_ref(node)
        self.stats.backed_up_blocks += len(plan.blocks)
        return len(host_indices)

    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> torch.Tensor | None:
        """SGLang's ``load_back`` of the evicted chain ending at ``node``, after making room in the GPU
        store (least recently used compressed leaves) and the dense pool for exactly what it takes."""
        chain, ancestor = [], node
        while ancestor.evicted:
            chain.insert(0, ancestor)
            ancestor = ancestor.parent
        plan = self.cache_controller.load_plan(torch.cat([n.host_value for n in chain]))
        demand = plan.demand()
        self.inc_lock_ref(ancestor)  # as SGLang does: the chain's device ancestors must stay
        try:
            store_demand = {pool: demand[pool] for pool in STORE_POOLS}
            if any(store_demand.values()):
                self._make_room(store_demand, keep=None)
            short = demand["dense"] - self.token_to_kv_pool_allocator.available_size()
            if short > 0:
                self.evict(EvictParams(num_tokens=short))
        finally:
            self.dec_lock_ref(ancestor)
        device_indices = super().load_back(node, mem_quota)
        if device_indices is None:
            return None
        for loaded in chain:  # SGLang locked them: their compressed tokens are protected now
            loaded.hs_virtual = self.host_virtual_tokens(loaded)
            self._virtual_protected += loaded.hs_virtual
        self.stats.loaded_blocks += len(plan.blocks)
        self.publish_metrics()
        return device_indices

    # ----------------------------------------------------------------------------- device eviction
    def _remove_leaf(self, node: TreeNode) -> None:
        """Drop a device leaf's device copy the way SGLang's hierarchical eviction does: a backed-up
        leaf keeps its host copy (demoted); under write-back a leaf is backed up first and its device
        slots are freed once the copy is done (``_flush_staged_write_back``); a leaf whose host-only
        children have no host parent takes its subtree with it; any other leaf is deleted."""
        if node.backuped:
            self._evict_backuped(node)
        elif self.cache_controller.write_policy == "write_back" and self.write_backup(node, write_back=True) > 0:
            node.protect_host()
            self._staged_write_back.append((node, node.value))
            self._detach_backuped(node)
        elif node.children:
            self._flush_staged_write_back()
            self._drop_subtree_no_host(node)
        else:
            super()._remove_leaf(node)

    def _flush_staged_write_back(self) -> None:
        """Wait for the write-back copies, then free the device slots (dense pages and store blocks)."""
        if not self._staged_write_back:
            return
        self.writing_check(write_back=True)
        for node, device_indices in self._staged_write_back:
            self.cache_controller.evict_device(device_indices)
            node.release_host()
        self._staged_write_back.clear()

    def _evict_leaves(self, amount: int, freed_by, exclude: TreeNode | None = None, eligible=None) -> EvictResult:
        result = super()._evict_leaves(amount, freed_by, exclude, eligible)
        self._flush_staged_write_back()
        return result

    def _trim_dense_tails(self, amount: int) -> int:
        freed = super()._trim_dense_tails(amount)
        self._flush_staged_write_back()
        return freed

    def _detach_backuped(self, node: TreeNode) -> int:
        """SGLang's demotion; the node's compressed tokens leave the evictable count with it."""
        virtual = virtual_tokens(node)
        evicted = super()._detach_backuped(node)
        self._virtual_evictable -= virtual
        node.hs_virtual = 0
        return evicted

    def _drop_subtree_no_host(self, root: TreeNode) -> int:
        virtual = virtual_tokens(root) if not root.evicted else 0
        freed = super()._drop_subtree_no_host(root)
        if virtual and root.evicted:  # dropped (SGLang leaves it when a host copy is in use)
            self._virtual_evictable -= virtual
            root.hs_virtual = 0
        return freed

    # ----------------------------------------------------------------------------- checks
    def reset(self):
        if hasattr(self, "host_store"):  # not on the first reset, inside RadixCache.__init__
            problem = self._host_ownership_problem(force=True)
            if problem:
                logger.error("hierasparse: host tier at reset: %s", problem)
            else:
                logger.info("hierasparse: host tier at reset: %d compressed blocks and %d dense tokens, all owned by "
                            "the tree", self.host_store.used_blocks(), self.token_to_kv_pool_host.used_dense_slots())
        self._staged_write_back = []
        super().reset()

    def host_held(self) -> tuple[int, int]:
        """(dense host tokens, compressed host blocks) that the tree's host values hold."""
        dense = blocks = 0
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.host_value is not None:
                virtual = self.host_virtual_tokens(node)
                dense += len(node.host_value) - virtual
                blocks += virtual // self.config.block_size
        return dense, blocks

    def _host_ownership_problem(self, force: bool = False) -> str | None:
        """None if the tree's host values hold exactly the host slots in use (walked only when the host
        allocation changed since the last clean check), else what differs."""
        host = self.token_to_kv_pool_host
        signature = (host.hs_generation, host.available_size(), tuple(self.host_store.free_counts().values()))
        if not force and signature == self._host_checked:
            return None
        held = self.host_held()
        used = (host.used_dense_slots(), self.host_store.used_blocks())
        if held != used:
            return (f"hierarchical cache host leak: the host holds {used[0]} dense tokens and {used[1]} compressed "
                    f"blocks, the tree {held[0]} and {held[1]}")  # fmt: skip
        self._host_checked = signature
        return None

    def check_stores(self) -> str | None:
        """The GPU store, the host store (free + used == capacity per pool) and host ownership."""
        return super().check_stores() or self.host_store.check() or self._host_ownership_problem()

    def rank_state(self) -> str:
        free = self.host_store.free_counts()
        host = " ".join(f"host_free_{name}={count}" for name, count in free.items())
        return (f"{super().rank_state()} host_free_dense={self.token_to_kv_pool_host.available_size()} {host} "
                f"backed_up={self.stats.backed_up_blocks} loaded={self.stats.loaded_blocks}")  # fmt: skip

    def status(self) -> dict[str, float]:
        status = super().status()
        if hasattr(self, "host_store"):
            status["host_compressed_tokens"] = self.host_store.used_blocks() * self.config.block_size
            status["host_store_capacity_blocks"] = self.host_store.capacity.virtual_blocks
        return status

