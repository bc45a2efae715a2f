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
