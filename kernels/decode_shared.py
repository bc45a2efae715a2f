"""Shared-prefix (cascade) decode: a prefix shared by several requests of one decode batch is read once
for all of them.

A decode batch in shared-prefix serving holds many requests whose block tables start with the same
blocks (the radix tree hands every request of a document, few-shot bank or system prompt the same
cache pages and compressed virtual blocks). The split-KV decode kernel (:mod:`.decode`) walks each
request's blocks on its own, so a prefix shared by ``m`` requests is read, and stepped through, ``m``
times; FlashInfer then serves the repeats from L2 and wins (``docs/results.md``). Here the batch is
split in two passes over disjoint KV, merged by log-sum-exp:

* **Shared pass** (:mod:`.shared_pass_extend`). The requests of a prefix group are folded into the
  query-head axis of the extend kernel's n32 tile, whose 32 query columns a CTA serve ``fold = 32 // G``
  requests' ``G = Hq / Hkv`` query heads of one KV head: a *column set* of up to ``fold`` members is
  one extend "request" of one query token with ``Hkv * fold * G`` query heads, at the last position of
  the group's shared blocks (so every shared key is visible and no mask applies). Each shared block
  is loaded and stepped once per set, not once per request. Under settings that give every
  compressed block one form per operand (:func:`compressed_forms`) the shared pass takes only the
  shared blocks of that form and the kernel's stages hold just that form (smaller stages, three CTAs
  an SM); dense sinks and windows (one after every chunk of a prefix cached through chunked
  prefill) then go to the own pass.
* **Own pass.** Every request then attends to the blocks its set's shared pass did not take (its
  question, its generated tokens, dense sinks and windows) with the model's own decode kernel, built
  with a floor of blocks a split (its requests mostly read a short tail). A request alone on a long
  prefix (:data:`LONE_MIN_BLOCKS`) is a column set of one in a batch that has groups; other requests
  without a group read all of their blocks here.
* **Merge.** ``out = (e^(lse_s) o_s + e^(lse_o) o_o) / (e^(lse_s) + e^(lse_o))`` per query head (an
  empty pass has LSE ``-inf`` and weight 0).

Each set's split count is chosen on the GPU too (:func:`split_limits`): the shared pass's rule
(:meth:`.shared_pass_extend.ExtendSharedPass.rule_splits`) at the number of sets that have blocks to
share, read by the kernel per set (``dynamic_splits``; an empty set gets 0 and is skipped), so a
captured graph's fixed grid serves steps of few and of many sets.

Grouping runs on the GPU once per decode step (:func:`step_tables`): requests whose first block
entries are equal share a radix-tree path; the shared part is the run of leading block-table columns
equal for all of them, full blocks only. Every tensor has a shape fixed by the batch size (``bs // 2``
column sets, padded with empty sets) and nothing is read back to the host, so a step can be captured
in a CUDA graph. Calls of fewer than :data:`MIN_SHARED_BATCH` requests form no sets and run the
per-request kernel. ``sglang_hs.reference.paged_attention`` over each request's whole block table is
the oracle (``tests/test_decode_shared.py``). The plan's rules (the constants below) and the
measurements behind them: ``docs/kernels.md``, "Shared-prefix decode: the plan's rules".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_hs.format import BlockPools
from sglang_hs.kernels.common import ANY_FORMS
from sglang_hs.kernels.shared_pass_extend import SHARED_COLUMNS, SHARED_TILE

OWN_MIN_SPLIT_BLOCKS = 4
"""The own pass's floor of blocks a split (``HieraSparseDecode(min_split_blocks=...)``). Its requests
mostly read a short tail (a dense sink and window, the question, generated tokens), which a split
count planned for long requests would spread one block a CTA. Its split count is the per-request
rule's for the whole batch: requests alone on a long prefix are sets of one, so more splits would
only add CTAs past their request's tail."""
LONE_MIN_BLOCKS = 64
"""A request alone on its prefix joins the shared pass as a set of one from this many blocks to share
(4K tokens at 64-token blocks; :func:`step_tables`' ``lone_min_blocks``): in the own pass its whole
prefix would be the one long read that pass waits for, while a set of one costs a set row whatever
it holds, so short requests stay in the own pass (the threshold itself is not tuned)."""
SHARED_MAX_PARTS = 512
"""The shared pass's scratch, in (set, split) partials: a server's plan for 256 requests has 128 set
rows, which at 8 splits would take 134 MB of fp32 partials at Llama-8B's 512 folded heads; such a
call gets fewer splits (a batch that large has many sets)."""
MIN_SHARED_BATCH = 8
"""Calls of fewer requests run the per-request kernel: the shared pass has a fixed cost (about 100 us
a layer) that a small batch's shared reads do not pay back, even when every request shares one
prefix."""

def fold_of(q_heads: int, kv_heads: int) -> int:
    """Requests per column set for a model's GQA group (1 when the group fills the shared pass's
    :data:`~sglang_hs.kernels.shared_pass_extend.SHARED_COLUMNS`: no sets)."""
    return max(1, SHARED_COLUMNS // (q_heads // kv_heads))


def shared_heads(q_heads: int, kv_heads: int) -> int:
    """Query heads of the shared pass's extend kernel: ``Hkv * fold * G`` (one KV head's CTA serves
    ``fold`` requests' ``G`` heads)."""
    return kv_heads * fold_of(q_heads, kv_heads) * (q_heads // kv_heads)


def shared_pass_k_sparse(k_form: str, every_form: tuple[bool, ...] = (False, True)) -> tuple[bool, ...]:
    """Whether the shared pass's extend kernel has 2:4 K rows (``run`` picks it by the store's K values
    pool): with 2:4 K blocks yes, with dense K no, with every form the options ``every_form`` lists."""
    return {"sparse": (True,), "dense": (False,)}.get(k_form, every_form)


GPU_SHAPES = ((32, 8, 128, "float16"), (16, 2, 128, "bfloat16"), (8, 2, 64, "float16"), (9, 3, 64, "float16"),
              (28, 4, 128, "bfloat16"))  # the last two: GQA groups 3 and 7 (10 and 4 requests a column set)
"""The model shapes (q_heads, kv_heads, head_dim, dtype) of the GPU tests; their own-pass kernels are
:data:`sglang_hs.kernels.decode.PRECOMPILE` entries, their shared-pass kernels (one per
:data:`GPU_FORMS` entry) and own-pass kernels (the model's shape with a split floor) are compiled by
``python -m sglang_hs.kernels.decode_shared [--jobs N]``."""
GPU_FORMS = (ANY_FORMS, ("sparse", "sparse"), ("dense", "sparse"))
"""The shared-pass forms the GPU tests build for every shape of :data:`GPU_SHAPES`."""


def compressed_forms(sk: tuple[float, ...], sv: tuple[float, ...], k_head_map: bool = False) -> tuple[str, str]:
    """The ``(k_form, v_form)`` every compressed block of a store has, from its settings (each operand's
    S for prefill- and decode-compressed blocks): ``sparse`` when every S is 1 (for K: and no K head
    map keeps some heads dense), ``dense`` when every S is 0, else ``any``. The shared pass then runs a
    kernel whose stages hold just those forms over the blocks that have them (its dense sink and
    window go to the own pass): smaller stages, more CTAs an SM."""
    def form(values, uniform=True):
        if uniform and all(v == 1 for v in values):
            return "sparse"
        return "dense" if all(v == 0 for v in values) else "any"

    return form(sk, not k_head_map), form(sv)


def conforming_blocks(block_table: torch.Tensor, k_index: torch.Tensor, v_index: torch.Tensor,
                      forms: tuple[str, str]) -> torch.Tensor | None:  # fmt: skip
    """``[bs, W]`` bool: whether each block-table entry is, for every KV head, of the forms a shared
    pass kernel for ``forms`` takes (``None``: every block, ``forms`` is ``("any", "any")``). A cache
    page is dense K and V; a virtual block's form per head is its index maps' sign (``>= 0`` dense
    row). Entries past a request's blocks give arbitrary values (the caller masks them)."""
    if tuple(forms) == ANY_FORMS:
        return None
    virtual = block_table < 0
    ok = torch.ones_like(block_table, dtype=torch.bool)
    for form, index in zip(forms, (k_index, v_index)):
        if form == "any":
            continue
        if index.shape[1] == 0:  # an empty store: no virtual block exists
            sparse = dense = torch.zeros_like(ok)
        else:
            vb = torch.where(virtual, -block_table.long() - 1, 0).clamp(0, index.shape[1] - 1)
            signs = index[:, vb] < 0  # [H, bs, W]: 2:4 row
            sparse, dense = signs.all(0), (~signs).all(0)
        ok &= (virtual & sparse) if form == "sparse" else (~virtual | dense)
    return ok


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """``[bs, Hq, D]`` attention over the union of two disjoint KV sets from each set's output and
    natural-log LSE ``[bs, Hq]`` (``-inf``: an empty set, weight 0). In ``out_a``'s dtype. The
    PyTorch form of the Triton kernel of :func:`_merge_kernel_factory` (used off the GPU)."""
    top = torch.maximum(lse_a, lse_b).clamp(min=torch.finfo(torch.float32).min)  # both -inf: weights 0
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = (wa + wb).clamp(min=torch.finfo(torch.float32).tiny)

    def weighted(out, w):  # a side of weight 0 is never read (a skipped set's rows are not written)
        return torch.where(w[..., None] > 0, out.float() * (w / total)[..., None], 0.0)

    return (weighted(out_a, wa) + weighted(out_b, wb)).to(out_a.dtype)


@dataclass
class StepTables:
    """What one decode step's layers share (built once per step by :func:`step_tables`):
    ``members [max_sets, fold]`` (``-1`` pads), the shared pass's ``shared_table [max_sets, W]`` and
    ``shared_lens [max_sets]``, the own pass's ``own_table [bs, W]`` and ``own_lens [bs]``, ``pick
    [bs]`` int32: the unfolded shared-pass row of each request (``set * fold + position``, ``-1``:
    none), ``shared_splits [max_sets]`` int32: each set's split count, 0 for an empty set
    (:func:`split_limits`; 1 for the others from :func:`step_tables` alone), and ``fold_rows
    [max_sets, Hkv * fold * G]`` int64: the row of ``q.view(bs * Hq, D)`` each folded query head reads
    (:meth:`SharedPrefixDecode.fold_rows`; set by ``plan_step``, None from :func:`step_tables`). Each
    field's ``rows`` metadata says whether it has a row per set or per request (a CUDA graph's buffers
    are viewed per batch size by it)."""

    members: torch.Tensor = field(metadata={"rows": "set"})
    shared_table: torch.Tensor = field(metadata={"rows": "set"})
    shared_lens: torch.Tensor = field(metadata={"rows": "set"})
    own_table: torch.Tensor = field(metadata={"rows": "request"})
    own_lens: torch.Tensor = field(metadata={"rows": "request"})
    pick: torch.Tensor = field(metadata={"rows": "request"})
    shared_splits: torch.Tensor = field(metadata={"rows": "set"})
    fold_rows: torch.Tensor | None = field(default=None, metadata={"rows": "set"})


def step_tables(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, fold: int, max_sets: int,
                min_shared_blocks: int = 1, min_own_blocks: int = 0,
                conforming: torch.Tensor | None = None, lone_min_blocks: int | None = None) -> "StepTables":  # fmt: skip
    """Group one decode batch on the GPU, without a host synchronisation and in shapes fixed by the
    batch size (so a CUDA graph can replay it).

    Requests with the same first block-table entry form a group (they hang off one radix-tree path);
    its common blocks are the leading columns equal in every member, at most each member's full blocks
    (``seq_len // block_size``) minus ``min_own_blocks`` (the benchmark keeps 1, standing in for a
    request's own question and generated tokens). The shared pass takes the common blocks that are
    ``conforming`` (``[bs, W]`` bool, :func:`conforming_blocks`: the blocks its kernel's forms hold;
    ``None``: all of them), packed in table order; each request's own pass takes every other block of
    its table, in table order (attention does not depend on the order of its keys). A prefix that
    entered the radix tree in chunks (chunked prefill) keeps a dense window at the end of every chunk,
    so its compressed blocks come in runs with dense blocks between them: all of those runs are shared.
    Members are cut, in batch order, into column sets of ``fold``; a group's remainder of one is a set
    too (in the own pass it would read its whole prefix after the shared pass). A request alone on
    its prefix becomes a set of its own, numbered after every group's sets, when it has at least
    ``lone_min_blocks`` blocks to take and the batch has a group (the shared pass runs anyway); with
    ``lone_min_blocks=None``, or no group in the batch, it stays out. A group with fewer than
    ``min_shared_blocks`` blocks to share and sets beyond ``max_sets`` stay out too (their requests read
    everything in the own pass), and so does a request with fewer than ``min_shared_blocks`` full
    blocks (padding requests included). With ``fold >= 4`` a group of ``s >= 2`` makes at most ``s / 2``
    sets, so ``bs // 2`` rows hold every group's set; lone requests take the rows left."""
    device = block_table.device
    bs, width = block_table.shape
    lens = seq_lens.long()
    idx = torch.arange(bs, device=device)
    first = block_table[:, 0]
    # Leading columns a request may share: its full blocks minus the ones it keeps. A request too short
    # to share (a CUDA graph's padding rows among them) joins no group, so it cannot cut a group's run.
    limit = (lens // block_size - min_own_blocks).clamp(min=0)
    valid = limit >= max(min_shared_blocks, 1)
    same = (first[:, None] == first[None, :]) & valid[:, None] & valid[None, :]
    leader = torch.where(valid, same.int().argmax(1), idx)  # the group's first request
    columns = torch.arange(width, device=device)[None, :]
    equal = (block_table == block_table[leader]) & (columns < limit[:, None])
    common = torch.full((bs,), width, dtype=torch.long, device=device).scatter_reduce(
        0, leader, equal.int().cumprod(1).sum(1), "amin")[leader]  # fmt: skip
    take = columns < common[:, None]  # equal in every member: so is whether the kernel takes them
    if conforming is not None:
        take &= conforming
    shared = take.sum(1)
    size = torch.zeros(bs, dtype=torch.long, device=device).scatter_add(0, leader, valid.long())[leader]
    position = (same & (idx[None, :] < idx[:, None])).sum(1)  # members before this one
    chunk, slot = position // fold, position % fold
    sets_of_group = -(-size // fold)  # a remainder of one is a set too
    group_ok = valid & (size >= 2) & (shared >= max(min_shared_blocks, 1)) & (fold >= 2)
    per_leader = torch.where((leader == idx) & group_ok, sets_of_group, 0)  # column sets per group, at its leader
    set_id = (per_leader.cumsum(0) - per_leader)[leader] + chunk
    if lone_min_blocks is not None:  # lone requests: sets of one after the groups' (if the batch has a group)
        lone = valid & (size == 1) & (shared >= max(lone_min_blocks, min_shared_blocks, 1)) & group_ok.any()
        set_id = torch.where(lone, per_leader.sum() + lone.long().cumsum(0) - 1, set_id)
        group_ok = group_ok | lone
    eligible = group_ok & (set_id < max_sets)
    flat = torch.where(eligible, set_id * fold + slot, max_sets * fold)  # the spare entry takes the others
    members = torch.full((max_sets * fold + 1,), -1, dtype=torch.long, device=device).scatter(0, flat, idx)
    members = members[:-1].view(max_sets, fold)
    set_rows = torch.where(eligible, set_id, max_sets)
    shared_blocks = torch.zeros(max_sets + 1, dtype=torch.long, device=device).scatter(0, set_rows, shared)[:-1]
    take &= eligible[:, None]
    return StepTables(
        members=members,
        shared_table=_pack(block_table, take)[members[:, 0].clamp(min=0)].contiguous(),
        shared_lens=(shared_blocks * block_size).to(torch.int32),
        own_table=_pack(block_table, ~take),
        own_lens=(lens - take.sum(1) * block_size).to(torch.int32),
        pick=torch.where(eligible, flat, -1).to(torch.int32),
        shared_splits=(shared_blocks > 0).to(torch.int32),  # 0: an empty set, skipped by the shared pass
    )


def step_tables_pytorch(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, fold: int, max_sets: int,
                        forms: tuple[str, str] = ANY_FORMS, k_index: torch.Tensor | None = None,
                        v_index: torch.Tensor | None = None, splits_by_sets: torch.Tensor | None = None,
                        split_cap: int = 1, **kw) -> StepTables:  # fmt: skip
    """The PyTorch form of ``decode_shared_tables.step_tables_fused`` (same arguments): :func:`step_tables`
    over the blocks of ``forms`` (:func:`conforming_blocks`), with :func:`split_limits` given
    ``splits_by_sets``. It runs off the GPU, and it is the oracle of the Triton kernels."""
    conforming = None if tuple(forms) == ANY_FORMS else conforming_blocks(block_table, k_index, v_index, forms)
    step = step_tables(block_table, seq_lens, block_size, fold, max_sets, conforming=conforming, **kw)
    if splits_by_sets is not None:
        step.shared_splits = split_limits(step.shared_lens, splits_by_sets, split_cap)
    return step


def split_limits(shared_lens: torch.Tensor, by_sets: torch.Tensor, cap: int) -> torch.Tensor:
    """``[sets]`` int32, every set's split count for a step: ``by_sets[n]`` for the ``n`` sets with
    blocks to share (a GPU gather, no host synchronisation), at most ``cap`` (the launch's grid), and 0
    for a set with none (the shared pass skips it; once a step here, not once a layer there)."""
    live = shared_lens > 0
    limit = by_sets.index_select(0, live.sum().view(1)).clamp(max=cap).to(torch.int32)
    return torch.where(live, limit, 0)


def _pack(block_table: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[bs, W]``: each row's entries where ``keep``, in order, then zeros (a stable compaction)."""
    bs, width = block_table.shape
    slots = torch.where(keep, keep.long().cumsum(1) - 1, width)  # the others go to a spare column
    packed = torch.zeros(bs, width + 1, dtype=block_table.dtype, device=block_table.device)
    return packed.scatter_(1, slots, block_table)[:, :width].contiguous()


def _merge_kernel_factory():
    import triton
    import triton.language as tl

    @triton.jit
    def merge_kernel(out, own_out, own_lse, sh_out, sh_lse, pick, HQ: tl.constexpr, G: tl.constexpr,
                     FOLD: tl.constexpr, D: tl.constexpr):  # fmt: skip
        # One program per (request, query head): read the request's own-pass result and, if it is in a
        # column set, its column of the shared pass (folded layout), and write the LSE-weighted mix.
        r = tl.program_id(0)
        j = tl.program_id(1)
        d = tl.arange(0, D)
        o_own = tl.load(own_out + (r * HQ + j) * D + d).to(tl.float32)
        l_own = tl.load(own_lse + r * HQ + j)
        p = tl.load(pick + r)
        valid = p >= 0
        p0 = tl.where(valid, p, 0)
        col = (j // G) * FOLD * G + (p0 % FOLD) * G + j % G  # the folded query head of (request, head)
        row = (p0 // FOLD) * HQ * FOLD + col
        l_sh = tl.where(valid, tl.load(sh_lse + row), float("-inf"))
        # Only a request in a set reads the shared pass: a skipped (empty) set's rows are never written.
        o_sh = tl.load(sh_out + row * D + d, mask=valid & (d < D), other=0.0).to(tl.float32)
        top = tl.maximum(l_own, l_sh)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_own = tl.exp(l_own - top)
        w_sh = tl.exp(l_sh - top)
        mixed = (o_own * w_own + o_sh * w_sh) / tl.maximum(w_own + w_sh, 1e-30)
        tl.store(out + (r * HQ + j) * D + d, mixed.to(out.dtype.element_ty))

    return merge_kernel


class SharedPrefixDecode:
    """Plan + run of shared-prefix decode (module docstring): the *shared* pass
    (:class:`.shared_pass_extend.ExtendSharedPass`, ``Hkv * fold * G`` query heads over ``max_sets``
    column sets), two :class:`.decode.HieraSparseDecode` plans of the model's shape over ``batch_size``
    requests (the *own* pass, with a split floor, and the per-request kernel), the query fold, and one
    fused gather-and-merge kernel (Triton) per layer.

    ``shared_splits`` forces every set's split count (else each step's sets use the shared pass's rule
    at the number of sets that have blocks to share, chosen on the GPU: :func:`split_limits`).
    ``forms`` (:func:`compressed_forms`): the block forms of the shared pass's kernel; with fewer than
    every form, :meth:`plan_step` keeps the other blocks (a dense sink and window) to the own pass.
    Calls of fewer than :data:`MIN_SHARED_BATCH` requests form no sets and run the per-request kernel
    over the whole batch.
    ``overlap``: the own pass runs on a side stream (joined before the merge, and captured with the
    step by a CUDA graph), so its CTAs fill the SMs the shared pass leaves idle instead of starting
    after it (GPU plans only).
    ``plans`` (tests): a ``(shared, own[, per_request])`` tuple of objects with ``HieraSparseDecode.run``'s
    signature (``return_lse`` and ``split_limit`` included) to use instead of building the kernels (the
    per-request one defaults to the own one); the merge then runs in PyTorch."""

    def __init__(self, batch_size: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
                 max_blocks: int, dtype: torch.dtype, device, max_sets: int | None = None, plans=None,
                 shared_splits: int | None = None, forms: tuple[str, str] = ANY_FORMS, overlap: bool = True):  # fmt: skip
        self.q_heads, self.kv_heads, self.head_dim, self.block_size = q_heads, kv_heads, head_dim, block_size
        self.group = q_heads // kv_heads
        self.fold = fold_of(q_heads, kv_heads)
        self.max_sets = max_sets or max(1, batch_size // 2)
        # The query head each folded head reads (h * G + g), for fold_queries' gather.
        heads = torch.arange(q_heads, device=device).view(kv_heads, 1, self.group)
        self.fold_heads = heads.expand(kv_heads, self.fold, self.group).reshape(-1)
        self.forms = tuple(forms)
        self.merge_kernel = None
        # Split counts chosen on the GPU per step (else stand-ins: tests).
        self.dynamic_splits = plans is None
        if plans is None:
            from sglang_hs.kernels.decode import HieraSparseDecode
            from sglang_hs.kernels.shared_pass_extend import SHARED_SPLITS, ExtendSharedPass

            # The scratch holds every set row's splits: at most SHARED_MAX_PARTS (set, split) partials.
            splits = shared_splits or max(1, min(SHARED_SPLITS, SHARED_MAX_PARTS // self.max_sets))
            plans = (ExtendSharedPass(self.max_sets, shared_heads(q_heads, kv_heads), kv_heads, head_dim, block_size,
                                      max_blocks, dtype, device, num_splits=splits, forms=self.forms),
                     HieraSparseDecode(batch_size, q_heads, kv_heads, head_dim, block_size, max_blocks, dtype, device,
                                       min_split_blocks=OWN_MIN_SPLIT_BLOCKS),
                     HieraSparseDecode(batch_size, q_heads, kv_heads, head_dim, block_size, max_blocks, dtype,
                                       device))  # fmt: skip
            if torch.device(device).type == "cuda":  # off the GPU (tests) the merge runs in PyTorch
                self.merge_kernel = _merge_kernel_factory()
        self.own_stream = torch.cuda.Stream(device) if overlap and self.merge_kernel is not None else None
        self.shared_plan, self.own_plan = plans[:2]
        self.per_request_plan = plans[2] if len(plans) > 2 else self.own_plan
        # Split count by the number of sets with blocks to share (index 0..max_sets), on the device.
        by_sets = [1] * (self.max_sets + 1)
        if self.dynamic_splits:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            by_sets = [shared_splits or self.shared_plan.rule_splits(max(n, 1), sms) for n in range(self.max_sets + 1)]
        self.splits_by_sets = torch.tensor(by_sets, dtype=torch.int32, device=device)

    def sets_for(self, bs: int) -> int:
        """Column sets a call of ``bs`` requests can have: a group of ``s >= 2`` members makes at most
        ``s / 2`` sets at a fold of 4 or more, so at most ``bs // 2`` (and the plan's ``max_sets``; at a
        fold of 2 a group of 3 makes 2, and a set past the rows falls back to the own pass);
        :func:`step_tables` numbers sets from 0. The shared pass runs over that many rows, not over the
        ``max_sets`` of the largest captured batch, and its grid's split count is cut to the scratch
        for them. A call of fewer than :data:`MIN_SHARED_BATCH` requests has none (a server's batch
        is small while long prompts prefill)."""
        return 0 if bs < MIN_SHARED_BATCH else min(self.max_sets, bs // 2)

    @property
    def batch_size(self) -> int:
        """Requests the plan's scratch holds (the own pass's; see ``HieraSparseDecode``)."""
        return self.own_plan.batch_size

    @property
    def captured(self) -> bool:
        """Whether a CUDA graph captured the plan (its scratch may no longer move)."""
        return any(plan.captured for plan in (self.own_plan, self.shared_plan, self.per_request_plan))

    def plan_step(self, block_table: torch.Tensor, seq_lens: torch.Tensor, k_index: torch.Tensor | None = None,
                  v_index: torch.Tensor | None = None, pytorch: bool = False, **kw) -> StepTables:  # fmt: skip
        """The tables every layer of one decode step uses (:func:`step_tables` with this plan's fold and
        sets): built once per step, on the GPU, in shapes fixed by the batch size. A plan for fewer than
        every form needs the index maps (``[Hkv, n_virtual]``, the same in every layer) to find the
        blocks of its forms. On the GPU the tables come from ``decode_shared_tables``' Triton kernels
        (``pytorch``: from their PyTorch form, :func:`step_tables_pytorch`, which runs off the GPU)."""
        if self.forms != ANY_FORMS and (k_index is None or v_index is None):
            raise ValueError(f"a shared pass for forms {self.forms} needs the index maps")
        sets = self.sets_for(block_table.shape[0])
        kw.setdefault("lone_min_blocks", LONE_MIN_BLOCKS)
        by_sets, cap = (self.splits_by_sets, self.shared_plan.num_splits) if sets and self.dynamic_splits else (None, 1)
        args = (block_table, seq_lens, self.block_size, self.fold, sets)
        kw.update(forms=self.forms, k_index=k_index, v_index=v_index, splits_by_sets=by_sets, split_cap=cap)
        if block_table.is_cuda and block_table.shape[0] > 0 and not pytorch:  # 4 Triton launches, not ~110 kernels
            from sglang_hs.kernels.decode_shared_tables import step_tables_fused

            step = StepTables(**step_tables_fused(*args, **kw))
        else:
            step = step_tables_pytorch(*args, **kw)
        step.fold_rows = self.fold_rows(step.members)
        return step

    def fold_rows(self, members: torch.Tensor) -> torch.Tensor:
        """``[sets, Hkv * fold * G]`` int64: the row of ``q.view(bs * Hq, D)`` each folded head reads:
        member ``m``'s query head ``fold_heads[c]`` for columns ``m * G .. m * G + G - 1`` of every KV
        head (padding members read request 0). Once per step, so that a layer's fold is one
        ``index_select`` (a two-tensor gather took 7-8 us a layer)."""
        sets, fold = members.shape
        requests = members.clamp(min=0).long()[:, None, :, None].expand(sets, self.kv_heads, fold, self.group)
        return requests.reshape(sets, self.kv_heads * fold * self.group) * self.q_heads + self.fold_heads

    def fold_queries(self, q: torch.Tensor, members: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``q [bs, Hq, D]`` -> ``[sets, Hkv * fold * G, D]``: column set ``s``'s KV head ``h`` holds the G
        query heads of ``h`` of each member in turn (padding members read request 0); one
        ``index_select``, given the step's :meth:`fold_rows` of ``members``."""
        rows = self.fold_rows(members) if rows is None else rows
        head_dim = q.shape[-1]
        return q.reshape(-1, head_dim).index_select(0, rows.reshape(-1)).view(*rows.shape, head_dim)

    def unfold(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`fold_queries`' head layout for ``[sets, Hkv*fold*G, ...]`` -> ``[sets*fold, Hq, ...]``."""
        sets, tail = x.shape[0], x.shape[2:]
        x = x.view(sets, self.kv_heads, self.fold, self.group, *tail).transpose(1, 2)
        return x.reshape(sets * self.fold, self.q_heads, *tail)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pools: BlockPools,
            k_index: torch.Tensor, v_index: torch.Tensor, step: StepTables, sm_scale: float) -> torch.Tensor:  # fmt: skip
        """Decode attention of one layer, ``[bs, Hq, D]``. ``q`` and the KV arguments as
        ``HieraSparseDecode.run``'s; ``step`` from :meth:`plan_step`. No host synchronisation."""
        kv = (k_cache, v_cache, pools, k_index, v_index)
        sets = self.sets_for(q.shape[0])  # the rows that can hold a set: a static shape per batch size
        if sets == 0:  # no sets: the own tables are the whole tables
            return self.per_request_plan.run(q, *kv, step.own_table, step.own_lens, sm_scale)
        rows = None if step.fold_rows is None else step.fold_rows[:sets]
        folded = self.fold_queries(q, step.members[:sets], rows)

        def shared_pass():
            return self.shared_plan.run(folded, *kv, step.shared_table[:sets], step.shared_lens[:sets], sm_scale,
                                        return_lse=True, split_limit=step.shared_splits[:sets])  # fmt: skip

        if self.own_stream is None:
            out_s, lse_s = shared_pass()
            out_o, lse_o = self.own_plan.run(q, *kv, step.own_table, step.own_lens, sm_scale, return_lse=True)
        else:  # the own pass beside the shared pass, on a side stream; its output allocated here
            main, out_o = torch.cuda.current_stream(), torch.empty_like(q)
            self.own_stream.wait_stream(main)
            with torch.cuda.stream(self.own_stream):
                out_o, lse_o = self.own_plan.run(q, *kv, step.own_table, step.own_lens, sm_scale, out=out_o,
                                                 return_lse=True)  # fmt: skip
            out_s, lse_s = shared_pass()
            main.wait_stream(self.own_stream)
        if self.merge_kernel is None:
            pick = step.pick.long()
            rows = pick.clamp(min=0)
            out_sh = self.unfold(out_s)[rows]
            lse_sh = torch.where(pick[:, None] >= 0, self.unfold(lse_s[..., None])[..., 0][rows], -torch.inf)
            return merge_states(out_o, lse_o, out_sh, lse_sh)
        out = torch.empty_like(q)
        bs = q.shape[0]
        self.merge_kernel[(bs, self.q_heads)](out, out_o, lse_o, out_s, lse_s, step.pick, self.q_heads, self.group,
                                             self.fold, self.head_dim)  # fmt: skip
        return out


def _precompile_one(cfg):
    from sglang_hs.kernels.decode import STAGES, build_decode_kernel
    from sglang_hs.kernels.extend import build_extend_kernel, default_stages

    hq, hkv, d, dt, forms = cfg
    if forms is None:  # the own pass's kernel
        build_decode_kernel(hq, hkv, d, 64, dt, STAGES, min_split_blocks=OWN_MIN_SPLIT_BLOCKS)
    else:  # the shared pass's, with and (but for 2:4 K blocks) without 2:4 K rows, as run() picks by the pools
        for k_sparse in shared_pass_k_sparse(forms[0]):
            build_extend_kernel(shared_heads(hq, hkv), hkv, d, 64, dt, SHARED_TILE, default_stages(SHARED_TILE),
                                k_sparse, forms, True)
    return cfg


def _precompile_configs() -> list[tuple]:
    """The kernels of the GPU tests and of ``lab/profile_shared_decode.py``: (shape..., forms or None for the own pass)."""
    configs = [(*shape, forms) for shape in GPU_SHAPES for forms in (*GPU_FORMS, None)]
    return configs + [(32, 8, 128, "bfloat16", forms) for forms in (("sparse", "sparse"), None)]


if __name__ == "__main__":
    from sglang_hs.kernels.common import precompile_main

    precompile_main("compile the shared-pass decode kernels of the GPU tests", _precompile_one, _precompile_configs())
