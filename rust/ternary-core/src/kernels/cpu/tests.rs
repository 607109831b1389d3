//! Kernel tests: every supported variant and precision against a float64 reference computed straight
//! from the canonical codes (never from the bit-planes), and SIMD variants against the scalar one.

#![allow(clippy::needless_range_loop)]

use half::{bf16, f16};
use proptest::prelude::*;

use super::*;
use crate::canonical::CanonicalRef;
use crate::threads::Rayon;

struct Case {
    n: usize,
    k: usize,
    g: usize,
    qweight: Vec<u8>,
    scales: Vec<f16>,
    x: Vec<f32>,
    bias: Vec<f32>,
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn case(m: usize, n: usize, k: usize, g: usize, seed: u64) -> Case {
    let mut st = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let codes: Vec<u8> = (0..n * k).map(|_| (xorshift(&mut st) % 3) as u8).collect();
    let qweight = codes
        .chunks(4)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u8, |b, (i, &v)| b | (v << (2 * i)))
        })
        .collect();
    let mut uniform = move || (xorshift(&mut st) >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
    let scales = (0..n * k / g)
        .map(|_| f16::from_f64(0.01 + uniform().abs()))
        .collect();
    let x = (0..m * k).map(|_| uniform() as f32 * 3.0).collect();
    let bias = (0..n).map(|_| uniform() as f32).collect();
    Case {
        n,
        k,
        g,
        qweight,
        scales,
        x,
        bias,
    }
}

impl Case {
    fn canonical(&self) -> CanonicalRef<'_> {
        CanonicalRef {
            rows: self.n,
            cols: self.k,
            group_size: self.g,
            qweight: &self.qweight,
            scales: &self.scales,
        }
    }

    /// float64 reference from the canonical codes: returns (y, Σ|x·w|) per output.
    fn reference(&self, x: &[f32], with_bias: bool) -> (Vec<f64>, Vec<f64>) {
        let w = self.canonical();
        let m = x.len() / self.k;
        let mut y = vec![0f64; m * self.n];
        let mut mag = vec![0f64; m * self.n];
        for mi in 0..m {
            for n in 0..self.n {
                let (mut s, mut a) = (0f64, 0f64);
                for k in 0..self.k {
                    let wv = w.trit(n, k) as f64 * w.scale(n, k).to_f64();
                    let p = wv * x[mi * self.k + k] as f64;
                    s += p;
                    a += p.abs();
                }
                y[mi * self.n + n] = s + if with_bias { self.bias[n] as f64 } else { 0.0 };
                mag[mi * self.n + n] = a;
            }
        }
        (y, mag)
    }

    fn prepared(&self) -> (Vec<u8>, Vec<f16>) {
        layout::prepare(self.canonical(), "w").unwrap()
    }

    fn prepared_in(&self, layout: Layout) -> (Vec<u8>, Vec<f16>) {
        layout::prepare_layout(self.canonical(), "w", layout).unwrap()
    }

    /// This case's weight in the kernel layout, over `prepared`'s buffers.
    fn weight<'a>(&self, prepared: &'a (Vec<u8>, Vec<f16>)) -> PreparedRef<'a> {
        self.weight_in(prepared, Layout::Rows4)
    }

    fn weight_in<'a>(&self, prepared: &'a (Vec<u8>, Vec<f16>), layout: Layout) -> PreparedRef<'a> {
        PreparedRef {
            rows: self.n,
            cols: self.k,
            group_size: self.g,
            layout,
            planes: &prepared.0,
            scales: &prepared.1,
        }
    }

    fn run<T: Activation + Default + Clone>(
        &self,
        x: &[T],
        bias: Option<&[T]>,
        variant: Variant,
        precision: Precision,
        prepared: &(Vec<u8>, Vec<f16>),
    ) -> Vec<T> {
        self.run_in(x, bias, variant, precision, prepared, Layout::Rows4)
    }

    fn run_in<T: Activation + Default + Clone>(
        &self,
        x: &[T],
        bias: Option<&[T]>,
        variant: Variant,
        precision: Precision,
        prepared: &(Vec<u8>, Vec<f16>),
        layout: Layout,
    ) -> Vec<T> {
        let m = x.len() / self.k;
        let mut y = vec![T::default(); m * self.n];
        let w = self.weight_in(prepared, layout);
        gemm(
            w,
            x,
            m,
            bias,
            &mut y,
            KernelChoice { variant, precision },
            &Rayon,
        )
        .unwrap();
        y
    }
}

fn supported() -> Vec<Variant> {
    Variant::ALL
        .into_iter()
        .filter(|v| v.is_supported())
        .collect()
}

/// Exact mode, f32: within the documented f32-accumulation bound of float64.
fn check_exact_f32(m: usize, n: usize, k: usize, g: usize, seed: u64) {
    check_exact_f32_in(m, n, k, g, seed, Layout::Rows4);
}

fn check_exact_f32_in(m: usize, n: usize, k: usize, g: usize, seed: u64, layout: Layout) {
    let c = case(m, n, k, g, seed);
    let planes = c.prepared_in(layout);
    let (want, mag) = c.reference(&c.x, true);
    let mut scalar_out = None;
    for v in supported() {
        let got = c.run_in(&c.x, Some(&c.bias), v, Precision::Exact, &planes, layout);
        for i in 0..got.len() {
            let tol =
                4.0 * (k as f64) * f32::EPSILON as f64 * (mag[i] + c.bias[i % n].abs() as f64)
                    + 1e-30;
            let err = (got[i] as f64 - want[i]).abs();
            assert!(
                err <= tol,
                "{v:?} m{m} n{n} k{k} g{g} [{i}]: {} vs {} (tol {tol})",
                got[i],
                want[i]
            );
        }
        if v == Variant::Scalar {
            scalar_out = Some(got);
        } else if let Some(s) = &scalar_out {
            for i in 0..got.len() {
                let tol = 2.0 * (k as f64) * f32::EPSILON as f64 * (mag[i] + 1.0);
                assert!(
                    (got[i] as f64 - s[i] as f64).abs() <= tol,
                    "{v:?} vs scalar [{i}]"
                );
            }
        }
    }
}

#[test]
fn exact_f32_shapes() {
    for &(m, n, k, g) in &[
        (1, 1, 32, 32),
        (1, 3, 96, 32),
        (1, 7, 128, 64),
        (2, 33, 256, 128),
        (3, 5, 512, 256),
        (1, 1030, 160, 32),
        (16, 9, 96, 32),
        (17, 21, 640, 128),
        (33, 18, 1088, 64),
        (20, 40, 768, 256),
    ] {
        check_exact_f32(m, n, k, g, (m * 1000 + n + k) as u64);
    }
}

/// |W| summed per group: `l1[n][gi]`.
fn group_l1(c: &Case) -> Vec<Vec<f64>> {
    let w = c.canonical();
    (0..c.n)
        .map(|nn| {
            (0..c.k / c.g)
                .map(|gi| {
                    (gi * c.g..(gi + 1) * c.g)
                        .map(|kk| (w.trit(nn, kk) as f64 * w.scale(nn, kk).to_f64()).abs())
                        .sum()
                })
                .collect()
        })
        .collect()
}

/// Int8 modes vs float64: within the documented quantization bound (each x moves by at most xs/2),
/// and the SIMD variants agree with the scalar reference (identical integer sums, f32 combination).
fn check_int8(m: usize, n: usize, k: usize, g: usize, seed: u64, precision: Precision) {
    let c = case(m, n, k, g, seed);
    let planes = c.prepared();
    let (want, mag) = c.reference(&c.x, false);
    let l1 = group_l1(&c);
    let mut outs = vec![];
    for v in supported() {
        let got = c.run(&c.x, None, v, precision, &planes);
        for mi in 0..m {
            let xr = &c.x[mi * k..(mi + 1) * k];
            let token_amax = xr.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
            for nn in 0..n {
                let bound: f64 = (0..k / g)
                    .map(|gi| {
                        let amax = match precision {
                            Precision::Int8Token => token_amax.max(1e-5),
                            _ => xr[gi * g..(gi + 1) * g]
                                .iter()
                                .fold(0f32, |a, v| a.max(v.abs()))
                                as f64,
                        };
                        amax / 127.0 / 2.0 * l1[nn][gi]
                    })
                    .sum();
                let i = mi * n + nn;
                let tol = bound * 1.0001 + 1e-5 * mag[i] + 1e-6;
                assert!(
                    (got[i] as f64 - want[i]).abs() <= tol,
                    "{v:?} {precision:?} m{m} n{n} k{k} g{g} [{i}] {} vs {} (tol {tol})",
                    got[i],
                    want[i]
                );
            }
        }
        outs.push((v, got));
    }
    let (_, scalar) = &outs[0];
    for (v, o) in &outs[1..] {
        for (i, (a, b)) in o.iter().zip(scalar).enumerate() {
            assert!(
                (a - b).abs() as f64 <= 2e-6 * (1.0 + mag[i]),
                "{v:?} vs scalar [{i}]: {a} vs {b}"
            );
        }
    }
}

#[test]
fn int8_within_quantization_bound() {
    for precision in [Precision::Int8Group, Precision::Int8Token] {
        for &(m, n, k, g) in &[
            (1, 5, 32, 32),
            (2, 9, 96, 32),
            (1, 33, 512, 128),
            (3, 7, 768, 256),
            (1, 6, 192, 64),
            (4, 8, 256, 128),
            (5, 13, 1280, 64),
            (9, 6, 544, 32),
            (17, 21, 640, 128),
            // AMX: full and partial 16-token tiles, 16-row groups with a partial last group, column
            // chunks (1024) with a partial last chunk, every group size.
            (16, 37, 2304, 256),
            (33, 20, 1536, 32),
            (20, 70, 1280, 64),
            (48, 16, 1024, 128),
            // AMX narrow (8-token) tiles for M ≤ 8: full and partial, every group size.
            (8, 37, 2304, 256),
            (6, 70, 1280, 32),
            (7, 20, 1536, 128),
            (8, 33, 576, 64),
            // Per-row kernel: several token tiles over several 16-block runs, the last run and the
            // last block partial.
            (9, 150, 512, 128),
            (6, 131, 256, 32),
        ] {
            check_int8(m, n, k, g, 7 + n as u64 + m as u64, precision);
        }
    }
}

#[test]
fn int8_token_mode_is_bitnet_activation_quant() {
    // transformers' BitLinear.activation_quant, written out: scale = 127 / clamp(max|x|, 1e-5),
    // q = clamp(round_half_even(x · scale), −128, 127), y = (q · W) / scale.
    let (m, n, k, g) = (3, 10, 512, 128);
    let mut c = case(m, n, k, g, 77);
    c.x[..k].fill(0.0); // an all-zero token: the 1e-5 floor, y = 0
    c.x[k + 3] = 0.5 / 127.0 * 3.0; // a tie-free but small value
    let planes = c.prepared();
    let w = c.canonical();
    for v in supported() {
        let got = c.run(&c.x, None, v, Precision::Int8Token, &planes);
        for mi in 0..m {
            let xr = &c.x[mi * k..(mi + 1) * k];
            let amax = xr.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-5);
            let scale = 127.0 / amax;
            let q: Vec<f64> = xr
                .iter()
                .map(|&x| ((x * scale).round_ties_even().clamp(-128.0, 127.0)) as f64)
                .collect();
            for nn in 0..n {
                let y: f64 = (0..k)
                    .map(|kk| q[kk] * w.trit(nn, kk) as f64 * w.scale(nn, kk).to_f64())
                    .sum::<f64>()
                    / scale as f64;
                let mag: f64 = (0..k)
                    .map(|kk| (q[kk] * w.scale(nn, kk).to_f64()).abs())
                    .sum::<f64>()
                    / scale as f64;
                let got_v = got[mi * n + nn] as f64;
                assert!(
                    (got_v - y).abs() <= 1e-6 * mag + 1e-12,
                    "{v:?} [{mi},{nn}] {got_v} vs {y}"
                );
            }
        }
    }
}

#[test]
fn quantizers_match_the_reference_bit_for_bit() {
    let mut st = 5u64;
    for &(kp, g) in &[(256usize, 32usize), (512, 64), (768, 128), (1024, 256)] {
        for per_token in [false, true] {
            let mut x: Vec<f32> = (0..kp)
                .map(|i| {
                    ((xorshift(&mut st) >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                        * (1 + i % 7) as f32
                })
                .collect();
            x[3] = 0.5 * 127.0 / 64.0; // exact halves after scaling hit the ties-to-even rule
            x[kp - 1] = 0.0;
            x[g..2 * g].fill(0.0); // an all-zero group
                                   // A group whose max|x| is so small that 127 / max|x| overflows f32 (x · inf would be inf for
                                   // its nonzero values and NaN for its zeros): it quantizes as an all-zero group.
            for (i, v) in x[2 * g..3 * g].iter_mut().enumerate() {
                *v = if i % 3 == 0 {
                    0.0
                } else {
                    1e-38 * (i % 5) as f32
                };
            }
            let gp = kp / g;
            let mut want = (vec![0i8; kp], vec![0f32; gp * 4], vec![0f32; gp * 4]);
            quantize_row(&x, &mut want.0, g, per_token, &mut want.1, &mut want.2);
            for v in supported() {
                let kern = v.kernels().unwrap();
                let mut got = (vec![0i8; kp], vec![0f32; gp * 4], vec![0f32; gp * 4]);
                unsafe { (kern.quantize)(&x, &mut got.0, g, per_token, &mut got.1, &mut got.2) };
                assert_eq!(got, want, "{v:?} kp{kp} g{g} token {per_token}");
            }
        }
    }
}

#[test]
fn half_dtypes_round_once() {
    let (m, n, k, g) = (2, 11, 256, 64);
    let c = case(m, n, k, g, 3);
    let planes = c.prepared();
    let xb: Vec<bf16> = c.x.iter().map(|&v| bf16::from_f32(v)).collect();
    let xh: Vec<f16> = c.x.iter().map(|&v| f16::from_f32(v)).collect();
    let bb: Vec<bf16> = c.bias.iter().map(|&v| bf16::from_f32(v)).collect();
    for v in supported() {
        let yb = c.run(&xb, Some(&bb), v, Precision::Exact, &planes);
        let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        let cb = Case {
            bias: bb.iter().map(|v| v.to_f32()).collect(),
            ..case(m, n, k, g, 3)
        };
        let (want, mag) = cb.reference(&xr, true);
        for i in 0..yb.len() {
            let tol = want[i].abs() * 2f64.powi(-8) + 1e-4 * mag[i] + 1e-6;
            assert!((yb[i].to_f64() - want[i]).abs() <= tol, "{v:?} bf16 [{i}]");
        }
        let yh = c.run(&xh, None, v, Precision::Exact, &planes);
        let xr: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
        let (want, mag) = c.reference(&xr, false);
        for i in 0..yh.len() {
            let tol = want[i].abs() * 2f64.powi(-11) + 1e-4 * mag[i] + 1e-6;
            assert!((yh[i].to_f64() - want[i]).abs() <= tol, "{v:?} f16 [{i}]");
        }
    }
}

#[test]
fn parallel_path_matches_single_thread_shape() {
    // N·K above PARALLEL_MIN_WEIGHTS exercises the rayon split (GEMV and GEMM).
    check_exact_f32(1, 1100, 1024, 128, 11);
    check_exact_f32(16, 1030, 1024, 32, 12);
}

#[test]
fn rejects_bad_sizes_and_variants() {
    let c = case(1, 4, 64, 32, 1);
    let (planes, scales) = c.prepared();
    let w = PreparedRef {
        rows: 4,
        cols: 64,
        group_size: 32,
        layout: Layout::Rows4,
        planes: &planes,
        scales: &scales,
    };
    let mut y = vec![0f32; 4];
    assert!(gemm(
        w,
        &c.x[..63],
        1,
        None,
        &mut y,
        KernelChoice {
            variant: Variant::Scalar,
            precision: Precision::Exact
        },
        &Rayon
    )
    .is_err());
    assert!(gemm(
        w,
        &c.x,
        1,
        Some(&c.bias[..3]),
        &mut y,
        KernelChoice {
            variant: Variant::Scalar,
            precision: Precision::Exact
        },
        &Rayon
    )
    .is_err());
    let short = PreparedRef {
        planes: &planes[..planes.len() - 1],
        ..w
    };
    assert!(gemm(
        short,
        &c.x,
        1,
        None,
        &mut y,
        KernelChoice {
            variant: Variant::Scalar,
            precision: Precision::Exact
        },
        &Rayon
    )
    .is_err());
    let bad_g = PreparedRef {
        group_size: 48,
        ..w
    };
    assert!(gemm(
        bad_g,
        &c.x,
        1,
        None,
        &mut y,
        KernelChoice {
            variant: Variant::Scalar,
            precision: Precision::Exact
        },
        &Rayon
    )
    .is_err());
    assert!(Variant::parse("neon").is_err());
    assert_eq!(Variant::parse("auto").unwrap(), Variant::best());
}

#[test]
fn nan_activation_propagates() {
    // One token (the GEMV kernels) and eight (AMX tiles from AMX_MIN_M): the NaN sits in token 0;
    // the other tokens stay finite.
    for m in [1, 8] {
        let c = case(m, 3, 64, 32, 2);
        let planes = c.prepared();
        let mut x = c.x.clone();
        x[5] = f32::NAN;
        for v in supported() {
            for p in [Precision::Exact, Precision::Int8Group, Precision::Int8Token] {
                let y = c.run(&x, None, v, p, &planes);
                // Rows whose weight at column 5 is nonzero must be NaN in exact mode; int8 poisons
                // the row.
                for nn in 0..3 {
                    if p != Precision::Exact || c.canonical().trit(nn, 5) != 0 {
                        assert!(y[nn].is_nan(), "{v:?} {p:?} m{m} row {nn}");
                    }
                }
                assert!(
                    y[3..].iter().all(|v| v.is_finite()),
                    "{v:?} {p:?} m{m}: NaN leaked"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn exact_matches_reference(m in 1usize..20, n in 1usize..13, groups in 1usize..5, gi in 0usize..4, seed in any::<u64>()) {
        let g = GROUP_SIZES_FOR_TEST[gi];
        check_exact_f32(m, n, groups * g, g, seed);
    }
}

const GROUP_SIZES_FOR_TEST: [usize; 4] = crate::canonical::GROUP_SIZES;

/// Throughput of the whole kernel at M = 1..128 (AVX2, VNNI and AMX) on a weight larger than the caches, single-threaded
/// (run by hand: `cargo test --release -p ternary-core kernel_throughput -- --ignored --nocapture`).
/// The benchmarks in `benches/` are the numbers to quote; this is for quick iteration on the kernel.
#[test]
#[ignore]
fn kernel_throughput() {
    let (n, k, g) = (4096, 5120, 128);
    let c = case(128, n, k, g, 9);
    let prepared = c.prepared();
    let w = c.weight(&prepared);
    let xb: Vec<bf16> = c.x.iter().map(|&v| bf16::from_f32(v)).collect();
    let mut y = vec![bf16::ZERO; 128 * n];
    let variants: Vec<Variant> = [Variant::Avx2, Variant::Avx512, Variant::Amx]
        .into_iter()
        .filter(|v| v.is_supported())
        .collect();
    for (precision, ms) in [
        (
            Precision::Int8Group,
            &[1usize, 2, 4, 8, 16, 32, 64, 128][..],
        ),
        (Precision::Exact, &[1, 4, 16][..]),
    ] {
        for (&m, &variant) in ms.iter().flat_map(|m| variants.iter().map(move |v| (m, v))) {
            let reps = 20;
            gemm(
                w,
                &xb[..m * k],
                m,
                None,
                &mut y[..m * n],
                KernelChoice { variant, precision },
                &crate::threads::Serial,
            )
            .unwrap();
            let t = std::time::Instant::now();
            for _ in 0..reps {
                gemm(
                    w,
                    &xb[..m * k],
                    m,
                    None,
                    &mut y[..m * n],
                    KernelChoice { variant, precision },
                    &crate::threads::Serial,
                )
                .unwrap();
            }
            let dt = t.elapsed().as_secs_f64() / reps as f64;
            println!(
                "{:6} {precision:?} M={m:3}: {:6.1} G weights/s, {:6.1} G weight-tokens/s, {:5.2} GB/s packed",
                variant.name(),
                (n * k) as f64 / dt / 1e9,
                (m * n * k) as f64 / dt / 1e9,
                (prepared.0.len() + 2 * prepared.1.len()) as f64 / dt / 1e9
            );
        }
    }
}

#[test]
fn dense_bf16_decode_is_codes_times_bf16_scales() {
    for &(n, k, g) in &[(7, 96, 32), (9, 256, 64), (5, 640, 128), (12, 512, 256)] {
        let c = case(1, n, k, g, 7);
        let p = c.prepared();
        let w = c.weight(&p);
        let mut out = vec![bf16::ZERO; n * k];
        dense::decode_blocks_bf16(&w, 0..layout::row_blocks(n), &mut out, &Rayon).unwrap();
        let cw = c.canonical();
        for r in 0..n {
            for col in 0..k {
                let s = bf16::from_f32(cw.scale(r, col).to_f32()).to_f32();
                let want = cw.trit(r, col) as f32 * s;
                assert_eq!(
                    out[r * k + col].to_f32(),
                    want,
                    "n{n} k{k} g{g} at [{r}, {col}]"
                );
            }
        }
        // One block alone decodes the same rows; a wrong output length is an error, not a panic.
        let rows = (2 * ROWS).min(n) - ROWS;
        let mut part = vec![bf16::ZERO; rows * k];
        dense::decode_blocks_bf16(&w, 1..2, &mut part, &Rayon).unwrap();
        assert_eq!(part, out[ROWS * k..(ROWS + rows) * k]);
        assert!(dense::decode_blocks_bf16(&w, 0..1, &mut part[..k], &Rayon).is_err());
    }
}

#[test]
fn bf16_output_rounding_is_half_s() {
    // Every kernel's bf16 results go through `Activation::from_f32_slice`: ties to even, NaN quiet,
    // overflow to infinity, subnormals, and lengths around the 16-lane step, against half's scalar.
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut vals: Vec<f32> = [
        0x3F80_8000u32, // tie, even below: stays
        0x3F81_8000,    // tie, odd below: rounds up
        0x3F80_8001,
        0x7F7F_FFFF, // rounds to infinity
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0001, // signalling NaN: quiet bit set
        0xFFC0_1234,
        0x0000_8000, // subnormal tie
        0x8000_0000,
        0x0001_8000,
    ]
    .iter()
    .map(|&b| f32::from_bits(b))
    .collect();
    for _ in 0..4000 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        vals.push(f32::from_bits(seed as u32));
    }
    for len in [0, 1, 15, 16, 17, 33, vals.len()] {
        let src = &vals[..len];
        let mut got = vec![bf16::ZERO; len];
        <bf16 as Activation>::from_f32_slice(src, &mut got);
        for (i, (&g, &x)) in got.iter().zip(src).enumerate() {
            assert_eq!(
                g.to_bits(),
                bf16::from_f32(x).to_bits(),
                "[{i}] {:#010x}",
                x.to_bits()
            );
        }
    }
}

/// Outputs of at least `STREAM_Y_MIN_BYTES` leave the AMX paths through non-temporal stores (whole
/// aligned lines; the rest as before): every element written, as the scalar kernel computes it, with
/// bias, for aligned rows (n = 2048) and rows that are not (n = 2068, partial last row group), on
/// 16- and 8-token tiles.
#[test]
fn amx_streamed_outputs_match_scalar() {
    if !Variant::Amx.is_supported() {
        eprintln!("no AMX here: nothing to test");
        return;
    }
    fn aligned<T: Activation>(len: usize) -> Vec<T> {
        vec![T::default(); len + 64]
    }
    fn window<T: Activation>(buf: &mut [T], len: usize) -> &mut [T] {
        let off = (64 - buf.as_ptr() as usize % 64) % 64 / std::mem::size_of::<T>();
        &mut buf[off..off + len]
    }
    for &(m, n) in &[(70, 2048), (70, 2068), (8, 16384)] {
        let (k, g) = (256, 128);
        let c = case(m, n, k, g, 23 + n as u64);
        let planes = c.prepared();
        let w = c.weight(&planes);
        assert!(m * n * 2 >= STREAM_Y_MIN_BYTES);
        let xb: Vec<bf16> = c.x.iter().map(|&v| bf16::from_f32(v)).collect();
        let bb: Vec<bf16> = c.bias.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut outs = vec![];
        for v in [Variant::Scalar, Variant::Amx] {
            let mut buf = aligned::<bf16>(m * n);
            let y = window(&mut buf, m * n);
            gemm(
                w,
                &xb,
                m,
                Some(&bb),
                y,
                KernelChoice {
                    variant: v,
                    precision: Precision::Int8Group,
                },
                &Rayon,
            )
            .unwrap();
            outs.push(y.to_vec());
            let mut buf = aligned::<f32>(m * n);
            let yf = window(&mut buf, m * n);
            gemm(
                w,
                &c.x,
                m,
                Some(&c.bias),
                yf,
                KernelChoice {
                    variant: v,
                    precision: Precision::Int8Group,
                },
                &Rayon,
            )
            .unwrap();
            outs.push(yf.iter().map(|&v| bf16::from_f32(v)).collect());
        }
        // outs: scalar bf16, scalar f32, AMX bf16, AMX f32.
        for (dtype, scalar, amx) in [("bf16", &outs[0], &outs[2]), ("f32", &outs[1], &outs[3])] {
            for (i, (a, b)) in scalar.iter().zip(amx).enumerate() {
                let (a, b) = (a.to_f32(), b.to_f32());
                assert!(
                    (a - b).abs() <= 2f32.powi(-7) * a.abs().max(1.0),
                    "{dtype} m{m} n{n} [{i}]: {a} vs {b}"
                );
            }
        }
    }
}

/// The wide kernel's numerics written out in scalar code: per (token, row), `v = fma(f32(Σ_{k∈g} t·q),
/// f32(s) · xs, v)` group after group from 0, plus bias (the AMX epilogue's order too).
fn wide_model(c: &Case, m: usize, precision: Precision, bias: bool) -> Vec<f32> {
    let (k, g) = (c.k, c.g);
    let kp = layout::padded_cols(k);
    let gp = layout::padded_groups(k, g);
    let w = c.canonical();
    let mut y = vec![0f32; m * c.n];
    for mi in 0..m {
        let mut xf = vec![0f32; kp];
        xf[..k].copy_from_slice(&c.x[mi * k..(mi + 1) * k]);
        let (mut q, mut xs4, mut qsum4) = (vec![0i8; kp], vec![0f32; gp * 4], vec![0f32; gp * 4]);
        quantize_row(
            &xf,
            &mut q,
            g,
            precision == Precision::Int8Token,
            &mut xs4,
            &mut qsum4,
        );
        for nn in 0..c.n {
            let mut v = 0f32;
            for gi in 0..k / g {
                let sum: i32 = (gi * g..(gi + 1) * g)
                    .map(|kk| w.trit(nn, kk) as i32 * q[kk] as i32)
                    .sum();
                let cs = w.scale(nn, gi * g).to_f32() * xs4[gi * 4];
                v = (sum as f32).mul_add(cs, v);
            }
            y[mi * c.n + nn] = v + if bias { c.bias[nn] } else { 0.0 };
        }
    }
    y
}

/// (N, K, g) of the bit-equality tests of the rows-in-lanes kernels: partial 16- and 32-row groups, odd N,
/// partial chunks, every group size.
const BIT_EQUALITY_SHAPES: [(usize, usize, usize); 8] = [
    (1, 96, 32),
    (5, 1280, 64),
    (17, 640, 128),
    (33, 2304, 256),
    (37, 544, 32),
    (16, 1024, 128),
    (3, 768, 256),
    (21, 192, 64),
];

/// The token counts tried on shape `si`: every M = 1..9, 16 and 20, a third of the rest.
fn bit_equality_ms(si: usize) -> impl Iterator<Item = usize> {
    (1..=20).filter(move |&m| (m + si).is_multiple_of(3) || m <= 9 || m == 16 || m == 20)
}

/// The rows-in-lanes AVX-512 kernel (forced at every M = 1..20) and the AMX tiles (from
/// `AMX_MIN_M` tokens; the rows-in-lanes kernel below) equal their one scalar model bit for bit:
/// partial 16- and 32-row groups, odd N, partial chunks, every group size, both int8 modes, token
/// counts that split into several passes or tiles, with and without bias, single- and multi-threaded.
#[test]
fn wide_int8_matches_its_scalar_model_bit_for_bit() {
    if !Variant::Avx512.is_supported() {
        eprintln!("no AVX-512 VNNI here: nothing to test");
        return;
    }
    WIDE_MIN_M_OVERRIDE.with(|o| o.set(Some(1)));
    for (si, &(n, k, g)) in BIT_EQUALITY_SHAPES.iter().enumerate() {
        for m in bit_equality_ms(si) {
            let c = case(m, n, k, g, 100 + (si * 20 + m) as u64);
            let planes = c.prepared();
            for precision in [Precision::Int8Group, Precision::Int8Token] {
                for bias in [false, true] {
                    let want = wide_model(&c, m, precision, bias);
                    let b = bias.then_some(&c.bias[..]);
                    for v in [Variant::Avx512, Variant::Amx] {
                        if !v.is_supported() {
                            continue;
                        }
                        let got = c.run(&c.x, b, v, precision, &planes);
                        for (i, (a, w)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                w.to_bits(),
                                "{v:?} {precision:?} m{m} n{n} k{k} g{g} bias {bias} [{i}]: {a} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
    // Parallel split over 16-row groups (N·K above PARALLEL_MIN_WEIGHTS), bf16 in and out: one row
    // group per pass (M = 7) and pairs of them (M ≥ wide::PAIR_MIN_M), ranges of odd length included.
    check_parallel_bf16(Layout::Rows4, &[Variant::Avx512, Variant::Amx], &[7, 19]);
    WIDE_MIN_M_OVERRIDE.with(|o| o.set(None));
}

/// The rows-in-lanes layout: every variant (the AVX-512 lanes kernel, or the plain reference on the
/// others) equals the wide kernel's scalar model bit for bit at every M = 1..20 — the same numbers for
/// a token whatever batch it is in — on partial row groups, odd N, every group size, both int8 modes,
/// with and without bias; in parallel with bf16 in and out; the exact mode within its float64 bound.
#[test]
fn lanes_int8_matches_the_wide_model_bit_for_bit() {
    for (si, &(n, k, g)) in BIT_EQUALITY_SHAPES.iter().enumerate() {
        for m in bit_equality_ms(si) {
            let c = case(m, n, k, g, 300 + (si * 20 + m) as u64);
            let planes = c.prepared_in(Layout::Lanes16);
            for precision in [Precision::Int8Group, Precision::Int8Token] {
                for bias in [false, true] {
                    let want = wide_model(&c, m, precision, bias);
                    let b = bias.then_some(&c.bias[..]);
                    for v in supported() {
                        let got = c.run_in(&c.x, b, v, precision, &planes, Layout::Lanes16);
                        for (i, (a, w)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                w.to_bits(),
                                "{v:?} {precision:?} m{m} n{n} k{k} g{g} bias {bias} [{i}]: {a} vs {w}"
                            );
                        }
                    }
                }
            }
        }
        check_exact_f32_in(3, n, k, g, 7 + si as u64, Layout::Lanes16);
        // The exact modes: the AVX-512 lanes kernel equals the plain reference bit for bit, NaN included.
        for m in [1, 5, 9] {
            let mut c = case(m, n, k, g, 500 + si as u64);
            c.x[k / 2] = f32::NAN;
            let planes = c.prepared_in(Layout::Lanes16);
            let want = c.run_in(
                &c.x,
                Some(&c.bias),
                Variant::Scalar,
                Precision::Exact,
                &planes,
                Layout::Lanes16,
            );
            assert!(want[..n].iter().all(|v| v.is_nan()) && want[n..].iter().all(|v| !v.is_nan()));
            for v in supported() {
                let got = c.run_in(
                    &c.x,
                    Some(&c.bias),
                    v,
                    Precision::Exact,
                    &planes,
                    Layout::Lanes16,
                );
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                        "{v:?} exact m{m} n{n} k{k} g{g} [{i}]: {a} vs {b}"
                    );
                }
            }
        }
    }
    // Parallel split over row groups (N·K above PARALLEL_MIN_WEIGHTS), bf16 in and out: one row group
    // per pass (M = 1, 7) and two passes (M = 19), ranges of odd length included.
    check_parallel_bf16(Layout::Lanes16, &supported(), &[1, 7, 19]);
}

/// A 1100 × 1024 weight (split over threads; odd ranges of 16-row groups) with bf16 x, bias and y in the
/// int8 group mode: `variants` (the unsupported ones skipped) equal the wide model rounded to bf16, bit for
/// bit, at each M of `ms`.
fn check_parallel_bf16(layout: Layout, variants: &[Variant], ms: &[usize]) {
    for &m in ms {
        let (n, k, g) = (1100, 1024, 128);
        let c = case(m, n, k, g, 5);
        let planes = c.prepared_in(layout);
        let xb: Vec<bf16> = c.x.iter().map(|&v| bf16::from_f32(v)).collect();
        let xq: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        let bq: Vec<f32> = c.bias.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let cq = Case {
            x: xq,
            bias: bq,
            ..c
        };
        let want_b: Vec<bf16> = wide_model(&cq, m, Precision::Int8Group, true)
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        let bias_b: Vec<bf16> = cq.bias.iter().map(|&v| bf16::from_f32(v)).collect();
        for &v in variants.iter().filter(|v| v.is_supported()) {
            let got = cq.run_in(
                &xb,
                Some(&bias_b[..]),
                v,
                Precision::Int8Group,
                &planes,
                layout,
            );
            assert_eq!(want_b.len(), got.len());
            for (i, (a, w)) in got.iter().zip(&want_b).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    w.to_bits(),
                    "{v:?} {layout:?} parallel bf16 m{m} [{i}]: {a} vs {w}"
                );
            }
        }
    }
}

/// A rows-in-lanes weight is refused where row blocks are read (the MoE kernel, the bf16 decode) and
/// checked against its own layout's sizes.
#[test]
fn lanes_weights_are_refused_where_row_blocks_are_read() {
    let c = case(1, 40, 256, 128, 9);
    let planes = c.prepared_in(Layout::Lanes16);
    let w = c.weight_in(&planes, Layout::Lanes16);
    w.check().unwrap();
    let e = c
        .weight_in(&planes, Layout::Rows4)
        .check()
        .unwrap_err()
        .to_string();
    assert!(e.contains("rows4"), "{e}");
    let mut out = vec![bf16::ZERO; 40 * 256];
    let e = dense::decode_blocks_bf16(&w, 0..1, &mut out, &Rayon)
        .unwrap_err()
        .to_string();
    assert!(e.contains("lanes16") && e.contains("rows4"), "{e}");
    let experts = moe::Experts {
        w13: std::slice::from_ref(&w),
        w2: std::slice::from_ref(&w),
    };
    let e = experts.check().unwrap_err().to_string();
    assert!(e.contains("MoE") && e.contains("lanes16"), "{e}");
}

/// Every variant and both int8 modes at M = 1..20 against float64 (the quantization bound) and the
/// scalar reference, on shapes with partial groups of every kind (odd N, partial chunks).
#[test]
fn int8_every_m_to_20() {
    for precision in [Precision::Int8Group, Precision::Int8Token] {
        for m in 1..=20 {
            let (n, k, g) = [(19, 1280, 64), (37, 768, 256), (5, 544, 32), (33, 640, 128)][m % 4];
            check_int8(m, n, k, g, 40 + m as u64, precision);
        }
    }
}

/// Every token-tile size with every group size, K past one column panel of the AVX2 GEMV (8
/// superblocks) with a partial last panel: each (tile, group size) is its own monomorphized loop there.
#[test]
fn int8_every_tile_and_group_size_across_panels() {
    for precision in [Precision::Int8Group, Precision::Int8Token] {
        for m in 1..=INT8_TILE {
            for g in GROUP_SIZES_FOR_TEST {
                check_int8(m, 9, 2304, g, 90 + (m * g) as u64, precision);
            }
        }
    }
}

/// The small-M int8 GEMV unpacking with GFNI equals the one unpacking with shifts bit for bit (every
/// token count and group size): CPUs without GFNI, and AMD's (`avx512::gfni_unpack_pays`), run the
/// second, so the variant tests above run only one of them on any one machine.
#[cfg(target_arch = "x86_64")]
#[test]
fn int8_gfni_unpack_matches_shift_unpack_bit_for_bit() {
    if !(avx512::is_supported() && avx512::has_gfni()) {
        eprintln!("no AVX-512 VNNI + GFNI here: nothing to compare");
        return;
    }
    let mut st = 0x5EED_u64;
    for &g in &[32usize, 64, 128, 256] {
        for &kp in &[256usize, 512, 1280] {
            let block: Vec<u8> = (0..kp).map(|_| xorshift(&mut st) as u8).collect();
            let xs: Vec<Vec<i8>> = (0..INT8_TILE)
                .map(|_| (0..kp).map(|_| xorshift(&mut st) as i8).collect())
                .collect();
            let cs: Vec<f32> = (0..INT8_TILE * (kp / g) * ROWS)
                .map(|_| (xorshift(&mut st) % 2000) as f32 / 997.0 - 1.0)
                .collect();
            let args = Int8Tile {
                block: &block,
                x: std::array::from_fn(|t| &xs[t][..]),
                cs: &cs,
                group_size: g,
            };
            let shifts = [
                avx512::int8::<1>,
                avx512::int8::<2>,
                avx512::int8::<3>,
                avx512::int8::<4>,
            ];
            let gfni = [
                avx512::int8_gfni::<1>,
                avx512::int8_gfni::<2>,
                avx512::int8_gfni::<3>,
                avx512::int8_gfni::<4>,
            ];
            for t in 0..INT8_TILE {
                // SAFETY: AVX-512 VNNI and GFNI checked above; block, x and cs have the lengths
                // `Int8Tile` promises for kp and g.
                let (a, b) = unsafe { (shifts[t](&args), gfni[t](&args)) };
                for tok in 0..=t {
                    for r in 0..ROWS {
                        assert_eq!(
                            a[tok][r].to_bits(),
                            b[tok][r].to_bits(),
                            "g{g} kp{kp} T{} token {tok} row {r}: {} vs {}",
                            t + 1,
                            a[tok][r],
                            b[tok][r]
                        );
                    }
                }
            }
        }
    }
}

/// The per-expert composition [`moe::moe`] must equal: sorted pairs, one [`gemm`] per expert and
/// projection, SiLU-and-mul in f32 rounded once, slot-order f32 sums rounded once.
fn moe_by_expert<T: Activation>(
    w13: &[PreparedRef<'_>],
    w2: &[PreparedRef<'_>],
    x: &[T],
    routing: &moe::Routing<'_>,
    choice: KernelChoice,
) -> Vec<T> {
    let (ids, weights, top_k) = (routing.ids, routing.weights, routing.top_k);
    let on_input = routing.weight_on_input;
    let (hidden, inter) = (w13[0].cols, w13[0].rows / 2);
    let m = x.len() / hidden;
    let mut out_of_pair = vec![Vec::new(); ids.len()];
    for e in 0..w13.len() {
        let pairs: Vec<usize> = (0..ids.len()).filter(|&p| ids[p] as usize == e).collect();
        if pairs.is_empty() {
            continue;
        }
        let mut xe = vec![T::default(); pairs.len() * hidden];
        let mut f = vec![0f32; 2 * inter.max(hidden)];
        for (row, &p) in xe.chunks_exact_mut(hidden).zip(&pairs) {
            let src = &x[(p / top_k) * hidden..][..hidden];
            T::to_f32_slice(src, &mut f[..hidden]);
            let s = if on_input { weights[p] } else { 1.0 };
            f[..hidden].iter_mut().for_each(|v| *v *= s);
            T::from_f32_slice(&f[..hidden], row);
        }
        let mut h = vec![T::default(); pairs.len() * 2 * inter];
        gemm(w13[e], &xe, pairs.len(), None, &mut h, choice, &Rayon).unwrap();
        let mut a = vec![T::default(); pairs.len() * inter];
        for (hr, ar) in h.chunks_exact(2 * inter).zip(a.chunks_exact_mut(inter)) {
            T::to_f32_slice(hr, &mut f[..2 * inter]);
            let (gate, up) = f[..2 * inter].split_at_mut(inter);
            for (g, u) in gate.iter_mut().zip(up.iter()) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
            T::from_f32_slice(gate, ar);
        }
        let mut o = vec![T::default(); pairs.len() * hidden];
        gemm(w2[e], &a, pairs.len(), None, &mut o, choice, &Rayon).unwrap();
        for (row, &p) in o.chunks_exact(hidden).zip(&pairs) {
            out_of_pair[p] = row.to_vec();
        }
    }
    let mut y = vec![T::default(); m * hidden];
    let (mut acc, mut f) = (vec![0f32; hidden], vec![0f32; hidden]);
    for t in 0..m {
        acc.fill(0.0);
        for j in 0..top_k {
            let p = t * top_k + j;
            T::to_f32_slice(&out_of_pair[p], &mut f);
            let w = if on_input { 1.0 } else { weights[p] };
            acc.iter_mut().zip(&f).for_each(|(a, v)| *a += v * w);
        }
        T::from_f32_slice(&acc, &mut y[t * hidden..(t + 1) * hidden]);
    }
    y
}

#[test]
fn moe_matches_per_expert_gemms_bit_for_bit() {
    // 5 experts, one never routed; token counts per expert reach the AMX / wide tilings at m = 20
    // (expert 0 takes every token's first slot); the parallel region is used from a few tokens.
    let (n_expert, hidden, inter) = (5, 512, 256);
    let up: Vec<Case> = (0..n_expert)
        .map(|e| case(0, 2 * inter, hidden, 128, 40 + e as u64))
        .collect();
    let down: Vec<Case> = (0..n_expert)
        .map(|e| case(0, hidden, inter, 64, 50 + e as u64))
        .collect();
    let (p13, p2): (Vec<_>, Vec<_>) = (
        up.iter().map(Case::prepared).collect(),
        down.iter().map(Case::prepared).collect(),
    );
    let w13: Vec<PreparedRef<'_>> = up.iter().zip(&p13).map(|(c, p)| c.weight(p)).collect();
    let w2: Vec<PreparedRef<'_>> = down.iter().zip(&p2).map(|(c, p)| c.weight(p)).collect();
    let experts = moe::Experts { w13: &w13, w2: &w2 };
    for (m, top_k, on_input) in [
        (1, 2, false),
        (3, 2, false),
        (9, 2, false),
        (20, 2, false),
        (6, 1, true),
    ] {
        let xin = case(m, 1, hidden, 128, 60 + m as u64).x;
        let mut st = 77 + m as u64;
        let ids: Vec<i32> = (0..m * top_k)
            .map(|p| {
                if p % top_k == 0 {
                    0
                } else {
                    1 + (xorshift(&mut st) % 3) as i32
                }
            })
            .collect();
        let weights: Vec<f32> = (0..m * top_k)
            .map(|p| 0.25 + 0.1 * (p % 5) as f32)
            .collect();
        let routing = moe::Routing {
            ids: &ids,
            weights: &weights,
            top_k,
            weight_on_input: on_input,
        };
        for variant in supported() {
            for precision in [Precision::Int8Group, Precision::Int8Token, Precision::Exact] {
                let choice = KernelChoice { variant, precision };
                let xb: Vec<bf16> = xin.iter().map(|&v| bf16::from_f32(v)).collect();
                let mut yb = vec![bf16::ZERO; m * hidden];
                moe::moe(&experts, &xb, m, &routing, &mut yb, choice, &Rayon).unwrap();
                let want = moe_by_expert(&w13, &w2, &xb, &routing, choice);
                let same = yb
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "bf16 m={m} top_k={top_k} {variant:?} {precision:?}");
                let mut yf = vec![0f32; m * hidden];
                moe::moe(&experts, &xin, m, &routing, &mut yf, choice, &Rayon).unwrap();
                let want = moe_by_expert(&w13, &w2, &xin, &routing, choice);
                let same = yf
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "f32 m={m} top_k={top_k} {variant:?} {precision:?}");
            }
        }
    }
}

#[test]
fn moe_refuses_bad_routing_and_mismatched_experts() {
    let up = case(0, 128, 256, 64, 1);
    let down = case(0, 256, 64, 64, 2);
    let odd = case(0, 256, 128, 64, 3);
    let (pu, pd, po) = (up.prepared(), down.prepared(), odd.prepared());
    let (w13, w2) = (
        [up.weight(&pu), up.weight(&pu)],
        [down.weight(&pd), down.weight(&pd)],
    );
    let choice = KernelChoice {
        variant: Variant::Scalar,
        precision: Precision::Int8Group,
    };
    let x = vec![0.5f32; 2 * 256];
    let mut y = vec![0f32; 2 * 256];
    let run = |w13: &[PreparedRef<'_>], w2: &[PreparedRef<'_>], ids: &[i32], y: &mut [f32]| {
        let routing = moe::Routing {
            ids,
            weights: &[0.5; 4][..ids.len()],
            top_k: 2,
            weight_on_input: false,
        };
        moe::moe(
            &moe::Experts { w13, w2 },
            &x,
            2,
            &routing,
            y,
            choice,
            &Rayon,
        )
        .map_err(|e| e.to_string())
    };
    let err = run(&w13, &w2, &[0, 1, 1, 2], &mut y).unwrap_err();
    assert!(
        err.contains("expert id 2 (token 1, slot 1) is outside [0, 2)"),
        "{err}"
    );
    let err = run(&w13, &w2, &[0, -1, 1, 0], &mut y).unwrap_err();
    assert!(err.contains("expert id -1 (token 0, slot 1)"), "{err}");
    let err = run(&w13, &w2, &[0, 1], &mut y).unwrap_err();
    assert!(err.contains("2 ids and 2 weights"), "{err}");
    let err = run(
        &w13,
        &[down.weight(&pd), odd.weight(&po)],
        &[0, 1, 1, 0],
        &mut y,
    )
    .unwrap_err();
    assert!(
        err.contains("MoE expert 1 has weights [128, 256] g64 and [256, 128] g64"),
        "{err}"
    );
    let err = run(&w13, &w2, &[0, 1, 1, 0], &mut y[..10]).unwrap_err();
    assert!(err.contains("y 10 elements"), "{err}");
    run(&w13, &w2, &[0, 1, 1, 0], &mut y).unwrap();
    assert!(y.iter().all(|v| v.is_finite()));
}

/// The per-row int8 kernel alone on one row block (K = 14336, hot in L1/L2), per group and tile size: its own
/// rate without quantization, prepass or stores (by hand: `cargo test --release -p ternary-core
/// int8_kernel_alone -- --ignored --nocapture`).
#[test]
#[ignore]
fn int8_kernel_alone() {
    for g in [32, 64, 128, 256] {
        let (n, k) = (4, 14336);
        let c = case(4, n, k, g, 3);
        let prepared = c.prepared();
        let q: Vec<i8> = (0..4 * k).map(|i| ((i * 37) % 255) as i8).collect();
        let cs = vec![0.5f32; 4 * (k / g) * ROWS];
        for v in supported().into_iter().filter(|&v| v != Variant::Scalar) {
            let kern = v.kernels().unwrap();
            for t in 1..=INT8_TILE {
                let x: [&[i8]; INT8_TILE] = std::array::from_fn(|i| &q[i * k..(i + 1) * k]);
                let a = Int8Tile {
                    block: &prepared.0,
                    x,
                    cs: &cs,
                    group_size: g,
                };
                let reps = 200_000;
                let t0 = std::time::Instant::now();
                let mut s = 0f32;
                for _ in 0..reps {
                    s += unsafe { (kern.int8[t - 1])(std::hint::black_box(&a)) }[0][0];
                }
                let dt = t0.elapsed().as_secs_f64() / reps as f64;
                println!(
                    "{:7} g{g} T={t}: {:6.1} G weight-tokens/s ({s})",
                    v.name(),
                    (ROWS * k * t) as f64 / dt / 1e9
                );
            }
        }
    }
}
