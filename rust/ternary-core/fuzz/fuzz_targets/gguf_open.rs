//! Any bytes: `GgufFile::open` returns Ok or Err, never panics, and every tensor slice it hands out
//! lies inside the file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ternary_core::container::GgufFile;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("ternary-fuzz-{}.gguf", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(f) = GgufFile::open(&path) {
        for (i, t) in f.tensors().iter().enumerate() {
            let bytes = f.tensor_data(i).expect("index in range");
            assert_eq!(bytes.len() as u64, t.nbytes);
            assert!(t.nbytes == 0 || t.abs_offset + t.nbytes <= data.len() as u64);
        }
        for (_, v) in f.metadata() {
            std::hint::black_box(v.value_type());
        }
    }
});
