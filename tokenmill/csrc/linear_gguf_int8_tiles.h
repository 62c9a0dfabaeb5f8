// The interleaved tiles of linear_gguf_int8.h (included by it, inside its build guard):
// kRowsPerVec W rows of a K-quant decoded once, 4 bytes of each row's values side by side,
// so that one vpmaddubsw multiplies 4 weights of every row by the same 4 values of x
// (broadcast) and each int32 lane holds one output's I or J. A super-block's float terms
// are then one vector op for kRowsPerVec outputs, lane by lane the raw rows' scalar ones
// (the same integers, the same fma order): the two ways give bitwise the same result.
// With AVX-512 VNNI a group of 16 weights meets x in four vpdpbusd and its scale in one
// vpmulld (the same integers again); with the transposing interleave below, 16-64 rows of a
// Q4_K / Q6_K layer ran 1.4-1.5x the maddubs / madd tiles on Zen 4 (RESULTS.md).
#pragma once

namespace gguf_int8 {

// One super-block of kRowsPerVec W rows: step t's vector holds bytes 4t .. 4t + 3 of each
// row's values side by side; group g's vector each row's sc_g twice (both int16 of its
// lane); pair i's vector each row's (a_2i, a_2i+1), a = sc (zero point kinds) or mn; d, e.
struct TileSuperBlock {
  IVec v[kSuper / 4], sc[16], a[8];
  alignas(sizeof(IVec)) float d[kRowsPerVec], e[kRowsPerVec];
};

using RowValues = uint8_t[kRowsPerVec][kSuper];
using RowScales = int16_t[kRowsPerVec][16];

// A super-block's tile vectors from its rows' values, scales and pair factors (a, as
// TileSuperBlock describes). AVX-512: 16 x 16 dword transposes (six a super-block), where
// copying lane by lane had cost ~1,400 scalar moves: ~20% of a 16-row step's time.
static TM_GGUF_INLINE void interleave(const RowValues& values, const RowScales& sc,
                                      const RowScales& a, TileSuperBlock& t) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BW__)
  static_assert(kRowsPerVec == 16);
  __m512 r[16];
  for (int c = 0; c < 4; ++c) {  // steps 16 c .. 16 c + 15
    for (int j = 0; j < 16; ++j)
      r[j] = _mm512_castsi512_ps(_mm512_load_si512(values[j] + 64 * c));
    transpose16(r, [&](int i, __m512 v) { t.v[16 * c + i] = _mm512_castps_si512(v); });
  }
  for (int j = 0; j < 16; ++j) {  // sc_g in both int16 of a lane
    const __m512i v =
        _mm512_cvtepi16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc[j])));
    r[j] = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF)),
                                               _mm512_slli_epi32(v, 16)));
  }
  transpose16(r, [&](int i, __m512 v) { t.sc[i] = _mm512_castps_si512(v); });
  for (int j = 0; j < 16; ++j)  // (a_2i, a_2i+1) is dword i of a row's 16 int16
    r[j] = _mm512_castsi512_ps(
        _mm512_zextsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(a[j]))));
  transpose16(r, [&](int i, __m512 v) {
    if (i < 8) t.a[i] = _mm512_castps_si512(v);
  });
#else
  alignas(sizeof(IVec)) int32_t lanes[kRowsPerVec];
  for (int step = 0; step < kSuper / 4; ++step) {
    for (int j = 0; j < kRowsPerVec; ++j) std::memcpy(&lanes[j], values[j] + 4 * step, 4);
    t.v[step] = iload(lanes);
  }
  for (int gi = 0; gi < 16; ++gi) {
    for (int j = 0; j < kRowsPerVec; ++j)
      lanes[j] = static_cast<int32_t>(static_cast<uint16_t>(sc[j][gi]) * 0x10001u);
    t.sc[gi] = iload(lanes);
  }
  for (int i = 0; i < 8; ++i) {  // (a_2i, a_2i+1): the low and high int16 of a lane
    for (int j = 0; j < kRowsPerVec; ++j) {
      const uint32_t lo = static_cast<uint16_t>(a[j][2 * i]);
      const uint32_t hi = static_cast<uint16_t>(a[j][2 * i + 1]);
      lanes[j] = static_cast<int32_t>(lo | (hi << 16));
    }
    t.a[i] = iload(lanes);
  }
#endif
}

// W rows [n0, n1) (n1 - n0 <= kRowsPerVec; missing rows zero) decoded into tile[0 .. nsb).
template <int64_t KIND>
static void decode_tile(const uint8_t* W, int64_t K, int64_t n0, int64_t n1,
                        TileSuperBlock* tile) {
  const int64_t rb = row_bytes(KIND, K), nsb = K / kSuper;
  alignas(64) uint8_t values[kRowsPerVec][kSuper];
  alignas(64) int16_t sc[kRowsPerVec][16], a[kRowsPerVec][16];
  for (int64_t sb = 0; sb < nsb; ++sb) {
    TileSuperBlock& t = tile[sb];
    for (int j = 0; j < kRowsPerVec; ++j) {
      t.d[j] = t.e[j] = 0.f;
      if (n0 + j >= n1) {  // a missing row: zeros (a present one overwrites all of its own)
        std::memset(values[j], 0, kSuper), std::memset(sc[j], 0, sizeof(sc[j]));
        std::memset(a[j], 0, sizeof(a[j]));
        continue;
      }
      const uint8_t* p = W + (n0 + j) * rb + sb * block_bytes(KIND);
      for (int s = 0; s < 8; ++s)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(values[j] + 32 * s),
                            block_values<KIND>(p, s));
      const GroupScales g = group_scales<KIND>(p, gguf_rows::superblock_scales<KIND>(p));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc[j]), g.sc);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a[j]), zero_point(KIND) ? g.sc : g.mn);
      t.d[j] = g.d, t.e[j] = g.e;
    }
    interleave(values, sc, a, t);
  }
}

// acc[r] (a lane per W row) += super-block sb's terms for rows x0 .. x0 + R of x.
template <int64_t KIND, int R>
static TM_GGUF_INLINE void tile_superblock(const TileSuperBlock& t, const Int8Rows& x,
                                           int64_t x0, int64_t sb, FVec (&acc)[R]) {
  const int64_t K = x.K, nsb = K / kSuper;
  const int8_t* xr[R];
  const int16_t* s16[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = x.x.data() + ((x0 + r) * nsb + sb) * kSuper;
    s16[r] = x.s16.data() + ((x0 + r) * nsb + sb) * 16;
  }
  IVec I[R][2];  // two partial sums a row: shorter add chains (exact: any order)
  for (int r = 0; r < R; ++r) I[r][0] = I[r][1] = izero();
  for (int gi = 0; gi < 16; ++gi) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
    // a group's 16 weights of each row meet x in four vpdpbusd (a lane's sum at most
    // 16 * 63 * 127), then its scale in one vpmulld: 6 instructions for what maddubs / madd
    // / add take 12
    const IVec sc = _mm512_srai_epi32(t.sc[gi], 16);  // sc_g (the lane's high int16)
    for (int r = 0; r < R; ++r) {
      IVec g = izero();
      for (int u = 0; u < 4; ++u)
        g = _mm512_dpbusd_epi32(g, t.v[4 * gi + u], bcast32(xr[r] + 16 * gi + 4 * u));
      I[r][gi & 1] = add(I[r][gi & 1], _mm512_mullo_epi32(g, sc));
    }
#else
    const IVec sc = t.sc[gi];
    for (int u = 0; u < 4; ++u) {
      const IVec v = t.v[4 * gi + u];
      for (int r = 0; r < R; ++r)
        I[r][u & 1] = add(I[r][u & 1], madd(maddubs(v, bcast32(xr[r] + 16 * gi + 4 * u)), sc));
    }
#endif
  }
  const FVec d = fload(t.d), e = fload(t.e);
  for (int r = 0; r < R; ++r) {
    IVec Z = izero();  // sum_g a_g S16_g, a pair of groups a vector
    for (int i = 0; i < 8; ++i) Z = add(Z, madd(t.a[i], bcast32(s16[r] + 2 * i)));
    IVec sum = add(I[r][0], I[r][1]);
    if constexpr (zero_point(KIND) != 0) sum = sub(sum, shl(Z, zero_shift(KIND)));
    const FVec dx = fset1(x.dx[(x0 + r) * nsb + sb]);
    acc[r] = fmadd(to_float(sum), fmul(d, dx), acc[r]);
    if constexpr (has_mins(KIND)) acc[r] = fmadd(to_float(Z), fmul(e, dx), acc[r]);
  }
}

// Rows [x0, x0 + R) of x times the tile of W rows [n0, n1) into y.
template <int64_t KIND, int R>
static void tile_rows_times(const Int8Rows& x, int64_t x0, const TileSuperBlock* tile,
                            int64_t n0, int64_t n1, int64_t N, const float* bias, float* y) {
  const int64_t nsb = x.K / kSuper;
  FVec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = fzero();
  for (int64_t sb = 0; sb < nsb; ++sb) tile_superblock<KIND, R>(tile[sb], x, x0, sb, acc);
  alignas(64) float out[kRowsPerVec];
  for (int r = 0; r < R; ++r) {
    fstore(out, acc[r]);
    for (int64_t n = n0; n < n1; ++n)
      y[(x0 + r) * N + n] = out[n - n0] + (bias ? bias[n] : 0.f);
  }
}

}  // namespace gguf_int8
