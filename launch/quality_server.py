"""The server backend of the quality evaluation (``python -m sglang_hs.launch.eval_quality --backend
server``): the same questions and windows through real SGLang servers, one per setting. The
evaluation's module docstring says what is measured and how."""

from __future__ import annotations

import math

from sglang_hs.launch.quality_inputs import MissingInput, PrefixGeometry, Sample, Setting, Window
from sglang_hs.launch.quality_report import Progress, needle_record
from sglang_hs.launch.server_check import TOP, Steps, meta_steps
from sglang_hs.config import FP8_KERNELS, HieraSparseConfig
from sglang_hs.pruner import PRUNERS


# ===================================================================================== server backend
class ServerBackend:
    """The same evaluation through SGLang servers: one dense baseline, then one server per setting."""

    name = "server"

    def __init__(self, model_path: str, geometry: PrefixGeometry, port: int, dense_backend: str,
                 server_args: list[str], log_prefix: str, top_k: int, max_len: int):  # fmt: skip
        from transformers import AutoTokenizer

        self.model_path, self.geometry, self.port = model_path, geometry, port
        self.dense_backend, self.server_args, self.log_prefix, self.top_k = dense_backend, server_args, log_prefix, top_k
        self.chunk = max(8192, 1 << (max_len - 1).bit_length())
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.support: dict[str, list[int]] = {}  # fidelity window -> token ids U (from the dense server)
        self.dense_outputs: dict[tuple[str, int], str] = {}
        self.dense_fidelity: dict[str, tuple[list[dict[int, float]], list[int]]] = {}  # window -> (dists, top-1)
        # --k-head-map: (file, share of (layer, head) pairs that store K 2:4) for the hierasparse servers
        self.k_head_map: tuple[str, float] | None = None
        # --decode-anchors/-topk/-tau: the flags of every setting with a decode mode (mode=kascade|psa)
        self.decode_mode_flags: dict[str, object] = {}

    def launch_args(self, setting: Setting) -> list[str]:
        g = self.geometry
        common = ["--page-size", str(g.block), "--chunked-prefill-size", str(self.chunk),
                  "--max-prefill-tokens", str(self.chunk), *self.server_args]  # fmt: skip
        if setting.is_dense:
            kv = [] if setting.kv == "auto" else ["--kv-cache-dtype", setting.kv]
            return ["--attention-backend", self.dense_backend, *kv, *common]
        flags = {
            "sk-prefill": setting.sk, "sv-prefill": setting.sv, "sk-decode": setting.sk, "sv-decode": setting.sv,
            "pruner": setting.pruner, "sink-tokens": g.sink, "window-tokens": g.window,
            "block-size": g.block, "dense-backend": self.dense_backend,
        }  # fmt: skip
        if self.k_head_map is not None:
            flags["k-head-map"] = self.k_head_map[0]
        if setting.mode != "full":
            flags.update({"decode-mode": setting.mode, **self.decode_mode_flags})
        # FP8 store values and FP8 pages: the server's kernels that take FP8 KV (the compressor is PyTorch's);
        # the last --hierasparse-kernels wins.
        fp8 = [] if setting.store == "auto" else [f"--hierasparse-store-dtype={setting.store}"]
        fp8 += [] if setting.kv == "auto" else ["--kv-cache-dtype", setting.kv]
        fp8 += [f"--hierasparse-kernels={self.fp8_kernels()}"] if fp8 else []
        return ["--attention-backend", "hierasparse", *[f"--hierasparse-{k}={v:g}" if isinstance(v, float) else
                f"--hierasparse-{k}={v}" for k, v in flags.items()], *common, *fp8]  # fmt: skip

    def fp8_kernels(self) -> str:
        """The kernels of the servers' ``--hierasparse-kernels`` (SGLang's default without one) that take FP8
        KV, or ``none``."""
        given = [a.split("=", 1)[1] for a in self.server_args if a.startswith("--hierasparse-kernels=")]
        names = (given[-1] if given else HieraSparseConfig.kernels).split(",")
        return ",".join(k for k in names if k in FP8_KERNELS) or "none"

    def evaluate(self, settings: list[Setting], samples: list[Sample], windows: list[Window]) -> list[dict]:
        from sglang_hs.launch.server import SGLangServer

        if not settings or not settings[0].is_baseline:
            raise ValueError("the server backend needs the dense 16-bit setting first (it is the reference)")
        runnable = [s for s in settings if s.is_dense or s.pruner in PRUNERS]
        for s in settings:
            if s not in runnable:
                print(f"[eval server] skip {s.name}: the server has no such pruner", flush=True)
        records: list[dict] = []
        progress = Progress(len(runnable) * (len(samples) + len(windows)), "eval server")
        for setting in runnable:
            log = f"{self.log_prefix}_{setting.name.replace(':', '_').replace(',', '_')}.log"
            with SGLangServer(self.model_path, self.launch_args(setting), self.port, log) as server:
                check_prompt_lengths(server, samples, windows)
                for sample in samples:
                    self._prime(server, sample.prefix_ids)
                    for qi, question in enumerate(sample.questions):
                        text, steps = self._answer(server, sample.prefix_ids + question.suffix_ids,
                                                   question.max_new_tokens)  # fmt: skip
                        key = (sample.name, qi)
                        if setting.is_baseline:
                            self.dense_outputs[key] = text
                        records.append(needle_record(setting, sample, qi, question, text, text == self.dense_outputs[key],
                                                     self.geometry, {"steps": steps}))  # fmt: skip
                    progress.step(f"{setting.name} {sample.name}")
                for window in windows:
                    self._prime(server, window.prefix_ids)
                    records.append(self._fidelity(server, setting, window))
                    progress.step(f"{setting.name} {window.name}")
                if self.k_head_map is not None and not setting.is_dense:
                    for record in records:  # what the report's effective S_K scales by
                        if record["setting"] == setting.name:
                            record["k_head_share"] = self.k_head_map[1]
                problems = [line for line in server.log_text().splitlines() if "leak" in line.lower() or "Traceback" in line]
                if problems:
                    raise RuntimeError(f"server {setting.name} logged problems: {problems[:3]}")
        return records

    @staticmethod
    def _prime(server, prefix_ids: list[int]) -> None:
        """Empty the cache, then let the prefix alone enter the radix tree (where it is compressed)."""
        # SGLang flushes only when idle (400 otherwise); ``timeout`` lets it wait for the last request.
        server.post("/flush_cache?timeout=30")
        server.post("/generate", {"input_ids": prefix_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})

    def _answer(self, server, input_ids: list[int], max_new_tokens: int) -> tuple[str, Steps | None]:
        """The greedy answer, and each step's choice and two most likely tokens: where two runs' answers
        part, :func:`~sglang_hs.launch.quality_report.compare_runs` tells a near tie from a real change."""
        reply = server.post("/generate", {"input_ids": input_ids, "return_logprob": True, "top_logprobs_num": TOP,
                                          "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})  # fmt: skip
        steps = meta_steps(reply.get("meta_info", {}))
        if reply.get("output_ids") is not None:
            return self.tokenizer.decode(reply["output_ids"], skip_special_tokens=True), steps
        return reply["text"], steps

    def _logprobs(self, server, window: Window, token_ids: list[int] | None) -> dict:
        payload = {
            "input_ids": window.prefix_ids + window.continuation_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "logprob_start_len": len(window.prefix_ids) - 1,
            "top_logprobs_num": self.top_k if token_ids is None else 1,
        }  # fmt: skip
        if token_ids is not None:
            payload["token_ids_logprob"] = token_ids
        return server.post("/generate", payload)["meta_info"]

    def _fidelity(self, server, setting: Setting, window: Window) -> dict:
        n = len(window.continuation_ids)
        if setting.is_baseline:
            top = self._logprobs(server, window, None)["input_top_logprobs"][-n:]
            self.support[window.name] = sorted({int(t[1]) for pos in top for t in pos} | set(window.continuation_ids))
        meta = self._logprobs(server, window, self.support[window.name])
        dist = [{int(t[1]): float(t[0]) for t in pos} for pos in meta["input_token_ids_logprobs"][-n:]]
        top1 = [int(pos[0][1]) for pos in meta["input_top_logprobs"][-n:]]
        nll = [-float(t[0]) for t in meta["input_token_logprobs"][-n:]]
        if setting.is_baseline:
            self.dense_fidelity[window.name] = (dist, top1)
        p_dist, p_top1 = self.dense_fidelity[window.name]
        kls = [coarse_kl(p, q) for p, q in zip(p_dist, dist)]
        return {
            "kind": "fidelity", "setting": setting.name, "length": window.length, "window": window.index,
            "prefix_tokens": len(window.prefix_ids), "tokens": n, "kl": sum(kls) / n, "kl_max": max(kls),
            "top1": sum(a == b for a, b in zip(top1, p_top1)) / n, "nll": sum(nll) / n,
            "kl_support": len(self.support[window.name]),
        }  # fmt: skip


def check_prompt_lengths(server, samples: list[Sample], windows: list[Window]) -> None:
    """Refuse before any request when the longest prompt exceeds what the server takes (its
    context length less a few tokens): SGLang would answer that request with HTTP 400."""
    from sglang_hs.launch.server import http_json

    limit = http_json(server.base_url + "/server_info", method="GET").get("max_req_input_len")
    prompts = [len(s.prefix_ids) + len(q.suffix_ids) for s in samples for q in s.questions]
    prompts += [len(w.prefix_ids) + len(w.continuation_ids) for w in windows]
    if limit and prompts and max(prompts) > limit:
        raise MissingInput(f"the longest prompt has {max(prompts)} tokens, the server takes {limit}: "
                           "pass --lengths below the model's context length")  # fmt: skip


def coarse_kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) over the tokens of ``p`` plus one bin for the rest (natural-log probabilities)."""
    kl, p_in, q_in = 0.0, 0.0, 0.0
    for token, lp in p.items():
        lq = q.get(token, -math.inf)
        kl += math.exp(lp) * (lp - lq) if lq > -math.inf else math.inf
        p_in, q_in = p_in + math.exp(lp), q_in + math.exp(lq)
    p_rest, q_rest = max(0.0, 1 - p_in), max(1e-30, 1 - q_in)
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(0.0, kl)
