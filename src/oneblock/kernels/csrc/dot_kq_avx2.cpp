// AVX2 kernels of Q5_K and IQ4_XS, in the manner of dot_avx2.cpp's K-quants: every sub-block's integer dot scaled by
// its integer scale in int32 lanes (`vpmaddwd` with the scales in place of ones) and the super-block's lanes summed
// as integers: the exact `isum` of the scalar kernel (dot_kq_scalar.cpp), then the same float operations, so these
// equal it bit for bit. IQ4_XS's indices become values by a table lookup (`vpshufb` on the 16 values, as ggml's).
// Compiled for AVX2 by the target attribute alone; called only when the CPU reports AVX2 and FMA.
#include <immintrin.h>

#include "dot.h"

#define OB_AVX2 __attribute__((target("avx2,fma")))

namespace oneblock {
namespace {

OB_AVX2 inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

OB_AVX2 inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

OB_AVX2 float q5_k_one_avx2(const BlockQ5_K* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  const __m256i low_mask = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ5_K& w = blocks[b];
    const int16_t* bs = a.bsums + b * (QK_K / 16);
    const __m256i qh = load32(w.qh);  // bit s of byte l: bit 4 of value l of sub-block s
    __m256i sums = _mm256_setzero_si256();
    int msum = 0;
    for (int c = 0; c < QK_K / 64; ++c) {  // 32 bytes of nibbles: sub-blocks 2c (low) and 2c + 1 (high)
      const __m256i raw = load32(w.qs + 32 * c);
      for (int h = 0; h < 2; ++h) {
        const int s = 2 * c + h;
        int sc, m;
        q4_k_scale_min(w.scales, s, sc, m);
        const __m256i low = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, low_mask);
        // each byte's bit s moved to bit 0, masked, then to bit 4 (shifting 16-bit lanes: no bit crosses a byte)
        const __m256i top = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(s)), one), 4);
        const __m256i qw = _mm256_or_si256(low, top);  // [0, 31]: a pair of products is at most 2 * 31 * 127
        const __m256i qa = load32(a.q + b * QK_K + 32 * s);
        sums = _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(qw, qa), _mm256_set1_epi16(sc)));
        msum += m * (bs[2 * s] + bs[2 * s + 1]);
      }
    }
    acc += static_cast<float>(hsum_epi32(sums)) * (g_half[load_u16(&w.d)] * a.d[b]);
    acc -= static_cast<float>(msum) * (g_half[load_u16(&w.dmin)] * a.d[b]);
  }
  return acc;
}

OB_AVX2 float iq4_xs_one_avx2(const BlockIQ4_XS* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)));
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const BlockIQ4_XS& w = blocks[b];
    __m256i sums = _mm256_setzero_si256();
    for (int s = 0; s < QK_K / 32; ++s) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + 16 * s));
      const __m256i index = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low_mask);
      const __m256i qw = _mm256_shuffle_epi8(values, index);  // values 0..15 low nibbles, 16..31 high
      const __m256i qa = load32(a.q + b * QK_K + 32 * s);
      // |w| <= 127 (no value is 0) and |a| <= 127: a pair of products fits int16; the scale multiplies it in vpmaddwd
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
      sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, _mm256_set1_epi16(static_cast<int16_t>(iq4_xs_scale(w, s)))));
    }
    acc += static_cast<float>(hsum_epi32(sums)) * (g_half[load_u16(&w.d)] * a.d[b]);
  }
  return acc;
}

}  // namespace

void dot_q5_k_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                   float* out, int64_t stride) {
  each_row<BlockQ5_K, q5_k_one_avx2>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_iq4_xs_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                     float* out, int64_t stride) {
  each_row<BlockIQ4_XS, iq4_xs_one_avx2>(w, row_bytes, cols, a, rows, nb, out, stride);
}

}  // namespace oneblock
