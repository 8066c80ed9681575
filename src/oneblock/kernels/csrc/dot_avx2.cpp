// AVX2 kernels. Per block, the 32 code products are summed in 8 int32 lanes (`vpmaddubsw`: unsigned x signed
// bytes to int16 pairs, then `vpmaddwd` to int32; no saturation is possible, see each kernel), converted to
// float and fused-multiply-added with the block's scale into 8 float accumulators per activation row.
// Compiled for AVX2 by the target attribute alone; called only when the CPU reports AVX2 and FMA.
#include <immintrin.h>

#include "dot.h"

#define OB_AVX2 __attribute__((target("avx2,fma")))

namespace oneblock {
namespace {

OB_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 signed codes w times 32 signed codes a, as 8 int32 lane sums of 4 products each. |w| <= 128, |a| <= 127:
// a pair of products is at most 32512 in magnitude and fits int16.
OB_AVX2 inline __m256i dot_signed(__m256i w, __m256i a) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// 16 bytes of nibbles -> 32 codes in [0, 15]: low nibbles are values 0..15, high nibbles 16..31.
OB_AVX2 inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

OB_AVX2 inline __m256i load_codes(const int8_t* q) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
}

template <int R>
OB_AVX2 void q8_0_rows(const BlockQ8_0* w, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i qw = load_codes(w[b].qs);
    const float dw = g_half[load_u16(&w[b].d)];
    for (int r = 0; r < R; ++r) {
      const __m256i sumi = dot_signed(qw, load_codes(a[r].q + b * QK));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a[r].d[b]), _mm256_cvtepi32_ps(sumi), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * stride] = hsum(acc[r]);
}

template <int R>
OB_AVX2 void q4_0_rows(const BlockQ4_0* w, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i qw = _mm256_sub_epi8(unpack_nibbles(w[b].qs), _mm256_set1_epi8(8));  // [-8, 7]
    const float dw = g_half[load_u16(&w[b].d)];
    for (int r = 0; r < R; ++r) {
      const __m256i sumi = dot_signed(qw, load_codes(a[r].q + b * QK));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a[r].d[b]), _mm256_cvtepi32_ps(sumi), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * stride] = hsum(acc[r]);
}

// Q4_1 codes are unsigned [0, 15]: they feed `vpmaddubsw` directly (a pair is at most 2 * 15 * 127).
template <int R>
OB_AVX2 void q4_1_rows(const BlockQ4_1* w, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  __m256 acc[R];
  float mins[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    mins[r] = 0.0f;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i qw = unpack_nibbles(w[b].qs);
    const float dw = g_half[load_u16(&w[b].d)];
    const float mw = g_half[load_u16(&w[b].m)];
    for (int r = 0; r < R; ++r) {
      const __m256i pairs = _mm256_maddubs_epi16(qw, load_codes(a[r].q + b * QK));
      const __m256i sumi = _mm256_madd_epi16(pairs, ones);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a[r].d[b]), _mm256_cvtepi32_ps(sumi), acc[r]);
      mins[r] += mw * a[r].s[b];
    }
  }
  for (int r = 0; r < R; ++r) out[r * stride] = hsum(acc[r]) + mins[r];
}

// Up to 4 activation rows share each weight block's loads and unpacking.
template <typename Block, void (*K1)(const Block*, const ActRow*, int64_t, float*, int64_t),
          void (*K2)(const Block*, const ActRow*, int64_t, float*, int64_t),
          void (*K3)(const Block*, const ActRow*, int64_t, float*, int64_t),
          void (*K4)(const Block*, const ActRow*, int64_t, float*, int64_t)>
void rows_dispatch(const uint8_t* w, const ActRow* a, int rows, int64_t nb, float* out, int64_t stride) {
  const auto* blocks = reinterpret_cast<const Block*>(w);
  switch (rows) {
    case 1: K1(blocks, a, nb, out, stride); break;
    case 2: K2(blocks, a, nb, out, stride); break;
    case 3: K3(blocks, a, nb, out, stride); break;
    default: K4(blocks, a, nb, out, stride); break;
  }
}

}  // namespace

void dot_q8_0_avx2(const uint8_t* w, const ActRow* a, int rows, int64_t nb, float* out, int64_t stride) {
  rows_dispatch<BlockQ8_0, q8_0_rows<1>, q8_0_rows<2>, q8_0_rows<3>, q8_0_rows<4>>(w, a, rows, nb, out, stride);
}
void dot_q4_0_avx2(const uint8_t* w, const ActRow* a, int rows, int64_t nb, float* out, int64_t stride) {
  rows_dispatch<BlockQ4_0, q4_0_rows<1>, q4_0_rows<2>, q4_0_rows<3>, q4_0_rows<4>>(w, a, rows, nb, out, stride);
}
void dot_q4_1_avx2(const uint8_t* w, const ActRow* a, int rows, int64_t nb, float* out, int64_t stride) {
  rows_dispatch<BlockQ4_1, q4_1_rows<1>, q4_1_rows<2>, q4_1_rows<3>, q4_1_rows<4>>(w, a, rows, nb, out, stride);
}

}  // namespace oneblock
