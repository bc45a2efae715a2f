"""The radix-cache hook: prefixes entering SGLang's radix cache are compressed, their pages freed.

Policy (also in the README):

- **What is compressed.** When a node enters the tree (after a prefill, at each chunked-prefill
  boundary, and when a request finishes), its whole blocks that lie after the sequence's first
  ``sink_tokens`` and before the node's last ``window_tokens`` go to the compressed store; the rest
  stay in SGLang's dense pages. Blocks of prompt tokens use ``S_K/S_V`` of prefill, blocks of
  generated tokens (cached when a request finishes) those of decode.
- **Virtual slots.** A compressed token's slot id becomes ``virtual_base + vb·B + offset``, above
  every dense slot: ``node.value`` and the requests' ``req_to_token`` rows keep one slot per token as
  SGLang expects, and the backend resolves virtual block ``vb`` through the store's index maps.
- **Running requests.** Compression happens inside the insert, before SGLang rewrites the inserting
  request's ``req_to_token`` row from the tree, so that request continues on the compressed copy. The
  dense pages are freed at once; a forward already in flight may still read them, which is safe
  because a freed page is only rewritten by a later forward on the same stream. The compression runs
  on the scheduler's current stream, ordered after the forward that wrote the KV and before the next.
- **Accounting.** ``evictable_size()``/``protected_size()`` count dense tokens only, so SGLang's
  idle check ``available + evictable + protected == total`` holds. The allocator routes virtual slots
  it is asked to free to the store. Eviction frees both representations of a node.
- **Store full.** Compressed leaves that no request holds are evicted, least recently used first;
  if that is not enough the prefix stays dense.
- **Dense pool full.** Mostly dense leaves go first; then compressed leaves lose their dense tail
  (the window), which a later hit prefills again; whole compressed leaves go last (``evict``).
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import logging
import time
from typing import TYPE_CHECKING

import torch

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

from sglang_hs.format import dense_block_bytes, sparse_count
from sglang_hs.pools import CompressedStore, StoreFull, VirtualSlots
from sglang_hs.pruner import make_pruner
from sglang_hs.runtime import HieraSparseRuntime
from sglang_hs.sglang_compat import record_remove_event, request_insert_mixin, watch_stored_nodes

if TYPE_CHECKING:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

logger = logging.getLogger(__name__)


class HieraSparseAllocator(PagedTokenToKVPoolAllocator):
    """SGLang's paged allocator, plus: virtual slots handed to ``free`` go back to the store.

    Installed by re-classing the scheduler's allocator object (see :func:`make_virtual_aware`), so
    every holder of the allocator (scheduler, tree, batch code) frees through it.
    """

    hs_store: CompressedStore
    hs_virtual: VirtualSlots

    def _dense_part(self, free_index: torch.Tensor) -> torch.Tensor | None:
        """Free the virtual part; return the dense part, or None if there was no virtual part."""
        if self.hs_store.used_blocks() == 0 or free_index.numel() == 0:
            return None
        virtual = self.hs_virtual.mask(free_index)
        if not bool(virtual.any()):
            return None
        self.hs_store.free(self.hs_virtual.blocks_of(free_index[virtual]))
        return free_index[~virtual]

    def free(self, free_index: torch.Tensor):
        dense = self._dense_part(free_index)
        super().free(free_index if dense is None else dense)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int):
        dense = self._dense_part(free_index)
        if dense is None:
            super().free_segment(free_index, start_pos=start_pos)
        else:  # the dense part is no longer one consecutive run of the row
            super().free(dense)


def make_virtual_aware(allocator, store: CompressedStore, virtual: VirtualSlots) -> HieraSparseAllocator:
    if type(allocator) is not PagedTokenToKVPoolAllocator:
        raise TypeError(f"hierasparse needs SGLang's paged allocator, got {type(allocator).__name__}")
    allocator.__class__ = HieraSparseAllocator
    allocator.hs_store, allocator.hs_virtual = store, virtual
    return allocator


class HieraSparseRadixCache(request_insert_mixin(), RadixCache):
    def __init__(
        self,
        params: CacheInitParams,
        runtime: HieraSparseRuntime,
        k_buffers: list[torch.Tensor],
        v_buffers: list[torch.Tensor],
        **cache_kwargs,
    ):
        """``runtime`` is the one the attention backend reads (store, virtual slots, settings,
        compressor); ``k_buffers``/``v_buffers`` are SGLang's per-layer KV buffers; ``cache_kwargs``
        go to the next tree class (``server_args`` for SGLang's hierarchical cache)."""
        self.runtime = runtime
        self.store, self.config, self.virtual = runtime.store, runtime.config, runtime.virtual
        self.k_buffers, self.v_buffers = k_buffers, v_buffers
        self.pruner = make_pruner(self.config.pruner)
        self.stats = CompressionStats()
        self.prometheus: PrometheusGauges | None = None
        self._prompt_len: int | None = None  # set while a request's tokens are inserted
        super().__init__(params, **cache_kwargs)
        watch_stored_nodes(self, self._node_stored)
        make_virtual_aware(self.token_to_kv_pool_allocator, self.store, self.virtual)

    # ----------------------------------------------------------------------------- accounting
    def reset(self):
        if hasattr(self, "_virtual_evictable"):  # not on the first reset, inside RadixCache.__init__
            self._log_store_ownership()
        super().reset()
        self._virtual_evictable = 0
        self._virtual_protected = 0
        self.store.clear()
        self.publish_metrics()

    def _log_store_ownership(self) -> None:
        """Before a flush empties the store: every block in use must belong to a tree node (under
        tensor parallelism each rank logs its own line). A block no node holds is a leak that the
        store's own check cannot see; it is logged with SGLang's leak wording. A second line gives
        the tree's state: under tensor parallelism every rank's tree must make the same decisions
        (splits, evictions, pool counts) although its block masks differ, so the lines must match."""
        held = (self._virtual_evictable + self._virtual_protected) // self.config.block_size
        used = self.store.used_blocks()
        if held == used:
            logger.info("hierasparse: cache reset; the store held %d compressed blocks, all owned by the tree (%d "
                        "compressed since start)", used, self.stats.compressed_blocks)  # fmt: skip
        else:
            logger.error("hierasparse: compressed store leak: %d blocks in use at reset, the tree held %d", used, held)
        logger.info("hierasparse: tree state %s", self.rank_state())

    def rank_state(self) -> str:
        """``key=value`` pairs that are equal on every tensor-parallel rank while the ranks' trees
        stay in step: node count and a digest of the tree's shape (each node's position, length,
        compressed tokens), cumulative split / compression / eviction counts, free slots per pool.
        Which blocks are 2:4 sparse may differ per rank (each ranks its own heads' losses); how many
        may not, so the pool counts are compared too."""
        digest, nodes, stack = hashlib.sha1(), 0, [(self.root_node, 0)]
        while stack:
            node, start = stack.pop()
            for child in sorted(node.children.values(), key=lambda c: tuple(c.key.token_ids[:1])):
                end = start + len(child.key)
                digest.update(f"{start}:{len(child.key)}:{virtual_tokens(child)};".encode())
                nodes += 1
                stack.append((child, end))
        stats, free = self.stats, self.store.free_counts()
        fields = {
            "nodes": nodes, "digest": digest.hexdigest()[:12], "splits": stats.node_splits,
            "compressed_blocks": stats.compressed_blocks, "kept_dense": stats.kept_dense_prefixes,
            "trimmed_tails": stats.trimmed_tails, "evicted_for_dense": stats.evicted_blocks["dense"],
            "evicted_for_store": stats.evicted_blocks["store"], "evictable": self.evictable_size(),
            **{f"free_{name}": count for name, count in free.items()},
        }  # fmt: skip
        return " ".join(f"{key}={value}" for key, value in fields.items())

    def evictable_size(self):
        return self.evictable_size_ - self._virtual_evictable

    def protected_size(self):
        return self.protected_size_ - self._virtual_protected

    def inc_lock_ref(self, node: TreeNode):
        walk = node
        while walk is not self.root_node and not self.disable:
            if walk.lock_ref == 0:
                self._virtual_evictable -= virtual_tokens(walk)
                self._virtual_protected += virtual_tokens(walk)
            walk = walk.parent
        return super().inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode, params=None):
        walk = node
        while walk is not self.root_node and not self.disable:
            if walk.lock_ref == 1:
                self._virtual_evictable += virtual_tokens(walk)
                self._virtual_protected -= virtual_tokens(walk)
            walk = walk.parent
        return super().dec_lock_ref(node, params)

    def _delete_leaf(self, node: TreeNode):
        super()._delete_leaf(node)
        self._virtual_evictable -= virtual_tokens(node)

    def _split_node(self, key, child: TreeNode, split_len: int):
        new_node = super()._split_node(key, child, split_len)
        self.stats.node_splits += 1
        if virtual_tokens(child):
            new_node.hs_virtual = int(self.virtual.mask(new_node.value).sum())
            child.hs_virtual -= new_node.hs_virtual
        return new_node

    def evict(self, params: EvictParams) -> EvictResult:
        """Like ``RadixCache.evict``, but ``num_tokens`` counts dense tokens (the request is for dense
        pool pages; compressed blocks free store slots instead), in three passes, each least recently
        used first:

        1. leaves that hold at least as many dense tokens as compressed ones (a request's own suffix);
        2. the dense tails of compressed leaves (the window kept after the last compressed block): the
           leaf is split there and only the tail is evicted, so the compressed prefix stays resident
           and a later hit prefills the tail again, a window's worth of tokens, not the prefix;
        3. whole leaves: a compressed prefix gives back only its sink pages here but is lost whole.
        """
        wanted = params.num_tokens
        freed = self._evict_leaves(wanted, dense_tokens, eligible=mostly_dense).num_tokens_evicted
        if freed < wanted:
            freed += self._trim_dense_tails(wanted - freed)
        if freed < wanted:
            freed += self._evict_leaves(wanted - freed, dense_tokens).num_tokens_evicted
        return EvictResult(num_tokens_evicted=freed)

    def _evict_leaves(self, amount: int, freed_by, exclude: TreeNode | None = None, eligible=None) -> EvictResult:
        """Evict least-recently-used unlocked leaves (``eligible`` ones, and not ``exclude``) until
        ``freed_by`` adds up to ``amount``."""
        if self.disable:
            return EvictResult()
        start = time.perf_counter()

        def candidate(node: TreeNode) -> bool:
            return node is not exclude and (eligible is None or eligible(node))

        heap = [(self.eviction_strategy.get_priority(node), node) for node in self.evictable_leaves if candidate(node)]
        heapq.heapify(heap)
        freed = evicted_tokens = 0
        while freed < amount and heap:
            _, node = heapq.heappop(heap)
            freed += freed_by(node)
            evicted_tokens += dense_tokens(node)
            self.stats.evicted_blocks["store" if freed_by is virtual_tokens else "dense"] += (
                virtual_tokens(node) // self.config.block_size
            )
            parent = node.parent
            self._remove_leaf(node)
            # SGLang keeps evictable_leaves current: the parent is one once no child is on the device.
            if parent in self.evictable_leaves and candidate(parent):
                heapq.heappush(heap, (self.eviction_strategy.get_priority(parent), parent))
        self.update_eviction_metrics(evicted_tokens, start)
        self.publish_metrics()
        return EvictResult(num_tokens_evicted=evicted_tokens)

    def _trim_dense_tails(self, amount: int) -> int:
        """Split unlocked compressed leaves before their dense tail and evict the tails, least
        recently used first, until ``amount`` dense tokens are freed; returns the tokens freed."""
        if self.disable:
            return 0
        start = time.perf_counter()
        heap = [
            (self.eviction_strategy.get_priority(node), node)
            for node in self.evictable_leaves
            if virtual_tokens(node) and not mostly_dense(node)
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < amount and heap:
            _, node = heapq.heappop(heap)
            tail = self.dense_tail(node)
            if tail == 0:
                continue
            kept = self._split_node(node.key, node, len(node.key) - tail)
            # The compressed part keeps the leaf's age: being cut is no use of the prefix.
            kept.last_access_time, kept.creation_time = node.last_access_time, node.creation_time
            freed += tail
            self._remove_leaf(node)
            self.stats.trimmed_tails += 1
        self.update_eviction_metrics(freed, start)
        self.publish_metrics()
        return freed

    def _remove_leaf(self, node: TreeNode) -> None:
        """Free an unlocked leaf's slots (dense pages and store blocks) and drop it from the tree."""
        self.token_to_kv_pool_allocator.free(node.value)
        self._delete_leaf(node)
        record_remove_event(self, node)

    def dense_tail(self, node: TreeNode) -> int:
        """Tokens of ``node`` after its last compressed one (its whole length if it has none); a
        multiple of the block size, since compressed blocks and node boundaries are page aligned."""
        virtual = self.virtual.mask(node.value)
        if not bool(virtual.any()):
            return len(node.value)
        return len(node.value) - 1 - int(torch.nonzero(virtual)[-1])

    def check_stores(self) -> str | None:
        """None if the compressed store accounts for every slot, else what is wrong (idle check)."""
        return self.store.check()

    # ----------------------------------------------------------------------------- compression
    @contextlib.contextmanager
    def inserting_request(self, req):
        """While SGLang inserts ``req``'s tokens (the method is ``sglang_compat.request_insert_mixin``'s),
        blocks before its prompt length are compressed with the prefill sparsity, later ones with the
        decode sparsity."""
        self._prompt_len = len(req.origin_input_ids)
        try:
            yield
        finally:
            self._prompt_len = None

    def _node_stored(self, node: TreeNode, medium=None) -> None:
        """Called after SGLang records ``node`` entering the tree (``sglang_compat.watch_stored_nodes``)."""
        if self.disable or medium is not None:
            return  # a host-tier or load-back event (hierarchical cache): the node is compressed already
        try:
            self._compress_node(node)
        except StoreFull as exc:
            logger.debug("hierasparse: prefix kept dense: %s", exc)
            self.stats.kept_dense_prefixes += 1

    def _compress_node(self, node: TreeNode) -> None:
        cfg, block = self.config, self.config.block_size
        start = node_start(node)
        end = start + len(node.key)
        first = max(start, cfg.sink_tokens) // block
        last = (end - cfg.window_tokens) // block  # exclusive
        if last <= first:
            return
        offset = first * block - start
        slots = node.value[offset : offset + (last - first) * block].clone()  # value is rewritten below
        block_starts = torch.arange(first, last) * block
        prompt = block_starts < (self._prompt_len if self._prompt_len is not None else end)
        groups = [(prompt, cfg.sk_prefill, cfg.sv_prefill), (~prompt, cfg.sk_decode, cfg.sv_decode)]
        self._make_room(pool_demand(groups, last - first), keep=node)
        vbs = self.runtime.compress_prefix(self.store, self.pruner, self.k_buffers, self.v_buffers, slots, groups)
        node.value[offset : offset + len(slots)] = self.virtual.slots_of(vbs, node.value.device)
        self.token_to_kv_pool_allocator.free(slots)
        tokens = len(slots)
        node.hs_virtual = virtual_tokens(node) + tokens
        if node.lock_ref == 0:
            self._virtual_evictable += tokens
        else:
            self._virtual_protected += tokens
        self.stats.compressed_blocks += len(vbs)
        self.publish_metrics()
        logger.debug("hierasparse: compressed %d blocks at positions %d..%d", len(vbs), first * block, last * block)

    def _make_room(self, demand: dict[str, int], keep: TreeNode) -> None:
        """Evict unlocked compressed leaves (LRU) until every pool of the store has the free slots
        ``demand`` names. At a fractional S the sparse and dense pools of K (or V) can run out before
        the virtual blocks do: each is checked, and eviction goes on while it frees anything."""
        free = self.store.free_counts()
        while (missing := max(demand[pool] - free[pool] for pool in demand)) > 0:
            self._evict_leaves(missing * self.config.block_size, virtual_tokens, exclude=keep)
            before, free = free, self.store.free_counts()
            if free == before:
                return  # nothing left to evict: the compression raises StoreFull

    def enable_metrics(self, gauges: "PrometheusGauges") -> None:
        """Export the status as Prometheus gauges, from now on: a scrape before the first request
        already reads the empty store's figures (a soak's "before" counts)."""
        self.prometheus = gauges
        self.publish_metrics()

    def publish_metrics(self) -> None:
        if self.prometheus is not None:
            self.prometheus.publish(self.status())

    def status(self) -> dict[str, float]:
        """What is resident now and what compression has done so far (for logs and metrics)."""
        store, block = self.store, self.config.block_size
        dense_block_bytes_all = 2 * dense_block_bytes(block, store.head_dim) * store.kv_heads * store.num_layers
        return {
            "compressed_tokens": store.used_blocks() * block,
            "dense_tree_tokens": self.evictable_size() + self.protected_size(),
            "store_used_blocks": store.used_blocks(),
            "store_capacity_blocks": store.capacity.virtual_blocks,
            "bytes_saved": store.used_blocks() * dense_block_bytes_all - store.stored_bytes(),
            "blocks_compressed_total": self.stats.compressed_blocks,
            "prefixes_kept_dense_total": self.stats.kept_dense_prefixes,
            "tails_trimmed_total": self.stats.trimmed_tails,
            "blocks_evicted_for_dense_total": self.stats.evicted_blocks["dense"],
            "blocks_evicted_for_store_total": self.stats.evicted_blocks["store"],
            # The host tier (hierarchical cache only; see sglang_hs.radix.hicache).
            "host_compressed_tokens": 0,
            "host_store_capacity_blocks": 0,
            "blocks_backed_up_total": self.stats.backed_up_blocks,
            "blocks_loaded_total": self.stats.loaded_blocks,
            "blocks_evicted_from_host_total": self.stats.host_evicted_blocks,
        }


class PrometheusGauges:
    """The tree's status as Prometheus gauges (SGLang's registry, multiprocess mode), with
    ``--enable-metrics``; ``/metrics`` then shows ``sglang:hierasparse_*``."""

    DOCS = {
        "compressed_tokens": "Prefix tokens resident in the compressed store",
        "dense_tree_tokens": "Cached prefix tokens still in dense KV pages",
        "store_used_blocks": "Compressed blocks in use",
        "store_capacity_blocks": "Compressed blocks the store can hold",
        "bytes_saved": "KV bytes saved against keeping the compressed blocks dense",
        "blocks_compressed_total": "Blocks compressed since start",
        "prefixes_kept_dense_total": "Prefixes kept dense because the store was full",
        "tails_trimmed_total": "Dense tails cut off compressed prefixes to free dense pages",
        "blocks_evicted_for_dense_total": "Compressed blocks evicted to free dense pages",
        "blocks_evicted_for_store_total": "Compressed blocks evicted to make room in the store",
        "host_compressed_tokens": "Prefix tokens resident in the host tier's compressed store",
        "host_store_capacity_blocks": "Compressed blocks the host tier's store can hold",
        "blocks_backed_up_total": "Compressed blocks written to the host tier since start",
        "blocks_loaded_total": "Compressed blocks loaded back from the host tier since start",
        "blocks_evicted_from_host_total": "Compressed blocks evicted from the host tier since start",
    }

    def __init__(self, labels: dict[str, str], registry=None):
        from prometheus_client import REGISTRY, Gauge

        self.labels = labels
        self.gauges = {
            key: Gauge(f"sglang:hierasparse_{key}", doc, labelnames=list(labels), multiprocess_mode="mostrecent",
                       registry=registry or REGISTRY)  # fmt: skip
            for key, doc in self.DOCS.items()
        }

    def publish(self, status: dict[str, float]) -> None:
        for key, gauge in self.gauges.items():
            gauge.labels(**self.labels).set(status[key])


class CompressionStats:
    """Cumulative compression and eviction counters (the store reports what is resident now)."""

    def __init__(self):
        self.compressed_blocks = 0
        self.kept_dense_prefixes = 0
        self.trimmed_tails = 0
        self.node_splits = 0
        # Compressed blocks evicted from the GPU store, by what the eviction made room for (with the
        # hierarchical cache a block backed up on the host stays there).
        self.evicted_blocks = {"dense": 0, "store": 0}
        # The host tier (hierarchical cache): compressed blocks written to, loaded from, evicted from it.
        self.backed_up_blocks = 0
        self.loaded_blocks = 0
        self.host_evicted_blocks = 0


def check_store_when_idle(result, checker, *args, **kwargs):
    """AFTER hook on SGLang's idle pool check (``SchedulerInvariantChecker._check_all_pools``): the
    compressed store must account for every slot (free or owned by exactly one virtual block), and
    with the hierarchical cache the host tier too (``check_stores``); reported through SGLang's own
    leak path."""
    tree = checker.tree_cache
    if not isinstance(tree, HieraSparseRadixCache):
        return None
    has_leak, messages = result
    problem = tree.check_stores()
    if problem is None:
        return None
    return True, [*messages, problem]


STATUS_TREE_ATTR = "hierasparse_tree"
"""The ``PoolStats`` attribute that carries the tree from the pool observer to the log line."""


def tag_pool_stats(pool_stats, observer, *args, **kwargs) -> None:
    """AFTER hook on ``SchedulerPoolStatsObserver.get_pool_stats``: the stats it returns carry the
    scheduler's tree (the batch log line reads them, but sees no scheduler object)."""
    if isinstance(observer.tree_cache, HieraSparseRadixCache):
        setattr(pool_stats, STATUS_TREE_ATTR, observer.tree_cache)


def status_line_parts(result, pool_stats, *args, **kwargs) -> list[str] | None:
    """AFTER hook on ``PoolStats.get_{prefill,decode}_usage_msg_parts``: append the
    compressed-cache status to SGLang's batch log line."""
    tree = getattr(pool_stats, STATUS_TREE_ATTR, None)
    if tree is None:
        return None
    s = tree.status()
    parts = [
        f"#hs compressed token: {s['compressed_tokens']}",
        f"#hs dense prefix token: {s['dense_tree_tokens']}",
        f"hs store usage: {s['store_used_blocks'] / max(1, s['store_capacity_blocks']):.2f}",
        f"hs saved: {s['bytes_saved'] / 2**20:.1f} MiB",
    ]
    if s.get("host_store_capacity_blocks"):
        parts.append(f"#hs host compressed token: {s['host_compressed_tokens']}")
    counts = getattr(getattr(tree, "runtime", None), "shared_decode_counts", None)
    if counts is not None:  # shared-prefix decode: the share of decoded requests read through a column set
        grouped, decoded = counts.tolist()
        parts.append(f"hs shared-decode grouped: {grouped / max(1, decoded):.2f}")
    counts = getattr(getattr(tree, "runtime", None), "decode_mode_counts", None)
    if counts is not None:  # a decode mode: the share of compressed blocks the layers between anchors read
        kept, offered = counts.tolist()
        parts.append(f"hs decode-mode read: {kept / max(1, offered):.3f}")
    return list(result or []) + parts


def pool_demand(groups: list[tuple[torch.Tensor, float, float]], blocks: int) -> dict[str, int]:
    """Free slots per store pool that compressing ``blocks`` blocks takes: each group of blocks
    (prompt or generated, with its S_K and S_V) makes ``sparse_count`` of its blocks sparse, the
    same count the compressor's ranking picks, so the demand is exact before any block is ranked."""
    k_sparse = sum(sparse_count(int(mask.sum()), sk) for mask, sk, _ in groups)
    v_sparse = sum(sparse_count(int(mask.sum()), sv) for mask, _, sv in groups)
    return {"virtual": blocks, "k_sparse": k_sparse, "k_dense": blocks - k_sparse,
            "v_sparse": v_sparse, "v_dense": blocks - v_sparse}  # fmt: skip


def virtual_tokens(node: TreeNode) -> int:
    return getattr(node, "hs_virtual", 0)


def dense_tokens(node: TreeNode) -> int:
    return len(node.value) - virtual_tokens(node)


def mostly_dense(node: TreeNode) -> bool:
    return dense_tokens(node) >= virtual_tokens(node)


def node_start(node: TreeNode) -> int:
    """Token position where ``node``'s key starts (the length of its ancestors' keys)."""
    start, walk = 0, node.parent
    while walk is not None and walk.parent is not None:
        start += len(walk.key)
        walk = walk.parent
    return start
