"""Shared-prefix serving benchmark: dense SGLang vs hierasparse at equal GPU memory.

    python -m sglang_hs.launch.bench_prefix --model-path DIR --load-format dummy \\
        --servers flashinfer,hicache,hs:1:1,hs:0:1,hs+hicache:0:1 --regimes 1,2,3 --context 8192 \\
        --hicache-size 40 --out launch/results/prefix_bench_llama8b_h100.json

Servers: ``flashinfer`` and ``triton`` (dense SGLang), ``flashinfer-fp8`` and ``triton-fp8`` (the same with
``--kv-cache-dtype fp8_e4m3``), ``hicache`` (flashinfer with SGLang's hierarchical cache), ``hs:SK:SV[:F]``
(hierasparse, store fraction F or ``auto``), ``hs-fp8:SK:SV[:F]`` (hierasparse over FP8 KV: an FP8 store,
SGLang's FP8 pages, the decode and extend kernels) and
``hs+hicache[:SK:SV[:F]]`` (hierasparse with ``--enable-hierarchical-cache``: compressed prefixes
on the host tier too; S_K/S_V default to the plugin's 0 and 1). ``--hicache-size`` gives both
hierarchical servers the same host memory (hierasparse splits it between SGLang's dense host pool
and its compressed host store, ``--hierasparse-host-store-fraction``); without it both use SGLang's
``--hicache-ratio`` default (2x the device KV budget).

For each server (started one after another on the same GPU with the same --mem-fraction-static):

1. **Capacity probe.** Distinct random prefixes of ``--context`` tokens are sent (one output token
   each) until twice the dense cache would hold them; then they are re-sent newest first until the
   first miss. The prefixes still fully cached, times the context, are the resident prefix tokens.
2. **Load.** For each regime SGLang's own ``python -m sglang.benchmark.serving --dataset-name
   generated-shared-prefix`` runs G groups of ``--prompts-per-group`` questions over a shared prefix,
   Poisson arrivals at ``--request-rate``, through ``--api`` (SGLang's native ``/generate``, or the
   OpenAI API: ``sglang-oai`` completions, ``sglang-oai-chat``). G is chosen from the dense server's
   KV capacity so that the working set (G × context) is 0.5× (regime 1: fits), 1.4× (regime 2:
   between 1× and 1.78×) or 2.5× (regime 3: beyond both) of it; a regime ``gN`` runs N groups
   (``gNxM``: N groups of M questions). A dense server (flashinfer, triton, or hicache, whose GPU pool
   is the dense one) must therefore run first, in this run or an earlier one whose records are in
   ``--out``, or ``--dense-capacity`` must be given. Prompt lengths are calibrated so that the server sees ``--context`` and
   ``--question-len`` tokens (bench_serving's random text re-encodes to more tokens than it asked
   for: about 1.5x with the random-weight models' tokenizers; ``prompt_tokens_mean`` records it).
3. **Flush check.** After its loads a server's cache is flushed (``/flush_cache``) and its metrics
   read again: a hierasparse store must be empty then. SGLang checks its pools' accounting every
   time the scheduler goes idle (the plugin adds the compressed store to that check) and stops the
   server on a mismatch, so a server that is still healthy here lost no KV slot.

Per server and load a record is written (throughput, TTFT/TPOT p50/p99, request errors, the
radix-cache hit rate from the server's prefill log lines and the per-request cached tokens, the
decode log lines' CUDA-graph share and generation rate at the most running requests, the
compressed-cache gauges of ``/metrics``, resident prefix tokens, the KV budget, the flush check) to
``--out`` (JSON), with PNG plots beside it. Servers are always stopped, also on Ctrl-C and on errors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from sglang_hs.config import HieraSparseConfig
from sglang_hs.format import compressed_fraction
from sglang_hs.launch.server import SGLangServer, ServerStartError, device_name, http_json
from sglang_hs.launch.trace_summary import load_events, summarize
from sglang_hs.plotting import pyplot

REGIME_WORKING_SET = {1: 0.5, 2: 1.4, 3: 2.5}
DENSE_SERVERS = ("flashinfer", "triton")  # plain SGLang servers: their KV capacity sizes the regimes
FP8_DENSE_SERVERS = ("flashinfer-fp8", "triton-fp8")  # the same over SGLang's FP8 pages
CAPACITY_SERVERS = (*DENSE_SERVERS, "hicache")  # 16-bit GPU pools: the regimes' unit
BASELINES = (*CAPACITY_SERVERS, *FP8_DENSE_SERVERS)  # what hierasparse records are compared with
FP8_FLAGS = ["--kv-cache-dtype", "fp8_e4m3"]
MAX_STORE_FRACTION = 0.95
_PREFILL_LINE = re.compile(r"Prefill batch.*?#new-token: (\d+), #cached-token: (\d+)")
_DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+),.*?cuda graph: (True|False), "
                          r"gen throughput \(token/s\): ([0-9.]+)")
_GROUPED_LINE = re.compile(r"hs shared-decode grouped: ([0-9.]+)")
_RETRACT_LINE = "KV cache pool is full. Retract requests."  # SGLang's scheduler, when decode runs out of pages
_STORE_LINE = re.compile(r"hierasparse: KV budget ([0-9.]+) GiB")
_METRIC_LINE = re.compile(r"^(sglang:\w+)(?:\{[^}]*\})? ([-+0-9.eEinfINFaN]+)$", re.MULTILINE)
APIS = ("sglang", "sglang-oai", "sglang-oai-chat")


@dataclass
class ServerSpec:
    label: str
    backend: str
    args: list[str]
    sk: float | None = None
    sv: float | None = None
    store_fraction: float | str | None = None
    hicache: bool = False
    """Runs SGLang's hierarchical cache (a host tier): gets --hicache-size."""
    k_head_share: float = 1.0
    """With ``--k-head-map``: the share of (layer, KV head) pairs whose K a K-sparse block stores 2:4."""
    fp8: bool = False
    """FP8 KV: SGLang's FP8 pages (and, for hierasparse, FP8 store values)."""

    @property
    def effective_sk(self) -> float | None:
        """The fraction of compressible K rows stored 2:4 (S_K on the K head map's share)."""
        return None if self.sk is None else self.sk * self.k_head_share

    @classmethod
    def parse(cls, text: str, store_fraction: float) -> "ServerSpec":
        if text in DENSE_SERVERS:
            return cls(text, text, ["--attention-backend", text])
        if text in FP8_DENSE_SERVERS:
            backend = text.removesuffix("-fp8")
            return cls(text, backend, ["--attention-backend", backend, *FP8_FLAGS], fp8=True)
        if text == "hicache":
            return cls("hicache", "flashinfer+hicache", ["--attention-backend", "flashinfer",
                                                         "--enable-hierarchical-cache", "--page-size", "64"],
                       hicache=True)  # fmt: skip
        hicache = text.startswith("hs+hicache")
        pattern = r"hs\+hicache(?::([0-9.]+):([0-9.]+)(?::([0-9.]+|auto))?)?" if hicache else (
            r"hs(?:-fp8)?:([0-9.]+):([0-9.]+)(?::([0-9.]+|auto))?")  # fmt: skip
        match = re.fullmatch(pattern, text)
        if not match:
            raise SystemExit(f"error: --servers entry {text!r}; allowed: flashinfer, triton, flashinfer-fp8, triton-fp8, "
                             "hicache, hs:SK:SV[:F], hs-fp8:SK:SV[:F], hs+hicache[:SK:SV[:F]] (F: this server's store "
                             "fraction, or auto)")  # fmt: skip
        defaults = HieraSparseConfig()
        sk = float(match.group(1)) if match.group(1) else defaults.sk_prefill
        sv = float(match.group(2)) if match.group(2) else defaults.sv_prefill
        args = ["--attention-backend", "hierasparse"] + (["--enable-hierarchical-cache"] if hicache else [])
        for phase in ("prefill", "decode"):
            args += [f"--hierasparse-sk-{phase}={sk}", f"--hierasparse-sv-{phase}={sv}"]
        fp8 = text.startswith("hs-fp8")
        if fp8:  # the kernels that read FP8 KV (the compressor is PyTorch's)
            args += ["--hierasparse-store-dtype=fp8_e4m3", *FP8_FLAGS, "--hierasparse-kernels=decode,extend"]
        spec = cls(text, "hierasparse", args, sk, sv, hicache=hicache, fp8=fp8)
        spec.store_fraction = match.group(3) or store_fraction
        return spec

    def server_args(self, dense_capacity: int | None, context: int, head_dim: int) -> list[str]:
        """The launch flags; an ``auto`` store fraction is sized for prefixes of ``context`` tokens."""
        if self.backend != "hierasparse":
            return self.args
        fraction = self.store_fraction
        if fraction == "auto":
            if not dense_capacity:
                raise SystemExit("error: hs:SK:SV:auto needs the dense capacity: run a dense server first")
            fraction, prefixes = auto_store_fraction(dense_capacity, context, self.effective_sk, self.sv, head_dim,
                                                     fp8=self.fp8)  # fmt: skip
            print(f"[bench] {self.label}: store fraction {fraction:.4f} (room for {prefixes} prefixes of {context} "
                  f"tokens; dense holds {dense_capacity // context})", flush=True)
        self.store_fraction = float(fraction)
        return [*self.args, f"--hierasparse-store-fraction={self.store_fraction}"]


def apply_k_head_map(specs: list[ServerSpec], path: str) -> None:
    """Give every hierasparse server ``--hierasparse-k-head-map path`` and the map's share (one-line
    exit if the file is not a K head map)."""
    from sglang_hs.k_head_map import KHeadMap

    try:
        share = KHeadMap.load(path).share
    except ValueError as exc:
        raise SystemExit(f"error: --k-head-map: {exc}") from None
    for spec in specs:
        if spec.backend == "hierasparse":
            spec.args = [*spec.args, f"--hierasparse-k-head-map={os.path.abspath(path)}"]
            spec.k_head_share = share


def auto_store_fraction(
    dense_tokens: int, context: int, sk: float, sv: float, head_dim: int = 128,
    sink: int = HieraSparseConfig.sink_tokens, window: int = HieraSparseConfig.window_tokens,
    block: int = HieraSparseConfig.block_size, fp8: bool = False,
) -> tuple[float, int]:  # fmt: skip
    """The store fraction that holds the most cached prefixes of ``context`` tokens at this KV budget
    (``dense_tokens``: what it holds as 16-bit pages).

    A cached prefix keeps its sink and its last ``window`` tokens in SGLang's dense pool and the
    blocks between them in the store, which costs ``ratio`` 16-bit-token equivalents per token (``fp8``:
    FP8 values and scales in the store, and FP8 pages at half a 16-bit token each). The dense pool also
    needs room for one prompt being prefilled (``context`` tokens and one output page) before its blocks
    are compressed. Returns the fraction and the prefixes it has room for.
    """
    compressed = max(0, (context - window) // block - sink // block) * block
    ratio = compressed_fraction(sk, sv, 1 if fp8 else 2, block, head_dim)  # stored bytes per 16-bit byte of K and V
    page = 0.5 if fp8 else 1.0  # a dense token's bytes against a 16-bit one's
    reserve = (context + block) * page
    prefixes = int((dense_tokens - reserve) // ((context - compressed) * page + compressed * ratio))
    store_tokens = prefixes * compressed * ratio + block  # one block of slack for rounding
    if store_tokens > MAX_STORE_FRACTION * dense_tokens:  # the dense pool keeps a twentieth at least
        prefixes = int((MAX_STORE_FRACTION * dense_tokens - block) // (compressed * ratio))
        return MAX_STORE_FRACTION, prefixes
    return store_tokens / dense_tokens, prefixes


def random_prompt_ids(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(length)]


def calibrated_prompt_lens(tokenizer_path: str, *tokens: int, sample: int = 2048) -> list[int]:
    """The token counts to ask bench_serving for so that the server sees about ``tokens`` tokens.

    bench_serving builds an N-token prompt by decoding N random token ids; the server encodes that
    text again (so does bench_serving's own count), which can give many more tokens: the
    random-weight models' tokenizers give about 1.5x. The expansion is measured once, with
    bench_serving's own prompt generator on the model's tokenizer.
    """
    from sglang.benchmark.datasets.common import gen_prompt
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    state = random.getstate()
    random.seed(0)
    encoded = len(tokenizer.encode(gen_prompt(tokenizer, sample), add_special_tokens=False))
    random.setstate(state)
    return [max(1, round(n * sample / encoded)) for n in tokens]


def probe_capacity(server: SGLangServer, context: int, count: int, vocab: int) -> int:
    """Resident prefix tokens after filling the cache with ``count`` distinct prefixes."""
    rng = random.Random(1234)
    prefixes = [random_prompt_ids(rng, context, vocab) for _ in range(count)]
    params = {"max_new_tokens": 1, "temperature": 0}
    for i, ids in enumerate(prefixes):
        server.post("/generate", {"input_ids": ids, "sampling_params": params})
        if (i + 1) % 20 == 0:
            print(f"[bench] capacity probe: filled {i + 1}/{count} prefixes", flush=True)
    resident = 0
    for ids in reversed(prefixes):
        answer = server.post("/generate", {"input_ids": ids, "sampling_params": params})
        cached = answer["meta_info"].get("cached_tokens", 0)
        if cached < context - 64:  # a page-aligned full hit leaves at most one page uncached
            break
        resident += context
    return resident


def hit_rate(log_text: str) -> float:
    new = cached = 0
    for match in _PREFILL_LINE.finditer(log_text):
        new += int(match.group(1))
        cached += int(match.group(2))
    return cached / (new + cached) if new + cached else 0.0


def decode_log_stats(log_text: str) -> dict:
    """From SGLang's decode log lines (one every ``--decode-log-interval`` steps): how many there are,
    the share that ran in a CUDA graph, the most running requests, and the median generation rate of the
    lines at that many. The rate is tokens over the wall time since the previous line, prefill batches
    in between included; against TPOT it tells whether a slow decode comes from the decode steps or
    from what runs between them. Also the mean running requests over the lines and how often the
    scheduler retracted decoding requests for want of KV pages (each one re-prefills later)."""
    lines = [(int(m.group(1)), m.group(2) == "True", float(m.group(3))) for m in _DECODE_LINE.finditer(log_text)]
    if not lines:
        return {"decode_log_lines": 0}
    top = max(running for running, _, _ in lines)
    rates = sorted(rate for running, _, rate in lines if running == top)
    grouped = _GROUPED_LINE.findall(log_text)  # shared-prefix decode: a share since the server started
    return {"decode_log_lines": len(lines), "decode_cuda_graph_share": sum(g for _, g, _ in lines) / len(lines),
            "decode_max_running": top, "decode_tok_s_p50_at_max_running": rates[len(rates) // 2],
            "decode_running_mean": sum(running for running, _, _ in lines) / len(lines),
            "shared_decode_grouped": float(grouped[-1]) if grouped else None,
            "retractions": log_text.count(_RETRACT_LINE)}


def start_profile(server: SGLangServer, trace_dir: str, steps: int, delay: float = 0.0, log_start: int = 0,
                  stop: threading.Event | None = None, stacks: bool = False) -> None:  # fmt: skip
    """Ask the server for a PyTorch profiler trace (CPU and GPU activity) of its next ``steps`` forward
    passes, written to ``trace_dir`` (SGLang's ``/start_profile``), ``delay`` seconds after the load's
    first prefill (its first ``Prefill batch`` log line after ``log_start``: bench_serving spends tens
    of seconds building long prompts before it sends any). ``stop`` set: give up. ``stacks``: with
    Python stacks (the summary's ``host_waits``; the host runs slower while they are recorded)."""
    stop = stop or threading.Event()
    while not stop.is_set() and not _PREFILL_LINE.search(server.log_text(), log_start):
        stop.wait(0.5)
    if stop.wait(delay):
        return
    try:
        server.post("/start_profile", {"output_dir": trace_dir, "num_steps": steps, "activities": ["CPU", "GPU"],
                                        "with_stack": stacks, "record_shapes": False})
    except Exception as exc:  # the load goes on; the record says no trace came
        print(f"[bench] /start_profile failed: {exc}", flush=True)


def profile_summary(trace_dir: str, wait_s: float = 120) -> dict | None:
    """:func:`sglang_hs.launch.trace_summary.summarize` of the trace the server wrote to ``trace_dir``
    (waits for the export), with its path; ``None`` if none came."""
    deadline = time.time() + wait_s
    while time.time() < deadline:
        traces = sorted(f for f in os.listdir(trace_dir) if f.endswith(".trace.json.gz")) if os.path.isdir(trace_dir) else []
        if traces:
            time.sleep(2)  # the export writes the file in one go; let it finish
            path = os.path.join(trace_dir, traces[0])
            return {"trace": path, **summarize(load_events(path))}
        time.sleep(2)
    return None


def kv_budget_gib(log_text: str, kv_tokens: int, model_config: dict, tp_size: int = 1, elem_bytes: int = 2) -> float:
    """KV memory of a server, over all its GPUs: hierasparse logs each rank's budget (dense pool +
    store); a dense server's is its token capacity (per rank, each rank holding its share of the KV
    heads) times the bytes of one token's K and V in every layer and head (``elem_bytes`` a value)."""
    match = _STORE_LINE.search(log_text)
    if match:
        return float(match.group(1)) * tp_size
    heads = model_config.get("num_key_value_heads", model_config["num_attention_heads"])
    return kv_tokens * 2 * model_config["num_hidden_layers"] * heads * model_head_dim(model_config) * elem_bytes / 2**30


def model_head_dim(model_config: dict) -> int:
    return model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"]


def parse_metrics(text: str) -> dict[str, float]:
    """``sglang:*`` values of a Prometheus text page (one label set per name here: the last wins)."""
    return {name: float(value) for name, value in _METRIC_LINE.findall(text)}


def read_metrics(base_url: str) -> dict[str, float]:
    """A server's ``sglang:*`` metrics now (it runs with ``--enable-metrics``)."""
    return parse_metrics(http_json(base_url + "/metrics", method="GET"))


def metrics_fields(metrics: dict[str, float]) -> dict[str, float | None]:
    """The compressed-cache gauges (absent on dense servers) and SGLang's own cache hit rate."""
    fields = {"metrics_cache_hit_rate": metrics.get("sglang:cache_hit_rate")}
    for key in ("compressed_tokens", "store_used_blocks", "blocks_compressed_total", "bytes_saved",
                "tails_trimmed_total", "blocks_evicted_for_dense_total", "blocks_evicted_for_store_total",
                "host_compressed_tokens", "blocks_backed_up_total", "blocks_loaded_total",
                "blocks_evicted_from_host_total"):  # fmt: skip
        fields[f"hs_{key}"] = metrics.get(f"sglang:hierasparse_{key}")
    return fields


_FIXED_LOAD = re.compile(r"g([1-9][0-9]*)(?:x([1-9][0-9]*))?")


def parse_regimes(text: str) -> list[int | str]:
    """``1,2,3`` (working set from the dense capacity) and ``gN`` / ``gNxM`` (N groups [of M questions])."""
    regimes: list[int | str] = []
    for item in filter(None, text.split(",")):
        if item.isdigit() and int(item) in REGIME_WORKING_SET:
            regimes.append(int(item))
        elif _FIXED_LOAD.fullmatch(item):
            regimes.append(item)
        else:
            raise SystemExit(f"error: --regimes entry {item!r}; allowed: 1, 2, 3, gN or gNxM (N groups of M questions)")
    return regimes


def load_shape(regime: int | str, dense_capacity: int, context: int, prompts_per_group: int) -> tuple[int, int]:
    """Groups and questions per group of a load."""
    if isinstance(regime, str):
        groups, per_group = _FIXED_LOAD.fullmatch(regime).groups()
        return int(groups), int(per_group or prompts_per_group)
    return max(1, round(REGIME_WORKING_SET[regime] * dense_capacity / context)), prompts_per_group


def request_fields(result: dict) -> dict:
    """Per-request outcome of a bench_serving run: errors and the share of prompt tokens served from cache."""
    errors = [e for e in result.get("errors", []) if e]
    cached, inputs = result.get("cached_tokens") or [], result.get("input_lens") or []
    return {
        "num_prompts": len(result.get("errors", [])),
        "completed": result["completed"],
        "errors": len(errors),
        "first_error": errors[0][:300] if errors else None,
        "cached_token_rate": sum(cached) / sum(inputs) if cached and sum(inputs) else None,
    }


def itl_fields(result: dict) -> dict:
    """Where the time between a request's streamed chunks went (bench_serving's ``itls``, pooled over
    requests; a chunk may carry several tokens): the median gap is an undisturbed stretch of decode
    steps, the mean adds every stall behind a prefill batch. Two servers' p50 ratio is their decode
    steps' ratio and their mean ratio is what TPOT sees, with no threshold to pick (one set relative to
    each server's own median counted a faster server's ordinary prefill stalls and not the other's)."""
    gaps = [gap for request in result.get("itls") or [] for gap in request]
    if not gaps:
        return {}
    median, mean = statistics.median(gaps), statistics.fmean(gaps)
    return {"itl_p50_ms": median * 1e3, "itl_mean_ms": mean * 1e3, "itl_step_share": median / mean}


def flush_check(server: SGLangServer) -> dict:
    """Flush the cache, let the scheduler go idle (its pool check runs), read the gauges again."""
    flushed = server.post("/flush_cache")
    time.sleep(3)
    log = server.log_text()
    metrics = read_metrics(server.base_url)
    return {
        "flush_answer": str(flushed).strip()[:80],
        "store_used_blocks_after_flush": metrics.get("sglang:hierasparse_store_used_blocks"),
        "compressed_tokens_after_flush": metrics.get("sglang:hierasparse_compressed_tokens"),
        "leak_reports": server.leak_reports(),
        # One line per rank and flush (the radix hook's ownership check; hierasparse servers only).
        "store_reset_lines": [line[-160:] for line in log.splitlines() if "hierasparse: cache reset" in line][-4:],
        # With --enable-hierarchical-cache: the host tier's ownership line per rank and flush.
        "host_reset_lines": [line[-160:] for line in log.splitlines()
                             if "hierasparse: host tier at reset" in line][-4:],  # fmt: skip
        **server.rank_states(),
        "healthy_after_flush": server.healthy(),
    }



def host_tier(spec: ServerSpec, hicache_size: int | None) -> str | None:
    """The host memory of a server with SGLang's hierarchical cache (None without one)."""
    if not spec.hicache:
        return None
    return f"{hicache_size} GB" if hicache_size else "hicache-ratio default"


def plot(records: list[dict], png_path: str) -> None:
    """Request throughput, median TTFT and median TPOT per load (regime, context, KV memory), one bar
    per server: loads of different contexts or memory are not points of one curve."""
    loaded = [r for r in records if r.get("regime") is not None]
    if not loaded:
        return
    def load_of(r: dict) -> tuple:
        return str(r["regime"]), r["context"], r["mem_fraction_static"], r.get("working_set_tokens")

    latest = {(r["server"], load_of(r)): r for r in loaded}  # a later record of a load replaces an earlier one
    loads = list(dict.fromkeys(load for _, load in latest))
    servers = list(dict.fromkeys(server for server, _ in latest))
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(servers)
    panels = (("req_throughput", "requests / s"), ("ttft_p50_ms", "TTFT p50 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)"))
    for ax, (key, label) in zip(axes, panels):
        for i, server in enumerate(servers):
            xs, ys = [], []
            for x, load in enumerate(loads):
                row = latest.get((server, load))
                if row is not None and row.get(key) is not None:
                    xs.append(x + (i - (len(servers) - 1) / 2) * width)
                    ys.append(row[key])
            ax.bar(xs, ys, width, label=server)
        ax.set_xticks(range(len(loads)))
        ax.set_xticklabels([f"regime {g}\n{c // 1024}K ctx, mem {m}\n{(w or 0) // 1000}K prefix tok"
                            for g, c, m, w in loads], fontsize=7)  # fmt: skip
        ax.set(ylabel=label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


def save(records: list[dict], out: str) -> None:
    with open(out, "w") as f:
        json.dump(records, f, indent=1)
    plot(records, os.path.splitext(out)[0] + ".png")


# (record key, label, True where higher is better); ratios are stated so that > 1 favours hierasparse.
RATIO_FIELDS = (("req_throughput", "req/s", True), ("output_tok_throughput", "output tok/s", True),
                ("ttft_p50_ms", "TTFT p50", False), ("tpot_p50_ms", "TPOT p50", False),
                ("resident_prefix_tokens", "resident prefix tokens", True))  # fmt: skip


def same_setup(a: dict, b: dict) -> bool:
    """Records measured at the same context, KV memory and tensor-parallel size (comparable servers);
    two servers with a host tier also with the same host memory."""
    hosts = (a.get("host_tier"), b.get("host_tier"))
    return (a.get("context") == b.get("context") and a.get("mem_fraction_static") == b.get("mem_fraction_static")
            and a.get("tp_size", 1) == b.get("tp_size", 1) and (None in hosts or hosts[0] == hosts[1]))  # fmt: skip


def ratio_lines(records: list[dict]) -> list[str]:
    """Each hierasparse record against the latest record of every baseline server (flashinfer, triton,
    hicache) of the same load, context and KV memory: higher-is-better fields as ours / theirs,
    latencies as theirs / ours."""
    lines = []
    for ours in (r for r in records if r["backend"] == "hierasparse"):
        for name in BASELINES:
            base = next((r for r in reversed(records) if r["server"] == name and r["regime"] == ours["regime"]
                         and r.get("api") == ours.get("api") and same_setup(r, ours)), None)  # fmt: skip
            if base is None:
                continue
            parts = [
                f"{label} {(ours[key] / base[key]) if higher else (base[key] / ours[key]):.2f}x"
                for key, label, higher in RATIO_FIELDS
                if ours.get(key) and base.get(key)
            ]
            line = f"regime {ours['regime']}, {ours['server']} vs {base['server']}: " + ", ".join(parts)
            if ours.get("cache_hit_rate") is not None and base.get("cache_hit_rate") is not None:
                line += f" (cache hit rate {ours['cache_hit_rate']:.2f} vs {base['cache_hit_rate']:.2f})"
            lines.append(line)
    return lines


def run_bench_serving(server: SGLangServer, args, groups: int, per_group: int, result_path: str) -> dict:
    command = [
        sys.executable, "-m", "sglang.benchmark.serving", "--backend", args.api,
        "--base-url", server.base_url, "--model", args.model_path, "--tokenizer", args.model_path,
        "--dataset-name", "generated-shared-prefix",
        "--gsp-num-groups", str(groups), "--gsp-prompts-per-group", str(per_group),
        "--gsp-system-prompt-len", str(args.gsp_prompt_len), "--gsp-question-len", str(args.gsp_question_len),
        "--gsp-output-len", str(args.output_len), "--num-prompts", str(groups * per_group),
        "--request-rate", str(args.request_rate), "--max-concurrency", str(args.max_concurrency),
        "--flush-cache", "--seed", "1", "--output-file", result_path, "--disable-tqdm", "--output-details",
    ]  # fmt: skip
    if args.api == "sglang":
        # Per-request cached tokens. Not with the OpenAI API: SGLang 0.5.17 then streams a chunk with no
        # choices, which bench_serving's client fails to parse (every such request counts as an error).
        command.append("--cache-report")
    print(f"[bench] {' '.join(command[2:])}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.bench_timeout)
    if done.returncode != 0:
        raise RuntimeError(f"bench_serving failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    with open(result_path) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def _interrupt(signum, frame) -> None:
    """SIGTERM handler: raise KeyboardInterrupt, so the running server's context stops it (a server left
    running holds its port and GPU memory, and the next run's server on that port cannot start)."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path")
    parser.add_argument("--report-only", metavar="JSON", help="print an earlier run's ratios and redraw its PNG")
    parser.add_argument("--load-format", default=None, help="e.g. dummy for random weights")
    parser.add_argument("--servers", default="flashinfer,hs:1:1,hs:0:1,hicache")
    parser.add_argument("--regimes", default="1,2,3", help="comma list of 1, 2, 3, gN (N groups); empty: capacity probe only")
    parser.add_argument("--api", default="sglang", choices=APIS, help="bench_serving backend: native or OpenAI API")
    parser.add_argument("--context", type=int, default=8192, help="shared prefix tokens per group")
    parser.add_argument("--question-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--request-rate", type=float, default=8.0)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--mem-fraction-static", type=float, default=0.85)
    parser.add_argument("--store-fraction", type=float, default=0.5,
                        help="hierasparse store fraction unless a server gives its own (hs:SK:SV:F)")
    parser.add_argument("--dense-capacity", type=int, default=None, help="dense KV tokens, if flashinfer is not run first")
    parser.add_argument("--skip-capacity-probe", action="store_true")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size of every server")
    parser.add_argument("--hicache-size", type=int, default=None,
                        help="hicache and hs+hicache servers: host KV memory in GB per rank (SGLang's default, 2x the GPU "
                             "pool, may not fit the host)")  # fmt: skip
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for every server")
    parser.add_argument("--k-head-map", metavar="FILE", help="hierasparse servers: --hierasparse-k-head-map FILE "
                        "(python -m sglang_hs.launch.calibrate_heads); their auto store fraction and records use "
                        "the effective S_K")  # fmt: skip
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--bench-timeout", type=float, default=900)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="trace this many forward passes of every load in each server (PyTorch profiler), "
                             "--profile-delay seconds after the load's first prefill; the record gets a summary")  # fmt: skip
    parser.add_argument("--profile-delay", type=float, default=10.0)
    parser.add_argument("--profile-stacks", action="store_true",
                        help="record Python stacks in the trace: the summary then names the host code that "
                             "waited on the GPU (host_waits)")  # fmt: skip
    parser.add_argument("--out", default="launch/results/prefix_bench_llama8b_h100.json")
    args = parser.parse_args(argv)
    if args.report_only:
        with open(args.report_only) as f:
            records = json.load(f)
        save(records, args.report_only)
        print_ratios(records)
        return 0
    if not args.model_path or not os.path.exists(os.path.join(args.model_path, "config.json")):
        raise SystemExit(f"error: --model-path {args.model_path} has no config.json")
    specs = [ServerSpec.parse(s, args.store_fraction) for s in args.servers.split(",")]
    if args.k_head_map:
        apply_k_head_map(specs, args.k_head_map)
    regimes = parse_regimes(args.regimes)
    with open(os.path.join(args.model_path, "config.json")) as f:
        model_config = json.load(f)
    vocab = min(model_config.get("vocab_size", 32000), 2000)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    records: list[dict] = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            records = json.load(f)
    # The dense capacity sizes the regimes; an earlier run's dense record at the same context, memory
    # and TP size can provide it.
    setup = {"context": args.context, "mem_fraction_static": args.mem_fraction_static, "tp_size": args.tp_size}
    dense_capacity = args.dense_capacity or next(
        (r["dense_kv_tokens"] for r in reversed(records) if r.get("server") in CAPACITY_SERVERS and same_setup(r, setup)),
        None,
    )
    if regimes:
        args.gsp_prompt_len, args.gsp_question_len = calibrated_prompt_lens(args.model_path, args.context,
                                                                            args.question_len)  # fmt: skip
        print(f"[bench] bench_serving prompt lengths {args.gsp_prompt_len} + {args.gsp_question_len} tokens re-encode "
              f"to about {args.context} + {args.question_len} (the server's tokens)", flush=True)  # fmt: skip
    common = ["--mem-fraction-static", str(args.mem_fraction_static), "--tp-size", str(args.tp_size),
              "--sampling-backend", "pytorch", "--grammar-backend", "none", "--enable-metrics", *args.server_arg]  # fmt: skip
    if args.load_format:
        common += ["--load-format", args.load_format]
    try:
        for spec in specs:
            log_path = os.path.join(out_dir, f"server_{spec.label.replace(':', '_')}.log")
            launch_args = spec.server_args(dense_capacity, args.context, model_head_dim(model_config)) + common
            if spec.hicache and args.hicache_size:
                launch_args += ["--hicache-size", str(args.hicache_size)]
            with SGLangServer(args.model_path, launch_args, args.port, log_path) as server:
                info = http_json(server.base_url + "/get_server_info")
                kv_tokens = int(info.get("max_total_num_tokens", 0))
                tp_size = int(info.get("tp_size") or 1)
                if spec.label in CAPACITY_SERVERS:  # hicache's GPU pool is the dense one; its host tier is extra
                    dense_capacity = kv_tokens
                if not dense_capacity:
                    raise SystemExit("error: run a 16-bit dense server (flashinfer, triton or hicache) first or pass "
                                     "--dense-capacity")
                resident = None
                if not args.skip_capacity_probe:
                    count = int(2.2 * dense_capacity / args.context) + 1
                    resident = probe_capacity(server, args.context, count, vocab)
                    print(f"[bench] {spec.label}: resident prefix tokens {resident}", flush=True)
                server_fields = {
                    "backend": spec.backend, "server": spec.label, "S_K": spec.sk, "S_V": spec.sv,
                    "k_head_map": args.k_head_map if spec.backend == "hierasparse" else None,
                    "effective_S_K": spec.effective_sk, "kv_dtype": "fp8_e4m3" if spec.fp8 else "auto",
                    "context": args.context, "resident_prefix_tokens": resident, "dense_kv_tokens": kv_tokens,
                    "peak_kv_gib": kv_budget_gib(server.log_text(), kv_tokens, model_config, tp_size,
                                                 1 if spec.fp8 else 2),
                    "tp_size": tp_size,
                    "mem_fraction_static": args.mem_fraction_static, "store_fraction": spec.store_fraction,
                    "host_tier": host_tier(spec, args.hicache_size),
                    "device": device_name(), "server_args": list(args.server_arg),
                }  # fmt: skip
                server_records = []
                if not regimes:
                    server_records.append({"regime": None, **server_fields})
                for regime in regimes:
                    groups, per_group = load_shape(regime, dense_capacity, args.context, args.prompts_per_group)
                    print(f"[bench] {spec.label}: regime {regime}, {groups} groups x {per_group} prompts through "
                          f"{args.api}", flush=True)  # fmt: skip
                    log_start = len(server.log_text())
                    result_path = os.path.join(out_dir, f"bs_{spec.label.replace(':', '_')}_{regime}.jsonl")
                    if os.path.exists(result_path):
                        os.remove(result_path)  # bench_serving appends
                    trace_dir = os.path.join(out_dir, f"trace_{spec.label.replace(':', '_')}_{regime}")
                    profiler, stop_profiler = None, threading.Event()
                    if args.profile_steps:
                        profiler = threading.Thread(target=start_profile, daemon=True, args=(
                            server, trace_dir, args.profile_steps, args.profile_delay, log_start, stop_profiler,
                            args.profile_stacks))
                        profiler.start()
                    result = run_bench_serving(server, args, groups, per_group, result_path)
                    stop_profiler.set()
                    metrics = read_metrics(server.base_url)
                    record = {
                        "regime": regime, "api": args.api, **server_fields, "working_set_tokens": groups * args.context,
                        "prompt_tokens_mean": result["total_input_tokens"] / max(1, result["completed"]),
                        "req_throughput": result["request_throughput"],
                        "output_tok_throughput": result["output_throughput"],
                        "total_tok_throughput": result["total_throughput"],
                        "ttft_mean_ms": result["mean_ttft_ms"], "ttft_p50_ms": result["median_ttft_ms"],
                        "ttft_p99_ms": result["p99_ttft_ms"], "tpot_mean_ms": result["mean_tpot_ms"],
                        "tpot_p50_ms": result["median_tpot_ms"], "tpot_p99_ms": result["p99_tpot_ms"],
                        "cache_hit_rate": hit_rate(server.log_text()[log_start:]),
                        **decode_log_stats(server.log_text()[log_start:]),
                        **request_fields(result), **itl_fields(result), **metrics_fields(metrics),
                    }  # fmt: skip
                    if profiler is not None:
                        record["profile"] = profile_summary(trace_dir)
                    server_records.append(record)
                    records.append(record)
                    print(f"[bench] {json.dumps(record)}", flush=True)
                    save(records, args.out)
                check = flush_check(server)
                print(f"[bench] {spec.label}: flush check {json.dumps(check)}", flush=True)
                for record in server_records:
                    record.update(check)
                if not regimes:
                    records.extend(server_records)
                save(records, args.out)
    except ServerStartError as exc:
        reason, _, log_tail = str(exc).partition("\n")  # the reason on the [bench] line, which scripts grep
        print(f"[bench] server failed to start: {reason}\n{log_tail}".rstrip(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[bench] interrupted; servers stopped", file=sys.stderr)
        return 130
    print_ratios(records)
    return 0


def print_ratios(records: list[dict]) -> None:
    for line in ratio_lines(records):
        print(f"[bench] ratio: {line}", flush=True)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout` and job control: stop the servers as Ctrl-C does
    sys.exit(main())
