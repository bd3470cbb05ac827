// Fused CPU kernels for the decode (bfloat16 or float32 activations): each replaces a run of ATen calls
// that cost more to issue than to compute on a few hundred numbers (scripted.py, kernels.py).
// Elementwise results round to the activations' type exactly where the eager ops round; reductions sum in
// float32 in their own order, so results can differ from the eager path's in the last bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"
#include "kernel_rows.h"
#include "vector_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

using at::BFloat16;
using at::Tensor;
using trtserver_kernels::check_activation;
#if defined(__AVX2__) && defined(__FMA__)
using trtserver_kernels::exp8;
#endif
#if defined(__AVX512F__)
using trtserver_kernels::exp16;
#endif

// The body with scalar_t bound to the activations' type, bfloat16 or float32 (check_activation refuses the rest).
#define ACTIVATIONS(type, name, ...) \
  AT_DISPATCH_SWITCH(type, name, AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__))

namespace {

inline float f(BFloat16 v) {  // exact: bfloat16 is the top half of a float32, and the shift vectorizes
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float f(float v) { return v; }
// to the activations' type T: bfloat16 rounds to nearest even, as ATen's casts
template <typename T>
inline T to(float v) { return T(v); }

// A softmax row in place, less its normalisation: e^(x - best) for each x, returning their sum; vector_exp.h's
// e^x 16 or 8 at a time (within ~2 ulp) with AVX-512 or AVX2, instead of a scalar std::exp call per score.
float exp_row(float* x, int64_t n, float best) {
  int64_t t = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  const __m512 top = _mm512_set1_ps(best);
  __m512 sum = _mm512_setzero_ps();
  for (; t < n; t += 16) {
    const __mmask16 live = n - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + t), top));
    _mm512_mask_storeu_ps(x + t, live, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, e));
  }
  total = _mm512_reduce_add_ps(sum);
#else
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 top = _mm256_set1_ps(best);
  __m256 sum = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), top));
    _mm256_storeu_ps(x + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  total = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
#endif
  for (; t < n; ++t) {
    x[t] = std::exp(x[t] - best);
    total += x[t];
  }
#endif
  return total;
}

// q . k for one query head and one key row, both float32 of length hs (with AVX2 or AVX-512, only the last few
// keys of a task: dot4 takes the rest).
inline float dot(const float* q, const float* k, int64_t hs) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < hs; ++i) total += q[i] * k[i];
  return total;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// q . k for one query head and four consecutive float32 key rows, hs a multiple of 8, on CPUs without AVX-512:
// four independent FMA chains, their lanes added together by three hadds instead of four trees.
inline __m128 dot4(const float* q, const float* k, int64_t hs) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < hs; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + hs + i), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * hs + i), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * hs + i), a3);
  }
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}
#endif

#if defined(__AVX512F__)
// 16 values of a key row as float32: loaded, or widened from bfloat16.
inline __m512 key16(const float* k) { return _mm512_loadu_ps(k); }
inline __m512 key16(const BFloat16* k) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k))), 16));
}

// q . k for one query head (float32) and four consecutive key rows (float32 or bfloat16), hs a multiple of 16:
// four independent FMA chains, their lanes added as a 4 x 4 transpose rather than four trees.
template <typename T>
inline __m128 dot4(const float* q, const T* k, int64_t hs) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i = 0; i < hs; i += 16) {
    const __m512 qi = _mm512_loadu_ps(q + i);
    for (int r = 0; r < 4; ++r) acc[r] = _mm512_fmadd_ps(qi, key16(k + r * hs + i), acc[r]);
  }
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1));  // AVX-512F, not DQ
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), high);
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#endif

// The row of n values at p as float32: p itself for float32, else converted into buf.
inline const float* as_float(const float* p, int64_t, float*) { return p; }
inline const float* as_float(const BFloat16* p, int64_t n, float* buf) {
  for (int64_t i = 0; i < n; ++i) buf[i] = f(p[i]);
  return buf;
}

// K and V caches of one shape, (slots, kv heads, positions, head_dim); one (slot, position) per row, in range.
void check_rows(const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots, const Tensor& positions,
                int64_t rows, int64_t n_kv_heads, const char* op) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), op, ": K and V caches of one 4-d shape");
  TORCH_CHECK(n_kv_heads > 0 && k_cache.size(1) == n_kv_heads, op, ": the caches hold ", k_cache.size(1),
              " kv heads, not ", n_kv_heads);
  TORCH_CHECK(slots.device().is_cpu() && positions.device().is_cpu() && slots.numel() == rows &&
              positions.numel() == rows, op, ": one slot and one position per row, on the CPU");
}

// model.RMSNorm: normalised in float32, cast to the activations' type, then scaled by the weight.
template <typename T>
void rms_norm_rows(const T* xp, const T* wp, T* op, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = xp + r * n;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += f(xr[i]) * f(xr[i]);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) op[r * n + i] = to<T>(f(to<T>(f(xr[i]) * inv)) * f(wp[i]));
  }
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const auto type = x.scalar_type();
  check_activation(x, type, "rms_norm x");
  check_activation(weight, type, "rms_norm weight");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  TORCH_CHECK(weight.numel() == n, "rms_norm: weight has ", weight.numel(), " elements, rows have ", n);
  Tensor out = at::empty_like(x);
  ACTIVATIONS(type, "rms_norm", [&] {
    rms_norm_rows(x.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
                  rows, n, static_cast<float>(eps));
  });
  return out;
}

// The rotation of model.apply_rope (x * cos + roll(x, hs / 2) * signed_sin, each product and the sum
// rounded to the activations' type) on q and k of a fused qkv row, then k and v written to the caches at
// each row's (slot, position); q into qp, (B, n_heads, head_dim).
template <typename T>
void rope_cache_rows(const T* in, const T* cp, const T* sn, T* qp, T* kc, T* vc, const int64_t* sp,
                     const int64_t* pp, int64_t B, int64_t width, int64_t nh, int64_t nkv, int64_t hs, int64_t P) {
  const int64_t half = hs / 2;
  for (int64_t b = 0; b < B; ++b) {
    const T* row = in + b * width;
    const T* c = cp + b * hs;
    const T* s = sn + b * hs;
    for (int64_t h = 0; h < nh + nkv; ++h) {
      const T* x = row + h * hs;
      T* dst = h < nh ? qp + (b * nh + h) * hs : kc + ((sp[b] * nkv + (h - nh)) * P + pp[b]) * hs;
      for (int64_t i = 0; i < half; ++i) {  // roll(x, hs / 2): the halves swap
        dst[i] = to<T>(f(to<T>(f(x[i]) * f(c[i]))) + f(to<T>(f(x[i + half]) * f(s[i]))));
      }
      for (int64_t i = half; i < hs; ++i) {
        dst[i] = to<T>(f(to<T>(f(x[i]) * f(c[i]))) + f(to<T>(f(x[i - half]) * f(s[i]))));
      }
    }
    const T* v = row + (nh + nkv) * hs;
    for (int64_t h = 0; h < nkv; ++h) {
      std::copy(v + h * hs, v + (h + 1) * hs, vc + ((sp[b] * nkv + h) * P + pp[b]) * hs);
    }
  }
}

Tensor rope_cache(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache,
                  const Tensor& slots, const Tensor& positions, int64_t n_heads, int64_t n_kv_heads) {
  const auto type = qkv.scalar_type();
  check_activation(qkv, type, "rope_cache qkv");
  check_activation(cos, type, "rope_cache cos");
  check_activation(sin, type, "rope_cache sin");
  check_activation(k_cache, type, "rope_cache k_cache");
  check_activation(v_cache, type, "rope_cache v_cache");
  TORCH_CHECK(qkv.dim() == 2, "rope_cache: qkv must be (rows, (n_heads + 2 n_kv_heads) head_dim)");
  check_rows(k_cache, v_cache, slots, positions, qkv.size(0), n_kv_heads, "rope_cache");
  const int64_t B = qkv.size(0), hs = k_cache.size(3), P = k_cache.size(2), nh = n_heads, nkv = n_kv_heads;
  TORCH_CHECK(nh > 0 && hs % 2 == 0 && qkv.size(1) == (nh + 2 * nkv) * hs, "rope_cache: shapes disagree");
  TORCH_CHECK(cos.numel() == B * hs && sin.numel() == B * hs, "rope_cache: cos/sin must be (B, head_dim)");
  const auto rows = trtserver_kernels::cache_rows(slots, positions, k_cache.size(0), P, "rope_cache");
  const int64_t* sp = rows.sp;
  const int64_t* pp = rows.pp;
  Tensor q = at::empty({B, nh, hs}, qkv.options());
  ACTIVATIONS(type, "rope_cache", [&] {
    rope_cache_rows(qkv.const_data_ptr<scalar_t>(), cos.const_data_ptr<scalar_t>(), sin.const_data_ptr<scalar_t>(),
                    q.mutable_data_ptr<scalar_t>(), k_cache.mutable_data_ptr<scalar_t>(),
                    v_cache.mutable_data_ptr<scalar_t>(), sp, pp, B, qkv.size(1), nh, nkv, hs, P);
  });
  return q;
}

}  // namespace

namespace trtserver_kernels {

void plan_attention(AttentionWork& w, int64_t B, int64_t nh, int64_t nkv, int64_t hs, int64_t P, int64_t longest,
                    int64_t threads) {
  // Tasks: (row, kv head, split of the positions); a task's `group` query heads read each key and value row
  // once. Few rows and kv heads would leave threads idle or uneven (1 row of SmolLM2: 3 tasks for 2 threads,
  // one of them doing two), so the positions are split until there are at least two tasks per thread and, where
  // the splits allow, as many for each thread, each of at least 32 positions; each split keeps its own maximum,
  // sum and weighted values, merged after (flash-decoding). A few heads over a short context take microseconds:
  // threads only where there is real work.
  w.n_heads = nh, w.n_kv_heads = nkv, w.head_dim = hs, w.cache_positions = P;
  w.group = nh / nkv;
  w.pairs = B * nkv;
  w.threaded = B * nh * longest * hs >= (1 << 15);
  const int64_t used = w.threaded ? threads : 1;
  if (w.pairs >= 2 * used) {
    w.splits = 1;
  } else {
    const int64_t most = std::max<int64_t>(1, longest / 32);
    int64_t splits = std::min(most, (2 * used + w.pairs - 1) / w.pairs);
    for (int64_t even = splits; even <= std::min(most, 2 * splits); ++even) {
      if (w.pairs * even % used == 0) {
        splits = even;
        break;
      }
    }
    w.splits = splits;
  }
  w.chunk = (longest + w.splits - 1) / w.splits;
  w.part_max.resize(w.pairs * w.splits * w.group);
  w.part_sum.resize(w.pairs * w.splits * w.group);
  w.part_acc.resize(w.pairs * w.splits * w.group * hs);
}

}  // namespace trtserver_kernels

namespace {

using trtserver_kernels::AttentionWork;

// Tasks [begin, end) of a planned decode attention: one query row per sequence against its slot's keys
// 0..position (inclusive), as the small-batch float32 SDPA with its mask: each q head j * g + i reads kv head j.
template <typename T>
void attention_tasks(AttentionWork& w, const T* qp, const T* kc, const T* vc, const int64_t* sp, const int64_t* pp,
                     int64_t begin, int64_t end) {
  const int64_t nh = w.n_heads, nkv = w.n_kv_heads, hs = w.head_dim, P = w.cache_positions, group = w.group;
  const int64_t splits = w.splits, chunk = w.chunk;
  const float scale = 1.f / std::sqrt(static_cast<float>(hs));
  float* part_max = w.part_max.data();
  float* part_sum = w.part_sum.data();
  float* part_acc_base = w.part_acc.data();
  std::vector<float> scores(group * chunk), query(group * hs), row(hs);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t pair = task / splits, b = pair / nkv, kv = pair % nkv, n = pp[b] + 1;
    const int64_t t0 = std::min(n, (task % splits) * chunk), t1 = std::min(n, t0 + chunk);
    const int64_t base = (sp[b] * nkv + kv) * P * hs;
    const T* qb = qp + (b * nh + kv * group) * hs;
    for (int64_t i = 0; i < group * hs; ++i) query[i] = f(qb[i]);
    int64_t t = t0;
#if defined(__AVX512F__)
    if (hs % 16 == 0) {  // four keys at a time: four independent sums a query head, reduced together
      for (; t + 4 <= t1; t += 4) {
        const T* k = kc + base + t * hs;
        for (int64_t j = 0; j < group; ++j) {
          const __m128 four = dot4(query.data() + j * hs, k, hs);
          _mm_storeu_ps(scores.data() + j * chunk + t - t0, _mm_mul_ps(four, _mm_set1_ps(scale)));
        }
      }
    }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
      if (hs % 8 == 0) {  // four keys at a time, as the bfloat16 rows take them with AVX-512
        for (; t + 4 <= t1; t += 4) {
          for (int64_t j = 0; j < group; ++j) {
            const __m128 four = dot4(query.data() + j * hs, kc + base + t * hs, hs);
            _mm_storeu_ps(scores.data() + j * chunk + t - t0, _mm_mul_ps(four, _mm_set1_ps(scale)));
          }
        }
      }
    }
#endif
    for (; t < t1; ++t) {
      const float* k = as_float(kc + base + t * hs, hs, row.data());
      for (int64_t j = 0; j < group; ++j) scores[j * chunk + t - t0] = dot(query.data() + j * hs, k, hs) * scale;
    }
    for (int64_t j = 0; j < group; ++j) {
      float* sj = scores.data() + j * chunk;
      float best = -INFINITY;
      for (int64_t t = 0; t < t1 - t0; ++t) best = std::max(best, sj[t]);
      part_max[task * group + j] = best;  // -inf for an empty split: it weighs nothing in the merge
      part_sum[task * group + j] = t1 > t0 ? exp_row(sj, t1 - t0, best) : 0.f;
    }
    float* acc = part_acc_base + task * group * hs;
    std::fill(acc, acc + group * hs, 0.f);
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = as_float(vc + base + t * hs, hs, row.data());
      for (int64_t j = 0; j < group; ++j) {
        const float p = scores[j * chunk + t - t0];
        float* aj = acc + j * hs;
#pragma omp simd
        for (int64_t i = 0; i < hs; ++i) aj[i] += p * v[i];
      }
    }
  }
}

// The tasks' partial results merged into op (rows, n_heads * head_dim).
template <typename T>
void merge_attention(const AttentionWork& work, T* op) {
  const int64_t pairs = work.pairs, nkv = work.n_kv_heads, nh = work.n_heads, hs = work.head_dim;
  const int64_t group = work.group, splits = work.splits;
  const std::vector<float>& part_max = work.part_max;
  const std::vector<float>& part_sum = work.part_sum;
  const std::vector<float>& part_acc = work.part_acc;
  std::vector<float> merged(hs);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = pair / nkv, kv = pair % nkv;
    for (int64_t j = 0; j < group; ++j) {
      float best = -INFINITY, total = 0.f;
      for (int64_t s = 0; s < splits; ++s) best = std::max(best, part_max[(pair * splits + s) * group + j]);
      std::fill(merged.begin(), merged.end(), 0.f);
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t at = (pair * splits + s) * group + j;
        const float w = std::exp(part_max[at] - best);
        total += w * part_sum[at];
        const float* acc = part_acc.data() + at * hs;
        for (int64_t i = 0; i < hs; ++i) merged[i] += w * acc[i];
      }
      T* ob = op + (b * nh + (kv * group + j)) * hs;
      for (int64_t i = 0; i < hs; ++i) ob[i] = to<T>(merged[i] / total);
    }
  }
}

template <typename T>
void decode_attention_rows(const T* qp, const T* kc, const T* vc, T* op, const int64_t* sp, const int64_t* pp,
                           int64_t B, int64_t nh, int64_t nkv, int64_t hs, int64_t P, int64_t longest) {
  AttentionWork w;
  trtserver_kernels::plan_attention(w, B, nh, nkv, hs, P, longest, at::get_num_threads());
  if (w.threaded) {
    at::parallel_for(0, w.tasks(), 1, [&](int64_t begin, int64_t end) {
      attention_tasks(w, qp, kc, vc, sp, pp, begin, end);
    });
  } else {
    attention_tasks(w, qp, kc, vc, sp, pp, 0, w.tasks());
  }
  merge_attention(w, op);
}

Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                        const Tensor& positions) {
  const auto type = q.scalar_type();
  check_activation(q, type, "decode_attention q");
  check_activation(k_cache, type, "decode_attention k_cache");
  check_activation(v_cache, type, "decode_attention v_cache");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "decode_attention: q (rows, n_heads, head_dim), 4-d caches");
  check_rows(k_cache, v_cache, slots, positions, q.size(0), k_cache.size(1), "decode_attention");
  const int64_t B = q.size(0), nh = q.size(1), hs = q.size(2), nkv = k_cache.size(1), P = k_cache.size(2);
  TORCH_CHECK(nh % nkv == 0 && k_cache.size(3) == hs, "decode_attention: shapes disagree");
  const auto rows = trtserver_kernels::cache_rows(slots, positions, k_cache.size(0), P, "decode_attention");
  const int64_t* sp = rows.sp;
  const int64_t* pp = rows.pp;
  const int64_t longest = rows.longest;
  Tensor out = at::empty({B, nh * hs}, q.options());
  ACTIVATIONS(type, "decode_attention", [&] {
    decode_attention_rows(q.const_data_ptr<scalar_t>(), k_cache.const_data_ptr<scalar_t>(),
                          v_cache.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), sp, pp, B, nh, nkv, hs,
                          P, longest);
  });
  return out;
}

}  // namespace

namespace trtserver_kernels {  // the float32 rows for decode_stack.cpp (kernel_rows.h)

void rms_norm_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t n, float eps) {
  ::rms_norm_rows(x, weight, out, rows, n, eps);
}

void rope_cache_rows(const float* qkv, const float* cos, const float* sin, float* q, float* k_cache, float* v_cache,
                     const int64_t* slots, const int64_t* positions, int64_t rows, int64_t width, int64_t n_heads,
                     int64_t n_kv_heads, int64_t head_dim, int64_t cache_positions) {
  ::rope_cache_rows(qkv, cos, sin, q, k_cache, v_cache, slots, positions, rows, width, n_heads, n_kv_heads, head_dim,
                    cache_positions);
}

void attention_tasks(AttentionWork& work, const float* q, const float* k_cache, const float* v_cache,
                     const int64_t* slots, const int64_t* positions, int64_t begin, int64_t end) {
  ::attention_tasks(work, q, k_cache, v_cache, slots, positions, begin, end);
}

void merge_attention(const AttentionWork& work, float* out) { ::merge_attention(work, out); }

}  // namespace trtserver_kernels

TORCH_LIBRARY(trtserver, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("rope_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "Tensor positions, int n_heads, int n_kv_heads) -> Tensor", &rope_cache);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor positions) -> Tensor",
        &decode_attention);
}
