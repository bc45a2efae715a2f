"""Shared fixtures and the GPU marker: GPU tests skip with a reason on machines without CUDA."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAB_ROOT = os.path.join(REPO_ROOT, "lab")
# The lab is not installed; its scripts run as ``python lab/x.py``, which puts lab/ first on sys.path.
# Its tests import its modules the same way (appended: a lab module never shadows an installed one).
if LAB_ROOT not in sys.path:
    sys.path.append(LAB_ROOT)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_python(*args: str, cwd: str = REPO_ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` in a fresh interpreter, capturing text output."""
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random-weight Llama with a local tokenizer (``make_model tiny``)."""
    from sglang_hs.launch.make_model import write_tiny

    out = str(tmp_path_factory.mktemp("tiny"))
    write_tiny(out, layers=2, seed=0)
    return out


@pytest.fixture(scope="module")
def calibration_corpus(tmp_path_factory) -> str:
    """Essays of seed 100: the head calibration's filler in the calibration and study tests (the
    evaluation tests' haystacks use seed 0)."""
    return write_essays(tmp_path_factory.mktemp("essays"), seed=100)


def write_essays(folder, seed: int) -> str:
    """Ten 'essays' of sentences over the tiny tokenizer's training words (few tokens per word) in
    ``folder``; ``seed`` picks the sentences, so two test modules can hold disjoint corpora."""
    from sglang_hs.launch.make_model import _CORPUS

    words = sorted(set(re.findall(r"[a-z]+", " ".join(_CORPUS).lower())))
    for i in range(10):
        rng = random.Random(seed + i)
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + "." for _ in range(150)]
        (folder / f"essay{i:02d}.txt").write_text(" ".join(sentences))
    return str(folder)
