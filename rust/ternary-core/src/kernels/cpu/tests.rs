//! Kernel tests: every supported variant and precision against a float64 reference computed straight
//! from the canonical codes (never from the bit-planes), and SIMD variants against the scalar one.

#![allow(clippy::needless_range_loop)]

use half::{bf16, f16};
use proptest::prelude::*;

use super::*;
use crate::canonical::CanonicalRef;

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

    fn run<T: Activation + Default + Clone>(
        &self,
        x: &[T],
        bias: Option<&[T]>,
        variant: Variant,
        precision: Precision,
        planes: &[u8],
    ) -> Vec<T> {
        let m = x.len() / self.k;
        let mut y = vec![T::default(); m * self.n];
        let w = PreparedRef {
            rows: self.n,
            cols: self.k,
            group_size: self.g,
            planes,
            scales: &self.scales,
        };
        gemm(w, x, m, bias, &mut y, variant, precision).unwrap();
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
    let c = case(m, n, k, g, seed);
    let planes = layout::prepare(c.canonical(), "w").unwrap();
    let (want, mag) = c.reference(&c.x, true);
    let mut scalar_out = None;
    for v in supported() {
        let got = c.run(&c.x, Some(&c.bias), v, Precision::Exact, &planes);
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

#[test]
fn int8_within_quantization_bound() {
    for &(m, n, k, g) in &[
        (1, 5, 32, 32),
        (2, 9, 96, 32),
        (1, 33, 512, 128),
        (3, 7, 768, 256),
        (1, 6, 192, 64),
    ] {
        let c = case(m, n, k, g, 7 + n as u64);
        let planes = layout::prepare(c.canonical(), "w").unwrap();
        let (want, _) = c.reference(&c.x, false);
        let mut outs = vec![];
        for v in supported() {
            let got = c.run(&c.x, None, v, Precision::Int8, &planes);
            for mi in 0..m {
                let xr = &c.x[mi * k..(mi + 1) * k];
                let xs = xr.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                for nn in 0..n {
                    let l1: f64 = (0..k)
                        .map(|kk| {
                            (c.canonical().trit(nn, kk) as f64
                                * c.canonical().scale(nn, kk).to_f64())
                            .abs()
                        })
                        .sum();
                    let i = mi * n + nn;
                    let tol = xs / 2.0 * l1 * 1.0001 + 1e-4 * want[i].abs() + 1e-6;
                    assert!(
                        (got[i] as f64 - want[i]).abs() <= tol,
                        "{v:?} int8 [{i}] {} vs {}",
                        got[i],
                        want[i]
                    );
                }
            }
            outs.push(got);
        }
        // Integer sums are identical across variants; only the f32 combination order differs.
        for o in &outs[1..] {
            for (a, b) in o.iter().zip(&outs[0]) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }
}

#[test]
fn half_dtypes_round_once() {
    let (m, n, k, g) = (2, 11, 256, 64);
    let c = case(m, n, k, g, 3);
    let planes = layout::prepare(c.canonical(), "w").unwrap();
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
    let planes = layout::prepare(c.canonical(), "w").unwrap();
    let w = PreparedRef {
        rows: 4,
        cols: 64,
        group_size: 32,
        planes: &planes,
        scales: &c.scales,
    };
    let mut y = vec![0f32; 4];
    assert!(gemm(
        w,
        &c.x[..63],
        1,
        None,
        &mut y,
        Variant::Scalar,
        Precision::Exact
    )
    .is_err());
    assert!(gemm(
        w,
        &c.x,
        1,
        Some(&c.bias[..3]),
        &mut y,
        Variant::Scalar,
        Precision::Exact
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
        Variant::Scalar,
        Precision::Exact
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
        Variant::Scalar,
        Precision::Exact
    )
    .is_err());
    assert!(Variant::parse("neon").is_err());
    assert_eq!(Variant::parse("auto").unwrap(), Variant::best());
}

#[test]
fn nan_activation_propagates() {
    let c = case(1, 3, 64, 32, 2);
    let planes = layout::prepare(c.canonical(), "w").unwrap();
    let mut x = c.x.clone();
    x[5] = f32::NAN;
    for v in supported() {
        for p in [Precision::Exact, Precision::Int8] {
            let y = c.run(&x, None, v, p, &planes);
            // Rows whose weight at column 5 is nonzero must be NaN in exact mode; int8 poisons the row.
            for nn in 0..3 {
                if p == Precision::Int8 || c.canonical().trit(nn, 5) != 0 {
                    assert!(y[nn].is_nan(), "{v:?} {p:?} row {nn}");
                }
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

/// Throughput of the inner loops on cache-resident weights (run by hand:
/// `cargo test --release -p ternary-core kernel_throughput -- --ignored --nocapture`).
#[test]
#[ignore]
fn kernel_throughput() {
    let (n, k, g) = (64, 4096, 128);
    let c = case(1, n, k, g, 9);
    let planes = layout::prepare(c.canonical(), "w").unwrap();
    let w = PreparedRef {
        rows: n,
        cols: k,
        group_size: g,
        planes: &planes,
        scales: &c.scales,
    };
    let kern = Variant::best().kernels().unwrap();
    let xb: Vec<u16> = c.x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    let mut q = vec![0i8; k];
    let mut nq = vec![0i8; k];
    quantize_row_int8(&c.x, &mut q, &mut nq);
    let reps = 4000;
    // On-CPU time of this thread (ns), so a loaded machine does not skew the numbers.
    let cpu_ns = || -> f64 {
        std::fs::read_to_string("/proc/thread-self/schedstat")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .unwrap_or(f64::NAN)
    };
    let time = |name: &str, f: &dyn Fn(&RowBlock<'_>) -> f32| {
        let t = cpu_ns();
        let mut s = 0f32;
        for _ in 0..reps {
            for b in (0..n).step_by(ROWS) {
                s += f(&w.block(b));
            }
        }
        let dt = (cpu_ns() - t) / 1e9;
        println!(
            "{name:>10}: {:.1} G weights/s ({s})",
            (reps * n * k) as f64 / dt / 1e9
        );
    };
    time("f32 mask", &|b| unsafe { (kern.gemv_exact)(b, &c.x, g)[0] });
    if let Some(f) = kern.gemv_bf16 {
        time("bf16 dot", &|b| unsafe { f(b, &xb, g)[0] });
    }
    time("int8", &|b| unsafe { (kern.gemv_int8)(b, &q, &nq, g)[0] });
    // GEMM micro-kernel alone on L1-resident operands (MACs/s), and the tile decode (weights/s).
    let xs = vec![1.0f32; MICRO_M * TILE_K];
    let ws = vec![0.5f32; ROWS * TILE_K];
    let mut acc = vec![0f32; ACC_WINDOW];
    let t = cpu_ns();
    let calls = 200_000;
    for _ in 0..calls {
        let xa: [&[f32]; MICRO_M] = std::array::from_fn(|i| &xs[i * TILE_K..(i + 1) * TILE_K]);
        let wa: [&[f32]; ROWS] = std::array::from_fn(|r| &ws[r * TILE_K..(r + 1) * TILE_K]);
        unsafe { (kern.micro)(xa, wa, &mut acc) };
    }
    let dt = (cpu_ns() - t) / 1e9;
    let macs = (calls * MICRO_M * ROWS * TILE_K) as f64;
    println!("     micro: {:.1} GMAC/s ({})", macs / dt / 1e9, acc[0]);
    let mut out = vec![0f32; TILE_K];
    let t = cpu_ns();
    let (planes0, scales0) = w.row(0);
    for i in 0..calls {
        unsafe { (kern.decode_row)(planes0, scales0, g, (i % 8) * TILE_K, &mut out) };
    }
    let dt = (cpu_ns() - t) / 1e9;
    println!(
        "    decode: {:.1} G weights/s ({})",
        (calls * TILE_K) as f64 / dt / 1e9,
        out[3]
    );
    // Whole GEMM path, single-threaded (N·K below PARALLEL_MIN_WEIGHTS), M = 128.
    let (m, n, k) = (128, 128, 5120);
    let c = case(m, n, k, g, 10);
    let planes = layout::prepare(c.canonical(), "w").unwrap();
    let w = PreparedRef {
        rows: n,
        cols: k,
        group_size: g,
        planes: &planes,
        scales: &c.scales,
    };
    let mut y = vec![0f32; m * n];
    let t = cpu_ns();
    for _ in 0..20 {
        gemm(w, &c.x, m, None, &mut y, Variant::best(), Precision::Exact).unwrap();
    }
    let dt = (cpu_ns() - t) / 1e9;
    println!(
        "  gemm 128: {:.1} GMAC/s",
        (20 * m * n * k) as f64 / dt / 1e9
    );
}
