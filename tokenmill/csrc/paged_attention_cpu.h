// Paged attention on CPU straight from the block-paged KV cache (no gathered copy).
//
// Every query row n attends tokens [start_lens[n], ctx_lens[n]) of sequence row seq_rows[n],
// whose cache blocks are block_tables[seq_rows[n], :] (start_lens > 0: cascade attention, where
// a shared prefix is attended separately and merged through the returned log-sum-exp). A work
// item (one query row, a range of its KV heads and of its keys, see below) walks its keys in
// tiles with an online softmax (running max, sum and output per query head, rescaled as the max
// grows): each tile's K and V rows are read from memory once, the G = Hq / Hkv query heads of
// each KV head are scored against them (GQA without expanding K/V) and their weighted V added
// while the tile is still in cache. Work items run in parallel on torch's intra-op thread pool.
//
// Shapes: q (N, Hq, D) float32; k_cache, v_cache (num_blocks, block_size, Hkv, R) contiguous,
// in any row format of kv_formats.h (float32: R = D; int8: R = D + 4; float8_e4m3fn: R = D,
// with kv_scales (2, Hkv)); block_tables (B, max_blocks) int64; seq_rows, start_lens, ctx_lens
// (N,) int64. Returns out (N, Hq, D) and the scores' log-sum-exp (N, Hq). Accumulation is
// float32. A quantized cache is read in place: each tile's K and V rows are dequantized into a
// small float buffer (L1/L2-resident) as they are read, and the same float32 code runs on it;
// the bytes read from memory, which bound long-context decode, are the cache's own.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include "kv_formats.h"
#include "vec_utils.h"
#include <cmath>
#include <limits>
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

// scores[(h * G + g) * keys + i] = scale * <q_{h,g}, k_{i,h}> for `heads` KV heads and the G
// query heads of each. Key-major: each key's row (all its heads, contiguous in the cache) is
// read in one sweep, which memory prefetchers follow; head-major order read a strided part of
// every row per head and ran 1.5x slower once the cache spills out of L3. Each K row is loaded
// once for the G query heads sharing it. G is a template parameter so that the G accumulators
// live in registers (a runtime-sized array went through the stack and cost 5x).
template <int G>
static void score_keys(const float* q, const float* const* krows, int64_t heads, int64_t keys,
                       int64_t D, float scale, float* scores) {
  for (int64_t i = 0; i < keys; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* k = krows[i] + h * D;
      const float* qh = q + h * G * D;
      Vec acc[G];
      for (int g = 0; g < G; ++g) acc[g] = Vec(0.f);
      for (int64_t d = 0; d < D; d += Vec::size()) {
        const Vec kv = Vec::loadu(k + d);
        for (int g = 0; g < G; ++g) acc[g] = at::vec::fmadd(Vec::loadu(qh + g * D + d), kv, acc[g]);
      }
      for (int g = 0; g < G; ++g) scores[(h * G + g) * keys + i] = scale * hsum(acc[g]);
    }
  }
}

static void score_keys_any(const float* q, const float* const* krows, int64_t heads,
                           int64_t keys, int64_t G, int64_t D, float scale, float* scores) {
  if (D % Vec::size() == 0) {
    switch (G) {
      case 1: return score_keys<1>(q, krows, heads, keys, D, scale, scores);
      case 2: return score_keys<2>(q, krows, heads, keys, D, scale, scores);
      case 3: return score_keys<3>(q, krows, heads, keys, D, scale, scores);
      case 4: return score_keys<4>(q, krows, heads, keys, D, scale, scores);
      case 5: return score_keys<5>(q, krows, heads, keys, D, scale, scores);
      case 6: return score_keys<6>(q, krows, heads, keys, D, scale, scores);
      case 7: return score_keys<7>(q, krows, heads, keys, D, scale, scores);
      case 8: return score_keys<8>(q, krows, heads, keys, D, scale, scores);
      default: break;
    }
  }
  for (int64_t i = 0; i < keys; ++i)
    for (int64_t r = 0; r < heads * G; ++r)
      scores[r * keys + i] = scale * dot(q + r * D, krows[i] + (r / G) * D, D);
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

// acc (D) = corr * acc + sum_i p[i] * v_i over the rows v_i = vrows[i] + offset (one tile of
// keys of the online softmax). D = 64 (the common head size) keeps acc in registers over the
// tile; other sizes go through memory.
static inline void rescale_accumulate(const float* p, const float* const* vrows, int64_t offset,
                                      int64_t n, int64_t D, float corr, float* acc) {
  constexpr int64_t kRegs = 64 / Vec::size();
  if (D == 64 && kRegs <= 16) {
    Vec a[kRegs];
    const Vec c(corr);
    for (int64_t j = 0; j < kRegs; ++j) a[j] = Vec::loadu(acc + j * Vec::size()) * c;
    for (int64_t i = 0; i < n; ++i) {
      const Vec w(p[i]);
      const float* v = vrows[i] + offset;
      for (int64_t j = 0; j < kRegs; ++j)
        a[j] = at::vec::fmadd(w, Vec::loadu(v + j * Vec::size()), a[j]);
    }
    for (int64_t j = 0; j < kRegs; ++j) a[j].store(acc + j * Vec::size());
    return;
  }
  for (int64_t i = 0; i < D; ++i) acc[i] *= corr;
  for (int64_t i = 0; i < n; ++i) axpy(p[i], vrows[i] + offset, acc, D);
}

static inline float max_of(const float* s, int64_t n) {
  int64_t t = 0;
  float m = -std::numeric_limits<float>::infinity();
  if (n >= Vec::size()) {
    Vec mv = Vec::loadu(s);
    for (t = Vec::size(); t + Vec::size() <= n; t += Vec::size())
      mv = at::vec::maximum(mv, Vec::loadu(s + t));
    float buf[Vec::size()];
    mv.store(buf);
    for (int64_t i = 0; i < Vec::size(); ++i) m = std::max(m, buf[i]);
  }
  for (; t < n; ++t) m = std::max(m, s[t]);
  return m;
}

inline std::vector<torch::Tensor> paged_attention(torch::Tensor q, torch::Tensor k_cache,
                                           torch::Tensor v_cache, torch::Tensor block_tables,
                                           torch::Tensor seq_rows, torch::Tensor start_lens,
                                           torch::Tensor ctx_lens, double scale,
                                           c10::optional<torch::Tensor> kv_scales = c10::nullopt,
                                           double soft_cap = 0.0) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be (N, Hq, D) float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  const KVFormat fmt = kv_format(k_cache);
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches differ in dtype");
  q = q.contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto rows = seq_rows.to(torch::kInt64).contiguous();
  auto lens = ctx_lens.to(torch::kInt64).contiguous();
  auto starts = start_lens.to(torch::kInt64).contiguous();
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(kv_head_dim(fmt, k_cache.size(3)) == D && Hq % Hkv == 0,
              "head shapes do not match");
  const float* head_scales = kv_head_scales(fmt, kv_scales, Hkv);  // fp8 only: K's, V's
  const int64_t G = Hq / Hkv, max_blocks = tables.size(1);
  auto out = torch::empty_like(q);
  auto lse = torch::empty({N, Hq}, q.options());
  const int64_t* sp = starts.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const auto* kb = static_cast<const uint8_t*>(k_cache.data_ptr());
  const auto* vb = static_cast<const uint8_t*>(v_cache.data_ptr());
  const int64_t row_bytes = kv_row_bytes(fmt, D);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  const float cap = static_cast<float>(soft_cap);  // > 0: scores become cap tanh(s / cap)
  int64_t longest = 0;
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(sp[n] >= 0 && lp[n] > sp[n] && lp[n] <= max_blocks * bs,
                "context range out of bounds");
    longest = std::max(longest, lp[n] - sp[n]);
  }

  // A work item is one query row, a range of its KV heads and a range of its keys. With enough
  // rows every item takes all heads and keys, so each cached token's K (and V) row of Hkv * D
  // floats is read once, sequentially. With few rows (batch-1 decode) items split by head and
  // then the keys into `splits` chunks (flash-decoding), whose partial results are merged
  // through their maxima and sums below: every core gets an equal share.
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item = N >= 4 * threads ? Hkv : 1;
  const int64_t items_per_row = Hkv / heads_per_item;
  constexpr int64_t kMinKeysPerSplit = 64;
  // Keys per tile of the online softmax: the tile's K and V rows (2 x 48 KB for 3 KV heads of
  // 64) stay in L2 while the query heads use them; big enough to amortise the rescale.
  constexpr int64_t kTile = 64;
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(
      (8 * threads + N * items_per_row - 1) / (N * items_per_row), longest / kMinKeysPerSplit));
  // Only with splits > 1, per (row, split, query head): unnormalised output (D), max and sum.
  const int64_t parts = splits > 1 ? N * splits * Hq : 0;
  std::vector<float> part_acc(parts * D), part_max(parts), part_sum(parts);
  float* op = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();

  at::parallel_for(0, N * items_per_row * splits, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows_q = heads_per_item * G;  // query heads of an item
    std::vector<float> scores(rows_q * kTile);  // (query heads, tile keys)
    std::vector<const float*> krows(kTile), vrows(kTile);
    // A quantized tile's K and V rows, dequantized: (keys, the item's heads, D) each.
    std::vector<float> kbuf(fmt == KVFormat::kFloat32 ? 0 : kTile * heads_per_item * D);
    std::vector<float> vbuf(kbuf.size());
    std::vector<float> acc(rows_q * D), run_max(rows_q), run_sum(rows_q);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item % splits;
      const int64_t n = item / splits / items_per_row;
      const int64_t h0 = (item / splits % items_per_row) * heads_per_item;
      const int64_t span = lp[n] - sp[n];
      const int64_t k0 = sp[n] + span * c / splits, k1 = sp[n] + span * (c + 1) / splits;
      const int64_t* table = tp + rp[n] * max_blocks;
      const int64_t slot = (n * splits + c) * Hq + h0 * G;  // first (row, split, head) entry
      if (k1 == k0) {  // a short row's empty chunk (splits > 1): nothing to merge
        std::fill_n(&part_sum[slot], rows_q, 0.f);
        continue;
      }
      const float* qn = qp + (n * Hq + h0 * G) * D;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(run_sum.begin(), run_sum.end(), 0.f);
      // Online softmax over tiles of keys: a tile's K and V rows (all heads of the item) are
      // read from memory once and stay in cache while each query head uses them.
      for (int64_t t0 = k0; t0 < k1; t0 += kTile) {
        const int64_t keys = std::min(kTile, k1 - t0);
        for (int64_t i = 0; i < keys; ++i) {
          const int64_t t = t0 + i;
          const int64_t row = (table[t / bs] * bs + t % bs) * Hkv + h0;  // its first head's
          if (fmt == KVFormat::kFloat32) {  // read in place
            krows[i] = reinterpret_cast<const float*>(kb) + row * D;
            vrows[i] = reinterpret_cast<const float*>(vb) + row * D;
            continue;
          }
          float* kd = &kbuf[i * heads_per_item * D];
          float* vd = &vbuf[i * heads_per_item * D];
          for (int64_t h = 0; h < heads_per_item; ++h) {
            const float ks = head_scales ? head_scales[h0 + h] : 0.f;
            const float vs = head_scales ? head_scales[Hkv + h0 + h] : 0.f;
            kv_load_row(fmt, kb + (row + h) * row_bytes, D, ks, kd + h * D);
            kv_load_row(fmt, vb + (row + h) * row_bytes, D, vs, vd + h * D);
          }
          krows[i] = kd;
          vrows[i] = vd;
        }
        score_keys_any(qn, krows.data(), heads_per_item, keys, G, D, sc, scores.data());
        if (cap > 0.f) {  // Gemma 2's soft cap, before the softmax
          for (int64_t j = 0; j < rows_q * keys; ++j) scores[j] = cap * std::tanh(scores[j] / cap);
        }
        for (int64_t r = 0; r < rows_q; ++r) {
          float* s = scores.data() + r * keys;
          const float m = std::max(run_max[r], max_of(s, keys));
          const float corr = std::exp(run_max[r] - m);  // 0 on the first tile (-inf)
          run_sum[r] = run_sum[r] * corr + exp_minus_max(s, m, keys);
          run_max[r] = m;
          rescale_accumulate(s, vrows.data(), (r / G) * D, keys, D, corr, &acc[r * D]);
        }
      }
      for (int64_t r = 0; r < rows_q; ++r) {
        if (splits > 1) {  // kept for the merge below
          part_max[slot + r] = run_max[r];
          part_sum[slot + r] = run_sum[r];
          std::copy_n(&acc[r * D], D, &part_acc[(slot + r) * D]);
          continue;
        }
        float* o = op + (n * Hq + h0 * G + r) * D;
        const float inv = 1.f / run_sum[r];
        for (int64_t i = 0; i < D; ++i) o[i] = acc[r * D + i] * inv;
        lsep[n * Hq + h0 * G + r] = run_max[r] + std::log(run_sum[r]);
      }
    }
  });
  if (splits > 1) {  // merge the chunks of every (row, query head)
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t h = 0; h < Hq; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < splits; ++c) {  // empty chunks (sum 0) have no max
          const int64_t e = (n * splits + c) * Hq + h;
          if (part_sum[e] > 0.f) m = std::max(m, part_max[e]);
        }
        float total = 0.f;
        float* o = op + (n * Hq + h) * D;
        std::fill_n(o, D, 0.f);
        for (int64_t c = 0; c < splits; ++c) {
          const int64_t e = (n * splits + c) * Hq + h;
          if (part_sum[e] == 0.f) continue;
          const float w = std::exp(part_max[e] - m);
          total += part_sum[e] * w;
          axpy(w, &part_acc[e * D], o, D);
        }
        const float inv = 1.f / total;
        for (int64_t i = 0; i < D; ++i) o[i] *= inv;
        lsep[n * Hq + h] = m + std::log(total);
      }
    }
  }
  return {out, lse};
}
