"""The FlashInfer delegate's paged prefill choice (``sglang_hs.dense_prefill``): when fa3 is taken, and
on the GPU that fa3's paged output and LSE equal the reference and fa2's as SGLang runs them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_hs.dense_prefill import FA3_MIN_NEW_TOKENS, PagedPrefillChoice


def _delegate(**flags):
    cls = type("FlashInferAttnBackend", (), {})
    delegate = cls()
    delegate.prefill_wrappers_paged = ["fa2 wrapper"]
    delegate.workspace_buffer = None
    delegate.__dict__.update(flags)
    return delegate


def _batch(mode: str, new_tokens: int, bs: int, prefix_lens: list[int] | None = None):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(forward_mode=getattr(ForwardMode, mode), extend_num_tokens=new_tokens, batch_size=bs,
                           extend_prefix_lens_cpu=[1024] * bs if prefix_lens is None else prefix_lens)


@pytest.mark.parametrize(
    "delegate, capability, dtype",
    [
        (SimpleNamespace(prefill_wrappers_paged=["w"]), (9, 0), torch.bfloat16),  # not FlashInfer's backend
        (_delegate(), (8, 0), torch.bfloat16),  # Ampere: no fa3
        (_delegate(), (10, 0), torch.bfloat16),  # Blackwell: SGLang's own choices stand
        (_delegate(), (9, 0), torch.float8_e4m3fn),
        (_delegate(dispatch_reason="sliding window"), (9, 0), torch.float16),
        (_delegate(enable_mis=True), (9, 0), torch.float16),
        (_delegate(prefill_wrappers_paged=[]), (9, 0), torch.float16),  # skip_prefill delegates
    ],
)
def test_no_choice_where_fa3_cannot_take_the_paged_prefill(delegate, capability, dtype):
    assert PagedPrefillChoice.for_delegate(delegate, capability, dtype) is None


def test_fa3_from_the_threshold_for_plain_prefill_batches_only():
    delegate = _delegate()
    choice = PagedPrefillChoice(delegate, ["fa3 wrapper"])
    n = FA3_MIN_NEW_TOKENS
    assert choice.choose(_batch("EXTEND", 8 * n, 8)) and delegate.prefill_wrappers_paged == ["fa3 wrapper"]
    assert not choice.choose(_batch("EXTEND", 8 * n - 1, 8)) and delegate.prefill_wrappers_paged == ["fa2 wrapper"]
    assert choice.choose(_batch("MIXED", 4 * n, 4))
    assert not choice.choose(_batch("EXTEND", 64 * n, 2, [8192, 0]))  # a new prompt beside a chunk
    for mode in ("TARGET_VERIFY", "DRAFT_EXTEND_V2", "SPLIT_PREFILL"):
        assert not choice.choose(_batch(mode, 64 * n, 1)) and delegate.prefill_wrappers_paged == ["fa2 wrapper"]
    assert choice.fa3_batches == 2


@pytest.mark.gpu
@pytest.mark.parametrize("new_tokens, prefixes", [(16, [0, 300, 1000]), (300, [512, 0, 2048]), (FA3_MIN_NEW_TOKENS, [4096])])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fa3_paged_prefix_equals_reference_and_fa2(new_tokens, prefixes, dtype):
    """Page size 1, shuffled pool slots, non-causal. A request without a prefix among them: fa2 gives
    it output 0 and a very negative LSE (the merge keeps the ragged part alone); fa3 leaves its rows
    unwritten (FlashInfer 0.6.15), which is why the choice keeps such batches on fa2."""
    from bench_dense_prefill import delegate_case, paged_prefix_attention, reference  # lab/

    case = delegate_case(new_tokens, prefixes, dtype=dtype, seed=len(prefixes) + new_tokens)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    ref_o, ref_lse = reference(case)
    rows = torch.repeat_interleave(torch.tensor([p > 0 for p in prefixes], device="cuda"), new_tokens)
    results = {b: paged_prefix_attention(case, b, workspace)() for b in ("fa2", "fa3")}
    for backend, (o, lse) in results.items():
        err = (o[rows].float() - ref_o[rows]).norm() / ref_o[rows].norm()
        assert err < 1e-2, (backend, float(err))
        assert torch.allclose(lse[rows].float(), ref_lse[rows], atol=2e-2), backend
    o2, s2 = results["fa2"]
    assert (s2[~rows] < -1e4).all() and (o2[~rows] == 0).all()
    o3, s3 = results["fa3"]
    assert (o3[rows].float() - o2[rows].float()).abs().max() < 2e-2
    assert torch.allclose(s3[rows], s2[rows], atol=2e-2)


@pytest.mark.gpu
def test_for_delegate_builds_fa3_wrappers_on_hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 needs a Hopper GPU")
    delegate = _delegate(workspace_buffer=torch.zeros(16 << 20, dtype=torch.uint8, device="cuda"))
    choice = PagedPrefillChoice.for_delegate(delegate, torch.cuda.get_device_capability(), torch.bfloat16)
    assert choice is not None and len(choice.fa3_wrappers) == 1 and choice.fa3_wrappers[0]._backend == "fa3"
