// What a work item of the paged-attention kernel (paged_attention_cpu.h) reads and the
// per-thread buffers its tile walk (paged_attention_tiles.h) uses: the kernel's arguments,
// the tile size, a query row's softmax state.
#pragma once
#include "kv_formats.h"
#include "paged_attention_ahead.h"
#include "paged_attention_amx_walk.h"
#include "paged_attention_keys_t.h"
#include <cstdint>
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
  bool tiles;   // bf16 on the AMX tile unit (paged_attention_amx.h): every row (keys_t off)
  bool dot;     // keys_t on vdpbf16ps (paged_attention_keys_dp.h): q and p rounded to bf16
  bool raw;     // a lone row's bf16 / fp16 K and V read in place (paged_attention_raw.h), keys_t off
};

constexpr int64_t kTileKeys = 64;  // keys of a tile of the online softmax
// Up to this many consecutive query rows (one sequence's, or sequences' sharing cached
// blocks) form a work item (attend_group).
constexpr int64_t kGroupRows = 16;
#ifdef TM_ATTENTION_KEYS_T
static_assert(kTileKeys == attention_keys_t::kTileKeys, "one tile size");
#endif
#ifdef TM_ATTENTION_AMX
static_assert(kTileKeys == attention_amx::kKeys, "one tile size");
#endif

// One query row's share of a group walking the same keys (attend_keys): its row, its keys'
// end and its softmax state (acc (heads G, D) unnormalised, mx and sum per query head).
struct RowState {
  int64_t n, k1;
  float *acc, *mx, *sum;
};

// Grows v to at least n elements (never shrinks it: a thread's buffers are kept between calls).
template <class T>
static inline void grow_to(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// Per-thread buffers of an item covering `heads` KV heads (G query heads each): one set per
// thread, kept between calls and grown as needed. Allocated per call, they cost a decode at
// Llama-3.1-8B's heads 1 MB a thread zeroed (with the group buffers), and where glibc maps
// such blocks afresh ~500 page faults a call: 2x the kernel's own time for a lone row over
// 3,000 keys. Every buffer is written before it is read, so what a call left is never used.
struct PagedScratch {
  std::vector<float> scores, kbuf, vbuf, corr, kT;  // kT: a.dot's word pairs (uint32) there
  std::vector<uint32_t> qp;           // dot: the item's q rounded, (heads G, 32) bf16 pairs
  std::vector<const float*> krows, vrows;
  std::vector<const uint16_t*> kraw, vraw;  // keys_t, raw: a tile's half K (V) rows of a head
  std::vector<int64_t> key_rows;      // keys_t, raw: each key's first row (head h0) in the cache
  std::vector<int64_t> next_rows;     // direct: the next tile's keys' first rows,
  LinesAhead ahead;                   // whose cache lines are asked for through this
  std::vector<RowState> run;          // attend_runs: the rows of one run
  KeyStream* stream = nullptr;        // a lone row's keys asked for ahead through it, if set
#ifdef TM_ATTENTION_AMX
  attention_amx::Scratch* tiles = nullptr;  // tiles: the thread's buffers (amx_walk.h)
#endif

  static PagedScratch& of_thread(const PagedArgs& a, int64_t heads, int64_t tile) {
    static thread_local PagedScratch s;
    s.grow(a, heads, tile);
    return s;
  }

 private:
  void grow(const PagedArgs& a, int64_t heads, int64_t tile) {
    grow_to(krows, tile), grow_to(vrows, tile), grow_to(kraw, tile), grow_to(vraw, tile);
    grow_to(key_rows, tile), grow_to(next_rows, tile);
#ifdef TM_ATTENTION_AMX
    tiles = nullptr;
    if (a.tiles) {  // their own buffers
      const int64_t columns = kGroupRows * a.G;  // per KV head, at most
      tiles = &attention_amx::Scratch::of_thread(heads, (columns + 15) / 16, a.D);
      return;
    }
#endif
    grow_to(scores, heads * a.G * tile), grow_to(corr, heads * a.G);
    if (a.fmt != KVFormat::kFloat32 && !a.keys_t) grow_to(kbuf, tile * heads * a.D);
    if (a.fmt != KVFormat::kFloat32 && !a.dot) grow_to(vbuf, tile * heads * a.D);
    if (a.keys_t) grow_to(kT, heads * a.D * tile);
    if (a.dot) grow_to(qp, heads * a.G * a.D / 2);
  }
};
