"""Decode-time block selection: the references in ``sglang_hs.reference`` (exact block masses, top-k,
attention-mass threshold) and the offline anchor placement of ``calibrate_anchors``."""

from __future__ import annotations

import pytest
import torch

from sglang_hs import reference as bs
from sglang_hs.launch.calibrate_anchors import place_anchors

B, H, G, D, N = 16, 2, 3, 32, 10


def case(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H * G, D, generator=g, dtype=torch.float64),
            torch.randn(N * B, H, D, generator=g, dtype=torch.float64),
            torch.randn(N * B, H, D, generator=g, dtype=torch.float64))  # fmt: skip


def test_exact_mass_sums_to_the_query_heads():
    q, k, _ = case(1)
    mass = bs.exact_block_mass(q, k, B, 0.2)
    assert mass.shape == (H, N) and torch.allclose(mass.sum(-1), torch.full((H,), float(G), dtype=mass.dtype))


def test_topk_keeps_always_blocks_and_the_best_others():
    scores = torch.tensor([[5.0, 1.0, 4.0, 3.0, 9.0], [0.0, 2.0, 2.0, 1.0, 0.5]])
    always = torch.tensor([True, False, False, False, True])
    chosen = bs.select_topk(scores, 2, always)
    assert chosen.tolist() == [[True, False, True, True, True], [True, True, True, False, True]]
    assert bs.select_topk(scores, 10, always).all()


def test_mass_threshold_takes_the_fewest_blocks():
    log_mass = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    none = torch.zeros(4, dtype=torch.bool)
    assert bs.select_mass(log_mass, 0.8, none).tolist() == [[True, True, False, False], [True, True, True, True]]
    assert bs.select_mass(log_mass, 0.5, none).sum(-1).tolist() == [1, 2]
    first = torch.tensor([False, False, False, True])  # an always block counts toward the share
    assert bs.select_mass(log_mass, 0.6, first).tolist()[0] == [True, False, False, True]  # 0.1 + 0.5 reaches 0.6
    assert bs.select_mass(log_mass, 0.61, first).tolist()[0] == [True, True, False, True]
    with pytest.raises(ValueError):
        bs.select_mass(log_mass, 0.0, none)


def test_selected_attention_reads_only_its_blocks():
    q, k, v = case(2)
    every = torch.ones(H, N, dtype=torch.bool)
    full = bs.selected_attention(q, k, v, every, B, 0.3)
    ref = torch.einsum("hgt,thd->hgd", (0.3 * torch.einsum("hgd,thd->hgt", q.view(H, G, D), k)).softmax(-1), v)
    assert torch.allclose(full, ref.flatten(0, 1))
    only = torch.zeros(H, N, dtype=torch.bool)
    only[:, 3] = True
    k2, v2 = k.clone(), v.clone()
    k2.view(N, B, H, D)[4:] = 100.0  # unselected blocks cannot matter
    assert torch.allclose(bs.selected_attention(q, k2, v2, only, B, 0.3), bs.selected_attention(q, k, v, only, B, 0.3))
    # Selecting the blocks that hold nearly all the mass reproduces full attention closely.
    mass = bs.exact_block_mass(q, k, B, 0.3)
    top = bs.select_mass(torch.log(mass), 0.999, torch.zeros(N, dtype=torch.bool))
    assert (bs.selected_attention(q, k, v, top, B, 0.3) - full).abs().max() < 0.05


def test_anchor_placement_starts_a_run_where_attention_moves():
    """Layers 0-2 attend to block 0, layers 3-5 to block 3: two anchors go to layers 0 and 3, where a
    reused choice keeps all of each layer's top-1 mass; one anchor must be layer 0; more anchors than
    needed still start at 0 and cover a change at 3."""
    mass = torch.full((6, 4), 0.01)
    mass[:3, 0] = 1.0
    mass[3:, 3] = 1.0
    assert place_anchors([mass], k=1, count=2) == [0, 3]
    assert place_anchors([mass], k=1, count=1) == [0]
    three = place_anchors([mass, mass], k=1, count=3)
    assert three[0] == 0 and 3 in three and len(set(three)) == 3
    with pytest.raises(ValueError):
        place_anchors([mass], k=1, count=7)
