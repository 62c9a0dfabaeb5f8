// What a work item of the paged-attention kernel (paged_attention_cpu.h) reads and the
// per-thread buffers its tile walk (paged_attention_tiles.h) uses: the kernel's arguments,
// the tile size, a query row's softmax state.
#pragma once
#include "kv_formats.h"
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
  bool raw;     // AVX2: a lone row's bf16 K and V read in place (paged_attention_raw.h)
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

// Per-thread buffers of an item covering `heads` KV heads (G query heads each).
struct PagedScratch {
  std::vector<float> scores, kbuf, vbuf, corr, kT;  // kT: a.dot's word pairs (uint32) there
  std::vector<uint32_t> qp;           // dot: the item's q rounded, (heads G, 32) bf16 pairs
  std::vector<const float*> krows, vrows;
  std::vector<const uint16_t*> kraw, vraw;  // keys_t, raw: a tile's bf16 K (V) rows of a head
  std::vector<int64_t> key_rows;      // keys_t, raw: each key's first row (head h0) in the cache
  std::vector<const void*> ahead;     // direct: the next tile's cache lines, to prefetch
  std::vector<RowState> run;          // attend_runs: the rows of one run
#ifdef TM_ATTENTION_AMX
  attention_amx::Scratch* tiles = nullptr;  // tiles: the thread's buffers (amx_walk.h)
#endif
  PagedScratch(const PagedArgs& a, int64_t heads, int64_t tile)
      : scores(a.tiles ? 0 : heads * a.G * tile),  // (tiles: their own buffers)
        kbuf(a.fmt == KVFormat::kFloat32 || a.keys_t || a.tiles ? 0 : tile * heads * a.D),
        vbuf(a.fmt == KVFormat::kFloat32 || a.tiles || a.dot ? 0 : tile * heads * a.D),
        corr(heads * a.G), kT(a.keys_t ? heads * a.D * tile : 0),
        qp(a.dot ? heads * a.G * a.D / 2 : 0), krows(tile), vrows(tile),
        kraw(tile), vraw(tile), key_rows(tile) {
#ifdef TM_ATTENTION_AMX
    if (!a.tiles) return;
    const int64_t columns = kGroupRows * a.G;  // per KV head, at most
    tiles = &attention_amx::Scratch::of_thread(heads, (columns + 15) / 16, a.D);
#endif
  }
};
