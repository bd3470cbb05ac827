// Every decoder block of a float32 decode step in one call, on int4.cpp's int4 weights and kernels.cpp's fused
// norm, RoPE / K/V write and attention: what decode_layers.DecodeLayers._block computes on that path, call for
// call and bit for bit, without an op dispatch, a new tensor and interpreter work for each piece of each layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "checks.h"
#include "int4.h"
#include "kernel_rows.h"

using at::Tensor;
using at::TensorList;
using namespace trtserver_kernels;

namespace {

void check_cache(const Tensor& cache, const Tensor& first, const char* name) {
  check_activation(cache, at::kFloat, name);
  TORCH_CHECK(cache.dim() == 4 && cache.sizes() == first.sizes(), "int4_decode_layers: every K and V cache of one 4-d shape");
}

// x (rows, dim): the residual stream into the first block; returns it out of the last. Per layer: norms[2 l] and
// norms[2 l + 1] (attention, feed-forward), the int4 weights [4 l .. 4 l + 3] of wqkv, wo, w13 (gate then up),
// w2; cos / sin (rows, head_dim), each row's RoPE at its position.
Tensor int4_decode_layers(const Tensor& x, const Tensor& cos, const Tensor& sin, TensorList k_caches,
                          TensorList v_caches, const Tensor& slots, const Tensor& positions, TensorList norms,
                          TensorList packed, TensorList scales_mins, int64_t n_heads, int64_t n_kv_heads, double eps) {
  check_activation(x, at::kFloat, "int4_decode_layers x (float32)");
  check_activation(cos, at::kFloat, "int4_decode_layers cos");
  check_activation(sin, at::kFloat, "int4_decode_layers sin");
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(x.dim() == 2 && layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
              static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(packed.size()) == 4 * layers &&
              static_cast<int64_t>(scales_mins.size()) == 4 * layers,
              "int4_decode_layers: x (rows, dim); per layer a K and a V cache, two norms and four projections");
  const Tensor& first = k_caches[0];
  for (int64_t l = 0; l < layers; ++l) {
    check_cache(k_caches[l], first, "int4_decode_layers k_cache");
    check_cache(v_caches[l], first, "int4_decode_layers v_cache");
  }
  const int64_t B = x.size(0), dim = x.size(1), nh = n_heads, nkv = n_kv_heads;
  const int64_t hs = first.size(3), P = first.size(2), width = (nh + 2 * nkv) * hs;
  TORCH_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0 && first.size(1) == nkv && hs % 2 == 0,
              "int4_decode_layers: the caches' kv heads and head_dim disagree with the heads");
  TORCH_CHECK(cos.numel() == B * hs && sin.numel() == B * hs, "int4_decode_layers: cos/sin must be (rows, head_dim)");
  TORCH_CHECK(slots.device().is_cpu() && positions.device().is_cpu() && slots.numel() == B && positions.numel() == B,
              "int4_decode_layers: one slot and one position per row, on the CPU");
  const auto rows = cache_rows(slots, positions, first.size(0), P, "int4_decode_layers");
  const int64_t* sp = rows.sp;
  const int64_t* pp = rows.pp;
  const int64_t longest = rows.longest;
  // the feed-forward's width, from the first w2; every layer's is checked against it (the buffers' size)
  TORCH_CHECK(packed[3].dim() == 3 && packed[3].size(1) > 0, "int4_decode_layers: w2 must be int4 (N / 8, K / 32, 128)");
  const int64_t hidden = packed[3].size(1) * 32;
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t i = 0; i < 2; ++i) {
      check_activation(norms[2 * l + i], at::kFloat, "int4_decode_layers norm");
      TORCH_CHECK(norms[2 * l + i].numel() == dim, "int4_decode_layers: a norm's weight has dim elements");
    }
    const int64_t inputs[4] = {dim, nh * hs, dim, hidden}, outputs[4] = {width, dim, 2 * hidden, dim};
    for (int64_t p = 0; p < 4; ++p) {
      TORCH_CHECK(check_int4_weights(packed[4 * l + p], scales_mins[4 * l + p], inputs[p], "int4_decode_layers") ==
                  outputs[p], "int4_decode_layers: layer ", l, " projection ", p, " has the wrong output features");
    }
  }
  Tensor out = x.clone();
  float* h = out.mutable_data_ptr<float>();
  std::vector<float> qkv(B * width), q(B * nh * hs), gate_up(B * 2 * hidden);
  const float* cp = cos.const_data_ptr<float>();
  const float* snp = sin.const_data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  AttentionWork attention;  // every layer's the same split: the rows and their positions are the step's
  const int64_t threads = std::max(1, at::get_num_threads());
  plan_attention(attention, B, nh, nkv, hs, P, longest, threads);
  // One parallel region for the whole step, the threads meeting at a barrier between the pieces, instead of a
  // region (a fork and a join) for each projection and attention. What a projection reads (a norm, the attention's
  // merge, SiLU x up, and their scaling to int16) every thread computes for itself, the same bits on each: a few
  // microseconds, where one thread doing it for the others would cost a barrier more.
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#if defined(_OPENMP)
    const int64_t thread = omp_get_thread_num();
#else
    const int64_t thread = 0;
#endif
    std::vector<float> normed(B * dim), attended(B * nh * hs), gated(B * hidden);  // this thread's
    Int4Input input;  // this thread's copy of the projection's activations, scaled to int16
    // A projection's groups of 8 features go to the threads as they come for them, so that a thread the OS
    // preempts (for the server's event loop, a client, a neighbour) leaves the rest of its share to the other
    // instead of holding it at the barrier.
    const auto project = [&](const Tensor& w, const Tensor& s, int64_t N, float* y, bool accumulate) {
#pragma omp for schedule(guided, 8) nowait
      for (int64_t g = 0; g < N / 8; ++g) int4_groups(input, w, s, N, y, accumulate, g, g + 1);
    };
    for (int64_t l = 0; l < layers; ++l) {
      float* kc = k_caches[l].mutable_data_ptr<float>();
      float* vc = v_caches[l].mutable_data_ptr<float>();
      const Tensor* w = &packed[4 * l];
      const Tensor* s = &scales_mins[4 * l];
      rms_norm_rows(h, norms[2 * l].const_data_ptr<float>(), normed.data(), B, dim, epsilon);
      quantize_int4_input(normed.data(), B, dim, input);
      project(w[0], s[0], width, qkv.data(), false);
#pragma omp barrier
#pragma omp single
      rope_cache_rows(qkv.data(), cp, snp, q.data(), kc, vc, sp, pp, B, width, nh, nkv, hs, P);
      if (attention.threaded) {  // the tasks too go to the threads as they come for them
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t task = 0; task < attention.tasks(); ++task) {
          attention_tasks(attention, q.data(), kc, vc, sp, pp, task, task + 1);
        }
      } else if (thread == 0) {
        attention_tasks(attention, q.data(), kc, vc, sp, pp, 0, attention.tasks());
      }
#pragma omp barrier
      merge_attention(attention, attended.data());
      quantize_int4_input(attended.data(), B, nh * hs, input);
      project(w[1], s[1], dim, h, true);  // h + wo(attention)
#pragma omp barrier
      rms_norm_rows(h, norms[2 * l + 1].const_data_ptr<float>(), normed.data(), B, dim, epsilon);
      quantize_int4_input(normed.data(), B, dim, input);
      project(w[2], s[2], 2 * hidden, gate_up.data(), false);
#pragma omp barrier
      silu_times_up(gate_up.data(), B, hidden, gated.data());
      quantize_int4_input(gated.data(), B, hidden, input);
      project(w[3], s[3], dim, h, true);  // h + w2(SiLU(gate) * up)
#pragma omp barrier
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtserver, m) {
  m.def("int4_decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor slots, Tensor positions, Tensor[] norms, Tensor[] packed, Tensor[] scales_mins, int n_heads, "
        "int n_kv_heads, float eps) -> Tensor", &int4_decode_layers);
}
