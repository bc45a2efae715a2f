// Issue rate of the warp-level tensor-core instructions the extend kernel's warp schedule uses, on the
// H100: dense mma.sync m16n8k16 against 2:4 mma.sp m16n8k32 (fp16 in, fp32 accumulate), with 1, 2 and 4
// warps per SM partition; then which warps of a CTA share a partition (two warps that share one take
// twice as long, because one warp already fills it). Build and run on the GPU machine:
//     nvcc -arch=sm_90a -O3 -o /tmp/mma_rate launch/mma_rate.cu && /tmp/mma_rate
// Output of the H100: launch/results/mma_rate_h100.log.
#include <cstdio>
#include <cuda_runtime.h>

constexpr int kAcc = 16;  // independent accumulators a warp cycles through (no dependent mma in a row)

template <bool kSparse>
__device__ __forceinline__ void mma(float (&c)[4], unsigned a0, unsigned a1, unsigned b0, unsigned b1) {
  const unsigned meta = 0x44444444u;  // keep elements 0 and 1 of each group of 4
  if (kSparse) {
    asm volatile(
        "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%4,%5}, {%6,%7,%6,%7}, {%0,%1,%2,%3}, %8, 0x0;"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(b0), "r"(b1), "r"(meta));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%4,%5}, {%6,%7}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
  }
}

// Warps whose bit is set in `active` run `iters` x kAcc instructions; each records its clock64 cycles.
template <bool kSparse>
__global__ void issue(float* out, long long* cycles, int iters, unsigned active) {
  const int warp = threadIdx.x / 32;
  if (!((active >> warp) & 1)) return;
  float c[kAcc][4] = {};
  const unsigned a0 = threadIdx.x, a1 = a0 * 3, b0 = a0 * 11, b1 = a0 * 13;
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) mma<kSparse>(c[i], a0, a1, b0, b1);
  }
  const long long t1 = clock64();
  float s = 0.f;
  for (int i = 0; i < kAcc; ++i) s += c[i][0] + c[i][1] + c[i][2] + c[i][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the results live
  if (threadIdx.x % 32 == 0) cycles[blockIdx.x * 32 + warp] = t1 - t0;
}

template <bool kSparse>
double cycles_per_mma(int sms, int warps, unsigned active, int iters, float* out, long long* cycles, int warp) {
  issue<kSparse><<<sms, warps * 32>>>(out, cycles, iters, active);
  cudaDeviceSynchronize();
  long long h = 0;
  cudaMemcpy(&h, cycles + warp, sizeof(h), cudaMemcpyDeviceToHost);
  return double(h) / (double(iters) * kAcc);
}

int main() {
  int sms = 0, khz = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  float* out;
  long long* cycles;
  cudaMalloc(&out, sms * 1024 * sizeof(float));
  cudaMalloc(&cycles, sms * 32 * sizeof(long long));
  const int iters = 20000;
  std::printf("%d SMs, max clock %d MHz; %d independent accumulators a warp\n", sms, khz / 1000, kAcc);
  for (int per_partition : {1, 2, 4}) {
    const int warps = 4 * per_partition;
    for (bool sparse : {false, true}) {
      cycles_per_mma<true>(sms, warps, ~0u, 100, out, cycles, 0);  // warm-up
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      cudaEventRecord(e0);
      double cyc = sparse ? cycles_per_mma<true>(sms, warps, ~0u, iters, out, cycles, 0)
                          : cycles_per_mma<false>(sms, warps, ~0u, iters, out, cycles, 0);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0.f;
      cudaEventElapsedTime(&ms, e0, e1);
      const double flop = 2.0 * 16 * 8 * (sparse ? 32 : 16);  // dense-equivalent
      const double tflops = double(sms) * warps * iters * kAcc * flop / (ms * 1e-3) / 1e12;
      std::printf("%-22s %d warp(s) per partition: %5.2f cycles a warp per instruction = %5.2f a partition; "
                  "%4.0f dense-equivalent TFLOP/s\n",
                  sparse ? "mma.sp m16n8k32" : "mma.sync m16n8k16", per_partition, cyc, cyc / per_partition, tflops);
    }
  }
  std::printf("which warps of a CTA of 8 share a partition (mma.sp, cycles per instruction of warp 0):\n");
  for (int other = 1; other < 8; ++other) {
    const double alone = cycles_per_mma<true>(sms, 8, 1u, 4000, out, cycles, 0);
    const double pair = cycles_per_mma<true>(sms, 8, 1u | (1u << other), 4000, out, cycles, 0);
    std::printf("  warp 0 alone %.1f, with warp %d %.1f%s\n", alone, other, pair,
                pair > 1.5 * alone ? "  <- same partition" : "");
  }
  return 0;
}
