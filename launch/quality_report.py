"""Reports of the quality evaluation: per-setting summaries, the Markdown tables and checks, the figure,
and the merge of an evaluation run in parts."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

from sglang_hs.format import SAVING_PER_SPARSE_SIDE, compressed_fraction
from sglang_hs.launch.quality_inputs import (TASKS, MissingInput, PrefixGeometry, Question, Sample, Setting,
                                             score_answer, setting_from_name)  # fmt: skip
from sglang_hs.launch.server_check import explain
from sglang_hs.plotting import pyplot


def summarize(records: list[dict], settings: list[Setting], geometry: PrefixGeometry) -> list[dict]:
    """One row per setting: fidelity (token-weighted) and needle metrics, overall and per length."""
    rows = []
    for setting in settings:
        fid = [r for r in records if r["kind"] == "fidelity" and r["setting"] == setting.name]
        ndl = [r for r in records if r["kind"] == "needle" and r["setting"] == setting.name]
        row: dict[str, Any] = {"setting": setting.name, "pruner": setting.pruner, "sk": setting.sk, "sv": setting.sv,
                               "decode_mode": setting.mode,
                               "sk_setting": setting.sk, "sv_setting": setting.sv}  # fmt: skip
        row.update(_effective_sparsity(fid + ndl))
        share = next((r["k_head_share"] for r in fid + ndl if "k_head_share" in r), 1.0)
        if "bytes_saved" not in row and not setting.is_dense:  # server rows: from the setting (and K head map)
            row["sk"] = round(setting.sk * share, 4)
            row["bytes_saved"] = SAVING_PER_SPARSE_SIDE * (row["sk"] + setting.sv)
        if setting.store == "fp8_e4m3" and not setting.is_dense:  # of the compressed blocks, against 16 bits
            row["bytes_saved"] = 1 - compressed_fraction(row["sk"], row["sv"], elem_bytes=1, block_size=geometry.block)
        # Over the whole prefix, at the effective S_K / S_V where the records say what was stored (a K
        # head map stores fewer K rows 2:4 than the setting's S_K).
        prefix_lens = [r["prefix_tokens"] for r in fid + ndl]
        row["kv_saved"] = (
            0.0 if setting.is_dense or not prefix_lens
            else sum(geometry.kv_saving(n, row["sk"], row["sv"]) for n in prefix_lens) / len(prefix_lens)
        )  # fmt: skip
        # The prefix's K+V bytes against 16-bit dense, FP8 values and pages included (sink, window, tail
        # in the dense pool's dtype, 2:4 metadata and scales counted).
        if prefix_lens:
            row["kv_bytes_vs_bf16"] = round(sum(geometry.kv_bytes_fraction(n, setting, share) for n in prefix_lens)
                                            / len(prefix_lens), 4)  # fmt: skip
            if setting.store != "auto" or setting.kv != "auto":
                row["kv_saved"] = 1 - row["kv_bytes_vs_bf16"]
        row.update(_fidelity_summary(fid))
        row.update(_needle_summary(ndl))
        lengths = sorted({r["length"] for r in fid + ndl})
        row["by_length"] = {
            str(n): {**_fidelity_summary([r for r in fid if r["length"] == n]),
                     **_needle_summary([r for r in ndl if r["length"] == n])}
            for n in lengths
        }  # fmt: skip
        row["by_task"] = {t: _needle_summary([r for r in ndl if r["task"] == t]) for t in TASKS if any(r["task"] == t for r in ndl)}
        rows.append(row)
    return rows


def _effective_sparsity(records: list[dict]) -> dict:
    """Where the records say what was stored: the effective S_K / S_V (the fraction of compressible
    K / V block x head x layer rows stored sparse, over every prefix of the setting) in ``sk`` /
    ``sv``, and ``bytes_saved``, the fraction of the compressed blocks' K+V bytes saved."""
    blocks = sum(r.get("compressed_blocks", 0) for r in records)
    if not blocks:
        return {}
    sk = sum(r["sparse_k_blocks"] for r in records) / blocks
    sv = sum(r["sparse_v_blocks"] for r in records) / blocks
    return {"sk": round(sk, 4), "sv": round(sv, 4), "bytes_saved": SAVING_PER_SPARSE_SIDE * (sk + sv)}


def _fidelity_summary(fid: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in fid)
    if not tokens:
        return {}
    mean = lambda key: sum(r[key] * r["tokens"] for r in fid) / tokens  # noqa: E731
    return {"tokens": tokens, "kl": mean("kl"), "top1": mean("top1"), "ppl": math.exp(mean("nll"))}


def _needle_summary(ndl: list[dict]) -> dict:
    if not ndl:
        return {}
    inside = [r for r in ndl if r["in_compressed"]]
    return {
        "questions": len(ndl),
        "accuracy": sum(r["score"] for r in ndl) / len(ndl),
        "accuracy_compressed": sum(r["score"] for r in inside) / len(inside) if inside else float("nan"),
        "questions_compressed": len(inside),
        "agree": sum(r["agrees_with_dense"] for r in ndl) / len(ndl),
    }


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown_report(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# HieraSparse quality: {meta['model']} ({meta['backend']} backend)",
        "",
        f"Lengths {meta['lengths']}; tasks {meta['tasks']} with {meta['samples']} sample(s) each per length "
        f"({meta['questions']} questions per setting); fidelity: {meta['fidelity_windows']} window(s) per length, "
        f"{meta['fidelity_tokens']} scored tokens each ({meta['fidelity_tokens_total']} per setting). Block "
        f"{meta['block']}, sink {meta['sink']}, window {meta['window']} tokens; KV stored as {meta['kv_dtype']}. "
        f"Run time {meta['seconds'] / 60:.1f} min.",
        "",
        "| setting | S_K | S_V | effective S_K | bytes saved, compressed blocks | prefix KV saved | KL (nats/token) "
        "| top-1 agree | ppl | needle acc | acc, needles in compressed blocks | answer = dense |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pruner = r["pruner"] + (f" ({r['decode_mode']} decode)" if r.get("decode_mode", "full") != "full" else "")
        lines.append(
            f"| {pruner} | {_fmt(_nominal(r, 'sk'), 2)} | {_fmt(_nominal(r, 'sv'), 2)} | {_fmt(r['sk'])} | "
            f"{r.get('bytes_saved', 0.0):.1%} | {r['kv_saved']:.1%} | {_fmt(r.get('kl'), 4)} | "
            f"{_fmt(r.get('top1'))} | {_fmt(r.get('ppl'), 2)} | {_fmt(r.get('accuracy'))} | "
            f"{_fmt(r.get('accuracy_compressed'))} | {_fmt(r.get('agree'))} |"
        )
    lengths = sorted({n for r in rows for n in r["by_length"]}, key=int)
    lines += ["", "Per context length: KL (nats/token) / needle accuracy", "",
              "| setting | " + " | ".join(lengths) + " |", "|---|" + "---|" * len(lengths)]  # fmt: skip
    for r in rows:
        cells = [f"{_fmt(r['by_length'][n].get('kl'), 4)} / {_fmt(r['by_length'][n].get('accuracy'), 2)}" for n in lengths]
        lines.append(f"| {r['setting']} | " + " | ".join(cells) + " |")
    lines += ["", "Checks (computed from the rows above)", ""] + [f"- {c}" for c in checks(rows)]
    tasks = [t for t in TASKS if any(t in r["by_task"] for r in rows)]
    if tasks:
        lines += ["", "Per task: needle accuracy (answer = dense)", "",
                  "| setting | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]  # fmt: skip
        for r in rows:
            cells = [f"{_fmt(r['by_task'][t].get('accuracy'), 2)} ({_fmt(r['by_task'][t].get('agree'), 2)})" for t in tasks]
            lines.append(f"| {r['setting']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _nominal(row: dict, key: str) -> float:
    """The setting's S_K / S_V (``sk`` / ``sv`` hold the effective values; older runs have only those)."""
    return row.get(key + "_setting", row[key])


def checks(rows: list[dict]) -> list[str]:
    """One-line verdicts: the S=0 identity, the paper's V-vs-K direction, the pruners compared (rows of
    full decode only)."""
    rows = [r for r in rows if r.get("decode_mode", "full") == "full"]
    by = {(r["pruner"], _nominal(r, "sk"), _nominal(r, "sv")): r for r in rows}
    dense = by.get(("dense", 0.0, 0.0), {})
    out = []
    zero = by.get(("magnitude", 0.0, 0.0))
    if zero and zero.get("kl") is not None:
        exact = zero["kl"] == 0 and zero.get("top1", 1) == 1 and zero.get("agree", 1) == 1
        out.append(f"S_K=S_V=0 through the compressed path: KL {zero['kl']:.2g}, top-1 {zero.get('top1', 1):.3f}, "
                   f"answers equal to dense {zero.get('agree', 1):.3f}" + (" (identical to dense)" if exact else ""))  # fmt: skip
    for pruner in dict.fromkeys(r["pruner"] for r in rows if r["pruner"] != "dense"):
        v, k = by.get((pruner, 0.0, 1.0)), by.get((pruner, 1.0, 0.0))
        if not (v and k and v.get("kl") is not None and k.get("kl") is not None):
            continue
        agrees = v["kl"] < k["kl"]
        acc = ""
        if dense.get("accuracy") is not None and v.get("accuracy") is not None:
            acc = (f"; needle accuracy {dense['accuracy']:.2f} dense, {v['accuracy']:.2f} with S_V=1, "
                   f"{k['accuracy']:.2f} with S_K=1")  # fmt: skip
        out.append(f"{pruner}: S_V=1 costs KL {v['kl']:.4f}, S_K=1 costs {k['kl']:.4f} "
                   f"({k['kl'] / max(v['kl'], 1e-12):.1f}x){acc}: "
                   + ("pruning K hurts more, as in the paper" if agrees else "DISAGREES with the paper (V hurts more)"))  # fmt: skip
    pruners = [p for p in dict.fromkeys(r["pruner"] for r in rows) if p not in ("dense", "magnitude")]
    for pruner in pruners:
        pairs = [(by[("magnitude", sk, sv)], r) for (p, sk, sv), r in by.items()
                 if p == pruner and ("magnitude", sk, sv) in by and r.get("kl") is not None]  # fmt: skip
        if pairs:
            lower = sum(r["kl"] < m["kl"] for m, r in pairs)
            out.append(f"{pruner} vs magnitude at the same S_K/S_V: lower KL in {lower} of {len(pairs)} settings"
                       + (f"; needle accuracy {sum(r.get('accuracy', 0) for _, r in pairs) / len(pairs):.2f} vs "
                          f"{sum(m.get('accuracy', 0) for m, _ in pairs) / len(pairs):.2f} (mean over those settings)"
                          if pairs[0][0].get("accuracy") is not None else ""))  # fmt: skip
    return out


def plot(rows: list[dict], path: str, title: str) -> None:
    plt = pyplot()
    rows = [r for r in rows if r.get("decode_mode", "full") == "full"]  # decode modes: the tables only
    by = {(r["pruner"], _nominal(r, "sk"), _nominal(r, "sv")): r for r in rows}
    dense = by.get(("dense", 0.0, 0.0))
    pruners = [p for p in dict.fromkeys(r["pruner"] for r in rows) if p != "dense"]
    grid = sorted({_nominal(r, "sk") for r in rows} | {_nominal(r, "sv") for r in rows})
    lines = {"V only (S_K=0)": lambda s: (0.0, s), "K only (S_V=0)": lambda s: (s, 0.0), "K and V (S_K=S_V)": lambda s: (s, s)}
    colors = {"V only (S_K=0)": "tab:blue", "K only (S_V=0)": "tab:red", "K and V (S_K=S_V)": "tab:purple"}
    styles = ["-", "--", ":", "-."]
    metrics = [("kl", "KL(dense || sparse), nats/token"), ("top1", "top-1 agreement with dense"), ("accuracy", "needle accuracy")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for ax, (key, label) in zip(axes, metrics):
        for pi, pruner in enumerate(pruners):
            for line, coords in lines.items():
                xs, ys = [], []
                for s in grid:
                    sk, sv = coords(s)
                    row = by.get((pruner, sk, sv))
                    if row is None and s == 0:  # S=0 is the same for every pruner
                        row = by.get((pruners[0], 0.0, 0.0)) or dense
                    if row is not None and row.get(key) is not None:
                        xs.append(s)
                        ys.append(row[key])
                if xs:
                    ax.plot(xs, ys, styles[pi % len(styles)], marker="o", color=colors[line],
                            label=f"{line}, {pruner}")  # fmt: skip
        if dense is not None and dense.get(key) is not None and key != "kl":
            ax.axhline(dense[key], color="gray", lw=0.8, ls=":", label="dense")
        ax.set_xlabel("sparsity S (fraction of compressible blocks stored 2:4)")
        ax.set_title(label)
        ax.set_xticks(grid)
        if key == "kl":
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


READING_GUIDE = """
## How to read this

- **Settings.** `dense` is the unmodified model. `magnitude` is the paper's pruner (keep the 2 largest
  |x| of every 4, rank blocks by the L1 they lose). S_K / S_V is the fraction of *compressible* prefix blocks
  stored 2:4 sparse. The first 64 (sink) and the last 256 (window) prefix tokens always stay dense,
  so **prefix KV saved** (bytes saved over the whole prefix) grows with the context length: at 1K
  tokens only about 2/3 of the prefix is compressible, at 4K more than 90%.
- **`magnitude S_K=0 S_V=0`** runs the whole compressed path with no sparse block. On the reference
  backend its logits are asserted to equal the dense logits bit for bit (KL exactly 0, every answer
  equal): the harness itself adds no error.
- **KL (nats/token)** is the mean KL(dense ‖ sparse) of the next-token distributions on held-out
  essay text that follows the prefix; 0 means identical predictions. It is the sensitive signal:
  a few dozen questions give a coarse accuracy, but the distributions over thousands of tokens move
  measurably with every pruned block. **top-1 agree** is the share of positions whose most likely next token is unchanged;
  **ppl** is the sparse setting's perplexity on the same tokens (compare with the dense row).
- **needle acc** is the mean share of expected strings (the number, all four values, the three
  variable names) found in the greedy answer. **acc, needles in compressed blocks** counts only
  questions whose needles all lie in blocks that can be sparse (the others sit in the dense sink or
  window, where sparsity cannot touch them). **answer = dense** is the share of greedy answers
  identical to the dense answer, a task-independent signal.
- **Expected shape** (paper, Llama-3.1-8B, LongBench): pruning V costs almost nothing (S_V=1:
  -0.06 points), pruning K costs much more (S_K=1: -2 points), because an error in K shifts the
  logits inside the softmax's exponential while an error in V is averaged by the attention weights.
  The *Checks* list above states whether this run agrees (KL and accuracy of S_V=1 vs S_K=1).
- **Judge a setting on both KL and needle accuracy**: a method that minimizes the error the
  prefix's own last queries see lowers next-token KL on following text, while a needle that the end
  of the haystack never attends to looks cheap to it.
- **Small samples.** The CPU run uses a few haystacks per length: accuracy differences of one or two
  questions are noise; the KL and top-1 columns average thousands of tokens and are the numbers to
  compare. Rerun with more `--samples` / `--fidelity-windows`, or on the GPU machine with
  `--backend server`, for tighter estimates.
"""


# Meta fields that must agree for runs to be merged into one report.
MERGE_KEYS = ("model", "backend", "tasks", "samples", "fidelity_windows", "fidelity_tokens", "block", "sink", "window",
              "seed")  # fmt: skip


def merge_runs(runs: list[dict], names: list[str]) -> tuple[dict, list[Setting], list[dict]]:
    """One evaluation split over several processes (one per GPU, say, or one per context length),
    each with its own dense baseline: the settings in order of first appearance and, per (setting,
    length), the records of the first run that has them (so KL and agreement are against the dense
    baseline of that run). Runs may split the settings, the lengths or both, as long as every length
    ends up with the same settings. The meta says whether the dense baselines of runs that share a
    length gave the same answers and logprobs (they should: same model, same prompts, greedy)."""
    first = runs[0]["meta"]
    for name, run in zip(names[1:], runs[1:]):
        differ = [k for k in MERGE_KEYS if run["meta"].get(k) != first.get(k)]
        if differ:
            raise MissingInput(f"--merge: {name} differs from {names[0]} in {differ}; merge runs of one evaluation")
    settings: list[Setting] = []
    records: list[dict] = []
    covered: dict[int, set[str]] = {}
    for run in runs:
        taken = {(r["setting"], r["length"]) for r in records}
        settings += [setting_from_name(s["name"]) for s in run["settings"] if s["name"] not in {t.name for t in settings}]
        records += [r for r in run["records"] if (r["setting"], r["length"]) not in taken]
        for length in run["meta"]["lengths"]:
            covered.setdefault(length, set()).update(s["name"] for s in run["settings"])
    if len({frozenset(c) for c in covered.values()}) > 1:
        raise MissingInput(f"--merge: the runs cover different settings at different lengths ({covered}); "
                           "merge runs of one evaluation")  # fmt: skip

    def dense_view(run: dict, lengths: set[int]) -> list:
        return [(r["kind"], r["length"], r.get("output"), r.get("nll"), r.get("kl")) for r in run["records"]
                if r["setting"] == "dense" and r["length"] in lengths]  # fmt: skip

    identical = all(dense_view(run, shared) == dense_view(other, shared) for i, run in enumerate(runs)
                    for other in runs[i + 1 :] if (shared := set(run["meta"]["lengths"]) & set(other["meta"]["lengths"])))
    dense = [r for r in records if r["setting"] == "dense"]
    meta = {**first, "merged_from": names, "seconds": max(run["meta"]["seconds"] for run in runs),
            "lengths": sorted(covered), "questions": sum(r["kind"] == "needle" for r in dense),
            "fidelity_tokens_total": sum(r["tokens"] for r in dense if r["kind"] == "fidelity"),
            "dense_runs_identical": identical}  # fmt: skip
    if any(run["meta"].get("command") != first.get("command") for run in runs[1:]):
        meta["commands"] = [run["meta"].get("command") for run in runs]
    return meta, settings, records


def write_report(stem: str, meta: dict, rows: list[dict]) -> str:
    report = markdown_report(meta, rows)
    with open(stem + ".md", "w") as f:
        f.write(report + READING_GUIDE)
    plot(rows, stem + ".png", f"{meta['model']}, {meta['backend']} backend, lengths {meta['lengths']}")
    return report


def save_run(stem: str, meta: dict, settings: list[Setting], rows: list[dict], records: list[dict]) -> None:
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "settings": [dataclasses.asdict(s) | {"name": s.name} for s in settings],
                   "summary": rows, "records": records}, f, indent=1)  # fmt: skip
    report = write_report(stem, meta, rows)
    print(report, flush=True)
    print(f"[eval] wrote {stem}.json, .md, .png in {meta['seconds'] / 60:.1f} min", flush=True)


# ===================================================================================== progress and records
class Progress:
    """Console progress of an evaluation: done / total and the time left."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self.start = max(1, total), label, 0, time.time()

    def step(self, what: str, n: int = 1) -> None:
        self.done += n
        elapsed = time.time() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        print(f"[{self.label}] {self.done}/{self.total} {what} | {elapsed:.0f} s elapsed, ~{eta:.0f} s left", flush=True)


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


def compare_runs(a: dict, b: dict, tie_gap: float) -> dict:
    """Every needle question two runs (JSONs of ``eval_quality --backend server``) answer differently in a
    setting both ran, with :func:`~sglang_hs.launch.server_check.explain`'s account of where the answers
    part: a near tie (both runs hold both choices within ``tie_gap`` nats among their top two tokens) or
    not. Two paths computing the same attention (the kernels and PyTorch) should differ in near ties only."""
    def needles(run: dict) -> dict:
        return {(r["setting"], r["task"], r["length"], r["sample"], r["question"]): r
                for r in run["records"] if r["kind"] == "needle"}  # fmt: skip
    ours, theirs = needles(a), needles(b)
    differences = []
    for key in sorted(ours.keys() & theirs.keys()):
        x, y = ours[key], theirs[key]
        if x["output"] != y["output"]:
            why = explain(x.get("steps"), y.get("steps"), tie_gap)
            differences.append({"setting": key[0], "key": "/".join(map(str, key[1:])), "tie": why["near_tie"],
                                "scores": [x["score"], y["score"]],
                                "logprobs": {k: v for k, v in why.items() if k != "near_tie"}})  # fmt: skip
    return {"questions": len(ours.keys() & theirs.keys()), "tie_gap": tie_gap, "differences": differences,
            "unexplained": [f"{d['setting']} {d['key']}" for d in differences if not d["tie"]]}  # fmt: skip
