"""Quality per byte across question sets: merge ``eval_quality`` runs into one frontier record and plot.

Each run (its JSON) is one question set under one server configuration; ``--run FILE=NAME`` names the set
(e.g. ``essays seed 21``). A run's hierasparse servers may carry a K head map or a K channel order (its
``meta``); those settings are labelled ``+kheadmap`` / ``+korder`` so that presets stay apart. Every
setting of every run becomes a row ``{setting, kv_bytes_vs_bf16, needle_acc, dense_acc, question_set,
backend}`` (with KL, the share of answers equal to dense's and the accuracy per task) (bytes: the prefix's K+V against 16-bit dense, sink, window, 2:4 metadata and FP8 scales counted,
from the run's summary); ``pooled`` gives each setting's accuracy over the sets that ran it (question
weighted; KL: the mean over the sets) and the dense baseline over the same sets. ``--base RECORD`` starts from
an earlier frontier record's rows, so that question sets and settings run at another time join it without their
runs (a setting of a question set that the runs have again is taken from the runs).

    python -m sglang_hs.launch.quality_frontier --out launch/results/quality_frontier_smollm2_h200.json \\
        [--base EARLIER.json] --run q21.json="essays seed 21" --run q23.json="pydoc topics seed 23" ...
"""

from __future__ import annotations

import argparse
import json
import sys

from sglang_hs.plotting import pyplot


def preset_label(setting: str, meta: dict) -> str:
    """The setting's name, with the run's calibration files that change what it stores."""
    if setting.startswith("dense"):
        return setting
    extra = ("+kheadmap" if meta.get("k_head_map") else "") + (
        "+korder" if "k-channel-order" in meta.get("command", "") else "")
    return setting + extra


def frontier_rows(runs: list[tuple[dict, str]]) -> list[dict]:
    """One row per (setting, question set): runs of one set under other server configurations (a K head
    map, say) each have their dense baseline, which the first run of the set gives."""
    rows, seen = [], set()
    for run, question_set in runs:
        summary = {row["setting"]: row for row in run["summary"]}
        dense = summary["dense"]["accuracy"]
        for name, row in summary.items():
            label = preset_label(name, run["meta"])
            if (label, question_set) in seen:
                continue
            seen.add((label, question_set))
            rows.append({"setting": label, "kv_bytes_vs_bf16": row.get("kv_bytes_vs_bf16"),
                         "needle_acc": round(row["accuracy"], 4), "dense_acc": round(dense, 4),
                         "questions": row["questions"], "kl": row.get("kl"), "agree": row.get("agree"),
                         "by_task": {task: round(t["accuracy"], 4) for task, t in row.get("by_task", {}).items()},
                         "question_set": question_set,
                         "backend": run["meta"]["backend"]})  # fmt: skip
    return rows


def pooled(rows: list[dict]) -> list[dict]:
    """Per setting: question-weighted accuracy and bytes over its sets, and dense's over the same sets."""
    out = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == setting]
        n = sum(r["questions"] for r in mine)
        sets = {r["question_set"] for r in mine}
        out.append({
            "setting": setting, "question_sets": len(sets), "questions": n,
            "needle_acc": round(sum(r["needle_acc"] * r["questions"] for r in mine) / n, 4),
            "dense_acc": round(sum(r["dense_acc"] * r["questions"] for r in mine) / n, 4),
            "kv_bytes_vs_bf16": round(sum(r["kv_bytes_vs_bf16"] * r["questions"] for r in mine) / n, 4),
            "kl": round(sum(r["kl"] or 0.0 for r in mine) / len(mine), 5),
        })  # fmt: skip
        out[-1]["vs_dense_points"] = round(100 * (out[-1]["needle_acc"] - out[-1]["dense_acc"]), 1)
    return out


def plot(pool: list[dict], path: str, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in pool:
        ax.scatter(row["kv_bytes_vs_bf16"], row["needle_acc"], s=30)
        ax.annotate(row["setting"], (row["kv_bytes_vs_bf16"], row["needle_acc"]), fontsize=7,
                    xytext=(4, 2), textcoords="offset points")  # fmt: skip
    ax.set_xlabel("prefix KV bytes against bf16 (sink, window, metadata, scales)")
    ax.set_ylabel("needle accuracy, pooled over the question sets")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", default=[], metavar="FILE=NAME",
                        help="an eval_quality JSON and the name of its question set (repeat)")  # fmt: skip
    parser.add_argument("--out", required=True, help="the record's path (.json; the PNG beside it)")
    parser.add_argument("--base", metavar="RECORD", help="an earlier frontier record whose rows (and commands) this one "
                        "keeps; a setting of a question set in both is taken from the runs")  # fmt: skip
    parser.add_argument("--device", default="", help="the record's device field (default: the runs' own)")
    parser.add_argument("--commit", default="", help="the commit the runs ran at (the record's commit field)")
    args = parser.parse_args(argv)
    if not args.run and not args.base:
        print("quality_frontier: nothing to merge; give --run FILE=NAME (repeat) and/or --base RECORD", file=sys.stderr)
        return 2
    runs = []
    for item in args.run:
        path, sep, name = item.partition("=")
        if not sep or not name:
            print(f"quality_frontier: --run {item!r} is invalid; allowed: FILE=NAME", file=sys.stderr)
            return 2
        with open(path) as f:
            runs.append((json.load(f), name))
    rows = frontier_rows(runs)
    base = {"rows": [], "commands": [], "device": ""}
    if args.base:
        with open(args.base) as f:
            base = json.load(f)
    rerun = {(r["setting"], r["question_set"]) for r in rows}
    rows = [r for r in base["rows"] if (r["setting"], r["question_set"]) not in rerun] + rows
    missing = sorted({r["setting"] for r in rows if r["kv_bytes_vs_bf16"] is None})
    if missing:
        print(f"quality_frontier: runs without kv_bytes_vs_bf16 for {missing}; rerun or --report-only them "
              "with this version of eval_quality", file=sys.stderr)  # fmt: skip
        return 2
    pool = pooled(rows)
    devices = {str(run.get("device") or run["meta"].get("device") or "") for run, _ in runs}
    devices = sorted((devices | set(base["device"].split(", "))) - {""})
    commands = [c for r, _ in runs for c in (r["meta"].get("commands") or [r["meta"].get("command")])]
    record = {"description": "Quality per byte: every setting of every question set (rows) and pooled over the sets "
                             "(pooled); bytes are the prefix's K+V against 16-bit dense.",
              "device": args.device or ", ".join(devices), "commit": args.commit or base.get("commit", ""),
              "commands": base["commands"] + commands, "pooled": pool, "rows": rows}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    sets = len({r["question_set"] for r in rows})
    plot(pool, args.out.removesuffix(".json") + ".png", f"{sets} question sets, {len(pool)} settings")
    for row in pool:
        print(f"[frontier] {row['setting']}: bytes {row['kv_bytes_vs_bf16']:.3f}, needles {row['needle_acc']:.3f} "
              f"({row['vs_dense_points']:+.1f} against dense over {row['question_sets']} sets)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
