// Paged attention on CPU straight from the block-paged KV cache (no gathered copy).
//
// Every query row n attends tokens [start_lens[n], ctx_lens[n]) of sequence row seq_rows[n],
// whose cache blocks are block_tables[seq_rows[n], :] (start_lens > 0: cascade attention, where
// a shared prefix is attended separately and merged through the returned log-sum-exp). A work
// item (one query row and a range of its KV heads, see below) reads the keys and values once,
// block by block, scores the G = Hq / Hkv query heads of each KV head against them (GQA
// without expanding K/V), then a softmax and a weighted sum of V. Work items run in parallel
// on torch's intra-op thread pool.
//
// Shapes: q (N, Hq, D) float32; k_cache, v_cache (num_blocks, block_size, Hkv, D) float32,
// contiguous; block_tables (B, max_blocks) int64; seq_rows, start_lens, ctx_lens (N,) int64.
// Returns out (N, Hq, D) and the scores' log-sum-exp (N, Hq). Accumulation is float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include "vec_utils.h"
#include <cmath>
#include <vector>

static inline float dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  Vec acc(0.f);
  for (; i + Vec::size() <= d; i += Vec::size())
    acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float s = hsum(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// scores[g * stride] = scale * <q_g, k> for the G query heads: k is loaded once for all of them.
static inline void scores_for_key(const float* q, const float* k, int64_t G, int64_t D,
                                  float scale, float* scores, int64_t stride) {
  constexpr int64_t kMaxG = 16;
  if (G > kMaxG || D % Vec::size() != 0) {
    for (int64_t g = 0; g < G; ++g) scores[g * stride] = dot(q + g * D, k, D) * scale;
    return;
  }
  Vec acc[kMaxG];
  for (int64_t g = 0; g < G; ++g) acc[g] = Vec(0.f);
  for (int64_t i = 0; i < D; i += Vec::size()) {
    Vec kv = Vec::loadu(k + i);
    for (int64_t g = 0; g < G; ++g) acc[g] = at::vec::fmadd(Vec::loadu(q + g * D + i), kv, acc[g]);
  }
  for (int64_t g = 0; g < G; ++g)
    scores[g * stride] = scale * hsum(acc[g]);
}

static inline void axpy(float w, const float* x, float* y, int64_t d) {
  int64_t i = 0;
  Vec wv(w);
  for (; i + Vec::size() <= d; i += Vec::size())
    at::vec::fmadd(wv, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < d; ++i) y[i] += w * x[i];
}

// s[t] = exp(s[t] - m) in place; returns the sum.
static inline float exp_minus_max(float* s, float m, int64_t n) {
  int64_t t = 0;
  Vec mv(m), total(0.f);
  for (; t + Vec::size() <= n; t += Vec::size()) {
    Vec e = (Vec::loadu(s + t) - mv).exp_u20();
    e.store(s + t);
    total = total + e;
  }
  float sum = hsum(total);
  for (; t < n; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
  return sum;
}

std::vector<torch::Tensor> paged_attention(torch::Tensor q, torch::Tensor k_cache,
                                           torch::Tensor v_cache, torch::Tensor block_tables,
                                           torch::Tensor seq_rows, torch::Tensor start_lens,
                                           torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be (N, Hq, D) float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32, "cache must be float32");
  q = q.contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto rows = seq_rows.to(torch::kInt64).contiguous();
  auto lens = ctx_lens.to(torch::kInt64).contiguous();
  auto starts = start_lens.to(torch::kInt64).contiguous();
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "head shapes do not match");
  const int64_t G = Hq / Hkv, max_blocks = tables.size(1);
  auto out = torch::empty_like(q);
  auto lse = torch::empty({N, Hq}, q.options());
  float* lsep = lse.data_ptr<float>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t token_stride = Hkv * D, block_stride = bs * Hkv * D;

  // A work item is one query row and a range of KV heads. With enough rows every item takes
  // all heads, so each cached token's K (and V) row of Hkv * D floats is read once,
  // sequentially; with few rows (batch-1 decode) items split by head to use every core.
  const int64_t heads_per_item = N >= 4 * at::get_num_threads() ? Hkv : 1;
  const int64_t items_per_row = Hkv / heads_per_item;
  at::parallel_for(0, N * items_per_row, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // (heads_per_item * G, ctx)
    std::vector<float> acc(heads_per_item * G * D);
    std::vector<float> inv_sum(heads_per_item * G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / items_per_row;
      const int64_t h0 = (item % items_per_row) * heads_per_item;
      const int64_t rows_q = heads_per_item * G;  // query heads of this item
      const int64_t first = sp[n];
      const int64_t ctx = lp[n] - first;  // tokens attended
      const int64_t* table = tp + rp[n] * max_blocks;
      TORCH_CHECK(first >= 0 && ctx > 0 && lp[n] <= max_blocks * bs,
                  "context range out of bounds");
      const float* qn = qp + (n * Hq + h0 * G) * D;
      scores.resize(rows_q * ctx);
      for (int64_t i = 0; i < ctx; ++i) {
        const int64_t t = first + i;
        const float* k = kp + table[t / bs] * block_stride + (t % bs) * token_stride + h0 * D;
        for (int64_t h = 0; h < heads_per_item; ++h)
          scores_for_key(qn + h * G * D, k + h * D, G, D, sc, scores.data() + h * G * ctx + i,
                         ctx);
      }
      for (int64_t r = 0; r < rows_q; ++r) {
        float* s = scores.data() + r * ctx;
        float m = s[0];
        for (int64_t t = 1; t < ctx; ++t) m = std::max(m, s[t]);
        const float total = exp_minus_max(s, m, ctx);
        inv_sum[r] = 1.f / total;
        lsep[n * Hq + h0 * G + r] = m + std::log(total);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < ctx; ++i) {
        const int64_t t = first + i;
        const float* v = vp + table[t / bs] * block_stride + (t % bs) * token_stride + h0 * D;
        for (int64_t r = 0; r < rows_q; ++r)
          axpy(scores[r * ctx + i], v + (r / G) * D, acc.data() + r * D, D);
      }
      for (int64_t r = 0; r < rows_q; ++r) {
        float* o = op + (n * Hq + h0 * G + r) * D;
        for (int64_t i = 0; i < D; ++i) o[i] = acc[r * D + i] * inv_sum[r];
      }
    }
  });
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention from the block-paged KV cache");
}
