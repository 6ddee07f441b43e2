// A blended layer's K/V correction on the CPU (blendkv/blend/correction.py): the rows of each
// chunk that are not recomputed get the mean move of the chunk's recomputed rows, in one call
// per layer (CpuBlendKernels.shift_kept_rows).
//
// Built with the other CPU kernels by blendkv/kernels/cpu_extension.py; its reference is the
// torch code of correct_kept_rows, which the tests hold it to.
//
//   pool        [2, blocks, block_size, H, D]  the layer's KV pool (K rotated), contiguous
//   which       1 = K, 2 = V, 3 = both
//   shrink      the shrinkage's pseudo-count; pooled: its prior is all rows' (else 0)
//   k, v        [T, H, D]  the layer's fresh rows (K before RoPE); rows may be strided
//   rec_rows    [N] int64  the recomputed reused rows among them, in chunk order or not
//   rec_slots, rec_positions, rec_chunks   [N] int64  their slots (still holding the reused
//               K/V), positions and chunk indices
//   kept_slots, kept_positions, kept_chunks  [M] int64  the rows to shift
//   cos, sin    [P, D] float32  rotary tables (attention_scaling s folded in), both halves
//
// Per chunk c and element: shift = (sum over c's recomputed rows of (fresh - reused), summed in
// row order as index_add_ sums, + prior * shrink) times 1 / (n_c + shrink); the pooled prior is
// the chunks' sums added in chunk order over (the number of rows + shrink), else 0. K's reused
// rows are read back with the rotation undone ((k cos - rotate_half(k) sin) / s^2); the K shift
// is rotated to each kept row's position and added (x cos, then one FMA with rotate_half(x) sin,
// as torch's addcmul_ runs on AVX-512). Everything in float32, rounded to the pool's dtype on the
// way out; on the AMD EPYC here the pool's bits equal the torch code's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <vector>

#include "bf16.h"  // last: fast-math off from here on

namespace {

using blendkv_cpu::round_to;
using blendkv_cpu::to_float;

struct Rows {
  const int64_t* slots;
  const int64_t* positions;
  const int64_t* chunks;
  int64_t count;
};

// sums[c] (float32 [chunks, H * D]) = per-chunk mean shift of one half (K: 0, V: 1).
template <typename T>
std::vector<float> chunk_shift(const T* pool_half, const T* fresh, int64_t row_stride,
                               int64_t head_stride, const int64_t* rec_rows, const Rows& rec,
                               bool is_k, int64_t num_chunks, double shrink, bool pooled,
                               const float* cos, const float* sin, float inv_s2, int64_t H,
                               int64_t D) {
  const int64_t width = H * D, half = D / 2;
  std::vector<float> sums(num_chunks * width, 0.0f), counts(num_chunks, 0.0f);
  std::vector<float> old(width);
  for (int64_t i = 0; i < rec.count; ++i) {
    const T* stored = pool_half + rec.slots[i] * width;
    const T* row = fresh + rec_rows[i] * row_stride;
    float* sum = sums.data() + rec.chunks[i] * width;
    counts[rec.chunks[i]] += 1.0f;
    if (is_k) {
      const float* c = cos + rec.positions[i] * D;
      const float* s = sin + rec.positions[i] * D;
      for (int64_t h = 0; h < H; ++h) {
        const T* y = stored + h * D;
        float* o = old.data() + h * D;
        // rotate_half(y) = (-y[half:], y[:half]); each half in its own loop (they vectorize)
        for (int64_t d = 0; d < half; ++d) {
          o[d] = (to_float(y[d]) * c[d] - (-to_float(y[d + half])) * s[d]) * inv_s2;
        }
        for (int64_t d = half; d < D; ++d) {
          o[d] = (to_float(y[d]) * c[d] - to_float(y[d - half]) * s[d]) * inv_s2;
        }
      }
    } else {
      for (int64_t j = 0; j < width; ++j) old[j] = to_float(stored[j]);
    }
    for (int64_t h = 0; h < H; ++h) {
      const T* f = row + h * head_stride;
      for (int64_t d = 0; d < D; ++d) {
        sum[h * D + d] += to_float(f[d]) - old[h * D + d];
      }
    }
  }
  if (pooled && rec.count > 0) {
    std::vector<float> prior(width, 0.0f);
    float total = 0.0f;
    for (int64_t c = 0; c < num_chunks; ++c) {
      total += counts[c];
      for (int64_t j = 0; j < width; ++j) prior[j] += sums[c * width + j];
    }
    const float shrink_f = static_cast<float>(shrink);
    for (int64_t j = 0; j < width; ++j) prior[j] = prior[j] / (total + shrink_f) * shrink_f;
    for (int64_t c = 0; c < num_chunks; ++c) {
      for (int64_t j = 0; j < width; ++j) sums[c * width + j] += prior[j];
    }
  }
  for (int64_t c = 0; c < num_chunks; ++c) {
    float denom = counts[c] + static_cast<float>(shrink);
    denom = denom < 1e-12f ? 1e-12f : denom;
    const float weight = 1.0f / denom;
    for (int64_t j = 0; j < width; ++j) sums[c * width + j] *= weight;
  }
  return sums;
}

template <typename T>
void add_shift(T* pool_half, const std::vector<float>& shift, const Rows& kept, bool is_k,
               const float* cos, const float* sin, int64_t H, int64_t D) {
  const int64_t width = H * D, half = D / 2;
  at::parallel_for(0, kept.count, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      T* dst = pool_half + kept.slots[i] * width;
      const float* sh = shift.data() + kept.chunks[i] * width;
      if (!is_k) {
        for (int64_t j = 0; j < width; ++j) dst[j] = round_to<T>(sh[j] + to_float(dst[j]));
        continue;
      }
      const float* c = cos + kept.positions[i] * D;
      const float* s = sin + kept.positions[i] * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* x = sh + h * D;
        T* y = dst + h * D;
        // x cos + rotate_half(x) sin, the second product fused into the sum (addcmul_)
        for (int64_t d = 0; d < half; ++d) {
          y[d] = round_to<T>(__builtin_fmaf(-x[d + half], s[d], x[d] * c[d]) + to_float(y[d]));
        }
        for (int64_t d = half; d < D; ++d) {
          y[d] = round_to<T>(__builtin_fmaf(x[d - half], s[d], x[d] * c[d]) + to_float(y[d]));
        }
      }
    }
  });
}

template <typename T>
void run(at::Tensor& pool, int64_t which, double shrink, bool pooled, const at::Tensor& k,
         const at::Tensor& v, const int64_t* rec_rows, const Rows& rec, const Rows& kept,
         int64_t num_chunks, const float* cos, const float* sin, float inv_s2) {
  const int64_t H = pool.size(3), D = pool.size(4);
  const int64_t half_size = pool.size(1) * pool.size(2) * H * D;
  T* base = pool.data_ptr<T>();
  for (int64_t half = 0; half < 2; ++half) {
    if (!(which & (1 << half))) continue;
    const at::Tensor& fresh = half == 0 ? k : v;
    T* pool_half = base + half * half_size;
    const auto shift =
        chunk_shift<T>(pool_half, fresh.data_ptr<T>(), fresh.stride(0), fresh.stride(1),
                       rec_rows, rec, half == 0, num_chunks, shrink, pooled, cos, sin, inv_s2,
                       H, D);
    add_shift<T>(pool_half, shift, kept, half == 0, cos, sin, H, D);
  }
}

const int64_t* long_data(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == n,
              "shift_kept_rows: ", name, " must be contiguous int64 of the rows' length");
  return t.data_ptr<int64_t>();
}

void shift_kept_rows(at::Tensor pool, int64_t which, double shrink, bool pooled,
                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& rec_rows,
                     const at::Tensor& rec_slots, const at::Tensor& rec_positions,
                     const at::Tensor& rec_chunks, const at::Tensor& kept_slots,
                     const at::Tensor& kept_positions, const at::Tensor& kept_chunks,
                     int64_t num_chunks, const at::Tensor& cos, const at::Tensor& sin,
                     double attention_scaling) {
  TORCH_CHECK(pool.dim() == 5 && pool.size(0) == 2 && pool.is_contiguous(),
              "shift_kept_rows: pool must be contiguous [2, blocks, block_size, H, D]");
  const auto dtype = pool.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "shift_kept_rows: float32 or bfloat16 only");
  TORCH_CHECK(which >= 1 && which <= 3, "shift_kept_rows: which must be 1 (K), 2 (V) or 3");
  const int64_t H = pool.size(3), D = pool.size(4), slots = pool.size(1) * pool.size(2);
  TORCH_CHECK(D % 2 == 0, "shift_kept_rows: head_dim must be even");
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->dim() == 3 && t->size(1) == H &&
                    t->size(2) == D && t->stride(2) == 1,
                "shift_kept_rows: k and v must be [T, H, D] of the pool's dtype, last dim "
                "contiguous");
  }
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) == D && sin.sizes() == cos.sizes(),
              "shift_kept_rows: cos and sin must be contiguous float32 [P, head_dim]");
  TORCH_CHECK(num_chunks >= 1, "shift_kept_rows: num_chunks must be >= 1");
  const int64_t n = rec_rows.numel(), m = kept_slots.numel();
  const int64_t* rows = long_data(rec_rows, n, "rec_rows");
  const Rows rec{long_data(rec_slots, n, "rec_slots"), long_data(rec_positions, n, "rec_positions"),
                 long_data(rec_chunks, n, "rec_chunks"), n};
  const Rows kept{long_data(kept_slots, m, "kept_slots"),
                  long_data(kept_positions, m, "kept_positions"),
                  long_data(kept_chunks, m, "kept_chunks"), m};
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < k.size(0) && rows[i] < v.size(0),
                "shift_kept_rows: recomputed row out of range");
  }
  for (const Rows* r : {&rec, &kept}) {
    for (int64_t i = 0; i < r->count; ++i) {
      TORCH_CHECK(r->slots[i] >= 0 && r->slots[i] < slots, "shift_kept_rows: slot out of the pool");
      TORCH_CHECK(r->positions[i] >= 0 && r->positions[i] < cos.size(0),
                  "shift_kept_rows: position out of the table");
      TORCH_CHECK(r->chunks[i] >= 0 && r->chunks[i] < num_chunks,
                  "shift_kept_rows: chunk index out of range");
    }
  }
  if (n == 0 || m == 0) return;
  const float inv_s2 = static_cast<float>(1.0 / (attention_scaling * attention_scaling));
  if (dtype == at::kFloat) {
    run<float>(pool, which, shrink, pooled, k, v, rows, rec, kept, num_chunks,
               cos.data_ptr<float>(), sin.data_ptr<float>(), inv_s2);
  } else {
    run<c10::BFloat16>(pool, which, shrink, pooled, k, v, rows, rec, kept, num_chunks,
                       cos.data_ptr<float>(), sin.data_ptr<float>(), inv_s2);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blendkv_cpu, m) {
  m.def(
      "shift_kept_rows(Tensor(a!) pool, int which, float shrink, bool pooled, Tensor k, Tensor v, "
      "Tensor rec_rows, Tensor rec_slots, Tensor rec_positions, Tensor rec_chunks, "
      "Tensor kept_slots, Tensor kept_positions, Tensor kept_chunks, int num_chunks, "
      "Tensor cos, Tensor sin, float attention_scaling) -> ()");
  m.impl("shift_kept_rows", c10::DispatchKey::CPU, TORCH_FN(shift_kept_rows));
}
