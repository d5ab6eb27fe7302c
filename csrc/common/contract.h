// The contract's names (ppo_fast/contract.py) on the C++ side: the aggregation modes as an
// enum (the KL estimators: kl_estimators.h), and (outside nvcc) their parsers from the strings the op
// schemas take, so that no integer order couples the C++ ops to Python tuples.
// The enums need no torch headers (the CUDA kernels include them through loss_math.h).
#pragma once

#include <cstdint>

namespace ppo_fast {

// ppo_fast.contract.AGG_MODES: how a [B, T] per-token loss is reduced over the mask.
enum Agg : int64_t {
  kTokenMean = 0,
  kTokenSum = 1,
  kSeqMeanTokenSum = 2,
  kSeqMeanTokenMean = 3,
  kSeqMeanTokenSumNorm = 4,
};

}  // namespace ppo_fast

#if !defined(__CUDACC__)
#include <c10/util/Exception.h>

#include <string_view>

namespace ppo_fast {

// `op` names the calling op in the error.
inline Agg parse_agg(const char* op, std::string_view agg) {
  if (agg == "token-mean") return kTokenMean;
  if (agg == "token-sum") return kTokenSum;
  if (agg == "seq-mean-token-sum") return kSeqMeanTokenSum;
  if (agg == "seq-mean-token-mean") return kSeqMeanTokenMean;
  if (agg == "seq-mean-token-sum-norm") return kSeqMeanTokenSumNorm;
  TORCH_CHECK(false, op,
              ": agg must be one of 'token-mean', 'token-sum', 'seq-mean-token-sum', 'seq-mean-token-mean', "
              "'seq-mean-token-sum-norm', got '",
              agg, "'");
}

}  // namespace ppo_fast
#endif
