fn main() {
    // Filled in by the CUDA work: when the `nvcc` feature is on, compile ../../cuda/*.cu for sm_89/sm_90.
    println!("cargo:rerun-if-changed=build.rs");
}
