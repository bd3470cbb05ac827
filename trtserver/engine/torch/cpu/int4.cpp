// Weight-only int4 projections for small decode batches (cpu/weights.py's Int4Linear in its kernel layout).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "checks.h"

using at::Tensor;
using trtserver_kernels::check_activation;

namespace {

// Weight-only int4 for small batches: w[n][k] = q * scale + min, in blocks of 32 along k, each block's 32 values
// as 16 bytes (byte j: value j in its low nibble, value j + 16 in its high one). y[r][n] = sum over blocks of
// scale * (q . x) + min * sum(x), the sums of x in float32. With AVX2, q . x multiplies int16s: each block of x
// is scaled to int16 by its largest magnitude (within 2^-16 of it, where bfloat16 rounds each value to 2^-9),
// so a block takes two vpmaddwd instead of widening every nibble to float. R rows share each block's unpacking.
struct Int4Activations {
  const float* x;            // (rows, K) float32
  const float* block_sums;   // (rows, K / 32)
  const int16_t* quantized;  // (rows, K) with AVX2: x / block_scales, rounded
  const float* block_scales; // (rows, K / 32)
};

template <int R>
void int4_rows(const Int4Activations& a, const uint8_t* packed, const float* scales_mins, float* y, int64_t K,
               int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = packed + n * (K / 2);
    const float* sc = scales_mins + n * G * 2;  // the row's G scales, then its G mins
    const float* mn = sc + G;
    float total[R];
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[2][R];  // even and odd blocks: two FMA chains a row, not one
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    const __m128i nibble = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < G; ++g) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16));
      const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, nibble));
      const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
      for (int r = 0; r < R; ++r) {
        const int16_t* xq = a.quantized + r * K + g * 32;
        const __m256i dot = _mm256_add_epi32(
            _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))),
            _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16))));
        __m256& chain = acc[g & 1][r];
        chain = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(sc[g] * a.block_scales[r * G + g]), chain);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 both = _mm256_add_ps(acc[0][r], acc[1][r]);
      const __m128 half = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
      const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
      total[r] = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
    }
#else
    for (int r = 0; r < R; ++r) total[r] = 0.f;
    float q[32];
    for (int64_t g = 0; g < G; ++g) {
      for (int j = 0; j < 16; ++j) {
        q[j] = static_cast<float>(w[g * 16 + j] & 0x0F);
        q[j + 16] = static_cast<float>(w[g * 16 + j] >> 4);
      }
      for (int r = 0; r < R; ++r) {
        const float* xr = a.x + r * K + g * 32;
        float d = 0.f;
        for (int j = 0; j < 32; ++j) d += q[j] * xr[j];
        total[r] += d * sc[g];
      }
    }
#endif
    for (int r = 0; r < R; ++r) {
      const float* sums = a.block_sums + r * G;
      float offset = 0.f;
#pragma omp simd reduction(+ : offset)
      for (int64_t g = 0; g < G; ++g) offset += mn[g] * sums[g];
      y[r * N + n] = total[r] + offset;
    }
  }
}

Tensor int4_linear(const Tensor& x, const Tensor& packed, const Tensor& scales_mins) {
  const auto type = x.scalar_type();
  check_activation(x, type, "int4_linear x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "int4_linear: x must be (rows, K), K a multiple of 32");
  const int64_t rows = x.size(0), K = x.size(1), G = K / 32;
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.dim() == 2 && packed.size(1) == K / 2, "int4_linear: packed must be contiguous uint8 (N, K / 2)");
  const int64_t N = packed.size(0);
  TORCH_CHECK(scales_mins.device().is_cpu() && scales_mins.scalar_type() == at::kFloat && scales_mins.is_contiguous() &&
              scales_mins.dim() == 3 && scales_mins.size(0) == N && scales_mins.size(1) == 2 && scales_mins.size(2) == G,
              "int4_linear: scales_mins must be contiguous float32 (N, 2, K / 32): each row's scales, then its mins");
  const Tensor xf = type == at::kFloat ? x : x.to(at::kFloat);
  const float* xp = xf.const_data_ptr<float>();
  std::vector<float> block_sums(rows * G), block_scales(rows * G);
  std::vector<int16_t> quantized(rows * K);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xb = xp + r * K + g * 32;
      float sum = 0.f, largest = 0.f;
      for (int64_t j = 0; j < 32; ++j) {
        sum += xb[j];
        largest = std::max(largest, std::fabs(xb[j]));
      }
      block_sums[r * G + g] = sum;
      // a block below 1e-30 (or NaN) contributes its min term only: 32767 / largest would overflow
      const bool scaled = largest > 1e-30f;
      block_scales[r * G + g] = scaled ? largest / 32767.f : 0.f;
      const float inverse = scaled ? 32767.f / largest : 0.f;
      for (int64_t j = 0; j < 32; ++j) {
        const float q = std::min(32767.f, std::max(-32767.f, std::nearbyint(xb[j] * inverse)));
        quantized[r * K + g * 32 + j] = static_cast<int16_t>(q);
      }
    }
  }
  Tensor y = at::empty({rows, N}, x.options().dtype(at::kFloat));
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const float* sp = scales_mins.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  // each task takes output features for every row: the weights, the bulk of the bytes, are read once
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < rows; r += 4) {
      const Int4Activations a{xp + r * K, block_sums.data() + r * G, quantized.data() + r * K,
                              block_scales.data() + r * G};
      float* yr = yp + r * N;
      switch (std::min<int64_t>(4, rows - r)) {
        case 1: int4_rows<1>(a, wp, sp, yr, K, N, n0, n1); break;
        case 2: int4_rows<2>(a, wp, sp, yr, K, N, n0, n1); break;
        case 3: int4_rows<3>(a, wp, sp, yr, K, N, n0, n1); break;
        default: int4_rows<4>(a, wp, sp, yr, K, N, n0, n1); break;
      }
    }
  });
  return type == at::kFloat ? y : y.to(type);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtserver, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_mins) -> Tensor", &int4_linear);
}
