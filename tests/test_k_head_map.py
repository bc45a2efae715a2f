"""The K head map (``--hierasparse-k-head-map``): the map file, and the compressed store's per-layer K
layout under it (``sglang_hs.pools``), checked against a store without a map on CPU.

In a K-sparse block the mapped (layer, head) pairs must hold exactly what a store without a map holds
(2:4-pruned K), the other pairs K exactly as cached, V must not change, and the slot accounting and
byte counts must follow the per-layer row counts.
"""

import pytest
import torch

from sglang_hs.config import HieraSparseConfig, HieraSparseConfigError
from sglang_hs.format import BlockPools, decompress_blocks
from sglang_hs.k_head_map import KHeadMap
from sglang_hs.pools import CompressedStore, StoreCapacity, block_losses, compress_prefix
from sglang_hs.pruner import make_pruner

LAYERS, HEADS, DIM, B = 3, 4, 64, 64
# Layer 0: every head 2:4 (as without a map); layer 1: heads 0 and 2; layer 2: none.
MAP = torch.tensor([[True] * 4, [True, False, True, False], [False] * 4])


def _prefix(n_blocks: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(n_blocks * B, HEADS, DIM, generator=gen).half() for _ in range(LAYERS)]
    v = [torch.randn(n_blocks * B, HEADS, DIM, generator=gen).half() for _ in range(LAYERS)]
    return k, v, torch.arange(n_blocks * B)


def _store(blocks: int, head_map=None) -> CompressedStore:
    capacity = StoreCapacity(blocks, blocks, blocks, blocks, blocks)
    return CompressedStore(capacity, LAYERS, HEADS, DIM, B, torch.float16, "cpu", k_sparse_heads=head_map)


def _read(store: CompressedStore, vbs: list[int], layer: int, operand: str) -> torch.Tensor:
    index = store.k_index_of(layer) if operand == "k" else store.v_index
    return decompress_blocks(store.layer_pools(layer), index[:, torch.tensor(vbs)], operand)


def test_mapped_heads_hold_2to4_k_and_the_others_keep_it_dense():
    k, v, slots = _prefix(3)
    groups = [(torch.ones(3, dtype=torch.bool), 1.0, 1.0)]
    plain, mapped = _store(3), _store(3, MAP)
    vbs_plain = compress_prefix(plain, make_pruner("magnitude"), k, v, slots, groups)
    vbs = compress_prefix(mapped, make_pruner("magnitude"), k, v, slots, groups)
    for layer in range(LAYERS):
        cached = k[layer].view(3, B, HEADS, DIM).permute(2, 0, 1, 3)  # [H, n, B, D]
        pruned = _read(plain, vbs_plain, layer, "k")
        got = _read(mapped, vbs, layer, "k")
        for h in range(HEADS):
            want = pruned[h] if MAP[layer, h] else cached[h]
            assert torch.equal(got[h], want), (layer, h)
        assert torch.equal(_read(mapped, vbs, layer, "v"), _read(plain, vbs_plain, layer, "v"))
        # Per layer: the 3 dense-K slots' rows, then the 3 sparse-K slots' dense rows (unmapped heads);
        # 2:4 rows for the mapped heads only.
        n_s = int(MAP[layer].sum())
        assert mapped.k_values[layer].shape[0] == 3 * n_s
        assert mapped.k_dense[layer].shape[0] == 3 * HEADS + 3 * (HEADS - n_s)
    assert mapped.check() is None and mapped.k_index.shape == (LAYERS, HEADS, 3)
    assert mapped.stored_bytes() > plain.stored_bytes()
    # A store of sparse slots only, filled: its capacity's bytes, its pools' and its blocks' agree.
    tight = CompressedStore(StoreCapacity(3, 0, 3, 0, 3), LAYERS, HEADS, DIM, B, torch.float16, "cpu", k_sparse_heads=MAP)
    compress_prefix(tight, make_pruner("magnitude"), k, v, slots, groups)
    share = MAP.float().mean().item()
    allocated = sum(tight.layer_pools(layer).nbytes() for layer in range(LAYERS))
    assert tight.capacity.nbytes(LAYERS, HEADS, DIM, B, share) == allocated == tight.stored_bytes()
    assert tight.k_sparse_share == pytest.approx(share)


def test_k_dense_blocks_and_reuse_after_free():
    """A K-dense block (S_K = 0) is dense on every head of every layer; freed slots come back clean."""
    k, v, slots = _prefix(2, seed=1)
    store = _store(4, MAP)
    first = compress_prefix(store, make_pruner("magnitude"), k, v, slots, [(torch.ones(2, dtype=torch.bool), 1.0, 0.0)])
    second = compress_prefix(store, make_pruner("magnitude"), k, v, slots, [(torch.ones(2, dtype=torch.bool), 0.0, 0.0)])
    for layer in range(LAYERS):
        assert torch.equal(_read(store, second, layer, "k"), k[layer].view(2, B, HEADS, DIM).permute(2, 0, 1, 3))
    before = [_read(store, first, layer, "k") for layer in range(LAYERS)]
    store.free(first)
    assert store.check() is None
    again = compress_prefix(store, make_pruner("magnitude"), k, v, slots, [(torch.ones(2, dtype=torch.bool), 1.0, 0.0)])
    assert sorted(again) == sorted(first)
    for layer in range(LAYERS):  # again[i] holds the prefix's block i, as first[i] did
        assert torch.equal(_read(store, again, layer, "k"), before[layer])
    store.free(again + second)
    assert store.check() is None and store.used_blocks() == 0


def test_k_losses_count_only_the_mapped_heads():
    k, v, slots = _prefix(3, seed=2)
    pruner = make_pruner("magnitude")
    full, _ = block_losses(pruner, k, v, slots, B, HEADS)
    none_mapped, _ = block_losses(pruner, k, v, slots, B, HEADS, torch.zeros(LAYERS, HEADS, dtype=torch.bool))
    every, _ = block_losses(pruner, k, v, slots, B, HEADS, torch.ones(LAYERS, HEADS, dtype=torch.bool))
    assert torch.equal(every, full) and bool((none_mapped == 0).all())


def test_map_file_round_trip_rank_slices_and_errors(tmp_path):
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.2], [0.3, 0.8, 0.0, 0.7]])
    head_map = KHeadMap.from_scores(scores, 0.5)  # the 4 lowest scores: 0.0, 0.1, 0.2, 0.3
    assert head_map.sparse.tolist() == [[False, True, False, True], [True, False, True, False]]
    path = str(tmp_path / "map.pt")
    head_map.save(path, score="needle")
    loaded = KHeadMap.load(path)
    assert torch.equal(loaded.sparse, head_map.sparse) and loaded.share == 0.5
    assert loaded.for_rank(2, 1, 2).sparse.tolist() == [[False, True], [True, False]]
    with pytest.raises(ValueError, match="4 KV heads; 3 ranks"):
        loaded.for_rank(1, 0, 3)
    with pytest.raises(ValueError, match=r"\[layers, kv_heads\] = \[2, 4\]"):
        loaded.check_model(3, 4)
    torch.save({"perm": torch.zeros(1)}, str(tmp_path / "other.pt"))
    with pytest.raises(ValueError, match="not a K head map file"):
        KHeadMap.load(str(tmp_path / "other.pt"))
    with pytest.raises(ValueError, match="shape"):
        CompressedStore(StoreCapacity(1, 1, 1, 1, 1), LAYERS, HEADS, DIM, B, torch.float16, "cpu",
                        k_sparse_heads=head_map.sparse)  # fmt: skip


def test_config_needs_a_map_file(tmp_path):
    path = str(tmp_path / "map.pt")
    KHeadMap(MAP).save(path)
    assert HieraSparseConfig(k_head_map=path).k_head_map == path  # every kernel, the fused compressor too
    with pytest.raises(HieraSparseConfigError, match="calibrate_heads"):
        HieraSparseConfig(k_head_map=str(tmp_path / "missing.pt"), kernels="none")


def test_calibration_command_maps_the_lowest_scores(tmp_path):
    """``calibrate_heads`` from cached head scores (no model forward): the share of pairs with the lowest
    score of the chosen kind is mapped to 2:4 K, and the file loads as the server loads it."""
    from sglang_hs.launch import calibrate_heads

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    needle = torch.arange(12, dtype=torch.float64).view(3, 4)  # pair (l, h) scores 4l + h
    scores = tmp_path / "scores.pt"
    torch.save({"scores": {"needle": needle, "copy": -needle}, "query_moment": None, "meta": {}}, str(scores))
    out = str(tmp_path / "map.pt")
    argv = ["--model-path", str(model), "--head-scores", str(scores), "--share", "0.5", "--out", out]
    assert calibrate_heads.main(argv) == 0
    assert KHeadMap.load(out).sparse.flatten().tolist() == [True] * 6 + [False] * 6
    assert calibrate_heads.main(argv[:-2] + ["--score", "copy", "--out", out]) == 0
    assert KHeadMap.load(out).sparse.flatten().tolist() == [False] * 6 + [True] * 6
    assert calibrate_heads.main(["--model-path", str(tmp_path / "none")]) == 2


def test_random_map_for_dummy_weights_needs_no_model(tmp_path):
    """``--score random`` reads only config.json: a seeded map of the share over its layers and KV heads
    (for speed and capacity runs on dummy weights), the same for the same seed."""
    import json

    from sglang_hs.launch import calibrate_heads

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 32, "num_key_value_heads": 8,
                                                   "num_attention_heads": 32}))  # fmt: skip
    maps = []
    for seed in (0, 0, 1):
        out = str(tmp_path / f"map{len(maps)}.pt")
        argv = ["--model-path", str(model), "--score", "random", "--share", "0.75", "--calib-seed", str(seed), "--out", out]
        assert calibrate_heads.main(argv) == 0
        maps.append(KHeadMap.load(out).sparse)
    assert maps[0].shape == (32, 8) and int(maps[0].sum()) == 192
    assert torch.equal(maps[0], maps[1]) and not torch.equal(maps[0], maps[2])


def test_the_backend_hands_each_layer_its_own_k_map():
    """The attention backend passes a layer's own K index map to the kernels and the fallback."""
    from types import SimpleNamespace

    from sglang_hs.backend import HieraSparseAttnBackend

    backend = HieraSparseAttnBackend.__new__(HieraSparseAttnBackend)
    store = _store(2, MAP)
    compress_prefix(store, make_pruner("magnitude"), *_prefix(2)[:2], torch.arange(2 * B),
                    [(torch.ones(2, dtype=torch.bool), 1.0, 1.0)])  # fmt: skip
    cache = torch.zeros(8, HEADS, DIM)
    pool = SimpleNamespace(get_key_buffer=lambda layer: cache, get_value_buffer=lambda layer: cache)
    backend.__dict__.update(store=store, token_to_kv_pool=pool, dense=None)
    for layer in range(LAYERS):
        k_index = backend._kernel_kv(SimpleNamespace(layer_id=layer))[3]
        assert torch.equal(k_index, store.k_index[layer])
    assert not torch.equal(store.k_index[0], store.k_index[1])  # the layers' maps differ


@pytest.mark.gpu
def test_decode_kernel_reads_each_layers_k_map():
    """GPU: the decode kernel, given a layer's own K index map, attends over that layer's mixed K (2:4
    on the mapped heads, dense on the others) as the reference does."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the device machine)")
    from sglang_hs import reference as R
    from sglang_hs.kernels.decode import HieraSparseDecode

    layers, heads, q_heads, dim, n = 2, 2, 8, 64, 6
    head_map = torch.tensor([[True, False], [False, True]])
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = [torch.randn(n * B, heads, dim, device="cuda", generator=gen).half() for _ in range(layers)]
    v = [torch.randn(n * B, heads, dim, device="cuda", generator=gen).half() for _ in range(layers)]
    store = CompressedStore(StoreCapacity(n, 0, n, 0, n), layers, heads, dim, B, torch.float16, "cuda",
                            k_sparse_heads=head_map)  # fmt: skip
    vbs = compress_prefix(store, make_pruner("magnitude"), k, v, torch.arange(n * B, device="cuda"),
                          [(torch.ones(n, dtype=torch.bool), 1.0, 1.0)])  # fmt: skip
    table = torch.tensor([[-vb - 1 for vb in vbs]] * 2, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([n * B, (n - 1) * B], dtype=torch.int32, device="cuda")  # whole blocks: all compressed
    cache = torch.zeros(B, heads, dim, dtype=torch.float16, device="cuda")  # no cache page is read
    plan = HieraSparseDecode(2, q_heads, heads, dim, B, n, torch.float16, "cuda")
    for layer in range(layers):
        q = torch.randn(2, q_heads, dim, device="cuda", generator=gen).half()
        pools, k_index = store.layer_pools(layer), store.k_index_of(layer)
        out = plan.run(q, cache, cache, pools, k_index, store.v_index, table, seq_lens, dim**-0.5)
        cpu_pools = BlockPools(**{name: None if t is None else t.cpu() for name, t in vars(pools).items()})
        ref, _ = R.paged_attention(q.cpu(), [0, 1, 2], cache.cpu(), cache.cpu(), cpu_pools, k_index.cpu(),
                                   store.v_index.cpu(), table.cpu(), seq_lens.tolist(), dim**-0.5)  # fmt: skip
        err = (out.float().cpu() - ref.float()).abs().max() / ref.float().abs().max()
        assert float(err) < 3e-3, (layer, float(err))


def test_stored_bytes_counts_the_blocks_held_after_allocations_and_frees():
    """``stored_bytes`` reads slots in use from the free lists; it equals the sum over the held
    blocks' placements (dense and 2:4 K and V, the map's mixed K rows) through allocations and frees."""
    from sglang_hs.format import dense_block_bytes, sparse_block_bytes

    store = CompressedStore(StoreCapacity(12, 6, 6, 6, 6), LAYERS, HEADS, DIM, B, torch.float16, "cpu",
                            k_sparse_heads=MAP)  # fmt: skip
    dense, sparse = dense_block_bytes(B, DIM), sparse_block_bytes(B, DIM)
    mapped = int(MAP.sum())

    def walked() -> int:
        total = 0
        for p in store.placements().values():
            total += (mapped * sparse + (LAYERS * HEADS - mapped) * dense) if p.k_sparse else LAYERS * HEADS * dense
            total += LAYERS * HEADS * (sparse if p.v_sparse else dense)
        return total

    assert store.stored_bytes() == walked() == 0
    first = store.allocate([True, False, True], [False, True, True])
    second = store.allocate([False, False], [True, False])
    assert store.stored_bytes() == walked() > 0
    store.free(first[1:])
    assert store.stored_bytes() == walked()
    store.free(first[:1] + second)
    assert store.stored_bytes() == walked() == 0
