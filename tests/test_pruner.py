"""The magnitude pruner: element masks along the right axis, block ranking, protected blocks."""

from __future__ import annotations

import torch

from sglang_hs.pruner import make_pruner, prunable_mask, top2_of_4


def test_top2_keeps_largest_with_lower_index_on_ties():
    score = torch.tensor([[3.0, 1.0, 3.0, 2.0, 5.0, 5.0, 5.0, 0.0]])
    assert top2_of_4(score, -1).tolist() == [[True, False, True, False, True, True, False, False]]


def test_k_groups_along_head_dim_v_groups_along_tokens():
    torch.manual_seed(0)
    blocks = torch.randn(2, 5, 64, 128)
    pruner = make_pruner("magnitude")
    k = pruner(blocks, "k", 1.0)
    v = pruner(blocks, "v", 1.0)
    assert (k.keep.reshape(2, 5, 64, 32, 4).sum(-1) == 2).all()
    assert (v.keep.reshape(2, 5, 16, 4, 128).sum(-2) == 2).all()
    expected_k_loss = (blocks.abs() * ~k.keep).sum((-1, -2))
    assert torch.allclose(k.loss, expected_k_loss)
    assert k.sparse.all() and v.sparse.all()


def test_lowest_loss_blocks_become_sparse_per_head():
    torch.manual_seed(0)
    blocks = torch.randn(2, 6, 64, 64)
    blocks[0, 4] *= 0.01  # head 0: block 4 loses least
    blocks[1, 1] *= 0.01  # head 1: block 1 loses least
    result = make_pruner("magnitude")(blocks, "v", 1 / 6)
    assert result.sparse.tolist() == [
        [False, False, False, False, True, False],
        [False, True, False, False, False, False],
    ]


def test_protected_blocks_are_never_sparse():
    torch.manual_seed(0)
    blocks = torch.randn(1, 10, 64, 64) * 0.01
    # 10 blocks of 64 = 640 tokens: sink 64 protects block 0, window 256 protects blocks 6..9.
    prunable = prunable_mask(10, 640, 64, sink_tokens=64, window_tokens=256)
    assert prunable.tolist() == [False] + [True] * 5 + [False] * 4
    result = make_pruner("magnitude")(blocks, "k", 1.0, prunable)
    assert torch.equal(result.sparse[0], prunable)
    # A partial tail: 600 tokens keep blocks ending after 344 dense.
    assert prunable_mask(9, 600, 64, 64, 256).tolist() == [False, True, True, True, True] + [False] * 4
