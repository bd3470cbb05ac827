// e^x 8 floats at a time with AVX2 and 16 with AVX-512 (kernels.cpp's softmax, int4.cpp's SiLU).
#pragma once

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace trtserver_kernels {
namespace exp_detail {

// The vector operations the polynomial needs, for one register width V whose intrinsics begin with PREFIX.
#define TRTSERVER_EXP_OPS(V, PREFIX, ROUND)                                                          \
  inline V splat(V, float c) { return PREFIX##_set1_ps(c); }                                        \
  inline V mul(V a, V b) { return PREFIX##_mul_ps(a, b); }                                          \
  inline V add(V a, V b) { return PREFIX##_add_ps(a, b); }                                          \
  inline V fmadd(V a, V b, V c) { return PREFIX##_fmadd_ps(a, b, c); }                              \
  inline V fnmadd(V a, V b, V c) { return PREFIX##_fnmadd_ps(a, b, c); }                            \
  inline V nearest(V a) { return PREFIX##_##ROUND##_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#if defined(__AVX2__) && defined(__FMA__)
TRTSERVER_EXP_OPS(__m256, _mm256, round)
#endif
#if defined(__AVX512F__)
TRTSERVER_EXP_OPS(__m512, _mm512, roundscale)
#endif
#undef TRTSERVER_EXP_OPS

// Cody-Waite's reduction of x to k ln 2 + r and Cephes' polynomial for e^r (within ~2 ulp): returns e^r, and k.
template <typename V>
inline V reduced_exp(V x, V& k) {
  k = nearest(mul(x, splat(x, 1.44269504088896341f)));
  x = fnmadd(k, splat(x, 0.693359375f), x);
  x = fnmadd(k, splat(x, -2.12194440e-4f), x);
  V p = splat(x, 1.9875691500e-4f);
  p = fmadd(p, x, splat(x, 1.3981999507e-3f));
  p = fmadd(p, x, splat(x, 8.3334519073e-3f));
  p = fmadd(p, x, splat(x, 4.1665795894e-2f));
  p = fmadd(p, x, splat(x, 1.6666665459e-1f));
  p = fmadd(p, x, splat(x, 5.0000001201e-1f));
  return add(fmadd(mul(p, x), x, x), splat(x, 1.f));
}

}  // namespace exp_detail

// max_ps and min_ps return their second operand where either is NaN, so a NaN stays NaN, as std::exp keeps it.
#if defined(__AVX2__) && defined(__FMA__)
// x clamped to [-87, 88], where 2^k, written into the exponent bits, stays a normal float.
inline __m256 exp8(__m256 x) {
  __m256 k;
  const __m256 clamped = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x));
  const __m256 p = exp_detail::reduced_exp(clamped, k);
  const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_k));
}
#endif
#if defined(__AVX512F__)
// x clamped below at -87, 2^k by vscalefps.
inline __m512 exp16(__m512 x) {
  __m512 k;
  const __m512 p = exp_detail::reduced_exp(_mm512_max_ps(_mm512_set1_ps(-87.f), x), k);
  return _mm512_scalef_ps(p, k);
}
#endif

}  // namespace trtserver_kernels
