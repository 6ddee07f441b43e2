// A stored chunk's K/V written into the KV pool on the CPU, K rotated to the chunk's positions in
// this prompt on the way: one pass over the source, one call per chunk and layer range
// (the blend's layer-wise loading; TorchAttentionBackend.load_rotated_kv).
//
// Built with the attention kernels by blendkv/kernels/cpu_extension.py; the reference it must
// match bit for bit is AttentionBackend.load_rotated_kv (RoPE in the K/V dtype, HF rotate_half,
// then write_kv).
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

#include "bf16.h"  // last: fast-math off from here on

namespace {

using blendkv_cpu::round_to;
using blendkv_cpu::to_float;

template <typename T>
void write_layer(const T* k, const T* v, T* pool, int64_t pool_slots, const int64_t* positions,
                 const int64_t* slots, const float* cos, const float* sin, int64_t T_, int64_t H,
                 int64_t D) {
  const int64_t half = D / 2, row = H * D;
  T c[512], s[512];  // this token's table rows, in the K/V dtype (D <= 512, checked)
  for (int64_t t = 0; t < T_; ++t) {
    const float* cr = cos + positions[t] * D;
    const float* sr = sin + positions[t] * D;
    for (int64_t d = 0; d < D; ++d) {
      c[d] = round_to<T>(cr[d]);
      s[d] = round_to<T>(sr[d]);
    }
    T* dk = pool + slots[t] * row;
    T* dv = pool + (pool_slots + slots[t]) * row;
    const T* sk = k + t * row;
    for (int64_t h = 0; h < H; ++h) {
      const T* k1 = sk + h * D;
      const T* k2 = k1 + half;
      T* d1 = dk + h * D;
      T* d2 = d1 + half;
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(blendkv_cpu, m) {
  m.def(
      "rope_write_kv(Tensor kv, Tensor(a!)[] pools, int first_layer, Tensor positions, "
      "Tensor slots, Tensor cos, Tensor sin) -> ()");
  m.impl("rope_write_kv", c10::DispatchKey::CPU, TORCH_FN(rope_write_kv));
}
