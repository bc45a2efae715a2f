"""``HieraSparseRuntime``: what the attention backend and the radix cache of one model runner share.

SGLang builds a scheduler process's parts through separate hooks, none of which sees the others:

1. ``KVCacheConfigurator.config_from_budget`` turns the KV-cache byte budget into pool sizes.
   :func:`reserve_store_budget` (an AROUND hook) takes the store's share out of the budget first, so
   a hierasparse server uses the memory a dense one would, and leaves a :class:`StoreReservation` (the
   parsed settings and the store's bytes) on the resulting ``MemoryPoolConfig``, which the model
   runner keeps as ``model_runner.memory_pool_config``.
2. The attention-backend factory gets the ``ModelRunner``, whose KV pool now exists.
   :func:`attach_runtime` builds the runtime from the reservation (the settings are parsed once per
   process, in step 1, or here when step 1 did not apply) and sets it as
   ``model_runner.hierasparse_runtime``.
3. The radix-cache factory gets ``ctx.tp_worker.model_runner`` and finds the runtime there
   (:func:`runtime_of`).

The backend and the tree hold the same runtime; neither reaches into the other.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from sglang_hs.channel_order import ChannelOrder
from sglang_hs.config import HieraSparseConfig, HieraSparseConfigError, uses_backend
from sglang_hs.k_head_map import KHeadMap
from sglang_hs.pools import CompressedStore, LossReducer, StoreCapacity, VirtualSlots, compress_prefix

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

RUNTIME_ATTR = "hierasparse_runtime"
"""The ``ModelRunner`` attribute that holds the runtime."""
RESERVATION_ATTR = "hierasparse_reservation"
"""The ``MemoryPoolConfig`` attribute that holds the :class:`StoreReservation`."""

Compressor = Callable[..., list[int]]
"""A function with :func:`sglang_hs.pools.compress_prefix`'s signature."""


@dataclass(frozen=True)
class StoreReservation:
    """The settings and the store's share of SGLang's KV-cache budget, fixed while sizing the pools."""

    config: HieraSparseConfig
    store_bytes: int


@dataclass
class HieraSparseRuntime:
    """One model runner's HieraSparse state: settings, compressed store, virtual slots, compressor."""

    config: HieraSparseConfig
    store: CompressedStore
    virtual: VirtualSlots
    compress_prefix: Compressor = compress_prefix
    """The fused TileLang compressor when that kernel is on, else the PyTorch one."""
    store_budget_bytes: int = 0
    kernels_available: bool = False
    """TileLang and a Hopper GPU are present (each kernel also needs its ``--hierasparse-kernels`` entry)."""
    channel_order: ChannelOrder | None = None
    """This rank's K channel order (``--hierasparse-k-channel-order``), or None: natural order."""
    shared_decode_counts: torch.Tensor | None = None
    """With shared-prefix decode: int64 ``[2]`` on the GPU, decoded requests read through a column set
    and decoded requests, summed over the decode steps since start (the backend adds to it without a
    host read; the batch log line shows the share)."""
    decode_mode_counts: torch.Tensor | None = None
    """With a decode mode: int64 ``[2]`` on the GPU, compressed blocks the anchors kept and offered,
    summed over anchor layers and decode steps since start (the batch log line shows the share)."""

    def uses_kernel(self, name: str) -> bool:
        """Whether the TileLang kernel ``name`` runs (available and enabled by the settings)."""
        return self.kernels_available and self.config.uses_kernel(name)

    @classmethod
    def build(cls, model_runner: ModelRunner) -> HieraSparseRuntime:
        """Size the store from the reservation and pick the compressor; the KV pool must exist."""
        reservation: StoreReservation | None = getattr(model_runner.memory_pool_config, RESERVATION_ATTR, None)
        config = reservation.config if reservation else HieraSparseConfig.from_env()
        budget = reservation.store_bytes if reservation else 0
        block = config.block_size
        # Virtual slots start above every dense slot (the KV buffers hold size + page_size rows).
        dense_rows = model_runner.token_to_kv_pool_allocator.size + model_runner.page_size
        virtual = VirtualSlots(base=-(-dense_rows // block) * block, block_size=block)
        kv_pool = model_runner.token_to_kv_pool
        # The store's blocks are 16-bit values of the model's dtype (or FP8 with scales), also over FP8 pages.
        model_dtype = kv_pool.dtype
        if kv_pool.dtype.itemsize == 1:
            check_unit_kv_scales(model_runner.model)
            model_dtype = model_runner.dtype
        head_map = rank_k_head_map(config.k_head_map, kv_pool) if config.k_head_map else None
        capacity = StoreCapacity.from_budget(
            budget, kv_pool.layer_num, kv_pool.head_num, kv_pool.head_dim, block, config.sk_prefill, config.sv_prefill,
            head_map.share if head_map is not None else 1.0, 1 if config.store_value_dtype is not None else 2,
        )  # fmt: skip
        store = CompressedStore(
            capacity, kv_pool.layer_num, kv_pool.head_num, kv_pool.head_dim, block, model_dtype, kv_pool.device,
            k_sparse_heads=head_map.sparse if head_map is not None else None, value_dtype=config.store_value_dtype,
        )  # fmt: skip
        kernels = tilelang_kernels_available()
        compressor: Compressor = compress_prefix
        if kernels and config.uses_kernel("compress"):
            from sglang_hs.kernels.compress import FusedCompressor

            compressor = FusedCompressor()
        reduce_losses = tensor_parallel_loss_sum(model_runner)
        if reduce_losses is not None:
            compressor = functools.partial(compressor, reduce_losses=reduce_losses)
        order = rank_channel_order(config.k_channel_order, kv_pool) if config.k_channel_order else None
        return cls(config, store, virtual, compressor, budget, kernels, order)


def check_unit_kv_scales(model: torch.nn.Module) -> None:
    """SGLang's FP8 pages hold K and V divided by the checkpoint's per-layer scales; the PyTorch paths and
    the compressor read them with unit scales, so a checkpoint that ships other scales is refused."""
    for module in model.modules():
        scales = {getattr(module, name, None) for name in ("k_scale_float", "v_scale_float")} - {None, 1.0}
        if scales:
            raise HieraSparseConfigError(
                f"hierasparse: --kv-cache-dtype fp8 with this checkpoint's KV scales ({sorted(scales)[0]:g}, ...) is "
                "invalid; allowed: a checkpoint without KV scales (unit scales), or --kv-cache-dtype auto")


def attention_tp_rank() -> tuple[int, int]:
    """(rank, size) of this process in SGLang's attention tensor-parallel group ((0, 1) without one):
    which KV heads the per-head calibration files give this rank."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return (parallel.attn_tp_rank, parallel.attn_tp_size) if parallel.attn_tp_size > 1 else (0, 1)


def rank_k_head_map(path: str, kv_pool) -> KHeadMap:
    """The K head map of ``path`` for this rank's KV heads, checked against the KV pool's shape."""
    head_map = KHeadMap.load(path).for_rank(kv_pool.head_num, *attention_tp_rank())
    head_map.check_model(kv_pool.layer_num, kv_pool.head_num)
    return head_map


def rank_channel_order(path: str, kv_pool) -> ChannelOrder:
    """The K channel order of ``path`` for this rank's KV heads, checked against the KV pool's shape."""
    order = ChannelOrder.load(path).for_rank(kv_pool.head_num, *attention_tp_rank())
    order.check_model(kv_pool.layer_num, kv_pool.head_num, kv_pool.head_dim)
    return order


def tensor_parallel_loss_sum(model_runner: ModelRunner) -> LossReducer | None:
    """Under attention tensor parallelism, a reducer that sums block losses over the ranks; None on one
    rank. Every rank compresses the same nodes at the same point of its (identical) schedule, so the
    collective is met by all ranks. It runs on the group's CPU (gloo) side, like SGLang's own
    scheduler-thread collectives, so it never interleaves with the forward pass's NCCL kernels; and it
    gathers every rank's losses and adds them in rank order, so all ranks hold bit-identical sums (a
    reduction's summation order may differ per rank) and rank the blocks identically."""
    if getattr(model_runner, "tp_size", 1) == 1:
        return None
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    if parallel.attn_tp_size == 1:
        return None
    return functools.partial(ordered_sum, group=parallel.attn_tp_group)


def ordered_sum(losses: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``losses`` over the ranks of ``group`` (an SGLang ``GroupCoordinator``: its
    ``world_size`` and gloo ``cpu_group``), added in rank order so that every rank gets the same bits."""
    host = losses.detach().to("cpu", torch.float32)
    parts = [torch.empty_like(host) for _ in range(group.world_size)]
    torch.distributed.all_gather(parts, host, group=group.cpu_group)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total.to(losses.device)


def tilelang_kernels_available() -> bool:
    """The TileLang kernels need TileLang and a Hopper GPU (both checked again at start-up)."""
    return importlib.util.find_spec("tilelang") is not None and torch.cuda.is_available() and (
        torch.cuda.get_device_capability() == (9, 0)
    )


def attach_runtime(model_runner: ModelRunner) -> HieraSparseRuntime:
    """The model runner's runtime, built and attached on first use (by the attention backend)."""
    runtime = runtime_of(model_runner)
    if runtime is None:
        runtime = HieraSparseRuntime.build(model_runner)
        setattr(model_runner, RUNTIME_ATTR, runtime)
    return runtime


def runtime_of(model_runner: ModelRunner) -> HieraSparseRuntime | None:
    return getattr(model_runner, RUNTIME_ATTR, None)


def reserve_store_budget(original, configurator, budget_bytes: int, *args, cap_tokens: int | None = None, **kwargs):
    """AROUND hook on ``KVCacheConfigurator.config_from_budget``: when SGLang sizes the pools from the
    profiled budget, carve the compressed store out of it (``--hierasparse-store-fraction``), so dense
    and hierasparse servers use equal memory. The resize after CUDA-graph capture (``cap_tokens``
    given) measures free memory, where the store is already accounted for, and is left alone."""
    server_args = configurator.server_args
    if (cap_tokens is not None or configurator.is_draft_worker or not uses_backend(server_args)
            or server_args.disable_radix_cache):  # fmt: skip
        return original(configurator, budget_bytes, *args, cap_tokens=cap_tokens, **kwargs)
    config = HieraSparseConfig.from_env()
    store_bytes = int(budget_bytes * config.store_fraction)
    dense_bytes = budget_bytes - store_bytes
    logger.info(
        "hierasparse: KV budget %.2f GiB = dense pool %.2f GiB + compressed store %.2f GiB",
        budget_bytes / 2**30, dense_bytes / 2**30, store_bytes / 2**30,
    )  # fmt: skip
    pool_config = original(configurator, dense_bytes, *args, cap_tokens=cap_tokens, **kwargs)
    setattr(pool_config, RESERVATION_ATTR, StoreReservation(config, store_bytes))
    return pool_config
