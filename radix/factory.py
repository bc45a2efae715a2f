"""The radix-cache factory SGLang's scheduler calls for ``--radix-cache-backend hierasparse``: the
compressed radix cache, or its hierarchical variant with ``--enable-hierarchical-cache``."""

from __future__ import annotations

import logging

from sglang_hs.config import BACKEND_NAME
from sglang_hs.radix.hook import HieraSparseRadixCache, PrometheusGauges
from sglang_hs.radix.host_tier import dense_host_args, host_budget
from sglang_hs.runtime import runtime_of

logger = logging.getLogger(__name__)


def create_radix_cache(ctx) -> HieraSparseRadixCache:
    """Build the tree for SGLang's scheduler over the model runner's runtime (set up by the attention
    backend) and the KV pool's per-layer buffers. With the hierarchical cache the host budget is split
    between SGLang's dense host pool and the host store, and the tree's layer counter is registered with
    the TP worker (as SGLang's own factory does), so attention waits for each layer's load."""
    runner = ctx.tp_worker.model_runner
    runtime = runtime_of(runner)
    if runtime is None:
        raise TypeError(f"--radix-cache-backend {BACKEND_NAME} needs --attention-backend {BACKEND_NAME}")
    kv_pool = runner.token_to_kv_pool
    layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)
    k_buffers = [kv_pool.get_key_buffer(layer) for layer in layers]
    v_buffers = [kv_pool.get_value_buffer(layer) for layer in layers]
    if ctx.enable_hierarchical_cache:
        from sglang_hs.radix.hicache import HieraSparseHiRadixCache  # needs SGLang's HiRadixCache (sglang_compat)

        budget = host_budget(ctx.server_args, kv_pool, runtime)
        logger.info("hierasparse: host budget %.2f GB = dense host pool %.2f GB + compressed store %.2f GB",
                    budget.total_bytes / 1e9, budget.dense_bytes / 1e9,
                    (budget.total_bytes - budget.dense_bytes) / 1e9)  # fmt: skip
        tree = HieraSparseHiRadixCache(ctx.params, dense_host_args(ctx.server_args, budget), runtime, k_buffers,
                                       v_buffers, budget.store_capacity)  # fmt: skip
        ctx.tp_worker.register_hicache_layer_transfer_counter(tree.cache_controller.layer_done_counter)
    else:
        tree = HieraSparseRadixCache(ctx.params, runtime, k_buffers, v_buffers)
    if ctx.params.enable_metrics:
        tree.enable_metrics(PrometheusGauges({"cache_type": type(tree).__name__}))
    return tree
