"""The reference backend of the quality evaluation (``python -m sglang_hs.launch.eval_quality
--backend reference``): the model in transformers on the CPU, prefixes compressed by the server's own
compressor and read back from a CPU store. The evaluation's module docstring says what is measured and
how. The model's attention also serves the calibration tools: a per-layer probe of queries and keys
(``calibrate_heads``, ``calibrate_channels``) and a mask of the keys a decode step reads
(``calibrate_anchors`` records block masses through it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sglang_hs.format import decompress_blocks
from sglang_hs.launch.quality_inputs import PrefixGeometry, Sample, Setting, Window
from sglang_hs.launch.quality_report import Progress, needle_record
from sglang_hs.pools import CompressedStore, StoreCapacity, block_losses, compress_prefix
from sglang_hs.pruner import make_pruner, rank_sparse

if TYPE_CHECKING:
    from sglang_hs.launch.head_calibration import LayerProbe


# ===================================================================================== compression
def read_back(store: CompressedStore, vbs: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the ``[n·B, H, D]`` K and V that virtual blocks ``vbs`` hold (pruned elements 0)."""
    cols = torch.tensor(vbs, dtype=torch.long, device=store.device)
    out = []
    for layer in range(store.num_layers):
        pools = store.layer_pools(layer)
        maps = (("k", store.k_index_of(layer)), ("v", store.v_index))
        k, v = (decompress_blocks(pools, index[:, cols], op) for op, index in maps)
        flat = lambda x: x.permute(1, 2, 0, 3).reshape(-1, x.shape[0], x.shape[-1])  # noqa: E731
        out.append((flat(k), flat(v)))
    return out


def kv_stats(blocks: range, sparse: tuple[torch.Tensor, torch.Tensor] | None, rows: int = 1) -> dict:
    """Compressed blocks and how many of them are sparse. ``sparse`` holds block masks ``[n]`` or
    (head-adaptive K) row masks ``[L, H, n]`` with ``rows = L·H``: then ``sparse_k_blocks`` is the
    sparse row count over ``rows`` (a fraction of a block when heads differ)."""

    def count(mask: torch.Tensor) -> int | float:
        return int(mask.sum()) if mask.dim() == 1 else round(int(mask.sum()) / rows, 4)

    return {
        "compressed_blocks": len(blocks) if sparse is not None else 0,
        "sparse_k_blocks": count(sparse[0]) if sparse is not None else 0,
        "sparse_v_blocks": count(sparse[1]) if sparse is not None else 0,
    }


# ===================================================================================== reference backend
class KeyMask(Protocol):
    """What a decode step reads: bool ``[batch, heads, 1, kv_len]``, False on the keys it skips, from one
    layer's query ``[batch, q_heads, 1, D]`` and keys ``[batch, heads, kv_len, D]``."""

    def key_mask(self, query: torch.Tensor, key: torch.Tensor, scaling: float, layer: int = 0) -> torch.Tensor: ...


class CalibrationCapture:
    """The reference model's attention hooks. One per model: :func:`capture_attention` finds it on the
    attention modules (``hs_capture``)."""

    def __init__(self):
        self.probe: LayerProbe | None = None  # calibration: called per layer of a prefix forward
        self.select: KeyMask | None = None  # decode steps read only the keys this leaves in
        self.hide: KeyMask | None = None  # keys no query reads, prefill and decode (a streaming head's middle)

    def attach(self, model) -> None:
        for module in model.modules():
            if hasattr(module, "layer_idx"):  # the attention modules (and, harmlessly, their layers)
                module.hs_capture = self


def capture_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention for the reference backend: SDPA with GQA done by grouping the queries of
    a KV head (no K/V copies per query head, which transformers' SDPA path makes whenever a mask is
    present), plus the calibration probe of a prefix forward and the decode key mask."""
    capture = getattr(module, "hs_capture", None)
    if capture is not None and capture.probe is not None and query.shape[2] == key.shape[2]:  # a prefix forward
        capture.probe(module.layer_idx, query[0], key[0], scaling)
    batch, q_heads, q_len, dim = query.shape
    heads, kv_len = key.shape[1], key.shape[2]
    group = q_heads // heads
    if attention_mask is None:  # plain causal: query i sits at position kv_len - q_len + i
        positions = torch.arange(kv_len - q_len, kv_len, device=query.device)
        attention_mask = (torch.arange(kv_len, device=query.device)[None, :] <= positions[:, None])[None, None]
    mask = attention_mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(attention_mask.shape[0], 1, group * q_len, kv_len)
    if capture is not None and capture.select is not None and q_len == 1:
        mask = mask & capture.select.key_mask(query, key, scaling, module.layer_idx)
    if capture is not None and capture.hide is not None:
        mask = mask & capture.hide.key_mask(query, key, scaling, module.layer_idx)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, heads, group * q_len, dim), key, value, attn_mask=mask, scale=scaling
    )
    return out.reshape(batch, q_heads, q_len, dim).transpose(1, 2).contiguous(), None


def register_capture_attention() -> str:
    """Register :func:`capture_attention` with transformers; returns its ``attn_implementation`` name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("hs_capture", capture_attention)
    AttentionMaskInterface.register("hs_capture", sdpa_mask)
    return "hs_capture"


@dataclass
class PrefixState:
    """Dense K/V of the reused prefix (rounded to the KV dtype), per layer ``[A, H, D]``."""

    prefix_len: int
    reused: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    pruned: dict[str, Any] = field(default_factory=dict)  # per pruner: all-sparse read-back + block losses


class ReferenceBackend:
    """The model in transformers on CPU; prefixes compressed by the server's compression code."""

    name = "reference"

    def __init__(self, model_path: str, geometry: PrefixGeometry, kv_dtype: str = "float16",
                 threads: int | None = None, batch: int = 8):  # fmt: skip
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.batch = max(2, batch)  # dense and S=0 must share a batch

        if threads:
            torch.set_num_threads(threads)
        self.geometry = geometry
        self.kv_dtype = getattr(torch, kv_dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation=register_capture_attention()
        ).eval()
        self.capture = CalibrationCapture()
        self.capture.attach(self.model)
        config = self.model.config
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        eos = [config.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id]
        self.stop_ids = {i for e in eos for i in (e if isinstance(e, list) else [e]) if i is not None}
        self._store: CompressedStore | None = None
        self.k_head_map: torch.Tensor | None = None  # --k-head-map: the store's K head map (bool [L, H]), as the server's

    # ------------------------------------------------------------------------- pieces
    def store_for(self, n_blocks: int) -> CompressedStore:
        if self._store is None or self._store.capacity.virtual_blocks < n_blocks:
            capacity = StoreCapacity(n_blocks, n_blocks, n_blocks, n_blocks, n_blocks)
            self._store = CompressedStore(
                capacity, self.num_layers, self.kv_heads, self.head_dim, self.geometry.block, self.kv_dtype, "cpu",
                k_sparse_heads=self.k_head_map,
            )  # fmt: skip
        self._store.clear()
        return self._store

    @torch.no_grad()
    def prefix_state(self, prefix_ids: list[int], reused: int) -> PrefixState:
        """One forward over the reused prefix tokens; K/V rounded to the KV dtype."""
        out = self.model.model(input_ids=torch.tensor([prefix_ids[:reused]]), use_cache=True)
        cache = out.past_key_values
        k = [layer.keys[0].transpose(0, 1).to(self.kv_dtype).contiguous() for layer in cache.layers]
        v = [layer.values[0].transpose(0, 1).to(self.kv_dtype).contiguous() for layer in cache.layers]
        return PrefixState(len(prefix_ids), reused, k, v)

    @torch.no_grad()
    def probe_forward(self, ids, on_layer: LayerProbe) -> None:
        """A forward over ``ids`` that hands every layer's post-RoPE query and key to ``on_layer``."""
        self.capture.probe = on_layer
        try:
            self.model.model(input_ids=torch.tensor([list(ids)]), use_cache=False)
        finally:
            self.capture.probe = None

    def _slots(self, blocks: range) -> torch.Tensor:
        """Token slots of the prefix's ``blocks`` in the per-layer K/V of a :class:`PrefixState`."""
        return torch.arange(blocks.start * self.geometry.block, blocks.stop * self.geometry.block)

    def _compress(self, state: PrefixState, pruner: str, sk: float, sv: float, blocks: range):
        """Compress the prefix's ``blocks`` into a CPU store with the server's compressor; read them back."""
        store = self.store_for(len(blocks))
        groups = [(torch.ones(len(blocks), dtype=torch.bool), sk, sv)]
        vbs = compress_prefix(store, make_pruner(pruner), state.k, state.v, self._slots(blocks), groups)
        placements = [store.placement(vb) for vb in vbs]
        sparse = tuple(torch.tensor([getattr(p, field) for p in placements]) for field in ("k_sparse", "v_sparse"))
        return read_back(store, vbs), sparse

    def compressed_kv(self, state: PrefixState, setting: Setting) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
        """Per-layer K/V ``[A, H, D]`` as a request reading the compressed prefix sees them: one
        compression of the prefix at the setting's S_K/S_V, read back from the store."""
        blocks = self.geometry.compressed_blocks(state.prefix_len, state.reused)
        if setting.is_dense or len(blocks) == 0:
            return state.k, state.v, kv_stats(blocks, None)
        layers, sparse = self._compress(state, setting.pruner, setting.sk, setting.sv, blocks)
        lo, hi = blocks.start * self.geometry.block, blocks.stop * self.geometry.block
        k = [torch.cat([kl[:lo], kb, kl[hi:]]) for kl, (kb, _) in zip(state.k, layers)]
        v = [torch.cat([vl[:lo], vb, vl[hi:]]) for vl, (_, vb) in zip(state.v, layers)]
        return k, v, self._stats(blocks, sparse)

    def fast_kv(self, state: PrefixState, setting: Setting) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
        """The same result as :meth:`compressed_kv`, at the cost of one compression per pruner and
        prefix instead of one per setting (tested equal for every setting of the grid).

        Element masks do not depend on S, and the block choice is ``rank_sparse`` of block losses
        summed over layers and heads, nested in S. So the prefix is compressed once with S_K=S_V=1
        (every block sparse, through the store), the block losses are computed as the compressor
        computes them, and a setting takes the read-back sparse form of exactly the blocks
        ``rank_sparse`` picks at its S_K/S_V and the dense form of the others.
        """
        blocks = self.geometry.compressed_blocks(state.prefix_len, state.reused)
        if setting.is_dense or len(blocks) == 0:
            return state.k, state.v, kv_stats(blocks, None)
        layers, (loss_k, loss_v) = self._all_sparse(state, setting.pruner, blocks)
        every = torch.ones(len(blocks), dtype=torch.bool)
        sparse = (rank_sparse(loss_k, every, setting.sk), rank_sparse(loss_v, every, setting.sv))
        b = self.geometry.block
        lo, hi = blocks.start * b, blocks.stop * b
        tokens_k = sparse[0].repeat_interleave(b)[:, None, None]
        tokens_v = sparse[1].repeat_interleave(b)[:, None, None]
        k = [torch.cat([kl[:lo], torch.where(tokens_k, kb, kl[lo:hi]), kl[hi:]]) for kl, (kb, _) in zip(state.k, layers)]
        v = [torch.cat([vl[:lo], torch.where(tokens_v, vb, vl[lo:hi]), vl[hi:]]) for vl, (_, vb) in zip(state.v, layers)]
        return k, v, self._stats(blocks, sparse)

    def _stats(self, blocks: range, sparse: tuple[torch.Tensor, torch.Tensor]) -> dict:
        """``kv_stats`` of block masks ``[n]``; with a K head map the K rows actually stored 2:4
        (``[L, H, n]``: a K-sparse block's mapped heads), so effective S_K and bytes follow the map."""
        if self.k_head_map is None:
            return kv_stats(blocks, sparse)
        rows = self.k_head_map[:, :, None] & sparse[0][None, None, :]
        return kv_stats(blocks, (rows, sparse[1].expand_as(rows)), self.num_layers * self.kv_heads)

    def _all_sparse(self, state: PrefixState, pruner: str, blocks: range):
        """(per layer the read-back ``(K, V)`` of the prefix compressed with every block sparse,
        (K, V) block losses), computed once per pruner and prefix."""
        if pruner not in state.pruned:
            layers, _ = self._compress(state, pruner, 1.0, 1.0, blocks)
            state.pruned[pruner] = (layers, self._block_losses(state, pruner, blocks))
        return state.pruned[pruner]


    def _block_losses(self, state: PrefixState, pruner: str, blocks: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block, the pruning loss summed over layers and KV heads (the compressor's first pass)."""
        return block_losses(make_pruner(pruner), state.k, state.v, self._slots(blocks),
                            self.geometry.block, self.kv_heads, self.k_head_map)  # fmt: skip

    def _cache(self, kvs: list[tuple[list[torch.Tensor], list[torch.Tensor]]], room: int = 0):
        """A transformers cache holding one batch row per setting: row ``i`` is ``kvs[i]``'s K/V.
        With ``room`` > 0 it is a static cache with that many free positions (decoding then writes in
        place instead of re-concatenating the whole cache every step)."""
        from transformers import DynamicCache, StaticCache

        data = [
            (torch.stack([k[layer] for k, _ in kvs]).float().transpose(1, 2),
             torch.stack([v[layer] for _, v in kvs]).float().transpose(1, 2))
            for layer in range(self.num_layers)
        ]  # fmt: skip
        if not room:
            return DynamicCache(ddp_cache_data=data)
        cache = StaticCache(config=self.model.config, max_cache_len=data[0][0].shape[2] + room)
        for layer, (k, v) in zip(cache.layers, data):
            layer.update(k, v)
        return cache

    @torch.no_grad()
    def greedy(self, kvs, suffix_ids: list[int], max_new_tokens: int,
               select: KeyMask | None = None, hide: KeyMask | None = None) -> list[list[int]]:  # fmt: skip
        """Greedy continuations of ``suffix_ids`` over each of ``kvs`` (one batch row per setting: all
        rows have the same length at every step, so no padding is involved); the decode steps (not the
        suffix's prefill) read only the blocks ``select`` picks on its rows, and no step reads the keys
        ``hide`` masks."""
        cache = self._cache(kvs, room=len(suffix_ids) + max_new_tokens)
        rows = len(kvs)
        self.capture.hide = hide
        try:
            out = self.model(input_ids=torch.tensor([suffix_ids] * rows), past_key_values=cache, use_cache=True,
                             logits_to_keep=1)  # fmt: skip
            self.capture.select = select
            return self._decode(out, cache, rows, max_new_tokens)
        finally:
            self.capture.select = self.capture.hide = None

    def _decode(self, out, cache, rows: int, max_new_tokens: int) -> list[list[int]]:
        generated: list[list[int]] = [[] for _ in range(rows)]
        running = [True] * rows
        for step in range(max_new_tokens):
            tokens = out.logits[:, -1].argmax(-1).tolist()
            for i, token in enumerate(tokens):
                if running[i]:
                    if token in self.stop_ids:
                        running[i] = False
                    else:
                        generated[i].append(token)
            if not any(running) or step == max_new_tokens - 1:
                break
            out = self.model(input_ids=torch.tensor(tokens)[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        return generated

    @torch.no_grad()
    def logits(self, kvs, suffix_ids: list[int], first: int, count: int, hide: KeyMask | None = None) -> torch.Tensor:
        """float32 ``[len(kvs), count, vocab]``: logits of suffix positions ``first .. first+count-1``
        (no position reading the keys ``hide`` masks)."""
        keep = torch.arange(first, first + count)
        self.capture.hide = hide
        try:
            out = self.model(input_ids=torch.tensor([suffix_ids] * len(kvs)), past_key_values=self._cache(kvs),
                             use_cache=True, logits_to_keep=keep)  # fmt: skip
        finally:
            self.capture.hide = None
        return out.logits.float()

    # ------------------------------------------------------------------------- evaluation
    def is_identity(self, setting: Setting) -> bool:
        """Whether ``setting`` must reproduce dense bit for bit (checked on every question): S = 0."""
        return setting.is_identity

    def decode_selection(self, chunk: list[Setting], blocks: range) -> KeyMask | None:
        """The keys the decode steps of a batch of settings read (``blocks``: the prefix's compressed
        ones); None: every key (the server's ``full`` decode). A study overrides it."""
        return None

    def hidden_keys(self, chunk: list[Setting], blocks: range) -> KeyMask | None:
        """Keys no query of a batch of settings reads, at any step (e.g. the compressed blocks of heads
        that keep only sink and window); None: none. A study overrides it."""
        return None

    def evaluate(self, settings: list[Setting], samples: list[Sample], windows: list[Window]) -> list[dict]:
        """Every setting on every sample and window. Settings run as batch rows (``self.batch`` at a
        time; dense and S=0 share the first batch, where S=0 must reproduce dense exactly)."""
        if settings[0].is_dense is False:
            raise ValueError("the dense setting must come first")
        chunks = [settings[i : i + self.batch] for i in range(0, len(settings), self.batch)]
        records: list[dict] = []
        progress = Progress(len(samples) + len(windows), "eval reference")
        for sample in samples:
            t0 = time.time()
            reused = self.geometry.reused(len(sample.prefix_ids), len(sample.prefix_ids))
            state = self.prefix_state(sample.prefix_ids, reused)
            views = {setting: self.fast_kv(state, setting) for setting in settings}  # shared by the questions
            blocks = self.geometry.compressed_blocks(len(sample.prefix_ids), reused)
            for qi, question in enumerate(sample.questions):
                suffix = sample.prefix_ids[reused:] + question.suffix_ids
                outputs: dict[Setting, tuple[list[int], dict, bool]] = {}
                for chunk in chunks:
                    select, hide = self.decode_selection(chunk, blocks), self.hidden_keys(chunk, blocks)
                    ids = self.greedy([views[s][:2] for s in chunk], suffix, question.max_new_tokens, select, hide)
                    outputs.update({s: (i, views[s][2], select is None and hide is None) for s, i in zip(chunk, ids)})
                dense_ids = outputs[settings[0]][0]
                for setting, (ids, stats, reads_all) in outputs.items():
                    if self.is_identity(setting) and reads_all and ids != dense_ids:
                        raise AssertionError(f"{sample.name} q{qi}: S=0 output differs from dense")
                    records.append(self._needle_record(setting, sample, qi, question, ids, ids == dense_ids, stats))
            del views, state
            progress.step(f"{sample.name} ({len(sample.prefix_ids)} prefix tokens, {time.time() - t0:.0f} s)")
        for window in windows:
            t0 = time.time()
            prefix_len = len(window.prefix_ids)
            reused = self.geometry.reused(prefix_len, prefix_len - 1)  # logprobs from the prefix's last token on
            state = self.prefix_state(window.prefix_ids, reused)
            suffix = window.prefix_ids[reused:] + window.continuation_ids
            first = prefix_len - 1 - reused  # suffix position predicting the first scored token
            targets = torch.tensor(window.continuation_ids)
            blocks = self.geometry.compressed_blocks(prefix_len, reused)
            dense_logits = dense_logp = None
            for chunk in chunks:
                kvs = [self.fast_kv(state, setting) for setting in chunk]
                hide = self.hidden_keys(chunk, blocks)
                batch_logits = self.logits([(k, v) for k, v, _ in kvs], suffix, first, len(targets), hide)
                for setting, logits, (_, _, stats) in zip(chunk, batch_logits, kvs):
                    if setting.is_dense:
                        dense_logits, dense_logp = logits, torch.log_softmax(logits, -1)
                    elif self.is_identity(setting) and not torch.equal(logits, dense_logits):
                        raise AssertionError(f"{window.name}: S=0 logits differ from dense")
                    logq = torch.log_softmax(logits, -1)
                    kl = (dense_logp.exp() * (dense_logp - logq)).sum(-1).clamp_min(0)
                    records.append({
                        "kind": "fidelity", "setting": setting.name, "length": window.length, "window": window.index,
                        "prefix_tokens": prefix_len, "tokens": len(targets),
                        "kl": float(kl.mean()), "kl_max": float(kl.max()),
                        "top1": float((logq.argmax(-1) == dense_logp.argmax(-1)).float().mean()),
                        "nll": float(-logq.gather(-1, targets[:, None]).mean()),
                        **stats,
                    })  # fmt: skip
                del batch_logits
            progress.step(f"{window.name} ({prefix_len} prefix + {len(targets)} scored tokens, {time.time() - t0:.0f} s)")
        return records

    def _needle_record(self, setting, sample, qi, question, ids, agrees, stats) -> dict:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return needle_record(setting, sample, qi, question, text, agrees, self.geometry, stats)
