// The CUDA machinery of the token-level losses, shared by csrc/cuda/policy_loss.cu and
// csrc/cuda/value_loss.cu; each instantiates it with its Token (per-token math and
// stats), one instantiation per input dtype (no dtype switch per element).  The [B, T] tokens are cut into work items
// of one warp each: a chunk of one row (the chunk length is chosen per launch so that about kTargetItems items cover
// the batch: a short row is one item, a long one several).  A lane takes N consecutive tokens at a time (N = 8 for
// 16-bit types, 4 for float32, 2 for float64: one 16-byte load of each input, N bytes of mask) when the rows are a
// multiple of N long and the pointers are aligned, else the same N tokens by scalar loads (the same order: the same
// bits).  The mask is a select on the result: every in-bounds token is loaded, none waits on the mask, and a NaN at a
// masked token changes nothing. Forward, two kernels: each warp sums its chunk (per-lane sums, then a fixed shuffle
// tree) into partials[item]; then one warp per row sums the row's chunks (lane c the chunks c, c + 32, ..., then the
// same tree) into row_sums[row], and the last block to finish (a counter, as CUDA's threadFenceReduction) sums the
// rows, then the loss, each in a fixed order: no float atomics, so the same inputs give bitwise the same loss.
// Backward: the same items, elementwise, with the row's scale (saved by the forward) read once per warp.
// The packed layout (cu_seqlens): the rows are its segments, each cut into the same number of pieces
// (token_loss.h varlen_chunk_plan), their bounds and the longest length read on the device, scalar loads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "common/loss_math.h"
#include "cuda/token_loss.h"

namespace ppo_fast {
namespace cuda {
namespace token_loss {

constexpr int kWarpsPerBlock = 8;
constexpr int kBlockThreads = kWarp * kWarpsPerBlock;
// Blocks per SM the forward kernels promise ptxas (<= 85 registers).  Without a promise it
// held the float64 policy kernel to 64 registers and spilled in its loop; 3 x 8 warps keep
// enough loads in flight.
constexpr int kMinBlocksPerSm = 3;

// Input dtypes: the stored bits, the compute type, and the conversions.
struct F32 {
  using Bits = float;
  using T = float;
  static __device__ __forceinline__ T load(Bits b) { return b; }
  static __device__ __forceinline__ Bits store(T v) { return v; }
};
struct F64 {
  using Bits = double;
  using T = double;
  static __device__ __forceinline__ T load(Bits b) { return b; }
  static __device__ __forceinline__ Bits store(T v) { return v; }
};
struct F16 {
  using Bits = unsigned short;
  using T = float;
  static __device__ __forceinline__ T load(Bits b) { return __half2float(__ushort_as_half(b)); }
  static __device__ __forceinline__ Bits store(T v) { return __half_as_ushort(__float2half_rn(v)); }
};
struct BF16 {
  using Bits = unsigned short;
  using T = float;
  static __device__ __forceinline__ T load(Bits b) { return __uint_as_float(static_cast<unsigned>(b) << 16); }
  static __device__ __forceinline__ Bits store(T v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};

// Tokens per lane step: one 16-byte word of each input (8 16-bit values, 4 float32, 2
// float64: more float64 registers would spill in the policy kernels).
template <typename D>
constexpr int kTokens = 16 / sizeof(typename D::Bits);

template <int N>
union MaskWord;
template <>
union MaskWord<2> {
  unsigned short word;
  unsigned char v[2];
};
template <>
union MaskWord<4> {
  unsigned word;
  unsigned char v[4];
};
template <>
union MaskWord<8> {
  uint2 word;
  unsigned char v[8];
};

// Values to and from the 32-bit words of one 16-byte word as memory holds them
// (little-endian), in registers: no union through local memory.  Stores go out as one
// st.global.v4 (a plain uint4 store through a pointer is split into four 32-bit STGs).
template <int N>
__device__ __forceinline__ void to_words(const unsigned short (&v)[N], unsigned (&u)[N / 2]) {
#pragma unroll
  for (int m = 0; m < N / 2; ++m) u[m] = static_cast<unsigned>(v[2 * m]) | (static_cast<unsigned>(v[2 * m + 1]) << 16);
}
template <int N>
__device__ __forceinline__ void to_words(const float (&v)[N], unsigned (&u)[N]) {
#pragma unroll
  for (int m = 0; m < N; ++m) u[m] = __float_as_uint(v[m]);
}
template <int N>
__device__ __forceinline__ void to_words(const double (&v)[N], unsigned (&u)[2 * N]) {
#pragma unroll
  for (int m = 0; m < N; ++m) {
    u[2 * m] = static_cast<unsigned>(__double2loint(v[m]));
    u[2 * m + 1] = static_cast<unsigned>(__double2hiint(v[m]));
  }
}

__device__ __forceinline__ void from_words(const unsigned (&u)[4], unsigned short (&v)[8]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    v[2 * m] = static_cast<unsigned short>(u[m] & 0xffffu);
    v[2 * m + 1] = static_cast<unsigned short>(u[m] >> 16);
  }
}
__device__ __forceinline__ void from_words(const unsigned (&u)[4], float (&v)[4]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) v[m] = __uint_as_float(u[m]);
}
__device__ __forceinline__ void from_words(const unsigned (&u)[4], double (&v)[2]) {
#pragma unroll
  for (int m = 0; m < 2; ++m) v[m] = __hiloint2double(static_cast<int>(u[2 * m + 1]), static_cast<int>(u[2 * m]));
}

// x[j] = p[i + j] for the tokens j < in_bounds; absent (p == nullptr) inputs read as 1.
// kAligned: the N tokens are all in bounds and 16-byte aligned (one vector load).
template <typename D, int N, bool kAligned>
__device__ __forceinline__ void load_tokens(const typename D::Bits* p, int64_t i, int64_t in_bounds,
                                            typename D::T (&x)[N]) {
  using T = typename D::T;
  if (p == nullptr) {
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = T(1);
  } else if (kAligned) {
    const uint4 word = *reinterpret_cast<const uint4*>(p + i);
    const unsigned u[4] = {word.x, word.y, word.z, word.w};
    typename D::Bits bits[N];
    from_words(u, bits);
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = D::load(bits[j]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = j < in_bounds ? D::load(p[i + j]) : T(0);
  }
}

// valid[j]: token j is in bounds and not masked.
template <int N, bool kAligned>
__device__ __forceinline__ void load_mask(const bool* mask, int64_t i, int64_t in_bounds, bool (&valid)[N]) {
  if (kAligned) {
    MaskWord<N> m;
    m.word = *reinterpret_cast<const decltype(m.word)*>(mask + i);
#pragma unroll
    for (int j = 0; j < N; ++j) valid[j] = m.v[j] != 0;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) valid[j] = j < in_bounds && mask[i + j];
  }
}

template <typename D, int N, bool kAligned>
__device__ __forceinline__ void store_tokens(typename D::Bits* p, int64_t i, int64_t in_bounds,
                                             const typename D::T (&g)[N]) {
  using Bits = typename D::Bits;
  if (kAligned) {
    Bits bits[N];
#pragma unroll
    for (int j = 0; j < N; ++j) bits[j] = D::store(g[j]);
    unsigned u[4];
    to_words(bits, u);
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p + i), "r"(u[0]), "r"(u[1]), "r"(u[2]), "r"(u[3]));
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < in_bounds) p[i + j] = D::store(g[j]);
  }
}

// The tokens [begin, end) of one row that warp `item` owns (row-relative), and where the row starts.
struct ItemSpan {
  int64_t item, row, row_start, begin, end;
};

// Row `row` of the packed layout: its first token and its length, clamped to the `tokens` (a
// malformed cu_seqlens, which the public layer refuses, reads nothing outside the inputs).
__device__ __forceinline__ void segment(const int64_t* cu, int64_t row, int64_t tokens, int64_t* start, int64_t* size) {
  const int64_t first = min(max(cu[row], int64_t(0)), tokens);
  *start = first;
  *size = min(max(cu[row + 1], first), tokens) - first;
}

// items < 2^31 (the glue checks): 32-bit division, once per warp.  `length` is the rows' length,
// or in the packed layout (plan.cu) the number of tokens.
__device__ __forceinline__ bool item_span(const ChunkPlan& plan, int64_t length, ItemSpan* span) {
  const unsigned item = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  if (item >= plan.items) return false;
  const unsigned chunks_per_row = static_cast<unsigned>(plan.chunks_per_row);
  const unsigned row = item / chunks_per_row;
  const int64_t piece = item - row * chunks_per_row;
  span->item = item;
  span->row = row;
  if (plan.cu != nullptr) {  // pieces of whole warp steps (plan.chunk), as equal as they can be
    int64_t size = 0;
    segment(plan.cu, row, length, &span->row_start, &size);
    const int64_t per_piece = (size + plan.chunks_per_row - 1) / plan.chunks_per_row;
    const int64_t chunk = (per_piece + plan.chunk - 1) / plan.chunk * plan.chunk;
    span->begin = min(piece * chunk, size);
    span->end = min(span->begin + chunk, size);
    return true;
  }
  span->row_start = span->row * length;
  span->begin = piece * plan.chunk;
  span->end = min(span->begin + plan.chunk, length);
  return true;
}

// The longest row of the packed layout, over the block's kThreads threads (every thread gets it).
template <int kThreads>
__device__ __noinline__ double longest_segment(const int64_t* cu, int64_t rows, int64_t tokens) {
  __shared__ double shared[kThreads];
  double longest = 0.0;
  for (int64_t b = threadIdx.x; b < rows; b += kThreads) {
    int64_t start = 0, size = 0;
    segment(cu, b, tokens, &start, &size);
    longest = fmax(longest, static_cast<double>(size));
  }
  shared[threadIdx.x] = longest;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) shared[threadIdx.x] = fmax(shared[threadIdx.x], shared[threadIdx.x + half]);
    __syncthreads();
  }
  longest = shared[0];
  __syncthreads();
  return longest;
}

// x[k][j] = input k of token row_start + t + j; valid[j] as load_mask.
template <typename D, int N, bool kAligned, typename Token>
__device__ __forceinline__ void load_step(const Token& token, const bool* mask, int64_t i, int64_t in_bounds,
                                          typename D::T (&x)[Token::kInputs][N], bool (&valid)[N]) {
#pragma unroll
  for (int k = 0; k < Token::kInputs; ++k) load_tokens<D, N, kAligned>(token.in[k], i, in_bounds, x[k]);
  load_mask<N, kAligned>(mask, i, in_bounds, valid);
}

// partials[item, :] = sums over the valid tokens of the item's chunk.
// Also zeroes the finalize's block counter (the next kernel on the stream reads it).
template <typename D, bool kAligned, typename Token>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocksPerSm)
    partials_kernel(Token token, const bool* mask, ChunkPlan plan, int64_t length, double* partials,
                    unsigned* counter) {
  using T = typename D::T;
  constexpr int N = kTokens<D>;
  if (blockIdx.x == 0 && threadIdx.x == 0) *counter = 0u;
  ItemSpan span;
  if (!item_span(plan, length, &span)) return;  // the whole warp: no block-wide sync below
  const typename Token::Math math = token.math();
  const int lane = threadIdx.x % kWarp;
  T acc[Token::kParts] = {};
  for (int64_t t = span.begin + lane * N; t < span.end; t += kWarp * N) {
    T x[Token::kInputs][N];
    bool valid[N];
    load_step<D, N, kAligned>(token, mask, span.row_start + t, span.end - t, x, valid);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      T token_x[Token::kInputs];
#pragma unroll
      for (int k = 0; k < Token::kInputs; ++k) token_x[k] = x[k][j];
      math.accumulate(token_x, valid[j], acc);
    }
  }
  double sums[Token::kParts];
#pragma unroll
  for (int k = 0; k < Token::kParts; ++k) sums[k] = acc[k];
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2)  // a fixed tree: deterministic
#pragma unroll
    for (int k = 0; k < Token::kParts; ++k) sums[k] += __shfl_down_sync(0xffffffffu, sums[k], offset);
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < Token::kParts; ++k) partials[span.item * Token::kParts + k] = sums[k];
  }
}

// Sums values[k] over the block's threads; every thread gets the totals.  Fixed order.
template <int kParts, int kThreads>
__device__ void block_sum(double (&values)[kParts]) {
  __shared__ double shared[kParts][kThreads];
  for (int k = 0; k < kParts; ++k) shared[k][threadIdx.x] = values[k];
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half)
      for (int k = 0; k < kParts; ++k) shared[k][threadIdx.x] += shared[k][threadIdx.x + half];
    __syncthreads();
  }
  for (int k = 0; k < kParts; ++k) values[k] = shared[k][0];
  __syncthreads();  // shared may be reused by the next call
}

struct FinalizeArgs {
  int64_t rows, length, agg;  // length: the rows', or in the packed layout the tokens'
  ChunkPlan plan;
  LossOutputs out;
  double* row_sums;   // [rows, kParts]
  unsigned* counter;  // zeroed by the partials kernel
};

// The row sums of rows b, b + kBlockThreads, ... (this thread's) as written by the other blocks: read
// through L2 (__ldcg), where their fenced writes are.
template <int kParts>
__device__ __forceinline__ void load_row(const double* row_sums, int64_t b, double (&row)[kParts]) {
  for (int k = 0; k < kParts; ++k) row[k] = __ldcg(row_sums + b * kParts + k);
}

// One warp per row: row_sums[b] = its chunks' partials summed in a fixed order.  The last block to
// finish then sums the rows (totals), and the loss = sum_b row_scale_b * row_sum_b.
template <typename T, typename Token>
__global__ void __launch_bounds__(kBlockThreads) finalize_kernel(const double* partials, FinalizeArgs args) {
  constexpr int kParts = Token::kParts;
  const int lane = threadIdx.x % kWarp;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (b < args.rows) {
    double row[kParts] = {};
    const double* p = partials + b * args.plan.chunks_per_row * kParts;
    for (int64_t c = lane; c < args.plan.chunks_per_row; c += kWarp)
      for (int k = 0; k < kParts; ++k) row[k] += p[c * kParts + k];
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2)  // a fixed tree: deterministic
      for (int k = 0; k < kParts; ++k) row[k] += __shfl_down_sync(0xffffffffu, row[k], offset);
    if (lane == 0) {
      for (int k = 0; k < kParts; ++k) args.row_sums[b * kParts + k] = row[k];
      __threadfence();  // visible to the last block before this block counts itself done
    }
  }
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(args.counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  double totals[kParts] = {};
  double nonempty[1] = {0.0};
  for (int64_t r = threadIdx.x; r < args.rows; r += kBlockThreads) {
    double row[kParts];
    load_row(args.row_sums, r, row);
    for (int k = 0; k < kParts; ++k) totals[k] += row[k];
    nonempty[0] += row[Token::kCountColumn] > 0.0 ? 1.0 : 0.0;
  }
  block_sum<kParts, kBlockThreads>(totals);
  block_sum<1, kBlockThreads>(nonempty);
  // seq-mean-token-sum-norm's T: the padded length, or the longest segment (found here: no host read)
  const int64_t length =
      args.plan.cu == nullptr
          ? args.length
          : static_cast<int64_t>(longest_segment<kBlockThreads>(args.plan.cu, args.rows, args.length));
  T* row_scale_out = static_cast<T*>(args.out.row_scale);
  double loss[1] = {0.0};
  for (int64_t r = threadIdx.x; r < args.rows; r += kBlockThreads) {
    double row[kParts];
    load_row(args.row_sums, r, row);  // rows x kParts doubles: the chunk partials are read once, above
    const double scale =
        row_scale(args.agg, row[Token::kCountColumn], totals[Token::kCountColumn], nonempty[0], length);
    row_scale_out[r] = static_cast<T>(scale);
    loss[0] += scale * row[Token::kSumColumn];
  }
  block_sum<1, kBlockThreads>(loss);
  if (threadIdx.x == 0) {
    *static_cast<T*>(args.out.loss) = static_cast<T>(loss[0]);
    Token::store_stats(totals, args.out);
  }
}

// Every requested gradient of every token of the item; 0 at masked tokens.
template <typename D, bool kAligned, typename Token>
__global__ void __launch_bounds__(kBlockThreads)
    backward_kernel(Token token, const bool* mask, ChunkPlan plan, int64_t length, const typename D::T* grad_loss,
                    const typename D::T* row_scale, GradOutputs out) {
  using T = typename D::T;
  using Bits = typename D::Bits;
  constexpr int N = kTokens<D>;
  ItemSpan span;
  if (!item_span(plan, length, &span)) return;
  const typename Token::Math math = token.math();
  const T upstream = *grad_loss * row_scale[span.row];
  for (int64_t t = span.begin + (threadIdx.x % kWarp) * N; t < span.end; t += kWarp * N) {
    const int64_t i = span.row_start + t;
    T x[Token::kInputs][N];
    bool valid[N];
    load_step<D, N, kAligned>(token, mask, i, span.end - t, x, valid);
    T g[Token::kGrads][N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      T token_x[Token::kInputs], token_g[Token::kGrads];
#pragma unroll
      for (int k = 0; k < Token::kInputs; ++k) token_x[k] = x[k][j];
      math.grads(token_x, upstream, token_g);
#pragma unroll
      for (int k = 0; k < Token::kGrads; ++k) g[k][j] = valid[j] ? token_g[k] : T(0);
    }
#pragma unroll
    for (int k = 0; k < Token::kGrads; ++k)
      if (out.data[k]) store_tokens<D, N, kAligned>(static_cast<Bits*>(out.data[k]), i, span.end - t, g[k]);
  }
}

inline bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether the vector path may run: rows a multiple of N tokens, every pointer aligned.
template <typename D, typename Token>
bool vector_path(const Token& token, const bool* mask, int64_t length, const GradOutputs* grads) {
  constexpr int N = kTokens<D>;
  bool ok = length % N == 0 && reinterpret_cast<uintptr_t>(mask) % N == 0;
  for (int k = 0; k < Token::kInputs; ++k) ok = ok && aligned16(token.in[k]);
  if (grads)
    for (int k = 0; k < Token::kGrads; ++k) ok = ok && aligned16(grads->data[k]);
  return ok;
}

inline unsigned item_blocks(const ChunkPlan& plan) {
  return static_cast<unsigned>((plan.items + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// The forward over `plan`'s items; `vector` whether the vector path may run.
template <typename D, typename Token>
void forward_planned(const Token& token, const bool* mask, const ChunkPlan& plan, bool vector, int64_t rows,
                     int64_t length, int64_t agg, double* partials, const LossOutputs& out, cudaStream_t stream) {
  constexpr int kParts = Token::kParts;
  // The scratch as forward_scratch_doubles lays it out.
  double* row_sums = partials + plan.items * kParts;
  unsigned* counter = reinterpret_cast<unsigned*>(row_sums + rows * kParts);
  // At least one block, which zeroes the counter, even without tokens.
  const unsigned blocks = std::max(1u, item_blocks(plan));
  if (vector)
    partials_kernel<D, true><<<blocks, kBlockThreads, 0, stream>>>(token, mask, plan, length, partials, counter);
  else
    partials_kernel<D, false><<<blocks, kBlockThreads, 0, stream>>>(token, mask, plan, length, partials, counter);
  const unsigned row_blocks = static_cast<unsigned>(std::max<int64_t>(1, (rows + kWarpsPerBlock - 1) / kWarpsPerBlock));
  finalize_kernel<typename D::T, Token><<<row_blocks, kBlockThreads, 0, stream>>>(
      partials, FinalizeArgs{rows, length, agg, plan, out, row_sums, counter});
}

template <typename D, typename Token>
void forward(const Token& token, const bool* mask, int64_t rows, int64_t length, int64_t agg, double* partials,
             const LossOutputs& out, cudaStream_t stream) {
  const ChunkPlan plan = chunk_plan(rows, length, sizeof(typename D::Bits));
  forward_planned<D>(token, mask, plan, vector_path<D>(token, mask, length, nullptr), rows, length, agg, partials, out,
                     stream);
}

// The packed layout: rows `rows` segments of `tokens` tokens given by cu (int64, on the device).  Scalar
// loads: a segment starts anywhere.
template <typename D, typename Token>
void forward_varlen(const Token& token, const bool* mask, const int64_t* cu, int64_t rows, int64_t tokens, int64_t agg,
                    double* partials, const LossOutputs& out, cudaStream_t stream) {
  const ChunkPlan plan = varlen_chunk_plan(cu, rows, tokens, sizeof(typename D::Bits));
  forward_planned<D>(token, mask, plan, false, rows, tokens, agg, partials, out, stream);
}

template <typename D, typename Token>
void backward_planned(const Token& token, const bool* mask, const ChunkPlan& plan, bool vector, int64_t length,
                      const void* grad_loss, const void* row_scale, const GradOutputs& grads, cudaStream_t stream) {
  using T = typename D::T;
  if (plan.items == 0) return;
  const T* upstream = static_cast<const T*>(grad_loss);
  const T* scale = static_cast<const T*>(row_scale);
  if (vector)
    backward_kernel<D, true>
        <<<item_blocks(plan), kBlockThreads, 0, stream>>>(token, mask, plan, length, upstream, scale, grads);
  else
    backward_kernel<D, false>
        <<<item_blocks(plan), kBlockThreads, 0, stream>>>(token, mask, plan, length, upstream, scale, grads);
}

template <typename D, typename Token>
void backward(const Token& token, const bool* mask, int64_t rows, int64_t length, const void* grad_loss,
              const void* row_scale, const GradOutputs& grads, cudaStream_t stream) {
  const ChunkPlan plan = chunk_plan(rows, length, sizeof(typename D::Bits));
  backward_planned<D>(token, mask, plan, vector_path<D>(token, mask, length, &grads), length, grad_loss, row_scale,
                      grads, stream);
}

template <typename D, typename Token>
void backward_varlen(const Token& token, const bool* mask, const int64_t* cu, int64_t rows, int64_t tokens,
                     const void* grad_loss, const void* row_scale, const GradOutputs& grads, cudaStream_t stream) {
  const ChunkPlan plan = varlen_chunk_plan(cu, rows, tokens, sizeof(typename D::Bits));
  backward_planned<D>(token, mask, plan, false, tokens, grad_loss, row_scale, grads, stream);
}

// body(D{}) for the dtype tag of `dtype` (once per launch, on the host).
template <typename Body>
void with_dtype(int dtype, const Body& body) {
  switch (dtype) {
    case kFloat16:
      return body(F16{});
    case kBFloat16:
      return body(BF16{});
    case kFloat64:
      return body(F64{});
    default:
      return body(F32{});
  }
}

}  // namespace token_loss
}  // namespace cuda
}  // namespace ppo_fast
