// A prototype, for bench/kv_read_floor.py only (not in the pipeline): one decode step's attention that
// reads the listed store slots where they lie, as a kernel of ExecuTorch's runtime (a library loaded
// beside it, the op's out variant registered by name), to measure what reading in place gives.
//
//   kvbench::attend_inplace.out(q [B, Hq, D] f32, k [slots, Hkv, D], v [slots, Hkv, D], slots [B, N] i64,
//                               scale, *, out [B, Hq, D] f32)
//   kvbench::attend_inplace_q8.out(q, k int8, k_scale [slots, Hkv] f32, v int8, v_scale, slots, scale, *, out)
//
// Query head h reads KV head h / (Hq / Hkv). No masks (every listed key is visible), as the bench's other
// forms. Each (sequence, KV head) is one task of ExecuTorch's threadpool: the G query heads of the KV head
// read each key row once, scores and softmax in float32, then the values.
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/operator_registry.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using executorch::aten::Tensor;
using executorch::runtime::EValue;
using executorch::runtime::KernelRuntimeContext;
using executorch::runtime::Span;

// the rows a task reads lie a store row apart (the columns interleave), a page or more: the hardware
// prefetcher does not follow them, so each loop asks for the row kAhead keys on
constexpr int64_t kAhead = 8;

inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(p) + at);
}

template <typename KV, int64_t DIM>
void attend(const float* q, const KV* k, const float* k_scale, const KV* v, const float* v_scale,
            const int64_t* slots, float* out, int64_t batches, int64_t keys, int64_t heads, int64_t kv_heads,
            int64_t dim_arg, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t dim = DIM ? DIM : dim_arg;  // a compile-time width lets the compiler unroll the row loops
  executorch::extension::parallel_for(0, batches * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(group * keys), acc(group * dim), row_f(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const float* qb = q + (b * heads + h * group) * dim;
      const int64_t* listed = slots + b * keys;
      for (int64_t n = 0; n < keys; ++n) {
        const int64_t row = listed[n] * kv_heads + h;
        if (n + kAhead < keys) {
          prefetch_row(k + (listed[n + kAhead] * kv_heads + h) * dim, dim * sizeof(KV));
          if (k_scale) __builtin_prefetch(k_scale + listed[n + kAhead] * kv_heads + h);
          if (v_scale) __builtin_prefetch(v_scale + listed[n + kAhead] * kv_heads + h);
        }
        const float* kr;
        if constexpr (std::is_same_v<KV, float>) {
          kr = k + row * dim;
        } else {  // the 8-bit row as floats once, for the G query heads
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) row_f[d] = static_cast<float>(k[row * dim + d]);
          kr = row_f.data();
        }
        const float ks = k_scale ? k_scale[row] * scale : scale;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qb + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * kr[d];
          weights[g * keys + n] = s * ks;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* w = weights.data() + g * keys;
        float top = *std::max_element(w, w + keys), total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t n = 0; n < keys; ++n) {
          w[n] = std::exp(w[n] - top);
          total += w[n];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t n = 0; n < keys; ++n) w[n] *= inv;
        if (v_scale) {
          for (int64_t n = 0; n < keys; ++n) w[n] *= v_scale[listed[n] * kv_heads + h];
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t n = 0; n < keys; ++n) {
        const int64_t row = listed[n] * kv_heads + h;
        if (n + kAhead < keys) prefetch_row(v + (listed[n + kAhead] * kv_heads + h) * dim, dim * sizeof(KV));
        const float* vr;
        if constexpr (std::is_same_v<KV, float>) {
          vr = v + row * dim;
        } else {
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) row_f[d] = static_cast<float>(v[row * dim + d]);
          vr = row_f.data();
        }
        for (int64_t g = 0; g < group; ++g) {
          const float wn = weights[g * keys + n];
          float* a = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += wn * vr[d];
        }
      }
      std::copy(acc.begin(), acc.end(), out + (b * heads + h * group) * dim);
    }
  });
}

template <typename KV>
void attend_any(const float* q, const KV* k, const float* k_scale, const KV* v, const float* v_scale,
                const int64_t* slots, float* out, int64_t batches, int64_t keys, int64_t heads, int64_t kv_heads,
                int64_t dim, float scale) {
  if (dim == 64) {
    attend<KV, 64>(q, k, k_scale, v, v_scale, slots, out, batches, keys, heads, kv_heads, dim, scale);
  } else {
    attend<KV, 0>(q, k, k_scale, v, v_scale, slots, out, batches, keys, heads, kv_heads, dim, scale);
  }
}

void attend_inplace_out(KernelRuntimeContext&, Span<EValue*> stack) {
  const Tensor& q = stack[0]->toTensor();
  const Tensor& k = stack[1]->toTensor();
  const Tensor& v = stack[2]->toTensor();
  const Tensor& slots = stack[3]->toTensor();
  Tensor& out = stack[5]->toTensor();
  attend_any<float>(q.const_data_ptr<float>(), k.const_data_ptr<float>(), nullptr, v.const_data_ptr<float>(), nullptr,
                slots.const_data_ptr<int64_t>(), out.mutable_data_ptr<float>(), slots.size(0), slots.size(1),
                q.size(1), k.size(1), q.size(2), static_cast<float>(stack[4]->toDouble()));
}

void attend_inplace_q8_out(KernelRuntimeContext&, Span<EValue*> stack) {
  const Tensor& q = stack[0]->toTensor();
  const Tensor& k = stack[1]->toTensor();
  const Tensor& k_scale = stack[2]->toTensor();
  const Tensor& v = stack[3]->toTensor();
  const Tensor& v_scale = stack[4]->toTensor();
  const Tensor& slots = stack[5]->toTensor();
  Tensor& out = stack[7]->toTensor();
  attend_any<int8_t>(q.const_data_ptr<float>(), k.const_data_ptr<int8_t>(), k_scale.const_data_ptr<float>(),
                 v.const_data_ptr<int8_t>(), v_scale.const_data_ptr<float>(), slots.const_data_ptr<int64_t>(),
                 out.mutable_data_ptr<float>(), slots.size(0), slots.size(1), q.size(1), k.size(1), q.size(2),
                 static_cast<float>(stack[6]->toDouble()));
}

const executorch::runtime::Kernel kernels[] = {
    executorch::runtime::Kernel("kvbench::attend_inplace.out", attend_inplace_out),
    executorch::runtime::Kernel("kvbench::attend_inplace_q8.out", attend_inplace_q8_out),
};
const auto registered = executorch::runtime::register_kernels({kernels, 2});

}  // namespace
