"""Calibrate a model's K head map (``--hierasparse-k-head-map``): which (layer, KV head) pairs may store
K 2:4 in a compressed prefix, and which keep it dense because they retrieve.

    python -m sglang_hs.launch.calibrate_heads --model-path MODEL [--share 0.75] [--score needle]
        [--out FILE] [--calib-corpus DIR] [--calib-seed 0] [--head-scores PT] [--threads N]

Runs the checkpoint (transformers, on the CPU, through the quality evaluation's reference model) over
synthetic calibration prompts (:mod:`sglang_hs.launch.head_calibration`: pass keys hidden in filler text, and
passages to copy) and scores each KV head by the attention mass its query heads put on the tokens
that matter (``needle``: the pass key; ``copy``: the next token to copy). The ``--share`` of pairs
with the lowest scores are mapped to 2:4 K; at S_K = 1 that is the effective S_K. Writes ``FILE``
(default ``MODEL/hierasparse_k_head_map.pt``) and prints a progress line per probe. The filler is
the licence texts of ``/usr/share/common-licenses`` unless ``--calib-corpus`` names a folder of text
files; the evaluation's essays are not used. SmolLM2-135M: about 5 minutes on two CPU cores.
``--head-scores PT`` reuses (or writes) the scores of an earlier calibration (``eval_quality``'s cache).
``--score random`` runs no model: a seeded random map of the share (``--calib-seed``), for speed and
capacity runs on dummy weights, where no head retrieves (a random map loses retrieval on a real model).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from sglang_hs.config import HieraSparseConfig
from sglang_hs.k_head_map import KHeadMap, model_shape
from sglang_hs.launch import head_calibration

RANDOM = "random"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--share", type=float, default=0.75, help="share of (layer, KV head) pairs that store K 2:4")
    ap.add_argument("--score", default="needle", choices=[*head_calibration.SCORE_NAMES, RANDOM],
                    help="which calibration score ranks the heads (low: mapped to 2:4 first)")
    ap.add_argument("--out", help="the map file (default MODEL/hierasparse_k_head_map.pt)")
    ap.add_argument("--calib-corpus", help="folder of calibration filler texts")
    ap.add_argument("--calib-seed", type=int, default=0)
    ap.add_argument("--head-scores", metavar="PT", help="scores of an earlier calibration: loaded if the file "
                    "exists, else written after calibrating")  # fmt: skip
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    args = ap.parse_args(argv)
    if not 0.0 <= args.share <= 1.0:
        ap.error(f"--share {args.share} is outside [0, 1]")
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        print(f"calibrate_heads: --model-path {args.model_path} has no config.json", file=sys.stderr)
        return 2
    if args.score == RANDOM:
        scores = {RANDOM: head_calibration.random_scores(*model_shape(args.model_path), args.calib_seed)}
    elif args.head_scores and os.path.isfile(args.head_scores):
        scores = head_calibration.HeadScores(**torch.load(args.head_scores)).scores
        print(f"[calibrate] head scores from {args.head_scores}", flush=True)
    else:
        from sglang_hs.launch.quality_inputs import MissingInput, PrefixGeometry
        from sglang_hs.launch.quality_reference import ReferenceBackend

        try:
            texts = head_calibration.load_calibration_texts(args.calib_corpus)
        except MissingInput as exc:
            print(f"calibrate_heads: {exc}", file=sys.stderr)
            return 2
        defaults = HieraSparseConfig()  # the server's default sink, window and block (the drop scores' geometry)
        geometry = PrefixGeometry(defaults.block_size, defaults.sink_tokens, defaults.window_tokens)
        backend = ReferenceBackend(args.model_path, geometry, threads=args.threads)
        found = head_calibration.calibrate_model(backend, texts, head_calibration.CalibrationSpec(seed=args.calib_seed),
                                                 lambda m: print(f"[calibrate] {m}", flush=True))  # fmt: skip
        scores = found.scores
        if args.head_scores:
            torch.save({"scores": found.scores, "query_moment": found.query_moment, "meta": found.meta,
                        "key_energy": found.key_energy}, args.head_scores)  # fmt: skip
    k_map = KHeadMap.from_scores(scores[args.score], args.share)
    out = args.out or os.path.join(args.model_path, "hierasparse_k_head_map.pt")
    k_map.save(out, score=args.score, share=args.share, calib_seed=args.calib_seed)
    layers = sorted({layer for layer, _ in (~k_map.sparse).nonzero().tolist()})
    print(f"[calibrate] wrote {out}: {k_map.share:.3f} of {k_map.sparse.numel()} (layer, KV head) pairs store K 2:4; "
          f"dense K in layers {layers}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
