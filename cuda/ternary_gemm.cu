// Fused ternary dequant-GEMM for sm_89 / sm_90: y = x @ W^T (+ bias), W ternary with f16 group scales.
//
// Two kernels, both fed by one weight layout (ternary_frag.h / gpu_layout.rs) in which one 16-byte load
// per lane yields all mma.sync.m16n8k16 fragment registers of a 64 (K) x 32 (N) chunk:
//
// * decode GEMV (M <= kGemvMaxM = 8, tunable up to 16 at run time): memory-bound. W is the mma's A operand
//   (16 output features per tile), x^T its B operand (each 8 rows of x fill one n8), so tensor cores do
//   the multiply-adds (fp32 accumulation) and the ALUs only unpack (one lop3 + one hsub2 per two weights,
//   plus a shift shared by several registers; see Unpack in ternary_frag.h). Four warps per block
//   split one strip's K range into contiguous runs (scales flushed once per group) with four 16-byte
//   loads in flight per lane; K is split across blocks until the grid is about one wave.
// * GEMM (larger M): x tiles stream through a 4-stage cp.async pipeline into XOR-swizzled shared memory
//   and are read with ldmatrix; each warp's weight chunk is one 16-byte shared load per lane per K-chunk.
//   For very large M a dequantize-to-bf16 + cuBLAS path (Hopper cuBLAS uses wgmma, which mma.sync cannot
//   match) may win; it is not implemented because it could not be measured here (see benches/bench_gpu.py).
//
// Scales are applied in fp32 once per group: trits x activations accumulate exactly in a per-group fp32
// fragment that is scaled into the output accumulator when the group ends. Split-K blocks write fp32
// partials; the last block of a tile to finish (atomic counter) sums them in split order (deterministic),
// adds the bias, writes y and resets the counter, so no memset is needed between calls or graph replays.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "ternary_frag.h"
#include "ternary_gemm.h"

namespace ternary {
namespace {

template <typename T>
struct DType;
template <>
struct DType<__nv_bfloat16> {
  using U = Unpack<true>;
  __device__ static uint32_t sub2(uint32_t a, uint32_t b) {
    __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
    return *reinterpret_cast<uint32_t*>(&r);
  }
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
};
template <>
struct DType<__half> {
  using U = Unpack<false>;
  __device__ static uint32_t sub2(uint32_t a, uint32_t b) {
    __half2 r = __hsub2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
    return *reinterpret_cast<uint32_t*>(&r);
  }
  __device__ static __half from_float(float v) { return __float2half_rn(v); }
  __device__ static float to_float(__half v) { return __half2float(v); }
};

// Trits of fragment register r (a compile-time constant after unrolling) of a weight word, as one
// bf16x2 / half2 register: shift (shared across registers), lop3, hsub2 — all exact. The lop3 is written
// out so that the magic exponent sits in a register (hoisted out of the loops) and the mask is the one
// immediate: (w & mask) | magic in one instruction instead of two.
template <typename T>
__device__ __forceinline__ uint32_t frag_rt(uint32_t word, int r) {
  using U = typename DType<T>::U;
  const uint32_t shifted = word >> U::shift(r);
  const uint32_t magic = U::magic(r) * 0x00010001u;
  uint32_t bits;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(bits) : "r"(shifted), "r"(0x00030003u << U::bit(r)), "r"(magic));
  return DType<T>::sub2(bits, U::offset_bits(r));
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Weights are read once: keep them out of L1.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 zero-fills (rows past M, columns past K, strips past N).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ float scale_at(const __half* scales, int64_t idx) {
  return __half2float(__ldg(scales + idx));
}

// Common split-K tail. Every thread of the block calls it after writing its partials. Returns true in the
// one block (of `splits` for this tile) that arrives last; that block must then sum the partials and it
// resets the counter for the next call.
__device__ __forceinline__ bool arrive_last(int32_t* counter, int splits) {
  __shared__ int is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(counter, 1);
    is_last = prev == splits - 1;
    if (is_last) *counter = 0;  // nobody else touches it again in this launch
  }
  __syncthreads();
  if (is_last) __threadfence();
  return is_last;
}

template <typename T>
__device__ __forceinline__ float sum_partials(const float* partials, int splits, int64_t m_rows, int64_t n_pad,
                                              int m, int n) {
  float v = 0.f;
  for (int s = 0; s < splits; ++s) v += __ldcg(partials + ((int64_t)s * m_rows + m) * n_pad + n);
  return v;
}

template <typename T>
__device__ __forceinline__ void store_out(T* y, const T* bias, int m, int n, int n_real, float v) {
  if (bias != nullptr) v += DType<T>::to_float(bias[n]);
  y[(int64_t)m * n_real + n] = DType<T>::from_float(v);
}

// y[m, n] and y[m, n + 1] (n even): one 32-bit store when both exist and pairs are 4-byte aligned (pair_ok:
// N even and y 4-byte aligned).
template <typename T>
__device__ __forceinline__ void store_out_pair(T* y, const T* bias, int m, int n, int n_real, bool pair_ok, float v0,
                                               float v1) {
  if (pair_ok && n + 1 < n_real) {
    if (bias != nullptr) {
      v0 += DType<T>::to_float(bias[n]);
      v1 += DType<T>::to_float(bias[n + 1]);
    }
    T pair[2] = {DType<T>::from_float(v0), DType<T>::from_float(v1)};
    *reinterpret_cast<uint32_t*>(y + (int64_t)m * n_real + n) = *reinterpret_cast<const uint32_t*>(pair);
  } else {
    if (n < n_real) store_out<T>(y, bias, m, n, n_real, v0);
    if (n + 1 < n_real) store_out<T>(y, bias, m, n + 1, n_real, v1);
  }
}

struct Args {
  const void* x;
  const uint4* qweight;
  const __half* scales;
  const void* bias;
  void* y;
  float* partials;
  int32_t* counters;
  int m, n, k, n_pad, k_chunks, group_size, splits;
  int group_shift;   // log2(group_size): group of element k is k >> group_shift
  bool pair_stores;  // N even and y 4-byte aligned: y may be written as bf16x2 / half2 pairs
};

// ---- decode GEMV -------------------------------------------------------------------------------------
// grid (strips, splits), kGemvWarps warps. NT8 n8-tiles of x^T (M <= 8 NT8). Accumulator acc[p][t8][i]:
// W rows (n) 16p + c_row, x rows (m) 8 t8 + c_col.
template <typename T, int NT8>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(const Args a) {
  constexpr int kThreads = kGemvWarps * 32;
  constexpr int kRows = 8 * NT8;
  const int strip = blockIdx.x, split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kb_begin = split_begin(split, a.splits, a.k_chunks);
  const int kb_end = split_begin(split + 1, a.splits, a.k_chunks);
  const T* x = static_cast<const T*>(a.x);
  bool x_row_ok[NT8];
  // The x pairs this lane feeds into the B fragments: row 8 t8 + lane / 4, elements 2 (lane % 4) + 8 j + 16 w
  // of each chunk, i.e. u32 offsets 4 j + 8 w from x_lane (immediate offsets off one pointer per chunk).
  const uint32_t* x_lane[NT8];
#pragma unroll
  for (int t8 = 0; t8 < NT8; ++t8) {
    const int xm = 8 * t8 + lane / 4;
    x_row_ok[t8] = xm < a.m;
    x_lane[t8] = reinterpret_cast<const uint32_t*>(x + (int64_t)(x_row_ok[t8] ? xm : 0) * a.k) + lane % 4;
  }
  const uint4* w_strip = a.qweight + (int64_t)strip * a.k_chunks * 32 + lane;
  // Scales of the rows this lane's A fragments cover: n = 32 strip + 8 nt + lane / 4 (gemv_scale_n).
  const __half* s_lane = a.scales + (int64_t)strip * kChunkN + gemv_scale_n(lane, 0);

  float acc[2][NT8][4] = {};
  float part[2][NT8][4] = {};
  // Each warp streams a contiguous run of the split's chunks, so groups longer than a chunk are flushed
  // once per group (not once per chunk).
  const int kb_warp_begin = kb_begin + split_begin(warp, kGemvWarps, kb_end - kb_begin);
  const int kb_warp_end = kb_begin + split_begin(warp + 1, kGemvWarps, kb_end - kb_begin);
  const int kstep_end = kb_warp_end * kKSteps;
  for (int kb0 = kb_warp_begin; kb0 < kb_warp_end; kb0 += kGemvUnroll) {
    uint4 wq[kGemvUnroll];
    uint32_t xb[kGemvUnroll][NT8][kKSteps][2];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int kb = kb0 + u;
      wq[u] = kb < kb_warp_end ? load_stream(w_strip + (int64_t)kb * 32) : make_uint4(0, 0, 0, 0);
      // K is a multiple of 32, so a k-step is entirely inside or outside [0, K); only the last chunk of
      // a K that is not a multiple of 64 has an empty half.
      const int steps = kb < kb_warp_end ? (a.k - kb * kChunkK) / 16 : 0;
#pragma unroll
      for (int t8 = 0; t8 < NT8; ++t8) {
        const uint32_t* xc = x_lane[t8] + (int64_t)kb * (kChunkK / 2);
#pragma unroll
        for (int w = 0; w < kKSteps; ++w)
#pragma unroll
          for (int j = 0; j < 2; ++j)  // == x[xm][kb * 64 + gemv_b_k(lane, w, j)] and the element after it
            xb[u][t8][w][j] = x_row_ok[t8] && w < steps ? __ldg(xc + 8 * w + 4 * j) : 0u;
      }
    }
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int kb = kb0 + u;
      if (kb >= kb_warp_end) break;
      const uint32_t words[kKSteps] = {wq[u].x, wq[u].y, wq[u].z, wq[u].w};
#pragma unroll
      for (int w = 0; w < kKSteps; ++w) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
          const uint32_t a0 = frag_rt<T>(words[w], gemv_a_reg(p, 0)), a1 = frag_rt<T>(words[w], gemv_a_reg(p, 1));
          const uint32_t a2 = frag_rt<T>(words[w], gemv_a_reg(p, 2)), a3 = frag_rt<T>(words[w], gemv_a_reg(p, 3));
#pragma unroll
          for (int t8 = 0; t8 < NT8; ++t8) mma16816<T>(part[p][t8], a0, a1, a2, a3, xb[u][t8][w][0], xb[u][t8][w][1]);
        }
        const int kstep = kb * kKSteps + w;
        if (group_ends_after(kstep, a.group_size) || kstep + 1 == kstep_end) {
          const int grp = (kb * kChunkK + 16 * w) >> a.group_shift;
          const __half* srow = s_lane + (int64_t)grp * a.n_pad;  // + 8 nt: immediate offsets
#pragma unroll
          for (int p = 0; p < 2; ++p) {
            const float s_lo = scale_at(srow, gemv_scale_n(0, 2 * p));
            const float s_hi = scale_at(srow, gemv_scale_n(0, 2 * p + 1));
#pragma unroll
            for (int t8 = 0; t8 < NT8; ++t8)
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                acc[p][t8][i] += part[p][t8][i] * (i < 2 ? s_lo : s_hi);
                part[p][t8][i] = 0.f;
              }
          }
        }
      }
    }
  }

  // Sum the warps' accumulators for this strip: red[warp][m][n].
  __shared__ float red[kGemvWarps][kRows][kChunkN];
#pragma unroll
  for (int p = 0; p < 2; ++p)
#pragma unroll
    for (int t8 = 0; t8 < NT8; ++t8)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][gemv_c_m(lane, t8, i)][gemv_c_n(lane, p, i)] = acc[p][t8][i];
  __syncthreads();

  T* y = static_cast<T*>(a.y);
  const T* bias = static_cast<const T*>(a.bias);
  const int rows = a.m < kRows ? a.m : kRows;
  for (int idx = threadIdx.x; idx < rows * kChunkN; idx += kThreads) {
    const int m = idx / kChunkN, nl = idx % kChunkN, n = strip * kChunkN + nl;
    float v = 0.f;
#pragma unroll
    for (int wi = 0; wi < kGemvWarps; ++wi) v += red[wi][m][nl];
    if (a.splits == 1) {
      if (n < a.n) store_out<T>(y, bias, m, n, a.n, v);
    } else {
      __stcg(a.partials + ((int64_t)split * a.m + m) * a.n_pad + n, v);
    }
  }
  if (a.splits == 1) return;
  if (!arrive_last(a.counters + strip, a.splits)) return;
  for (int idx = threadIdx.x; idx < rows * kChunkN; idx += kThreads) {
    const int m = idx / kChunkN, n = strip * kChunkN + idx % kChunkN;
    if (n < a.n) store_out<T>(y, bias, m, n, a.n, sum_partials<T>(a.partials, a.splits, a.m, a.n_pad, m, n));
  }
}

// ---- tensor-core GEMM --------------------------------------------------------------------------------
// grid (N / (32 WARPS_N), M / (16 MT WARPS_M), splits). Warp (wm, wn) owns rows 16 MT wm.. of the block
// tile and strip wn; accumulator acc[mt][nt][i]: row 16 mt + c_row, n 8 nt + c_col.
constexpr int kStages = 4;

template <int WARPS_M, int WARPS_N, int MT>
struct GemmShape {
  static constexpr int kThreads = 32 * WARPS_M * WARPS_N;
  static constexpr int kBlockM = 16 * MT * WARPS_M;
  static constexpr int kBlockN = kChunkN * WARPS_N;
  static constexpr int kAChunks = kBlockM * 8;  // 16-byte chunks of one stage's x tile
  static constexpr int kBChunks = WARPS_N * 32;  // 16-byte chunks of one stage's weights
  static constexpr int kStageChunks = kAChunks + kBChunks;
  static constexpr int kSmemBytes = kStages * kStageChunks * 16;
};

template <typename T, int WARPS_M, int WARPS_N, int MT>
__global__ void __launch_bounds__(32 * WARPS_M * WARPS_N) gemm_kernel(const Args a) {
  using S = GemmShape<WARPS_M, WARPS_N, MT>;
  extern __shared__ uint4 smem[];
  const int n_block = blockIdx.x, m_block = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  const int strips = a.n_pad / kChunkN;
  const int strip = n_block * WARPS_N + wn;
  const int kb_begin = split_begin(split, a.splits, a.k_chunks);
  const int kb_end = split_begin(split + 1, a.splits, a.k_chunks);
  const T* x = static_cast<const T*>(a.x);
  const int m0 = m_block * S::kBlockM;

  auto load_stage = [&](int stage, int kb) {
    uint4* st = smem + stage * S::kStageChunks;
#pragma unroll
    for (int i = threadIdx.x; i < S::kAChunks; i += S::kThreads) {
      const int r = i / 8, c = i % 8, m = m0 + r, k = kb * kChunkK + 8 * c;
      const bool ok = m < a.m && k < a.k;
      cp_async16(st + a_smem_chunk(r, c), ok ? static_cast<const void*>(x + (int64_t)m * a.k + k) : a.x,
                 ok ? 16 : 0);
    }
#pragma unroll
    for (int i = threadIdx.x; i < S::kBChunks; i += S::kThreads) {
      const int s = n_block * WARPS_N + i / 32;
      const bool ok = s < strips;
      const uint4* src = ok ? a.qweight + ((int64_t)s * a.k_chunks + kb) * 32 + i % 32 : a.qweight;
      cp_async16(st + S::kAChunks + i, src, ok ? 16 : 0);
    }
  };

  float acc[MT][4][4] = {};
  float part[MT][4][4] = {};
  const int kstep_end = kb_end * kKSteps;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (kb_begin + s < kb_end) load_stage(s, kb_begin + s);
    cp_async_commit();
  }
  for (int kb = kb_begin; kb < kb_end; ++kb) {
    const int it = kb - kb_begin;
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage `it` landed for every thread; stage `it - 1` is no longer read by anyone
    if (kb + kStages - 1 < kb_end) load_stage((it + kStages - 1) % kStages, kb + kStages - 1);
    cp_async_commit();

    const uint4* st = smem + (it % kStages) * S::kStageChunks;
    const uint4 bw = st[S::kAChunks + wn * 32 + lane];
    const uint32_t words[kKSteps] = {bw.x, bw.y, bw.z, bw.w};
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r = wm * 16 * MT + mt * 16 + ldmatrix_a_row(lane);
        ldmatrix_x4(af[mt], st + a_smem_chunk(r, ldmatrix_a_chunk(lane, ks)));
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const uint32_t b0 = frag_rt<T>(words[ks], gemm_b_reg(nt, 0));
        const uint32_t b1 = frag_rt<T>(words[ks], gemm_b_reg(nt, 1));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          mma16816<T>(part[mt][nt], af[mt][0], af[mt][1], af[mt][2], af[mt][3], b0, b1);
      }
      const int kstep = kb * kKSteps + ks;
      if (group_ends_after(kstep, a.group_size) || kstep + 1 == kstep_end) {
        const int grp = (kstep * 16) >> a.group_shift;
        const __half* srow = a.scales + (int64_t)grp * a.n_pad + (int64_t)(strip < strips ? strip : 0) * kChunkN;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const __half2 s2 = __ldg(reinterpret_cast<const __half2*>(srow + gemm_c_n(lane, nt, 0)));
          const float2 s = __half22float2(s2);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              acc[mt][nt][i] += part[mt][nt][i] * ((i & 1) ? s.y : s.x);
              part[mt][nt][i] = 0.f;
            }
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  T* y = static_cast<T*>(a.y);
  const T* bias = static_cast<const T*>(a.bias);
  if (strip < strips) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int i = 0; i < 4; i += 2) {  // elements i, i + 1: one row, columns n, n + 1
          const int m = m0 + wm * 16 * MT + mt * 16 + c_row(lane, i);
          const int n = strip * kChunkN + gemm_c_n(lane, nt, i);
          if (m >= a.m) continue;
          if (a.splits == 1) {
            store_out_pair<T>(y, bias, m, n, a.n, a.pair_stores, acc[mt][nt][i], acc[mt][nt][i + 1]);
          } else {
            __stcg(reinterpret_cast<float2*>(a.partials + ((int64_t)split * a.m + m) * a.n_pad + n),
                   make_float2(acc[mt][nt][i], acc[mt][nt][i + 1]));
          }
        }
  }
  if (a.splits == 1) return;
  if (!arrive_last(a.counters + (int64_t)m_block * gridDim.x + n_block, a.splits)) return;
  for (int idx = threadIdx.x; idx < S::kBlockM * S::kBlockN; idx += S::kThreads) {
    const int m = m0 + idx / S::kBlockN, n = n_block * S::kBlockN + idx % S::kBlockN;
    if (m < a.m && n < a.n)
      store_out<T>(y, bias, m, n, a.n, sum_partials<T>(a.partials, a.splits, a.m, a.n_pad, m, n));
  }
}

// ---- dequantize (for the optional dequantize + cuBLAS path at large M) -------------------------------
// W[n, k] = trit * scale, rounded once to T, written row-major [N, K]. One warp per chunk; each lane writes
// its 32 pairs (k, k + 1) as 32-bit stores (4 lanes cover 16 contiguous bytes of a row per instruction).
template <typename T>
__global__ void __launch_bounds__(kDequantWarps * 32) dequant_kernel(const uint4* __restrict__ qweight,
                                                                     const __half* __restrict__ scales,
                                                                     T* __restrict__ w_out, int n, int k, int n_pad,
                                                                     int k_chunks, int group_size,
                                                                     int64_t total_chunks) {
  const int lane = threadIdx.x % 32;
  const int64_t chunk = (int64_t)blockIdx.x * kDequantWarps + threadIdx.x / 32;
  if (chunk >= total_chunks) return;
  const int strip = (int)(chunk / k_chunks), kb = (int)(chunk % k_chunks);
  const uint4 q = load_stream(qweight + chunk * 32 + lane);
  const uint32_t words[kKSteps] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int w = 0; w < kKSteps; ++w) {
    const int k0 = kb * kChunkK + 16 * w;
    if (k0 >= k) break;  // K is a multiple of 32: whole k-steps are in or out
    const int64_t grp = k0 / group_size;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int nn = strip * kChunkN + reg_n(lane, r);
      if (nn >= n) continue;
      const int kk = kb * kChunkK + reg_k(lane, w, r);
      const float s = __half2float(__ldg(scales + grp * n_pad + nn));
      uint32_t t = frag_rt<T>(words[w], r);
      const T* tv = reinterpret_cast<const T*>(&t);
      T pair[2] = {DType<T>::from_float(DType<T>::to_float(tv[0]) * s), DType<T>::from_float(DType<T>::to_float(tv[1]) * s)};
      *reinterpret_cast<uint32_t*>(w_out + (int64_t)nn * k + kk) = *reinterpret_cast<const uint32_t*>(pair);
    }
  }
}

template <typename T, int WARPS_M, int WARPS_N, int MT>
cudaError_t launch_gemm(const Args& a, const Plan& p, cudaStream_t stream) {
  using S = GemmShape<WARPS_M, WARPS_N, MT>;
  auto kernel = gemm_kernel<T, WARPS_M, WARPS_N, MT>;
  // Not a stream operation, so it is allowed during graph capture (needed above 48 KiB).
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes);
  if (e != cudaSuccess) return e;
  kernel<<<dim3(p.grid_n, p.grid_m, p.splits), S::kThreads, S::kSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(const Args& a, const Plan& p, cudaStream_t stream) {
  switch (p.kernel) {
    case kKernelGemv:
      if (p.block_m <= 8)
        gemv_kernel<T, 1><<<dim3(p.grid_n, p.splits), kGemvWarps * 32, 0, stream>>>(a);
      else
        gemv_kernel<T, 2><<<dim3(p.grid_n, p.splits), kGemvWarps * 32, 0, stream>>>(a);
      return cudaGetLastError();
    case kKernelGemm16:
      return launch_gemm<T, 1, 4, 1>(a, p, stream);
    case kKernelGemm32:
      return launch_gemm<T, 1, 4, 2>(a, p, stream);
    case kKernelGemm64:
      return launch_gemm<T, 2, 4, 2>(a, p, stream);
    default:
      return launch_gemm<T, 2, 4, 4>(a, p, stream);
  }
}

template <typename T>
cudaError_t launch_dequant(const void* qweight, const void* scales, void* w_out, int n, int k, int n_pad, int k_chunks,
                           int group_size, int64_t total, cudaStream_t stream) {
  const int64_t blocks = (total + kDequantWarps - 1) / kDequantWarps;
  dequant_kernel<T><<<(unsigned)blocks, kDequantWarps * 32, 0, stream>>>(
      static_cast<const uint4*>(qweight), static_cast<const __half*>(scales), static_cast<T*>(w_out), n, k, n_pad,
      k_chunks, group_size, total);
  return cudaGetLastError();
}

std::atomic<int> g_gemv_max_m{kGemvMaxM};

bool aligned(const void* p, uintptr_t to) { return (reinterpret_cast<uintptr_t>(p) & (to - 1)) == 0; }

int check_sizes(int64_t m, int64_t n, int64_t k, int32_t group_size) {
  if (group_size != 32 && group_size != 64 && group_size != 128 && group_size != 256)
    return TERNARY_CUDA_ERR_GROUP;
  if (m <= 0 || n <= 0 || k <= 0 || m > kMaxDim || n > kMaxDim || k > kMaxDim || k % group_size != 0)
    return TERNARY_CUDA_ERR_SHAPE;
  return TERNARY_CUDA_OK;
}

}  // namespace
}  // namespace ternary

extern "C" int ternary_cuda_plan(int64_t m, int64_t n, int64_t k, int32_t group_size, int32_t sm_count,
                                 TernaryCudaPlan* out) {
  using namespace ternary;
  const int rc = check_sizes(m, n, k, group_size);
  if (rc != TERNARY_CUDA_OK) return rc;
  if (out == nullptr) return TERNARY_CUDA_ERR_POINTER;
  Plan p;
  if (!make_plan(m, n, k, sm_count, g_gemv_max_m.load(std::memory_order_relaxed), &p)) return TERNARY_CUDA_ERR_SHAPE;
  out->kernel = p.kernel;
  out->splits = p.splits;
  out->grid_n = p.grid_n;
  out->grid_m = p.grid_m;
  out->partial_floats = p.partial_floats;
  out->counters = p.counters;
  return TERNARY_CUDA_OK;
}

extern "C" int ternary_cuda_linear(const void* x, const void* qweight, const void* scales, const void* bias,
                                   void* y, float* partials, int64_t partials_len, int32_t* counters,
                                   int64_t counters_len, int64_t m, int64_t n, int64_t k,
                                   int32_t group_size, int32_t dtype, int32_t sm_count, void* stream) {
  using namespace ternary;
  int rc = check_sizes(m, n, k, group_size);
  if (rc != TERNARY_CUDA_OK) return rc;
  if (dtype != TERNARY_DTYPE_BF16 && dtype != TERNARY_DTYPE_FP16) return TERNARY_CUDA_ERR_DTYPE;
  if (x == nullptr || qweight == nullptr || scales == nullptr || y == nullptr || !aligned(x, 16) ||
      !aligned(qweight, 16) || !aligned(scales, 4) || !aligned(y, 2) || (bias != nullptr && !aligned(bias, 2)))
    return TERNARY_CUDA_ERR_POINTER;
  Plan p;
  if (!make_plan(m, n, k, sm_count, g_gemv_max_m.load(std::memory_order_relaxed), &p)) return TERNARY_CUDA_ERR_SHAPE;
  if (p.splits > 1 && (partials == nullptr || counters == nullptr || partials_len < p.partial_floats ||
                       counters_len < p.counters || !aligned(partials, 8) || !aligned(counters, 4)))
    return TERNARY_CUDA_ERR_WORKSPACE;
  Args a;
  a.x = x;
  a.qweight = static_cast<const uint4*>(qweight);
  a.scales = static_cast<const __half*>(scales);
  a.bias = bias;
  a.y = y;
  a.partials = partials;
  a.counters = counters;
  a.m = (int)m;
  a.n = (int)n;
  a.k = (int)k;
  a.n_pad = (int)((n + kChunkN - 1) / kChunkN * kChunkN);
  a.k_chunks = (int)((k + kChunkK - 1) / kChunkK);
  a.group_size = group_size;
  a.group_shift = group_size == 32 ? 5 : group_size == 64 ? 6 : group_size == 128 ? 7 : 8;
  a.splits = p.splits;
  a.pair_stores = n % 2 == 0 && aligned(y, 4);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t e = dtype == TERNARY_DTYPE_BF16 ? launch<__nv_bfloat16>(a, p, s) : launch<__half>(a, p, s);
  return static_cast<int>(e);
}

extern "C" int ternary_cuda_dequantize(const void* qweight, const void* scales, void* w_out, int64_t n, int64_t k,
                                       int32_t group_size, int32_t dtype, void* stream) {
  using namespace ternary;
  const int rc = check_sizes(1, n, k, group_size);
  if (rc != TERNARY_CUDA_OK) return rc;
  if (dtype != TERNARY_DTYPE_BF16 && dtype != TERNARY_DTYPE_FP16) return TERNARY_CUDA_ERR_DTYPE;
  if (qweight == nullptr || scales == nullptr || w_out == nullptr || !aligned(qweight, 16) || !aligned(scales, 2) ||
      !aligned(w_out, 4))
    return TERNARY_CUDA_ERR_POINTER;
  const int n_pad = (int)((n + kChunkN - 1) / kChunkN * kChunkN);
  const int k_chunks = (int)((k + kChunkK - 1) / kChunkK);
  const int64_t total = (int64_t)(n_pad / kChunkN) * k_chunks;
  const int64_t blocks = (total + kDequantWarps - 1) / kDequantWarps;
  if (blocks > 0x7fffffff) return TERNARY_CUDA_ERR_SHAPE;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const cudaError_t e =
      dtype == TERNARY_DTYPE_BF16
          ? launch_dequant<__nv_bfloat16>(qweight, scales, w_out, (int)n, (int)k, n_pad, k_chunks, group_size, total, s)
          : launch_dequant<__half>(qweight, scales, w_out, (int)n, (int)k, n_pad, k_chunks, group_size, total, s);
  return static_cast<int>(e);
}

extern "C" int ternary_cuda_set_gemv_max_m(int32_t m) {
  using namespace ternary;
  if (m < 0 || m > kGemvMaxRows) return TERNARY_CUDA_ERR_SHAPE;
  return ternary::g_gemv_max_m.exchange(m);
}

extern "C" int ternary_cuda_device_count(int32_t* count) {
  int c = 0;
  const cudaError_t e = cudaGetDeviceCount(&c);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" state
    c = 0;
  }
  if (count != nullptr) *count = c;
  return static_cast<int>(e);
}

extern "C" int ternary_cuda_sm_count(int32_t device, int32_t* count) {
  if (count == nullptr) return TERNARY_CUDA_ERR_POINTER;
  int c = 0;
  const cudaError_t e = cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return static_cast<int>(e);
  }
  *count = c;
  return TERNARY_CUDA_OK;
}

extern "C" int ternary_cuda_stream_capturing(void* stream, int32_t* capturing) {
  if (capturing == nullptr) return TERNARY_CUDA_ERR_POINTER;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st);
  if (e != cudaSuccess) return static_cast<int>(e);
  *capturing = st == cudaStreamCaptureStatusNone ? 0 : 1;
  return TERNARY_CUDA_OK;
}

extern "C" const char* ternary_cuda_error_string(int code) {
  switch (code) {
    case TERNARY_CUDA_OK:
      return "ok";
    case TERNARY_CUDA_ERR_SHAPE:
      return "M, N or K out of range (each must be 1..2^28) or K not a multiple of the group size";
    case TERNARY_CUDA_ERR_GROUP:
      return "group size must be one of 32, 64, 128, 256";
    case TERNARY_CUDA_ERR_DTYPE:
      return "dtype must be bf16 or fp16 (fp32 too for the activation quantizers and the row-scale epilogue)";
    case TERNARY_CUDA_ERR_POINTER:
      return "a required pointer is null or misaligned (x and qweight need 16 bytes, scales 4, y and bias 2)";
    case TERNARY_CUDA_ERR_WORKSPACE:
      return "split-K needs an fp32 partials workspace and zeroed int32 counters of at least the planned sizes";
    default:
      return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown ternary_cuda error";
  }
}
