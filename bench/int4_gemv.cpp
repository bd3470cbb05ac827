// Two int4 GEMV kernels for small decode batches (1-4 rows), measured against ATen's
// _weight_int4pack_mm_for_cpu by bench/int4_gemv.py; not used by the engine (see bench/RESULTS.md).
// Both keep 16 output rows in the lanes of one AVX-512 register (no horizontal sums), with weights
// laid out so that one load feeds several dot-product instructions; groups of 32 along K, each with a
// bfloat16 scale and zero: w = (q - 8) * scale + zero, as ATen's kernel.
//   int4_mm_bf16: vdpbf16ps on bfloat16(128 + q) against the bfloat16 activations (their exact values). The
//     128 is taken back off after the sums, which cancels: with a transformer's outlier activations the
//     float32 sums lose bits. Wired into the fused one-row decode it agreed with ATen to ~2e-5 per projection
//     on random inputs, yet a real decode step's hidden state drifted 8.4 % from the eager one's after 30
//     layers (ATen's kernel there: 0.0 %). A lookup to bfloat16(q - 8) would avoid it, for more ops per weight.
//   int4_mm_int8: vpdpbusd on q against activations quantized to int8 per group of 32 (as llama.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

using at::BFloat16;
using at::Tensor;

namespace {
constexpr int64_t kGroup = 32, kBlock = 16, kMaxRows = 4;

inline __m512 bf16x16_to_f32(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline float f32(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// packed: (N / 16, G, 4, 64) bytes. Chunk c of group g of row block b: byte 16L + 8h + 2i + j (L, i < 4; h, j < 2)
// holds q[16b + 4L + i, 32g + 8c + 2h + j] in its low nibble and q[.., 32g + 8c + 4 + 2h + j] in its high one, the
// order in which vpunpck{l,h}bw with 0x43 bytes yields bf16(128 + q) pairs lane by lane. scales, zeros: (G, N).
Tensor int4_mm_bf16(const Tensor& x, const Tensor& packed, const Tensor& scales, const Tensor& zeros) {
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(1), G = K / kGroup;
  TORCH_CHECK(M >= 1 && M <= kMaxRows && K % kGroup == 0 && N % kBlock == 0, "int4_mm: 1-4 rows, K % 32, N % 16");
  Tensor y = at::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr<BFloat16>());
  std::vector<float> xs(static_cast<size_t>(M * G));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) s += f32(xp[m * K + g * kGroup + i]);
      xs[m * G + g] = s;
    }
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(zeros.const_data_ptr<BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.mutable_data_ptr<BFloat16>());
  const __m512i nib8 = _mm512_set1_epi8(0x0F), hib = _mm512_set1_epi8(0x43);  // bf16(128 + q) = 0x4300 | q
  at::parallel_for(0, N / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock;
      const uint8_t* w = wp + b * (K / 2) * kBlock;
      __m512 total[kMaxRows];
      for (int64_t m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        __m512 a0[kMaxRows], a1[kMaxRows], a2[kMaxRows], a3[kMaxRows];
        for (int64_t m = 0; m < M; ++m) a0[m] = a1[m] = a2[m] = a3[m] = _mm512_setzero_ps();
        for (int64_t c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(w);
          w += 64;
          const __m512i lo = _mm512_and_si512(v, nib8), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib8);
          const __m512bh wa = (__m512bh)_mm512_unpacklo_epi8(lo, hib), wb = (__m512bh)_mm512_unpackhi_epi8(lo, hib);
          const __m512bh wc = (__m512bh)_mm512_unpacklo_epi8(hi, hib), wd = (__m512bh)_mm512_unpackhi_epi8(hi, hib);
          for (int64_t m = 0; m < M; ++m) {
            const int* xk = reinterpret_cast<const int*>(xp + m * K + g * kGroup + 8 * c);
            a0[m] = _mm512_dpbf16_ps(a0[m], wa, (__m512bh)_mm512_set1_epi32(xk[0]));
            a1[m] = _mm512_dpbf16_ps(a1[m], wb, (__m512bh)_mm512_set1_epi32(xk[1]));
            a2[m] = _mm512_dpbf16_ps(a2[m], wc, (__m512bh)_mm512_set1_epi32(xk[2]));
            a3[m] = _mm512_dpbf16_ps(a3[m], wd, (__m512bh)_mm512_set1_epi32(xk[3]));
          }
        }
        const __m512 s = bf16x16_to_f32(sp + g * N + n0), z = bf16x16_to_f32(zp + g * N + n0);
        const __m512 cz = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, z);  // z - 8 s - 128 s
        for (int64_t m = 0; m < M; ++m) {
          const __m512 dot = _mm512_add_ps(_mm512_add_ps(a0[m], a1[m]), _mm512_add_ps(a2[m], a3[m]));
          total[m] = _mm512_fmadd_ps(dot, s, total[m]);
          total[m] = _mm512_fmadd_ps(cz, _mm512_set1_ps(xs[m * G + g]), total[m]);
        }
      }
      for (int64_t m = 0; m < M; ++m)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + m * N + n0), (__m256i)_mm512_cvtneps_pbh(total[m]));
    }
  });
  return y;
}

// packed: (N / 16, G, 4, 64) bytes; chunk c of group g of row block b: byte 4r + j holds q[16b + r, 32g + 8c + j]
// in its low nibble and q[16b + r, 32g + 8c + 4 + j] in its high one. x is quantized to int8 per group of 32.
Tensor int4_mm_int8(const Tensor& x, const Tensor& packed, const Tensor& scales, const Tensor& zeros) {
  const int64_t M = x.size(0), K = x.size(1), N = scales.size(1), G = K / kGroup;
  TORCH_CHECK(M >= 1 && M <= kMaxRows && K % kGroup == 0 && N % kBlock == 0, "int4_mm: 1-4 rows, K % 32, N % 16");
  Tensor y = at::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr<BFloat16>());
  std::vector<int8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> dx(static_cast<size_t>(M * G)), dxsum(static_cast<size_t>(M * G));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* xg = xp + m * K + g * kGroup;
      float amax = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(f32(xg[i])));
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < kGroup; ++i) {
        const int v = static_cast<int>(std::nearbyint(f32(xg[i]) * inv));
        xq[m * K + g * kGroup + i] = static_cast<int8_t>(v);
        sum += v;
      }
      dx[m * G + g] = d;
      dxsum[m * G + g] = d * static_cast<float>(sum);
    }
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(zeros.const_data_ptr<BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.mutable_data_ptr<BFloat16>());
  const __m512i nib8 = _mm512_set1_epi8(0x0F);
  at::parallel_for(0, N / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock;
      const uint8_t* w = wp + b * (K / 2) * kBlock;
      __m512 total[kMaxRows];
      for (int64_t m = 0; m < M; ++m) total[m] = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        __m512i a0[kMaxRows], a1[kMaxRows];
        for (int64_t m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_si512();
        for (int64_t c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(w);
          w += 64;
          const __m512i lo = _mm512_and_si512(v, nib8), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib8);
          for (int64_t m = 0; m < M; ++m) {
            const int* xk = reinterpret_cast<const int*>(xq.data() + m * K + g * kGroup + 8 * c);
            a0[m] = _mm512_dpbusd_epi32(a0[m], lo, _mm512_set1_epi32(xk[0]));
            a1[m] = _mm512_dpbusd_epi32(a1[m], hi, _mm512_set1_epi32(xk[1]));
          }
        }
        const __m512 s = bf16x16_to_f32(sp + g * N + n0), z = bf16x16_to_f32(zp + g * N + n0);
        const __m512 cz = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);  // z - 8 s
        for (int64_t m = 0; m < M; ++m) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a0[m], a1[m]));
          total[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(dx[m * G + g])), total[m]);
          total[m] = _mm512_fmadd_ps(cz, _mm512_set1_ps(dxsum[m * G + g]), total[m]);
        }
      }
      for (int64_t m = 0; m < M; ++m)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + m * N + n0), (__m256i)_mm512_cvtneps_pbh(total[m]));
    }
  });
  return y;
}
}  // namespace

TORCH_LIBRARY(trtserver_bench_int4, m) {
  m.def("int4_mm_bf16(Tensor x, Tensor packed, Tensor scales, Tensor zeros) -> Tensor", &int4_mm_bf16);
  m.def("int4_mm_int8(Tensor x, Tensor packed, Tensor scales, Tensor zeros) -> Tensor", &int4_mm_int8);
}
