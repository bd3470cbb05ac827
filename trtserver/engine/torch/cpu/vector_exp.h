// e^x eight floats at a time with AVX2 (kernels.cpp's softmax, int4.cpp's SiLU).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace trtserver_kernels {

// Cody-Waite's reduction to x = k ln 2 + r, Cephes' polynomial for e^r and 2^k written into the exponent bits
// (within ~2 ulp). x is clamped to [-87, 88], where 2^k stays a normal float; max_ps and min_ps return their
// second operand where either is NaN, so a NaN stays NaN, as std::exp keeps it.
inline __m256 exp8(__m256 x) {
  __m256 v = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  v = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), v);
  v = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), v);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, v, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, v), v, v), _mm256_set1_ps(1.f));
  const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_k));
}

}  // namespace trtserver_kernels
#endif
