"""Where a kernel's warps wait, from Nsight Compute's source page: stall samples by reason and the SASS
instructions that hold the most of them.

    ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:hs_decode --section SourceCounters \
        --section WarpStateStats -o dec python3 lab/profile_decode.py --sk 1 --sv 1 --plain
    ncu --import dec.ncu-rep --page source --csv --print-source sass > dec.csv
    python lab/ncu_hotspots.py dec.csv --top 24

The CSV has a title row (the kernel's name), a header row, then one row per SASS instruction with its
``Warp Stall Sampling (All Samples)``, ``Instructions Executed`` and one ``stall_<reason>`` column per
reason (``(Not Issued)`` columns are left out).
"""

from __future__ import annotations

import argparse
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else 0.0


def hotspots(rows: list[list[str]], top: int = 24) -> tuple[dict[str, float], list[dict]]:
    """``(share of all samples by reason, the top instructions)``; each instruction is a dict with its
    ``source``, ``share`` of all samples, ``executed`` count and its two largest ``reasons``."""
    header = next(row for row in rows if SAMPLES in row)
    data = rows[rows.index(header) + 1:]
    col = {name: header.index(name) for name in header}
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    total = sum(_number(row[col[SAMPLES]]) for row in data) or 1.0
    by_reason = {name[len("stall_"):]: sum(_number(row[col[name]]) for row in data) / total for name in reasons}
    ranked = sorted(data, key=lambda row: -_number(row[col[SAMPLES]]))[:top]
    top_rows = []
    for row in ranked:
        counts = sorted(((name[len("stall_"):], _number(row[col[name]])) for name in reasons), key=lambda x: -x[1])
        top_rows.append(dict(source=row[col["Source"]].strip(), share=_number(row[col[SAMPLES]]) / total,
                             executed=int(_number(row[col[EXECUTED]])), reasons=[n for n, c in counts[:2] if c > 0]))
    return dict(sorted(by_reason.items(), key=lambda x: -x[1])), top_rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=24)
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        by_reason, top_rows = hotspots(list(csv.reader(f)), args.top)
    print("samples by reason: " + ", ".join(f"{name} {share:.1%}" for name, share in by_reason.items() if share >= 0.005))
    for row in top_rows:
        print(f"{row['share']:6.1%} {row['executed']:10d}  {row['source'][:64]:64} {', '.join(row['reasons'])}")


if __name__ == "__main__":
    main()
