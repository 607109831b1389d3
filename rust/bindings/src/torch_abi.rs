//! The CPU kernel of `torch.ops.ternary_rs.ternary_linear`, registered natively with torch's
//! dispatcher through PyTorch's stable C ABI (torch ≥ 2.10), so a call runs no Python.
//!
//! Nothing here is built against torch: the C functions of the stable ABI
//! (`torch/csrc/stable/c/shim.h`, `torch/csrc/inductor/aoti_torch/c/shim.h`) are resolved at run time
//! from the `libtorch_cpu.so` that `import torch` has already loaded (`dlopen(RTLD_NOLOAD)` on the path
//! Python passes), so the abi3 wheel works across torch versions. Registration is what
//! `STABLE_TORCH_LIBRARY_IMPL(ternary_rs, CPU, m)` expands to: `aoti_torch_library_init_impl` +
//! `torch_library_impl` with a boxed kernel (`csrc/torch_boxed.cpp` turns our error code into the C++
//! exception torch expects). Inside the kernel, work is split over torch's own intra-op pool
//! (`torch_parallel_for`): inside vLLM that is the OpenMP pool bound to the cores, so no second pool
//! spins against it.
//!
//! Boxed calling convention (`torch/csrc/stable/library.h`): the stack holds one 64-bit StableIValue per
//! argument — tensors as owned `AtenTensorHandle`s (the kernel must free them), ints as `i64`, an
//! optional as a pointer to a heap StableIValue (or null for None; the kernel frees it) — and the
//! kernel writes its outputs (a new owned tensor handle) to the front of the stack.

use std::ffi::{c_char, c_void, CStr, CString};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::OnceLock;

use half::{bf16, f16};
use ternary_core::kernels::cpu::{
    self, dense, layout, Activation, Precision, PreparedRef, Variant,
};
use ternary_core::threads::ParallelFor;

pub(crate) type Handle = *mut c_void;
pub(crate) type Status = i32;
pub(crate) type BoxedFn = unsafe extern "C" fn(*mut u64, u64, u64);
type ParallelFunc = unsafe extern "C" fn(i64, i64, *mut c_void);

/// The schema's argument count: x, qweight, scales, out_features, in_features, group_size, bias,
/// activations.
pub const NUM_ARGS: u64 = 8;
/// torch 2.10.0 as `TORCH_ABI_VERSION` encodes it (`torch/headeronly/version.h`): the stable-ABI
/// conventions this kernel was written for.
const BUILD_ABI_VERSION: u64 = (2 << 56) | (10 << 48);

/// Values of the op's `activations` argument.
pub const ACTIVATIONS_AUTO: i64 = 0;
pub const ACTIVATIONS_EXACT: i64 = 1;
pub const ACTIVATIONS_INT8_GROUP: i64 = 2;
pub const ACTIVATIONS_INT8_TOKEN: i64 = 3;

extern "C" {
    fn dlopen(filename: *const c_char, flags: i32) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *const c_char;
    fn ternary_rs_cpu_linear_entry(stack: *mut u64, num_args: u64, num_outputs: u64);
    fn ternary_rs_delete_stable_ivalue(p: *mut u64);
}
const RTLD_LAZY: i32 = 0x1;
const RTLD_NOLOAD: i32 = 0x4;

type InitImplFn =
    unsafe extern "C" fn(*const c_char, *const c_char, *const c_char, u32, *mut Handle) -> Status;
type ImplFn = unsafe extern "C" fn(Handle, *const c_char, BoxedFn, u64) -> Status;
pub(crate) type HandleFn = unsafe extern "C" fn(Handle) -> Status;
/// `aoti_torch__reinterpret_tensor(self, ndim, sizes, strides, storage_offset_increment, &out)`.
pub(crate) type ReinterpretFn =
    unsafe extern "C" fn(Handle, i64, *const i64, *const i64, i64, *mut Handle) -> Status;
type PtrOutFn = unsafe extern "C" fn(Handle, *mut *mut c_void) -> Status;
type I64OutFn = unsafe extern "C" fn(Handle, *mut i64) -> Status;
type ArrayOutFn = unsafe extern "C" fn(Handle, *mut *mut i64) -> Status;
type I32OutFn = unsafe extern "C" fn(Handle, *mut i32) -> Status;
type EmptyStridedFn =
    unsafe extern "C" fn(i64, *const i64, *const i64, i32, i32, i32, *mut Handle) -> Status;
pub(crate) type CopyFn = unsafe extern "C" fn(Handle, Handle, i32) -> Status;
type DeleteFn = unsafe extern "C" fn(Handle) -> Status;
type ParallelForFn = unsafe extern "C" fn(i64, i64, i64, ParallelFunc, *mut c_void) -> Status;
type U32OutFn = unsafe extern "C" fn(*mut u32) -> Status;
type DeleteIValueFn = unsafe extern "C" fn(*mut u64) -> Status;
type ConstFn = unsafe extern "C" fn() -> i32;
pub(crate) type FromBlobFn = unsafe extern "C" fn(
    *mut c_void,
    i64,
    *const i64,
    *const i64,
    i64,
    i32,
    i32,
    i32,
    *mut Handle,
) -> Status;
pub(crate) type MmOutFn = unsafe extern "C" fn(Handle, Handle, Handle) -> Status;
pub(crate) type AddmmOutFn =
    unsafe extern "C" fn(Handle, Handle, Handle, Handle, f64, f64) -> Status;

/// torch's own GEMM, for the dense-tile path at large M (absent in a torch without these symbols:
/// then every M runs the fused kernel).
pub(crate) struct TorchGemm {
    pub(crate) from_blob: FromBlobFn,
    mm_out: MmOutFn,
    addmm_out: AddmmOutFn,
}

/// The stable-ABI functions we call, resolved once.
pub(crate) struct Api {
    library_init_impl: InitImplFn,
    library_impl: ImplFn,
    get_data_ptr: PtrOutFn,
    get_dim: I64OutFn,
    get_sizes: ArrayOutFn,
    get_strides: ArrayOutFn,
    get_dtype: I32OutFn,
    get_device_type: I32OutFn,
    get_device_index: I32OutFn,
    pub(crate) zero_: Option<HandleFn>,
    pub(crate) reinterpret: Option<ReinterpretFn>,
    empty_strided: EmptyStridedFn,
    pub(crate) copy_: CopyFn,
    delete_tensor: DeleteFn,
    parallel_for: ParallelForFn,
    get_num_threads: U32OutFn,
    delete_stable_ivalue: Option<DeleteIValueFn>,
    pub(crate) gemm: Option<TorchGemm>,
    pub(crate) dtype_bf16: i32,
    pub(crate) dtype_f16: i32,
    pub(crate) dtype_f32: i32,
    pub(crate) dtype_i32: i32,
    pub(crate) dtype_u8: i32,
    pub(crate) device_cpu: i32,
    pub(crate) device_cuda: i32,
}

// SAFETY: plain function pointers and integers.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

static API: OnceLock<Api> = OnceLock::new();

/// The API, resolved from the loaded `libtorch_cpu` at `path` on first use.
pub(crate) fn api(path: &str) -> Result<&'static Api, String> {
    match API.get() {
        Some(a) => Ok(a),
        None => {
            let a = load(path)?;
            Ok(API.get_or_init(|| a))
        }
    }
}
/// The `torch::Library` our impl lives in; kept for the life of the process (dropping it would
/// deregister the kernel).
static LIBRARY: OnceLock<usize> = OnceLock::new();

/// Global CPU-kernel settings the Python side sets (`_ops_cpu.set_kernel_variant`, the
/// `TERNARY_RS_CPU_INT8` default), read by every native call.
static VARIANT: AtomicU8 = AtomicU8::new(0); // 0 auto, 1 scalar, 2 avx2, 3 avx512, 4 amx
static DEFAULT_MODE: AtomicU8 = AtomicU8::new(0); // 0 by dtype, 1 exact, 2 int8

pub fn set_variant(v: Option<Variant>) {
    let code = match v {
        None => 0,
        Some(Variant::Scalar) => 1,
        Some(Variant::Avx2) => 2,
        Some(Variant::Avx512) => 3,
        Some(Variant::Amx) => 4,
    };
    VARIANT.store(code, Ordering::Relaxed);
}

fn variant() -> Variant {
    match VARIANT.load(Ordering::Relaxed) {
        1 => Variant::Scalar,
        2 => Variant::Avx2,
        3 => Variant::Avx512,
        4 => Variant::Amx,
        _ => Variant::best(),
    }
}

/// `None`: the dtype decides (int8 for bf16/fp16, exact for f32); `Some(false)`: exact for every
/// dtype; `Some(true)`: int8 for every dtype.
pub fn set_default_int8(v: Option<bool>) {
    DEFAULT_MODE.store(
        match v {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        },
        Ordering::Relaxed,
    );
}

/// The precision an `activations` argument resolves to for activations of `dtype_is_f32`.
pub fn resolve_precision(activations: i64, dtype_is_f32: bool) -> Result<Precision, String> {
    Ok(match activations {
        ACTIVATIONS_AUTO => match DEFAULT_MODE.load(Ordering::Relaxed) {
            1 => Precision::Exact,
            2 => Precision::Int8Group,
            _ => Precision::default_for(dtype_is_f32),
        },
        ACTIVATIONS_EXACT => Precision::Exact,
        ACTIVATIONS_INT8_GROUP => Precision::Int8Group,
        ACTIVATIONS_INT8_TOKEN => Precision::Int8Token,
        other => {
            return Err(format!(
                "activations={other}: expected 0 (auto), 1 (exact), 2 (int8 per group) or 3 (int8 per token)"
            ))
        }
    })
}

/// Resolve the API from the loaded `libtorch_cpu` at `path` and register the CPU kernel of
/// `ternary_rs::ternary_linear` (whose schema the Python side has defined). Idempotent.
pub fn register(path: &str) -> Result<(), String> {
    if LIBRARY.get().is_some() {
        return Ok(());
    }
    let lib = register_boxed(api(path)?, c"CPU", ternary_rs_cpu_linear_entry)?;
    let _ = LIBRARY.set(lib);
    Ok(())
}

/// `STABLE_TORCH_LIBRARY_IMPL(ternary_rs, <key>, m) { m.impl("ternary_linear", entry); }`: returns the
/// new `torch::Library`, which the caller keeps for the life of the process.
/// The registration names the caller's source line (`torch._C._dispatch_dump` shows it).
#[track_caller]
pub(crate) fn register_boxed(api: &Api, key: &CStr, entry: BoxedFn) -> Result<usize, String> {
    let at = std::panic::Location::caller();
    let file = CString::new(at.file()).unwrap_or_default();
    let mut lib: Handle = std::ptr::null_mut();
    // SAFETY: valid C strings; `lib` receives a new heap torch::Library the caller keeps forever.
    let status = unsafe {
        (api.library_init_impl)(
            c"ternary_rs".as_ptr(),
            key.as_ptr(),
            file.as_ptr(),
            at.line(),
            &mut lib,
        )
    };
    if status != 0 || lib.is_null() {
        return Err(format!(
            "aoti_torch_library_init_impl(ternary_rs, {}) failed",
            key.to_string_lossy()
        ));
    }
    // SAFETY: `lib` is the library just created; the entry point follows the boxed convention.
    let status =
        unsafe { (api.library_impl)(lib, c"ternary_linear".as_ptr(), entry, BUILD_ABI_VERSION) };
    if status != 0 {
        return Err("torch_library_impl(ternary_linear) failed (is the schema defined?)".into());
    }
    Ok(lib as usize)
}

/// A library already loaded in this process (`dlopen(RTLD_NOLOAD)`), for looking up its symbols.
pub(crate) struct LoadedLib {
    path: String,
    handle: *mut c_void,
}

impl LoadedLib {
    pub(crate) fn open(path: &str) -> Result<LoadedLib, String> {
        let cpath = CString::new(path).map_err(|_| format!("bad library path {path:?}"))?;
        // SAFETY: RTLD_NOLOAD only returns a handle to an already loaded library (never runs its init).
        let handle = unsafe { dlopen(cpath.as_ptr(), RTLD_LAZY | RTLD_NOLOAD) };
        if handle.is_null() {
            // SAFETY: dlerror returns a thread-local C string or null.
            let why = unsafe { dlerror() };
            let why = if why.is_null() {
                String::new()
            } else {
                unsafe { CStr::from_ptr(why) }
                    .to_string_lossy()
                    .into_owned()
            };
            return Err(format!("{path} is not loaded in this process ({why})"));
        }
        Ok(LoadedLib {
            path: path.to_string(),
            handle,
        })
    }

    pub(crate) fn sym(&self, name: &CStr) -> Result<*mut c_void, String> {
        // SAFETY: `handle` is a valid handle and `name` a C string.
        let p = unsafe { dlsym(self.handle, name.as_ptr()) };
        if p.is_null() {
            Err(format!(
                "{} has no {} (torch < 2.10?)",
                self.path,
                name.to_string_lossy()
            ))
        } else {
            Ok(p)
        }
    }
}

fn load(path: &str) -> Result<Api, String> {
    let lib = LoadedLib::open(path)?;
    let sym = |name: &CStr| lib.sym(name);
    macro_rules! f {
        ($name:literal, $ty:ty) => {
            // SAFETY: the symbol is the stable-ABI function of that name, whose C signature `$ty`
            // spells out (torch/csrc/stable/c/shim.h, aoti_torch/c/shim.h).
            unsafe { std::mem::transmute::<*mut c_void, $ty>(sym($name)?) }
        };
    }
    let dtype = |name: &CStr| -> Result<i32, String> {
        let p = sym(name)?;
        // SAFETY: `int32_t aoti_torch_dtype_*(void)` / `aoti_torch_device_type_*(void)`.
        Ok(unsafe { std::mem::transmute::<*mut c_void, ConstFn>(p)() })
    };
    let delete_stable_ivalue = sym(c"torch_delete_stable_ivalue")
        .ok()
        // SAFETY: `AOTITorchError torch_delete_stable_ivalue(StableIValue*)` (torch ≥ 2.13).
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, DeleteIValueFn>(p) });
    let optional = |name: &CStr| sym(name).ok();
    let gemm = match (
        optional(c"aoti_torch_create_tensor_from_blob"),
        optional(c"aoti_torch_cpu_mm_out"),
        optional(c"aoti_torch_cpu_addmm_out"),
    ) {
        // SAFETY: the AOTI shim functions of these names (aoti_torch/c/shim.h and
        // generated/c_shim_cpu.h), with the C signatures FromBlobFn / MmOutFn / AddmmOutFn spell out.
        (Some(a), Some(b), Some(c)) => Some(unsafe {
            TorchGemm {
                from_blob: std::mem::transmute::<*mut c_void, FromBlobFn>(a),
                mm_out: std::mem::transmute::<*mut c_void, MmOutFn>(b),
                addmm_out: std::mem::transmute::<*mut c_void, AddmmOutFn>(c),
            }
        }),
        _ => None,
    };
    Ok(Api {
        library_init_impl: f!(c"aoti_torch_library_init_impl", InitImplFn),
        library_impl: f!(c"torch_library_impl", ImplFn),
        get_data_ptr: f!(c"aoti_torch_get_data_ptr", PtrOutFn),
        get_dim: f!(c"aoti_torch_get_dim", I64OutFn),
        get_sizes: f!(c"aoti_torch_get_sizes", ArrayOutFn),
        get_strides: f!(c"aoti_torch_get_strides", ArrayOutFn),
        get_dtype: f!(c"aoti_torch_get_dtype", I32OutFn),
        get_device_type: f!(c"aoti_torch_get_device_type", I32OutFn),
        get_device_index: f!(c"aoti_torch_get_device_index", I32OutFn),
        // SAFETY: `AOTITorchError aoti_torch_zero_(AtenTensorHandle)`.
        zero_: optional(c"aoti_torch_zero_")
            .map(|p| unsafe { std::mem::transmute::<*mut c_void, HandleFn>(p) }),
        // SAFETY: `aoti_torch__reinterpret_tensor`, signature ReinterpretFn (aoti_torch/c/shim.h).
        reinterpret: optional(c"aoti_torch__reinterpret_tensor")
            .map(|p| unsafe { std::mem::transmute::<*mut c_void, ReinterpretFn>(p) }),
        empty_strided: f!(c"aoti_torch_empty_strided", EmptyStridedFn),
        copy_: f!(c"aoti_torch_copy_", CopyFn),
        delete_tensor: f!(c"aoti_torch_delete_tensor_object", DeleteFn),
        parallel_for: f!(c"torch_parallel_for", ParallelForFn),
        get_num_threads: f!(c"torch_get_num_threads", U32OutFn),
        delete_stable_ivalue,
        gemm,
        dtype_bf16: dtype(c"aoti_torch_dtype_bfloat16")?,
        dtype_f16: dtype(c"aoti_torch_dtype_float16")?,
        dtype_f32: dtype(c"aoti_torch_dtype_float32")?,
        dtype_i32: dtype(c"aoti_torch_dtype_int32")?,
        dtype_u8: dtype(c"aoti_torch_dtype_uint8")?,
        device_cpu: dtype(c"aoti_torch_device_type_cpu")?,
        device_cuda: dtype(c"aoti_torch_device_type_cuda")?,
    })
}

/// An owned tensor handle (freed on drop).
pub(crate) struct Tensor<'a> {
    pub(crate) api: &'a Api,
    pub(crate) h: Handle,
}

/// Where a tensor lives: the stable ABI's device type code and index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Device {
    pub(crate) kind: i32,
    pub(crate) index: i32,
}

impl Drop for Tensor<'_> {
    fn drop(&mut self) {
        if !self.h.is_null() {
            // SAFETY: we own the handle.
            unsafe { (self.api.delete_tensor)(self.h) };
        }
    }
}

macro_rules! check {
    ($call:expr, $what:expr) => {
        if $call != 0 {
            return Err(format!("torch C API call failed: {}", $what));
        }
    };
}
pub(crate) use check;

impl<'a> Tensor<'a> {
    pub(crate) fn into_raw(mut self) -> Handle {
        std::mem::replace(&mut self.h, std::ptr::null_mut())
    }

    pub(crate) fn sizes(&self) -> Result<&[i64], String> {
        let (mut dim, mut p) = (0i64, std::ptr::null_mut());
        // SAFETY: valid handle; the sizes array is borrowed from the tensor, which outlives `self`'s borrow.
        unsafe {
            check!((self.api.get_dim)(self.h, &mut dim), "get_dim");
            check!((self.api.get_sizes)(self.h, &mut p), "get_sizes");
            Ok(if dim == 0 {
                &[]
            } else {
                std::slice::from_raw_parts(p, dim as usize)
            })
        }
    }

    fn strides(&self) -> Result<&[i64], String> {
        let (mut dim, mut p) = (0i64, std::ptr::null_mut());
        // SAFETY: as in `sizes`.
        unsafe {
            check!((self.api.get_dim)(self.h, &mut dim), "get_dim");
            check!((self.api.get_strides)(self.h, &mut p), "get_strides");
            Ok(if dim == 0 {
                &[]
            } else {
                std::slice::from_raw_parts(p, dim as usize)
            })
        }
    }

    pub(crate) fn dtype(&self) -> Result<i32, String> {
        let mut d = 0;
        // SAFETY: valid handle.
        check!(unsafe { (self.api.get_dtype)(self.h, &mut d) }, "get_dtype");
        Ok(d)
    }

    fn is_cpu(&self) -> Result<bool, String> {
        let mut d = 0;
        // SAFETY: valid handle.
        check!(
            unsafe { (self.api.get_device_type)(self.h, &mut d) },
            "get_device_type"
        );
        Ok(d == self.api.device_cpu)
    }

    /// A view of this tensor's storage with `sizes` and `strides` (same data pointer, same device); no
    /// device-pointer query, unlike a tensor made from a blob.
    pub(crate) fn view(&self, sizes: &[i64], strides: &[i64]) -> Result<Tensor<'a>, String> {
        let f = self
            .api
            .reinterpret
            .ok_or("this torch has no aoti_torch__reinterpret_tensor")?;
        let mut h = std::ptr::null_mut();
        // SAFETY: valid handle; sizes and strides have ndim entries and address inside the storage
        // (the callers view contiguous tensors of at least that many elements).
        check!(
            unsafe {
                f(
                    self.h,
                    sizes.len() as i64,
                    sizes.as_ptr(),
                    strides.as_ptr(),
                    0,
                    &mut h,
                )
            },
            "_reinterpret_tensor"
        );
        Ok(Tensor { api: self.api, h })
    }

    pub(crate) fn device(&self) -> Result<Device, String> {
        let (mut kind, mut index) = (0, 0);
        // SAFETY: valid handle, plain out-parameters.
        unsafe {
            check!(
                (self.api.get_device_type)(self.h, &mut kind),
                "get_device_type"
            );
            check!(
                (self.api.get_device_index)(self.h, &mut index),
                "get_device_index"
            );
        }
        Ok(Device { kind, index })
    }

    pub(crate) fn data(&self) -> Result<*mut c_void, String> {
        let mut p = std::ptr::null_mut();
        // SAFETY: valid handle.
        check!(
            unsafe { (self.api.get_data_ptr)(self.h, &mut p) },
            "get_data_ptr"
        );
        Ok(p)
    }

    pub(crate) fn numel(&self) -> Result<usize, String> {
        Ok(self.sizes()?.iter().map(|&s| s as usize).product())
    }

    pub(crate) fn is_contiguous(&self) -> Result<bool, String> {
        let (sizes, strides) = (self.sizes()?, self.strides()?);
        let mut expect = 1i64;
        for (&s, &st) in sizes.iter().zip(strides).rev() {
            if s != 1 && st != expect {
                return Ok(false);
            }
            expect *= s;
        }
        Ok(true)
    }

    /// A new contiguous CPU tensor of `sizes` and `dtype`.
    fn empty(api: &'a Api, sizes: &[i64], dtype: i32) -> Result<Tensor<'a>, String> {
        let cpu = Device {
            kind: api.device_cpu,
            index: 0,
        };
        Tensor::empty_on(api, sizes, dtype, cpu)
    }

    /// A new contiguous tensor of `sizes` and `dtype` on `device` (torch's allocator; on CUDA the
    /// caching allocator, ordered on the current stream).
    pub(crate) fn empty_on(
        api: &'a Api,
        sizes: &[i64],
        dtype: i32,
        device: Device,
    ) -> Result<Tensor<'a>, String> {
        let mut strides = vec![1i64; sizes.len()];
        for i in (0..sizes.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * sizes[i + 1].max(1);
        }
        let mut h = std::ptr::null_mut();
        // SAFETY: sizes/strides arrays of ndim entries.
        check!(
            unsafe {
                (api.empty_strided)(
                    sizes.len() as i64,
                    sizes.as_ptr(),
                    strides.as_ptr(),
                    dtype,
                    device.kind,
                    device.index,
                    &mut h,
                )
            },
            "empty_strided"
        );
        Ok(Tensor { api, h })
    }

    /// This tensor, or a contiguous copy of it in `dtype` when it is strided or of another dtype.
    pub(crate) fn contiguous_as(self, dtype: i32) -> Result<Tensor<'a>, String> {
        self.contiguous_aligned(dtype, 1)
    }

    /// [`Self::contiguous_as`], also copying when the data is not `align`-byte aligned (a view at an
    /// odd offset); the copy is on the same device.
    pub(crate) fn contiguous_aligned(self, dtype: i32, align: usize) -> Result<Tensor<'a>, String> {
        if self.dtype()? == dtype
            && self.is_contiguous()?
            && (self.data()? as usize).is_multiple_of(align)
        {
            return Ok(self);
        }
        let out = Tensor::empty_on(self.api, self.sizes()?, dtype, self.device()?)?;
        // SAFETY: both handles valid; copy_ converts dtype and layout.
        check!(unsafe { (self.api.copy_)(out.h, self.h, 0) }, "copy_");
        Ok(out)
    }
}

/// torch's intra-op pool as a [`ParallelFor`].
struct TorchPool<'a>(&'a Api);

struct Trampoline<'f> {
    f: &'f (dyn Fn(Range<usize>) + Sync),
    panicked: AtomicBool,
}

unsafe extern "C" fn trampoline(begin: i64, end: i64, ctx: *mut c_void) {
    // SAFETY: ctx is the `Trampoline` `run` passes, alive for the whole parallel_for call.
    let t = unsafe { &*(ctx as *const Trampoline<'_>) };
    // A panic must never unwind into torch's C++ frames.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        (t.f)(begin as usize..end as usize)
    }))
    .is_err()
    {
        t.panicked.store(true, Ordering::Relaxed);
    }
}

impl ParallelFor for TorchPool<'_> {
    fn threads(&self) -> usize {
        let mut n = 1u32;
        // SAFETY: plain out-parameter.
        unsafe { (self.0.get_num_threads)(&mut n) };
        n.max(1) as usize
    }

    fn run(&self, n: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let t = Trampoline {
            f,
            panicked: AtomicBool::new(false),
        };
        // SAFETY: `t` outlives the call; torch_parallel_for returns after every piece ran.
        unsafe {
            (self.0.parallel_for)(
                0,
                n as i64,
                1,
                trampoline,
                &t as *const Trampoline<'_> as *mut c_void,
            )
        };
        if t.panicked.load(Ordering::Relaxed) {
            panic!("a ternary_rs kernel task panicked");
        }
    }
}

/// Entry point called by `csrc/torch_boxed.cpp`: returns 0, or non-zero with a message in `err`.
///
/// # Safety
/// `stack` is torch's boxed stack of `max(num_args, num_outputs)` StableIValues; `err` has `err_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ternary_rs_cpu_linear_boxed(
    stack: *mut u64,
    num_args: u64,
    num_outputs: u64,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: forwarded from our caller's contract.
    unsafe { run_boxed(stack, num_args, num_outputs, err, err_len, linear) }
}

/// The device kernel behind a boxed entry point: the op's arguments, owned, and its result.
#[allow(clippy::type_complexity)]
pub(crate) type LinearFn = for<'a> fn(
    &'a Api,
    Tensor<'a>,
    &Tensor<'a>,
    &Tensor<'a>,
    usize,
    usize,
    usize,
    Option<Tensor<'a>>,
    i64,
) -> Result<Tensor<'a>, String>;

/// Unbox the stack, run `kernel`, box its result; an error or panic becomes a message in `err`.
///
/// # Safety
/// As for [`ternary_rs_cpu_linear_boxed`].
pub(crate) unsafe fn run_boxed(
    stack: *mut u64,
    num_args: u64,
    num_outputs: u64,
    err: *mut c_char,
    err_len: usize,
    kernel: LinearFn,
) -> i32 {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: forwarded from our caller's contract.
        unsafe { boxed(stack, num_args, num_outputs, kernel) }
    }));
    let msg = match result {
        Ok(Ok(())) => return 0,
        Ok(Err(msg)) => msg,
        Err(_) => "ternary_rs::ternary_linear: internal error (panic)".to_string(),
    };
    if err_len > 0 {
        let bytes = msg.as_bytes();
        let n = bytes.len().min(err_len - 1);
        // SAFETY: n + 1 ≤ err_len bytes are written.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), err.cast::<u8>(), n);
            *err.add(n) = 0;
        }
    }
    1
}

unsafe fn boxed(
    stack: *mut u64,
    num_args: u64,
    num_outputs: u64,
    kernel: LinearFn,
) -> Result<(), String> {
    let api = API
        .get()
        .ok_or("ternary_rs: native kernel called before registration")?;
    if num_args != NUM_ARGS || num_outputs != 1 {
        return Err(format!(
            "ternary_rs::ternary_linear: the registered schema has {num_args} arguments and {num_outputs} outputs, \
             this kernel expects {NUM_ARGS} and 1 (ternary_rs's ops.py and _core are from different versions?)"
        ));
    }
    // SAFETY: the stack holds NUM_ARGS entries.
    let arg = |i: usize| unsafe { *stack.add(i) };
    // Take ownership of every handle first, so all are freed whatever fails below.
    let x = Tensor {
        api,
        h: arg(0) as Handle,
    };
    let qweight = Tensor {
        api,
        h: arg(1) as Handle,
    };
    let scales = Tensor {
        api,
        h: arg(2) as Handle,
    };
    let bias_box = arg(6) as *mut u64;
    let bias = if bias_box.is_null() {
        None
    } else {
        // SAFETY: a non-null optional is a heap StableIValue holding an owned tensor handle.
        let h = unsafe { *bias_box } as Handle;
        match api.delete_stable_ivalue {
            Some(del) => unsafe { del(bias_box) },
            None => {
                unsafe { ternary_rs_delete_stable_ivalue(bias_box) };
                0
            }
        };
        Some(Tensor { api, h })
    };
    let int_arg = |i: usize, name: &str| -> Result<usize, String> {
        let v = arg(i) as i64;
        usize::try_from(v).map_err(|_| format!("ternary_linear: {name}={v} must be non-negative"))
    };
    let n = int_arg(3, "out_features")?;
    let k = int_arg(4, "in_features")?;
    let g = int_arg(5, "group_size")?;
    let activations = arg(7) as i64;

    let out = kernel(api, x, &qweight, &scales, n, k, g, bias, activations)?;
    // SAFETY: outputs go to the front of the stack; ownership passes to torch.
    unsafe { *stack = out.into_raw() as u64 };
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn linear<'a>(
    api: &'a Api,
    x: Tensor<'a>,
    qweight: &Tensor<'a>,
    scales: &Tensor<'a>,
    n: usize,
    k: usize,
    g: usize,
    bias: Option<Tensor<'a>>,
    activations: i64,
) -> Result<Tensor<'a>, String> {
    let name = if x.dtype()? == api.dtype_bf16 {
        "bfloat16"
    } else if x.dtype()? == api.dtype_f16 {
        "float16"
    } else if x.dtype()? == api.dtype_f32 {
        "float32"
    } else {
        return Err(
            "ternary_linear: x dtype is not supported; use bfloat16, float16 or float32".into(),
        );
    };
    for (t, what) in [(&x, "x"), (qweight, "qweight"), (scales, "scales")] {
        if !t.is_cpu()? {
            return Err(format!(
                "ternary_linear (CPU kernel): {what} is not a CPU tensor"
            ));
        }
    }
    let xs = x.sizes()?.to_vec();
    if xs.is_empty() || xs[xs.len() - 1] as usize != k {
        return Err(format!(
            "ternary_linear: x has shape {xs:?}, expected [..., {k}]"
        ));
    }
    ternary_core::canonical::check_shape(n.max(1), k, g)
        .map_err(|e| format!("ternary_linear: {e}"))?;
    let want_q = [layout::row_blocks(n) as i64, layout::block_bytes(k) as i64];
    let want_s = [
        layout::row_blocks(n) as i64,
        (layout::padded_groups(k, g) * layout::ROWS) as i64,
    ];
    if qweight.dtype()? != api.dtype_u8 || qweight.sizes()? != want_q || !qweight.is_contiguous()? {
        return Err(format!(
            "ternary_linear: qweight must be the prepared uint8 {want_q:?} (ops.prepare_weight), got shape {:?}",
            qweight.sizes()?
        ));
    }
    if scales.dtype()? != api.dtype_f16 || scales.sizes()? != want_s || !scales.is_contiguous()? {
        return Err(format!(
            "ternary_linear: scales must be the prepared float16 {want_s:?} (ops.prepare_weight), got shape {:?}",
            scales.sizes()?
        ));
    }
    let dtype = x.dtype()?;
    let x = x.contiguous_as(dtype)?;
    let bias = match bias {
        Some(b) => {
            if b.sizes()? != [n as i64] || !b.is_cpu()? {
                return Err(format!(
                    "ternary_linear: bias must be a CPU tensor of shape [{n}], got {:?}",
                    b.sizes()?
                ));
            }
            Some(b.contiguous_as(dtype)?)
        }
        None => None,
    };
    let mut out_sizes = xs[..xs.len() - 1].to_vec();
    out_sizes.push(n as i64);
    let y = Tensor::empty(api, &out_sizes, dtype)?;
    let m = x.numel()? / k.max(1);
    if m == 0 || n == 0 {
        return Ok(y);
    }
    let precision = resolve_precision(activations, name == "float32")?;
    let ptrs = Ptrs {
        x: x.data()? as usize,
        q: qweight.data()? as usize,
        s: scales.data()? as usize,
        b: match &bias {
            Some(b) => b.data()? as usize,
            None => 0,
        },
        y: y.data()? as usize,
    };
    let pool = TorchPool(api);
    // Prefill without AMX-INT8: decoded bf16 chunks through torch's GEMM beat the VNNI kernel
    // (dense.rs docs); with it the int8 AMX tiles beat both (cpu::amx docs), so they keep the default.
    // Only in the default mode: an explicit activations mode or TERNARY_RS_CPU_INT8 keeps its numerics.
    if name == "bfloat16"
        && activations == ACTIVATIONS_AUTO
        && DEFAULT_MODE.load(Ordering::Relaxed) == 0
        && m >= dense::DENSE_MIN_M
        && variant() != Variant::Amx
    {
        if let Some(gemm) = &api.gemm {
            dense_tile_gemm(api, gemm, ptrs, m, n, k, g, bias.is_some(), &pool)?;
            return Ok(y);
        }
    }
    match name {
        "bfloat16" => run::<bf16>(ptrs, m, n, k, g, precision, &pool),
        "float16" => run::<f16>(ptrs, m, n, k, g, precision, &pool),
        _ => run::<f32>(ptrs, m, n, k, g, precision, &pool),
    }?;
    Ok(y)
}

#[derive(Clone, Copy)]
struct Ptrs {
    x: usize,
    q: usize,
    s: usize,
    b: usize,
    y: usize,
}

fn run<T: Activation>(
    p: Ptrs,
    m: usize,
    n: usize,
    k: usize,
    g: usize,
    precision: Precision,
    pool: &dyn ParallelFor,
) -> Result<(), String> {
    let w = prepared_weight(p, n, k, g)?;
    // SAFETY: x, bias and y are the data of contiguous CPU tensors whose dtype and shape were checked
    // above (x: m·k elements of T, bias n, y freshly allocated m·n).
    let (x, bias, y) = unsafe {
        (
            std::slice::from_raw_parts(p.x as *const T, m * k),
            (p.b != 0).then(|| std::slice::from_raw_parts(p.b as *const T, n)),
            std::slice::from_raw_parts_mut(p.y as *mut T, m * n),
        )
    };
    cpu::gemm(w, x, m, bias, y, variant(), precision, pool)
        .map_err(|e| format!("ternary_linear: {e}"))
}

/// The prepared weight behind `p.q` / `p.s`.
fn prepared_weight(p: Ptrs, n: usize, k: usize, g: usize) -> Result<PreparedRef<'static>, String> {
    let planes = layout::prepared_bytes(n, k).ok_or("prepared weight size overflows")?;
    let scales = layout::prepared_scales(n, k, g).ok_or("prepared scales size overflows")?;
    // SAFETY: both are the data of contiguous CPU tensors checked to have exactly these sizes, alive
    // (held by the caller's handles) for the whole call; 'static never escapes the call.
    Ok(unsafe {
        PreparedRef {
            rows: n,
            cols: k,
            group_size: g,
            planes: std::slice::from_raw_parts(p.q as *const u8, planes),
            scales: std::slice::from_raw_parts(p.s as *const f16, scales),
        }
    })
}

/// Bytes of bf16 weight decoded per torch GEMM call: big enough that the GEMM's N is wide, small
/// enough to stay in the last-level cache.
const DENSE_CHUNK_BYTES: usize = 16 << 20;

/// `y = x · Wᵀ (+ bias)` for bf16 `x [m, k]`: row chunks of W decoded to bf16, each multiplied by
/// torch's GEMM straight into its columns of `y` (row stride n), the bias added by the same call.
#[allow(clippy::too_many_arguments)]
fn dense_tile_gemm(
    api: &Api,
    gemm: &TorchGemm,
    p: Ptrs,
    m: usize,
    n: usize,
    k: usize,
    g: usize,
    has_bias: bool,
    pool: &dyn ParallelFor,
) -> Result<(), String> {
    let w = prepared_weight(p, n, k, g)?;
    let blocks = layout::row_blocks(n);
    let per_chunk = (DENSE_CHUNK_BYTES / (2 * k * layout::ROWS)).clamp(1, blocks);
    // One buffer per thread, kept: a fresh 16 MiB allocation is a fresh mmap, page-faulted on every call.
    thread_local! {
        static BUF: std::cell::RefCell<Vec<bf16>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with(|cell| {
        let mut buf = cell.borrow_mut();
        let need = (per_chunk * layout::ROWS).min(n) * k;
        if buf.len() < need {
            buf.resize(need, bf16::ZERO);
        }
        // A tensor over memory we own (or torch owns: x, y, bias), freed (not the memory) on drop.
        let view =
            |data: usize, sizes: [i64; 2], strides: [i64; 2]| -> Result<Tensor<'_>, String> {
                let mut h = std::ptr::null_mut();
                // SAFETY: `data` points at ≥ the bytes these sizes/strides address, alive past the GEMM.
                check!(
                    unsafe {
                        (gemm.from_blob)(
                            data as *mut c_void,
                            2,
                            sizes.as_ptr(),
                            strides.as_ptr(),
                            0,
                            api.dtype_bf16,
                            api.device_cpu,
                            0,
                            &mut h,
                        )
                    },
                    "create_tensor_from_blob"
                );
                Ok(Tensor { api, h })
            };
        let (mi, ki, ni) = (m as i64, k as i64, n as i64);
        let x = view(p.x, [mi, ki], [ki, 1])?;
        for b0 in (0..blocks).step_by(per_chunk) {
            let b1 = (b0 + per_chunk).min(blocks);
            let (r0, r1) = (b0 * layout::ROWS, (b1 * layout::ROWS).min(n));
            let rows = r1 - r0;
            dense::decode_blocks_bf16(&w, b0..b1, &mut buf[..rows * k], pool)
                .map_err(|e| format!("ternary_linear: {e}"))?;
            let c = rows as i64;
            let wt = view(buf.as_ptr() as usize, [ki, c], [1, ki])?; // Wᵀ chunk [k, rows]
            let out = view(p.y + 2 * r0, [mi, c], [ni, 1])?;
            if has_bias {
                let bias = view(p.b + 2 * r0, [mi, c], [0, 1])?; // broadcast over tokens
                                                                 // SAFETY: valid handles; out = 1·bias + 1·(x · wt).
                check!(
                    unsafe { (gemm.addmm_out)(out.h, bias.h, x.h, wt.h, 1.0, 1.0) },
                    "addmm_out"
                );
            } else {
                // SAFETY: valid handles.
                check!(unsafe { (gemm.mm_out)(out.h, x.h, wt.h) }, "mm_out");
            }
        }
        Ok(())
    })
}
