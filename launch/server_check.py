"""Serve the same prompts on a dense backend and on hierasparse; compare greedy outputs.

    python -m sglang_hs.launch.server_check --model-path /tmp/tiny --out check.json \
        [--baseline triton] [--hs-arg=--hierasparse-sv-prefill=0] [--allow-mismatch]

Each server gets OpenAI chat completions (a long shared system prompt and distinct questions, each
sent twice so the second round hits the radix cache), two plain ``/generate`` prompts, and one
SGLang frontend-language program (``sgl.function`` + ``run_batch`` over a shared prefix), and with
``--concurrent N`` N chat requests over the shared prompt at once (decode batches large enough for
``--hierasparse-shared-prefix-decode on``'s column sets, given ``--cuda-graph-max-bs`` >= N). All
sampling is greedy and ignores EOS, so every answer has ``--max-tokens`` tokens. With
``--evict-between-rounds X`` distinct filler prompts of X times the server's KV capacity
(``max_total_num_tokens``) pass between the two chat rounds, so the second round finds the shared
prompt evicted from the GPU: with ``--enable-hierarchical-cache`` it is loaded back from the host
tier (the ``loaded=`` count of the tree-state lines), otherwise prefilled again. Afterwards the
cache is flushed and one more request is served, so SGLang's idle memory check (which stops the
server on any leaked slot) has run. The script exits non-zero when any output differs, unless
``--allow-mismatch`` (used to show that the comparison can see a sparsity setting's effect).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from sglang_hs.launch.server import SGLangServer

QUESTIONS = [
    "What is the capital of France?",
    "Write a function that adds two numbers.",
    "Count from one to ten.",
    "Tell me a story about a fox.",
]
_WORDS = (
    "the quick brown fox jumps over lazy dog while cat watches from window shared prefixes such as "
    "system prompts documents and few shot examples are reused by many requests once upon a time "
    "in city by sea there lived programmer who loved fast inference"
).split()


def shared_prompt(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "You are a helpful assistant. " + " ".join(rng.choice(_WORDS) for _ in range(n_words)) + "\n"


def push_out_of_gpu(server: SGLangServer, times_capacity: float, prompt_words: int) -> int:
    """Send distinct filler prompts (one output token each) until ``times_capacity`` times the
    server's KV capacity has been prefilled; returns how many were sent."""
    from sglang_hs.launch.server import http_json

    capacity = int(http_json(server.base_url + "/get_server_info").get("max_total_num_tokens", 0))
    sent = tokens = 0
    while tokens < times_capacity * capacity:
        sent += 1
        answer = server.post("/generate", {"text": shared_prompt(prompt_words, seed=1000 + sent),
                                           "sampling_params": {"max_new_tokens": 1, "temperature": 0}})  # fmt: skip
        tokens += int(answer["meta_info"].get("prompt_tokens", 0)) or prompt_words
    return sent


def concurrent_chats(server: SGLangServer, system_prompt: str, max_tokens: int, n: int) -> dict[str, str]:
    """``n`` greedy chat answers over ``system_prompt``, sent at once (question ``i`` is a variant of
    ``QUESTIONS[i % 4]``), keyed ``concurrent/i``."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(i: int) -> str:
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (variant {i})"
        answer = server.post("/v1/chat/completions", {
            "model": "default", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]})  # fmt: skip
        return answer["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(n) as pool:
        return {f"concurrent/{i}": text for i, text in enumerate(pool.map(ask, range(n)))}


def run_workload(server: SGLangServer, system_prompt: str, max_tokens: int, evict_between_rounds: float = 0.0,
                 prompt_words: int = 600, concurrent: int = 0) -> dict[str, str]:  # fmt: skip
    """Every greedy output of the workload, keyed by a stable name."""
    import sglang as sgl

    outputs: dict[str, str] = {}
    for round_ in range(2):
        if round_ == 1 and evict_between_rounds > 0:
            sent = push_out_of_gpu(server, evict_between_rounds, prompt_words)
            print(f"[check] {sent} filler prompts between the rounds", flush=True)
        for i, question in enumerate(QUESTIONS):
            answer = server.post(
                "/v1/chat/completions",
                {
                    "model": "default",
                    "messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            outputs[f"chat/{round_}/{i}"] = answer["choices"][0]["message"]["content"]
    for i, text in enumerate(["The capital of France is", system_prompt[:400] + " In summary,"]):
        answer = server.post(
            "/generate",
            {"text": text, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}},
        )
        outputs[f"generate/{i}"] = answer["text"]

    @sgl.function
    def answer_with_context(s, question):
        s += system_prompt + "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=max_tokens, temperature=0, ignore_eos=True)

    sgl.set_default_backend(sgl.RuntimeEndpoint(server.base_url))
    states = answer_with_context.run_batch([{"question": q} for q in QUESTIONS], num_threads=len(QUESTIONS))
    for i, state in enumerate(states):
        outputs[f"frontend/{i}"] = state["answer"]
    if concurrent:
        outputs.update(concurrent_chats(server, system_prompt, max_tokens, concurrent))
    server.post("/flush_cache")
    time.sleep(2)  # let the scheduler go idle: its memory check runs then
    answer = server.post("/generate", {"text": "After the flush,", "sampling_params": {"max_new_tokens": 4}})
    outputs["after_flush"] = answer["text"]
    return outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--baseline", default="triton", help="dense --attention-backend to compare with")
    parser.add_argument("--hs-arg", action="append", default=[], help="extra server flag for hierasparse")
    parser.add_argument("--common-arg", action="append", default=[], help="extra server flag for both servers")
    parser.add_argument("--prompt-words", type=int, default=600, help="shared system prompt length in words")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--out", default="server_check.json")
    parser.add_argument("--allow-mismatch", action="store_true", help="report differences, exit 0")
    parser.add_argument("--baseline-from", help="reuse the baseline outputs of an earlier --out JSON")
    parser.add_argument("--log-prefix", default="/tmp/server_check")
    parser.add_argument("--evict-between-rounds", type=float, default=0.0, metavar="X",
                        help="between the chat rounds, prefill filler prompts of X times the KV capacity")
    parser.add_argument("--concurrent", type=int, default=0, metavar="N",
                        help="then N chat requests over the shared prompt at once (shared-prefix decode's batches)")
    args = parser.parse_args(argv)

    system_prompt = shared_prompt(args.prompt_words)
    runs = {
        args.baseline: ["--attention-backend", args.baseline, "--page-size", "64"],
        "hierasparse": ["--attention-backend", "hierasparse", *args.hs_arg],
    }
    results = {}
    if args.baseline_from:
        with open(args.baseline_from) as f:
            results[args.baseline] = json.load(f)["results"][args.baseline]
        del runs[args.baseline]
    for name, backend_args in runs.items():
        print(f"[check] === {name} ===", flush=True)
        log_path = f"{args.log_prefix}_{name}.log"
        with SGLangServer(args.model_path, backend_args + args.common_arg, args.port, log_path) as server:
            results[name] = run_workload(server, system_prompt, args.max_tokens, args.evict_between_rounds,
                                         args.prompt_words, args.concurrent)  # fmt: skip
            if name == "hierasparse":
                log = server.log_text().splitlines()
                results["hierasparse_log_lines"] = [line for line in log if "hierasparse" in line.lower()][-10:]
                results["status_lines"] = [line for line in log if "#hs compressed token" in line][-10:]
                # With shared-prefix decode: the share of decoded requests read through column sets.
                results["shared_decode_lines"] = [line for line in log if "hs shared-decode grouped" in line][-3:]
                results["problems"] = [line for line in log if "leak" in line.lower() or "Traceback" in line]
                # One line per rank at the flush: its compressed blocks, all owned by its tree.
                results["store_reset_lines"] = [line for line in log if "hierasparse: cache reset" in line][-8:]
                # With --enable-hierarchical-cache: the host tier's ownership line per rank at the flush.
                results["host_reset_lines"] = [line for line in log if "hierasparse: host tier at reset" in line][-8:]
                results.update(server.rank_states())
    baseline, ours = results[args.baseline], results["hierasparse"]
    mismatches = sorted(key for key in baseline if baseline[key] != ours.get(key) and key != "after_flush")
    summary = {
        "baseline": args.baseline,
        "hs_args": args.hs_arg,
        "outputs": len(baseline) - 1,
        "mismatches": mismatches,
        "status_lines": results["status_lines"][-3:],
        "shared_decode_lines": results.get("shared_decode_lines", []),
        "problems": results["problems"],
        "store_reset_lines": results["store_reset_lines"],
        "host_reset_lines": results["host_reset_lines"],
        "rank_tree_states": results.get("rank_tree_states"),
        "ranks_in_step": results.get("ranks_in_step"),
    }
    with open(args.out, "w") as f:
        json.dump({**summary, "results": results}, f, indent=2)
    print(json.dumps(summary, indent=2))
    for key in list(baseline)[:3]:
        print(f"[check] {key}: {baseline[key]!r}")
    return 1 if results["problems"] or (mismatches and not args.allow_mismatch) else 0


if __name__ == "__main__":
    sys.exit(main())
