//! Every kernel build against the float64 reference, the validation, and the edge cases (empty sequences,
//! split spans, strided rows, NaN).

use half::{bf16, f16};
use proptest::prelude::*;

use super::*;
use crate::threads::Serial;

/// A pool that claims `n` threads (so calls are split as on `n` cores) and runs the pieces in turn.
struct Claims(usize);

impl ParallelFor for Claims {
    fn threads(&self) -> usize {
        self.0
    }
    fn run(&self, n: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        for i in 0..n {
            f(i..i + 1);
        }
    }
}

fn st<'a, T>(
    query: &'a [T],
    query_rows: HeadStrides,
    cache: PagedKvCache<'a, T>,
    batch: DecodeBatch<'a>,
    params: AttentionParams,
) -> DecodeStep<'a, T> {
    DecodeStep {
        query,
        query_rows,
        cache,
        batch,
        params,
    }
}

/// A batch whose block table rows are `width` entries, unpadded.
fn table_of<'a>(seq_lens: &'a [i32], table: &'a [i32], width: usize) -> DecodeBatch<'a> {
    DecodeBatch {
        seq_lens,
        block_table: table,
        blocks_per_seq: width,
        block_table_stride: width,
    }
}

fn kernels() -> Vec<Kernel> {
    [Kernel::Avx512, Kernel::Avx2, Kernel::Portable]
        .into_iter()
        .filter(|k| k.is_supported())
        .collect()
}

/// A tiny deterministic generator (xorshift) for the cases' values.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

struct Case {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    seq_lens: Vec<i32>,
    params: AttentionParams,
}

/// Build the case's cache (blocks shuffled, one spare), a strided query (every other head slot used) and
/// run `kernel`; returns (got as f64, reference, the largest |v| in the cache).
fn run<T: Element + Default>(
    case: &Case,
    kernel: Kernel,
    par: &dyn ParallelFor,
    seed: u64,
) -> (Vec<f64>, Vec<f64>, f64) {
    let mut rng = Rng(seed | 1);
    let (h, kvh, d, bs) = (case.heads, case.kv_heads, case.head_dim, case.block_size);
    let n = case.seq_lens.len();
    let width = case
        .seq_lens
        .iter()
        .map(|&l| (l as usize).div_ceil(bs))
        .max()
        .unwrap_or(0)
        .max(1);
    let blocks = n * width + 1;
    let mut order: Vec<i32> = (0..blocks as i32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    let stride = width + 3; // a padded table row
    let mut table = vec![-1i32; n * stride];
    for i in 0..n {
        for j in 0..width {
            table[i * stride + j] = order[i * width + j];
        }
    }
    let data: Vec<T> = (0..blocks * kvh * 2 * bs * d)
        .map(|_| T::from_f32(rng.unit() * 2.0))
        .collect();
    let cache = PagedKvCache::new(&data, blocks, kvh, bs, d).unwrap();
    let q_rows = HeadStrides {
        tokens: n,
        heads: h,
        token_stride: 2 * h * d + 5,
        head_stride: 2 * d,
    };
    let query: Vec<T> = (0..q_rows.values(d).unwrap())
        .map(|_| T::from_f32(rng.unit() * 3.0))
        .collect();
    let batch = DecodeBatch {
        seq_lens: &case.seq_lens,
        block_table: &table,
        blocks_per_seq: width,
        block_table_stride: stride,
    };
    let out_rows = HeadStrides::contiguous(n, h, d);
    let mut out = vec![T::from_f32(f32::NAN); n * h * d];
    decode_attention_with(
        kernel,
        &st(&query, q_rows, cache, batch, case.params),
        &mut out,
        out_rows,
        par,
    )
    .unwrap();
    let want = decode_attention_reference(&st(&query, q_rows, cache, batch, case.params)).unwrap();
    let vmax = data
        .iter()
        .map(|v| f64::from(v.to_f32()).abs())
        .fold(0.0, f64::max);
    (
        out.iter().map(|v| f64::from(v.to_f32())).collect(),
        want,
        vmax,
    )
}

/// |got − want| ≤ one rounding of the output type + f32 sums (2⁻¹⁸ of the largest value).
fn assert_close(got: &[f64], want: &[f64], vmax: f64, out_ulp: f64, what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = out_ulp * w.abs() + vmax * 2f64.powi(-18);
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: got {g}, want {w} (tolerance {tol})"
        );
    }
}

fn params(window: Option<usize>, softcap: Option<f32>) -> AttentionParams {
    AttentionParams {
        scale: 0.125,
        sliding_window: window,
        softcap,
    }
}

#[test]
fn every_kernel_matches_the_float64_reference() {
    let cases = [
        Case {
            heads: 16,
            kv_heads: 8,
            head_dim: 128,
            block_size: 32,
            seq_lens: vec![1, 37, 100, 0, 64],
            params: params(None, None),
        },
        Case {
            heads: 4,
            kv_heads: 4,
            head_dim: 64,
            block_size: 16,
            seq_lens: vec![300, 5],
            params: params(None, None),
        },
        Case {
            heads: 8,
            kv_heads: 2,
            head_dim: 80,
            block_size: 32,
            seq_lens: vec![90, 41, 2],
            params: params(Some(40), Some(30.0)),
        },
        Case {
            heads: 24,
            kv_heads: 4,
            head_dim: 256,
            block_size: 128,
            seq_lens: vec![700],
            params: params(None, None),
        },
        Case {
            heads: 6,
            kv_heads: 1,
            head_dim: 16,
            block_size: 32,
            seq_lens: vec![1100, 3, 33],
            params: params(Some(1000), None),
        },
    ];
    for (c, case) in cases.iter().enumerate() {
        for kernel in kernels() {
            // one thread, and as if on 8 (sequences split into spans and merged)
            for (par, name) in [
                (&Serial as &dyn ParallelFor, "serial"),
                (&Claims(8), "8 claimed"),
            ] {
                let what = format!("case {c}, {kernel:?}, {name}");
                let (got, want, vmax) = run::<f32>(case, kernel, par, c as u64 + 7);
                assert_close(&got, &want, vmax, 2f64.powi(-22), &format!("{what}, f32"));
                let (got, want, vmax) = run::<bf16>(case, kernel, par, c as u64 + 7);
                assert_close(&got, &want, vmax, 2f64.powi(-8), &format!("{what}, bf16"));
                let (got, want, vmax) = run::<f16>(case, kernel, par, c as u64 + 7);
                assert_close(&got, &want, vmax, 2f64.powi(-11), &format!("{what}, f16"));
            }
        }
    }
}

#[test]
fn splits_happen_where_pairs_are_few_and_cover_every_key_once() {
    let seq_lens = [2000i32, 10, 600];
    let table: Vec<i32> = (0..3 * 63).map(|i| i % 64).collect();
    let data = vec![0f32; 64 * 2 * 2 * 32 * 16];
    let cache = PagedKvCache::new(&data, 64, 2, 32, 16).unwrap();
    let batch = table_of(&seq_lens, &table, 63);
    let rows = HeadStrides::contiguous(3, 4, 16);
    let query = vec![0f32; 3 * 4 * 16];
    let step = st(&query, rows, cache, batch, params(None, None));
    let p = plan(&step, 3 * 64, rows, 8).unwrap();
    // 6 pairs < 32 wanted: split into 6 spans where long enough, never below SPLIT_MIN_KEYS
    for (seq, want) in [(0u32, 6usize), (1, 1), (2, 2)] {
        for kv in 0..2 {
            let mut spans: Vec<(u32, u32)> = p
                .items
                .iter()
                .filter(|i| i.seq == seq && i.kv_head == kv)
                .map(|i| i.keys)
                .collect();
            spans.sort();
            assert_eq!(spans.len(), want, "sequence {seq}");
            assert_eq!(spans[0].0, 0);
            assert_eq!(spans.last().unwrap().1, seq_lens[seq as usize] as u32);
            assert!(spans.windows(2).all(|w| w[0].1 == w[1].0));
        }
    }
    assert!(
        p.items
            .windows(2)
            .all(|w| w[0].keys.1 - w[0].keys.0 >= w[1].keys.1 - w[1].keys.0),
        "longest first"
    );
    // one thread: never split
    let p1 = plan(&step, 3 * 64, rows, 1).unwrap();
    assert_eq!((p1.items.len(), p1.split_items), (6, 0));
}

#[test]
fn empty_sequences_give_zeros_and_nan_stays_in_its_sequence() {
    let (kvh, bs, d) = (1, 16, 16);
    let mut data = vec![0.5f32; 4 * kvh * 2 * bs * d];
    data[0] = f32::NAN; // block 0, key 0
    let cache = PagedKvCache::new(&data, 4, kvh, bs, d).unwrap();
    let seq_lens = [0i32, 3, 5];
    let table = [3i32, 0, 1];
    let batch = table_of(&seq_lens, &table, 1);
    let rows = HeadStrides::contiguous(3, 2, d);
    let query = vec![1f32; 3 * 2 * d];
    for kernel in kernels() {
        let mut out = vec![7f32; 3 * 2 * d];
        decode_attention_with(
            kernel,
            &st(&query, rows, cache, batch, params(None, None)),
            &mut out,
            rows,
            &Serial,
        )
        .unwrap();
        assert!(
            out[..2 * d].iter().all(|&v| v == 0.0),
            "{kernel:?}: no keys → zeros"
        );
        assert!(
            out[2 * d..4 * d].iter().all(|v| v.is_nan()),
            "{kernel:?}: a NaN key poisons its sequence"
        );
        assert!(
            out[4 * d..].iter().all(|&v| v == 0.5),
            "{kernel:?}: others untouched"
        );
    }
}

#[test]
fn bad_arguments_are_errors_that_name_what_is_wrong() {
    let (kvh, bs, d) = (2, 16, 32);
    let data = vec![0f32; 3 * kvh * 2 * bs * d];
    let cache = PagedKvCache::new(&data, 3, kvh, bs, d).unwrap();
    let rows = HeadStrides::contiguous(2, 4, d);
    let query = vec![0f32; 2 * 4 * d];
    let call = |seq_lens: &[i32],
                table: &[i32],
                width: usize,
                p: AttentionParams,
                out_rows: HeadStrides| {
        let mut out = vec![0f32; 4096];
        let batch = DecodeBatch {
            seq_lens,
            block_table: table,
            blocks_per_seq: width,
            block_table_stride: width,
        };
        decode_attention(
            &st(&query, rows, cache, batch, p),
            &mut out,
            out_rows,
            &Serial,
        )
        .unwrap_err()
        .to_string()
    };
    let ok = params(None, None);
    for (err, want) in [
        (
            call(&[20, 5], &[0, 3, 1, 2], 2, ok, rows),
            "sequence 0: block table entry 1 is block 3; the cache has 3 blocks",
        ),
        (
            call(&[20, 5], &[0, 1, -1, 2], 2, ok, rows),
            "sequence 1: block table entry 0 is block -1",
        ),
        (
            call(&[40, 5], &[0, 1, 1, 2], 2, ok, rows),
            "sequence 0: seq_len=40 needs 3 blocks",
        ),
        (
            call(&[-1, 5], &[0, 1, 1, 2], 2, ok, rows),
            "sequence 0 has seq_len=-1",
        ),
        (
            call(&[20, 20], &[0, 1, 2], 2, ok, rows),
            "sequence 1: its 2 blocks lie past the block table's 3 entries",
        ),
        (
            call(
                &[1, 1],
                &[0, 1],
                1,
                ok,
                HeadStrides {
                    head_stride: d / 2,
                    ..rows
                },
            ),
            "make rows of head_dim=32 overlap",
        ),
        (
            call(&[1, 1], &[0, 1], 1, params(Some(0), None), rows),
            "sliding_window=0",
        ),
        (
            call(&[1, 1], &[0, 1], 1, params(None, Some(0.0)), rows),
            "softcap=0 must be positive",
        ),
        (
            call(
                &[1, 1],
                &[0, 1],
                1,
                AttentionParams {
                    scale: f32::NAN,
                    ..ok
                },
                rows,
            ),
            "scale=NaN must be finite",
        ),
        (call(&[1], &[0, 1], 1, ok, rows), "query has 2 tokens"),
    ] {
        assert!(err.contains(want), "{err:?} should contain {want:?}");
    }
    let three = HeadStrides::contiguous(2, 3, d);
    let mut out = vec![0f32; 2 * 3 * d];
    let batch = DecodeBatch {
        seq_lens: &[1, 1],
        block_table: &[0, 1],
        blocks_per_seq: 1,
        block_table_stride: 1,
    };
    let err = decode_attention(
        &st(&query, three, cache, batch, ok),
        &mut out,
        three,
        &Serial,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("3 query heads over 2 KV heads"), "{err}");
    let short = vec![0f32; 10];
    let err = decode_attention(&st(&short, rows, cache, batch, ok), &mut out, rows, &Serial)
        .unwrap_err()
        .to_string();
    assert!(err.contains("query holds 10 values"), "{err}");
    let odd = vec![0f32; 3 * kvh * 2 * bs * 24];
    let c24 = PagedKvCache::new(&odd, 3, kvh, bs, 24).unwrap();
    let r24 = HeadStrides::contiguous(2, 4, 24);
    let err = decode_attention(&st(&query, r24, c24, batch, ok), &mut out, r24, &Serial)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("head_dim=24 must be a positive multiple of 16"),
        "{err}"
    );
    assert!(PagedKvCache::new(&data, 4, kvh, bs, d)
        .unwrap_err()
        .to_string()
        .contains("needs"));
}

proptest! {
    /// Random tables, lengths and windows, valid or not: an answer within tolerance or an error, never a
    /// panic or a read outside the cache.
    #[test]
    fn random_batches_never_panic(seq_lens in prop::collection::vec(-2i32..90, 1..5),
                                  table in prop::collection::vec(-1i32..7, 0..40),
                                  width in 0usize..8, window in 0usize..50, g in 1usize..4) {
        let (kvh, bs, d) = (2, 16, 16);
        let data: Vec<f32> = (0..6 * kvh * 2 * bs * d).map(|i| ((i * 7919) % 13) as f32 / 13.0).collect();
        let cache = PagedKvCache::new(&data, 6, kvh, bs, d).unwrap();
        let n = seq_lens.len();
        let rows = HeadStrides::contiguous(n, kvh * g, d);
        let query: Vec<f32> = (0..n * kvh * g * d).map(|i| ((i * 31) % 7) as f32 - 3.0).collect();
        let batch = DecodeBatch { seq_lens: &seq_lens, block_table: &table, blocks_per_seq: width, block_table_stride: width };
        let p = params((window > 0).then_some(window), None);
        let mut out = vec![0f32; n * kvh * g * d];
        let got = decode_attention(&st(&query, rows, cache, batch, p), &mut out, rows, &Claims(4));
        let want = decode_attention_reference(&st(&query, rows, cache, batch, p));
        prop_assert_eq!(got.is_ok(), want.is_ok());
        if let Ok(want) = want {
            let got: Vec<f64> = out.iter().map(|&v| f64::from(v)).collect();
            assert_close(&got, &want, 1.0, 2f64.powi(-21), "random batch");
        }
    }
}

#[test]
fn padded_strides_give_the_same_bits_as_a_contiguous_cache() {
    let (blocks, kvh, bs, d) = (5, 2, 32, 16);
    let slab = 2 * bs * d;
    let mut rng = Rng(99);
    let dense: Vec<f32> = (0..blocks * kvh * slab).map(|_| rng.unit()).collect();
    // pages padded as vLLM pads hybrid models' attention pages, heads 8 values apart
    let (head_stride, block_stride) = (slab + 8, 2 * (slab + 8) + 40);
    let shape = |block_stride, head_stride| CacheShape {
        blocks,
        block_stride,
        kv_heads: kvh,
        head_stride,
        block_size: bs,
        head_dim: d,
    };
    let mut padded = vec![f32::NAN; (blocks - 1) * block_stride + head_stride + slab];
    for b in 0..blocks {
        for h in 0..kvh {
            let src = &dense[(b * kvh + h) * slab..][..slab];
            padded[b * block_stride + h * head_stride..][..slab].copy_from_slice(src);
        }
    }
    let a = PagedKvCache::new(&dense, blocks, kvh, bs, d).unwrap();
    let b = PagedKvCache::strided(&padded, shape(block_stride, head_stride)).unwrap();
    let seq_lens = [70i32, 33];
    let table = [4i32, 0, 2, 1, 3, 0];
    let batch = table_of(&seq_lens, &table, 3);
    let rows = HeadStrides::contiguous(2, 4, d);
    let query: Vec<f32> = (0..2 * 4 * d).map(|_| rng.unit()).collect();
    for kernel in kernels() {
        let (mut x, mut y) = (vec![0f32; 2 * 4 * d], vec![1f32; 2 * 4 * d]);
        let p = params(None, None);
        decode_attention_with(
            kernel,
            &st(&query, rows, a, batch, p),
            &mut x,
            rows,
            &Serial,
        )
        .unwrap();
        decode_attention_with(
            kernel,
            &st(&query, rows, b, batch, p),
            &mut y,
            rows,
            &Serial,
        )
        .unwrap();
        assert_eq!(x, y, "{kernel:?}");
    }
    // slabs that overlap, or run past the data, are refused
    assert!(PagedKvCache::strided(&padded, shape(block_stride, slab - 1)).is_err());
    assert!(PagedKvCache::strided(&padded, shape(head_stride, head_stride)).is_err());
    assert!(PagedKvCache::strided(&padded[1..], shape(block_stride, head_stride)).is_err());
}
