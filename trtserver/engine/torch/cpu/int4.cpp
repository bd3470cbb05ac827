// Weight-only int4 projections for small decode batches (cpu/weights.py's Int4Linear in its kernel layout).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "checks.h"
#include "int4.h"
#include "vector_exp.h"

using at::Tensor;
using trtserver_kernels::check_activation;
#if defined(__AVX2__) && defined(__FMA__)
using trtserver_kernels::exp8;
#endif

namespace {

// w[n][k] = q * scale + min, in blocks of 32 along k with a scale and a min each, output features in groups of
// 8. A group's block is 128 bytes: 8 chunks of 16, chunk p's byte j holding, for feature j / 2, the value at
// k = 2p + j % 2 in its low nibble and at k = 16 + 2p + j % 2 in its high one; then the block's 8 scales and 8
// mins (float16, `scales_mins`: 20 bytes a feature's block in all). Widened to int16, a chunk's nibbles are the
// 8 features' weights for two pairs of k, so vpmaddwd against one pair of the activations broadcast puts
// feature f's partial dot product in lane f: a block sums to the group's 8 outputs with no horizontal additions.
// The activations are scaled to int16 a block at a time by the block's largest magnitude (within 2^-16 of it,
// where bfloat16 rounds each value to 2^-9). y[r][n] = sum over blocks of scale * (q . x) + min * sum(x).
constexpr int64_t kGroup = 8, kBlock = 32, kBlockBytes = kGroup * kBlock / 2;

struct Int4Activations {
  const float* x;            // (rows, K) float32
  const float* block_sums;   // (rows, K / 32)
  const int16_t* quantized;  // (rows, K): x / block_scales, rounded
  const float* block_scales; // (rows, K / 32)
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Block g's integer dot products of one group for R rows: feature f's in lane f of dot[r].
template <int R>
void block_dots(const Int4Activations& a, const uint8_t* w, int64_t K, int64_t g, __m256i* dot) {
  const __m256i nibble = _mm256_set1_epi16(0x0F);
  for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
  for (int p = 0; p < 8; ++p) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 16)));
    const __m256i low = _mm256_and_si256(bytes, nibble), high = _mm256_srli_epi16(bytes, 4);
    for (int r = 0; r < R; ++r) {
      const int16_t* xq = a.quantized + r * K + g * kBlock + 2 * p;
      int32_t pair_low, pair_high;  // (x[k], x[k + 1]) as one int32, broadcast to the 8 features' lanes
      std::memcpy(&pair_low, xq, 4);
      std::memcpy(&pair_high, xq + 16, 4);
      dot[r] = _mm256_add_epi32(dot[r], _mm256_add_epi32(_mm256_madd_epi16(low, _mm256_set1_epi32(pair_low)),
                                                         _mm256_madd_epi16(high, _mm256_set1_epi32(pair_high))));
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// block_dots two chunks at a time in 512 bits: chunk 2q's sums in lanes 0-7 and chunk 2q + 1's in lanes 8-15, each
// half against its own pair of activations (vpermd from the block's 16 pairs), the halves added at the end. The
// same integers in half the instructions; for two rows or more, and for one row where it measured faster
// (int4_wide_from_rows).
template <int R>
void block_dots_wide(const Int4Activations& a, const uint8_t* w, int64_t K, int64_t g, __m256i* dot) {
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  __m512i wide[R], xs[R];
  for (int r = 0; r < R; ++r) {
    wide[r] = _mm512_setzero_si512();
    xs[r] = _mm512_loadu_si512(a.quantized + r * K + g * kBlock);  // (x[2j], x[2j + 1]) as int32 j
  }
  for (int q = 0; q < 4; ++q) {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 32)));
    const __m512i low = _mm512_and_si512(bytes, nibble), high = _mm512_srli_epi16(bytes, 4);
    const __m512i pick_low = _mm512_set_epi32(2 * q + 1, 2 * q + 1, 2 * q + 1, 2 * q + 1, 2 * q + 1, 2 * q + 1,
                                              2 * q + 1, 2 * q + 1, 2 * q, 2 * q, 2 * q, 2 * q, 2 * q, 2 * q, 2 * q,
                                              2 * q);
    const __m512i pick_high = _mm512_add_epi32(pick_low, _mm512_set1_epi32(8));  // k + 16
    for (int r = 0; r < R; ++r) {
      const __m512i x_low = _mm512_permutexvar_epi32(pick_low, xs[r]);
      const __m512i x_high = _mm512_permutexvar_epi32(pick_high, xs[r]);
#if defined(__AVX512VNNI__)
      wide[r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(wide[r], low, x_low), high, x_high);
#else
      wide[r] = _mm512_add_epi32(wide[r], _mm512_add_epi32(_mm512_madd_epi16(low, x_low),
                                                           _mm512_madd_epi16(high, x_high)));
#endif
    }
  }
  for (int r = 0; r < R; ++r) {
    dot[r] = _mm256_add_epi32(_mm512_castsi512_si256(wide[r]), _mm512_extracti64x4_epi64(wide[r], 1));
  }
}
#endif

// Block g's dot products for R rows, in 512 bits where `wide`.
template <int R>
void group_block_dots(const Int4Activations& a, const uint8_t* w, int64_t K, int64_t g, bool wide, __m256i* dot) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (wide) return block_dots_wide<R>(a, w, K, g, dot);
#endif
  block_dots<R>(a, w, K, g, dot);
}
#endif

// The fewest rows that take the 512-bit loop: two unless start-up measured it faster for one (int4_wide_from_rows).
// One row is bound by reading the weights, and which loop reads them faster depends on the CPU: on a Zen 4 EPYC the
// 256-bit one, on a Xeon whose cache holds the model the 512-bit one. Either gives the same bits.
std::atomic<int64_t> wide_from_rows{2};

// One group of 8 features for R rows.
template <int R>
void int4_group(const Int4Activations& a, const uint8_t* packed, const at::Half* scales_mins, float* y, int64_t K,
                int64_t N, int64_t group, bool accumulate) {
  const int64_t G = K / kBlock;
  const uint8_t* w = packed + group * G * kBlockBytes;
  const at::Half* sm = scales_mins + group * G * 2 * kGroup;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const bool wide = R >= wide_from_rows.load(std::memory_order_relaxed);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i dot[R];
    group_block_dots<R>(a, w, K, g, wide, dot);
    const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm)));
    const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + kGroup)));
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_mul_ps(scales, _mm256_set1_ps(a.block_scales[r * G + g]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.block_sums[r * G + g]), acc[r]);
    }
    w += kBlockBytes;
    sm += 2 * kGroup;
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * N + group * kGroup;
    _mm256_storeu_ps(yr, accumulate ? _mm256_add_ps(_mm256_loadu_ps(yr), acc[r]) : acc[r]);
  }
#else
  float total[R][kGroup] = {};
  for (int64_t g = 0; g < G; ++g, w += kBlockBytes, sm += 2 * kGroup) {
    for (int f = 0; f < kGroup; ++f) {
      float q[kBlock];
      for (int p = 0; p < 8; ++p) {
        for (int e = 0; e < 2; ++e) {
          const uint8_t byte = w[p * 16 + 2 * f + e];
          q[2 * p + e] = static_cast<float>(byte & 0x0F);
          q[16 + 2 * p + e] = static_cast<float>(byte >> 4);
        }
      }
      for (int r = 0; r < R; ++r) {
        const float* xr = a.x + r * K + g * kBlock;
        float d = 0.f;
        for (int j = 0; j < kBlock; ++j) d += q[j] * xr[j];
        total[r][f] += d * static_cast<float>(sm[f]) + static_cast<float>(sm[kGroup + f]) * a.block_sums[r * G + g];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int f = 0; f < kGroup; ++f) y[r * N + group * kGroup + f] = accumulate ? y[r * N + group * kGroup + f] + total[r][f] : total[r][f];
  }
#endif
}

}  // namespace

namespace trtserver_kernels {

int64_t check_int4_weights(const Tensor& packed, const Tensor& scales_mins, int64_t K, const char* op) {
  const int64_t G = K / kBlock;
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.dim() == 3 && packed.size(1) == G && packed.size(2) == kBlockBytes,
              op, ": packed must be contiguous uint8 (N / 8, K / 32, 128)");
  const int64_t groups = packed.size(0);
  TORCH_CHECK(scales_mins.device().is_cpu() && scales_mins.scalar_type() == at::kHalf && scales_mins.is_contiguous() &&
              scales_mins.dim() == 4 && scales_mins.size(0) == groups && scales_mins.size(1) == G &&
              scales_mins.size(2) == 2 && scales_mins.size(3) == kGroup,
              op, ": scales_mins must be contiguous float16 (N / 8, K / 32, 2, 8): each block's scales, then its mins");
  return groups * kGroup;
}

#if defined(__AVX2__)
// The largest of 8 lanes.
inline float max8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
#endif

void quantize_int4_input(const float* xp, int64_t rows, int64_t K, Int4Input& in) {
  const int64_t G = K / kBlock;
  in.x = xp;
  in.rows = rows;
  in.K = K;
  in.block_sums.resize(rows * G);
  in.block_scales.resize(rows * G);
  in.quantized.resize(rows * K);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xb = xp + r * K + g * kBlock;
      int16_t* qb = in.quantized.data() + r * K + g * kBlock;
      float sum = 0.f;  // in order: the blocks' chains overlap, and a tree would round the sums otherwise
      for (int64_t j = 0; j < kBlock; ++j) sum += xb[j];
#if defined(__AVX2__)
      // the largest magnitude ignoring NaN as std::max does, and below the scaling, in eight lanes at a time
      __m256 x[4];
      for (int i = 0; i < 4; ++i) x[i] = _mm256_loadu_ps(xb + 8 * i);
      const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      __m256 most = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) most = _mm256_max_ps(_mm256_and_ps(x[i], magnitude), most);  // NaN: `most`
      const float largest = max8(most);
#else
      float largest = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) largest = std::max(largest, std::fabs(xb[j]));
#endif
      in.block_sums[r * G + g] = sum;
      // a block below 1e-30 (or NaN) contributes its min term only: 32767 / largest would overflow
      const bool scaled = largest > 1e-30f;
      in.block_scales[r * G + g] = scaled ? largest / 32767.f : 0.f;
      const float inverse = scaled ? 32767.f / largest : 0.f;
#if defined(__AVX2__)
      const __m256 high = _mm256_set1_ps(32767.f), low = _mm256_set1_ps(-32767.f);
      for (int i = 0; i < 4; ++i) {
        const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(x[i], _mm256_set1_ps(inverse)),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, low), high));  // NaN: -32767
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 8 * i),
                         _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
      }
#else
      for (int64_t j = 0; j < kBlock; ++j) {
        qb[j] = static_cast<int16_t>(std::min(32767.f, std::max(-32767.f, std::nearbyint(xb[j] * inverse))));
      }
#endif
    }
  }
}

void int4_groups(const Int4Input& in, const Tensor& packed, const Tensor& scales_mins, int64_t N, float* yp,
                 bool accumulate, int64_t g0, int64_t g1) {
  const int64_t rows = in.rows, K = in.K, G = K / kBlock;
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const at::Half* sp = scales_mins.const_data_ptr<at::Half>();
  // a group's weights, the bulk of the bytes, are read from memory once, and stay in cache while four rows at a
  // time pass over them
  for (int64_t group = g0; group < g1; ++group) {
    for (int64_t r = 0; r < rows; r += 4) {
      const Int4Activations a{in.x + r * K, in.block_sums.data() + r * G, in.quantized.data() + r * K,
                              in.block_scales.data() + r * G};
      float* yr = yp + r * N;
      switch (std::min<int64_t>(4, rows - r)) {
        case 1: int4_group<1>(a, wp, sp, yr, K, N, group, accumulate); break;
        case 2: int4_group<2>(a, wp, sp, yr, K, N, group, accumulate); break;
        case 3: int4_group<3>(a, wp, sp, yr, K, N, group, accumulate); break;
        default: int4_group<4>(a, wp, sp, yr, K, N, group, accumulate); break;
      }
    }
  }
}

void int4_project_into(const float* xp, int64_t rows, int64_t K, const Tensor& packed, const Tensor& scales_mins,
                       int64_t N, float* yp, bool accumulate) {
  Int4Input in;
  quantize_int4_input(xp, rows, K, in);
  at::parallel_for(0, N / kGroup, 8, [&](int64_t g0, int64_t g1) {
    int4_groups(in, packed, scales_mins, N, yp, accumulate, g0, g1);
  });
}

void silu_times_up(const float* gate_up, int64_t rows, int64_t K, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * K;
    const float* up = gate + K;
    float* xr = out + r * K;
    int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.f);
    for (; k + 8 <= K; k += 8) {
      const __m256 g = _mm256_loadu_ps(gate + k);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      _mm256_storeu_ps(xr + k, _mm256_mul_ps(silu, _mm256_loadu_ps(up + k)));
    }
#endif
    for (; k < K; ++k) xr[k] = gate[k] / (1.f + std::exp(-gate[k])) * up[k];
  }
}

}  // namespace trtserver_kernels

namespace {

using trtserver_kernels::check_int4_weights;
using trtserver_kernels::int4_project_into;

Tensor int4_linear(const Tensor& x, const Tensor& packed, const Tensor& scales_mins) {
  const auto type = x.scalar_type();
  check_activation(x, type, "int4_linear x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "int4_linear: x must be (rows, K), K a multiple of 32");
  const int64_t rows = x.size(0), K = x.size(1);
  const int64_t N = check_int4_weights(packed, scales_mins, K, "int4_linear");
  const Tensor xf = type == at::kFloat ? x : x.to(at::kFloat);
  Tensor y = at::empty({rows, N}, x.options().dtype(at::kFloat));
  int4_project_into(xf.const_data_ptr<float>(), rows, K, packed, scales_mins, N, y.mutable_data_ptr<float>(), false);
  return type == at::kFloat ? y : y.to(type);
}

// The feed-forward's down projection of SiLU(gate) * up, `gate_up` (rows, 2K) holding gate then up: the product
// is formed as the activations are read, one call instead of the split, the SiLU and the multiplication.
Tensor int4_gated_linear(const Tensor& gate_up, const Tensor& packed, const Tensor& scales_mins) {
  const auto type = gate_up.scalar_type();
  check_activation(gate_up, type, "int4_gated_linear gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % (2 * kBlock) == 0,
              "int4_gated_linear: gate_up must be (rows, 2K), K a multiple of 32");
  const int64_t rows = gate_up.size(0), K = gate_up.size(1) / 2;
  const int64_t N = check_int4_weights(packed, scales_mins, K, "int4_gated_linear");
  const Tensor gf = type == at::kFloat ? gate_up : gate_up.to(at::kFloat);
  std::vector<float> x(rows * K);
  trtserver_kernels::silu_times_up(gf.const_data_ptr<float>(), rows, K, x.data());
  Tensor y = at::empty({rows, N}, gate_up.options().dtype(at::kFloat));
  int4_project_into(x.data(), rows, K, packed, scales_mins, N, y.mutable_data_ptr<float>(), false);
  return type == at::kFloat ? y : y.to(type);
}

// Sets the fewest rows that take the 512-bit loop (1 or 2) where the build has it; returns the setting now (2
// without AVX-512: the 256-bit loop serves every row count).
int64_t int4_wide_from_rows(int64_t rows) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__)
  TORCH_CHECK(rows == 1 || rows == 2, "int4_wide_from_rows: 1 or 2");
  wide_from_rows.store(rows);
#endif
  return wide_from_rows.load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtserver, m) {
  m.def("int4_wide_from_rows(int rows) -> int", &int4_wide_from_rows);
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_mins) -> Tensor", &int4_linear);
  m.def("int4_gated_linear(Tensor gate_up, Tensor packed, Tensor scales_mins) -> Tensor", &int4_gated_linear);
}
