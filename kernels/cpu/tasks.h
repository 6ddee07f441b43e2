// What blendkv's CPU attention kernels share: the task queue torch's threads draw from, and
// the (query heads per KV head, head dim) pairs compiled with constant sizes.
#pragma once

#include <atomic>
#include <cstdint>

namespace blendkv_cpu {

// Tasks handed out in `order` (longest first) to whichever thread frees up first.
struct TaskQueue {
  const int64_t* order;
  int64_t size;
  int64_t heads = 1;  // kv heads per task (the decode kernel's; 1 elsewhere)
  std::atomic<int64_t> next{0};
};

}  // namespace blendkv_cpu

// CASE(G, D) for each (group, head dim) pair compiled with constant sizes; any other pair takes
// the kernel's generic loop.
#define BLENDKV_CONSTANT_SHAPES(CASE)                                                         \
  CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(7, 64) CASE(8, 64) CASE(1, 128)        \
  CASE(2, 128) CASE(4, 128) CASE(7, 128) CASE(8, 128)
