// kernels.cpp's fused pieces on float32 rows, for the ops built on them (decode_stack.cpp); each is what the op of
// its name computes (rms_norm, rope_cache, decode_attention), on raw buffers, its checks left to the caller.
#pragma once

#include <cstdint>

namespace trtserver_kernels {

void rms_norm_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t n, float eps);

// q and k of each fused qkv row rotated, k and v written to the caches (slots, n_kv_heads, cache_positions,
// head_dim) at the row's slot and position, q to `q` (rows, n_heads, head_dim)
void rope_cache_rows(const float* qkv, const float* cos, const float* sin, float* q, float* k_cache, float* v_cache,
                     const int64_t* slots, const int64_t* positions, int64_t rows, int64_t width, int64_t n_heads,
                     int64_t n_kv_heads, int64_t head_dim, int64_t cache_positions);

// each row's query heads against its slot's keys 0..position; `longest` the largest position + 1
void decode_attention_rows(const float* q, const float* k_cache, const float* v_cache, float* out,
                           const int64_t* slots, const int64_t* positions, int64_t rows, int64_t n_heads,
                           int64_t n_kv_heads, int64_t head_dim, int64_t cache_positions, int64_t longest);

}  // namespace trtserver_kernels
