//! Round trips through the writers and readers, and malformed-input handling.
//! (Cross-checks against llama.cpp's own gguf-py reader/writer and the `safetensors` package live in
//! the Python tests.)

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use proptest::prelude::*;

use super::gguf::{ArrayItems, ByteOrder, GgufValue, GgufValueType as T};
use super::*;
use crate::Error;

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ternary-core-container-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A small file with one tensor of each interesting type and metadata of every value type.
fn write_sample(path: &Path, alignment: u64) -> Vec<(String, Vec<u64>, u32, Vec<u8>)> {
    let mut w = GgufWriter::create(path, alignment).unwrap();
    w.add_metadata("general.architecture", MetaValue::String("llama".into()))
        .unwrap();
    w.add_metadata("u8", MetaValue::U8(7)).unwrap();
    w.add_metadata("i8", MetaValue::I8(-7)).unwrap();
    w.add_metadata("u16", MetaValue::U16(65535)).unwrap();
    w.add_metadata("i16", MetaValue::I16(-300)).unwrap();
    w.add_metadata("u32", MetaValue::U32(1 << 31)).unwrap();
    w.add_metadata("i32", MetaValue::I32(-5)).unwrap();
    w.add_metadata("f32", MetaValue::F32(0.5)).unwrap();
    w.add_metadata("bool", MetaValue::Bool(true)).unwrap();
    w.add_metadata("u64", MetaValue::U64(u64::MAX)).unwrap();
    w.add_metadata("i64", MetaValue::I64(i64::MIN)).unwrap();
    w.add_metadata("f64", MetaValue::F64(-2.25)).unwrap();
    w.add_metadata(
        "strings",
        MetaValue::Array(
            T::String,
            vec![MetaValue::String("a".into()), MetaValue::String("".into())],
        ),
    )
    .unwrap();
    w.add_metadata(
        "i8s",
        MetaValue::Array(T::I8, vec![MetaValue::I8(-1), MetaValue::I8(2)]),
    )
    .unwrap();
    w.add_metadata(
        "nested",
        MetaValue::Array(
            T::Array,
            vec![
                MetaValue::Array(T::U32, vec![MetaValue::U32(1), MetaValue::U32(2)]),
                MetaValue::Array(T::String, vec![MetaValue::String("x".into())]),
            ],
        ),
    )
    .unwrap();
    let tensors: Vec<(String, Vec<u64>, u32, u64)> = vec![
        ("f32".into(), vec![3, 2], 0, 24),
        ("tq2".into(), vec![256, 2], 35, 132),
        ("pq2".into(), vec![128, 3], 142, 102),
        ("ptq1".into(), vec![256], 143, 56),
        // Big enough that the g64 reading (n/64 bytes longer) cannot hide in 256-byte padding.
        ("q2_g128".into(), vec![128 * 256], 42, 256 * 34),
        ("empty".into(), vec![0, 4], 1, 0),
        ("i2s".into(), vec![128, 2], 36, 64 + 32),
    ];
    let mut out = Vec::new();
    for (name, ne, id, nbytes) in &tensors {
        w.add_tensor_info(name, ne, *id, *nbytes).unwrap();
    }
    for (i, (name, ne, id, nbytes)) in tensors.iter().enumerate() {
        let data: Vec<u8> = (0..*nbytes)
            .map(|b| (b as u8).wrapping_mul(31).wrapping_add(i as u8))
            .collect();
        // Two chunks, to exercise chunked writes.
        let mid = data.len() / 2;
        if !data.is_empty() {
            w.write_tensor_data(name, &data[..mid]).unwrap();
            w.write_tensor_data(name, &data[mid..]).unwrap();
        }
        out.push((name.clone(), ne.clone(), *id, data));
    }
    w.finish().unwrap();
    out
}

#[test]
fn gguf_round_trip_every_value_type() {
    for alignment in [32, 64, 256, 1] {
        let p = tmp(&format!("sample-{alignment}.gguf"));
        let expect = write_sample(&p, alignment);
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(
            (f.version, f.byte_order, f.alignment),
            (3, ByteOrder::Little, alignment)
        );
        assert_eq!(f.get("u8"), Some(&GgufValue::U8(7)));
        assert_eq!(f.get("i16"), Some(&GgufValue::I16(-300)));
        assert_eq!(f.get("u64"), Some(&GgufValue::U64(u64::MAX)));
        assert_eq!(f.get("i64"), Some(&GgufValue::I64(i64::MIN)));
        assert_eq!(f.get("f64"), Some(&GgufValue::F64(-2.25)));
        assert_eq!(f.get("bool"), Some(&GgufValue::Bool(true)));
        assert_eq!(f.get_str("general.architecture").as_deref(), Some("llama"));
        let Some(GgufValue::Array(a)) = f.get("strings") else {
            panic!()
        };
        let ArrayItems::Strings(s) = &a.items else {
            panic!()
        };
        assert_eq!(f.str_lossy(s[0]), "a");
        assert_eq!(f.str_lossy(s[1]), "");
        let Some(GgufValue::Array(a)) = f.get("i8s") else {
            panic!()
        };
        assert_eq!(f.array_scalar(a, 0), Some(GgufValue::I8(-1)));
        assert_eq!(f.array_scalar(a, 2), None);
        let Some(GgufValue::Array(a)) = f.get("nested") else {
            panic!()
        };
        let ArrayItems::Arrays(inner) = &a.items else {
            panic!()
        };
        assert_eq!(f.array_scalar(&inner[0], 1), Some(GgufValue::U32(2)));
        assert_eq!(inner[1].elem, T::String);
        if alignment != 32 {
            assert_eq!(
                f.get("general.alignment"),
                Some(&GgufValue::U32(alignment as u32))
            );
        }
        assert_eq!(f.tensors().len(), expect.len());
        for (t, (name, ne, id, data)) in f.tensors().iter().zip(&expect) {
            assert_eq!((&t.name, &t.ne, t.type_id), (name, ne, *id));
            assert_eq!(f.tensor_data_by_name(name).unwrap(), &data[..], "{name}");
            assert_eq!(t.abs_offset % alignment, f.data_offset % alignment);
        }
        assert_eq!(
            f.tensor_info("q2_g128").unwrap().ggml_type,
            GgmlType::Q2_0_G128
        );
        assert_eq!(f.tensor_info("ptq1").unwrap().ggml_type, GgmlType::PTQ1_0);
        assert_eq!(f.tensor_info("i2s").unwrap().ggml_type, GgmlType::I2_S);
        assert_eq!(f.tensor_info("f32").unwrap().shape(), vec![2, 3]);
    }
}

#[test]
fn id_42_is_resolved_by_byte_span() {
    let p = tmp("q2.gguf");
    let mut w = GgufWriter::create(&p, 32).unwrap();
    // 64 blocks of 64 (g64: 1152 B) and 32 blocks of 128 (g128: 1088 B) — unambiguous spans.
    w.add_tensor_info("a", &[4096], 42, 4096 / 64 * 18).unwrap();
    w.add_tensor_info("b", &[4096], 42, 4096 / 128 * 34)
        .unwrap();
    // 64 values: only g64 possible.
    w.add_tensor_info("c", &[64], 42, 18).unwrap();
    // 128 values: 34 or 36 bytes both fit one 32-byte-aligned slot; follows the file's majority.
    w.add_tensor_info("d", &[128], 42, 34).unwrap();
    // (Unambiguous votes so far: a, c for g64; b, e, f for g128.)
    w.add_tensor_info("e", &[4096], 42, 4096 / 128 * 34)
        .unwrap();
    w.add_tensor_info("f", &[4096], 42, 4096 / 128 * 34)
        .unwrap();
    for (n, b) in [
        ("a", 1152),
        ("b", 1088),
        ("c", 18),
        ("d", 34),
        ("e", 1088),
        ("f", 1088),
    ] {
        w.write_tensor_data(n, &vec![0u8; b]).unwrap();
    }
    w.finish().unwrap();
    let f = GgufFile::open(&p).unwrap();
    let ty: Vec<_> = f
        .tensors()
        .iter()
        .map(|t| (t.ggml_type, t.nbytes))
        .collect();
    assert_eq!(
        ty,
        vec![
            (GgmlType::Q2_0, 1152),
            (GgmlType::Q2_0_G128, 1088),
            (GgmlType::Q2_0, 18),
            (GgmlType::Q2_0_G128, 34),
            (GgmlType::Q2_0_G128, 1088),
            (GgmlType::Q2_0_G128, 1088)
        ]
    );
}

fn expect_format_err(bytes: &[u8], needle: &str) {
    let p = tmp(&format!("bad-{}.gguf", needle.replace(' ', "_")));
    std::fs::write(&p, bytes).unwrap();
    match GgufFile::open(&p) {
        Err(Error::Format { what, .. }) => {
            assert!(what.contains(needle), "'{what}' lacks '{needle}'")
        }
        other => panic!("expected a format error containing '{needle}', got {other:?}"),
    }
}

fn header(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut h = b"GGUF".to_vec();
    h.extend_from_slice(&version.to_le_bytes());
    h.extend_from_slice(&n_tensors.to_le_bytes());
    h.extend_from_slice(&n_kv.to_le_bytes());
    h
}

fn tensor_info(h: &mut Vec<u8>, name: &str, ne: &[u64], ty: u32, offset: u64) {
    h.extend_from_slice(&(name.len() as u64).to_le_bytes());
    h.extend_from_slice(name.as_bytes());
    h.extend_from_slice(&(ne.len() as u32).to_le_bytes());
    for d in ne {
        h.extend_from_slice(&d.to_le_bytes());
    }
    h.extend_from_slice(&ty.to_le_bytes());
    h.extend_from_slice(&offset.to_le_bytes());
}

fn pad_to(h: &mut Vec<u8>, a: usize, extra: usize) {
    while !h.len().is_multiple_of(a) {
        h.push(0);
    }
    h.extend(std::iter::repeat_n(0u8, extra));
}

#[test]
fn malformed_gguf_headers_are_format_errors() {
    expect_format_err(b"GGUX\x03\0\0\0", "bad magic 0x47 0x47 0x55 0x58");
    expect_format_err(&header(1, 0, 0), "version 1");
    expect_format_err(&header(7, 0, 0), "unsupported GGUF version 7");
    expect_format_err(&header(3, u64::MAX, 0), "MAX_TENSORS");
    expect_format_err(&header(3, 0, u64::MAX), "MAX_KV");
    let mut h = header(3, 0, 1);
    h.extend_from_slice(&u64::MAX.to_le_bytes());
    expect_format_err(&h, "MAX_STRING_LEN");
    let mut h = header(3, 0, 1);
    h.extend_from_slice(&3u64.to_le_bytes());
    h.extend_from_slice(b"key");
    h.extend_from_slice(&9u32.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&(1u64 << 27).to_le_bytes());
    expect_format_err(&h, "needs at least");
    let mut h = header(3, 1, 0);
    tensor_info(&mut h, "t", &[1, 1, 1, 1, 1], 0, 0);
    expect_format_err(&h, "MAX_DIMS");
    let mut h = header(3, 1, 0);
    tensor_info(&mut h, "t", &[4], 0, 0);
    pad_to(&mut h, 32, 8);
    expect_format_err(&h, "run past the end");
    let mut h = header(3, 2, 0);
    tensor_info(&mut h, "a", &[16], 0, 0);
    tensor_info(&mut h, "b", &[16], 0, 32);
    pad_to(&mut h, 32, 96);
    expect_format_err(&h, "overlaps");
    let mut h = header(3, 1, 0);
    tensor_info(&mut h, "t", &[4], 0, 8);
    pad_to(&mut h, 32, 64);
    expect_format_err(&h, "not a multiple of the alignment");
    let mut h = header(3, 1, 0);
    tensor_info(&mut h, "t", &[100], 35, 0);
    pad_to(&mut h, 32, 4096);
    expect_format_err(&h, "not a multiple of the TQ2_0 block size 256");
    let mut h = header(3, 0, 1);
    h.extend_from_slice(&17u64.to_le_bytes());
    h.extend_from_slice(b"general.alignment");
    h.extend_from_slice(&4u32.to_le_bytes());
    h.extend_from_slice(&48u32.to_le_bytes());
    expect_format_err(&h, "power of two");
    let p = tmp("unknown-type.gguf");
    let mut h = header(3, 1, 0);
    tensor_info(&mut h, "t", &[4], 37, 0);
    pad_to(&mut h, 32, 64);
    std::fs::write(&p, &h).unwrap();
    assert!(matches!(
        GgufFile::open(&p),
        Err(Error::UnsupportedType { .. })
    ));
}

#[test]
fn big_endian_files_are_read() {
    let mut h = b"GGUF".to_vec();
    h.extend_from_slice(&3u32.to_be_bytes());
    h.extend_from_slice(&1u64.to_be_bytes());
    h.extend_from_slice(&1u64.to_be_bytes());
    h.extend_from_slice(&1u64.to_be_bytes());
    h.push(b'k');
    h.extend_from_slice(&(T::U32 as u32).to_be_bytes());
    h.extend_from_slice(&0x01020304u32.to_be_bytes());
    h.extend_from_slice(&1u64.to_be_bytes());
    h.push(b't');
    h.extend_from_slice(&1u32.to_be_bytes());
    h.extend_from_slice(&2u64.to_be_bytes());
    h.extend_from_slice(&0u32.to_be_bytes());
    h.extend_from_slice(&0u64.to_be_bytes());
    pad_to(&mut h, 32, 8);
    let p = tmp("be.gguf");
    std::fs::write(&p, &h).unwrap();
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.byte_order, ByteOrder::Big);
    assert_eq!(f.get("k"), Some(&GgufValue::U32(0x01020304)));
    assert_eq!(f.tensors()[0].ne, vec![2]);
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let p = tmp("trunc-src.gguf");
    write_sample(&p, 32);
    let full = std::fs::read(&p).unwrap();
    let q = tmp("trunc.gguf");
    let data_offset = GgufFile::open(&p).unwrap().data_offset as usize;
    // Every byte of the header, then a sample of points in the data.
    let cuts = (0..data_offset + 64).chain((data_offset + 64..full.len()).step_by(61));
    for cut in cuts {
        std::fs::write(&q, &full[..cut]).unwrap();
        assert!(
            GgufFile::open(&q).is_err(),
            "truncated at {cut} of {} opened",
            full.len()
        );
    }
}

#[test]
fn writer_refuses_misuse() {
    let p = tmp("misuse.gguf");
    let mut w = GgufWriter::create(&p, 32).unwrap();
    assert!(w.add_tensor_info("x", &[256], 35, 65).is_err()); // wrong size
    assert!(w.add_tensor_info("x", &[100], 35, 66).is_err()); // partial block
    w.add_tensor_info("a", &[4], 0, 16).unwrap();
    w.add_tensor_info("b", &[4], 0, 16).unwrap();
    assert!(w.add_tensor_info("a", &[4], 0, 16).is_err()); // duplicate
    assert!(w.write_tensor_data("b", &[0; 16]).is_err()); // out of order
    assert!(w.write_tensor_data("a", &[0; 17]).is_err()); // too long
    w.write_tensor_data("a", &[0; 16]).unwrap();
    assert!(w.add_metadata("late", MetaValue::U8(1)).is_err());
    assert!(w.finish().is_err()); // b missing
    assert!(GgufWriter::create(tmp("x.gguf"), 48).is_err());
    let mut w = GgufWriter::create(tmp("arr.gguf"), 32).unwrap();
    assert!(w
        .add_metadata(
            "mixed",
            MetaValue::Array(T::U8, vec![MetaValue::U8(1), MetaValue::I8(1)])
        )
        .is_err());
}

#[test]
fn safetensors_round_trip_and_validation() {
    let p = tmp("a.safetensors");
    let tensors = vec![
        ("w".to_string(), Dtype::F32, vec![2, 3]),
        ("b".to_string(), Dtype::U8, vec![5]),
        ("h".to_string(), Dtype::BF16, vec![3]),
        ("z".to_string(), Dtype::F16, vec![0]),
        ("f4".to_string(), Dtype::F4, vec![4]),
    ];
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let mut w = SafetensorsWriter::create(&p, &tensors, Some(&meta)).unwrap();
    w.write("w", &[1u8; 24]).unwrap();
    assert!(w.write("h", &[0; 6]).is_err());
    w.write("b", &[1, 2]).unwrap();
    w.write("b", &[3, 4, 5]).unwrap();
    w.write("h", &[9; 6]).unwrap();
    assert!(w.finish().is_err());
    w.write("f4", &[7, 8]).unwrap();
    w.finish().unwrap();
    let c = SafetensorsCheckpoint::open_file(&p).unwrap();
    assert_eq!(c.metadata().unwrap()["format"], "pt");
    let names: Vec<_> = c.tensors().map(|(_, t)| t.name.clone()).collect();
    assert_eq!(names, ["w", "b", "h", "z", "f4"]);
    assert_eq!(c.tensor_data("b").unwrap(), &[1, 2, 3, 4, 5]);
    assert_eq!(c.tensor_data("f4").unwrap(), &[7, 8]);
    let (_, h) = c.tensor_info("h").unwrap();
    assert_eq!((h.abs_offset % 2, h.nbytes), (1, 6)); // unaligned BF16 after 5 U8 bytes is allowed

    let full = std::fs::read(&p).unwrap();
    let q = tmp("a-trunc.safetensors");
    for cut in 0..full.len() {
        std::fs::write(&q, &full[..cut]).unwrap();
        assert!(SafetensorsFile::open(&q).is_err(), "truncated at {cut}");
    }
    let mut big = full.clone();
    big[..8].copy_from_slice(&(limits::MAX_HEADER_SIZE + 1).to_le_bytes());
    std::fs::write(&q, &big).unwrap();
    assert!(
        matches!(SafetensorsFile::open(&q), Err(Error::Format { what, .. }) if what.contains("MAX_HEADER_SIZE"))
    );
}

fn meta_value() -> impl Strategy<Value = MetaValue> {
    let leaf = prop_oneof![
        any::<u8>().prop_map(MetaValue::U8),
        any::<i8>().prop_map(MetaValue::I8),
        any::<u16>().prop_map(MetaValue::U16),
        any::<i32>().prop_map(MetaValue::I32),
        any::<u64>().prop_map(MetaValue::U64),
        any::<bool>().prop_map(MetaValue::Bool),
        (-1e6f64..1e6).prop_map(MetaValue::F64),
        "[a-z0-9 ]{0,12}".prop_map(MetaValue::String),
    ];
    leaf.prop_recursive(2, 16, 4, |inner| {
        inner.prop_flat_map(|first| {
            let ty = first.value_type();
            let same = Just(first.clone());
            proptest::collection::vec(same, 0..4).prop_map(move |items| MetaValue::Array(ty, items))
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_files_round_trip(
        values in proptest::collection::vec(meta_value(), 0..6),
        dims in proptest::collection::vec((1u64..4, 1u64..3, prop_oneof![Just(0u32), Just(34), Just(35), Just(142), Just(143)]), 0..5),
        align_pow in 0u32..9,
    ) {
        let alignment = 1u64 << align_pow;
        let p = tmp(&format!("prop-{}.gguf", align_pow));
        let mut w = GgufWriter::create(&p, alignment).unwrap();
        for (i, v) in values.iter().enumerate() {
            w.add_metadata(&format!("k{i}"), v.clone()).unwrap();
        }
        let mut datas = Vec::new();
        for (i, &(a, b, id)) in dims.iter().enumerate() {
            let ty = GgmlType::from_id(id).unwrap();
            let ne = [a * ty.block_size(), b];
            let nbytes = ty.tensor_bytes(ne[0] * ne[1]).unwrap();
            w.add_tensor_info(&format!("t{i}"), &ne, id, nbytes).unwrap();
            datas.push(vec![i as u8; nbytes as usize]);
        }
        for (i, d) in datas.iter().enumerate() {
            w.write_tensor_data(&format!("t{i}"), d).unwrap();
        }
        w.finish().unwrap();
        let f = GgufFile::open(&p).unwrap();
        for (i, v) in values.iter().enumerate() {
            let got = f.get(&format!("k{i}")).unwrap();
            prop_assert_eq!(got.value_type(), v.value_type());
            if let (GgufValue::String(s), MetaValue::String(e)) = (got, v) {
                let s = f.str_lossy(*s).into_owned();
                prop_assert_eq!(s.as_str(), e.as_str());
            }
        }
        for (i, d) in datas.iter().enumerate() {
            prop_assert_eq!(f.tensor_data_by_name(&format!("t{i}")).unwrap(), &d[..]);
        }
        // Flip any one header byte: open must return (Ok or Err), never panic.
        let bytes = std::fs::read(&p).unwrap();
        let q = tmp(&format!("prop-flip-{}.gguf", align_pow));
        for pos in (0..bytes.len().min(400)).step_by(7) {
            let mut b = bytes.clone();
            b[pos] ^= 0xA5;
            std::fs::write(&q, &b).unwrap();
            let _ = GgufFile::open(&q);
        }
    }
}

#[test]
fn many_tensors_sharing_an_offset_open_in_linear_time() {
    // 200k empty tensors at offset 0: a quadratic span search would take minutes.
    let n = 200_000u64;
    let mut h = header(3, n, 0);
    for i in 0..n {
        tensor_info(&mut h, &format!("t{i}"), &[0], 0, 0);
    }
    pad_to(&mut h, 32, 0);
    let p = tmp("many-empty.gguf");
    std::fs::write(&p, &h).unwrap();
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.tensors().len(), n as usize);
    assert!(f.tensors().iter().all(|t| t.nbytes == 0));
}

#[test]
fn empty_tensor_past_an_unpadded_header_is_an_empty_slice() {
    // A header with no padding after it: the data start lies past the end of the file.
    let mut h = header(3, 1, 0);
    tensor_info(&mut h, "e", &[0], 0, 0);
    assert_ne!(h.len() % 32, 0);
    let p = tmp("unpadded.gguf");
    std::fs::write(&p, &h).unwrap();
    let f = GgufFile::open(&p).unwrap();
    assert!(f.data_offset > h.len() as u64);
    assert_eq!(f.tensor_data(0), Some(&[][..]));
}

// ---- files that change under a map -------------------------------------------------------------

#[test]
fn truncated_file_reads_zeros_and_is_reported_not_fatal() {
    let dir = std::env::temp_dir().join(format!("ternary-sigbus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("shrinks.bin");
    let page = 4096usize;
    std::fs::write(&path, vec![0xA5u8; 16 * page]).unwrap();
    let map = crate::container::MappedFile::open(&path).unwrap();
    map.check_unchanged().unwrap();
    assert_eq!(map.bytes()[5 * page], 0xA5);
    // Shrink to 2 pages: pages 2.. are gone; touching them would raise SIGBUS without the guard.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(2 * page as u64)
        .unwrap();
    let tail: u64 = map.bytes()[3 * page..].iter().map(|&b| b as u64).sum();
    assert_eq!(tail, 0, "lost pages read as zeros");
    assert_eq!(
        map.bytes()[page],
        0xA5,
        "pages still in the file keep their bytes"
    );
    let e = map.check_unchanged().unwrap_err().to_string();
    assert!(e.contains("shrank") && e.contains("shrinks.bin"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn modified_replaced_and_removed_files_are_reported() {
    let dir = std::env::temp_dir().join(format!("ternary-changed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("f.bin");
    std::fs::write(&path, [1u8; 64]).unwrap();
    let map = crate::container::MappedFile::open(&path).unwrap();
    // Same size, rewritten in place: caught by the modification time.
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&path, [2u8; 64]).unwrap();
    let e = map.check_unchanged().unwrap_err().to_string();
    assert!(e.contains("was modified"), "{e}");

    let map = crate::container::MappedFile::open(&path).unwrap();
    std::fs::write(dir.join("g.bin"), [3u8; 64]).unwrap();
    std::fs::rename(dir.join("g.bin"), &path).unwrap();
    let e = map.check_unchanged().unwrap_err().to_string();
    assert!(e.contains("replaced"), "{e}");
    assert_eq!(
        map.bytes()[0],
        2,
        "a replaced file's map keeps the old bytes"
    );

    let map = crate::container::MappedFile::open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(map
        .check_unchanged()
        .unwrap_err()
        .to_string()
        .contains("removed"));
    std::fs::remove_dir_all(&dir).unwrap();
}
