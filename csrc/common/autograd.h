// What the ops' autograd kernels (csrc/autograd/<op>.cpp, registered at the Autograd key) share.
// The autograd of every native op lives in C++: a Python autograd kernel
// (torch.library.register_autograd) costs about 90 us of host time per forward + backward on
// top of the kernels, more than the kernels themselves on a training step's loss.  The fake
// kernels stay in Python (ppo_fast/backends/native/<op>.py): torch.compile traces these
// kernels with fake tensors, as it traces any C++ autograd kernel.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace ppo_fast {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The typed handle of the operator ppo_fast::<name>.  Hold it in a function-local static: the
// lookup (a hash of the name under the dispatcher's lock) then happens once.
template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Whether a call of an autograd kernel must go through its Function: grad mode on and a tensor
// argument that requires a gradient, or one with a forward-mode tangent (which the Function
// refuses rather than drop).  Otherwise the kernel calls its op below autograd, without the
// Function's node, context and saved tensors: about a sixth of a small op's host time under
// no_grad, where a training loop computes its rewards and advantages.
inline bool has_tangent(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }
inline bool has_tangent(const std::optional<at::Tensor>& t) { return t.has_value() && has_tangent(*t); }
template <typename T>
bool has_tangent(const T&) {
  return false;
}
inline bool wants_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool wants_grad(const std::optional<at::Tensor>& t) { return t.has_value() && wants_grad(*t); }
template <typename T>
bool wants_grad(const T&) {
  return false;
}
template <typename... Args>
bool records_autograd(const Args&... args) {
  return (has_tangent(args) || ...) || (at::GradMode::is_enabled() && (wants_grad(args) || ...));
}

// A gradient the backward op computed if it was asked for, else undefined (the backward ops
// return an empty tensor for an input whose output_mask entry is false).
inline at::Tensor wanted(at::Tensor grad, bool want) { return want ? std::move(grad) : at::Tensor(); }

// ctx->needs_input_grad(i) counts the tensor inputs autograd sees: a std::nullopt optional
// tensor is not one, so the inputs after it move down by one.
inline bool needs_grad(AutogradContext* ctx, int64_t index) {
  return index >= 0 && ctx->needs_input_grad(static_cast<size_t>(index));
}

// The gradient of a backward op (a second-order gradient of its forward op): not implemented, so
// it raises, saying what to use, instead of letting autograd treat its outputs as constants.
[[noreturn]] inline void no_second_order(const char* backward_op) {
  std::string forward(backward_op);
  forward.resize(forward.size() - std::string("_backward").size());
  TORCH_CHECK(false, "ppo_fast::", backward_op, " has no gradient: second-order gradients (create_graph=True) through ",
              forward, " are not supported on the native backend; use pf.use_backend('reference') for them");
}

// The Autograd kernel (::kernel) of a backward op of C++ signature Signature without a gradient of its own.  Under
// create_graph=True its outputs get a node that raises when reached; otherwise (grad mode off, as in every plain
// backward) no node is made and the call costs one redispatch.
template <const char* Name, typename Signature>
struct NoSecondOrder;

template <const char* Name, typename Return, typename... Args>
struct NoSecondOrder<Name, Return(Args...)> : torch::autograd::Function<NoSecondOrder<Name, Return(Args...)>> {
  static variable_list forward(AutogradContext*, Args... args) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<Return(Args...)>(Name);
    return to_list(op.call(args...));
  }
  static variable_list backward(AutogradContext*, variable_list) { no_second_order(Name + 10); }  // past "ppo_fast::"

  static Return kernel(Args... args) {
    if (!at::GradMode::is_enabled()) {  // a plain backward: skip the Function's bookkeeping
      at::AutoDispatchBelowADInplaceOrView guard;
      static const auto op = typed_op<Return(Args...)>(Name);
      return op.call(args...);
    }
    variable_list outputs = NoSecondOrder::apply(args...);
    if constexpr (std::is_same_v<Return, at::Tensor>) {
      return std::move(outputs[0]);
    } else {
      return from_list(std::move(outputs), std::make_index_sequence<std::tuple_size_v<Return>>());
    }
  }

 private:
  static variable_list to_list(at::Tensor output) { return {std::move(output)}; }
  template <typename... T>
  static variable_list to_list(std::tuple<T...> outputs) {
    return std::apply([](auto&&... t) { return variable_list{std::move(t)...}; }, std::move(outputs));
  }
  template <size_t... I>
  static Return from_list(variable_list outputs, std::index_sequence<I...>) {
    return Return(std::move(outputs[I])...);
  }
};

}  // namespace ppo_fast
