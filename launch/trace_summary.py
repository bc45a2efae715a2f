"""What a server's decode steps spend their time on, from a PyTorch profiler trace of the server.

    python3 -m sglang_hs.launch.trace_summary TRACE.json.gz [--top 15]

``bench_prefix --profile-steps N`` asks the server for such a trace (SGLang's ``/start_profile``, CPU
and GPU activity) in the middle of a load and stores this summary in the record. It answers the
question the kernel timings alone cannot: where a step's time goes when the kernels are fast.

- ``graph_steps``: one entry per decode step's CUDA-graph launch (the launches of forwards that made
  exactly one), from the kernels that carry the launch's correlation id: ``gpu_us`` (their summed
  time), ``span_us`` (first start to last end) and ``period_us`` (launch to next launch, the step's
  wall time). Medians over the steps are reported; ``period - span`` is time the GPU waited on the
  host or ran other work between steps.
- ``graph_kernels_per_step``: the graph steps' GPU time and launches per kernel name, per step;
  ``prefill_kernels_per_forward`` the same for the other forwards (eager and breakable: prefills and
  extends), per forward. The project's TileLang kernels are named by role (``hs_decode`` the
  per-request decode, ``hs_decode_floor`` the shared-prefix decode's own pass, ``hs_extend_shared``
  its shared pass, ``hs_extend``, ``hs_pack``, ``hs_loss``; traces of code before commit 4112877
  show ``hs_decode_ss`` / ``_ds`` for the shared pass, on the decode kernel then).
- ``kernels``: GPU time per kernel name (all activity in the window, graph or not), the largest first.
- ``runtime``: CUDA runtime calls by name, count and host time; a long ``cudaStreamSynchronize`` or
  device-to-host ``cudaMemcpyAsync`` is a host wait that stops the scheduler from running ahead.
- ``forwards``: forward passes (SGLang's ``scheduler.run_batch`` annotation) by kind, ``eager`` (no
  graph launch: prefills without prefill graphs), ``one_graph`` (decode steps) and ``breakable``
  (SGLang's breakable prefill graphs, one launch per captured segment): count, GPU span against the
  kernels' time (p50 and total). A span well above the kernel time is a forward the host could not
  launch fast enough.
- ``gpu_busy_share``: the union of GPU activity over the window; ``gaps_over_100us``: idle gaps.
- ``host_waits`` (traces taken with Python stacks, ``bench_prefix --profile-stacks``): the host calls
  that waited on the GPU (``cudaStreamSynchronize``, ``cudaMemcpyAsync``, ``cudaEventSynchronize``,
  ``cudaDeviceSynchronize`` over :data:`WAIT_MIN_US`) by the innermost Python frame of this project
  around them (else of SGLang, else any): total wait, count. A wait in a forward pass lets the GPU run
  dry while the host catches up.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
from collections import defaultdict

_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")
_WAIT_CALLS = ("cudaStreamSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize", "cudaDeviceSynchronize")
WAIT_MIN_US = 20.0
"""Host calls shorter than this are not counted as waits (a copy that did not wait takes a few us)."""
_PROJECT_FRAMES = ("sglang_hs", "hierasparse", "/radix/", "/kernels/", "/launch/")


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


class _Tally:
    """Time and count per name; :meth:`largest` lists the names with the most time."""

    def __init__(self):
        self.by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])

    def add(self, name: str, us: float) -> None:
        entry = self.by_name[name]
        entry[0] += us
        entry[1] += 1

    def largest(self, top: int) -> list[tuple[str, float, int]]:
        return [(name, t, int(n)) for name, (t, n) in sorted(self.by_name.items(), key=lambda kv: -kv[1][0])[:top]]

    def totals(self, top: int) -> list[dict]:
        return [{"name": name, "total_us": round(t, 1), "count": n} for name, t, n in self.largest(top)]

    def per(self, units: int, top: int) -> list[dict]:
        """Time and count per unit (decode step, prefill forward)."""
        return [{"name": name, "us": round(t / units, 1), "count": round(n / units, 2)}
                for name, t, n in self.largest(top)]  # fmt: skip


def host_waits(events: list[dict], top: int = 15) -> list[dict]:
    """``host_waits`` of the module docstring: each waiting runtime call attributed to its innermost
    enclosing Python frame of the project (else SGLang's, else any), by a sweep over each thread's
    nested ``python_function`` events."""
    by_thread: dict[tuple, list[tuple[float, float, int, str]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        start, dur = float(e["ts"]), float(e.get("dur", 0))
        if e.get("cat") == "python_function":
            by_thread[(e.get("pid"), e.get("tid"))].append((start, start + dur, 0, e.get("name", "?")))
        elif e.get("cat") in _RUNTIME_CATEGORIES and e.get("name") in _WAIT_CALLS and dur >= WAIT_MIN_US:
            by_thread[(e.get("pid"), e.get("tid"))].append((start, start + dur, 1, e["name"]))
    waits = _Tally()
    for items in by_thread.values():
        stack: list[tuple[float, str]] = []  # open frames: (end, name)
        for start, end, is_wait, name in sorted(items, key=lambda it: (it[0], -it[1])):  # outer frames first
            while stack and stack[-1][0] <= start:
                stack.pop()
            if not is_wait:
                stack.append((end, name))
                continue
            frames = [frame for _, frame in reversed(stack)]
            caller = next((f for f in frames if any(p in f for p in _PROJECT_FRAMES)),
                          next((f for f in frames if "sglang" in f), frames[0] if frames else "(no Python frame)"))
            waits.add(f"{caller} [{name}]", end - start)
    return [{"caller": caller, "us": round(t, 1), "count": n} for caller, t, n in waits.largest(top)]


def summarize(events: list[dict], top: int = 15) -> dict:
    """The summary described in the module docstring, from a Chrome trace's ``traceEvents``."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in _GPU_CATEGORIES]
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") in _RUNTIME_CATEGORIES]
    if not gpu:
        return {"gpu_events": 0}
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu]
    window = max(end for _, end in intervals) - min(start for start, _ in intervals)
    busy = _union(intervals)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:]) if b[0] - a[1] > 100]

    by_kernel, by_call = _Tally(), _Tally()
    for e in gpu:
        by_kernel.add(e.get("name", "?")[:100], float(e.get("dur", 0)))
    for e in runtime:
        by_call.add(e.get("name", "?"), float(e.get("dur", 0)))

    # A graph launch's kernels carry its correlation id.
    by_correlation: dict[int, list[tuple[float, float]]] = defaultdict(list)
    names_by_correlation: dict[int, list[str]] = defaultdict(list)
    for e, interval in zip(gpu, intervals):
        correlation = (e.get("args") or {}).get("correlation")
        if correlation is not None:
            by_correlation[correlation].append(interval)
            names_by_correlation[correlation].append(e.get("name", "?")[:100])
    launches = sorted((float(e["ts"]), (e.get("args") or {}).get("correlation"))
                      for e in runtime if e.get("name") == "cudaGraphLaunch")  # fmt: skip
    graph_correlations = {correlation for _, correlation in launches}

    # Forward passes: SGLang marks each with a ``scheduler.run_batch`` annotation, projected onto the
    # GPU timeline; a forward is eager (no graph launch), one graph (a decode step) or breakable
    # (several: SGLang's breakable prefill graphs launch one per captured segment).
    order = sorted(range(len(gpu)), key=lambda i: intervals[i][0])
    starts = [intervals[i][0] for i in order]
    forwards: dict[str, list[tuple[float, float]]] = defaultdict(list)
    in_prefills = _Tally()  # eager and breakable forwards' kernels
    decode_graphs: set = set()
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "gpu_user_annotation" or e.get("name") != "scheduler.run_batch":
            continue
        t0, t1 = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        inside = [order[i] for i in range(bisect.bisect_left(starts, t0), bisect.bisect_right(starts, t1))]
        graphs = {(gpu[i].get("args") or {}).get("correlation") for i in inside} & graph_correlations
        kind = "eager" if not graphs else "one_graph" if len(graphs) == 1 else "breakable"
        decode_graphs |= graphs if kind == "one_graph" else set()
        forwards[kind].append((t1 - t0, sum(intervals[i][1] - intervals[i][0] for i in inside)))
        if kind != "one_graph":
            for i in inside:
                in_prefills.add(gpu[i].get("name", "?")[:100], intervals[i][1] - intervals[i][0])
    if forwards:  # graph steps: the one-graph forwards' launches (all launches without annotations)
        launches = [launch for launch in launches if launch[1] in decode_graphs]

    steps = []
    in_graphs = _Tally()
    for (ts, correlation), following in zip(launches, [*launches[1:], None]):
        kernels = by_correlation.get(correlation, [])
        if not kernels:
            continue
        for name, (start, end) in zip(names_by_correlation[correlation], kernels):
            in_graphs.add(name, end - start)
        steps.append({
            "gpu_us": sum(end - start for start, end in kernels),
            "span_us": max(end for _, end in kernels) - min(start for start, _ in kernels),
            "period_us": following[0] - ts if following else None,
        })  # fmt: skip
    periods = [s["period_us"] for s in steps if s["period_us"] is not None]
    prefills = max(1, sum(len(spans) for kind, spans in forwards.items() if kind != "one_graph"))
    return {
        "gpu_events": len(gpu),
        "window_ms": round(window / 1000, 2),
        "gpu_busy_share": round(sum(e - s for s, e in busy) / window, 3) if window else None,
        "gaps_over_100us": len(gaps),
        "gap_ms_over_100us": round(sum(gaps) / 1000, 2),
        "graph_steps": len(steps),
        "graph_step_gpu_us_p50": _median([s["gpu_us"] for s in steps]),
        "graph_step_span_us_p50": _median([s["span_us"] for s in steps]),
        "graph_step_period_us_p50": _median(periods),
        "forwards": {kind: {
            "count": len(spans),
            "span_us_p50": _median([span for span, _ in spans]),
            "kernel_us_p50": _median([busy for _, busy in spans]),
            "span_ms_total": round(sum(span for span, _ in spans) / 1000, 1),
            "kernel_ms_total": round(sum(busy for _, busy in spans) / 1000, 1),
        } for kind, spans in sorted(forwards.items())},  # fmt: skip
        "graph_kernels_per_step": in_graphs.per(len(steps) or 1, top),  # (no steps: nothing tallied)
        "prefill_kernels_per_forward": in_prefills.per(prefills, top),
        "kernels": by_kernel.totals(top),
        "runtime": by_call.totals(top),
        "host_waits": host_waits(events, top),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    print(json.dumps(summarize(load_events(args.trace), args.top), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
