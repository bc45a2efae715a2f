"""``HieraSparseAttnBackend``: SGLang attention over dense tokens plus compressed prefix blocks.

Shape follows SGLang's ``triton_backend.py``: one class, one forward-metadata object, separate
extend and decode paths. The dense tokens of every request (new tokens, the sequence's sink and the
cached prefix's local window) are attended by SGLang's own kernels through a delegate backend
(FlashInfer by default, ``--hierasparse-dense-backend triton`` otherwise), which also owns the
CUDA-graph state of the dense path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_hs.config import HieraSparseConfig

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

    is_decode: bool


class HieraSparseAttnBackend(AttentionBackend):
    def __init__(self, model_runner: ModelRunner):
        super().__init__()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        self.config = HieraSparseConfig.from_env()
        self.dense = ATTENTION_BACKENDS[self.config.dense_backend](model_runner)
        for flag in _MIRRORED_FLAGS:
            setattr(self, flag, getattr(self.dense, flag))
        self.forward_metadata: ForwardMetadata | None = None
        logger.info(
            "HieraSparse backend ready (dense tokens via %s; settings %s)",
            self.config.dense_backend,
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
        self.forward_metadata = ForwardMetadata(is_decode=forward_batch.forward_mode.is_decode())

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        self.dense.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        self.forward_metadata = ForwardMetadata(is_decode=forward_batch.forward_mode.is_decode())

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        self.dense.init_forward_metadata_in_graph(forward_batch)

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
        return self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
