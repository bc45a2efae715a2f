"""The server helper's shutdown: every process of the server's group is gone and its port is free
before the next server starts (a leftover scheduler would hold GPU memory and the port)."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import time

import pytest

from sglang_hs.launch.server import SGLangServer, ServerStartError, port_in_use

# A stand-in launcher: a child (like SGLang's scheduler) listens on the port and needs a second to
# shut down after SIGTERM; the launcher itself exits at once.
_LAUNCHER = textwrap.dedent("""
    import os, signal, socket, sys, time
    port = int(sys.argv[1])
    if os.fork() == 0:
        sock = socket.socket(); sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port)); sock.listen()
        signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.0), os._exit(0)))
        while True:
            time.sleep(0.1)
    time.sleep(60)
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_stop_waits_for_the_whole_process_group_and_the_port(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    port = free_port()
    server = SGLangServer(str(tmp_path), [], port, str(tmp_path / "log"))
    server.command = [sys.executable, "-c", _LAUNCHER, str(port)]
    server._wait_healthy = lambda: None
    with server:
        for _ in range(100):
            if port_in_use(port):
                break
            time.sleep(0.05)
        assert port_in_use(port)
        pgid = server.process.pid
    assert not port_in_use(port)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_refuses_a_port_in_use(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(ServerStartError, match="already in use"):
            SGLangServer(str(tmp_path), [], sock.getsockname()[1], str(tmp_path / "log"))


def test_leak_reports_count_sglang_and_store_ownership_lines(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    server = SGLangServer(str(tmp_path), [], free_port(), str(tmp_path / "log"))
    (tmp_path / "log").write_text(
        "[TP0] hierasparse: cache reset; the store held 3 compressed blocks, all owned by the tree\n"
        "[TP1] hierasparse: compressed store leak: 4 blocks in use at reset, the tree held 3\n"
        "token_to_kv_pool_allocator memory leak detected! available_size=1\n"
    )
    assert server.leak_reports() == 2


def test_server_check_sends_its_concurrent_chats_at_once():
    """``server_check --concurrent N``: N distinct questions over the shared prompt, all in flight together
    (a server's decode batch must reach shared-prefix decode's 8 requests), keyed ``concurrent/i``."""
    import threading

    from sglang_hs.launch.server_check import concurrent_chats

    class FakeServer:
        def __init__(self, n):
            self.barrier, self.questions = threading.Barrier(n, timeout=10), []

        def post(self, path, body):
            assert path == "/v1/chat/completions" and body["temperature"] == 0 and body["ignore_eos"]
            self.questions.append(body["messages"][1]["content"])
            self.barrier.wait()  # breaks (and fails the test) unless all n requests are in flight at once
            return {"choices": [{"message": {"content": "answer to " + body["messages"][1]["content"]}}]}

    server = FakeServer(12)
    out = concurrent_chats(server, "system prompt", 8, 12)
    assert list(out) == [f"concurrent/{i}" for i in range(12)] and len(set(server.questions)) == 12
    assert out["concurrent/5"].endswith("(variant 5)")


def test_server_check_explains_a_difference_as_a_near_tie_only_when_both_servers_nearly_tie():
    """``server_check``: two greedy answers that part where both choices are among each server's top
    two within the tie gap (an exact tie included) are a near tie; a wide gap on either server, a
    choice outside a server's top two, or an answer without logprobs is not."""
    from sglang_hs.launch.server_check import explain

    same = ("a", [("a", -0.1), ("b", -2.0)])
    base = [same, ("x", [("x", -0.70), ("y", -0.70)])]  # an exact tie, picked as x
    near = [same, ("y", [("y", -0.69), ("x", -0.70)])]
    assert explain(base, near, 0.05) == {"near_tie": True, "step": 1, "picks": ["x", "y"],
                                         "baseline_top": base[1][1], "ours_top": near[1][1], "gaps": [0.0, 0.01]}
    assert not explain(base, [same, ("y", [("y", -0.1), ("x", -0.9)])], 0.05)["near_tie"]  # ours is sure: 0.8 nats
    assert not explain(base, [same, ("y", [("y", -0.69), ("z", -0.70)])], 0.05)["near_tie"]  # x not in our top two
    assert explain(base, None, 0.05) == {"near_tie": False, "why": "no logprobs"}
    assert not explain(base, base, 0.05)["near_tie"]  # texts differ elsewhere: not explained


def test_server_check_records_the_rank_gqa_group(tmp_path):
    """The record's gqa_group is the kernels' group on one rank: replicated KV heads count once a rank."""
    import json

    from sglang_hs.launch.server_check import rank_gqa_group

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 14, "num_key_value_heads": 2}))
    assert rank_gqa_group(str(tmp_path), []) == 7
    assert rank_gqa_group(str(tmp_path), ["--tp-size=2"]) == 7
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 8, "num_key_value_heads": 2}))
    assert rank_gqa_group(str(tmp_path), ["--mem-fraction-static=0.3", "--tp-size=4"]) == 2


def test_tiny_model_takes_any_gqa_group(tmp_path):
    """make_model tiny --q-heads 2G --kv-heads 2 writes a model transformers loads and runs (the GQA=G server
    checks serve it); its hidden size follows the heads at head_dim 64."""
    import torch
    from transformers import LlamaForCausalLM

    from sglang_hs.launch.make_model import write_tiny

    write_tiny(str(tmp_path), layers=1, seed=0, q_heads=14, kv_heads=2)
    model = LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert (model.config.num_attention_heads, model.config.num_key_value_heads, model.config.hidden_size) == (14, 2, 896)
    logits = model(torch.tensor([[3, 4, 5, 6]])).logits
    assert logits.shape == (1, 4, 1024) and torch.isfinite(logits).all()


def test_a_difference_is_recorded_with_both_servers_logprobs():
    """server_check's mismatches: {"key", "tie", "logprobs"}; a tie needs both picks within tie_gap on both
    servers, otherwise the difference stays unexplained."""
    from sglang_hs.launch.server_check import explain, mismatch_entry

    base = [("a", [["a", -0.1], ["b", -3.0]]), ("c", [["c", -2.9132], ["d", -2.9132]])]
    ours = [("a", [["a", -0.1], ["b", -3.0]]), ("d", [["d", -2.9095], ["c", -2.9134]])]
    entry = mismatch_entry("frontend/2", explain(base, ours, tie_gap=0.05))
    assert entry["key"] == "frontend/2" and entry["tie"] is True
    assert entry["logprobs"]["step"] == 1 and entry["logprobs"]["picks"] == ["c", "d"]
    assert entry["logprobs"]["gaps"] == [0.0, 0.0039]
    far = [("a", [["a", -0.1], ["b", -3.0]]), ("d", [["d", -1.0], ["c", -2.0]])]
    assert mismatch_entry("k", explain(base, far, tie_gap=0.05))["tie"] is False
    assert mismatch_entry("k", explain(None, far, tie_gap=0.05)) == {"key": "k", "tie": False,
                                                                      "logprobs": {"why": "no logprobs"}}


@pytest.mark.parametrize("message, starts", [
    ("ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.08.", 3),
    ("ValueError: some other start failure", 1),
])  # fmt: skip
def test_a_start_is_retried_only_after_the_kv_pool_memory_race(tmp_path, monkeypatch, message, starts):
    """Servers started side by side on one GPU can see another's allocations while sizing their KV pool;
    only that failure is retried (twice), any other one is raised at once."""
    import sglang_hs.launch.server as server_module

    monkeypatch.setattr(server_module, "START_RETRY_DELAY_S", 0)
    (tmp_path / "config.json").write_text("{}")
    counter = tmp_path / "starts"
    server = SGLangServer(str(tmp_path), [], free_port(), str(tmp_path / "log"))
    server.command = [sys.executable, "-c",
                      f"open({str(counter)!r}, 'a').write('x'); print({message!r}); raise SystemExit(1)"]  # fmt: skip
    with pytest.raises(ServerStartError, match=message.split(":")[0]):
        with server:
            pass
    assert len(counter.read_text()) == starts
