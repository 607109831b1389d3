//! The CPU kernel of `ternary_rs::fwht`: Bonsai 2's blockwise Hadamard rotation
//! (`ternary_core::hadamard::Transform`) on torch's intra-op pool.
//!
//! Native for the same reason as `ternary_linear`: a rotated model calls it before every rotated layer
//! (~280 times per decode step at 27B), and through a Python custom op each call in a compiled graph
//! cost ~50 µs of dispatch, autograd wrapper and NumPy views around a transform of a few µs.

use half::{bf16, f16};
use ternary_core::hadamard::{Direction, Element, Transform};

use super::abi::Api;
use super::pool::TorchPool;
use super::tensor::{check, Tensor};
use super::{api_for_schema, take_optional_tensor, take_tensor};

/// The schema's argument count: x, block_size, signs, inverse, gather.
const NUM_ARGS: u64 = 5;
const OP: &str = "ternary_rs::fwht";

cpu_boxed_op!(
    c"fwht",
    OP,
    ternary_rs_cpu_fwht_entry,
    ternary_rs_cpu_fwht_boxed
);

unsafe fn boxed(stack: *mut u64, num_args: u64, num_outputs: u64) -> Result<(), String> {
    let api = api_for_schema(OP, (num_args, num_outputs), NUM_ARGS)?;
    // Own every tensor handle first, so all are freed whatever fails below.
    // SAFETY: by the schema, 0 is a tensor, 1 an int, 2 and 4 optional tensors, 3 a bool (its
    // StableIValue is the bool's byte, zero-padded).
    let (x, block_size, signs, inverse, gather) = unsafe {
        (
            take_tensor(api, stack, 0),
            *stack.add(1) as i64,
            take_optional_tensor(api, stack, 2),
            *stack.add(3) & 0xFF != 0,
            take_optional_tensor(api, stack, 4),
        )
    };
    let out = fwht(api, x, block_size, signs, inverse, gather)?;
    // SAFETY: outputs go to the front of the stack; ownership passes to torch.
    unsafe { *stack = out.into_raw() as u64 };
    Ok(())
}

fn fwht<'a>(
    api: &'a Api,
    x: Tensor<'a>,
    block_size: i64,
    signs: Option<Tensor<'a>>,
    inverse: bool,
    gather: Option<Tensor<'a>>,
) -> Result<Tensor<'a>, String> {
    for (t, what) in [
        (Some(&x), "x"),
        (signs.as_ref(), "signs"),
        (gather.as_ref(), "gather"),
    ] {
        if let Some(t) = t {
            if !t.is_cpu()? {
                return Err(format!("{OP}: {what} is not a CPU tensor"));
            }
        }
    }
    let block_size = usize::try_from(block_size)
        .map_err(|_| format!("{OP}: block_size={block_size} must be positive"))?;
    let sizes = x.sizes()?.to_vec();
    let in_dtype = x.dtype()?;
    // Other float dtypes (float64) are transformed in float32 and converted back, as torch would.
    let native = [api.dtype_f32, api.dtype_bf16, api.dtype_f16].contains(&in_dtype);
    let dtype = if native { in_dtype } else { api.dtype_f32 };
    let x = x.contiguous_as(dtype)?;
    let y = Tensor::empty(api, &sizes, dtype)?;
    let numel = x.numel()?;
    if numel > 0 {
        let width = *sizes
            .last()
            .ok_or(format!("{OP}: x must have at least one dimension"))?
            as usize;
        let signs = signs.map(|s| s.contiguous_as(api.dtype_f32)).transpose()?;
        let gather = gather.map(|g| g.contiguous_as(api.dtype_i32)).transpose()?;
        // SAFETY: contiguous CPU tensors of f32 / i32 (converted above) of numel elements, alive for
        // the call; a negative index reads as a huge u32, which the permutation check refuses.
        let signs = match &signs {
            Some(s) => {
                Some(unsafe { std::slice::from_raw_parts(s.data()? as *const f32, s.numel()?) })
            }
            None => None,
        };
        let gather = match &gather {
            Some(g) => {
                Some(unsafe { std::slice::from_raw_parts(g.data()? as *const u32, g.numel()?) })
            }
            None => None,
        };
        let direction = if inverse {
            Direction::Inverse
        } else {
            Direction::Forward
        };
        let t = Transform::new(width, block_size, direction, signs, gather)
            .map_err(|e| format!("{OP}: {e}"))?;
        let pool = TorchPool(api);
        let (src, dst) = (x.data()? as usize, y.data()? as usize);
        if dtype == api.dtype_bf16 {
            run::<bf16>(&t, src, dst, numel, &pool)
        } else if dtype == api.dtype_f16 {
            run::<f16>(&t, src, dst, numel, &pool)
        } else {
            run::<f32>(&t, src, dst, numel, &pool)
        }?;
    }
    if native {
        return Ok(y);
    }
    let out = Tensor::empty(api, &sizes, in_dtype)?;
    // SAFETY: both handles valid; copy_ converts the dtype.
    check!(unsafe { (api.copy_)(out.h, y.h, 0) }, "copy_");
    Ok(out)
}

fn run<T: Element>(
    t: &Transform<'_>,
    src: usize,
    dst: usize,
    numel: usize,
    pool: &TorchPool<'_>,
) -> Result<(), String> {
    // SAFETY: the data of a contiguous CPU tensor of T (x) and a fresh one of the same shape (y),
    // numel elements each, alive for the call.
    let (src, dst) = unsafe {
        (
            std::slice::from_raw_parts(src as *const T, numel),
            std::slice::from_raw_parts_mut(dst as *mut T, numel),
        )
    };
    t.apply_on(src, dst, pool).map_err(|e| format!("{OP}: {e}"))
}
