"""K head map: which (layer, KV head) pairs store K 2:4 in a K-sparse block, and which keep it dense.

Pruning K 2:4 on every head stops retrieval (SmolLM2 needles 0.55 -> 0.02), but retrieval runs through
a few heads: keeping K dense on the heads whose attention lands on a needle in synthetic calibration
prompts kept needle accuracy within 2 points of V pruning alone at an effective S_K of 0.75
(``docs/quality.md``). The map is calibrated offline (``python -m sglang_hs.launch.calibrate_heads``,
from :mod:`sglang_hs.launch.head_calibration`'s scores) and passed with ``--hierasparse-k-head-map
FILE``; the store lays out each layer's K pools by it (:mod:`sglang_hs.pools`), and S_K then applies
to the mapped heads only: the effective S_K is ``S_K * share`` of the mapped pairs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from sglang_hs.channel_order import load_calibration_file, rank_first_head

FORMAT = "hierasparse-k-head-map/1"


def model_shape(model_path: str) -> tuple[int, int]:
    """(layers, KV heads) of a checkpoint's ``config.json``: the shape of its K head map (before tensor
    parallelism). ``OSError`` / ``KeyError`` if the file is missing or lacks them."""
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    return config["num_hidden_layers"], config.get("num_key_value_heads", config["num_attention_heads"])


@dataclass(frozen=True)
class KHeadMap:
    """``sparse [L, H]`` bool: True where a K-sparse block stores the head's K 2:4."""

    sparse: torch.Tensor

    def __post_init__(self) -> None:
        if self.sparse.dim() != 2 or self.sparse.dtype != torch.bool:
            raise ValueError(f"a K head map is a bool [layers, kv_heads] tensor, got {self.sparse.dtype} "
                             f"{tuple(self.sparse.shape)}")  # fmt: skip

    @property
    def share(self) -> float:
        """The share of (layer, head) pairs that store K 2:4."""
        return float(self.sparse.float().mean())

    @classmethod
    def from_scores(cls, scores: torch.Tensor, share: float) -> KHeadMap:
        """Map the ``round(share * L * H)`` lowest-scoring pairs (the heads that retrieve least) to 2:4
        K; ties by flat index."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"K head map share {share} is outside [0, 1]")
        order = scores.flatten().double().argsort(stable=True)
        sparse = torch.zeros(scores.numel(), dtype=torch.bool)
        sparse[order[: round(share * scores.numel())]] = True
        return cls(sparse.view(scores.shape))

    def save(self, path: str, **source) -> None:
        """Write the map with ``source`` (how it was calibrated) to a torch file."""
        torch.save({"format": FORMAT, "sparse": self.sparse, "source": source}, path)

    @classmethod
    def load(cls, path: str) -> KHeadMap:
        """Read a file written by :meth:`save`; ``ValueError`` with one line if it is not one."""
        return cls(load_calibration_file(path, FORMAT, "K head map", "calibrate_heads")["sparse"].to(torch.bool))

    def for_rank(self, kv_heads_per_rank: int, rank: int, tp_size: int) -> KHeadMap:
        """The columns of the KV heads a tensor-parallel rank holds."""
        start = rank_first_head(self.sparse.shape[1], kv_heads_per_rank, rank, tp_size, "the K head map")
        return KHeadMap(self.sparse[:, start : start + kv_heads_per_rank])

    def check_model(self, num_layers: int, kv_heads: int) -> None:
        """One-line ``ValueError`` unless the map fits a model (per rank) of that shape."""
        if tuple(self.sparse.shape) != (num_layers, kv_heads):
            raise ValueError(f"the K head map is for [layers, kv_heads] = {list(self.sparse.shape)}, the model has "
                             f"{[num_layers, kv_heads]}")  # fmt: skip
