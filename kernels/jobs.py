"""The TileLang kernels a model shape needs, and compiling the missing ones in parallel processes.

A job is ``(kind, args)``: ``args`` are all the arguments of that kind's builder (``build_decode_kernel``,
``build_extend_kernel``, ``build_pack_kernel``, ``build_loss_kernel``) but the target, which is also the
key of its entry in TileLang's disk cache (:func:`sglang_hs.kernels.common.load_cached`). No job
depends on a batch size or a context length, so a server needs the same few kernels whatever its
CUDA-graph settings.

The server (``HieraSparseAttnBackend``) calls :func:`prepare_kernels` once at start-up; ``python -m
sglang_hs.launch.warm_kernels`` calls :func:`compile_missing` to fill a cache for another machine.
Compilation runs in spawned processes (TileLang lowering and nvcc are single-threaded; each kernel
takes 20-90 s); their GPUs are hidden, so no worker opens a CUDA context on a serving GPU. One process
at a time compiles into a cache directory (a file lock next to TileLang's cache), so the ranks of a
tensor-parallel server do not compile the same kernels side by side: the first compiles, the others
wait and then load.

Importing this module needs neither TileLang nor a GPU.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import multiprocessing
import os
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterator

from sglang_hs.config import KERNEL_GQA_GROUPS

Job = tuple[str, tuple]
BLOCK_SIZE = 64
LOCK_NAME = "hierasparse-compile.lock"


def model_jobs(q_heads: int, kv_heads: int, head_dim: int, dtype: str, *, decode: bool = True,
               extend_k_sparse: tuple[bool, ...] = (False, True), compress: bool = True,
               loss_operands: tuple[str, ...] = ("k", "v"),
               shared_decode_forms: tuple[str, str] | None = None, store_fp8: bool = False,
               cache_fp8: bool = False, decode_compact: tuple[str, str] | None = None) -> list[Job]:  # fmt: skip
    """The kernels of one model shape (per tensor-parallel rank): the decode kernel (``decode``) and,
    with ``shared_decode_forms`` (the block forms of its shared pass, ``decode_shared.compressed_forms``),
    the shared-prefix decode's own-pass kernel (a split floor) and shared-pass kernels (the extend
    kernel's ``SHARED_TILE`` over its folded columns, for those forms: with 2:4 K rows for 2:4 K blocks,
    without for dense K, else as ``extend_k_sparse`` lists, both when it is empty), the extend tiles, each with and
    without 2:4 K rows as ``extend_k_sparse`` lists (empty: none), the pack kernel (``compress``) and
    the loss kernels of ``loss_operands``. A GQA group the attention kernels do not take gets the
    compressor's kernels only. ``store_fp8`` (an FP8 store), ``cache_fp8`` (and FP8 cache pages): the
    decode kernel is that variant; the extend kernel runs over 16-bit copies of a batch's blocks (the
    caller asks for its tiles without 2:4 K rows), and the settings enable no compress kernel.
    ``decode_compact`` (``decode.decode_compact``): the decode kernel is the compact one of those forms."""
    from sglang_hs.kernels.decode import STAGES as DECODE_STAGES
    from sglang_hs.kernels.decode import decode_kernel_args
    from sglang_hs.kernels.decode_shared import OWN_MIN_SPLIT_BLOCKS, fold_of, shared_heads, shared_pass_k_sparse
    from sglang_hs.kernels.extend import extend_kernel_args
    from sglang_hs.kernels.extend_common import TILES
    from sglang_hs.kernels.shared_pass_extend import SHARED_TILE

    jobs: list[Job] = []
    if q_heads // kv_heads in KERNEL_GQA_GROUPS:
        if decode and decode_compact:
            jobs.append(("decode", decode_kernel_args(q_heads, kv_heads, head_dim, BLOCK_SIZE, dtype, DECODE_STAGES,
                                                      compact=tuple(decode_compact))))  # fmt: skip
        elif decode:
            jobs.append(("decode", decode_kernel_args(q_heads, kv_heads, head_dim, BLOCK_SIZE, dtype, DECODE_STAGES,
                                                      store_fp8=store_fp8, cache_fp8=cache_fp8)))  # fmt: skip
        if decode and shared_decode_forms and fold_of(q_heads, kv_heads) >= 2:
            jobs.append(("decode", decode_kernel_args(q_heads, kv_heads, head_dim, BLOCK_SIZE, dtype, DECODE_STAGES,
                                                      min_split_blocks=OWN_MIN_SPLIT_BLOCKS)))  # fmt: skip
            k_sparse_options = shared_pass_k_sparse(shared_decode_forms[0], extend_k_sparse or (False, True))
            jobs += [("extend", extend_kernel_args(shared_heads(q_heads, kv_heads), kv_heads, head_dim, BLOCK_SIZE, dtype,
                                                   SHARED_TILE, _extend_stages(SHARED_TILE), k_sparse, shared_decode_forms,
                                                   dynamic_splits=True))
                     for k_sparse in k_sparse_options]  # fmt: skip
        jobs += [("extend", extend_kernel_args(q_heads, kv_heads, head_dim, BLOCK_SIZE, dtype, tile,
                                               _extend_stages(tile), k_sparse))
                 for tile in TILES for k_sparse in extend_k_sparse]  # fmt: skip
    if compress:
        jobs.append(("pack", (kv_heads, head_dim, BLOCK_SIZE)))
    jobs += [("loss", (operand, kv_heads, head_dim, BLOCK_SIZE, dtype)) for operand in loss_operands]
    return jobs


def _extend_stages(tile: str) -> int:
    from sglang_hs.kernels.extend import default_stages

    return default_stages(tile)


def _builder(kind: str) -> tuple[Callable, dict]:
    """A job kind's builder and the pass configs its cache entries are keyed with."""
    from sglang_hs.kernels import common, compress, decode, extend

    return {
        "decode": (decode.build_decode_kernel, common.PASS_CONFIGS),
        "extend": (extend.build_extend_kernel, extend.EXTEND_PASS_CONFIGS),
        "pack": (compress.build_pack_kernel, compress.PASS_CONFIGS),
        "loss": (compress.build_loss_kernel, compress.PASS_CONFIGS),
    }[kind]


def build(job: Job) -> Job:
    """Compile, or load from TileLang's disk cache, one kernel (memoized in this process)."""
    kind, args = job
    _builder(kind)[0](*args)
    return job


def is_cached(job: Job) -> bool:
    """Whether the kernel is in TileLang's disk cache (a hit also loads it into this process)."""
    from sglang_hs.kernels.common import load_cached

    kind, args = job
    return load_cached(kind, args, _builder(kind)[1]) is not None


def describe(job: Job) -> str:
    kind, args = job
    return f"{kind}{args}"


def _hide_gpus() -> None:
    """Worker initializer: compiling needs no GPU, and a CUDA context would take serving memory."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _run_in_worker(builder: Callable[[Job], Job], job: Job) -> Job:
    """One job in a worker; TileLang's per-kernel INFO lines stay out of the server's log (the parent
    logs progress)."""
    if builder is build:
        import tilelang

        tilelang.set_log_level("WARNING")
    return builder(job)


def compile_parallel(jobs: list[Job], workers: int, on_done: Callable[[int, Job, float], None],
                     builder: Callable[[Job], Job] | None = None) -> None:
    """Run ``builder`` (a module-level function: it is pickled) over ``jobs`` in ``workers`` spawned
    processes; ``on_done(k, job, seconds)`` after the k-th finishes. A failure raises once the others
    have stopped."""
    start = time.time()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max(1, min(workers, len(jobs))), mp_context=context,
                                                initializer=_hide_gpus) as pool:
        futures = {pool.submit(_run_in_worker, builder or build, job): job for job in jobs}
        for k, future in enumerate(concurrent.futures.as_completed(futures), 1):
            future.result()
            on_done(k, futures[future], time.time() - start)


@contextlib.contextmanager
def _exclusive(path: str, on_wait: Callable[[], None]) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (``on_wait()`` first if another process holds it); yields
    whether it had to wait."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        waited = False
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited = True
            on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield waited
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_workers() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def cache_dir() -> str:
    import tilelang

    return tilelang.env.TILELANG_CACHE_DIR


def compile_missing(jobs: list[Job], log: Callable[[str], None], workers: int | None = None,
                    lock_path: str | None = None, builder: Callable[[Job], Job] | None = None,
                    probe: Callable[[Job], bool] | None = None) -> int:
    """Compile the jobs that TileLang's disk cache lacks, in parallel, one process per cache at a time.
    Returns how many this process compiled.

    Progress goes to ``log`` as ``hierasparse: compiling N kernels (k/N) ...`` lines; when every
    kernel is cached, nothing is logged. A process that finds another compiling waits for it (one line
    says so) and then compiles only what is still missing."""
    probe = probe or is_cached
    missing = [job for job in jobs if not probe(job)]
    lock_path = lock_path or os.path.join(cache_dir(), LOCK_NAME)
    where = os.path.dirname(lock_path)
    compiled = 0
    while missing:
        message = f"hierasparse: waiting for another process compiling {len(missing)} kernels into {where}"
        with _exclusive(lock_path, lambda: log(message)) as waited:
            if not waited:
                missing = [job for job in missing if not probe(job)]  # another may have finished meanwhile
                n = len(missing)
                if n:
                    procs = max(1, min(workers or default_workers(), n))
                    log(f"hierasparse: compiling {n} kernels (0/{n}) in {procs} processes into {where} (the first "
                        "start of this model shape; later starts load them)")
                    _compile_with_progress(missing, procs, log, builder)
                    compiled += n
                missing = []
        if waited:  # the other process is done: load what it compiled, compile what is still missing
            missing = [job for job in missing if not probe(job)]
    return compiled


def _compile_with_progress(jobs: list[Job], workers: int, log: Callable[[str], None],
                           builder: Callable[[Job], Job] | None) -> None:
    """:func:`compile_parallel` with ``(k/N)`` lines; if worker processes cannot run here (a daemonic
    process, a worker killed for memory), the jobs not done yet compile in this process."""
    n, done, start = len(jobs), [], time.time()

    def on_done(k: int, job: Job, seconds: float) -> None:
        done.append(job)
        log(f"hierasparse: compiling {n} kernels ({k}/{n}) {describe(job)} done at {seconds:.0f} s")

    try:
        compile_parallel(jobs, workers, on_done, builder)
    except (AssertionError, OSError, BrokenProcessPool) as exc:
        log(f"hierasparse: worker processes failed ({type(exc).__name__}: {exc}); compiling in this process")
        for job in [job for job in jobs if job not in done]:
            (builder or build)(job)
            on_done(len(done) + 1, job, time.time() - start)


def cache_enabled() -> bool:
    import tilelang

    return tilelang.env.is_cache_enabled()


def prepare_kernels(jobs: list[Job], log: Callable[[str], None], workers: int | None = None) -> int:
    """Start-up of a server: compile what the disk cache lacks (:func:`compile_missing`), then load
    every kernel into this process, so no request waits for one. Logs one line when nothing was
    compiled. Returns how many kernels this process compiled."""
    start = time.time()
    if cache_enabled():
        compiled = compile_missing(jobs, log, workers)
    else:
        log(f"hierasparse: TileLang's disk cache is off: compiling {len(jobs)} kernels in this process")
        compiled = len(jobs)
    for job in jobs:
        build(job)
    elapsed = time.time() - start
    if compiled:
        log(f"hierasparse: compiled {compiled} and loaded {len(jobs)} kernels in {elapsed:.0f} s")
    else:
        log(f"hierasparse: {len(jobs)} kernels loaded from TileLang's cache in {elapsed:.1f} s")
    return compiled
