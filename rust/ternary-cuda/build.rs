//! With the `nvcc` feature: compile `cuda/ternary_gemm.cu` for sm_89 and sm_90 (+ compute_90 PTX) with
//! warnings as errors, archive it, and link it with the static CUDA runtime. Without the feature: nothing
//! (the crate then reports the CUDA path as unavailable and needs no toolkit).
//!
//! The toolkit is found from `CUDA_HOME` / `CUDA_PATH`, then `nvcc` on `PATH`, then the PyPI toolkit
//! (`nvidia-cuda-nvcc` & co. install it into `site-packages/nvidia/cu13`) of the interpreter maturin
//! builds for (`PYO3_PYTHON`, `PYTHON_SYS_EXECUTABLE`) or of `python3` / `python` on `PATH`, then
//! `/usr/local/cuda`; a failure lists every place tried. Kernels carry `-lineinfo` (line tables only, no
//! code change) so compute-sanitizer and profilers point at source lines.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const KERNEL_SOURCES: [&str; 3] = ["ternary_gemm.cu", "fwht.cu", "activation_quant.cu"];
const KERNEL_HEADERS: [&str; 5] = [
    "ternary_gemm.h",
    "ternary_frag.h",
    "fwht.h",
    "activation_quant.h",
    "activation_quant_math.h",
];
const GENCODE: [&str; 3] = [
    "arch=compute_89,code=sm_89",
    "arch=compute_90,code=sm_90",
    "arch=compute_90,code=compute_90",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_PATH");
    println!("cargo:rerun-if-env-changed=NVCC_CCBIN");
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=PYTHON_SYS_EXECUTABLE");
    if env::var_os("CARGO_FEATURE_NVCC").is_none() {
        return;
    }
    let manifest =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let cuda_dir = manifest.join("../../cuda");
    for f in KERNEL_SOURCES.iter().chain(KERNEL_HEADERS.iter()) {
        println!("cargo:rerun-if-changed={}", cuda_dir.join(f).display());
    }
    let toolkit = find_toolkit().unwrap_or_else(|tried| {
        panic!(
            "feature `nvcc` is on but no CUDA toolkit was found; tried:\n  {}\nset CUDA_HOME, put nvcc on \
             PATH, or `pip install nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-crt nvidia-cuda-cccl \
             nvidia-nvvm` into the Python you build for (see scripts/setup_env.sh)",
            tried.join("\n  ")
        )
    });
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = toolkit.join("bin/nvcc");
    let mut objects = Vec::new();
    for src in KERNEL_SOURCES {
        let obj = out.join(src.replace(".cu", ".o"));
        let mut cmd = Command::new(&nvcc);
        cmd.arg("-c")
            .arg(cuda_dir.join(src))
            .arg("-o")
            .arg(&obj)
            .args([
                "-std=c++17",
                "-O3",
                "-lineinfo",
                "-Werror",
                "all-warnings",
                "-Xcompiler",
                "-fPIC",
            ]);
        for g in GENCODE {
            cmd.arg("-gencode").arg(g);
        }
        if let Some(ccbin) = env::var_os("NVCC_CCBIN") {
            cmd.arg("-ccbin").arg(ccbin);
        }
        run(&mut cmd);
        objects.push(obj);
    }
    let lib = out.join("libternary_gemm.a");
    let _ = std::fs::remove_file(&lib);
    run(Command::new("ar").arg("crs").arg(&lib).args(&objects));

    let libdir = cudart_dir(&toolkit);
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=ternary_gemm");
    println!("cargo:rustc-link-search=native={}", libdir.display());
    println!("cargo:rustc-link-lib=static=cudart_static");
    for lib in ["dl", "rt", "pthread", "stdc++"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
}

fn run(cmd: &mut Command) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(status.success(), "{cmd:?} failed with {status}");
}

fn is_toolkit(dir: &Path) -> bool {
    dir.join("bin/nvcc").is_file()
}

/// The toolkit directory, or every place looked at.
fn find_toolkit() -> Result<PathBuf, Vec<String>> {
    let mut tried = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        match env::var_os(var).map(PathBuf::from) {
            Some(d) if is_toolkit(&d) => return Ok(d),
            Some(d) => tried.push(format!("{var}={} (no bin/nvcc)", d.display())),
            None => tried.push(format!("{var} (not set)")),
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for d in env::split_paths(&path) {
            if d.join("nvcc").is_file() {
                if let Some(root) = d.parent() {
                    return Ok(root.to_path_buf());
                }
            }
        }
    }
    tried.push("nvcc on PATH (none)".into());
    // The interpreter maturin builds for first: its site-packages is where setup_env.sh installs nvcc.
    let mut pythons: Vec<String> = ["PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"]
        .iter()
        .filter_map(|v| env::var(v).ok())
        .collect();
    pythons.extend(["python3".to_string(), "python".to_string()]);
    for python in pythons {
        let Ok(out) = Command::new(&python)
            .args([
                "-c",
                "import nvidia, os; print('\\n'.join(nvidia.__path__))",
            ])
            .output()
        else {
            tried.push(format!("{python} (cannot run)"));
            continue;
        };
        if !out.status.success() {
            tried.push(format!("{python}: no `nvidia` package"));
            continue;
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            for sub in ["cu13", "cu12", "cuda_nvcc"] {
                let d = Path::new(line.trim()).join(sub);
                if is_toolkit(&d) {
                    return Ok(d);
                }
                tried.push(format!("{python}: {} (no bin/nvcc)", d.display()));
            }
        }
    }
    let d = PathBuf::from("/usr/local/cuda");
    if is_toolkit(&d) {
        return Ok(d);
    }
    tried.push("/usr/local/cuda (no bin/nvcc)".into());
    Err(tried)
}

/// Where `libcudart_static.a` lives (`lib64` in system toolkits, `lib` in the PyPI one).
fn cudart_dir(toolkit: &Path) -> PathBuf {
    for sub in ["lib64", "lib", "lib/x64", "targets/x86_64-linux/lib"] {
        let d = toolkit.join(sub);
        if d.join("libcudart_static.a").is_file() {
            return d;
        }
    }
    panic!(
        "no libcudart_static.a under {} (install nvidia-cuda-runtime)",
        toolkit.display()
    );
}
