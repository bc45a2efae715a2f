"""The lab's scripts (``lab/``, not installed) start: each answers ``--help`` when run as its README says,
``python lab/NAME.py`` from the repository root (CPU; what they measure needs a GPU)."""

from __future__ import annotations

import os

import pytest
from conftest import LAB_ROOT, REPO_ROOT, run_python

SCRIPTS = sorted(name for name in os.listdir(LAB_ROOT) if name.endswith(".py")
                 and "__main__" in open(os.path.join(LAB_ROOT, name), encoding="utf-8").read())  # fmt: skip


def test_the_lab_has_its_scripts():
    assert {"eval_study.py", "profile_shared_decode.py", "profile_extend.py", "bench_dense_prefill.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_starts(script):
    result = run_python(os.path.join("lab", script), "--help", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:")


def test_ncu_hotspots_reads_the_source_page(tmp_path):
    """``ncu_hotspots`` ranks SASS instructions by their share of all stall samples and sums each reason
    over the kernel; ``(Not Issued)`` columns and the title row are left out."""
    import ncu_hotspots

    rows = [
        ["Kernel Name", "hs_decode_kernel"],
        ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
         "stall_short_sb", "stall_short_sb (Not Issued)"],
        ["0x10", "  FMNMX R1, R2, R3", "60", "1,024", "10", "50", "999"],
        ["0x20", "  BAR.SYNC 0x0", "30", "1024", "30", "0", "0"],
        ["0x30", "  MOV R1, R2", "10", "512", "0", "10", "0"],
    ]
    by_reason, top = ncu_hotspots.hotspots(rows, top=2)
    assert by_reason == {"short_sb": 0.6, "wait": 0.4}
    assert [row["source"] for row in top] == ["FMNMX R1, R2, R3", "BAR.SYNC 0x0"]
    assert top[0]["share"] == 0.6 and top[0]["executed"] == 1024 and top[0]["reasons"] == ["short_sb", "wait"]
    assert top[1]["reasons"] == ["wait"]
    path = tmp_path / "page.csv"
    path.write_text("\n".join(",".join(f'"{cell}"' for cell in row) for row in rows) + "\n")
    result = run_python(os.path.join("lab", "ncu_hotspots.py"), str(path), "--top", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[0] == "samples by reason: short_sb 60.0%, wait 40.0%"
    assert "FMNMX" in result.stdout.splitlines()[1] and len(result.stdout.splitlines()) == 2


def test_time_extend_kernels_imports_the_kernels_of_another_tree(tmp_path):
    """``time_extend_kernels --kernels DIR`` times DIR's kernels: after ``use_kernels_tree`` every
    ``sglang_hs.kernels`` module this process imports comes from DIR, and the rest of the package from
    the installed tree; a kernel source edited in DIR changes the digest its cache entries are keyed by."""
    import shutil

    tree = tmp_path / "kernels"
    shutil.copytree(os.path.join(REPO_ROOT, "kernels"), tree,
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(tree / "extend_producer.py", "a", encoding="utf-8") as f:
        f.write("\n# edited in the tree\n")
    code = (
        "import sys; sys.path.insert(0, 'lab'); import time_extend_kernels as t\n"
        "from sglang_hs.kernels.common import kernel_source_digest as installed\n"
        "before = installed()\n"
        "for name in [m for m in sys.modules if m.startswith('sglang_hs.kernels')]: del sys.modules[name]\n"
        f"t.use_kernels_tree({str(tree)!r})\n"
        "from sglang_hs.kernels import extend, common\n"
        "import sglang_hs.format\n"
        "print(extend.__file__); print(sglang_hs.format.__file__); print(common.kernel_source_digest() != before)\n"
    )
    result = run_python("-c", code, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    extend_file, format_file, digest_changed = result.stdout.split()
    assert extend_file == str(tree / "extend.py")
    assert not format_file.startswith(str(tmp_path))
    assert digest_changed == "True"


def test_kernel_sources_compare_up_to_shared_buffer_placement():
    """``diff_kernel_source.normalise`` drops the shared buffers' declarations and names each buffer by its
    first use, so two compiles that differ only in offsets and numbering read the same; using another
    buffer (or other code) still differs."""
    from diff_kernel_source import normalise

    def kernel(decls: list[tuple[str, int]], body: str) -> str:
        lines = [f"  void* {name} = ((void*)((char*)buf_dyn_shmem + {offset}));" for name, offset in decls]
        lines += ["  __shared__ __align__(16) uint64_t v_9_mem[1];", "  auto v_9 = reinterpret_cast<Barrier*>(v_9_mem);"]
        return "\n".join(lines + body.splitlines())

    first = kernel([("v", 0), ("v_1", 1024)], "  v_9[0].wait(0);\n  copy(v, v_1);\n  gemm(v);\n  int v_mode = 2;")
    second = kernel([("v_1", 2048), ("v_3", 0)], "  v_9[0].wait(0);\n  copy(v_3, v_1);\n  gemm(v_3);\n  int v_mode = 2;")
    other = kernel([("v", 0), ("v_1", 1024)], "  v_9[0].wait(0);\n  copy(v, v_1);\n  gemm(v_1);\n  int v_mode = 2;")
    assert normalise(first) == normalise(second)
    assert "v_mode" in normalise(first) and "buf_dyn_shmem" not in normalise(first)
    assert normalise(first) != normalise(other)  # the GEMM reads the other buffer


@pytest.mark.parametrize("variant", ["noexp", "novote", "nostore", "nogemmo", "noload", "double", "probe",
                                     "noexp+novote+nostore", "double+twoloads"])
def test_extend_ablations_apply_to_the_installed_kernels(variant, tmp_path):
    """Each of ``ablate_extend``'s variants finds its anchors in the installed extend sources (they follow the
    kernel's edits) and changes them; the copy leaves the other modules as they are."""
    import ablate_extend

    tree = ablate_extend.write_variant(variant, str(tmp_path))
    import sglang_hs.kernels as kernels

    src = list(kernels.__path__)[0]
    changed = [name for name in sorted(os.listdir(src)) if name.endswith(".py")
               and open(os.path.join(src, name)).read() != open(os.path.join(tree, name)).read()]
    assert changed and set(changed) <= {"extend_common.py", "extend_producer.py"}
    with pytest.raises(ValueError, match="unknown variant"):
        ablate_extend.edit("nothing", "", "")
