// Prefill rows at any ascending positions over one sequence's keys on the CPU, flash style, one
// call per sequence and layer: fresh prompts, chunked-prefill chunks, prefix-hit tails and
// CacheBlend's scattered recomputed rows (the cpu attention backend).
//
// Built with decode_attention.cpp by blendkv/kernels/cpu_extension.py; the eager paths it
// replaces (SDPA's causal flash, blendkv.kernels.split_attention) and a float64 oracle are what
// the tests hold it to.
//
//   q, out     [n, Hq, D]     rows at strictly ascending positions[n] (a row sees keys 0 .. its own)
//   keys       [S, Hkv, D]    the sequence's keys at positions 0 .. S - 1 (RoPE applied),
//   values     [S, Hkv, D]    rows of Hkv * D contiguous values (a slice of the pool, or gathered)
//
// The keys the rows see are transposed once per call into float32 [Hkv, D, S'] (bf16 values
// copied to float32); bfloat16 keys on a CPU with bf16 dot products (AVX512-BF16) into pairs
// of dims [Hkv, D / 2, S'] instead, scored with vdpbf16ps (both products of a pair into a
// float32 sum: half the instructions). One task per (kv head, block of consecutive rows),
// longest context first: it folds the G = Hq / Hkv query heads of its rows into one block of
// G * rows query rows (each key is read once for all of them), walks the keys up to its last
// row's position in blocks of BK, and keeps an online softmax per query row in float32. Only
// key blocks past the task's first row's position are masked: there each block of RI rows goes
// up to its last row's key and a row stops at its own position. Scores (RI rows x KJ keys) and
// P.V (RI rows x 64 dims) are register-blocked loops over GCC vector types. With bf16 dot
// products and head dims a multiple of 64, the values go into pairs of keys [Hkv, S' / 2, D]
// too and P.V is a pair dot product of P rounded to bfloat16 (as GPU flash kernels round it).
//
// With `mass` [S] (ProphetKV's query rows) the attention pass also keeps its rows' exponentiated
// scores and the running max each key block's were taken at; when a task's rows are done it
// rescales them to probabilities and sums them over its rows into its own row of partial sums,
// added up in task order at the end: the probability every row and query head pays each key,
// the rows' output and their score in one call. Where those buffers would pass
// `max_prob_floats`, the attention pass keeps each row's log-sum-exp only and a second pass
// (add_mass, one task per key block) recomputes the scores.
//
// A call's rows go in blocks of at most `block_rows`, smaller when that few tasks would leave
// threads idle (ProphetKV's ~30 query rows: 2 blocks of 18 rather than 32 + 3).
//
// A sliding window (window > 0: a row at p sees keys p - window < j <= p) starts a task's key
// walk at its first row's first key (rounded down to a register block): the keys before every
// row's window are never read; blocks that reach below a row's window are masked from below
// too. soft_cap > 0 caps every score (soft_cap * tanh(score / soft_cap)) before the softmax.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cmath>
#include <numeric>
#include <optional>
#include <vector>

#include "tasks.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define BLENDKV_BF16_DOT 1  // bfloat16 q.k as pair dot products (vdpbf16ps), float32 sums
#else
#define BLENDKV_BF16_DOT 0
#endif

namespace {

using RowsQueue = blendkv_cpu::TaskQueue;

constexpr int64_t BK = 256;  // keys per block (a multiple of KJ)
constexpr int64_t RI = 6;    // query rows per register block
constexpr int64_t KJ = 32;   // keys per register block (two vectors)
constexpr int64_t W = 16;    // floats per vector

// GCC/Clang vector extensions: 16 floats, lowered to whatever the machine has (one AVX-512
// register, two AVX2 ones, ...). Unaligned loads and stores through memcpy.
typedef float vec __attribute__((vector_size(W * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(vec));
  return v;
}
inline void store(float* p, vec v) { __builtin_memcpy(p, &v, sizeof(vec)); }
inline vec splat(float x) { return vec{} + x; }

struct RowsArgs {
  const void* q;
  const float* kt;      // [Hkv, D, ldk]: the keys transposed, float32, zero past the last one
  const float* values;  // rows of ldv floats (the input's, or a float32 copy of bfloat16 ones)
  int64_t ldk, ldv;
  const int64_t* positions;
  void* out;
  int64_t num_rows, num_kv_heads, num_q_heads, group, head_dim, block_rows;
  float scale;
  float* lse = nullptr;  // [n, Hq]: each row's log-sum-exp of its scaled scores (mass pass)
  // bfloat16 on a CPU with bf16 dot products, instead of kt: [Hkv, D / 2, ldk] pairs of dims,
  // and (D a multiple of 64) instead of values: [Hkv, ldk / 2, D] pairs of keys
  const uint32_t* ktb = nullptr;
  const uint32_t* vb = nullptr;
  // The mass from the attention pass: each task's rows' probabilities summed into its own row
  // of mass_parts [tasks, ldk], added up in task order afterwards (add_mass otherwise).
  float* mass_parts = nullptr;
  int64_t window = 0;    // > 0: a row at p sees keys p - window < j <= p
  float soft_cap = 0.f;  // > 0: scores soft_cap * tanh(score / soft_cap)
};

// The soft cap on rows [0, rows) x keys [0, nk) of a scores block (rows BK floats apart).
inline void cap_scores(float* s, int64_t rows, int64_t nk, float cap) {
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < rows; ++i) {
    float* si = s + i * BK;
    for (int64_t j = 0; j < nk; ++j) si[j] = cap * std::tanh(si[j] * inv);
  }
}

// s[i][j] = sum_d qf[i][d] * kt[d * ldk + j] for i < mpad (a multiple of RI), j < kpad (of KJ):
// RI rows x KJ keys of accumulators in registers, two key loads and RI broadcasts per d.
inline void scores_block(const float* qf, const float* kt, int64_t ldk, float* s, int64_t mpad,
                         int64_t kpad, int64_t D) {
  for (int64_t i = 0; i < mpad; i += RI) {
    for (int64_t j = 0; j < kpad; j += KJ) {
      vec acc[RI][2] = {};
      for (int64_t d = 0; d < D; ++d) {
        const vec k0 = load(kt + d * ldk + j), k1 = load(kt + d * ldk + j + W);
        for (int64_t r = 0; r < RI; ++r) {
          const vec b = splat(qf[(i + r) * D + d]);
          acc[r][0] += b * k0;
          acc[r][1] += b * k1;
        }
      }
      for (int64_t r = 0; r < RI; ++r) {
        store(s + (i + r) * BK + j, acc[r][0]);
        store(s + (i + r) * BK + j + W, acc[r][1]);
      }
    }
  }
}

#if BLENDKV_BF16_DOT
// scores_block for bfloat16: qb[i][d2] and kb[d2 * ldk + j] hold dims (2 d2, 2 d2 + 1) of row i
// and key j; one vdpbf16ps adds both products of a pair into float32, so half the
// instructions of the float32 loop. The sums are scaled at the end (q stays as given).
inline void scores_block_bf16(const uint32_t* qb, const uint32_t* kb, int64_t ldk, float* s,
                              int64_t mpad, int64_t kpad, int64_t D, float scale) {
  const int64_t D2 = D / 2;
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < mpad; i += RI) {
    for (int64_t j = 0; j < kpad; j += KJ) {
      __m512 acc[RI][2];
      for (int64_t r = 0; r < RI; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int64_t d2 = 0; d2 < D2; ++d2) {
        const uint32_t* kp = kb + d2 * ldk + j;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + W);
        for (int64_t r = 0; r < RI; ++r) {
          const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(qb[(i + r) * D2 + d2]));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, k0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, k1);
        }
      }
      for (int64_t r = 0; r < RI; ++r) {
        _mm512_storeu_ps(s + (i + r) * BK + j, _mm512_mul_ps(acc[r][0], sc));
        _mm512_storeu_ps(s + (i + r) * BK + j + W, _mm512_mul_ps(acc[r][1], sc));
      }
    }
  }
}
#endif

// o[i][:] += sum_j p[i][j] * v[j][:] for i < mpad, j < nk; v rows `ldv` floats apart. Head
// dims that are a multiple of 64 go 64 at a time (RI rows x 4 vectors of accumulators).
inline void values_block(const float* p, const float* v, int64_t ldv, float* o, int64_t mpad,
                         int64_t nk, int64_t D) {
  if (D % (4 * W) == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 4 * W) {
      for (int64_t i = 0; i < mpad; i += RI) {
        vec acc[RI][4];
        for (int64_t r = 0; r < RI; ++r) {
          for (int64_t c = 0; c < 4; ++c) acc[r][c] = load(o + (i + r) * D + d0 + c * W);
        }
        for (int64_t j = 0; j < nk; ++j) {
          const float* vj = v + j * ldv + d0;
          const vec v0 = load(vj), v1 = load(vj + W), v2 = load(vj + 2 * W),
                    v3 = load(vj + 3 * W);
          for (int64_t r = 0; r < RI; ++r) {
            const vec b = splat(p[(i + r) * BK + j]);
            acc[r][0] += b * v0;
            acc[r][1] += b * v1;
            acc[r][2] += b * v2;
            acc[r][3] += b * v3;
          }
        }
        for (int64_t r = 0; r < RI; ++r) {
          for (int64_t c = 0; c < 4; ++c) store(o + (i + r) * D + d0 + c * W, acc[r][c]);
        }
      }
    }
    return;
  }
  for (int64_t i = 0; i < mpad; ++i) {
    float* oi = o + i * D;
    for (int64_t j = 0; j < nk; ++j) {
      const float pv = p[i * BK + j];
      const float* vj = v + j * ldv;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) oi[d] += pv * vj[d];
    }
  }
}

#if BLENDKV_BF16_DOT
// values_block for bfloat16 values, D a multiple of 64: vb[j2 * D + d] holds value dim d of
// keys (2 j2, 2 j2 + 1). Each row's probabilities are rounded to bfloat16 pairs of keys (as
// GPU flash kernels round P for their P.V), one vdpbf16ps adds both keys' products into
// float32: half the instructions of the float32 loop. A key past nk counts zero.
inline void values_block_bf16(const float* p, const uint32_t* vb, float* o, int64_t mpad,
                              int64_t nk, int64_t D) {
  const int64_t nk2 = (nk + 1) / 2;
  uint32_t pb[RI][BK / 2];
  for (int64_t i = 0; i < mpad; i += RI) {
    for (int64_t r = 0; r < RI; ++r) {
      const float* pr = p + (i + r) * BK;
      for (int64_t j = 0; j < nk2 * 2; j += 2 * W) {
        const __m512bh x =
            _mm512_cvtne2ps_pbh(_mm512_loadu_ps(pr + j + W), _mm512_loadu_ps(pr + j));
        _mm512_storeu_si512(pb[r] + j / 2, (__m512i)x);
      }
      if (nk % 2 != 0) pb[r][nk2 - 1] &= 0xffffu;  // key nk: the upper half of the last pair
    }
    for (int64_t d0 = 0; d0 < D; d0 += 4 * W) {
      __m512 acc[RI][4];
      for (int64_t r = 0; r < RI; ++r) {
        for (int64_t c = 0; c < 4; ++c) {
          acc[r][c] = _mm512_loadu_ps(o + (i + r) * D + d0 + c * W);
        }
      }
      for (int64_t j2 = 0; j2 < nk2; ++j2) {
        const uint32_t* vj = vb + j2 * D + d0;
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vj),
                       v1 = (__m512bh)_mm512_loadu_si512(vj + W),
                       v2 = (__m512bh)_mm512_loadu_si512(vj + 2 * W),
                       v3 = (__m512bh)_mm512_loadu_si512(vj + 3 * W);
        for (int64_t r = 0; r < RI; ++r) {
          const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[r][j2]));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, v0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, v1);
          acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, v2);
          acc[r][3] = _mm512_dpbf16_ps(acc[r][3], b, v3);
        }
      }
      for (int64_t r = 0; r < RI; ++r) {
        for (int64_t c = 0; c < 4; ++c) {
          _mm512_storeu_ps(o + (i + r) * D + d0 + c * W, acc[r][c]);
        }
      }
    }
  }
}
#endif

// Scores of `count` staged query rows of kv head h (from row i0; count a multiple of RI) over
// keys [k0, k0 + kpad): float32 rows D apart, pre-scaled, or (bf16 dot products) bfloat16
// pairs of dims D / 2 apart, scaled after the sums.
inline void score_rows(const RowsArgs& a, const void* qh, int64_t i0, int64_t count, int64_t h,
                       int64_t k0, int64_t kpad, float* dst, int64_t D) {
#if BLENDKV_BF16_DOT
  if (a.ktb != nullptr) {
    const int64_t D2 = D / 2;
    scores_block_bf16(static_cast<const uint32_t*>(qh) + i0 * D2, a.ktb + h * D2 * a.ldk + k0,
                      a.ldk, dst, count, kpad, D, a.scale);
    return;
  }
#endif
  scores_block(static_cast<const float*>(qh) + i0 * D, a.kt + h * D * a.ldk + k0, a.ldk, dst,
               count, kpad, D);
}

// o[i][:] += P.V over keys [k0, k0 + nk) of kv head h for `count` rows: float32 values or
// (bf16 dot products, D a multiple of 64) bfloat16 pairs of keys.
inline void value_rows(const RowsArgs& a, const float* p, int64_t count, int64_t h, int64_t k0,
                       int64_t nk, float* o, int64_t D) {
#if BLENDKV_BF16_DOT
  if (a.vb != nullptr) {
    values_block_bf16(p, a.vb + (h * (a.ldk / 2) + k0 / 2) * D, o, count, nk, D);
    return;
  }
#endif
  values_block(p, a.values + k0 * a.ldv + h * D, a.ldv, o, count, nk, D);
}

// One row of a block's scores: online-softmax update over its first n of nk keys (the rest
// zeroed, as values_block reads all nk); the row's running max m, sum l and output o rescaled.
inline void softmax_row(float* si, int64_t n, int64_t nk, float& m, float& l, float* o,
                        int64_t D) {
  if (n == 0) {
    std::fill(si, si + nk, 0.f);
    return;
  }
  float mx = m;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, si[j]);
  const float alpha = std::exp(m - mx);  // 0 for the first block (m = -inf)
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < n; ++j) {
    si[j] = std::exp(si[j] - mx);
    total += si[j];
  }
  std::fill(si + n, si + nk, 0.f);
  l = l * alpha + total;
  m = mx;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
}

// softmax_row over keys [lo, n) of the block only (a sliding window's lower edge); the rest
// zeroed. A row that sees none of them keeps its state.
inline void softmax_row_window(float* si, int64_t lo, int64_t n, int64_t nk, float& m, float& l,
                               float* o, int64_t D) {
  if (lo >= n) {
    std::fill(si, si + nk, 0.f);
    return;
  }
  float mx = m;
  for (int64_t j = lo; j < n; ++j) mx = std::max(mx, si[j]);
  const float alpha = std::exp(m - mx);
  float total = 0.f;
  for (int64_t j = lo; j < n; ++j) {
    si[j] = std::exp(si[j] - mx);
    total += si[j];
  }
  std::fill(si, si + lo, 0.f);
  std::fill(si + n, si + nk, 0.f);
  l = l * alpha + total;
  m = mx;
  for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
}

// GT, DT: the group size and head dim as constants (0 = read them from args).
template <typename scalar_t, int64_t GT, int64_t DT>
void run_rows(const RowsArgs& a, RowsQueue& queue) {
  const int64_t G = GT ? GT : a.group, D = DT ? DT : a.head_dim;
  const int64_t Hkv = a.num_kv_heads, Hq = a.num_q_heads, BR = a.block_rows;
  const int64_t mpad = (BR * G + RI - 1) / RI * RI;
  const auto* q = static_cast<const scalar_t*>(a.q);
  auto* out = static_cast<scalar_t*>(a.out);
  const int64_t* pos = a.positions;
  const bool dot = a.ktb != nullptr;  // (bfloat16 only)
  const int64_t D2 = D / 2;
  std::vector<float> qf(dot ? 0 : mpad * D), s(mpad * BK), o(mpad * D), m(mpad), l(mpad);
  std::vector<uint32_t> qb(dot ? mpad * D2 : 0);
  // With mass_parts: the task's rows' exps over their keys [row][ldk], and the running max
  // each key block's exps took [row][key block].
  std::vector<float> probs, mb;
  if (a.mass_parts != nullptr) probs.resize(mpad * a.ldk);
  const int64_t blocks = (a.num_rows + BR - 1) / BR;
  for (int64_t t = queue.next++; t < queue.size; t = queue.next++) {
    const int64_t task = queue.order[t], h = task / blocks, r0 = (task % blocks) * BR;
    const int64_t r1 = std::min(a.num_rows, r0 + BR), rows = (r1 - r0) * G;
    const int64_t mrows = (rows + RI - 1) / RI * RI;  // this task's rows (a last block is short)
    std::fill(qf.begin(), qf.end(), 0.f);
    std::fill(qb.begin(), qb.end(), 0u);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* src = q + (r * Hq + h * G + g) * D;
        const int64_t i = (r - r0) * G + g;
        if (dot) {  // the bfloat16 pairs as they are
          std::memcpy(qb.data() + i * D2, src, D * sizeof(scalar_t));
          continue;
        }
        float* dst = qf.data() + i * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * a.scale;
      }
    }
    std::fill(o.begin(), o.end(), 0.f);
    std::fill(m.begin(), m.end(), -INFINITY);
    std::fill(l.begin(), l.end(), 0.f);
    const int64_t first = pos[r0], end = pos[r1 - 1] + 1, win = a.window;
    const void* qh = dot ? static_cast<const void*>(qb.data()) : qf.data();
    // A window: from the first row's first key, rounded down to a register block of keys.
    const int64_t kstart = win > 0 ? std::max<int64_t>(0, first - win + 1) / KJ * KJ : 0;
    const int64_t kblocks = (end - kstart + BK - 1) / BK;
    if (a.mass_parts != nullptr) mb.resize(mrows * kblocks);
    // Row i's exps over keys [k0, k0 + count) of the block kept, with the max they took.
    auto keep = [&](int64_t i, int64_t k0, int64_t count) {
      std::copy_n(s.data() + i * BK, count, probs.data() + i * a.ldk + k0);
      mb[i * kblocks + (k0 - kstart) / BK] = m[i];
    };
    for (int64_t k0 = kstart; k0 < end; k0 += BK) {
      const int64_t nk = std::min(BK, end - k0);
      // every row sees every key of the block (a window: the last row's window starts by k0)
      if (k0 + nk - 1 <= first && (win == 0 || k0 > end - 1 - win)) {
        const int64_t kpad = (nk + KJ - 1) / KJ * KJ;
        score_rows(a, qh, 0, mrows, h, k0, kpad, s.data(), D);
        if (a.soft_cap > 0.f) cap_scores(s.data(), mrows, nk, a.soft_cap);
        for (int64_t i = 0; i < mrows; ++i) {
          softmax_row(s.data() + i * BK, i < rows ? nk : 0, nk, m[i], l[i], o.data() + i * D, D);
          if (a.mass_parts != nullptr && i < rows) keep(i, k0, nk);
        }
        value_rows(a, s.data(), mrows, h, k0, nk, o.data(), D);
        continue;
      }
      // Masked: each register block of RI rows goes up to its last row's key only (rows
      // ascend, so blocks of rows that see none of these keys are skipped).
      for (int64_t i0 = 0; i0 < mrows; i0 += RI) {
        const int64_t last = std::min(i0 + RI, rows) - 1;  // its last real row
        const int64_t nki = std::clamp<int64_t>(pos[r0 + last / G] - k0 + 1, 0, nk);
        if (nki == 0) continue;
        const int64_t kpad = (nki + KJ - 1) / KJ * KJ;
        float* si = s.data() + i0 * BK;
        score_rows(a, qh, i0, RI, h, k0, kpad, si, D);
        if (a.soft_cap > 0.f) cap_scores(si, RI, nki, a.soft_cap);
        for (int64_t i = i0; i < i0 + RI; ++i) {
          const int64_t n =
              i < rows ? std::clamp<int64_t>(pos[r0 + i / G] - k0 + 1, 0, nki) : 0;
          if (win > 0) {
            const int64_t lo = i < rows ? std::clamp<int64_t>(pos[r0 + i / G] - win + 1 - k0, 0, n)
                                        : 0;
            softmax_row_window(s.data() + i * BK, lo, n, nki, m[i], l[i], o.data() + i * D, D);
          } else {
            softmax_row(s.data() + i * BK, n, nki, m[i], l[i], o.data() + i * D, D);
          }
          if (a.mass_parts != nullptr && n > 0) keep(i, k0, n);
        }
        value_rows(a, si, RI, h, k0, nki, o.data() + i0 * D, D);
      }
    }
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = (r - r0) * G + g;
        const float inv = 1.f / l[i];
        scalar_t* dst = out + (r * Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[i * D + d] * inv);
        if (a.lse != nullptr) a.lse[r * Hq + h * G + g] = m[i] + std::log(l[i]);
      }
    }
    if (a.mass_parts == nullptr) continue;
    // exp(s - block max) * exp(block max - lse) = the probability, over each row's own keys,
    // summed over the task's rows in order.
    float* part = a.mass_parts + task * a.ldk;
    std::fill(part, part + a.ldk, 0.f);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t p = pos[r0 + i / G], lo = win > 0 ? std::max<int64_t>(0, p - win + 1) : 0;
      const float lse = m[i] + std::log(l[i]);
      const float* pi = probs.data() + i * a.ldk;
      for (int64_t t = 0; t < kblocks; ++t) {
        const int64_t k0 = kstart + t * BK;
        const int64_t j0 = std::max(lo, k0), j1 = std::min(p + 1, k0 + BK);
        if (j0 >= j1) continue;
        const float f = std::exp(mb[i * kblocks + t] - lse);
#pragma omp simd
        for (int64_t j = j0; j < j1; ++j) part[j] += pi[j] * f;
      }
    }
  }
}

template <typename scalar_t>
void dispatch_rows(const RowsArgs& a, RowsQueue& queue) {
#define BLENDKV_CASE(G, D) \
  if (a.group == G && a.head_dim == D) return run_rows<scalar_t, G, D>(a, queue);
  BLENDKV_CONSTANT_SHAPES(BLENDKV_CASE)
#undef BLENDKV_CASE
  run_rows<scalar_t, 0, 0>(a, queue);
}


// The mass pass, when the attention pass kept no probabilities: mass[j] += sum over rows and
// query heads of each row's softmax probability of key j, exp(score - lse), the scores
// recomputed by scores_block on the same scaled float32 q `qs` as the attention pass, so they
// are the bits its softmax saw. One task per block of BK keys (no two tasks add to the same
// key), rows and heads in one order: the same sum on every call.
void add_mass(const RowsArgs& a, const void* qs, int64_t used, float* mass) {
  const int64_t G = a.group, D = a.head_dim, Hq = a.num_q_heads, n = a.num_rows, D2 = D / 2;
  const int64_t rows = n * G, mrows = (rows + RI - 1) / RI * RI;
  at::parallel_for(0, (used + BK - 1) / BK, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> s(RI * BK), acc(BK);
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t k0 = b * BK, nk = std::min(BK, used - k0);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t h = 0; h < a.num_kv_heads; ++h) {
        const void* qh = a.ktb != nullptr ? static_cast<const void*>(
                                                static_cast<const uint32_t*>(qs) + h * mrows * D2)
                                          : static_cast<const float*>(qs) + h * mrows * D;
        for (int64_t i0 = 0; i0 < mrows; i0 += RI) {
          const int64_t last = std::min(i0 + RI, rows) - 1;  // rows ascend: skip unseeing ones
          const int64_t nki = std::clamp<int64_t>(a.positions[last / G] - k0 + 1, 0, nk);
          if (nki == 0) continue;
          const int64_t kpad = (nki + KJ - 1) / KJ * KJ;
          score_rows(a, qh, i0, RI, h, k0, kpad, s.data(), D);
          if (a.soft_cap > 0.f) cap_scores(s.data(), RI, nki, a.soft_cap);
          for (int64_t i = i0; i <= last; ++i) {
            const int64_t r = i / G, g = i % G;
            const int64_t ni = std::clamp<int64_t>(a.positions[r] - k0 + 1, 0, nki);
            const int64_t j0 =
                a.window > 0 ? std::clamp<int64_t>(a.positions[r] - a.window + 1 - k0, 0, ni) : 0;
            const float lse = a.lse[r * Hq + h * G + g];
            const float* si = s.data() + (i - i0) * BK;
#pragma omp simd
            for (int64_t j = j0; j < ni; ++j) acc[j] += std::exp(si[j] - lse);
          }
        }
      }
      for (int64_t j = 0; j < nk; ++j) mass[k0 + j] += acc[j];
    }
  });
}

void rows_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                    const at::Tensor& positions, double scale, int64_t block_rows,
                    at::Tensor out, const std::optional<at::Tensor>& mass, int64_t window,
                    double soft_cap, int64_t max_prob_floats) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(),
              "rows_attention: q [n, Hq, D], keys/values [S, Hkv, D]");
  TORCH_CHECK(out.sizes() == q.sizes(), "rows_attention: out must have q's shape");
  TORCH_CHECK(q.size(2) == keys.size(2) && q.size(1) % keys.size(1) == 0,
              "rows_attention: head dims differ or Hq is not a multiple of Hkv");
  for (const at::Tensor* t : {&q, &keys, &values, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == q.scalar_type() && t->is_cpu(),
                "rows_attention: q, keys, values, out: contiguous CPU tensors of one dtype");
  }
  TORCH_CHECK(positions.is_contiguous() && positions.scalar_type() == at::kLong &&
                  positions.is_cpu() && positions.dim() == 1 && positions.size(0) == q.size(0),
              "rows_attention: positions: [n] contiguous int64 CPU tensor");
  TORCH_CHECK(block_rows >= 1, "rows_attention: block_rows >= 1");
  TORCH_CHECK(window >= 0 && soft_cap >= 0 && max_prob_floats >= 0,
              "rows_attention: window, soft_cap, max_prob_floats >= 0");
  TORCH_CHECK(!mass || (mass->is_contiguous() && mass->scalar_type() == at::kFloat &&
                        mass->is_cpu() && mass->dim() == 1 && mass->size(0) == keys.size(0)),
              "rows_attention: mass: [S] contiguous float32 CPU tensor");
  const int64_t n = q.size(0);
  if (n == 0) return;
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(pp[r] >= 0 && pp[r] < keys.size(0) && (r == 0 || pp[r] > pp[r - 1]),
                "rows_attention: positions must ascend strictly within 0 .. S - 1");
  }
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "rows_attention: float32 or bfloat16 only");
  // The keys the rows see, transposed per kv head into float32 [Hkv, D, ldk] (zeros past the
  // last one, so a block's last register block reads zeros), and bfloat16 values as float32:
  // once per call, not once per task.
  const int64_t Hkv = keys.size(1), D = q.size(2), used = pp[n - 1] + 1;
  // Rows ldk floats apart with ldk / 16 odd: an odd number of 64-byte lines, so the D rows a
  // register block reads fall into different cache sets. With ldk a multiple of 1024 (6,114
  // keys -> 6,144) they all fell into one set and the call ran slower (docs/benchmarks.md).
  const int64_t ldk = (used + KJ - 1) / KJ * KJ + W;
  // Only the padding is zeroed: every other float is written below (zeroing all of it costs a
  // pass over the keys).
  // bfloat16 keys on a CPU with bf16 dot products: pairs of dims, [Hkv, D / 2, ldk] (half the
  // bytes, and half the instructions per score).
  const bool dot = BLENDKV_BF16_DOT && dtype == at::kBFloat16 && D % 2 == 0;
  const int64_t D2 = D / 2;
  at::Tensor kt = dot ? at::empty({Hkv, D2, ldk}, q.options().dtype(at::kInt))
                      : at::empty({Hkv, D, ldk}, q.options().dtype(at::kFloat));
  kt.narrow(2, used, ldk - used).zero_();
  // Their values as pairs of keys, [Hkv, ldk / 2, D] (head dims a multiple of 64), for the
  // P.V dot products; else float32 (bfloat16 ones copied).
  const bool dotv = dot && D % 64 == 0;
  const int64_t ldk2 = ldk / 2;
  at::Tensor vbt = dotv ? at::empty({Hkv, ldk2, D, 2}, q.options().dtype(at::kBFloat16))
                        : at::Tensor();
  at::Tensor vf =
      dtype == at::kFloat || dotv ? values : values.narrow(0, 0, used).to(at::kFloat);
  float* ktp = dot ? nullptr : kt.data_ptr<float>();
  auto* ktb = dot ? reinterpret_cast<uint32_t*>(kt.data_ptr<int32_t>()) : nullptr;
  auto* vbp = dotv ? reinterpret_cast<uint16_t*>(vbt.data_ptr<c10::BFloat16>()) : nullptr;
  if (dotv && used % 2 != 0) {  // the pair of the last key: the key past it counts zero
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t d = 0; d < D; ++d) vbp[((h * ldk2 + used / 2) * D + d) * 2 + 1] = 0;
    }
  }
  constexpr int64_t TILE = 64;
  at::parallel_for(0, Hkv * ((used + TILE - 1) / TILE), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t h = t % Hkv, j0 = t / Hkv * TILE, j1 = std::min(used, j0 + TILE);
      for (int64_t j = j0; j < j1; ++j) {
        if (dot) {
          const auto* src = reinterpret_cast<const uint32_t*>(keys.data_ptr<c10::BFloat16>()) +
                            (j * Hkv + h) * D2;
          for (int64_t d2 = 0; d2 < D2; ++d2) ktb[(h * D2 + d2) * ldk + j] = src[d2];
          if (!dotv) continue;
          const auto* v = reinterpret_cast<const uint16_t*>(values.data_ptr<c10::BFloat16>()) +
                          (j * Hkv + h) * D;
          uint16_t* dst = vbp + (h * ldk2 + j / 2) * D * 2 + j % 2;
          for (int64_t d = 0; d < D; ++d) dst[2 * d] = v[d];
        } else if (dtype == at::kFloat) {
          const float* src = keys.data_ptr<float>() + (j * Hkv + h) * D;
          for (int64_t d = 0; d < D; ++d) ktp[(h * D + d) * ldk + j] = src[d];
        } else {
          const auto* src = keys.data_ptr<c10::BFloat16>() + (j * Hkv + h) * D;
          for (int64_t d = 0; d < D; ++d) ktp[(h * D + d) * ldk + j] = static_cast<float>(src[d]);
        }
      }
    }
  });
  // Blocks of at most block_rows rows; more, smaller ones while the tasks would not share out
  // evenly over the threads and are few (a last round with idle threads costs a whole task).
  const int64_t threads = at::get_num_threads();
  int64_t blocks = (n + block_rows - 1) / block_rows;
  while (blocks < n && (blocks * Hkv) % threads != 0 && blocks * Hkv < 4 * threads) ++blocks;
  const int64_t rows_per_block = (n + blocks - 1) / blocks;
  blocks = (n + rows_per_block - 1) / rows_per_block;
  RowsArgs a{q.data_ptr(), ktp, dotv ? nullptr : vf.data_ptr<float>(), ldk, Hkv * D, pp,
             out.data_ptr(), n, Hkv, q.size(1), q.size(1) / Hkv, D, rows_per_block,
             static_cast<float>(scale)};
  a.window = window;
  a.soft_cap = static_cast<float>(soft_cap);
  a.ktb = ktb;
  a.vb = dotv ? reinterpret_cast<const uint32_t*>(vbp) : nullptr;
  const int64_t num_tasks = blocks * a.num_kv_heads;
  const int64_t workers = std::min<int64_t>(threads, num_tasks);
  at::Tensor lse, parts;
  if (mass) {
    lse = at::empty({n, q.size(1)}, q.options().dtype(at::kFloat));
    a.lse = lse.data_ptr<float>();
    // Kept probabilities: a row per task, and each worker's rows of exps (run_rows').
    const int64_t mpad = (rows_per_block * a.group + RI - 1) / RI * RI;
    if ((num_tasks + workers * mpad) * ldk <= max_prob_floats) {
      parts = at::empty({num_tasks, ldk}, q.options().dtype(at::kFloat));
      a.mass_parts = parts.data_ptr<float>();
    }
  }
  // Longest context first: a task's cost grows with its last row's position.
  std::vector<int64_t> order(num_tasks);
  std::iota(order.begin(), order.end(), 0);
  auto last = [&](int64_t task) {
    return pp[std::min(n, (task % blocks) * rows_per_block + rows_per_block) - 1];
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return last(x) > last(y); });
  RowsQueue queue{order.data(), num_tasks};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    if (dtype == at::kFloat) {
      dispatch_rows<float>(a, queue);
    } else {
      dispatch_rows<c10::BFloat16>(a, queue);
    }
  });
  if (!mass) return;
  if (a.mass_parts != nullptr) {  // the tasks' sums, added in task order: the same every call
    float* mp = mass->data_ptr<float>();
    at::parallel_for(0, used, BK, [&](int64_t lo, int64_t hi) {
      std::vector<float> acc(hi - lo, 0.f);
      for (int64_t t = 0; t < num_tasks; ++t) {
        const float* part = a.mass_parts + t * ldk + lo;
#pragma omp simd
        for (int64_t j = 0; j < hi - lo; ++j) acc[j] += part[j];
      }
      for (int64_t j = lo; j < hi; ++j) mp[j] += acc[j - lo];
    });
    return;
  }
  // q per kv head as the attention pass's tasks stage it, its G heads' rows r-major ([Hkv, rows
  // padded to RI, D]): scaled to float32, or (bf16 dot products) the bfloat16 pairs as given.
  const int64_t G = a.group, mrows = (n * G + RI - 1) / RI * RI;
  at::Tensor qs = dot ? q.view(at::kInt) : q.to(at::kFloat) * static_cast<float>(scale);
  qs = qs.view({n, Hkv, G, dot ? D2 : D}).permute({1, 0, 2, 3}).reshape({Hkv, n * G, -1});
  qs = at::constant_pad_nd(qs, {0, 0, 0, mrows - n * G}).contiguous();
  add_mass(a, qs.data_ptr(), used, mass->data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blendkv_cpu, m) {
  m.def(
      "rows_attention(Tensor q, Tensor keys, Tensor values, Tensor positions, float scale, "
      "int block_rows, Tensor(a!) out, Tensor(b!)? mass=None, int window=0, "
      "float soft_cap=0.0, int max_prob_floats=16777216) -> ()");
  m.impl("rows_attention", c10::DispatchKey::CPU, TORCH_FN(rows_attention));
}
