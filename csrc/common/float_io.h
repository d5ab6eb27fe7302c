// Moving data of any floating dtype in and out of scratch buffers of the compute type
// (float32, or float64 when an input is float64, as ppo_fast.reference computes), so
// that each CPU kernel has one code path for every mix of input dtypes.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/EmptyTensor.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <optional>

namespace ppo_fast {

// A 0-d tensor of `dtype` holding `value` (a double accumulated over a batch): rounded as a
// cast rounds it, out-of-range values to +-inf (as torch's float arithmetic overflows; a
// Scalar conversion would raise "cannot be converted without overflow" instead).
inline at::Tensor scalar_result(double value, const at::TensorOptions& options, at::ScalarType dtype) {
  if (dtype != at::kDouble && std::isfinite(value)) {
    const double top = dtype == at::kFloat ? double(std::numeric_limits<float>::max()) : 0.0;
    if (top > 0.0 && std::abs(value) > top) value = std::copysign(std::numeric_limits<double>::infinity(), value);
  }
  if (options.device().is_cpu() && (dtype == at::kFloat || dtype == at::kDouble)) {
    // Made and written in place, without the dispatcher (at::scalar_tensor is an empty and a
    // fill_, each dispatched): a loss returns four of these per call.
    at::Tensor out(at::detail::empty_cpu({}, dtype));
    if (dtype == at::kFloat) {
      *out.mutable_data_ptr<float>() = static_cast<float>(value);
    } else {
      *out.mutable_data_ptr<double>() = value;
    }
    return out;
  }
  return at::scalar_tensor(value, options.dtype(dtype));
}

// dst[i] = acc_t(t.flat[offset + i]) for a contiguous tensor t.
template <typename acc_t>
void load_as(const at::Tensor& t, int64_t offset, int64_t n, acc_t* dst) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "load_as", [&] {
    const scalar_t* src = t.const_data_ptr<scalar_t>() + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<acc_t>(src[i]);
  });
}

// t's elements [offset, offset + n) in the compute type: t's own data when t has that
// dtype (no copy), else converted into scratch.
template <typename acc_t>
const acc_t* chunk_in(const at::Tensor& t, int64_t offset, int64_t n, acc_t* scratch) {
  if (t.scalar_type() == c10::CppTypeToScalarType<acc_t>::value) return t.const_data_ptr<acc_t>() + offset;
  load_as(t, offset, n, scratch);
  return scratch;
}

// t.flat[offset + i] = src[i] rounded to t's dtype, for a contiguous tensor t.
template <typename acc_t>
void store_as(const at::Tensor& t, int64_t offset, int64_t n, const acc_t* src) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "store_as", [&] {
    scalar_t* dst = t.mutable_data_ptr<scalar_t>() + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
  });
}

// The compute (and result) dtype: float64 if any defined input is float64, else float32.
inline at::ScalarType compute_dtype(std::initializer_list<const at::Tensor*> inputs) {
  for (const at::Tensor* t : inputs)
    if (t->defined() && t->scalar_type() == at::kDouble) return at::kDouble;
  return at::kFloat;
}

// body(acc_t{}) with acc_t = double for kDouble, else float; body is a generic lambda.
template <typename Body>
decltype(auto) with_compute_type(at::ScalarType dtype, const Body& body) {
  if (dtype == at::kDouble) return body(double{});
  return body(float{});
}

// Where to write t's elements [offset, ...) in the compute type: into t when t has that
// dtype, else into scratch, which store_chunk then converts into t.  An undefined or
// empty t (a gradient nobody asked for) is written to scratch and never stored.
template <typename acc_t>
acc_t* chunk_out(const at::Tensor& t, int64_t offset, acc_t* scratch) {
  if (!t.defined() || t.numel() == 0) return scratch;
  return t.scalar_type() == c10::CppTypeToScalarType<acc_t>::value ? t.mutable_data_ptr<acc_t>() + offset : scratch;
}

template <typename acc_t>
void store_chunk(const at::Tensor& t, int64_t offset, int64_t n, const acc_t* out, const acc_t* scratch) {
  if (out == scratch && t.defined() && t.numel() != 0) store_as(t, offset, n, out);
}

// The gradient of `input` when wanted (contiguous, of input's shape, in `dtype`: input's
// own by default), else an empty tensor of input's dtype.
inline at::Tensor grad_like(const at::Tensor& input, bool wanted, std::optional<at::ScalarType> dtype = std::nullopt) {
  if (!wanted) {  // on CPU without the dispatcher: a backward returns up to three of these per call
    return input.is_cpu() ? at::Tensor(at::detail::empty_cpu({0}, input.scalar_type()))
                          : at::empty({0}, input.options());
  }
  return at::empty(
      input.sizes(),
      input.options().dtype(dtype.value_or(input.scalar_type())).memory_format(at::MemoryFormat::Contiguous));
}

// Rows per parallel task so that a task has at least ~32k elements of work.
inline int64_t row_grain(int64_t row_length) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(row_length, 1));
}

}  // namespace ppo_fast
