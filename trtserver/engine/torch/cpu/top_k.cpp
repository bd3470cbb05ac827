// The indices of each row's k largest scores, in no order: what topk(k, sorted=False).indices selects, for the
// refined int4 head (weights.Int4Head), in two vector passes over the row instead of ATen's heap.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

namespace {

// A float's bits as a signed integer in the floats' order (negative floats' magnitudes flipped), NaN above +inf
// as topk ranks it; the passes compare these, so their vector forms are integer compares and maxima.
inline int32_t order_key(float v) {
  int32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

#if defined(__AVX2__)
inline __m256i order_keys(const float* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(0x7FFFFFFF)));
}
#endif

// The largest key of x[begin, end).
int32_t block_max(const float* x, int64_t begin, int64_t end) {
  int32_t best = INT32_MIN;
  int64_t i = begin;
#if defined(__AVX2__)
  if (end - begin >= 8) {
    __m256i top = _mm256_set1_epi32(INT32_MIN);
    for (; i + 8 <= end; i += 8) top = _mm256_max_epi32(top, order_keys(x + i));
    int32_t lanes[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), top);
    best = *std::max_element(lanes, lanes + 8);
  }
#endif
  for (; i < end; ++i) best = std::max(best, order_key(x[i]));
  return best;
}

// Row `x` (n scores) -> its k largest's indices in `out`. Of the row's blocks, the k-th largest block maximum
// has k scores at or above it (each of those blocks' maxima), so the k-th largest score is too: only the
// scores at or above it are candidates, typically a few times k, ordered among themselves.
void top_k_row(const float* x, int64_t n, int64_t k, int64_t* out) {
  const int64_t block = std::max<int64_t>(8, n / (4 * k) / 8 * 8), blocks = (n + block - 1) / block;
  int32_t floor = INT32_MIN;
  if (blocks >= k) {
    std::vector<int32_t> maxima(blocks);
    for (int64_t b = 0; b < blocks; ++b) maxima[b] = block_max(x, b * block, std::min(n, (b + 1) * block));
    std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<int32_t>());
    floor = maxima[k - 1];
  }
  std::vector<std::pair<int32_t, int64_t>> candidates;
  candidates.reserve(4 * k);
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256i below = _mm256_set1_epi32(floor == INT32_MIN ? INT32_MIN : floor - 1);
  for (; i + 8 <= n; i += 8) {
    const __m256i keys = order_keys(x + i);
    int mask = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(keys, below)));
    if (floor == INT32_MIN) mask = 0xFF;  // every score is a candidate
    while (mask != 0) {
      const int lane = __builtin_ctz(mask);
      candidates.emplace_back(order_key(x[i + lane]), i + lane);
      mask &= mask - 1;
    }
  }
#endif
  for (; i < n; ++i) {
    const int32_t key = order_key(x[i]);
    if (key >= floor) candidates.emplace_back(key, i);
  }
  std::nth_element(candidates.begin(), candidates.begin() + (k - 1), candidates.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (int64_t j = 0; j < k; ++j) out[j] = candidates[j].second;
}

at::Tensor top_k_indices(const at::Tensor& scores, int64_t k) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.is_contiguous() &&
              scores.dim() == 2, "top_k_indices: scores must be contiguous float32 (rows, n)");
  const int64_t rows = scores.size(0), n = scores.size(1);
  TORCH_CHECK(k > 0 && k <= n, "top_k_indices: k must be in 1..", n, ", not ", k);
  at::Tensor out = at::empty({rows, k}, scores.options().dtype(at::kLong));
  const float* sp = scores.const_data_ptr<float>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) top_k_row(sp + r * n, n, k, op + r * k);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trtserver, m) {
  m.def("top_k_indices(Tensor scores, int k) -> Tensor", &top_k_indices);
}
