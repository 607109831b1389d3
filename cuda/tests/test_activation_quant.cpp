// Host replay of the int8 activation modes' CUDA arithmetic (activation_quant_math.h, the very functions
// the kernels in activation_quant.cu call), built by g++ with no CUDA toolkit. tests/test_cuda_host.py
// drives it with activations it also hands to the CPU kernel's quantization and compares bit for bit.
//
//   test_activation_quant --self-test
//   test_activation_quant tokens M K x.f32 codes.f32 xs.f32    codes as float (q * 2^-7, exact in fp16)
//   test_activation_quant groups M K G x.f32 out.bf16           bf16 bits of q * xs_g
//   test_activation_quant scale M N y.f32 xs.f32 bias.f32 out.f32
//
// The replay follows each kernel's loop: one max over the domain (max_keep_nan; its order does not change
// the result), then the per-element maths.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../activation_quant_math.h"

using namespace ternary::quant;

static std::vector<float> read_f32(const char* path, size_t count) {
  std::vector<float> v(count);
  FILE* f = std::fopen(path, "rb");
  if (f == nullptr || std::fread(v.data(), sizeof(float), count, f) != count) {
    std::fprintf(stderr, "cannot read %zu floats from %s\n", count, path);
    std::exit(2);
  }
  std::fclose(f);
  return v;
}

template <typename T>
static void write(const char* path, const std::vector<T>& v) {
  FILE* f = std::fopen(path, "wb");
  if (f == nullptr || std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) {
    std::fprintf(stderr, "cannot write %s\n", path);
    std::exit(2);
  }
  std::fclose(f);
}

// __float2bfloat16_rn: round to nearest even, NaN kept quiet.
static uint16_t bf16_rn(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

static float domain_max(const float* x, int64_t n) {
  float a = 0.0f;
  for (int64_t i = 0; i < n; ++i) a = max_keep_nan(a, std::fabs(x[i]));
  return a;
}

static void tokens(const std::vector<float>& x, int64_t m, int64_t k, std::vector<float>& codes,
                   std::vector<float>& xs) {
  codes.resize(m * k);
  xs.resize(m);
  for (int64_t r = 0; r < m; ++r) {
    const DomainScale d = domain_scale(domain_max(&x[r * k], k), true);
    for (int64_t i = 0; i < k; ++i) codes[r * k + i] = mul_rn(quantize(x[r * k + i], d.mul, -128.0f), kCodeScale);
    xs[r] = d.xs;
  }
}

static std::vector<uint16_t> groups(const std::vector<float>& x, int64_t m, int64_t k, int64_t g) {
  std::vector<uint16_t> out(m * k);
  for (int64_t base = 0; base < m * k; base += g) {
    const DomainScale d = domain_scale(domain_max(&x[base], g), false);
    for (int64_t i = 0; i < g; ++i) out[base + i] = bf16_rn(mul_rn(quantize(x[base + i], d.mul, -kInt8Max), d.xs));
  }
  return out;
}

static int self_test() {
  int bad = 0;
  auto expect = [&](bool ok, const char* what) {
    if (!ok) {
      std::fprintf(stderr, "FAIL %s\n", what);
      ++bad;
    }
  };
  // Scale exactly 1 (max|x| = 127): .5 ties go to even.
  std::vector<float> codes, xs;
  std::vector<float> ties = {127.0f, 2.5f, -3.5f, 0.5f, -1.5f, 126.5f, 0.0f, -0.5f};
  tokens(ties, 1, 8, codes, xs);
  const float want[8] = {127, 2, -4, 0, -2, 126, 0, -0};
  for (int i = 0; i < 8; ++i) expect(codes[i] == want[i] * kCodeScale, "token codes round half to even");
  expect(xs[0] == 1.0f, "token scale of max|x| = 127 is 1");
  // Below the 1e-5 floor the scale is 127 / 1e-5 (BitNet's clamp), not 127 / max|x|.
  std::vector<float> tiny = {1e-8f, -2e-8f};
  tokens(tiny, 1, 2, codes, xs);
  expect(xs[0] == 1.0f / (127.0f / 1e-5f), "token scale floor");
  // An all-zero token: codes 0, finite scale.
  std::vector<float> zero(4, 0.0f);
  tokens(zero, 1, 4, codes, xs);
  expect(codes[0] == 0.0f && std::isfinite(xs[0]), "all-zero token");
  // NaN anywhere in the domain makes xs NaN, whichever position it takes in the max.
  for (int pos = 0; pos < 4; ++pos) {
    std::vector<float> v = {1.0f, -2.0f, 3.0f, 0.5f};
    v[pos] = NAN;
    tokens(v, 1, 4, codes, xs);
    expect(std::isnan(xs[0]), "NaN propagates to the token scale");
  }
  std::vector<float> inf = {1.0f, INFINITY};
  tokens(inf, 1, 2, codes, xs);
  expect(std::isnan(xs[0]), "Inf makes the token scale NaN");
  // Per group: an all-zero group gives exact zeros, -128 is clamped to -127.
  std::vector<float> gx(64, 0.0f);
  gx[32] = -128.0f;
  gx[33] = 127.0f;
  const std::vector<uint16_t> go = groups(gx, 1, 64, 32);
  expect(go[0] == 0 && go[31] == 0, "all-zero group");
  const float s = 128.0f / 127.0f;
  expect(go[32] == bf16_rn(mul_rn(-127.0f, s)), "per-group clamp at -127");
  // max|x_g| < 127 / FLT_MAX: the multiplier would overflow (x * inf = inf, 0 * inf = NaN); a zero group.
  std::vector<float> tiny_group(32, 0.0f);
  for (int i = 0; i < 32; i += 3) tiny_group[i] = 1e-38f;
  const std::vector<uint16_t> tg = groups(tiny_group, 1, 32, 32);
  bool all_zero = true;
  for (uint16_t b : tg) all_zero = all_zero && b == 0;
  expect(all_zero, "a group whose 127 / max|x| overflows quantizes to zeros");
  // Epilogue: one rounding per operation, no FMA; -0 stays -0 without a bias.
  expect(std::signbit(scale_row_value(-0.0f, 0.25f, -0.0f)), "no-bias epilogue keeps -0");
  expect(scale_row_value(3.0f, 0.25f, 1.0f) == 97.0f, "epilogue y * xs * 128 + bias");
  if (bad == 0) std::printf("all activation-quantizer replays match\n");
  return bad == 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--self-test") return self_test();
  if (argc == 7 && std::string(argv[1]) == "tokens") {
    const int64_t m = std::atoll(argv[2]), k = std::atoll(argv[3]);
    std::vector<float> codes, xs;
    tokens(read_f32(argv[4], m * k), m, k, codes, xs);
    write(argv[5], codes);
    write(argv[6], xs);
    return 0;
  }
  if (argc == 7 && std::string(argv[1]) == "groups") {
    const int64_t m = std::atoll(argv[2]), k = std::atoll(argv[3]), g = std::atoll(argv[4]);
    write(argv[6], groups(read_f32(argv[5], m * k), m, k, g));
    return 0;
  }
  if (argc == 8 && std::string(argv[1]) == "scale") {
    const int64_t m = std::atoll(argv[2]), n = std::atoll(argv[3]);
    const std::vector<float> y = read_f32(argv[4], m * n), xs = read_f32(argv[5], m), b = read_f32(argv[6], n);
    std::vector<float> out(m * n);
    for (int64_t i = 0; i < m * n; ++i) out[i] = scale_row_value(y[i], xs[i / n], b[i % n]);
    write(argv[7], out);
    return 0;
  }
  std::fprintf(stderr, "usage: see the header of test_activation_quant.cpp\n");
  return 2;
}
