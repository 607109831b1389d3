// C ABI of the fused ternary dequant-GEMM kernels (no torch, no allocation, no host synchronisation:
// every launcher only enqueues kernels on the given stream, so calls can be captured in CUDA graphs).
//
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]),  W[n, k] = trit(n, k) * scale[n, k / group_size]
//
// x, bias and y share one dtype (bf16 or fp16; row-major, contiguous, x 16-byte aligned); qweight and
// scales are in the GPU layout of rust/ternary-core/src/kernels/gpu_layout.rs (see ternary_frag.h).
// Splitting K needs a caller-provided fp32 workspace of `partial_floats` elements and `counters` int32
// tile counters that are zero before the first call; the kernels leave them zero again.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  TERNARY_CUDA_OK = 0,
  TERNARY_CUDA_ERR_SHAPE = -1,      // M, N or K out of range, K not a multiple of the group size
  TERNARY_CUDA_ERR_GROUP = -2,      // group size not in {32, 64, 128, 256}
  TERNARY_CUDA_ERR_DTYPE = -3,      // dtype code unknown
  TERNARY_CUDA_ERR_POINTER = -4,    // a required pointer is null or misaligned
  TERNARY_CUDA_ERR_WORKSPACE = -5,  // split-K needs workspace/counters that were not given
};

// The GEMM kernels take bf16 and fp16; fp32 only the activation functions of activation_quant.h.
enum { TERNARY_DTYPE_BF16 = 0, TERNARY_DTYPE_FP16 = 1, TERNARY_DTYPE_FP32 = 2 };

typedef struct {
  int32_t kernel;          // 0 = decode GEMV (M <= 8), 1..4 = mma GEMM with 16/32/64/128-row tiles
  int32_t splits;          // K-splits
  int32_t grid_n, grid_m;  // blocks along N and M
  int64_t partial_floats;  // fp32 workspace elements needed (0: none)
  int64_t counters;        // int32 counters needed (0: none)
} TernaryCudaPlan;

// How a call of these sizes will run and what workspace it needs. Returns TERNARY_CUDA_OK or an error.
int ternary_cuda_plan(int64_t m, int64_t n, int64_t k, int32_t group_size, int32_t sm_count,
                      TernaryCudaPlan* plan);

// Enqueue y = x @ W^T (+ bias) on `stream` (a cudaStream_t; null = legacy default stream). `bias`,
// `partials` and `counters` may be null when not needed; `partials_len` / `counters_len` are their sizes
// in elements, checked against the plan (TERNARY_CUDA_ERR_WORKSPACE when too small). Returns TERNARY_CUDA_OK, a negative
// TERNARY_CUDA_ERR_* or a positive cudaError_t from the launch.
int ternary_cuda_linear(const void* x, const void* qweight, const void* scales, const void* bias, void* y,
                        float* partials, int64_t partials_len, int32_t* counters, int64_t counters_len, int64_t m,
                        int64_t n, int64_t k, int32_t group_size, int32_t dtype, int32_t sm_count, void* stream);

// Enqueue W[N, K] = trit * scale (rounded once to `dtype`, row-major, contiguous, 4-byte aligned) from the
// GPU layout: the optional dequantize + cuBLAS path for large M (only worth it where measured faster).
int ternary_cuda_dequantize(const void* qweight, const void* scales, void* w_out, int64_t n, int64_t k,
                            int32_t group_size, int32_t dtype, void* stream);

// Set the largest M that uses the decode GEMV (0..16; default 8; above it the mma GEMM runs). Returns the
// previous value, or TERNARY_CUDA_ERR_SHAPE. Process-wide; meant for tuning and benchmarks.
int ternary_cuda_set_gemv_max_m(int32_t m);

// Number of visible CUDA devices; 0 (and the cudaError_t) when there is no driver or device.
int ternary_cuda_device_count(int32_t* count);

// Streaming multiprocessors of `device` (the plan's `sm_count`). Returns TERNARY_CUDA_OK or a cudaError_t.
int ternary_cuda_sm_count(int32_t device, int32_t* count);

// Whether `stream` is being captured into a CUDA graph (*capturing = 1) or not (0). Legal during capture.
int ternary_cuda_stream_capturing(void* stream, int32_t* capturing);

// A static message for a code returned above.
const char* ternary_cuda_error_string(int code);

#ifdef __cplusplus
}
#endif
