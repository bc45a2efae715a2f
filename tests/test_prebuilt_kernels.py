"""Prebuilt kernel archives (``sglang_hs.launch.prebuilt_kernels``) on CPU: the shape list, the manifest
checks and refusals, and build -> install round trips over a stand-in compiler that writes cache entries
laid out as TileLang's (so nothing compiles for minutes)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

import pytest

from sglang_hs.config import KERNEL_GQA_GROUPS
from sglang_hs.kernels import jobs as J
from sglang_hs.launch import prebuilt_kernels as P

HERE = {"tilelang": "0.1.11", "tilelang_libs": "libtilelang.so:ab", "machine": "x86_64", "sources": "d" * 64,
        "target": "sm_90a", "python": "3.11.7", "nvcc": "13.0.88"}  # fmt: skip
NAMESPACE = "0.1.11-x86_64"
TINY = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512, "head_dim": 64, "dtype": "float16"}


def _key(job: J.Job) -> str:
    return hashlib.sha256(J.describe(job).encode()).hexdigest()


def fake_compile_missing(jobs, log, workers, builder=None, fail=()):
    """Writes each job's entry as TileLang lays one out, into ``TILELANG_CACHE_DIR`` (plus the folders and
    the lock file an archive leaves out); the jobs in ``fail`` write nothing."""
    cache = os.environ["TILELANG_CACHE_DIR"]
    for k, job in enumerate(jobs, 1):
        if job in fail:
            continue
        folder = os.path.join(cache, NAMESPACE, "kernels", _key(job))
        os.makedirs(folder)
        for name in ("device_kernel.cu", "host_kernel.cu", "executable.so", "params.pkl", "prim_func.pkl"):
            with open(os.path.join(folder, name), "w") as f:
                f.write(J.describe(job))
        os.makedirs(os.path.join(cache, NAMESPACE, "frontend"), exist_ok=True)
        with open(os.path.join(cache, NAMESPACE, "frontend", _key(job) + ".json"), "w") as f:
            json.dump({"kernel_key": _key(job)}, f)
        log(f"hierasparse: compiling {len(jobs)} kernels ({k}/{len(jobs)})")
    for junk in ("tmp", "py-cache", os.path.join(NAMESPACE, ".staging")):
        os.makedirs(os.path.join(cache, junk), exist_ok=True)
        open(os.path.join(cache, junk, "x"), "w").close()
    open(os.path.join(cache, J.LOCK_NAME), "w").close()
    return len(jobs) - len(fail)


def fake_is_cached(job: J.Job) -> bool:
    """The server's lookup, in the stand-in layout: the frontend entry and the kernel folder it names."""
    cache = os.path.join(os.environ["TILELANG_CACHE_DIR"], NAMESPACE)
    return (os.path.exists(os.path.join(cache, "frontend", _key(job) + ".json"))
            and os.path.exists(os.path.join(cache, "kernels", _key(job), "executable.so")))  # fmt: skip


@pytest.fixture
def fake_tilelang(tmp_path, monkeypatch):
    """A stand-in compiler and environment; the server's cache is ``tmp_path / "server"``."""
    server = tmp_path / "server"
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(server))
    monkeypatch.setattr(P, "compile_missing", fake_compile_missing)
    monkeypatch.setattr(J, "is_cached", fake_is_cached)
    monkeypatch.setattr(P, "environment", lambda: dict(HERE))
    monkeypatch.setattr(P, "cache_enabled", lambda: True)
    monkeypatch.setattr(P, "cache_dir", lambda: str(server))
    return server


def tiny_dir(tmp_path) -> str:
    folder = tmp_path / "tiny"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY))
    return str(folder)


def test_common_shapes_cover_the_kernels_groups():
    shapes = P.resolve_shapes(["common"], P.TP_SIZES, P.DTYPES)
    keys = {P.shape_key(s) for s in shapes}
    assert {head_dim for _, _, head_dim, _ in keys} == {64, 128}
    assert {dtype for *_, dtype in keys} == {"bfloat16", "float16"}
    assert {s["tp"] for s in shapes} == set(P.TP_SIZES)
    assert {q // kv for q, kv, _, _ in keys} == set(KERNEL_GQA_GROUPS)  # every group the kernels take
    # Llama-3.1-8B at TP 8: 4 query heads and 1 KV head a rank; Qwen2.5-7B's 28 heads have no TP 8.
    assert {"model": "llama-3.1-8b", "tp": 8, "q_heads": 4, "kv_heads": 1, "head_dim": 128,
            "dtype": "bfloat16"} in shapes  # fmt: skip
    assert {s["tp"] for s in shapes if s["model"] == "qwen2.5-7b"} == {1, 2, 4}
    jobs = P.jobs_of(shapes)
    assert len(jobs) == len(set(jobs))
    # Two models of one per-rank shape share its kernels: Llama-3.1-8B at TP 8 and Qwen2.5-3B at TP 4.
    one = P.jobs_of(P.table_shapes("llama-3.1-8b", (8,), ("bfloat16",)))
    both = P.jobs_of(P.table_shapes("llama-3.1-8b", (8,), ("bfloat16",))
                     + P.table_shapes("qwen2.5-3b", (4,), ("bfloat16",)))
    assert one == both and len(one) == 14  # a shape's kernels (warm_kernels.kernel_jobs)


def test_model_folders_and_bad_specs(tmp_path):
    shapes = P.resolve_shapes([tiny_dir(tmp_path)], (1, 2, 4, 8, 3), P.DTYPES)
    assert [(s["tp"], s["q_heads"], s["kv_heads"]) for s in shapes] == [(1, 8, 2), (2, 4, 1), (4, 2, 1), (8, 1, 1)]
    assert {s["dtype"] for s in shapes} == {"float16"}  # a folder's own dtype
    with pytest.raises(SystemExit, match="neither 'common'"):
        P.resolve_shapes([str(tmp_path / "nowhere")], (1,), P.DTYPES)
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({**TINY, "head_dim": 96}))
    with pytest.raises(SystemExit, match="head_dim 96"):
        P.resolve_shapes([str(tmp_path / "tiny")], (1,), P.DTYPES)
    with pytest.raises(SystemExit, match="--tp-sizes"):
        P.main(["build", "--out", str(tmp_path / "a.tar.gz"), "--tp-sizes", "1,x"])
    with pytest.raises(SystemExit, match="--dtypes"):
        P.main(["build", "--out", str(tmp_path / "a.tar.gz"), "--dtypes", "float32"])


def test_mismatches_name_each_difference():
    assert P.mismatches({"format": P.FORMAT, **HERE}, HERE) == []
    assert P.mismatches({"format": P.FORMAT, **HERE, "python": "3.12.3", "nvcc": "13.1.0"}, HERE) == []  # not in a key
    older = P.mismatches({"format": P.FORMAT, **HERE, "nvcc": "12.8.0"}, HERE)
    assert older == ["nvcc 12.8.0 in the archive, 13.0.88 here"]
    assert P.mismatches({"format": P.FORMAT, **HERE}, {**HERE, "nvcc": None}) == []  # no nvcc here: nothing to compare
    for key in P.CHECKED:
        problems = P.mismatches({"format": P.FORMAT, **HERE, key: "other"}, HERE)
        assert len(problems) == 1 and "other in the archive" in problems[0], problems
    assert "format" in P.mismatches({"format": 99, **HERE}, HERE)[0]


def test_build_then_install_round_trip(fake_tilelang, tmp_path, capsys):
    archive = str(tmp_path / "out" / "tiny.tar.gz")
    assert P.main(["build", "--out", archive, "--shapes", tiny_dir(tmp_path), "--tp-sizes", "1,2", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "[prebuilt] hierasparse: compiling" in out and "wrote " + archive in out
    assert not os.path.exists(fake_tilelang)  # the build used a fresh cache, not the server's
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert names[0] == P.MANIFEST
    assert not [n for n in names if "tmp" in n.split("/") or "py-cache" in n or ".staging" in n or n.endswith(".lock")]
    manifest = P.read_manifest(archive)
    jobs = P.jobs_of(P.resolve_shapes([tiny_dir(tmp_path)], (1, 2), P.DTYPES))
    assert manifest["kernels"] == len(jobs) and manifest["missing"] == [] and manifest["sources"] == HERE["sources"]
    assert [(s["model"], s["tp"]) for s in manifest["shapes"]] == [("tiny", 1), ("tiny", 2)]

    assert not any(J.is_cached(job) for job in jobs)
    assert P.main(["install", archive]) == 0
    assert all(J.is_cached(job) for job in jobs)  # every kernel the server looks up is there
    assert f"({len(jobs)} new)" in capsys.readouterr().out
    assert P.main(["install", archive]) == 0  # again: nothing new, nothing broken
    assert "(0 new)" in capsys.readouterr().out
    assert sorted(os.listdir(fake_tilelang)) == [NAMESPACE]  # no staging folder left behind


def test_install_refuses_a_stale_archive(fake_tilelang, tmp_path, monkeypatch):
    archive = str(tmp_path / "tiny.tar.gz")
    assert P.main(["build", "--out", archive, "--shapes", tiny_dir(tmp_path), "--tp-sizes", "1"]) == 0
    monkeypatch.setattr(P, "environment", lambda: {**HERE, "sources": "e" * 64, "tilelang": "0.1.12"})
    with pytest.raises(SystemExit) as stop:
        P.main(["install", archive])
    line = str(stop.value)
    assert "\n" not in line and "not installed" in line
    assert "tilelang 0.1.11 in the archive, 0.1.12 here" in line and "kernel sources (sha256) dddddddddddd" in line
    assert not os.path.exists(fake_tilelang) or not os.listdir(fake_tilelang)
    with pytest.raises(SystemExit, match="not a prebuilt kernel archive"):
        P.main(["install", str(tmp_path / "missing.tar.gz")])


def test_install_refuses_paths_outside_the_cache(fake_tilelang, tmp_path):
    archive = str(tmp_path / "evil.tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in ((P.MANIFEST, json.dumps({"format": P.FORMAT, **HERE}).encode()), ("cache/../../evil", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(SystemExit, match="could not be unpacked"):
        P.main(["install", archive])
    assert not os.path.exists(tmp_path / "evil") and not os.path.exists(fake_tilelang.parent.parent / "evil")


def test_failed_kernels_stay_out_and_changed_sources_stop_the_build(fake_tilelang, tmp_path, monkeypatch):
    shapes = P.resolve_shapes([tiny_dir(tmp_path)], (1,), P.DTYPES)
    jobs = P.jobs_of(shapes)
    monkeypatch.setattr(P, "compile_missing", lambda *a, **k: fake_compile_missing(*a, **k, fail=(jobs[1],)))
    archive = str(tmp_path / "partial.tar.gz")
    assert P.build_archive(archive, [tiny_dir(tmp_path)], (1,), P.DTYPES, 1, log=lambda line: None) == 1
    manifest = P.read_manifest(archive)
    assert manifest["missing"] == [J.describe(jobs[1])] and manifest["kernels"] == len(jobs) - 1

    digests = iter(["d" * 64, "f" * 64])  # the sources were edited while the kernels compiled
    monkeypatch.setattr(P, "environment", lambda: {**HERE, "sources": next(digests)})
    with pytest.raises(SystemExit, match="sources changed"):
        P.build_archive(str(tmp_path / "x.tar.gz"), [tiny_dir(tmp_path)], (1,), P.DTYPES, 1, log=lambda line: None)
    assert not os.path.exists(tmp_path / "x.tar.gz")


def test_a_compile_failure_is_reported_not_raised(monkeypatch, capsys):
    def broken(job):
        raise NotImplementedError("Attribute assignment not supported yet, `self.load_k`\nmore")

    monkeypatch.setattr(P, "build", broken)
    job = ("extend", (8, 2, 64, 64, "float16", "n64", 2, False))
    assert P._compile_one(job) == job
    assert "[prebuilt] FAILED extend(8, 2, 64" in capsys.readouterr().out
