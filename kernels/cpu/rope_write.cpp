// A stored chunk's K/V written into the KV pool on the CPU, K rotated to the chunk's positions in
// this prompt on the way: one pass over the source, one call per chunk and layer range
// (the blend's layer-wise loading; CpuBlendKernels.load_rotated_kv).
//
// Built with the attention kernels by blendkv/kernels/cpu_extension.py; the reference it must
// match bit for bit is blend_kernels.load_rotated_reference (RoPE in the K/V dtype, HF
// rotate_half, then write_kv).
//
//   kv        [L', 2, T, H, D]  K before RoPE (index 0) and V (index 1), contiguous
//   pools     L'' tensors [2, blocks, block_size, H, D] (the layers' KV pools), contiguous;
//             layer first_layer + i receives kv[i]
//   positions [T] int64         each token's position in this prompt (a row of cos and sin)
//   slots     [T] int64         each token's slot in the pool
//   cos, sin  [P, D] float32    rotary tables, both halves stored
//
// K: out[:half] = k1 c1 - k2 s1 and out[half:] = k2 c2 + k1 s2, each product and the sum rounded
// to the K/V dtype as torch's elementwise ops round them (the tables rounded to it first), so
// the bits equal the reference's: this file is compiled without fast-math and without
// contracting a product and a sum into one FMA. V: copied. A call for one layer (the loading
// thread's, beside the forward's threads) runs in the caller's thread; a call for a chunk's
// layers (everything loaded before the forward) splits them across torch's threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "bf16.h"  // last: fast-math off from here on

namespace {

using blendkv_cpu::round_to;
using blendkv_cpu::to_float;

// K rotated into the pool: d1 = k1 c1 - k2 s1, d2 = k2 c2 + k1 s2 (c, s: the token's table rows
// in the K/V dtype), each product and sum rounded to T as torch rounds them.
template <typename T>
inline void rotate_head(const T* k1, const T* k2, const T* c, const T* s, T* d1, T* d2,
                        int64_t half) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = to_float(k1[j]), b = to_float(k2[j]);
    const T p1 = round_to<T>(a * to_float(c[j]));
    const T p2 = round_to<T>(b * to_float(s[j]));
    const T p3 = round_to<T>(b * to_float(c[half + j]));
    const T p4 = round_to<T>(a * to_float(s[half + j]));
    d1[j] = round_to<T>(to_float(p1) - to_float(p2));
    d2[j] = round_to<T>(to_float(p3) + to_float(p4));
  }
}

// The token's table rows, rounded to T (as the reference casts the tables to the K/V dtype).
template <typename T>
inline void table_rows(const float* cos, const float* sin, int64_t position, int64_t D, T* c,
                       T* s) {
  const float* cr = cos + position * D;
  const float* sr = sin + position * D;
  for (int64_t d = 0; d < D; ++d) {
    c[d] = round_to<T>(cr[d]);
    s[d] = round_to<T>(sr[d]);
  }
}

template <typename T>
void write_layer(const T* k, const T* v, T* pool, int64_t pool_slots, const int64_t* positions,
                 const int64_t* slots, const float* cos, const float* sin, int64_t T_, int64_t H,
                 int64_t D) {
  const int64_t half = D / 2, row = H * D;
  T c[512], s[512];  // this token's table rows, in the K/V dtype (D <= 512, checked)
  for (int64_t t = 0; t < T_; ++t) {
    table_rows(cos, sin, positions[t], D, c, s);
    T* dk = pool + slots[t] * row;
    T* dv = pool + (pool_slots + slots[t]) * row;
    const T* sk = k + t * row;
    for (int64_t h = 0; h < H; ++h) {
      const T* k1 = sk + h * D;
      rotate_head(k1, k1 + half, c, s, dk + h * D, dk + h * D + half, half);
    }
    std::memcpy(dv, v + t * row, row * sizeof(T));
  }
}

void rope_write_kv(const at::Tensor& kv, at::TensorList pools, int64_t first_layer,
                   const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& cos,
                   const at::Tensor& sin) {
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.is_contiguous(),
              "rope_write_kv: kv must be contiguous [L, 2, T, H, D]");
  const int64_t L = kv.size(0), T_ = kv.size(2), H = kv.size(3), D = kv.size(4);
  const auto dtype = kv.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "rope_write_kv: float32 or bfloat16 only");
  TORCH_CHECK(D % 2 == 0 && D <= 512, "rope_write_kv: head_dim must be even and <= 512");
  TORCH_CHECK(first_layer >= 0 && first_layer + L <= static_cast<int64_t>(pools.size()),
              "rope_write_kv: layers out of range");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slots.is_contiguous() && positions.numel() == T_ &&
                  slots.numel() == T_,
              "rope_write_kv: positions and slots must be contiguous int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) == D && sin.sizes() == cos.sizes(),
              "rope_write_kv: cos and sin must be contiguous float32 [P, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rope_write_kv: position out of the table");
  }
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor& pool = pools[first_layer + i];
    TORCH_CHECK(pool.scalar_type() == dtype && pool.is_contiguous() && pool.dim() == 5 &&
                    pool.size(0) == 2 && pool.size(3) == H && pool.size(4) == D,
                "rope_write_kv: pools must be contiguous [2, blocks, block_size, H, D] of kv's "
                "dtype");
    const int64_t pool_slots = pool.size(1) * pool.size(2);
    for (int64_t t = 0; t < T_; ++t) {
      TORCH_CHECK(sl[t] >= 0 && sl[t] < pool_slots, "rope_write_kv: slot out of the pool");
    }
  }
  // Layers in parallel: one layer (the loading thread's calls) runs inline in the caller's
  // thread; a chunk's layers all at once (loading before the forward) use torch's threads.
  const int64_t stride = T_ * H * D;  // kv[i, 0] and kv[i, 1]
  at::parallel_for(0, L, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const at::Tensor& pool = pools[first_layer + i];
      const int64_t pool_slots = pool.size(1) * pool.size(2);
      if (dtype == at::kFloat) {
        const float* src = kv.data_ptr<float>() + i * 2 * stride;
        write_layer<float>(src, src + stride, pool.data_ptr<float>(), pool_slots, pos, sl,
                           cos.data_ptr<float>(), sin.data_ptr<float>(), T_, H, D);
      } else {
        const auto* src = kv.data_ptr<c10::BFloat16>() + i * 2 * stride;
        write_layer<c10::BFloat16>(src, src + stride, pool.data_ptr<c10::BFloat16>(),
                                   pool_slots, pos, sl, cos.data_ptr<float>(),
                                   sin.data_ptr<float>(), T_, H, D);
      }
    }
  });
}

// ---- decode while loading ------------------------------------------------------------------
// An encoded chunk (blendkv.kernels.kv_decode.EncodedChunk, store/codecs.py) is decoded row by
// row into a small buffer and written like write_layer writes a raw one: no decoded copy of the
// chunk. Each of K and V is a group-wise affine code,
//   x[l, t, h, d] = (q[l, t, h, d] - zero[l, t / gt, h, d / gd]) * scale[l, t / gt, h, d / gd]
// in float32 (scale, zero given as float32: exact widenings of the stored halves), cast once to
// the pool dtype; q int8 [L, T, H, D] (bits 8) or two unsigned 4-bit codes a byte along D
// [L, T, H, D / 2] (bits 4; low nibble = even d, signed nibbles in [-8, 7]). Outlier (layer, head)
// pairs (outlier_index >= 0: a row of outlier_k / outlier_v [N, T, D], in the pool dtype) take
// those values instead. The reference: blendkv.store.codecs.decode_reference.

struct Code {
  const int8_t* q8 = nullptr;
  const uint8_t* q4 = nullptr;
  const float* scale;
  const float* zero;  // nullptr: symmetric
  int64_t gt, gd, groups_t, groups_d;
};

Code make_code(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero, int64_t gt,
               int64_t gd, int64_t bits, int64_t L, int64_t T_, int64_t H, int64_t D,
               const char* name) {
  TORCH_CHECK(bits == 8 || bits == 4, "dequant_rope_write_kv: ", name, " bits must be 8 or 4");
  TORCH_CHECK(gt >= 1 && gd >= 1, "dequant_rope_write_kv: ", name, " group sizes must be >= 1");
  const int64_t qd = bits == 8 ? D : D / 2;
  TORCH_CHECK(q.is_contiguous() && q.dim() == 4 && q.size(0) == L && q.size(1) == T_ &&
                  q.size(2) == H && q.size(3) == qd &&
                  q.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "dequant_rope_write_kv: ", name,
              " codes must be contiguous int8 [L, T, H, D] (8 bits) or uint8 [L, T, H, D/2]");
  Code c;
  c.gt = gt;
  c.gd = gd;
  c.groups_t = (T_ + gt - 1) / gt;
  c.groups_d = (D + gd - 1) / gd;
  const std::vector<int64_t> want{L, c.groups_t, H, c.groups_d};
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.sizes() == at::IntArrayRef(want),
              "dequant_rope_write_kv: ", name,
              " scale must be contiguous float32 [L, ceil(T/gt), H, ceil(D/gd)]");
  TORCH_CHECK(zero.numel() == 0 || (zero.scalar_type() == at::kFloat && zero.is_contiguous() &&
                                    zero.sizes() == scale.sizes()),
              "dequant_rope_write_kv: ", name, " zero must be empty or shaped as its scale");
  if (bits == 8) {
    c.q8 = q.data_ptr<int8_t>();
  } else {
    c.q4 = q.data_ptr<uint8_t>();
  }
  c.scale = scale.data_ptr<float>();
  c.zero = zero.numel() ? zero.data_ptr<float>() : nullptr;
  return c;
}

// Row (l, t, h) of a code, decoded into out[D] in the pool dtype.
template <typename T>
inline void decode_row(const Code& c, int64_t l, int64_t t, int64_t h, int64_t T_, int64_t H,
                       int64_t D, T* out) {
  const int64_t g = ((l * c.groups_t + t / c.gt) * H + h) * c.groups_d;
  const float* sc = c.scale + g;
  const float* ze = c.zero ? c.zero + g : nullptr;
  const int64_t row = (l * T_ + t) * H + h;
  float code[512];
  if (c.q8) {
    const int8_t* q = c.q8 + row * D;
    for (int64_t d = 0; d < D; ++d) code[d] = static_cast<float>(q[d]);
  } else {
    const uint8_t* q = c.q4 + row * (D / 2);
    for (int64_t j = 0; j < D / 2; ++j) {  // two's-complement nibbles, sign-extended
      code[2 * j] = static_cast<float>(static_cast<int8_t>(q[j] << 4) >> 4);
      code[2 * j + 1] = static_cast<float>(static_cast<int8_t>(q[j]) >> 4);
    }
  }
  if (ze) {
    for (int64_t d = 0; d < D; ++d) {
      const int64_t i = d / c.gd;
      out[d] = round_to<T>((code[d] - ze[i]) * sc[i]);
    }
  } else {
    for (int64_t d = 0; d < D; ++d) out[d] = round_to<T>(code[d] * sc[d / c.gd]);
  }
}

template <typename T>
void decode_layer(const Code& k, const Code& v, int64_t l, const int64_t* outlier_index,
                  const T* outlier_k, const T* outlier_v, int64_t token_lo, T* pool,
                  int64_t pool_slots, const int64_t* positions, const int64_t* slots,
                  const float* cos, const float* sin, int64_t n, int64_t T_, int64_t H,
                  int64_t D) {
  const int64_t half = D / 2, row = H * D;
  T c[512], s[512], kb[512];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = token_lo + i;
    table_rows(cos, sin, positions[i], D, c, s);
    T* dk = pool + slots[i] * row;
    T* dv = pool + (pool_slots + slots[i]) * row;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t o = outlier_index ? outlier_index[l * H + h] : -1;
      const T* src = kb;
      if (o >= 0 && outlier_k) {
        src = outlier_k + (o * T_ + t) * D;
      } else {
        decode_row(k, l, t, h, T_, H, D, kb);
      }
      rotate_head(src, src + half, c, s, dk + h * D, dk + h * D + half, half);
      if (o >= 0 && outlier_v) {
        std::memcpy(dv + h * D, outlier_v + (o * T_ + t) * D, D * sizeof(T));
      } else {
        decode_row(v, l, t, h, T_, H, D, dv + h * D);
      }
    }
  }
}

void dequant_rope_write_kv(const at::Tensor& kq, const at::Tensor& kscale, const at::Tensor& kzero,
                          int64_t kgt, int64_t kgd, int64_t kbits, const at::Tensor& vq,
                          const at::Tensor& vscale, const at::Tensor& vzero, int64_t vgt,
                          int64_t vgd, int64_t vbits, const at::Tensor& outlier_index,
                          const at::Tensor& outlier_k, const at::Tensor& outlier_v,
                          int64_t token_lo, int64_t head_dim, at::TensorList pools,
                          int64_t first_layer, const at::Tensor& positions,
                          const at::Tensor& slots, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(kq.dim() == 4, "dequant_rope_write_kv: codes must be [L, T, H, *]");
  const int64_t L = kq.size(0), T_ = kq.size(1), H = kq.size(2), D = head_dim;
  const int64_t n = positions.numel();
  TORCH_CHECK(D % 2 == 0 && D <= 512, "dequant_rope_write_kv: head_dim must be even and <= 512");
  TORCH_CHECK(token_lo >= 0 && token_lo + n <= T_, "dequant_rope_write_kv: tokens out of range");
  TORCH_CHECK(first_layer >= 0 && first_layer + L <= static_cast<int64_t>(pools.size()),
              "dequant_rope_write_kv: layers out of range");
  const Code k = make_code(kq, kscale, kzero, kgt, kgd, kbits, L, T_, H, D, "K");
  const Code v = make_code(vq, vscale, vzero, vgt, vgd, vbits, L, T_, H, D, "V");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slots.is_contiguous() && slots.numel() == n,
              "dequant_rope_write_kv: positions and slots must be contiguous int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) == D && sin.sizes() == cos.sizes(),
              "dequant_rope_write_kv: cos and sin must be contiguous float32 [P, head_dim]");
  const auto dtype = pools[first_layer].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "dequant_rope_write_kv: float32 or bfloat16 pools only");
  const int64_t* oi = nullptr;
  int64_t num_outliers = 0;
  if (outlier_index.numel()) {
    TORCH_CHECK(outlier_index.scalar_type() == at::kLong && outlier_index.is_contiguous() &&
                    outlier_index.numel() == L * H,
                "dequant_rope_write_kv: outlier_index must be contiguous int64 [L, H]");
    oi = outlier_index.data_ptr<int64_t>();
  }
  for (const at::Tensor* o : {&outlier_k, &outlier_v}) {
    if (o->numel() == 0) continue;
    TORCH_CHECK(oi && o->scalar_type() == dtype && o->is_contiguous() && o->dim() == 3 &&
                    o->size(1) == T_ && o->size(2) == D,
                "dequant_rope_write_kv: outlier values must be contiguous [N, T, head_dim] of "
                "the pool dtype, with an outlier_index");
    num_outliers = o->size(0);
  }
  if (oi) {
    for (int64_t i = 0; i < L * H; ++i) {
      TORCH_CHECK(oi[i] < num_outliers, "dequant_rope_write_kv: outlier index out of range");
    }
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0),
                "dequant_rope_write_kv: position out of the table");
  }
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor& pool = pools[first_layer + i];
    TORCH_CHECK(pool.scalar_type() == dtype && pool.is_contiguous() && pool.dim() == 5 &&
                    pool.size(0) == 2 && pool.size(3) == H && pool.size(4) == D,
                "dequant_rope_write_kv: pools must be contiguous [2, blocks, block_size, H, D] "
                "of one dtype");
    const int64_t pool_slots = pool.size(1) * pool.size(2);
    for (int64_t t = 0; t < n; ++t) {
      TORCH_CHECK(sl[t] >= 0 && sl[t] < pool_slots, "dequant_rope_write_kv: slot out of the pool");
    }
  }
  at::parallel_for(0, L, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const at::Tensor& pool = pools[first_layer + i];
      const int64_t pool_slots = pool.size(1) * pool.size(2);
      if (dtype == at::kFloat) {
        decode_layer<float>(k, v, i, oi,
                            outlier_k.numel() ? outlier_k.data_ptr<float>() : nullptr,
                            outlier_v.numel() ? outlier_v.data_ptr<float>() : nullptr, token_lo,
                            pool.data_ptr<float>(), pool_slots, pos, sl, cos.data_ptr<float>(),
                            sin.data_ptr<float>(), n, T_, H, D);
      } else {
        using B = c10::BFloat16;
        decode_layer<B>(k, v, i, oi, outlier_k.numel() ? outlier_k.data_ptr<B>() : nullptr,
                        outlier_v.numel() ? outlier_v.data_ptr<B>() : nullptr, token_lo,
                        pool.data_ptr<B>(), pool_slots, pos, sl, cos.data_ptr<float>(),
                        sin.data_ptr<float>(), n, T_, H, D);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blendkv_cpu, m) {
  m.def(
      "rope_write_kv(Tensor kv, Tensor(a!)[] pools, int first_layer, Tensor positions, "
      "Tensor slots, Tensor cos, Tensor sin) -> ()");
  m.impl("rope_write_kv", c10::DispatchKey::CPU, TORCH_FN(rope_write_kv));
  m.def(
      "dequant_rope_write_kv(Tensor kq, Tensor kscale, Tensor kzero, int kgt, int kgd, int kbits, "
      "Tensor vq, Tensor vscale, Tensor vzero, int vgt, int vgd, int vbits, "
      "Tensor outlier_index, Tensor outlier_k, Tensor outlier_v, int token_lo, int head_dim, "
      "Tensor(a!)[] pools, int first_layer, Tensor positions, Tensor slots, Tensor cos, "
      "Tensor sin) -> ()");
  m.impl("dequant_rope_write_kv", c10::DispatchKey::CPU, TORCH_FN(dequant_rope_write_kv));
}
