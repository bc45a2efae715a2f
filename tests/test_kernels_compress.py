"""Tests of the fused prune + compress kernels (``sglang_hs.kernels.compress``).

GPU (``@pytest.mark.gpu``, skipped without CUDA): the TileLang kernels through ``FusedCompressor``
against ``sglang_hs.pools.compress_prefix``, bit for bit (virtual block ids, slot ownership, index
maps, every pool of every layer), for S_K, S_V in {0, 0.5, 1} x head_dim {64, 128} x fp16/bf16 x
several layer counts; the loss pass and the pack pass on their own.

CPU: the pure-PyTorch helpers (the compare network, the metadata words, the loss network, the
host-side block choice, the ranking), the whole wrapper on ``TorchEmulation`` against the PyTorch
path, and, where TileLang and g++ are installed, the kernels' *generated CUDA* compiled for the host
and run thread by thread (shuffles and barriers emulated) against the emulation: the generated code's
index arithmetic, compare network and stores are checked before the GPU sees them.

Test data: random normal KV times a random per-token scale (block losses then differ by far more
than float32 summation order, so the kernel's and PyTorch's rankings agree; blocks whose losses agree
to ~1e-7 could legitimately swap), plus pages of small integers and signed zeros, whose losses are
exact in any summation order and whose groups are full of ties.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from sglang_hs.format import pack_2to4
from sglang_hs.kernels import compress as C
from sglang_hs.pools import CompressedStore, StoreCapacity
from sglang_hs.pools import compress_prefix as torch_compress_prefix
from sglang_hs.pruner import MagnitudePruner, rank_sparse, top2_of_4

B = 64
POOLS = ("k_dense", "k_values", "k_meta", "v_dense", "v_values", "v_meta")
S_VALUES = (0.0, 0.5, 1.0)


# ------------------------------------------------------------------------------------------ helpers
def make_kv(layers, heads, dim, dtype, pages, device="cpu", seed=0, tie_pages=()):
    """Per-layer K and V buffers ``[pages*B, H, D]``: normal x per-token scale; ``tie_pages`` hold small
    integers and signed zeros (exact losses, tied groups)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def one():
        x = torch.randn(pages * B, heads, dim, generator=gen, device=device)
        x = x * torch.rand(pages * B, 1, 1, generator=gen, device=device).mul(3).exp()
        for p in tie_pages:
            t = torch.randint(-2, 3, (B, heads, dim), generator=gen, device=device).float()
            neg0 = torch.rand(B, heads, dim, generator=gen, device=device) < 0.5
            x[p * B:(p + 1) * B] = torch.where((t == 0) & neg0, torch.full_like(t, -0.0), t)
        return x.to(dtype)

    return [one() for _ in range(layers)], [one() for _ in range(layers)]


def make_store(layers, heads, dim, dtype, blocks, device="cpu", k_sparse=None, v_sparse=None, k_dense=None,
               v_dense=None, k_sparse_heads=None):
    def pick(x):
        return blocks if x is None else x

    cap = StoreCapacity(blocks, pick(k_dense), pick(k_sparse), pick(v_dense), pick(v_sparse))
    return CompressedStore(cap, layers, heads, dim, B, dtype, device, k_sparse_heads=k_sparse_heads)


def head_map(layers, heads, seed=0):
    """A K head map with every layer different: some heads 2:4, some dense, a layer with all heads
    2:4 and (with 2+ layers) one with none."""
    g = torch.Generator().manual_seed(seed)
    sparse = torch.rand(layers, heads, generator=g) < 0.6
    sparse[0] = True
    if layers > 1:
        sparse[1] = False
    if layers > 2:
        sparse[2, 0], sparse[2, -1] = True, False
    return sparse


def page_slots(pages):
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * B + torch.arange(B)).reshape(-1)


def bits(t):
    return t if t.dtype == torch.int16 else t.view(torch.int16)


def assert_same_store(got, want):
    assert got.placements() == want.placements()
    assert torch.equal(got.k_index, want.k_index) and torch.equal(got.v_index, want.v_index)
    for name in POOLS:
        for layer, (a, b) in enumerate(zip(getattr(got, name), getattr(want, name))):
            if not torch.equal(bits(a), bits(b)):
                rows = (bits(a) != bits(b)).reshape(a.shape[0], -1).any(-1).nonzero().flatten().tolist()
                raise AssertionError(f"{name}[layer {layer}] differs in pool rows {rows[:10]}")


def torch_loss(buffers, pages, heads, operand, sparse_heads=None):
    """``compress_prefix``'s loss: per layer and head (the heads ``sparse_heads [L, H]`` maps, if
    given), the pruner's block loss, summed."""
    pruner = MagnitudePruner()
    total = torch.zeros(len(pages), dtype=torch.float32, device=buffers[0].device)
    slots = page_slots(pages).to(buffers[0].device)
    for layer, buf in enumerate(buffers):
        blocks = buf[slots].reshape(len(pages), B, heads, -1).permute(2, 0, 1, 3)
        per_head = pruner.block_loss(blocks, pruner.element_mask(blocks, operand))
        if sparse_heads is not None:
            per_head = per_head[sparse_heads[layer].to(per_head.device)]
        total += per_head.sum(0)
    return total


def run_pair(kb, vb, heads, dim, dtype, groups_list, prefixes, device, backend=None, reduce_losses=None, **store_kw):
    """Compress the same prefixes (page lists) into two fresh stores, with the PyTorch path and with
    ours; returns (ours, theirs, [(vbs_ours, vbs_theirs)])."""
    layers = len(kb)
    blocks = sum(len(p) for p in prefixes)
    ours = make_store(layers, heads, dim, dtype, blocks, device, **store_kw)
    theirs = make_store(layers, heads, dim, dtype, blocks, device, **store_kw)
    ids = []
    compressor = C.FusedCompressor()
    for pages, groups in zip(prefixes, groups_list):
        slots = page_slots(pages).to(device)
        want = torch_compress_prefix(theirs, MagnitudePruner(), kb, vb, slots, groups, reduce_losses=reduce_losses)
        got = compressor(ours, MagnitudePruner(), kb, vb, slots, groups, backend=backend, reduce_losses=reduce_losses)
        ids.append((got, want))
    return ours, theirs, ids


# ------------------------------------------------------------------------------------- CPU: helpers
def test_import_needs_neither_tilelang_nor_gpu():
    code = "import sys, sglang_hs.kernels.compress; assert 'tilelang' not in sys.modules"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_top2_network_is_the_pruners_choice(dtype):
    """The kernel's integer compare network on the 16-bit words equals ``top2_of_4`` on |x|: random
    values, small integers (ties), signed zeros, infinities and subnormals."""
    torch.manual_seed(0)
    tiny = torch.finfo(dtype).tiny
    x = torch.cat([
        torch.randn(4096) * 10,
        torch.randint(-2, 3, (4096,)).float(),
        torch.tensor([0.0, -0.0, 0.0, -0.0, -0.0, 1.0, -1.0, 0.0, float("inf"), -float("inf"), 3.0, float("inf")]),
        torch.tensor([tiny / 4, -tiny / 2, tiny / 4, 0.0]),
    ]).to(dtype).reshape(-1, 4)
    got = C.top2_network(x.view(torch.int16))
    want = top2_of_4(x.float().abs(), -1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pack_words_is_the_format(dtype):
    """Values and int16 metadata built from (lowest, highest) kept position equal ``format.pack_2to4``."""
    torch.manual_seed(1)
    x = torch.randn(6, 64, 128).to(dtype)
    x[0] = torch.randint(-1, 2, (64, 128)).to(dtype)
    keep = top2_of_4(x.float().abs(), -1)
    values, meta = C.pack_words(x.view(torch.int16), keep)
    ref_values, ref_meta = pack_2to4(x, keep)
    assert torch.equal(values, ref_values.view(torch.int16)) and torch.equal(meta, ref_meta)


def test_dropped_l1_is_the_block_loss():
    torch.manual_seed(2)
    pruner = MagnitudePruner()
    exact = torch.randint(-3, 4, (3, 5, 64, 64)).half()  # integer sums: exact in any order
    for blocks, op in ((exact, "k"), (exact, "v")):
        want = pruner.block_loss(blocks, pruner.element_mask(blocks, op))
        a = blocks.float().abs()
        got = C.dropped_l1(a if op == "k" else a.transpose(-1, -2)).sum((-1, -2))
        assert torch.equal(got, want)
    noisy = torch.randn(3, 5, 64, 64).half() * 7
    want = pruner.block_loss(noisy, pruner.element_mask(noisy, "k"))
    assert torch.allclose(C.dropped_l1(noisy.float().abs()).sum((-1, -2)), want, rtol=1e-5)


def test_host_choice_and_ranking_equal_rank_sparse():
    """S = 0 and S = 1 are decided on the host without a loss; fractional counts are ranked with
    rank_sparse's ops; both equal rank_sparse on any loss."""
    torch.manual_seed(3)
    n = 23
    loss = torch.rand(n)
    loss[3] = loss[7]  # a tie: stable order keeps the earlier block first
    prompt = torch.rand(n) < 0.6
    for s_prompt in (0.0, 0.3, 0.5, 1.0):
        for s_decode in (0.0, 0.5, 1.0):
            groups = [(prompt, s_prompt, s_decode), (~prompt, s_decode, s_prompt)]
            for op in ("k", "v"):
                want = torch.zeros(n, dtype=torch.bool)
                for mask, sk, sv in groups:
                    want |= rank_sparse(loss, mask, sk if op == "k" else sv)
                fixed, ranked = C.plan_choice(groups, n, op)
                fractional = [s for s in ((s_prompt, s_decode) if op == "k" else (s_decode, s_prompt))
                              if s not in (0.0, 1.0)]
                assert len(ranked) == len(fractional)
                got = fixed | C.rank_on_device(loss, ranked) if ranked else fixed
                assert torch.equal(got, want), (s_prompt, s_decode, op)


def test_other_pruners_and_cpu_tensors_use_the_pytorch_path():
    class Scaled(MagnitudePruner):
        def element_scores(self, blocks, operand):
            return blocks.float().abs() * 2

    store = make_store(1, 2, 64, torch.float16, 4)
    kb, vb = make_kv(1, 2, 64, torch.float16, 4)
    assert "magnitude" in C.unsupported_reason(store, Scaled(), kb, vb, page_slots([0]))
    assert C.is_magnitude(MagnitudePruner()) and not C.is_magnitude(Scaled())
    assert "CUDA" in C.unsupported_reason(store, MagnitudePruner(), kb, vb, page_slots([0]))
    ours, theirs, ids = run_pair(kb, vb, 2, 64, torch.float16, [[(torch.ones(3, dtype=torch.bool), 0.5, 1.0)]],
                                 [[2, 0, 3]], "cpu")
    assert ids[0][0] == ids[0][1]
    assert_same_store(ours, theirs)


# ------------------------------------------------------------------------- CPU: wrapper on emulation
# The third: SmolLM2-135M's 3 KV heads of 64 (its V loss kernel runs 192 threads, not 256).
CPU_SHAPES = [(2, 64, torch.float16, 1), (4, 128, torch.bfloat16, 3), (3, 64, torch.float16, 2)]


@pytest.mark.parametrize("heads,dim,dtype,layers", CPU_SHAPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("sk", S_VALUES)
@pytest.mark.parametrize("sv", S_VALUES)
def test_wrapper_on_emulation_equals_pytorch_path(heads, dim, dtype, layers, sk, sv):
    """The wrapper's decisions (host choice, ranking, store allocation, block info, page ids) with the
    kernels' arithmetic emulated in PyTorch: the same store as ``pools.compress_prefix``, bit for bit,
    over two prefixes with prompt and decode groups."""
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(4)).tolist()
    kb, vb = make_kv(layers, heads, dim, dtype, 40, seed=5, tie_pages=perm[:3])
    first, second = perm[:13], perm[13:20]
    prompt = torch.arange(13) < 9
    groups = [[(prompt, sk, sv), (~prompt, sv, sk)], [(torch.ones(7, dtype=torch.bool), sk, sv)]]
    ours, theirs, ids = run_pair(kb, vb, heads, dim, dtype, groups, [first, second], "cpu",
                                 backend=C.TorchEmulation())
    for got, want in ids:
        assert got == want
    assert_same_store(ours, theirs)


@pytest.mark.parametrize("heads,dim,dtype,layers", CPU_SHAPES[1:], ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("sk,sv", [(1.0, 1.0), (0.5, 1.0), (1.0, 0.0), (0.5, 0.5), (0.0, 1.0)])
def test_wrapper_on_emulation_with_k_head_map(heads, dim, dtype, layers, sk, sv):
    """With a K head map (a layer all 2:4, a layer all dense, mixed layers) the wrapper and the
    emulated kernels fill the store exactly as ``pools.compress_prefix`` does, a fractional S_K ranked
    by the loss of the mapped heads only."""
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(21)).tolist()
    kb, vb = make_kv(layers, heads, dim, dtype, 40, seed=22, tie_pages=perm[:3])
    prompt = torch.arange(13) < 9
    groups = [[(prompt, sk, sv), (~prompt, sv, sk)], [(torch.ones(7, dtype=torch.bool), sk, sv)]]
    ours, theirs, ids = run_pair(kb, vb, heads, dim, dtype, groups, [perm[:13], perm[13:20]], "cpu",
                                 backend=C.TorchEmulation(), k_sparse_heads=head_map(layers, heads, seed=heads))
    for got, want in ids:
        assert got == want
    assert_same_store(ours, theirs)
    assert ours.k_index.dim() == 3


def test_loss_reduction_reaches_the_ranking_on_both_paths():
    """Under tensor parallelism both compressors rank by the losses summed over the ranks. A stand-in
    reduction that reverses the ranking (negated losses) must change the block choice of both paths
    in the same way, and leave S = 0 / 1 (no ranking) alone."""
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(8)).tolist()
    kb, vb = make_kv(2, 2, 64, torch.float16, 40, seed=9)
    groups = [[(torch.ones(12, dtype=torch.bool), 0.5, 0.5)], [(torch.ones(6, dtype=torch.bool), 0.0, 1.0)]]
    prefixes = [perm[:12], perm[12:18]]
    calls = []

    def negate(losses: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(losses.shape))
        return -losses

    plain, _, _ = run_pair(kb, vb, 2, 64, torch.float16, groups, prefixes, "cpu", backend=C.TorchEmulation())
    ours, theirs, ids = run_pair(kb, vb, 2, 64, torch.float16, groups, prefixes, "cpu", backend=C.TorchEmulation(),
                                 reduce_losses=negate)  # fmt: skip
    assert calls == [(2, 12), (2, 12)]  # once per path for the fractional prefix, never for S = 0 / 1
    for got, want in ids:
        assert got == want
    assert_same_store(ours, theirs)
    sparse_k = [[store.placement(vb).k_sparse for vb in ids[0][0]] for store in (plain, ours)]
    assert sum(sparse_k[0]) == sum(sparse_k[1]) == 6 and sparse_k[0] != sparse_k[1]


def test_emulated_loss_matches_pytorch_loss():
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(6)).tolist()
    kb, vb = make_kv(2, 4, 128, torch.float16, 20, seed=7, tie_pages=perm[:2])
    store = make_store(2, 4, 128, torch.float16, 1)
    emu = C.TorchEmulation()
    addr = emu.address_table(kb, vb, store)
    pages = torch.tensor(perm[:9])
    for op, bufs in (("k", kb), ("v", vb)):
        want = torch_loss(bufs, perm[:9], 4, op)
        assert torch.allclose(emu.loss(addr, pages, op, store.loss_head_weights[op]), want, rtol=1e-5)


# ------------------------------------------------------------- CPU: the generated CUDA, run on the host
_SHIM = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <barrier>
#include <thread>
#include <vector>
struct dim3_ { int x = 0, y = 0, z = 0; };
thread_local dim3_ threadIdx, blockIdx;
typedef unsigned short ushort;
typedef unsigned int uint;
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) short4 { short x, y, z, w; };
struct alignas(4) short2 { short x, y; };
struct alignas(8) ushort4 { ushort x, y, z, w; };
struct alignas(4) ushort2 { ushort x, y; };
static int g_misaligned = 0;
template <class T> static inline T* CHK(const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % sizeof(T)) g_misaligned = 1;
  return (T*)p;
}
static inline float h2f(uint16_t h) {
  uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
  if (e == 0) {
    if (m == 0) u = s;
    else { int k = -1; do { k++; m <<= 1; } while (!(m & 0x400)); m &= 0x3ff; u = s | ((uint32_t)(112 - k) << 23) | (m << 13); }
  } else if (e == 31) u = s | 0x7f800000 | (m << 13);
  else u = s | ((e + 112) << 23) | (m << 13);
  float f; std::memcpy(&f, &u, 4); return f;
}
struct half_t { uint16_t b; operator float() const { return h2f(b); } };
struct bfloat16_t { uint16_t b; operator float() const { uint32_t u = (uint32_t)b << 16; float f; std::memcpy(&f, &u, 4); return f; } };
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static float* g_smem;
static float* g_shfl;
static std::barrier<>* g_bar;
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int m, int) {
  int t = threadIdx.x; g_shfl[t] = v; g_bar->arrive_and_wait(); float r = g_shfl[t ^ m]; g_bar->arrive_and_wait(); return r;
}
#define __global__
#define __launch_bounds__(...)
#define __restrict__
#define __align__(n)
"""

_PACK_LAUNCH = r"""
extern "C" int launch(const int64_t* ADDR, const int* INFO, const int* KROW, const int64_t* PAGES, int L, int n, int H,
                      int threads) {
  for (int z = 0; z < L; ++z) for (int y = 0; y < n; ++y) for (int x = 0; x < H; ++x)
    for (int t = 0; t < threads; ++t) {
      blockIdx = {x, y, z}; threadIdx = {t, 0, 0}; main_kernel(ADDR, INFO, KROW, PAGES, L, n);
    }
  return g_misaligned;
}
"""

_LOSS_LAUNCH = r"""
extern "C" int launch(const int64_t* ADDR, const float* HW, float* LP, const int64_t* PAGES, float* OUT, int L, int n,
                      int threads) {
  std::vector<float> smem(1024), shfl(threads);
  g_smem = smem.data(); g_shfl = shfl.data();
  for (int y = 0; y < L; ++y) for (int x = 0; x < n; ++x) {
    std::barrier<> bar(threads); g_bar = &bar;
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([=] { blockIdx = {x, y, 0}; threadIdx = {t, 0, 0}; main_kernel(ADDR, HW, LP, PAGES, L, n); });
    for (auto& th : ts) th.join();
  }
  for (int x = 0; x < (n + 127) / 128; ++x)
    for (int t = 0; t < 128; ++t) { blockIdx = {x, 0, 0}; threadIdx = {t, 0, 0}; main_kernel_1(LP, OUT, L, n); }
  return g_misaligned;
}
"""

PACK_SIGNATURE = ("main_kernel(const int64_t* __restrict__ ADDR, const int* __restrict__ INFO, "
                  "const int* __restrict__ KROW, const int64_t* __restrict__ PAGES, int L, int n)")
LOSS_SIGNATURE = ("main_kernel(const int64_t* __restrict__ ADDR, const float* __restrict__ HW, "
                  "float* __restrict__ LP, const int64_t* __restrict__ PAGES, int L, int n)")


def _lower(prim_func) -> str:
    tilelang = pytest.importorskip("tilelang")
    from tilelang import tvm

    with tvm.transform.PassContext(config=C.PASS_CONFIGS), tvm.target.Target(C.SM90_TARGET):
        return tilelang.lower(prim_func, target=C.SM90_TARGET).kernel_source


def _host_library(cuda_src: str, launcher: str):
    """The generated CUDA as host C++: kernels become functions called once per (block, thread);
    vector accesses are checked for alignment; dynamic shared memory is one host array."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    body = cuda_src[cuda_src.index('extern "C" __global__ void __launch'):]
    body = re.sub(r"extern __shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+(\w+)\[\];", r"\1* \2 = (\1*)g_smem;", body)
    body = re.sub(r"\*\((u?(?:int|short)[24])\*\)\(", r"*CHK<\1>(", body)
    code = _SHIM + body + launcher
    folder = os.path.join(tempfile.gettempdir(), "hs_compress_host")
    os.makedirs(folder, exist_ok=True)
    lib = os.path.join(folder, hashlib.sha1(code.encode()).hexdigest()[:16] + ".so")
    if not os.path.exists(lib):
        src = lib[:-3] + ".cpp"
        with open(src, "w") as f:
            f.write(code)
        res = subprocess.run(["g++", "-O1", "-std=c++20", "-fno-strict-aliasing", "-shared", "-fPIC", "-pthread",
                              src, "-o", lib], capture_output=True, text=True)
        if res.returncode:
            raise AssertionError("host build of the generated CUDA failed:\n" + res.stderr[-3000:])
    return ctypes.CDLL(lib)


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


@pytest.mark.parametrize("heads,dim,dtype,layers", CPU_SHAPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("mapped", [False, True], ids=["all-heads", "k-head-map"])
def test_generated_pack_kernel_on_host(heads, dim, dtype, layers, mapped):
    """The pack kernel's CUDA (as lowered for sm_90a), run on the host, writes exactly what the
    emulation writes: random pages, random slots, every mix of dense/sparse K and V, with and without
    a K head map (K-sparse blocks' unmapped heads in the dense-K pool's tail)."""
    src = _lower(C.build_pack_prim_func(heads, dim, B))
    assert PACK_SIGNATURE in src, "kernel signature changed: update the host launcher"
    lib = _host_library(src, _PACK_LAUNCH)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(8)).tolist()
    kb, vb = make_kv(layers, heads, dim, dtype, 16, seed=9, tie_pages=perm[:2])
    pages = torch.tensor(perm[:8], dtype=torch.int64)
    info = torch.tensor([[1, 2, 0, 5], [0, 1, 1, 0], [1, 7, 1, 3], [0, 4, 0, 6], [1, 0, 1, 1], [1, 5, 0, 2],
                         [0, 0, 1, 6], [0, 6, 0, 1]], dtype=torch.int32)
    sparse_heads = head_map(layers, heads, seed=heads) if mapped else None
    ours, emulated = (make_store(layers, heads, dim, dtype, 8, k_sparse_heads=sparse_heads) for _ in range(2))
    table = torch.tensor([[t.data_ptr() for t in row] for row in
                          (kb, vb, *(getattr(ours, name) for name in POOLS))], dtype=torch.int64)
    krow = ours.k_sparse_block_rows.contiguous()
    assert lib.launch(_ptr(table), _ptr(info), _ptr(krow), _ptr(pages), layers, len(pages), heads,
                      C.PACK_THREADS) == 0, "misaligned vector access"
    emu = C.TorchEmulation()
    emu.pack(emu.address_table(kb, vb, emulated), pages, info, emulated.k_sparse_block_rows)
    for name in POOLS:
        for layer in range(layers):
            a, b = bits(getattr(ours, name)[layer]), bits(getattr(emulated, name)[layer])
            assert (b.any() or b.numel() == 0) and torch.equal(a, b), f"{name}[{layer}]"


@pytest.mark.parametrize("heads,dim,dtype,layers", CPU_SHAPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("operand", ["k", "v", "k-head-map"])
def test_generated_loss_kernel_on_host(heads, dim, dtype, layers, operand):
    """The loss kernel's CUDA, run on the host with emulated warp shuffles and barriers: the PyTorch
    path's loss to float32 summation order (with a K head map: over the mapped heads only)."""
    sparse_heads = head_map(layers, heads, seed=heads) if operand == "k-head-map" else None
    operand = operand[0]
    dt = "float16" if dtype == torch.float16 else "bfloat16"
    src = _lower(C.build_loss_prim_func(operand, heads, dim, B, dt))
    assert LOSS_SIGNATURE in src, "kernel signature changed: update the host launcher"
    threads = int(src.split("__launch_bounds__(")[1].split(",")[0])
    lib = _host_library(src, _LOSS_LAUNCH)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(10)).tolist()
    kb, vb = make_kv(layers, heads, dim, dtype, 12, seed=11, tie_pages=perm[:1])
    pages = torch.tensor(perm[:5], dtype=torch.int64)
    bufs = kb if operand == "k" else vb
    addr = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.int64)
    scratch, out = torch.zeros(layers, len(pages)), torch.zeros(len(pages))
    weights = make_store(layers, heads, dim, dtype, 1, k_sparse_heads=sparse_heads).loss_head_weights[operand]
    assert lib.launch(_ptr(addr), _ptr(weights), _ptr(scratch), _ptr(pages), _ptr(out), layers, len(pages),
                      threads) == 0
    want = torch_loss(bufs, perm[:5], heads, operand, sparse_heads)
    assert torch.allclose(out, want, rtol=1e-5), (out, want)
    in_order = torch.zeros(len(pages))
    for layer in range(layers):  # the second kernel adds the layers in order, like compress_prefix
        in_order += scratch[layer]
    assert torch.equal(out, in_order)


# ---------------------------------------------------------------------------------------------- GPU
GPU_SHAPES = [  # (kv_heads, head_dim, dtype, layers): head_dim 64/128, fp16/bf16, 1-4 layers
    (2, 64, torch.float16, 1),
    (2, 64, torch.bfloat16, 3),
    (8, 128, torch.float16, 4),
    (8, 128, torch.bfloat16, 2),
    (3, 64, torch.float16, 2),
]


def _shape_id(v):
    h, d, dt, layers = v
    return f"H{h}-d{d}-{str(dt).split('.')[-1]}-L{layers}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("sk", S_VALUES)
@pytest.mark.parametrize("sv", S_VALUES)
def test_kernels_equal_pytorch_compress_prefix(shape, sk, sv):
    """Two prefixes (pages in random order, tie-heavy pages among them, prompt and decode groups)
    compressed by the kernels and by ``pools.compress_prefix``: identical stores."""
    heads, dim, dtype, layers = shape
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(12)).tolist()
    kb, vb = make_kv(layers, heads, dim, dtype, 48, "cuda", seed=13, tie_pages=perm[:4])
    store = make_store(layers, heads, dim, dtype, 1, "cuda")
    assert C.unsupported_reason(store, MagnitudePruner(), kb, vb, page_slots([0]).cuda()) is None
    first, second = perm[:21], perm[21:30]
    prompt = torch.arange(21) < 15
    groups = [[(prompt, sk, sv), (~prompt, sk, sv)], [(torch.ones(9, dtype=torch.bool), sk, sv)]]
    ours, theirs, ids = run_pair(kb, vb, heads, dim, dtype, groups, [first, second], "cuda")
    torch.cuda.synchronize()
    for got, want in ids:
        assert got == want
    assert_same_store(ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES[1:], ids=_shape_id)
@pytest.mark.parametrize("sk,sv", [(1.0, 1.0), (0.5, 1.0), (0.5, 0.5)])
def test_kernels_with_k_head_map_equal_pytorch_compress_prefix(shape, sk, sv):
    """With a K head map (per layer: all heads 2:4, none, or some), the kernels and
    ``pools.compress_prefix`` give identical stores; a fractional S_K ranks by the mapped heads' loss."""
    heads, dim, dtype, layers = shape
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(23)).tolist()
    kb, vb = make_kv(layers, heads, dim, dtype, 48, "cuda", seed=24, tie_pages=perm[:4])
    prompt = torch.arange(21) < 15
    groups = [[(prompt, sk, sv), (~prompt, 0.0, 1.0)], [(torch.ones(9, dtype=torch.bool), sk, sv)]]
    ours, theirs, ids = run_pair(kb, vb, heads, dim, dtype, groups, [perm[:21], perm[21:30]], "cuda",
                                 k_sparse_heads=head_map(layers, heads, seed=heads))
    torch.cuda.synchronize()
    for got, want in ids:
        assert got == want
    assert_same_store(ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("sk,sv", [(1.0, 1.0), (0.0, 1.0), (0.5, 0.5)])
def test_llama8b_shape_all_layers_one_launch(sk, sv):
    """32 layers x 8 KV heads x d 128 in one launch per pass, mixed groups (prompt at (sk, sv),
    generated blocks at (0, 1))."""
    perm = torch.randperm(80, generator=torch.Generator().manual_seed(14)).tolist()
    kb, vb = make_kv(32, 8, 128, torch.float16, 80, "cuda", seed=15, tie_pages=perm[:2])
    prompt = torch.arange(64) < 48
    groups = [[(prompt, sk, sv), (~prompt, 0.0, 1.0)]]
    ours, theirs, ids = run_pair(kb, vb, 8, 128, torch.float16, groups, [perm[:64]], "cuda")
    assert ids[0][0] == ids[0][1]
    assert_same_store(ours, theirs)


@pytest.mark.gpu
def test_empty_pools_are_never_touched():
    """A store without sparse-K and dense-V pools (S_K = 0, S_V = 1 only): null addresses in the table."""
    kb, vb = make_kv(2, 8, 128, torch.float16, 12, "cuda", seed=16)
    groups = [[(torch.ones(10, dtype=torch.bool), 0.0, 1.0)]]
    ours, theirs, ids = run_pair(kb, vb, 8, 128, torch.float16, groups, [list(range(11, 1, -1))], "cuda",
                                 k_sparse=0, v_dense=0)
    assert ids[0][0] == ids[0][1]
    assert_same_store(ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=_shape_id)
def test_loss_pass(shape):
    """The loss pass alone, int32 and int64 page ids: PyTorch's loss (summation order aside) and the
    emulation's; deterministic."""
    heads, dim, dtype, layers = shape
    perm = torch.randperm(30, generator=torch.Generator().manual_seed(17)).tolist()
    kb, vb = make_kv(layers, heads, dim, dtype, 30, "cuda", seed=18, tie_pages=perm[:3])
    store = make_store(layers, heads, dim, dtype, 1, "cuda")
    plan = C.HieraSparseCompress(heads, dim, B, dtype, "cuda")
    addr = C.address_table(kb, vb, store)
    emu = C.TorchEmulation()
    for op, bufs in (("k", kb), ("v", vb)):
        want = torch_loss(bufs, perm[:17], heads, op)
        weights = store.loss_head_weights[op]
        got = plan.loss(addr, torch.tensor(perm[:17], dtype=torch.int32, device="cuda"), op, weights)
        again = plan.loss(addr, torch.tensor(perm[:17], dtype=torch.int64, device="cuda"), op, weights)
        assert torch.equal(got, again)
        assert torch.allclose(got, want, rtol=1e-5)
        assert torch.allclose(got, emu.loss(emu.address_table(kb, vb, store), torch.tensor(perm[:17]).cuda(), op,
                                                       weights),
                              rtol=1e-5)
        # the tie-heavy blocks have exact losses
        ties = [perm[:17].index(p) for p in perm[:3]]
        assert torch.equal(got[ties], want[ties])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES[:3], ids=_shape_id)
def test_pack_pass_arbitrary_slots_no_host_sync(shape):
    """The pack pass alone with random modes and slots equals the emulation, bit for bit, and neither
    it nor the ranking nor the page-id computation synchronizes with the host."""
    heads, dim, dtype, layers = shape
    g = torch.Generator().manual_seed(19)
    perm = torch.randperm(40, generator=g).tolist()
    kb, vb = make_kv(layers, heads, dim, dtype, 40, "cuda", seed=20, tie_pages=perm[:2])
    n = 25
    info = torch.stack([torch.randint(0, 2, (n,), generator=g), torch.randperm(n, generator=g),
                        torch.randint(0, 2, (n,), generator=g), torch.randperm(n, generator=g)], 1).int()
    ours, emulated = (make_store(layers, heads, dim, dtype, n, "cuda") for _ in range(2))
    plan = C.HieraSparseCompress(heads, dim, B, dtype, "cuda")
    plan.build_all()
    addr = C.address_table(kb, vb, ours)
    pages_host = torch.tensor(perm[:n])
    slots = page_slots(pages_host).cuda()
    info_dev = info.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pages = C.page_ids(slots, B)
        plan.pack(addr, pages, info_dev, ours.k_sparse_block_rows)
        loss = plan.loss(addr, pages, "k", ours.loss_head_weights["k"])
        C.rank_on_device(loss, [(torch.rand(n, generator=g) < 0.5, 3)])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    emu = C.TorchEmulation()
    emu.pack(emu.address_table(kb, vb, emulated), pages_host.cuda(), info_dev, emulated.k_sparse_block_rows)
    for name in POOLS:
        for layer in range(layers):
            a, b = bits(getattr(ours, name)[layer]), bits(getattr(emulated, name)[layer])
            assert torch.equal(a, b), f"{name}[{layer}]"
    assert torch.equal(pages.cpu(), pages_host)
