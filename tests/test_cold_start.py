"""The cold-start timer (``sglang_hs.launch.cold_start``): log parsing and server arguments, on CPU."""

from __future__ import annotations

import argparse

from sglang_hs.launch import cold_start as C

LOG = """[2026-11-26 TP0] hierasparse: compiling 4 kernels (0/4) in 4 processes into /tmp/c (the first start ...)
[2026-11-26 TP0] hierasparse: compiling 4 kernels (1/4) pack(2, 64, 64) done at 31 s
[2026-11-26 TP1] hierasparse: waiting for another process compiling 4 kernels into /tmp/c
[2026-11-26 TP0] hierasparse: compiling 4 kernels (2/4) extend(8, 2, 64, 64, 'float16', 'n64', 2, False) done at 52 s
[2026-11-26 TP0] hierasparse: compiling 4 kernels (3/4) extend(...) done at 60 s
[2026-11-26 TP0] hierasparse: compiling 4 kernels (4/4) decode(8, 2, 64, 64, 'float16', 2) done at 64 s
[2026-11-26 TP0] hierasparse: compiled 4 and loaded 4 kernels in 70 s
[2026-11-26 TP1] hierasparse: 4 kernels loaded from TileLang's cache in 1.2 s
"""


def test_kernels_compiled_counts_progress_lines():
    assert C.kernels_compiled(LOG) == 4
    assert C.kernels_compiled("hierasparse: 4 kernels loaded from TileLang's cache in 0.6 s") == 0


def test_server_arguments():
    args = argparse.Namespace(model="llama8b", server_arg=["--tp-size=2"], hs_dense_backend="triton",
                              dense_backend="triton")
    assert C.server_args("hierasparse", args) == [
        "--attention-backend", "hierasparse", "--hierasparse-dense-backend=triton", "--tp-size=2",
        "--load-format=dummy"]
    assert C.server_args("dense", args) == ["--attention-backend", "triton", "--tp-size=2", "--load-format=dummy"]
    args.model = "tiny"
    assert C.server_args("dense", args) == ["--attention-backend", "triton", "--tp-size=2"]


FAKE_SERVER = '''
import http.server, os, sys, time
cache = os.environ["TILELANG_CACHE_DIR"]
assert os.path.dirname(cache) == os.path.dirname(os.environ["FLASHINFER_WORKSPACE_BASE"])  # one fresh set a server
assert os.path.dirname(cache) == os.path.dirname(os.environ["TRITON_CACHE_DIR"])
if "hierasparse" in sys.argv:
    if os.path.isdir(cache):
        print("hierasparse: 2 kernels loaded from TileLang's cache in 0.3 s", flush=True)
    else:
        for k in range(3):
            print(f"hierasparse: compiling 2 kernels ({k}/2) pack done at {k} s", flush=True)
        os.makedirs(cache)
time.sleep(0.5)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
'''


def run_against_fake_servers(tmp_path, monkeypatch, device: str, *flags: str) -> list[dict]:
    """``cold_start.main`` against the stand-in server (``FAKE_SERVER``); returns the records."""
    import json
    import socket
    import sys

    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")

    class FakeTimedServer(C.TimedServer):
        def __init__(self, model_path, args, port, log, timeout, env):
            super().__init__(model_path, args, port, log, timeout, env=env)
            self.command = [sys.executable, str(script), str(port), *args]

    monkeypatch.setattr(C, "TimedServer", FakeTimedServer)
    monkeypatch.setattr(C, "device_name", lambda: device)
    out = tmp_path / "out"
    assert C.main(["--model", "tiny", "--model-path", str(tmp_path / "model"), "--out", str(out),
                   "--port", str(port), "--timeout", "60", *flags]) == 0  # fmt: skip
    tag = "h200" if "H200" in device else "h100"
    return json.loads((out / f"cold_start_tiny_{tag}.json").read_text())


def test_records_from_fake_servers(tmp_path, monkeypatch):
    """The whole run against a stand-in server (an HTTP process that answers /health_generate and logs
    progress lines when its TILELANG_CACHE_DIR does not exist yet): four records, the empty starts of
    hierasparse counting its compiled kernels, the warm one none."""
    records = run_against_fake_servers(tmp_path, monkeypatch, "NVIDIA H100 80GB HBM3")
    assert [(r["server"], r["cache"], r["kernels_compiled"]) for r in records] == [
        ("hierasparse", "empty", 2), ("hierasparse", "warm", 0), ("dense", "empty", 0), ("dense", "warm", 0)]
    assert all(0 < r["ready_s"] < 60 and r["device"] == "NVIDIA H100 80GB HBM3" for r in records)
    assert records[1]["kernel_log"].startswith("2 kernels loaded")


def test_prebuilt_kernels_are_installed_into_the_fresh_cache_first(tmp_path, monkeypatch):
    """--prebuilt: the archive goes into the hierasparse server's fresh TileLang cache before its first
    start (here: the stand-in finds its cache and compiles nothing), and its records name it."""
    import os

    installed = []
    monkeypatch.setattr(C, "install_prebuilt", lambda archive, cache: (installed.append((archive, cache)),
                                                                       os.makedirs(cache)))  # fmt: skip
    records = run_against_fake_servers(tmp_path, monkeypatch, "NVIDIA H200", "--prebuilt", "/x/hs-kernels.tar.gz")
    assert len(installed) == 1 and installed[0][1].endswith(os.path.join("hierasparse_tiny", "tilelang"))
    assert [(r["server"], r["cache"], r["kernels_compiled"], r.get("prebuilt_kernels")) for r in records] == [
        ("hierasparse", "empty", 0, "hs-kernels.tar.gz"), ("hierasparse", "warm", 0, "hs-kernels.tar.gz"),
        ("dense", "empty", 0, None), ("dense", "warm", 0, None)]
