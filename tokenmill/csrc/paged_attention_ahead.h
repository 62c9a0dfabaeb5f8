// The cache lines a paged-attention walk asks for ahead of its loads, a few at a time during
// its arithmetic (paged_attention_tiles.h for a row alone, paged_attention_amx_walk.h):
// - LinesAhead: the next tile's K and V lines, into L1;
// - KeyStream: a thread's lone query rows' keys, a window ahead into L2, across the work
//   items it computes (paged_attention_cpu.h adds the items of its parallel range in order).
//
// Why spread: a burst of prefetches stalls once the core's outstanding misses are full, and
// the loads then wait on the memory instead of overlapping it. Each step asks for one line of
// a key's K rows and the same line of its V rows, in key order, the addresses computed as
// they are asked for. Before (the fifty-third session's perf of 64 decodes over 320 keys of a
// bf16 cache): a list of the next tile's line addresses built per tile (768 pointers) had cost
// as much as the keys' scores, and the L2 window, asked for a tile at a time, stalled on its
// prefetcht1 for 8% of the kernel. Why across items: each item used to ask for its own
// window as it began, so every item started with its keys still in memory.
// Invariant: prefetches only, never a result; a consumer out of step with a stream would
// only make its prefetches useless.
#pragma once
#include "vec_utils.h"
#include <cstdint>
#include <vector>

// The K and V bytes of the L2 window: an eighth of a 1 MB L2 (64 decodes over 80, 320 and
// 1,100 keys: 64 KB to 256 KB within the noise, 512 KB slower; the fifty-third session).
constexpr int64_t kL2WindowBytes = 128 << 10;

// Where a cache's rows lie: row r of K at kb + r row_bytes (V: vb), `heads` heads a key from
// its first head's row.
struct CacheRows {
  const uint8_t *kb = nullptr, *vb = nullptr;
  int64_t row_bytes = 0, heads = 0;
  int64_t key_bytes() const { return heads * row_bytes; }
};

// One lone row's keys [k0, k1) through its block table (blocks of bs keys; Hkv heads a
// cached token, the stream's heads from h0).
struct KeySegment {
  const int64_t* table;
  int64_t k0, k1, h0;
};

class KeyStream {
 public:
  // A new parallel range: no segments, nothing asked for.
  void restart(const CacheRows& c, int64_t bs, int64_t Hkv) {
    segs_.clear(), seg_ = 0, offset_ = 0, ahead_ = 0;
    c_ = c, bs_ = bs, Hkv_ = Hkv;
  }
  void add(const KeySegment& s) {
    if (s.k1 <= s.k0) return;
    segs_.push_back(s);
    if (segs_.size() == 1) start(s);
  }
  // The stream's next `keys` keys are about to be read: the window moves on by them. Those
  // of them not yet asked for (a range's first tile) are asked for at once: the loads would
  // wait on them anyway.
  void consumed(int64_t keys) {
    ahead_ -= keys * 2 * c_.key_bytes();
    if (ahead_ < 0) ask((-ahead_ + 127) / 128);
  }
  // Steps (a K line and a V line) that would fill the window.
  int64_t missing() const {
    return ahead_ >= kL2WindowBytes || seg_ >= segs_.size() ? 0 : (kL2WindowBytes - ahead_) / 128;
  }
  void ask(int64_t n) {
    for (; n > 0 && seg_ < segs_.size(); --n) {
      const int64_t at = row_ * c_.row_bytes + offset_;
      prefetch_l2(c_.kb + at);
      prefetch_l2(c_.vb + at);
      if ((offset_ += 64) < c_.key_bytes()) continue;
      offset_ = 0, ahead_ += 2 * c_.key_bytes();
      if (++key_ < segs_[seg_].k1) {  // the next slot of the block, or the next block's first
        row_ = ++slot_ < bs_ ? row_ + Hkv_ : first_row(segs_[seg_], ++blk_, slot_ = 0);
        continue;
      }
      if (++seg_ < segs_.size()) start(segs_[seg_]);
    }
  }

  static KeyStream& of_thread() {
    static thread_local KeyStream s;
    return s;
  }

 private:
  // Key blk bs + slot's cache row (steps, not a division per key: ~10% of a decode).
  int64_t first_row(const KeySegment& s, int64_t blk, int64_t slot) const {
    return (s.table[blk] * bs_ + slot) * Hkv_ + s.h0;
  }
  void start(const KeySegment& s) {
    key_ = s.k0, blk_ = s.k0 / bs_, slot_ = s.k0 % bs_, row_ = first_row(s, blk_, slot_);
  }
  std::vector<KeySegment> segs_;  // the thread's lone rows' keys, in the order it reads them
  size_t seg_ = 0;
  // the next line: offset_ into key key_'s (block blk_, slot slot_, cache row row_)
  int64_t key_ = 0, blk_ = 0, slot_ = 0, row_ = 0, offset_ = 0;
  int64_t ahead_ = 0;                       // bytes asked for and not yet read
  CacheRows c_;
  int64_t bs_ = 0, Hkv_ = 0;
};

// The next tile's keys (their first heads' rows rows[0 .. keys)) into L1 and, with a stream,
// `far` steps of its window into L2: step i asks for line i of each where there is one.
class LinesAhead {
 public:
  LinesAhead() = default;
  LinesAhead(const CacheRows& c, const int64_t* rows, int64_t keys, KeyStream* far = nullptr)
      : c_(c), rows_(rows), keys_(keys), far_(far), far_steps_(far ? far->missing() : 0) {}

  int64_t steps() const {
    const int64_t near = keys_ * ((c_.key_bytes() + 63) / 64);
    return near > far_steps_ ? near : far_steps_;
  }
  void ask(int64_t n) {
    if (far_steps_ > 0) {
      const int64_t f = n < far_steps_ ? n : far_steps_;
      far_->ask(f);
      far_steps_ -= f;
    }
    for (; n > 0 && key_ < keys_; --n) {
      const int64_t at = rows_[key_] * c_.row_bytes + offset_;
      __builtin_prefetch(c_.kb + at);
      __builtin_prefetch(c_.vb + at);
      if ((offset_ += 64) >= c_.key_bytes()) offset_ = 0, ++key_;
    }
  }

 private:
  CacheRows c_;
  const int64_t* rows_ = nullptr;
  int64_t keys_ = 0, key_ = 0, offset_ = 0;
  KeyStream* far_ = nullptr;
  int64_t far_steps_ = 0;
};

// Asks for `steps` of `ahead` spread over `parts` parts of a walk: part i's share.
struct AheadShare {
  LinesAhead* ahead;
  int64_t per_part, left;
  AheadShare(LinesAhead& a, int64_t steps, int64_t parts)
      : ahead(&a), per_part((steps + parts - 1) / (parts > 0 ? parts : 1)), left(steps) {}
  void next() {
    const int64_t n = per_part < left ? per_part : left;
    ahead->ask(n);
    left -= n;
  }
};
