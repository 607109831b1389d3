//! Compiles the C++ wrapper that lets the natively registered torch kernel raise errors
//! (see csrc/torch_boxed.cpp). Needs only a C++ compiler, never torch's headers.
fn main() {
    println!("cargo:rerun-if-changed=csrc/torch_boxed.cpp");
    cc::Build::new()
        .cpp(true)
        .file("csrc/torch_boxed.cpp")
        .flag_if_supported("-std=c++17")
        .compile("ternary_rs_torch_boxed");
}
