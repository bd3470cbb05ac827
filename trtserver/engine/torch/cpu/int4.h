// int4.cpp's projection, for the ops built on it (decode_stack.cpp): weights in weights.int4_kernel_layout.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace trtserver_kernels {

// The int4 weights' checks for K input features; returns N, their output features.
int64_t check_int4_weights(const at::Tensor& packed, const at::Tensor& scales_mins, int64_t K, const char* op);

// x (rows, K), float32, with each block of 32 scaled to int16 by its largest magnitude: what the groups read.
struct Int4Input {
  const float* x = nullptr;
  int64_t rows = 0, K = 0;
  std::vector<float> block_sums, block_scales;  // (rows, K / 32)
  std::vector<int16_t> quantized;               // (rows, K)
};
void quantize_int4_input(const float* x, int64_t rows, int64_t K, Int4Input& in);

// Output features [8 g0, 8 g1) of y (rows, N) = x W^T (+= with `accumulate`), on the calling thread.
void int4_groups(const Int4Input& in, const at::Tensor& packed, const at::Tensor& scales_mins, int64_t N, float* y,
                 bool accumulate, int64_t g0, int64_t g1);

// y (rows, N) = x (rows, K) W^T, float32, or y += x W^T with `accumulate` (a residual added as the sums are
// stored, the same float addition as y + x W^T): quantize_int4_input, then the groups in parallel.
void int4_project_into(const float* x, int64_t rows, int64_t K, const at::Tensor& packed,
                       const at::Tensor& scales_mins, int64_t N, float* y, bool accumulate);

// out (rows, K) = SiLU(gate) * up for gate_up (rows, 2K) holding gate then up, vector_exp.h's e^x with AVX2.
void silu_times_up(const float* gate_up, int64_t rows, int64_t K, float* out);

}  // namespace trtserver_kernels
