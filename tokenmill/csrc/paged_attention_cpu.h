// Paged attention on CPU straight from the block-paged KV cache (no gathered copy).
//
// Every query row n attends tokens [start_lens[n], ctx_lens[n]) of sequence row seq_rows[n],
// whose cache blocks are block_tables[seq_rows[n], :] (start_lens > 0: cascade attention, where
// a shared prefix is attended separately and merged through the returned log-sum-exp). A work
// item (a query row, or up to 16 consecutive rows of one sequence: a prefill chunk's; a range
// of their KV heads and of their keys, see below) walks its keys in tiles with an online
// softmax per row (running max, sum and output per query head, rescaled as the max grows):
// each tile's K and V rows are read from memory (and widened) once for all the item's rows,
// the G = Hq / Hkv query heads of each KV head are scored against them (GQA without expanding
// K/V) and their weighted V added while the tile is still in cache. Each row's arithmetic is
// its own, whatever rows share its item. Work items run in parallel on torch's intra-op
// thread pool. The per-row arithmetic: paged_attention_rows.h.
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
#include "paged_attention_keys_t.h"
#include "paged_attention_rows.h"
#include "vec_utils.h"
#include <cmath>
#include <limits>
#include <vector>

// What every work item reads.
struct PagedArgs {
  const float* q;           // (N, Hq, D)
  const uint8_t *kb, *vb;   // the caches' bytes
  const int64_t *tables, *rows, *starts, *lens;
  const float* head_scales;  // fp8 only
  KVFormat fmt;
  int64_t Hq, Hkv, G, D, bs, max_blocks, row_bytes;
  float scale, cap;
  bool keys_t;  // bf16 keys read transposed (paged_attention_keys_t.h), else row-major
};

constexpr int64_t kTileKeys = 64;  // keys of a tile of the online softmax
#ifdef TM_ATTENTION_KEYS_T
static_assert(kTileKeys == attention_keys_t::kTileKeys, "one tile size");
#endif

// Per-thread buffers of an item covering `heads` KV heads (G query heads each).
struct PagedScratch {
  std::vector<float> scores, kbuf, vbuf, corr, kT;
  std::vector<const float*> krows, vrows;
  std::vector<const uint16_t*> kraw;  // keys_t: a tile's bf16 K rows of one head
  std::vector<int64_t> key_rows;      // keys_t: each key's first row (head h0) in the cache
  PagedScratch(const PagedArgs& a, int64_t heads, int64_t tile)
      : scores(heads * a.G * tile), corr(heads * a.G),
        kbuf(a.fmt == KVFormat::kFloat32 || a.keys_t ? 0 : tile * heads * a.D),
        vbuf(a.fmt == KVFormat::kFloat32 ? 0 : tile * heads * a.D),
        kT(a.keys_t ? heads * a.D * tile : 0), krows(tile), vrows(tile), kraw(tile),
        key_rows(tile) {}
};

// Asks for the K and V rows (heads [h0, h0 + heads), from cache row `row`) of one cached
// token ahead of their use. Blocks lie anywhere in the pool, and a tile was read (widened)
// and then computed: without prefetches the memory sat idle while a tile was computed, and
// the loads stalled while it was read (64 decodes from DRAM, bf16: 1.3x with them).
static inline void prefetch_row(const PagedArgs& a, int64_t row, int64_t heads) {
  for (int64_t o = 0; o < heads * a.row_bytes; o += 64) {
    __builtin_prefetch(a.kb + row * a.row_bytes + o);
    __builtin_prefetch(a.vb + row * a.row_bytes + o);
  }
}

// The first tile's rows of query row n's keys from k0 (heads [h0, h0 + heads)): the next
// work item's, prefetched as a thread starts an item.
static inline void prefetch_first_tile(const PagedArgs& a, int64_t n, int64_t k0, int64_t h0,
                                       int64_t heads) {
  const int64_t* table = a.tables + a.rows[n] * a.max_blocks;
  for (int64_t k = k0; k < std::min(a.lens[n], k0 + kTileKeys); ++k)
    prefetch_row(a, (table[k / a.bs] * a.bs + k % a.bs) * a.Hkv + h0, heads);
}

// One query row's share of a group walking the same keys (attend_keys): its row, its keys'
// end and its softmax state (acc (heads G, D) unnormalised, mx and sum per query head).
struct RowState {
  int64_t n, k1;
  float *acc, *mx, *sum;
};

// One tile's `keys` keys (rows in s.krows / s.vrows) for one query row: scores, the online
// softmax's rescale, the weighted sum of V.
static void attend_tile(const PagedArgs& a, PagedScratch& s, const RowState& row, int64_t h0,
                        int64_t heads, int64_t keys) {
  const int64_t rows_q = heads * a.G, D = a.D;
  const float* qn = a.q + (row.n * a.Hq + h0 * a.G) * D;
  float *acc = row.acc, *mx = row.mx, *sum = row.sum;
#ifdef TM_ATTENTION_KEYS_T
  if (a.keys_t) {
    for (int64_t h = 0; h < heads; ++h)
      attention_keys_t::score_group_t(a.G, qn + h * a.G * D, s.kT.data() + h * D * kTileKeys, a.scale,
                                      keys, keys, s.scores.data() + h * a.G * keys);
  } else
#endif
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

// Keys [t0, t0 + keys) of a sequence (block table `table`), heads [h0, h0 + heads), into s:
// a float32 cache's rows in place; others widened row by row (s.kbuf, s.vbuf), or with
// keys_t the V rows widened and the K rows transposed into s.kT (one (D, 64) per head).
// The rows of keys [t0 + keys, next_end) (the next tile) are prefetched meanwhile.
static void load_tile(const PagedArgs& a, PagedScratch& s, const int64_t* table, int64_t t0,
                      int64_t keys, int64_t next_end, int64_t h0, int64_t heads) {
  const int64_t D = a.D;
  int64_t blk = t0 / a.bs, off = t0 % a.bs;  // key t0 + i's block and slot, stepped (a
  int64_t next = t0 + keys;                  // division per key cost ~10% of a decode)
  int64_t nblk = next / a.bs, noff = next % a.bs;
  for (int64_t i = 0; i < keys; ++i) {
    if (off == a.bs) ++blk, off = 0;
    if (noff == a.bs) ++nblk, noff = 0;
    if (next++ < next_end) prefetch_row(a, (table[nblk] * a.bs + noff) * a.Hkv + h0, heads);
    ++noff;
    const int64_t row = (table[blk] * a.bs + off++) * a.Hkv + h0;  // first head's
    if (a.fmt == KVFormat::kFloat32) {  // read in place
      s.krows[i] = reinterpret_cast<const float*>(a.kb) + row * D;
      s.vrows[i] = reinterpret_cast<const float*>(a.vb) + row * D;
      continue;
    }
    float* vd = &s.vbuf[i * heads * D];
    s.vrows[i] = vd;
    if (a.keys_t) {  // K transposed below (its rows asked for now); V widened row by row
      s.key_rows[i] = row;
      for (int64_t o = 0; o < heads * a.row_bytes; o += 64)
        __builtin_prefetch(a.kb + row * a.row_bytes + o);
      for (int64_t h = 0; h < heads; ++h)
        bf16_load_row(a.vb + (row + h) * a.row_bytes, D, vd + h * D);
      continue;
    }
    float* kd = &s.kbuf[i * heads * D];
    for (int64_t h = 0; h < heads; ++h) {
      const float ks = a.head_scales ? a.head_scales[h0 + h] : 0.f;
      const float vs = a.head_scales ? a.head_scales[a.Hkv + h0 + h] : 0.f;
      kv_load_row(a.fmt, a.kb + (row + h) * a.row_bytes, D, ks, kd + h * D);
      kv_load_row(a.fmt, a.vb + (row + h) * a.row_bytes, D, vs, vd + h * D);
    }
    s.krows[i] = kd;
  }
#ifdef TM_ATTENTION_KEYS_T
  for (int64_t h = 0; a.keys_t && h < heads; ++h) {  // the tile's keys of head h0 + h
    for (int64_t i = 0; i < keys; ++i)
      s.kraw[i] = reinterpret_cast<const uint16_t*>(a.kb + (s.key_rows[i] + h) * a.row_bytes);
    attention_keys_t::widen_keys_t(s.kraw.data(), keys, s.kT.data() + h * D * kTileKeys);
  }
#endif
}

// Keys [k0, rows[r].k1) of each query row r (rows of one sequence, the same k0), for KV heads
// [h0, h0 + heads), as an online softmax over tiles of kTileKeys keys starting at k0. Each
// tile's K and V rows (all heads of the item) are read from memory (and widened) once for
// every row of the group and stay in cache while each query head of each row uses them; a
// row's arithmetic is that of the row alone (its tiles are [k0 + 64 j, min(k1, k0 + 64 (j +
// 1))) whatever the group), so grouping changes no result.
static void attend_keys(const PagedArgs& a, PagedScratch& s, const RowState* rows, int64_t R,
                        int64_t h0, int64_t heads, int64_t k0) {
  const int64_t rows_q = heads * a.G, D = a.D;
  const int64_t* table = a.tables + a.rows[rows[0].n] * a.max_blocks;
  int64_t k1 = k0;
  for (int64_t r = 0; r < R; ++r) {
    std::fill_n(rows[r].acc, rows_q * D, 0.f);
    std::fill_n(rows[r].mx, rows_q, -std::numeric_limits<float>::infinity());
    std::fill_n(rows[r].sum, rows_q, 0.f);
    k1 = std::max(k1, rows[r].k1);
  }
  for (int64_t t0 = k0; t0 < k1; t0 += kTileKeys) {
    const int64_t keys = std::min(kTileKeys, k1 - t0);
    load_tile(a, s, table, t0, keys, std::min(k1, t0 + 2 * kTileKeys), h0, heads);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t own = std::min(kTileKeys, rows[r].k1 - t0);  // this row's keys of the tile
      if (own > 0) attend_tile(a, s, rows[r], h0, heads, own);
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

// Up to this many consecutive query rows of one sequence form a work item (attend_group).
constexpr int64_t kGroupRows = 16;

// A work item's buffers: each row's running state, a later chunk's state, the rows' shares.
struct GroupBuffers {
  std::vector<float> acc, mx, sum, run, run_max, run_sum;
  std::vector<RowState> rows;
  GroupBuffers(int64_t heads_q, int64_t D)  // heads_q: query heads of an item
      : acc(kGroupRows * heads_q * D), mx(kGroupRows * heads_q), sum(mx.size()),
        run(acc.size()), run_max(mx.size()), run_sum(mx.size()) {}
};

// Query rows [g0, g1) (one sequence, the same first key) over KV heads [h0, h0 + heads):
// chunk 0 of every row as its running state, each later chunk merged into it (rows with fewer
// chunks drop out), as a row alone would be computed. Leaves row g0 + r's state at offset
// r * heads * G of b.run / run_max / run_sum.
static void attend_group(const PagedArgs& a, PagedScratch& s, const KeyChunks& chunks,
                         int64_t g0, int64_t g1, int64_t h0, int64_t heads, GroupBuffers& b) {
  const int64_t rows_q = heads * a.G, D = a.D;
  int64_t most = 0;  // chunk 0 is every row's first (non-empty): the running state
  b.rows.clear();
  for (int64_t n = g0; n < g1; ++n) {
    const int64_t i = (n - g0) * rows_q;
    b.rows.push_back({n, chunks.range(n, 0).second, &b.run[i * D], &b.run_max[i],
                      &b.run_sum[i]});
    most = std::max(most, chunks.count(n));
  }
  attend_keys(a, s, b.rows.data(), b.rows.size(), h0, heads, chunks.range(g0, 0).first);
  for (int64_t c = 1; c < most; ++c) {  // later chunks: merged into each row's state
    b.rows.clear();
    int64_t k0 = 0;  // the same for every row: chunks start at fixed multiples here
    for (int64_t n = g0; n < g1; ++n) {
      if (c >= chunks.count(n)) continue;
      const auto [r0, r1] = chunks.range(n, c);
      if (r1 == r0) continue;
      const int64_t i = (n - g0) * rows_q;
      k0 = r0;
      b.rows.push_back({n, r1, &b.acc[i * D], &b.mx[i], &b.sum[i]});
    }
    if (b.rows.empty()) continue;
    attend_keys(a, s, b.rows.data(), b.rows.size(), h0, heads, k0);
    for (const RowState& r : b.rows)
      for (int64_t q = 0; q < rows_q; ++q) {
        const int64_t j = (r.n - g0) * rows_q + q;
        merge_into(&b.run[j * D], b.run_max[j], b.run_sum[j], &r.acc[q * D], r.mx[q],
                   r.sum[q], D);
      }
  }
}

// Whether a cache of this format and these head shapes is scored with its keys transposed.
inline bool keys_transposed(KVFormat fmt, int64_t D, int64_t G) {
#ifdef TM_ATTENTION_KEYS_T
  return attention_keys_t::applies(fmt == KVFormat::kBf16, D, G);
#else
  return false;
#endif
}

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
                    static_cast<float>(scale), static_cast<float>(soft_cap),
                    keys_transposed(fmt, D, Hq / Hkv)};
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
  // Whole rows go in groups: consecutive query rows of one sequence with the same first key
  // (a prefill chunk's queries) walk their keys together, up to kGroupRows at a time; their
  // chunks start alike where chunks are cut at fixed multiples or are whole ranges.
  std::vector<int64_t> group_first;  // each group's first row, then N
  for (int64_t n = 0; n < N && whole_rows; ++n) {
    const int64_t g = group_first.empty() ? -1 : group_first.back();
    if (g < 0 || n - g >= kGroupRows || (split_keys == 0 && splits > 1) ||
        a.rows[n] != a.rows[g] || a.starts[n] != a.starts[g])
      group_first.push_back(n);
  }
  group_first.push_back(N);
  const int64_t groups = static_cast<int64_t>(group_first.size()) - 1;
  const int64_t units = whole_rows ? groups * items_per_row : total_chunks * items_per_row;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    PagedScratch s(a, heads_per_item, kTileKeys);
    GroupBuffers b(rows_q, D);
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
        const RowState one{n, k1, &part_acc[e * D], &part_max[e], &part_sum[e]};
        attend_keys(a, s, &one, 1, h0, heads_per_item, k0);
        continue;
      }
      const int64_t g0 = group_first[u / items_per_row], g1 = group_first[u / items_per_row + 1];
      if (u + 1 < end) {  // the next item's first keys, while this one is computed
        const int64_t n = group_first[(u + 1) / items_per_row];
        prefetch_first_tile(a, n, chunks.range(n, 0).first,
                            ((u + 1) % items_per_row) * heads_per_item, heads_per_item);
      }
      attend_group(a, s, chunks, g0, g1, h0, heads_per_item, b);
      for (int64_t n = g0; n < g1; ++n) {
        const int64_t i = (n - g0) * rows_q;
        finish(n, h0 * a.G, rows_q, &b.run[i * D], &b.run_max[i], &b.run_sum[i]);
      }
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
