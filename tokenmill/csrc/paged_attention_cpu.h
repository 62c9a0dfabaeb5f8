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
#include "paged_attention_groups.h"
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
static void score_keys(const float* q, const float* const* krows, int64_t heads, int64_t first,
                       int64_t keys, int64_t D, float scale, float* scores) {
  for (int64_t i = first; i < keys; ++i) {
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
  int64_t first = 0;  // keys scored four at a time by the grouped loop, where it applies
#ifdef TM_ATTENTION_GROUPS
  if (attention_groups::score_group(G, q, krows, heads, keys, D, scale, scores, &first) &&
      first == keys)
    return;
#endif
  if (D % Vec::size() == 0) {
    switch (G) {
      case 1: return score_keys<1>(q, krows, heads, first, keys, D, scale, scores);
      case 2: return score_keys<2>(q, krows, heads, first, keys, D, scale, scores);
      case 3: return score_keys<3>(q, krows, heads, first, keys, D, scale, scores);
      case 4: return score_keys<4>(q, krows, heads, first, keys, D, scale, scores);
      case 5: return score_keys<5>(q, krows, heads, first, keys, D, scale, scores);
      case 6: return score_keys<6>(q, krows, heads, first, keys, D, scale, scores);
      case 7: return score_keys<7>(q, krows, heads, first, keys, D, scale, scores);
      case 8: return score_keys<8>(q, krows, heads, first, keys, D, scale, scores);
      default: break;
    }
  }
  for (int64_t i = first; i < keys; ++i)
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

// A running softmax state over keys: per query head, the unnormalised output (D), max, sum.
// `merge_into` folds a later range's partial state into it; it is the one rule by which key
// ranges are combined, whichever thread computed them.
static inline void merge_into(float* out, float& mx, float& sum, const float* acc, float m,
                              float s, int64_t D) {
  const float new_max = std::max(mx, m);
  const float a = std::exp(mx - new_max), b = std::exp(m - new_max);
  sum = sum * a + s * b;
  mx = new_max;
  int64_t i = 0;
  const Vec av(a), bv(b);
  for (; i + Vec::size() <= D; i += Vec::size())
    at::vec::fmadd(Vec::loadu(acc + i), bv, Vec::loadu(out + i) * av).store(out + i);
  for (; i < D; ++i) out[i] = std::fma(acc[i], b, out[i] * a);
}

// What every work item reads.
struct PagedArgs {
  const float* q;           // (N, Hq, D)
  const uint8_t *kb, *vb;   // the caches' bytes
  const int64_t *tables, *rows, *starts, *lens;
  const float* head_scales;  // fp8 only
  KVFormat fmt;
  int64_t Hq, Hkv, G, D, bs, max_blocks, row_bytes;
  float scale, cap;
};

// Per-thread buffers of an item covering `heads` KV heads (G query heads each).
struct PagedScratch {
  std::vector<float> scores, kbuf, vbuf, corr;
  std::vector<const float*> krows, vrows;
  PagedScratch(const PagedArgs& a, int64_t heads, int64_t tile)
      : scores(heads * a.G * tile), corr(heads * a.G),
        kbuf(a.fmt == KVFormat::kFloat32 ? 0 : tile * heads * a.D), vbuf(kbuf.size()),
        krows(tile), vrows(tile) {}
};

// Keys [k0, k1) of query row n for KV heads [h0, h0 + heads), as an online softmax over tiles
// of kTile keys starting at k0: acc (heads G, D) unnormalised, mx and sum per query head.
static void attend_keys(const PagedArgs& a, PagedScratch& s, int64_t n, int64_t h0,
                        int64_t heads, int64_t k0, int64_t k1, float* acc, float* mx,
                        float* sum) {
  constexpr int64_t kTile = 64;
  const int64_t rows_q = heads * a.G, D = a.D;
  const float* qn = a.q + (n * a.Hq + h0 * a.G) * D;
  const int64_t* table = a.tables + a.rows[n] * a.max_blocks;
  std::fill_n(acc, rows_q * D, 0.f);
  std::fill_n(mx, rows_q, -std::numeric_limits<float>::infinity());
  std::fill_n(sum, rows_q, 0.f);
  // A tile's K and V rows (all heads of the item) are read from memory once and stay in
  // cache while each query head uses them.
  for (int64_t t0 = k0; t0 < k1; t0 += kTile) {
    const int64_t keys = std::min(kTile, k1 - t0);
    int64_t blk = t0 / a.bs, off = t0 % a.bs;  // key t0 + i's block and slot, stepped (a
    for (int64_t i = 0; i < keys; ++i) {       // division per key cost ~10% of a decode)
      if (off == a.bs) ++blk, off = 0;
      const int64_t row = (table[blk] * a.bs + off++) * a.Hkv + h0;  // first head's
      if (a.fmt == KVFormat::kFloat32) {  // read in place
        s.krows[i] = reinterpret_cast<const float*>(a.kb) + row * D;
        s.vrows[i] = reinterpret_cast<const float*>(a.vb) + row * D;
        continue;
      }
      float* kd = &s.kbuf[i * heads * D];
      float* vd = &s.vbuf[i * heads * D];
      for (int64_t h = 0; h < heads; ++h) {
        const float ks = a.head_scales ? a.head_scales[h0 + h] : 0.f;
        const float vs = a.head_scales ? a.head_scales[a.Hkv + h0 + h] : 0.f;
        kv_load_row(a.fmt, a.kb + (row + h) * a.row_bytes, D, ks, kd + h * D);
        kv_load_row(a.fmt, a.vb + (row + h) * a.row_bytes, D, vs, vd + h * D);
      }
      s.krows[i] = kd;
      s.vrows[i] = vd;
    }
    score_keys_any(qn, s.krows.data(), heads, keys, a.G, D, a.scale, s.scores.data());
    if (a.cap > 0.f) {  // Gemma 2's soft cap, before the softmax
      for (int64_t j = 0; j < rows_q * keys; ++j)
        s.scores[j] = a.cap * std::tanh(s.scores[j] / a.cap);
    }
    for (int64_t r = 0; r < rows_q; ++r) {
      float* sc = s.scores.data() + r * keys;
      const float m = std::max(mx[r], max_of(sc, keys));
      s.corr[r] = std::exp(mx[r] - m);  // 0 on the first tile (-inf)
      sum[r] = sum[r] * s.corr[r] + exp_minus_max(sc, m, keys);
      mx[r] = m;
    }
    for (int64_t h = 0; h < heads; ++h) {  // the G heads sharing each V row together
      const int64_t r0 = h * a.G;
#ifdef TM_ATTENTION_GROUPS
      if (attention_groups::accumulate_group(a.G, s.scores.data() + r0 * keys, keys,
                                             s.vrows.data(), h * D, keys, D, &s.corr[r0],
                                             acc + r0 * D))
        continue;
#endif
      for (int64_t r = r0; r < r0 + a.G; ++r)
        rescale_accumulate(s.scores.data() + r * keys, s.vrows.data(), h * D, keys, D,
                           s.corr[r], acc + r * D);
    }
  }
}

// Which keys each query row attends, in ranges (chunks) combined by merge_into.
// split_keys > 0 (batch-invariant): chunk c of row n is [start, ctx) cut at the multiples of
// split_keys, a function of the row alone. 0: the keys of every row in `splits` equal parts,
// as many as balance this call's work over the threads (flash-decoding for a few rows).
struct KeyChunks {
  int64_t split_keys, splits;
  const int64_t *starts, *lens;

  int64_t count(int64_t n) const {
    if (split_keys == 0) return splits;
    return (lens[n] - 1) / split_keys - starts[n] / split_keys + 1;
  }
  std::pair<int64_t, int64_t> range(int64_t n, int64_t c) const {
    if (split_keys == 0) {
      const int64_t span = lens[n] - starts[n];
      return {starts[n] + span * c / splits, starts[n] + span * (c + 1) / splits};
    }
    const int64_t first = starts[n] / split_keys + c;
    return {std::max(starts[n], first * split_keys), std::min(lens[n], (first + 1) * split_keys)};
  }
};

inline std::vector<torch::Tensor> paged_attention(torch::Tensor q, torch::Tensor k_cache,
                                           torch::Tensor v_cache, torch::Tensor block_tables,
                                           torch::Tensor seq_rows, torch::Tensor start_lens,
                                           torch::Tensor ctx_lens, double scale,
                                           c10::optional<torch::Tensor> kv_scales = c10::nullopt,
                                           double soft_cap = 0.0, int64_t split_keys = 0) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be (N, Hq, D) float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(split_keys >= 0, "split_keys must be >= 0");
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
  const PagedArgs a{q.data_ptr<float>(), static_cast<const uint8_t*>(k_cache.data_ptr()),
                    static_cast<const uint8_t*>(v_cache.data_ptr()), tables.data_ptr<int64_t>(),
                    rows.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                    lens.data_ptr<int64_t>(), kv_head_scales(fmt, kv_scales, Hkv), fmt, Hq, Hkv,
                    Hq / Hkv, D, bs, tables.size(1), kv_row_bytes(fmt, D),
                    static_cast<float>(scale), static_cast<float>(soft_cap)};
  auto out = torch::empty_like(q);
  auto lse = torch::empty({N, Hq}, q.options());
  int64_t longest = 0;
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(a.starts[n] >= 0 && a.lens[n] > a.starts[n] && a.lens[n] <= a.max_blocks * bs,
                "context range out of bounds");
    longest = std::max(longest, a.lens[n] - a.starts[n]);
  }

  // A work item is one query row, a range of its KV heads and its chunks of keys: all of them
  // (merged as they are computed) when there are rows enough to keep every core busy, else one
  // chunk (partial states kept, merged below). With enough rows an item takes all heads, so
  // each cached token's K (and V) row of Hkv * D floats is read once, sequentially. Neither
  // choice changes any row's arithmetic: only which thread does it.
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item = N >= 4 * threads ? Hkv : 1;
  const int64_t items_per_row = Hkv / heads_per_item;
  constexpr int64_t kMinKeysPerSplit = 64;
  const int64_t splits = split_keys > 0 ? 0 : std::max<int64_t>(1, std::min<int64_t>(
      (8 * threads + N * items_per_row - 1) / (N * items_per_row), longest / kMinKeysPerSplit));
  const KeyChunks chunks{split_keys, splits, a.starts, a.lens};
  std::vector<int64_t> first_chunk(N + 1, 0);  // row n's chunks: [first[n], first[n + 1])
  for (int64_t n = 0; n < N; ++n) first_chunk[n + 1] = first_chunk[n] + chunks.count(n);
  const int64_t total_chunks = first_chunk[N];
  const bool whole_rows = total_chunks == N || N * items_per_row >= 4 * threads;
  // Per-chunk items: (chunk, query head) partial states, merged after the parallel region.
  const int64_t parts = whole_rows ? 0 : total_chunks * Hq;
  std::vector<float> part_acc(parts * D), part_max(parts), part_sum(parts);
  std::vector<int64_t> chunk_row(whole_rows ? 0 : total_chunks);
  for (int64_t n = 0; n < N && !whole_rows; ++n)
    std::fill(chunk_row.begin() + first_chunk[n], chunk_row.begin() + first_chunk[n + 1], n);
  float* op = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const int64_t rows_q = heads_per_item * a.G;  // query heads of an item

  // The normalised output and log-sum-exp of row n's query heads [r0, r0 + count).
  auto finish = [&](int64_t n, int64_t r0, int64_t count, const float* acc, const float* mx,
                    const float* sum) {
    for (int64_t r = 0; r < count; ++r) {
      float* o = op + (n * Hq + r0 + r) * D;
      const float inv = 1.f / sum[r];
      for (int64_t i = 0; i < D; ++i) o[i] = acc[r * D + i] * inv;
      lsep[n * Hq + r0 + r] = mx[r] + std::log(sum[r]);
    }
  };
  const int64_t units = whole_rows ? N * items_per_row : total_chunks * items_per_row;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    PagedScratch s(a, heads_per_item, 64);
    std::vector<float> acc(rows_q * D), mx(rows_q), sum(rows_q);
    std::vector<float> run(rows_q * D), run_max(rows_q), run_sum(rows_q);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t h0 = (u % items_per_row) * heads_per_item;
      if (!whole_rows) {  // one chunk: its partial state, kept
        const int64_t c = u / items_per_row, n = chunk_row[c];
        const auto [k0, k1] = chunks.range(n, c - first_chunk[n]);
        const int64_t e = c * Hq + h0 * a.G;
        if (k1 == k0) {  // (adaptive splits) a short row's empty chunk: nothing to merge
          std::fill_n(&part_sum[e], rows_q, 0.f);
          continue;
        }
        attend_keys(a, s, n, h0, heads_per_item, k0, k1, &part_acc[e * D], &part_max[e],
                    &part_sum[e]);
        continue;
      }
      const int64_t n = u / items_per_row;
      bool first = true;
      for (int64_t c = 0; c < chunks.count(n); ++c) {
        const auto [k0, k1] = chunks.range(n, c);
        if (k1 == k0) continue;
        if (first) {  // the running state starts as the first chunk's
          attend_keys(a, s, n, h0, heads_per_item, k0, k1, run.data(), run_max.data(),
                      run_sum.data());
          first = false;
          continue;
        }
        attend_keys(a, s, n, h0, heads_per_item, k0, k1, acc.data(), mx.data(), sum.data());
        for (int64_t r = 0; r < rows_q; ++r)
          merge_into(&run[r * D], run_max[r], run_sum[r], &acc[r * D], mx[r], sum[r], D);
      }
      finish(n, h0 * a.G, rows_q, run.data(), run_max.data(), run_sum.data());
    }
  });
  if (!whole_rows) {  // merge each (row, query head)'s chunks in order
    at::parallel_for(0, N * Hq, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> run(D);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n = i / Hq, h = i % Hq;
        float run_max = 0.f, run_sum = 0.f;
        bool first = true;
        for (int64_t c = first_chunk[n]; c < first_chunk[n + 1]; ++c) {
          const int64_t e = c * Hq + h;
          if (part_sum[e] == 0.f) continue;  // an empty chunk
          if (first) {
            std::copy_n(&part_acc[e * D], D, run.data());
            run_max = part_max[e], run_sum = part_sum[e], first = false;
          } else {
            merge_into(run.data(), run_max, run_sum, &part_acc[e * D], part_max[e],
                       part_sum[e], D);
          }
        }
        finish(n, h, 1, run.data(), &run_max, &run_sum);
      }
    });
  }
  return {out, lse};
}
