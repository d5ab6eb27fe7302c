// What the ops' autograd kernels (csrc/autograd/<op>.cpp, registered at the Autograd key) share.
// The autograd of every native op lives in C++: a Python autograd kernel
// (torch.library.register_autograd) costs about 90 us of host time per forward + backward on
// top of the kernels, more than the kernels themselves on a training step's loss.  The fake
// kernels stay in Python (ppo_fast/backends/native/<op>.py): torch.compile traces these
// kernels with fake tensors, as it traces any C++ autograd kernel.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>

#include <array>
#include <cstring>
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
template <typename Context>
bool needs_grad(Context* ctx, int64_t index) {
  return index >= 0 && ctx->needs_input_grad(static_cast<size_t>(index));
}

// ------------------------------------------------------------------------------------------ LeanFunction
// torch::autograd::Function's API (T::forward(ctx, args...), T::backward(ctx, grads), T::apply) on a
// leaner node, as torch's generated nodes are: no per-call hash map of named values (saved_data
// is a few named slots), no VariableInfo copies of every input and output, no sets of
// non-differentiable or dirty outputs (pf.clipped_policy_loss forward + backward, 4x64 CPU, one thread: 43.9 -> 36.6 us
// of CPU time).  It serves first-order Functions whose outputs
// are new tensors (neither inputs nor views: checked); a forward-mode tangent raises, as
// Function's does.  Not supported: compiled autograd (the node has no compiled_args), as for any
// extension node without one.
// The pointer that owns an autograd node: std::shared_ptr before torch 2.13, c10::intrusive_ptr after.
using NodePtr = decltype(torch::autograd::Edge::function);
template <typename N, typename Ptr = NodePtr>
Ptr make_node() {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<N>();
  } else {
    return c10::make_intrusive<N>();
  }
}
// An owning pointer to a node that is alive (owned elsewhere).
template <typename N, typename Ptr = NodePtr>
Ptr owning(N* node) {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>) {
    return node->shared_from_this();
  } else {
    return Ptr::unsafe_reclaim_from_nonowning(node);
  }
}

class LeanContext {
 public:
  // A few named values, in the order they were set (a linear search over at most kSlots names).
  class Data {
   public:
    c10::IValue& operator[](const char* key) {
      for (size_t i = 0; i < size_; ++i)
        if (std::strcmp(keys_[i], key) == 0) return values_[i];
      TORCH_INTERNAL_ASSERT(size_ < kSlots, "LeanContext: more than ", kSlots, " saved values");
      keys_[size_] = key;
      return values_[size_++];
    }
    const c10::IValue& at(const char* key) const {
      for (size_t i = 0; i < size_; ++i)
        if (std::strcmp(keys_[i], key) == 0) return values_[i];
      TORCH_INTERNAL_ASSERT(false, "LeanContext: no saved value ", key);
    }

   private:
    static constexpr size_t kSlots = 6;
    std::array<const char*, kSlots> keys_{};
    std::array<c10::IValue, kSlots> values_;
    size_t size_ = 0;
  };

  Data saved_data;

  void save_for_backward(variable_list to_save) { to_save_ = std::move(to_save); }
  void mark_non_differentiable(const variable_list& outputs) {
    for (const auto& t : outputs) non_differentiable_.push_back(t.unsafeGetTensorImpl());
  }
  void set_materialize_grads(bool value) { materialize_grads_ = value; }
  bool needs_input_grad(size_t index) const { return node_->task_should_compute_output(index); }
  variable_list get_saved_variables() const {
    TORCH_CHECK(!freed_,
                "Trying to backward through the graph a second time (or directly access saved tensors after "
                "they have already been freed). Specify retain_graph=True if you need to backward through "
                "the graph a second time.");
    variable_list out;
    out.reserve(saved_.size());
    auto self = owning(node_);
    for (const auto& s : saved_) out.push_back(s.unpack(self));
    return out;
  }

 private:
  template <typename T>
  friend struct LeanFunction;
  template <typename T>
  friend struct LeanNode;
  bool non_differentiable(const at::Tensor& t) const {
    return std::find(non_differentiable_.begin(), non_differentiable_.end(), t.unsafeGetTensorImpl()) !=
           non_differentiable_.end();
  }

  torch::autograd::Node* node_ = nullptr;
  variable_list to_save_;
  std::vector<torch::autograd::SavedVariable> saved_;
  std::vector<const c10::TensorImpl*> non_differentiable_;
  bool materialize_grads_ = true;
  bool freed_ = false;
};

template <typename T>
struct LeanNode final : torch::autograd::Node {
  LeanContext ctx;
  uint64_t variable_inputs = 0;  // bit i: forward argument i is a tensor input (an edge)

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);  // as generated nodes with saved tensors: against release_variables
    if (ctx.materialize_grads_) {
      for (const auto i : c10::irange(grads.size()))
        if (!grads[i].defined() && !input_metadata(i).was_default_constructed())
          grads[i] = input_metadata(i).zeros_like();
    }
    variable_list outputs = T::backward(&ctx, std::move(grads));
    variable_list results;
    results.reserve(num_outputs());
    for (const auto i : c10::irange(outputs.size())) {
      if (variable_inputs >> i & 1) {
        results.push_back(std::move(outputs[i]));
      } else {
        TORCH_CHECK(!outputs[i].defined(), name(), " returned a gradient for argument ", i, ", not a tensor input");
      }
    }
    TORCH_CHECK(results.size() == num_outputs(), name(), " returned ", results.size(), " gradients for ", num_outputs(),
                " tensor inputs");
    return results;
  }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    ctx.saved_.clear();
    ctx.freed_ = true;
  }
};

template <typename T>
struct LeanFunction {
  template <typename... Args>
  static auto apply(Args&&... args) {
    static_assert(sizeof...(Args) <= 64);
    if (const auto& functorch_tls = at::functorch::functorchTLSAccessor()) {
      functorch_tls->checkSupportsCppAutogradFunction();
    }
    const NodePtr owner = make_node<LeanNode<T>>();
    auto* node = static_cast<LeanNode<T>*>(owner.get());
    variable_list inputs;
    inputs.reserve(sizeof...(Args));
    size_t position = 0;
    (add_input(node->variable_inputs, inputs, position++, args), ...);
    for (const auto& t : inputs)
      TORCH_CHECK(!has_tangent(t), c10::demangle(typeid(T).name()),
                  ": forward-mode AD (a tangent) is not supported on the native backend");
    const bool executable = at::GradMode::is_enabled() && std::any_of(inputs.begin(), inputs.end(), [](const auto& t) {
                              return t.defined() && t.requires_grad();
                            });
    node->ctx.node_ = node;
    if (executable) {
      torch::autograd::edge_list edges;
      edges.reserve(inputs.size());
      for (const auto& t : inputs)
        edges.push_back(t.defined() ? torch::autograd::impl::gradient_edge(t) : torch::autograd::Edge());
      node->set_next_edges(std::move(edges));
    }
    decltype(T::forward(&node->ctx, std::forward<Args>(args)...)) outputs;
    {
      at::AutoGradMode no_grad(false);
      outputs = T::forward(&node->ctx, std::forward<Args>(args)...);
    }
    if (!executable) return outputs;
    if constexpr (std::is_same_v<decltype(outputs), at::Tensor>) {
      wrap(*node, inputs, outputs);
    } else {
      for (auto& output : outputs) wrap(*node, inputs, output);
    }
    LeanContext& ctx = node->ctx;
    ctx.saved_.reserve(ctx.to_save_.size());
    for (const auto& t : ctx.to_save_) {
      const bool is_output = t.defined() && t.grad_fn().get() == node;
      ctx.saved_.emplace_back(t, is_output);
    }
    ctx.to_save_.clear();
    return outputs;
  }

 private:
  static void add_input(uint64_t& mask, variable_list& inputs, size_t position, const at::Tensor& t) {
    mask |= uint64_t{1} << position;
    inputs.push_back(t);
  }
  static void add_input(uint64_t& mask, variable_list& inputs, size_t position, const std::optional<at::Tensor>& t) {
    if (t.has_value()) add_input(mask, inputs, position, *t);
  }
  template <typename A>
  static void add_input(uint64_t&, variable_list&, size_t, const A&) {}

  // An output's history: the node's, or none (a non-differentiable or undefined output keeps its slot).
  static void wrap(LeanNode<T>& node, const variable_list& inputs, const at::Tensor& output) {
    if (!output.defined() || node.ctx.non_differentiable(output)) {
      node.add_input_metadata(torch::autograd::Node::undefined_input());
      return;
    }
    TORCH_INTERNAL_ASSERT(!output.is_view(), c10::demangle(typeid(T).name()), ": an output is a view");
    for (const auto& input : inputs)
      TORCH_INTERNAL_ASSERT(!input.is_same(output), c10::demangle(typeid(T).name()), ": an output is an input");
    torch::autograd::set_history(output, owning(&node));
  }
};

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
