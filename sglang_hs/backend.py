"""``HieraSparseAttnBackend``: SGLang attention over dense tokens plus compressed prefix blocks.

Shape follows SGLang's ``triton_backend.py``: one class, one forward-metadata object, separate
extend and decode paths. A batch whose requests read no compressed block (no radix hit on a
compressed prefix) is attended by SGLang's own kernels through a delegate backend (FlashInfer by
default, ``--hierasparse-dense-backend triton`` otherwise). A batch in which some request's
``req_to_token`` row holds virtual slots (see ``sglang_hs.radix.hook``) is attended over the block
table that mixes SGLang pages and compressed blocks.

The backend owns the compressed store, sized from the bytes the plugin reserved out of SGLang's
KV-cache budget (``sglang_hs.pools.reserve_store_budget``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_hs import pools, reference
from sglang_hs.config import HieraSparseConfig
from sglang_hs.pools import CompressedStore, StoreCapacity
from sglang_hs.radix.hook import VirtualSlots

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

logger = logging.getLogger(__name__)

# Class-level switches SGLang's runners read off a backend; they must describe the dense delegate.
_MIRRORED_FLAGS = (
    "needs_cpu_seq_lens",
    "supports_ragged_verify_graph",
    "use_captured_forward_metadata_for_breakable_cuda_graph",
    "supports_full_cuda_graph_chunked_prefix",
)


@dataclass
class ForwardMetadata:
    """What one forward batch needs beyond the delegate's own metadata."""

    reads_compressed: bool
    """Some request attends over compressed blocks: the batch takes this backend's own path."""
    block_table: torch.Tensor | None = None
    """int32 ``[bs, max_blocks]``: SGLang page ``e >= 0`` or compressed virtual block ``~e``."""
    seq_lens: list[int] | None = None
    qo_indptr: list[int] | None = None


class HieraSparseAttnBackend(AttentionBackend):
    def __init__(self, model_runner: ModelRunner):
        super().__init__()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        self.config = HieraSparseConfig.from_env()
        self.dense = ATTENTION_BACKENDS[self.config.dense_backend](model_runner)
        for flag in _MIRRORED_FLAGS:
            setattr(self, flag, getattr(self.dense, flag))
        self.forward_metadata: ForwardMetadata | None = None
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        block = self.config.block_size
        # Virtual slots start above every dense slot (the KV buffers hold size + page_size rows).
        dense_rows = model_runner.token_to_kv_pool_allocator.size + model_runner.page_size
        self.virtual = VirtualSlots(base=-(-dense_rows // block) * block, block_size=block)
        kv_pool = self.token_to_kv_pool
        capacity = StoreCapacity.from_budget(
            pools.store_budget_bytes(), kv_pool.layer_num, kv_pool.head_num, kv_pool.head_dim, block,
            self.config.sk_prefill, self.config.sv_prefill,
        )  # fmt: skip
        self.store = CompressedStore(
            capacity, kv_pool.layer_num, kv_pool.head_num, kv_pool.head_dim, block, kv_pool.dtype, kv_pool.device
        )
        logger.info(
            "HieraSparse backend ready: dense tokens via %s, compressed store %s (%.2f GiB), settings %s",
            self.config.dense_backend,
            capacity,
            pools.store_budget_bytes() / 2**30,
            self.config.to_json(),
        )

    def __getattr__(self, name: str):
        # Runner code reads backend-specific state (for example a delegate's CUDA-graph buffers);
        # everything this class does not define belongs to the dense delegate.
        if name == "dense":  # not set yet: avoid recursing during construction
            raise AttributeError(name)
        return getattr(self.dense, name)

    # ----------------------------------------------------------------------------- metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        self.dense.init_forward_metadata(forward_batch)
        self.forward_metadata = self._compressed_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        # Only dense batches are captured: the plugin keeps decode CUDA graphs off while the store is
        # in use (see sglang_hs.plugin.apply_backend_defaults).
        self.dense.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        self.forward_metadata = ForwardMetadata(reads_compressed=False)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        self.dense.init_forward_metadata_in_graph(forward_batch)

    def _compressed_metadata(self, forward_batch: ForwardBatch) -> ForwardMetadata:
        if self.store.used_blocks() == 0 or forward_batch.forward_mode.is_idle():
            return ForwardMetadata(reads_compressed=False)
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        rows = self.req_to_token[forward_batch.req_pool_indices.long(), : max(seq_lens)]
        if not bool(self.virtual.mask(rows).any()):
            return ForwardMetadata(reads_compressed=False)
        table = self.virtual.block_table(rows)
        if forward_batch.forward_mode.is_decode():
            qo_indptr = list(range(len(seq_lens) + 1))
        else:
            qo_indptr = [0]
            for n in forward_batch.extend_seq_lens_cpu:
                qo_indptr.append(qo_indptr[-1] + int(n))
        return ForwardMetadata(True, table, seq_lens, qo_indptr)

    def _forward_compressed(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool):
        """Attention over the mixed block table (the PyTorch serving fallback until the TileLang
        kernels land: compressed blocks are decompressed, then torch's fused attention runs)."""
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        meta = self.forward_metadata
        out = reference.decompressed_paged_attention(
            q.view(-1, layer.tp_q_head_num, layer.head_dim),
            meta.qo_indptr,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.store.layer_pools(layer.layer_id),
            self.store.k_index,
            self.store.v_index,
            meta.block_table,
            meta.seq_lens,
            block_size=self.config.block_size,
            sm_scale=layer.scaling,
        )
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    # ----------------------------------------------------------------------------- CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.dense.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.dense.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        self.dense.on_after_cuda_graph_warmup()

    # ----------------------------------------------------------------------------- forward
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ):
        if self.forward_metadata.reads_compressed:
            return self._forward_compressed(q, k, v, layer, forward_batch, save_kv_cache)
        return self.dense.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ):
        if self.forward_metadata.reads_compressed:
            return self._forward_compressed(q, k, v, layer, forward_batch, save_kv_cache)
        return self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
