// Helpers shared by the CPU kernels in this folder (float32, ATen's Vectorized<float>).
#pragma once
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <type_traits>
#include <vector>

using Vec = at::vec::Vectorized<float>;

// A std::vector whose data starts on a cache line. A large std::vector's data sits 16 bytes
// into a page (malloc's header), so every 64-byte load of it spans two cache lines: the
// VNNI kernels' int16 rows of x and decoded tiles ran 3-10% slower for it.
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, kAlign); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};
template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// Rows of x per block in the quantized kernels' tile loops (a multiple of `multiple`, the rows
// of one kernel call): each thread's tiles of W meet a step's x a block of about `bytes` at a
// time, so a tile re-reads its block from L2 rather than all of x from L3 or memory (a
// 2048-row prefill's 8192-wide down projection is 32 MB of int16 x: it had run at 0.6x the
// rate of the other layers). The best size is the kernel's: measured per kernel (the bf16
// kernels' too: linear_bf16.h 256 KB, linear_bf16_amx.h 512 KB).
inline int64_t x_block_rows(int64_t row_bytes, int64_t multiple, int64_t bytes) {
  return std::max<int64_t>(multiple, bytes / row_bytes / multiple * multiple);
}

// A prefetch into L2 that the compiler keeps. GCC 12 deletes a loop whose body is only
// __builtin_prefetch (_mm_prefetch) when it sits in another loop (the lines of each block of a
// sequence's keys, say) as free of side effects: the attention kernel's window of keys asked
// for into L2 compiled to nothing. An asm volatile statement is never removed. The address
// goes in as a register, not as a memory operand ("m"(*p)): GCC took such an asm to read
// memory, so the arithmetic around it kept its accumulators in memory too (keys_dp::
// accumulate stored its twelve zmm sums every key pair: 36 stores in the function, 24 left,
// none in its loops, with "r").
static inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 (%0)" : : "r"(p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// A weight read once, as one stream (a decode step's rows of x against W's contiguous
// blocks): each block asks for the bytes kPrefetchBytes ahead of it. With the arithmetic
// between its loads the hardware prefetcher alone kept too few misses in flight: one row of x
// read a 2048 x 8192 Q4_K / Q6_K layer at 10-12 GB/s on Zen 3, 13-17 with this
// (benchmarks/gguf_kernels.py); the Q8_0 / 4-bit tiles' steps of 2+ rows likewise
// (linear_block_tiles.h). Larger M re-reads each tile from L2, where it does not help. Into
// L2 (prefetcht1) and 6 KB ahead: into L1 and 3 KB ahead (until the fifty-second session), a
// 1B Q4_K_M decode step, whose Q6_K tensors are read so, ran ~5% slower on Zen 4 (either
// change alone gained little; benchmarks/RESULTS.md).
constexpr int64_t kPrefetchBytes = 6144;
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t* p,
                                                                 int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) prefetch_l2(p + kPrefetchBytes + off);
}

// f(std::integral_constant<int, G>{}) for a runtime G in 1 .. kMax (larger: kMax; callers
// check their range first). Kernels take their group of query heads as a template parameter
// so that its G accumulators live in registers (a runtime-sized array went through the stack).
template <int kMax, int G = 1, class F>
static inline void with_group_size(int64_t g, F&& f) {
  if constexpr (G < kMax) {
    if (g == G) return f(std::integral_constant<int, G>{});
    return with_group_size<kMax, G + 1>(g, f);
  } else {
    return f(std::integral_constant<int, kMax>{});
  }
}

// Horizontal sum. NOTE: at::vec::vec_reduce_all goes through memory and costs several times
// more, which dominated the attention kernel (three reductions per cached token).
static inline float hsum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  __m256 x = v;
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
#else
  float buf[Vec::size()];
  v.store(buf);
  float total = 0.f;
  for (int64_t i = 0; i < Vec::size(); ++i) total += buf[i];
  return total;
#endif
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
// hsum of four vectors at once, in registers, each in hsum's own tree (_mm512_reduce_add_ps:
// t_i = a_i + a_(i+8), u_j = t_j + t_(j+4), (u_0 + u_2) + (u_1 + u_3)), so each of the four
// sums is bitwise hsum(a[k]). Where many outputs are each one vector's sum (attention scores,
// bf16 products), one horizontal sum per output cost more than their products.
static inline __m128 hsum4(const __m512* a) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44),   // a.l0 a.l1 b.l0 b.l1
                                  _mm512_shuffle_f32x4(a[0], a[1], 0xEE));  // a.l2 a.l3 b.l2 b.l3
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44),
                                  _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88),   // t_0..3 of a b c d
                                 _mm512_shuffle_f32x4(ab, cd, 0xDD));  // t_4..7
  const __m512 x = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));      // u0 + u2, u1 + u3
  const __m512 r = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));      // lane 0 of each 128
  return _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, r));
}

// r[l] (element c: row l's column c) transposed: store(c, column c's 16 rows) for c < 16.
template <typename Store>
static inline void transpose16(__m512 (&r)[16], Store store) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[4j + e]: lane L = column 4L + e of rows 4j .. 4j + 3
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 v0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x44);
    const __m512 v1 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xEE);
    const __m512 w0 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x44);
    const __m512 w1 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xEE);
    store(e, _mm512_shuffle_f32x4(v0, w0, 0x88));
    store(4 + e, _mm512_shuffle_f32x4(v0, w0, 0xDD));
    store(8 + e, _mm512_shuffle_f32x4(v1, w1, 0x88));
    store(12 + e, _mm512_shuffle_f32x4(v1, w1, 0xDD));
  }
}
#endif
