// int4.cpp's projection, for the ops built on it (decode_stack.cpp): weights in weights.int4_kernel_layout.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace trtserver_kernels {

// The int4 weights' checks for K input features; returns N, their output features.
int64_t check_int4_weights(const at::Tensor& packed, const at::Tensor& scales_mins, int64_t K, const char* op);

// y (rows, N) = x (rows, K) W^T, float32, or y += x W^T with `accumulate` (a residual added as the sums are
// stored, the same float addition as y + x W^T): each block of x scaled to int16, then the groups in parallel.
void int4_project_into(const float* x, int64_t rows, int64_t K, const at::Tensor& packed,
                       const at::Tensor& scales_mins, int64_t N, float* y, bool accumulate);

// out (rows, K) = SiLU(gate) * up for gate_up (rows, 2K) holding gate then up, vector_exp.h's e^x with AVX2.
void silu_times_up(const float* gate_up, int64_t rows, int64_t K, float* out);

}  // namespace trtserver_kernels
