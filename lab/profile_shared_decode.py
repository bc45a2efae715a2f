"""Where the time of one layer of shared-prefix decode goes: the whole call and each of its parts.

    python3 lab/profile_shared_decode.py [--server-shape | --batches | --short | --chunked | --splits | --ncu]

16 requests over 6 shared prefixes of 32K, S_K = S_V = 1, Llama-3.1-8B decode shape (32/8 heads, d 128),
each request keeping its last block to its own pass, natural pool order. Times are CUDA-graph replays
side by side (``sglang_hs.kernels.timing.time_graphs``): ``plan.run`` (all), the shared pass, the own
pass, the query fold, the step tables (once per decode step in a server; Triton, and the PyTorch form
beside), and the shared pass at other split counts. ``--server-shape``: the regime-1 server's shape
instead (bf16, a block table 529 blocks wide, plans built for 256 requests as for SGLang's largest
captured batch and for 16), beside FlashInfer fa2 and the per-request kernel. At the server's shape,
``--batches``: batches of 1 to 16 requests over 1 and over 6 prefixes (a server's batch is small while
long prompts prefill), with the shared pass also at 2, 4, 8 and 16 splits and, below
``MIN_SHARED_BATCH``, with column sets formed anyway; ``--short``: the same rows at regimes 2 and 3's
shape (8K prefixes, a 257-block table) for batches of even and uneven groups (:data:`SHORT_GROUPS`),
where the prefix benchmark measured shared-prefix decode slower than without it, plus the call with
lone requests left to the own pass and with a set row for every request; ``--chunked``: 8, 16 and 32
requests whose prefixes keep a dense window after every 8K chunk, as a prefix cached by chunked prefill
does; ``--splits``: uneven groups with requests alone on their prefix (16 and 32 requests), the whole
call at the plan's split counts and with every set at a fixed count, lone requests as column sets or in
the own pass, the own pass after the shared pass instead of beside it, and the shared pass alone at
fixed split counts; ``--ncu``: eager launches
of the shared pass and of the own pass for Nsight Compute (``ncu -k regex:hs_extend_shared --section
WarpStateStats ...``: stall reasons). ``docs/results.md`` quotes them.
"""

import argparse
import itertools

import torch

from sglang_hs.kernels.cases import flashinfer_decode, make_case, paged_dense, run_args, share_prefixes
from sglang_hs.kernels.decode import HieraSparseDecode
from sglang_hs.kernels.decode_shared import (LONE_MIN_BLOCKS, MIN_SHARED_BATCH, OWN_MIN_SPLIT_BLOCKS,
                                             SharedPrefixDecode, shared_heads)
from sglang_hs.kernels.shared_pass_extend import ExtendSharedPass
from sglang_hs.kernels.timing import time_graphs

CONTEXT, BATCH, PREFIXES, FORMS = 32768, 16, 6, ("sparse", "sparse")


def _shared_pass_at(splits: int, folded, kv, table, lens, scale: float, max_blocks: int):
    """The shared pass alone with every live set at ``splits`` splits (a plan of its own, the same kernel)."""
    sets = folded.shape[0]
    plan = ExtendSharedPass(sets, shared_heads(32, 8), 8, 128, 64, max_blocks, folded.dtype, "cuda", num_splits=splits,
                            forms=FORMS)  # fmt: skip
    return lambda: plan.run(folded, *kv, table, lens, scale, return_lse=True)


def _case(dtype: torch.dtype, max_blocks: int | None, seed: int):
    case = make_case([CONTEXT] * PREFIXES, 32, 8, 128, 1.0, 1.0, dtype, "cuda", seed=seed, magnitude=False,
                     shuffle=False, max_blocks=max_blocks)  # fmt: skip
    paged = paged_dense(case)
    return share_prefixes(case, paged, BATCH, seed=seed)


def benchmark_shape() -> dict:
    case, _ = _case(torch.float16, None, 11)
    q, kc, vc, pools, ki, vi, bt, sl, scale = run_args(case)
    kv = (kc, vc, pools, ki, vi)
    plan = SharedPrefixDecode(BATCH, 32, 8, 128, 64, case["max_blocks"], torch.float16, "cuda", forms=FORMS)
    step = plan.plan_step(bt, sl, ki, vi, min_own_blocks=1)
    sets = plan.sets_for(BATCH)
    folded = plan.fold_queries(q, step.members[:sets], step.fold_rows[:sets])
    table, lens = step.shared_table[:sets], step.shared_lens[:sets]
    fns = {
        "all": lambda: plan.run(q, *kv, step, scale),
        f"shared pass ({int(step.shared_splits[0])} splits)":
            lambda: plan.shared_plan.run(folded, *kv, table, lens, scale, return_lse=True,
                                         split_limit=step.shared_splits[:sets]),
        "own pass": lambda: plan.own_plan.run(q, *kv, step.own_table, step.own_lens, scale, return_lse=True),
        "query fold": lambda: plan.fold_queries(q, step.members[:sets], step.fold_rows[:sets]),
        "step tables": lambda: plan.plan_step(bt, sl, ki, vi, min_own_blocks=1),
        "step tables, PyTorch form": lambda: plan.plan_step(bt, sl, ki, vi, pytorch=True, min_own_blocks=1),
    }  # fmt: skip
    for splits in (2, 4, 8, 16):
        fns[f"shared pass ({splits} splits)"] = _shared_pass_at(splits, folded, kv, table, lens, scale,
                                                                case["max_blocks"])
    return fns


UNEVEN_GROUPS = ((6, 5, 5), (7, 6, 2, 1), (8, 7, 1), (5, 5, 4, 1, 1), (3, 3, 3, 3, 2, 2), (12, 11, 8, 1))
"""``--splits``: sizes of the groups of one batch (1: a request alone on its prefix), interleaved in
arrival order (:func:`_arrivals`)."""
SERVER_WIDTH = 529  # the regime-1 server's block table: (32768 + 1024) / 64 + 1


SHORT_CONTEXT, SHORT_WIDTH = 8192, 257
"""``--short``: regimes 2 and 3's prefixes (8K) and servers' block table (``--context-length 16384``)."""
SHORT_GROUPS = ((8, 8), (4, 4, 4, 4), (2,) * 8, (2, 2, 2) + (1,) * 10, (1,) * 16, (2, 2) + (1,) * 4)
"""``--short``'s batches as group sizes. bench_serving shuffles a load's requests, so 16 running
requests of regime 2 (34 groups of 8) come from about 12-13 groups: a few pairs and lone requests."""


def _server_case(prefixes: int, context: int = CONTEXT, width: int = SERVER_WIDTH) -> dict:
    """``prefixes`` compressed prefixes of ``context`` tokens at a server's shape (bf16, ``width``-wide
    tables; by default regime 1's: 32K, 529)."""
    return make_case([context] * prefixes, 32, 8, 128, 1.0, 1.0, torch.bfloat16, "cuda", seed=5, magnitude=False,
                     shuffle=False, max_blocks=width)  # fmt: skip


def _add_chunk_windows(block_table: torch.Tensor) -> None:
    """A dense window of 4 pages after every 8K chunk of each prefix, as chunked prefill caches a
    prefix (the case's own window pages, read again)."""
    blocks = CONTEXT // 64
    for start in range(128, blocks, 128):
        block_table[:, start : start + 4] = block_table[:, blocks - 4 : blocks]


def server_shape() -> dict:
    case, paged = _case(torch.bfloat16, SERVER_WIDTH, 5)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    q, kc, vc, pools, ki, vi, bt, sl, scale = run_args(case)
    kv = (kc, vc, pools, ki, vi)
    per_request = HieraSparseDecode(256, 32, 8, 128, 64, SERVER_WIDTH, torch.bfloat16, "cuda")
    out = torch.empty_like(q)
    fns = {"FlashInfer fa2": flashinfer_decode(case, paged, workspace, "fa2"),
           "per-request kernel": lambda: per_request.run(q, *kv, bt, sl, scale, out=out)}
    for plan_batch, forms in ((256, FORMS), (16, FORMS), (256, ("any", "any"))):
        plan = SharedPrefixDecode(plan_batch, 32, 8, 128, 64, SERVER_WIDTH, torch.bfloat16, "cuda", forms=forms)
        step = plan.plan_step(bt, sl, ki, vi, min_own_blocks=1)
        fns[f"shared-prefix decode, plan for {plan_batch}, forms {'/'.join(forms)}"] = (
            lambda plan=plan, step=step: plan.run(q, *kv, step, scale))
    return fns


class _SetRowPerRequest(SharedPrefixDecode):
    """Set rows for every request of a call (the shipped plan has ``bs // 2``, which every group's sets
    fit, and lone requests past them read their whole prefix in the own pass): what ``--short`` times
    for batches of many lone requests."""

    def sets_for(self, bs: int) -> int:
        return 0 if bs < MIN_SHARED_BATCH else min(self.max_sets, bs)


def _batch_size(batch: int | tuple[int, ...]) -> int:
    return batch if isinstance(batch, int) else sum(batch)


class _SetsFromTwoRequests(SharedPrefixDecode):
    """Column sets in calls of any size (the shipped plan forms none below ``MIN_SHARED_BATCH``): what
    ``--batches`` times against the per-request kernel to place that threshold."""

    def sets_for(self, bs: int) -> int:
        return min(self.max_sets, bs // 2)


def _server_batches(batches, prefixes: int, chunk_windows: bool, context: int = CONTEXT, width: int = SERVER_WIDTH,
                    lone_policies: bool = False):  # fmt: skip
    """Per batch: its label and the functions timed side by side (FlashInfer fa2, the per-request kernel,
    shared-prefix decode and its passes) at a server's shape (``context``-token prefixes, ``width``-wide
    tables; regime 1's by default), plans built for 32 requests (the prefix benchmark's largest captured
    batch). A batch is a request count spread evenly over ``prefixes``, or a tuple of group sizes
    (:func:`_arrivals`; at least ``prefixes`` of them). ``chunk_windows``: :func:`_add_chunk_windows`.
    ``lone_policies``: also the call with requests alone on their prefix left to the own pass, and with
    a set row for every request (:class:`_SetRowPerRequest`)."""
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    per_request = HieraSparseDecode(32, 32, 8, 128, 64, width, torch.bfloat16, "cuda")
    floor = HieraSparseDecode(32, 32, 8, 128, 64, width, torch.bfloat16, "cuda",
                              min_split_blocks=OWN_MIN_SPLIT_BLOCKS)  # fmt: skip
    plan = SharedPrefixDecode(32, 32, 8, 128, 64, width, torch.bfloat16, "cuda", forms=FORMS)
    small = (_SetsFromTwoRequests(32, 32, 8, 128, 64, width, torch.bfloat16, "cuda", forms=FORMS)
             if min(map(_batch_size, batches)) < MIN_SHARED_BATCH else None)  # only --batches asks so small
    every_row = (_SetRowPerRequest(32, 32, 8, 128, 64, width, torch.bfloat16, "cuda", max_sets=32, forms=FORMS)
                 if lone_policies else None)  # fmt: skip
    base = _server_case(prefixes, context, width)
    paged = paged_dense(base)
    for batch in batches:
        bs, prefix_of = _batch_size(batch), None if isinstance(batch, int) else _arrivals(batch)
        case, case_paged = share_prefixes(base, paged, bs, seed=5, prefix_of=prefix_of)
        q, kc, vc, pools, ki, vi, bt, sl, scale = run_args(case)
        if chunk_windows:
            _add_chunk_windows(bt)
        kv, out = (kc, vc, pools, ki, vi), torch.empty_like(q)
        step = plan.plan_step(bt, sl, ki, vi, min_own_blocks=1)
        sets = plan.sets_for(bs)
        fns = {"FlashInfer fa2": flashinfer_decode(case, case_paged, workspace, "fa2"),
               "per-request kernel": lambda: per_request.run(q, *kv, bt, sl, scale, out=out),
               "per-request kernel with the own pass's floor": lambda: floor.run(q, *kv, bt, sl, scale, out=out),
               "shared-prefix decode": lambda: plan.run(q, *kv, step, scale),
               "own pass": lambda: plan.own_plan.run(q, *kv, step.own_table, step.own_lens, scale, return_lse=True)}
        if lone_policies:
            own_step = plan.plan_step(bt, sl, ki, vi, min_own_blocks=1, lone_min_blocks=None)
            row_step = every_row.plan_step(bt, sl, ki, vi, min_own_blocks=1)
            fns["shared-prefix decode, lone requests in the own pass"] = lambda: plan.run(q, *kv, own_step, scale)
            fns["shared-prefix decode, a set row for every request"] = lambda: every_row.run(q, *kv, row_step, scale)
        if bs < MIN_SHARED_BATCH:
            small_step = small.plan_step(bt, sl, ki, vi, min_own_blocks=1)
            fns["shared-prefix decode with sets below MIN_SHARED_BATCH"] = lambda: small.run(q, *kv, small_step, scale)
        if sets:
            folded = plan.fold_queries(q, step.members[:sets], step.fold_rows[:sets])
            table, lens = step.shared_table[:sets], step.shared_lens[:sets]
            fns[f"shared pass (the step's {int(step.shared_splits[0])} splits)"] = (
                lambda: plan.shared_plan.run(folded, *kv, table, lens, scale, return_lse=True,
                                             split_limit=step.shared_splits[:sets]))
            # The split count trades the walk (blocks a CTA steps through) against the fused merge (the
            # last CTA of a set and KV head loops over every split for each of its folded heads).
            for splits in (2, 4, 8, 16):
                fns[f"shared pass ({splits} splits)"] = _shared_pass_at(splits, folded, kv, table, lens, scale, width)
        grouped = int((step.pick[:bs] >= 0).sum())
        shared_blocks = (step.shared_lens[:sets] // 64).tolist()
        what = f"{prefixes} prefixes" if prefix_of is None else f"groups {'/'.join(map(str, batch))}"
        yield f"{what}, {bs} requests ({grouped} in column sets, shared blocks {shared_blocks})", fns


def _server_mix(base: dict, paged: dict, bs: int, per_request: HieraSparseDecode, workspace: torch.Tensor | None,
                prefix_of: list[int] | None = None):  # fmt: skip
    """One batch of ``bs`` requests over ``base``'s prefixes (``share_prefixes``) with chunk windows:
    its run arguments ``(q, kv, bt, sl, ki, vi, scale)`` and the dense baselines timed beside it
    (FlashInfer fa2, unless ``workspace`` is None, and the per-request kernel)."""
    case, case_paged = share_prefixes(base, paged, bs, seed=5, prefix_of=prefix_of)
    q, kc, vc, pools, ki, vi, bt, sl, scale = run_args(case)
    _add_chunk_windows(bt)
    kv, out = (kc, vc, pools, ki, vi), torch.empty_like(q)
    fns = {} if workspace is None else {"FlashInfer fa2": flashinfer_decode(case, case_paged, workspace, "fa2")}
    fns["per-request kernel"] = lambda: per_request.run(q, *kv, bt, sl, scale, out=out)
    return (q, kv, bt, sl, ki, vi, scale), fns


def _arrivals(group_sizes) -> list[int]:
    """The prefix of each request of a batch of groups of these sizes, interleaved in arrival order: one
    request of each prefix with requests left, in turn."""
    left, prefix_of = list(group_sizes), []
    while any(left):
        for g, n in enumerate(left):
            if n:
                prefix_of.append(g)
                left[g] -= 1
    return prefix_of


def _server_splits(group_sizes, splits_options=(None, 4, 6, 8, 11, 16)):
    """Per batch of uneven groups: the whole call at the plan's split counts (None) or with every set
    at a fixed count, lone requests as sets or in the own pass, and at the plan's counts with the own
    pass after the shared pass (not beside it); server shape with chunk windows, plans built for 32
    requests, beside FlashInfer fa2 and the per-request kernel."""
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    per_request = HieraSparseDecode(32, 32, 8, 128, 64, SERVER_WIDTH, torch.bfloat16, "cuda")
    plans = {splits: SharedPrefixDecode(32, 32, 8, 128, 64, SERVER_WIDTH, torch.bfloat16, "cuda", forms=FORMS,
                                        shared_splits=splits)
             for splits in splits_options}  # fmt: skip
    after = SharedPrefixDecode(32, 32, 8, 128, 64, SERVER_WIDTH, torch.bfloat16, "cuda", forms=FORMS, overlap=False)
    base = _server_case(max(len(sizes) for sizes in group_sizes))
    paged = paged_dense(base)
    for sizes in group_sizes:
        prefix_of = _arrivals(sizes)
        bs = len(prefix_of)
        (q, kv, bt, sl, ki, vi, scale), fns = _server_mix(base, paged, bs, per_request, workspace, prefix_of)
        notes = []
        for lone in (LONE_MIN_BLOCKS, None):
            where = "as sets" if lone else "in own pass"
            for splits, plan in plans.items():
                step = plan.plan_step(bt, sl, ki, vi, min_own_blocks=1, lone_min_blocks=lone)
                if splits is None:
                    notes.append(f"lone {where}: {int((step.shared_lens > 0).sum())} sets at "
                                 f"{int(step.shared_splits[0])} splits")
                fns[f"lone {where}, {'plan' if splits is None else splits} splits"] = (
                    lambda plan=plan, step=step, q=q, kv=kv: plan.run(q, *kv, step, scale))
        step = after.plan_step(bt, sl, ki, vi, min_own_blocks=1)
        fns["lone as sets, plan splits, own pass after"] = lambda step=step, q=q, kv=kv: after.run(q, *kv, step, scale)
        # The parts: the own pass alone, the query fold, the shared pass alone at the plan's split counts
        # and at fixed counts.
        sets = after.sets_for(bs)
        folded = after.fold_queries(q, step.members[:sets], step.fold_rows[:sets])
        fns["own pass alone"] = lambda step=step, q=q, kv=kv: after.own_plan.run(q, *kv, step.own_table, step.own_lens,
                                                                                scale, return_lse=True)  # fmt: skip
        fns["query fold"] = lambda step=step, q=q, sets=sets: after.fold_queries(q, step.members[:sets],
                                                                                 step.fold_rows[:sets])
        fns["shared pass alone, plan splits"] = lambda step=step, folded=folded, kv=kv, sets=sets: after.shared_plan.run(
            folded, *kv, step.shared_table[:sets], step.shared_lens[:sets], scale, return_lse=True,
            split_limit=step.shared_splits[:sets])
        for splits in (8, 11, 16):
            fns[f"shared pass alone, {splits} splits"] = _shared_pass_at(
                splits, folded, kv, step.shared_table[:sets], step.shared_lens[:sets], scale, SERVER_WIDTH)
        yield f"groups {'/'.join(map(str, sizes))}, {bs} requests ({'; '.join(notes)})", fns


def ncu_launches(group_sizes=(6, 5, 5), splits: int = 8) -> dict:
    """Eager launches for Nsight Compute over one batch of uneven groups (server shape, chunk windows):
    the shared pass alone (3 sets at 8 splits), then the own pass alone, five launches each (``ncu -k
    regex:hs_extend_shared`` or ``regex:hs_decode``: read the last, warm). Returns the launches' times
    (us, CUDA events) by name."""
    base = _server_case(len(group_sizes))
    prefix_of = _arrivals(group_sizes)
    per_request = HieraSparseDecode(32, 32, 8, 128, 64, SERVER_WIDTH, torch.bfloat16, "cuda")
    (q, kv, bt, sl, ki, vi, scale), _ = _server_mix(base, paged_dense(base), len(prefix_of), per_request, None,
                                                    prefix_of)  # fmt: skip
    plan = SharedPrefixDecode(32, 32, 8, 128, 64, SERVER_WIDTH, torch.bfloat16, "cuda", forms=FORMS)
    step = plan.plan_step(bt, sl, ki, vi, min_own_blocks=1)
    sets = plan.sets_for(len(prefix_of))
    folded = plan.fold_queries(q, step.members[:sets], step.fold_rows[:sets])
    times = {}
    runs = {"shared pass": _shared_pass_at(splits, folded, kv, step.shared_table[:sets], step.shared_lens[:sets], scale,
                                           SERVER_WIDTH),
            "own pass": lambda: plan.own_plan.run(q, *kv, step.own_table, step.own_lens, scale, return_lse=True)}
    for name, run in runs.items():
        for i in range(5):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            torch.cuda.synchronize()
            times[f"{name}, launch {i + 1}"] = start.elapsed_time(stop) * 1e3
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--server-shape", action="store_true", help="the regime-1 server's shape (see the docstring)")
    mode.add_argument("--batches", action="store_true", help="1 to 16 requests over 1 and 6 prefixes, server shape")
    mode.add_argument("--short", action="store_true", help="even and uneven groups on 8K prefixes (regimes 2, 3)")
    mode.add_argument("--chunked", action="store_true", help="prefixes cached in 8K chunks, server shape")
    mode.add_argument("--splits", action="store_true",
                      help="uneven groups with lone requests: the shared pass at the plan's and at fixed split counts")
    mode.add_argument("--ncu", action="store_true", help="eager launches of the shared and own passes for Nsight Compute")
    args = ap.parse_args(argv)
    if args.ncu:
        for name, us in ncu_launches().items():
            print(f"{name}: {us:.1f} us", flush=True)
        return
    if args.batches or args.short or args.chunked or args.splits:
        # Lazily: each batch's functions close over that batch's tensors, which the next one rebinds.
        if args.batches:
            runs = itertools.chain(*(_server_batches((1, 2, 4, 8, 16), prefixes, False) for prefixes in (1, 6)))
        elif args.short:
            runs = _server_batches(SHORT_GROUPS, 16, False, SHORT_CONTEXT, SHORT_WIDTH, lone_policies=True)
        elif args.chunked:
            runs = _server_batches((8, 16, 32), PREFIXES, True)
        else:
            runs = _server_splits(UNEVEN_GROUPS)
        for label, fns in runs:
            print(label, flush=True)
            for name, us in zip(fns, time_graphs(list(fns.values()), 20)):
                print(f"  {name}: {us:.1f} us", flush=True)
        return
    fns = server_shape() if args.server_shape else benchmark_shape()
    for name, us in zip(fns, time_graphs(list(fns.values()), 20)):
        print(f"{name}: {us:.1f} us", flush=True)


if __name__ == "__main__":
    main()
