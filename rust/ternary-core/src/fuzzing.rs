//! Fuzz harnesses: one function per fuzz target, taking arbitrary bytes.
//!
//! Each returns normally when the code under test behaved (an `Ok` that satisfies the invariants, or
//! a clean `Err`) and panics otherwise. The libFuzzer targets in `fuzz/fuzz_targets/` are one-line
//! wrappers around these (`scripts/fuzz.sh` runs them); the unit tests below replay every file of
//! `fuzz/regressions/<target>/` (inputs that once failed, kept as regression cases) on stable Rust.
//!
//! Block decoders are fuzzed *differentially*: the fast path (`repack::decode_gguf`, SIMD where the
//! CPU has it) must agree bit for bit with the scalar reference written from its docs/formats.md section
//! (`decode_block_ref`), accept exactly the inputs the reference finds valid (no code 3, finite
//! scales), and re-encode to bytes that decode to the same tensor.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use half::f16;

use crate::canonical::{CanonicalRef, CanonicalTernary, GROUP_SIZES};
use crate::container::{GgufFile, MappedFile, SafetensorsCheckpoint, SafetensorsFile};
use crate::formats::blocks::{decode_blocks_ref, encode_blocks_ref};
use crate::formats::pq2_0::BlockPq2_0;
use crate::formats::ptq1_0::BlockPtq1_0;
use crate::formats::q1_0::BlockQ1_0;
use crate::formats::q2_0::BlockQ2_0;
use crate::formats::stq1_0::{self, BlockStq1_0};
use crate::formats::tq1_0::BlockTq1_0;
use crate::formats::tq2_0::BlockTq2_0;
use crate::formats::{bitnet, dense, i2_s, mlx, BlockCodec, Format};
use crate::repack::{decode_gguf, encode_gguf, regroup};
use crate::{Error, Result};

/// A fuzz harness: returns on acceptable behaviour, panics otherwise.
pub type Harness = fn(&[u8]);

/// Every fuzz target, by the name `scripts/fuzz.sh` and `fuzz/regressions/` use.
pub const TARGETS: &[(&str, Harness)] = &[
    ("gguf_open", gguf_open),
    ("safetensors_open", safetensors_open),
    ("safetensors_index", safetensors_index),
    ("decode_tq1_0", decode_tq1_0),
    ("decode_tq2_0", decode_tq2_0),
    ("decode_q2_0", decode_q2_0),
    ("decode_pq2_0", decode_pq2_0),
    ("decode_ptq1_0", decode_ptq1_0),
    ("decode_q1_0", decode_q1_0),
    ("decode_stq1_0", decode_stq1_0),
    ("decode_i2_s", decode_i2_s),
    ("decode_bitnet", decode_bitnet),
    ("decode_mlx", decode_mlx),
    ("decode_dense", decode_dense),
];

/// Scratch directory for the index target (shards are opened by path): tmpfs when there is one.
fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = Path::new("/dev/shm");
        let base = if base.is_dir() {
            base.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("ternary-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create fuzz scratch directory");
        dir
    })
}

// ------------------------------------------------------------------------------------- containers

/// Any bytes: opening them as a GGUF returns Ok or Err, and every tensor slice it hands out lies inside
/// the file and has the size the header implies.
pub fn gguf_open(data: &[u8]) {
    if let Ok(f) = GgufFile::from_mapped(MappedFile::from_bytes("input.gguf", data.to_vec())) {
        for (i, t) in f.tensors().iter().enumerate() {
            let bytes = f.tensor_data(i).expect("index in range");
            assert_eq!(bytes.len() as u64, t.nbytes);
            assert!(t.nbytes == 0 || t.abs_offset + t.nbytes <= data.len() as u64);
        }
        for (_, v) in f.metadata() {
            std::hint::black_box(v.value_type());
        }
    }
}

/// Any bytes: opening them as a safetensors file returns Ok or Err, and the tensors tile the data section.
pub fn safetensors_open(data: &[u8]) {
    let map = MappedFile::from_bytes("input.safetensors", data.to_vec());
    if let Ok(f) = SafetensorsFile::from_mapped(map) {
        let mut covered = 0u64;
        for t in f.tensors() {
            let bytes = f.tensor_data(&t.name).expect("listed tensor");
            assert_eq!(bytes.len() as u64, t.nbytes);
            covered += t.nbytes;
        }
        assert_eq!(8 + f.header_size + covered, data.len() as u64);
    }
}

/// Shards the index target may point at: `model-00001-of-00002.safetensors` holds `a` (F32 [2])
/// and `b` (U8 [4]); `model-00002-of-00002.safetensors` holds `c` (F16 [1, 2]).
pub const INDEX_SHARDS: &[(&str, &str, &[u8])] = &[
    (
        "model-00001-of-00002.safetensors",
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}}"#,
        &[0, 0, 128, 63, 0, 0, 0, 64, 1, 2, 3, 4],
    ),
    (
        "model-00002-of-00002.safetensors",
        r#"{"__metadata__":{"format":"pt"},"c":{"dtype":"F16","shape":[1,2],"data_offsets":[0,4]}}"#,
        &[0, 60, 0, 64],
    ),
];

fn index_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch_dir().join("index");
        std::fs::create_dir_all(&dir).expect("create index scratch directory");
        for (name, header, data) in INDEX_SHARDS {
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(header.as_bytes());
            bytes.extend_from_slice(data);
            std::fs::write(dir.join(name), bytes).expect("write index shard");
        }
        dir
    })
}

/// Any bytes as `model.safetensors.index.json` next to two valid shards: `open_index` returns Ok or
/// Err; on Ok every tensor it lists resolves to in-bounds bytes of the shard that holds it.
pub fn safetensors_index(data: &[u8]) {
    let path = index_dir().join("model.safetensors.index.json");
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(ckpt) = SafetensorsCheckpoint::open_index(&path) {
        assert!(ckpt.shards().len() <= INDEX_SHARDS.len());
        for (s, t) in ckpt.tensors() {
            let shard = &ckpt.shards()[s];
            let bytes = shard
                .tensor_data(&t.name)
                .expect("listed tensor in its shard");
            assert_eq!(bytes.len() as u64, t.nbytes);
            let (_, info) = ckpt.tensor_info(&t.name).expect("listed tensor by name");
            assert_eq!(info.nbytes, t.nbytes);
        }
    }
}

// ------------------------------------------------------------------------------------- block codecs

/// The first input byte selects: bit 0 rows (1, 2), bit 1 blocks per row (1, 2), bits 2–3 the group
/// size a regroup tries, bits 4–6 the format a transcode tries (bit 6 also: requantize), bit 7 keeps
/// the data at its own length instead of zero-padding or cutting it to size (the length checks).
/// Shapes stay small: every path is reached with 2 rows of 2 blocks, and small inputs run fast.
fn block_input<C: BlockCodec>(data: &[u8]) -> Option<(usize, usize, Vec<u8>, u8)> {
    let (&sel, rest) = data.split_first()?;
    let rows = 1 + (sel & 1) as usize;
    let blocks_per_row = 1 + ((sel >> 1) & 1) as usize;
    let need = rows * blocks_per_row * C::BLOCK_BYTES;
    let bytes = if sel & 0x80 != 0 {
        rest.to_vec()
    } else {
        rest.iter()
            .copied()
            .chain(std::iter::repeat(0))
            .take(need)
            .collect()
    };
    Some((rows, blocks_per_row * C::BLOCK_VALUES, bytes, sel))
}

fn same_scales(a: &[f16], b: &[f16]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn codes_of(t: &CanonicalTernary) -> Vec<u8> {
    let r = t.as_ref();
    (0..t.rows)
        .flat_map(|n| (0..t.cols).map(move |k| (n, k)))
        .map(|(n, k)| r.code(n, k))
        .collect()
}

/// A valid canonical tensor: regroup to the group size `sel` picks (lossless when it succeeds
/// without requantizing) and transcode to the GGUF format it picks; nothing may panic.
fn exercise_canonical(t: &CanonicalTernary, sel: u8) {
    t.as_ref()
        .validate("fuzz")
        .expect("decoder output validates");
    let dense = t.as_ref().dequantize_f32().expect("dequantize");
    let g = GROUP_SIZES[((sel >> 2) & 3) as usize];
    if t.cols.is_multiple_of(g) {
        if let Ok(r) = regroup(t.as_ref(), "fuzz", g, false) {
            r.as_ref()
                .validate("fuzz")
                .expect("regrouped tensor validates");
            let back = r.as_ref().dequantize_f32().expect("dequantize regrouped");
            assert!(
                back.iter().zip(&dense).all(|(a, b)| a == b),
                "lossless regroup {} -> {g} changed values",
                t.group_size
            );
        }
        if sel & 0x40 != 0 {
            if let Ok(r) = regroup(t.as_ref(), "fuzz", g, true) {
                r.as_ref()
                    .validate("fuzz")
                    .expect("requantized tensor validates");
            }
        }
    }
    let to = [
        Format::Tq1_0,
        Format::Tq2_0,
        Format::Q2_0,
        Format::Pq2_0,
        Format::Ptq1_0,
        Format::Q1_0,
        Format::I2S,
        Format::Stq1_0,
    ][((sel >> 4) & 7) as usize];
    if let Ok(bytes) = encode_gguf(to, "fuzz", t.as_ref(), sel & 0x40 != 0) {
        let back = decode_gguf(to, "fuzz", &bytes, t.rows, t.cols, None, false)
            .expect("an encoder's output decodes");
        back.as_ref()
            .validate("fuzz")
            .expect("re-decoded tensor validates");
    }
}

/// Differential check of one GGUF block format against its scalar reference.
fn block_codec<C: BlockCodec>(format: Format, data: &[u8]) {
    block_codec_via::<C>(
        format,
        data,
        |bytes, rows, cols| decode_gguf(format, "fuzz", bytes, rows, cols, None, false),
        |t| encode_gguf(format, "fuzz", t, false),
    )
}

/// [`block_codec`] through given tensor-level decode and encode drivers.
fn block_codec_via<C: BlockCodec>(
    format: Format,
    data: &[u8],
    decode: impl Fn(&[u8], usize, usize) -> Result<CanonicalTernary>,
    encode: impl Fn(CanonicalRef<'_>) -> Result<Vec<u8>>,
) {
    let Some((rows, cols, bytes, sel)) = block_input::<C>(data) else {
        return;
    };
    let got = decode(&bytes, rows, cols);
    let need = rows * (cols / C::BLOCK_VALUES) * C::BLOCK_BYTES;
    if bytes.len() != need {
        assert!(
            got.is_err(),
            "{} accepted {} bytes for {need}",
            format.name(),
            bytes.len()
        );
        return;
    }
    let (codes, scales) = decode_blocks_ref::<C>(&bytes, rows, cols);
    let invalid = codes.contains(&3) || scales.iter().any(|s| !s.is_finite());
    let t = match got {
        Err(e) => {
            assert!(
                invalid,
                "{} refused data its reference accepts: {e}",
                format.name()
            );
            return;
        }
        Ok(t) => t,
    };
    assert!(
        !invalid,
        "{} accepted code 3 or a non-finite scale",
        format.name()
    );
    assert_eq!(
        (t.rows, t.cols, t.group_size),
        (rows, cols, C::BLOCK_VALUES)
    );
    assert!(
        same_scales(&t.scales, &scales),
        "{}: fast scales differ from the reference",
        format.name()
    );
    assert_eq!(
        codes_of(&t),
        codes,
        "{}: fast codes differ from the reference",
        format.name()
    );
    // Fast encoder = reference encoder, and its output decodes to the same tensor.
    let enc = encode(t.as_ref()).expect("re-encode a decoded tensor");
    assert_eq!(
        enc,
        encode_blocks_ref::<C>(&codes, &scales),
        "{}: fast encoder differs",
        format.name()
    );
    let back = decode(&enc, rows, cols).expect("decode re-encoded");
    assert_eq!(
        back,
        t,
        "{}: decode(encode(decode(x))) != decode(x)",
        format.name()
    );
    exercise_canonical(&t, sel);
}

pub fn decode_tq1_0(data: &[u8]) {
    block_codec::<BlockTq1_0>(Format::Tq1_0, data)
}
pub fn decode_tq2_0(data: &[u8]) {
    block_codec::<BlockTq2_0>(Format::Tq2_0, data)
}
pub fn decode_q2_0(data: &[u8]) {
    block_codec::<BlockQ2_0>(Format::Q2_0, data)
}
/// PQ2_0 and PrismML's id-42 g128 "Q2_0" share these bytes; both names must decode alike.
pub fn decode_pq2_0(data: &[u8]) {
    block_codec::<BlockPq2_0>(Format::Pq2_0, data);
    if let Some((rows, cols, bytes, _)) = block_input::<BlockPq2_0>(data) {
        let a = decode_gguf(Format::Pq2_0, "fuzz", &bytes, rows, cols, None, false).ok();
        let b = decode_gguf(Format::Q2_0G128, "fuzz", &bytes, rows, cols, None, false).ok();
        assert_eq!(
            a, b,
            "PQ2_0 and Q2_0_G128 decode the same bytes differently"
        );
    }
}
pub fn decode_ptq1_0(data: &[u8]) {
    block_codec::<BlockPtq1_0>(Format::Ptq1_0, data)
}
pub fn decode_q1_0(data: &[u8]) {
    block_codec::<BlockQ1_0>(Format::Q1_0, data)
}
/// STQ1_0 through the GGUF dispatch and through its own drivers (`stq1_0::decode` / `encode`),
/// then the encode side on arbitrary trits: the input bytes as a canonical g256 tensor (code 3 read
/// as 1) either encodes — and decodes back to itself — or is refused with exactly the groups
/// `first_unrepresentable` counts; requantized, it always encodes, keeps representable tensors
/// bit for bit, and equals the scalar reference quantizer on the dequantized weights.
pub fn decode_stq1_0(data: &[u8]) {
    block_codec::<BlockStq1_0>(Format::Stq1_0, data);
    block_codec_via::<BlockStq1_0>(
        Format::Stq1_0,
        data,
        |bytes, rows, cols| stq1_0::decode("fuzz", bytes, rows, cols),
        |t| stq1_0::encode("fuzz", t),
    );
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let (rows, cols) = small_shape(sel, 256);
    let qweight: Vec<u8> = sized(rest, rows * cols / 4)
        .into_iter()
        .map(|b| b & !((b & (b >> 1) & 0x55) << 1))
        .collect();
    let t = CanonicalTernary {
        rows,
        cols,
        group_size: 256,
        qweight,
        scales: vec![f16::from_f32(0.5); rows * cols / 256],
    };
    let (count, first) = stq1_0::first_unrepresentable(t.as_ref());
    let requantized = encode_gguf(Format::Stq1_0, "fuzz", t.as_ref(), true)
        .expect("requantizing a valid canonical tensor to STQ1_0");
    let dense = t.as_ref().dequantize_f32().expect("dequantize");
    let mut want = vec![0u8; requantized.len()];
    for (blk, x) in want.chunks_exact_mut(42).zip(dense.chunks_exact(256)) {
        stq1_0::quantize_block_ref(x, blk);
    }
    match stq1_0::encode("fuzz", t.as_ref()) {
        Ok(enc) => {
            assert_eq!(count, 0, "STQ1_0 encoded {count} unrepresentable groups");
            let back = stq1_0::decode("fuzz", &enc, rows, cols).expect("decode encoded");
            assert_eq!(back, t, "STQ1_0: decode(encode(x)) != x");
            assert_eq!(
                requantized, enc,
                "STQ1_0: requantize changed a representable tensor"
            );
        }
        Err(Error::Validation {
            first_index,
            count: n,
            ..
        }) => {
            let u = first.expect("a refusal names a group");
            assert_eq!(n, count);
            assert_eq!(first_index, (u.row * cols + u.cols[0]) as u64);
        }
        Err(e) => panic!("STQ1_0 refused a valid canonical tensor: {e}"),
    }
    // With one positive scale, upstream's quantizer keeps a representable tensor's bytes too.
    assert_eq!(
        requantized, want,
        "STQ1_0: requantize differs from the reference quantizer"
    );
}

/// Shape `[rows, cols]` from bits 0–2 of `sel`: rows ∈ 1..=2, cols a multiple of `unit` (1..=4 of them).
fn small_shape(sel: u8, unit: usize) -> (usize, usize) {
    (
        1 + (sel & 1) as usize,
        unit * (1 + ((sel >> 1) & 3) as usize),
    )
}

/// The input after the selector, zero-padded or cut to `len` bytes.
fn sized(rest: &[u8], len: usize) -> Vec<u8> {
    rest.iter()
        .copied()
        .chain(std::iter::repeat(0))
        .take(len)
        .collect()
}

/// I2_S against its reference: codes, the one f32 scale rounded to fp16, and a lossless re-encode.
pub fn decode_i2_s(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let (rows, cols) = small_shape(sel, i2_s::BLOCK_VALUES);
    let g = GROUP_SIZES[((sel >> 5) & 3) as usize];
    let len = i2_s::tensor_bytes(rows, cols).expect("small shape");
    let bytes = if sel & 0x80 != 0 {
        rest.to_vec()
    } else {
        sized(rest, len)
    };
    let got = i2_s::decode("fuzz", &bytes, rows, cols, g);
    if bytes.len() != len || !cols.is_multiple_of(g) {
        assert!(got.is_err(), "I2_S accepted a wrong length or group");
        return;
    }
    let (codes, raw) = i2_s::decode_ref(&bytes, rows * cols);
    let scale = f16::from_f32(raw);
    let invalid = codes.contains(&3) || !scale.is_finite();
    let t = match got {
        Err(e) => {
            assert!(invalid, "I2_S refused data its reference accepts: {e}");
            return;
        }
        Ok(t) => t,
    };
    assert!(!invalid, "I2_S accepted code 3 or a non-finite scale");
    assert_eq!(codes_of(&t), codes);
    assert!(t.scales.iter().all(|s| s.to_bits() == scale.to_bits()));
    let enc = i2_s::encode("fuzz", t.as_ref()).expect("re-encode I2_S");
    assert_eq!(
        enc[..len - i2_s::TAIL_BYTES],
        bytes[..len - i2_s::TAIL_BYTES],
        "I2_S codes changed"
    );
    exercise_canonical(&t, sel);
}

/// transformers BitNet (4 rows per byte along N, one `weight_scale`) against its reference.
pub fn decode_bitnet(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    if rest.len() < 4 {
        return;
    }
    let (ws, rest) = rest.split_at(4);
    let weight_scale = f32::from_le_bytes([ws[0], ws[1], ws[2], ws[3]]);
    let rows = 4 * (1 + (sel & 1) as usize);
    let cols = 32 * (1 + ((sel >> 1) & 3) as usize);
    let convention = if sel & 0x20 != 0 {
        bitnet::ScaleConvention::AutoBitLinear
    } else {
        bitnet::ScaleConvention::BitLinear
    };
    let len = rows / 4 * cols;
    let bytes = if sel & 0x80 != 0 {
        rest.to_vec()
    } else {
        sized(rest, len)
    };
    let got = bitnet::decode("fuzz", &bytes, rows, cols, weight_scale, convention, 32);
    if bytes.len() != len {
        assert!(got.is_err(), "BitNet accepted a wrong length");
        return;
    }
    let codes = bitnet::decode_ref(&bytes, rows, cols);
    let scale = convention.canonical_scale("fuzz", weight_scale);
    let invalid = codes.contains(&3) || scale.is_err();
    let t = match got {
        Err(e) => {
            assert!(invalid, "BitNet refused data its reference accepts: {e}");
            return;
        }
        Ok(t) => t,
    };
    assert!(!invalid, "BitNet accepted code 3 or a bad scale");
    assert_eq!(codes_of(&t), codes);
    let scale = scale.expect("checked");
    assert!(t.scales.iter().all(|s| s.to_bits() == scale.to_bits()));
    let (packed, _) = bitnet::encode("fuzz", t.as_ref(), convention).expect("re-encode BitNet");
    assert_eq!(packed, bytes, "BitNet codes changed");
    exercise_canonical(&t, sel);
}

/// MLX affine 2-bit packs: accepted exactly when ternary (bias = −scale, finite, no code 3).
pub fn decode_mlx(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let (rows, cols) = small_shape(sel, 32);
    let g = GROUP_SIZES[((sel >> 5) & 3) as usize];
    let groups = if cols.is_multiple_of(g) { cols / g } else { 1 };
    let n_scales = rows * groups + usize::from(sel & 0x80 != 0); // sometimes one too many
    let wlen = rows * cols / 4;
    let bytes = sized(rest, wlen + 4 * n_scales);
    let (weight, tail) = bytes.split_at(wlen);
    let halves: Vec<f16> = tail
        .chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]))
        .collect();
    let (scales, mut biases) = (halves[..n_scales].to_vec(), halves[n_scales..].to_vec());
    if sel & 0x10 != 0 {
        biases = scales.iter().map(|s| -*s).collect(); // make most inputs ternary
    }
    let got = mlx::decode("fuzz", weight, &scales, &biases, rows, cols);
    // What the pack really is: scales per row, and the group size that implies.
    let per_row = n_scales / rows;
    let well_shaped = n_scales == rows * per_row
        && per_row > 0
        && cols.is_multiple_of(per_row)
        && GROUP_SIZES.contains(&(cols / per_row));
    let ternary = scales.iter().all(|s| s.is_finite())
        && scales.iter().zip(&biases).all(|(s, b)| *b == -*s)
        && !weight.iter().any(|&b| b & (b >> 1) & 0x55 != 0);
    match got {
        Ok(t) => {
            assert!(
                well_shaped && ternary,
                "MLX accepted a malformed or non-ternary pack"
            );
            assert_eq!(t.qweight, weight);
            assert_eq!(t.group_size, cols / per_row);
            exercise_canonical(&t, sel);
        }
        Err(e) => assert!(
            !(well_shaped && ternary),
            "MLX refused a valid ternary pack: {e}"
        ),
    }
}

/// Dense "unpacked" ternary: when `recover` accepts a float tensor, dequantizing the result gives
/// back exactly the input values; `ternarize` of any floats returns Ok or Err, never panics.
pub fn decode_dense(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let (rows, cols) = small_shape(sel, 32);
    let g = GROUP_SIZES[((sel >> 5) & 3) as usize];
    let dtype = [
        dense::DenseDtype::F16,
        dense::DenseDtype::BF16,
        dense::DenseDtype::F32,
        dense::DenseDtype::F16,
    ][((sel >> 3) & 3) as usize];
    let n = rows * cols;
    let mut bytes = sized(rest, n * dtype.size());
    if sel & 0x80 != 0 {
        // Mostly ternary input: t·a with t from the data and one a = m/64 (m in 1..=256, exact in
        // every dtype) per group of g, so `recover` gets past its first checks.
        let vals: Vec<f32> = (0..n)
            .map(|i| {
                let t = (bytes[i] % 3) as f32 - 1.0;
                let m = 1 + bytes[(i / g * 7 + 1) % bytes.len()] as u32;
                t * m as f32 / 64.0
            })
            .collect();
        bytes = vals
            .iter()
            .flat_map(|&v| match dtype {
                dense::DenseDtype::F16 => f16::from_f32(v).to_le_bytes().to_vec(),
                dense::DenseDtype::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                dense::DenseDtype::F32 => v.to_le_bytes().to_vec(),
            })
            .collect();
    }
    let value = |i: usize| -> f32 {
        let s = dtype.size();
        let c = &bytes[i * s..(i + 1) * s];
        match dtype {
            dense::DenseDtype::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
            dense::DenseDtype::BF16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
            dense::DenseDtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        }
    };
    if let Ok(t) = dense::recover("fuzz", &bytes, dtype, rows, cols, g) {
        let back = t.as_ref().dequantize_f32().expect("dequantize recovered");
        for (i, b) in back.iter().enumerate() {
            assert!(
                *b == value(i),
                "dense recover changed element {i}: {} -> {b}",
                value(i)
            );
        }
        exercise_canonical(&t, sel);
    }
    let w: Vec<f32> = (0..n).map(value).collect();
    for method in [
        dense::Method::Absmax,
        dense::Method::Absmean,
        dense::Method::AbsmeanTensor,
    ] {
        if let Ok(t) = dense::ternarize("fuzz", &w, rows, cols, g, method) {
            t.as_ref()
                .validate("fuzz")
                .expect("ternarized tensor validates");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `fuzz/regressions/<target>/*`: every input that ever failed a target, replayed on each run.
    #[test]
    fn replay_regression_corpus() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions");
        let mut replayed = 0;
        for (name, target) in TARGETS {
            let Ok(entries) = std::fs::read_dir(root.join(name)) else {
                continue;
            };
            for entry in entries {
                let path = entry.expect("dir entry").path();
                let data = std::fs::read(&path).expect("read regression input");
                let outcome = std::panic::catch_unwind(|| target(&data));
                assert!(
                    outcome.is_ok(),
                    "{name}: regression input {} fails",
                    path.display()
                );
                replayed += 1;
            }
        }
        let dirs = std::fs::read_dir(&root)
            .map(|d| {
                d.filter(|e| e.as_ref().is_ok_and(|e| e.path().is_dir()))
                    .count()
            })
            .unwrap_or(0);
        assert!(
            dirs == 0 || replayed > 0,
            "regression directories hold no inputs"
        );
    }

    /// A few structured inputs per target, so each harness runs in plain `cargo test`.
    #[test]
    fn every_target_accepts_simple_inputs() {
        for (_, target) in TARGETS {
            for sel in [0u8, 0x13, 0x55, 0x80, 0xC7, 0xFF] {
                for fill in [0u8, 0x55, 0xAA, 0xFF, 0x3C] {
                    let mut data = vec![sel];
                    data.extend(std::iter::repeat_n(fill, 600));
                    target(&data);
                }
            }
            target(&[]);
        }
    }
}
