//! torch's stable C ABI, resolved at run time: nothing here is built against torch. The C functions
//! (`torch/csrc/stable/c/shim.h`, `torch/csrc/inductor/aoti_torch/c/shim.h`) are looked up in the
//! `libtorch_cpu.so` that `import torch` has already loaded (`dlopen(RTLD_NOLOAD)` on the path Python
//! passes), so the abi3 wheel works across torch versions.

use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::OnceLock;

pub(crate) type Handle = *mut c_void;
pub(crate) type Status = i32;
pub(crate) type BoxedFn = unsafe extern "C" fn(*mut u64, u64, u64);
pub(crate) type ParallelFunc = unsafe extern "C" fn(i64, i64, *mut c_void);

extern "C" {
    fn dlopen(filename: *const c_char, flags: i32) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *const c_char;
}
const RTLD_LAZY: i32 = 0x1;
const RTLD_NOLOAD: i32 = 0x4;

pub(crate) type InitImplFn =
    unsafe extern "C" fn(*const c_char, *const c_char, *const c_char, u32, *mut Handle) -> Status;
pub(crate) type ImplFn = unsafe extern "C" fn(Handle, *const c_char, BoxedFn, u64) -> Status;
pub(crate) type HandleFn = unsafe extern "C" fn(Handle) -> Status;
/// `aoti_torch__reinterpret_tensor(self, ndim, sizes, strides, storage_offset_increment, &out)`.
pub(crate) type ReinterpretFn =
    unsafe extern "C" fn(Handle, i64, *const i64, *const i64, i64, *mut Handle) -> Status;
pub(crate) type PtrOutFn = unsafe extern "C" fn(Handle, *mut *mut c_void) -> Status;
pub(crate) type I64OutFn = unsafe extern "C" fn(Handle, *mut i64) -> Status;
pub(crate) type ArrayOutFn = unsafe extern "C" fn(Handle, *mut *mut i64) -> Status;
pub(crate) type I32OutFn = unsafe extern "C" fn(Handle, *mut i32) -> Status;
pub(crate) type EmptyStridedFn =
    unsafe extern "C" fn(i64, *const i64, *const i64, i32, i32, i32, *mut Handle) -> Status;
pub(crate) type CopyFn = unsafe extern "C" fn(Handle, Handle, i32) -> Status;
pub(crate) type DeleteFn = unsafe extern "C" fn(Handle) -> Status;
pub(crate) type ParallelForFn =
    unsafe extern "C" fn(i64, i64, i64, ParallelFunc, *mut c_void) -> Status;
pub(crate) type U32OutFn = unsafe extern "C" fn(*mut u32) -> Status;
pub(crate) type DeleteIValueFn = unsafe extern "C" fn(*mut u64) -> Status;
pub(crate) type ConstFn = unsafe extern "C" fn() -> i32;
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
    pub(crate) mm_out: MmOutFn,
    pub(crate) addmm_out: AddmmOutFn,
}

/// The stable-ABI functions we call, resolved once.
pub(crate) struct Api {
    pub(crate) library_init_impl: InitImplFn,
    pub(crate) library_impl: ImplFn,
    pub(crate) get_data_ptr: PtrOutFn,
    pub(crate) get_dim: I64OutFn,
    pub(crate) get_sizes: ArrayOutFn,
    pub(crate) get_strides: ArrayOutFn,
    pub(crate) get_dtype: I32OutFn,
    pub(crate) get_device_type: I32OutFn,
    pub(crate) get_device_index: I32OutFn,
    pub(crate) zero_: Option<HandleFn>,
    pub(crate) reinterpret: Option<ReinterpretFn>,
    pub(crate) empty_strided: EmptyStridedFn,
    pub(crate) copy_: CopyFn,
    pub(crate) delete_tensor: DeleteFn,
    pub(crate) parallel_for: ParallelForFn,
    pub(crate) get_num_threads: U32OutFn,
    pub(crate) delete_stable_ivalue: Option<DeleteIValueFn>,
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

/// The API if [`api`] resolved it (a kernel can run only after registration did).
pub(crate) fn registered_api() -> Option<&'static Api> {
    API.get()
}

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
