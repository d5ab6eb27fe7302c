// The ppo_fast operator library: schemas (implementations are registered per device in
// csrc/cpu/*.cpp and csrc/cuda/*.cpp; fake kernels and autograd in
// ppo_fast/ops/native_backend.py) and the Python module ppo_fast._C that loads them.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(ppo_fast, m) {
  // Every op checks its arguments (ranks, shapes, dtypes, devices; csrc/checks.h) and
  // raises RuntimeError on a mismatch.  `agg` is a name in ppo_fast.contract.AGG_MODES
  // and `estimator` one in KL_ESTIMATORS (parsed in csrc/contract.h).  A backward op
  // returns the gradient of each input whose `output_mask` entry is true (in that
  // input's dtype) and an empty tensor for the others.

  // Losses.  `row_scale` [B] is d loss / d row sum, kept for the backward.
  m.def(
      "clipped_policy_loss(Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, Tensor? weights, "
      "float clip_low, float clip_high, float? dual_clip, str agg) "
      "-> (Tensor loss, Tensor clipfrac, Tensor clipfrac_lower, Tensor approx_kl, Tensor row_scale)");
  m.def(
      "clipped_policy_loss_backward(Tensor grad_loss, Tensor logprobs, Tensor old_logprobs, Tensor advantages, "
      "Tensor mask, Tensor? weights, Tensor row_scale, float clip_low, float clip_high, float? dual_clip, "
      "bool[4] output_mask) "
      "-> (Tensor grad_logprobs, Tensor grad_old_logprobs, Tensor grad_advantages, Tensor grad_weights)");
  // The sequence-level policy-loss modes (ppo_fast.policy_loss_modes: a per-row reduction
  // before the ratio), with clipped_policy_loss's inputs and stats.  `row_state` [B, 2] keeps
  // per-row values for the backward (csrc/seq_loss_math.h); GSPO gives old_logprobs no gradient.
  m.def(
      "policy_loss_gspo(Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, Tensor? weights, "
      "float clip_eps_low, float clip_eps_high, str agg) "
      "-> (Tensor loss, Tensor clipfrac, Tensor clipfrac_lower, Tensor approx_kl, Tensor row_scale, Tensor row_state)");
  m.def(
      "policy_loss_gspo_backward(Tensor grad_loss, Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, "
      "Tensor? weights, Tensor row_scale, Tensor row_state, float clip_eps_low, float clip_eps_high, bool[4] output_mask) "
      "-> (Tensor grad_logprobs, Tensor grad_old_logprobs, Tensor grad_advantages, Tensor grad_weights)");
  m.def(
      "policy_loss_geo_mean(Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, Tensor? weights, "
      "float clip_eps_low, float clip_eps_high, str agg) "
      "-> (Tensor loss, Tensor clipfrac, Tensor clipfrac_lower, Tensor approx_kl, Tensor row_scale, Tensor row_state)");
  m.def(
      "policy_loss_geo_mean_backward(Tensor grad_loss, Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, "
      "Tensor? weights, Tensor row_scale, Tensor row_state, float clip_eps_low, float clip_eps_high, bool[4] output_mask) "
      "-> (Tensor grad_logprobs, Tensor grad_old_logprobs, Tensor grad_advantages, Tensor grad_weights)");
  m.def(
      "value_loss(Tensor values, Tensor old_values, Tensor returns, Tensor mask, float clip, str agg) "
      "-> (Tensor loss, Tensor clipfrac, Tensor row_scale)");
  m.def(
      "value_loss_backward(Tensor grad_loss, Tensor values, Tensor old_values, Tensor returns, Tensor mask, "
      "Tensor row_scale, float clip, bool[3] output_mask) "
      "-> (Tensor grad_values, Tensor grad_old_values, Tensor grad_returns)");
  // Rewards and advantages.  The backwards of kl_penalized_rewards and gae take the
  // upstream gradients as optional (an unused output has none) and the inputs' dtypes.
  m.def("kl_estimate(Tensor logprobs, Tensor ref_logprobs, str estimator) -> Tensor");
  m.def(
      "kl_estimate_backward(Tensor grad_kl, Tensor logprobs, Tensor ref_logprobs, str estimator, bool[2] output_mask) "
      "-> (Tensor grad_logprobs, Tensor grad_ref_logprobs)");
  m.def(
      "kl_penalized_rewards(Tensor scores, Tensor logprobs, Tensor ref_logprobs, Tensor mask, float kl_coef, "
      "str estimator) -> (Tensor rewards, Tensor kl)");
  m.def(
      "kl_penalized_rewards_backward(Tensor? grad_rewards, Tensor? grad_kl, Tensor logprobs, Tensor ref_logprobs, "
      "Tensor mask, float kl_coef, str estimator, ScalarType scores_dtype, bool[3] output_mask) "
      "-> (Tensor grad_scores, Tensor grad_logprobs, Tensor grad_ref_logprobs)");
  m.def("gae(Tensor rewards, Tensor values, Tensor mask, float gamma, float lam) -> (Tensor advantages, Tensor returns)");
  // A 0/1 mask of a float or integer dtype as bool, in one pass; ValueError naming `name`
  // if it holds anything but 0 and 1 (the public ops' host check, CPU only).
  m.def("bool_mask(Tensor mask, str name) -> Tensor");
  // Group advantages' reduction: values [B, C] float32/float64, group_index [B] int64 in
  // [0, B); row i of the result is the sum of the rows of i's group.  Its own backward.
  m.def("group_sum(Tensor values, Tensor group_index) -> Tensor");
  m.def(
      "gae_backward(Tensor? grad_advantages, Tensor? grad_returns, Tensor mask, float gamma, float lam, "
      "ScalarType rewards_dtype, ScalarType values_dtype, bool[2] output_mask) -> (Tensor grad_rewards, Tensor grad_values)");
  // Log-probs.  `entropy` is empty unless return_entropy; `lse` is the per-row
  // logsumexp of logits / temperature, kept for the backward.  A label outside [0, V)
  // that is not ignore_index gives its row NaN log-prob and entropy and no gradient.
  m.def(
      "token_logprobs(Tensor logits, Tensor labels, float temperature, bool return_entropy, int ignore_index) "
      "-> (Tensor logprobs, Tensor entropy, Tensor lse)");
  m.def(
      "token_logprobs_backward(Tensor? grad_logprobs, Tensor? grad_entropy, Tensor logits, Tensor labels, "
      "Tensor lse, Tensor entropy, float temperature, int ignore_index) -> Tensor");
  // The fused LM head: log-probs of labels [N] under softcap(logit_scale * (hidden [N, H] @ weight.T [H, V]
  // + bias)) / temperature, without the [N, V] logits (float? logit_softcap: None for no cap).
  m.def(
      "linear_token_logprobs(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, float temperature, "
      "float logit_scale, float? logit_softcap, bool return_entropy, int ignore_index) "
      "-> (Tensor logprobs, Tensor entropy, Tensor lse)");
  m.def(
      "linear_token_logprobs_backward(Tensor? grad_logprobs, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
      "Tensor labels, Tensor? bias, Tensor lse, Tensor entropy, float temperature, float logit_scale, "
      "float? logit_softcap, int ignore_index, bool[3] output_mask) "
      "-> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)");
}

namespace {

PyObject* built_with_cuda(PyObject*, PyObject*) {
#ifdef PPO_FAST_WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyMethodDef methods[] = {
    {"built_with_cuda", built_with_cuda, METH_NOARGS, "Whether the CUDA kernels were compiled into this build."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "ppo_fast native kernels (registered as torch.ops.ppo_fast.*)", -1, methods};

}  // namespace

// Importing the module runs the static registrations above.
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }
