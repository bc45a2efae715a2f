"""The quality study on the reference backend: ``eval_quality`` with the K-pruning variants and the
decode-time block selection rules of ``docs/quality.md``.

    python lab/eval_study.py --backend reference --model-path DIR [eval_quality's flags] \
        [--settings headmap-needle+fperm:sk=0.7556,sv=0 ...] [--k-channel-order FILE] \
        [--calib-corpus DIR] [--calib-seed 0] [--head-scores PT] [--decode-select RULE]

Every flag of ``python -m sglang_hs.launch.eval_quality`` works here; the settings may also name the
variants of :mod:`quality_variants` (``headmap-<score>``, ``perm``, ``fperm``, ``vmap``,
``vcomp-<percent>``), and ``--decode-select RULE`` makes the decode steps of every non-dense setting
read only the compressible prefix blocks the rule picks by exact attention mass
(:class:`DecodeSelection`). The records are ``eval_quality``'s, with the study's choices in ``meta``
(``decode_select``, ``head_calibration``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_hs.channel_order import ChannelOrder
from sglang_hs.k_head_map import KHeadMap
from sglang_hs.launch import eval_quality, head_calibration
from sglang_hs.launch.calibrate_anchors import CALIBRATION_SEED_OFFSET, calibration_samples, place_on
from sglang_hs.launch.quality_inputs import Setting, split_corpus
from sglang_hs.launch.quality_reference import KeyMask, PrefixState, ReferenceBackend
from sglang_hs.pruner import PRUNERS
from sglang_hs.reference import exact_block_mass, select_topk

from quality_variants import VariantKV, needs_calibration, parse_variant  # isort: skip (lab/, this script's folder)


# ===================================================================================== decode-time selection
@dataclass
class DecodeSelection:
    """Decode-time block selection (``--decode-select``) on the rows ``rows`` of a batch: a decode step
    reads the compressible prefix blocks ``[lo, hi)`` (token positions) that ``rule`` picks, and every
    other position in full."""

    rule: str  # "exact:K" (each layer's top K by exact mass, per KV head: an oracle), "pooled:K" (exact mass
    #            summed over the KV heads, one choice for all), "panchor:K:S" (pooled, on every S-th layer,
    #            reused between) or "canchor:K:A-B-.." (pooled, on anchor layers placed offline)
    lo: int
    hi: int
    block: int
    rows: list[bool]
    anchor_choice: dict[int, torch.Tensor] = field(default_factory=dict)  # per row: the last anchor's top-k

    def key_mask(self, query: torch.Tensor, key: torch.Tensor, scaling: float, layer: int = 0) -> torch.Tensor:
        """bool ``[batch, heads, 1, kv_len]``: False on the unselected blocks of the selected rows.
        ``panchor:K:S`` measures exact masses on every S-th layer (0, S, 2S, ...) and reuses that top-K
        in the layers up to the next anchor, as Kascade does; ``canchor:K:A-B-..`` on the listed anchor
        layers (placed offline: ``calibrate_anchors``). The server's ``kascade`` decode mode is
        ``canchor``."""
        batch, heads, kv_len = key.shape[0], key.shape[1], key.shape[2]
        keep = torch.ones(batch, heads, 1, kv_len, dtype=torch.bool)
        kind, value, *rest = self.rule.split(":")
        n = (self.hi - self.lo) // self.block
        for row in range(batch):
            if not self.rows[row] or n == 0:
                continue
            region = key[row, :, self.lo : self.hi].transpose(0, 1)  # [n*B, H, D]
            none = torch.zeros(n, dtype=torch.bool)
            if kind in ("panchor", "canchor"):
                if (layer in {int(a) for a in rest[0].split("-")}) if kind == "canchor" else layer % int(rest[0]) == 0:
                    mass = exact_block_mass(query[row, :, 0], region, self.block, scaling)
                    mass = mass.sum(0, keepdim=True).expand(heads, n)  # pooled over the KV heads: one choice
                    self.anchor_choice[row] = select_topk(mass, int(value), none)
                chosen = self.anchor_choice[row]
            else:
                mass = exact_block_mass(query[row, :, 0], region, self.block, scaling)
                if kind == "pooled":  # the same top-k for every KV head (a per-request block table can say it)
                    mass = mass.sum(0, keepdim=True)
                chosen = select_topk(mass, int(value), none).expand(heads, n)
            keep[row, :, 0, self.lo : self.hi] = chosen.repeat_interleave(self.block, dim=-1)
        return keep


@dataclass
class StreamingHeads:
    """Streaming heads on the rows of a batch: ``heads[row]`` (bool ``[L, H]`` or None) marks the
    (layer, KV head) pairs whose compressed prefix tokens ``[lo, hi)`` no query reads."""

    lo: int
    hi: int
    heads: list[torch.Tensor | None]

    def key_mask(self, query: torch.Tensor, key: torch.Tensor, scaling: float, layer: int = 0) -> torch.Tensor:
        keep = torch.ones(key.shape[0], key.shape[1], 1, key.shape[2], dtype=torch.bool)
        for row, heads in enumerate(self.heads):
            if heads is not None:
                keep[row, heads[layer], 0, self.lo : self.hi] = False
        return keep


def parse_decode_select(rule: str | None) -> str | None:
    """``exact:K`` / ``pooled:K`` (K >= 1), ``panchor:K:S``, ``canchor:K:M`` (M anchors placed on
    calibration prompts) / ``canchor:K:0-A-B..`` (those anchor layers); ValueError with one line otherwise.
    (Rules scored by per-block key bounds, ``topk`` and ``mass``, and per-head anchors, ``anchor``,
    lost; ``docs/quality.md``.)"""
    if rule is None:
        return None
    kind, _, value = rule.partition(":")
    try:
        if kind == "canchor":
            k, anchors = value.split(":")
            layers = [int(a) for a in anchors.split("-")]
            ok = int(k) >= 1 and (layers[0] >= 1 if len(layers) == 1 else layers[0] == 0 and layers == sorted(set(layers)))
        elif kind == "panchor":
            k, stride = value.split(":")
            ok = int(k) >= 1 and int(stride) >= 1
        else:
            ok = kind in ("exact", "pooled") and int(value) >= 1
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--decode-select {rule!r}: expected exact:K, pooled:K, panchor:K:STRIDE, canchor:K:COUNT "
                         "or canchor:K:0-A-B...")
    return rule


# ===================================================================================== the study's backend
class StudyBackend(VariantKV, ReferenceBackend):
    """The reference backend with the variants' K/V and the decode-time selection."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_scores: head_calibration.HeadScores | None = None  # from calibrate(), for the head-map variants
        self.random_seed = 0  # seed of the random head-map control
        self.decode_select: str | None = None  # block selection on the non-dense rows' decode steps

    def fast_kv(self, state: PrefixState, setting: Setting) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
        variant = None if setting.is_dense else parse_variant(setting.pruner)
        blocks = self.geometry.compressed_blocks(state.prefix_len, state.reused)
        if variant is None or len(blocks) == 0:
            return super().fast_kv(state, setting)
        return self.variant_kv(state, setting, variant, blocks)

    def is_identity(self, setting: Setting) -> bool:
        """S = 0 of a variant that quantizes (fp8*) or streams heads moves the output: not an identity."""
        variant = None if setting.is_dense else parse_variant(setting.pruner)
        return super().is_identity(setting) and not (variant and (variant.fp8 or variant.stream))

    def hidden_keys(self, chunk: list[Setting], blocks: range) -> KeyMask | None:
        variants = [None if s.is_dense else parse_variant(s.pruner) for s in chunk]
        if not any(v and v.stream for v in variants) or len(blocks) == 0:
            return None
        b = self.geometry.block
        return StreamingHeads(blocks.start * b, blocks.stop * b,
                              [self.streaming_heads(v) if v and v.stream else None for v in variants])  # fmt: skip

    def decode_selection(self, chunk: list[Setting], blocks: range) -> KeyMask | None:
        if not self.decode_select:
            return None
        b = self.geometry.block
        return DecodeSelection(self.decode_select, blocks.start * b, blocks.stop * b, b, [not s.is_dense for s in chunk])


def known_pruner(name: str) -> bool:
    """The server's pruners and the variants."""
    try:
        return name in PRUNERS or parse_variant(name) is not None
    except ValueError:
        return False


def prepare_study(args: argparse.Namespace, settings: list[Setting], k_map: KHeadMap | None,
                  texts: dict[str, str]) -> tuple[StudyBackend, dict[str, Any]]:  # fmt: skip
    """``eval_quality.ReferencePreparer`` of the study: the checks, the backend, the K channel order of
    ``fperm``, the head calibration the variants need and the anchors ``canchor:K:M`` places."""
    Usage = eval_quality.UsageError
    variants = [s.name for s in settings if not s.is_dense and parse_variant(s.pruner) is not None]
    if k_map is not None and variants:  # the variants choose their own K rows and would ignore the map
        raise Usage(f"--k-head-map applies to the server's pruners; {variants[0]} prunes K its own way "
                    "(run it without the map)")  # fmt: skip
    try:
        rule = parse_decode_select(args.decode_select)
    except ValueError as exc:
        raise Usage(str(exc)) from None
    spec = head_calibration.CalibrationSpec(seed=args.calib_seed)
    calibrate = needs_calibration([s.pruner for s in settings])
    if calibrate:
        shared = set(args.lengths) & set(spec.needle_lengths + spec.copy_lengths)
        if shared:
            raise Usage(f"--lengths {sorted(shared)} are calibration lengths; evaluate on others")
        calib_texts = head_calibration.load_calibration_texts(args.calib_corpus)
    backend = StudyBackend(args.model_path, eval_quality.geometry_of(args), args.kv_dtype, args.threads, args.batch)
    backend.random_seed = args.calib_seed
    if args.k_channel_order:
        try:
            backend.channel_order = ChannelOrder.load(args.k_channel_order)
            backend.channel_order.check_model(backend.num_layers, backend.kv_heads, backend.head_dim)
        except ValueError as exc:
            raise Usage(str(exc)) from None
    if k_map is not None:
        backend.k_head_map = k_map.sparse
        print(f"[eval] K head map {args.k_head_map}: {k_map.share:.3f} of (layer, head) pairs store K 2:4", flush=True)
    meta: dict[str, Any] = {}
    if calibrate:
        if args.head_scores and os.path.isfile(args.head_scores):
            backend.head_scores = head_calibration.HeadScores(**torch.load(args.head_scores))
            print(f"[eval] head scores from {args.head_scores}", flush=True)
        else:
            backend.calibrate(calib_texts, spec)
            if args.head_scores:
                hs = backend.head_scores
                torch.save({"scores": hs.scores, "query_moment": hs.query_moment, "meta": hs.meta,
                            "key_energy": hs.key_energy}, args.head_scores)  # fmt: skip
        meta["head_calibration"] = {**backend.head_scores.to_json(), "corpus": args.calib_corpus or "default",
                                    "spec": dataclasses.asdict(spec)}  # fmt: skip
    if rule and rule.startswith("canchor:") and "-" not in rule:  # a count of anchors: place them
        k, count = (int(x) for x in rule.split(":")[1:])
        haystack, _ = split_corpus(texts)
        calib, lengths = calibration_samples(backend.tokenizer, haystack, args.calib_seed, args.tasks)
        if set(lengths) & set(args.lengths):
            raise Usage(f"--lengths {sorted(set(lengths) & set(args.lengths))} are calibration lengths; evaluate on others")
        rule = f"canchor:{k}:{'-'.join(map(str, place_on(backend, calib, k, count)))}"
        print(f"[eval] {count} anchors placed on {sum(len(c.questions) for c in calib)} calibration questions "
              f"(seed {args.calib_seed + CALIBRATION_SEED_OFFSET}, lengths {lengths}): {rule}", flush=True)  # fmt: skip
    backend.decode_select = rule
    meta["decode_select"] = rule
    return backend, meta


def build_parser() -> argparse.ArgumentParser:
    parser = eval_quality.build_parser()
    parser.description = __doc__
    parser.set_defaults(command="python lab/eval_study.py")
    calib = parser.add_argument_group("the study (reference backend)")
    calib.add_argument("--calib-corpus", help="folder of calibration filler texts (default: the licence texts of "
                       "/usr/share/common-licenses, disjoint from the essays)")  # fmt: skip
    calib.add_argument("--calib-seed", type=int, default=0, help="seed of the calibration prompts and the random control")
    calib.add_argument("--k-channel-order", metavar="FILE", help="the fperm variant's K channel order "
                       "(python -m sglang_hs.launch.calibrate_channels)")  # fmt: skip
    calib.add_argument("--head-scores", metavar="PT", help="cache of the calibration (torch file): loaded if it exists, "
                       "else written after calibrating")  # fmt: skip
    calib.add_argument("--decode-select", metavar="RULE", help="decode steps of every non-dense setting read only "
                       "the compressible prefix blocks RULE picks by exact attention mass: exact:K (each layer's "
                       "top K per KV head, an oracle), pooled:K (summed over KV heads: one choice per layer), "
                       "panchor:K:S (pooled top K on every S-th layer, reused between) or canchor:K:M (M pooled "
                       "anchors placed offline on calibration questions of another seed and lengths)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    return eval_quality.run(build_parser().parse_args(argv), argv, prepare_study, known_pruner)


if __name__ == "__main__":
    sys.exit(main())
