"""Prebuilt kernel archives: compile the TileLang kernels of common model shapes once, on any machine
with TileLang and nvcc (no GPU needed), and install them where a server looks, so that its first start
compiles nothing for those shapes.

    python -m sglang_hs.launch.prebuilt_kernels build --out ARCHIVE.tar.gz \\
        [--shapes common|MODEL_NAME|MODEL_DIR ...] [--tp-sizes 1,2,4,8] [--dtypes bfloat16,float16] [--jobs N]
    python -m sglang_hs.launch.prebuilt_kernels install ARCHIVE.tar.gz

``build`` compiles, into a fresh cache directory, the kernels ``warm_kernels`` would compile for each
shape (every setting's variants), for each tensor-parallel size that divides the model's query heads,
and packs that cache with a ``manifest.json``. ``common`` is :data:`COMMON_MODELS` in both dtypes; a
name from it picks one model; a folder with a ``config.json`` is read as ``warm_kernels`` reads it.
``install`` unpacks an archive into ``TILELANG_CACHE_DIR`` (default ``~/.tilelang/cache``); a shape
it lacks compiles at start-up as before.

Why an archive built elsewhere is valid here: a server finds each kernel through TileLang's frontend
cache, ``TILELANG_CACHE_DIR/<TileLang version>-<machine>/frontend/<key>.json``, whose key hashes our
(kind, args, kernel source digest), the target, TileLang's execution backend and the pass configs
(``kernels/common.py``: ``load_cached``); the entry names a ``kernels/<key>/`` folder (an
``executable.so`` that needs only libc and holds sm_90a SASS, the pickled ``PrimFunc`` and params).
Neither key holds the Python or nvcc version (an archive built under Python 3.11 serves 3.12: TileLang's
wheel is abi3, the pickles hold no code). ``install`` refuses, in one line saying why, an archive whose
TileLang version, TileLang native libraries (the kernel key's build stamp), machine or kernel sources
differ from this machine's, or whose nvcc major version differs from a local nvcc (a newer toolkit's
cubins need a newer driver).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import os
import platform
import shutil
import tarfile
import tempfile
import time
from typing import Callable

from sglang_hs.kernels.jobs import Job, build, cache_dir, cache_enabled, compile_missing, default_workers, describe
from sglang_hs.launch.warm_kernels import kernel_jobs, model_shape

FORMAT = 1
MANIFEST = "manifest.json"
CACHE_PREFIX = "cache"
TP_SIZES = (1, 2, 4, 8)
DTYPES = ("bfloat16", "float16")
COMMON_MODELS = {
    # name: (query heads, KV heads, head_dim); models with the same attention shape share a row
    "llama-3.1-8b": (32, 8, 128),  # also Mistral-7B, Mixtral-8x7B, Qwen3-4B/8B, DeepSeek-R1-Distill-Llama-8B
    "llama-3.1-70b": (64, 8, 128),  # also Qwen2.5-72B, Qwen3-32B
    "llama-3.2-1b": (32, 8, 64),
    "llama-3.2-3b": (24, 8, 128),
    "qwen2.5-0.5b": (14, 2, 64),
    "qwen2.5-1.5b": (12, 2, 128),
    "qwen2.5-3b": (16, 2, 128),
    "qwen2.5-7b": (28, 4, 128),  # also DeepSeek-R1-Distill-Qwen-7B
    "qwen2.5-14b": (40, 8, 128),  # also Qwen2.5-32B, Qwen3-14B
    "qwen3-1.7b": (16, 8, 128),  # also Qwen3-0.6B
    "smollm2-135m": (9, 3, 64),
    "smollm2-360m": (15, 5, 64),
    "smollm2-1.7b": (32, 32, 64),
}
"""Attention shapes of widely served Llama-style checkpoints (head_dim 64 or 128, GQA groups 1 to 8)."""


def table_shapes(name: str, tp_sizes: tuple[int, ...], dtypes: tuple[str, ...]) -> list[dict]:
    """A :data:`COMMON_MODELS` row's per-rank shapes, split over the ranks as ``warm_kernels.model_shape``
    splits a config's heads."""
    q_heads, kv_heads, head_dim = COMMON_MODELS[name]
    return [{"model": name, "tp": tp, "q_heads": q_heads // tp, "kv_heads": max(1, kv_heads // tp),
             "head_dim": head_dim, "dtype": dtype}
            for dtype in dtypes for tp in tp_sizes if q_heads % tp == 0]  # fmt: skip


def dir_shapes(path: str, tp_sizes: tuple[int, ...]) -> list[dict]:
    """A model folder's per-rank shapes, one per tensor-parallel size that divides its query heads."""
    if not os.path.exists(os.path.join(path, "config.json")):
        raise SystemExit(f"error: --shapes {path}: neither 'common', a name of COMMON_MODELS nor a folder with "
                         "config.json")
    full = model_shape(path, 1)
    if full["head_dim"] not in (64, 128):
        raise SystemExit(f"error: {path} has head_dim {full['head_dim']}; the kernels take 64 or 128")
    name = os.path.basename(os.path.normpath(path))
    return [{"model": name, "tp": tp, **model_shape(path, tp)} for tp in tp_sizes if full["q_heads"] % tp == 0]


def resolve_shapes(specs: list[str], tp_sizes: tuple[int, ...], dtypes: tuple[str, ...]) -> list[dict]:
    """Every (model, TP size, dtype) shape the ``--shapes`` arguments name."""
    shapes: list[dict] = []
    for spec in specs:
        if spec == "common":
            shapes += [s for name in COMMON_MODELS for s in table_shapes(name, tp_sizes, dtypes)]
        elif spec in COMMON_MODELS:
            shapes += table_shapes(spec, tp_sizes, dtypes)
        else:
            shapes += dir_shapes(spec, tp_sizes)
    return shapes


def shape_key(shape: dict) -> tuple:
    return shape["q_heads"], shape["kv_heads"], shape["head_dim"], shape["dtype"]


def jobs_of(shapes: list[dict]) -> list[Job]:
    """The kernels of all shapes, each once (models and TP sizes often share a per-rank shape)."""
    jobs: dict[Job, None] = {}
    for shape in shapes:
        jobs.update(dict.fromkeys(kernel_jobs(shape)))
    return list(jobs)


def environment() -> dict:
    """What decides whether a cache entry built here loads elsewhere (checked by ``install``), and what
    only describes the build (``python``, ``nvcc`` but its major version)."""
    import tilelang
    from tilelang.cache.kernel_cache import KernelCache

    from sglang_hs.kernels.common import SM90_TARGET, kernel_source_digest

    try:
        from tilelang.contrib.nvcc import get_cuda_version

        nvcc = ".".join(map(str, get_cuda_version()))
    except (RuntimeError, OSError, IndexError, ValueError):
        nvcc = None
    stamp = getattr(KernelCache, "_get_tilelang_lib_stamp", lambda: None)()  # part of every kernel key
    return {
        "tilelang": tilelang.__version__,
        "tilelang_libs": hashlib.sha256(stamp.encode()).hexdigest() if stamp else None,
        "machine": platform.machine(),
        "sources": kernel_source_digest.__wrapped__(),  # read now: the once-per-process value may be stale
        "target": SM90_TARGET["arch"],
        "python": platform.python_version(),
        "nvcc": nvcc,
    }


CHECKED = ("tilelang", "tilelang_libs", "machine", "sources")
"""Manifest fields that must equal this machine's: they decide which cache entries TileLang and the
kernels look up, and that a kernel compiled there is the one this code would compile."""


def mismatches(manifest: dict, here: dict) -> list[str]:
    """Why an archive's kernels must not be installed here (empty: they may)."""
    if manifest.get("format") != FORMAT:
        return [f"archive format {manifest.get('format')!r}, this tool reads {FORMAT}"]
    names = {"tilelang_libs": "TileLang native libraries", "sources": "kernel sources (sha256)"}
    problems = [f"{names.get(key, key)} {_short(manifest.get(key))} in the archive, {_short(here[key])} here"
                for key in CHECKED if manifest.get(key) != here[key]]  # fmt: skip
    built, local = manifest.get("nvcc"), here.get("nvcc")
    if built and local and built.split(".")[0] != local.split(".")[0]:
        problems.append(f"nvcc {built} in the archive, {local} here")
    return problems


def _short(value: object) -> str:
    text = str(value)
    return text[:12] if len(text) == 64 else text[:40]


def _compile_one(job: Job) -> Job:
    """Worker: compile one kernel; a failure is printed and leaves the kernel out of the archive (a server
    compiles it at start-up) instead of stopping the other shapes' builds."""
    import tilelang

    tilelang.set_log_level("WARNING")
    try:
        build(job)
    except Exception as exc:  # noqa: BLE001 (any compile failure: report and go on)
        print(f"[prebuilt] FAILED {describe(job)}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
    return job


def compile_into(cache: str, jobs: list[Job], workers: int, log: Callable[[str], None],
                 builder: Callable[[Job], Job] = _compile_one) -> list[Job]:  # fmt: skip
    """Compile ``jobs`` into the cache directory ``cache`` (spawned workers inherit it through
    ``TILELANG_CACHE_DIR``); returns the jobs whose kernels did not land there."""
    from sglang_hs.kernels.jobs import is_cached

    saved = os.environ.get("TILELANG_CACHE_DIR")
    os.environ["TILELANG_CACHE_DIR"] = cache
    try:
        compile_missing(jobs, log, workers, builder=builder)
        return [job for job in jobs if not is_cached(job)]  # the lookup a server makes, with this build's digest
    finally:
        if saved is None:
            os.environ.pop("TILELANG_CACHE_DIR", None)
        else:
            os.environ["TILELANG_CACHE_DIR"] = saved


def _kernel_members(cache: str) -> list[str]:
    """The cache's entries, relative to it: ``<namespace>/kernels/<key>`` and ``<namespace>/frontend/<key>.json``
    (TileLang's tmp, staging and Python-source folders and our lock stay out)."""
    members = []
    for namespace in sorted(os.listdir(cache)):
        for sub in ("kernels", "frontend"):
            folder = os.path.join(cache, namespace, sub)
            if os.path.isdir(folder):
                members += [os.path.join(namespace, sub, name) for name in sorted(os.listdir(folder))]
    return members


def pack(cache: str, manifest: dict, out: str) -> int:
    """Write ``out`` (a .tar.gz: the manifest first, then the cache's entries under ``cache/``), atomically.
    Returns its size in bytes."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    partial = out + ".partial"
    with tarfile.open(partial, "w:gz") as tar:
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
        for member in _kernel_members(cache):
            tar.add(os.path.join(cache, member), arcname=f"{CACHE_PREFIX}/{member}")
    os.replace(partial, out)
    return os.path.getsize(out)


def build_archive(out: str, specs: list[str], tp_sizes: tuple[int, ...], dtypes: tuple[str, ...], workers: int,
                  log: Callable[[str], None] = print) -> int:  # fmt: skip
    """The ``build`` command. Returns 0, or 1 when some kernels failed (the archive holds the others)."""
    if not cache_enabled():
        raise SystemExit("error: TileLang's disk cache is off (TILELANG_DISABLE_CACHE): nothing to pack")
    shapes = resolve_shapes(specs, tp_sizes, dtypes)
    if not shapes:
        raise SystemExit("error: no shape: no --tp-sizes value divides the models' query heads")
    jobs = jobs_of(shapes)
    here = environment()
    log(f"[prebuilt] {len(jobs)} kernels for {len(shapes)} shapes ({len({shape_key(s) for s in shapes})} per-rank), "
        f"TileLang {here['tilelang']}, nvcc {here['nvcc']}, sources {here['sources'][:12]}, {workers} processes")
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="hs-prebuilt-") as cache:
        missing = compile_into(cache, jobs, workers, lambda line: log(f"[prebuilt] {line}"))
        if environment()["sources"] != here["sources"]:
            raise SystemExit("error: the kernel sources changed during the build; not packed (run it again)")
        manifest = {"format": FORMAT, **here, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "shapes": shapes, "kernels": len(jobs) - len(missing),
                    "missing": [describe(job) for job in missing]}  # fmt: skip
        size = pack(cache, manifest, out)
    log(f"[prebuilt] wrote {out}: {len(jobs) - len(missing)} kernels, {size / 2**20:.1f} MiB, "
        f"{time.time() - start:.0f} s")
    if missing:
        log(f"[prebuilt] {len(missing)} kernels failed and are not in the archive (servers compile them at start-up)")
    return 1 if missing else 0


def read_manifest(archive: str) -> dict:
    try:
        with tarfile.open(archive, "r:gz") as tar:
            f = tar.extractfile(MANIFEST)
            return json.load(f) if f else {}
    except (OSError, tarfile.TarError, KeyError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: {archive} is not a prebuilt kernel archive ({type(exc).__name__}: {exc})") from exc


def _unpack(archive: str, staging: str) -> str:
    """The archive's cache entries, unpacked under ``staging`` (no path may leave it); returns their root."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(CACHE_PREFIX + "/")]
            tar.extractall(staging, members=members, filter="data")
    except (OSError, tarfile.TarError) as exc:
        raise SystemExit(f"error: {archive} could not be unpacked ({type(exc).__name__}: {exc}); "
                         "not installed") from exc
    return os.path.join(staging, CACHE_PREFIX)


def install_archive(archive: str, log: Callable[[str], None] = print) -> int:
    """The ``install`` command: check the manifest against this machine, then move each entry into
    TileLang's cache unless it is there already (a kernel folder appears whole: renamed in from a
    staging folder beside it, so a server starting meanwhile never reads half of one)."""
    manifest = read_manifest(archive)
    problems = mismatches(manifest, environment())
    if problems:
        raise SystemExit(f"error: {archive} was built for another setup ({'; '.join(problems)}): not installed; "
                         "servers compile their kernels at start-up as before")
    dest = cache_dir()
    os.makedirs(dest, exist_ok=True)
    added = 0
    staging = tempfile.mkdtemp(prefix=".hs-prebuilt-", dir=dest)
    try:
        root = _unpack(archive, staging)
        for member in sorted(_kernel_members(root), key=lambda m: "/frontend/" in m):  # kernels before their names
            target = os.path.join(dest, member)
            if os.path.exists(target):
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.rename(os.path.join(root, member), target)
            added += "/frontend/" in member
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    shapes = sorted({f"{s['model']} tp{s['tp']} {s['dtype']}" for s in manifest.get("shapes", [])})
    log(f"[prebuilt] installed {manifest.get('kernels')} kernels ({added} new) into {dest}: {len(shapes)} shapes "
        f"(TileLang {manifest['tilelang']}, built with Python {manifest.get('python')}, nvcc {manifest.get('nvcc')})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    b = commands.add_parser("build", help="compile shapes' kernels into a fresh cache and pack it")
    b.add_argument("--out", required=True, help="archive to write (.tar.gz)")
    b.add_argument("--shapes", nargs="+", default=["common"], help="common, names of COMMON_MODELS, model folders")
    b.add_argument("--tp-sizes", default=",".join(map(str, TP_SIZES)), help="tensor-parallel sizes (default 1,2,4,8)")
    b.add_argument("--dtypes", default=",".join(DTYPES), help="dtypes of COMMON_MODELS shapes (folders: their own)")
    b.add_argument("--jobs", type=int, default=default_workers(), help="compile processes (default: CPUs)")
    i = commands.add_parser("install", help="unpack an archive into TILELANG_CACHE_DIR")
    i.add_argument("archive")
    args = parser.parse_args(argv)
    if args.command == "install":
        return install_archive(args.archive)
    try:
        tp_sizes = tuple(int(t) for t in args.tp_sizes.split(","))
    except ValueError:
        raise SystemExit(f"error: --tp-sizes {args.tp_sizes!r} is not a comma list of integers") from None
    dtypes = tuple(args.dtypes.split(","))
    if any(t < 1 for t in tp_sizes) or args.jobs < 1:
        raise SystemExit("error: --tp-sizes and --jobs must be positive")
    if not set(dtypes) <= set(DTYPES):
        raise SystemExit(f"error: --dtypes takes {', '.join(DTYPES)}")
    return build_archive(args.out, args.shapes, tp_sizes, dtypes, args.jobs)


if __name__ == "__main__":
    raise SystemExit(main())
