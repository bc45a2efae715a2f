"""Time a server's start from process start to the first ``/health_generate`` 200, with empty and with
warm kernel caches, for hierasparse and a dense backend on the same machine.

    python -m sglang_hs.launch.cold_start --model tiny --model-path /tmp/hs_tiny --out OUT \\
        [--servers hierasparse,dense] [--dense-backend triton] [--hs-dense-backend BACKEND] \\
        [--server-arg=--tp-size=2] [--tag h100]

For each server (in the order given) the script starts ``sglang.launch_server`` with SGLang's default
CUDA-graph settings twice: first with empty kernel caches (``cache: "empty"``: a fresh
``TILELANG_CACHE_DIR``, ``TRITON_CACHE_DIR`` and FlashInfer workspace (``FLASHINFER_WORKSPACE_BASE``:
its JIT-compiled sampling and attention ops) under ``--cache-root``, default ``OUT/caches/``), then
again with the caches that first start filled (``"warm"``). So each server's empty start pays every
JIT compilation a fresh machine would, whichever server runs first. ``--prebuilt ARCHIVE`` first installs
a ``prebuilt_kernels`` archive into the hierasparse server's fresh TileLang cache, as a user would after
``pip install`` (its records name the archive in ``prebuilt_kernels``). Hierasparse attends dense tokens with the dense server's backend (``--hs-dense-backend``,
default ``--dense-backend``), so both start the same SGLang kernels. ``kernels_compiled`` counts the
``hierasparse: compiling N kernels (k/N)`` progress lines in the server's log (0 for a dense server).
Writes ``OUT/cold_start_<model>[_tpN]_<tag>.json`` after every start: a list of ``{"server":
"dense"|"hierasparse", "model", "cache": "empty"|"warm", "ready_s", "kernels_compiled", "device",
...}`` records; the server logs go beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

from sglang_hs.launch.server import ServerStartError, SGLangServer, device_name

PROGRESS = re.compile(r"hierasparse: compiling (\d+) kernels \((\d+)/\1\)")


class TimedServer(SGLangServer):
    """A server whose start counts as done at the first ``/health_generate`` 200 (a generation ran),
    timed from just before the launcher process starts."""

    start_retries = 0  # a retried start would not time one cold start

    def __init__(self, *args, env: dict[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.env = env
        self.ready_s: float | None = None
        self._start = 0.0

    def __enter__(self) -> "TimedServer":
        saved = {key: os.environ.get(key) for key in self.env}
        os.environ.update(self.env)  # the launcher and its scheduler processes inherit the cache dirs
        try:
            self._start = time.time()
            return super().__enter__()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def _wait_healthy(self) -> None:
        while time.time() - self._start < self.start_timeout:
            if self.process.poll() is not None:
                raise ServerStartError(f"server exited with code {self.process.returncode}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health_generate", timeout=60) as response:
                    if response.status == 200:
                        self.ready_s = time.time() - self._start
                        print(f"[cold_start] ready after {self.ready_s:.1f} s", flush=True)
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise ServerStartError(f"server not ready after {self.start_timeout:.0f} s\n{self.log_tail()}")


def kernels_compiled(log_text: str) -> int:
    """Kernels the server compiled: its ``(k/N)`` progress lines with k >= 1 (one rank compiles; the
    others wait on the compile lock and load)."""
    return sum(1 for match in PROGRESS.finditer(log_text) if int(match.group(2)) >= 1)


def server_args(server: str, args: argparse.Namespace) -> list[str]:
    common = list(args.server_arg)
    if args.model == "llama8b" and not any(a.startswith("--load-format") for a in common):
        common.append("--load-format=dummy")
    if server == "hierasparse":
        return ["--attention-backend", "hierasparse", f"--hierasparse-dense-backend={args.hs_dense_backend}", *common]
    return ["--attention-backend", args.dense_backend, *common]


def tp_size(args: argparse.Namespace) -> int:
    for arg in args.server_arg:
        if arg.startswith("--tp-size=") or arg.startswith("--tp="):
            return int(arg.split("=", 1)[1])
    return 1


def install_prebuilt(archive: str, tilelang_cache: str) -> None:
    """``prebuilt_kernels install ARCHIVE`` into the server's fresh TileLang cache, as a user would run it
    once after ``pip install`` (a separate process: it reads ``TILELANG_CACHE_DIR`` from its environment)."""
    env = {**os.environ, "TILELANG_CACHE_DIR": tilelang_cache}
    subprocess.run([sys.executable, "-m", "sglang_hs.launch.prebuilt_kernels", "install", archive], env=env, check=True)


def run(args: argparse.Namespace, save) -> list[dict]:
    """Start each server twice (empty, then warm caches); ``save(records)`` after every start."""
    device = device_name()
    records: list[dict] = []
    for server in args.servers.split(","):
        caches = os.path.join(args.cache_root or os.path.join(args.out, "caches"), f"{server}_{args.model}")
        shutil.rmtree(caches, ignore_errors=True)
        env = {"TILELANG_CACHE_DIR": os.path.join(caches, "tilelang"),
               "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
               "FLASHINFER_WORKSPACE_BASE": os.path.join(caches, "flashinfer")}
        if server == "hierasparse" and args.prebuilt:  # the user's install step: kernels, no JIT caches
            install_prebuilt(args.prebuilt, env["TILELANG_CACHE_DIR"])
        for cache in ("empty", "warm"):
            log = os.path.join(args.out, f"cold_start_{server}_{args.model}_{cache}.log")
            record = dict(server="hierasparse" if server == "hierasparse" else "dense", model=args.model, cache=cache,
                          ready_s=None, kernels_compiled=None, device=device, tp_size=tp_size(args),
                          backend=args.dense_backend if server != "hierasparse" else
                          f"hierasparse (dense tokens: {args.hs_dense_backend})",
                          server_args=server_args(server, args), log=os.path.basename(log))  # fmt: skip
            if server == "hierasparse" and args.prebuilt:
                record["prebuilt_kernels"] = os.path.basename(args.prebuilt)
            try:
                with TimedServer(args.model_path, record["server_args"], args.port, log, args.timeout, env=env) as srv:
                    record["ready_s"] = round(srv.ready_s, 1)
            except ServerStartError as exc:
                record["error"] = str(exc).splitlines()[0]
                print(f"[cold_start] {server} {cache}: {record['error']}", flush=True)
            with open(log, errors="replace") as f:
                text = f.read()
            record["kernels_compiled"] = kernels_compiled(text)
            loaded = [line.split("hierasparse: ", 1)[1].strip() for line in text.splitlines()
                      if "kernels loaded from TileLang's cache" in line or "and loaded" in line]
            if loaded:
                record["kernel_log"] = loaded[-1]
            records.append(record)
            save(records)
            print(f"[cold_start] {record['server']} {args.model} {cache}: ready {record['ready_s']} s, "
                  f"{record['kernels_compiled']} kernels compiled", flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=["tiny", "llama8b"], help="the record's model name")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--servers", default="hierasparse,dense", help="comma list of hierasparse, dense (in order)")
    parser.add_argument("--dense-backend", default="triton", help="the dense server's --attention-backend")
    parser.add_argument("--hs-dense-backend", default=None,
                        help="hierasparse's --hierasparse-dense-backend (default: --dense-backend)")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to every server (repeatable)")
    parser.add_argument("--cache-root", default=None, help="where the fresh kernel caches go (default: OUT/caches)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--timeout", type=float, default=900, help="seconds a start may take")
    parser.add_argument("--tag", default=None, help="file tag (default: h100/h200 from the GPU's name)")
    parser.add_argument("--prebuilt", metavar="ARCHIVE", help="install this prebuilt_kernels archive into the "
                        "hierasparse server's fresh TileLang cache first (records get prebuilt_kernels)")  # fmt: skip
    args = parser.parse_args(argv)
    args.hs_dense_backend = args.hs_dense_backend or args.dense_backend
    if not set(args.servers.split(",")) <= {"hierasparse", "dense"}:
        raise SystemExit("error: --servers takes hierasparse and dense")
    os.makedirs(args.out, exist_ok=True)
    name = device_name().lower()
    tag = args.tag or next((t for t in ("h200", "h100") if t in name), "gpu")
    tp = f"_tp{tp_size(args)}" if tp_size(args) > 1 else ""
    path = os.path.join(args.out, f"cold_start_{args.model}{tp}_{tag}.json")

    def save(records: list[dict]) -> None:
        with open(path, "w") as f:
            json.dump(records, f, indent=1)

    records = run(args, save)
    print(f"[cold_start] {len(records)} records -> {path}", flush=True)
    for r in records:
        print(f"[cold_start] {r['server']:11} {r['model']:7} {r['cache']:5} ready_s={r['ready_s']} "
              f"kernels_compiled={r['kernels_compiled']}", flush=True)
    return 0 if all(r["ready_s"] is not None for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
