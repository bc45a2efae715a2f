"""Merge reference runs of the byte studies (``eval_study.py`` with the ``fp8*`` and ``stream-<p>`` variants)
into one record whose rows give each setting's prefix KV bytes against bf16 (sink, window, 2:4 metadata and
fp32 scales counted, averaged over the questions' prefixes), needle accuracy and KL per question set.

    python lab/fp8_frontier.py --commit C --out launch/results/quality_fp8_reference_smollm2.json \
        [--description TEXT] RUN.json "question set name" [RUN.json "name" ...]
"""

from __future__ import annotations

import argparse
import json

from sglang_hs.format import compressed_fraction, dense_block_bytes
from sglang_hs.launch.quality_frontier import pooled

HEAD_DIM = 64  # SmolLM2-135M: only the scales' share depends on it
BLOCK = 64


def bytes_vs_bf16(setting: str, rec: dict) -> float:
    """The prefix's K+V bytes against bf16 for one question's record: ``fp8prefix`` holds every prefix
    token in e4m3 (scales counted), ``fp8store`` the compressed blocks only, ``fp8unit`` every token at a
    unit scale; ``stream-<p>`` heads (the record's ``streaming_heads`` share) store no compressed block;
    compressed blocks count as the store does (:func:`sglang_hs.format.compressed_fraction`: values, 2:4
    metadata, FP8 scales)."""
    name = setting.split(":")[0]
    parts = set(name.split("+"))
    if name == "dense":
        return 1.0
    if "fp8unit" in parts:
        return 0.5
    a, c = rec["prefix_tokens"], rec["compressed_blocks"] * BLOCK
    kept = 1.0 - rec.get("streaming_heads", 0.0)  # the heads that store the compressed blocks
    # sink, window, tail: dense tokens at 8 bits (a scale per block and head) or 16
    outside = dense_block_bytes(BLOCK, HEAD_DIM, 1 if "fp8prefix" in parts else 2) / dense_block_bytes(BLOCK, HEAD_DIM)
    blocks = 0.0
    if c:
        elem = 1 if parts & {"fp8prefix", "fp8store"} else 2
        blocks = compressed_fraction(rec["sparse_k_blocks"] * BLOCK / c, rec["sparse_v_blocks"] * BLOCK / c, elem,
                                     BLOCK, HEAD_DIM)  # fmt: skip
    return ((a - c) * outside + kept * c * blocks) / a


def merge(runs_named: list[tuple[str, str]], commit: str, description: str | None = None) -> dict:
    rows, runs = [], {}
    for path, question_set in runs_named:
        with open(path) as f:
            d = json.load(f)
        runs[question_set] = {"meta": d["meta"], "summary": d["summary"]}
        needles = [r for r in d["records"] if r["kind"] == "needle"]
        dense_acc = next(x["accuracy"] for x in d["summary"] if x["setting"] == "dense")
        for s in d["summary"]:
            mine = [r for r in needles if r["setting"] == s["setting"]]
            kv = sum(bytes_vs_bf16(s["setting"], r) for r in mine) / len(mine)
            rows.append({"setting": s["setting"], "kv_bytes_vs_bf16": round(kv, 4), "needle_acc": round(s["accuracy"], 4),
                         "dense_acc": round(dense_acc, 4), "kl": s["kl"], "answer_equals_dense": s["agree"],
                         "questions": s["questions"], "question_set": question_set, "backend": "reference"})
    return {
        "description": description or "FP8 (e4m3) values on the cached prefix, on the PyTorch reference (lab/eval_study.py): fp8unit = "
                       "the whole prefix at a unit scale (SGLang's fp8_e4m3 without scales, prefix only: the question's "
                       "own K/V stay 16-bit), fp8prefix = the whole prefix with a scale per 64-token block and KV head, "
                       "sv=1 = 2:4 V on the compressed blocks; magnitude:sk=0,sv=1 is the shipped default (bf16 values). "
                       "kv_bytes_vs_bf16 counts sink, window, 2:4 metadata and fp32 scales, averaged over the questions' "
                       "prefixes (lab/fp8_frontier.py).",
        "device": "CPU", "model": "SmolLM2-135M-Instruct", "commit": commit, "pooled": pooled(rows), "rows": rows, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", required=True, help="the commit the runs ran on")
    parser.add_argument("--out", required=True, help="the merged record")
    parser.add_argument("--description", help="the record's description (default: the FP8 study's)")
    parser.add_argument("runs", nargs="+", help="pairs: an eval_study JSON, then its question set's name")
    args = parser.parse_args()
    if len(args.runs) % 2:
        parser.error("runs come in pairs: JSON, question set name")
    record = merge(list(zip(args.runs[::2], args.runs[1::2])), args.commit, args.description)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    for r in record["rows"]:
        print(r["question_set"], r["setting"], r["kv_bytes_vs_bf16"], r["needle_acc"], r["dense_acc"], round(r["kl"], 4))


if __name__ == "__main__":
    main()
