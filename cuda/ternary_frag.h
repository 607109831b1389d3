// Per-thread index and unpack logic of the fused ternary kernels, shared by the device code
// (ternary_gemm.cu) and the host tests (tests/test_fragments.cpp, built by g++ with no CUDA).
//
// Weight layout (produced by rust/ternary-core/src/kernels/gpu_layout.rs; its module docs are the spec):
// W[N, K] is cut into chunks of 64 (K) x 32 (N), stored strip-major (all K-chunks of N rows 32*nb.. are
// contiguous). A chunk is 512 bytes: lane l of a warp loads bytes 16l..16l+15 as four u32 words, word w
// for k-step w (16 k). Code q (0..15) of a word is at bits 2q; with r = q % 8, h = q / 8, nt = r / 2,
// j = r % 2 it is W[32nb + 8nt + l/4][64kb + 16w + 8j + 2(l%4) + h]. So bits 2r and 16+2r are the two
// halves of one bf16x2/half2 mma fragment register:
//   * GEMM (x is the A operand, W^T the B operand): B fragment of n-tile nt = registers {2nt, 2nt+1};
//   * GEMV (W is the A operand, x^T the B operand, M <= 8 fits the mma's n8): A fragment of W rows
//     16p..16p+15 = registers {4p, 4p+2, 4p+1, 4p+3}.
// Scales are f16 [groups_pad, n_pad] (group-major).
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define TERNARY_HD __host__ __device__ __forceinline__
#else
#define TERNARY_HD inline
#endif

namespace ternary {

constexpr int kChunkN = 32;          // output features per chunk (4 n8-tiles)
constexpr int kChunkK = 64;          // input features per chunk (4 k16-steps)
constexpr int kChunkWords = 128;     // u32 words per chunk: 32 lanes x 4
constexpr int kKSteps = kChunkK / 16;

// 2-bit code pairs -> fp16/bf16 trits without conversion instructions. The two codes of register r sit at
// bits s, s+1 of each 16-bit half of (word >> shift(r)). OR-ing them into the mantissa of 2^E with E chosen
// so that mantissa bit s weighs 1 gives 2^E + c exactly; subtracting 2^E + 1 (offset_bits, also exact)
// leaves the trit c - 1. Per register that is one lop3 ((w & mask) | magic) and one hsub2; the shifts are
// shared by several registers (fp16's 10-bit mantissa holds s <= 8, so r = 0..4 need no shift; bf16's
// 7 bits hold s <= 4: shifts 0, 6, 12).
template <bool kBf16>
struct Unpack {
  static constexpr int kMantissaBits = kBf16 ? 7 : 10;
  static constexpr int kExponentBias = kBf16 ? 127 : 15;
  static TERNARY_HD int shift(int r) { return kBf16 ? (r < 3 ? 0 : (r < 6 ? 6 : 12)) : (r < 5 ? 0 : 10); }
  static TERNARY_HD int bit(int r) { return 2 * r - shift(r); }
  // 2^E for E = kMantissaBits - bit(r), in both halves.
  static TERNARY_HD uint32_t magic(int r) {
    return (uint32_t)(kMantissaBits - bit(r) + kExponentBias) << kMantissaBits;
  }
  // Register r of a weight word: both halves hold 2^E + c.
  static TERNARY_HD uint32_t bits(uint32_t word, int r) {
    return ((word >> shift(r)) & (0x00030003u << bit(r))) | (magic(r) * 0x00010001u);
  }
  // 2^E + 1 in both halves (what to subtract to get the trits).
  static TERNARY_HD uint32_t offset_bits(int r) { return (magic(r) | (1u << bit(r))) * 0x00010001u; }
};

// GEMV: register index (into a word) of A-fragment register i (a0a1, a2a3, a4a5, a6a7) of rows 16p..16p+15.
TERNARY_HD int gemv_a_reg(int p, int i) {
  // a0a1 = (row g, k 2c..), a2a3 = (row g+8, k 2c..), a4a5 = (row g, k 2c+8..), a6a7 = (row g+8, k 2c+8..)
  // rows g / g+8 of tile p are n-tiles 2p / 2p+1; k 2c / 2c+8 are j = 0 / 1.
  return 2 * (2 * p + (i & 1)) + (i >> 1);
}

// GEMM: register index of B-fragment register j (b0b1, b2b3) of n-tile nt.
TERNARY_HD int gemm_b_reg(int nt, int j) { return 2 * nt + j; }

// Accumulator element i (c0..c3) of an m16n8 tile: row and column inside the tile (PTX ISA fragment order).
TERNARY_HD int c_row(int lane, int i) { return lane / 4 + (i >= 2 ? 8 : 0); }
TERNARY_HD int c_col(int lane, int i) { return 2 * (lane % 4) + (i & 1); }

// GEMV: in-strip output feature (n) of accumulator element i of W-row tile p (rows are n here).
TERNARY_HD int gemv_c_n(int lane, int p, int i) { return 16 * p + c_row(lane, i); }
// GEMV: x row (m) of accumulator element i of x^T tile t8 (columns are m here).
TERNARY_HD int gemv_c_m(int lane, int t8, int i) { return 8 * t8 + c_col(lane, i); }
// GEMV: x element offsets (k inside the chunk) of the B fragment (x^T) register j of k-step w.
TERNARY_HD int gemv_b_k(int lane, int w, int j) { return 16 * w + 8 * j + 2 * (lane % 4); }
// GEMV: in-strip n of the scale a lane applies to n-tile nt (= the A rows it owns).
TERNARY_HD int gemv_scale_n(int lane, int nt) { return 8 * nt + lane / 4; }

// GEMM: in-strip n of accumulator element i of n-tile nt; the scale pair a lane needs starts at i = 0.
TERNARY_HD int gemm_c_n(int lane, int nt, int i) { return 8 * nt + c_col(lane, i); }

// Dequantize kernel: in-chunk (n, k) of the first element of fragment register r of word w of a lane (the
// second is k + 1). Straight from the layout definition: r = 2 nt + j.
TERNARY_HD int reg_n(int lane, int r) { return 8 * (r / 2) + lane / 4; }
TERNARY_HD int reg_k(int lane, int w, int r) { return 16 * w + 8 * (r % 2) + 2 * (lane % 4); }

// Shared-memory A tile: rows of 64 bf16/fp16 = 8 chunks of 16 bytes. The chunk index is XOR-swizzled with
// the row so the 8 rows one ldmatrix 8x8 reads hit 8 different 16-byte bank groups.
TERNARY_HD int a_smem_chunk(int row, int chunk) { return row * 8 + (chunk ^ (row & 7)); }
// ldmatrix.x4 for the m16k16 A fragment of k-step ks: the row and 16-byte chunk lane l points at.
TERNARY_HD int ldmatrix_a_row(int lane) { return lane % 16; }
TERNARY_HD int ldmatrix_a_chunk(int lane, int ks) { return 2 * ks + lane / 16; }

// Balanced split of k_chunks K-chunks into `splits` contiguous ranges.
TERNARY_HD int split_begin(int split, int splits, int k_chunks) {
  return (int)(((int64_t)split * k_chunks) / splits);
}

// Does the group end after k-step `kstep` (global, 16 k each), given group_size in {32..256}?
TERNARY_HD bool group_ends_after(int kstep, int group_size) {
  return ((kstep + 1) & (group_size / 16 - 1)) == 0;
}

// ---- launch planning (host) -------------------------------------------------------------------------

// M <= the cut-off: decode kernel (W is the mma's A operand, x^T its B operand, 8 rows of x per n8 tile).
// Default 8 (one n8 tile); the kernel supports up to kGemvMaxRows (two tiles), so the cut-off is tunable
// at run time (ternary_cuda_set_gemv_max_m) against the mma GEMM's 16-row tile.
constexpr int kGemvMaxM = 8;
constexpr int kGemvMaxRows = 16;
constexpr int kGemvWarps = 4;        // warps per decode block, interleaved over one strip's K-chunks
constexpr int kGemvUnroll = 4;       // K-chunks (16-byte loads) each lane keeps in flight
constexpr int kGemvBlocksPerSm = 4;  // aim: ~one wave (about 5 blocks of 95 registers x 128 threads fit an SM)
constexpr int kGemvMinChunksPerSplit = 8;
constexpr int kGemmMinChunksPerSplit = 4;
constexpr int kGemmBlocksPerSm = 2;
constexpr int kMaxSplits = 64;
constexpr int kDequantWarps = 4;      // chunks per dequantize block (one per warp)
constexpr int64_t kMaxDim = int64_t(1) << 28;   // each of M, N, K (keeps every 32-bit grid/index sane)

enum Kernel : int { kKernelGemv = 0, kKernelGemm16 = 1, kKernelGemm32 = 2, kKernelGemm64 = 3, kKernelGemm128 = 4 };

struct Plan {
  int kernel;        // Kernel
  int block_m;       // rows of x per block (GEMV: 8 per n8 tile of x^T)
  int block_n;       // output features per block
  int grid_n;        // blocks along N
  int grid_m;        // blocks along M
  int splits;        // K-splits (1: no workspace)
  int64_t partial_floats;  // fp32 workspace elements (0 when splits == 1)
  int64_t counters;        // int32 tile counters (0 when splits == 1); must start zeroed, left zeroed
};

inline int ceil_div_int(int64_t a, int64_t b) { return (int)((a + b - 1) / b); }

inline int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Returns false on sizes outside the limits (the launcher reports which).
inline bool make_plan(int64_t m, int64_t n, int64_t k, int sm_count, int gemv_max_m, Plan* plan) {
  if (m <= 0 || n <= 0 || k <= 0 || m > kMaxDim || n > kMaxDim || k > kMaxDim || sm_count <= 0) return false;
  const int64_t n_pad = (n + kChunkN - 1) / kChunkN * kChunkN;
  const int k_chunks = ceil_div_int(k, kChunkK);
  const int strips = (int)(n_pad / kChunkN);
  Plan p{};
  if (m <= gemv_max_m && m <= kGemvMaxRows) {
    p.kernel = kKernelGemv;
    p.block_m = m <= 8 ? 8 : 16;
    p.block_n = kChunkN;
    p.grid_n = strips;
    p.grid_m = 1;
    const int want = ceil_div_int((int64_t)sm_count * kGemvBlocksPerSm, strips);
    p.splits = clamp_int(want, 1, clamp_int(k_chunks / kGemvMinChunksPerSplit, 1, kMaxSplits));
  } else {
    if (m <= 16) { p.kernel = kKernelGemm16; p.block_m = 16; }
    else if (m <= 32) { p.kernel = kKernelGemm32; p.block_m = 32; }
    else if (m <= 64) { p.kernel = kKernelGemm64; p.block_m = 64; }
    else { p.kernel = kKernelGemm128; p.block_m = 128; }
    p.block_n = 128;
    p.grid_n = ceil_div_int(n_pad, p.block_n);
    p.grid_m = ceil_div_int(m, p.block_m);
    const int64_t tiles = (int64_t)p.grid_n * p.grid_m;
    const int64_t target = (int64_t)sm_count * kGemmBlocksPerSm;
    const int want = tiles >= target ? 1 : ceil_div_int(target, tiles);
    p.splits = clamp_int(want, 1, clamp_int(k_chunks / kGemmMinChunksPerSplit, 1, kMaxSplits));
  }
  if (p.grid_m > 65535) return false;
  p.partial_floats = p.splits > 1 ? (int64_t)p.splits * m * n_pad : 0;
  p.counters = p.splits > 1 ? (int64_t)p.grid_n * p.grid_m : 0;
  *plan = p;
  return true;
}

}  // namespace ternary
