// The one piece of C++ in the bindings: torch's dispatcher expects a boxed kernel to report failure
// by throwing a C++ exception (it becomes a Python RuntimeError naming our message). Rust cannot
// throw, so the kernels themselves (`ternary_rs_cpu_linear_boxed` in src/torch/cpu_op.rs,
// `ternary_rs_cuda_linear_boxed` in src/torch/cuda_op.rs, `ternary_rs_cpu_moe_boxed` in
// src/torch/moe_op.rs, `ternary_rs_cpu_dense_boxed` in src/torch/dense_op.rs, `ternary_rs_cpu_fwht_boxed` in src/torch/fwht_op.rs, `ternary_rs_cpu_attention_boxed` in src/torch/attention_op.rs) return an error code and these wrappers throw. No torch header is needed:
// the stack is an array of 64-bit StableIValues (torch/csrc/stable/library.h).
#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>

extern "C" {
int32_t ternary_rs_cpu_linear_boxed(uint64_t* stack, uint64_t num_args, uint64_t num_outputs,
                                    char* err, size_t err_len);
int32_t ternary_rs_cuda_linear_boxed(uint64_t* stack, uint64_t num_args, uint64_t num_outputs,
                                     char* err, size_t err_len);
int32_t ternary_rs_cpu_moe_boxed(uint64_t* stack, uint64_t num_args, uint64_t num_outputs, char* err,
                                 size_t err_len);

int32_t ternary_rs_cpu_dense_boxed(uint64_t* stack, uint64_t num_args, uint64_t num_outputs, char* err,
                                   size_t err_len);
int32_t ternary_rs_cpu_fwht_boxed(uint64_t* stack, uint64_t num_args, uint64_t num_outputs, char* err,
                                  size_t err_len);
int32_t ternary_rs_cpu_attention_boxed(uint64_t* stack, uint64_t num_args, uint64_t num_outputs, char* err,
                                       size_t err_len);

void ternary_rs_cpu_linear_entry(uint64_t* stack, uint64_t num_args, uint64_t num_outputs) {
  char err[2048];
  if (ternary_rs_cpu_linear_boxed(stack, num_args, num_outputs, err, sizeof(err)) != 0) {
    throw std::runtime_error(err);
  }
}

void ternary_rs_cuda_linear_entry(uint64_t* stack, uint64_t num_args, uint64_t num_outputs) {
  char err[2048];
  if (ternary_rs_cuda_linear_boxed(stack, num_args, num_outputs, err, sizeof(err)) != 0) {
    throw std::runtime_error(err);
  }
}

void ternary_rs_cpu_moe_entry(uint64_t* stack, uint64_t num_args, uint64_t num_outputs) {
  char err[2048];
  if (ternary_rs_cpu_moe_boxed(stack, num_args, num_outputs, err, sizeof(err)) != 0) {
    throw std::runtime_error(err);
  }
}

void ternary_rs_cpu_dense_entry(uint64_t* stack, uint64_t num_args, uint64_t num_outputs) {
  char err[2048];
  if (ternary_rs_cpu_dense_boxed(stack, num_args, num_outputs, err, sizeof(err)) != 0) {
    throw std::runtime_error(err);
  }
}

void ternary_rs_cpu_fwht_entry(uint64_t* stack, uint64_t num_args, uint64_t num_outputs) {
  char err[2048];
  if (ternary_rs_cpu_fwht_boxed(stack, num_args, num_outputs, err, sizeof(err)) != 0) {
    throw std::runtime_error(err);
  }
}

void ternary_rs_cpu_attention_entry(uint64_t* stack, uint64_t num_args, uint64_t num_outputs) {
  char err[2048];
  if (ternary_rs_cpu_attention_boxed(stack, num_args, num_outputs, err, sizeof(err)) != 0) {
    throw std::runtime_error(err);
  }
}

// Frees a heap StableIValue (the boxed form of an `optional` argument) where the running torch
// predates torch_delete_stable_ivalue (< 2.13) and allocated it with `new`.
void ternary_rs_delete_stable_ivalue(uint64_t* p) { delete p; }
}
