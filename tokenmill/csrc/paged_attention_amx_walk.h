// The walk of paged_attention_amx.h over a work item's keys, one tile of 64 at a time: the
// tile's keys located in the cache, the next tile's asked for, and its phases over the item's
// columns (query row, query head) per KV head.
#pragma once
#include "paged_attention_ahead.h"
#include "paged_attention_amx.h"
#include <vector>

#ifdef TM_ATTENTION_AMX
namespace attention_amx {

// What a tile of keys' walk reads: the caches, their rows' shapes, each key's cache row
// (its first KV head's) and the scores' scale and soft cap.
struct TileKeys {
  const uint8_t *kb, *vb;
  int64_t row_bytes, Hkv, D;
  const int64_t* rows;  // key i's cache row, head h at rows[i] + h
  int64_t keys;         // the tile's keys (<= 64)
  float scale, cap;
  const int64_t* next;  // the next tile's keys' cache rows (next_keys of them), whose heads'
  int64_t next_keys;    // K and V lines are asked for during this tile
};

// The next tile's cache lines (`heads` heads of each key's K and V rows).
static inline LinesAhead lines_ahead(const TileKeys& t, int64_t heads) {
  return LinesAhead(CacheRows{t.kb, t.vb, t.row_bytes, heads}, t.next, t.next_keys);
}

// An item's columns: per KV head h (of `heads`) J columns (query row, query head), in column
// blocks of 16; column c of head h has own[c] keys in this tile (<= 0: none) and its state at
// mx[h * J + c], sum[..] and acc[..] (D floats).
struct Columns {
  int64_t heads, J;
  const int64_t* own;
  float* const *mx, *const *sum, *const *acc;
  int64_t blocks() const { return (J + kCols - 1) / kCols; }
  int64_t width(int64_t cb) const { return std::min<int64_t>(kCols, J - kCols * cb); }
};

// A thread's buffers for items of up to `heads` KV heads and `blocks` column blocks: one per
// thread, kept between calls and grown as needed (allocating and zeroing them per call cost
// ~10% of a one-sequence decode's attention).
struct Scratch {
  std::vector<uint32_t> qT, pe, po;      // per (head, block): q as B tiles; per unit: p
  std::vector<uint16_t> kcopy, vcopy;    // per (head, 16 keys): rows not in place
  std::vector<float> sT, st, ot, corr;   // per unit: scores, (one unit) transposed, o, corr
  std::vector<const uint8_t*> kp, vp;    // per (head, 16 keys): where its rows lie
  std::vector<int64_t> ks, vs, own;      // their strides; own: a tile's keys per column
  std::vector<int64_t> next_rows;        // the next tile's keys' cache rows
  std::vector<const float*> q;           // per (head, column): q, and the state (Columns)
  std::vector<float*> mx, sum, acc;

  static Scratch& of_thread(int64_t heads, int64_t blocks, int64_t D) {
    static thread_local Scratch s;
    s.grow(heads, blocks, D);
    return s;
  }

 private:
  template <class T>
  static void at_least(std::vector<T>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }
  void grow(int64_t heads, int64_t blocks, int64_t D) {
    const int64_t units = heads * blocks;
    at_least(qT, units * 8 * D), at_least(pe, units * 1024), at_least(po, units * 1024);
    at_least(kcopy, heads * 4 * 16 * D), at_least(vcopy, heads * 4 * 16 * D);
    at_least(sT, units * 1024), at_least(st, 1024), at_least(ot, units * 16 * D);
    at_least(corr, units * 16), at_least(kp, heads * 4), at_least(vp, heads * 4);
    at_least(ks, heads * 4), at_least(vs, heads * 4), at_least(own, blocks * kCols);
    at_least(next_rows, kKeys), at_least(q, blocks * kCols * heads);
    at_least(mx, blocks * kCols * heads), at_least(sum, blocks * kCols * heads);
    at_least(acc, blocks * kCols * heads);
  }
};

// qT of every (head, column block) of an item: q[h * J + c] the D floats of column c of head h.
static inline void item_q_tiles(const float* const* q, const Columns& c, int64_t D,
                                Scratch& s) {
  for (int64_t h = 0; h < c.heads; ++h)
    for (int64_t cb = 0; cb < c.blocks(); ++cb)
      q_tiles(q + h * c.J + kCols * cb, c.width(cb), D,
              s.qT.data() + (h * c.blocks() + cb) * 8 * D);
}

// Where each (head, 16 keys) of the tile lies (key_rows16): s.kp / s.vp, strides s.ks / s.vs.
static inline void locate(const TileKeys& t, int64_t heads, Scratch& s) {
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t kb = 0; kb * 16 < t.keys; ++kb) {
      const int64_t i = h * 4 + kb;
      s.kp[i] = key_rows16(t.kb, t.rows, 16 * kb, t.keys, h, t.row_bytes, t.Hkv, t.D,
                           s.kcopy.data() + i * 16 * t.D, &s.ks[i]);
      s.vp[i] = key_rows16(t.vb, t.rows, 16 * kb, t.keys, h, t.row_bytes, t.Hkv, t.D,
                           s.vcopy.data() + i * 16 * t.D, &s.vs[i]);
    }
}

// Every unit's scores sT (per 16 keys: 16 keys x 16 columns, float32), by the tile unit.
// Unit u: column block u / heads of head u % heads.
static inline void score_units(const TileKeys& t, const Columns& c, Scratch& s,
                               Config& config) {
  const int64_t D = t.D, kbs = (t.keys + 15) / 16;
  for (int64_t u = 0; u < c.heads * c.blocks(); ++u) {
    const int64_t h = u % c.heads, cb = u / c.heads, n = c.width(cb);
    const uint32_t* qT = s.qT.data() + (h * c.blocks() + cb) * 8 * D;
    config.cols(n);
    for (int64_t kb = 0; kb < kbs; ++kb) {
      amx::zero<2>();
      for (int64_t dh = 0; dh < D / 32; ++dh) {  // d in order
        amx::load<0>(s.kp[h * 4 + kb] + 64 * dh, s.ks[h * 4 + kb]);
        amx::load<1>(qT + dh * 16 * n, 4 * n);
        dot<2, 0, 1>();
      }
      amx::store<2>(s.sT.data() + u * 1024 + kb * 256, 64);
    }
  }
}

// Every unit's scores transposed to its columns' rows and scaled (s.st), soft-capped, then
// each column's softmax (softmax_rows: s.pe, s.po, s.corr); the next tile's cache lines
// asked for meanwhile, a few per transposed vector (a burst stalls once the core's
// outstanding misses are full).
static inline void softmax_units(const TileKeys& t, const Columns& c, Scratch& s) {
  const int64_t kbs = (t.keys + 15) / 16, units = c.heads * c.blocks();
  const __m512 scale = _mm512_set1_ps(t.scale);
  LinesAhead ahead = lines_ahead(t, c.heads);
  const int64_t calls = units * kbs * 16, per_call = (ahead.steps() + calls - 1) / calls;
  for (int64_t u = 0; u < units; ++u) {
    const int64_t h = u % c.heads, cb = u / c.heads, n = c.width(cb), c0 = h * c.J + kCols * cb;
    for (int64_t kb = 0; kb < kbs; ++kb) {
      __m512 w[16];
      for (int i = 0; i < 16; ++i) w[i] = _mm512_loadu_ps(&s.sT[u * 1024 + kb * 256 + 16 * i]);
      transpose16(w, [&](int j, __m512 v) {  // v: column j's scores of keys 16 kb ..
        ahead.ask(per_call);
        if (j < n) _mm512_storeu_ps(&s.st[j * kKeys + 16 * kb], _mm512_mul_ps(scale, v));
      });
    }
    for (int64_t j = 0; t.cap > 0.f && j < n; ++j)  // Gemma 2's soft cap
      for (int64_t i = 0; i < c.own[kCols * cb + j]; ++i) {
        float& x = s.st[j * kKeys + i];
        x = t.cap * std::tanh(x / t.cap);
      }
    softmax_rows(s.st.data(), n, c.own + kCols * cb, c.mx + c0, c.sum + c0, &s.corr[u * 16],
                 &s.pe[u * 1024], &s.po[u * 1024]);
  }
}

// Every unit's o = p . V by the tile unit (s.ot: per 32 d, its even d then its odd d, 16
// columns x 16 each).
static inline void value_units(const TileKeys& t, const Columns& c, Scratch& s,
                               Config& config) {
  const int64_t D = t.D, kbs = (t.keys + 15) / 16;
  for (int64_t u = 0; u < c.heads * c.blocks(); ++u) {
    const int64_t h = u % c.heads, n = c.width(u / c.heads);
    config.cols(n);
    for (int64_t dh = 0; dh < D / 32; ++dh) {  // o's d in [32 dh, 32 dh + 32)
      amx::zero<6>();
      amx::zero<7>();
      for (int64_t kb = 0; kb < kbs; ++kb) {
        amx::load<5>(s.vp[h * 4 + kb] + 64 * dh, s.vs[h * 4 + kb]);
        amx::load<3>(&s.pe[u * 1024 + kb * n * 16], 64);
        amx::load<4>(&s.po[u * 1024 + kb * n * 16], 64);
        dot<6, 3, 5>();
        dot<7, 4, 5>();
      }
      amx::store<6>(&s.ot[u * 16 * D + dh * 512], 64);
      amx::store<7>(&s.ot[u * 16 * D + dh * 512 + 256], 64);
    }
  }
}

// Each column with keys in the tile: acc = fma(acc, corr, o), o's even and odd d interleaved.
static inline void update_columns(const TileKeys& t, const Columns& c, const Scratch& s) {
  const int64_t D = t.D;
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int64_t u = 0; u < c.heads * c.blocks(); ++u) {
    const int64_t h = u % c.heads, cb = u / c.heads, n = c.width(cb), c0 = h * c.J + kCols * cb;
    for (int64_t j = 0; j < n; ++j) {
      if (c.own[kCols * cb + j] <= 0) continue;
      const __m512 corr = _mm512_set1_ps(s.corr[u * 16 + j]);
      for (int64_t dh = 0; dh < D / 32; ++dh) {
        const float* o = &s.ot[u * 16 * D + dh * 512 + 16 * j];
        const __m512 e = _mm512_loadu_ps(o), od = _mm512_loadu_ps(o + 256);
        float* out = c.acc[c0 + j] + 32 * dh;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_loadu_ps(out), corr,
                                              _mm512_permutex2var_ps(e, lo, od)));
        _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_loadu_ps(out + 16), corr,
                                                   _mm512_permutex2var_ps(e, hi, od)));
      }
    }
  }
}

// One tile of keys for every column of an item, in phases over all (column block, head)
// units rather than unit after unit: each phase's stores (the tile unit's or the vectors')
// are read by the next phase's loads, and a load waits for the stores before it to
// complete, so a unit's round trips overlap the other units' work.
static inline void attend_tile(const TileKeys& t, const Columns& c, Scratch& s,
                               Config& config) {
  locate(t, c.heads, s);
  score_units(t, c, s, config);
  softmax_units(t, c, s);
  value_units(t, c, s, config);
  update_columns(t, c, s);
}

}  // namespace attention_amx
#endif
