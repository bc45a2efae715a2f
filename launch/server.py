"""Start and stop real SGLang servers from scripts: health wait, log tail on failure, clean shutdown.

Used by the server check, the prefix benchmark and the soak driver. A server started here is always
stopped, also on Ctrl-C and on errors, because :class:`SGLangServer` is a context manager that kills
the server's whole process group on exit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

# SGLang prefixes a scheduler's log lines with its rank (`[time TP1] ...`; no rank at TP 1).
_RANK_STATE_LINE = re.compile(r"^(.*?)hierasparse: tree state (.*)$")
_RANK_PREFIX = re.compile(r"\bTP(\d+)\b")


# SGLang sizes its KV pool from the free memory it saw before loading weights; when servers start side by side
# on one GPU (the verify and quality steps), another one's allocations in between make that check fail. Such
# a start is retried after a pause; any other failure is not.
_MEMORY_RACE = "leave no GPU memory for the KV cache"
START_RETRIES = 2
START_RETRY_DELAY_S = 20


def device_name() -> str:
    """The GPU servers started from this process run on (CUDA device 0), ``cpu`` without one: the
    records' ``device`` field."""
    try:
        import torch
    except ImportError:
        return "unknown"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log tail."""


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex((host, port)) == 0


def http_json(url: str, payload: dict | None = None, timeout: float = 600, method: str | None = None) -> Any:
    """Send a request (POST when there is a payload) and decode a JSON answer; other answers come
    back as text (SGLang's /flush_cache answers in plain text)."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method=method)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read().decode()
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body


class SGLangServer:
    """``python -m sglang.launch_server`` in its own process group, logging to a file."""

    start_retries = START_RETRIES  # starts retried after the KV-pool memory race (above)

    def __init__(self, model_path: str, args: list[str], port: int, log_path: str, start_timeout: float = 900):
        if not os.path.exists(os.path.join(model_path, "config.json")):
            raise ServerStartError(f"--model-path {model_path} has no config.json")
        if port_in_use(port):
            raise ServerStartError(f"port {port} is already in use; pick another with --port")
        self.command = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
            "--host", "127.0.0.1", "--port", str(port), *args,
        ]  # fmt: skip
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "SGLangServer":
        for attempt in range(1 + self.start_retries):
            print(f"[server] starting: {' '.join(self.command)}", flush=True)
            log = open(self.log_path, "w")
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            try:
                self._wait_healthy()
                return self
            except ServerStartError as error:
                self.stop()
                if attempt == self.start_retries or _MEMORY_RACE not in str(error):
                    raise
                print(f"[server] another process took GPU memory while this one sized its KV pool; "
                      f"starting again in {START_RETRY_DELAY_S} s", flush=True)
                time.sleep(START_RETRY_DELAY_S)
            except BaseException:
                self.stop()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        started = time.time()
        last_report = started
        while time.time() - started < self.start_timeout:
            if self.process.poll() is not None:
                raise ServerStartError(f"server exited with code {self.process.returncode}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as response:
                    if response.status == 200:
                        print(f"[server] healthy after {time.time() - started:.0f} s", flush=True)
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.time() - last_report > 30:
                print(f"[server] waiting for health ({time.time() - started:.0f} s)", flush=True)
                last_report = time.time()
            time.sleep(2)
        raise ServerStartError(f"server not healthy after {self.start_timeout:.0f} s\n{self.log_tail()}")

    def healthy(self) -> bool:
        """The server process is alive and answers ``/health``."""
        if self.process is None or self.process.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=10) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def leak_reports(self) -> int:
        """Leaks reported in the log so far: SGLang's idle memory check (which the plugin extends with
        the compressed store and the host tier) and the radix hooks' ownership checks at each cache reset
        (GPU store; host tier with the hierarchical cache)."""
        log = self.log_text()
        return log.count("memory leak detected") + log.count("compressed store leak") + log.count(
            "hierarchical cache host leak")

    def rank_states(self) -> dict:
        """Each tensor-parallel rank's last ``hierasparse: tree state`` line (the radix hook logs one
        per rank at every cache reset) and whether all ranks agree: their trees must split, compress
        and evict in step although their block masks differ. Empty for dense servers."""
        states: dict[str, str] = {}
        for line in self.log_text().splitlines():
            match = _RANK_STATE_LINE.search(line)
            if match:
                rank = _RANK_PREFIX.search(match.group(1))
                states[f"tp{rank.group(1) if rank else 0}"] = match.group(2).strip()
        if not states:
            return {}
        return {"rank_tree_states": states, "ranks_in_step": len(set(states.values())) == 1}

    def post(self, path: str, payload: dict | None = None, timeout: float = 600) -> Any:
        return http_json(self.base_url + path, payload, timeout, method="POST")

    def stop(self) -> None:
        """Stop every process of the server's group and wait until they are gone and the port is free:
        a scheduler process that outlives the launcher still holds GPU memory, which would shrink the
        KV cache of the next server started on this GPU (and keep the port)."""
        if self.process is None:
            return
        pgid = self.process.pid
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            if self._wait_group_gone(grace):
                break
        self.process.wait(timeout=30)
        deadline = time.time() + 30
        while port_in_use(self.port) and time.time() < deadline:
            time.sleep(0.5)
        self.process = None
        print("[server] stopped", flush=True)

    def _wait_group_gone(self, timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.process.poll()  # reap the launcher: a zombie would keep its group alive
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.5)
        return False
