"""The lab's scripts (``lab/``, not installed) start: each answers ``--help`` when run as its README says,
``python lab/NAME.py`` from the repository root (CPU; what they measure needs a GPU)."""

from __future__ import annotations

import os

import pytest
from conftest import LAB_ROOT, run_python

SCRIPTS = sorted(name for name in os.listdir(LAB_ROOT) if name.endswith(".py")
                 and "__main__" in open(os.path.join(LAB_ROOT, name), encoding="utf-8").read())  # fmt: skip


def test_the_lab_has_its_scripts():
    assert {"eval_study.py", "profile_shared_decode.py", "profile_extend.py", "bench_dense_prefill.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_starts(script):
    result = run_python(os.path.join("lab", script), "--help", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:")
