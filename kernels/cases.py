"""Synthetic inputs of the HieraSparse attention kernels, shared by the GPU tests and the benchmark.

A *case* is a dict holding the kernels' inputs for a batch of requests in the serving layout (see
:func:`make_case`): cache pages, the store's pools (``k_dense`` .. ``v_meta``) and index maps, the
block table, the lengths and the query, plus what the references need. :func:`run_args` and
:func:`extend_run_args` turn it into the arguments of ``HieraSparseDecode.run`` and
``HieraSparseExtend.run``. The references over the same case: the oracle
(:func:`extend_reference`, ``sglang_hs.reference``), the decompressed KV (:func:`paged_dense`,
:func:`dense_kv`) and FlashInfer's paged kernels over it (:func:`flashinfer_decode`,
:func:`flashinfer_extend`).

Importing this module needs neither a GPU nor TileLang.
"""

import itertools
import math

import torch

from sglang_hs.format import FP8_DTYPE, BlockPools, decompress_blocks, pack_2to4, quantize_rows, sparse_count

CHUNK = 2048  # pool rows per chunk when packing or decompressing large pools
POOL_KEYS = ("k_dense", "k_values", "k_meta", "v_dense", "v_values", "v_meta")
"""A case's pool tensors, in :class:`sglang_hs.format.BlockPools` field order."""
SCALE_KEYS = ("k_dense_scale", "k_values_scale", "v_dense_scale", "v_values_scale")
"""An FP8 case's (:func:`quantize_case`) float32 row scales of its value pools."""


# ------------------------------------------------------------------------------------------- inputs
def random_keep(shape, device, gen, x=None):
    """A 2:4 keep mask along the last axis: top-2 |x| of every group of 4 (or random if x is None)."""
    n = shape[-1]
    groups = (*shape[:-1], n // 4, 4)
    score = x.reshape(groups).abs().float() if x is not None else torch.rand(groups, device=device, generator=gen)
    idx = score.topk(2, dim=-1).indices
    keep = torch.zeros(groups, dtype=torch.bool, device=device).scatter_(-1, idx, True)
    return keep.reshape(shape)


def _pack_chunked(x, magnitude, gen):
    vals, metas = [], []
    for i in range(0, x.shape[0], CHUNK):
        xi = x[i:i + CHUNK]
        keep = random_keep(xi.shape, x.device, gen, xi if magnitude else None)
        v, m = pack_2to4(xi, keep)
        vals.append(v)
        metas.append(m)
    return torch.cat(vals), torch.cat(metas)


def make_case(seq_lens, q_heads=32, kv_heads=8, head_dim=128, sk=0.0, sv=0.0, dtype=torch.float16,
              device="cuda", block_size=64, sink_blocks=1, window_blocks=4, max_blocks=None, seed=0,
              magnitude=True, extra_pages=3, shuffle=True, prefix_lens=None, k_sparse_heads=None):
    """Inputs of ``HieraSparseDecode.run`` for requests of ``seq_lens`` tokens.

    A request's block table holds ``sink_blocks`` cache pages, then compressed virtual blocks, then
    ``window_blocks`` cache pages (the last one partial when the length is not a multiple of the block
    size), then a poison value up to ``max_blocks``; a fraction S_K (S_V) of the compressed blocks is
    2:4 sparse per KV head. ``shuffle``: cache pages, virtual blocks and pool rows are assigned in random order, so that every
    indirection is exercised (tests); otherwise in allocation order, pool rows in (KV head, block)
    order as ``sglang_hs.reference.compress_blocks`` writes them (the benchmark's default layout).
    ``magnitude``: sparse blocks keep the top-2 of each group of a random dense block (else a random
    2 of 4). ``prefix_lens`` (extend): the sink/window/compressed layout covers only each request's
    first ``prefix_lens[r]`` tokens; the blocks after them (the new tokens) are cache pages.
    ``k_sparse_heads`` (a K head map of that many heads in every layer): S_K applies to KV heads
    ``0 .. k_sparse_heads-1`` only, the others keep every K block dense. Returns a dict.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    B, D, H = block_size, head_dim, kv_heads
    bs = len(seq_lens)
    nblk = [-(-L // B) for L in seq_lens]
    max_blocks = max_blocks or max(max(nblk), 1)
    kinds = []  # per request: list of "c" (cache page) / "v" (virtual)
    for r, (L, n) in enumerate(zip(seq_lens, nblk)):
        P = L if prefix_lens is None else prefix_lens[r]  # tokens the sink/compressed/window layout covers
        nP = -(-P // B)
        k = ["v"] * n
        for j in range(n):
            if j < sink_blocks or j >= nP - window_blocks or (j == nP - 1 and P % B):
                k[j] = "c"
        kinds.append(k)
    n_cache = sum(k.count("c") for k in kinds)
    n_virtual = sum(k.count("v") for k in kinds)
    n_pages = n_cache + extra_pages
    perm = (lambda n: torch.randperm(n, generator=cpu_gen)) if shuffle else torch.arange
    page_perm = perm(n_pages).tolist()
    vb_perm = perm(max(n_virtual, 1)).tolist()
    table = torch.full((bs, max_blocks), -(1 << 30), dtype=torch.int32)  # poison beyond each row's blocks
    pi = vi = 0
    for r, k in enumerate(kinds):
        for j, kind in enumerate(k):
            if kind == "c":
                table[r, j] = page_perm[pi]
                pi += 1
            else:
                table[r, j] = ~vb_perm[vi]
                vi += 1

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen, dtype=torch.float32).to(dtype)

    k_cache = randn(n_pages * B, H, D)
    v_cache = randn(n_pages * B, H, D)
    q = randn(bs, q_heads, D)

    def operand(s, transpose, heads=H):
        n_sp = sparse_count(n_virtual, s) if n_virtual else 0
        sparse = torch.zeros(H, n_virtual, dtype=torch.bool)
        for h in range(heads):
            sparse[h, torch.randperm(n_virtual, generator=cpu_gen)[:n_sp]] = True
        nd, ns = int((~sparse).sum()), int(sparse.sum())
        dense_rows = perm(nd)
        sparse_rows = perm(ns)
        index = torch.empty(H, n_virtual, dtype=torch.int32)
        index[~sparse] = dense_rows.to(torch.int32)
        index[sparse] = (-sparse_rows - 1).to(torch.int32)
        dense_pool = randn(nd, B, D)
        blocks = randn(ns, B, D)
        if transpose:
            blocks = blocks.transpose(-1, -2).contiguous()  # V^T: tokens become the sparse axis
        if ns:
            values, meta = _pack_chunked(blocks, magnitude, gen)
        else:
            values = torch.empty(0, *blocks.shape[1:-1], blocks.shape[-1] // 2, dtype=dtype, device=device)
            meta = torch.empty(0, *blocks.shape[1:-1], blocks.shape[-1] // 16, dtype=torch.int16, device=device)
        return dense_pool, values, meta, index.to(device)

    k_dense, k_values, k_meta, k_index = operand(sk, False, H if k_sparse_heads is None else k_sparse_heads)
    v_dense, v_values, v_meta, v_index = operand(sv, True)
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, k_dense=k_dense, k_values=k_values, k_meta=k_meta,
        v_dense=v_dense, v_values=v_values, v_meta=v_meta, k_index=k_index, v_index=v_index,
        block_table=table.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        sm_scale=1.0 / math.sqrt(D), seq_lens_list=list(seq_lens), kinds=kinds, block_size=B,
        max_blocks=max_blocks, sk=sk, sv=sv,
    )


def quantize_case(case: dict, seed: int = 0, spread: float = 1.5) -> dict:
    """The case with an FP8 store (``--hierasparse-store-dtype fp8_e4m3``): every value pool row (dense
    K/V, 2:4 K/V values) first multiplied by its own random factor in ``[2^-spread, 2^spread]`` (so that
    rows have unequal scales, and a row read with another's scale shows), then quantized to e4m3 with
    its float32 scale (:func:`sglang_hs.format.quantize_rows`). Cache pages stay 16-bit."""
    gen = torch.Generator(device=case["q"].device).manual_seed(seed + 11)
    out = dict(case)
    for name in ("k_dense", "k_values", "v_dense", "v_values"):
        x = case[name]
        factor = torch.exp2((torch.rand(x.shape[0], device=x.device, generator=gen) * 2 - 1) * spread)
        out[name], out[f"{name}_scale"] = quantize_rows(x.float() * factor.view(-1, *([1] * (x.dim() - 1))))
    return out


def fp8_pages(case: dict) -> tuple[dict, dict]:
    """SGLang's FP8 pages (``--kv-cache-dtype fp8_e4m3``, unit scales) for the case's cache pages:
    ``(fp8, oracle)``, the case with e4m3 ``k_cache``/``v_cache``, and the same case with those e4m3 values
    in the 16-bit dtype (exact: every e4m3 value is an fp16 and a bf16 value), which the oracle takes."""
    fp8, oracle = dict(case), dict(case)
    for name in ("k_cache", "v_cache"):
        fp8[name] = case[name].to(FP8_DTYPE)
        oracle[name] = fp8[name].to(case[name].dtype)
    return fp8, oracle


def pools_of(case: dict, device=None) -> BlockPools:
    """The case's pools (on ``device`` when given), with their row scales for an FP8 case."""
    keys = POOL_KEYS + (SCALE_KEYS if "k_dense_scale" in case else ())
    return BlockPools(*(case[k] if device is None else case[k].to(device) for k in keys))


def run_args(case: dict) -> list:
    """Positional arguments of ``HieraSparseDecode.run``."""
    return [case["q"], case["k_cache"], case["v_cache"], pools_of(case), case["k_index"], case["v_index"],
            case["block_table"], case["seq_lens"], case["sm_scale"]]


def virtual_blocks(case: dict, operand: str) -> torch.Tensor:
    """All virtual blocks of one operand (``"k"``, ``"v"``), decompressed: ``[H, n_virtual, B, D]``
    (pruned entries 0), a chunk of columns at a time to bound the temporary memory."""
    index = case[f"{operand}_index"]
    heads, n = index.shape
    if n == 0:
        return case["k_cache"].new_zeros(heads, 0, case["block_size"], case["k_cache"].shape[-1])
    pools, step = pools_of(case), max(1, CHUNK // heads)
    return torch.cat([decompress_blocks(pools, index[:, i:i + step], operand) for i in range(0, n, step)], 1)


def paged_dense(case):
    """The case's KV as a dense FlashInfer paged cache (NHD, page = block; request r's block j is page
    ``r * max_blocks + j``) plus ``indptr, indices, last_page_len``."""
    B, mb = case["block_size"], case["max_blocks"]
    k_cache, v_cache, table = case["k_cache"], case["v_cache"], case["block_table"]
    H, D = k_cache.shape[1], k_cache.shape[2]
    bs = table.shape[0]
    kv, vv = virtual_blocks(case, "k"), virtual_blocks(case, "v")
    fk = k_cache.new_zeros(bs * mb, B, H, D)
    fv = k_cache.new_zeros(bs * mb, B, H, D)
    ck, cv = k_cache.view(-1, B, H, D), v_cache.view(-1, B, H, D)
    indices, indptr, last = [], [0], []
    tab = table.cpu()
    for r, L in enumerate(case["seq_lens_list"]):
        n = -(-L // B)
        ents = tab[r, :n]
        pages = r * mb + torch.arange(n)
        c = ents >= 0
        dev_pages = pages.to(k_cache.device)
        if c.any():
            fk[dev_pages[c.to(k_cache.device)]] = ck[ents[c].long().to(k_cache.device)]
            fv[dev_pages[c.to(k_cache.device)]] = cv[ents[c].long().to(k_cache.device)]
        if (~c).any():
            vb = (-ents[~c] - 1).long().to(k_cache.device)
            fk[dev_pages[(~c).to(k_cache.device)]] = kv[:, vb].permute(1, 2, 0, 3).to(fk.dtype)  # FP8 pools: scaled back
            fv[dev_pages[(~c).to(k_cache.device)]] = vv[:, vb].permute(1, 2, 0, 3).to(fv.dtype)
        indices.append(pages)
        indptr.append(indptr[-1] + n)
        last.append(L - (n - 1) * B if n else 0)
    i32 = dict(dtype=torch.int32, device=k_cache.device)
    return dict(k=fk, v=fv, indptr=torch.tensor(indptr, **i32), indices=torch.cat(indices).to(**i32),
                last_page_len=torch.tensor(last, **i32))


def dense_kv(case, paged, r):
    """Request ``r``'s dense ``[L, H, D]`` K and V from :func:`paged_dense`."""
    mb, L = case["max_blocks"], case["seq_lens_list"][r]
    H, D = paged["k"].shape[2], paged["k"].shape[3]
    k = paged["k"][r * mb:(r + 1) * mb].reshape(-1, H, D)[:L]
    v = paged["v"][r * mb:(r + 1) * mb].reshape(-1, H, D)[:L]
    return k, v


def share_prefixes(case, paged, bs, seed=0, prefix_of: list[int] | None = None):
    """Expand a case of G requests to ``bs`` requests where request ``r`` reads the KV of request
    ``r % G`` (G shared prefixes, arrivals interleaved, as in a shared-prefix serving batch), or of
    ``prefix_of[r]`` (uneven groups), with its own query. Both kernels read the same blocks for
    requests of one group (ours through the block table, FlashInfer through its page indices), so both
    can reuse them from L2."""
    groups = case["block_table"].shape[0]
    idx = torch.arange(bs, device=case["block_table"].device) % groups
    if prefix_of is not None:
        if len(prefix_of) != bs or not all(0 <= g < groups for g in prefix_of):
            raise ValueError(f"prefix_of needs {bs} entries in [0, {groups})")
        idx = torch.tensor(prefix_of, device=idx.device)
    shared = dict(case)
    shared["block_table"] = case["block_table"][idx].contiguous()
    shared["seq_lens"] = case["seq_lens"][idx].contiguous()
    shared["seq_lens_list"] = [case["seq_lens_list"][g] for g in idx.tolist()]
    gen = torch.Generator(device=case["q"].device).manual_seed(seed + 1)
    q = case["q"]
    shared["q"] = torch.randn(bs, *q.shape[1:], device=q.device, generator=gen, dtype=torch.float32).to(q.dtype)
    indptr = paged["indptr"].tolist()
    pages = [paged["indices"][indptr[g]:indptr[g + 1]] for g in idx.tolist()]
    i32 = dict(dtype=torch.int32, device=q.device)
    shared_paged = dict(paged, indices=torch.cat(pages).to(**i32),
                        indptr=torch.tensor([0, *itertools.accumulate(len(p) for p in pages)], **i32),
                        last_page_len=paged["last_page_len"][idx].contiguous())
    return shared, shared_paged


def share_with_tails(case, requests, seed=0):
    """A decode batch of requests over a case's blocks where some share a prefix: request ``r`` of
    ``requests`` = ``(prefix_source, shared_blocks, tail_source, tail_len)`` reads the first
    ``shared_blocks`` blocks of case request ``prefix_source``'s table, then the first
    ``ceil(tail_len / B)`` blocks of ``tail_source``'s (its own question and generated tokens), with
    its own query. Returns the case dict with ``q``, ``block_table``, ``seq_lens``, ``seq_lens_list``
    and ``max_blocks`` replaced."""
    B = case["block_size"]
    table = case["block_table"].cpu()
    rows, lens = [], []
    for prefix, shared, tail, tail_len in requests:
        rows.append(torch.cat([table[prefix, :shared], table[tail, : -(-tail_len // B)]]))
        lens.append(shared * B + tail_len)
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), -(1 << 30), dtype=torch.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    q = case["q"]
    gen = torch.Generator(device=q.device).manual_seed(seed + 3)
    q_new = torch.randn(len(rows), *q.shape[1:], device=q.device, generator=gen, dtype=torch.float32).to(q.dtype)
    return dict(case, q=q_new, block_table=out.to(q.device), seq_lens=torch.tensor(lens, dtype=torch.int32,
                device=q.device), seq_lens_list=lens, max_blocks=width)  # fmt: skip


# ------------------------------------------------------------------------------------------- extend
def make_extend_case(prefix_lens, new_lens, q_heads=32, kv_heads=8, head_dim=128, sk=0.0, sv=0.0,
                     dtype=torch.float16, device="cuda", max_blocks=None, seed=0, magnitude=True, shuffle=True,
                     compress_new=False, **kw):
    """Inputs of ``HieraSparseExtend.run``: request r has a cached prefix of ``prefix_lens[r]`` tokens (1 sink
    page, compressed virtual blocks, 4 window pages: :func:`make_case`'s layout over the prefix) and
    ``new_lens[r]`` new tokens in cache pages after it; ``q`` is packed ``[sum(new_lens), Hq, D]`` with
    ``qo_indptr``. ``compress_new`` (full prefill over compressed KV, as chunked prefill with pruning
    sees it): the layout covers the whole sequence, new tokens included. Returns :func:`make_case`'s
    dict plus ``qo_indptr`` (GPU int32), ``qo_indptr_list``, ``new_lens`` and ``prefix_lens``."""
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    layout = seq_lens if compress_new else prefix_lens
    case = make_case(seq_lens, q_heads, kv_heads, head_dim, sk, sv, dtype, device, max_blocks=max_blocks,
                     seed=seed, magnitude=magnitude, shuffle=shuffle, prefix_lens=list(layout), **kw)
    gen = torch.Generator(device=device).manual_seed(seed + 7919)
    total = sum(new_lens)
    case["q"] = torch.randn(total, q_heads, head_dim, device=device, generator=gen, dtype=torch.float32).to(dtype)
    indptr = [0]
    for n in new_lens:
        indptr.append(indptr[-1] + n)
    case.update(qo_indptr=torch.tensor(indptr, dtype=torch.int32, device=device), qo_indptr_list=indptr,
                new_lens=list(new_lens), prefix_lens=list(prefix_lens))
    return case


def extend_run_args(case: dict) -> list:
    """Positional arguments of ``HieraSparseExtend.run``."""
    return [case["q"], case["qo_indptr"], *run_args(case)[1:]]


# ------------------------------------------------------------------------------------------- references
def extend_reference(case, device=None):
    """The oracle (``sglang_hs.reference.paged_attention``, float32 arithmetic) on ``device`` (default: where
    the case lives; on a GPU its many small products run in seconds instead of a minute): ``(out, lse)``."""
    from sglang_hs import reference as R

    dev = torch.device(device) if device is not None else case["q"].device
    t = {k: case[k].to(dev) for k in ("q", "k_cache", "v_cache", "k_index", "v_index", "block_table")}
    return R.paged_attention(t["q"], case["qo_indptr_list"], t["k_cache"], t["v_cache"], pools_of(case, dev),
                             t["k_index"], t["v_index"], t["block_table"], case["seq_lens_list"], case["sm_scale"])


def flashinfer_decode(case, paged, workspace=None, backend="fa2"):
    """A planned FlashInfer tensor-core decode wrapper over ``paged`` (``backend`` fa2, as SGLang's
    FlashInfer backend, or fa3: the prefill kernels at one query a request); returns ``run() -> out``."""
    import flashinfer

    q = case["q"]
    H, D = paged["k"].shape[2], paged["k"].shape[3]
    workspace = workspace if workspace is not None else torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True, backend=backend)
    w.plan(paged["indptr"], paged["indices"], paged["last_page_len"], q.shape[1], H, D, case["block_size"],
           q_data_type=q.dtype, kv_data_type=paged["k"].dtype, sm_scale=case["sm_scale"])
    out = torch.empty_like(q)
    kv = (paged["k"], paged["v"])
    return lambda: w.run(q, kv, out=out)


def flashinfer_extend(case, paged, workspace=None, backend="fa2"):
    """A planned FlashInfer ``BatchPrefillWithPagedKVCacheWrapper`` (causal, NHD, page 64) over ``paged``
    (:func:`paged_dense`, the pruned KV of the same requests); returns ``run() -> out``. ``fa2`` is the
    backend SGLang's FlashInfer attention backend uses for paged prefill."""
    import flashinfer

    q = case["q"]
    H, D = paged["k"].shape[2], paged["k"].shape[3]
    workspace = workspace if workspace is not None else torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    w.plan(case["qo_indptr"], paged["indptr"], paged["indices"], paged["last_page_len"], q.shape[1], H, D,
           case["block_size"], causal=True, sm_scale=case["sm_scale"], q_data_type=q.dtype,
           kv_data_type=paged["k"].dtype)
    out = torch.empty_like(q)
    kv = (paged["k"], paged["v"])
    return lambda: w.run(q, kv, out=out)


def flashinfer_ragged_prefill(case, paged, workspace=None):
    """Full prefill as SGLang's FlashInfer backend runs it for a request without a cached prefix:
    ``BatchPrefillWithRaggedKVCacheWrapper`` (backend ``auto``: fa3 on Hopper), causal, over contiguous
    dense K and V (``paged``, :func:`paged_dense`, laid out request after request). Returns ``(run() ->
    out, backend chosen)``."""
    import flashinfer

    q = case["q"]
    mb = case["max_blocks"]
    rows = [paged[x].view(-1, mb, *paged[x].shape[1:]) for x in ("k", "v")]  # [bs, max_blocks, B, H, D]
    k, v = (torch.cat([r[i].flatten(0, 1)[:L] for i, L in enumerate(case["seq_lens_list"])]) for r in rows)
    workspace = workspace if workspace is not None else torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="auto")
    w.plan(case["qo_indptr"], case["qo_indptr"], q.shape[1], k.shape[1], k.shape[2], causal=True,
           sm_scale=case["sm_scale"], q_data_type=q.dtype, kv_data_type=k.dtype)
    out = torch.empty_like(q)
    return (lambda: w.run(q, k, v, out=out)), getattr(w, "_backend", "auto")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against ``b``."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------- metrics
def kv_bytes(case):
    """Bytes of K and V that one decode step must read (pools as stored, cache pages, index maps)."""
    B, H = case["block_size"], case["k_cache"].shape[1]
    D = case["k_cache"].shape[2]
    esz = case["k_cache"].element_size()
    total = 0
    for r, L in enumerate(case["seq_lens_list"]):
        for j, kind in enumerate(case["kinds"][r]):
            if kind == "c":
                total += 2 * B * H * D * esz
    for idx in ("k_index", "v_index"):
        index = case[idx]
        n_sp = int((index < 0).sum())
        n_d = index.numel() - n_sp
        total += n_d * B * D * esz + n_sp * (B * D // 2 * esz + B * D // 16 * 2)
    return total


def extend_flops(case):
    """Causal attention FLOPs of the case (both GEMMs, dense equivalent)."""
    Hq, D = case["q"].shape[1], case["q"].shape[2]
    keys = sum(n * p + n * (n + 1) // 2 for p, n in zip(case["prefix_lens"], case["new_lens"]))
    return 4 * D * Hq * keys
