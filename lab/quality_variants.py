"""K-pruning variants of the quality study beyond the server's pruner (reference backend only; run
through ``python lab/eval_study.py``, which takes ``eval_quality``'s flags).

A setting's pruner name selects a variant (``+`` joins parts):

- ``headmap-<score>``: head-adaptive K: the (layer, KV head) pairs with the lowest calibration
  ``<score>`` (``needle``, ``needle_drop``, ``copy``, ``copy_drop`` from
  :mod:`sglang_hs.launch.head_calibration`, or ``random``, a seeded control) store K 2:4, the others
  keep K dense, so that the effective S_K (fraction of compressible K block x head x layer rows stored
  sparse) meets the setting's S_K (:func:`budget_map`, :func:`head_sparse_masks`; a fractional
  boundary head, which the server's K head map does not have);
- ``perm``: 2:4 K along a calibrated permutation of head_dim per (layer, KV head)
  (:func:`channel_permutations`; the store would hold K permuted and the kernels permute Q alike): the
  server compressor's output on the permuted K, read back and un-permuted;
- ``fperm``: ``perm`` with the K channel order of ``--k-channel-order FILE`` (what a server given
  ``--hierasparse-k-channel-order FILE`` stores; ``python -m sglang_hs.launch.calibrate_channels``);

``perm`` and ``fperm`` prune K on every block the magnitude ranking picks at S_K, or, after
``headmap-<score>+``, on the rows the head map picks (e.g. ``headmap-copy+perm``).

- ``vmap`` (with ``headmap-<score>``): V follows the head map too: 2:4 V only on the (layer, KV head)
  rows whose K the map stores sparse (and on blocks the V ranking picks at S_V), so the heads that
  retrieve keep both K and V dense (a per-head V format the store does not hold yet).
- ``vcomp-<percent>``: V error compensation on the magnitude 2:4 support: in every group of 4 tokens
  and channel, the two kept values each take ``percent``/100 of half the dropped values' sum (100: the
  group's sum is kept exactly, the optimum when attention is even across the group; 0: plain
  magnitude). The format and the kernels are unchanged; only the stored values move.

Variants that lost (``mustafar``: per-token unstructured K; ``wperm``/``sperm``: data-free channel
orders; ``refit``: kept values re-fitted to the query second moment; ``output_aware``: Wanda-style
scores from the prefix's own last queries) are described with their results in ``docs/quality.md``
and live in git history (commit 8f42e89; ``output_aware``: ``git log -S OutputAwarePruner``).

- ``stream-<percent>``: streaming heads (DuoAttention's split): the ``percent`` of (layer, KV head) pairs
  with the lowest head-map score (the ``headmap-<score>`` part's, else ``needle``) keep only sink, window and
  the question's own tokens of a cached prefix: no query reads their compressed blocks
  (``eval_study.StreamingHeads``), which the store would not hold. The other heads store what the rest
  of the setting says.
- ``fp8store``, ``fp8prefix``, ``fp8unit``: FP8 (e4m3) values, round-tripped: ``fp8store`` on the
  compressed blocks only (dense and 2:4 alike: the compressor would quantize the kept values, with a scale
  per block and KV head from their absolute maximum), ``fp8prefix`` on the whole cached prefix with the same
  scales (an FP8 dense pool for sink and window beside the store), ``fp8unit`` on the whole prefix with a
  unit scale, saturating at ±448 (SGLang's ``--kv-cache-dtype fp8_e4m3`` without scales, on the prefix
  only: its questions' own K/V stay 16-bit here). Alone (``fp8store:sk=0,sv=1``) they take the magnitude
  pruner's blocks.

V is the magnitude pruner's (2:4, the server's block ranking at S_V), on every head unless ``vmap``,
with its stored values unless ``vcomp``. The sparse K of the magnitude and head-map variants is the
server compressor's output read back from the store.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from sglang_hs.channel_order import ChannelOrder, ranked_quarter_permutations, unpermute
from sglang_hs.format import GROUP, KEEP, sparse_count
from sglang_hs.launch import head_calibration
from sglang_hs.launch.head_calibration import SCORE_NAMES
from sglang_hs.launch.quality_inputs import Setting
from sglang_hs.launch.quality_reference import kv_stats
from sglang_hs.pools import prefix_blocks
from sglang_hs.pruner import MagnitudePruner, Pruner, rank_sparse, top2_of_4

HEADMAP = "headmap-"
PERM = "perm"
V_MAP = "vmap"
V_COMP = "vcomp-"
STREAM = "stream-"
FP8_PARTS = {"fp8store": "store", "fp8prefix": "prefix", "fp8unit": "unit"}
FP8_MAX = 448.0  # e4m3's largest finite value
FILE_PERM = "fperm"
RANDOM_SCORE = "random"


@dataclass(frozen=True)
class Variant:
    score: str | None  # head-map score name, or None (every head alike)
    perm: bool = False
    perm_source: str = "calibration"  # or "file" (fperm)
    v_map: bool = False  # V sparse only where the head map stores K sparse
    v_comp: float = 0.0  # share of the dropped V group sum the kept values absorb
    fp8: str = ""  # "", or FP8_PARTS' values: which tokens hold e4m3 values, and how they are scaled
    stream: float = 0.0  # share of (layer, KV head) pairs that keep only sink and window of a cached prefix


def parse_variant(pruner: str) -> Variant | None:
    """The variant a pruner name selects, or None for the server's own pruners."""
    parts = pruner.split("+")
    score, perm, source, v_map, v_comp, fp8, stream = None, False, "calibration", False, 0.0, "", 0.0
    for part in parts:
        if part.startswith(HEADMAP) and score is None:
            score = part[len(HEADMAP) :].replace("-", "_")
            if score not in (*SCORE_NAMES, RANDOM_SCORE):
                raise ValueError(f"unknown head-map score {score!r}; allowed: {[*SCORE_NAMES, RANDOM_SCORE]}")
        elif part == PERM:
            perm = True
        elif part == FILE_PERM:
            perm, source = True, "file"
        elif part == V_MAP:
            v_map = True
        elif part.startswith(V_COMP) and part[len(V_COMP) :].isdigit():
            v_comp = int(part[len(V_COMP) :]) / 100
        elif part in FP8_PARTS and not fp8:
            fp8 = FP8_PARTS[part]
        elif part.startswith(STREAM) and part[len(STREAM) :].isdigit() and int(part[len(STREAM) :]) <= 100:
            stream = int(part[len(STREAM) :]) / 100
        elif len(parts) == 1:
            return None
        else:
            raise ValueError(f"unknown variant part {part!r} in {pruner!r}")
    if v_map and score is None:
        raise ValueError(f"{V_MAP!r} needs a head map part ({HEADMAP}<score>) in {pruner!r}")
    return Variant(score, perm, source, v_map, v_comp, fp8, stream)


def needs_calibration(pruners: list[str]) -> bool:
    variants = [parse_variant(p) for p in pruners if p != "dense"]
    return any(v and ((v.perm and v.perm_source == "calibration") or (v.score and v.score != RANDOM_SCORE)
                      or (v.stream and v.score is None)) for v in variants)  # fmt: skip


def fp8_round_trip(x: torch.Tensor, lo: int, hi: int, block: int, unit_scale: bool = False) -> torch.Tensor:
    """``x [T, H, D]`` with tokens ``[lo, hi)`` stored as e4m3 and read back: a scale per ``block`` tokens
    and head from the absolute maximum (a partial last block has its own), or a unit scale saturating at
    ±448. Zeros (pruned elements) stay zero."""
    seg = x[lo:hi].float()
    n, heads, dim = seg.shape
    padded = torch.nn.functional.pad(seg, (0, 0, 0, 0, 0, (-n) % block)).view(-1, block, heads, dim)
    if unit_scale:
        scale = torch.ones(1)
    else:
        scale = padded.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12) / FP8_MAX
    stored = (padded / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = x.clone()
    out[lo:hi] = (stored.float() * scale).view(-1, heads, dim)[:n].to(x.dtype)
    return out


def token_mask(mask: torch.Tensor, block: int) -> torch.Tensor:
    """``[H, n]`` block mask -> ``[n·B, H, 1]`` token mask (the ``[tokens, H, D]`` K layout)."""
    return mask.repeat_interleave(block, dim=-1).transpose(0, 1)[..., None]


def compensated_v(dense: torch.Tensor, share: float) -> torch.Tensor:
    """``[T, H, D]`` V (T a multiple of 4, groups aligned) pruned 2:4 along tokens by magnitude, the
    kept two of every group raised by ``share`` x half the group's dropped sum (per head and channel)."""
    x = dense.float()
    keep = top2_of_4(x.abs(), 0)
    dropped = (x * ~keep).unflatten(0, (-1, GROUP)).sum(1, keepdim=True)
    moved = x.unflatten(0, (-1, GROUP)) + share * dropped / KEEP
    return torch.where(keep, moved.flatten(0, 1), 0).to(dense.dtype)


# ===================================================================================== head map and masks
def budget_map(scores: torch.Tensor, sk: float) -> torch.Tensor:
    """float64 ``[L, H]``: each (layer, head)'s fraction of compressible K blocks stored sparse, so
    that the mean is exactly ``sk``. Heads are pruned in increasing score order (ties: lower flat
    index first); the first ``floor(sk·L·H)`` are fully sparse, the next takes the remainder."""
    if not 0.0 <= sk <= 1.0:
        raise ValueError(f"S_K budget {sk} is outside [0, 1]")
    n = scores.numel()
    units = round(sk * n, 9)
    full = math.floor(units)
    order = scores.flatten().double().argsort(stable=True)
    fractions = torch.zeros(n, dtype=torch.float64)
    fractions[order[:full]] = 1.0
    if full < n and units > full:
        fractions[order[full]] = units - full
    return fractions.view(scores.shape)


def head_sparse_masks(fractions: torch.Tensor, losses: torch.Tensor, prunable: torch.Tensor) -> torch.Tensor:
    """bool ``[L, H, n]``: per (layer, head), its ``ceil(f·n_prunable)`` prunable blocks of least
    ``losses [L, H, n]`` (stable: ties to the earlier block). A pure function of its inputs."""
    n_prunable = int(prunable.sum())
    counts = torch.tensor([sparse_count(n_prunable, float(f)) for f in fractions.flatten()]).view(fractions.shape)
    ranked = torch.where(prunable, losses.float(), torch.inf).argsort(dim=-1, stable=True)
    rank = ranked.argsort(dim=-1)
    return (rank < counts[..., None]) & prunable


def head_block_losses(pruner: Pruner, k_buffers: Sequence[torch.Tensor], slots: torch.Tensor, block_size: int,
                      kv_heads: int) -> torch.Tensor:  # fmt: skip
    """float32 ``[L, H, n]``: each K block's pruning loss per layer and KV head (the compressor's
    first pass, before it sums over layers and heads)."""
    out = []
    for buffer in k_buffers:
        blocks = prefix_blocks(buffer, slots, block_size, kv_heads)
        out.append(pruner.operand_loss(blocks, "k", pruner.element_mask(blocks, "k")))
    return torch.stack(out)



# ===================================================================================== channel permutation
def channel_permutations(key_energy: torch.Tensor, query_energy: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[L, H, D]``: per (layer, KV head) a permutation of head_dim whose consecutive groups
    of 4 each take one channel from every quarter of the channels ranked by importance
    (``E[k_c²]``, times ``E[q_c²]`` when given): group ``g`` holds the channels ranked ``g``,
    ``g + D/4``, ``g + D/2`` and ``g + 3D/4``. Magnitude 2:4 along the permuted axis then never has
    to drop one of two large channels that happen to sit side by side (low-frequency RoPE channels
    carry most of K's energy and are adjacent). Applied to K and to Q alike after RoPE it leaves
    ``q·k`` unchanged."""
    importance = key_energy if query_energy is None else key_energy * query_energy
    return ranked_quarter_permutations(importance)


def permuted_keep(blocks: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """bool like ``blocks [H, ..., D]`` (original channel order): magnitude 2:4 along head_dim
    after permuting the channels of head ``h`` by ``perm [H, D]``."""
    index = perm.view(perm.shape[0], *[1] * (blocks.dim() - 2), perm.shape[1]).expand_as(blocks)
    keep = top2_of_4(blocks.float().abs().gather(-1, index), -1)
    return torch.zeros_like(keep).scatter_(-1, index, keep)


# ===================================================================================== the backend's part
class VariantKV:
    """The reference backend's K/V for variant settings (mixed into
    :class:`sglang_hs.launch.quality_reference.ReferenceBackend` by ``eval_study.StudyBackend``, whose
    model, geometry, store and ``_compress`` / ``_all_sparse`` / ``_slots`` it uses), and the head
    calibration."""

    head_scores: head_calibration.HeadScores | None
    random_seed: int
    channel_order: ChannelOrder | None = None  # the fperm variant's order (--k-channel-order), loaded once

    def variant_kv(self, state: Any, setting: Setting, variant: Variant, blocks: range):
        """K/V of a variant setting: V (and the 2:4 K) as the magnitude
        compressor stores them, K dense or sparse per (layer, head, block) as the variant says."""
        layers, (loss_k, loss_v) = self._all_sparse(state, "magnitude", blocks)
        b, n, rows = self.geometry.block, len(blocks), self.num_layers * self.kv_heads
        lo, hi = blocks.start * b, blocks.stop * b
        every = torch.ones(n, dtype=torch.bool)
        if variant.score is not None:
            sparse_k = self.head_mask(state, variant.score, setting.sk, blocks)
        else:
            sparse_k = rank_sparse(loss_k, every, setting.sk).expand(self.num_layers, self.kv_heads, n)
        sparse_v = rank_sparse(loss_v, every, setting.sv).expand(self.num_layers, self.kv_heads, n)
        if variant.v_map:  # the mapped heads: those the K budget prunes fully
            sparse_v = sparse_v & (budget_map(self.scores_of(variant.score), setting.sk) >= 1.0)[..., None]
        if variant.v_comp:
            layers = [(kb, compensated_v(vl[lo:hi], variant.v_comp)) for vl, (kb, _) in zip(state.v, layers)]
        v = [torch.cat([vl[:lo], torch.where(token_mask(mask, b), vb, vl[lo:hi]), vl[hi:]])
             for vl, (_, vb), mask in zip(state.v, layers, sparse_v)]  # fmt: skip
        k_sparse = self._permuted(state, blocks, variant.perm_source) if variant.perm else [kb for kb, _ in layers]
        k = [torch.cat([kl[:lo], torch.where(token_mask(mask, b), kb, kl[lo:hi]), kl[hi:]])
             for kl, kb, mask in zip(state.k, k_sparse, sparse_k)]  # fmt: skip
        if variant.fp8:
            first, last = (lo, hi) if variant.fp8 == "store" else (0, k[0].shape[0])  # the reused prefix
            k = [fp8_round_trip(x, first, last, b, variant.fp8 == "unit") for x in k]
            v = [fp8_round_trip(x, first, last, b, variant.fp8 == "unit") for x in v]
        stats = kv_stats(blocks, (sparse_k, sparse_v), rows)
        if variant.stream:
            stats["streaming_heads"] = round(float(self.streaming_heads(variant).double().mean()), 4)
        return k, v, stats

    def streaming_heads(self, variant: Variant) -> torch.Tensor:
        """bool ``[L, H]``: the (layer, KV head) pairs that keep only sink and window (lowest score first)."""
        return budget_map(self.scores_of(variant.score or "needle"), variant.stream) >= 1.0

    def head_mask(self, state: Any, score: str, sk: float, blocks: range) -> torch.Tensor:
        """bool ``[L, H, n]``: the K rows the head map of ``score`` at budget ``sk`` stores sparse."""
        scores = self.scores_of(score)
        if "head_losses" not in state.pruned:
            state.pruned["head_losses"] = head_block_losses(
                MagnitudePruner(), state.k, self._slots(blocks), self.geometry.block, self.kv_heads)
        every = torch.ones(len(blocks), dtype=torch.bool)
        return head_sparse_masks(budget_map(scores, sk), state.pruned["head_losses"], every)

    def scores_of(self, score: str) -> torch.Tensor:
        """``[L, H]`` calibration scores of ``score`` (or the seeded random control)."""
        if score == RANDOM_SCORE:
            return head_calibration.random_scores(self.num_layers, self.kv_heads, self.random_seed)
        if self.head_scores is None or score not in self.head_scores.scores:
            raise RuntimeError(f"head-map score {score!r} needs calibrate() first")
        return self.head_scores.scores[score]

    def permutations(self) -> torch.Tensor:
        """int64 ``[L, H, D]``: the calibrated channel permutation of K (and Q) per (layer, KV head)."""
        hs = self.head_scores
        if hs is None or hs.key_energy is None or hs.query_moment is None:
            raise RuntimeError("perm needs calibrate() first (the key and query channel energies)")
        return channel_permutations(hs.key_energy, hs.query_moment.diagonal(dim1=-2, dim2=-1))

    def _permuted(self, state: Any, blocks: range, source: str = "calibration") -> list[torch.Tensor]:
        """Per layer ``[n·B, H, D]``: the compressible blocks' K pruned 2:4 along the permuted channels,
        i.e. the compressor's output (every block sparse) on permuted K, read back and un-permuted."""
        key = f"perm/{source}"
        if key not in state.pruned:
            if source == "file":
                if self.channel_order is None:
                    raise RuntimeError("fperm needs --k-channel-order FILE")
                perms = self.channel_order.perm
            else:
                perms = self.permutations()
            k_perm = [kl.gather(-1, p[None].expand_as(kl)) for kl, p in zip(state.k, perms)]
            layers, _ = self._compress(dataclasses.replace(state, k=k_perm, pruned={}), "magnitude", 1.0, 1.0, blocks)
            state.pruned[key] = [unpermute(kb, p) for (kb, _), p in zip(layers, perms)]
        return state.pruned[key]

    def calibrate(self, texts: list[str], spec: head_calibration.CalibrationSpec) -> head_calibration.HeadScores:
        """Head scores (and query moments) from the calibration probes on ``texts``."""
        self.head_scores = head_calibration.calibrate_model(self, texts, spec, lambda m: print(f"[eval] {m}", flush=True))
        self.random_seed = spec.seed
        return self.head_scores
