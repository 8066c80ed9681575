// Products of F16 and BF16 matrices (block_mm at every M, the native step): each weight widened exactly
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

// One weight row times one activation row, 8 lanes, four sums: the row is read once, front to back (a matrix's
// rows one after another are one stream, which the hardware prefetcher follows), the activations from L1.
template <bool BF16>
OB_F16C_FMA float row_avx2(const uint8_t* w, const float* x, int64_t k) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t j = 0;
  for (; j + 32 <= k; j += 32) {
    for (int i = 0; i < 4; ++i) {
      acc[i] = _mm256_fmadd_ps(widen8<BF16>(w + 2 * (j + 8 * i)), _mm256_loadu_ps(x + j + 8 * i), acc[i]);
    }
  }
  for (; j + 8 <= k; j += 8) acc[0] = _mm256_fmadd_ps(widen8<BF16>(w + 2 * j), _mm256_loadu_ps(x + j), acc[0]);
  float s = sum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  for (; j < k; ++j) s += widen_one(w + 2 * j, BF16) * x[j];
  return s;
}

template <bool BF16>
OB_AVX512 inline __m512 widen16(const uint8_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// One weight row times one activation row, 16 lanes: one sum, added to in the order block4x4_avx512 adds each of
// its 16, so that a row's result is the same whether it is multiplied alone or among others (bit for bit). The
// chain of fused multiply-adds waits on itself, 16 values each 4 cycles: twice what memory feeds a decoding step.
template <bool BF16>
OB_AVX512 float row_avx512(const uint8_t* w, const float* x, int64_t k) {
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) acc = _mm512_fmadd_ps(widen16<BF16>(w + 2 * j), _mm512_loadu_ps(x + j), acc);
  float s = _mm512_reduce_add_ps(acc);
  for (; j < k; ++j) s += widen_one(w + 2 * j, BF16) * x[j];
  return s;
}

// Weight rows w[0..3] (row_bytes apart) times activation rows x[0..3] (ldx apart) into y[r * ldy + c]: 16 sums in
// registers, each value of the 4 weight rows widened once for the 4 activation rows (a prompt's rows: the
// products then outrun the reads, unlike one row at a time).
template <bool BF16>
OB_AVX512 void block4x4_avx512(const uint8_t* w, int64_t row_bytes, const float* x, int64_t ldx, int64_t k, float* y,
                               int64_t ldy) {
  __m512 acc[4][4];
  for (int c = 0; c < 4; ++c) {
    for (int r = 0; r < 4; ++r) acc[c][r] = _mm512_setzero_ps();
  }
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    __m512 xs[4];
    for (int r = 0; r < 4; ++r) xs[r] = _mm512_loadu_ps(x + r * ldx + j);
    for (int c = 0; c < 4; ++c) {
      const __m512 wv = widen16<BF16>(w + c * row_bytes + 2 * j);
      for (int r = 0; r < 4; ++r) acc[c][r] = _mm512_fmadd_ps(wv, xs[r], acc[c][r]);
    }
  }
  for (int c = 0; c < 4; ++c) {
    for (int r = 0; r < 4; ++r) {
      float s = _mm512_reduce_add_ps(acc[c][r]);
      for (int64_t i = j; i < k; ++i) s += widen_one(w + c * row_bytes + 2 * i, BF16) * x[r * ldx + i];
      y[r * ldy + c] = s;
    }
  }
}

// n values widened, 16 an instruction: a token table's rows, and the tiles the product's backward multiplies.
template <bool BF16>
OB_AVX512 void widen_avx512(const uint8_t* row, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(out + j, widen16<BF16>(row + 2 * j));
  for (; j < n; ++j) out[j] = widen_one(row + 2 * j, BF16);
}

template <bool BF16>
OB_F16C_FMA void widen_avx2(const uint8_t* row, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, widen8<BF16>(row + 2 * j));
  for (; j < n; ++j) out[j] = widen_one(row + 2 * j, BF16);
}

}  // namespace

void widen_row(const uint8_t* row, bool bf16, int64_t n, float* out) {
  const int isa = current_isa();
  if (isa >= kAvx512) return bf16 ? widen_avx512<true>(row, n, out) : widen_avx512<false>(row, n, out);
  if (isa >= kAvx2) return bf16 ? widen_avx2<true>(row, n, out) : widen_avx2<false>(row, n, out);
  for (int64_t j = 0; j < n; ++j) out[j] = widen_one(row + 2 * j, bf16);
}

void float_dot(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, int64_t ldx, int64_t rows,
               int64_t k, float* y, int64_t ldy, bool bf16) {
  const int isa = current_isa();
  int64_t c = 0;
  if (isa >= kAvx512 && rows >= 4) {  // 4 weight rows against each 4 activation rows, the rest one by one below
    for (; c + 4 <= cols; c += 4) {
      const uint8_t* wc = w + c * row_bytes;
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) {
        (bf16 ? block4x4_avx512<true> : block4x4_avx512<false>)(wc, row_bytes, x + r * ldx, ldx, k, y + r * ldy + c,
                                                                 ldy);
      }
      for (; r < rows; ++r) {
        for (int64_t i = 0; i < 4; ++i) {
          y[r * ldy + c + i] = (bf16 ? row_avx512<true> : row_avx512<false>)(wc + i * row_bytes, x + r * ldx, k);
        }
      }
    }
  }
  // Each weight row once, against every activation row while it is in L1.
  for (; c < cols; ++c) {
    const uint8_t* wc = w + c * row_bytes;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * ldx;
      float v;
      if (isa >= kAvx512) {
        v = bf16 ? row_avx512<true>(wc, xr, k) : row_avx512<false>(wc, xr, k);
      } else if (isa >= kAvx2) {
        v = bf16 ? row_avx2<true>(wc, xr, k) : row_avx2<false>(wc, xr, k);
      } else {
        v = dot_scalar(wc, xr, k, bf16);
      }
      y[r * ldy + c] = v;
    }
  }
}

}  // namespace oneblock
