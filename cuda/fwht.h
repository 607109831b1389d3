// C ABI of the blockwise normalized Walsh–Hadamard transform (Bonsai 2's activation rotation; see
// rust/ternary-core/src/hadamard.rs for the math and the CPU reference). No torch, no allocation, no
// host synchronisation: the launcher only enqueues one kernel on the given stream (CUDA-graph safe).
//
//   forward (inverse = 0): out[r, :] = H_b/sqrt(b) · (in[r, gather[:]] * signs[:])   per block of b values
//   inverse (inverse = 1): out[r, :] = (H_b/sqrt(b) · in[r, :]) * signs[:]
//
// in/out: rows × width, row-major, contiguous, dtype bf16 / fp16 / fp32; `signs` (fp32, width) and
// `gather` (int32, width, a permutation) are device pointers or null. in and out must not alias.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  TERNARY_FWHT_OK = 0,
  TERNARY_FWHT_ERR_SHAPE = -11,    // rows/width out of range or width not a multiple of the block
  TERNARY_FWHT_ERR_BLOCK = -12,    // block size not a power of two in [1, TERNARY_FWHT_MAX_BLOCK]
  TERNARY_FWHT_ERR_DTYPE = -13,    // dtype code unknown
  TERNARY_FWHT_ERR_POINTER = -14,  // in/out null, or gather given for the inverse transform
};

enum { TERNARY_FWHT_BF16 = 0, TERNARY_FWHT_FP16 = 1, TERNARY_FWHT_FP32 = 2 };

// One thread block holds one Hadamard block in shared memory (fp32), so this bounds the block size.
#define TERNARY_FWHT_MAX_BLOCK 8192

// Enqueue the transform on `stream` (a cudaStream_t; null = legacy default stream). Returns
// TERNARY_FWHT_OK, a negative TERNARY_FWHT_ERR_* or a positive cudaError_t from the launch.
int ternary_cuda_fwht(const void* in, void* out, int64_t rows, int64_t width, int32_t block_size,
                      int32_t dtype, const float* signs, const int32_t* gather, int32_t inverse,
                      void* stream);

#ifdef __cplusplus
}
#endif
