"""Shared fixtures and the GPU marker: GPU tests skip with a reason on machines without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
