"""The FlashInfer delegate's paged prefill on FlashInfer's fa3 kernels where they are the faster ones.

SGLang's FlashInfer backend attends a prefill batch's new tokens with its ragged wrapper (backend
``auto``: fa3 on Hopper) and their queries over a cached dense prefix with paged wrappers it builds on
fa2. In a hierasparse server the delegate attends only batches that read no compressed block, so
that path serves prefixes still dense: a prompt's chunks before its first blocks are compressed,
prefixes shorter than a sink and a window, prefixes kept dense when the store is full. On an H100
fa2 is the faster paged kernel only for short extends; from ``FA3_MIN_NEW_TOKENS`` new tokens a
request fa3 is (``python lab/bench_dense_prefill.py``, ``docs/results.md``).
:class:`PagedPrefillChoice` keeps both wrapper sets and points the delegate at one of them before it
plans each batch, so SGLang's own planning and kernels run unchanged.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

FA3_MIN_NEW_TOKENS = 128
"""Mean new tokens a request from which a prefill batch's paged part runs on fa3 (H100, page size 1,
batch 8 over 8K: fa3 0.98x fa2 at 64, 1.53x at 128, 1.58-1.77x from 256 to 8K chunks)."""


class PagedPrefillChoice:
    """fa2 or fa3 paged prefill wrappers for a FlashInfer delegate, chosen per prefill batch."""

    def __init__(self, delegate, fa3_wrappers: list):
        self.delegate = delegate
        self.fa2_wrappers = list(delegate.prefill_wrappers_paged)
        self.fa3_wrappers = fa3_wrappers
        self.fa3_batches = 0
        """Prefill batches planned on fa3 so far."""

    @classmethod
    def for_delegate(cls, delegate, capability: tuple[int, int], kv_dtype: torch.dtype) -> PagedPrefillChoice | None:
        """The choice for ``delegate``, or None where fa3 cannot take its paged prefill: a delegate
        other than SGLang's FlashInfer backend, a GPU other than Hopper (compute capability 9.x), a KV
        cache other than fp16/bf16, or delegate features the choice leaves on fa2 (two wrappers for
        sliding windows or cross-attention, multimodal or multi-item masks, deterministic mode)."""
        wrappers = getattr(delegate, "prefill_wrappers_paged", None)
        if type(delegate).__name__ != "FlashInferAttnBackend" or not wrappers:
            return None
        if capability[0] != 9 or kv_dtype not in (torch.float16, torch.bfloat16):
            return None
        if any(getattr(delegate, flag, None) for flag in ("dispatch_reason", "is_multimodal", "enable_mis",
                                                          "enable_deterministic", "use_sliding_window_kv_pool")):  # fmt: skip
            return None
        from flashinfer import BatchPrefillWithPagedKVCacheWrapper

        fa3 = [BatchPrefillWithPagedKVCacheWrapper(delegate.workspace_buffer, "NHD", backend="fa3") for _ in wrappers]
        return cls(delegate, fa3)

    @staticmethod
    def wants_fa3(forward_batch: ForwardBatch) -> bool:
        """A plain prefill batch (extend or mixed, not speculative) with at least
        ``FA3_MIN_NEW_TOKENS`` new tokens a request on average, every request over a cached prefix.

        Why the last: FlashInfer 0.6.15's fa3 paged prefill leaves the output and LSE of a request
        with no KV unwritten (fa2 writes 0 and an LSE of -5e4), and SGLang merges that row with the
        ragged part, so a new prompt batched with chunks or hits would read garbage."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import (
            is_in_tc_piecewise_cuda_graph,
        )

        if forward_batch.forward_mode not in (ForwardMode.EXTEND, ForwardMode.MIXED):
            return False
        if is_in_tc_piecewise_cuda_graph():  # captured prefill: SGLang's own wrappers and plan
            return False
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        if not prefix_lens or min(prefix_lens) <= 0:
            return False
        new_tokens = forward_batch.extend_num_tokens or 0
        return new_tokens >= FA3_MIN_NEW_TOKENS * max(forward_batch.batch_size, 1)

    def choose(self, forward_batch: ForwardBatch) -> bool:
        """Point the delegate's paged prefill at fa3 or fa2 for this batch, before the delegate plans
        it (its metadata keeps the list it planned). Returns whether fa3 was chosen."""
        use_fa3 = self.wants_fa3(forward_batch)
        self.delegate.prefill_wrappers_paged = self.fa3_wrappers if use_fa3 else self.fa2_wrappers
        if use_fa3 and not self.fa3_batches:  # once: the server log shows the path ran
            logger.info("hierasparse: dense paged prefill on fa3 from this batch (%d new tokens, %d requests)",
                        forward_batch.extend_num_tokens, forward_batch.batch_size)
        self.fa3_batches += use_fa3
        return use_fa3
