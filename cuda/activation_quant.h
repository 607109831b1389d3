// C ABI of the int8 activation modes on CUDA (the op's `activations` = 3 per token, 2 per group): the
// activation quantizers and the per-token epilogue around the fp16/bf16 GEMM of ternary_gemm.h. Like the
// GEMM launchers they allocate nothing and only enqueue work on `stream` (graph-capturable).
//
//   per token (BitNet b1.58): codes[m, k] = fp16(q * 2^-7), xs[m] = 1 / scale, scale = 127 / max(max|x|, 1e-5)
//       -> y16 = codes @ W^T (fp16 GEMM) -> out = fl(y16 * xs * 2^7) + bias
//   per group: out[m, k] = bf16(q * xs_g), xs_g = max|x_g| / 127 -> bf16 GEMM
//
// q = clamp(round_half_even(x * scale), -128 (token) / -127 (group), 127): the CPU kernel's codes and
// scales bit for bit (activation_quant_math.h). x, out: row-major contiguous, any alignment.
#pragma once
#include <stdint.h>

#include "ternary_gemm.h"

#ifdef __cplusplus
extern "C" {
#endif

// x: [m, k] of x_dtype (TERNARY_DTYPE_BF16 / FP16 / FP32); codes: fp16 [m, k]; xs: fp32 [m].
int ternary_cuda_quantize_tokens(const void* x, int32_t x_dtype, int64_t m, int64_t k, void* codes, float* xs,
                                 void* stream);

// x: [m, k] of x_dtype; out: bf16 [m, k]; k a multiple of group_size (32, 64, 128 or 256).
int ternary_cuda_quantize_groups(const void* x, int32_t x_dtype, int64_t m, int64_t k, int32_t group_size, void* out,
                                 void* stream);

// out[m, n] (out_dtype BF16 / FP16 / FP32) = fl(y16 * xs[row] * 2^7) + bias[col]; y16: fp16 [m, n]; xs: fp32
// [m]; bias: fp32 [n] or null.
int ternary_cuda_scale_rows(const void* y16, const float* xs, const float* bias, void* out, int32_t out_dtype,
                            int64_t m, int64_t n, void* stream);

#ifdef __cplusplus
}
#endif
