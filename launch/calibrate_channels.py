"""Calibrate a model's K channel order (``--hierasparse-k-channel-order``) from plain text.

    python -m sglang_hs.launch.calibrate_channels --model-path MODEL [--out FILE] [--corpus DIR]
        [--chunks 8] [--chunk-tokens 2048] [--device cpu|cuda] [--dtype float32|bfloat16]

Runs the checkpoint (transformers) over ``--chunks`` windows of ``--chunk-tokens`` tokens of the
corpus (default: the licence texts of ``/usr/share/common-licenses``; any prose works) and measures,
per (layer, KV head) and channel, the post-RoPE key energy ``E[k_c^2]`` (past the 64-token sink) and
the query energy ``E[q_c^2]`` (summed over the KV head's query heads). The order ranks channels by
their product and deals them into groups of four, one per quarter of the ranking
(:func:`sglang_hs.channel_order.ranked_quarter_permutations`). Writes ``FILE`` (default
``MODEL/hierasparse_k_channel_order.pt``) and prints one progress line per chunk. SmolLM2-135M takes
about a minute on two CPU cores; a model that does not fit in host memory needs ``--device cuda``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from sglang_hs.channel_order import ChannelOrder, ranked_quarter_permutations

SINK_TOKENS = 64


def text_chunks(tokenizer, texts: list[str], chunks: int, chunk_tokens: int) -> list[list[int]]:
    """``chunks`` windows of ``chunk_tokens`` ids cut from the texts in order (each window starts at
    a text's beginning or continues the previous window's text)."""
    ids: list[int] = []
    out: list[list[int]] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        while len(ids) >= chunk_tokens and len(out) < chunks:
            out.append(ids[:chunk_tokens])
            ids = ids[chunk_tokens:]
        if len(out) == chunks:
            return out
    raise ValueError(f"the corpus holds {len(out)} windows of {chunk_tokens} tokens, fewer than --chunks {chunks}")


class EnergyMeter:
    """Accumulates per (layer, KV head, channel) key and query energies from attention inputs."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int):
        self.key = torch.zeros(layers, kv_heads, head_dim, dtype=torch.float64)
        self.query = torch.zeros(layers, kv_heads, head_dim, dtype=torch.float64)
        self.key_tokens = [0] * layers
        self.query_tokens = [0] * layers

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """``query [Hq, T, D]``, ``key [H, T, D]`` of one layer (post-RoPE)."""
        heads, tokens, dim = key.shape
        self.key[layer] += key[:, SINK_TOKENS:].double().square().sum(1).cpu()
        self.query[layer] += query.double().reshape(heads, -1, dim).square().sum(1).cpu()
        self.key_tokens[layer] += max(0, tokens - SINK_TOKENS)
        self.query_tokens[layer] += tokens

    def order(self) -> ChannelOrder:
        key = self.key / torch.tensor(self.key_tokens, dtype=torch.float64).clamp(min=1)[:, None, None]
        query = self.query / torch.tensor(self.query_tokens, dtype=torch.float64).clamp(min=1)[:, None, None]
        return ChannelOrder(ranked_quarter_permutations(key * query))


def calibrate(model_path: str, texts: list[str], chunks: int, chunk_tokens: int, device: str, dtype: str,
              log=print) -> ChannelOrder:  # fmt: skip
    """The K channel order of the checkpoint at ``model_path`` over ``chunks`` windows of ``texts``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_hs.launch.quality_reference import CalibrationCapture, register_capture_attention

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, dtype), attn_implementation=register_capture_attention()
    ).to(device).eval()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    meter = EnergyMeter(config.num_hidden_layers, config.num_key_value_heads, head_dim)
    capture = CalibrationCapture()
    capture.attach(model)
    capture.probe = meter
    started = time.time()
    with torch.no_grad():
        for i, ids in enumerate(text_chunks(tokenizer, texts, chunks, chunk_tokens)):
            model.model(input_ids=torch.tensor([ids], device=device), use_cache=False)
            log(f"[calibrate] {i + 1}/{chunks} windows of {chunk_tokens} tokens ({time.time() - started:.0f} s)")
    return meter.order()


def main(argv: list[str] | None = None) -> int:
    from sglang_hs.launch.head_calibration import load_calibration_texts
    from sglang_hs.launch.quality_inputs import MissingInput

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--out", help="output file (default MODEL/hierasparse_k_channel_order.pt)")
    parser.add_argument("--corpus", help="folder of text files (default: /usr/share/common-licenses)")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        print(f"calibrate_channels: --model-path {args.model_path} has no config.json", file=sys.stderr)
        return 2
    try:
        texts = load_calibration_texts(args.corpus)
        order = calibrate(args.model_path, texts, args.chunks, args.chunk_tokens, args.device, args.dtype)
    except (MissingInput, ValueError) as exc:
        print(f"calibrate_channels: {exc}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.model_path, "hierasparse_k_channel_order.pt")
    order.save(out, model=os.path.basename(os.path.normpath(args.model_path)), chunks=args.chunks,
               chunk_tokens=args.chunk_tokens, corpus=args.corpus or "/usr/share/common-licenses")  # fmt: skip
    layers, heads, dim = order.shape
    print(f"[calibrate] wrote {out}: K channel order for {layers} layers x {heads} KV heads x {dim} channels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
