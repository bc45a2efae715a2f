"""Write local Llama-architecture models for serving tests, with no model hub.

    python -m sglang_hs.launch.make_model tiny OUT      # small random-weight model, weights written
    python -m sglang_hs.launch.make_model llama8b OUT   # Llama-3.1-8B config only: serve with --load-format dummy
    python -m sglang_hs.launch.make_model llama70b OUT  # Llama-3.1-70B config only (GQA group 8; TP 4 or 8)

Both get a byte-level BPE tokenizer trained here on a built-in corpus and a chat template, so
SGLang's OpenAI API and frontend language work. Real checkpoints need none of this: pass their
folder to ``--model-path`` as usual.
"""

from __future__ import annotations

import argparse
import json
import os

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# Llama-3.1-70B differs from 8B only in size: 64 query heads over 8 KV heads (a GQA group of 8, 2 KV
# heads a rank at TP 4), 80 layers.
LLAMA_31_70B = {
    **LLAMA_31_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat watches from the window.",
    "Question: what is the capital of France? Answer: Paris is the capital of France.",
    "Shared prefixes such as system prompts, documents and few-shot examples are reused by many requests.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \"",
    "Once upon a time, in a city by the sea, there lived a programmer who loved fast inference.",
]
_SPECIALS = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(out: str, vocab_size: int) -> None:
    """Train a byte-level BPE tokenizer (ids 0,1,2 = <s>, </s>, <unk>) and save it in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 100, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    wrapped.chat_template = _CHAT_TEMPLATE
    wrapped.save_pretrained(out)


def write_tiny(out: str, layers: int, seed: int, q_heads: int = 8, kv_heads: int = 2) -> None:
    """A 2-layer Llama with head_dim 64 (the smallest shape the kernels take) and fp16 weights;
    ``q_heads`` / ``kv_heads`` set its GQA group (8 / 2 = 4 by default).

    At the default init a random model's greedy output hardly depends on its context (it repeats
    one token). Scaling the query/key projections by 3 (sharper attention), value/output by 2 and
    the output head by 4 gives outputs that change when early context changes, yet are identical
    between fp16 and fp32 arithmetic on this CPU (checked for the server check's prompts): comparing
    greedy outputs between backends then tests attention, not rounding.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    write_tokenizer(out, vocab_size=1024)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=64 * q_heads,  # 512 at the default 8 heads; transformers wants a multiple of the heads
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=32768,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="float16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj, scale in (("q_proj", 3.0), ("k_proj", 3.0), ("v_proj", 2.0), ("o_proj", 2.0)):
                getattr(layer.self_attn, proj).weight.mul_(scale)
        model.lm_head.weight.mul_(4.0)
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)


def write_llama_config(out: str, config: dict) -> None:
    """A Llama-3.1 config.json plus a local tokenizer; SGLang's --load-format dummy fills weights."""
    write_tokenizer(out, vocab_size=2048)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**config, "bos_token_id": 0, "eos_token_id": 1}, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["tiny", "llama8b", "llama70b"])
    parser.add_argument("out", help="output folder (created)")
    parser.add_argument("--layers", type=int, default=2, help="tiny: number of layers")
    parser.add_argument("--seed", type=int, default=0, help="tiny: weight seed")
    parser.add_argument("--q-heads", type=int, default=8, help="tiny: query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="tiny: KV heads (a divisor of --q-heads)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.kind == "tiny":
        if args.q_heads % args.kv_heads:
            parser.error(f"--kv-heads {args.kv_heads} does not divide --q-heads {args.q_heads}")
        write_tiny(args.out, args.layers, args.seed, args.q_heads, args.kv_heads)
    else:
        write_llama_config(args.out, LLAMA_31_8B if args.kind == "llama8b" else LLAMA_31_70B)
    print(f"wrote {args.kind} model to {args.out}: {sorted(os.listdir(args.out))}")


if __name__ == "__main__":
    main()
