//! Fast paths against the scalar references, round trips, the byte examples of docs/formats.md#worked-examples, error cases.

use half::f16;
use proptest::prelude::*;

use super::*;
use crate::formats::bitnet::{self, ScaleConvention};
use crate::formats::blocks::{decode_blocks_ref, encode_blocks_ref};
use crate::formats::dense::{self, DenseDtype, Method};
use crate::formats::stq1_0::tests::{canonical, representable_codes, unrepresentable_tensor};
use crate::formats::{i2_s, mlx, BlockCodec};

/// Running example of docs/formats.md#worked-examples: trits [+1, 0, −1, −1, 0, +1, +1, 0] → codes.
const EXAMPLE_CODES: [u8; 8] = [2, 1, 0, 0, 1, 2, 2, 1];

fn xorshift(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n).map(|_| xorshift(&mut s) as u8).collect()
}

/// Random ternary codes with all three values frequent.
fn random_codes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n).map(|_| (xorshift(&mut s) % 3) as u8).collect()
}

fn pack_codes(codes: &[u8]) -> Vec<u8> {
    codes
        .chunks_exact(4)
        .map(|c| c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6)
        .collect()
}

fn unpack(q: &[u8]) -> Vec<u8> {
    q.iter()
        .flat_map(|&b| (0..4).map(move |j| (b >> (2 * j)) & 3))
        .collect()
}

/// Random blocks with finite scales at the format's scale offset.
fn random_blocks<C: BlockCodec>(n_blocks: usize, seed: u64, scale_at: usize) -> Vec<u8> {
    let mut data = random_bytes(n_blocks * C::BLOCK_BYTES, seed);
    for (i, blk) in data.chunks_exact_mut(C::BLOCK_BYTES).enumerate() {
        let d = f16::from_f32(0.01 + i as f32 * 0.003);
        blk[scale_at..scale_at + 2].copy_from_slice(&d.to_le_bytes());
    }
    data
}

fn fast_matches_reference<C: BlockCodec>(scale_at: usize) {
    let (rows, cols) = (3, C::BLOCK_VALUES * 4);
    for seed in 1..40u64 {
        let data = random_blocks::<C>(rows * cols / C::BLOCK_VALUES, seed, scale_at);
        let (ref_codes, ref_scales) = decode_blocks_ref::<C>(&data, rows, cols);
        // Fast unpack, block by block, including code 3 (validation is separate).
        let mut canon = vec![0u8; C::BLOCK_VALUES / 4];
        for (b, blk) in data.chunks_exact(C::BLOCK_BYTES).enumerate() {
            C::unpack_block(blk, &mut canon);
            assert_eq!(
                unpack(&canon),
                &ref_codes[b * C::BLOCK_VALUES..(b + 1) * C::BLOCK_VALUES],
                "{} block {b} seed {seed}",
                C::FORMAT.name()
            );
            assert_eq!(C::scale(blk), ref_scales[b]);
        }
        // Encode of ternary codes: fast == reference, and decodes back.
        let codes = random_codes(rows * cols, seed * 7);
        let codes = if C::FORMAT == Format::Q1_0 {
            codes.iter().map(|&c| if c == 1 { 2 } else { c }).collect()
        } else {
            codes
        };
        let enc_ref = encode_blocks_ref::<C>(&codes, &ref_scales);
        let canon = CanonicalTernary {
            rows,
            cols,
            group_size: C::BLOCK_VALUES,
            qweight: pack_codes(&codes),
            scales: ref_scales.clone(),
        };
        let enc = encode_blocks::<C>("t", canon.as_ref()).unwrap();
        assert_eq!(enc, enc_ref, "{} encode seed {seed}", C::FORMAT.name());
        let back = decode_blocks::<C>("t", &enc, rows, cols).unwrap();
        assert_eq!(back, canon);
    }
}

#[test]
fn tq2_0_fast_matches_reference() {
    fast_matches_reference::<BlockTq2_0>(64);
}
#[test]
fn tq1_0_fast_matches_reference() {
    fast_matches_reference::<BlockTq1_0>(52);
}
#[test]
fn ptq1_0_fast_matches_reference() {
    fast_matches_reference::<BlockPtq1_0>(26);
}
#[test]
fn q2_0_fast_matches_reference() {
    fast_matches_reference::<BlockQ2_0>(0);
}
#[test]
fn pq2_0_fast_matches_reference() {
    fast_matches_reference::<BlockPq2_0>(0);
}
#[test]
fn q1_0_fast_matches_reference() {
    fast_matches_reference::<BlockQ1_0>(0);
}

/// Encode the running example (rest of the block zero, d = 0.5) with the scalar reference.
fn example_block<C: BlockCodec>() -> Vec<u8> {
    let mut codes = vec![1u8; C::BLOCK_VALUES];
    codes[..8].copy_from_slice(&EXAMPLE_CODES);
    encode_blocks_ref::<C>(&codes, &[f16::from_f32(0.5)])
}

#[test]
fn formats_md_byte_examples() {
    let b = example_block::<BlockPq2_0>();
    assert_eq!(&b[..4], &[0x00, 0x38, 0x06, 0x69]);
    assert!(b[4..].iter().all(|&x| x == 0x55) && b.len() == 34);
    let b = example_block::<BlockQ2_0>();
    assert_eq!(&b[..4], &[0x00, 0x38, 0x06, 0x69]);
    assert_eq!(b.len(), 18);
    let b = example_block::<BlockPtq1_0>();
    assert_eq!(&b[..8], &[0xd5, 0x80, 0x2b, 0x2b, 0x80, 0xd5, 0xd5, 0x80]);
    assert!(b[8..24].iter().all(|&x| x == 0x80));
    assert_eq!(&b[24..], &[0x7f, 0x7f, 0x00, 0x38]);
    let b = example_block::<BlockTq1_0>();
    assert_eq!(&b[..8], &[0xd5, 0x80, 0x2b, 0x2b, 0x80, 0xd5, 0xd5, 0x80]);
    assert_eq!(&b[48..], &[0x7f, 0x7f, 0x7f, 0x7f, 0x00, 0x38]);
    let b = example_block::<BlockTq2_0>();
    assert_eq!(&b[..8], &[0x56, 0x55, 0x54, 0x54, 0x55, 0x56, 0x56, 0x55]);
    assert_eq!(&b[64..], &[0x00, 0x38]);
    // Q1_0 signs [+,−,−,+,+,+,−,+] → 0xb9.
    let mut codes = vec![2u8; 128];
    codes[..8].copy_from_slice(&[2, 0, 0, 2, 2, 2, 0, 2]);
    let b = encode_blocks_ref::<BlockQ1_0>(&codes, &[f16::from_f32(0.5)]);
    assert_eq!(&b[..3], &[0x00, 0x38, 0xb9]);
    // I2_S: first 8 values of an otherwise zero 128-block.
    let mut codes = vec![1u8; 128];
    codes[..8].copy_from_slice(&EXAMPLE_CODES);
    let canon = CanonicalTernary {
        rows: 1,
        cols: 128,
        group_size: 128,
        qweight: pack_codes(&codes),
        scales: vec![f16::from_f32(0.5)],
    };
    let b = i2_s::encode("t", canon.as_ref()).unwrap();
    assert_eq!(&b[..8], &[0x95, 0x55, 0x15, 0x15, 0x55, 0x95, 0x95, 0x55]);
    assert_eq!(&b[32..36], &0.5f32.to_le_bytes());
    assert_eq!(i2_s::decode("t", &b, 1, 128, 128).unwrap(), canon);
    // BitNet: W[:, 0] of an 8×1 weight (padded to K = 32) = running trits → packed[:, 0] = 92 61.
    let mut codes = vec![1u8; 8 * 32];
    for (n, c) in EXAMPLE_CODES.iter().enumerate() {
        codes[n * 32] = *c;
    }
    let canon = CanonicalTernary {
        rows: 8,
        cols: 32,
        group_size: 32,
        qweight: pack_codes(&codes),
        scales: vec![f16::from_f32(0.5); 8],
    };
    let (packed, ws) = bitnet::encode("t", canon.as_ref(), ScaleConvention::BitLinear).unwrap();
    assert_eq!((packed[0], packed[32]), (0x92, 0x61));
    assert_eq!(ws, 2.0);
    let back = bitnet::decode("t", &packed, 8, 32, ws, ScaleConvention::BitLinear, 32).unwrap();
    assert_eq!(back, canon);
}

#[test]
fn validation_reports_first_index_and_count() {
    // PQ2_0 with code 3 at element 5 of row 1 and at element 0 of row 2 (cols = 256).
    let codes = vec![1u8; 3 * 256];
    let canon = CanonicalTernary {
        rows: 3,
        cols: 256,
        group_size: 128,
        qweight: pack_codes(&codes),
        scales: vec![f16::ONE; 6],
    };
    let mut data = encode_gguf(Format::Pq2_0, "w", canon.as_ref(), false).unwrap();
    data[2 * 34 + 2 + 1] |= 0b11 << 2; // row 1, block 0, byte 1, field 1 → element 256 + 5
    data[4 * 34 + 2] |= 0b11; // row 2 element 0
    match decode_gguf(Format::Pq2_0, "w", &data, 3, 256, None, false).unwrap_err() {
        Error::Validation {
            first_index, count, ..
        } => assert_eq!((first_index, count), (261, 2)),
        e => panic!("{e}"),
    }
    // NaN scale in block 3 (TQ2_0 d is last).
    let canon = CanonicalTernary {
        rows: 2,
        cols: 512,
        group_size: 256,
        qweight: pack_codes(&vec![1u8; 1024]),
        scales: vec![f16::ONE; 4],
    };
    let mut data = encode_gguf(Format::Tq2_0, "w", canon.as_ref(), false).unwrap();
    data[3 * 66 + 64..3 * 66 + 66].copy_from_slice(&f16::NAN.to_le_bytes());
    let e = decode_gguf(Format::Tq2_0, "blk.0.w", &data, 2, 512, None, false).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Validation {
                first_index: 3,
                count: 1,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("blk.0.w"));
    // Non-finite scales spread over several tasks (256 rows each at K = 256): the first is located
    // across tasks and every one is counted; the codes of the good blocks are untouched.
    let (rows, cols) = (1024, 256);
    let canon = CanonicalTernary {
        rows,
        cols,
        group_size: 128,
        qweight: pack_codes(&vec![2u8; rows * cols]),
        scales: vec![f16::ONE; rows * 2],
    };
    let good = encode_gguf(Format::Ptq1_0, "w", canon.as_ref(), false).unwrap();
    let mut data = good.clone();
    for (block, bad) in [
        (1800, f16::NAN),
        (601, f16::INFINITY),
        (603, f16::NEG_INFINITY),
    ] {
        data[block * 28 + 26..block * 28 + 28].copy_from_slice(&bad.to_le_bytes());
    }
    match decode_gguf(Format::Ptq1_0, "w", &data, rows, cols, None, false).unwrap_err() {
        Error::Validation {
            first_index, count, ..
        } => assert_eq!((first_index, count), (601, 3)),
        e => panic!("{e}"),
    }
    let back = decode_gguf(Format::Ptq1_0, "w", &good, rows, cols, None, false).unwrap();
    assert_eq!((back.qweight, back.scales), (canon.qweight, canon.scales));
    // Shape not a multiple of the block; wrong byte count.
    let e = decode_gguf(Format::Tq1_0, "w", &[0; 54], 1, 128, None, false).unwrap_err();
    assert!(matches!(e, Error::Validation { .. }), "{e}");
    let e = decode_gguf(Format::Tq1_0, "w", &[0; 53], 1, 256, None, false).unwrap_err();
    assert!(matches!(e, Error::Format { .. }), "{e}");
}

#[test]
fn regroup_rules() {
    let codes = random_codes(2 * 256, 5);
    let canon = CanonicalTernary {
        rows: 2,
        cols: 256,
        group_size: 128,
        qweight: pack_codes(&codes),
        scales: vec![f16::ONE, f16::ONE, f16::ONE, f16::from_f32(2.0)],
    };
    // Smaller: repeat scales, lossless.
    let small = regroup(canon.as_ref(), "w", 32, false).unwrap();
    assert_eq!(small.scales.len(), 16);
    assert_eq!(
        small.as_ref().dequantize_f32().unwrap(),
        canon.as_ref().dequantize_f32().unwrap()
    );
    // Larger with unequal scales in row 1: refused naming merged group 1; requantize works.
    match regroup(canon.as_ref(), "w", 256, false).unwrap_err() {
        Error::Validation {
            first_index, count, ..
        } => assert_eq!((first_index, count), (1, 1)),
        e => panic!("{e}"),
    }
    let rq = regroup(canon.as_ref(), "w", 256, true).unwrap();
    assert_eq!(rq.scales[0], f16::ONE);
    // Back from 32 to 128: lossless.
    assert_eq!(regroup(small.as_ref(), "w", 128, false).unwrap(), canon);
    // TQ2_0 from g128 with unequal pairs: refused, unless requantize.
    assert!(encode_gguf(Format::Tq2_0, "w", canon.as_ref(), false).is_err());
    assert!(encode_gguf(Format::Tq2_0, "w", canon.as_ref(), true).is_ok());
}

#[test]
fn mlx_and_dense() {
    let (rows, cols) = (4, 256);
    let codes = random_codes(rows * cols, 9);
    let q = pack_codes(&codes);
    let scales: Vec<f16> = (0..8)
        .map(|i| f16::from_f32(0.25 * (i + 1) as f32))
        .collect();
    let mut biases: Vec<f16> = scales.iter().map(|s| -*s).collect();
    let t = mlx::decode("w", &q, &scales, &biases, rows, cols).unwrap();
    assert_eq!(t.group_size, 128);
    biases[5] = f16::ZERO;
    match mlx::validate("w", &q, &scales, &biases, rows, cols).unwrap_err() {
        Error::Validation { first_index, .. } => assert_eq!(first_index, 5),
        e => panic!("{e}"),
    }
    // Dense: dequantize to f32 bytes, recover exactly; a non-ternary value is refused at its index.
    let deq = t.as_ref().dequantize_f32().unwrap();
    let bytes: Vec<u8> = deq.iter().flat_map(|v| v.to_le_bytes()).collect();
    let back = dense::recover("w", &bytes, DenseDtype::F32, rows, cols, 128).unwrap();
    assert_eq!(back.as_ref().dequantize_f32().unwrap(), deq);
    let mut bad = bytes.clone();
    bad[4 * 300..4 * 301].copy_from_slice(&0.123f32.to_le_bytes());
    match dense::recover("w", &bad, DenseDtype::F32, rows, cols, 128).unwrap_err() {
        Error::Validation { first_index, .. } => assert_eq!(first_index, 300),
        e => panic!("{e}"),
    }
    // Absmax ternarization of the dequantized tensor reproduces it.
    let tz = dense::ternarize("w", &deq, rows, cols, 128, Method::Absmax).unwrap();
    assert_eq!(tz.as_ref().dequantize_f32().unwrap(), deq);
}

#[test]
fn dequantize_matches_scalar_formula_every_group_size() {
    for g in [32usize, 64, 128, 256] {
        let (rows, cols) = (4, 512);
        let codes = random_codes(rows * cols, g as u64);
        let scales: Vec<f16> = (0..rows * cols / g)
            .map(|i| {
                f16::from_f32(
                    [0.1f32, -3.5, 1e-7, 65504.0, 0.0, -0.0][i % 6] * (1.0 + i as f32 / 64.0),
                )
            })
            .collect();
        let t = CanonicalTernary {
            rows,
            cols,
            group_size: g,
            qweight: pack_codes(&codes),
            scales: scales.clone(),
        };
        // W[n, k] = (c − 1) · scale, computed value by value.
        let want: Vec<f32> = codes
            .iter()
            .enumerate()
            .map(|(i, &c)| (c as f32 - 1.0) * scales[i / g].to_f32())
            .collect();
        let f = t.as_ref().dequantize_f32().unwrap();
        let b = t.as_ref().dequantize_bits(HalfKind::BF16).unwrap();
        let h = t.as_ref().dequantize_bits(HalfKind::F16).unwrap();
        // The scalar loops (the fallback without AVX-512) give the same bits.
        let mut fs = vec![0f32; want.len()];
        t.as_ref().dequantize_f32_impl(&mut fs, false).unwrap();
        let mut bs = vec![0u16; want.len()];
        t.as_ref()
            .dequantize_bits_impl(HalfKind::BF16, &mut bs, false)
            .unwrap();
        let mut hs = vec![0u16; want.len()];
        t.as_ref()
            .dequantize_bits_impl(HalfKind::F16, &mut hs, false)
            .unwrap();
        // Output addresses 64-byte aligned (streaming stores) and not: the same bits.
        for shift in 0..3 {
            let mut buf = vec![0u16; want.len() + 64];
            let base = buf.as_ptr() as usize;
            let start = (64 - base % 64) % 64 / 2 + shift;
            t.as_ref()
                .dequantize_bits_into(HalfKind::BF16, &mut buf[start..start + want.len()])
                .unwrap();
            assert_eq!(
                &buf[start..start + want.len()],
                &b[..],
                "bf16 g{g} offset {shift}"
            );
            let mut fbuf = vec![0f32; want.len() + 32];
            let fstart = (64 - fbuf.as_ptr() as usize % 64) % 64 / 4 + shift;
            t.as_ref()
                .dequantize_f32_into(&mut fbuf[fstart..fstart + want.len()])
                .unwrap();
            let got: Vec<u32> = fbuf[fstart..fstart + want.len()]
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let f_bits: Vec<u32> = f.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, f_bits, "f32 g{g} offset {shift}");
        }
        for i in 0..want.len() {
            assert_eq!(
                (fs[i].to_bits(), bs[i], hs[i]),
                (f[i].to_bits(), b[i], h[i]),
                "scalar g{g} at {i}"
            );
            assert_eq!(f[i].to_bits(), want[i].to_bits(), "f32 g{g} at {i}");
            assert_eq!(
                b[i],
                half::bf16::from_f32(want[i]).to_bits(),
                "bf16 g{g} at {i}"
            );
            assert_eq!(h[i], f16::from_f32(want[i]).to_bits(), "f16 g{g} at {i}");
        }
        let trits = t.as_ref().trits().unwrap();
        assert!(trits.iter().zip(&codes).all(|(&t, &c)| t == c as i8 - 1));
        assert_eq!(
            crate::canonical::pack_trits("w", &trits, cols).unwrap(),
            t.qweight
        );
    }
}

use crate::canonical::HalfKind;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Every encodable format round-trips canonical → format → canonical exactly, and transcoding
    /// between formats preserves the dequantized values.
    #[test]
    fn round_trip_every_format(rows in 1usize..5, blocks in 1usize..4, seed in any::<u64>(),
                               scale in 1e-3f32..10.0) {
        let cols = 256 * blocks;
        let codes = random_codes(rows * cols, seed);
        let canon = CanonicalTernary {
            rows: rows * 4, cols, group_size: 256,
            qweight: pack_codes(&[codes.clone(), codes.clone(), codes.clone(), codes].concat()),
            scales: vec![f16::from_f32(scale); rows * 4 * blocks],
        };
        let deq = canon.as_ref().dequantize_f32().unwrap();
        for f in [Format::Tq1_0, Format::Tq2_0, Format::Q2_0, Format::Pq2_0, Format::Q2_0G128,
                  Format::Ptq1_0, Format::I2S] {
            let bytes = encode_gguf(f, "w", canon.as_ref(), false).unwrap();
            prop_assert_eq!(bytes.len(), gguf_tensor_bytes(f, rows * 4, cols).unwrap());
            let back = decode_gguf(f, "w", &bytes, rows * 4, cols, Some(256), false).unwrap();
            prop_assert_eq!(&back, &canon, "{}", f.name());
            for g in [Format::Tq1_0, Format::Ptq1_0, Format::Q2_0] {
                let other = transcode_gguf(f, g, "w", &bytes, rows * 4, cols, false).unwrap();
                let t = decode_gguf(g, "w", &other, rows * 4, cols, None, false).unwrap();
                prop_assert_eq!(t.as_ref().dequantize_f32().unwrap(), deq.clone());
            }
        }
        for conv in [ScaleConvention::BitLinear, ScaleConvention::AutoBitLinear] {
            let (p, ws) = bitnet::encode("w", canon.as_ref(), conv).unwrap();
            let back = bitnet::decode("w", &p, rows * 4, cols, ws, conv, 256).unwrap();
            prop_assert_eq!(&back, &canon);
        }
        let (w, s, b) = mlx::encode("w", canon.as_ref()).unwrap();
        prop_assert_eq!(&mlx::decode("w", &w, &s, &b, rows * 4, cols).unwrap(), &canon);
    }

    /// The BitNet fast path equals the scalar reference on arbitrary bytes (code 3 included).
    #[test]
    fn bitnet_fast_matches_reference(rows4 in 1usize..6, kq in 8usize..24, seed in any::<u64>()) {
        let (rows, cols) = (rows4 * 4, kq * 4);
        let packed: Vec<u8> = random_codes(rows / 4 * cols, seed).into_iter()
            .zip(random_bytes(rows / 4 * cols, seed ^ 1)).map(|(c, b)| (b & 0xFC) >> 2 << 2 | c).collect();
        let packed: Vec<u8> = packed.iter().map(|&b| {
            // keep codes ternary in every field so the decode validates
            (0..4).map(|j| (((b >> (2 * j)) & 3) % 3) << (2 * j)).fold(0, |a, x| a | x)
        }).collect();
        let want = bitnet::decode_ref(&packed, rows, cols);
        let g = if cols % 32 == 0 { 32 } else { return Ok(()); };
        let got = bitnet::decode("w", &packed, rows, cols, 1.0, ScaleConvention::AutoBitLinear, g).unwrap();
        prop_assert_eq!(unpack(&got.qweight), want);
    }

    /// The I2_S fast path equals the scalar reference on arbitrary ternary bytes.
    #[test]
    fn i2_s_fast_matches_reference(blocks in 1usize..8, seed in any::<u64>()) {
        let n = blocks * 128;
        let mut data: Vec<u8> = random_codes(n, seed).chunks_exact(4)
            .map(|c| c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6).collect();
        data.extend_from_slice(&0.75f32.to_le_bytes());
        data.extend_from_slice(&[0u8; 28]);
        let (want, scale) = i2_s::decode_ref(&data, n);
        let got = i2_s::decode("w", &data, blocks, 128, 128).unwrap();
        prop_assert_eq!(unpack(&got.qweight), want);
        prop_assert_eq!(got.scales[0].to_f32(), scale);
    }
}

/// Timing probe (not a test of speed: run with `--ignored --nocapture` to see where time goes).
#[test]
#[ignore]
fn timing_probe() {
    use std::time::Instant;
    let (rows, cols) = (5120, 6144);
    let codes = random_codes(rows * cols, 3);
    let canon = CanonicalTernary {
        rows,
        cols,
        group_size: 256,
        qweight: pack_codes(&codes),
        scales: vec![f16::from_f32(0.03); rows * cols / 256],
    };
    let tq2 = encode_gguf(Format::Tq2_0, "w", canon.as_ref(), false).unwrap();
    let c128 = regroup(canon.as_ref(), "w", 128, false).unwrap();
    let ptq1 = encode_gguf(Format::Ptq1_0, "w", c128.as_ref(), false).unwrap();
    let best = |f: &dyn Fn()| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .fold(f64::INFINITY, f64::min)
    };
    crate::threads::set_num_threads(1).unwrap();
    let alloc = best(&|| {
        let mut v = vec![0u8; rows * cols / 4];
        v[rows * cols / 8] = 1;
        v.iter_mut().step_by(4096).for_each(|b| *b = 1);
        std::hint::black_box(&v);
    });
    let alloc16 = best(&|| {
        let mut v = vec![0u16; rows * cols];
        v.iter_mut().step_by(2048).for_each(|b| *b = 1);
        std::hint::black_box(&v);
    });
    let t2 = best(&|| {
        std::hint::black_box(
            decode_gguf(Format::Tq2_0, "w", &tq2, rows, cols, None, false).unwrap(),
        );
    });
    let p1 = best(&|| {
        std::hint::black_box(
            decode_gguf(Format::Ptq1_0, "w", &ptq1, rows, cols, None, false).unwrap(),
        );
    });
    let bf = best(&|| {
        std::hint::black_box(canon.as_ref().dequantize_bits(HalfKind::BF16).unwrap());
    });
    let f32v = best(&|| {
        std::hint::black_box(canon.as_ref().dequantize_f32().unwrap());
    });
    eprintln!(
        "1 thread, [{rows}, {cols}]: touch u8 out {alloc:.1} ms, touch u16 out {alloc16:.1} ms, \
         TQ2_0 {t2:.1} ms, PTQ1_0 {p1:.1} ms, bf16 {bf:.1} ms, f32 {f32v:.1} ms"
    );
    crate::threads::set_num_threads(0).unwrap();
}

// ------------------------------------------------------------------------------------ STQ1_0 dispatch

#[test]
fn stq1_0_dispatch_decodes_encodes_and_regroups() {
    let (rows, cols) = (3usize, 768usize);
    assert_eq!(gguf_tensor_bytes(Format::Stq1_0, rows, cols).unwrap(), 378);
    assert!(gguf_tensor_bytes(Format::Stq1_0, 1, 128).is_err());
    let data = random_blocks::<BlockStq1_0>(rows * 3, 21, 40);
    let t = decode_gguf(Format::Stq1_0, "w", &data, rows, cols, None, false).unwrap();
    assert_eq!(t, stq1_0::decode("w", &data, rows, cols).unwrap());
    assert_eq!(
        encode_gguf(Format::Stq1_0, "w", t.as_ref(), false).unwrap(),
        data
    );
    // Exact requests stay exact even with requantize allowed.
    assert_eq!(
        encode_gguf(Format::Stq1_0, "w", t.as_ref(), true).unwrap(),
        data
    );
    // To a divisor and back: lossless.
    let g64 = decode_gguf(Format::Stq1_0, "w", &data, rows, cols, Some(64), false).unwrap();
    assert_eq!(g64.group_size, 64);
    assert_eq!(
        encode_gguf(Format::Stq1_0, "w", g64.as_ref(), false).unwrap(),
        data
    );
    // A g128 tensor whose halves differ in scale cannot merge: the regroup refusal, unless requantize.
    let codes = representable_codes(rows, cols, 4);
    let mut c128 = canonical(rows, cols, &codes, vec![]);
    c128.group_size = 128;
    c128.scales = (0..rows * cols / 128)
        .map(|i| f16::from_f32(0.5 + (i % 2) as f32 * 0.25))
        .collect();
    let e = encode_gguf(Format::Stq1_0, "w", c128.as_ref(), false).unwrap_err();
    assert!(e.to_string().contains("cannot merge groups of 128"), "{e}");
    let dense = c128.as_ref().dequantize_f32().unwrap();
    assert_eq!(
        encode_gguf(Format::Stq1_0, "w", c128.as_ref(), true).unwrap(),
        stq1_0::quantize("w", &dense, rows, cols).unwrap()
    );
    // Other formats transcode to STQ1_0 only when representable, and back from it always.
    let tq2 = encode_gguf(Format::Tq2_0, "w", t.as_ref(), false).unwrap();
    assert_eq!(
        transcode_gguf(Format::Tq2_0, Format::Stq1_0, "w", &tq2, rows, cols, false).unwrap(),
        data
    );
    let back =
        transcode_gguf(Format::Stq1_0, Format::Tq2_0, "w", &data, rows, cols, false).unwrap();
    assert_eq!(back, tq2);
    let zeros = CanonicalTernary::zeros(rows, cols, 256).unwrap();
    let tq2 = encode_gguf(Format::Tq2_0, "w", zeros.as_ref(), false).unwrap();
    let e =
        transcode_gguf(Format::Tq2_0, Format::Stq1_0, "w", &tq2, rows, cols, false).unwrap_err();
    assert!(e.to_string().contains("row 0 group 0"), "{e}");
}

#[test]
fn stq1_0_dispatch_requantizes_only_when_asked() {
    let (rows, cols) = (5usize, 512usize);
    for g in [32usize, 128, 256] {
        let t = unrepresentable_tensor(rows, cols, g);
        let want = stq1_0::requantize("w", t.as_ref()).unwrap();
        let e = encode_gguf(Format::Stq1_0, "w", t.as_ref(), false).unwrap_err();
        assert!(matches!(e, Error::Validation { .. }), "g{g}: {e}");
        assert!(e.to_string().contains("requantize"), "{e}");
        assert_eq!(
            encode_gguf(Format::Stq1_0, "w", t.as_ref(), true).unwrap(),
            want
        );
    }
}
