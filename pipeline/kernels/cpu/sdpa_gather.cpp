// The CPU attention's tokens that attend alone (a decode: each over its own sequence's listed rows), as kernels
// of ExecuTorch's runtime: the "one" group of kvcache::sdpa_gather's contract (pipeline/kernels/reference.py,
// its module docstring) computed over the listed store slots where they lie, with no copy of a key or value.
// A program built with kv.cpu_kernel=native runs sdpa_gather as these ops for the tokens alone and the ATen
// form for the block (a prefill chunk: XNNPACK's matrix products run it faster; pipeline/kernels/native.py).
// native.py builds this file with g++ against the ExecuTorch wheel's headers and runtime and loads it beside
// the runtime, whose operator registry then holds both ops' out variants by name.
//
//   sdpa_gather_alone.out(q [T, Hq, D] f32, k_store [slots, Hkv, D] f32, v_store [slots, Hkv, Dv] f32,
//                         q_pos [T] i64, one [T1, 3, N1] i64, float scale, bool causal, int window,
//                         *, out [T1, Hq, Dv] f32)
//   sdpa_gather_alone_q8.out(q, k_store i8, k_scale [slots, Hkv] f32, v_store i8, v_scale, q_pos, one, scale,
//                            causal, window, *, out)
//
// A task is one entry of ``one`` (a token and its list) and one KV head: the G query heads of the KV head read
// each visible key row once. A key is visible when its position is >= 0, the query's too, and the causal and
// window bounds hold; a query that sees no key gets zeros. Scores, the softmax and the sums are float32. The
// rows a task reads lie a store row apart (the batched layout interleaves its columns), so each loop
// prefetches the row kAhead keys on: without it the same step took 1.7x as long (bench/kv_read_floor.py).
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/operator_registry.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::KernelRuntimeContext;
using executorch::runtime::Span;

constexpr int64_t kAhead = 8;
// a hidden key's score: finite (the library is built with -ffast-math, which assumes no infinities), so
// exp underflows to 0 beside any visible key; a query that sees none returns before the softmax
constexpr float kHidden = -1e30f;

inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(p) + at);
}

struct Problem {
  const float* q;
  const void* k;
  const float* k_scale;  // null: a float32 store
  const void* v;
  const float* v_scale;
  const int64_t* q_pos;
  int64_t heads, kv_heads, dim, v_dim;
  float scale;
  bool causal;
  int64_t window;
};

// One query token (row ``token`` of q) and KV head ``h`` over ``n_keys`` listed slots and positions; its
// G heads' outputs to ``out`` ([G, Dv] floats).
template <typename KV>
void attend_one(const Problem& p, int64_t token, int64_t h, const int64_t* slots, const int64_t* positions,
                int64_t n_keys, float* out, std::vector<float>& weights, std::vector<float>& row) {
  const int64_t group = p.heads / p.kv_heads, dim = p.dim, v_dim = p.v_dim;
  const KV* k = static_cast<const KV*>(p.k);
  const KV* v = static_cast<const KV*>(p.v);
  const float* q = p.q + (token * p.heads + h * group) * dim;
  const int64_t q_pos = p.q_pos[token];
  const auto visible = [&](int64_t pos) {
    return pos >= 0 && q_pos >= 0 && !(p.causal && pos > q_pos) && !(p.window > 0 && q_pos - pos >= p.window);
  };
  weights.assign(group * n_keys, kHidden);
  bool any = false;
  for (int64_t n = 0; n < n_keys; ++n) {
    if (n + kAhead < n_keys && positions[n + kAhead] >= 0) {
      const int64_t ahead = slots[n + kAhead] * p.kv_heads + h;
      prefetch_row(k + ahead * dim, dim * sizeof(KV));
      if (p.k_scale) __builtin_prefetch(p.k_scale + ahead);
    }
    if (!visible(positions[n])) continue;
    any = true;
    const int64_t at = slots[n] * p.kv_heads + h;
    const float* kr;
    if constexpr (std::is_same_v<KV, float>) {
      kr = k + at * dim;
    } else {  // the 8-bit row as floats once, for the G query heads
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(k[at * dim + d]);
      kr = row.data();
    }
    const float s = p.k_scale ? p.k_scale[at] * p.scale : p.scale;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qg[d] * kr[d];
      weights[g * n_keys + n] = dot * s;
    }
  }
  std::fill(out, out + group * v_dim, 0.f);
  if (!any) return;
  for (int64_t g = 0; g < group; ++g) {
    float* w = weights.data() + g * n_keys;
    const float top = *std::max_element(w, w + n_keys);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t n = 0; n < n_keys; ++n) {
      w[n] = std::exp(w[n] - top);  // a hidden key's kHidden gives exactly 0 next to a visible one
      total += w[n];
    }
    const float inv = 1.f / total;
    for (int64_t n = 0; n < n_keys; ++n) w[n] *= inv;
  }
  for (int64_t n = 0; n < n_keys; ++n) {
    if (n + kAhead < n_keys && positions[n + kAhead] >= 0) {
      const int64_t ahead = slots[n + kAhead] * p.kv_heads + h;
      prefetch_row(v + ahead * v_dim, v_dim * sizeof(KV));
      if (p.v_scale) __builtin_prefetch(p.v_scale + ahead);
    }
    if (!visible(positions[n])) continue;  // a hidden key's row is not read
    const int64_t at = slots[n] * p.kv_heads + h;
    const float* vr;
    if constexpr (std::is_same_v<KV, float>) {
      vr = v + at * v_dim;
    } else {
#pragma omp simd
      for (int64_t d = 0; d < v_dim; ++d) row[d] = static_cast<float>(v[at * v_dim + d]);
      vr = row.data();
    }
    const float vs = p.v_scale ? p.v_scale[at] : 1.f;
    for (int64_t g = 0; g < group; ++g) {
      const float wn = weights[g * n_keys + n] * vs;
      float* o = out + g * v_dim;
#pragma omp simd
      for (int64_t d = 0; d < v_dim; ++d) o[d] += wn * vr[d];
    }
  }
}

template <typename KV>
void run(const Problem& p, const Tensor& one, Tensor& out) {
  const int64_t n_one = one.size(0), n_keys = one.size(2), group = p.heads / p.kv_heads;
  const int64_t* entries = one.const_data_ptr<int64_t>();
  float* o = out.mutable_data_ptr<float>();
  executorch::extension::parallel_for(0, n_one * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights, row(std::max(p.dim, p.v_dim));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / p.kv_heads, h = task % p.kv_heads;
      const int64_t* entry = entries + r * 3 * n_keys;
      attend_one<KV>(p, entry[2 * n_keys], h, entry, entry + n_keys, n_keys,
                     o + (r * p.heads + h * group) * p.v_dim, weights, row);
    }
  });
}

bool shapes_hold(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& one,
                 Tensor& out, ScalarType store) {
  ET_KERNEL_CHECK_MSG(ctx, q.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float,
                      InvalidArgument, false, "sdpa_gather_alone (native): q and out must be float32");
  ET_KERNEL_CHECK_MSG(ctx, k.scalar_type() == store && v.scalar_type() == store, InvalidArgument, false,
                      "sdpa_gather_alone (native): the stores' dtype is not the op's");
  ET_KERNEL_CHECK_MSG(ctx, q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && one.dim() == 3 && one.size(1) == 3 &&
                               q.size(2) == k.size(2) && k.size(1) == v.size(1) && q.size(1) % k.size(1) == 0,
                      InvalidArgument, false, "sdpa_gather_alone (native): shapes outside the op's contract");
  // the step's sizes are dynamic: out is planned at its bound and takes this step's [T1, Hq, Dv]
  const executorch::aten::SizesType sizes[3] = {static_cast<executorch::aten::SizesType>(one.size(0)),
                                                static_cast<executorch::aten::SizesType>(q.size(1)),
                                                static_cast<executorch::aten::SizesType>(v.size(2))};
  ET_KERNEL_CHECK_MSG(ctx, executorch::runtime::resize_tensor(out, {sizes, 3}) == Error::Ok, InvalidArgument, false,
                      "sdpa_gather_alone (native): out cannot take [T1, Hq, Dv]");
  return true;
}

// sdpa_gather_alone.out: q k v q_pos one scale causal window out (ret)
void sdpa_gather_alone_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  const Tensor& q = stack[0]->toTensor();
  const Tensor& k = stack[1]->toTensor();
  const Tensor& v = stack[2]->toTensor();
  const Tensor& one = stack[4]->toTensor();
  Tensor& out = stack[8]->toTensor();
  if (!shapes_hold(ctx, q, k, v, one, out, ScalarType::Float)) return;
  const Problem p{q.const_data_ptr<float>(), k.const_data_ptr<float>(), nullptr, v.const_data_ptr<float>(), nullptr,
                  stack[3]->toTensor().const_data_ptr<int64_t>(), q.size(1), k.size(1), q.size(2), v.size(2),
                  static_cast<float>(stack[5]->toDouble()), stack[6]->toBool(), stack[7]->toInt()};
  run<float>(p, one, out);
}

// sdpa_gather_alone_q8.out: q k k_scale v v_scale q_pos one scale causal window out (ret)
void sdpa_gather_alone_q8_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  const Tensor& q = stack[0]->toTensor();
  const Tensor& k = stack[1]->toTensor();
  const Tensor& v = stack[3]->toTensor();
  const Tensor& one = stack[6]->toTensor();
  Tensor& out = stack[10]->toTensor();
  if (!shapes_hold(ctx, q, k, v, one, out, ScalarType::Char)) return;
  const Problem p{q.const_data_ptr<float>(), k.const_data_ptr<int8_t>(), stack[2]->toTensor().const_data_ptr<float>(),
                  v.const_data_ptr<int8_t>(), stack[4]->toTensor().const_data_ptr<float>(),
                  stack[5]->toTensor().const_data_ptr<int64_t>(), q.size(1), k.size(1), q.size(2), v.size(2),
                  static_cast<float>(stack[7]->toDouble()), stack[8]->toBool(), stack[9]->toInt()};
  run<int8_t>(p, one, out);
}

const executorch::runtime::Kernel kKernels[] = {
    executorch::runtime::Kernel("kvcache::sdpa_gather_alone.out", sdpa_gather_alone_out),
    executorch::runtime::Kernel("kvcache::sdpa_gather_alone_q8.out", sdpa_gather_alone_q8_out),
};
const auto kRegistered = executorch::runtime::register_kernels({kKernels, 2});

}  // namespace
