"""Copies of the installed ``kernels/`` with one part of the n128 extend step left out, or with the step's
phases timed: what a block step's time is made of (CPU; the copies are timed on a GPU).

    python lab/ablate_extend.py --out /tmp/abl noexp novote nostore nogemmo noload noexp+novote+nostore double double+twoloads probe
    python lab/time_extend_kernels.py --label noexp --kernels /tmp/abl/noexp --sk 1 --tokens 256,2048
    python lab/ablate_extend.py --read-probe /tmp/abl/probe --tokens 256,2048

Each variant edits the source text of the S^T path (2:4 K rows, the benchmark's S_K = S_V = 1) and breaks
the kernel's results; only its time means something. Time the unedited tree the same way (``--kernels``
of a plain copy, or the installed one), in turn with the variants.

* ``noexp``: the common step's ``exp2`` left out (P is the offset score).
* ``novote``: the warpgroup vote left out (the offset moves on the CTA's first block only; the lane max
  that feeds the vote is then dead code).
* ``nostore``: P^T not written to shared memory (the O^T GEMM reads what the buffer held).
* ``nogemmo``: the O^T GEMM left out.
* ``noload``: the producer issues no TMA loads (the stages keep what they held).
* ``double``: each step does its block's GEMMs, softmax and P store twice at one step's turn, vote, fence
  and release (either K form, so also at S_K = 0): against twice the unedited time, what a step that takes
  two blocks could save. ``double+twoloads`` also issues each stage item's TMA loads twice (the second
  from L2), so that a step moves two blocks' bytes.
* ``probe``: every consumer thread sums ``clock64`` intervals over the block loop by phase (``PHASES``:
  full wait, fence and turn, GEMM issue, S wait, mask and scores, vote, exp2 and sums, release, P^T
  store, and the loop between steps); the first thread of each consumer warpgroup writes its sums into
  the LSE of the CTA's first 20 columns, which ``--read-probe`` turns into clocks a block step (GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

# The probe's phases, in acc's order (a step runs 0 .. 9; ``loop`` is the time between two steps).
PHASES = ["loop", "full_wait", "fence_turn", "gemm_issue", "s_wait", "mask_scores", "vote", "exp", "release", "p_store"]


def _swap(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise ValueError(f"the kernels' source has changed: {old.strip().splitlines()[0]!r} not found once")
    return text.replace(old, new)


def _probe(common: str, producer: str) -> tuple[str, str]:
    """The probe's edits: a ``mark(acc, last, k)`` macro adding the clocks since the last mark to ``acc[k]``,
    marks between the step's phases (the vote taken into ``lane_max[1]`` first, so that it has a mark of its
    own), and the sums written into the LSE after the output."""
    mark = ("        @T.macro\n        def mark(acc, last, k):\n"
            "            now = T.call_extern(\"int64\", \"clock64\")\n"
            "            acc[k] = acc[k] + (now - last[0])\n            last[0] = now\n\n")
    vote = ('T.call_extern("int32", "hs_warpgroup_any", T.if_then_else(lane_max[0] > LAZY, 1, 0),\n'
            "                               12 + T.get_thread_binding() // 128)")
    common = _swap(common, "        @T.macro\n        def resolve(", mark + "        @T.macro\n        def resolve(")
    common = _swap(common, "        def softmax(is_first, block, first_masked, last_pos, tile_tokens, scale_log2, P_s, sm):",
                   "        def softmax(is_first, block, first_masked, last_pos, tile_tokens, scale_log2, P_s, sm, acc, last):")
    common = _swap(common, "            lazy_scores(is_first, scale_log2, sT, offsets, lane_max)\n            if rows:",
                   "            lazy_scores(is_first, scale_log2, sT, offsets, lane_max)\n            mark(acc, last, 5)\n"
                   "            if not rows:\n                lane_max[1] = T.cast(" + vote + ", accum)\n"
                   "                mark(acc, last, 6)\n            if rows:")
    common = _swap(common, "            elif " + vote + " != 0:", "            elif lane_max[1] != 0:")
    common = _swap(common, "                       stage, sm, pingpong):", "                       stage, sm, pingpong, acc, last):")
    # The probe takes the turn before the S GEMM's dispatch (not inside it), so that a mark can follow it.
    common = _swap(common, "            gemm_s(sm.step_mode[0], Q_s, stage, sm.sT, sm.q_frag, pingpong)\n",
                   "            if pingpong:\n                turn()\n"
                   "            mark(acc, last, 2)\n            gemm_s(sm.step_mode[0], Q_s, stage, sm.sT, sm.q_frag, False)\n")
    common = _swap(common, "                gemm_o(sm.pending_mode[0] >> 2, P_r, stage, sm.oT, T.wgmma_gemm, T.wgmma_gemm_sp)\n"
                   "                T.wait_wgmma(1)\n            else:\n                T.wait_wgmma(0)\n",
                   "                gemm_o(sm.pending_mode[0] >> 2, P_r, stage, sm.oT, T.wgmma_gemm, T.wgmma_gemm_sp)\n"
                   "                mark(acc, last, 3)\n                T.wait_wgmma(1)\n            else:\n"
                   "                mark(acc, last, 3)\n                T.wait_wgmma(0)\n            mark(acc, last, 4)\n")
    common = _swap(common, "            softmax(is_first, block, first_masked, last_pos, tile_tokens, scale_log2, P_w, sm)",
                   "            softmax(is_first, block, first_masked, last_pos, tile_tokens, scale_log2, P_w, sm, acc, last)\n"
                   "            mark(acc, last, 7)")
    common = _swap(common, "                release(stage)  # before the store",
                   "                release(stage)\n                mark(acc, last, 8)  # before the store")
    common = _swap(common, "                T.copy(sm.sT, P_w)  # fenced at the next step's",
                   "                T.copy(sm.sT, P_w)\n                mark(acc, last, 9)  # fenced at the next step's")
    common = _swap(common, "        self.load_q = load_q\n", "        self.load_q = load_q\n        self.mark = mark\n")
    n = len(PHASES)
    producer = _swap(producer, "                 P_w, stage, sm):\n            if j < num_blocks:\n"
                     "                T.barrier_wait(stage.full, parity)\n",
                     "                 P_w, stage, sm, acc, last):\n            if j < num_blocks:\n"
                     "                parts.mark(acc, last, 0)\n                T.barrier_wait(stage.full, parity)\n"
                     "                parts.mark(acc, last, 1)\n")
    producer = _swap(producer, "ring.mode[j % RB], j, Q_s, P_r, P_w, stage, sm, True)",
                     "ring.mode[j % RB], j, Q_s, P_r, P_w, stage, sm, True, acc, last)")
    producer = _swap(producer, "        def ring_steps(it, tile, ring, Q_s, P_bufs, ring_stages, sm):",
                     "        def ring_steps(it, tile, ring, Q_s, P_bufs, ring_stages, sm, acc, last):")
    producer = _swap(producer, "P_bufs[(u - 1) % P_COUNT], P_bufs[u % P_COUNT], ring_stages[u % stages], sm)",
                     "P_bufs[(u - 1) % P_COUNT], P_bufs[u % P_COUNT], ring_stages[u % stages], sm, acc, last)")
    producer = _swap(producer, "                for it in T.serial(T.ceildiv(tile.num_blocks, RING)):\n"
                     "                    ring_steps(it, tile, ring, Q_s, P_bufs, ring_stages, sm)",
                     f"                acc = T.alloc_local([{n}], \"int64\")\n                last = T.alloc_local([1], \"int64\")\n"
                     f"                for k in T.serial({n}):\n                    acc[k] = T.int64(0)\n"
                     "                last[0] = T.call_extern(\"int64\", \"clock64\")\n"
                     "                for it in T.serial(T.ceildiv(tile.num_blocks, RING)):\n"
                     "                    ring_steps(it, tile, ring, Q_s, P_bufs, ring_stages, sm, acc, last)")
    producer = _swap(producer, "                parts.write_output(tile, sm, outputs)\n",
                     "                parts.write_output(tile, sm, outputs)\n                parts.consumer_sync()\n"
                     f"                if tid % 128 == 0:\n                    for k in T.serial({n}):\n"
                     f"                        c = (tid // 128) * {n} + k\n"
                     "                        outputs.lse[tile.first_row + tile.first_token + c // parts.G,\n"
                     "                                    tile.h * parts.G + c % parts.G] = T.cast(acc[k], \"float32\")\n")
    return common, producer


def _double(common: str) -> str:
    """The ``double`` edits: each step issues its block's S (S^T) GEMM and O^T GEMM twice (a second S
    accumulator), takes the scores of both into one lane max and one vote, exponentiates both and stores
    both P (into one buffer), with one turn, one fence and one release: the work of a two-block step at one
    step's fixed costs (the loads stay one block's; the offset's moves see the first copy only). Either K
    form: its time over twice the unedited step's is what a two-block step could save."""
    common = _swap(common, "    row_max: object = None  # q_rows: [N] the block's row max\n",
                   "    row_max: object = None  # q_rows: [N] the block's row max\n    sT2: object = None\n")
    common = _swap(common, "            gemm_s(sm.step_mode[0], Q_s, stage, sm.sT, sm.q_frag, pingpong)\n",
                   "            gemm_s(sm.step_mode[0], Q_s, stage, sm.sT, sm.q_frag, pingpong)\n"
                   "            gemm_s(sm.step_mode[0], Q_s, stage, sm.sT2, sm.q_frag, False)\n")
    common = _swap(common, "                gemm_o(sm.pending_mode[0] >> 2, P_r, stage, sm.oT, T.wgmma_gemm, T.wgmma_gemm_sp)\n"
                   "                T.wait_wgmma(1)\n",
                   "                gemm_o(sm.pending_mode[0] >> 2, P_r, stage, sm.oT, T.wgmma_gemm, T.wgmma_gemm_sp)\n"
                   "                gemm_o(sm.pending_mode[0] >> 2, P_r, stage, sm.oT, T.wgmma_gemm, T.wgmma_gemm_sp)\n"
                   "                T.wait_wgmma(2)\n")
    common = _swap(common, "            lazy_scores(is_first, scale_log2, sT, offsets, lane_max)\n            if rows:",
                   "            lazy_scores(is_first, scale_log2, sT, offsets, lane_max)\n"
                   "            causal_mask(block, first_masked, last_pos, tile_tokens, sm.sT2)\n"
                   "            if rows:\n"
                   "                for c, i in T.Parallel(N, B):\n"
                   "                    sm.sT2[c, i] = sm.sT2[c, i] * scale_log2 - offsets[c]\n"
                   "                    lane_max[i // 8 % (CHAINS // 2) * 2 + i % 2] = T.max(\n"
                   "                        lane_max[i // 8 % (CHAINS // 2) * 2 + i % 2], sm.sT2[c, i])\n"
                   "            else:\n"
                   "                for i, c in T.Parallel(B, N):\n"
                   "                    sm.sT2[i, c] = sm.sT2[i, c] * scale_log2 - offsets[c]\n"
                   "                    lane_max[c // 8 % (CHAINS // 2) * 2 + c % 2] = T.max(\n"
                   "                        lane_max[c // 8 % (CHAINS // 2) * 2 + c % 2], sm.sT2[i, c])\n"
                   "            for k in T.unroll(1, CHAINS):\n                lane_max[0] = T.max(lane_max[0], lane_max[k])\n"
                   "            if rows:")
    common = _swap(common, "                for c, i in T.Parallel(N, B):\n                    sT[c, i] = T.exp2(sT[c, i])\n"
                   "                    row_sums[c, i] = row_sums[c, i] + sT[c, i]\n",
                   "                for c, i in T.Parallel(N, B):\n                    sT[c, i] = T.exp2(sT[c, i])\n"
                   "                    row_sums[c, i] = row_sums[c, i] + sT[c, i]\n"
                   "                for c, i in T.Parallel(N, B):\n                    sm.sT2[c, i] = T.exp2(sm.sT2[c, i])\n"
                   "                    row_sums[c, i] = row_sums[c, i] + sm.sT2[c, i]\n")
    common = _swap(common, "                group_barrier()  # WAR: every warp's O^T GEMM of block j - 1 has read P_w\n"
                   "                T.copy(sm.sT, P_w)\n",
                   "                group_barrier()  # WAR: every warp's O^T GEMM of block j - 1 has read P_w\n"
                   "                T.copy(sm.sT, P_w)\n                T.copy(sm.sT2, P_w)\n")
    common = _swap(common, "                for i, c in T.Parallel(B, N):\n                    sT[i, c] = T.exp2(sT[i, c])\n"
                   "                    row_sums[i, c] = row_sums[i, c] + sT[i, c]\n",
                   "                for i, c in T.Parallel(B, N):\n                    sT[i, c] = T.exp2(sT[i, c])\n"
                   "                    row_sums[i, c] = row_sums[i, c] + sT[i, c]\n"
                   "                for i, c in T.Parallel(B, N):\n                    sm.sT2[i, c] = T.exp2(sm.sT2[i, c])\n"
                   "                    row_sums[i, c] = row_sums[i, c] + sm.sT2[i, c]\n")
    common = _swap(common, "                T.copy(sm.sT, P_w)  # fenced at the next step's",
                   "                T.copy(sm.sT, P_w)\n                T.copy(sm.sT2, P_w)  # fenced at the next step's")
    common = _swap(common, "                row_max = T.alloc_fragment([N], accum) if rows else None\n",
                   "                row_max = T.alloc_fragment([N], accum) if rows else None\n"
                   "                sT2 = T.alloc_fragment(S_SHAPE, accum)\n")
    common = _swap(common, "                                 step_mode, q_frag, rescale_cols, row_max)",
                   "                                 step_mode, q_frag, rescale_cols, row_max, sT2)")
    return common


def edit(variant: str, common: str, producer: str) -> tuple[str, str]:
    """``(extend_common.py, extend_producer.py)`` of ``variant`` (names joined by ``+`` apply in turn) from the
    installed texts."""
    if "+" in variant:
        for part in variant.split("+"):
            common, producer = edit(part, common, producer)
        return common, producer
    if variant == "noexp":
        common = _swap(common, "                for i, c in T.Parallel(B, N):\n                    sT[i, c] = T.exp2(sT[i, c])\n",
                       "                for i, c in T.Parallel(B, N):\n                    sT[i, c] = sT[i, c]\n")
    elif variant == "novote":
        common = _swap(common, "            elif T.call_extern(\"int32\", \"hs_warpgroup_any\", T.if_then_else(lane_max[0] > LAZY, 1, 0),\n"
                       "                               12 + T.get_thread_binding() // 128) != 0:",
                       "            elif is_first:")
    elif variant == "nostore":
        common = _swap(common, "                T.copy(sm.sT, P_w)  # fenced at the next step's", "                T.sync_warp()  # fenced at the next step's")
    elif variant == "nogemmo":
        common = _swap(common, "                gemm_o(sm.pending_mode[0] >> 2, P_r, stage, sm.oT, T.wgmma_gemm, T.wgmma_gemm_sp)\n"
                       "                T.wait_wgmma(1)", "                T.wait_wgmma(1)")
    elif variant == "noload":
        producer = _swap(producer, "                    parts.load_fetched(i, num_blocks, h, stage, src, self.entries)\n", "")
    elif variant == "twoloads":
        producer = _swap(producer, "                    parts.load_fetched(i, num_blocks, h, stage, src, self.entries)\n",
                         "                    parts.load_fetched(i, num_blocks, h, stage, src, self.entries)\n"
                         "                    parts.load_fetched(i, num_blocks, h, stage, src, self.entries)\n")
    elif variant == "double":
        common = _double(common)
    elif variant == "probe":
        common, producer = _probe(common, producer)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return common, producer


def write_variant(variant: str, out_dir: str) -> str:
    """A copy of the installed kernels/ with ``variant``'s edits in ``out_dir/variant``; returns its path."""
    import sglang_hs.kernels as kernels

    src = list(kernels.__path__)[0]
    dst = os.path.join(out_dir, variant)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    paths = [os.path.join(dst, name) for name in ("extend_common.py", "extend_producer.py")]
    texts = [open(p, encoding="utf-8").read() for p in paths]
    for path, text in zip(paths, edit(variant, *texts)):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return dst


def read_probe(tree: str, tokens: list[int]) -> None:
    """Run the probe tree on the benchmark's case (S_K = S_V = 1) and print each warpgroup's clocks a block
    step by phase, one JSON line per size (GPU)."""
    from time_extend_kernels import use_kernels_tree

    use_kernels_tree(tree)
    import torch
    from profile_extend import benchmark_case

    from sglang_hs.kernels.cases import extend_run_args
    from sglang_hs.kernels.extend_common import TILE_SHAPES

    for n in tokens:
        case, plan = benchmark_case(n, 1.0, 1.0, tile="n128", stages=2)
        run_args = extend_run_args(case)
        for _ in range(10):
            _, lse = plan.run(*run_args, return_lse=True)
        torch.cuda.synchronize()
        lse = lse.float().cpu()
        qo, group = case["qo_indptr_list"], plan.group
        tokens_per_tile = TILE_SHAPES["n128"][0] // group
        n_phases = len(PHASES)
        sums = torch.zeros(2, n_phases, dtype=torch.float64)
        steps = 0
        for r in range(len(qo) - 1):
            for t0 in range(0, qo[r + 1] - qo[r], tokens_per_tile):
                last_pos = case["seq_lens_list"][r] - (qo[r + 1] - qo[r]) + t0 + tokens_per_tile - 1
                for h in range(plan.kv_heads):
                    for c in range(2 * n_phases):
                        sums[c // n_phases, c % n_phases] += lse[qo[r] + t0 + c // group, h * group + c % group].item()
                    steps += last_pos // plan.block_size + 1
        per_step = (sums / steps).tolist()
        print(json.dumps(dict(new_tokens=n, device=torch.cuda.get_device_name(), block_steps=steps,
                              clocks_per_step={f"warpgroup{w}": dict(zip(PHASES, map(lambda v: round(v, 1), per_step[w])))
                                               for w in range(2)})), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", help="noexp novote nostore nogemmo noload twoloads double probe, or several joined by +")
    ap.add_argument("--out", help="folder for the variants' kernels/ copies")
    ap.add_argument("--read-probe", metavar="TREE", help="run a probe tree and print its phase clocks (GPU)")
    ap.add_argument("--tokens", default="256,2048")
    args = ap.parse_args(argv)
    if args.read_probe:
        read_probe(args.read_probe, [int(x) for x in args.tokens.split(",")])
        return 0
    if not args.out or not args.variants:
        ap.error("give --out and at least one variant, or --read-probe")
    for variant in args.variants:
        print(write_variant(variant, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
