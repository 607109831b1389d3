//! Any bytes: `SafetensorsFile::open` returns Ok or Err, never panics, and tensors tile the data
//! section exactly.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ternary_core::container::SafetensorsFile;

fuzz_target!(|data: &[u8]| {
    let path =
        std::env::temp_dir().join(format!("ternary-fuzz-{}.safetensors", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(f) = SafetensorsFile::open(&path) {
        let mut covered = 0u64;
        for t in f.tensors() {
            let bytes = f.tensor_data(&t.name).expect("listed tensor");
            assert_eq!(bytes.len() as u64, t.nbytes);
            covered += t.nbytes;
        }
        assert_eq!(8 + f.header_size + covered, data.len() as u64);
    }
});
