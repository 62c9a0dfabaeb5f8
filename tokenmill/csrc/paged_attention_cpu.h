// Paged attention on CPU straight from the block-paged KV cache (no gathered copy).
//
// Every query row n attends tokens [start_lens[n], ctx_lens[n]) of sequence row seq_rows[n],
// whose cache blocks are block_tables[seq_rows[n], :] (start_lens > 0: cascade attention, where
// a shared prefix is attended separately and merged through the returned log-sum-exp). A work
// item (a query row, or up to 16 consecutive rows of one sequence, a prefill chunk's, or of
// sequences sharing cached blocks; a range of their KV heads and of their keys, see below)
// walks its keys in tiles (paged_attention_tiles.h) with an online softmax per row (running
// max, sum and output per query head, rescaled as the max grows): each tile's K and V rows
// are read from memory (and widened) once for all the item's rows that read them, the G =
// Hq / Hkv query heads of each KV head are scored against them (GQA without expanding K/V)
// and their weighted V added while the tile is still in cache. Each row's arithmetic is its
// own, whatever rows share its item. Work items run in parallel on torch's intra-op
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
#include "kv_formats.h"
#include "paged_attention_ahead.h"
#include "paged_attention_tiles.h"
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

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

// A work item's buffers: each row's running state, a later chunk's state, the rows' shares.
struct GroupBuffers {
  std::vector<float> acc, mx, sum, run, run_max, run_sum;
  std::vector<RowState> rows;
  // The thread's, kept between calls as PagedScratch's (heads_q: query heads of an item).
  static GroupBuffers& of_thread(int64_t heads_q, int64_t D) {
    static thread_local GroupBuffers b;
    grow_to(b.acc, kGroupRows * heads_q * D), grow_to(b.run, kGroupRows * heads_q * D);
    for (auto* v : {&b.mx, &b.sum, &b.run_max, &b.run_sum}) grow_to(*v, kGroupRows * heads_q);
    return b;
  }
};

// Whether query rows n and g (the same first key) start in the same cache block: rows of one
// sequence, or of sequences whose cached prefix is shared (their work then goes in runs).
static inline bool shares_first_block(const PagedArgs& a, int64_t n, int64_t g) {
  const int64_t b = a.starts[n] / a.bs;
  return a.rows[n] == a.rows[g] ||
         a.tables[a.rows[n] * a.max_blocks + b] == a.tables[a.rows[g] * a.max_blocks + b];
}

// Whether query rows x and y read the same cache rows for keys [k0, max of their ends): the
// same sequence, or other sequences whose block tables agree over those keys (a prefix that
// prefix caching shares).
static inline bool same_keys(const PagedArgs& a, const RowState& x, const RowState& y,
                             int64_t k0) {
  if (a.rows[x.n] == a.rows[y.n]) return true;
  const int64_t b0 = k0 / a.bs, b1 = (std::max(x.k1, y.k1) + a.bs - 1) / a.bs;
  return std::equal(a.tables + a.rows[x.n] * a.max_blocks + b0,
                    a.tables + a.rows[x.n] * a.max_blocks + b1,
                    a.tables + a.rows[y.n] * a.max_blocks + b0);
}

// attend_keys for `rows` (the same k0), in runs of rows that read the same cache rows: each
// run's tiles are read once for all of its rows.
static void attend_runs(const PagedArgs& a, PagedScratch& s, const std::vector<RowState>& rows,
                        int64_t h0, int64_t heads, int64_t k0) {
  char taken[kGroupRows] = {};
  std::vector<RowState>& run = s.run;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (taken[i]) continue;
    run.assign(1, rows[i]);
    for (size_t j = i + 1; j < rows.size(); ++j)
      if (!taken[j] && same_keys(a, rows[i], rows[j], k0)) run.push_back(rows[j]), taken[j] = 1;
    attend_keys(a, s, run.data(), run.size(), h0, heads, k0);
  }
}

// Query rows [g0, g1) (the same first key; one sequence, or sequences sharing cached blocks)
// over KV heads [h0, h0 + heads):
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
  attend_runs(a, s, b.rows, h0, heads, chunks.range(g0, 0).first);
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
    attend_runs(a, s, b.rows, h0, heads, k0);
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

// Whether such a cache's transposed keys are scored on vdpbf16ps (q and p rounded to bf16).
inline bool keys_dot(KVFormat fmt, int64_t D, int64_t G) {
#ifdef TM_ATTENTION_KEYS_DP
  return keys_transposed(fmt, D, G) && attention_keys_dp::active();
#else
  return false;
#endif
}

// Whether a lone row reads such a cache's bf16 or fp16 K and V rows in place through
// paged_attention_raw.h (where the transposed keys, which read bf16 in place too, do not apply).
inline bool reads_raw(KVFormat fmt, int64_t D, int64_t G) {
#ifdef TM_ATTENTION_RAW
  const bool half = fmt == KVFormat::kBf16 || fmt == KVFormat::kFp16;
  return attention_raw::applies(half, D, G) && !keys_transposed(fmt, D, G);
#else
  return false;
#endif
}

// Whether a cache of this format and head size is attended on the AMX tile unit.
inline bool on_tiles(KVFormat fmt, int64_t D) {
#ifdef TM_ATTENTION_AMX
  return attention_amx::applies(fmt == KVFormat::kBf16, D);
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
  const bool tiles = on_tiles(fmt, D);  // (every row there: the transposed keys unused)
  const PagedArgs a{q.data_ptr<float>(), static_cast<const uint8_t*>(k_cache.data_ptr()),
                    static_cast<const uint8_t*>(v_cache.data_ptr()), tables.data_ptr<int64_t>(),
                    rows.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                    lens.data_ptr<int64_t>(), kv_head_scales(fmt, kv_scales, Hkv), fmt, Hq, Hkv,
                    Hq / Hkv, D, bs, tables.size(1), kv_row_bytes(fmt, D),
                    static_cast<float>(scale), static_cast<float>(soft_cap),
                    keys_transposed(fmt, D, Hq / Hkv) && !tiles, tiles,
                    keys_dot(fmt, D, Hq / Hkv) && !tiles,
                    reads_raw(fmt, D, Hq / Hkv) && !tiles};
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
  // chunk (partial states kept, merged below). An item takes all heads with enough rows, else
  // the most heads (a divisor of Hkv) that still give every thread two items with the rows'
  // chunks of keys: each cached token's K (and V) row, its Hkv heads of D values, is read in
  // as few contiguous pieces as the threads allow, with a window of keys asked for ahead into
  // L2 (attend_keys); an item of one head reads a strided 1 / Hkv of every row (a lone decode
  // over 1,500 keys of a bf16 cache in batch-invariant mode, AVX2: 0.53 ms at one head an
  // item, 0.34 at four, benchmarks/attention_kernel.py, the fiftieth session).
  // With split_keys > 0 (batch-invariant) neither choice changes any row's arithmetic, only
  // which thread does it; with 0 a row's chunks follow the items, as they follow the threads.
  const int64_t threads = at::get_num_threads();
  constexpr int64_t kMinKeysPerSplit = 64;
  const int64_t key_chunks =
      N * std::max<int64_t>(1, longest / (split_keys > 0 ? split_keys : kMinKeysPerSplit));
  int64_t heads_per_item = Hkv;  // the most heads that still give every thread two items
  while (N < 4 * threads && heads_per_item > 1 &&
         (Hkv % heads_per_item != 0 || key_chunks * (Hkv / heads_per_item) < 2 * threads))
    --heads_per_item;
  const int64_t items_per_row = Hkv / heads_per_item;
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
        a.starts[n] != a.starts[g] || !shares_first_block(a, n, g))
      group_first.push_back(n);
  }
  group_first.push_back(N);
  const int64_t groups = static_cast<int64_t>(group_first.size()) - 1;
  const int64_t units = whole_rows ? groups * items_per_row : total_chunks * items_per_row;
  // Item u's lone row and its keys, where a thread's items stream their keys into L2
  // (paged_attention_ahead.h): whole rows alone (a batch's decodes, each thread's a run of
  // short items). A few rows cut into chunks (each thread's a few long items) ask for each
  // item's window as it starts instead: the burst finds the memory idle (a lone decode over
  // 3,000 keys: ~1.15x faster than streamed, benchmarks/attention_kernel.py).
  auto lone_row = [&](int64_t u) -> std::optional<KeySegment> {
    if (!whole_rows || a.tiles) return std::nullopt;
    const int64_t g0 = group_first[u / items_per_row];
    if (group_first[u / items_per_row + 1] - g0 > 1) return std::nullopt;
    return KeySegment{a.tables + a.rows[g0] * a.max_blocks, a.starts[g0], a.lens[g0],
                      (u % items_per_row) * heads_per_item};
  };
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    PagedScratch& s = PagedScratch::of_thread(a, heads_per_item, kTileKeys);
    GroupBuffers& b = GroupBuffers::of_thread(rows_q, D);
    KeyStream& stream = KeyStream::of_thread();  // the range's lone rows' keys, in order
    stream.restart(CacheRows{a.kb, a.vb, a.row_bytes, heads_per_item}, a.bs, a.Hkv);
    for (int64_t u = begin; u < end; ++u)
      if (const auto seg = lone_row(u)) stream.add(*seg);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t h0 = (u % items_per_row) * heads_per_item;
      s.stream = lone_row(u) ? &stream : nullptr;
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
    s.stream = nullptr;
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
