// The paged-attention kernel's walk over one work item's keys (paged_attention_cpu.h): its
// K and V rows read tile by tile from the block-paged cache (in place, widened, or with bf16
// keys transposed: paged_attention_keys_t.h, which also widens a lone row's bf16 rows in
// registers, as paged_attention_raw.h does for the other shapes), the next tile's rows
// prefetched meanwhile, and each query row's online softmax over the tiles
// (paged_attention_rows.h's arithmetic).
// Invariant: a row's tiles are [k0 + 64 j, min(k1, k0 + 64 (j + 1))) and its arithmetic is
// its own, whatever other rows walk the same keys with it.
#pragma once
#include "kv_formats.h"
#include "paged_attention_amx_walk.h"
#include "paged_attention_args.h"
#include "paged_attention_keys_dp.h"
#include "paged_attention_keys_t.h"
#include "paged_attention_raw.h"
#include "paged_attention_rows.h"
#include "vec_utils.h"
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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

// A row walking its keys alone (a decode: attend_keys) asks for a window of its keys ahead
// into L2: through the thread's KeyStream (paged_attention_ahead.h) where the caller set one
// up for its items, else from the item's own keys (the window's first keys as it starts, then
// a tile's more as it reaches each tile). A tile's 64 keys span four scattered 16-token blocks
// of a few pages each, and with only the next tile asked for (into L1, load_tile) the reads
// still waited on memory: 64 decodes over 320 keys of a bf16 cache in DRAM ran at ~8 GB/s
// against ~20 from L3 (Zen 4; 1.3-1.4x with the window, bf16 and float32 caches alike).
// Prefetches only: no arithmetic changes.
static inline int64_t l2_window_keys(const PagedArgs& a, int64_t heads) {
  const int64_t per_key = 2 * heads * a.row_bytes;
  return std::max<int64_t>(1, kL2WindowBytes / per_key / kTileKeys) * kTileKeys;
}

// Keys [k0, k1) of a sequence (block table `table`; heads [h0, h0 + heads)) into L2, in
// address order: in each block the bytes from the first key's row to the last one's (all
// heads: one span), or each key's rows of the item's heads (some: not the other heads').
static inline void prefetch_keys_l2(const PagedArgs& a, const int64_t* table, int64_t k0,
                                    int64_t k1, int64_t h0, int64_t heads) {
  auto ask = [&](int64_t row, int64_t bytes) {  // K's and V's bytes from cache row `row`
    for (int64_t o = 0; o < bytes; o += 64) {
      prefetch_l2(a.kb + row * a.row_bytes + o);
      prefetch_l2(a.vb + row * a.row_bytes + o);
    }
  };
  for (int64_t k = k0; k < k1;) {
    const int64_t blk = k / a.bs, end = std::min(k1, (blk + 1) * a.bs);
    const int64_t first = (table[blk] * a.bs + k % a.bs) * a.Hkv + h0;
    if (heads == a.Hkv) {
      ask(first, ((end - k - 1) * a.Hkv + heads) * a.row_bytes);
    } else {
      for (int64_t i = 0; i < end - k; ++i) ask(first + i * a.Hkv, heads * a.row_bytes);
    }
    k = end;
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


// out[i] = the bf16 row of head h0 + h of the tile's key i (i < n), in the cache at `base`.
static inline void raw_rows(const PagedArgs& a, const uint8_t* base, const int64_t* key_rows,
                            int64_t h, int64_t n, const uint16_t** out) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = reinterpret_cast<const uint16_t*>(base + (key_rows[i] + h) * a.row_bytes);
}

// The online softmax's step over a tile's scores (s.scores, rows_q rows of `keys`): each
// row's max, its rescale factor (s.corr) and sum; the scores become exp(s - max).
static void softmax_tile(const PagedArgs& a, PagedScratch& s, const RowState& row,
                         int64_t rows_q, int64_t keys) {
  if (a.cap > 0.f) {  // Gemma 2's soft cap, before the softmax
    for (int64_t j = 0; j < rows_q * keys; ++j)
      s.scores[j] = a.cap * std::tanh(s.scores[j] / a.cap);
  }
  for (int64_t r = 0; r < rows_q; ++r) {
    float* sc = s.scores.data() + r * keys;
    const float m = std::max(row.mx[r], max_of(sc, keys));
    s.corr[r] = std::exp(row.mx[r] - m);  // 0 on the first tile (-inf)
    row.sum[r] = row.sum[r] * s.corr[r] + exp_minus_max(sc, m, keys);
    row.mx[r] = m;
  }
}

#ifdef TM_ATTENTION_KEYS_DP  // (implies TM_ATTENTION_KEYS_T)
// attend_tile on vdpbf16ps (paged_attention_keys_dp.h): a row alone scores the K rows in
// place (`direct`), a group's rows the tile's word pairs in s.kT; V is read in place by both.
static void attend_tile_dot(const PagedArgs& a, PagedScratch& s, const RowState& row,
                            int64_t h0, int64_t heads, int64_t keys, bool direct) {
  namespace dp = attention_keys_dp;
  const int64_t G = a.G, D = a.D;
  dp::round_q(a.q + (row.n * a.Hq + h0 * G) * D, heads * G, s.qp.data());
  for (int64_t h = 0; h < heads; ++h) {
    const uint32_t* kP = nullptr;
    if (direct)
      raw_rows(a, a.kb, s.key_rows.data(), h, keys, s.kraw.data());
    else
      kP = reinterpret_cast<const uint32_t*>(s.kT.data() + h * D * kTileKeys);  // load_tile's
    dp::score_group(G, s.qp.data() + h * G * dp::kPairs, kP, s.kraw.data(), a.scale, keys,
                    s.scores.data() + h * G * keys);
  }
  softmax_tile(a, s, row, heads * G, keys);
  const int64_t lines = s.ahead.steps();  // direct only: a share per head
  for (int64_t h = 0; h < heads; ++h) {
    raw_rows(a, a.vb, s.key_rows.data(), h, keys, s.vraw.data());
    const int64_t l0 = lines * h / heads, l1 = lines * (h + 1) / heads;
    dp::accumulate_group(G, s.scores.data() + h * G * keys, keys, s.vraw.data(), keys,
                         &s.corr[h * G], row.acc + h * G * D, s.ahead, l1 - l0);
  }
}
#endif

#ifdef TM_ATTENTION_RAW
// attend_tile for a row alone where paged_attention_raw.h applies: the bf16 or fp16 K and V
// rows of s.key_rows read in place, the widened path's arithmetic.
static void attend_tile_raw(const PagedArgs& a, PagedScratch& s, const RowState& row,
                            int64_t h0, int64_t heads, int64_t keys) {
  const int64_t G = a.G, D = a.D;
  const float* qn = a.q + (row.n * a.Hq + h0 * G) * D;
  const bool f16 = a.fmt == KVFormat::kFp16;
  attention_raw::score_heads_raw(f16, G, qn, a.kb, a.vb, s.key_rows.data(), a.row_bytes, heads, D,
                                 a.scale, keys, s.scores.data());
  softmax_tile(a, s, row, heads * G, keys);
  const int64_t lines = s.ahead.steps();  // a share per head
  for (int64_t h = 0; h < heads; ++h) {
    raw_rows(a, a.vb, s.key_rows.data(), h, keys, s.vraw.data());
    const int64_t l0 = lines * h / heads, l1 = lines * (h + 1) / heads;
    attention_raw::accumulate_group_raw(f16, G, s.scores.data() + h * G * keys, keys, s.vraw.data(),
                                        keys, D, &s.corr[h * G], row.acc + h * G * D,
                                        s.ahead, l1 - l0);
  }
}
#endif

// One tile's `keys` keys (rows in s.krows / s.vrows; `direct`: the half rows of
// s.key_rows, read in place) for one query row: scores, the online softmax's rescale, the
// weighted sum of V.
static void attend_tile(const PagedArgs& a, PagedScratch& s, const RowState& row, int64_t h0,
                        int64_t heads, int64_t keys, bool direct) {
#ifdef TM_ATTENTION_KEYS_DP  // (implies TM_ATTENTION_KEYS_T)
  if (a.dot) return attend_tile_dot(a, s, row, h0, heads, keys, direct);
#endif
#ifdef TM_ATTENTION_RAW
  if (direct && a.raw) return attend_tile_raw(a, s, row, h0, heads, keys);
#endif
  const int64_t rows_q = heads * a.G, D = a.D;
  const float* qn = a.q + (row.n * a.Hq + h0 * a.G) * D;
  float* acc = row.acc;
#ifdef TM_ATTENTION_KEYS_T
  if (direct) {
    for (int64_t h = 0; h < heads; ++h) {
      raw_rows(a, a.kb, s.key_rows.data(), h, keys, s.kraw.data());
      attention_keys_t::score_group_raw(a.G, qn + h * a.G * D, s.kraw.data(), a.scale, keys,
                                        s.scores.data() + h * a.G * keys);
    }
  } else if (a.keys_t) {
    for (int64_t h = 0; h < heads; ++h)
      attention_keys_t::score_group_t(a.G, qn + h * a.G * D, s.kT.data() + h * D * kTileKeys,
                                      a.scale, keys, s.scores.data() + h * a.G * keys);
  } else
#endif
  score_keys_any(qn, s.krows.data(), heads, keys, a.G, D, a.scale, s.scores.data());
  softmax_tile(a, s, row, rows_q, keys);
  for (int64_t h = 0; h < heads; ++h) {  // the G heads sharing each V row together
    const int64_t r0 = h * a.G;
#ifdef TM_ATTENTION_KEYS_T
    if (direct) {
      raw_rows(a, a.vb, s.key_rows.data(), h, keys, s.vraw.data());
      const int64_t lines = s.ahead.steps();  // a share per head
      const int64_t l0 = lines * h / heads, l1 = lines * (h + 1) / heads;
      attention_keys_t::accumulate_group_raw(a.G, s.scores.data() + r0 * keys, keys,
                                             s.vraw.data(), keys, &s.corr[r0], acc + r0 * D,
                                             s.ahead, l1 - l0);
      continue;
    }
#endif
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
// keys_t the V rows widened and the K rows transposed into s.kT (one (D, 64) per head), or
// (`direct`, keys_t for one row) only each key's cache row noted, in s.key_rows. The rows
// of keys [t0 + keys, next_end) (the next tile) are prefetched meanwhile.
static void load_tile(const PagedArgs& a, PagedScratch& s, const int64_t* table, int64_t t0,
                      int64_t keys, int64_t next_end, int64_t h0, int64_t heads, bool direct) {
  const int64_t D = a.D;
  int64_t blk = t0 / a.bs, off = t0 % a.bs;  // key t0 + i's block and slot, stepped (a
  int64_t next = t0 + keys;                  // division per key cost ~10% of a decode)
  int64_t nblk = next / a.bs, noff = next % a.bs;
  int64_t asked = 0;  // direct: the next tile's keys, their rows in s.next_rows
  for (int64_t i = 0; i < keys; ++i) {
    if (off == a.bs) ++blk, off = 0;
    if (noff == a.bs) ++nblk, noff = 0;
    if (next++ < next_end) {
      const int64_t nrow = (table[nblk] * a.bs + noff) * a.Hkv + h0;
      if (!direct) {
        prefetch_row(a, nrow, heads);
      } else {  // asked for during the arithmetic (s.ahead: paged_attention_ahead.h)
        s.next_rows[asked++] = nrow;
      }
    }
    ++noff;
    const int64_t row = (table[blk] * a.bs + off++) * a.Hkv + h0;  // first head's
    if (direct) {
      s.key_rows[i] = row;
      continue;
    }
    if (a.fmt == KVFormat::kFloat32) {  // read in place
      s.krows[i] = reinterpret_cast<const float*>(a.kb) + row * D;
      s.vrows[i] = reinterpret_cast<const float*>(a.vb) + row * D;
      continue;
    }
    if (a.keys_t) {  // K transposed below (its rows asked for now); V widened row by row,
      s.key_rows[i] = row;  // or with a.dot read in place (attend_tile_dot)
      for (int64_t o = 0; o < heads * a.row_bytes; o += 64)
        __builtin_prefetch(a.kb + row * a.row_bytes + o);
      for (int64_t h = 0; !a.dot && h < heads; ++h)
        bf16_load_row(a.vb + (row + h) * a.row_bytes, D, &s.vbuf[(i * heads + h) * D]);
      s.vrows[i] = a.dot ? nullptr : &s.vbuf[i * heads * D];
      continue;
    }
    float* vd = &s.vbuf[i * heads * D];
    s.vrows[i] = vd;
    float* kd = &s.kbuf[i * heads * D];
    for (int64_t h = 0; h < heads; ++h) {
      const float ks = a.head_scales ? a.head_scales[h0 + h] : 0.f;
      const float vs = a.head_scales ? a.head_scales[a.Hkv + h0 + h] : 0.f;
      kv_load_row(a.fmt, a.kb + (row + h) * a.row_bytes, D, ks, kd + h * D);
      kv_load_row(a.fmt, a.vb + (row + h) * a.row_bytes, D, vs, vd + h * D);
    }
    s.krows[i] = kd;
  }
  // (a lone row's stream: its window's lines asked for with the next tile's)
  s.ahead = LinesAhead(CacheRows{a.kb, a.vb, a.row_bytes, heads}, s.next_rows.data(), asked,
                       direct ? s.stream : nullptr);
#ifdef TM_ATTENTION_KEYS_T
  for (int64_t h = 0; a.keys_t && !direct && h < heads; ++h) {  // the tile's keys of head h0 + h
    for (int64_t i = 0; i < keys; ++i)
      s.kraw[i] = reinterpret_cast<const uint16_t*>(a.kb + (s.key_rows[i] + h) * a.row_bytes);
    float* kT = s.kT.data() + h * D * kTileKeys;
#ifdef TM_ATTENTION_KEYS_DP
    if (a.dot) {
      attention_keys_dp::pair_keys_t(s.kraw.data(), keys, reinterpret_cast<uint32_t*>(kT));
      continue;
    }
#endif
    attention_keys_t::widen_keys_t(s.kraw.data(), keys, kT);
  }
#endif
}

#ifdef TM_ATTENTION_AMX
// attend_keys on the tile unit (paged_attention_amx.h): the rows' columns (query row, query
// head) per KV head, each tile of keys read where it lies in the cache.
static void attend_keys_tiles(const PagedArgs& a, PagedScratch& s, const RowState* rows,
                              int64_t R, int64_t h0, int64_t heads, int64_t k0, int64_t k1) {
  namespace am = attention_amx;
  const int64_t G = a.G, J = R * G;
  const int64_t* table = a.tables + a.rows[rows[0].n] * a.max_blocks;
  std::vector<const float*>& q = s.tiles->q;
  std::vector<float*>&mx = s.tiles->mx, &sum = s.tiles->sum, &acc = s.tiles->acc;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < J; ++c) {
      const RowState& row = rows[c / G];
      const int64_t qh = h * G + c % G, i = h * J + c;
      q[i] = a.q + (row.n * a.Hq + h0 * G + qh) * a.D;
      mx[i] = row.mx + qh, sum[i] = row.sum + qh, acc[i] = row.acc + qh * a.D;
    }
  int64_t* own = s.tiles->own.data();
  const am::Columns cols{heads, J, own, mx.data(), sum.data(), acc.data()};
  am::item_q_tiles(q.data(), cols, a.D, *s.tiles);
  am::Config config;
  // key i of the tile at t0: its cache row (head h0's) in rows[i]; then the next tile's
  auto note_rows = [&](int64_t t0, int64_t keys, int64_t* out) {
    int64_t blk = t0 / a.bs, off = t0 % a.bs;  // stepped: a division per key costs
    for (int64_t i = 0; i < keys; ++i, ++off) {
      if (off == a.bs) ++blk, off = 0;
      out[i] = (table[blk] * a.bs + off) * a.Hkv + h0;
    }
  };
  int64_t* cur = s.key_rows.data();
  int64_t* next = s.tiles->next_rows.data();
  note_rows(k0, std::min(kTileKeys, k1 - k0), cur);
  for (int64_t t0 = k0; t0 < k1; t0 += kTileKeys) {
    const int64_t keys = std::min(kTileKeys, k1 - t0);
    const int64_t next_keys = std::clamp<int64_t>(k1 - t0 - kTileKeys, 0, kTileKeys);
    note_rows(t0 + kTileKeys, next_keys, next);
    for (int64_t c = 0; c < J; ++c) own[c] = std::min(kTileKeys, rows[c / G].k1 - t0);
    const am::TileKeys tk{a.kb, a.vb, a.row_bytes, a.Hkv, a.D, cur, keys, a.scale, a.cap,
                          next, next_keys};
    am::attend_tile(tk, cols, *s.tiles, config);
    std::swap(cur, next);
  }
}
#endif

// Keys [k0, rows[r].k1) of each query row r (the same k0; rows reading the same cache rows,
// rows[0]'s block table serving all), for KV heads [h0, h0 + heads), as an online softmax
// over tiles of kTileKeys keys starting at k0. Each tile's K and V rows (all heads of the
// item) are read from memory (and widened) once for every row and stay in cache while each
// query head of each row uses them; a row's arithmetic is that of the row alone (its tiles
// are [k0 + 64 j, min(k1, k0 + 64 (j + 1))) whatever the group), so grouping changes no
// result. A bf16 or fp16 cache's rows are read in place for a row alone (`direct`) and widened once
// for a group's rows otherwise: the same arithmetic either way.
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
#ifdef TM_ATTENTION_AMX
  if (a.tiles) return attend_keys_tiles(a, s, rows, R, h0, heads, k0, k1);
#endif
  const bool direct = (a.keys_t || a.raw) && R == 1;
  // Rows walking a tile together take a widened cache one KV head at a time, so that the
  // head's widened K and V (32 KB: bf16, D = 64) stay in L1 while every row reads them; all
  // heads at once (96 KB) were re-read from L2 by each row. Each query head's arithmetic is
  // the same either way.
  const bool per_head = !direct && R > 1 && heads > 1 && a.fmt != KVFormat::kFloat32;
  // A row alone (a decode): its window of keys into L2, the thread's stream's or its own
  KeyStream* stream = R == 1 ? s.stream : nullptr;
  const bool window_ahead = R == 1 && stream == nullptr;
  const int64_t window = window_ahead ? l2_window_keys(a, heads) : 0;
  if (window_ahead) prefetch_keys_l2(a, table, k0, std::min(k1, k0 + window), h0, heads);
  for (int64_t t0 = k0; t0 < k1; t0 += kTileKeys) {
    const int64_t keys = std::min(kTileKeys, k1 - t0), next_end = std::min(k1, t0 + 2 * kTileKeys);
    if (stream != nullptr) stream->consumed(keys);
    if (stream != nullptr && !direct) stream->ask(stream->missing());  // (no spread there)
    if (window_ahead && t0 + window < k1)  // the window moves on by this tile
      prefetch_keys_l2(a, table, t0 + window, std::min(k1, t0 + window + kTileKeys), h0, heads);
    for (int64_t h = 0; h < (per_head ? heads : 1); ++h) {
      const int64_t first = per_head ? h0 + h : h0, count = per_head ? 1 : heads;
      load_tile(a, s, table, t0, keys, next_end, first, count, direct);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t own = std::min(kTileKeys, rows[r].k1 - t0);  // the row's keys of the tile
        if (own <= 0) continue;
        const int64_t q = (first - h0) * a.G;  // the row state's first query head here
        const RowState part{rows[r].n, rows[r].k1, rows[r].acc + q * D, rows[r].mx + q,
                            rows[r].sum + q};
        attend_tile(a, s, part, first, count, own, direct);
      }
    }
  }
}
