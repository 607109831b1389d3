//! The CPU kernel of `ternary_rs::dense_linear`: a dense bf16 / f16 linear layer through the core's
//! half-precision kernel (`ternary_core::kernels::cpu::half_linear`) on torch's intra-op pool. The
//! vLLM plugin routes a ternary model's dense layers here where torch's bf16 GEMM is not native.

use half::{bf16, f16};
use ternary_core::kernels::cpu::half_linear::{self, Half, HalfVariant};
use ternary_core::kernels::cpu::Variant;

use super::abi::Api;
use super::policy::{variant, warm_up_pass};
use super::pool::TorchPool;
use super::tensor::Tensor;
use super::{api_for_schema, take_optional_tensor, take_tensor};

/// The schema's argument count: x, weight, bias.
const NUM_ARGS: u64 = 3;
const OP: &str = "ternary_rs::dense_linear";

cpu_boxed_op!(
    c"dense_linear",
    OP,
    ternary_rs_cpu_dense_entry,
    ternary_rs_cpu_dense_boxed
);

unsafe fn boxed(stack: *mut u64, num_args: u64, num_outputs: u64) -> Result<(), String> {
    let api = api_for_schema(OP, (num_args, num_outputs), NUM_ARGS)?;
    // Own every tensor handle first, so all are freed whatever fails below.
    // SAFETY: arguments 0 and 1 are tensors, 2 an optional tensor, by the schema.
    let (x, weight, bias) = unsafe {
        (
            take_tensor(api, stack, 0),
            take_tensor(api, stack, 1),
            take_optional_tensor(api, stack, 2),
        )
    };
    let out = linear(api, x, weight, bias)?;
    // SAFETY: outputs go to the front of the stack; ownership passes to torch.
    unsafe { *stack = out.into_raw() as u64 };
    Ok(())
}

fn linear<'a>(
    api: &'a Api,
    x: Tensor<'a>,
    weight: Tensor<'a>,
    bias: Option<Tensor<'a>>,
) -> Result<Tensor<'a>, String> {
    let dtype = weight.dtype()?;
    let name = if dtype == api.dtype_bf16 {
        "bfloat16"
    } else if dtype == api.dtype_f16 {
        "float16"
    } else {
        return Err(format!(
            "{OP}: weight dtype is not supported; use bfloat16 or float16"
        ));
    };
    for (t, what) in [(&x, "x"), (&weight, "weight")] {
        if !t.is_cpu()? {
            return Err(format!("{OP}: {what} is not a CPU tensor"));
        }
    }
    if x.dtype()? != dtype {
        return Err(format!("{OP}: x must have the weight's dtype ({name})"));
    }
    let (n, k) = match *weight.sizes()? {
        [n, k] => (n as usize, k as usize),
        ref s => {
            return Err(format!(
                "{OP}: weight must be 2-D [out, in], got shape {s:?}"
            ))
        }
    };
    let xs = x.sizes()?.to_vec();
    if xs.is_empty() || xs[xs.len() - 1] as usize != k {
        return Err(format!("{OP}: x has shape {xs:?}, expected [..., {k}]"));
    }
    let bias = match bias {
        Some(b) if b.sizes()? != [n as i64] || !b.is_cpu()? => {
            return Err(format!(
                "{OP}: bias must be a CPU tensor of shape [{n}], got {:?}",
                b.sizes()?
            ))
        }
        Some(b) => Some(b.contiguous_as(dtype)?),
        None => None,
    };
    let x = x.contiguous_as(dtype)?;
    let weight = weight.contiguous_as(dtype)?;
    let mut out_sizes = xs[..xs.len() - 1].to_vec();
    out_sizes.push(n as i64);
    let y = Tensor::empty(api, &out_sizes, dtype)?;
    let m = x.numel()? / k.max(1);
    if m == 0 || n == 0 {
        return Ok(y);
    }
    if warm_up_pass() {
        y.zero_cpu()?;
        return Ok(y);
    }
    let kernel = if variant() == Variant::Scalar {
        HalfVariant::Scalar
    } else {
        HalfVariant::best()
    };
    let pool = TorchPool(api);
    let ptrs = [
        x.data()? as usize,
        weight.data()? as usize,
        bias.as_ref()
            .map_or(Ok(0), |b| b.data().map(|p| p as usize))?,
        y.data()? as usize,
    ];
    match name {
        "bfloat16" => run::<bf16>(ptrs, (m, n, k), kernel, &pool),
        _ => run::<f16>(ptrs, (m, n, k), kernel, &pool),
    }?;
    Ok(y)
}

fn run<T: Half>(
    [x, w, b, y]: [usize; 4],
    (m, n, k): (usize, usize, usize),
    kernel: HalfVariant,
    pool: &TorchPool<'_>,
) -> Result<(), String> {
    // SAFETY: the data of contiguous CPU tensors of T whose shapes were checked above (x m·k, weight
    // n·k, bias n, y freshly allocated m·n), alive for the call.
    let (x, w, bias, y) = unsafe {
        (
            std::slice::from_raw_parts(x as *const T, m * k),
            std::slice::from_raw_parts(w as *const T, n * k),
            (b != 0).then(|| std::slice::from_raw_parts(b as *const T, n)),
            std::slice::from_raw_parts_mut(y as *mut T, m * n),
        )
    };
    half_linear::linear(x, w, bias, y, m, n, k, kernel, pool).map_err(|e| format!("{OP}: {e}"))
}
