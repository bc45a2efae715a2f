"""The per-process wiring: one runtime on the model runner, and the SGLang hooks that reach it.

Each hook sees only the objects SGLang hands it; these tests drive them with those objects (real
SGLang classes where they are cheap to build, stand-ins elsewhere) on CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import run_python

pytestmark = pytest.mark.sglang


def test_plugin_hooks_apply_to_every_sglang_target():
    """Every target the plugin hooks exists in the pinned SGLang and is patched without error."""
    code = (
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "import sglang_hs.plugin as p\n"
        "p.load()\n"
        "HookRegistry.apply_hooks()\n"
        "ours = [t for t, hooks in HookRegistry._hooks.items() if any(h.__module__ == p.__name__ for _, h, _ in hooks)]\n"
        "missing = [t for t in ours if t not in HookRegistry._patched]\n"
        "from sglang_hs.sglang_compat import settings_error_targets\n"
        "print(len(ours) - len(settings_error_targets()), missing)\n"
    )
    result = run_python("-c", code, cwd="/")
    assert result.returncode == 0, result.stderr[-2000:]
    count, missing = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(count) == 8 and missing == "[]", result.stdout


def fake_runner(memory_pool_config=None):
    """The parts of a ModelRunner the runtime reads: pools of 2 layers x 2 KV heads x d 64."""
    kv_pool = SimpleNamespace(layer_num=2, head_num=2, head_dim=64, dtype=torch.float16, device="cpu")
    allocator = SimpleNamespace(size=64 * 40)
    return SimpleNamespace(memory_pool_config=memory_pool_config or SimpleNamespace(), token_to_kv_pool=kv_pool,
                           token_to_kv_pool_allocator=allocator, page_size=64)  # fmt: skip


def test_runtime_is_built_once_from_the_reservation(monkeypatch):
    from sglang_hs.config import ENV_VAR, HieraSparseConfig
    from sglang_hs.pools import compress_prefix
    from sglang_hs.runtime import RESERVATION_ATTR, StoreReservation, attach_runtime, runtime_of

    config = HieraSparseConfig(sk_prefill=0.5, kernels="none")
    pool_config = SimpleNamespace(**{RESERVATION_ATTR: StoreReservation(config, 8 << 20)})
    runner = fake_runner(pool_config)
    monkeypatch.setenv(ENV_VAR, "not json: the reservation's settings are used, the environment is not read")
    assert runtime_of(runner) is None
    runtime = attach_runtime(runner)
    assert runtime_of(runner) is runtime and attach_runtime(runner) is runtime
    assert runtime.config is config and runtime.store_budget_bytes == 8 << 20
    assert runtime.store.capacity.k_sparse > 0 and runtime.store.capacity.virtual_blocks > 0
    assert runtime.virtual.base == 64 * 41 and runtime.compress_prefix is compress_prefix
    assert not runtime.uses_kernel("decode")


def test_over_fp8_pages_the_store_keeps_the_models_dtype():
    """SGLang's FP8 pages (--kv-cache-dtype fp8_e4m3): the store's blocks stay 16-bit values of the model's
    dtype (FP8 only with --hierasparse-store-dtype), and a checkpoint's KV scales are refused."""
    from sglang_hs.config import HieraSparseConfig, HieraSparseConfigError
    from sglang_hs.runtime import RESERVATION_ATTR, HieraSparseRuntime, StoreReservation

    for store_dtype, value_dtype in (("auto", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        config = HieraSparseConfig(kernels="none", store_dtype=store_dtype)
        runner = fake_runner(SimpleNamespace(**{RESERVATION_ATTR: StoreReservation(config, 8 << 20)}))
        runner.token_to_kv_pool.dtype, runner.dtype = torch.float8_e4m3fn, torch.bfloat16
        runner.model = torch.nn.Linear(1, 1)
        store = HieraSparseRuntime.build(runner).store
        assert store.dtype == torch.bfloat16 and store.value_dtype == value_dtype
    runner.model.k_scale_float = 0.5
    with pytest.raises(HieraSparseConfigError, match="KV scales"):
        HieraSparseRuntime.build(runner)


def test_without_a_reservation_the_store_is_empty_and_settings_come_from_the_environment(monkeypatch):
    from sglang_hs.config import ENV_VAR, HieraSparseConfig
    from sglang_hs.runtime import attach_runtime

    monkeypatch.setenv(ENV_VAR, HieraSparseConfig(window_tokens=128).to_json())
    runtime = attach_runtime(fake_runner())
    assert runtime.config.window_tokens == 128 and runtime.store.capacity.virtual_blocks == 0


def test_radix_cache_factory_needs_the_backends_runtime():
    from sglang_hs.radix.factory import create_radix_cache

    ctx = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=fake_runner()), params=None)
    with pytest.raises(TypeError, match="needs --attention-backend hierasparse"):
        create_radix_cache(ctx)


def test_log_line_and_idle_check_find_the_tree_through_scheduler_objects():
    from sglang.srt.managers.scheduler_components.pool_stats_observer import PoolStats

    from sglang_hs.radix.hook import HieraSparseRadixCache, check_store_when_idle, status_line_parts, tag_pool_stats

    tree = HieraSparseRadixCache.__new__(HieraSparseRadixCache)  # only status() and the store are read
    tree.store = SimpleNamespace(check=lambda: None)
    tree.status = lambda: {"compressed_tokens": 640, "dense_tree_tokens": 320, "store_used_blocks": 10,
                           "store_capacity_blocks": 40, "bytes_saved": 3 << 20}  # fmt: skip
    stats = PoolStats(full_num_used=1, full_token_usage=0.1, full_available_size=2, full_evictable_size=3)
    tag_pool_stats(stats, SimpleNamespace(tree_cache=object()))  # another tree: nothing to add
    assert status_line_parts(["#token: 1"], stats) is None
    tag_pool_stats(stats, SimpleNamespace(tree_cache=tree))
    parts = status_line_parts(["#token: 1"], stats)
    assert parts[0] == "#token: 1" and "#hs compressed token: 640" in parts and "hs store usage: 0.25" in parts
    assert not any("shared-decode" in part for part in parts)
    tree.runtime = SimpleNamespace(shared_decode_counts=torch.tensor([30, 40]))  # shared-prefix decode on
    assert "hs shared-decode grouped: 0.75" in status_line_parts(["#token: 1"], stats)
    tree.runtime = SimpleNamespace(decode_mode_counts=torch.tensor([12, 96]))  # a decode mode on
    assert "hs decode-mode read: 0.125" in status_line_parts(["#token: 1"], stats)
    checker = SimpleNamespace(tree_cache=tree)
    assert check_store_when_idle((False, ["ok"]), checker) is None
    tree.store = SimpleNamespace(check=lambda: "compressed store leak: ...")
    assert check_store_when_idle((False, ["ok"]), checker) == (True, ["ok", "compressed store leak: ..."])
    assert check_store_when_idle((False, ["ok"]), SimpleNamespace(tree_cache=object())) is None


def _ordered_sum_rank(rank: int, world: int, init_file: str, seed_base: int, queue) -> None:
    import torch.distributed as dist

    from sglang_hs.runtime import ordered_sum

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mine = torch.randn(2, 37, generator=torch.Generator().manual_seed(seed_base + rank)) * 10 ** (rank - 1)
        total = ordered_sum(mine, SimpleNamespace(world_size=world, cpu_group=dist.group.WORLD))
        # By value (numpy pickles its bytes): a torch tensor would travel as a shared-memory file
        # descriptor, which the parent can no longer fetch once this process has exited.
        queue.put((rank, total.numpy().copy()))
    finally:
        dist.destroy_process_group()


def test_ordered_sum_gives_every_rank_the_same_bits(tmp_path):
    """The tensor-parallel loss reduction over real gloo processes: every rank gets the rank-ordered sum
    of all ranks' losses, bit for bit (the block choice of every rank depends on it)."""
    import torch.multiprocessing as mp

    world, seed_base = 3, 100
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ordered_sum_rank, args=(r, world, str(tmp_path / "init"), seed_base, queue))
             for r in range(world)]  # fmt: skip
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=120) for _ in range(world))
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    parts = [torch.randn(2, 37, generator=torch.Generator().manual_seed(seed_base + r)) * 10 ** (r - 1)
             for r in range(world)]  # fmt: skip
    expected = parts[0].clone()
    for part in parts[1:]:
        expected += part
    for rank in range(world):
        assert torch.equal(torch.from_numpy(results[rank]), expected)
