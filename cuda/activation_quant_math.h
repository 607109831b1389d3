// The per-element arithmetic of the int8 activation modes, shared by the CUDA kernels
// (activation_quant.cu) and their host replay (tests/test_activation_quant.cpp, built by g++).
//
// It is the CPU kernel's quantization (rust/ternary-core/src/kernels/cpu/quant.rs) operation for
// operation: every product and quotient rounded once (no FMA contraction: __fmul_rn / __fdiv_rn on the
// device), round half to even (rintf under the default rounding mode), the same scales and clamps. So a
// token's codes and scale are the CPU kernel's bit for bit, on any device.
#pragma once
#include <math.h>

#if defined(__CUDACC__)
#define TERNARY_QUANT_FN __host__ __device__ __forceinline__
#else
#define TERNARY_QUANT_FN inline
#endif

namespace ternary {
namespace quant {

// Largest |q| of the per-group mode (symmetric); per token q may also be -128 (BitNet's clamp).
constexpr float kInt8Max = 127.0f;
// BitNet's activation_quant clamps max|x| at this before scale = 127 / max|x|.
constexpr float kTokenScaleFloor = 1e-5f;
// Per-token codes reach the fp16 GEMM as q * 2^-7: exact (|q| <= 128 has <= 8 significant bits), and
// the fp16 output (about y / max|x|) cannot overflow where q itself (up to 127 * sum|W|) could.
constexpr float kCodeScale = 0.0078125f;
// 1 / kCodeScale, exact.
constexpr float kCodeScaleInv = 128.0f;

TERNARY_QUANT_FN float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

TERNARY_QUANT_FN float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

TERNARY_QUANT_FN float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// max of two partial max|x| that keeps a NaN (fmaxf would drop it), in any combination order.
TERNARY_QUANT_FN float max_keep_nan(float a, float b) { return (b != b || b > a) ? b : a; }

// The multiplier and the dequantization scale of one quantization domain with maximum `amax`
// (x ~ xs * q, q = round(x * mul)). A non-finite activation gives xs = NaN: its whole output row (per
// token) or the group's contribution (per group) is NaN, as the exact path would make it.
struct DomainScale {
  float mul;
  float xs;
};

TERNARY_QUANT_FN DomainScale domain_scale(float amax, bool per_token) {
  if (!(fabsf(amax) <= 3.402823466e38f)) return {0.0f, NAN};  // NaN or Inf
  if (per_token) {
    const float scale = div_rn(kInt8Max, amax > kTokenScaleFloor ? amax : kTokenScaleFloor);
    return {scale, div_rn(1.0f, scale)};
  }
  // All zeros, or max|x| < 127 / FLT_MAX (~3.7e-37) where the multiplier overflows: a zero group.
  const float mul = div_rn(kInt8Max, amax);
  if (!(mul <= 3.402823466e38f)) return {0.0f, 0.0f};
  return {mul, div_rn(amax, kInt8Max)};
}

// q = clamp(round_half_even(v * mul), lo, 127) as a float (lo = -128 per token, -127 per group); NaN
// (only from a non-finite x, whose domain scale is NaN anyway) gives 0, as the CPU's `as i8` does.
TERNARY_QUANT_FN float quantize(float v, float mul, float lo) {
  const float r = rintf(mul_rn(v, mul));
  if (r != r) return 0.0f;
  return r < lo ? lo : (r > kInt8Max ? kInt8Max : r);
}

// The epilogue of the per-token mode: y = fl(fl(y16 * xs * 2^7) + bias) (xs * 2^7 is exact). Without a
// bias the caller passes -0.0f, the additive identity that also keeps a -0 product.
TERNARY_QUANT_FN float scale_row_value(float y16, float xs, float bias) {
  return add_rn(mul_rn(y16, mul_rn(xs, kCodeScaleInv)), bias);
}

}  // namespace quant
}  // namespace ternary
