"""The radix-cache hook's invariants, driving SGLang's real RadixCache, allocator and pools on CPU."""

from __future__ import annotations

import logging
from array import array
from types import SimpleNamespace

import pytest
import torch

from sglang_hs import reference as ref
from sglang_hs.config import HieraSparseConfig
from sglang_hs.pools import CompressedStore, StoreCapacity
from sglang_hs.sglang_compat import match_device_indices

pytestmark = pytest.mark.sglang

PAGE, HEADS, DIM, LAYERS = 64, 2, 64, 2
POOL_TOKENS = PAGE * 48


def sglang_pools(seed: int = 0, device: str = "cpu") -> SimpleNamespace:
    """SGLang's request pool, KV pool (random KV) and paged allocator, as a scheduler builds them."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    req_pool = ReqToTokenPool(size=4, max_context_len=4096, device=device, enable_memory_saver=False)
    kv = MHATokenToKVPool(POOL_TOKENS, page_size=PAGE, dtype=torch.float16, head_num=HEADS, head_dim=DIM,
                          layer_num=LAYERS, device=device, enable_memory_saver=False)  # fmt: skip
    # Drawn in float32 from a generator of its own (fp16 normal_ draws differ between torch releases).
    generator = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        for buffer in (kv.k_buffer[layer], kv.v_buffer[layer]):
            buffer.copy_(torch.randn(buffer.shape, generator=generator))
    allocator = PagedTokenToKVPoolAllocator(POOL_TOKENS, page_size=PAGE, dtype=torch.float16, device=device,
                                            kvcache=kv, need_sort=False)  # fmt: skip
    return SimpleNamespace(req_pool=req_pool, kv=kv, allocator=allocator)


@pytest.fixture
def env():
    """A tree over a real paged allocator and KV pool with random KV, plus a 1 MiB-per-block store."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sglang_hs.pools import VirtualSlots
    from sglang_hs.radix.hook import HieraSparseRadixCache
    from sglang_hs.runtime import HieraSparseRuntime

    def build(sk=1.0, sv=1.0, store_blocks=64, window=256, seed=0):
        pools = sglang_pools(seed)
        req_pool, kv, allocator = pools.req_pool, pools.kv, pools.allocator
        capacity = StoreCapacity(store_blocks, *(int(store_blocks * f) for f in (1 - sk, sk, 1 - sv, sv)))
        store = CompressedStore(capacity, LAYERS, HEADS, DIM, PAGE, torch.float16, "cpu")
        config = HieraSparseConfig(sk_prefill=sk, sv_prefill=sv, window_tokens=window)
        virtual = VirtualSlots(base=POOL_TOKENS + PAGE, block_size=PAGE)
        params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
                                 page_size=PAGE)  # fmt: skip
        tree = HieraSparseRadixCache(params, HieraSparseRuntime(config, store, virtual), kv.k_buffer, kv.v_buffer)
        return SimpleNamespace(tree=tree, allocator=allocator, store=store, kv=kv, req_pool=req_pool, virtual=virtual)

    return build


def key(tokens):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


def insert(e, tokens):
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    slots = e.allocator.alloc(len(tokens))
    snapshot = [(e.kv.k_buffer[l][slots].clone(), e.kv.v_buffer[l][slots].clone()) for l in range(LAYERS)]
    result = e.tree.insert(InsertParams(key=key(tokens), value=slots.clone()))
    e.allocator.free(slots[: result.prefix_len])  # as SGLang does: the tree already held these tokens
    return slots, snapshot


def match(e, tokens):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    return e.tree.match_prefix(MatchPrefixParams(key=key(tokens)))


def hit(e, tokens):
    """The device slots of the cached prefix of ``tokens``."""
    return match_device_indices(e.tree, match(e, tokens))


def balanced(e) -> bool:
    """SGLang's idle check: every dense slot is free, evictable or protected."""
    t = e.tree
    return e.allocator.available_size() + t.evictable_size() + t.protected_size() == POOL_TOKENS


def test_insert_compresses_middle_blocks_and_frees_their_pages(env):
    e = env()
    slots, _ = insert(e, list(range(1000, 2024)))  # 16 blocks: sink 1, window 4 -> 11 compressed
    node = next(iter(e.tree.root_node.children.values()))
    virtual = e.virtual.mask(node.value)
    assert virtual.tolist() == [False] * 64 + [True] * 11 * 64 + [False] * 256
    assert e.allocator.available_size() == POOL_TOKENS - 1024 + 11 * 64
    assert e.store.used_blocks() == 11 and e.tree.evictable_size() == 320
    assert balanced(e)
    # Invariant 1: no slot the tree still holds is free in the allocator.
    free_pages = set(e.allocator.free_pages.tolist())
    assert not free_pages & set((node.value[~virtual] // PAGE).tolist())
    assert free_pages >= set((slots[virtual] // PAGE).tolist())


def test_matching_request_reads_compressed_copy(env):
    e = env(sk=0.5, sv=1.0)
    tokens = list(range(5000, 5000 + 1000))  # 15 full blocks + 40 tokens: only 960 tokens enter the tree
    _, snapshot = insert(e, tokens)
    result = match(e, tokens)
    row = match_device_indices(e.tree, result)
    assert len(row) == 960 and int(e.virtual.mask(row).sum()) == 10 * 64
    table = e.virtual.block_table(row[None])
    assert (table[0, 1:11] < 0).all() and (table[0, [0, 11, 12, 13, 14]] >= 0).all()
    # Attention over the block table equals dense attention over the pruned original KV.
    q = torch.randn(3, 4 * HEADS, DIM).half()
    for layer in range(LAYERS):
        pools = e.store.layer_pools(layer)
        out, lse = ref.paged_attention(q, [0, 3], e.kv.k_buffer[layer], e.kv.v_buffer[layer], pools,
                                       e.store.k_index, e.store.v_index, table, [960])  # fmt: skip
        k, v = snapshot[layer]
        pruned = ref.gather_paged_sequence(e.kv.k_buffer[layer], e.kv.v_buffer[layer], pools, e.store.k_index,
                                           e.store.v_index, table[0], 960)  # fmt: skip
        pruned_k, pruned_v = ref.decompress(pruned)
        dense_blocks = [0, 11, 12, 13, 14]
        for b in dense_blocks:  # sink and window blocks are the original values
            assert torch.equal(pruned_k[b * 64 : (b + 1) * 64], k[b * 64 : (b + 1) * 64])
        assert ((pruned_v[64:704] == 0).float().mean() - 0.5).abs() < 0.01  # S_V = 1: V is 2:4 everywhere
        expected, expected_lse = ref.dense_attention(q, pruned_k, pruned_v)
        assert torch.allclose(out.float(), expected.float(), atol=1e-3)
        assert torch.allclose(lse, expected_lse, atol=1e-4)


def test_split_lock_evict_and_flush_return_every_slot(env, caplog):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    e = env()
    start_free, start_store = e.allocator.available_size(), e.store.free_counts()
    base = list(range(100, 1124))
    insert(e, base)
    # A second prompt diverges inside the compressed region (after 8 blocks): the node splits.
    insert(e, base[:512] + list(range(7000, 7512)))
    assert balanced(e)
    result = match(e, base[:600])
    assert len(match_device_indices(e.tree, result)) == 576
    e.tree.inc_lock_ref(result.last_device_node)
    assert balanced(e) and e.tree.protected_size() == 64  # only the sink page of the locked path is dense
    e.tree.evict(EvictParams(num_tokens=10**6))  # the locked path survives
    assert balanced(e) and e.store.used_blocks() == 8
    e.tree.dec_lock_ref(result.last_device_node)
    e.tree.evict(EvictParams(num_tokens=10**6))
    assert e.allocator.available_size() == start_free and e.store.free_counts() == start_store
    assert e.store.check() is None
    # /flush_cache: reset + allocator.clear also empties the store.
    insert(e, base)
    with caplog.at_level(logging.INFO, logger="sglang_hs.radix.hook"):
        e.tree.reset()
    assert "the store held 11 compressed blocks, all owned by the tree" in caplog.text
    e.allocator.clear()
    assert e.allocator.available_size() == start_free and e.store.free_counts() == start_store
    # A store block that no tree node holds is reported as a leak at the next reset.
    insert(e, base)
    e.store.allocate([True], [True])
    with caplog.at_level(logging.INFO, logger="sglang_hs.radix.hook"):
        e.tree.reset()
    assert "compressed store leak: 12 blocks in use at reset, the tree held 11" in caplog.text


def test_eviction_for_dense_pages_spares_compressed_prefixes(env):
    """Mostly dense leaves go before compressed ones, even more recent ones; then compressed leaves
    lose only their dense tail (the window); whole compressed leaves go last."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    e = env()
    start_free, start_store = e.allocator.available_size(), e.store.free_counts()
    prefix = list(range(100, 1124))
    insert(e, prefix)  # older: sink page, 11 compressed blocks, 256-token window
    insert(e, list(range(9000, 9256)))  # newer: 256 tokens, all within sink + window: dense only
    result = e.tree.evict(EvictParams(num_tokens=64))
    assert result.num_tokens_evicted == 256
    assert e.store.used_blocks() == 11 and len(hit(e, prefix)) == 1024
    assert len(hit(e, list(range(9000, 9256)))) == 0 and balanced(e)
    # Only a compressed leaf left: its window is cut off; the sink and the compressed blocks stay.
    result = e.tree.evict(EvictParams(num_tokens=64))
    assert result.num_tokens_evicted == 256 and e.store.used_blocks() == 11
    found = hit(e, prefix)
    assert len(found) == 768 and int(e.virtual.mask(found).sum()) == 11 * 64 and balanced(e)
    status = e.tree.status()
    assert status["tails_trimmed_total"] == 1 and status["blocks_evicted_for_dense_total"] == 0
    # No tail left to cut: the next request for dense pages evicts the leaf and its blocks.
    result = e.tree.evict(EvictParams(num_tokens=64))
    assert result.num_tokens_evicted == 64 and e.store.used_blocks() == 0
    assert e.tree.status()["blocks_evicted_for_dense_total"] == 11
    assert e.allocator.available_size() == start_free and e.store.free_counts() == start_store and balanced(e)


def test_trimmed_prefix_keeps_its_age_and_is_extended_again(env):
    """Cutting a tail is no use of the prefix: the compressed part keeps the leaf's access time, so
    LRU order holds. A later hit prefills the cut window again, below the compressed part."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    e = env()
    prefix = list(range(3000, 4024))
    insert(e, prefix)
    leaf = next(iter(e.tree.root_node.children.values()))
    accessed = leaf.last_access_time
    e.tree.evict(EvictParams(num_tokens=256))
    kept = next(iter(e.tree.root_node.children.values()))
    assert kept is not leaf and len(kept.key) == 768 and kept.last_access_time == accessed
    assert e.tree.dense_tail(kept) == 0 and kept in e.tree.evictable_leaves
    insert(e, prefix + list(range(8000, 8128)))  # the hit's own window and tokens enter below it
    assert len(hit(e, prefix)) == 1024 and balanced(e) and e.store.check() is None


def test_eviction_prefers_a_mostly_dense_suffix_to_a_compressed_prefix(env):
    """A request's suffix below a shared prefix (320 tokens: one block compressed, 256 dense) goes
    before an older compressed prefix."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    e = env()
    older, shared = list(range(100, 1124)), list(range(3000, 4024))
    insert(e, older)
    insert(e, shared)
    insert(e, shared + list(range(8000, 8320)))  # the suffix leaf: 1 compressed block + 256 dense tokens
    used = e.store.used_blocks()
    result = e.tree.evict(EvictParams(num_tokens=64))
    assert result.num_tokens_evicted == 256 and e.store.used_blocks() == used - 1
    assert len(hit(e, older)) == 1024 and len(hit(e, shared)) == 1024
    assert balanced(e)


class RequestDriver:
    """A request whose tokens enter the tree the way the installed SGLang's scheduler inserts them
    (``sglang_compat.request_insert_method``): SGLang 0.5.17 ``cache_unfinished_req`` after a prefill
    chunk and ``cache_finished_req`` at the finish; SGLang 0.5.23 ``checkpoint`` at both, then the
    release of the row past the tree's part and of the request's lock (``release_kv_cache``)."""

    def __init__(self, e, prompt: list[int]):
        from sglang_hs.sglang_compat import request_insert_method

        self.e, self.checkpoints = e, request_insert_method() == "checkpoint"
        req = SimpleNamespace(origin_input_ids=array("q", prompt), output_ids=array("q"), extra_key=None,
                              cache_salt=None, priority=0, last_node=e.tree.root_node, lock=None)  # fmt: skip
        if self.checkpoints:
            from sglang.srt.managers.schedule_batch import ReqKvInfo

            req.kv = ReqKvInfo()
        else:
            for name, value in dict(cache_protected_len=0, inflight_middle_chunks=0, kv_committed_len=0,
                                    req_pool_idx=None, prefix_indices=torch.empty(0, dtype=torch.int64)).items():
                setattr(req, name, value)
        req.get_fill_ids = lambda: req.origin_input_ids + req.output_ids
        self.req = req
        e.req_pool.alloc([req])

    @property
    def row(self) -> int:
        return self.req.kv.req_pool_idx if self.checkpoints else self.req.req_pool_idx

    def compute(self, start: int, end: int) -> None:
        """The KV of positions ``start:end`` is written to new slots of the request's row."""
        slots = self.e.allocator.alloc(end - start)
        self.e.req_pool.write((self.row, slice(start, end)), slots.to(torch.int32))
        if self.checkpoints:
            self.req.kv.kv_allocated_len = self.req.kv.kv_committed_len = end

    def chunk_done(self, end: int) -> None:
        if self.checkpoints:
            self.req.full_untruncated_fill_ids = self.req.get_fill_ids()
            self.e.tree.checkpoint(self.req, up_to=end)
        else:
            self.e.tree.cache_unfinished_req(self.req)

    def finish(self, end: int) -> None:
        tree = self.e.tree
        if self.checkpoints:
            self.chunk_done(end)
            tree.free_kv_row(self.req.kv, [(self.req.kv.cache_protected_len, end)])
            tree.unlock(self.req.lock)
        else:
            tree.cache_finished_req(self.req, kv_len_to_handle=end)


def test_finished_request_rows_and_generated_blocks(env):
    """A running request's insert rewrites its row to the compressed copy; its finish compresses
    generated tokens with the decode sparsity."""
    e = env(sk=0.0, sv=1.0, window=128)
    driver = RequestDriver(e, list(range(300, 300 + 640)))
    driver.compute(0, 640)
    e.tree.inc_lock_ref(e.tree.root_node)
    driver.chunk_done(640)
    row = e.req_pool.req_to_token[driver.row, :640]
    assert int(e.virtual.mask(row).sum()) == 7 * 64  # blocks 1..7 of 10 (sink 1, window 2)
    assert balanced(e) and e.tree.protected_size() == 640 - 7 * 64
    # The request generates 256 tokens and finishes: blocks 10..13 enter the tree and the two before
    # the 128-token window are compressed, with the decode sparsity.
    driver.req.output_ids = array("q", range(9000, 9256))
    driver.compute(640, 896)
    driver.finish(896)
    assert e.store.used_blocks() == 7 + 2
    assert balanced(e) and e.tree.protected_size() == 0
    status = e.tree.status()
    assert status["compressed_tokens"] == 9 * 64 and status["dense_tree_tokens"] == 896 - 9 * 64
    assert status["bytes_saved"] > 0


def test_prometheus_gauges_follow_the_store(env):
    from prometheus_client import CollectorRegistry

    from sglang_hs.radix.hook import PrometheusGauges

    e = env()
    registry = CollectorRegistry()
    e.tree.enable_metrics(PrometheusGauges({"cache_type": "test"}, registry=registry))
    value = lambda name: registry.get_sample_value(f"sglang:hierasparse_{name}", {"cache_type": "test"})
    assert value("store_used_blocks") == 0 and value("store_capacity_blocks") == e.tree.store.capacity.virtual_blocks
    insert(e, list(range(1000, 2024)))
    assert value("compressed_tokens") == 11 * 64 and value("blocks_compressed_total") == 11
    assert value("bytes_saved") > 0
    e.tree.reset()
    assert value("compressed_tokens") == 0


def test_tensor_parallel_ranks_stay_in_step(env):
    """Two trees fed the same requests over different KV (two tensor-parallel ranks hold different
    heads), at a fractional S_K. Ranked by its own heads' losses, each rank makes different blocks
    sparse, so evicting part of a node frees different sparse/dense pool counts and the ranks drift
    apart. With the losses summed over the ranks (the runtime's all-reduce, simulated here by two
    threads meeting at a barrier) both pick the same blocks, and the ``tree state`` line each rank logs
    at a flush stays equal through splits, tail trims and evictions."""
    import threading
    from functools import partial

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_hs.pools import compress_prefix

    def run_ranks(reduce: bool) -> list:
        ranks = [env(sk=0.5, sv=1.0, store_blocks=30, seed=seed) for seed in (0, 2)]
        deposit, barrier = [None, None], threading.Barrier(2)

        def all_reduce(rank: int, losses: torch.Tensor) -> torch.Tensor:
            deposit[rank] = losses.clone()
            barrier.wait()
            total = deposit[0] + deposit[1]
            barrier.wait()
            return total

        def serve(rank: int) -> None:
            e = ranks[rank]
            if reduce:
                e.tree.runtime.compress_prefix = partial(compress_prefix, reduce_losses=partial(all_reduce, rank))
            for start in (100, 3000, 5000):  # the store holds two prefixes: the third evicts one
                insert(e, list(range(start, start + 1024)))
            insert(e, list(range(3000, 3512)) + list(range(7000, 7640)))  # splits the second prefix
            e.tree.evict(EvictParams(num_tokens=300))  # trims a tail, evicts part of a split node

        threads = [threading.Thread(target=serve, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert all(balanced(e) and e.store.check() is None for e in ranks)
        return ranks

    own = run_ranks(reduce=False)
    assert own[0].tree.rank_state() != own[1].tree.rank_state()  # pool counts drift apart
    ranks = run_ranks(reduce=True)
    placements = [{vb: p.k_sparse for vb, p in e.store.placements().items()} for e in ranks]
    assert placements[0] == placements[1] and any(placements[0].values()) and not all(placements[0].values())
    states = [e.tree.rank_state() for e in ranks]
    assert states[0] == states[1] and "splits=2 " in states[0] and "evicted_for_store=11 " in states[0]
    ranks[1].tree.evict(EvictParams(num_tokens=64))
    assert ranks[1].tree.rank_state() != states[0]


def test_fractional_sparsity_evicts_for_the_pool_that_runs_out(env):
    """At S_K = 0.5 a prefix of 5 compressible blocks takes 3 sparse-K and 2 dense-K slots, so the
    sparse-K pool runs out while virtual blocks are still free. The next prefix must evict the
    least recently used compressed prefix, not stay dense."""
    e = env(sk=0.5, sv=1.0, store_blocks=20)  # 10 sparse-K slots, 10 dense-K slots
    prefixes = [list(range(start, start + 640)) for start in (100, 2000, 4000, 6000)]  # 10 blocks: 5 compressed
    for tokens in prefixes[:3]:
        insert(e, tokens)
    free = e.store.free_counts()
    assert free["virtual"] == 5 and free["k_sparse"] == 1  # room for a 4th prefix but for its sparse K
    insert(e, prefixes[3])
    status = e.tree.status()
    assert status["prefixes_kept_dense_total"] == 0 and status["blocks_evicted_for_store_total"] == 5
    assert len(hit(e, prefixes[0])) == 0  # the oldest prefix made room
    found = hit(e, prefixes[3])
    assert len(found) == 640 and int(e.virtual.mask(found).sum()) == 5 * 64
    assert balanced(e) and e.store.check() is None
