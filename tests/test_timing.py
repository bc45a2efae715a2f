"""The benchmarks' side-by-side timing rule, on the CPU (the timers replaced by recorders)."""

from __future__ import annotations

import os

from sglang_hs.kernels import timing


def test_ours_runs_beside_the_fastest_baseline_only(monkeypatch):
    """A slow baseline at full power lowers the clock for whatever shares its rounds, so ours must be
    timed beside the fastest baseline alone and the others after; every time lands under its name."""
    fa2, fa3, ours_a, ours_b = (lambda: None for _ in range(4))
    plain = {id(fa2): 700.0, id(fa3): 1900.0}
    rounds: list[list] = []

    def fake_timer(fns, iters=20):
        rounds.append(list(fns))
        return [{id(fa2): 705.0, id(fa3): 1950.0, id(ours_a): 410.0, id(ours_b): 420.0}[id(f)] for f in fns]

    monkeypatch.setattr(timing, "time_plain", lambda fn: plain[id(fn)])
    by_name, ours = timing.time_beside_fastest({"fa3": fa3, "fa2": fa2}, [ours_a, ours_b], timer=fake_timer)
    assert rounds == [[fa2, ours_a, ours_b], [fa3]]
    assert list(by_name) == ["fa3", "fa2"] and by_name == {"fa3": 1950.0, "fa2": 705.0}
    assert ours == [410.0, 420.0]


def test_one_baseline_needs_no_second_set_of_rounds(monkeypatch):
    base, ours = (lambda: None), (lambda: None)
    calls = []
    monkeypatch.setattr(timing, "time_plain", lambda fn: 1.0)
    timer = lambda fns, iters=20: calls.append(fns) or [2.0, 1.0]  # noqa: E731
    by_name, times = timing.time_beside_fastest({"fa2": base}, [ours], timer=timer)
    assert len(calls) == 1 and by_name == {"fa2": 2.0} and times == [1.0]


def test_records_are_named_by_the_device_that_ran_them():
    """The kernel benchmarks write kernels_h200.json on an H200 and kernels_h100.json on an H100, and by
    default merge into the committed record of that device."""
    from sglang_hs.kernels.bench_extend import results_json
    from sglang_hs.kernels.timing import device_tag

    assert device_tag("NVIDIA H200") == "h200" and device_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert results_json("h200").endswith("launch/results/kernels_h200.json")
    assert os.path.exists(results_json("h100")) and os.path.exists(results_json("h200"))


def test_alternated_stretches_settle_first_and_record_their_windows(monkeypatch):
    """Each timed stretch follows ``settle_ms`` of untimed calls of the same function (its own power state),
    and its wall-time span lands under that function, for the clock sampled beside it."""
    events = []
    monkeypatch.setattr(timing, "run_for", lambda fn, ms: events.append(("settle", fn, ms)))
    monkeypatch.setattr(timing, "time_stream", lambda fn, iters, reps, warmup: events.append(("time", fn)) or 5.0)
    a, b = (lambda: None), (lambda: None)
    windows: dict = {}
    assert timing.time_interleaved([a, b], iters=3, rounds=2, settle_ms=300.0, windows=windows) == [5.0, 5.0]
    assert events == [("settle", a, 300.0), ("time", a), ("settle", b, 300.0), ("time", b)] * 2
    assert set(windows) == {a, b} and all(len(w) == 2 and all(t0 <= t1 for t0, t1 in w) for w in windows.values())


def test_alternation_reports_each_rounds_time(monkeypatch):
    """``by_round`` gets every function's time in each round, in order, beside the medians."""
    monkeypatch.setattr(timing, "run_for", lambda fn, ms: None)
    times = iter([4.0, 8.0, 6.0, 9.0, 5.0, 7.0])  # rounds of (a, b)
    monkeypatch.setattr(timing, "time_stream", lambda fn, iters, reps, warmup: next(times))
    a, b = (lambda: None), (lambda: None)
    by_round: dict = {}
    assert timing.time_interleaved([a, b], iters=3, rounds=3, by_round=by_round) == [5.0, 8.0]
    assert by_round == {a: [4.0, 6.0, 5.0], b: [8.0, 9.0, 7.0]}


def test_clock_sampler_means_samples_inside_windows():
    """A stretch's clock is the mean of the samples taken inside its spans; none inside, or no NVML: None."""
    sampler = timing.ClockSampler.__new__(timing.ClockSampler)
    sampler.samples = [(1.0, 1500, 600.0), (2.0, 1980, 400.0), (3.0, 1800, 650.0)]
    assert sampler.mean([(0.5, 1.5), (2.5, 3.5)]) == (1650, 625)
    assert sampler.mean_mhz([(1.9, 2.1)]) == 1980
    assert sampler.mean([(4.0, 5.0)]) == (None, None) and sampler.mean_mhz(None) is None
