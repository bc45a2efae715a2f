"""Soak run with faults: one hierasparse server under mixed, messy traffic for a fixed time.

    python -m sglang_hs.launch.soak --model-path DIR [--load-format dummy] [--minutes 10] \\
        [--server-arg=--context-length=8192 ...] --out soak.json

Two loads run side by side until the time is up:

* SGLang's ``python -m sglang.benchmark.serving --dataset-name generated-shared-prefix``, again and
  again with fresh seeds and more groups than the cache holds (shared prefixes that force eviction);
* a fault driver (``--workers`` threads) sending, in a fixed random mix: prompts with no shared
  prefix (native ``/generate`` and OpenAI ``/v1/completions``, streaming and not), streams the client
  drops after the first chunk, streams aborted through ``/abort_request``, prompts longer than the
  context limit, empty prompts, and ``max_tokens`` 0 and 1.

Every answer is classified: ``ok`` (a well-formed answer, or the stream the driver meant to drop
or abort ended as intended), ``clean_error`` (an HTTP 4xx with a message, or SGLang's abort finish
reason with one: the normal way a server rejects bad input) or ``failure`` (5xx, a dropped
connection, a timeout, an unreadable body). Afterwards the cache is flushed and the compressed
store's gauges are read. Pass: the server stayed up, no well-formed request failed, every rejection
was clean, SGLang's strict idle memory check (which includes the compressed store) never reported a
leak, and the store is empty after the flush. The JSON report has the counts by kind and outcome,
the p99 latency of each kind, the store's gauges before and after, and the bench_serving summaries.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import defaultdict
from urllib.parse import urlparse

from sglang_hs.launch.bench_prefix import read_metrics
from sglang_hs.launch.server import SGLangServer, ServerStartError, http_json

KINDS = ("generate", "generate_stream", "openai", "openai_stream", "disconnect", "abort", "too_long", "empty",
         "max_tokens_0", "max_tokens_1")  # fmt: skip
# Kinds a server may answer with a clean rejection (SGLang's normal error) instead of a completion.
MAY_BE_REJECTED = ("too_long", "empty", "max_tokens_0")
_WORDS = "shared prefix cache compressed sparse tensor kernel request token answer question document".split()


class Client:
    """One HTTP connection per request (a dropped stream must not poison a shared connection)."""

    def __init__(self, base_url: str, timeout: float):
        url = urlparse(base_url)
        self.host, self.port, self.timeout = url.hostname, url.port, timeout

    def request(self, path: str, payload: dict) -> tuple[int, http.client.HTTPResponse, http.client.HTTPConnection]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response, conn


def stream_events(response: http.client.HTTPResponse):
    """The JSON payloads of a server-sent-event stream, up to ``[DONE]``."""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def abort_message(body: dict) -> str | None:
    """SGLang's abort finish reason (``meta_info.finish_reason`` or an OpenAI choice's) if it has a message."""
    reasons = [body.get("meta_info", {}).get("finish_reason")]
    reasons += [choice.get("finish_reason") for choice in body.get("choices", [])]
    for reason in reasons:
        if isinstance(reason, dict) and reason.get("type") == "abort" and reason.get("message"):
            return reason["message"]
    return None


def well_formed(body: dict) -> bool:
    return "text" in body or bool(body.get("choices"))


class FaultDriver:
    """Sends the fault mix; records ``(kind, outcome, seconds, detail)`` per request."""

    def __init__(self, client: Client, context_length: int, rng: random.Random):
        self.client, self.context_length, self.rng = client, context_length, rng
        self.records: list[tuple[str, str, float, str]] = []
        self.lock = threading.Lock()

    def prompt(self, words: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(words))

    def payload(self, kind: str) -> tuple[str, dict]:
        """Path and body of one request of ``kind``."""
        params = {"max_new_tokens": self.rng.randint(4, 32), "temperature": 0}
        if kind in ("generate", "generate_stream", "disconnect", "abort"):
            body = {"text": self.prompt(self.rng.randint(20, 400)), "sampling_params": params,
                    "stream": kind != "generate"}  # fmt: skip
            if kind == "abort":
                body["rid"] = f"soak-abort-{self.rng.getrandbits(48):x}"
                params["max_new_tokens"] = 256
            return "/generate", body
        if kind in ("openai", "openai_stream"):
            return "/v1/completions", {"model": "default", "prompt": self.prompt(self.rng.randint(20, 400)),
                                       "max_tokens": params["max_new_tokens"], "temperature": 0,
                                       "stream": kind == "openai_stream"}  # fmt: skip
        if kind == "too_long":
            ids = [self.rng.randrange(10, 1000) for _ in range(self.context_length + 64)]
            return "/generate", {"input_ids": ids, "sampling_params": params}
        if kind == "empty":
            return "/v1/completions", {"model": "default", "prompt": "", "max_tokens": 8}
        tokens = int(kind.rsplit("_", 1)[1])  # max_tokens_0 / max_tokens_1
        return "/v1/completions", {"model": "default", "prompt": self.prompt(50), "max_tokens": tokens}

    def send(self, kind: str) -> tuple[str, str]:
        """``(outcome, detail)`` of one request."""
        path, body = self.payload(kind)
        status, response, conn = self.client.request(path, body)
        try:
            if status >= 500:
                return "failure", f"HTTP {status}: {response.read()[:200]!r}"
            if status >= 400:
                text = response.read().decode(errors="replace")
                return ("clean_error" if text.strip() else "failure"), f"HTTP {status}: {text[:200]}"
            if not body.get("stream"):
                answer = json.loads(response.read())
                message = abort_message(answer)
                if message:
                    return "clean_error", message[:200]
                return ("ok", "") if well_formed(answer) else ("failure", f"malformed: {str(answer)[:200]}")
            events = stream_events(response)
            first = next(events, None)
            if first is None:
                return "failure", "stream ended before its first chunk"
            if kind == "disconnect":
                return "ok", "dropped after the first chunk"
            if kind == "abort":
                http_json(f"http://{self.client.host}:{self.client.port}/abort_request", {"rid": body["rid"]},
                          timeout=self.client.timeout, method="POST")  # fmt: skip
            last = first
            for last in events:
                pass
            message = abort_message(last)
            if kind == "abort":
                return "ok", message or "finished before the abort arrived"
            return ("clean_error", message[:200]) if message else ("ok", "")
        finally:
            conn.close()  # for "disconnect": the client goes away mid-stream

    def run(self, deadline: float, weights: dict[str, float]) -> None:
        kinds, w = zip(*weights.items())
        while time.time() < deadline:
            kind = self.rng.choices(kinds, w)[0]
            start = time.time()
            try:
                outcome, detail = self.send(kind)
            except (OSError, http.client.HTTPException, json.JSONDecodeError, ValueError) as exc:
                outcome, detail = "failure", f"{type(exc).__name__}: {exc}"[:200]
            with self.lock:
                self.records.append((kind, outcome, time.time() - start, detail))


DEFAULT_WEIGHTS = {"generate": 3, "generate_stream": 3, "openai": 3, "openai_stream": 3, "disconnect": 2, "abort": 2,
                   "too_long": 1, "empty": 1, "max_tokens_0": 1, "max_tokens_1": 1}  # fmt: skip


def summarize(records: list[tuple[str, str, float, str]]) -> dict:
    """Counts by kind and outcome, p99 latency per kind, and the first details of each non-ok outcome."""
    by_kind: dict[str, dict] = {}
    grouped = defaultdict(list)
    for kind, outcome, seconds, detail in records:
        grouped[kind].append((outcome, seconds, detail))
    for kind, rows in sorted(grouped.items()):
        latencies = sorted(seconds for _, seconds, _ in rows)
        counts = defaultdict(int)
        for outcome, _, _ in rows:
            counts[outcome] += 1
        by_kind[kind] = {
            "count": len(rows),
            **dict(counts),
            "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
            "examples": sorted({detail for outcome, _, detail in rows if outcome != "ok"})[:3],
        }
    return by_kind


def passed(by_kind: dict, healthy: bool, leak_reports: int, store_used_after_flush: float | None) -> list[str]:
    """The failed pass criteria (empty: pass)."""
    problems = []
    if not healthy:
        problems.append("the server did not stay up")
    for kind, row in by_kind.items():
        if row.get("failure"):
            problems.append(f"{row['failure']} {kind} request(s) failed: {row['examples']}")
        if kind not in MAY_BE_REJECTED and row.get("clean_error"):
            problems.append(f"{row['clean_error']} well-formed {kind} request(s) were rejected: {row['examples']}")
    if leak_reports:
        problems.append(f"{leak_reports} memory leak report(s) in the server log")
    if store_used_after_flush:
        problems.append(f"{store_used_after_flush:.0f} store blocks still used after the flush")
    return problems


def run_shared_prefix_loads(server: SGLangServer, args, deadline: float, results: list[dict]) -> None:
    """bench_serving's shared-prefix workload, repeated with new seeds until the deadline."""
    seed = 0
    while time.time() < deadline - 30:
        seed += 1
        path = os.path.join(args.workdir, f"soak_bench_{seed}.jsonl")
        command = [
            sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", server.base_url,
            "--model", args.model_path, "--tokenizer", args.model_path, "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", str(args.groups), "--gsp-prompts-per-group", "4",
            "--gsp-system-prompt-len", str(args.prefix_len), "--gsp-question-len", "128", "--gsp-output-len", "32",
            "--num-prompts", str(args.groups * 4), "--request-rate", str(args.request_rate),
            "--max-concurrency", "16", "--seed", str(seed), "--output-file", path, "--disable-tqdm",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(60, deadline - time.time() + 120))
        if done.returncode != 0 or not os.path.exists(path):
            results.append({"seed": seed, "error": (done.stderr or done.stdout)[-500:]})
            continue
        with open(path) as f:
            result = json.loads(f.read().strip().splitlines()[-1])
        results.append({"seed": seed, **{k: result.get(k) for k in ("completed", "request_throughput", "p99_e2e_latency_ms")}})
        print(f"[soak] shared-prefix round {seed}: {results[-1]}", flush=True)


def store_gauges(server: SGLangServer) -> dict:
    metrics = read_metrics(server.base_url)
    return {key: metrics.get(f"sglang:hierasparse_{key}") for key in ("store_used_blocks", "store_capacity_blocks",
                                                                     "compressed_tokens", "blocks_compressed_total")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=8, help="fault-driver threads")
    parser.add_argument("--groups", type=int, default=64, help="shared-prefix groups per bench_serving round")
    parser.add_argument("--prefix-len", type=int, default=4096)
    parser.add_argument("--request-rate", type=float, default=8.0)
    parser.add_argument("--context-length", type=int, default=8192, help="passed to the server; too_long exceeds it")
    parser.add_argument("--server-arg", action="append", default=[], help="extra server flag")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--request-timeout", type=float, default=120)
    parser.add_argument("--out", default="soak.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.workers < 1:
        raise SystemExit("error: --minutes and --workers must be positive")
    args.workdir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(args.workdir, exist_ok=True)
    server_args = ["--attention-backend", "hierasparse", "--enable-metrics", "--context-length",
                   str(args.context_length), *args.server_arg]  # fmt: skip
    if args.load_format:
        server_args += ["--load-format", args.load_format]
    log_path = os.path.join(args.workdir, "soak_server.log")
    try:
        with SGLangServer(args.model_path, server_args, args.port, log_path) as server:
            before = store_gauges(server)
            deadline = time.time() + 60 * args.minutes
            drivers = [FaultDriver(Client(server.base_url, args.request_timeout), args.context_length,
                                   random.Random(args.seed + i)) for i in range(args.workers)]  # fmt: skip
            threads = [threading.Thread(target=d.run, args=(deadline, DEFAULT_WEIGHTS), daemon=True) for d in drivers]
            bench_results: list[dict] = []
            threads.append(threading.Thread(target=run_shared_prefix_loads, args=(server, args, deadline, bench_results),
                                            daemon=True))  # fmt: skip
            for thread in threads:
                thread.start()
            while any(thread.is_alive() for thread in threads):
                time.sleep(15)
                done = sum(len(d.records) for d in drivers)
                print(f"[soak] {max(0, deadline - time.time()):.0f} s left, {done} fault-driver requests, "
                      f"server healthy: {server.healthy()}", flush=True)  # fmt: skip
                if time.time() > deadline + 3 * args.request_timeout:
                    print("[soak] some load is still running past the deadline; reporting now", flush=True)
                    break
            healthy = server.healthy()
            after_load = store_gauges(server) if healthy else {}
            server.post("/flush_cache")
            time.sleep(3)
            after_flush = store_gauges(server) if healthy else {}
            leak_reports = server.leak_reports()
            healthy = healthy and server.healthy()
            # Written before the server stops: SGLang's shutdown can take a minute, and a caller's time
            # limit must not cost the report.
            problems = write_report(args, drivers, bench_results, before, after_load, after_flush, leak_reports,
                                    healthy)  # fmt: skip
    except ServerStartError as exc:
        print(f"[soak] server failed to start:\n{exc}", file=sys.stderr)
        return 1
    return 0 if not problems else 1


def write_report(args, drivers, bench_results, before, after_load, after_flush, leak_reports, healthy) -> list[str]:
    """Write the JSON report, print its summary, return the failed pass criteria."""
    records = [row for d in drivers for row in d.records]
    by_kind = summarize(records)
    problems = passed(by_kind, healthy, leak_reports, after_flush.get("store_used_blocks"))
    report = {
        "minutes": args.minutes, "requests": len(records), "by_kind": by_kind, "shared_prefix_rounds": bench_results,
        "store_before": before, "store_after_load": after_load, "store_after_flush": after_flush,
        "leak_reports": leak_reports, "healthy": healthy, "problems": problems, "passed": not problems,
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in ("requests", "healthy", "leak_reports", "passed", "problems")}, indent=1),
          flush=True)  # fmt: skip
    return problems


if __name__ == "__main__":
    sys.exit(main())
