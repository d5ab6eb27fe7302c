// The autograd of group_sum (csrc/group_advantages.cpp): a sum over each row's group, linear and
// symmetric, so its gradient is itself (and so differentiable to every order).
#include <torch/library.h>

#include "common/autograd.h"

namespace ppo_fast {
namespace {

using Tensor = at::Tensor;
using GroupSum = Tensor(const Tensor&, const Tensor&);

c10::TypedOperatorHandle<GroupSum> group_sum_op() {
  static const auto op = typed_op<GroupSum>("ppo_fast::group_sum");
  return op;
}

struct GroupSumFunction : torch::autograd::Function<GroupSumFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& values, const Tensor& group_index) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({group_index});
    return group_sum_op().call(values, group_index);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // Through the Autograd key again: a second-order gradient differentiates this call.
    return {group_sum_op().call(grads[0].contiguous(), ctx->get_saved_variables()[0]), Tensor()};
  }

  static Tensor kernel(const Tensor& values, const Tensor& group_index) { return apply(values, group_index); }
};

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, Autograd, m) { m.impl("group_sum", &GroupSumFunction::kernel); }

}  // namespace ppo_fast
