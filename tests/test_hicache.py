"""The compressed radix cache on SGLang's hierarchical cache, driving SGLang's real HiRadixCache,
HiCacheController, MHA host pool, paged allocator and KV pool on CPU.

Faked on CPU, because they need a GPU: pinned host allocation (``cudaHostRegister``) and SGLang's
dense host<->device copy kernels (``sgl_kernel.kvcacheio``), replaced by ``torch`` indexing over the
same index tensors. CUDA streams and events are SGLang's own CPU stand-ins (``torch.cpu``). The
compressed rows move through the product's own CPU path (``sglang_hs.transfer``). The ``gpu`` tests
run the same round trip with nothing faked: SGLang's kernels and streams, and the kernel path of
``sglang_hs.transfer`` on pinned host memory."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
import torch

from sglang_hs import reference as ref
from sglang_hs.config import HieraSparseConfig
from sglang_hs.pools import CompressedStore, StoreCapacity
from sglang_hs.sglang_compat import has_hiradix_cache, sglang_version
from test_radix_hook import DIM, HEADS, LAYERS, PAGE, POOL_TOKENS, balanced, insert, match, sglang_pools

pytestmark = pytest.mark.sglang

NO_HIRADIX = (f"sglang {sglang_version()} has no HiRadixCache (HiCache moved onto UnifiedRadixCache), which the "
              "compressed host tier extends; hierasparse refuses --enable-hierarchical-cache there")  # fmt: skip
needs_hiradix = pytest.mark.skipif(not has_hiradix_cache(), reason=NO_HIRADIX)

TOKEN_BYTES = HEADS * DIM * LAYERS * 2 * 2
"""K and V of one token in every layer and head (fp16)."""

HEAD_MAP = torch.tensor([[True, False], [False, False]])
"""A K head map of the test shape (2 layers of 2 KV heads): one head 2:4 in layer 0, none in layer 1."""


# --------------------------------------------------------------------------------------- fakes
def unpinned_host_alloc(dims, dtype, device, pin_memory, allocator):
    """Stands in for SGLang's pinned host allocation (``cudaHostRegister`` needs a GPU)."""
    return torch.zeros(dims, dtype=dtype, device=device)


def torch_backup_all_layers(host_pool, device_pool, host_indices, device_indices, io_backend):
    """Stands in for SGLang's device->host copy kernels (layer_first layout)."""
    for layer in range(host_pool.layer_num):
        host_pool.k_buffer[layer][host_indices] = device_pool.k_buffer[layer][device_indices]
        host_pool.v_buffer[layer][host_indices] = device_pool.v_buffer[layer][device_indices]


def torch_load_one_layer(host_pool, device_pool, host_indices, device_indices, layer_id, io_backend):
    """Stands in for SGLang's host->device copy kernels (layer_first layout)."""
    device_pool.k_buffer[layer_id][device_indices] = host_pool.k_buffer[layer_id][host_indices]
    device_pool.v_buffer[layer_id][device_indices] = host_pool.v_buffer[layer_id][host_indices]


def hicache_server_args(hicache_size: float, policy: str = "write_through", layout: str = "layer_first"):
    """The server arguments HiRadixCache reads (on CPU the layer_first layout: the fakes above copy it)."""
    return SimpleNamespace(
        hicache_ratio=2.0, hicache_size=hicache_size, hicache_mem_layout=layout, hicache_io_backend="kernel",
        hicache_write_policy=policy, hicache_storage_backend=None, hicache_storage_backend_extra_config=None,
        hicache_storage_prefetch_policy="timeout", extra_metric_labels=None, served_model_name="test",
    )  # fmt: skip


def resolved_server_args(**fields):
    """A real ``ServerArgs`` in its resolved (read-only) state, holding only ``fields``."""
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs.__new__(ServerArgs)
    for name, value in fields.items():
        object.__setattr__(args, name, value)
    object.__setattr__(args, "_declarations_materialized", True)
    return args


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """HiRadixCache asks torch.distributed for its TP group's size: a one-process gloo group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("dist") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def hienv(one_rank, monkeypatch):
    """A hierarchical tree over SGLang's real pools, with a host tier of ``host_tokens`` dense host
    slots and ``host_blocks`` compressed host blocks."""
    if not has_hiradix_cache():
        pytest.skip(NO_HIRADIX)
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.pool_host import mha

    from sglang_hs.pools import VirtualSlots
    from sglang_hs.radix.hicache import HieraSparseHiRadixCache
    from sglang_hs.runtime import HieraSparseRuntime

    def build(sk=1.0, sv=1.0, store_blocks=64, host_blocks=64, host_tokens=64 * 20, policy="write_through", seed=0,
              device="cpu", layout="layer_first", k_sparse_heads=None):  # fmt: skip
        if device == "cpu":
            monkeypatch.setitem(mha.ALLOC_MEMORY_FUNCS, "cpu", unpinned_host_alloc)
            monkeypatch.setattr(mha.MHATokenToKVPoolHost, "backup_from_device_all_layer", torch_backup_all_layers)
            monkeypatch.setattr(mha.MHATokenToKVPoolHost, "load_to_device_per_layer", torch_load_one_layer)
        pools = sglang_pools(seed, device)
        req_pool, kv, allocator = pools.req_pool, pools.kv, pools.allocator

        def capacity(blocks):
            return StoreCapacity(blocks, *(int(blocks * f) for f in (1 - sk, sk, 1 - sv, sv)))

        store = CompressedStore(capacity(store_blocks), LAYERS, HEADS, DIM, PAGE, torch.float16, device,
                                k_sparse_heads=k_sparse_heads)  # fmt: skip
        config = HieraSparseConfig(sk_prefill=sk, sv_prefill=sv)
        virtual = VirtualSlots(base=POOL_TOKENS + PAGE, block_size=PAGE)
        params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
                                 page_size=PAGE)  # fmt: skip
        server_args = hicache_server_args((host_tokens - PAGE) * TOKEN_BYTES / 1e9, policy, layout)
        runtime = HieraSparseRuntime(config, store, virtual)
        tree = HieraSparseHiRadixCache(params, server_args, runtime, kv.k_buffer, kv.v_buffer, capacity(host_blocks))
        return SimpleNamespace(tree=tree, allocator=allocator, store=store, kv=kv, req_pool=req_pool, virtual=virtual,
                               host=tree.token_to_kv_pool_host, host_store=tree.host_store)  # fmt: skip

    return build


# --------------------------------------------------------------------------------------- helpers
def only_child(e):
    return next(iter(e.tree.root_node.children.values()))


def store_rows(store: CompressedStore, vb: int) -> list[torch.Tensor]:
    """Every pool row of virtual block ``vb`` in every layer, read through its K index map (per layer
    with a K head map) and V index map: K and V of each head as the kernels would find them."""
    rows = []
    for layer in range(store.num_layers):
        pools = store.layer_pools(layer)
        for operand, index in (("k", store.k_index_of(layer)), ("v", store.v_index)):
            for entry in index[:, vb].tolist():
                if entry >= 0:
                    rows.append(getattr(pools, f"{operand}_dense")[entry].to("cpu", copy=True))
                else:
                    rows += [getattr(pools, f"{operand}_{part}")[~entry].to("cpu", copy=True) for part in ("values", "meta")]
    return rows


def blocks_of(slots: torch.Tensor, virtual) -> list[int]:
    """Virtual blocks of ``slots``, in token order."""
    starts = slots[virtual.mask(slots)][::PAGE]
    return ((starts - virtual.base) // PAGE).tolist()


def attend(e, row: torch.Tensor, q: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Reference attention of ``q`` over the block table of ``row`` (a matched prefix), per layer."""
    table = e.virtual.block_table(row[None])
    return [ref.paged_attention(q, [0, q.shape[0]], e.kv.k_buffer[layer], e.kv.v_buffer[layer],
                                e.store.layer_pools(layer), e.store.k_index_of(layer), e.store.v_index, table, [len(row)])
            for layer in range(LAYERS)]  # fmt: skip


def load_hit(e, tokens):
    """What the scheduler does for a host hit: match, init_load_back, start the transfer, acknowledge it."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    result = match(e, tokens)
    if result.host_hit_length == 0:
        return result.device_indices
    loaded, _ = e.tree.init_load_back(InitLoadBackParams(best_match_node=result.best_match_node,
                                                         host_hit_length=result.host_hit_length))  # fmt: skip
    e.tree.ready_to_load_host_cache()
    synchronize()
    e.tree.loading_check()
    return torch.cat([result.device_indices, loaded])


def synchronize() -> None:
    """Let the transfer streams finish (SGLang's checks only take acknowledgements whose events are done)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_consistent(e) -> bool:
    return e.host_store.check() is None and e.tree.check_stores() is None


# --------------------------------------------------------------------------------------- tests
def test_write_through_copies_exactly_the_compressed_rows(hienv):
    e = hienv(sk=0.5, sv=1.0)
    tokens = list(range(1000, 2024))  # 16 blocks: sink 1, window 4 -> 11 compressed
    insert(e, tokens)
    node = only_child(e)
    assert node.backuped and node.lock_ref == 1  # write-through: locked until the copy is acknowledged
    e.tree.writing_check()
    assert node.lock_ref == 0 and balanced(e)
    dev_virtual, host_virtual = e.virtual.mask(node.value), e.tree.host_virtual.mask(node.host_value)
    assert torch.equal(dev_virtual, host_virtual) and int(host_virtual.sum()) == 11 * PAGE
    assert e.host_store.used_blocks() == 11 and e.host.used_dense_slots() == 1024 - 11 * PAGE
    for dev_vb, host_vb in zip(blocks_of(node.value, e.virtual), blocks_of(node.host_value, e.tree.host_virtual)):
        dp, hp = e.store.placement(dev_vb), e.host_store.placement(host_vb)
        assert (dp.k_sparse, dp.v_sparse) == (hp.k_sparse, hp.v_sparse)
        assert all(torch.equal(a, b) for a, b in zip(store_rows(e.store, dev_vb), store_rows(e.host_store, host_vb)))
    dense_dev, dense_host = node.value[~dev_virtual], node.host_value[~host_virtual]
    for layer in range(LAYERS):
        assert torch.equal(e.host.k_buffer[layer][dense_host], e.kv.k_buffer[layer][dense_dev])
        assert torch.equal(e.host.v_buffer[layer][dense_host], e.kv.v_buffer[layer][dense_dev])
    # Host bytes of the compressed blocks: S_K = 0.5 (6 of 11 K blocks sparse), S_V = 1.
    dense_bytes = 2 * 11 * PAGE * DIM * 2 * HEADS * LAYERS
    assert e.host_store.stored_bytes() == e.store.stored_bytes() < dense_bytes / 1.28
    assert e.tree.status()["blocks_backed_up_total"] == 11 and host_consistent(e)


def test_device_eviction_keeps_the_host_copy_and_frees_store_blocks(hienv):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    e = hienv()
    start_free, start_store = e.allocator.available_size(), e.store.free_counts()
    tokens = list(range(1000, 2024))
    insert(e, tokens)
    e.tree.writing_check()
    e.tree.evict(EvictParams(num_tokens=10**6))
    node = only_child(e)
    assert node.evicted and node.backuped and e.tree.host_virtual_tokens(node) == 11 * PAGE
    assert e.allocator.available_size() == start_free and e.store.free_counts() == start_store
    assert e.host_store.used_blocks() == 11 and balanced(e) and host_consistent(e)
    result = match(e, tokens)
    assert len(result.device_indices) == 0 and result.host_hit_length == 1024


def check_round_trip(e) -> None:
    """Write a prefix through to the host, evict its GPU copy, let others reuse and overwrite the
    freed slots, hit it again: its compressed blocks come back bit-identical (pool rows and placement
    kinds) into fresh virtual slots, its dense pages too, and attention equals attention before."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    tokens = list(range(1000, 2024))
    insert(e, tokens)
    synchronize()
    e.tree.writing_check()
    before = match(e, tokens).device_indices
    old_blocks, dense = blocks_of(before, e.virtual), before[~e.virtual.mask(before)]
    rows_before = [store_rows(e.store, vb) for vb in old_blocks]
    kinds_before = [e.store.placement(vb)[::2] for vb in old_blocks]
    dense_before = [(e.kv.k_buffer[layer][dense].clone(), e.kv.v_buffer[layer][dense].clone())
                    for layer in range(LAYERS)]  # fmt: skip
    q = torch.randn(5, 2 * HEADS, DIM, device=before.device).half()
    expected = attend(e, before, q)
    e.tree.evict(EvictParams(num_tokens=10**6))
    for tensors in (e.store.k_dense, e.store.k_values, e.store.v_dense, e.store.v_values, e.kv.k_buffer, e.kv.v_buffer):
        for t in tensors:
            t.normal_()
    for tensors in (e.store.k_meta, e.store.v_meta):
        for t in tensors:
            t.random_(-(2**15), 2**15)
    taken = e.store.allocate([True, True], [True, True])  # and some blocks are taken: the load gets other slots
    after = load_hit(e, tokens)
    assert len(after) == 1024 and torch.equal(e.virtual.mask(after), e.virtual.mask(before))
    new_blocks = blocks_of(after, e.virtual)
    assert new_blocks != old_blocks  # fresh virtual slots
    assert [e.store.placement(vb)[::2] for vb in new_blocks] == kinds_before
    for vb, old in zip(new_blocks, rows_before):
        assert all(torch.equal(a, b) for a, b in zip(store_rows(e.store, vb), old))
    dense_after = after[~e.virtual.mask(after)]
    for layer, (k, v) in enumerate(dense_before):
        assert torch.equal(e.kv.k_buffer[layer][dense_after], k) and torch.equal(e.kv.v_buffer[layer][dense_after], v)
    for (out, lse), (out0, lse0) in zip(attend(e, after, q), expected):
        assert torch.equal(out, out0) and torch.equal(lse, lse0)
    node = only_child(e)
    assert not node.evicted and node.lock_ref == 0 and e.tree.status()["blocks_loaded_total"] == 11
    e.store.free(taken)
    assert balanced(e) and e.tree.evictable_size() == 1024 - 11 * PAGE and host_consistent(e)


def test_host_hit_restores_blocks_bit_identically_and_attention_matches(hienv):
    check_round_trip(hienv(sk=0.5, sv=1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("layout,mapped", [("layer_first", False), ("page_first", False), ("page_head", False),
                                           ("layer_first", True)])
def test_gpu_round_trip_through_sglang_kernels(hienv, layout, mapped):
    """Nothing faked: SGLang's streams, events and dense copy kernels, the compressed rows through
    SGLang's item-copy kernels on a pinned host store (with a K head map: one launch per distinct
    rows-per-slot count, the dense heads of sparse-K blocks from the tail of ``k_dense``)."""
    e = hienv(sk=1.0 if mapped else 0.5, sv=1.0, device="cuda", layout=layout,
              k_sparse_heads=HEAD_MAP if mapped else None)  # fmt: skip
    assert e.host_store.k_dense[0].is_pinned() and e.host_store.v_values[1].is_pinned()
    check_round_trip(e)


@pytest.mark.gpu
def test_gpu_block_copy_kernels_match_torch():
    """``copy_blocks`` on a GPU store and a pinned host store (all layers, then one layer) moves the
    same rows as the CPU path."""
    from sglang_hs.transfer import copy_blocks, plan_block_copy

    capacity = StoreCapacity(8, 4, 4, 0, 8)
    gpu = CompressedStore(capacity, LAYERS, HEADS, DIM, PAGE, torch.float16, "cuda")
    host = CompressedStore(capacity, LAYERS, HEADS, DIM, PAGE, torch.float16, "cpu",
                           allocate=lambda shape, dtype: torch.zeros(shape, dtype=dtype, pin_memory=True))
    for name in ("k_dense", "k_values", "v_values"):
        for t in getattr(gpu, name):
            t.normal_()
    for name in ("k_meta", "v_meta"):
        for t in getattr(gpu, name):
            t.random_(-(2**15), 2**15)
    kinds = ([True, False, True], [True, True, True])
    src, dst = gpu.allocate(*kinds), host.allocate(*kinds)
    copy_blocks(gpu, host, plan_block_copy(gpu, src, host, dst))
    torch.cuda.synchronize()
    for a, b in zip(src, dst):
        assert all(torch.equal(x, y) for x, y in zip(store_rows(gpu, a), store_rows(host, b)))
    back = gpu.allocate(*kinds)
    for layer in range(LAYERS):
        copy_blocks(host, gpu, plan_block_copy(host, dst, gpu, back), layer)
    torch.cuda.synchronize()
    for a, b in zip(src, back):
        assert all(torch.equal(x, y) for x, y in zip(store_rows(gpu, a), store_rows(gpu, b)))


def test_host_eviction_frees_host_slots(hienv):
    """The host holds two prefixes' compressed blocks: backing up a third evicts the least recently
    used host-only prefix, whole (dense host slots and compressed blocks)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    e = hienv(host_blocks=24)
    prefixes = [list(range(start, start + 1024)) for start in (100, 3000, 6000)]
    for tokens in prefixes[:2]:
        insert(e, tokens)
        e.tree.writing_check()
    e.tree.evict(EvictParams(num_tokens=10**6))  # both host-only now
    assert e.host_store.used_blocks() == 22
    insert(e, prefixes[2])
    e.tree.writing_check()
    assert match(e, prefixes[0]).host_hit_length == 0  # the oldest is gone from both tiers
    assert match(e, prefixes[1]).host_hit_length == 1024 and len(match(e, prefixes[2]).device_indices) == 1024
    assert e.host_store.used_blocks() == 22 and e.host.used_dense_slots() == 2 * 320
    assert e.tree.status()["blocks_evicted_from_host_total"] == 11 and host_consistent(e) and balanced(e)


def test_flush_empties_both_tiers(hienv, caplog):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    e = hienv()
    start_free, start_store, start_host = e.allocator.available_size(), e.store.free_counts(), e.host.available_size()
    insert(e, list(range(100, 1124)))
    insert(e, list(range(3000, 4024)))
    e.tree.writing_check()
    e.tree.evict(EvictParams(num_tokens=400))  # both windows go to the host only
    with caplog.at_level(logging.INFO, logger="sglang_hs.radix.hicache"):
        e.tree.reset()
    assert "host tier at reset: 22 compressed blocks and 640 dense tokens, all owned by the tree" in caplog.text
    e.allocator.clear()
    assert e.allocator.available_size() == start_free and e.store.free_counts() == start_store
    assert e.host.available_size() == start_host and e.host_store.used_blocks() == 0 and balanced(e)


def test_idle_check_covers_the_host_tier(hienv):
    from sglang_hs.radix.hook import check_store_when_idle

    e = hienv()
    insert(e, list(range(100, 1124)))
    e.tree.writing_check()
    checker = SimpleNamespace(tree_cache=e.tree)
    assert check_store_when_idle((False, []), checker) is None
    e.host_store.allocate([True], [True])  # a host block no node owns
    leak, messages = check_store_when_idle((False, []), checker)
    assert leak and messages == ["hierarchical cache host leak: the host holds 320 dense tokens and 12 compressed "
                                 "blocks, the tree 320 and 11"]


def test_write_back_backs_up_on_eviction_and_loads_back(hienv):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    e = hienv(policy="write_back")
    start_free, start_store = e.allocator.available_size(), e.store.free_counts()
    tokens = list(range(1000, 2024))
    insert(e, tokens)
    assert not only_child(e).backuped and e.host_store.used_blocks() == 0
    e.tree.evict(EvictParams(num_tokens=10**6))
    node = only_child(e)
    assert node.evicted and node.backuped and node.host_ref_counter == 0
    assert e.allocator.available_size() == start_free and e.store.free_counts() == start_store
    assert e.host_store.used_blocks() == 11 and balanced(e) and host_consistent(e)
    assert len(load_hit(e, tokens)) == 1024 and e.store.used_blocks() == 11 and balanced(e)


def test_load_back_makes_room_in_the_store(hienv):
    """A host hit whose blocks do not fit the GPU store evicts the least recently used compressed
    device leaf (to the host: it was written through) instead of failing."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    e = hienv(store_blocks=24)
    a, b, c = (list(range(start, start + 1024)) for start in (100, 3000, 6000))
    insert(e, a)
    insert(e, b)
    e.tree.writing_check()
    e.tree.evict(EvictParams(num_tokens=10**6))  # a and b on the host only
    load_hit(e, b)
    insert(e, c)  # the store holds b and c now
    e.tree.writing_check()
    assert e.store.free_counts()["virtual"] == 2
    assert len(load_hit(e, a)) == 1024  # needs 11 blocks: b (least recently used) goes to the host
    assert match(e, b).host_hit_length == 1024 and len(match(e, c).device_indices) == 1024
    assert balanced(e) and e.store.check() is None and host_consistent(e)


def random_operations(e, seed: int, steps: int):
    """Random inserts (shared prefixes, divergent suffixes), host hits, partial evictions and late
    write acknowledgements; yields (step, operation) after each."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    rng = random.Random(seed)
    bases = [list(range(s, s + 64 * rng.randint(6, 14))) for s in range(10_000, 70_000, 10_000)]
    for step in range(steps):
        op = rng.choice(["insert", "insert", "hit", "evict", "ack"])
        tokens = rng.choice(bases)
        if op == "insert":
            cut = rng.randint(1, len(tokens) // PAGE) * PAGE
            tokens = tokens[:cut] + list(range(90_000 + step * 1000, 90_000 + step * 1000 + rng.randint(0, 5) * PAGE))
            if e.allocator.available_size() < len(tokens):
                e.tree.evict(EvictParams(num_tokens=len(tokens) - e.allocator.available_size()))
            if e.allocator.available_size() >= len(tokens):
                insert(e, tokens)
        elif op == "hit":
            load_hit(e, tokens)
        elif op == "evict":
            e.tree.evict(EvictParams(num_tokens=rng.randint(1, 20) * PAGE))
        else:
            e.tree.writing_check()
        yield step, op


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_random_operations_leave_no_block_lost_or_leaked(hienv, policy):
    """After every random step both tiers account for every slot; a flush frees all."""
    e = hienv(sk=0.5, sv=1.0, store_blocks=20, host_blocks=48, host_tokens=64 * 24, policy=policy)
    start = (e.allocator.available_size(), e.store.free_counts(), e.host.available_size(), e.host_store.free_counts())
    for step, op in random_operations(e, seed=28, steps=150):
        assert balanced(e), (step, op)
        assert e.store.check() is None and host_consistent(e), (step, op, e.tree.check_stores())
    e.tree.writing_check()
    assert e.tree.protected_size() == 0
    status = e.tree.status()
    assert status["blocks_backed_up_total"] > 0 and status["blocks_loaded_total"] > 0, status
    e.tree.reset()
    e.allocator.clear()
    end = (e.allocator.available_size(), e.store.free_counts(), e.host.available_size(), e.host_store.free_counts())
    assert end == start


def test_tensor_parallel_ranks_stay_in_step_across_tiers(hienv):
    """Two ranks (different KV heads, same requests) at S_K = 0, S_V = 1: every split, compression,
    backup, load and eviction on both tiers happens alike, so their tree-state lines (which include
    the host tier's free counts) stay equal step by step."""
    ranks = [hienv(sk=0.0, sv=1.0, store_blocks=20, host_blocks=48, host_tokens=64 * 24, seed=seed) for seed in (0, 1)]
    runs = [random_operations(e, seed=7, steps=100) for e in ranks]
    for (step, op), _ in zip(*runs):
        states = [e.tree.rank_state() for e in ranks]
        assert states[0] == states[1], (step, op, states)
    assert "loaded=0 " not in states[0] + " " and not torch.equal(ranks[0].kv.k_buffer[0], ranks[1].kv.k_buffer[0])


def test_host_budget_split_and_the_factory_builds_the_hierarchical_tree(hienv, one_rank):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sglang_hs.radix.factory import create_radix_cache
    from sglang_hs.radix.hicache import HieraSparseHiRadixCache
    from sglang_hs.radix.host_tier import dense_host_args, host_budget
    from sglang_hs.runtime import RUNTIME_ATTR

    e = hienv()
    runtime = e.tree.runtime
    server_args = hicache_server_args(0.004)
    budget = host_budget(server_args, e.kv, runtime)
    assert budget.total_bytes == 4_000_000 and budget.dense_bytes == 400_000  # host store fraction 0.9
    assert budget.store_capacity.virtual_blocks == int(3_600_000 // (2 * 0.5625 * PAGE * DIM * 2 * HEADS * LAYERS))
    assert dense_host_args(server_args, budget).hicache_size == 0.0004 and server_args.hicache_size == 0.004
    resolved = resolved_server_args(hicache_size=0.004)  # SGLang's ServerArgs refuse assignment once resolved
    with pytest.raises(AttributeError):
        resolved.hicache_size = 1.0
    assert dense_host_args(resolved, budget).hicache_size == 0.0004 and resolved.hicache_size == 0.004
    ratio = host_budget(hicache_server_args(0), e.kv, runtime)
    assert ratio.total_bytes == 2 * (POOL_TOKENS * TOKEN_BYTES + runtime.store_budget_bytes)
    # The factory, given SGLang's build context with enable_hierarchical_cache.
    counters, fresh = [], sglang_pools()
    runtime.store.clear()
    runner = SimpleNamespace(token_to_kv_pool=fresh.kv, **{RUNTIME_ATTR: runtime})
    params = CacheInitParams(disable=False, req_to_token_pool=fresh.req_pool,
                             token_to_kv_pool_allocator=fresh.allocator, page_size=PAGE)  # fmt: skip
    ctx = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner,
                                                    register_hicache_layer_transfer_counter=counters.append),
                          params=params, server_args=server_args, enable_hierarchical_cache=True)  # fmt: skip
    tree = create_radix_cache(ctx)
    assert isinstance(tree, HieraSparseHiRadixCache) and counters == [tree.cache_controller.layer_done_counter]
    assert tree.host_store.capacity == budget.store_capacity
    assert tree.token_to_kv_pool_host.size == (400_000 // TOKEN_BYTES // PAGE + 1) * PAGE


# --------------------------------------------------------------------------------------- start-up
def hierarchical_server_args(**overrides) -> SimpleNamespace:
    """What ``apply_backend_defaults`` reads of SGLang's ServerArgs, with --enable-hierarchical-cache."""

    class ModelConfigReached(Exception):
        pass

    def get_model_config():
        raise ModelConfigReached  # the radix-cache checks come before the model and GPU checks

    phase = lambda: SimpleNamespace(backend="auto")  # noqa: E731
    values = dict(
        attention_backend="hierasparse", prefill_attention_backend=None, decode_attention_backend=None,
        page_size=None, disable_radix_cache=False, radix_cache_backend=None, enable_hierarchical_cache=True,
        hicache_storage_backend=None, speculative_algorithm=None, hicache_io_backend="kernel",
        hicache_mem_layout="page_first", hicache_size=0, hicache_ratio=2.0,
        cuda_graph_config=SimpleNamespace(prefill=phase(), decode=phase()), get_model_config=get_model_config,
    )  # fmt: skip
    values.update(overrides)
    return SimpleNamespace(**values), ModelConfigReached


@needs_hiradix
def test_hierarchical_cache_selects_the_compressed_hierarchical_tree():
    from sglang_hs.plugin import apply_backend_defaults

    server_args, reached = hierarchical_server_args()
    with pytest.raises(reached):
        apply_backend_defaults(None, server_args)
    assert server_args.radix_cache_backend == "hierasparse" and server_args.page_size == 64


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"hicache_storage_backend": "file"}, "--hicache-storage-backend=file"),
        ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm=EAGLE"),
        ({"hicache_io_backend": "kernel_ascend"}, "--hicache-io-backend=kernel_ascend"),
        ({"hicache_mem_layout": "page_first_kv_split"}, "--hicache-mem-layout=page_first_kv_split"),
        ({"hicache_ratio": 0.0}, "--hicache-ratio=0.0"),
        ({"radix_cache_backend": "flexkv"}, "--radix-cache-backend=flexkv"),
        ({"page_size": 16}, "--page-size=16"),
    ],
)
def test_unsupported_hierarchical_settings_stop_with_one_line(overrides, flag):
    from sglang_hs.config import HieraSparseConfigError
    from sglang_hs.plugin import apply_backend_defaults

    hierarchical_only = not {"page_size", "radix_cache_backend"} & set(overrides)  # checked after HiRadixCache
    if hierarchical_only and not has_hiradix_cache():
        pytest.skip(NO_HIRADIX)
    server_args, _ = hierarchical_server_args(**overrides)
    with pytest.raises(HieraSparseConfigError) as info:
        apply_backend_defaults(None, server_args)
    message = str(info.value)
    assert flag in message and "allowed:" in message and "\n" not in message


def test_host_store_bytes_follow_its_capacity():
    capacity = StoreCapacity(10, 4, 6, 0, 10)
    store = CompressedStore(capacity, LAYERS, HEADS, DIM, PAGE, torch.float16, "cpu")
    allocated = sum(store.layer_pools(layer).nbytes() for layer in range(LAYERS))
    assert capacity.nbytes(LAYERS, HEADS, DIM, PAGE) == allocated


def test_k_head_map_round_trip_through_the_host_tier(hienv):
    """With a K head map the host store takes the GPU store's layout (per-layer K pools), write-through
    copies each block's mapped heads' 2:4 rows and the other heads' dense rows, and a host hit brings
    them back bit-identically: attention after equals attention before."""
    e = hienv(sk=1.0, sv=1.0, k_sparse_heads=HEAD_MAP)
    assert e.host_store.k_sparse_heads is not None and torch.equal(e.host_store.k_sparse_heads, HEAD_MAP)
    assert e.host_store.k_index.dim() == 3
    check_round_trip(e)


def test_k_head_map_host_budget_counts_dense_heads(hienv):
    """The host store's bytes follow its capacity with the map's share (its sparse-K slots hold dense
    rows for the unmapped heads)."""
    e = hienv(sk=1.0, sv=1.0, k_sparse_heads=HEAD_MAP)
    share = e.store.k_sparse_share
    allocated = sum(e.host_store.layer_pools(layer).nbytes() for layer in range(LAYERS))
    assert 0 < share < 1 and e.host_store.capacity.nbytes(LAYERS, HEADS, DIM, PAGE, share) == allocated


@pytest.mark.parametrize("flag, kept", [(None, "disabled"), ("disabled", "disabled"), ("breakable", "breakable")])
def test_prefill_cuda_graphs_only_when_asked_for_and_breakable(flag, kept):
    """Prefill graphs stay off unless --cuda-graph-backend-prefill breakable asks for them (attention
    then runs eagerly between the captured segments); SGLang's default on CUDA is breakable too, so
    the plugin reads the explicit flag, not the resolved config."""
    from sglang_hs.plugin import apply_backend_defaults

    server_args, reached = hierarchical_server_args(enable_hierarchical_cache=False, cuda_graph_backend_prefill=flag)
    server_args.cuda_graph_config.prefill.backend = "breakable"  # SGLang's resolved default
    with pytest.raises(reached):
        apply_backend_defaults(None, server_args)
    assert server_args.cuda_graph_config.prefill.backend == kept


@pytest.mark.parametrize("flag", ["full", "tc_piecewise"])
def test_prefill_cuda_graphs_that_capture_attention_stop_with_one_line(flag):
    from sglang_hs.config import HieraSparseConfigError
    from sglang_hs.plugin import apply_backend_defaults

    server_args, _ = hierarchical_server_args(enable_hierarchical_cache=False, cuda_graph_backend_prefill=flag)
    with pytest.raises(HieraSparseConfigError, match=f"--cuda-graph-backend-prefill={flag} captures attention"):
        apply_backend_defaults(None, server_args)
