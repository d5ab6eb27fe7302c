// bool_mask: its schema and CPU kernel: a 0/1 mask of any float or integer dtype as a bool tensor, and
// the check that it holds only 0 and 1, in one pass.  The public ops' host check of a
// float mask (ppo_fast._validation.mask) calls it on CPU tensors in eager mode: done with
// torch ops it takes three elementwise passes and a reduction, each of which wakes the
// thread pool (tens of milliseconds on a busy 2-core machine).  Masks up to kGrain
// elements are converted on the calling thread alone.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <string>

#include "common/checks.h"

namespace ppo_fast {

TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  // A 0/1 mask of a float or integer dtype as bool, in one pass; ValueError naming `name`
  // if it holds anything but 0 and 1 (the public ops' host check, CPU only).
  m.def("bool_mask(Tensor mask, str name) -> Tensor");
}

namespace {

constexpr int64_t kGrain = int64_t(1) << 18;

at::Tensor bool_mask_cpu(const at::Tensor& mask_in, c10::string_view name_in) {
  const std::string name(name_in);
  TORCH_CHECK(mask_in.scalar_type() != at::kBool, "bool_mask: ", name, " is already bool");
  TORCH_CHECK(!at::isComplexType(mask_in.scalar_type()), "bool_mask: ", name,
              " must be a float or integer tensor, got ", mask_in.scalar_type());
  const at::Tensor mask = mask_in.contiguous();
  at::Tensor out = at::empty(mask.sizes(), mask.options().dtype(at::kBool));
  std::atomic<bool> bad{false};
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, mask.scalar_type(), "bool_mask_cpu", [&] {
    const scalar_t* in = mask.const_data_ptr<scalar_t>();
    bool* o = out.mutable_data_ptr<bool>();
    at::parallel_for(0, mask.numel(), kGrain, [&](int64_t begin, int64_t end) {
      bool chunk_bad = false;
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t v = in[i];
        const bool zero = v == scalar_t(0), one = v == scalar_t(1);
        chunk_bad |= !(zero || one);  // NaN too
        o[i] = !zero;
      }
      if (chunk_bad) bad.store(true, std::memory_order_relaxed);
    });
  });
  TORCH_CHECK_VALUE(!bad.load(), name, " must hold only 0 and 1 (or be bool)");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) { m.impl("bool_mask", &bool_mask_cpu); }

}  // namespace ppo_fast
