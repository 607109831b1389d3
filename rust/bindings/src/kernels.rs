//! CPU ternary GEMV/GEMM bindings (`ternary_rs._core.ternary_gemm_cpu` and friends).
//!
//! Zero-copy from torch: the Python side (`ternary_rs/_ops_cpu.py`) passes `tensor.data_ptr()` and the
//! sizes as ints after checking device, dtype, contiguity and shape — these functions are private to
//! that module. Here we re-check what can be checked (shape limits, null and misaligned pointers) and
//! release the GIL for the whole kernel.

use half::{bf16, f16};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use ternary_core::canonical::{check_shape, CanonicalRef};
use ternary_core::kernels::cpu::{
    self, layout, Activation, KernelChoice, Layout, PreparedRef, Variant,
};
use ternary_core::threads::Rayon;

use crate::errors::to_py;
use crate::torch;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(ternary_cpu_prepare, m)?)?;
    m.add_function(wrap_pyfunction!(ternary_gemm_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_prepared_shapes, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernel_variants, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernel_best, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_int8_layout, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_dense_prefill_pays, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_set_kernel_variant, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_set_default_int8, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_set_warm_up_pass, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_warm_up_pass, m)?)?;
    m.add_function(wrap_pyfunction!(top_k_top_p_mask_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(gdn_decode_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(register_torch_cpu_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(register_torch_cpu_moe_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(register_torch_cpu_dense_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(register_torch_cpu_fwht_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(register_torch_cpu_attention_kernel, m)?)?;
    m.add("ACTIVATIONS_AUTO", torch::ACTIVATIONS_AUTO)?;
    m.add("ACTIVATIONS_EXACT", torch::ACTIVATIONS_EXACT)?;
    m.add("ACTIVATIONS_INT8_GROUP", torch::ACTIVATIONS_INT8_GROUP)?;
    m.add("ACTIVATIONS_INT8_TOKEN", torch::ACTIVATIONS_INT8_TOKEN)?;
    Ok(())
}

/// Mask, in place, the `rows × vocab` f32 logits at `logits_ptr` to each row's top-k (`k_ptr`: `rows`
/// int64, 0 = none) and then top-p (`p_ptr`: `rows` f32, 0 = none) set
/// (`ternary_core::sampling::mask_top_k_top_p`), on torch's intra-op pool once a native kernel is
/// registered (inside vLLM), else on the ternary-rs pool. ValueError, nothing written, for a NaN logit or
/// a p outside (0, 1].
#[pyfunction]
fn top_k_top_p_mask_cpu(
    py: Python<'_>,
    logits_ptr: usize,
    rows: usize,
    vocab: usize,
    k_ptr: usize,
    p_ptr: usize,
) -> PyResult<()> {
    let n = checked_len(rows, vocab, "logits")?;
    // SAFETY: the caller passes live, contiguous tensors of these lengths (Python checks them).
    let logits = unsafe { slice_at_mut::<f32>(logits_ptr, n, "logits")? };
    let k = (k_ptr != 0)
        .then(|| unsafe { slice_at::<i64>(k_ptr, rows, "k") })
        .transpose()?;
    let p = (p_ptr != 0)
        .then(|| unsafe { slice_at::<f32>(p_ptr, rows, "p") })
        .transpose()?;
    py.detach(move || match torch::intra_op_pool() {
        Some(pool) => ternary_core::sampling::mask_top_k_top_p(logits, vocab, k, p, &pool),
        None => ternary_core::sampling::mask_top_k_top_p(logits, vocab, k, p, &Rayon),
    })
    .map_err(to_py)
}

/// One Gated DeltaNet decode step (`ternary_core::gdn::decode`) on raw tensors: `shape` = (key heads,
/// value heads, key dim, value dim, conv width); `params` = pointers to the f32 conv weight, conv bias (0:
/// none), A_log and dt_bias; `x` (bf16 rows of `x_stride`), `a` / `b` (bf16 rows of `gate_stride`),
/// `slots` (int32, one per sequence); `conv` = (bf16 pointer, elements, slots, slot / channel / step
/// strides); `state` = (f32 pointer, elements, slots, slot stride); `out` (bf16, sequences × value heads ×
/// value dim). On torch's intra-op pool once a native kernel is registered, else the ternary-rs pool.
/// ValueError, nothing written, for anything `ternary_core::gdn` refuses. The Python caller
/// (`ternary_rs.serving.gdn`) checks devices, dtypes and extents first.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn gdn_decode_cpu(
    py: Python<'_>,
    shape: (usize, usize, usize, usize, usize),
    params: (usize, usize, usize, usize),
    x: (usize, usize),
    gates: (usize, usize, usize),
    slots: (usize, usize),
    conv: (usize, usize, usize, usize, usize, usize),
    state: (usize, usize, usize, usize),
    out_ptr: usize,
) -> PyResult<()> {
    use ternary_core::gdn::{
        self, ConvCache, DecodeInputs, DecodeStep, GdnParams, GdnShape, StateCache,
    };
    let shape = GdnShape {
        key_heads: shape.0,
        value_heads: shape.1,
        key_dim: shape.2,
        value_dim: shape.3,
        conv_width: shape.4,
    };
    let (n, channels) = (slots.1, shape.conv_channels());
    let rows = |stride: usize, row: usize, what: &str| -> PyResult<usize> {
        match n {
            0 => Ok(0),
            _ => checked_len(n - 1, stride, what)?
                .checked_add(row)
                .ok_or_else(|| PyValueError::new_err(format!("{what}: size overflows"))),
        }
    };
    let out_len = checked_len(
        checked_len(n, shape.value_heads, "out")?,
        shape.value_dim,
        "out",
    )?;
    // SAFETY (every slice): the Python caller passes live tensors covering these extents, the caches and
    // the output written by nobody else during the call (it checks them before calling).
    let (params, inputs, conv, state, out) = unsafe {
        let params = GdnParams {
            conv_weight: slice_at::<f32>(
                params.0,
                checked_len(channels, shape.conv_width, "conv weight")?,
                "conv weight",
            )?,
            conv_bias: (params.1 != 0)
                .then(|| slice_at::<f32>(params.1, channels, "conv bias"))
                .transpose()?,
            a_log: slice_at::<f32>(params.2, shape.value_heads, "A_log")?,
            dt_bias: slice_at::<f32>(params.3, shape.value_heads, "dt_bias")?,
        };
        let inputs = DecodeInputs {
            x: slice_at::<bf16>(x.0, rows(x.1, channels, "x")?, "x")?,
            x_stride: x.1,
            a: slice_at::<bf16>(gates.0, rows(gates.2, shape.value_heads, "a")?, "a")?,
            b: slice_at::<bf16>(gates.1, rows(gates.2, shape.value_heads, "b")?, "b")?,
            gate_stride: gates.2,
            slots: slice_at::<i32>(slots.0, n, "slots")?,
        };
        let conv = ConvCache {
            data: slice_at_mut::<bf16>(conv.0, conv.1, "conv state")?,
            slots: conv.2,
            slot_stride: conv.3,
            channel_stride: conv.4,
            step_stride: conv.5,
        };
        let state = StateCache {
            data: slice_at_mut::<f32>(state.0, state.1, "ssm state")?,
            slots: state.2,
            slot_stride: state.3,
        };
        (
            params,
            inputs,
            conv,
            state,
            slice_at_mut::<bf16>(out_ptr, out_len, "out")?,
        )
    };
    let (kernel, step) = (
        torch::float_kernel(),
        DecodeStep {
            shape,
            params,
            inputs,
        },
    );
    py.detach(move || match torch::intra_op_pool() {
        Some(pool) => gdn::decode(&step, conv, state, out, kernel, &pool),
        None => gdn::decode(&step, conv, state, out, kernel, &Rayon),
    })
    .map_err(to_py)
}

/// Register the native CPU kernel of `ternary_rs::ternary_linear` with torch's dispatcher (the schema
/// must already be defined); `libtorch_cpu` is the path of the loaded `libtorch_cpu.so`.
#[pyfunction]
fn register_torch_cpu_kernel(libtorch_cpu: &str) -> PyResult<()> {
    torch::register_cpu(libtorch_cpu).map_err(pyo3::exceptions::PyRuntimeError::new_err)
}

/// Register the native CPU kernel of `ternary_rs::ternary_moe` (routed experts) likewise.
#[pyfunction]
fn register_torch_cpu_moe_kernel(libtorch_cpu: &str) -> PyResult<()> {
    torch::register_cpu_moe(libtorch_cpu).map_err(pyo3::exceptions::PyRuntimeError::new_err)
}

/// Register the native CPU kernel of `ternary_rs::dense_linear` (dense bf16 / f16 layers) likewise.
#[pyfunction]
fn register_torch_cpu_dense_kernel(libtorch_cpu: &str) -> PyResult<()> {
    torch::register_cpu_dense(libtorch_cpu).map_err(pyo3::exceptions::PyRuntimeError::new_err)
}

/// Register the native CPU kernel of `ternary_rs::fwht` (the Hadamard rotation) likewise.
#[pyfunction]
fn register_torch_cpu_fwht_kernel(libtorch_cpu: &str) -> PyResult<()> {
    torch::register_cpu_fwht(libtorch_cpu).map_err(pyo3::exceptions::PyRuntimeError::new_err)
}

/// Register the native CPU kernel of `ternary_rs::decode_attention` (paged decode attention) likewise.
#[pyfunction]
fn register_torch_cpu_attention_kernel(libtorch_cpu: &str) -> PyResult<()> {
    torch::register_cpu_attention(libtorch_cpu).map_err(pyo3::exceptions::PyRuntimeError::new_err)
}

/// Force a CPU kernel variant for every later call (None or "auto": the best supported one).
#[pyfunction]
#[pyo3(signature = (name = None))]
fn cpu_set_kernel_variant(name: Option<&str>) -> PyResult<()> {
    let v = match name {
        None | Some("auto") | Some("") => None,
        Some(n) => Some(Variant::parse(n).map_err(to_py)?),
    };
    torch::set_variant(v);
    Ok(())
}

/// The activation mode `activations=0` (auto) resolves to: None = by dtype (int8 for bf16/fp16,
/// exact for f32), False = exact for every dtype, True = int8 for every dtype.
#[pyfunction]
#[pyo3(signature = (value = None))]
fn cpu_set_default_int8(value: Option<bool>) {
    torch::set_default_int8(value);
}

/// While set, the CPU ops (native and Python path) return zeros without computing: vLLM's warm-up
/// pass, whose outputs vLLM discards (`ternary_rs.vllm.warm_up`).
#[pyfunction]
fn cpu_set_warm_up_pass(on: bool) {
    torch::set_warm_up_pass(on);
}

/// Whether the warm-up pass is on ([`cpu_set_warm_up_pass`]).
#[pyfunction]
fn cpu_warm_up_pass() -> bool {
    torch::warm_up_pass()
}

/// A slice over `len` elements of `T` at address `addr` (checked non-null and aligned).
///
/// # Safety
/// The caller (the Python wrapper) guarantees that `addr` points at `len` live elements of `T`
/// that nobody writes for the duration of the call.
unsafe fn slice_at<'a, T>(addr: usize, len: usize, what: &str) -> PyResult<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    check_pointer::<T>(addr, what)?;
    // SAFETY: non-null and aligned (checked); length and liveness guaranteed by the caller.
    Ok(unsafe { std::slice::from_raw_parts(addr as *const T, len) })
}

/// Mutable version of [`slice_at`] (same contract, and no other reference to the memory exists).
unsafe fn slice_at_mut<'a, T>(addr: usize, len: usize, what: &str) -> PyResult<&'a mut [T]> {
    if len == 0 {
        return Ok(&mut []);
    }
    check_pointer::<T>(addr, what)?;
    // SAFETY: as in `slice_at`, plus exclusivity guaranteed by the caller.
    Ok(unsafe { std::slice::from_raw_parts_mut(addr as *mut T, len) })
}

fn check_pointer<T>(addr: usize, what: &str) -> PyResult<()> {
    if addr == 0 || !addr.is_multiple_of(std::mem::align_of::<T>()) {
        return Err(PyValueError::new_err(format!(
            "{what}: data pointer {addr:#x} is null or not aligned to {} bytes",
            std::mem::align_of::<T>()
        )));
    }
    Ok(())
}

fn checked_len(a: usize, b: usize, what: &str) -> PyResult<usize> {
    a.checked_mul(b)
        .ok_or_else(|| PyValueError::new_err(format!("{what}: size {a} x {b} overflows")))
}

/// Shapes of the CPU kernel's prepared tensors for a `[rows, cols]` weight at `group_size` in `layout`
/// ("rows4": `((row_blocks, Kp) uint8 codes, (row_blocks, Gp·4) float16 scales)`; "lanes16":
/// `((row_groups, 4·Kp), (row_groups, Gp·16))`).
#[pyfunction]
#[pyo3(signature = (rows, cols, group_size, layout = "rows4"))]
fn cpu_prepared_shapes(
    rows: usize,
    cols: usize,
    group_size: usize,
    layout: &str,
) -> PyResult<((usize, usize), (usize, usize))> {
    let layout = Layout::parse(layout).map_err(to_py)?;
    Ok((
        layout.codes_shape(rows, cols),
        layout.scales_shape(rows, cols, group_size),
    ))
}

/// The layout `ops.prepare_weight` gives weights that only the int8 modes will multiply, with the CPU
/// kernel variant in use ("lanes16" where that is the AVX-512 VNNI rows-in-lanes kernel on full-width
/// units, else "rows4"; `TERNARY_RS_CPU_LAYOUT` overrides).
#[pyfunction]
fn cpu_int8_layout() -> PyResult<&'static str> {
    Ok(cpu::int8_layout_for(torch::variant())
        .map_err(to_py)?
        .name())
}

/// Names of the CPU kernel variants this machine can run (always includes "scalar").
#[pyfunction]
fn cpu_kernel_variants() -> Vec<&'static str> {
    Variant::ALL
        .iter()
        .filter(|v| v.is_supported())
        .map(|v| v.name())
        .collect()
}

/// Name of the variant "auto" picks on this machine.
#[pyfunction]
fn cpu_kernel_best() -> &'static str {
    Variant::best().name()
}

/// Whether bf16 prefill calls with the variant `name` take the dense path (decoded bf16 chunks through
/// torch's GEMM) on this machine (`dense::prefill_pays`).
#[pyfunction]
fn cpu_dense_prefill_pays(name: &str) -> PyResult<bool> {
    let v = Variant::parse(name).map_err(to_py)?;
    Ok(ternary_core::kernels::cpu::dense::prefill_pays(v))
}

/// Permute canonical `qweight` (u8 `[rows, cols/4]`) and `scales` (f16 `[rows, cols/g]`) into the
/// kernel layout at `out_ptr` / `out_scales_ptr` (shapes from `cpu_prepared_shapes`); validates codes
/// and scales first.
#[pyfunction]
#[pyo3(signature = (qweight_ptr, scales_ptr, rows, cols, group_size, out_ptr, out_scales_ptr, tensor = "qweight", layout = "rows4"))]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
fn ternary_cpu_prepare(
    py: Python<'_>,
    qweight_ptr: usize,
    scales_ptr: usize,
    rows: usize,
    cols: usize,
    group_size: usize,
    out_ptr: usize,
    out_scales_ptr: usize,
    tensor: &str,
    layout: &str,
) -> PyResult<()> {
    check_shape(rows, cols, group_size).map_err(to_py)?;
    let layout = Layout::parse(layout).map_err(to_py)?;
    let codes = checked_len(rows, cols / 4, "qweight")?;
    let groups = checked_len(rows, cols / group_size, "scales")?;
    let overflow = || PyValueError::new_err("prepared weight size overflows");
    let out_len = layout.prepared_bytes(rows, cols).ok_or_else(overflow)?;
    let out_scales = layout
        .prepared_scales(rows, cols, group_size)
        .ok_or_else(overflow)?;
    let tensor = tensor.to_owned();
    py.detach(move || {
        // SAFETY: the Python wrapper passes contiguous CPU tensors of exactly these sizes.
        let (qweight, scales, out, out_s) = unsafe {
            (
                slice_at::<u8>(qweight_ptr, codes, "qweight")?,
                slice_at::<f16>(scales_ptr, groups, "scales")?,
                slice_at_mut::<u8>(out_ptr, out_len, "prepared qweight")?,
                slice_at_mut::<f16>(out_scales_ptr, out_scales, "prepared scales")?,
            )
        };
        let w = CanonicalRef {
            rows,
            cols,
            group_size,
            qweight,
            scales,
        };
        layout::prepare_layout_into(w, &tensor, layout, out, out_s).map_err(to_py)
    })
}

/// `y[M, N] = x[M, K] · Wᵀ (+ bias)` on the CPU, on the ternary-rs rayon pool (the path outside torch's
/// dispatcher). `dtype` ("bfloat16", "float16", "float32") is the type of x, bias and y; `bias_ptr` = 0
/// means no bias. `variant` is "auto", "avx512", "avx2" or "scalar"; `activations` is one of the
/// `ACTIVATIONS_*` values (0 = auto: by dtype and the process default).
#[pyfunction]
#[pyo3(signature = (x_ptr, dtype, m, k, planes_ptr, scales_ptr, n, group_size, bias_ptr, y_ptr, variant = "auto", activations = 0, layout = "rows4"))]
// One parameter per Python argument: the signature `_core` callers use.
#[allow(clippy::too_many_arguments)]
fn ternary_gemm_cpu(
    py: Python<'_>,
    x_ptr: usize,
    dtype: &str,
    m: usize,
    k: usize,
    planes_ptr: usize,
    scales_ptr: usize,
    n: usize,
    group_size: usize,
    bias_ptr: usize,
    y_ptr: usize,
    variant: &str,
    activations: i64,
    layout: &str,
) -> PyResult<()> {
    check_shape(n, k, group_size).map_err(to_py)?;
    let variant = Variant::parse(variant).map_err(to_py)?;
    let layout = Layout::parse(layout).map_err(to_py)?;
    let precision =
        torch::resolve_precision(activations, dtype == "float32").map_err(PyValueError::new_err)?;
    let overflow = || PyValueError::new_err("prepared weight size overflows");
    let sizes = Sizes {
        x: checked_len(m, k, "x")?,
        y: checked_len(m, n, "y")?,
        planes: layout.prepared_bytes(n, k).ok_or_else(overflow)?,
        scales: layout
            .prepared_scales(n, k, group_size)
            .ok_or_else(overflow)?,
        n,
    };
    let ptrs = Pointers {
        x: x_ptr,
        planes: planes_ptr,
        scales: scales_ptr,
        bias: bias_ptr,
        y: y_ptr,
    };
    let shape = GemmShape {
        m,
        n,
        k,
        g: group_size,
        layout,
    };
    let choice = KernelChoice { variant, precision };
    match dtype {
        "bfloat16" => py.detach(move || run::<bf16>(ptrs, sizes, shape, choice)),
        "float16" => py.detach(move || run::<f16>(ptrs, sizes, shape, choice)),
        "float32" => py.detach(move || run::<f32>(ptrs, sizes, shape, choice)),
        other => Err(PyValueError::new_err(format!(
            "x dtype {other} is not supported by the CPU kernel; supported: bfloat16, float16, float32"
        ))),
    }
}

/// The data pointers of one CPU GEMM call: x, the prepared weight's planes and scales, bias (0: none),
/// y.
#[derive(Clone, Copy)]
pub(crate) struct Pointers {
    pub(crate) x: usize,
    pub(crate) planes: usize,
    pub(crate) scales: usize,
    pub(crate) bias: usize,
    pub(crate) y: usize,
}

/// `y[m, n] = x[m, k] · Wᵀ` with W in groups of `g` along k.
#[derive(Clone, Copy)]
pub(crate) struct GemmShape {
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) g: usize,
    /// How the prepared weight is arranged.
    pub(crate) layout: Layout,
}

#[derive(Clone, Copy)]
struct Sizes {
    x: usize,
    y: usize,
    planes: usize,
    scales: usize,
    n: usize,
}

fn run<T: Activation>(
    p: Pointers,
    s: Sizes,
    shape: GemmShape,
    choice: KernelChoice,
) -> PyResult<()> {
    let GemmShape { m, n, k, g, layout } = shape;
    // SAFETY: the Python wrapper passes contiguous CPU tensors of exactly these sizes, y freshly
    // allocated (not aliasing any input).
    let (x, planes, scales, bias, y) = unsafe {
        (
            slice_at::<T>(p.x, s.x, "x")?,
            slice_at::<u8>(p.planes, s.planes, "qweight")?,
            slice_at::<f16>(p.scales, s.scales, "scales")?,
            if p.bias == 0 {
                None
            } else {
                Some(slice_at::<T>(p.bias, s.n, "bias")?)
            },
            slice_at_mut::<T>(p.y, s.y, "y")?,
        )
    };
    let w = PreparedRef {
        rows: n,
        cols: k,
        group_size: g,
        layout,
        planes,
        scales,
    };
    cpu::gemm(w, x, m, bias, y, choice, &Rayon).map_err(to_py)
}
