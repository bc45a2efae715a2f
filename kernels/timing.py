"""CUDA timing of kernel calls for the benchmarks: graph replays, back-to-back eager calls, and
rounds that alternate between the functions compared (so drift reaches all of them alike)."""

import time

import torch


def device_tag(name: str) -> str:
    """The file-name tag of a GPU (``h200`` or ``h100``): records are named by the device that ran them."""
    return "h200" if "H200" in name else "h100"


def time_graph(fn, iters=20, reps=5):
    """Median time (us) of one call, from ``reps`` CUDA-graph replays of ``iters`` back-to-back calls."""
    return time_graphs([fn], iters, rounds=reps)[0]


def capture_graph(fn, iters=20, warmup=3) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``iters`` back-to-back calls of ``fn`` (after ``warmup`` eager calls), replayed once."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(iters):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    g.replay()
    torch.cuda.synchronize()
    return g


def time_graphs(fns, iters=20, rounds=7) -> list[float]:
    """Median times (us) of one call of each of ``fns``: a CUDA graph of ``iters`` calls each, replayed
    in turn for ``rounds`` rounds (side by side: drift and L2 state reach every function alike)."""
    graphs = [capture_graph(fn, iters) for fn in fns]
    times = [[] for _ in fns]
    for _ in range(rounds):
        for k, g in enumerate(graphs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times[k].append(a.elapsed_time(b) * 1000 / iters)
    return [sorted(t)[len(t) // 2] for t in times]


def time_stream(fn, iters=20, reps=5, warmup=2):
    """Median time (us) of one call, from CUDA events around ``iters`` back-to-back eager calls (the host
    runs ahead of the GPU when a call takes longer on the GPU than to launch)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / iters)
    times.sort()
    return times[len(times) // 2]


def run_for(fn, ms: float) -> None:
    """Call ``fn`` untimed for at least ``ms`` milliseconds of wall time (four calls between checks)."""
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()


def time_interleaved(fns, iters=20, rounds=7, settle_ms=0.0, windows: dict | None = None,
                     by_round: dict | None = None):
    """Median times (us) of one call of each of ``fns``, measured in turn: each round times ``iters``
    back-to-back eager calls of every function, one after the other, so that clock and thermal drift
    over the run reach all of them alike (a ratio of two such medians is side by side).

    ``settle_ms``: each timed stretch follows that long of untimed calls of the same function, so that it
    runs in that function's own power state. The GPU's power limiter lags by tens of ms: without it, a
    stretch runs partly at the clock the previous function left (``lab/power_settle.py`` measures it).
    ``windows``: if given, ``windows[fn]`` collects each timed stretch's wall-time span (for
    :class:`ClockSampler`). ``by_round``: if given, ``by_round[fn]`` gets each round's time in order (a
    ratio per round of two functions timed side by side shows how far the median ratio can be trusted)."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            run_for(fn, settle_ms)
            t0 = time.time()
            times[k].append(time_stream(fn, iters, reps=1, warmup=1))
            if windows is not None:
                windows.setdefault(fn, []).append((t0, time.time()))
    if by_round is not None:
        by_round.update((fn, list(t)) for fn, t in zip(fns, times))
    return [sorted(t)[len(t) // 2] for t in times]


class ClockSampler:
    """The GPU's SM clock (MHz) and board power (W) sampled through NVML every ~10 ms on a thread, to put
    a clock beside a timing: a kernel near the board's power cap runs at a lower clock, so a time ratio
    mixes per-clock speed with power. Without NVML (``pynvml``) it takes no samples and :meth:`mean`
    gives Nones."""

    def __init__(self, device_index: int = 0, period_s: float = 0.01):
        import threading

        self.samples: list[tuple[float, int, float]] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self._read = lambda: (pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                                  pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)  # fmt: skip
            self._read()
        except Exception:  # noqa: BLE001 (no NVML: timings go without clocks)
            return

        def sample():
            while not self._stop.is_set():
                self.samples.append((time.time(), *self._read()))
                time.sleep(period_s)

        threading.Thread(target=sample, daemon=True).start()

    def mean(self, windows) -> tuple[int | None, int | None]:
        """Mean (SM MHz, W) of the samples inside any of ``windows`` [(t0, t1)], or Nones."""
        got = [(mhz, w) for t, mhz, w in self.samples if any(a <= t <= b for a, b in windows or ())]
        if not got:
            return None, None
        return round(sum(m for m, _ in got) / len(got)), round(sum(w for _, w in got) / len(got))

    def mean_mhz(self, windows) -> int | None:
        return self.mean(windows)[0]

    def stop(self) -> None:
        self._stop.set()


def time_plain(fn, iters=30, warmup=5):
    """Median time (us) of single launches timed with CUDA events."""
    return time_stream(fn, iters=1, reps=iters, warmup=warmup)


def time_beside_fastest(baselines: dict, fns: list, iters=20, timer=time_graphs) -> tuple[dict, list[float]]:
    """Times (us) of the dense ``baselines`` (name -> run()) and of ``fns``, each of ``fns`` in rounds
    beside only the fastest baseline (picked from single launches), the other baselines after them.

    Why not every baseline in one set of rounds: a slow baseline at full power lowers the SM clock for
    whatever runs in the rounds beside it. On the H100, FlashInfer's fa3 decode (1.9 ms, ~620 W) puts
    the GPU under its power cap (1620-1770 MHz instead of 1980), which made our S_K = S_V = 1 decode
    8% slower than beside fa2 alone; a server runs one backend and never sees that.
    ``timer``: :func:`time_graphs` (decode) or :func:`time_interleaved` (extend, prefill: eager rounds).
    Returns ``({name: us}, [us of each fn])``."""
    fastest = min(baselines, key=lambda b: time_plain(baselines[b]))
    fastest_us, *times = timer([baselines[fastest], *fns], iters)
    others = [b for b in baselines if b != fastest]
    by_name = dict(zip(others, timer([baselines[b] for b in others], iters))) if others else {}
    by_name[fastest] = fastest_us
    return {b: by_name[b] for b in baselines}, times
