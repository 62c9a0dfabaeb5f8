// The KV cache's row formats (attention/kv_cache.py has the layout): how the CPU kernels read
// and write one row, the D values of one token and KV head.
//
// - float32: D floats.
// - bfloat16: D bfloat16 values (a float32 model's cache at half the bytes): read by widening
//   (the 16 bits above 16 zero bits), written rounded to nearest even (torch's .to(bfloat16)).
// - float16: D float16 values (a float16 checkpoint's cache, computed in float32): read by
//   F16C's exact widening, written rounded to nearest even (torch's .to(float16)).
// - int8: D int8 values, then their float32 scale (4 bytes): x = q * scale, symmetric,
//   scale = max|x| / 127, q = round-half-even(x / scale) (torch's quantize_rows exactly).
// - fp8 (float8_e4m3fn): D bytes; x = fp8 value * head_scale, the layer's fixed scale of that
//   KV head (a per-tensor scale is the same value for every head); stored as
//   e4m3(clamp(x / head_scale, +-448)), torch's rounding.
//
// Reads widen 8 or 16 values at a time with the build's instruction set (AVX-512 or AVX2,
// chosen at run time by the loader), scalar elsewhere; writes are scalar (a step writes T
// rows per layer, reads walk the whole context). Every path gives the values torch's
// dequantization gives, bit for bit: the kernels are tested against it.
#pragma once
#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Float8_e4m3fn.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum class KVFormat { kFloat32, kBf16, kFp16, kInt8, kFp8 };

constexpr int64_t kInt8ScaleBytes = 4;
constexpr float kFp8Max = 448.f;
// e4m3's bits moved into a float32's exponent and mantissa read as 2^-120 times the value
// (bias 127 instead of 7): one exact multiplication by 2^120 restores it, subnormals included.
constexpr float kFp8Rebias = 1.329227995784916e36f;  // 2^120

inline KVFormat kv_format(const torch::Tensor& cache) {
  switch (cache.scalar_type()) {
    case torch::kFloat32: return KVFormat::kFloat32;
    case torch::kBFloat16: return KVFormat::kBf16;
    case torch::kHalf: return KVFormat::kFp16;
    case torch::kInt8: return KVFormat::kInt8;
    case torch::kFloat8_e4m3fn: return KVFormat::kFp8;
    default: TORCH_CHECK(false, "KV cache must be float32, bfloat16, float16, int8 or float8_e4m3fn, got ",
                         cache.scalar_type());
  }
  return KVFormat::kFloat32;
}

// Bytes of a row of D values, and D from a cache's last dimension R.
inline int64_t kv_row_bytes(KVFormat f, int64_t D) {
  switch (f) {
    case KVFormat::kFloat32: return 4 * D;
    case KVFormat::kBf16:
    case KVFormat::kFp16: return 2 * D;
    case KVFormat::kInt8: return D + kInt8ScaleBytes;
    default: return D;
  }
}
inline int64_t kv_head_dim(KVFormat f, int64_t R) {
  return f == KVFormat::kInt8 ? R - kInt8ScaleBytes : R;
}

// The per-head scales (2, Hkv) of an fp8 cache as a float32 pointer (K's, then V's); nullptr
// for the other formats, which need none.
inline const float* kv_head_scales(KVFormat f, const c10::optional<torch::Tensor>& scales,
                                   int64_t Hkv) {
  if (f != KVFormat::kFp8) return nullptr;
  TORCH_CHECK(scales.has_value() && scales->scalar_type() == torch::kFloat32 &&
                  scales->is_contiguous() && scales->numel() == 2 * Hkv,
              "an fp8 KV cache needs its (2, Hkv) float32 scales");
  return scales->data_ptr<float>();
}

static inline float fp8_bits_to_float(uint8_t b) {
  const uint32_t bits = (uint32_t(b & 0x7F) << 20) | (uint32_t(b & 0x80) << 24);
  float x;
  std::memcpy(&x, &bits, 4);
  return x * kFp8Rebias;
}

// out[0, D) = the D bfloat16 values at row, widened (exact).
inline void bf16_load_row(const uint8_t* row, int64_t D, float* out) {
  const auto* h = reinterpret_cast<const uint16_t*>(row);
  int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  for (; d + 16 <= D; d += 16) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + d));
    _mm512_storeu_ps(out + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(u), 16)));
  }
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  for (; d + 8 <= D; d += 8) {
    const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + d));
    _mm256_storeu_ps(out + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(u), 16)));
  }
#endif
  for (; d < D; ++d) {
    const uint32_t bits = uint32_t(h[d]) << 16;
    std::memcpy(out + d, &bits, 4);
  }
}

// out[0, D) = the D float16 values at row, widened (exact: F16C's vcvtph2ps).
inline void fp16_load_row(const uint8_t* row, int64_t D, float* out) {
  const auto* h = reinterpret_cast<const uint16_t*>(row);
  int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  for (; d + 16 <= D; d += 16)
    _mm512_storeu_ps(out + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + d))));
#elif defined(CPU_CAPABILITY_AVX2) && defined(__F16C__)
  for (; d + 8 <= D; d += 8)
    _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + d))));
#endif
  for (; d < D; ++d) out[d] = static_cast<float>(c10::Half(h[d], c10::Half::from_bits()));
}

// out[0, D) = the values of one row. head_scale: fp8's (ignored otherwise).
inline void kv_load_row(KVFormat f, const uint8_t* row, int64_t D, float head_scale,
                        float* out) {
  if (f == KVFormat::kFloat32) {
    std::memcpy(out, row, 4 * D);
    return;
  }
  if (f == KVFormat::kBf16) {
    bf16_load_row(row, D, out);
    return;
  }
  if (f == KVFormat::kFp16) {
    fp16_load_row(row, D, out);
    return;
  }
  float scale = head_scale;
  if (f == KVFormat::kInt8) std::memcpy(&scale, row + D, 4);
  int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale), rebias = _mm512_set1_ps(kFp8Rebias);
  const __m512i low7 = _mm512_set1_epi32(0x7F), sign = _mm512_set1_epi32(0x80);
  for (; d + 16 <= D; d += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
    __m512 x;
    if (f == KVFormat::kInt8) {
      x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    } else {
      const __m512i u = _mm512_cvtepu8_epi32(bytes);
      const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(u, low7), 20),
                                           _mm512_slli_epi32(_mm512_and_si512(u, sign), 24));
      x = _mm512_mul_ps(_mm512_castsi512_ps(bits), rebias);
    }
    _mm512_storeu_ps(out + d, _mm512_mul_ps(x, s));
  }
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__)
  const __m256 s = _mm256_set1_ps(scale), rebias = _mm256_set1_ps(kFp8Rebias);
  const __m256i low7 = _mm256_set1_epi32(0x7F), sign = _mm256_set1_epi32(0x80);
  for (; d + 8 <= D; d += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d));
    __m256 x;
    if (f == KVFormat::kInt8) {
      x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    } else {
      const __m256i u = _mm256_cvtepu8_epi32(bytes);
      const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(u, low7), 20),
                                           _mm256_slli_epi32(_mm256_and_si256(u, sign), 24));
      x = _mm256_mul_ps(_mm256_castsi256_ps(bits), rebias);
    }
    _mm256_storeu_ps(out + d, _mm256_mul_ps(x, s));
  }
#endif
  for (; d < D; ++d) {
    const float x = f == KVFormat::kInt8 ? float(static_cast<int8_t>(row[d]))
                                         : fp8_bits_to_float(row[d]);
    out[d] = x * scale;
  }
}

// One row from x[0, D) (head_scale: fp8's, ignored otherwise).
inline void kv_store_row(KVFormat f, const float* x, int64_t D, float head_scale,
                         uint8_t* row) {
  if (f == KVFormat::kFloat32) {
    std::memcpy(row, x, 4 * D);
    return;
  }
  if (f == KVFormat::kBf16) {  // c10's rounding: nearest even, NaN kept (torch's)
    auto* h = reinterpret_cast<uint16_t*>(row);
    for (int64_t d = 0; d < D; ++d) h[d] = c10::BFloat16(x[d]).x;
    return;
  }
  if (f == KVFormat::kFp16) {  // c10's rounding: nearest even, saturating to inf (torch's)
    auto* h = reinterpret_cast<uint16_t*>(row);
    for (int64_t d = 0; d < D; ++d) h[d] = c10::Half(x[d]).x;
    return;
  }
  if (f == KVFormat::kFp8) {
    for (int64_t d = 0; d < D; ++d)
      row[d] = c10::Float8_e4m3fn(std::clamp(x[d] / head_scale, -kFp8Max, kFp8Max)).x;
    return;
  }
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax / 127.f;
  const float divisor = std::max(scale, FLT_MIN);  // an all-zero row: zeros, scale 0
  for (int64_t d = 0; d < D; ++d)
    row[d] = static_cast<uint8_t>(static_cast<int8_t>(
        std::clamp(std::nearbyint(x[d] / divisor), -127.f, 127.f)));
  std::memcpy(row + D, &scale, 4);
}
