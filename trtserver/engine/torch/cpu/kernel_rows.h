// kernels.cpp's fused pieces on float32 rows, for the ops built on them (decode_stack.cpp); each is what the op of
// its name computes (rms_norm, rope_cache, decode_attention), on raw buffers, its checks left to the caller.
#pragma once

#include <cstdint>
#include <vector>

namespace trtserver_kernels {

void rms_norm_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t n, float eps);

// q and k of each fused qkv row rotated, k and v written to the caches (slots, n_kv_heads, cache_positions,
// head_dim) at the row's slot and position, q to `q` (rows, n_heads, head_dim)
void rope_cache_rows(const float* qkv, const float* cos, const float* sin, float* q, float* k_cache, float* v_cache,
                     const int64_t* slots, const int64_t* positions, int64_t rows, int64_t width, int64_t n_heads,
                     int64_t n_kv_heads, int64_t head_dim, int64_t cache_positions);

// A decode attention (the decode_attention op) in tasks, for a caller that runs them on threads of its own: each
// row's query heads against its slot's keys 0..position, split by (row, kv head, stretch of positions), each
// task's partial softmax kept apart until merge_attention.
struct AttentionWork {
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0, cache_positions = 0;
  int64_t group = 0, pairs = 0, splits = 0, chunk = 0;
  bool threaded = false;  // whether the work is worth more than one thread
  std::vector<float> part_max, part_sum, part_acc;
  int64_t tasks() const { return pairs * splits; }
};

// `longest`: the rows' largest position + 1; `threads`: how many threads the tasks may be shared by
void plan_attention(AttentionWork& work, int64_t rows, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                    int64_t cache_positions, int64_t longest, int64_t threads);
// tasks [begin, end) of the plan, on the calling thread; tasks run on any threads in any order
void attention_tasks(AttentionWork& work, const float* q, const float* k_cache, const float* v_cache,
                     const int64_t* slots, const int64_t* positions, int64_t begin, int64_t end);
// every task's part into out (rows, n_heads * head_dim)
void merge_attention(const AttentionWork& work, float* out);

}  // namespace trtserver_kernels
