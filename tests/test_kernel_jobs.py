"""Start-up compilation (``sglang_hs.kernels.jobs``) on CPU: which kernels a model shape needs, the
progress lines, the parallel worker processes (with a stand-in compiler) and the compile lock."""

from __future__ import annotations

import json
import os
import threading
import time

from sglang_hs.kernels import jobs as J


def fake_build(job: J.Job) -> J.Job:
    """A stand-in compiler (module level: the worker processes unpickle it): records its process, its
    time window and the GPUs it sees in a file named by the job."""
    _, (folder, i) = job
    start = time.time()
    time.sleep(1.5)
    with open(os.path.join(folder, f"{i}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "start": start, "end": time.time(),
                   "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)  # fmt: skip
    return job


def test_model_jobs_do_not_depend_on_batch_or_context():
    jobs = J.model_jobs(8, 2, 64, "float16")
    assert [kind for kind, _ in jobs] == ["decode"] + ["extend"] * 4 + ["pack", "loss", "loss"]
    assert jobs[0] == ("decode", (8, 2, 64, 64, "float16", 2))
    server = J.model_jobs(8, 2, 64, "float16", extend_k_sparse=(False,), loss_operands=())
    assert [kind for kind, _ in server] == ["decode", "extend", "extend", "pack"]
    assert {args[5] for kind, args in server if kind == "extend"} == {"n64", "n128"}
    assert [kind for kind, _ in J.model_jobs(9, 3, 64, "float16")] == [kind for kind, _ in jobs]  # GQA 3 (SmolLM2)
    assert [kind for kind, _ in J.model_jobs(18, 2, 64, "float16")] == ["pack", "loss", "loss"]  # GQA 9: none
    # Shared-prefix decode adds the own pass's kernel (a split floor of 4 blocks) and the shared pass's: the
    # extend kernel's n32 tile over 32 // G folded requests (256 heads of 8 KV heads at G = 4, 64 of 2 at
    # G = 8), for the store's forms, split counts read from the GPU, for the store's K (both without the
    # extend kernel's own K setting).
    every = ("any", "any")
    shared = J.model_jobs(32, 8, 128, "float16", shared_decode_forms=every)
    assert shared[:4] == [("decode", (32, 8, 128, 64, "float16", 2)),
                          ("decode", (32, 8, 128, 64, "float16", 2, 512, 4)),
                          ("extend", (256, 8, 128, 64, "float16", "n32", 2, False, every, True)),
                          ("extend", (256, 8, 128, 64, "float16", "n32", 2, True, every, True))]  # fmt: skip
    assert J.model_jobs(16, 2, 64, "float16", shared_decode_forms=every)[2] == (
        "extend", (64, 2, 64, 64, "float16", "n32", 2, False, every, True))  # fmt: skip
    ext = J.model_jobs(32, 8, 128, "bfloat16", extend_k_sparse=(True,), shared_decode_forms=("sparse", "sparse"))
    assert ext[2] == ("extend", (256, 8, 128, 64, "bfloat16", "n32", 2, True, ("sparse", "sparse"), True))
    assert [kind for kind, _ in ext].count("decode") == 2 and ext[3][1][5:7] == ("n64", 2) and len(ext[3][1]) == 8
    # The compact decode kernel (2:4 K and V stores) in place of the any-form one.
    ss = ("sparse", "sparse")
    compact = J.model_jobs(32, 8, 128, "float16", extend_k_sparse=(True,), decode_compact=ss)
    assert compact[0] == ("decode", (32, 8, 128, 64, "float16", 2, 512, 1, False, False, ss))
    assert [kind for kind, _ in compact].count("decode") == 1
    # An FP8 store (kernels: decode): the decode kernel's store_fp8 variant, under its own cache key.
    fp8 = J.model_jobs(8, 2, 64, "bfloat16", extend_k_sparse=(), compress=False, loss_operands=(), store_fp8=True)
    assert fp8 == [("decode", (8, 2, 64, 64, "bfloat16", 2, 512, 1, True))]


def test_job_arguments_are_the_builders_cache_keys(monkeypatch):
    """``build(job)`` reaches each builder's cache entry with exactly the job's arguments, so a job
    compiled by a worker process is the kernel the server's plans load."""
    from sglang_hs.kernels import common

    seen = []
    monkeypatch.setattr(common, "compile_cached",
                        lambda kind, args, make, passes, target=None, name=None: seen.append((kind, args)))
    from sglang_hs.kernels import compress, decode, extend

    for module in (compress, decode, extend):
        monkeypatch.setattr(module, "compile_cached", common.compile_cached)
    for builder in (decode.build_decode_kernel, extend.build_extend_kernel, compress.build_pack_kernel,
                    compress.build_loss_kernel):
        builder.cache_clear()
    jobs = J.model_jobs(4, 1, 64, "bfloat16") + J.model_jobs(32, 8, 128, "float16", shared_decode_forms=("dense", "sparse"))[1:3]
    jobs += J.model_jobs(4, 1, 64, "bfloat16", store_fp8=True)[:1]
    for job in jobs:
        J.build(job)
    assert seen == jobs
    for builder in (decode.build_decode_kernel, extend.build_extend_kernel, compress.build_pack_kernel,
                    compress.build_loss_kernel):
        builder.cache_clear()


def test_compile_missing_reports_progress(monkeypatch, tmp_path):
    lines, compiled = [], []

    def fake_parallel(jobs, workers, on_done, builder):
        for k, job in enumerate(jobs, 1):
            compiled.append(job)
            on_done(k, job, 20.0 * k)

    monkeypatch.setattr(J, "compile_parallel", fake_parallel)
    jobs = [("decode", (1,)), ("pack", (2,)), ("loss", (3,))]
    cached = {jobs[1]}
    n = J.compile_missing(jobs, lines.append, workers=8, lock_path=str(tmp_path / "lock"), probe=cached.__contains__)
    assert n == 2 and compiled == [jobs[0], jobs[2]]
    assert lines[0].startswith("hierasparse: compiling 2 kernels (0/2) in 2 processes")
    assert lines[1] == "hierasparse: compiling 2 kernels (1/2) decode(1,) done at 20 s"
    assert lines[2] == "hierasparse: compiling 2 kernels (2/2) loss(3,) done at 40 s" and len(lines) == 3
    lines.clear()
    assert J.compile_missing(jobs, lines.append, lock_path=str(tmp_path / "lock"), probe=lambda job: True) == 0
    assert lines == []


def test_warm_start_prints_one_line(monkeypatch, tmp_path):
    lines, loaded = [], []
    monkeypatch.setattr(J, "cache_enabled", lambda: True)
    monkeypatch.setattr(J, "cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(J, "is_cached", lambda job: True)
    monkeypatch.setattr(J, "build", loaded.append)
    jobs = J.model_jobs(8, 2, 64, "float16", extend_k_sparse=(False,), loss_operands=())
    assert J.prepare_kernels(jobs, lines.append) == 0
    assert loaded == jobs and len(lines) == 1 and "4 kernels loaded from TileLang's cache" in lines[0]


def test_parallel_compile_uses_worker_processes_without_gpus(tmp_path):
    jobs = [("fake", (str(tmp_path), i)) for i in range(4)]
    done = []
    J.compile_parallel(jobs, 2, lambda k, job, s: done.append((k, job)), builder=fake_build)
    assert [k for k, _ in done] == [1, 2, 3, 4] and sorted(job for _, job in done) == sorted(jobs)
    records = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(4)]
    pids = {r["pid"] for r in records}
    assert len(pids) == 2 and os.getpid() not in pids
    assert all(r["gpus"] == "" for r in records)
    first, second = sorted(records, key=lambda r: r["start"])[:2]
    assert second["start"] < first["end"], "the two workers never ran at the same time"


def test_a_second_process_waits_for_the_compiler_and_compiles_nothing(tmp_path):
    """Tensor-parallel ranks: the rank that finds the lock held waits, then loads what the holder
    compiled (one line says it waited) instead of compiling it again."""
    lock = str(tmp_path / J.LOCK_NAME)
    compiled, holding, release = set(), threading.Event(), threading.Event()

    def compiler():
        with J._exclusive(lock, lambda: None):
            holding.set()
            release.wait(10)
            compiled.add(("decode", (1,)))

    thread = threading.Thread(target=compiler)
    thread.start()
    holding.wait(10)
    lines = []
    timer = threading.Timer(0.5, release.set)
    timer.start()
    n = J.compile_missing([("decode", (1,))], lines.append, lock_path=lock, probe=compiled.__contains__,
                          builder=fake_build)
    thread.join()
    assert n == 0 and len(lines) == 1 and lines[0].startswith("hierasparse: waiting for another process")


def test_jobs_left_by_failed_workers_compile_in_this_process(monkeypatch, tmp_path):
    from concurrent.futures.process import BrokenProcessPool

    def broken(jobs, workers, on_done, builder):
        on_done(1, jobs[0], 30.0)
        raise BrokenProcessPool("a worker was killed")

    monkeypatch.setattr(J, "compile_parallel", broken)
    built, lines = [], []
    jobs = [("decode", (1,)), ("pack", (2,)), ("loss", (3,))]
    n = J.compile_missing(jobs, lines.append, lock_path=str(tmp_path / "lock"), probe=lambda job: False,
                          builder=built.append)
    assert n == 3 and built == jobs[1:]
    assert "worker processes failed (BrokenProcessPool" in lines[2]
    assert [line.split(") ")[0][-3:] for line in lines if "done at" in line] == ["1/3", "2/3", "3/3"]
