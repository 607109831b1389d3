// The int8 activation modes on CUDA: quantizers and the per-token epilogue (C ABI in activation_quant.h,
// per-element arithmetic in activation_quant_math.h, shared with the host replay test). Memory-bound and
// small next to the GEMM: x is read twice (max, then codes; a row of x stays in L2 between the passes).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "activation_quant.h"
#include "activation_quant_math.h"

namespace ternary {
namespace {

using quant::DomainScale;

constexpr int kTokenThreads = 256;
constexpr int kGroupWarps = 8;
constexpr int kScaleThreads = 256;

__device__ __forceinline__ float load_f32(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f32(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float load_f32(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }

__device__ __forceinline__ void store_f32(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f32(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void store_f32(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_abs_max(float a) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) a = quant::max_keep_nan(a, __shfl_xor_sync(0xffffffffu, a, off));
  return a;
}

// One block per token: max|x| over the row, then the codes.
template <typename T>
__global__ void __launch_bounds__(kTokenThreads) quantize_tokens_kernel(const T* __restrict__ x, int64_t k,
                                                                        __half* __restrict__ codes,
                                                                        float* __restrict__ xs) {
  __shared__ float warp_max[kTokenThreads / 32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * k;
  float a = 0.0f;
  for (int64_t i = threadIdx.x; i < k; i += kTokenThreads) a = quant::max_keep_nan(a, fabsf(load_f32(xr, i)));
  a = warp_abs_max(a);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = a;
  __syncthreads();
  a = warp_max[0];
#pragma unroll
  for (int w = 1; w < kTokenThreads / 32; ++w) a = quant::max_keep_nan(a, warp_max[w]);
  const DomainScale d = quant::domain_scale(a, true);
  __half* cr = codes + row * k;
  for (int64_t i = threadIdx.x; i < k; i += kTokenThreads)
    cr[i] = __float2half_rn(quant::mul_rn(quant::quantize(load_f32(xr, i), d.mul, -128.0f), quant::kCodeScale));
  if (threadIdx.x == 0) xs[row] = d.xs;
}

// One warp per (token, group): each lane holds group_size / 32 (1..8) values.
template <typename T>
__global__ void __launch_bounds__(kGroupWarps * 32) quantize_groups_kernel(const T* __restrict__ x, int64_t domains,
                                                                           int group_size,
                                                                           __nv_bfloat16* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  const int64_t domain = (int64_t)blockIdx.x * kGroupWarps + threadIdx.x / 32;
  if (domain >= domains) return;  // whole warps exit together
  const int64_t base = domain * group_size;
  const int per_lane = group_size / 32;
  float v[8];
  float a = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < per_lane) {
      v[j] = load_f32(x, base + j * 32 + lane);
      a = quant::max_keep_nan(a, fabsf(v[j]));
    }
  }
  a = warp_abs_max(a);
  const DomainScale d = quant::domain_scale(a, false);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < per_lane) {
      const float q = quant::quantize(v[j], d.mul, -quant::kInt8Max);
      out[base + j * 32 + lane] = __float2bfloat16_rn(quant::mul_rn(q, d.xs));
    }
  }
}

template <typename Out>
__global__ void __launch_bounds__(kScaleThreads) scale_rows_kernel(const __half* __restrict__ y16,
                                                                   const float* __restrict__ xs,
                                                                   const float* __restrict__ bias,
                                                                   Out* __restrict__ out, int64_t m, int64_t n) {
  const int64_t total = m * n;
  for (int64_t i = (int64_t)blockIdx.x * kScaleThreads + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * kScaleThreads) {
    const int64_t row = i / n, col = i - row * n;
    const float b = bias != nullptr ? bias[col] : -0.0f;
    store_f32(out, i, quant::scale_row_value(__half2float(y16[i]), xs[row], b));
  }
}

template <typename T>
cudaError_t launch_tokens(const void* x, int64_t m, int64_t k, void* codes, float* xs, cudaStream_t s) {
  quantize_tokens_kernel<T><<<(unsigned)m, kTokenThreads, 0, s>>>(static_cast<const T*>(x), k,
                                                                  static_cast<__half*>(codes), xs);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_groups(const void* x, int64_t domains, int group_size, void* out, cudaStream_t s) {
  const int64_t blocks = (domains + kGroupWarps - 1) / kGroupWarps;
  quantize_groups_kernel<T><<<(unsigned)blocks, kGroupWarps * 32, 0, s>>>(static_cast<const T*>(x), domains,
                                                                          group_size,
                                                                          static_cast<__nv_bfloat16*>(out));
  return cudaGetLastError();
}

template <typename Out>
cudaError_t launch_scale(const void* y16, const float* xs, const float* bias, void* out, int64_t m, int64_t n,
                         cudaStream_t s) {
  const int64_t want = (m * n + kScaleThreads - 1) / kScaleThreads;
  const unsigned blocks = (unsigned)(want < 65536 ? want : 65536);  // grid-stride beyond
  scale_rows_kernel<Out><<<blocks, kScaleThreads, 0, s>>>(static_cast<const __half*>(y16), xs, bias,
                                                          static_cast<Out*>(out), m, n);
  return cudaGetLastError();
}

// Rows and columns up to 2^31 - 1 (the token kernel's grid is one block per row).
constexpr int64_t kMaxRows = 0x7fffffff;
constexpr int64_t kMaxElems = (int64_t)1 << 40;

bool valid_dtype(int32_t d) {
  return d == TERNARY_DTYPE_BF16 || d == TERNARY_DTYPE_FP16 || d == TERNARY_DTYPE_FP32;
}

}  // namespace
}  // namespace ternary

extern "C" int ternary_cuda_quantize_tokens(const void* x, int32_t x_dtype, int64_t m, int64_t k, void* codes,
                                            float* xs, void* stream) {
  using namespace ternary;
  if (m <= 0 || k <= 0 || m > kMaxRows || m > kMaxElems / k) return TERNARY_CUDA_ERR_SHAPE;
  if (!valid_dtype(x_dtype)) return TERNARY_CUDA_ERR_DTYPE;
  if (x == nullptr || codes == nullptr || xs == nullptr) return TERNARY_CUDA_ERR_POINTER;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t e = x_dtype == TERNARY_DTYPE_BF16   ? launch_tokens<__nv_bfloat16>(x, m, k, codes, xs, s)
                        : x_dtype == TERNARY_DTYPE_FP16 ? launch_tokens<__half>(x, m, k, codes, xs, s)
                                                        : launch_tokens<float>(x, m, k, codes, xs, s);
  return static_cast<int>(e);
}

extern "C" int ternary_cuda_quantize_groups(const void* x, int32_t x_dtype, int64_t m, int64_t k,
                                            int32_t group_size, void* out, void* stream) {
  using namespace ternary;
  if (group_size != 32 && group_size != 64 && group_size != 128 && group_size != 256) return TERNARY_CUDA_ERR_GROUP;
  if (m <= 0 || k <= 0 || k % group_size != 0 || m > kMaxElems / k) return TERNARY_CUDA_ERR_SHAPE;
  const int64_t domains = m * (k / group_size);
  if ((domains + kGroupWarps - 1) / kGroupWarps > kMaxRows) return TERNARY_CUDA_ERR_SHAPE;
  if (!valid_dtype(x_dtype)) return TERNARY_CUDA_ERR_DTYPE;
  if (x == nullptr || out == nullptr) return TERNARY_CUDA_ERR_POINTER;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t e = x_dtype == TERNARY_DTYPE_BF16   ? launch_groups<__nv_bfloat16>(x, domains, group_size, out, s)
                        : x_dtype == TERNARY_DTYPE_FP16 ? launch_groups<__half>(x, domains, group_size, out, s)
                                                        : launch_groups<float>(x, domains, group_size, out, s);
  return static_cast<int>(e);
}

extern "C" int ternary_cuda_scale_rows(const void* y16, const float* xs, const float* bias, void* out,
                                       int32_t out_dtype, int64_t m, int64_t n, void* stream) {
  using namespace ternary;
  if (m <= 0 || n <= 0 || m > kMaxElems / n) return TERNARY_CUDA_ERR_SHAPE;
  if (!valid_dtype(out_dtype)) return TERNARY_CUDA_ERR_DTYPE;
  if (y16 == nullptr || xs == nullptr || out == nullptr) return TERNARY_CUDA_ERR_POINTER;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t e = out_dtype == TERNARY_DTYPE_BF16   ? launch_scale<__nv_bfloat16>(y16, xs, bias, out, m, n, s)
                        : out_dtype == TERNARY_DTYPE_FP16 ? launch_scale<__half>(y16, xs, bias, out, m, n, s)
                                                          : launch_scale<float>(y16, xs, bias, out, m, n, s);
  return static_cast<int>(e);
}
