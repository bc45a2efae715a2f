"""Whether two ``kernels/`` trees generate the same CUDA for one extend kernel, up to where TileLang places
the shared buffers (CPU: TileLang compiles without a GPU).

    python lab/diff_kernel_source.py --old /tmp/wt/kernels --config 32,8,128,float16,n128,2,1
    python lab/diff_kernel_source.py --old A/kernels --new B/kernels --config ...

TileLang places the dynamic shared buffers differently from one compile of a source to the next, and
numbers them in its own order, so two compiles of one source differ in offsets and names. Each tree's
kernel is compiled in a process of its own (``time_extend_kernels.use_kernels_tree``; ``--new``
defaults to the installed tree), then both sources are normalised (:func:`normalise`) and compared:
prints ``same`` or a unified diff. ``--config``: ``q_heads,kv_heads,head_dim,dtype,tile,stages,k_sparse``.
Set ``TILELANG_CACHE_DIR`` to a scratch folder: the two trees compile into it under their own digests.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile

# `void* v_3 = ((void*)((char*)buf_dyn_shmem + 82944));` and a barrier's
# `__shared__ __align__(16) uint64_t v_9_mem[1];` / `auto v_9 = reinterpret_cast<Barrier*>(v_9_mem);`
_DECLARATION = re.compile(r"^\s*(void\* v(_\d+)? = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ \d+\)\);"
                          r"|__shared__ __align__\(\d+\) uint64_t v_\d+_mem\[\d+\];"
                          r"|auto v_\d+ = reinterpret_cast<Barrier\*>\(v_\d+_mem\);)\s*$")
_BUFFER = re.compile(r"\bv(_\d+)?\b")


def normalise(source: str) -> str:
    """``source`` without the shared buffers' declarations (their offsets) and with each buffer renamed
    by its first use in what is left (``s0``, ``s1``, ...), so that two compiles that differ only in
    placement and numbering read the same."""
    body = [line for line in source.splitlines() if not _DECLARATION.match(line)]
    names: dict[str, str] = {}

    def rename(match: re.Match) -> str:
        return names.setdefault(match.group(0), f"s{len(names)}")

    return "\n".join(_BUFFER.sub(rename, line) for line in body)


def emit(tree: str | None, config: str, path: str) -> None:
    """Compile (or load) the extend kernel of ``config`` from ``tree`` (None: the installed one) and write
    its CUDA source to ``path``."""
    if tree:
        from time_extend_kernels import use_kernels_tree

        use_kernels_tree(tree)
    from sglang_hs.kernels.extend import build_extend_kernel

    hq, hkv, d, dtype, tile, stages, k_sparse = config.split(",")
    kernel = build_extend_kernel(int(hq), int(hkv), int(d), 64, dtype, tile, int(stages), k_sparse == "1")
    with open(path, "w", encoding="utf-8") as f:
        f.write(kernel.get_kernel_source())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="a kernels/ tree")
    ap.add_argument("--new", default=None, help="a kernels/ tree (default: the installed one)")
    ap.add_argument("--config", default="32,8,128,float16,n128,2,1")
    ap.add_argument("--emit", nargs=2, metavar=("TREE", "PATH"), help=argparse.SUPPRESS)  # one side, in its process
    args = ap.parse_args(argv)
    if args.emit:
        emit(None if args.emit[0] == "-" else args.emit[0], args.config, args.emit[1])
        return 0
    sources = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, tree in enumerate((args.old, args.new)):
            path = f"{tmp}/{i}.cu"
            subprocess.run([sys.executable, __file__, "--old", args.old, "--config", args.config,
                            "--emit", tree or "-", path], check=True)  # fmt: skip
            with open(path, encoding="utf-8") as f:
                sources.append(normalise(f.read()).splitlines())
    diff = list(difflib.unified_diff(*sources, "old", "new", lineterm=""))
    print("\n".join(diff) if diff else "same")
    return 0


if __name__ == "__main__":
    sys.exit(main())
