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
server on any leaked slot) has run.

Every answer also returns each step's chosen token and two most likely tokens, so a difference can be
explained: at the first step where the two servers' greedy choices differ, it is a *near tie* when
each server has both choices among its two most likely tokens, within ``--tie-gap`` nats of each
other (two attention kernels round fp16 differently, and a batch's composition changes split counts,
so a near tie, or an exact one, can go either way; after it the texts part). The script exits
non-zero on any other difference (or one whose logprobs are missing), unless ``--allow-mismatch``
(used to show that the comparison can see a sparsity setting's effect); near ties are listed with
their gaps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from sglang_hs.launch.server import SGLangServer, device_name

TOP = 2  # most likely tokens returned a step
Steps = list[tuple[str, list[tuple[str, float]]]]  # per generated token: the choice, and the top (token, logprob)

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


def chat_steps(answer: dict) -> Steps | None:
    """Each step's choice and top tokens from an OpenAI chat answer asked with ``top_logprobs``."""
    content = (answer["choices"][0].get("logprobs") or {}).get("content")
    if not content:
        return None
    return [(step["token"], [(t["token"], float(t["logprob"])) for t in step.get("top_logprobs", [])[:TOP]])
            for step in content]  # fmt: skip


def meta_steps(meta: dict) -> Steps | None:
    """Each step's choice and top tokens from a ``/generate`` answer's ``meta_info`` (``return_logprob``,
    ``top_logprobs_num``: entries ``[logprob, token id, text]``), keyed by token id."""
    chosen, tops = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
    if not chosen or not tops:
        return None
    return [(str(pick[1]), [(str(entry[1]), float(entry[0])) for entry in (top or [])[:TOP]])
            for pick, top in zip(chosen, tops)]  # fmt: skip


def chat(server: SGLangServer, system_prompt: str, question: str, max_tokens: int) -> tuple[str, Steps | None]:
    answer = server.post("/v1/chat/completions", {
        "model": "default", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": True,
        "top_logprobs": TOP,
        "messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]})  # fmt: skip
    return answer["choices"][0]["message"]["content"], chat_steps(answer)


def concurrent_chats(server: SGLangServer, system_prompt: str, max_tokens: int, n: int,
                     steps: dict[str, Steps | None] | None = None) -> dict[str, str]:  # fmt: skip
    """``n`` greedy chat answers over ``system_prompt``, sent at once (question ``i`` is a variant of
    ``QUESTIONS[i % 4]``), keyed ``concurrent/i`` (their top tokens a step into ``steps``)."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(i: int) -> tuple[str, Steps | None]:
        return chat(server, system_prompt, f"{QUESTIONS[i % len(QUESTIONS)]} (variant {i})", max_tokens)

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(ask, range(n)))
    if steps is not None:
        steps.update({f"concurrent/{i}": top for i, (_, top) in enumerate(answers)})
    return {f"concurrent/{i}": text for i, (text, _) in enumerate(answers)}


def run_workload(server: SGLangServer, system_prompt: str, max_tokens: int, evict_between_rounds: float = 0.0,
                 prompt_words: int = 600, concurrent: int = 0,
                 steps: dict[str, Steps | None] | None = None) -> dict[str, str]:  # fmt: skip
    """Every greedy output of the workload, keyed by a stable name (and, into ``steps``, each one's
    top tokens a step, None where the server returned none)."""
    import sglang as sgl

    steps = {} if steps is None else steps
    outputs: dict[str, str] = {}
    for round_ in range(2):
        if round_ == 1 and evict_between_rounds > 0:
            sent = push_out_of_gpu(server, evict_between_rounds, prompt_words)
            print(f"[check] {sent} filler prompts between the rounds", flush=True)
        for i, question in enumerate(QUESTIONS):
            key = f"chat/{round_}/{i}"
            outputs[key], steps[key] = chat(server, system_prompt, question, max_tokens)
    for i, text in enumerate(["The capital of France is", system_prompt[:400] + " In summary,"]):
        answer = server.post("/generate", {
            "text": text, "return_logprob": True, "top_logprobs_num": TOP,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})  # fmt: skip
        outputs[f"generate/{i}"], steps[f"generate/{i}"] = answer["text"], meta_steps(answer["meta_info"])

    @sgl.function
    def answer_with_context(s, question):
        s += system_prompt + "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=max_tokens, temperature=0, ignore_eos=True, return_logprob=True,
                     top_logprobs_num=TOP)  # fmt: skip

    sgl.set_default_backend(sgl.RuntimeEndpoint(server.base_url))
    states = answer_with_context.run_batch([{"question": q} for q in QUESTIONS], num_threads=len(QUESTIONS))
    for i, state in enumerate(states):
        outputs[f"frontend/{i}"] = state["answer"]
        steps[f"frontend/{i}"] = meta_steps(state.get_meta_info("answer") or {})
    if concurrent:
        outputs.update(concurrent_chats(server, system_prompt, max_tokens, concurrent, steps))
    server.post("/flush_cache")
    time.sleep(2)  # let the scheduler go idle: its memory check runs then
    answer = server.post("/generate", {"text": "After the flush,", "sampling_params": {"max_new_tokens": 4}})
    outputs["after_flush"] = answer["text"]
    return outputs


def explain(baseline: Steps | None, ours: Steps | None, tie_gap: float) -> dict:
    """Where two greedy answers part: the first step whose choices differ, both servers' top tokens
    there, and whether it is a near tie: each server has both choices among its top tokens, within
    ``tie_gap`` of each other (``gaps``: the baseline's, ours). Exact ties are common: a greedy pick
    between equal logprobs may go either way."""
    if not baseline or not ours:
        return {"near_tie": False, "why": "no logprobs"}
    for step, ((pick_a, top_a), (pick_b, top_b)) in enumerate(zip(baseline, ours)):
        if pick_a != pick_b:
            gaps = []
            for top in (top_a, top_b):
                lp = dict(top)
                gaps.append(round(abs(lp[pick_a] - lp[pick_b]), 5) if pick_a in lp and pick_b in lp else None)
            near = all(g is not None and g <= tie_gap for g in gaps)
            return {"near_tie": near, "step": step, "picks": [pick_a, pick_b], "baseline_top": top_a, "ours_top": top_b,
                    "gaps": gaps}  # fmt: skip
    return {"near_tie": False, "why": "the texts differ but no step's choice does"}


def mismatch_entry(key: str, why: dict) -> dict:
    """A record's account of one differing output: ``{"key", "tie", "logprobs"}``, ``logprobs`` holding
    :func:`explain`'s step, picks, both servers' top tokens and their gaps."""
    return {"key": key, "tie": why["near_tie"], "logprobs": {k: v for k, v in why.items() if k != "near_tie"}}


def rank_gqa_group(model_path: str, common_args: list[str]) -> int:
    """Query heads per KV head on one rank, as the kernels see them (KV heads fewer than the ranks are
    replicated: one a rank)."""
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    tp = next((int(arg.split("=", 1)[1]) for arg in common_args if arg.startswith("--tp-size=")), 1)
    q_heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", q_heads)
    return (q_heads // tp) // max(kv_heads // tp, 1)


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
    parser.add_argument("--tie-gap", type=float, default=0.05, metavar="NATS",
                        help="a difference is a near tie when both choices are within this of each other on both servers")
    args = parser.parse_args(argv)

    system_prompt = shared_prompt(args.prompt_words)
    runs = {
        args.baseline: ["--attention-backend", args.baseline, "--page-size", "64"],
        "hierasparse": ["--attention-backend", "hierasparse", *args.hs_arg],
    }
    results, steps = {}, {}
    if args.baseline_from:
        with open(args.baseline_from) as f:
            earlier = json.load(f)["results"]
        results[args.baseline] = earlier[args.baseline]
        steps[args.baseline] = earlier.get("top_tokens", {}).get(args.baseline, {})
        del runs[args.baseline]
    for name, backend_args in runs.items():
        print(f"[check] === {name} ===", flush=True)
        log_path = f"{args.log_prefix}_{name}.log"
        with SGLangServer(args.model_path, backend_args + args.common_arg, args.port, log_path) as server:
            steps[name] = {}
            results[name] = run_workload(server, system_prompt, args.max_tokens, args.evict_between_rounds,
                                         args.prompt_words, args.concurrent, steps[name])  # fmt: skip
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
    why = {key: explain(steps[args.baseline].get(key), steps["hierasparse"].get(key), args.tie_gap) for key in mismatches}
    unexplained = [key for key in mismatches if not why[key]["near_tie"]]
    results["top_tokens"] = steps
    summary = {
        "baseline": args.baseline,
        "gqa_group": rank_gqa_group(args.model_path, args.common_arg),
        "device": device_name(),
        "hs_args": args.hs_arg,
        "outputs": len(baseline) - 1,
        # Each difference with both servers' top logprobs where the answers part; tie: a near tie (below).
        "mismatches": [mismatch_entry(key, why[key]) for key in mismatches],
        "tie_gap": args.tie_gap,
        "unexplained_mismatches": unexplained,
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
    return 1 if results["problems"] or (unexplained and not args.allow_mismatch) else 0


if __name__ == "__main__":
    sys.exit(main())
