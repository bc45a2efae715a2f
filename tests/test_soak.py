"""The soak driver's request mix and its verdicts, against a local stand-in for SGLang's HTTP API
(the soak itself runs on the GPU machine against a real server)."""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sglang_hs.launch import soak

CONTEXT = 256


class FakeSGLang(BaseHTTPRequestHandler):
    """Answers like SGLang: 400 for an over-long prompt or max_tokens 0, abort finish reasons on
    /abort_request, 500 for the prompt "crash" (a server bug the soak must count as a failure)."""

    aborted: set[str] = set()

    def log_message(self, *args):
        pass

    def _send(self, status, body, stream_chunks=None):
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream" if stream_chunks is not None else "application/json")
        self.end_headers()
        if stream_chunks is None:
            self.wfile.write(json.dumps(body).encode())
            return
        try:
            for chunk in stream_chunks:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client dropped the stream

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/abort_request":
            FakeSGLang.aborted.add(body["rid"])
            return self._send(200, {})
        if len(body.get("input_ids", [])) > CONTEXT:
            return self._send(400, {"error": {"message": "The input is longer than the model's context length"}})
        if body.get("max_tokens") == 0:
            return self._send(400, {"error": {"message": "max_tokens must be at least 1"}})
        if body.get("prompt") == "crash" or body.get("text") == "crash":
            return self._send(500, {"error": "boom"})
        openai = self.path == "/v1/completions"
        chunk = {"choices": [{"text": "x", "finish_reason": None}]} if openai else {"text": "x", "meta_info": {}}
        if not body.get("stream"):
            return self._send(200, chunk)
        rid = body.get("rid")

        def chunks():
            for _ in range(50):
                if rid in FakeSGLang.aborted:
                    yield {"text": "x", "meta_info": {"finish_reason": {"type": "abort", "message": "Abort by user"}}}
                    return
                yield chunk
                threading.Event().wait(0.01)

        self._send(200, None, chunks())


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeSGLang)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_each_kind_is_sent_and_classified(server):
    driver = soak.FaultDriver(soak.Client(server, timeout=10), CONTEXT, random.Random(0))
    expected = {"generate": "ok", "generate_stream": "ok", "openai": "ok", "openai_stream": "ok", "disconnect": "ok",
                "abort": "ok", "too_long": "clean_error", "empty": "ok", "max_tokens_0": "clean_error",
                "max_tokens_1": "ok"}
    assert set(expected) == set(soak.KINDS)
    for kind, outcome in expected.items():
        got, detail = driver.send(kind)
        assert got == outcome, (kind, detail)
    assert driver.send("abort")[1] == "Abort by user"  # the stream ended with SGLang's abort reason


def test_verdicts(server):
    driver = soak.FaultDriver(soak.Client(server, timeout=10), CONTEXT, random.Random(1))
    driver.prompt = lambda words: "crash"  # every prompt now hits the server bug
    assert driver.send("openai")[0] == "failure"
    records = [("openai", "failure", 0.5, "HTTP 500"), ("openai", "ok", 0.1, ""), ("too_long", "clean_error", 0.2, "400"),
               ("generate", "clean_error", 0.3, "rejected")]
    by_kind = soak.summarize(records)
    assert by_kind["openai"] == {"count": 2, "failure": 1, "ok": 1, "p99_s": 0.5, "examples": ["HTTP 500"]}
    problems = soak.passed(by_kind, healthy=True, leak_reports=0, store_used_after_flush=0.0)
    assert problems == ["1 well-formed generate request(s) were rejected: ['rejected']",
                        "1 openai request(s) failed: ['HTTP 500']"]  # too_long may be rejected
    assert soak.passed({}, healthy=False, leak_reports=1, store_used_after_flush=3.0) == [
        "the server did not stay up", "1 memory leak report(s) in the server log",
        "3 store blocks still used after the flush"]
    assert soak.passed({"too_long": by_kind["too_long"]}, True, 0, 0.0) == []
