//! The owned tensor handle of the stable ABI and the few tensor operations the kernels need.

use std::ffi::c_void;

use super::abi::{Api, Handle};

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

    pub(crate) fn strides(&self) -> Result<&[i64], String> {
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

    pub(crate) fn is_cpu(&self) -> Result<bool, String> {
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

    /// Set every element of this contiguous bf16 / fp16 / f32 CPU tensor to 0.0 (all-zero bits in each).
    pub(crate) fn zero_cpu(&self) -> Result<(), String> {
        let dtype = self.dtype()?;
        let elem_bytes = if dtype == self.api.dtype_f32 {
            4
        } else if dtype == self.api.dtype_bf16 || dtype == self.api.dtype_f16 {
            2
        } else {
            return Err("zero_cpu: not a bf16, fp16 or f32 tensor".into());
        };
        if !self.is_cpu()? || !self.is_contiguous()? {
            return Err("zero_cpu: not a contiguous CPU tensor".into());
        }
        // SAFETY: a contiguous CPU tensor (checked) of numel elements of elem_bytes each (its dtype).
        unsafe { std::ptr::write_bytes(self.data()? as *mut u8, 0, self.numel()? * elem_bytes) };
        Ok(())
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
    pub(crate) fn empty(api: &'a Api, sizes: &[i64], dtype: i32) -> Result<Tensor<'a>, String> {
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
