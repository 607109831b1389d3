// Host tests of the kernels' per-thread logic (ternary_frag.h), built by g++ with no CUDA toolkit.
//
// The GPU cannot run here, so the two kernels' index maths are replayed on the CPU for every lane of every
// warp of whole grids: weights are permuted by an independent reference of the layout spec, fragments are
// assembled exactly as the kernels do (same helpers), and mma.sync.m16n8k16 and ldmatrix.x4 are emulated
// from their PTX ISA fragment definitions (written out here, not taken from the header). Outputs are
// compared with a plain float64 y = x W^T + bias. Values are small integers times dyadic scales, so every
// sum is exact and the comparison is equality.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../ternary_frag.h"

using namespace ternary;

static int g_failures = 0;
#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                  \
      std::fprintf(stderr, "\n");                         \
      if (++g_failures > 20) std::exit(1);                \
    }                                                     \
  } while (0)

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (uint32_t)(g_rng >> 11);
}

// IEEE binary16 and bfloat16 bit patterns to float (independent of any CUDA header).
static float half_to_float(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
  float v;
  if (exp == 0) v = std::ldexp((float)man, -24);
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = std::ldexp((float)(man | 1024), exp - 25);
  return sign ? -v : v;
}
static float bf16_to_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Pair { float lo, hi; };  // one 32-bit fragment register as its two values

// What the device's frag_rt computes for register r of a word: hsub2(Unpack::bits, Unpack::offset_bits),
// a difference of two exactly representable values (so exact in fp32 here as on the device).
static Pair decode_reg(uint32_t word, int r, bool bf16) {
  const uint32_t b = bf16 ? Unpack<true>::bits(word, r) : Unpack<false>::bits(word, r);
  const uint32_t o = bf16 ? Unpack<true>::offset_bits(r) : Unpack<false>::offset_bits(r);
  auto f = [bf16](uint32_t h) { return bf16 ? bf16_to_float((uint16_t)h) : half_to_float((uint16_t)h); };
  return {f(b & 0xffff) - f(o & 0xffff), f(b >> 16) - f(o >> 16)};
}

// ---- problem + reference layout --------------------------------------------------------------------
struct Problem {
  int m, n, k, g;
  std::vector<uint8_t> codes;   // [n][k], 0..2
  std::vector<float> scales;    // [n][k/g]
  std::vector<float> x;         // [m][k]
  std::vector<float> bias;      // [n]
  int n_pad, k_pad, k_chunks, groups_pad;
  std::vector<uint32_t> words;  // GPU layout, as u32 words
  std::vector<float> scales_t;  // [groups_pad][n_pad]
};

static Problem make_problem(int m, int n, int k, int g) {
  if (k % g != 0) {
    std::fprintf(stderr, "bad test case: k=%d is not a multiple of g=%d\n", k, g);
    std::exit(2);
  }
  Problem p{m, n, k, g, {}, {}, {}, {}, 0, 0, 0, 0, {}, {}};
  p.codes.resize((size_t)n * k);
  for (auto& c : p.codes) c = rnd() % 3;
  p.scales.resize((size_t)n * (k / g));
  for (auto& s : p.scales) s = (float)(1 + rnd() % 16) / 8.0f;  // exact in fp16
  p.x.resize((size_t)m * k);
  for (auto& v : p.x) v = (float)((int)(rnd() % 17) - 8);     // exact in bf16/fp16
  p.bias.resize(n);
  for (auto& b : p.bias) b = (float)((int)(rnd() % 9) - 4);
  p.n_pad = (n + 31) / 32 * 32;
  p.k_pad = (k + 63) / 64 * 64;
  p.k_chunks = p.k_pad / 64;
  p.groups_pad = (p.k_pad + g - 1) / g;
  // Reference of the layout spec (gpu_layout.rs docs), inverse direction: place every (n, k) by formula.
  std::vector<uint8_t> bytes((size_t)p.n_pad * p.k_pad / 4, 0x55);  // code 1 = weight 0 in the padding
  for (int nn = 0; nn < n; ++nn)
    for (int kk = 0; kk < k; ++kk) {
      const int nb = nn / 32, kb = kk / 64, dn = nn % 32, dk = kk % 64;
      const int lane = (dn % 8) * 4 + (dk % 8) / 2;
      const int nt = dn / 8, word = dk / 16, j = (dk % 16) / 8, h = dk % 2;
      const int q = h * 8 + nt * 2 + j;
      const size_t byte = ((size_t)nb * p.k_chunks + kb) * 512 + lane * 16 + word * 4 + q / 4;
      const int shift = 2 * (q % 4);
      bytes[byte] = (uint8_t)((bytes[byte] & ~(3 << shift)) | (p.codes[(size_t)nn * k + kk] << shift));
    }
  p.words.resize(bytes.size() / 4);
  for (size_t i = 0; i < p.words.size(); ++i)
    p.words[i] = bytes[4 * i] | bytes[4 * i + 1] << 8 | bytes[4 * i + 2] << 16 | (uint32_t)bytes[4 * i + 3] << 24;
  p.scales_t.assign((size_t)p.groups_pad * p.n_pad, 0.f);
  for (int nn = 0; nn < n; ++nn)
    for (int gi = 0; gi < k / g; ++gi) p.scales_t[(size_t)gi * p.n_pad + nn] = p.scales[(size_t)nn * (k / g) + gi];
  return p;
}

static std::vector<double> reference(const Problem& p, bool with_bias) {
  std::vector<double> y((size_t)p.m * p.n);
  for (int m = 0; m < p.m; ++m)
    for (int n = 0; n < p.n; ++n) {
      double s = with_bias ? p.bias[n] : 0.0;
      for (int k = 0; k < p.k; ++k)
        s += (double)p.x[(size_t)m * p.k + k] * ((int)p.codes[(size_t)n * p.k + k] - 1) *
             p.scales[(size_t)n * (p.k / p.g) + k / p.g];
      y[(size_t)m * p.n + n] = s;
    }
  return y;
}

// ---- PTX ISA fragment semantics (m16n8k16, .bf16/.f16 inputs, .f32 accumulators) ----------------------
// a_i: row = groupID (+8 for a2,a3,a6,a7), col = tig*2 + (i&1) (+8 for a4..a7); register i/2, half i%2.
// b_i: row = tig*2 + (i&1) (+8 for b2,b3), col = groupID. c_i: row = groupID (+8 for c2,c3), col = tig*2+(i&1).
static void mma_emulate(const Pair a[32][4], const Pair b[32][2], float c[32][4]) {
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int gid = lane >> 2, tig = lane & 3;
    for (int i = 0; i < 8; ++i) {
      const int row = gid + ((i == 2 || i == 3 || i == 6 || i == 7) ? 8 : 0);
      const int col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = (i & 1) ? a[lane][i / 2].hi : a[lane][i / 2].lo;
    }
    for (int i = 0; i < 4; ++i) {
      const int row = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      B[row][gid] = (i & 1) ? b[lane][i / 2].hi : b[lane][i / 2].lo;
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int gid = lane >> 2, tig = lane & 3;
    for (int i = 0; i < 4; ++i) {
      const int row = gid + (i >= 2 ? 8 : 0), col = tig * 2 + (i & 1);
      double s = 0;
      for (int kk = 0; kk < 16; ++kk) s += (double)A[row][kk] * B[kk][col];
      c[lane][i] += (float)s;
    }
  }
}

// ldmatrix.x4: lanes 8j..8j+7 give the row addresses of matrix j; lane t receives in register j the
// elements (row t/4, cols 2(t%4), 2(t%4)+1) of matrix j. `smem` holds 8-element 16-byte chunks.
static void ldmatrix_emulate(const std::vector<std::vector<float>>& smem, const int addr[32], Pair out[32][4]) {
  for (int t = 0; t < 32; ++t)
    for (int j = 0; j < 4; ++j) {
      const std::vector<float>& row = smem[addr[8 * j + t / 4]];
      out[t][j] = {row[2 * (t % 4)], row[2 * (t % 4) + 1]};
    }
}

// ---- replay of gemv_kernel ---------------------------------------------------------------------------
static std::vector<double> replay_gemv(const Problem& pr, bool bf16, bool with_bias, int sm_count, int gemv_max_m,
                                       int* splits_out) {
  Plan plan{};
  CHECK(make_plan(pr.m, pr.n, pr.k, sm_count, gemv_max_m, &plan), "plan");
  CHECK(plan.kernel == kKernelGemv, "gemv plan for m=%d", pr.m);
  *splits_out = plan.splits;
  const int nt8_count = plan.block_m / 8;
  CHECK(nt8_count * 8 >= pr.m && (nt8_count == 1 || nt8_count == 2), "gemv rows %d for m=%d", plan.block_m, pr.m);
  std::vector<double> y((size_t)pr.m * pr.n, NAN);
  std::vector<float> partials((size_t)plan.splits * pr.m * pr.n_pad, NAN);
  for (int strip = 0; strip < plan.grid_n; ++strip) {
    for (int split = 0; split < plan.splits; ++split) {
      const int kb_begin = split_begin(split, plan.splits, pr.k_chunks);
      const int kb_end = split_begin(split + 1, plan.splits, pr.k_chunks);
      float red[kGemvWarps][kGemvMaxRows][kChunkN];
      for (int warp = 0; warp < kGemvWarps; ++warp) {
        float acc[32][2][2][4] = {}, part[32][2][2][4] = {};  // [lane][p][t8][i]
        const int kb_warp_begin = kb_begin + split_begin(warp, kGemvWarps, kb_end - kb_begin);
        const int kb_warp_end = kb_begin + split_begin(warp + 1, kGemvWarps, kb_end - kb_begin);
        for (int kb = kb_warp_begin; kb < kb_warp_end; ++kb) {  // the unroll only groups loads
          for (int w = 0; w < kKSteps; ++w) {
            for (int p = 0; p < 2; ++p)
              for (int t8 = 0; t8 < nt8_count; ++t8) {
                Pair a[32][4], b[32][2];
                float c[32][4];
                for (int lane = 0; lane < 32; ++lane) {
                  const uint32_t word = pr.words[((size_t)strip * pr.k_chunks + kb) * kChunkWords + lane * 4 + w];
                  for (int i = 0; i < 4; ++i) a[lane][i] = decode_reg(word, gemv_a_reg(p, i), bf16);
                  const int xm = 8 * t8 + lane / 4;
                  for (int j = 0; j < 2; ++j) {
                    // The kernel reads u32 (x pair) number kb * 32 + 8 w + 4 j + lane % 4 of the row.
                    const int k = 2 * (kb * (kChunkK / 2) + 8 * w + 4 * j + lane % 4);
                    CHECK(k == kb * kChunkK + gemv_b_k(lane, w, j), "x pair offset");
                    const int steps = (pr.k - kb * kChunkK) / 16;
                    const bool ok = xm < pr.m && w < steps;
                    b[lane][j] = ok ? Pair{pr.x[(size_t)xm * pr.k + k], pr.x[(size_t)xm * pr.k + k + 1]} : Pair{0, 0};
                  }
                  for (int i = 0; i < 4; ++i) c[lane][i] = part[lane][p][t8][i];
                }
                mma_emulate(a, b, c);
                for (int lane = 0; lane < 32; ++lane)
                  for (int i = 0; i < 4; ++i) part[lane][p][t8][i] = c[lane][i];
              }
            const int kstep = kb * kKSteps + w;
            if (group_ends_after(kstep, pr.g) || kstep + 1 == kb_warp_end * kKSteps) {
              const int grp = (kb * kChunkK + 16 * w) / pr.g;
              CHECK(grp < pr.groups_pad, "group %d out of padded scales", grp);
              for (int lane = 0; lane < 32; ++lane)
                for (int p = 0; p < 2; ++p) {
                  const float s_lo = pr.scales_t[(size_t)grp * pr.n_pad + strip * 32 + gemv_scale_n(lane, 2 * p)];
                  const float s_hi = pr.scales_t[(size_t)grp * pr.n_pad + strip * 32 + gemv_scale_n(lane, 2 * p + 1)];
                  for (int t8 = 0; t8 < nt8_count; ++t8)
                    for (int i = 0; i < 4; ++i) {
                      acc[lane][p][t8][i] += part[lane][p][t8][i] * (i < 2 ? s_lo : s_hi);
                      part[lane][p][t8][i] = 0;
                    }
                }
            }
          }
        }
        for (int lane = 0; lane < 32; ++lane)
          for (int p = 0; p < 2; ++p)
            for (int t8 = 0; t8 < nt8_count; ++t8)
              for (int i = 0; i < 4; ++i)
                red[warp][gemv_c_m(lane, t8, i)][gemv_c_n(lane, p, i)] = acc[lane][p][t8][i];
      }
      const int rows = pr.m < plan.block_m ? pr.m : plan.block_m;
      for (int m = 0; m < rows; ++m)
        for (int nl = 0; nl < kChunkN; ++nl) {
          float v = 0;
          for (int wi = 0; wi < kGemvWarps; ++wi) v += red[wi][m][nl];
          const int n = strip * kChunkN + nl;
          if (plan.splits == 1) {
            if (n < pr.n) y[(size_t)m * pr.n + n] = v + (with_bias ? pr.bias[n] : 0.f);
          } else {
            partials[((size_t)split * pr.m + m) * pr.n_pad + n] = v;
          }
        }
    }
    if (plan.splits > 1)  // the last-arriving block's sum, in split order
      for (int m = 0; m < pr.m; ++m)
        for (int nl = 0; nl < kChunkN; ++nl) {
          const int n = strip * kChunkN + nl;
          if (n >= pr.n) continue;
          float v = 0;
          for (int s = 0; s < plan.splits; ++s) v += partials[((size_t)s * pr.m + m) * pr.n_pad + n];
          y[(size_t)m * pr.n + n] = v + (with_bias ? pr.bias[n] : 0.f);
        }
  }
  return y;
}

// ---- replay of gemm_kernel ---------------------------------------------------------------------------
static std::vector<double> replay_gemm(const Problem& pr, bool bf16, bool with_bias, int sm_count, int gemv_max_m,
                                       int* splits_out, int* kernel_out) {
  Plan plan{};
  CHECK(make_plan(pr.m, pr.n, pr.k, sm_count, gemv_max_m, &plan), "plan");
  CHECK(plan.kernel != kKernelGemv, "gemm plan for m=%d", pr.m);
  *splits_out = plan.splits;
  *kernel_out = plan.kernel;
  const int warps_m = plan.kernel >= kKernelGemm64 ? 2 : 1, warps_n = 4;
  const int mt_count = plan.block_m / (16 * warps_m);
  CHECK(plan.block_m == 16 * mt_count * warps_m && plan.block_n == 32 * warps_n, "tile shape");
  const int strips = pr.n_pad / 32;
  std::vector<double> y((size_t)pr.m * pr.n, NAN);
  std::vector<float> partials((size_t)plan.splits * pr.m * pr.n_pad, NAN);
  for (int n_block = 0; n_block < plan.grid_n; ++n_block)
    for (int m_block = 0; m_block < plan.grid_m; ++m_block) {
      const int m0 = m_block * plan.block_m;
      for (int split = 0; split < plan.splits; ++split) {
        const int kb_begin = split_begin(split, plan.splits, pr.k_chunks);
        const int kb_end = split_begin(split + 1, plan.splits, pr.k_chunks);
        const int kstep_end = kb_end * kKSteps;
        for (int warp = 0; warp < warps_m * warps_n; ++warp) {
          const int wm = warp / warps_n, wn = warp % warps_n, strip = n_block * warps_n + wn;
          std::vector<float> acc((size_t)mt_count * 4 * 32 * 4, 0.f), part(acc.size(), 0.f);
          auto at = [&](std::vector<float>& v, int mt, int nt, int lane, int i) -> float& {
            return v[(((size_t)mt * 4 + nt) * 32 + lane) * 4 + i];
          };
          for (int kb = kb_begin; kb < kb_end; ++kb) {
            // The stage as cp.async leaves it: swizzled x chunks (zero-filled) and the strip's weight chunk.
            std::vector<std::vector<float>> a_smem((size_t)plan.block_m * 8, std::vector<float>(8, 0.f));
            for (int r = 0; r < plan.block_m; ++r)
              for (int c = 0; c < 8; ++c) {
                const int m = m0 + r, k = kb * 64 + 8 * c;
                for (int e = 0; e < 8; ++e)
                  a_smem[a_smem_chunk(r, c)][e] = (m < pr.m && k < pr.k) ? pr.x[(size_t)m * pr.k + k + e] : 0.f;
              }
            for (int ks = 0; ks < kKSteps; ++ks) {
              std::vector<Pair> af((size_t)mt_count * 32 * 4);
              for (int mt = 0; mt < mt_count; ++mt) {
                int addr[32];
                for (int lane = 0; lane < 32; ++lane) {
                  const int r = wm * 16 * mt_count + mt * 16 + ldmatrix_a_row(lane);
                  addr[lane] = a_smem_chunk(r, ldmatrix_a_chunk(lane, ks));
                }
                Pair out[32][4];
                ldmatrix_emulate(a_smem, addr, out);
                for (int lane = 0; lane < 32; ++lane)
                  for (int i = 0; i < 4; ++i) af[((size_t)mt * 32 + lane) * 4 + i] = out[lane][i];
              }
              for (int nt = 0; nt < 4; ++nt) {
                Pair b[32][2];
                for (int lane = 0; lane < 32; ++lane) {
                  const uint32_t word =
                      strip < strips ? pr.words[((size_t)strip * pr.k_chunks + kb) * kChunkWords + lane * 4 + ks] : 0u;
                  for (int j = 0; j < 2; ++j) b[lane][j] = decode_reg(word, gemm_b_reg(nt, j), bf16);
                }
                for (int mt = 0; mt < mt_count; ++mt) {
                  Pair a[32][4];
                  float c[32][4];
                  for (int lane = 0; lane < 32; ++lane)
                    for (int i = 0; i < 4; ++i) {
                      a[lane][i] = af[((size_t)mt * 32 + lane) * 4 + i];
                      c[lane][i] = at(part, mt, nt, lane, i);
                    }
                  mma_emulate(a, b, c);
                  for (int lane = 0; lane < 32; ++lane)
                    for (int i = 0; i < 4; ++i) at(part, mt, nt, lane, i) = c[lane][i];
                }
              }
              const int kstep = kb * kKSteps + ks;
              if (group_ends_after(kstep, pr.g) || kstep + 1 == kstep_end) {
                const int grp = kstep * 16 / pr.g;
                CHECK(grp < pr.groups_pad, "group %d out of padded scales", grp);
                const int s_strip = strip < strips ? strip : 0;
                for (int lane = 0; lane < 32; ++lane)
                  for (int nt = 0; nt < 4; ++nt) {
                    const int n0 = s_strip * 32 + gemm_c_n(lane, nt, 0);
                    const float sx = pr.scales_t[(size_t)grp * pr.n_pad + n0];
                    const float sy = pr.scales_t[(size_t)grp * pr.n_pad + n0 + 1];
                    for (int mt = 0; mt < mt_count; ++mt)
                      for (int i = 0; i < 4; ++i) {
                        at(acc, mt, nt, lane, i) += at(part, mt, nt, lane, i) * ((i & 1) ? sy : sx);
                        at(part, mt, nt, lane, i) = 0;
                      }
                  }
              }
            }
          }
          if (strip >= strips) continue;
          for (int mt = 0; mt < mt_count; ++mt)
            for (int nt = 0; nt < 4; ++nt)
              for (int lane = 0; lane < 32; ++lane)
                for (int i = 0; i < 4; ++i) {
                  const int m = m0 + wm * 16 * mt_count + mt * 16 + c_row(lane, i);
                  const int n = strip * 32 + gemm_c_n(lane, nt, i);
                  if (m >= pr.m) continue;
                  if (plan.splits == 1) {
                    if (n < pr.n) y[(size_t)m * pr.n + n] = at(acc, mt, nt, lane, i) + (with_bias ? pr.bias[n] : 0.f);
                  } else {
                    partials[((size_t)split * pr.m + m) * pr.n_pad + n] = at(acc, mt, nt, lane, i);
                  }
                }
        }
      }
      if (plan.splits > 1)
        for (int idx = 0; idx < plan.block_m * plan.block_n; ++idx) {
          const int m = m0 + idx / plan.block_n, n = n_block * plan.block_n + idx % plan.block_n;
          if (m >= pr.m || n >= pr.n) continue;
          float v = 0;
          for (int s = 0; s < plan.splits; ++s) v += partials[((size_t)s * pr.m + m) * pr.n_pad + n];
          y[(size_t)m * pr.n + n] = v + (with_bias ? pr.bias[n] : 0.f);
        }
    }
  return y;
}

// ---- replay of dequant_kernel -------------------------------------------------------------------------
static void test_dequant(const Problem& pr, bool bf16) {
  std::vector<float> w((size_t)pr.n * pr.k, NAN);
  for (int strip = 0; strip < pr.n_pad / 32; ++strip)
    for (int kb = 0; kb < pr.k_chunks; ++kb)
      for (int lane = 0; lane < 32; ++lane)
        for (int wd = 0; wd < kKSteps; ++wd) {
          const int k0 = kb * kChunkK + 16 * wd;
          if (k0 >= pr.k) break;
          const uint32_t word = pr.words[((size_t)strip * pr.k_chunks + kb) * kChunkWords + lane * 4 + wd];
          for (int r = 0; r < 8; ++r) {
            const int nn = strip * 32 + reg_n(lane, r);
            if (nn >= pr.n) continue;
            const int kk = kb * kChunkK + reg_k(lane, wd, r);
            const float sc = pr.scales_t[(size_t)(k0 / pr.g) * pr.n_pad + nn];
            const Pair t = decode_reg(word, r, bf16);
            w[(size_t)nn * pr.k + kk] = t.lo * sc;
            w[(size_t)nn * pr.k + kk + 1] = t.hi * sc;
          }
        }
  size_t bad = 0;
  for (int nn = 0; nn < pr.n; ++nn)
    for (int kk = 0; kk < pr.k; ++kk) {
      const float want = ((int)pr.codes[(size_t)nn * pr.k + kk] - 1) * pr.scales[(size_t)nn * (pr.k / pr.g) + kk / pr.g];
      bad += !(w[(size_t)nn * pr.k + kk] == want);
    }
  CHECK(bad == 0, "dequant n=%d k=%d g=%d: %zu wrong", pr.n, pr.k, pr.g, bad);
}

static void compare(const char* what, const Problem& p, const std::vector<double>& got, const std::vector<double>& want) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= 1e-6 * (1 + std::fabs(want[i])))) {
      if (!bad) first = i;
      ++bad;
    }
  CHECK(bad == 0, "%s m=%d n=%d k=%d g=%d: %zu wrong, first (m=%zu, n=%zu) got %g want %g", what, p.m, p.n, p.k,
        p.g, bad, first / p.n, first % p.n, got[first], want[first]);
}

static void test_pair_bits() {
  // Every register of every word of 16 codes in {0, 1, 2} (43 million words is too many: all 3^8 patterns of
  // the low half against random high halves, and random words), both dtypes.
  for (int t = 0; t < 6561 + 20000; ++t) {
    uint32_t word = 0;
    if (t < 6561) {
      int v = t;
      for (int q = 0; q < 8; ++q, v /= 3) word |= (uint32_t)(v % 3) << (2 * q);
      for (int q = 8; q < 16; ++q) word |= (rnd() % 3) << (2 * q);
    } else {
      for (int q = 0; q < 16; ++q) word |= (rnd() % 3) << (2 * q);
    }
    for (int r = 0; r < 8; ++r)
      for (int bf = 0; bf < 2; ++bf) {
        const Pair v = decode_reg(word, r, bf);
        const int lo = (word >> (2 * r)) & 3, hi = (word >> (16 + 2 * r)) & 3;
        CHECK(v.lo == lo - 1 && v.hi == hi - 1, "pair r=%d word=%08x", r, word);
      }
  }
}

static void test_plan() {
  const int64_t shapes[][3] = {{1, 6144, 5120}, {4, 17408, 5120}, {8, 5120, 17408}, {16, 151936, 5120},
                               {64, 6144, 5120}, {512, 5120, 17408}, {2048, 6144, 5120}, {3, 33, 32}};
  for (auto& s : shapes) {
    Plan p{};
    CHECK(make_plan(s[0], s[1], s[2], 132, kGemvMaxM, &p), "plan");
    const int k_chunks = (int)((s[2] + 63) / 64);
    CHECK(p.splits >= 1 && p.splits <= kMaxSplits && p.splits <= k_chunks, "splits %d", p.splits);
    // Ranges tile [0, k_chunks) with no gap or overlap and none is empty.
    int prev = 0;
    for (int i = 0; i < p.splits; ++i) {
      const int b = split_begin(i, p.splits, k_chunks), e = split_begin(i + 1, p.splits, k_chunks);
      CHECK(b == prev && e > b, "split %d [%d, %d)", i, b, e);
      prev = e;
    }
    CHECK(prev == k_chunks, "splits cover K");
    CHECK((int64_t)p.grid_n * p.block_n >= s[1] && (int64_t)p.grid_m * p.block_m >= s[0], "grid covers output");
    CHECK(p.splits == 1 || (p.partial_floats == (int64_t)p.splits * s[0] * ((s[1] + 31) / 32 * 32) &&
                            p.counters == (int64_t)p.grid_n * p.grid_m),
          "workspace sizes");
    std::printf("plan m=%lld n=%lld k=%lld: kernel %d grid %dx%d splits %d\n", (long long)s[0], (long long)s[1],
                (long long)s[2], p.kernel, p.grid_n, p.grid_m, p.splits);
  }
  Plan p{};
  CHECK(!make_plan(0, 1, 32, 132, kGemvMaxM, &p) && !make_plan(1, 1, kMaxDim + 1, 132, kGemvMaxM, &p), "limits");
}

int main() {
  test_pair_bits();
  test_plan();
  // (m, n, k, g, sm_count): odd N, K with a half-empty last chunk (g = 32), every group size, and a large
  // sm_count to force split-K on these small shapes.
  const int cases[][5] = {{1, 45, 96, 32, 1},   {3, 64, 256, 64, 132},  {8, 100, 512, 128, 132},
                          {2, 7, 1024, 256, 4}, {5, 33, 160, 32, 132},  {17, 45, 96, 32, 1},
                          {16, 130, 512, 64, 132}, {33, 61, 256, 128, 132}, {70, 40, 320, 32, 2},
                          {129, 96, 256, 256, 1}, {9, 200, 1024, 128, 132}, {4, 40, 1024, 32, 132},
                          {2, 40, 2304, 256, 132}, {20, 64, 1280, 256, 1}, {16, 70, 2048, 64, 132}, {12, 33, 192, 32, 1},
                          {14, 300, 4096, 128, 132}};
  for (auto& c : cases)
    for (int bf = 0; bf < 2; ++bf) test_dequant(make_problem(1, c[1], c[2], c[3]), bf);
  std::printf("dequantize replay: ok=%d\n", g_failures == 0);
  // Every case under the default GEMV cut-off (8) and the largest (16), so rows 9..16 run both kernels.
  for (const int cutoff : {kGemvMaxM, kGemvMaxRows})
    for (auto& c : cases)
      for (int bf = 0; bf < 2; ++bf) {
        Problem p = make_problem(c[0], c[1], c[2], c[3]);
        const bool with_bias = (c[0] + bf) % 2 == 0;
        const std::vector<double> want = reference(p, with_bias);
        int splits = 0, kernel = 0;
        const bool gemv = c[0] <= cutoff;
        std::vector<double> got = gemv ? replay_gemv(p, bf, with_bias, c[4], cutoff, &splits)
                                       : replay_gemm(p, bf, with_bias, c[4], cutoff, &splits, &kernel);
        compare(gemv ? "gemv" : "gemm", p, got, want);
        std::printf("cut-off %2d: m=%d n=%d k=%d g=%d %s: kernel %d, %d split(s): ok=%d\n", cutoff, c[0], c[1], c[2],
                    c[3], bf ? "bf16" : "fp16", kernel, splits, g_failures == 0);
      }
  if (g_failures) {
    std::fprintf(stderr, "%d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("all fragment replays match the reference\n");
  return 0;
}
