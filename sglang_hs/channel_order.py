"""K channel order: a calibrated permutation of head_dim per (layer, KV head) that makes 2:4 K lose less.

Magnitude 2:4 keeps the two largest of every four *consecutive* channels of a key. RoPE puts channels
of similar frequency side by side, and a head's energy sits in a few of them (the slow rotation
pairs), so in natural order a group often holds two or three large channels and must drop one: on
SmolLM2 K pruning at S_K = 1 then loses retrieval (needles 0.58 -> 0.05) and KL grows fivefold. A
permutation that gives every group of four one channel from each quarter of the channels ranked by
importance (``E[k_c^2] * E[q_c^2]``, measured on calibration text) never has to drop a large channel
for another. With it S_K = 1 keeps about S_V = 1's fidelity (KL) on SmolLM2, but retrieval still
drops on some question sets (needles 0.35 against 0.52 through servers; ``docs/quality.md``).

Permuting the channels of q and k alike leaves every score ``q . k`` unchanged, so the server applies
the order to q and k as they enter the attention backend (after RoPE, before the KV cache write): the
KV cache, the compressed store, the host tier and every kernel then hold and read K in that order, the
dense delegate included, and no kernel changes. V and the attention output keep their order.

The order is computed offline by ``python -m sglang_hs.launch.calibrate_channels`` (a forward of the
checkpoint over text) and passed with ``--hierasparse-k-channel-order FILE``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMAT = "hierasparse-k-channel-order/1"


def ranked_quarter_permutations(importance: torch.Tensor) -> torch.Tensor:
    """int64 ``[..., D]``: for each row of ``importance [..., D]`` a permutation of its channels whose
    consecutive groups of 4 each take one channel from every quarter of the ranking: group ``g`` holds
    the channels ranked ``g``, ``g + D/4``, ``g + D/2`` and ``g + 3D/4`` (ties by channel index)."""
    dim = importance.shape[-1]
    if dim % 4:
        raise ValueError(f"head_dim {dim} is not a multiple of 4")
    order = importance.argsort(dim=-1, descending=True, stable=True)
    return order.unflatten(-1, (4, dim // 4)).transpose(-1, -2).reshape(order.shape)


def check_permutations(perm: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every row of ``perm [..., D]`` is a permutation of ``0 .. D-1``."""
    dim = perm.shape[-1]
    if not torch.equal(perm.long().sort(dim=-1).values, torch.arange(dim).expand(perm.shape)):
        raise ValueError("a K channel order row is not a permutation of head_dim")


def load_calibration_file(path: str, file_format: str, what: str, command: str) -> dict:
    """The dict of a per-head calibration file (``format`` = ``file_format``); a one-line ``ValueError``
    naming ``what`` and the ``sglang_hs.launch`` command that writes it, if it is not one."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"cannot read the {what} {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != file_format:
        raise ValueError(f"{path} is not a {what} file (python -m sglang_hs.launch.{command})")
    return data


def rank_first_head(total: int, kv_heads_per_rank: int, rank: int, tp_size: int, what: str) -> int:
    """The first of the ``kv_heads_per_rank`` KV heads (of ``total``) a tensor-parallel rank holds:
    SGLang gives rank ``r`` heads ``r*n .. r*n + n - 1`` when the heads divide over the ranks, else
    (fewer heads than ranks) replicates head ``r // (tp_size / heads)``. ``what`` names the per-head
    file in the one-line ``ValueError`` of a mismatch."""
    if tp_size <= total:
        if kv_heads_per_rank * tp_size != total:
            raise ValueError(f"{what} has {total} KV heads; {tp_size} ranks of "
                             f"{kv_heads_per_rank} hold {kv_heads_per_rank * tp_size}")  # fmt: skip
        return rank * kv_heads_per_rank
    if kv_heads_per_rank != 1 or tp_size % total:
        raise ValueError(f"{what} has {total} KV heads, which do not spread over {tp_size} ranks")
    return rank // (tp_size // total)


@dataclass(frozen=True)
class ChannelOrder:
    """Per (layer, KV head) permutations ``perm [L, H, D]`` (int64) of the channels of q and k."""

    perm: torch.Tensor

    def __post_init__(self) -> None:
        if self.perm.dim() != 3:
            raise ValueError(f"a K channel order is [layers, kv_heads, head_dim], got shape {tuple(self.perm.shape)}")
        check_permutations(self.perm)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.perm.shape)  # type: ignore[return-value]

    def save(self, path: str, **source) -> None:
        """Write the order (int16) with ``source`` (how it was calibrated) to a torch file."""
        torch.save({"format": FORMAT, "perm": self.perm.to(torch.int16), "source": source}, path)

    @classmethod
    def load(cls, path: str) -> ChannelOrder:
        """Read a file written by :meth:`save`; ``ValueError`` with one line if it is not one."""
        return cls(load_calibration_file(path, FORMAT, "K channel order", "calibrate_channels")["perm"].long())

    def for_rank(self, kv_heads_per_rank: int, rank: int, tp_size: int) -> ChannelOrder:
        """The rows of the KV heads a tensor-parallel rank holds (:func:`rank_first_head`)."""
        start = rank_first_head(self.perm.shape[1], kv_heads_per_rank, rank, tp_size, "the K channel order")
        return ChannelOrder(self.perm[:, start : start + kv_heads_per_rank])

    def check_model(self, num_layers: int, kv_heads: int, head_dim: int) -> None:
        """One-line ``ValueError`` unless the order fits a model (per rank) of that shape."""
        if self.shape != (num_layers, kv_heads, head_dim):
            raise ValueError(f"the K channel order is for [layers, kv_heads, head_dim] = {list(self.shape)}, "
                             f"the model has {[num_layers, kv_heads, head_dim]}")  # fmt: skip


class ChannelPermuter:
    """Applies a :class:`ChannelOrder` to the q and k of one rank's layers on the GPU (index tensors
    built once; two gathers per layer and forward)."""

    def __init__(self, order: ChannelOrder, device) -> None:
        self.index = [p.to(device) for p in order.perm]  # per layer [H, D] int64

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor | None):
        """``q [T, Hq*D]`` or ``[T, Hq, D]`` and ``k [T, H*D]`` or ``[T, H, D]`` (or None) with their
        channels in the layer's order, in the input shapes; query head ``j`` uses the order of its KV
        head ``j // (Hq / H)``."""
        index = self.index[layer_id]
        heads, dim = index.shape
        tokens = q.shape[0]
        qv = q.reshape(tokens, heads, -1, dim)
        q_out = qv.gather(-1, index[None, :, None, :].expand(qv.shape)).view(q.shape)
        if k is None:
            return q_out, None
        kv = k.reshape(k.shape[0], heads, dim)
        k_out = kv.gather(-1, index[None].expand(kv.shape)).view(k.shape)
        return q_out, k_out


def unpermute(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Inverse of ``x.gather(-1, perm)`` for ``x [..., H, D]`` and ``perm [H, D]``."""
    return torch.empty_like(x).scatter_(-1, perm.expand(x.shape), x)
