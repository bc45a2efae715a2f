"""The SGLang adapter (``sglang_hs.sglang_compat``) against whichever SGLang is installed: CI runs this
file on the oldest and the newest supported release. Each difference the adapter holds must resolve to
the installed SGLang's real classes, functions and methods."""

from __future__ import annotations

import pkgutil
from array import array
from types import SimpleNamespace

import pytest
import torch

from sglang_hs import sglang_compat as compat

pytestmark = pytest.mark.sglang


def test_the_installed_sglang_lies_in_the_supported_range():
    low, high = compat.SUPPORTED_SGLANG
    assert compat.version_problem(compat.sglang_version()) is None
    assert compat.version_problem(low) is None and compat.version_problem(high) is None


@pytest.mark.parametrize("found", ["0.5.16", "0.5.24", "0.6.0", "0.5.23rc1", "not installed"])
def test_versions_outside_the_range_are_refused_with_one_line(found, monkeypatch):
    from sglang_hs.config import HieraSparseConfigError
    from sglang_hs import plugin

    problem = compat.version_problem(found)
    assert problem is not None and "\n" not in problem
    assert f"sglang {found} is not supported" in problem and "allowed: sglang>=0.5.17,<=0.5.23" in problem
    monkeypatch.setattr(plugin, "sglang_version", lambda: found)
    with pytest.raises(HieraSparseConfigError, match="is not supported"):
        plugin.check_sglang_version()
    assert plugin.SUPPORTED_SGLANG == compat.SUPPORTED_SGLANG


def test_hook_targets_name_the_installed_sglangs_functions():
    from sglang.srt.server_args import ServerArgs

    target = compat.attention_defaults_target()
    assert callable(pkgutil.resolve_name(target))
    if hasattr(ServerArgs, "_handle_attention_backend_compatibility"):  # 0.5.17: a ServerArgs method
        assert target.endswith("ServerArgs._handle_attention_backend_compatibility")
    else:  # 0.5.23: a step of the resolution pipeline
        assert target.startswith("sglang.srt.arg_groups.")
    targets = compat.settings_error_targets()
    assert targets[0] == "sglang.srt.server_args.prepare_server_args"
    assert all(callable(pkgutil.resolve_name(t)) for t in targets)
    assert ("sglang.srt.server_args.ServerArgs.resolve_once" in targets) == hasattr(ServerArgs, "resolve_once")


def test_hierarchical_cache_is_found_or_refused_with_one_line():
    from sglang.srt.mem_cache.radix_cache import RadixCache

    if compat.has_hiradix_cache():  # 0.5.17
        assert compat.hierarchical_cache_problem() is None
        assert issubclass(compat.hiradix_cache_class(), RadixCache)
        assert compat.hiradix_cache_class().__name__ == "HiRadixCache"
    else:  # 0.5.23: HiCache lives on UnifiedRadixCache
        problem = compat.hierarchical_cache_problem()
        assert "--enable-hierarchical-cache" in problem and "allowed: unset" in problem and "\n" not in problem
        with pytest.raises(ImportError, match="HiRadixCache"):
            compat.hiradix_cache_class()


def test_the_plugin_refuses_hierarchical_cache_where_sglang_has_no_hiradix_cache(monkeypatch):
    from sglang_hs import plugin
    from sglang_hs.config import HieraSparseConfigError

    monkeypatch.setattr(plugin, "hierarchical_cache_problem", lambda: "hierasparse: no HiRadixCache; allowed: unset")
    args = SimpleNamespace(hicache_storage_backend=None, speculative_algorithm=None, hicache_io_backend="kernel",
                           hicache_mem_layout="page_first", hicache_size=0, hicache_ratio=2.0)  # fmt: skip
    with pytest.raises(HieraSparseConfigError, match="no HiRadixCache"):
        plugin.check_hierarchical_cache(args)


def simulated_tree():
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache.create_simulated(page_size=1)


def radix_key(tokens):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


def test_stored_nodes_are_watched_and_removals_recorded_on_the_real_tree():
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    tree = simulated_tree()
    recorded, seen = [], []
    # SGLang's own recording, spied on: 0.5.17 the tree's methods, 0.5.23 its event recorder's.
    owner, store, remove = ((tree.kv_events, "record_store", "record_remove") if hasattr(tree, "kv_events")
                            else (tree, "_record_store_event", "_record_remove_event"))  # fmt: skip
    for name in (store, remove):
        original = getattr(owner, name)
        setattr(owner, name, lambda node, *args, _name=name, _original=original, **kwargs: (
            recorded.append((_name, node)), _original(node, *args, **kwargs)))
    compat.watch_stored_nodes(tree, lambda node, medium: seen.append((node, medium)))
    compat.watch_stored_nodes(tree, lambda node, medium: seen.append(("second", node)))  # watchers add up
    slots = torch.arange(10, 18, dtype=torch.int64)
    tree.insert(InsertParams(key=radix_key(range(8)), value=slots))
    node = next(iter(tree.root_node.children.values()))
    assert seen == [(node, None), ("second", node)] and recorded == [(store, node)]
    compat.record_remove_event(tree, node)
    assert recorded == [(store, node), (remove, node)]


def test_match_results_give_the_prefix_slots_on_the_real_tree():
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

    tree = simulated_tree()
    slots = torch.arange(100, 112, dtype=torch.int64)
    tree.insert(InsertParams(key=radix_key(range(12)), value=slots))
    result = tree.match_prefix(MatchPrefixParams(key=radix_key([*range(6), 99])))
    assert compat.match_device_indices(tree, result).tolist() == slots[:6].tolist()
    empty = tree.match_prefix(MatchPrefixParams(key=radix_key([50, 51])))
    assert len(compat.match_device_indices(tree, empty)) == 0


def test_the_radix_hook_wraps_the_method_that_inserts_requests():
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_hs.radix.hook import HieraSparseRadixCache

    method = compat.request_insert_method()
    assert callable(getattr(RadixCache, method))
    mixin = compat.request_insert_mixin()
    assert method in vars(mixin) and HieraSparseRadixCache.__mro__[1] is mixin
    assert getattr(HieraSparseRadixCache, method) is vars(mixin)[method]


def test_server_args_resolution_on_assignable_arguments():
    """0.5.17's ServerArgs (and plain objects) take assignments; reads give the current values."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    phase = lambda: SimpleNamespace(backend="auto")  # noqa: E731
    args = SimpleNamespace(page_size=None, radix_cache_backend=None, get_model_config=lambda: "model",
                           cuda_graph_config=SimpleNamespace(prefill=phase(), decode=phase()))  # fmt: skip
    resolution = compat.ServerArgsResolution(args)
    resolution.declare(page_size=64, radix_cache_backend="hierasparse")
    resolution.declare_cuda_graph_backend("prefill", Backend.DISABLED)
    assert args.page_size == 64 and resolution.page_size == 64 and args.radix_cache_backend == "hierasparse"
    assert args.cuda_graph_config.prefill.backend == Backend.DISABLED and args.cuda_graph_config.decode.backend == "auto"
    assert resolution.model_config() == "model"
    with pytest.raises(AttributeError):
        resolution.page_size = 16


def test_server_args_resolution_on_sglangs_resolving_server_args():
    """0.5.23's ServerArgs resolve in a pipeline that refuses assignment: the adapter declares."""
    from sglang.srt.server_args import ServerArgs

    if not hasattr(ServerArgs, "resolve_once"):
        pytest.skip(f"sglang {compat.sglang_version()} resolves ServerArgs by assignment (the test above)")
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from sglang.srt.arg_groups.overrides import declare_resolution
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig

    args = ServerArgs(model_path="dummy", page_size=None)
    declare_resolution(args, "test", cuda_graph_config=CudaGraphConfig())  # an earlier step's decision
    resolution = compat.ServerArgsResolution(args)
    resolution.declare(page_size=64)
    resolution.declare_cuda_graph_backend("prefill", Backend.DISABLED)
    view = resolved_view(args)
    assert view.page_size == 64 and resolution.page_size == 64 and args.page_size is None  # the input stays
    assert view.cuda_graph_config.prefill.backend == Backend.DISABLED


def test_the_plugin_refuses_fp8_store_values_on_the_host_tier(monkeypatch):
    from sglang_hs import plugin
    from sglang_hs.config import HieraSparseConfig, HieraSparseConfigError

    monkeypatch.setattr(plugin, "hierarchical_cache_problem", lambda: None)
    args = SimpleNamespace(hicache_storage_backend=None, speculative_algorithm=None, hicache_io_backend="kernel",
                           hicache_mem_layout="page_first", hicache_size=0, hicache_ratio=2.0)  # fmt: skip
    config = HieraSparseConfig(store_dtype="fp8_e4m3", kernels="none")
    with pytest.raises(HieraSparseConfigError, match="--hierasparse-store-dtype=fp8_e4m3 with --enable-hierarchical"):
        plugin.check_hierarchical_cache(args, config)
