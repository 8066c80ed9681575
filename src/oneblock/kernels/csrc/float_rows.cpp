// Products of F16 and BF16 matrices (block_mm below kGemmRows rows, the native step): each weight widened exactly
// to float32 (every half and every bfloat16 is a float32) and multiplied with the float activations as they are,
// float32 sums. No activation blocks: the only rounding is float32's, so a row's result is the float32 product
// of the file's exact weights, summed in the order of the instruction set in use (16 lanes, 8 lanes or one).
#include <immintrin.h>

#include <cstring>

#include "dot.h"

#define OB_F16C_FMA __attribute__((target("avx2,fma,f16c")))
#define OB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace oneblock {
namespace {

inline float widen_one(const uint8_t* p, bool bf16) {
  const uint16_t h = load_u16(p);
  if (!bf16) return half_to_float(h);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One weight row times one activation row, in order.
float dot_scalar(const uint8_t* w, const float* x, int64_t k, bool bf16) {
  float acc = 0.0f;
  for (int64_t j = 0; j < k; ++j) acc += widen_one(w + 2 * j, bf16) * x[j];
  return acc;
}

template <bool BF16>
OB_F16C_FMA inline __m256 widen8(const uint8_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

OB_F16C_FMA inline float sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// `cols` (at most 4) weight rows, row_bytes apart, times one activation row: 8 lanes each, two sums per row.
template <bool BF16>
OB_F16C_FMA void dot_avx2(const uint8_t* w, int64_t row_bytes, int cols, const float* x, int64_t k, float* y) {
  __m256 acc[4][2];
  for (int c = 0; c < 4; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + j + 8);
    for (int c = 0; c < cols; ++c) {
      const uint8_t* row = w + c * row_bytes + 2 * j;
      acc[c][0] = _mm256_fmadd_ps(widen8<BF16>(row), x0, acc[c][0]);
      acc[c][1] = _mm256_fmadd_ps(widen8<BF16>(row + 16), x1, acc[c][1]);
    }
  }
  for (int c = 0; c < cols; ++c) {
    float s = sum8(_mm256_add_ps(acc[c][0], acc[c][1]));
    for (int64_t i = j; i < k; ++i) s += widen_one(w + c * row_bytes + 2 * i, BF16) * x[i];
    y[c] = s;
  }
}

template <bool BF16>
OB_AVX512 inline __m512 widen16(const uint8_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// As dot_avx2, 16 lanes.
template <bool BF16>
OB_AVX512 void dot_avx512(const uint8_t* w, int64_t row_bytes, int cols, const float* x, int64_t k, float* y) {
  __m512 acc[4][2];
  for (int c = 0; c < 4; ++c) acc[c][0] = acc[c][1] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= k; j += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + j), x1 = _mm512_loadu_ps(x + j + 16);
    for (int c = 0; c < cols; ++c) {
      const uint8_t* row = w + c * row_bytes + 2 * j;
      acc[c][0] = _mm512_fmadd_ps(widen16<BF16>(row), x0, acc[c][0]);
      acc[c][1] = _mm512_fmadd_ps(widen16<BF16>(row + 32), x1, acc[c][1]);
    }
  }
  for (int c = 0; c < cols; ++c) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[c][0], acc[c][1]));
    for (int64_t i = j; i < k; ++i) s += widen_one(w + c * row_bytes + 2 * i, BF16) * x[i];
    y[c] = s;
  }
}

}  // namespace

void widen_row(const uint8_t* row, bool bf16, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = widen_one(row + 2 * j, bf16);
}

void float_dot(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, int64_t ldx, int64_t rows,
               int64_t k, float* y, int64_t ldy, bool bf16) {
  const int isa = current_isa();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    for (int64_t c = 0; c < cols; c += 4) {
      const int n = static_cast<int>(cols - c < 4 ? cols - c : 4);
      const uint8_t* wc = w + c * row_bytes;
      float* yc = y + r * ldy + c;
      if (isa >= kAvx512) {
        bf16 ? dot_avx512<true>(wc, row_bytes, n, xr, k, yc) : dot_avx512<false>(wc, row_bytes, n, xr, k, yc);
      } else if (isa >= kAvx2) {
        bf16 ? dot_avx2<true>(wc, row_bytes, n, xr, k, yc) : dot_avx2<false>(wc, row_bytes, n, xr, k, yc);
      } else {
        for (int i = 0; i < n; ++i) yc[i] = dot_scalar(wc + i * row_bytes, xr, k, bf16);
      }
    }
  }
}

}  // namespace oneblock
