// What the CPU kernels (kernels.cpp, int4.cpp) check of their inputs.
#pragma once

#include <ATen/ATen.h>

namespace trtserver_kernels {

// A contiguous CPU tensor of the op's activation type (that of its first tensor: bfloat16 or float32).
inline void check_activation(const at::Tensor& t, at::ScalarType type, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (type == at::kBFloat16 || type == at::kFloat) && t.scalar_type() == type &&
              t.is_contiguous(), name, ": expected a contiguous CPU tensor in bfloat16 or float32, as the op's first");
}

}  // namespace trtserver_kernels
