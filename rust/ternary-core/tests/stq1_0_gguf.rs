//! STQ1_0 through the container: the GGUF type registry and a GGUF file written, reopened and
//! decoded. Here, outside the crate, because `container` and the codecs meet only in their callers
//! (docs/design.md#rust-layers).

use half::f16;
use ternary_core::container::{GgmlType, GgufFile, GgufWriter};
use ternary_core::formats::blocks::decode_blocks_ref;
use ternary_core::formats::stq1_0::{self, BlockStq1_0};

#[test]
fn ggml_type_is_registered() {
    let t = GgmlType::from_id(43).unwrap();
    assert_eq!(
        (t, t.name(), t.block_size(), t.type_size()),
        (GgmlType::STQ1_0, "STQ1_0", 256, 42)
    );
    assert_eq!(GgmlType::from_name("STQ1_0"), Some(GgmlType::STQ1_0));
    assert_eq!(t.tensor_bytes(256 * 10), Some(420));
    assert_eq!(t.tensor_bytes(128), None);
    // 1.3125 bits per weight.
    assert_eq!(t.type_size() as f64 * 8.0 / t.block_size() as f64, 1.3125);
}

/// Blocks of arbitrary `qs`/`sign` bytes (every one decodes) with finite scales.
fn blocks(n_blocks: usize) -> Vec<u8> {
    let mut data: Vec<u8> = (0..n_blocks * 42).map(|i| (i * 151 % 251) as u8).collect();
    for (i, blk) in data.chunks_exact_mut(42).enumerate() {
        let d = f16::from_f32(0.01 + i as f32 * 0.003);
        blk[40..42].copy_from_slice(&d.to_le_bytes());
    }
    data
}

#[test]
fn gguf_file_with_stq1_0_opens_lists_and_decodes() {
    let dir = std::env::temp_dir().join(format!("ternary-core-stq1_0-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("stq.gguf");
    let (rows, cols) = (3usize, 768usize);
    let data = blocks(rows * cols / 256);
    let mut w = GgufWriter::create(&path, 32).unwrap();
    w.add_tensor_info(
        "blk.0.ffn_up.weight",
        &[cols as u64, rows as u64],
        43,
        data.len() as u64,
    )
    .unwrap();
    w.write_tensor_data("blk.0.ffn_up.weight", &data).unwrap();
    w.finish().unwrap();
    let f = GgufFile::open(&path).unwrap();
    let info = f.tensor_info("blk.0.ffn_up.weight").unwrap();
    assert_eq!(info.ggml_type, GgmlType::STQ1_0);
    assert_eq!(info.nbytes, data.len() as u64);
    let bytes = f.tensor_data_by_name("blk.0.ffn_up.weight").unwrap();
    let t = stq1_0::decode("blk.0.ffn_up.weight", bytes, rows, cols).unwrap();
    let (codes, _) = decode_blocks_ref::<BlockStq1_0>(&data, rows, cols);
    let decoded: Vec<u8> = t
        .qweight
        .iter()
        .flat_map(|&b| (0..4).map(move |j| (b >> (2 * j)) & 3))
        .collect();
    assert_eq!(decoded, codes);
    std::fs::remove_dir_all(&dir).ok();
}
