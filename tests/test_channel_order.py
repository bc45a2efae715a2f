"""The K channel order: file format, tensor-parallel slicing, the q/k permutation the backend applies
(scores unchanged, 2:4 K keeps the large channels), and its calibration command."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_hs.channel_order import ChannelOrder, ChannelPermuter, ranked_quarter_permutations, unpermute
from sglang_hs.pruner import top2_of_4


def random_order(layers=2, heads=2, dim=64, seed=0) -> ChannelOrder:
    g = torch.Generator().manual_seed(seed)
    return ChannelOrder(torch.stack([torch.randperm(dim, generator=g) for _ in range(layers * heads)]).view(layers, heads, dim))


def test_ranked_quarters_deal_one_channel_of_each_quarter_to_every_group():
    importance = torch.rand(3, 2, 64, generator=torch.Generator().manual_seed(1))
    perm = ranked_quarter_permutations(importance)
    rank = importance.argsort(-1, descending=True).argsort(-1)
    quarters = (rank.gather(-1, perm) // 16).view(3, 2, 16, 4).sort(-1).values
    assert (quarters == torch.arange(4)).all()
    with pytest.raises(ValueError):
        ranked_quarter_permutations(torch.rand(2, 6))


def test_file_round_trip_and_one_line_errors(tmp_path):
    order = random_order()
    order.save(str(tmp_path / "order.pt"), model="m")
    assert torch.equal(ChannelOrder.load(str(tmp_path / "order.pt")).perm, order.perm)
    torch.save({"perm": order.perm}, tmp_path / "other.pt")
    for path in (tmp_path / "other.pt", tmp_path / "missing.pt"):
        with pytest.raises(ValueError) as err:
            ChannelOrder.load(str(path))
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="not a permutation"):
        ChannelOrder(torch.zeros(1, 1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[2, 2, 64\]"):
        order.check_model(2, 4, 64)


def test_tensor_parallel_ranks_take_their_kv_heads():
    order = random_order(heads=4)
    assert torch.equal(order.for_rank(2, 1, 2).perm, order.perm[:, 2:4])
    assert torch.equal(order.for_rank(1, 5, 8).perm, order.perm[:, 2:3])  # 8 ranks share 4 heads: rank 5 holds head 2
    with pytest.raises(ValueError):
        order.for_rank(1, 0, 2)


@pytest.mark.parametrize("flat", [True, False])
def test_permuted_q_and_k_give_the_same_scores(flat):
    order = random_order(layers=1, heads=2, dim=64)
    permute = ChannelPermuter(order, "cpu")
    q, k = torch.randn(5, 8, 64, dtype=torch.float64), torch.randn(7, 2, 64, dtype=torch.float64)
    qp, kp = permute(0, q.flatten(1) if flat else q, k.flatten(1) if flat else k)
    assert qp.shape == (q.flatten(1) if flat else q).shape and kp.shape == (k.flatten(1) if flat else k).shape
    qp, kp = qp.view(5, 2, 4, 64), kp.view(7, 2, 64)
    scores = torch.einsum("thgd,shd->thgs", q.view(5, 2, 4, 64), k)
    assert torch.allclose(torch.einsum("thgd,shd->thgs", qp, kp), scores)
    assert torch.equal(unpermute(kp, order.perm[0]), k)
    assert permute(0, q, None)[1] is None


def test_two_neighbouring_large_channels_survive_2to4_in_the_order():
    k = torch.ones(4, 1, 64)
    k[..., 8:11] = 10.0  # three large channels in one group of four: natural 2:4 must drop one
    energy = torch.ones(1, 1, 64)
    energy[..., 8:11] = 100.0
    order = ChannelOrder(ranked_quarter_permutations(energy))
    kp = ChannelPermuter(order, "cpu")(0, torch.zeros(4, 1, 64), k)[1]
    kept = unpermute(top2_of_4(kp.abs(), -1), order.perm[0])
    assert kept[..., 8:11].all() and not top2_of_4(k.abs(), -1)[..., 8:11].all()


@pytest.mark.sglang
def test_the_backend_permutes_q_and_k_on_every_path():
    from test_backend_paths import HKV, HQ, D, RecordingPlan, extend_batch, make_backend

    order = random_order(layers=1, heads=HKV, dim=D)
    index = order.perm[0]
    plan = RecordingPlan()
    backend = make_backend(plan)
    backend.permute = ChannelPermuter(order, "cpu")
    batch = extend_batch([0, 1], [256, 128], [64, 32])
    backend.forward_metadata = backend._compressed_metadata(batch)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=HQ, head_dim=D, v_head_dim=D, scaling=0.125, k_scale=None,
                            v_scale=None)  # fmt: skip
    q = torch.randn(96, HQ * D)
    backend.forward_extend(q, None, None, layer, batch, save_kv_cache=False)
    (q_kernel, _), = plan.calls
    expected = q.view(96, HKV, HQ // HKV, D).gather(-1, index[None, :, None].expand(96, HKV, HQ // HKV, D))
    assert torch.equal(q_kernel, expected.view(96, HQ, D))
    seen = {}
    backend.dense = SimpleNamespace(forward_extend=lambda q, k, v, *a, **kw: seen.update(q=q, k=k) or "dense")
    dense_batch = extend_batch([1], [128], [32])
    backend.forward_metadata = backend._compressed_metadata(dense_batch)
    k = torch.randn(32, HKV * D)
    assert backend.forward_extend(q[:32], k, k, layer, dense_batch) == "dense"
    assert torch.equal(seen["k"].view(32, HKV, D), k.view(32, HKV, D).gather(-1, index[None].expand(32, HKV, D)))


def test_calibration_command_writes_an_order_for_the_model(tmp_path):
    from conftest import write_essays

    from sglang_hs.launch import calibrate_channels
    from sglang_hs.launch.make_model import write_tiny

    model = tmp_path / "tiny"
    write_tiny(str(model), layers=2, seed=0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    assert calibrate_channels.main(["--model-path", str(model), "--corpus", write_essays(corpus, seed=7),
                                    "--chunks", "2", "--chunk-tokens", "256"]) == 0  # fmt: skip
    order = ChannelOrder.load(str(model / "hierasparse_k_channel_order.pt"))
    order.check_model(2, 2, 64)  # the tiny model: 2 layers, 2 KV heads, d 64
    assert calibrate_channels.main(["--model-path", str(tmp_path / "none")]) == 2
