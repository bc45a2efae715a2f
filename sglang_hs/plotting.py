"""matplotlib for the benchmarks' and the evaluation's figures: files only, no display."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (imported on first use: plotting is optional work)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
