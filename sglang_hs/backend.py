"""``HieraSparseAttnBackend``: SGLang attention over dense tokens plus compressed prefix blocks.

Shape follows SGLang's ``triton_backend.py``: one class, one forward-metadata object, separate
extend and decode paths. A batch whose requests read no compressed block (no radix hit on a
compressed prefix) is attended by SGLang's own kernels through a delegate backend (FlashInfer by
default, ``--hierasparse-dense-backend triton`` otherwise). A batch in which some request's
``req_to_token`` row holds virtual slots (see ``sglang_hs.pools.VirtualSlots``) is attended over the block
table that mixes SGLang pages and compressed blocks: by the TileLang extend kernel, or in PyTorch
when that kernel is off. Every decode batch runs the TileLang decode kernel when it is on (one path
under CUDA graphs, whether or not a request reads compressed blocks).

The compressed store, the virtual slots and the settings come from the model runner's
:class:`sglang_hs.runtime.HieraSparseRuntime`, which the radix cache shares.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_hs.channel_order import ChannelPermuter
from sglang_hs.decode_modes import BlockSelection
from sglang_hs.dense_prefill import FA3_MIN_NEW_TOKENS, PagedPrefillChoice
from sglang_hs.fallback import batch_chunks, batch_pages, decompressed_paged_attention
from sglang_hs.format import BlockPools
from sglang_hs.runtime import HieraSparseRuntime, attach_runtime

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sglang_hs.kernels.decode import HieraSparseDecode
    from sglang_hs.kernels.decode_shared import SharedPrefixDecode, StepTables
    from sglang_hs.kernels.extend import HieraSparseExtend

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

logger = logging.getLogger(__name__)


class Path(enum.Enum):
    DENSE = "dense"
    """No request reads a compressed block: SGLang's kernels through the delegate."""
    FALLBACK = "fallback"
    """Extend or decode over compressed blocks without a kernel: PyTorch, decompress + SDPA."""
    EXTEND_KERNEL = "extend_kernel"
    """Extend over the mixed block table with the TileLang extend kernel."""
    DECODE_KERNEL = "decode_kernel"
    """Decode over the mixed block table with the TileLang split-KV kernel (CUDA-graph capturable)."""


@dataclass
class ForwardMetadata:
    """What one forward batch needs beyond the delegate's own metadata."""

    path: Path
    block_table: torch.Tensor | None = None
    """int32 ``[bs, max_blocks]``: SGLang page ``e >= 0`` or compressed virtual block ``~e``."""
    seq_lens: list[int] | None = None
    qo_indptr: list[int] | None = None
    seq_lens_gpu: torch.Tensor | None = None
    """int32 ``[bs]`` (the kernels)."""
    qo_indptr_gpu: torch.Tensor | None = None
    """int32 ``[bs + 1]``: query rows of each request in an extend batch (the extend kernel)."""
    copy_chunks: list[ExtendChunk] | None = None
    """An extend over FP8 KV: the request chunks whose blocks the extend kernel reads as 16-bit copies."""
    decode_plan: HieraSparseDecode | SharedPrefixDecode | None = None
    """The decode kernel's plan (``Path.DECODE_KERNEL``): the per-request kernel, or with shared-prefix
    decode the two-pass plan."""
    decode_step: StepTables | None = None
    """With shared-prefix decode: the step's tables (grouping, both passes' tables)."""
    selected: tuple[torch.Tensor, torch.Tensor | list[int]] | None = None
    """With a decode mode: the last anchor layer's choice, ``(block_table, seq_lens)`` compacted to the
    blocks the following layers read (``sglang_hs.decode_modes``); the lengths are a host list on the
    PyTorch path (``Path.FALLBACK``)."""


@dataclass
class ExtendChunk:
    """Consecutive requests of an extend batch over FP8 KV, run as one extend-kernel call over 16-bit
    copies of their blocks (``sglang_hs.fallback.batch_pages``)."""

    requests: slice
    rows: slice
    """Their query rows in the batch."""
    width: int
    """Blocks of the longest."""
    qo_indptr_gpu: torch.Tensor
    """int32 ``[n + 1]``, from 0."""
    new_rows: torch.Tensor
    """int64: the rows of the copies that hold the requests' new tokens, in query order. They get the
    16-bit K and V the layer is handed, as SGLang's own extend attends to a request's new tokens (only the
    cached ones are read back from FP8 pages)."""


COPY_CHUNK_BYTES = 256 * 2**20
"""Bound on one operand's 16-bit copies in an extend over FP8 KV (a single longer request is one chunk)."""


def create_backend(model_runner: ModelRunner) -> HieraSparseAttnBackend:
    """The attention-backend factory SGLang calls: the backend over the model runner's runtime."""
    return HieraSparseAttnBackend(model_runner, attach_runtime(model_runner))


class HieraSparseAttnBackend(AttentionBackend):
    """What SGLang 0.5.17 reads or calls on an attention backend, for the models and settings the plugin
    accepts (its model runner, eager runner, decode and breakable-prefill CUDA-graph runners, forward
    context), and where each comes from:

    - defined here: ``init_forward_metadata`` (eager forwards and breakable prefill graphs),
      ``init_forward_metadata_out_graph`` / ``init_forward_metadata_in_graph`` and
      ``init_cuda_graph_state`` / ``get_cuda_graph_seq_len_fill_value`` (decode graphs),
      ``forward_decode`` / ``forward_extend`` (through the base class's ``forward``), ``forward_metadata``
      (the eager runner resets it), ``token_to_kv_pool`` / ``req_to_token_pool`` (the forward
      context's ``get_token_to_kv_pool`` / ``get_req_to_token_pool``);
    - delegated to the dense backend: the runners' capability flags, below;
    - the base class's: ``needs_cpu_seq_lens`` (True: the compressed paths read ``seq_lens_cpu``),
      ``on_after_cuda_graph_warmup``, ``verify_mask``, the ``*_attention_backend_str`` the model runner
      stamps.

    Nothing else reaches the delegate: its own state is its own (no attribute forwarding).
    """

    def __init__(self, model_runner: ModelRunner, runtime: HieraSparseRuntime):
        super().__init__()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        self.runtime = runtime
        self.config, self.store, self.virtual = runtime.config, runtime.store, runtime.virtual
        self.dense = ATTENTION_BACKENDS[self.config.dense_backend](model_runner)
        self.forward_metadata: ForwardMetadata | None = None
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.req_to_token = self.req_to_token_pool.req_to_token
        kv_device = torch.device(self.token_to_kv_pool.device)
        self.paged_prefill = (
            PagedPrefillChoice.for_delegate(self.dense, torch.cuda.get_device_capability(kv_device),
                                            self.token_to_kv_pool.dtype)
            if kv_device.type == "cuda" else None
        )  # fmt: skip
        from sglang.srt.runtime_context import get_parallel

        self.q_heads = model_runner.model_config.get_max_num_attention_heads() // get_parallel().attn_tp_size
        # The model's 16-bit dtype (the pages' unless they are SGLang's FP8 pages). Over FP8 KV (an FP8
        # store or FP8 pages) decode reads FP8 in the kernel; an extend reads 16-bit copies of its blocks.
        self.model_dtype = model_runner.dtype
        self.fp8_kv = self.store.quantized or self.token_to_kv_pool.dtype.itemsize == 1
        self.max_blocks = -(-self.req_to_token.shape[1] // self.config.block_size)
        self.use_decode_kernel = runtime.uses_kernel("decode")
        self.shared_prefix_decode = self.use_decode_kernel and self.config.shared_prefix_decode == "on"
        self.shared_forms = self._compressed_forms() if self.shared_prefix_decode else None
        self.decode_compact = self._decode_compact()
        self.selection = BlockSelection.from_config(self.config, self.store.num_layers)
        if self.selection is not None:  # compressed blocks kept / offered by the anchors, for the log line
            runtime.decode_mode_counts = torch.zeros(2, dtype=torch.int64, device=self.req_to_token.device)
        # q and k enter every path (dense delegate, kernels, fallback) in the K channel order, so the
        # cache and the store hold K in it; scores and outputs do not change.
        order = runtime.channel_order
        self.permute = ChannelPermuter(order, self.token_to_kv_pool.device) if order is not None else None
        self.kernels_compiled = self._prepare_kernels(runtime)
        self.extend_plan: HieraSparseExtend | None = None
        if runtime.uses_kernel("extend"):
            self.extend_plan = self._extend_plan(self.token_to_kv_pool, self.store.capacity.k_sparse > 0 and not self.fp8_kv)
            if self.fp8_kv:
                self._no_pools, self._no_index = self._empty_pools()
        self._decode_plan_obj: HieraSparseDecode | SharedPrefixDecode | None = None  # one plan (one kernel, one scratch) for every decode batch
        self._graph_table: torch.Tensor | None = None
        self._graph_seq_lens: torch.Tensor | None = None
        self._graph_step: StepTables | None = None  # shared-prefix decode: the step tables the captured graphs read
        self._counts_from_capture = False  # the log line's GPU counts hold the capture's warm-up runs
        logger.info(
            "HieraSparse backend ready: dense tokens via %s%s, compressed blocks via %s (extend) and %s "
            "(decode), compression via %s, compressed store %s (%.2f GiB), settings %s",
            self.config.dense_backend,
            " (paged prefill on fa3 from %d new tokens a request)" % FA3_MIN_NEW_TOKENS if self.paged_prefill else "",
            "the TileLang kernel" if self.extend_plan else "PyTorch",
            "the TileLang kernel" if self.use_decode_kernel else "the delegate / PyTorch",
            "the TileLang kernel" if runtime.uses_kernel("compress") else "PyTorch",
            self.store.capacity,
            runtime.store_budget_bytes / 2**30,
            self.config.to_json(),
        )

    # ----------------------------------------------------------------------------- delegated flags
    @property
    def supports_ragged_verify_graph(self) -> bool:
        """Read by the decode CUDA-graph runner (speculative verify graphs): the delegate's."""
        return self.dense.supports_ragged_verify_graph

    @property
    def use_captured_forward_metadata_for_breakable_cuda_graph(self) -> bool:
        """Read by the decode and prefill CUDA-graph runners (breakable graphs): the delegate's (False
        for FlashInfer and triton: the runner then calls :meth:`init_forward_metadata`)."""
        return self.dense.use_captured_forward_metadata_for_breakable_cuda_graph

    @property
    def supports_full_cuda_graph_chunked_prefix(self) -> bool:
        """Read by the prefill CUDA-graph runner (full prefill graphs, refused at start-up): the delegate's."""
        return self.dense.supports_full_cuda_graph_chunked_prefix

    # ----------------------------------------------------------------------------- metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        if self.use_decode_kernel and forward_batch.forward_mode.is_decode():
            # Eager decode (batches beyond the captured sizes, or no CUDA graphs): the kernel takes any
            # batch size, so no padding.
            bs = forward_batch.batch_size
            table, seq_lens = self._decode_inputs(forward_batch, bs)
            plan = self._decode_plan(bs)
            step = self._plan_step(plan, table, seq_lens) if self.shared_prefix_decode else None
            if step is not None:
                self._count_grouping(step, bs)
            self.forward_metadata = ForwardMetadata(
                Path.DECODE_KERNEL, block_table=table, seq_lens_gpu=seq_lens, decode_plan=plan, decode_step=step
            )
            return
        if self.paged_prefill is not None:
            self.paged_prefill.choose(forward_batch)
        self.dense.init_forward_metadata(forward_batch)
        self.forward_metadata = self._compressed_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        """Decode CUDA graphs (only with the TileLang kernel, see ``plugin.apply_backend_defaults``),
        before capture and before every replay: the step's metadata is views of the buffers the graph
        reads. What fills them (block table, lengths, shared-prefix step tables: some 60 small GPU ops)
        runs inside the graph (:meth:`init_forward_metadata_in_graph`), not as eager launches before
        every replay (they took about 0.5 ms of every regime-1 step in an H200 server's profile)."""
        bs = forward_batch.batch_size
        plan = self._decode_plan(bs)
        step = None
        if self.shared_prefix_decode:
            step = self._graph_step_views(plan, bs)
            self._grouping_counts()  # allocated here, outside any capture
        if in_capture:  # the capture's warm-up runs count the capture's dummy batches
            self._counts_from_capture = True
        elif self._counts_from_capture:  # the first replay: the log line's counts start from zero
            self._counts_from_capture = False
            for counts in (self.runtime.shared_decode_counts, self.runtime.decode_mode_counts):
                if counts is not None:
                    counts.zero_()
        self.forward_metadata = ForwardMetadata(
            Path.DECODE_KERNEL,
            block_table=self._graph_table[:bs],
            seq_lens_gpu=self._graph_seq_lens[:bs],
            decode_plan=plan,
            decode_step=step,
        )

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        """Recorded into the decode graph (SGLang runs it inside capture; replays repeat it): fill the
        buffers :meth:`init_forward_metadata_out_graph` pointed the metadata at, from the graph's own
        input buffers (request slots, lengths). Static shapes, no host synchronisation."""
        meta = self.forward_metadata
        bs = forward_batch.batch_size
        table, seq_lens = self._decode_inputs(forward_batch, bs)
        meta.block_table.copy_(table)
        meta.seq_lens_gpu.copy_(seq_lens)
        if meta.decode_step is not None:
            step = self._plan_step(meta.decode_plan, meta.block_table, meta.seq_lens_gpu)
            for field in dataclasses.fields(step):
                getattr(meta.decode_step, field.name).copy_(getattr(step, field.name))
            self._count_grouping(meta.decode_step, bs)

    def _count_grouping(self, step: StepTables, bs: int) -> None:
        """Add this step's requests read through a column set, and its requests, to the runtime's
        counts (GPU adds, no host read: the batch log line reads them, ``hs shared-decode grouped``)."""
        counts = self._grouping_counts()
        counts[0] += (step.pick[:bs] >= 0).sum()
        counts[1] += bs

    def _grouping_counts(self) -> torch.Tensor:
        """The runtime's ``[grouped, decoded]`` request counts, made on first use."""
        if self.runtime.shared_decode_counts is None:
            self.runtime.shared_decode_counts = torch.zeros(2, dtype=torch.int64, device=self.req_to_token.device)
        return self.runtime.shared_decode_counts

    def _graph_step_views(self, plan: SharedPrefixDecode, bs: int) -> StepTables:
        """Views, for a step of ``bs`` requests, of the step-table buffers the captured graphs read. The
        buffers are a step of the largest captured batch, built once: its per-set tables have the plan's
        set rows, its per-request ones a row per request."""
        if self._graph_step is None:
            self._graph_step = self._plan_step(plan, self._graph_table, self._graph_seq_lens)
        rows = {"set": plan.sets_for(bs), "request": bs}
        return type(self._graph_step)(**{field.name: getattr(self._graph_step, field.name)[: rows[field.metadata["rows"]]]
                                         for field in dataclasses.fields(self._graph_step)})  # fmt: skip

    def _compressed_forms(self) -> tuple[str, str]:
        """The block forms every compressed block has under the settings: the shared-prefix decode's
        shared pass and the compact decode kernel hold only them (and fit more CTAs an SM)."""
        from sglang_hs.kernels.decode_shared import compressed_forms

        c = self.config
        return compressed_forms((c.sk_prefill, c.sk_decode), (c.sv_prefill, c.sv_decode), bool(c.k_head_map))

    def _decode_compact(self) -> tuple[str, str] | None:
        """The compressed forms decode runs the compact kernel for (``kernels.decode.decode_compact``): 16-bit
        KV at head_dim >= 128 whose compressed blocks all have 2:4 K and V, without shared-prefix decode
        (whose own pass is the any-form kernel); None: the any-form kernel."""
        from sglang_hs.kernels.decode import decode_compact

        if self.fp8_kv or not self.use_decode_kernel or self.shared_prefix_decode:
            return None
        return decode_compact(self._compressed_forms(), self.token_to_kv_pool.head_dim)

    def _plan_step(self, plan: SharedPrefixDecode, table: torch.Tensor, seq_lens: torch.Tensor) -> StepTables:
        """A shared-prefix decode step's tables; the index maps (the same in every layer for the forms
        :meth:`_compressed_forms` restricts) tell which blocks the shared pass takes."""
        return plan.plan_step(table, seq_lens, self.store.k_index_of(0), self.store.v_index)

    def _decode_inputs(self, forward_batch, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block table (full ``req_to_token`` width, so shapes are fixed per batch size) and int32
        sequence lengths of a decode batch; no host synchronisation."""
        rows = self.req_to_token[forward_batch.req_pool_indices[:bs].long()]
        return self.virtual.block_table(rows), forward_batch.seq_lens[:bs].to(torch.int32)

    def _decode_plan(self, bs: int) -> HieraSparseDecode | SharedPrefixDecode:
        """The one decode plan: every batch size runs the model shape's one compiled kernel on views of
        one scratch. Built for the largest captured batch before capture (``init_cuda_graph_state``),
        else for the first eager batch (it grows while no graph holds it, and runs larger batches in
        chunks once one does)."""
        if self._decode_plan_obj is None:
            self._decode_plan_obj = self._new_decode_plan(bs)
        return self._decode_plan_obj

    def _new_decode_plan(self, batch_size: int) -> HieraSparseDecode | SharedPrefixDecode:
        from sglang_hs.kernels.decode import HieraSparseDecode
        from sglang_hs.kernels.decode_shared import SharedPrefixDecode

        kv_pool = self.token_to_kv_pool
        shape = (batch_size, self.q_heads, kv_pool.head_num, kv_pool.head_dim, self.config.block_size,
                 self.max_blocks, self.model_dtype, kv_pool.device)  # fmt: skip
        if self.shared_prefix_decode:
            return SharedPrefixDecode(*shape, forms=self.shared_forms)
        # An FP8 store: the kernel's store_fp8 variant (the store's value dtype; shared-prefix decode is off),
        # over FP8 pages its cache_fp8 one.
        fp8 = {"store_dtype": self.store.value_dtype} if self.store.quantized else {}
        if kv_pool.dtype != self.model_dtype:
            fp8["cache_dtype"] = kv_pool.dtype
        return HieraSparseDecode(*shape, block_lse=self.selection is not None, compact=self.decode_compact, **fp8)

    def _prepare_kernels(self, runtime: HieraSparseRuntime) -> int:
        """Compile, in parallel processes, the TileLang kernels this server will use that TileLang's disk
        cache lacks, and load them all now (progress lines in the log); returns how many were compiled.
        The set depends on the model shape and the settings only: one decode kernel, the two extend
        tiles (with 2:4 K buffers when the store holds 2:4 K rows), the pack kernel and, for a fractional
        S, the loss kernel of that operand."""
        if not runtime.kernels_available:
            return 0
        from sglang_hs.kernels.jobs import model_jobs, prepare_kernels

        kv_pool, config = self.token_to_kv_pool, self.config
        compress = runtime.uses_kernel("compress")
        loss = [op for op, values in (("k", (config.sk_prefill, config.sk_decode)),
                                      ("v", (config.sv_prefill, config.sv_decode)))
                if compress and any(0 < v < 1 for v in values)]  # fmt: skip
        jobs = model_jobs(
            self.q_heads, kv_pool.head_num, kv_pool.head_dim, str(self.model_dtype).removeprefix("torch."),
            decode=runtime.uses_kernel("decode"),
            extend_k_sparse=(self.store.capacity.k_sparse > 0 and not self.fp8_kv,) if runtime.uses_kernel("extend") else (),
            compress=compress, loss_operands=tuple(loss), shared_decode_forms=self.shared_forms,
            store_fp8=self.store.quantized, cache_fp8=kv_pool.dtype != self.model_dtype, decode_compact=self.decode_compact,
        )  # fmt: skip
        return prepare_kernels(jobs, logger.info) if jobs else 0

    def _extend_plan(self, kv_pool, k_sparse: bool) -> HieraSparseExtend:
        """The extend kernel's plan; both of its tiles are compiled (or loaded from TileLang's disk
        cache) now, so that no request waits for a compilation."""
        from sglang_hs.kernels.extend import TILES, HieraSparseExtend

        plan = HieraSparseExtend(
            self.q_heads, kv_pool.head_num, kv_pool.head_dim, self.config.block_size, self.max_blocks,
            self.model_dtype, kv_pool.device,
        )  # fmt: skip
        for tile in TILES:
            plan.kernel(tile, k_sparse)
        return plan

    def _empty_pools(self) -> tuple[BlockPools, torch.Tensor]:
        """16-bit pools without rows and an index map without blocks: what the extend kernel takes beside
        the 16-bit copies of an FP8 batch, which are all cache pages."""
        kv_pool, b = self.token_to_kv_pool, self.config.block_size
        d, kw = kv_pool.head_dim, dict(dtype=self.model_dtype, device=kv_pool.device)
        meta = dict(dtype=torch.int16, device=kv_pool.device)
        pools = BlockPools(torch.empty(0, b, d, **kw), torch.empty(0, b, d // 2, **kw), torch.empty(0, b, d // 16, **meta),
                           torch.empty(0, b, d, **kw), torch.empty(0, d, b // 2, **kw), torch.empty(0, d, b // 16, **meta))
        return pools, torch.empty(kv_pool.head_num, 0, dtype=torch.int32, device=kv_pool.device)

    def _copy_chunks(self, seq_lens: list[int], qo_indptr: list[int], device) -> list[ExtendChunk]:
        """The request chunks of an extend over FP8 KV (:class:`ExtendChunk`)."""
        kv_pool, b = self.token_to_kv_pool, self.config.block_size
        block_bytes = b * kv_pool.head_num * kv_pool.head_dim * self.model_dtype.itemsize
        chunks = []
        for first, stop, width in batch_chunks(seq_lens, b, max(1, COPY_CHUNK_BYTES // block_bytes)):
            indptr = torch.tensor([n - qo_indptr[first] for n in qo_indptr[first:stop + 1]], dtype=torch.int32)
            new_rows = torch.cat([torch.arange(seq_lens[r] - (qo_indptr[r + 1] - qo_indptr[r]), seq_lens[r]) +
                                  (r - first) * width * b for r in range(first, stop)])  # fmt: skip
            chunks.append(ExtendChunk(slice(first, stop), slice(qo_indptr[first], qo_indptr[stop]), width,
                                      indptr.to(device, non_blocking=True), new_rows.to(device, non_blocking=True)))
        return chunks

    def _compressed_metadata(self, forward_batch: ForwardBatch) -> ForwardMetadata:
        if self.store.used_blocks() == 0 or forward_batch.forward_mode.is_idle():
            return ForwardMetadata(Path.DENSE)
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        rows = self.req_to_token[forward_batch.req_pool_indices.long(), : max(seq_lens)]
        if not bool(self.virtual.mask(rows).any()):
            return ForwardMetadata(Path.DENSE)
        table = self.virtual.block_table(rows)
        if forward_batch.forward_mode.is_decode():
            return ForwardMetadata(Path.FALLBACK, table, seq_lens, list(range(len(seq_lens) + 1)))
        qo_indptr = [0]
        for n in forward_batch.extend_seq_lens_cpu:
            qo_indptr.append(qo_indptr[-1] + int(n))
        if self.extend_plan is not None:
            qo_indptr_gpu = torch.nn.functional.pad(forward_batch.extend_seq_lens.cumsum(0), (1, 0))
            return ForwardMetadata(
                Path.EXTEND_KERNEL,
                block_table=table,
                seq_lens_gpu=forward_batch.seq_lens.to(torch.int32),
                qo_indptr_gpu=qo_indptr_gpu.to(torch.int32),
                copy_chunks=self._copy_chunks(seq_lens, qo_indptr, table.device) if self.fp8_kv else None,
            )
        return ForwardMetadata(Path.FALLBACK, table, seq_lens, qo_indptr)

    def _save_kv(self, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool) -> None:
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale)

    def _kernel_kv(self, layer: RadixAttention) -> tuple:
        """A layer's KV as the kernels and the fallback take it: ``(k_cache, v_cache, pools, k_index,
        v_index)``, the cache buffers, the store's pools of the layer and the index maps."""
        return (
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.store.layer_pools(layer.layer_id),
            self.store.k_index_of(layer.layer_id),
            self.store.v_index,
        )

    def _forward_decode_kernel(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool):
        self._save_kv(k, v, layer, forward_batch, save_kv_cache)
        meta = self.forward_metadata
        bs = meta.block_table.shape[0]
        # q arrives as a strided view of the fused QKV projection; the kernel reads packed rows.
        q = q.reshape(bs, layer.tp_q_head_num, layer.head_dim).contiguous()
        if meta.decode_step is not None:
            out = meta.decode_plan.run(q, *self._kernel_kv(layer), meta.decode_step, layer.scaling)
        elif self.selection is not None and bs <= meta.decode_plan.batch_size:
            out = self._decode_selected(q, layer, meta)
        else:
            out = meta.decode_plan.run(q, *self._kernel_kv(layer), meta.block_table, meta.seq_lens_gpu, layer.scaling)
        return out.reshape(bs, layer.tp_q_head_num * layer.v_head_dim)

    def _decode_selected(self, q: torch.Tensor, layer: RadixAttention, meta: ForwardMetadata) -> torch.Tensor:
        """A decode mode's layer: an anchor reads every block and chooses, for each request, the blocks
        the next layers read; the others read the compacted table of that choice."""
        kv = self._kernel_kv(layer)
        if self._reads_choice(meta, layer):
            return meta.decode_plan.run(q, *kv, *meta.selected, layer.scaling)
        out, block_lse = meta.decode_plan.run(q, *kv, meta.block_table, meta.seq_lens_gpu, layer.scaling,
                                              return_block_lse=True)  # fmt: skip
        meta.selected = self.selection.apply(block_lse, meta.block_table, meta.seq_lens_gpu, self.config.block_size,
                                             self.runtime.decode_mode_counts)  # fmt: skip
        return out

    def _reads_choice(self, meta: ForwardMetadata, layer: RadixAttention) -> bool:
        """A decode mode's layer between anchors: it reads the last anchor's compacted table (layer 0 is
        always an anchor, so a step's first layer makes the choice)."""
        return meta.selected is not None and not self.selection.is_anchor(layer.layer_id)

    def _forward_extend_kernel(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool):
        """The new tokens' K/V go to their cache pages first; the kernel reads them there, in the
        same block loop as the cached prefix (causal on the diagonal blocks)."""
        self._save_kv(k, v, layer, forward_batch, save_kv_cache)
        meta = self.forward_metadata
        q = q.reshape(-1, layer.tp_q_head_num, layer.head_dim)
        if meta.copy_chunks is None:
            out = self.extend_plan.run(q, meta.qo_indptr_gpu, *self._kernel_kv(layer), meta.block_table,
                                       meta.seq_lens_gpu, layer.scaling)  # fmt: skip
            return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)
        # FP8 KV: each chunk of requests over 16-bit copies of its blocks (all read as cache pages), the new
        # tokens' rows holding the 16-bit K and V the layer was handed.
        out = torch.empty_like(q)
        for chunk in meta.copy_chunks:
            k_pages, v_pages, table = batch_pages(*self._kernel_kv(layer), meta.block_table[chunk.requests],
                                                  meta.seq_lens_gpu[chunk.requests], chunk.width, self.config.block_size,
                                                  q.dtype)  # fmt: skip
            if k is not None and v is not None:
                k_pages.index_copy_(0, chunk.new_rows, k.reshape(-1, *k_pages.shape[1:])[chunk.rows].to(q.dtype))
                v_pages.index_copy_(0, chunk.new_rows, v.reshape(-1, *v_pages.shape[1:])[chunk.rows].to(q.dtype))
            self.extend_plan.run(q[chunk.rows], chunk.qo_indptr_gpu, k_pages, v_pages, self._no_pools, self._no_index,
                                 self._no_index, table, meta.seq_lens_gpu[chunk.requests], layer.scaling,
                                 out=out[chunk.rows])  # fmt: skip
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _forward_compressed(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool):
        """Attention over the mixed block table without a kernel (``sglang_hs.fallback``: compressed
        blocks are decompressed, then torch's fused attention runs)."""
        self._save_kv(k, v, layer, forward_batch, save_kv_cache)
        meta = self.forward_metadata
        q = q.view(-1, layer.tp_q_head_num, layer.head_dim)
        block = self.config.block_size
        if self.selection is None or not forward_batch.forward_mode.is_decode():
            out = decompressed_paged_attention(q, meta.qo_indptr, *self._kernel_kv(layer), meta.block_table,
                                               meta.seq_lens, block_size=block, sm_scale=layer.scaling)  # fmt: skip
        elif self._reads_choice(meta, layer):
            out = decompressed_paged_attention(q, meta.qo_indptr, *self._kernel_kv(layer), *meta.selected,
                                               block_size=block, sm_scale=layer.scaling)  # fmt: skip
        else:  # a decode mode's anchor layer, as _decode_selected (eager: the compacted lengths go to the host)
            out, block_lse = decompressed_paged_attention(
                q, meta.qo_indptr, *self._kernel_kv(layer), meta.block_table, meta.seq_lens, block_size=block,
                sm_scale=layer.scaling, return_block_lse=True,
            )  # fmt: skip
            seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32, device=q.device)
            table, lengths = self.selection.apply(block_lse, meta.block_table, seq_lens, block,
                                                  self.runtime.decode_mode_counts)  # fmt: skip
            meta.selected = (table, lengths.tolist())
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    # ----------------------------------------------------------------------------- CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        device = self.req_to_token.device
        self._graph_table = torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, device=device)
        self._graph_seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        plan = self._decode_plan_obj
        if self.use_decode_kernel and (plan is None or (plan.batch_size < max_bs and not plan.captured)):
            # Before any capture: the scratch every captured batch size views, allocated once.
            self._decode_plan_obj = self._new_decode_plan(max_bs)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    # ----------------------------------------------------------------------------- forward
    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True, **kwargs):
        return self._forward(self.dense.forward_extend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache=True, **kwargs):
        return self._forward(self.dense.forward_decode, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _forward(self, dense_forward, q, k, v, layer, forward_batch, save_kv_cache: bool, **kwargs):
        """Run the path the batch's metadata chose; ``dense_forward`` is the delegate's own method."""
        if self.permute is not None:
            q, k = self.permute(layer.layer_id, q, k)
        path = self.forward_metadata.path
        if path is Path.DENSE:
            return dense_forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        run = {
            Path.EXTEND_KERNEL: self._forward_extend_kernel,
            Path.DECODE_KERNEL: self._forward_decode_kernel,
            Path.FALLBACK: self._forward_compressed,
        }[path]
        return run(q, k, v, layer, forward_batch, save_kv_cache)
