"""The server-trace summary (``launch/trace_summary.py``) on a small synthetic Chrome trace."""

import gzip
import json

from sglang_hs.launch.trace_summary import load_events, main, summarize


def _kernel(name, ts, dur, correlation=None):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def _runtime(name, ts, dur, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def _trace():
    # Two graph launches (decode steps) 1000 us apart, each running two kernels of 300 us; between them
    # an eager kernel of 50 us and a host wait; a CPU op that must not count as GPU activity.
    events = [
        _runtime("cudaGraphLaunch", 0, 10, 1), _kernel("attn", 20, 300, 1), _kernel("mlp", 320, 300, 1),
        _runtime("cudaLaunchKernel", 700, 5, 2), _kernel("plan", 710, 50, 2),
        _runtime("cudaStreamSynchronize", 800, 150, 3),
        _runtime("cudaGraphLaunch", 1000, 10, 4), _kernel("attn", 1020, 300, 4), _kernel("mlp", 1320, 300, 4),
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 5, "dur": 5000},
        # forward annotations: the first graph step's, and an eager forward around the plan kernel
        {"ph": "X", "cat": "gpu_user_annotation", "name": "scheduler.run_batch", "ts": 20, "dur": 600},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "scheduler.run_batch", "ts": 700, "dur": 200},
    ]  # fmt: skip
    return events


def test_summary_of_graph_steps_kernels_and_host_calls():
    s = summarize(_trace())
    assert s["gpu_events"] == 5 and s["window_ms"] == 1.6
    # Only the first graph launch lies in an annotated forward: it is the one decode step.
    assert s["graph_steps"] == 1
    assert s["graph_step_gpu_us_p50"] == 600 and s["graph_step_span_us_p50"] == 600
    assert s["graph_step_period_us_p50"] is None  # one step: no next launch among the steps
    assert s["gpu_busy_share"] == round(1250 / 1600, 3)
    assert s["gaps_over_100us"] == 1 and s["gap_ms_over_100us"] == 0.26  # 620-710 is 90 us: not counted
    assert s["forwards"]["eager"]["count"] == 1 and s["forwards"]["eager"]["span_us_p50"] == 200
    assert s["forwards"]["eager"]["kernel_us_p50"] == 50
    assert s["forwards"]["one_graph"]["count"] == 1 and "breakable" not in s["forwards"]
    assert s["kernels"][0] == {"name": "attn", "total_us": 600.0, "count": 2}
    assert s["runtime"][0] == {"name": "cudaStreamSynchronize", "total_us": 150.0, "count": 1}
    assert summarize([]) == {"gpu_events": 0}


def test_reads_gzipped_trace_files(tmp_path, capsys):
    path = tmp_path / "x-TP-0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert len(load_events(str(path))) == 12
    assert main([str(path), "--top", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["kernels"]) == 1 and printed["graph_steps"] == 1


def test_breakable_prefill_graphs_are_not_decode_steps():
    """A forward that launches several graphs (SGLang's breakable prefill graphs, one per captured
    segment) is a prefill: its launches do not count as decode steps."""
    events = [
        _runtime("cudaGraphLaunch", 0, 5, 1), _kernel("gemm", 10, 100, 1),
        _runtime("cudaLaunchKernel", 120, 5, 2), _kernel("attn", 130, 50, 2),
        _runtime("cudaGraphLaunch", 190, 5, 3), _kernel("gemm", 200, 100, 3),
        {"ph": "X", "cat": "gpu_user_annotation", "name": "scheduler.run_batch", "ts": 10, "dur": 290},
        _runtime("cudaGraphLaunch", 400, 5, 4), _kernel("decode", 410, 300, 4),
        {"ph": "X", "cat": "gpu_user_annotation", "name": "scheduler.run_batch", "ts": 410, "dur": 300},
    ]  # fmt: skip
    s = summarize(events)
    assert s["forwards"]["breakable"] == {"count": 1, "span_us_p50": 290, "kernel_us_p50": 250, "span_ms_total": 0.3,
                                          "kernel_ms_total": 0.2}  # fmt: skip
    assert s["graph_steps"] == 1 and s["graph_step_gpu_us_p50"] == 300
    # The prefill's kernels, per prefill forward (the decode step's are not among them).
    assert s["prefill_kernels_per_forward"] == [{"name": "gemm", "us": 200.0, "count": 2.0},
                                                {"name": "attn", "us": 50.0, "count": 1.0}]  # fmt: skip


def test_host_waits_go_to_the_innermost_project_frame():
    """With Python stacks in the trace, each waiting runtime call is charged to the innermost enclosing
    frame of this project (else SGLang's); short calls are not waits."""
    def frame(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}

    def call(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid,
                "args": {"correlation": ts}}

    events = [
        frame("sglang/srt/managers/scheduler.py(10): run_batch", 0, 1000),
        frame("sglang_hs/backend.py(277): _compressed_metadata", 100, 300),
        frame("torch/_tensor.py(5): __bool__", 150, 200),
        call("cudaMemcpyAsync", 160, 150),  # in our metadata code, under torch's frame
        call("cudaMemcpyAsync", 450, 5),  # too short to be a wait
        frame("sglang/srt/mem_cache/allocator.py(20): free", 500, 300),
        call("cudaStreamSynchronize", 520, 100),
        call("cudaStreamSynchronize", 700, 70),
        call("cudaStreamSynchronize", 2000, 40, tid=2),  # no frame on that thread
        _kernel("k", 0, 10, 1),
    ]  # fmt: skip
    waits = summarize(events)["host_waits"]
    assert waits == [
        {"caller": "sglang/srt/mem_cache/allocator.py(20): free [cudaStreamSynchronize]", "us": 170.0, "count": 2},
        {"caller": "sglang_hs/backend.py(277): _compressed_metadata [cudaMemcpyAsync]", "us": 150.0, "count": 1},
        {"caller": "(no Python frame) [cudaStreamSynchronize]", "us": 40.0, "count": 1},
    ]
