"""Installation and plugin registration, as a user sees them after ``pip install -e .``."""

from __future__ import annotations

from importlib.metadata import entry_points

from conftest import REPO_ROOT, run_python


def test_pypi_kernels_not_shadowed_from_repo_root():
    # SGLang depends on the PyPI package `kernels`; our kernels/ folder must never hide it.
    result = run_python("-c", "import kernels, os; print(os.path.realpath(kernels.__file__))", cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert "site-packages" in result.stdout, result.stdout
    assert not result.stdout.strip().startswith(REPO_ROOT), result.stdout


def test_subpackages_import_under_sglang_hs():
    result = run_python(
        "-c",
        "import sglang_hs.launch.make_model as m; print(m.__file__)",
        cwd="/",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("launch/make_model.py")


def test_entry_point_is_registered():
    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("hierasparse") == "sglang_hs.plugin:load"


def test_launch_server_help_lists_backend_and_settings():
    result = run_python("-m", "sglang.launch_server", "--help", cwd="/")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "hierasparse}" in result.stdout  # in the --attention-backend choices
    for flag in ("--hierasparse-sk-prefill", "--hierasparse-sv-decode", "--hierasparse-block-size"):
        assert flag in result.stdout


def test_results_index_and_docs_match_the_records():
    """Every record in launch/results/ is in its index, every record the index or docs/results.md names
    exists, and the user-facing docs stay within their length limits."""
    import os
    import re

    results = os.path.join(REPO_ROOT, "launch", "results")
    records = set(os.listdir(results)) - {"README.md"}
    index = open(os.path.join(results, "README.md")).read()
    named = set()
    for name in re.findall(r"`([\w{},.-]+\.(?:json|png|log|pt|txt))`", index):
        braces = re.search(r"\{([\w,]+)\}", name)  # server_check_gqa{3,5}_...: one record per item
        named |= {name.replace(braces.group(0), item) for item in braces.group(1).split(",")} if braces else {name}
    assert records - named == set(), "records missing from launch/results/README.md"
    assert named - records == set(), "the index names records that are not in launch/results/"
    cited = set(re.findall(r"`((?:quality|server_check|cold_start|prefix_bench|kernels|soak|gpu_tests|dense_prefill)"
                           r"_[\w.-]+\.(?:json|log))`", open(os.path.join(REPO_ROOT, "docs", "results.md")).read()))
    assert cited - records == set(), "docs/results.md cites records that are not in launch/results/"
    for doc, limit in (("README.md", 200), ("docs/results.md", 300)):
        assert len(open(os.path.join(REPO_ROOT, doc)).read().splitlines()) <= limit, doc
