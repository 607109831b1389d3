// Blockwise normalized Walsh–Hadamard transform (see fwht.h). One thread block per (Hadamard block, row):
// load with gather + signs fused (fp32 in shared memory), log2(b) butterfly stages separated by
// __syncthreads, store with the 1/sqrt(b) normalization (and, inverse, the signs) fused. Every stage
// computes the same fp32 a+b / a-b pairs as the CPU reference, so fp32 results are bit-identical to it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "fwht.h"

namespace {

constexpr int kMaxThreads = 512;
constexpr int64_t kMaxGridY = 65535;

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T>
__global__ void fwht_kernel(const T* __restrict__ in, T* __restrict__ out, int64_t rows, int64_t width,
                            int block, float norm, const float* __restrict__ signs,
                            const int32_t* __restrict__ gather, int inverse) {
  extern __shared__ float buf[];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * block;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const T* src = in + row * width;
    T* dst = out + row * width;
    for (int i = threadIdx.x; i < block; i += blockDim.x) {
      const int64_t col = base + i;
      const int64_t from = gather != nullptr ? static_cast<int64_t>(gather[col]) : col;
      float v = to_f32(src[from]);
      if (signs != nullptr && !inverse) v *= signs[col];
      buf[i] = v;
    }
    __syncthreads();
    for (int h = 1; h < block; h <<= 1) {
      for (int i = threadIdx.x; i < block / 2; i += blockDim.x) {
        const int j = (i / h) * 2 * h + (i % h);
        const float a = buf[j];
        const float b = buf[j + h];
        buf[j] = a + b;
        buf[j + h] = a - b;
      }
      __syncthreads();
    }
    for (int i = threadIdx.x; i < block; i += blockDim.x) {
      const int64_t col = base + i;
      float v = buf[i] * norm;
      if (signs != nullptr && inverse) v *= signs[col];
      dst[col] = from_f32<T>(v);
    }
    __syncthreads();  // buf is reused by the next row
  }
}

template <typename T>
cudaError_t launch(const void* in, void* out, int64_t rows, int64_t width, int block, const float* signs,
                   const int32_t* gather, int inverse, cudaStream_t stream) {
  const int threads = block / 2 < 1 ? 1 : (block / 2 < kMaxThreads ? block / 2 : kMaxThreads);
  const dim3 grid(static_cast<unsigned>(width / block),
                  static_cast<unsigned>(rows < kMaxGridY ? rows : kMaxGridY));
  const size_t smem = static_cast<size_t>(block) * sizeof(float);
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(fwht_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  const float norm = 1.0f / sqrtf(static_cast<float>(block));
  fwht_kernel<T><<<grid, threads, smem, stream>>>(static_cast<const T*>(in), static_cast<T*>(out), rows,
                                                  width, block, norm, signs, gather, inverse);
  return cudaGetLastError();
}

}  // namespace

extern "C" int ternary_cuda_fwht(const void* in, void* out, int64_t rows, int64_t width, int32_t block_size,
                                 int32_t dtype, const float* signs, const int32_t* gather, int32_t inverse,
                                 void* stream) {
  if (block_size < 1 || block_size > TERNARY_FWHT_MAX_BLOCK || (block_size & (block_size - 1)) != 0)
    return TERNARY_FWHT_ERR_BLOCK;
  if (rows < 0 || width <= 0 || width % block_size != 0 || width / block_size > 0x7fffffffLL)
    return TERNARY_FWHT_ERR_SHAPE;
  if (in == nullptr || out == nullptr || (gather != nullptr && inverse)) return TERNARY_FWHT_ERR_POINTER;
  if (rows == 0) return TERNARY_FWHT_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e;
  switch (dtype) {
    case TERNARY_FWHT_BF16:
      e = launch<__nv_bfloat16>(in, out, rows, width, block_size, signs, gather, inverse, s);
      break;
    case TERNARY_FWHT_FP16:
      e = launch<__half>(in, out, rows, width, block_size, signs, gather, inverse, s);
      break;
    case TERNARY_FWHT_FP32:
      e = launch<float>(in, out, rows, width, block_size, signs, gather, inverse, s);
      break;
    default:
      return TERNARY_FWHT_ERR_DTYPE;
  }
  return e == cudaSuccess ? TERNARY_FWHT_OK : static_cast<int>(e);
}
