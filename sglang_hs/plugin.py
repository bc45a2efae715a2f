"""The ``sglang.srt.plugins`` entry point: makes ``--attention-backend hierasparse`` exist.

SGLang (0.5.17 to 0.5.23, :data:`sglang_hs.sglang_compat.SUPPORTED_SGLANG`) calls :func:`load` in the
launcher, the engine and every scheduler process, then applies the hooks registered here through its
``HookRegistry``. Nothing in SGLang's files is edited; where SGLang's private interfaces differ between
the supported releases, :mod:`sglang_hs.sglang_compat` holds the difference.

- ``--attention-backend hierasparse`` is added to the choices and its factory is registered.
- ``--hierasparse-*`` flags are added to SGLang's parser; the launcher validates them and exports
  them (``SGLANG_HIERASPARSE_CONFIG``) to the scheduler processes.
- When the backend is selected, server-argument defaults it needs are applied (``--page-size`` =
  block size; prefill CUDA graphs only when asked for, and only breakable ones) and the model and GPU
  are checked, so that a bad setting stops the launcher with one line instead of a traceback from a
  scheduler.
- With ``--enable-hierarchical-cache`` the same radix-cache backend builds its hierarchical variant
  (SGLang's HiRadixCache, host pool and controller; compressed prefixes on the host tier too; SGLang
  releases without HiRadixCache refuse the flag with one line).
- In each scheduler process the KV-budget hook, the attention-backend factory and the radix-cache
  factory set up one :class:`sglang_hs.runtime.HieraSparseRuntime` on the model runner; the log-line
  and idle-check hooks find the tree through the scheduler objects SGLang hands them.

Every hook imports its module when SGLang first calls it: the plugin loads in every SGLang process.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from sglang_hs.config import (BACKEND_NAME, HieraSparseConfig, HieraSparseConfigError, cli_flag, field_parser,
                              uses_backend)
from sglang_hs.sglang_compat import (SUPPORTED_SGLANG, ServerArgsResolution, attention_defaults_target,
                                     hierarchical_cache_problem, settings_error_targets, sglang_version,
                                     version_problem)  # fmt: skip

logger = logging.getLogger(__name__)

__all__ = ("SUPPORTED_SGLANG", "load")
_SERVER_ARGS = "sglang.srt.server_args"


def load() -> None:
    """Register the backend choice, its factory and the server-argument hooks (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_backend)

    HookRegistry.register(f"{_SERVER_ARGS}.ServerArgs.add_cli_args", add_cli_flags, HookType.AFTER)
    HookRegistry.register(f"{_SERVER_ARGS}.ServerArgs.from_cli_args", read_cli_flags, HookType.AROUND)
    HookRegistry.register(attention_defaults_target(), apply_backend_defaults, HookType.AFTER)
    for target in settings_error_targets():
        HookRegistry.register(target, exit_with_one_line, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.config_from_budget",
        reserve_store_budget,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver.get_pool_stats",
        tag_pool_stats,
        HookType.AFTER,
    )
    for phase in ("decode", "prefill"):
        HookRegistry.register(
            f"sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats.get_{phase}_usage_msg_parts",
            status_line_parts,
            HookType.AFTER,
        )
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_all_pools",
        check_store_when_idle,
        HookType.AFTER,
    )
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, create_radix_cache)


# Hook targets. The plugin loads in every SGLang process (the launcher included), so each hook imports
# its module when SGLang first calls it: registering must not import the backend, the kernels or the
# radix hook.
def create_backend(*args, **kwargs):
    """Attention-backend factory, called by SGLang's ModelRunner in each scheduler process."""
    from sglang_hs.backend import create_backend as create

    return create(*args, **kwargs)


def reserve_store_budget(*args, **kwargs):
    """The compressed store's share of SGLang's KV-cache budget, taken when the pools are sized."""
    from sglang_hs.runtime import reserve_store_budget as reserve

    return reserve(*args, **kwargs)


def tag_pool_stats(*args, **kwargs):
    """Hands the scheduler's tree to the batch log line through the pool statistics."""
    from sglang_hs.radix.hook import tag_pool_stats as tag

    return tag(*args, **kwargs)


def status_line_parts(*args, **kwargs):
    """The compressed cache's status, appended to SGLang's periodic batch log line."""
    from sglang_hs.radix.hook import status_line_parts as parts

    return parts(*args, **kwargs)


def check_store_when_idle(*args, **kwargs):
    """The compressed store's own leak check, added to SGLang's idle memory check."""
    from sglang_hs.radix.hook import check_store_when_idle as check

    return check(*args, **kwargs)


def create_radix_cache(*args, **kwargs):
    """Radix-cache factory (``--radix-cache-backend hierasparse``, set by the backend defaults)."""
    from sglang_hs.radix.factory import create_radix_cache as create

    return create(*args, **kwargs)


# --------------------------------------------------------------------------------------- CLI flags
_FLAG_HELP = {
    "block_size": "Tokens per compressed block; also SGLang's --page-size.",
    "sink_tokens": "Leading tokens of a sequence that always stay dense.",
    "window_tokens": "Trailing tokens of a cached prefix that stay dense.",
    "sk_prefill": "Fraction of prompt-token blocks whose K is stored 2:4 sparse.",
    "sv_prefill": "Fraction of prompt-token blocks whose V is stored 2:4 sparse.",
    "sk_decode": "Fraction of generated-token blocks whose K is stored 2:4 sparse.",
    "sv_decode": "Fraction of generated-token blocks whose V is stored 2:4 sparse.",
    "pruner": "Pruner that picks element masks and ranks blocks.",
    "store_fraction": "Share of the KV-cache memory budget given to the compressed store.",
    "host_store_fraction": "With --enable-hierarchical-cache: share of the host tier given to compressed blocks.",
    "dense_backend": "SGLang backend that attends over the dense tokens.",
    "kernels": "TileLang kernels to use (decode,extend,compress); 'none' runs the PyTorch paths.",
    "store_dtype": "Values of the compressed blocks: 'auto' (the model's dtype) or 'fp8_e4m3' (a scale per block and head).",
    "k_channel_order": "K channel order file (python -m sglang_hs.launch.calibrate_channels); 2:4 K loses less with it.",
    "k_head_map": "K head map file (python -m sglang_hs.launch.calibrate_heads): K stays dense on the heads that retrieve.",
    "shared_prefix_decode": "'on': requests of a decode batch that share a prefix read it once per group.",
    "decode_mode": "'kascade' or 'psa': between anchor layers decode reads only the compressed blocks an anchor chose.",
    "decode_anchors": "Decode modes' anchor layers, a comma list from 0 (default: every 4th layer).",
    "decode_topk": "Decode modes: compressed blocks read between anchors (kascade), or at most (psa).",
    "decode_tau": "psa: share of the anchor's attention mass on compressed blocks the chosen blocks reach.",
}


def add_cli_flags(_result, parser: argparse.ArgumentParser) -> None:
    """AFTER hook on ``ServerArgs.add_cli_args``: one argument group with every setting."""
    if any(action.dest.startswith("hierasparse_") for action in parser._actions):
        return
    group = parser.add_argument_group("HieraSparse (with --attention-backend hierasparse)")
    for field in dataclasses.fields(HieraSparseConfig):
        group.add_argument(
            cli_flag(field.name),
            dest=f"hierasparse_{field.name}",
            type=field_parser(field),
            default=None,
            help=f"{_FLAG_HELP[field.name]} (default: {field.default})",
        )


def read_cli_flags(original, cls, args: argparse.Namespace):
    """AROUND hook on ``ServerArgs.from_cli_args``: validate the flags and export them before the
    dataclass (and its ``__post_init__`` checks) is built."""
    given = {
        field.name: getattr(args, f"hierasparse_{field.name}")
        for field in dataclasses.fields(HieraSparseConfig)
        if getattr(args, f"hierasparse_{field.name}", None) is not None
    }
    if given:
        base = dataclasses.asdict(HieraSparseConfig.from_env())
        HieraSparseConfig.from_mapping({**base, **given}).export()
    return original(cls, args)


# --------------------------------------------------------------------------------------- defaults
def apply_backend_defaults(_result, server_args) -> None:
    """AFTER hook on SGLang's attention-backend resolution step (``sglang_compat.attention_defaults_target``)."""
    if not uses_backend(server_args):
        return
    config = HieraSparseConfig.from_env()
    check_sglang_version()
    explicit = server_args
    server_args = ServerArgsResolution(explicit)  # reads the values resolved so far; writes with declare()
    prefill, decode = server_args.prefill_attention_backend, server_args.decode_attention_backend
    if server_args.attention_backend != BACKEND_NAME or {prefill, decode} - {None, BACKEND_NAME}:
        raise HieraSparseConfigError(
            f"hierasparse: --prefill-attention-backend={prefill} --decode-attention-backend={decode} "
            f"mix backends; allowed: --attention-backend {BACKEND_NAME} for both phases"
        )
    if server_args.page_size not in (None, config.block_size):
        raise HieraSparseConfigError(
            f"hierasparse: --page-size={server_args.page_size} differs from "
            f"{cli_flag('block_size')}={config.block_size}; allowed: {config.block_size} or unset"
        )
    server_args.declare(page_size=config.block_size)
    # Prefill CUDA graphs are off unless asked for with SGLang's --cuda-graph-backend-prefill breakable:
    # breakable graphs capture the layers' GEMMs and norms and run attention eagerly between the
    # captured segments with the live batch's metadata, which the compressed extend path needs (it
    # reads the batch's block table on the host); graphs that capture attention itself cannot take it.
    # Decode keeps SGLang's CUDA graphs when the TileLang decode kernel runs (it serves every decode
    # batch); without TileLang, or with the kernel left out of --hierasparse-kernels, decode falls back
    # to eager PyTorch and its graphs are off too.
    from importlib.util import find_spec

    from sglang.srt.model_executor.cuda_graph_config import Backend

    prefill_graphs = getattr(explicit, "cuda_graph_backend_prefill", None)  # the flag as given
    if prefill_graphs not in (None, Backend.DISABLED, Backend.BREAKABLE):
        raise HieraSparseConfigError(
            f"hierasparse: --cuda-graph-backend-prefill={prefill_graphs} captures attention; allowed: "
            f"{Backend.BREAKABLE} or {Backend.DISABLED} (the default)"
        )
    server_args.declare_cuda_graph_backend("prefill", prefill_graphs or Backend.DISABLED)
    has_tilelang = find_spec("tilelang") is not None
    if not has_tilelang:
        logger.warning("hierasparse: TileLang is not installed; the compressed paths run on PyTorch, decode "
                       "without CUDA graphs")
    if not (has_tilelang and config.uses_kernel("decode")):
        server_args.declare_cuda_graph_backend("decode", Backend.DISABLED)
    if not server_args.disable_radix_cache:
        if server_args.radix_cache_backend not in (None, BACKEND_NAME):
            raise HieraSparseConfigError(
                f"hierasparse: --radix-cache-backend={server_args.radix_cache_backend} is invalid; allowed: "
                f"unset or '{BACKEND_NAME}' (the compressed radix cache, hierarchical with "
                "--enable-hierarchical-cache)"
            )
        if server_args.enable_hierarchical_cache:
            check_hierarchical_cache(server_args, config)
        # The factory builds the hierarchical variant when SGLang's build context asks for HiCache.
        server_args.declare(radix_cache_backend=BACKEND_NAME)

    model_config = server_args.model_config()
    HieraSparseConfig.validate_architecture(
        architecture=(model_config.hf_config.architectures or ["model"])[0],
        attention_arch=model_config.attention_arch.name,
        # A window in the config counts unless the config turns it off (Qwen2/Qwen3: use_sliding_window false).
        sliding_window=bool(getattr(model_config, "is_hybrid_swa", False)) or (
            getattr(model_config, "sliding_window_size", None) is not None
            and getattr(model_config.hf_text_config, "use_sliding_window", True) is not False),
        encoder_decoder=bool(getattr(model_config, "is_encoder_decoder", False)),
        chunked_attention=getattr(model_config, "attention_chunk_size", None) is not None,
    )
    config.validate_model(
        head_dim=model_config.head_dim,
        dtype=str(model_config.dtype).removeprefix("torch."),
        kv_cache_dtype=server_args.kv_cache_dtype,
        gqa_group=model_config.get_num_attention_heads(server_args.tp_size)
        // model_config.get_num_kv_heads(server_args.tp_size),
        num_layers=model_config.num_hidden_layers,
    )
    if server_args.device != "cuda":
        raise HieraSparseConfigError(f"hierasparse: --device={server_args.device} is invalid; allowed: cuda")
    import torch

    if torch.cuda.is_available():
        HieraSparseConfig.validate_gpu(torch.cuda.get_device_capability(), torch.cuda.get_device_name())
    else:
        HieraSparseConfig.validate_gpu(None)
    config.export()
    logger.info("hierasparse settings: %s", config.to_json())


HICACHE_IO_BACKENDS = ("kernel", "direct")
HICACHE_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
"""SGLang's MHA host pool layouts; the compressed blocks have their own host store in any of them."""


def check_hierarchical_cache(server_args, config: HieraSparseConfig | None = None) -> None:
    """``--enable-hierarchical-cache`` with hierasparse keeps compressed prefixes on the host tier
    (``docs/hicache.md``). Refused, one line each: L3 storage backends (they move fixed-size dense pages,
    and prefetch allocates dense host slots), speculative decoding (SGLang's draft host pool would reuse
    the dense-only transfer indices), IO backends and host layouts SGLang's MHA host pool lacks on CUDA."""
    problem = hierarchical_cache_problem()
    if problem is not None:
        raise HieraSparseConfigError(problem)
    if config is not None and config.store_dtype != "auto":
        raise HieraSparseConfigError(
            f"hierasparse: --hierasparse-store-dtype={config.store_dtype} with --enable-hierarchical-cache is "
            "not supported yet; allowed: auto"
        )
    if server_args.hicache_storage_backend is not None:
        raise HieraSparseConfigError(
            f"hierasparse: --hicache-storage-backend={server_args.hicache_storage_backend} is not supported yet; "
            "allowed: unset (GPU and host tiers, compressed in both)"
        )
    if server_args.speculative_algorithm is not None:
        raise HieraSparseConfigError(
            f"hierasparse: --speculative-algorithm={server_args.speculative_algorithm} with "
            "--enable-hierarchical-cache is invalid; allowed: unset"
        )
    if server_args.hicache_io_backend not in HICACHE_IO_BACKENDS:
        raise HieraSparseConfigError(
            f"hierasparse: --hicache-io-backend={server_args.hicache_io_backend} is invalid; allowed: one of "
            f"{list(HICACHE_IO_BACKENDS)}"
        )
    if server_args.hicache_mem_layout not in HICACHE_LAYOUTS:
        raise HieraSparseConfigError(
            f"hierasparse: --hicache-mem-layout={server_args.hicache_mem_layout} is invalid; allowed: one of "
            f"{list(HICACHE_LAYOUTS)}"
        )
    if server_args.hicache_size <= 0 and server_args.hicache_ratio <= 0:
        raise HieraSparseConfigError(
            f"hierasparse: --hicache-ratio={server_args.hicache_ratio} with --hicache-size=0 leaves no host tier; "
            "allowed: a positive --hicache-ratio or --hicache-size"
        )


def check_sglang_version() -> None:
    """The installed SGLang must lie in the tested range (``sglang_compat.SUPPORTED_SGLANG``)."""
    problem = version_problem(sglang_version())
    if problem is not None:
        raise HieraSparseConfigError(problem)


def exit_with_one_line(original, *args, **kwargs):
    """AROUND hook on where the launcher checks its settings (``sglang_compat.settings_error_targets``): a
    settings error ends the launcher with one line."""
    try:
        return original(*args, **kwargs)
    except HieraSparseConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
