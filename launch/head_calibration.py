"""Retrieval-head calibration: how much each (layer, KV head) attends to the tokens a retrieval needs,
on synthetic prompts; ``calibrate_heads`` turns the scores into a K head map
(:class:`sglang_hs.k_head_map.KHeadMap`, ``--hierasparse-k-head-map``).

A cached prefix serves future questions the compressor never sees, and pruning K 2:4 everywhere
stops retrieval (needle accuracy falls to a few percent). Retrieval, however, runs through a few
heads (Wu et al. 2024, "Retrieval Head"; DuoAttention; HARD-KV): this module finds them on
synthetic calibration prompts that share nothing with the evaluation.

A *probe* is a prompt plus, for some query positions, the key positions whose attention mass counts
(:func:`needle_probes`, :func:`copy_probes`). A head's score is that mass, summed over the query heads
of its KV head (GQA group), averaged over query positions and prompts (:func:`calibrate`). Two probe
families:

- ``needle``: a pass key hidden in filler text at a given depth, then the question; queries are the
  question's tokens, targets the needle's tokens;
- ``copy`` (needle-free, KVzip-style context reconstruction): the prompt asks to continue a passage
  quoted from the filler and the answer is that passage, teacher-forced; each answer token's query
  targets the filler position of the token it must copy next. Any text works.

Each family also yields a ``*_drop`` score: the mass lost when that head's K is 2:4 pruned
(magnitude) on the blocks the server would compress, with the dense model's queries.
:func:`calibrate` also accumulates each KV head's query second moment ``E[q qᵀ]`` (post-RoPE, over
its query heads) and the keys' channel energies.

Calibration never sees the evaluation: its random streams are keyed under :data:`SEED_NAMESPACE`,
its prompt lengths and depths are its own (:class:`CalibrationSpec`), and its filler text is
whatever the caller passes (by default the licence texts of :data:`CALIBRATION_CORPUS`, which the
essays used as evaluation haystacks do not contain).
"""

from __future__ import annotations

import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from sglang_hs.launch.quality_inputs import MissingInput
from sglang_hs.pruner import top2_of_4

CALIBRATION_CORPUS = "/usr/share/common-licenses"
"""Default calibration filler: licence texts (Debian's ``base-files``), disjoint from the essays."""
SEED_NAMESPACE = "head-calibration"
"""Prefix of every calibration random stream key (the evaluation's keys start with a number)."""
SCORE_NAMES = ("needle", "needle_drop", "copy", "copy_drop")
_QUESTION_MARK = "\x00QUESTION\x00"
PASSKEY_INSTRUCTION = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize "
                       "it. I will ask you about it afterwards.\n\n")  # fmt: skip
COPY_INSTRUCTION = "Read the following document carefully.\n\n"


# ===================================================================================== probes
@dataclass(frozen=True)
class Probe:
    """One calibration prompt: ``ids``; for each scored query position ``queries[i]``, the key
    positions ``[start, end)`` of ``targets[i]`` whose attention mass counts. ``prefix_len`` is the
    part a server would cache (the document), the rest is the question (and teacher-forced answer)."""

    kind: str
    ids: tuple[int, ...]
    queries: tuple[int, ...]
    targets: tuple[tuple[int, int], ...]
    prefix_len: int
    length: int
    depth: float
    seed_key: str


@dataclass(frozen=True)
class CalibrationSpec:
    """Lengths (prompt tokens) and depths of the calibration prompts; none is used by the
    evaluation (its lengths are 1K/2K/4K and held-out ones; see the tests)."""

    needle_lengths: tuple[int, ...] = (1536, 2560)
    needle_depths: tuple[float, ...] = (0.1, 0.35, 0.6, 0.85)
    copy_lengths: tuple[int, ...] = (1536, 2560)
    copy_depths: tuple[float, ...] = (0.15, 0.4, 0.65, 0.9)
    copy_tokens: int = 96  # teacher-forced answer length of a copy probe
    quote_tokens: int = 12  # tokens of the passage quoted in the copy question (not scored)
    seed: int = 0

    def seed_key(self, kind: str, length: int, index: int) -> str:
        return f"{SEED_NAMESPACE}/{self.seed}/{kind}/{length}/{index}"


class ProbeBuilder:
    """Builds probes from a tokenizer (``tokenizer(text, add_special_tokens=False)`` and, if it has
    one, ``apply_chat_template``) and filler texts. Pieces are tokenized apart and concatenated as
    ids, so every position is exact."""

    def __init__(self, tokenizer, texts: Iterable[str]):
        self.tok = tokenizer
        sentences = [s for text in texts for s in re.split(r"(?<=[.!?;:])\s+", " ".join(text.split())) if len(s) > 1]
        if not sentences:
            raise ValueError("calibration needs some filler text")
        self.sentences = [self.encode(" " + s) for s in sentences]

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def chat(self, question: str, answer_prefix: str) -> tuple[list[int], list[int]]:
        """(ids before the user's document, ids after it up to the answer): the user turn holds the
        document then ``question``; the assistant turn opens with ``answer_prefix``."""
        if getattr(self.tok, "chat_template", None):
            rendered = self.tok.apply_chat_template([{"role": "user", "content": _QUESTION_MARK}], tokenize=False,
                                                    add_generation_prompt=True)  # fmt: skip
            head, tail = rendered.split(_QUESTION_MARK)
            return self.encode(head), self.encode("\n" + question + tail + answer_prefix)
        return [], self.encode("\n" + question + "\nAnswer:" + answer_prefix)

    def filler(self, rng: random.Random, n_tokens: int) -> list[list[int]]:
        """Consecutive sentences (token ids each) from a random start, about ``n_tokens`` in all."""
        start, out, total = rng.randrange(len(self.sentences)), [], 0
        while total < n_tokens:
            sentence = self.sentences[(start + len(out)) % len(self.sentences)]
            if total + len(sentence) > n_tokens and out:
                break
            out.append(sentence)
            total += len(sentence)
        return out

    def needle(self, spec: CalibrationSpec, length: int, depth: float, index: int) -> Probe:
        key = spec.seed_key("needle", length, index)
        rng = random.Random(key)
        passkey = str(rng.randrange(10_000, 100_000))
        needle = self.encode(f" The pass key is {passkey}. Remember it. {passkey} is the pass key.")
        head, tail = self.chat("What is the pass key?", " The pass key is")
        head = head + self.encode(PASSKEY_INSTRUCTION)
        sentences = self.filler(rng, length - len(head) - len(needle) - len(tail) - 8)
        at = round(depth * len(sentences))
        before = [t for s in sentences[:at] for t in s]
        after = [t for s in sentences[at:] for t in s]
        ids = head + before + needle + after
        start = len(head) + len(before)
        queries = tuple(range(len(ids), len(ids) + len(tail)))
        return Probe("needle", tuple(ids + tail), queries, ((start, start + len(needle)),) * len(queries), len(ids),
                     length, depth, key)  # fmt: skip

    def copy(self, spec: CalibrationSpec, length: int, depth: float, index: int) -> Probe:
        key = spec.seed_key("copy", length, index)
        rng = random.Random(key)
        answer_len = spec.copy_tokens
        head = self.encode(COPY_INSTRUCTION)
        probe_tail_guess = 40 + spec.quote_tokens * 2
        doc = [t for s in self.filler(rng, length - len(head) - answer_len - probe_tail_guess - 24) for t in s]
        span = min(max(0, round(depth * len(doc))), len(doc) - answer_len - 1)
        quote = self.tok.decode(doc[span : span + spec.quote_tokens]).strip()
        chat_head, tail = self.chat(f'Continue the passage of the document that starts with "{quote}", word for word.', "")
        ids = chat_head + head + doc
        start = len(chat_head) + len(head) + span  # document position of the answer's first token
        prompt = ids + tail
        answer = doc[span : span + answer_len]
        # Answer token j sits at len(prompt) + j and predicts answer token j + 1 = document token start + j + 1.
        queries = tuple(len(prompt) + j for j in range(spec.quote_tokens, answer_len - 1))
        targets = tuple((start + j + 1, start + j + 2) for j in range(spec.quote_tokens, answer_len - 1))
        return Probe("copy", tuple(prompt + answer), queries, targets, len(ids), length, depth, key)


def needle_probes(builder: ProbeBuilder, spec: CalibrationSpec) -> list[Probe]:
    return [builder.needle(spec, length, depth, i) for length in spec.needle_lengths
            for i, depth in enumerate(spec.needle_depths)]  # fmt: skip


def copy_probes(builder: ProbeBuilder, spec: CalibrationSpec) -> list[Probe]:
    return [builder.copy(spec, length, depth, i) for length in spec.copy_lengths for i, depth in enumerate(spec.copy_depths)]


# ===================================================================================== scoring
def compressible_range(prefix_len: int, block: int, sink: int, window: int) -> tuple[int, int]:
    """Token range ``[lo, hi)`` of the blocks a server compresses in a cached prefix of this length
    (after the sink, before the node's last ``window`` tokens; the node is the whole blocks)."""
    lo = -(-sink // block) * block
    hi = max(lo, (prefix_len // block * block - window) // block * block)
    return lo, hi


def prune_k_rows(key: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``key [H, L, D]`` with positions ``[lo, hi)`` 2:4 magnitude-pruned along head_dim."""
    out = key.clone()
    part = key[:, lo:hi]
    out[:, lo:hi] = part * top2_of_4(part.abs(), -1)
    return out


def attention_mass(query: torch.Tensor, key: torch.Tensor, scaling: float, probe: Probe) -> torch.Tensor:
    """float64 ``[H]``: attention mass of the probe's query positions on their targets (causal
    softmax over every key up to the query), summed over each KV head's query heads, averaged over
    query positions. ``query [Hq, L, D]`` and ``key [H, L, D]`` are one layer's post-RoPE tensors."""
    heads, length, dim = key.shape
    group = query.shape[0] // heads
    positions = torch.tensor(probe.queries)
    q = query[:, positions].float().reshape(heads, group * len(positions), dim)
    logits = torch.bmm(q, key.float().transpose(1, 2)).mul_(scaling).view(heads, group, len(positions), length)
    keys = torch.arange(length)
    logits.masked_fill_(keys[None, :] > positions[:, None], -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    bounds = torch.tensor(probe.targets)
    target = (keys[None, :] >= bounds[:, :1]) & (keys[None, :] < bounds[:, 1:])  # [R, L]
    return (probs * target).sum(-1).sum(1).mean(-1).double()


@dataclass
class HeadScores:
    """Calibration result: per score name a float64 ``[L, H]`` tensor (higher = keep K dense), the
    per-(layer, KV head) query second moments ``[L, H, D, D]`` and a description of the run."""

    scores: dict[str, torch.Tensor]
    query_moment: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)
    key_energy: torch.Tensor | None = None
    """float64 ``[L, H, D]``: mean squared K per channel over the probes' compressible positions."""

    def to_json(self) -> dict:
        return {"scores": {k: [[round(float(x), 6) for x in row] for row in v] for k, v in self.scores.items()},
                "meta": self.meta}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> "HeadScores":
        return cls({k: torch.tensor(v, dtype=torch.float64) for k, v in data["scores"].items()}, None, data.get("meta", {}))


LayerProbe = Callable[[int, torch.Tensor, torch.Tensor, float], None]
"""Called once per layer by a model forward: ``(layer, query [Hq, L, D], key [H, L, D], scaling)``
(post-RoPE, batch row 0)."""
ProbeForward = Callable[[Sequence[int], LayerProbe], None]
"""Runs the model over token ids, calling the layer probe from every attention layer."""


def calibrate(forward: ProbeForward, probes: Sequence[Probe], num_layers: int, kv_heads: int, head_dim: int,
              block: int, sink: int, window: int, progress: Callable[[str], None] | None = None) -> HeadScores:  # fmt: skip
    """Scores of every (layer, KV head) from ``probes``: for each probe kind ``k`` the mean
    attention mass ``k`` and its drop ``k_drop`` under 2:4 K pruning of the compressible blocks,
    plus the query second moments over every position of every probe."""
    sums = {name: torch.zeros(num_layers, kv_heads, dtype=torch.float64) for name in SCORE_NAMES}
    counts = dict.fromkeys({p.kind for p in probes}, 0)
    moment = torch.zeros(num_layers, kv_heads, head_dim, head_dim, dtype=torch.float64)
    key_energy = torch.zeros(num_layers, kv_heads, head_dim, dtype=torch.float64)
    key_count = 0
    started = time.time()
    for i, probe in enumerate(probes):
        lo, hi = compressible_range(probe.prefix_len, block, sink, window)

        def on_layer(layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float, probe: Probe = probe) -> None:
            dense = attention_mass(query, key, scaling, probe)
            pruned = attention_mass(query, prune_k_rows(key.float(), lo, hi), scaling, probe)
            sums[probe.kind][layer] += dense
            sums[probe.kind + "_drop"][layer] += dense - pruned
            q = query.double().reshape(kv_heads, -1, head_dim)
            moment[layer] += torch.bmm(q.transpose(1, 2), q)
            key_energy[layer] += key[:, lo:hi].double().square().sum(1)

        forward(probe.ids, on_layer)
        counts[probe.kind] += 1
        key_count += hi - lo
        if progress:
            progress(f"calibration {i + 1}/{len(probes)}: {probe.kind} {probe.length} tokens, depth {probe.depth:g} "
                     f"({time.time() - started:.0f} s)")  # fmt: skip
    scores = {name: sums[name] / counts[name.split("_")[0]] for name in SCORE_NAMES if counts.get(name.split("_")[0])}
    total_positions = sum(len(p.ids) for p in probes)
    meta = {
        "probes": [{"kind": p.kind, "length": p.length, "depth": p.depth, "tokens": len(p.ids), "seed_key": p.seed_key}
                   for p in probes],
        "seconds": time.time() - started,
    }  # fmt: skip
    return HeadScores(scores, moment / max(1, total_positions), meta, key_energy / max(1, key_count))


def random_scores(num_layers: int, kv_heads: int, seed: int = 0) -> torch.Tensor:
    """Seeded random scores: the control that tells whether a score's head choice matters (and a map
    for capacity runs on dummy weights, where no head retrieves)."""
    return torch.rand(num_layers, kv_heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ===================================================================================== inputs and model
def load_calibration_texts(folder: str | None) -> list[str]:
    """Every regular text file of ``folder`` (default :data:`CALIBRATION_CORPUS`), sorted by name,
    links to the same file counted once."""
    folder = folder or CALIBRATION_CORPUS
    if not os.path.isdir(folder):
        raise MissingInput(f"calibration text folder {folder} is missing: pass --calib-corpus DIR (any .txt files "
                           "that the evaluation's haystacks do not contain)")  # fmt: skip
    seen, texts = set(), []
    for name in sorted(os.listdir(folder)):
        path = os.path.realpath(os.path.join(folder, name))
        if path in seen or not os.path.isfile(path):
            continue
        seen.add(path)
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    if not texts:
        raise MissingInput(f"calibration text folder {folder} holds no files")
    return texts


def calibrate_model(backend, texts: list[str], spec: CalibrationSpec,
                    progress: Callable[[str], None] | None = None) -> HeadScores:  # fmt: skip
    """Head scores of the quality evaluation's reference model
    (:class:`sglang_hs.launch.quality_reference.ReferenceBackend`: its tokenizer, ``probe_forward``,
    shape and prefix geometry) from the needle and copy probes on ``texts``."""
    builder = ProbeBuilder(backend.tokenizer, texts)
    probes = needle_probes(builder, spec) + copy_probes(builder, spec)
    g = backend.geometry
    return calibrate(backend.probe_forward, probes, backend.num_layers, backend.kv_heads, backend.head_dim, g.block,
                     g.sink, g.window, progress)  # fmt: skip
