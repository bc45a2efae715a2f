"""The backend's path choice and the arguments it hands the kernels, on CPU with stand-in kernels
(the kernels themselves are checked on the GPU, and the server run on the H100 used these paths)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_hs.pools import CompressedStore, StoreCapacity, VirtualSlots

pytestmark = pytest.mark.sglang

B, HKV, HQ, D, LAYERS = 64, 2, 8, 64, 1


class RecordingPlan:
    """Stands in for ``HieraSparseExtend``: records its arguments, returns q."""

    def __init__(self):
        self.calls = []

    def run(self, q, *args, out=None):
        self.calls.append((q, args))
        if out is not None:
            out.copy_(q)
        return q


def make_backend(extend_plan, layers: int = LAYERS, value_dtype=None):
    from sglang_hs.backend import HieraSparseAttnBackend

    backend = HieraSparseAttnBackend.__new__(HieraSparseAttnBackend)
    store = CompressedStore(StoreCapacity(8, 8, 0, 8, 0), layers, HKV, D, B, torch.float16, "cpu",
                            value_dtype=value_dtype)  # fmt: skip
    store.allocate([False, False], [False, False])  # two compressed blocks in use: virtual blocks 0 and 1
    virtual = VirtualSlots(base=1024, block_size=B)
    req_to_token = torch.zeros(3, 512, dtype=torch.int32)
    # Request 0: sink page 1, virtual blocks 0-1, then page 2 (its new tokens). Request 1: pages only.
    req_to_token[0, :256] = torch.cat([torch.arange(64, 128), virtual.slots_of([0, 1], "cpu"), torch.arange(128, 192)])
    req_to_token[1, :128] = torch.arange(192, 320)
    k_buffer = torch.randn(1024, HKV, D).half()
    pool = SimpleNamespace(get_key_buffer=lambda layer: k_buffer, get_value_buffer=lambda layer: k_buffer + 1,
                           set_kv_buffer=lambda *a: None, head_num=HKV, head_dim=D, device="cpu")  # fmt: skip
    dense = SimpleNamespace(forward_extend=lambda *a, **k: "dense extend", forward_decode=lambda *a, **k: "dense decode")
    backend.__dict__.update(store=store, virtual=virtual, req_to_token=req_to_token, extend_plan=extend_plan,
                            use_decode_kernel=False, token_to_kv_pool=pool, forward_metadata=None, dense=dense,
                            permute=None, selection=None, fp8_kv=store.quantized, model_dtype=torch.float16,
                            config=SimpleNamespace(block_size=B),
                            runtime=SimpleNamespace(shared_decode_counts=None, decode_mode_counts=torch.zeros(2, dtype=torch.int64)))  # fmt: skip
    return backend


def extend_batch(rows, seq_lens, new_lens):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor(rows), seq_lens_cpu=torch.tensor(seq_lens),
        seq_lens=torch.tensor(seq_lens), extend_seq_lens=torch.tensor(new_lens), extend_seq_lens_cpu=new_lens,
        out_cache_loc=torch.arange(sum(new_lens)),
    )  # fmt: skip


def test_extend_over_compressed_blocks_uses_the_kernel_with_gpu_side_offsets():
    from sglang_hs.backend import Path

    plan = RecordingPlan()
    backend = make_backend(plan)
    batch = extend_batch([0, 1], [256, 128], [64, 32])
    meta = backend._compressed_metadata(batch)
    assert meta.path is Path.EXTEND_KERNEL
    assert meta.qo_indptr_gpu.tolist() == [0, 64, 96] and meta.qo_indptr_gpu.dtype == torch.int32
    assert meta.seq_lens_gpu.tolist() == [256, 128] and meta.seq_lens_gpu.dtype == torch.int32
    assert meta.block_table[0].tolist() == [1, ~0, ~1, 2] and meta.block_table[1, :2].tolist() == [3, 4]
    backend.forward_metadata = meta
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=HQ, head_dim=D, v_head_dim=D, scaling=0.125,
                            k_scale=None, v_scale=None)  # fmt: skip
    q = torch.randn(96, HQ * D)
    out = backend.forward_extend(q, None, None, layer, batch, save_kv_cache=False)
    assert out.shape == (96, HQ * D) and torch.equal(out, q)
    (q_arg, args), = plan.calls
    assert q_arg.shape == (96, HQ, D)
    qo_indptr, k_cache, v_cache, pools, k_index, v_index, block_table, seq_lens, sm_scale = args
    assert qo_indptr is meta.qo_indptr_gpu and pools == backend.store.layer_pools(0)
    assert all(t is getattr(backend.store, name)[0] for name, t in vars(pools).items() if t is not None)
    assert k_index is backend.store.k_index and v_index is backend.store.v_index
    assert k_cache.shape == (1024, HKV, D) and torch.equal(v_cache, k_cache + 1)
    assert block_table is meta.block_table and seq_lens is meta.seq_lens_gpu and sm_scale == 0.125


def test_extend_over_fp8_kv_runs_the_kernel_over_16_bit_copies_with_the_new_tokens_as_handed():
    """An FP8 store: the extend kernel reads 16-bit copies of the batch's blocks as cache pages (request r's
    block j is page r * width + j) beside empty pools; the new tokens' rows hold the K and V the layer was
    handed, the rest what the fallback reads."""
    from sglang_hs.backend import Path
    from sglang_hs.fallback import dense_view
    from sglang_hs.format import FP8_DTYPE

    plan = RecordingPlan()
    backend = make_backend(plan, value_dtype=FP8_DTYPE)
    pools = backend.store.layer_pools(0)
    for name, t in vars(pools).items():
        if t is not None:
            t.copy_(torch.ones_like(t) if name.endswith("scale") else torch.randn(t.shape).clamp(-4, 4).to(t.dtype)
                    if t.is_floating_point() else torch.zeros_like(t))  # fmt: skip
    backend._no_pools, backend._no_index = backend._empty_pools()
    batch = extend_batch([0, 1], [256, 128], [64, 32])
    meta = backend._compressed_metadata(batch)
    assert meta.path is Path.EXTEND_KERNEL and len(meta.copy_chunks) == 1
    (chunk,) = meta.copy_chunks
    assert chunk.width == 4 and chunk.qo_indptr_gpu.tolist() == [0, 64, 96]
    assert chunk.new_rows.tolist() == list(range(192, 256)) + list(range(256 + 96, 256 + 128))
    backend.forward_metadata = meta
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=HQ, head_dim=D, v_head_dim=D, scaling=0.125,
                            k_scale=None, v_scale=None)  # fmt: skip
    q, k, v = torch.randn(96, HQ * D).half(), torch.randn(96, HKV, D).half(), torch.randn(96, HKV, D).half()
    out = backend.forward_extend(q, k, v, layer, batch, save_kv_cache=False)
    assert torch.equal(out, q)
    (q_arg, args), = plan.calls
    qo_indptr, k_pages, v_pages, no_pools, k_index, v_index, table, seq_lens, sm_scale = args
    assert qo_indptr is chunk.qo_indptr_gpu and seq_lens.tolist() == [256, 128] and sm_scale == 0.125
    assert table.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and k_pages.shape == (8 * B, HKV, D) and k_pages.is_contiguous()
    assert no_pools.k_dense.shape[0] == 0 and not no_pools.quantized and k_index.shape == (HKV, 0)
    cache = backend.token_to_kv_pool.get_key_buffer(0)
    for r, (length, new, first) in enumerate([(256, 64, 0), (128, 32, 64)]):
        want_k, want_v = dense_view(cache, cache + 1, pools, backend.store.k_index_of(0), backend.store.v_index,
                                    meta.block_table[r], length, B, torch.float16)  # fmt: skip
        want_k[length - new:], want_v[length - new:] = k[first:first + new], v[first:first + new]
        rows = slice(r * 4 * B, r * 4 * B + length)
        assert torch.equal(k_pages[rows], want_k) and torch.equal(v_pages[rows], want_v), r


def test_other_batches_take_the_dense_or_pytorch_paths():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_hs.backend import Path

    backend = make_backend(None)
    meta = backend._compressed_metadata(extend_batch([0, 1], [256, 128], [64, 32]))
    assert meta.path is Path.FALLBACK and meta.qo_indptr == [0, 64, 96] and meta.seq_lens == [256, 128]
    dense_only = make_backend(RecordingPlan())
    batch = extend_batch([1], [128], [32])
    dense_only.forward_metadata = dense_only._compressed_metadata(batch)
    assert dense_only.forward_metadata.path is Path.DENSE
    assert dense_only.forward_extend(torch.zeros(32, HQ * D), None, None, None, batch) == "dense extend"
    decode = extend_batch([0], [256], [1])
    decode.forward_mode = ForwardMode.DECODE
    assert backend._compressed_metadata(decode).path is Path.FALLBACK


def test_decode_mode_on_the_pytorch_path_reads_the_anchor_choice():
    """--hierasparse-decode-mode kascade without the decode kernel: layer 0 (the anchor) reads every
    block and keeps the compressed block of most attention mass; layer 1 reads the compacted table."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_hs.config import HieraSparseConfig
    from sglang_hs.decode_modes import BlockSelection
    from sglang_hs.fallback import dense_view

    backend = make_backend(None, layers=2)
    backend.__dict__.update(selection=BlockSelection("kascade", frozenset({0}), 1), config=HieraSparseConfig())
    gen = torch.Generator().manual_seed(0)
    for layer in range(2):
        for name in ("k_dense", "v_dense"):
            pool = getattr(backend.store, name)[layer]
            pool.copy_(torch.randn(pool.shape, generator=gen).half())
    decode = extend_batch([0], [256], [1])
    decode.forward_mode = ForwardMode.DECODE
    backend.forward_metadata = meta = backend._compressed_metadata(decode)
    q = torch.randn(1, HQ * D, generator=gen).half()
    kv = backend._kernel_kv(SimpleNamespace(layer_id=0))
    k, v = dense_view(*kv, meta.block_table[0], 256, B)
    logits = torch.einsum("hgd,thd->hgt", q.float().view(HKV, -1, D), k.float()).flatten(0, 1) * 0.125
    share = logits[:, 64:192].unflatten(-1, (2, 64)).logsumexp(-1).softmax(-1).sum(0)  # the two compressed blocks
    chosen = int(share.argmax())
    outs = []
    for layer_id in (0, 1):
        layer = SimpleNamespace(layer_id=layer_id, tp_q_head_num=HQ, head_dim=D, v_head_dim=D, scaling=0.125,
                                k_scale=None, v_scale=None)  # fmt: skip
        outs.append(backend.forward_decode(q, None, None, layer, decode, save_kv_cache=False).view(1, HQ, D))
    table, lengths = meta.selected
    assert table[0, :3].tolist() == [1, ~chosen, 2] and lengths == [192]
    skipped = 1 + (1 - chosen)  # the table column of the compressed block not chosen
    for layer_id, out, tokens in ((0, outs[0], torch.ones(256, dtype=torch.bool)),
                                  (1, outs[1], torch.arange(256).div(64, rounding_mode="floor") != skipped)):
        k, v = dense_view(*backend._kernel_kv(SimpleNamespace(layer_id=layer_id)), meta.block_table[0], 256, B)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.view(1, HQ, D).transpose(0, 1), k[tokens].transpose(0, 1), v[tokens].transpose(0, 1), scale=0.125,
            enable_gqa=True).transpose(0, 1)  # fmt: skip
        assert torch.allclose(out.float(), ref.float(), atol=2e-3)


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_kv_budget_split_only_with_the_radix_cache(disable_radix_cache, monkeypatch):
    """With the radix cache on, the store is carved out of SGLang's KV budget and the reservation
    travels on the pool config; with ``--disable-radix-cache`` nothing is ever cached, so the dense
    pool keeps the whole budget and the store gets none. The resize after CUDA-graph capture
    (``cap_tokens``) is never split. (A batch that reads no compressed block takes the dense path:
    ``test_other_batches_take_the_dense_or_pytorch_paths``.)"""
    from sglang_hs.config import ENV_VAR, HieraSparseConfig
    from sglang_hs.runtime import RESERVATION_ATTR, reserve_store_budget

    monkeypatch.setenv(ENV_VAR, HieraSparseConfig(store_fraction=0.25).to_json())
    server_args = SimpleNamespace(attention_backend="hierasparse", prefill_attention_backend=None,
                                  decode_attention_backend=None, disable_radix_cache=disable_radix_cache)  # fmt: skip
    configurator = SimpleNamespace(server_args=server_args, is_draft_worker=False)

    def config_from_budget(configurator, budget_bytes, *, cap_tokens=None):
        return SimpleNamespace(budget_bytes=budget_bytes, cap_tokens=cap_tokens)

    pool_config = reserve_store_budget(config_from_budget, configurator, 4 << 30)
    reservation = getattr(pool_config, RESERVATION_ATTR, None)
    if disable_radix_cache:
        assert pool_config.budget_bytes == 4 << 30 and reservation is None
    else:
        assert pool_config.budget_bytes == 3 << 30 and reservation.store_bytes == 1 << 30
        assert reservation.config == HieraSparseConfig(store_fraction=0.25)
    resized = reserve_store_budget(config_from_budget, configurator, 4 << 30, cap_tokens=1000)
    assert resized.budget_bytes == 4 << 30 and resized.cap_tokens == 1000 and not hasattr(resized, RESERVATION_ATTR)


class RecordingDecodeKernel:
    """Stands in for the compiled decode kernel: records the batch of each launch, writes ones."""

    def __init__(self):
        self.batches = []
        self.tables = []  # per launch: (wants the per-block LSE, block table, seq_lens)
        self.scales = []  # per launch of the FP8 variant: the four row-scale arguments (after the six pools)

    def __call__(self, q, *args):
        out, lse, want_block_lse, block_lse = args[-5], args[-4], args[-2], args[-1]
        self.batches.append(q.shape[0])
        self.tables.append((want_block_lse, args[-10].clone(), args[-9].clone()))
        if len(args) == 24:  # k_cache, v_cache, 6 pools, 4 scales, 2 index maps and the 10 launch arguments
            self.scales.append(args[8:12])
        out.fill_(1.0)
        lse.fill_(0.0)
        if want_block_lse:  # the third block of every request gets the most attention
            block_lse.fill_(0.0).view(q.shape[0], q.shape[1], -1)[:, :, 2] = 5.0


class RecordingExtendKernel:
    """Stands in for the compiled extend kernel (the shared pass's): records each launch's set rows and
    split limits (read after ``qo_indptr``'s offsets), writes ones."""

    def __init__(self):
        self.batches = []
        self.limits = []

    def __call__(self, q, *args):
        qo_indptr, seq_lens, out, lse = args[-9], args[-7], args[-3], args[-2]
        bs = seq_lens.shape[0]
        self.batches.append(bs)
        self.limits.append(qo_indptr[bs + 1 :].clone())
        out.fill_(1.0)
        lse.fill_(0.0)


def graph_step(backend, forward_batch) -> None:
    """What SGLang's decode graph runner does for a capture or a replay: the metadata outside the graph,
    then the recorded in-graph part (replayed with the graph)."""
    backend.init_forward_metadata_out_graph(forward_batch)
    backend.init_forward_metadata_in_graph(forward_batch)


def decode_backend(monkeypatch, built: dict, shared_prefix_decode: str = "off", value_dtype=None, **settings):
    from sglang_hs.config import HieraSparseConfig
    from sglang_hs.decode_modes import BlockSelection
    from sglang_hs.kernels import decode, extend

    def record(*args, split_capacity=decode.SPLIT_CAPACITY, min_split_blocks=1, store_fp8=False, cache_fp8=False,
               compact=None):  # fmt: skip
        key = decode.decode_kernel_args(*args, split_capacity, min_split_blocks, store_fp8, cache_fp8, compact)
        return built.setdefault(key, RecordingDecodeKernel())

    def record_extend(*args):
        return built.setdefault(extend.extend_kernel_args(*args), RecordingExtendKernel())

    monkeypatch.setattr(decode, "build_decode_kernel", record)
    monkeypatch.setattr(extend, "build_extend_kernel", record_extend)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    backend = make_backend(None, layers=2, value_dtype=value_dtype)
    pool = backend.token_to_kv_pool
    pool.__dict__.update(head_num=HKV, head_dim=D, dtype=torch.float16, device=torch.device("cpu"))
    config = HieraSparseConfig(shared_prefix_decode=shared_prefix_decode, **settings)
    backend.__dict__.update(use_decode_kernel=True, q_heads=HQ, max_blocks=8, _decode_plan_obj=None, _graph_step=None,
                            _counts_from_capture=False, config=config, shared_prefix_decode=shared_prefix_decode != "off",
                            selection=BlockSelection.from_config(config, 2),
                            runtime=SimpleNamespace(shared_decode_counts=None, decode_mode_counts=torch.zeros(2, dtype=torch.int64)))  # fmt: skip
    backend.shared_forms = backend._compressed_forms() if backend.shared_prefix_decode else None
    backend.decode_compact = backend._decode_compact()
    return backend


def test_decode_mode_on_the_kernel_path_compacts_after_the_anchor(monkeypatch):
    """CPU, with a recording kernel, in the CUDA-graph path: layer 0 (the anchor) launches the kernel
    over the full table asking for the per-block LSE; layer 1 launches it over the table compacted to
    the request's top compressed block (the recording kernel gives block 2 the most mass)."""
    built = {}
    backend = decode_backend(monkeypatch, built, decode_mode="kascade", decode_anchors="0", decode_topk=1)
    backend.init_cuda_graph_state(4, 4)
    assert backend._decode_plan_obj.with_block_lse
    graph_step(backend, decode_batch(2))
    for layer_id in (0, 1):
        layer = SimpleNamespace(layer_id=layer_id, tp_q_head_num=HQ, head_dim=D, v_head_dim=D, scaling=0.125)
        backend.forward_decode(torch.zeros(2, HQ * D, dtype=torch.float16), None, None, layer, decode_batch(2),
                               save_kv_cache=False)  # fmt: skip
    (kernel,) = built.values()
    (want0, table0, lens0), (want1, table1, lens1) = kernel.tables
    assert want0 == 1 and table0[0, :4].tolist() == [1, ~0, ~1, 2] and lens0.tolist() == [200, 200]
    assert want1 == 0 and table1[0, :3].tolist() == [1, ~1, 2] and lens1.tolist() == [136, 200]
    assert torch.equal(table1[1, :4], table0[1, :4])  # request 1 has no compressed block: reads every page
    assert backend.runtime.decode_mode_counts.tolist() == [1, 2]  # one of request 0's two compressed blocks


def decode_batch(bs: int):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(batch_size=bs, req_pool_indices=torch.arange(bs) % 2, seq_lens=torch.full((bs,), 200),
                           forward_mode=ForwardMode.DECODE, out_cache_loc=torch.arange(bs))  # fmt: skip


def test_a_replays_tables_are_filled_inside_the_graph(monkeypatch):
    """CPU: before a replay (``init_forward_metadata_out_graph``) the backend only points the metadata
    at the graph's buffers; the block table, lengths and shared-prefix step tables are computed by the
    in-graph part, which a replay repeats from the graph's input buffers (so a new batch in the same
    buffers gets new tables without any eager launch)."""
    built = {}
    backend = decode_backend(monkeypatch, built, shared_prefix_decode="on", sv_prefill=0.0, sv_decode=0.0)
    backend.init_cuda_graph_state(16, 16)
    batch = decode_batch(16)
    backend.init_forward_metadata_out_graph(batch)
    meta = backend.forward_metadata
    assert not bool(meta.block_table.any()) and bool((meta.seq_lens_gpu == 1).all())  # untouched buffers
    assert backend.runtime.shared_decode_counts.tolist() == [0, 0]
    backend.init_forward_metadata_in_graph(batch)
    assert meta.block_table.data_ptr() == backend._graph_table.data_ptr() and bool((meta.seq_lens_gpu == 200).all())
    assert bool((meta.decode_step.pick >= 0).all()) and backend.runtime.shared_decode_counts.tolist() == [16, 16]
    own_lens = meta.decode_step.own_lens.clone()
    batch.seq_lens.fill_(130)  # the runner refills its input buffers before the next replay
    backend.init_forward_metadata_in_graph(batch)
    assert bool((meta.seq_lens_gpu == 130).all()) and not torch.equal(meta.decode_step.own_lens, own_lens)
    # A capture's warm-up runs (in_capture=True, then the in-graph part run eagerly) count its dummy
    # batches; the first replay starts the log line's counts from zero.
    backend.init_forward_metadata_out_graph(batch, in_capture=True)
    backend.init_forward_metadata_in_graph(batch)
    assert backend.runtime.shared_decode_counts.tolist() == [48, 48]
    backend.init_forward_metadata_out_graph(batch)
    assert backend.runtime.shared_decode_counts.tolist() == [0, 0]
    backend.init_forward_metadata_in_graph(batch)
    assert backend.runtime.shared_decode_counts.tolist() == [16, 16]


def test_every_decode_batch_size_shares_one_plan_and_one_kernel(monkeypatch):
    """CPU, with a recording kernel: the CUDA-graph state builds one plan for the largest captured batch;
    every captured batch size (SGLang's 36 defaults) and an eager batch beyond them run on it, views of
    one scratch, and the model shape compiles one decode kernel."""
    built = {}
    backend = decode_backend(monkeypatch, built)
    capture = [1, 2, 4, 8, 12, 16, 24, 32] + list(range(40, 257, 8))
    backend.init_cuda_graph_state(max(capture), max(capture))
    plan = backend._decode_plan_obj
    assert plan.batch_size == 256
    for bs in capture:
        graph_step(backend, decode_batch(bs))
        meta = backend.forward_metadata
        assert meta.decode_plan is plan and meta.block_table.shape == (bs, 8) and meta.seq_lens_gpu.shape == (bs,)
    backend.init_forward_metadata(decode_batch(300))  # eager, no padding
    assert backend.forward_metadata.decode_plan is plan and backend.forward_metadata.block_table.shape == (300, 8)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=HQ, head_dim=D, v_head_dim=D, scaling=0.125)
    out = backend.forward_decode(torch.zeros(300, HQ * D, dtype=torch.float16), None, None, layer, decode_batch(300),
                                 save_kv_cache=False)
    assert out.shape == (300, HQ * D) and bool((out == 1).all())
    assert list(built) == [(HQ, HKV, D, 64, "float16", 2)]


def test_a_2_4_k_and_v_store_decodes_on_the_compact_kernel(monkeypatch):
    """CPU, with recording kernels: at S_K = S_V = 1 (16-bit KV, no shared-prefix decode) the decode plan
    is the compact kernel: every layer launches it over the block table, and start-up compiles it in place
    of the any-form kernel. Shared-prefix decode, a fractional S and a head_dim below the compact kernel's
    keep the any-form kernel (this module's model has d 64: the floor is lowered to see the wiring)."""
    from sglang_hs.kernels import decode, jobs

    ones = dict(sk_prefill=1.0, sk_decode=1.0, sv_prefill=1.0, sv_decode=1.0)
    assert decode_backend(monkeypatch, {}, **ones).decode_compact is None  # d 64
    monkeypatch.setattr(decode, "COMPACT_MIN_HEAD_DIM", D)
    built = {}
    backend = decode_backend(monkeypatch, built, **ones)
    assert backend.decode_compact == ("sparse", "sparse")
    backend.init_cuda_graph_state(4, 4)
    graph_step(backend, decode_batch(3))
    layer = SimpleNamespace(layer_id=1, tp_q_head_num=HQ, head_dim=D, v_head_dim=D, scaling=0.125)
    out = backend.forward_decode(torch.zeros(3, HQ * D, dtype=torch.float16), None, None, layer, decode_batch(3),
                                 save_kv_cache=False)  # fmt: skip
    assert bool((out == 1).all())
    shape = (HQ, HKV, D, 64, "float16", 2, 512, 1, False, False, ("sparse", "sparse"))
    assert list(built) == [shape]
    assert built[shape].tables[-1][1].shape[0] == 3
    seen = []
    monkeypatch.setattr(jobs, "prepare_kernels", lambda job_list, log: seen.append(job_list) or 0)
    backend._prepare_kernels(SimpleNamespace(kernels_available=True, uses_kernel=lambda name: name == "decode"))
    assert seen[-1] == [("decode", shape)]
    assert decode_backend(monkeypatch, {}, shared_prefix_decode="on", **ones).decode_compact is None
    assert decode_backend(monkeypatch, {}, sk_prefill=0.5, sk_decode=1.0, sv_prefill=1.0, sv_decode=1.0).decode_compact is None


def test_fp8_store_decodes_on_the_kernels_fp8_variant(monkeypatch):
    """CPU, with a recording kernel: with --hierasparse-store-dtype fp8_e4m3 (kernels: decode) the
    decode plan is the kernel's store_fp8 variant, compiled at start-up as such, and each layer's launch
    gets that layer's e4m3 pools and row scales (the empty 2:4 pools' as one-row stand-ins)."""
    from sglang_hs.format import FP8_DTYPE
    from sglang_hs.kernels import jobs

    built = {}
    backend = decode_backend(monkeypatch, built, value_dtype=FP8_DTYPE, store_dtype="fp8_e4m3", kernels="none")
    backend.init_cuda_graph_state(4, 4)
    assert backend._decode_plan_obj.store_fp8
    graph_step(backend, decode_batch(2))
    for layer_id in (0, 1):
        layer = SimpleNamespace(layer_id=layer_id, tp_q_head_num=HQ, head_dim=D, v_head_dim=D, scaling=0.125)
        out = backend.forward_decode(torch.zeros(2, HQ * D, dtype=torch.float16), None, None, layer, decode_batch(2),
                                     save_kv_cache=False)  # fmt: skip
        assert bool((out == 1).all())
    ((key, kernel),) = built.items()
    assert key == (HQ, HKV, D, 64, "float16", 2, 512, 1, True)
    assert len(kernel.scales) == 2
    for layer_id, scales in enumerate(kernel.scales):
        pools = backend.store.layer_pools(layer_id)
        assert pools.quantized and pools.k_dense.dtype == FP8_DTYPE
        assert scales[0].data_ptr() == pools.k_dense_scale.data_ptr() and scales[2].data_ptr() == pools.v_dense_scale.data_ptr()
        assert scales[1].tolist() == scales[3].tolist() == [1.0]  # no 2:4 rows in this store: stand-ins
    seen = []
    monkeypatch.setattr(jobs, "prepare_kernels", lambda job_list, log: seen.append(job_list) or 0)
    backend._prepare_kernels(SimpleNamespace(kernels_available=True, uses_kernel=lambda name: name == "decode"))
    assert seen[-1] == [("decode", key)]


def test_shared_prefix_decode_runs_both_passes_from_graph_buffers(monkeypatch):
    """CPU, with recording kernels: with --hierasparse-shared-prefix-decode on, the decode plan is the
    shared-prefix one; every captured batch size's step tables are views of buffers allocated once (the
    addresses a graph captured), requests sharing a row are grouped, and a layer launches the shared
    pass (over column sets, on the extend kernel: 64 // G requests a set) and the own pass (over
    requests, on the decode kernel). The store's compressed blocks are dense (S = 0), so the shared
    pass's kernel holds dense blocks only and takes every block of the rows."""
    from sglang_hs.kernels.decode_shared import SharedPrefixDecode, fold_of, shared_heads
    from sglang_hs.kernels.shared_pass_extend import ExtendSharedPass

    built = {}
    backend = decode_backend(monkeypatch, built, shared_prefix_decode="on", sv_prefill=0.0, sv_decode=0.0)
    assert backend.shared_forms == ("dense", "dense")
    backend.init_cuda_graph_state(16, 16)
    plan = backend._decode_plan_obj
    assert isinstance(plan, SharedPrefixDecode) and plan.batch_size == 16
    assert isinstance(plan.shared_plan, ExtendSharedPass) and plan.fold == 32 // (HQ // HKV)
    assert plan.shared_plan.extend.q_heads == shared_heads(HQ, HKV) == HKV * plan.fold * (HQ // HKV)
    assert plan.shared_plan.batch_size == plan.max_sets == 8 and plan.shared_plan.num_splits == 8
    addresses = None
    for bs in (4, 8, 16):
        graph_step(backend, decode_batch(bs))
        step = backend.forward_metadata.decode_step
        assert step.own_table.shape == (bs, 8) and step.members.shape == (plan.sets_for(bs), fold_of(HQ, HKV))
        # Requests r and r + 2 read the same row; calls of fewer than 8 requests form no sets.
        assert bool((step.pick >= 0).all()) == (bs >= 8) and bool((step.pick < 0).all()) == (bs < 8)
        if bs < 8:  # no sets: the per-set views are empty
            continue
        now = [t.data_ptr() for t in (step.members, step.shared_table, step.own_table, step.pick)]
        assert addresses is None or now == addresses
        addresses = now
    # The batch log line's grouping share: 0 of 4, 8 of 8 and 16 of 16 requests read through column sets.
    assert backend.runtime.shared_decode_counts.tolist() == [24, 28]
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=HQ, head_dim=D, v_head_dim=D, scaling=0.125)
    out = backend.forward_decode(torch.zeros(16, HQ * D, dtype=torch.float16), None, None, layer, decode_batch(16),
                                 save_kv_cache=False)  # fmt: skip
    assert out.shape == (16, HQ * D) and bool((out == 1).all())
    heads = shared_heads(HQ, HKV)
    assert sorted(key[0] for key in built) == sorted([HQ, HQ, heads])  # own pass, per-request, shared pass
    shared_key = next(key for key in built if key[0] == heads)
    assert shared_key[5:] == ("n32", 2, False, ("dense", "dense"), True)  # tile, stages, no 2:4 K, forms, dynamic
    shared_kernel = built[shared_key]
    assert shared_kernel.batches == [plan.max_sets]
    # Its split count per set, chosen on the device from the sets that have blocks to share.
    step = backend.forward_metadata.decode_step
    real = int((step.shared_lens > 0).sum())
    want = [int(plan.splits_by_sets[real]) if n > 0 else 0 for n in step.shared_lens.tolist()]  # empty sets: skipped
    assert 0 < real and shared_kernel.limits[0].tolist() == want
    # A server captures graphs up to a larger batch than it runs: the plan holds max_bs // 2 set rows,
    # a step of 16 requests hands the shared pass 8.
    built.clear()
    backend = decode_backend(monkeypatch, built, shared_prefix_decode="on", sv_prefill=0.0, sv_decode=0.0)
    backend.init_cuda_graph_state(64, 64)
    graph_step(backend, decode_batch(16))
    backend.forward_decode(torch.zeros(16, HQ * D, dtype=torch.float16), None, None, layer, decode_batch(16),
                           save_kv_cache=False)  # fmt: skip
    assert backend._decode_plan_obj.max_sets == 32
    assert built[next(key for key in built if key[0] == heads)].batches == [8]
    backend = decode_backend(monkeypatch, {}, shared_prefix_decode="on", sv_prefill=0.0, sv_decode=0.0)
    backend.init_cuda_graph_state(256, 256)  # 128 set rows: 4 splits keep the scratch at 512 partials
    assert backend._decode_plan_obj.shared_plan.num_splits == 4


def test_start_up_compiles_the_kernels_the_settings_use(monkeypatch):
    """The jobs handed to the parallel compiler at construction: one decode kernel, both extend tiles
    in the store's K form, the pack kernel, and a loss kernel only for a fractional S."""
    from sglang_hs.config import HieraSparseConfig
    from sglang_hs.kernels import jobs

    seen = []
    monkeypatch.setattr(jobs, "prepare_kernels", lambda job_list, log: seen.append(job_list) or 0)
    backend = decode_backend(monkeypatch, {})
    every = SimpleNamespace(kernels_available=True, uses_kernel=lambda name: True)
    assert backend._prepare_kernels(every) == 0
    assert [(kind, args[-1]) for kind, args in seen[-1]] == [
        ("decode", 2), ("extend", False), ("extend", False), ("pack", 64)]
    backend.config = HieraSparseConfig(sk_decode=0.5)
    backend._prepare_kernels(every)
    assert [kind for kind, _ in seen[-1]] == ["decode", "extend", "extend", "pack", "loss"]
    assert seen[-1][-1][1][0] == "k"
    backend._prepare_kernels(SimpleNamespace(kernels_available=True, uses_kernel=lambda name: name == "compress"))
    assert [kind for kind, _ in seen[-1]] == ["pack", "loss"]
    calls = len(seen)
    assert backend._prepare_kernels(SimpleNamespace(kernels_available=False, uses_kernel=lambda name: True)) == 0
    assert len(seen) == calls


def test_sglang_reads_the_delegates_flags_and_nothing_else_of_it():
    """The runners' capability flags are the dense delegate's; any other attribute the backend does not
    define is missing (no forwarding to the delegate), and what SGLang calls is defined here or in the
    base class."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    from sglang_hs.backend import HieraSparseAttnBackend

    backend = make_backend(RecordingPlan())
    flags = ("supports_ragged_verify_graph", "use_captured_forward_metadata_for_breakable_cuda_graph",
             "supports_full_cuda_graph_chunked_prefix")  # fmt: skip
    for value in (True, False):
        backend.dense = SimpleNamespace(**dict.fromkeys(flags, value), kv_indptr="delegate state")
        assert all(getattr(backend, flag) is value for flag in flags)
    assert not hasattr(backend, "kv_indptr")  # the delegate's own state stays its own
    called = ("init_forward_metadata", "init_forward_metadata_out_graph", "init_forward_metadata_in_graph",
              "init_cuda_graph_state", "get_cuda_graph_seq_len_fill_value", "forward_decode", "forward_extend")  # fmt: skip
    assert all(getattr(HieraSparseAttnBackend, name) is not getattr(AttentionBackend, name) for name in called)
    assert backend.needs_cpu_seq_lens and backend.get_cuda_graph_seq_len_fill_value() == 1
