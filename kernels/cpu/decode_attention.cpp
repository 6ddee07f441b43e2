// Paged decode attention on the CPU: every decode row of a step, one call per layer.
//
// Built and loaded at run time by blendkv/kernels/cpu_extension.py (the cpu attention backend);
// the reference is dense_decode_attention in blendkv/kernels/cpu_decode.py.
//
//   q, out   [T, Hq, D]       the step's rows; rows[r] is the r-th decode row
//   keys     [S, Hkv, D]      one layer's pool (pool slots x kv heads x head dim), values alike
//   slots    [R, L] int64     pool slots of decode row r's keys 0 .. lens[r] - 1 (L >= lens[r])
//
// One task per (decode row, kv head), handed out longest context first to torch's intra-op
// threads as each finishes the one before (a batch mixing long RAG contexts with short chats
// stays balanced); a task reads each key and value once for the G = Hq / Hkv query heads that
// share them, keeps the
// scores in a buffer (softmax over exactly lens[r] keys, no padding), and accumulates in
// float32 for float32 and bfloat16 pools alike. Common (G, D) pairs are compiled with constant
// sizes so the compiler unrolls and vectorises the inner loops; others take the generic loop.
// A sliding window (window > 0) starts a row at its key lens - window: the slots before it
// (whole blocks outside the window among them) are never read. soft_cap > 0 caps the scores.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <numeric>
#include <cmath>
#include <vector>

#include "tasks.h"

namespace {

using Queue = blendkv_cpu::TaskQueue;

struct Args {
  const void* q;
  const void* keys;
  const void* values;
  const int64_t* rows;
  const int64_t* slots;
  const int64_t* lens;
  void* out;
  int64_t num_kv_heads, num_q_heads, max_len, group, head_dim;
  float scale;
  int64_t window;  // > 0: a row reads only its last `window` keys (a sliding-window layer)
  float soft_cap;  // > 0: scores soft_cap * tanh(score / soft_cap)
};

// GT, DT: the group size and head dim as constants (0 = read them from args).
template <typename scalar_t, int64_t GT, int64_t DT>
void run_tasks(const Args& a, Queue& queue) {
  const int64_t G = GT ? GT : a.group, D = DT ? DT : a.head_dim, Hkv = a.num_kv_heads;
  const auto* q = static_cast<const scalar_t*>(a.q);
  const auto* keys = static_cast<const scalar_t*>(a.keys);
  const auto* values = static_cast<const scalar_t*>(a.values);
  auto* out = static_cast<scalar_t*>(a.out);
  std::vector<float> scores, qf(G * D), acc(G * D), sums(G);
  const int64_t blocks_per_row = Hkv / queue.heads;
  for (int64_t t = queue.next++; t < queue.size; t = queue.next++) {
    const int64_t task = queue.order[t], r = task / blocks_per_row;
    // A window: the row's keys start at lens - window (the slots before are never read).
    const int64_t skip = a.window > 0 ? std::max<int64_t>(0, a.lens[r] - a.window) : 0;
    const int64_t row = a.rows[r], n = a.lens[r] - skip;
    const int64_t* slots = a.slots + r * a.max_len + skip;
    const int64_t first_head = (task % blocks_per_row) * queue.heads;
    for (int64_t h = first_head; h < first_head + queue.heads; ++h) {
      const scalar_t* qr = q + (row * a.num_q_heads + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qr[i]) * a.scale;
      scores.resize(G * n);
      for (int64_t j = 0; j < n; ++j) {
        const scalar_t* k = keys + (slots[j] * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(k[d]);
          if (a.soft_cap > 0.f) s = a.soft_cap * std::tanh(s / a.soft_cap);
          scores[g * n + j] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        float m = -FLT_MAX;
        for (int64_t j = 0; j < n; ++j) m = std::max(m, sg[j]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = std::exp(sg[j] - m);
          total += sg[j];
        }
        sums[g] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const scalar_t* v = values + (slots[j] * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + j];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(v[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        scalar_t* o = out + (row * a.num_q_heads + h * G + g) * D;
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[g * D + d] * inv);
      }
    }
  }
}

template <typename scalar_t>
void dispatch(const Args& a, Queue& queue) {
#define BLENDKV_CASE(G, D) \
  if (a.group == G && a.head_dim == D) return run_tasks<scalar_t, G, D>(a, queue);
  BLENDKV_CONSTANT_SHAPES(BLENDKV_CASE)
#undef BLENDKV_CASE
  run_tasks<scalar_t, 0, 0>(a, queue);
}

void decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                      const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& lens,
                      double scale, at::Tensor out, int64_t window, double soft_cap) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(),
              "decode_attention: q [T, Hq, D], keys/values [S, Hkv, D]");
  TORCH_CHECK(out.sizes() == q.sizes(), "decode_attention: out must have q's shape");
  TORCH_CHECK(q.size(2) == keys.size(2) && q.size(1) % keys.size(1) == 0,
              "decode_attention: head dims differ or Hq is not a multiple of Hkv");
  for (const at::Tensor* t : {&q, &keys, &values, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == q.scalar_type() && t->is_cpu(),
                "decode_attention: q, keys, values, out: contiguous CPU tensors of one dtype");
  }
  for (const at::Tensor* t : {&rows, &slots, &lens}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kLong && t->is_cpu(),
                "decode_attention: rows, slots, lens: contiguous int64 CPU tensors");
  }
  const int64_t num_rows = rows.size(0);
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == num_rows && lens.size(0) == num_rows,
              "decode_attention: slots [R, L] and lens [R] for R rows");
  TORCH_CHECK(window >= 0 && soft_cap >= 0, "decode_attention: window, soft_cap >= 0");
  if (num_rows == 0) return;
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= slots.size(1),
                "decode_attention: every row attends 1 .. L keys");
  }
  Args a{q.data_ptr(), keys.data_ptr(), values.data_ptr(), rows.data_ptr<int64_t>(),
         slots.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr(), keys.size(1),
         q.size(1), slots.size(1), q.size(1) / keys.size(1), q.size(2),
         static_cast<float>(scale), window, static_cast<float>(soft_cap)};
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "decode_attention: float32 or bfloat16 only");
  // A row's kv heads read neighbouring bytes of each slot: one task takes all of them when
  // there are rows enough to balance the threads, else one head each (a lone long row).
  const int64_t threads = at::get_num_threads();
  const int64_t heads = num_rows >= 4 * threads ? a.num_kv_heads : 1;
  const int64_t blocks_per_row = a.num_kv_heads / heads, num_tasks = num_rows * blocks_per_row;
  std::vector<int64_t> order(num_tasks);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return lp[x / blocks_per_row] > lp[y / blocks_per_row];
  });
  Queue queue{order.data(), num_tasks, heads};
  const int64_t workers = std::min<int64_t>(threads, num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    if (dtype == at::kFloat) {
      dispatch<float>(a, queue);
    } else {
      dispatch<c10::BFloat16>(a, queue);
    }
  });
}

}  // namespace

TORCH_LIBRARY(blendkv_cpu, m) {
  m.def(
      "decode_attention(Tensor q, Tensor keys, Tensor values, Tensor rows, Tensor slots, "
      "Tensor lens, float scale, Tensor(a!) out, int window=0, float soft_cap=0.0) -> ()");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
