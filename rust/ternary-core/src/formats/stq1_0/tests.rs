//! STQ1_0: the codebook against its upstream rule, hand-built blocks, fast paths (portable and
//! AVX-512BW) against the scalar reference on any bytes, round trips, shapes, scales, refusals.

use half::f16;
use proptest::prelude::*;

use super::*;
use crate::formats::blocks::{decode_blocks_ref, encode_blocks_ref};

fn xorshift(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

pub(crate) fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n).map(|_| xorshift(&mut s) as u8).collect()
}

/// Canonical bytes → one code per value.
pub(crate) fn unpack(q: &[u8]) -> Vec<u8> {
    q.iter()
        .flat_map(|&b| (0..4).map(move |j| (b >> (2 * j)) & 3))
        .collect()
}

pub(crate) fn pack(codes: &[u8]) -> Vec<u8> {
    codes
        .chunks_exact(4)
        .map(|c| c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6)
        .collect()
}

/// Random blocks (any `qs`/`sign` bytes: every one decodes) with finite scales.
fn random_blocks(n_blocks: usize, seed: u64) -> Vec<u8> {
    let mut data = random_bytes(n_blocks * 42, seed);
    for (i, blk) in data.chunks_exact_mut(42).enumerate() {
        let d = f16::from_f32(if i % 5 == 4 {
            -0.25
        } else {
            0.01 + i as f32 * 0.003
        });
        blk[40..42].copy_from_slice(&d.to_le_bytes());
    }
    data
}

/// Codes of a representable `[rows, cols]` tensor, built group by group from its own rule (one
/// zero lane, independent signs) and the documented lane placement.
pub(crate) fn representable_codes(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut codes = vec![0u8; rows * cols];
    for r in 0..rows {
        for b in 0..cols / 256 {
            for chunk in 0..4 {
                for gloc in 0..16 {
                    let zero = (xorshift(&mut s) % 4) as usize;
                    for p in 0..4 {
                        let c = if p == zero {
                            1
                        } else {
                            2 * (xorshift(&mut s) & 1) as u8
                        };
                        codes[r * cols + 256 * b + 64 * chunk + gloc + 16 * p] = c;
                    }
                }
            }
        }
    }
    codes
}

pub(crate) fn canonical(
    rows: usize,
    cols: usize,
    codes: &[u8],
    scales: Vec<f16>,
) -> CanonicalTernary {
    CanonicalTernary {
        rows,
        cols,
        group_size: 256,
        qweight: pack(codes),
        scales,
    }
}

// ------------------------------------------------------------------------------------ the codebook

#[test]
fn codebook_follows_the_upstream_rule() {
    // ggml-common.h (PR #22836): slot = (zero_pos << 2) | tail, tail bit 0/1 = the 2nd/3rd non-zero
    // lane is −1 (the 1st is +1); sign = 1 flips every non-zero lane; lanes −1/0/+1 → 0b00/01/10.
    for sign in 0..2usize {
        for slot in 0..16usize {
            let (zero, tail) = (slot >> 2, slot & 3);
            let mut trits = [0i8; 4];
            let mut k = 0;
            for (p, t) in trits.iter_mut().enumerate() {
                if p == zero {
                    continue;
                }
                let neg = k > 0 && (tail >> (k - 1)) & 1 == 1;
                *t = if neg { -1 } else { 1 };
                k += 1;
            }
            if sign == 1 {
                trits = trits.map(|t| -t);
            }
            let want = trits
                .iter()
                .enumerate()
                .fold(0u8, |a, (p, &t)| a | (((t + 1) as u8) << (2 * p)));
            assert_eq!(
                CODEBOOK[(sign << 4) | slot],
                want,
                "sign {sign} slot {slot}"
            );
        }
    }
    // The PR's worked examples.
    assert_eq!(CODEBOOK[0], 0xA9);
    assert_eq!(CODEBOOK[16], 0x01);
}

#[test]
fn codebook_is_every_one_zero_pattern_exactly_once() {
    let mut patterns: Vec<u8> = (0..=255u8)
        .filter(|&q| {
            let lanes: Vec<u8> = (0..4).map(|p| (q >> (2 * p)) & 3).collect();
            !lanes.contains(&3) && lanes.iter().filter(|&&c| c == 1).count() == 1
        })
        .collect();
    let mut book = CODEBOOK.to_vec();
    patterns.sort_unstable();
    book.sort_unstable();
    assert_eq!(book, patterns);
    assert_eq!(book.len(), 32);
    for q in 0..=255u8 {
        assert_eq!(representable(q), patterns.contains(&q), "{q:#04x}");
    }
}

// ------------------------------------------------------------------------------------ hand-built blocks

#[test]
fn hand_built_blocks_decode_as_the_upstream_description() {
    // All slots 0 and signs 0 → every group is CODEBOOK[0] = 0xA9 = lanes (0, +1, +1, +1): lane 0
    // of each group (value 64c + gloc, i.e. value % 64 < 16) is zero, everything else +1.
    let mut blk = [0u8; 42];
    blk[40..42].copy_from_slice(&f16::ONE.to_le_bytes());
    let want: Vec<u8> = (0..256).map(|j| if j % 64 < 16 { 1 } else { 2 }).collect();
    let mut codes = [0u8; 256];
    assert_eq!(BlockStq1_0::decode_block_ref(&blk, &mut codes), f16::ONE);
    assert_eq!(codes.to_vec(), want);

    // Sign bit 0 of sign[0] → group 0 is CODEBOOK[16] = lanes (0, −1, −1, −1) at values 0, 16, 32, 48.
    blk[32] = 0x01;
    // Group 17 (chunk 1, gloc 1): high nibble of qs[8] = slot 6 (zero lane 1, 3rd non-zero flipped),
    // sign bit 1 of sign[2] set → lanes (−1, 0, −1, +1) at values 65, 81, 97, 113.
    blk[8] = 0x60;
    blk[34] = 0x02;
    // Group 63 (chunk 3, gloc 15): high nibble of qs[31] = slot 15 (zero lane 3, both flipped),
    // sign 0 → lanes (+1, −1, −1, 0) at values 207, 223, 239, 255.
    blk[31] = 0xF0;
    let mut want = want;
    for j in [16, 32, 48] {
        want[j] = 0;
    }
    for (j, c) in [
        (65, 0),
        (81, 1),
        (97, 0),
        (113, 2),
        (207, 2),
        (223, 0),
        (239, 0),
        (255, 1),
    ] {
        want[j] = c;
    }
    BlockStq1_0::decode_block_ref(&blk, &mut codes);
    assert_eq!(codes.to_vec(), want);
    let mut canon = [0u8; 64];
    BlockStq1_0::unpack_block(&blk, &mut canon);
    assert_eq!(unpack(&canon), want);
    unpack_block_portable(&blk, &mut canon);
    assert_eq!(unpack(&canon), want);
    // And back: the reference and the fast encoder rebuild the bytes.
    let mut enc = [0u8; 42];
    BlockStq1_0::encode_block_ref(&want, f16::ONE, &mut enc);
    assert_eq!(enc, blk);
    BlockStq1_0::pack_block(&pack(&want), f16::ONE, &mut enc);
    assert_eq!(enc, blk);
}

// ------------------------------------------------------------------------------------ fast vs reference

fn check_block_fast_paths(blk: &[u8]) {
    let mut codes = [0u8; 256];
    let d = BlockStq1_0::decode_block_ref(blk, &mut codes);
    assert_eq!(BlockStq1_0::scale(blk).to_bits(), d.to_bits());
    let mut canon = [0u8; 64];
    unpack_block_portable(blk, &mut canon);
    assert_eq!(unpack(&canon), codes, "portable {blk:02x?}");
    if crate::cpu_features::avx512bw_available() {
        let mut simd = [0u8; 64];
        unpack_simd::block(blk, &mut simd);
        assert_eq!(simd, canon, "AVX-512BW {blk:02x?}");
    }
    let mut dispatched = [0u8; 64];
    BlockStq1_0::unpack_block(blk, &mut dispatched);
    assert_eq!(dispatched, canon);
    // Every block a decoder returns is representable and re-encodes to the same bytes.
    let mut enc = [0u8; 42];
    BlockStq1_0::pack_block(&canon, d, &mut enc);
    assert_eq!(&enc[..], blk, "pack(unpack(x)) != x");
    BlockStq1_0::encode_block_ref(&codes, d, &mut enc);
    assert_eq!(&enc[..], blk, "encode_ref(decode_ref(x)) != x");
}

#[test]
fn fast_paths_match_reference_on_any_bytes() {
    for seed in 1..3000u64 {
        check_block_fast_paths(&random_bytes(42, seed));
    }
    for fill in [0x00u8, 0xFF, 0x55, 0xAA, 0x0F, 0xF0] {
        check_block_fast_paths(&[fill; 42]);
    }
}

#[test]
fn tensor_decode_matches_reference_on_odd_shapes() {
    for (rows, blocks) in [
        (1usize, 1usize),
        (1, 3),
        (3, 1),
        (7, 2),
        (5, 5),
        (64, 1),
        (33, 4),
    ] {
        let cols = 256 * blocks;
        let data = random_blocks(rows * blocks, (rows * 131 + blocks) as u64);
        let t = decode("w", &data, rows, cols).unwrap();
        assert_eq!((t.rows, t.cols, t.group_size), (rows, cols, 256));
        let (codes, scales) = decode_blocks_ref::<BlockStq1_0>(&data, rows, cols);
        assert_eq!(unpack(&t.qweight), codes, "[{rows}, {cols}]");
        assert_eq!(t.scales, scales);
        // Re-encode: fast driver = reference = the input bytes.
        assert_eq!(encode("w", t.as_ref()).unwrap(), data);
        assert_eq!(encode_blocks_ref::<BlockStq1_0>(&codes, &scales), data);
    }
}

// ------------------------------------------------------------------------------------ scales and sizes

#[test]
fn non_finite_scales_are_refused_by_block_and_zero_decodes() {
    let (rows, cols) = (3, 512);
    let mut data = random_blocks(6, 9);
    // d = 0 is a valid scale: decodes, values all zero.
    data[40..42].copy_from_slice(&f16::ZERO.to_le_bytes());
    data[42 + 40..42 + 42].copy_from_slice(&f16::NEG_ZERO.to_le_bytes());
    let t = decode("w", &data, rows, cols).unwrap();
    assert_eq!(t.scales[0], f16::ZERO);
    assert!(t.as_ref().dequantize_f32().unwrap()[..512]
        .iter()
        .all(|&v| v == 0.0));
    for (bad, what) in [
        (f16::NAN, "NaN"),
        (f16::INFINITY, "+Inf"),
        (f16::NEG_INFINITY, "-Inf"),
    ] {
        let mut d = data.clone();
        d[3 * 42 + 40..3 * 42 + 42].copy_from_slice(&bad.to_le_bytes());
        d[5 * 42 + 40..5 * 42 + 42].copy_from_slice(&bad.to_le_bytes());
        match decode("blk.1.ffn_up_exps", &d, rows, cols).unwrap_err() {
            Error::Validation {
                tensor,
                what: w,
                first_index,
                count,
            } => {
                assert_eq!(tensor, "blk.1.ffn_up_exps");
                assert!(w.contains("STQ1_0") && w.contains("scale"), "{what}: {w}");
                assert_eq!((first_index, count), (3, 2), "{what}");
            }
            e => panic!("{what}: {e}"),
        }
    }
}

#[test]
fn wrong_sizes_and_shapes_are_refused() {
    let data = random_blocks(2, 3);
    let e = decode("w", &data[..83], 1, 512).unwrap_err().to_string();
    assert!(
        e.contains("'w'") && e.contains("STQ1_0") && e.contains("84"),
        "{e}"
    );
    let e = decode("w", &data, 1, 384).unwrap_err().to_string();
    assert!(e.contains("STQ1_0") && e.contains("256"), "{e}");
    assert!(decode("w", &[], 1, 0).is_err());
}

// ------------------------------------------------------------------------------------ encode refusals

#[test]
fn unrepresentable_groups_are_refused_with_row_and_group() {
    let (rows, cols) = (3, 512);
    let mut codes = representable_codes(rows, cols, 5);
    let scales = vec![f16::from_f32(0.5); rows * 2];
    assert!(encode("w", canonical(rows, cols, &codes, scales.clone()).as_ref()).is_ok());
    // Row 1, block 1, group 21 (chunk 1, gloc 5): all four lanes non-zero.
    let base = cols + 256 + 64 + 5;
    for p in 0..4 {
        codes[base + 16 * p] = 2;
    }
    // Row 2, group 0: two zeros (a second refusal, counted).
    codes[2 * cols] = 1;
    codes[2 * cols + 16] = 1;
    let t = canonical(rows, cols, &codes, scales.clone());
    let (count, first) = first_unrepresentable(t.as_ref());
    assert_eq!(count, 2);
    let u = first.unwrap();
    assert_eq!((u.row, u.group), (1, 64 + 21));
    assert_eq!(u.cols, [256 + 69, 256 + 85, 256 + 101, 256 + 117]);
    assert_eq!(u.trits, [1, 1, 1, 1]);
    match encode("blk.3.ffn_gate_exps", t.as_ref()).unwrap_err() {
        Error::Validation {
            tensor,
            what,
            first_index,
            count,
        } => {
            assert_eq!(tensor, "blk.3.ffn_gate_exps");
            assert!(what.contains("row 1 group 85"), "{what}");
            assert!(what.contains("[325, 341, 357, 373]"), "{what}");
            assert_eq!((first_index, count), ((cols + 325) as u64, 2));
        }
        e => panic!("{e}"),
    }
    // An all-zero group is not representable either (the format always stores three ±d).
    let zeros = vec![1u8; 256];
    let e = encode("z", canonical(1, 256, &zeros, vec![f16::ZERO]).as_ref()).unwrap_err();
    assert!(e.to_string().contains("row 0 group 0"), "{e}");
}

#[test]
fn encode_needs_group_256_and_valid_codes() {
    let codes = representable_codes(1, 256, 2);
    let mut t = canonical(1, 256, &codes, vec![f16::ONE; 2]);
    t.group_size = 128;
    let e = encode("w", t.as_ref()).unwrap_err().to_string();
    assert!(e.contains("group size 256") && e.contains("128"), "{e}");
    let mut t = canonical(1, 256, &codes, vec![f16::ONE]);
    t.qweight[0] |= 3;
    assert!(matches!(
        encode("w", t.as_ref()),
        Err(Error::Validation { .. })
    ));
}

// ------------------------------------------------------------------------------------ registration

#[test]
fn format_is_registered() {
    let f = Format::from_name("stq1_0").unwrap();
    assert_eq!(f, Format::Stq1_0);
    assert_eq!(
        (f.name(), f.gguf_type_id(), f.native_group()),
        ("STQ1_0", Some(43), Some(256))
    );
    assert!(crate::formats::FORMAT_NAMES.contains("STQ1_0"));
}

// ------------------------------------------------------------------------------------ properties

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// canonical → STQ1_0 → canonical is the identity on representable tensors, and the fast
    /// encoder writes the reference's bytes.
    #[test]
    fn representable_round_trip(rows in 1usize..6, blocks in 1usize..4, seed in any::<u64>(),
                                 scale_bits in proptest::collection::vec(any::<u16>(), 15)) {
        let cols = 256 * blocks;
        let codes = representable_codes(rows, cols, seed);
        let scales: Vec<f16> = (0..rows * blocks)
            .map(|i| {
                let d = f16::from_bits(scale_bits[i % scale_bits.len()]);
                if d.is_finite() { d } else { f16::from_f32(0.75) }
            })
            .collect();
        let t = canonical(rows, cols, &codes, scales.clone());
        prop_assert_eq!(first_unrepresentable(t.as_ref()).0, 0);
        let enc = encode("w", t.as_ref()).unwrap();
        prop_assert_eq!(enc.len(), rows * blocks * 42);
        prop_assert_eq!(&enc, &encode_blocks_ref::<BlockStq1_0>(&codes, &scales));
        let back = decode("w", &enc, rows, cols).unwrap();
        prop_assert_eq!(back, t);
    }

    /// Random valid blocks (any code bytes, finite d): the tensor decoder equals the scalar reference.
    #[test]
    fn random_blocks_decode_like_reference(rows in 1usize..5, blocks in 1usize..4,
                                           seed in any::<u64>(), d in any::<u16>()) {
        let cols = 256 * blocks;
        let mut data = random_bytes(rows * blocks * 42, seed);
        let d = f16::from_bits(d);
        let d = if d.is_finite() { d } else { f16::from_f32(-1.5) };
        for blk in data.chunks_exact_mut(42) {
            blk[40..42].copy_from_slice(&d.to_le_bytes());
        }
        let t = decode("w", &data, rows, cols).unwrap();
        let (codes, scales) = decode_blocks_ref::<BlockStq1_0>(&data, rows, cols);
        prop_assert_eq!(unpack(&t.qweight), codes);
        prop_assert!(t.scales.iter().zip(&scales).all(|(a, b)| a.to_bits() == b.to_bits()));
        // Values: (code − 1) · d exactly.
        let vals = t.as_ref().dequantize_f32().unwrap();
        for (i, v) in vals.iter().enumerate() {
            let c = (t.qweight[i / 4] >> (2 * (i % 4))) & 3;
            prop_assert!(*v == (c as f32 - 1.0) * d.to_f32(), "value {} = {}", i, v);
        }
    }
}

// ------------------------------------------------------------------------------------ requantization

/// Floats that stress the quantizer: ties in `|x|`, signed zeros, all-zero groups, wide magnitudes.
fn awkward_floats(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            let r = xorshift(&mut s);
            match r % 8 {
                0 => 0.0,
                1 => -0.0,
                2 => 0.5,
                3 => -0.5,
                _ => {
                    let m = (r >> 8) as u32 as f32 / u32::MAX as f32;
                    let e = ((r >> 40) % 30) as i32 - 20;
                    let v = m * 2f32.powi(e);
                    if r & (1 << 60) != 0 {
                        -v
                    } else {
                        v
                    }
                }
            }
        })
        .collect()
}

fn quantize_ref(x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; x.len() / 256 * 42];
    for (blk, xb) in out.chunks_exact_mut(42).zip(x.chunks_exact(256)) {
        quantize_block_ref(xb, blk);
    }
    out
}

#[test]
fn quantizer_follows_the_upstream_rule() {
    // Group 0 (values 0, 16, 32, 48): |x| = 3, 1, 2, 1 → zero lane 1 (the first smallest), the others
    // keep their signs; group 1 (values 1, 17, 33, 49) all zero → zero lane 0, the rest +1 (0 is not
    // < 0, −0.0 neither); every other value 0.25. d = max |x| = 4 (value 255).
    let mut x = vec![0.25f32; 256];
    x[..].iter_mut().step_by(2).for_each(|v| *v = -0.25);
    for (j, v) in [(0, -3.0), (16, 1.0), (32, 2.0), (48, -1.0), (255, 4.0)] {
        x[j] = v;
    }
    for (j, v) in [(1, 0.0), (17, -0.0), (33, 0.0), (49, -0.0)] {
        x[j] = v;
    }
    let mut blk = [0u8; 42];
    quantize_block_ref(&x, &mut blk);
    let mut fast = [0u8; 42];
    quantize_block(&x, &mut fast);
    assert_eq!(blk, fast);
    let mut codes = [0u8; 256];
    assert_eq!(
        BlockStq1_0::decode_block_ref(&blk, &mut codes),
        f16::from_f32(4.0)
    );
    assert_eq!([codes[0], codes[16], codes[32], codes[48]], [0, 1, 2, 0]);
    assert_eq!([codes[1], codes[17], codes[33], codes[49]], [1, 2, 2, 2]);
    // Elsewhere |x| ties at 0.25 (255 aside): lane 0 is the zero, lanes 1..3 follow the signs.
    assert_eq!([codes[2], codes[18], codes[34], codes[50]], [1, 0, 0, 0]);
    assert_eq!([codes[3], codes[19], codes[35], codes[51]], [1, 2, 2, 2]);
    assert_eq!(codes[255], 2);
}

#[test]
fn fast_quantizer_matches_reference_and_keeps_its_error_bound() {
    for seed in 1..400u64 {
        let x = awkward_floats(256 * 3, seed);
        let want = quantize_ref(&x);
        let mut got = vec![0u8; want.len()];
        for (blk, xb) in got.chunks_exact_mut(42).zip(x.chunks_exact(256)) {
            quantize_block(xb, blk);
        }
        assert_eq!(got, want, "seed {seed}");
        assert_eq!(quantize("w", &x, 3, 256).unwrap(), want);
        assert_eq!(quantize("w", &x, 1, 768).unwrap(), want);
        // |x − x̂| ≤ d' = max(max |x|, d) per block (d is max |x| rounded to fp16), and x̂ never
        // has the opposite sign of x.
        let t = decode("w", &want, 3, 256).unwrap();
        let xq = t.as_ref().dequantize_f32().unwrap();
        for (b, (xb, qb)) in x.chunks_exact(256).zip(xq.chunks_exact(256)).enumerate() {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let bound = amax.max(t.scales[b].to_f32());
            for (&v, &q) in xb.iter().zip(qb) {
                assert!(
                    (v - q).abs() <= bound,
                    "seed {seed}: {v} -> {q} (bound {bound})"
                );
                assert!(v * q >= 0.0 || v == 0.0, "seed {seed}: {v} -> {q}");
            }
        }
    }
    // All-zero block: d = 0, every group is CODEBOOK[0].
    let mut blk = [0xAAu8; 42];
    quantize_block(&[0.0; 256], &mut blk);
    assert_eq!(blk, [0u8; 42]);
}

#[test]
fn quantize_refuses_non_finite_overflow_and_bad_shapes() {
    let mut x = vec![0.5f32; 512];
    x[300] = f32::NAN;
    x[400] = f32::INFINITY;
    match quantize("blk.0.ffn_down", &x, 2, 256).unwrap_err() {
        Error::Validation {
            tensor,
            what,
            first_index,
            count,
        } => {
            assert_eq!(tensor, "blk.0.ffn_down");
            assert!(what.contains("non-finite"), "{what}");
            assert_eq!((first_index, count), (300, 2));
        }
        e => panic!("{e}"),
    }
    let mut x = vec![0.5f32; 512];
    x[300] = 70000.0; // max |x| of block 1 rounds to +Inf in fp16
    match quantize("w", &x, 1, 512).unwrap_err() {
        Error::Validation {
            what,
            first_index,
            count,
            ..
        } => {
            assert!(what.contains("fp16"), "{what}");
            assert_eq!((first_index, count), (1, 1));
        }
        e => panic!("{e}"),
    }
    let e = quantize("w", &[0.0; 384], 1, 384).unwrap_err().to_string();
    assert!(e.contains("'w'") && e.contains("256"), "{e}");
    assert!(quantize("w", &[0.0; 256], 2, 256).is_err());
}

/// A `[rows, cols]` tensor of random codes 0..=2 at group `g` whose scales differ from group to group
/// (every third negative): no STQ1_0 codebook pattern, so encoding it needs requantization.
pub(crate) fn unrepresentable_tensor(rows: usize, cols: usize, g: usize) -> CanonicalTernary {
    let codes: Vec<u8> = random_bytes(rows * cols, g as u64)
        .iter()
        .map(|b| b % 3)
        .collect();
    let scales: Vec<f16> = (0..rows * cols / g)
        .map(|i| {
            f16::from_f32(if i % 3 == 2 {
                -0.02
            } else {
                0.01 + i as f32 * 1e-3
            })
        })
        .collect();
    CanonicalTernary {
        rows,
        cols,
        group_size: g,
        qweight: pack(&codes),
        scales,
    }
}

#[test]
fn requantize_is_the_quantizer_on_dequantized_weights() {
    let (rows, cols) = (5usize, 512usize);
    for g in [32usize, 128, 256] {
        let t = unrepresentable_tensor(rows, cols, g);
        let dense = t.as_ref().dequantize_f32().unwrap();
        let want = quantize("w", &dense, rows, cols).unwrap();
        assert_eq!(requantize("w", t.as_ref()).unwrap(), want, "g{g}");
        assert_eq!(quantize_ref(&dense), want);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The fast quantizer equals the scalar reference on arbitrary finite floats.
    #[test]
    fn quantize_fast_matches_reference(bits in proptest::collection::vec(any::<u32>(), 256)) {
        let x: Vec<f32> = bits.iter().map(|&b| {
            let v = f32::from_bits(b);
            if v.is_finite() && v.abs() < 6.0e4 { v } else { (b % 7) as f32 - 3.0 }
        }).collect();
        let mut want = [0u8; 42];
        quantize_block_ref(&x, &mut want);
        let mut got = [0u8; 42];
        quantize_block(&x, &mut got);
        prop_assert_eq!(got, want);
    }
}
