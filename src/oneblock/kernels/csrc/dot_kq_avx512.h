// AVX-512 kernels of Q4_K, Q5_K and Q6_K, included twice by dot_kq_avx512.cpp: once with OB_VNNI 0 (`vpmaddubsw`,
// then `vpmaddwd` with the sub-block scales in place of ones) and once with OB_VNNI 1 (`vpdpbusd`, then the scales
// multiplied into the int32 lanes). 64 bytes of codes per instruction, the scales of a super-block unpacked once for
// its 8 (16) sub-blocks, and up to 4 weight rows (or 4 activation rows) per call sharing each load. Every lane holds an
// exact integer and a super-block's lanes are summed as integers: the `isum` (and `msum`) of the scalar kernel, then
// the same float operations in the same order, so both paths equal the scalar kernel bit for bit.
// Expects OB_TARGET (the target attribute), OB_VNNI and OB_SUFFIX (the exported names' suffix) defined.
#include <immintrin.h>

#include "dot.h"

#define OB_CAT2(a, b) a##b
#define OB_CAT(a, b) OB_CAT2(a, b)

namespace oneblock {
namespace OB_CAT(kq_, OB_SUFFIX) {

// Unsigned codes u (< 64) times signed activations s, each int32 lane's 4 products summed and multiplied by its
// lane's scale (scale32: int32 lanes; the non-VNNI path takes the same scales as int16 pairs). A pair of products is
// at most 2 * 63 * 127 in magnitude: no int16 saturates.
OB_TARGET inline __m512i scaled_dot(__m512i u, __m512i s, __m512i scale32) {
#if OB_VNNI
  return _mm512_mullo_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s), scale32);
#else
  const __m512i scale16 = _mm512_or_si512(_mm512_and_si512(scale32, _mm512_set1_epi32(0xFFFF)),
                                          _mm512_slli_epi32(scale32, 16));
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), scale16);
#endif
}

// The sums of the int32 lanes of v (16) and of m (8), exact: returned as (sum of v, sum of m).
OB_TARGET inline void hsum_two(__m512i v, __m256i m, int& sv, int& sm) {
  const __m256i v8 = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  __m256i x = _mm256_hadd_epi32(v8, m);  // [v01 v23 m01 m23 | v45 v67 m45 m67]
  x = _mm256_hadd_epi32(x, x);           // [v0-3 m0-3 . . | v4-7 m4-7 . .]
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  sv = _mm_cvtsi128_si32(s);
  sm = _mm_extract_epi32(s, 1);
}

// Q4_K's 12 bytes of scales and minimums -> 16 bytes: the 8 scales, then the 8 minimums (ggml's unpacking; the
// values of q4_k_scale_min).
inline void q4_k_scales_mins(const uint8_t* q, uint8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, q, 12);
  const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t mins_low = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = mins_low;
  u[0] &= k1;
  std::memcpy(out, u, 16);
}

// Q5_K's fifth bits: bit s of qh[l] adds 16 to value l of sub-block s. A chunk's lanes 0-31 are of one sub-block and
// 32-63 of another: the byte mask of qh (twice) tested against those two sub-blocks' bits.
OB_TARGET inline __m512i add_fifth(__m512i low, __m512i qh2, int s0, int s1) {
  const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << s0)),
                                          _mm256_set1_epi8(static_cast<char>(1 << s1)), 1);
  return _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(qh2, bits), low, _mm512_set1_epi8(16));
}

// Q4_K, and Q5_K (Five: the same scales, minimums and nibbles, and a fifth bit per code).
template <typename Block, bool Five>
struct Q4_K {
  template <int R, int C>
  struct Tile {
    OB_TARGET static void run(const uint8_t* wp, int64_t row_bytes, const ActRow* a, int64_t nb, float* out,
                              int64_t stride) {
      // A 64-byte chunk k of nibbles holds sub-blocks 4k (low nibbles of bytes 0-31), 4k + 1 (their high nibbles),
      // 4k + 2 and 4k + 3 (bytes 32-63): its low nibbles pair with the activations of sub-blocks (4k, 4k + 2), its high
      // ones with (4k + 1, 4k + 3); the scale of each int32 lane is its sub-block's.
      const __m512i pick[4] = {
          _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
          _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
          _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4),
          _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5)};
      const __m512i low_mask = _mm512_set1_epi8(0x0F);
      float acc[R][C] = {};
      for (int64_t b = 0; b < nb; ++b) {
        __m512i qa[R][4];  // per row: activations of sub-blocks (0, 2), (1, 3), (4, 6), (5, 7)
        __m256i bsums[R];  // per row: the 16 int16 sums of 16 codes
        for (int r = 0; r < R; ++r) {
          const int8_t* q = a[r].q + b * QK_K;
          for (int k = 0; k < 2; ++k) {
            const __m512i a0 = _mm512_loadu_si512(q + 128 * k), a1 = _mm512_loadu_si512(q + 128 * k + 64);
            qa[r][2 * k] = _mm512_shuffle_i64x2(a0, a1, 0x44);
            qa[r][2 * k + 1] = _mm512_shuffle_i64x2(a0, a1, 0xEE);
          }
          bsums[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r].bsums + b * (QK_K / 16)));
        }
        for (int c = 0; c < C; ++c) {
          const Block& w = reinterpret_cast<const Block*>(wp + c * row_bytes)[b];
          alignas(16) uint8_t sm[16];
          q4_k_scales_mins(w.scales, sm);
          const __m128i packed = _mm_load_si128(reinterpret_cast<const __m128i*>(sm));
          const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi32(packed));
          // each minimum twice, as int16: vpmaddwd with the bsums gives m[s] * (bs[2s] + bs[2s + 1])
          const __m128i mins8 = _mm_srli_si128(packed, 8);
          const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins8, mins8));
          __m512i qw[4], scale[4];
          for (int k = 0; k < 2; ++k) {
            const __m512i raw = _mm512_loadu_si512(w.qs + 64 * k);
            qw[2 * k] = _mm512_and_si512(raw, low_mask);
            qw[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_mask);
          }
          if constexpr (Five) {
            const __m512i qh2 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qh)));
            for (int k = 0; k < 2; ++k) {
              qw[2 * k] = add_fifth(qw[2 * k], qh2, 4 * k, 4 * k + 2);
              qw[2 * k + 1] = add_fifth(qw[2 * k + 1], qh2, 4 * k + 1, 4 * k + 3);
            }
          }
          for (int i = 0; i < 4; ++i) scale[i] = _mm512_permutexvar_epi32(pick[i], sc);
          const float d = g_half[load_u16(&w.d)], dmin = g_half[load_u16(&w.dmin)];
          for (int r = 0; r < R; ++r) {
            __m512i sums = scaled_dot(qw[0], qa[r][0], scale[0]);
            for (int i = 1; i < 4; ++i) sums = _mm512_add_epi32(sums, scaled_dot(qw[i], qa[r][i], scale[i]));
            int isum, msum;
            hsum_two(sums, _mm256_madd_epi16(bsums[r], mins), isum, msum);
            acc[r][c] += static_cast<float>(isum) * (d * a[r].d[b]);
            acc[r][c] -= static_cast<float>(msum) * (dmin * a[r].d[b]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) out[r * stride + c] = acc[r][c];
    }
  };
};

template <int R, int C>
using Q4_KTile = Q4_K<BlockQ4_K, false>::Tile<R, C>;
template <int R, int C>
using Q5_KTile = Q4_K<BlockQ5_K, true>::Tile<R, C>;

template <int R, int C>
struct Q6_KTile {
  OB_TARGET static void run(const uint8_t* wp, int64_t row_bytes, const ActRow* a, int64_t nb, float* out,
                            int64_t stride) {
    // Half h (values 128h .. 128h + 127) takes ql[64h .. 64h + 63] and qh[32h .. 32h + 31]: the low nibbles are values
    // 128h + 0..63 in order, the high ones 128h + 64..127; qh's bit pairs 0, 1 (2, 3) top the low (high) nibbles of
    // bytes 0-31 and 32-63. The codes are taken unsigned, in [0, 63]; the -32 is subtracted as 32 * scale * bsum.
    // Each int32 lane holds 4 values; 4 lanes share a scale of 16 values.
    const __m512i pick[4] = {
        _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
        _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4),
        _mm512_set_epi32(11, 11, 11, 11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8),
        _mm512_set_epi32(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12)};
    const __m512i low_mask = _mm512_set1_epi8(0x0F), top_mask = _mm512_set1_epi8(0x30);
    float acc[R][C] = {};
    for (int64_t b = 0; b < nb; ++b) {
      __m512i qa[R][4];
      __m256i bsums[R];
      for (int r = 0; r < R; ++r) {
        const int8_t* q = a[r].q + b * QK_K;
        for (int i = 0; i < 4; ++i) qa[r][i] = _mm512_loadu_si512(q + 64 * i);
        bsums[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r].bsums + b * (QK_K / 16)));
      }
      for (int c = 0; c < C; ++c) {
        const BlockQ6_K& w = reinterpret_cast<const BlockQ6_K*>(wp + c * row_bytes)[b];
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales));
        const __m512i sc = _mm512_cvtepi8_epi32(sc8);
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        __m512i qw[4], scale[4];
        for (int h = 0; h < 2; ++h) {
          const __m512i raw = _mm512_loadu_si512(w.ql + 64 * h);
          const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qh + 32 * h));
          const __m512i top = _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
          const __m512i low = _mm512_and_si512(raw, low_mask);
          const __m512i high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_mask);
          qw[2 * h] = _mm512_or_si512(low, _mm512_and_si512(_mm512_slli_epi16(top, 4), top_mask));
          qw[2 * h + 1] = _mm512_or_si512(high, _mm512_and_si512(top, top_mask));
        }
        for (int i = 0; i < 4; ++i) scale[i] = _mm512_permutexvar_epi32(pick[i], sc);
        const float d = g_half[load_u16(&w.d)];
        for (int r = 0; r < R; ++r) {
          __m512i sums = scaled_dot(qw[0], qa[r][0], scale[0]);
          for (int i = 1; i < 4; ++i) sums = _mm512_add_epi32(sums, scaled_dot(qw[i], qa[r][i], scale[i]));
          // minus 32 * sum of scale[j] * bsum[j]
          const __m256i shift = _mm256_slli_epi32(_mm256_madd_epi16(bsums[r], sc16), 5);
          sums = _mm512_sub_epi32(sums, _mm512_zextsi256_si512(shift));
          const int isum = _mm512_reduce_add_epi32(sums);
          acc[r][c] += static_cast<float>(isum) * (d * a[r].d[b]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[r * stride + c] = acc[r][c];
  }
};

}  // namespace OB_CAT(kq_, OB_SUFFIX)

#define OB_EXPORT(fmt, tile)                                                                                  \
  void OB_CAT(dot_##fmt##_, OB_SUFFIX)(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows,  \
                                       int64_t nb, float* out, int64_t stride) {                                 \
    tile_dispatch<OB_CAT(kq_, OB_SUFFIX)::tile>(w, row_bytes, cols, a, rows, nb, out, stride);                   \
  }
OB_EXPORT(q4_k, Q4_KTile)
OB_EXPORT(q6_k, Q6_KTile)
OB_EXPORT(q5_k, Q5_KTile)
#undef OB_EXPORT

}  // namespace oneblock

#undef OB_CAT
#undef OB_CAT2
