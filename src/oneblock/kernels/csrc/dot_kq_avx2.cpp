// AVX2 kernels of the super-block formats (Q4_K, Q5_K, Q6_K, IQ4_XS), one weight row against one Q8_K activation
// row. Each sub-block's integer dot is scaled by its integer scale in int32 lanes (`vpmaddwd` with the scales in
// place of ones) and the super-block's lanes summed as integers: the exact `isum` (and `msum`) of the scalar kernel
// (dot_kq_scalar.cpp, dot_scalar.cpp), then the same float operations, so these equal it bit for bit.
//
// As ggml's: a super-block's 6-bit scales and minimums are unpacked together (12 bytes to 16 lanes), Q4_K's and
// Q5_K's minimum term is the minimums times the activations' sums of 16 (`msum`, one `vpmaddwd`), and Q6_K's codes
// are multiplied unsigned, in [0, 63], their offset of 32 taken away once per super-block as 32 times the scales
// times those sums. IQ4_XS's indices become values by a table lookup (`vpshufb` on the 16 values).
// Compiled for AVX2 by the target attribute alone; called only when the CPU reports AVX2 and FMA.
#include <immintrin.h>

#include <cstring>
#include <type_traits>

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

// The sums of the 8 lanes of `v` and of the 4 lanes of `w`, together.
OB_AVX2 inline void hsum_two(__m256i v, __m128i w, int& sv, int& sw) {
  __m128i s = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)), w);
  s = _mm_hadd_epi32(s, s);
  sv = _mm_cvtsi128_si32(s), sw = _mm_extract_epi32(s, 1);
}

OB_AVX2 inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Q4_K's and Q5_K's 8 scales (lanes 0..7) and 8 minimums (lanes 8..15) as int16, from their 12 packed bytes
// (q4_k_scale_min for all 8 at once, as ggml's `utmp` words).
OB_AVX2 inline __m256i scales_and_mins(const uint8_t* packed) {
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  constexpr uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
  u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);  // minimums 4..7
  const uint32_t mins_low = u[1] & six;                         // minimums 0..3
  u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);          // scales 4..7
  u[2] = mins_low;
  u[0] &= six;  // scales 0..3
  return _mm256_cvtepu8_epi16(_mm_set_epi32(static_cast<int>(u[3]), static_cast<int>(u[2]), static_cast<int>(u[1]),
                                            static_cast<int>(u[0])));
}

// int16 lane s of each half of `v`, in every lane.
OB_AVX2 inline __m256i lane16(__m256i v, int s) { return _mm256_shuffle_epi8(v, _mm256_set1_epi16(0x0100 + 0x0202 * s)); }

// The minimum term of a Q4_K / Q5_K super-block: sub-block s's minimum times its 32 activations' sum, as 4 lanes.
OB_AVX2 inline __m128i minimum_terms(__m256i scales_mins, const int16_t* bsums) {
  const __m256i sums16 = load32(bsums);  // 16 sums of 16 codes; sub-block s takes sums 2s and 2s + 1
  const __m128i sums32 = _mm_hadd_epi16(_mm256_castsi256_si128(sums16), _mm256_extracti128_si256(sums16, 1));
  return _mm_madd_epi16(_mm256_extracti128_si256(scales_mins, 1), sums32);  // |sum| <= 32 * 127: int16 holds it
}

// Q4_K, and Q5_K (the same scales, minimums and nibbles, with bit s of qh[l] as bit 4 of value l of sub-block s).
template <typename Block>
OB_AVX2 float q4_k_one_avx2(const Block* blocks, const ActRow& a, int64_t nb) {
  constexpr bool kFive = std::is_same_v<Block, BlockQ5_K>;
  float acc = 0.0f;
  const __m256i low_mask = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    const Block& w = blocks[b];
    const int8_t* qa = a.q + b * QK_K;
    const __m256i packed = scales_and_mins(w.scales);
    const __m256i scales = _mm256_permute4x64_epi64(packed, 0x44);  // the scales in both halves
    __m256i sums = _mm256_setzero_si256();
    for (int c = 0; c < QK_K / 64; ++c) {  // 32 bytes of nibbles: sub-blocks 2c (low) and 2c + 1 (high)
      const __m256i raw = load32(w.qs + 32 * c);
      __m256i low = _mm256_and_si256(raw, low_mask), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low_mask);
      if constexpr (kFive) {  // each byte's bit s moved to bit 4 (16-bit shifts, masked: no bit crosses a byte)
        const __m256i qh = load32(w.qh);
        low = _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
        high = _mm256_or_si256(high, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
      }
      // codes in [0, 31]: a pair of products is at most 2 * 31 * 127, times a scale of at most 63 in int32
      const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(low, load32(qa + 64 * c)), lane16(scales, 2 * c));
      const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(high, load32(qa + 64 * c + 32)), lane16(scales, 2 * c + 1));
      sums = _mm256_add_epi32(sums, _mm256_add_epi32(pl, ph));
    }
    int isum, msum;
    hsum_two(sums, minimum_terms(packed, a.bsums + b * (QK_K / 16)), isum, msum);
    acc += static_cast<float>(isum) * (g_half[load_u16(&w.d)] * a.d[b]);
    acc -= static_cast<float>(msum) * (g_half[load_u16(&w.dmin)] * a.d[b]);
  }
  return acc;
}

OB_AVX2 float q6_k_one_avx2(const BlockQ6_K* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  const __m256i low_mask = _mm256_set1_epi8(0x0F), pair_mask = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ6_K& w = blocks[b];
    const int8_t* qa = a.q + b * QK_K;
    const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales)));
    // sum_j sc * (q - 32) * a = sum_j sc * q * a - 32 * sum_s sc_s * (the sum of sub-block s's 16 activations)
    __m256i sums = _mm256_sub_epi32(_mm256_setzero_si256(),
                                    _mm256_slli_epi32(_mm256_madd_epi16(scales, load32(a.bsums + b * (QK_K / 16))), 5));
    for (int half = 0; half < 2; ++half) {  // 128 values: ql[64 half ..], qh[32 half ..], scales 8 half .. 8 half + 7
      const __m256i sc = _mm256_permute4x64_epi64(scales, half ? 0xEE : 0x44);
      const __m256i ql0 = load32(w.ql + 64 * half), ql1 = load32(w.ql + 64 * half + 32), qh = load32(w.qh + 32 * half);
      for (int quarter = 0; quarter < 4; ++quarter) {  // 32 codes: sub-blocks 8 half + 2 quarter and the next
        const __m256i nibbles = _mm256_and_si256(_mm256_srli_epi16(quarter & 1 ? ql1 : ql0, 4 * (quarter >> 1)), low_mask);
        const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * quarter), pair_mask);
        const __m256i qw = _mm256_or_si256(nibbles, _mm256_slli_epi16(top, 4));  // [0, 63]: a pair <= 2 * 63 * 127
        const __m256i scale = _mm256_shuffle_epi8(
            sc, _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * (2 * quarter + 1))),
                                 _mm_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * (2 * quarter)))));
        const __m256i pairs = _mm256_maddubs_epi16(qw, load32(qa + 128 * half + 32 * quarter));
        sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, scale));
      }
    }
    acc += static_cast<float>(hsum_epi32(sums)) * (g_half[load_u16(&w.d)] * a.d[b]);
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

void dot_q4_k_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                   float* out, int64_t stride) {
  each_row<BlockQ4_K, q4_k_one_avx2<BlockQ4_K>>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q6_k_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                   float* out, int64_t stride) {
  each_row<BlockQ6_K, q6_k_one_avx2>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q5_k_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                   float* out, int64_t stride) {
  each_row<BlockQ5_K, q4_k_one_avx2<BlockQ5_K>>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_iq4_xs_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                     float* out, int64_t stride) {
  each_row<BlockIQ4_XS, iq4_xs_one_avx2>(w, row_bytes, cols, a, rows, nb, out, stride);
}

}  // namespace oneblock
