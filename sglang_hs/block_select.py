"""Decode-time block selection over a cached prefix: which KV blocks a decode query reads.

Two rules from the literature, as PyTorch references of the decode modes (``sglang_hs.decode_modes``,
whose batched, fixed-shape rules the tests check against these), and the offline anchor placement:

- **top-k** (Kascade): read the ``k`` blocks of most exact attention mass (:func:`exact_block_mass`,
  :func:`select_topk`); Kascade measures the masses on a few anchor layers and reuses the choice in the
  layers between, pooled over the KV heads here (one choice a request: a shorter block table).
- **mass threshold** (PSA): read the fewest blocks whose attention mass reaches a fraction ``tau`` of
  the total (:func:`select_mass`); the budget follows how peaked attention is.
- **anchor placement** (:func:`place_anchors`): which layers measure, chosen offline on calibration
  queries.

Scores from a per-block key summary (Quest's bound from each block's channel-wise key min/max) were
measured and lost on SmolLM2 (``docs/quality.md``); they live in git history (commit 9eed4b0).

The sink and the window blocks are always read (``always``). Shapes: ``n`` blocks of ``B`` tokens,
``H`` KV heads, ``Hq`` query heads (a KV head's query heads are consecutive), ``D`` head_dim.
"""

from __future__ import annotations

import math

import torch


def _real(x: torch.Tensor) -> torch.Tensor:
    """fp32 for 16-bit inputs (scores are compared, not stored); fp64 stays fp64."""
    return x if x.dtype == torch.float64 else x.float()


def exact_block_mass(q: torch.Tensor, k: torch.Tensor, block: int, scale: float) -> torch.Tensor:
    """float ``[H, n]``: the softmax attention mass of each block, summed over a KV head's query heads
    (``q [Hq, D]``, ``k [n*B, H, D]``): what an anchor layer measures exactly."""
    heads = k.shape[1]
    qg = _real(q).unflatten(0, (heads, -1))  # [H, G, D]
    logits = scale * torch.einsum("hgd,thd->hgt", qg, _real(k))
    probs = logits.softmax(-1)
    return probs.unflatten(-1, (-1, block)).sum(-1).sum(1)


def select_topk(scores: torch.Tensor, k: int, always: torch.Tensor) -> torch.Tensor:
    """bool ``[H, n]``: the ``always`` blocks (bool ``[n]``) plus the ``k`` highest-scoring other blocks
    of each head (ties to the lower block)."""
    masked = scores.masked_fill(always, -math.inf)
    k = min(k, int((~always).sum()))
    order = masked.argsort(dim=-1, descending=True, stable=True)[:, :k]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)
    return chosen | always


def select_mass(log_mass: torch.Tensor, tau: float, always: torch.Tensor, cap: int | None = None) -> torch.Tensor:
    """bool ``[H, n]``: per head the ``always`` blocks plus the fewest highest blocks whose mass
    (``softmax`` of ``log_mass [H, n]``, e.g. the log of :func:`exact_block_mass`) brings the selected
    share to at least ``tau`` in ``(0, 1]``; at most ``cap`` blocks besides the ``always`` ones."""
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau={tau} is not in (0, 1]")
    mass = _real(log_mass).softmax(-1)
    base = (mass * always).sum(-1, keepdim=True)
    other = mass.masked_fill(always, 0.0)
    order = other.argsort(dim=-1, descending=True, stable=True)
    before = other.gather(-1, order).cumsum(-1) - other.gather(-1, order)  # mass chosen before each block
    take = (base + before < tau - 1e-6) & (other.gather(-1, order) > 0)
    if cap is not None:
        take &= torch.arange(take.shape[-1], device=take.device) < cap
    chosen = torch.zeros_like(take).scatter_(-1, order, take)
    return chosen | always


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor, block: int,
                       scale: float) -> torch.Tensor:  # fmt: skip
    """float ``[Hq, D]``: decode attention of ``q [Hq, D]`` over ``k``, ``v [n*B, H, D]`` reading only the
    blocks ``selected [H, n]`` of each KV head."""
    heads = k.shape[1]
    qg = _real(q).unflatten(0, (heads, -1))
    logits = scale * torch.einsum("hgd,thd->hgt", qg, _real(k))
    keep = selected.repeat_interleave(block, dim=-1)[:, None]  # [H, 1, n*B]
    probs = logits.masked_fill(~keep, -math.inf).softmax(-1)
    return torch.einsum("hgt,thd->hgd", probs, _real(v)).flatten(0, 1)


def place_anchors(masses: list[torch.Tensor], k: int, count: int) -> list[int]:
    """Anchor layers for Kascade-style reuse, placed offline: ``count`` layers (layer 0 first) such
    that each layer, reusing the top-``k`` blocks of the last anchor at or before it, keeps the most
    of the attention mass its own top-``k`` would read, averaged over calibration queries.

    ``masses``: per calibration query a float ``[L, n]`` of each layer's block masses (pooled over KV
    heads). The gain of layer ``l`` under anchor ``a`` is ``mass_l(top_k(a)) / mass_l(top_k(l))``;
    the anchors split the layers into ``count`` runs, each starting at its anchor, chosen by dynamic
    programming for the largest total gain."""
    layers = masses[0].shape[0]
    if not 1 <= count <= layers:
        raise ValueError(f"count={count} anchors for {layers} layers")
    gain = torch.zeros(layers, layers, dtype=torch.float64)  # [anchor, layer]
    for mass in masses:
        mass = mass.double()
        top = mass.topk(min(k, mass.shape[1]), dim=1).indices  # [L, k]
        own = mass.gather(1, top).sum(1).clamp_min(1e-30)  # [L]
        for a in range(layers):
            gain[a] += mass[:, top[a]].sum(1) / own
    gain /= len(masses)
    run = torch.zeros(layers, layers + 1, dtype=torch.float64)  # run[a, b]: gain of layers a..b-1 under anchor a
    for a in range(layers):
        run[a, a + 1 :] = gain[a, a:].cumsum(0)
    best = torch.full((count + 1, layers + 1), -math.inf, dtype=torch.float64)
    back = torch.zeros(count + 1, layers + 1, dtype=torch.long)
    best[0, 0] = 0.0
    for c in range(1, count + 1):
        for b in range(c, layers + 1):
            options = best[c - 1, c - 1 : b] + run[c - 1 : b, b]  # the last run starts at a in [c-1, b)
            back[c, b] = int(options.argmax()) + c - 1
            best[c, b] = options.max()
    anchors, b = [], layers
    for c in range(count, 0, -1):
        b = int(back[c, b])
        anchors.append(b)
    return anchors[::-1]
