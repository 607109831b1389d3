//! libFuzzer target `decode_stq1_0`: see `ternary_core::fuzzing::decode_stq1_0` for what it checks.
#![no_main]

libfuzzer_sys::fuzz_target!(
    // One worker thread (fuzzing runs niced beside other work), and each input runs on it: nested
    // pool calls then run inline instead of handing work across threads several times per input.
    init: ternary_core::threads::set_num_threads(1).expect("one thread"),
    |data: &[u8]| ternary_core::threads::install(|| ternary_core::fuzzing::decode_stq1_0(data))
);
