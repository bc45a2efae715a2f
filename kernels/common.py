"""Host-side pieces that the TileLang attention kernels (``decode`` and ``extend``) share: build
constants, the plans' argument checks, and the stand-ins for empty pools.

Importing this module needs neither TileLang nor a GPU.
"""

from __future__ import annotations

import functools
import hashlib
import linecache
import os
from typing import Callable, NamedTuple

import torch

from sglang_hs.format import FP8_DTYPE, BlockPools

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}
SMEM_PER_SM = 228 * 1024  # H100/H200: 228 KB per SM, 227 KB usable per CTA, 1 KB reserved per CTA

PASS_CONFIGS = {
    "tl.disable_warp_specialized": True,
    "tl.disable_thread_storage_sync": True,
}


class Stage(NamedTuple):
    """One stage of a kernel's shared-memory ring: a block's K and V in each form, and its barriers
    (``full``: the stage's loads landed; ``empty``: every consumer warp is done with it, where the
    kernel has one). Only one form per operand is filled per block; ``k_values``/``k_meta`` are None
    in a kernel without 2:4 K rows. A kernel over FP8 pool rows (the decode kernel's ``store_fp8``) also
    has their TMA landing tiles (``*8``, e4m3, the pool's dtype; FP8 cache pages land in the dense ones),
    which the warpgroup converts into the 16-bit tiles above before the block's GEMMs; None otherwise.
    ``expanded``: where the extend kernel's producer expands 2:4 K rows into ``k_dense`` (``k_expand``), its
    one arrival per block once they are there; None otherwise."""

    k_dense: object  # [B, D]
    k_values: object  # [B, D/2]
    k_meta: object  # [B*D/256, 16] int16 (viewed as [B, D/16] by the GEMM)
    v_dense: object  # [B, D]
    v_values: object  # [D, B/2] (V^T)
    v_meta: object  # [B*D/256, 16] int16 (viewed as [D, B/16])
    full: object
    empty: object
    k_dense8: object = None  # [B, D] e4m3
    k_values8: object = None  # [B, D/2] e4m3
    v_dense8: object = None  # [B, D] e4m3
    v_values8: object = None  # [D, B/2] e4m3
    expanded: object = None  # the extend producer's barrier: a 2:4 K block expanded into k_dense (k_expand)


class KvSources(NamedTuple):
    """The kernel's global KV inputs: SGLang's cache buffers and one layer's pools."""

    k_cache: object  # [slots, Hkv, D]
    v_cache: object
    k_dense: object  # [rows, B, D]
    k_values: object  # [rows, B, D/2]
    k_meta: object  # [rows, B*D/256, 16] int16
    v_dense: object  # [rows, B, D]
    v_values: object  # [rows, D, B/2]
    v_meta: object  # [rows, B*D/256, 16] int16


KV_FORMS = ("any", "dense", "sparse")
"""What a kernel's stages hold for one operand (K or V): every form (``any``: cache pages, dense pool
rows and 2:4 rows), dense rows only (cache pages and dense pool rows), or 2:4 rows only. A kernel
compiled for fewer forms has smaller stages, so more CTAs fit an SM; it must only be given blocks of
its forms."""
ANY_FORMS = ("any", "any")


def stage_form_bytes(form: str, block_size: int, head_dim: int) -> int:
    """Shared memory (bytes) that one operand's block takes in a pipeline stage holding ``form``
    (:data:`KV_FORMS`): a 16-bit dense tile, 2:4 values + int16 metadata, or both."""
    elems = block_size * head_dim
    return (elems * 2 if form in ("any", "dense") else 0) + (elems + elems // 8 if form in ("any", "sparse") else 0)


def fp8_landing_bytes(form: str, block_size: int, head_dim: int) -> int:
    """Shared memory (bytes) of one operand's FP8 landing tiles in a stage holding ``form``: e4m3 pool
    rows, dense ``[B, D]`` and/or 2:4 values (half the elements), at one byte a value."""
    elems = block_size * head_dim
    return (elems if form in ("any", "dense") else 0) + (elems // 2 if form in ("any", "sparse") else 0)


def tma_loads(T, block_size: int, k_form: str = "any", v_form: str = "any", store_fp8: bool = False,
              cache_fp8: bool = False):
    """The TileLang macros ``load_k(mode, k_row, h, stage, src)`` and ``load_v(mode, v_row, h, stage,
    src)``: the TMA loads of a block's K (mode ``& 3``) or V (mode ``>> 2``) of KV head ``h`` into a
    :class:`Stage` from a :class:`KvSources`, on the stage's ``full`` barrier. Mode 0: a cache page (the
    row is the page, a strided 3-D box); 1: a dense pool row; 2: 2:4 values and metadata of a pool row
    (the metadata tile is contiguous and moved as a ``[B*D/256, 16]`` box: TMA needs an inner box of
    >= 16 bytes). ``k_form`` / ``v_form`` (:data:`KV_FORMS`): the forms the stage holds; the branches
    of the others are not generated. ``store_fp8`` (``form`` ``any`` only): pool rows are e4m3 and land
    in the stage's FP8 tiles (``k_dense8`` ..), cache pages in its 16-bit tiles; ``cache_fp8`` (with
    ``store_fp8``): cache pages are e4m3 too (SGLang's FP8 pages) and land in the dense FP8 tiles."""
    B = block_size
    assert k_form in KV_FORMS and v_form in KV_FORMS
    assert not store_fp8 or (k_form, v_form) == ANY_FORMS
    assert store_fp8 or not cache_fp8

    @T.macro
    def load_k(mode, k_row, h, stage, src):
        if k_form == "sparse":
            T.tma_copy(src.k_values[k_row, :, :], stage.k_values, barrier=stage.full)
            T.tma_copy(src.k_meta[k_row, :, :], stage.k_meta, barrier=stage.full)
        elif k_form == "dense":
            if (mode & 3) == 0:
                T.tma_copy(src.k_cache[k_row * B:(k_row + 1) * B, h, :], stage.k_dense, barrier=stage.full)
            else:
                T.tma_copy(src.k_dense[k_row, :, :], stage.k_dense, barrier=stage.full)
        elif store_fp8:
            if (mode & 3) == 0:
                if cache_fp8:
                    T.tma_copy(src.k_cache[k_row * B:(k_row + 1) * B, h, :], stage.k_dense8, barrier=stage.full)
                else:
                    T.tma_copy(src.k_cache[k_row * B:(k_row + 1) * B, h, :], stage.k_dense, barrier=stage.full)
            elif (mode & 3) == 1:
                T.tma_copy(src.k_dense[k_row, :, :], stage.k_dense8, barrier=stage.full)
            else:
                T.tma_copy(src.k_values[k_row, :, :], stage.k_values8, barrier=stage.full)
                T.tma_copy(src.k_meta[k_row, :, :], stage.k_meta, barrier=stage.full)
        else:
            if (mode & 3) == 0:
                T.tma_copy(src.k_cache[k_row * B:(k_row + 1) * B, h, :], stage.k_dense, barrier=stage.full)
            elif (mode & 3) == 1:
                T.tma_copy(src.k_dense[k_row, :, :], stage.k_dense, barrier=stage.full)
            else:
                T.tma_copy(src.k_values[k_row, :, :], stage.k_values, barrier=stage.full)
                T.tma_copy(src.k_meta[k_row, :, :], stage.k_meta, barrier=stage.full)

    @T.macro
    def load_v(mode, v_row, h, stage, src):
        if v_form == "sparse":
            T.tma_copy(src.v_values[v_row, :, :], stage.v_values, barrier=stage.full)
            T.tma_copy(src.v_meta[v_row, :, :], stage.v_meta, barrier=stage.full)
        elif v_form == "dense":
            if (mode >> 2) == 0:
                T.tma_copy(src.v_cache[v_row * B:(v_row + 1) * B, h, :], stage.v_dense, barrier=stage.full)
            else:
                T.tma_copy(src.v_dense[v_row, :, :], stage.v_dense, barrier=stage.full)
        elif store_fp8:
            if (mode >> 2) == 0:
                if cache_fp8:
                    T.tma_copy(src.v_cache[v_row * B:(v_row + 1) * B, h, :], stage.v_dense8, barrier=stage.full)
                else:
                    T.tma_copy(src.v_cache[v_row * B:(v_row + 1) * B, h, :], stage.v_dense, barrier=stage.full)
            elif (mode >> 2) == 1:
                T.tma_copy(src.v_dense[v_row, :, :], stage.v_dense8, barrier=stage.full)
            else:
                T.tma_copy(src.v_values[v_row, :, :], stage.v_values8, barrier=stage.full)
                T.tma_copy(src.v_meta[v_row, :, :], stage.v_meta, barrier=stage.full)
        else:
            if (mode >> 2) == 0:
                T.tma_copy(src.v_cache[v_row * B:(v_row + 1) * B, h, :], stage.v_dense, barrier=stage.full)
            elif (mode >> 2) == 1:
                T.tma_copy(src.v_dense[v_row, :, :], stage.v_dense, barrier=stage.full)
            else:
                T.tma_copy(src.v_values[v_row, :, :], stage.v_values, barrier=stage.full)
                T.tma_copy(src.v_meta[v_row, :, :], stage.v_meta, barrier=stage.full)

    return load_k, load_v


def entry_mode(T, k_entry, v_entry):
    """The mode of a virtual block (``k_mode | v_mode << 2``: 1 a dense pool row, 2 a 2:4 row) from its
    signed index-map entries (``>= 0`` dense row, ``< 0`` 2:4 row ``-i - 1``); a cache page is mode 0."""
    return T.if_then_else(k_entry >= 0, 1, 2) + T.if_then_else(v_entry >= 0, 4, 8)


def entry_row(T, entry):
    """The pool row of a signed index-map entry (``>= 0`` dense row, ``< 0`` 2:4 row ``-i - 1``)."""
    return T.if_then_else(entry >= 0, entry, -entry - 1)


def pin_source(path: str) -> None:
    """Keep a kernel module's text as it was imported for TileLang's frontend, which reads each macro's
    and prim_func's source back (``inspect.getsource``, through ``linecache``) whenever a kernel is
    built: after an edit of the file since import, it would parse other lines than the running code's
    (``Attribute assignment not supported yet, `...load_k` ``, or another kernel). An entry whose
    mtime is None is never reloaded by ``linecache.checkcache``. The generated TIR is unchanged."""
    with open(path) as f:
        lines = f.read().splitlines(keepends=True)
    linecache.cache[path] = (sum(map(len, lines)), None, lines, path)


pin_source(__file__)


def check_plan_shape(q_heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    """The shapes and dtypes the kernels are written for."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}")
    if q_heads % kv_heads:
        raise ValueError("q_heads must be a multiple of kv_heads")
    if head_dim not in (64, 128) or block_size != 64:
        raise ValueError("head_dim must be 64 or 128 and block_size 64")


def split_count(pairs: int, blocks: int, num_sms: int, ctas_per_sm: int | Callable[[int], int], max_splits: int,
                cta_overhead_blocks: float = 0.0, min_splits: int = 1) -> int:
    """The split-KV cost model of both attention kernels: the fewest splits ``S >= min_splits`` per
    (work item, KV head) within 2% of the best modelled time (fewer splits: less scratch, cheaper merge).

    ``pairs`` CTAs per split run in waves of ``num_sms * ctas_per_sm`` (``ctas_per_sm`` may depend on
    ``S``: a callable); a CTA costs ``ceil(blocks / S)`` block steps plus ``cta_overhead_blocks``; each
    split adds a twentieth of a block (its partial and its share of the merge).
    """
    best = []
    for s in range(min_splits, max(min_splits, min(max_splits, blocks)) + 1):
        slots = max(1, num_sms * (ctas_per_sm(s) if callable(ctas_per_sm) else ctas_per_sm))
        waves = -(-pairs * s // slots)
        cost = waves * (-(-blocks // s) + cta_overhead_blocks) + 0.05 * s
        best.append((cost, s))
    lo = min(c for c, _ in best)
    return min(s for c, s in best if c <= lo * 1.02)


class PoolArgs:
    """One layer's pools and the index maps as the kernels take them.

    A TMA descriptor cannot describe a zero-length tensor, so an empty pool (no 2:4 K rows at
    S_K = 0, say) or index map is replaced by a one-row stand-in (of the pool's dtype: 16-bit or
    e4m3); no block-table entry points at it, so it is never read. Metadata pools are viewed as
    ``[rows, B*D/256, 16]`` int16. FP8 pools' float32 row scales (``scales=True``) likewise: an empty
    (or absent) one is a one-row stand-in of scale 1.
    """

    def __init__(self, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device):
        self.meta_rows = block_size * head_dim // 256
        kw = dict(device=device)
        self.dummy = {
            "dense": torch.zeros(1, block_size, head_dim, dtype=dtype, **kw),
            "k_values": torch.zeros(1, block_size, head_dim // 2, dtype=dtype, **kw),
            "v_values": torch.zeros(1, head_dim, block_size // 2, dtype=dtype, **kw),
            "meta": torch.zeros(1, self.meta_rows, 16, dtype=torch.int16, **kw),
            "index": torch.zeros(kv_heads, 1, dtype=torch.int32, **kw),
            "scale": torch.ones(1, dtype=torch.float32, **kw),
        }
        self._fp8_dummy: dict[str, torch.Tensor] = {}

    def _or_dummy(self, t: torch.Tensor, key: str) -> torch.Tensor:
        if t.numel():
            return t
        if t.dtype == FP8_DTYPE:  # an empty e4m3 pool: an e4m3 stand-in (the kernel's argument type)
            if key not in self._fp8_dummy:
                self._fp8_dummy[key] = self.dummy[key].to(FP8_DTYPE)
            return self._fp8_dummy[key]
        return self.dummy[key]

    def __call__(self, pools: BlockPools, k_index: torch.Tensor, v_index: torch.Tensor, scales: bool = False) -> tuple:
        """``(k_dense, k_values, k_meta, v_dense, v_values, v_meta, k_index, v_index)``, ready to launch;
        with ``scales`` the four float32 row scales (``k_dense_scale, k_values_scale, v_dense_scale,
        v_values_scale``) follow ``v_meta``: the arguments of a kernel over FP8 pools."""
        k_index, v_index = self._or_dummy(k_index, "index"), self._or_dummy(v_index, "index")
        if k_index.shape[1] != v_index.shape[1]:  # one of them empty: both must be stand-ins then
            k_index = v_index = self.dummy["index"]
        values = (
            self._or_dummy(pools.k_dense, "dense"), self._or_dummy(pools.k_values, "k_values"),
            self._or_dummy(pools.k_meta, "meta").reshape(-1, self.meta_rows, 16),
            self._or_dummy(pools.v_dense, "dense"), self._or_dummy(pools.v_values, "v_values"),
            self._or_dummy(pools.v_meta, "meta").reshape(-1, self.meta_rows, 16),
        )  # fmt: skip
        if scales:
            values += tuple(self.dummy["scale"] if t is None or not t.numel() else t
                            for t in (pools.k_dense_scale, pools.k_values_scale, pools.v_dense_scale,
                                      pools.v_values_scale))  # fmt: skip
        return values + (k_index, v_index)


KERNEL_SOURCES = ("common.py", "decode.py", "extend.py", "extend_common.py", "extend_overlap.py",
                  "extend_producer.py", "compress.py")
"""The files whose text defines the compiled kernels (with ``sglang_hs/format.py``): their digest is
part of every kernel's cache entry, so an edited kernel is never loaded from a stale entry."""


@functools.lru_cache(maxsize=None)
def kernel_source_digest() -> str:
    """sha256 of the kernel sources (read once per process)."""
    from sglang_hs import format as block_format

    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for path in [os.path.join(here, name) for name in KERNEL_SOURCES] + [block_format.__file__]:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def _frontend_key(kind: str, args: tuple) -> dict:
    return {"project": "sglang-hierasparse", "kind": kind, "args": repr(tuple(args)),
            "sources": kernel_source_digest()}


def load_cached(kind: str, args: tuple, pass_configs: dict, target=None):
    """The kernel ``kind(*args)`` from TileLang's disk cache, or None when it was never compiled there.

    Entries are found by (kind, args, source digest) through TileLang's frontend cache
    (``tilelang.cache.load_frontend_cached``), so a hit builds no ``prim_func`` and hashes no TIR: a
    warm start loads each kernel in a fraction of a second."""
    import tilelang  # noqa: F401 (first: importing tilelang.cache alone is a circular import in 0.1.11)
    from tilelang.cache import load_frontend_cached

    return load_frontend_cached(_frontend_key(kind, args), target=target or SM90_TARGET, pass_configs=pass_configs)


def compile_cached(kind: str, args: tuple, make_func: Callable[[], object], pass_configs: dict, target=None,
                   name: str | None = None):  # fmt: skip
    """``tilelang.compile(make_func())`` through :func:`load_cached`: load the kernel when its entry
    exists, else compile it (into TileLang's disk cache) and record the entry. ``args`` must be every
    argument the kernel depends on (the builder's parameters but ``target``). The CUDA kernel is named
    ``{name}_kernel`` (``name`` a function of ``args``, default ``hs_{kind}``), not TileLang's
    ``main_kernel`` for all of them, so that profiler traces tell the kernels apart."""
    import tilelang
    from tilelang.cache import store_frontend_cache

    kernel = load_cached(kind, args, pass_configs, target)
    if kernel is None:
        func = make_func().with_attr("global_symbol", name or f"hs_{kind}")
        kernel = tilelang.compile(func, target=target or SM90_TARGET, pass_configs=pass_configs)
        key = getattr(kernel, "_tilelang_cache_key", None)
        if key:
            store_frontend_cache(_frontend_key(kind, args), key, target=target or SM90_TARGET,
                                 pass_configs=pass_configs)
    return kernel


def precompile_main(description: str, build_one: Callable, configs: list) -> None:
    """The command line of a kernel module's ``PRECOMPILE``: ``build_one`` (a module-level function)
    over ``configs`` in ``--jobs`` processes, each kernel compiled into TileLang's disk cache."""
    import argparse
    import concurrent.futures
    import time

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    t0 = time.time()
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        for cfg in pool.map(build_one, configs):
            print(f"{cfg} ready ({time.time() - t0:.0f} s)", flush=True)
