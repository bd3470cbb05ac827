// What the CPU kernels (kernels.cpp, int4.cpp) check of their inputs.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace trtserver_kernels {

// A contiguous CPU tensor of the op's activation type (that of its first tensor: bfloat16 or float32).
inline void check_activation(const at::Tensor& t, at::ScalarType type, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (type == at::kBFloat16 || type == at::kFloat) && t.scalar_type() == type &&
              t.is_contiguous(), name, ": expected a contiguous CPU tensor in bfloat16 or float32, as the op's first");
}

// Each row's slot and position as int64, checked to lie inside caches of `slots` slots and `positions` positions.
struct CacheRows {
  at::Tensor slot, position;  // int64, contiguous: sp and pp point into them
  const int64_t* sp = nullptr;
  const int64_t* pp = nullptr;
  int64_t longest = 0;  // the largest position + 1
};
inline CacheRows cache_rows(const at::Tensor& slots, const at::Tensor& positions, int64_t n_slots, int64_t n_positions,
                            const char* op) {
  CacheRows rows;
  rows.slot = slots.to(at::kLong).contiguous();
  rows.position = positions.to(at::kLong).contiguous();
  rows.sp = rows.slot.const_data_ptr<int64_t>();
  rows.pp = rows.position.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < rows.slot.numel(); ++b) {
    TORCH_CHECK(rows.sp[b] >= 0 && rows.sp[b] < n_slots && rows.pp[b] >= 0 && rows.pp[b] < n_positions, op, ": row ",
                b, " points outside the cache");
    rows.longest = std::max(rows.longest, rows.pp[b] + 1);
  }
  return rows;
}

}  // namespace trtserver_kernels
