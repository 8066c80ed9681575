// AVX2 kernels. Per block, the 32 code products are summed in 8 int32 lanes (`vpmaddubsw`: unsigned x signed
// bytes to int16 pairs, then `vpmaddwd` to int32; no saturation is possible, see each kernel), converted to
// float and fused-multiply-added with the block's scale into 8 float accumulators per output.
// Compiled for AVX2 by the target attribute alone; called only when the CPU reports AVX2 and FMA.
#include <immintrin.h>

#include "dot.h"
#include "sum_avx2.h"

#define OB_AVX2 __attribute__((target("avx2,fma")))

namespace oneblock {
namespace {

// 32 signed codes w times 32 signed codes a, as 8 int32 lane sums of 4 products each. |w| <= 128, |a| <= 127:
// a pair of products is at most 32512 in magnitude and fits int16.
OB_AVX2 inline __m256i dot_signed(__m256i w, __m256i a) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// Unsigned codes u in [0, 31] times signed a: a pair is at most 2 * 31 * 127.
OB_AVX2 inline __m256i dot_unsigned(__m256i u, __m256i a) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
}

// 16 bytes of nibbles -> 32 codes in [0, 15]: low nibbles are values 0..15, high nibbles 16..31.
OB_AVX2 inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// A 5-bit block's codes in [0, 31]: the nibbles, with bit j of qh (little-endian) set as bit 4 of code j. Byte j
// of the broadcast qh word takes byte j / 8 of it; or-ing every bit but j % 8 and comparing with all ones tests
// that bit (ggml's bytes_from_bits_32).
OB_AVX2 inline __m256i unpack_q5(const uint8_t* qs, const uint8_t* qh) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(load_u32(qh))),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  const __m256i others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE));
  const __m256i set = _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1));  // 0xFF where the fifth bit is 1
  return _mm256_or_si256(unpack_nibbles(qs), _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

OB_AVX2 inline __m256i load_codes(const int8_t* q) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
}

// Signed-code formats: Q8_0 as stored, Q4_0 as code - 8 in [-8, 7].
struct Q8_0Codes {
  using Block = BlockQ8_0;
  OB_AVX2 static __m256i codes(const Block& w) { return load_codes(w.qs); }
};
struct Q4_0Codes {
  using Block = BlockQ4_0;
  OB_AVX2 static __m256i codes(const Block& w) {
    return _mm256_sub_epi8(unpack_nibbles(w.qs), _mm256_set1_epi8(8));
  }
};

struct Q5_0Codes {
  using Block = BlockQ5_0;
  OB_AVX2 static __m256i codes(const Block& w) {
    return _mm256_sub_epi8(unpack_q5(w.qs, w.qh), _mm256_set1_epi8(16));  // [-16, 15]
  }
};

// IQ4_NL: the 4-bit indices looked up in the 16 non-linear values (vpshufb, as ggml's), in [-127, 113].
struct IQ4_NLCodes {
  using Block = BlockIQ4_NL;
  OB_AVX2 static __m256i codes(const Block& w) {
    const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues));
    return _mm256_shuffle_epi8(_mm256_set_m128i(values, values), unpack_nibbles(w.qs));
  }
};

template <typename Codes>
struct Signed {
  template <int R, int C>
  struct Tile {
    OB_AVX2 static void run(const uint8_t* wp, int64_t row_bytes, const ActRow* a, int64_t nb, float* out,
                            int64_t stride) {
      using Block = typename Codes::Block;
      __m256 acc[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        __m256i qa[R];
        for (int r = 0; r < R; ++r) qa[r] = load_codes(a[r].q + b * QK);
        for (int c = 0; c < C; ++c) {
          const Block& blk = reinterpret_cast<const Block*>(wp + c * row_bytes)[b];
          const __m256i qw = Codes::codes(blk);
          const float dw = g_half[load_u16(&blk.d)];
          for (int r = 0; r < R; ++r) {
            const __m256 sumi = _mm256_cvtepi32_ps(dot_signed(qw, qa[r]));
            acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a[r].d[b]), sumi, acc[r][c]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) out[r * stride + c] = hsum(acc[r][c]);
    }
  };
};

// Formats with a minimum: unsigned codes (Q4_1's in [0, 15], Q5_1's in [0, 31]: a pair of products is at most
// 2 * 31 * 127) and m * s added per block.
struct Q4_1Codes {
  using Block = BlockQ4_1;
  OB_AVX2 static __m256i codes(const Block& w) { return unpack_nibbles(w.qs); }
};
struct Q5_1Codes {
  using Block = BlockQ5_1;
  OB_AVX2 static __m256i codes(const Block& w) { return unpack_q5(w.qs, w.qh); }
};

template <typename Codes>
struct WithMin {
  template <int R, int C>
  struct Tile {
    OB_AVX2 static void run(const uint8_t* wp, int64_t row_bytes, const ActRow* a, int64_t nb, float* out,
                            int64_t stride) {
      __m256 acc[R][C];
      float mins[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
          acc[r][c] = _mm256_setzero_ps();
          mins[r][c] = 0.0f;
        }
      for (int64_t b = 0; b < nb; ++b) {
        __m256i qa[R];
        for (int r = 0; r < R; ++r) qa[r] = load_codes(a[r].q + b * QK);
        for (int c = 0; c < C; ++c) {
          const auto& blk = reinterpret_cast<const typename Codes::Block*>(wp + c * row_bytes)[b];
          const __m256i qw = Codes::codes(blk);
          const float dw = g_half[load_u16(&blk.d)];
          const float mw = g_half[load_u16(&blk.m)];
          for (int r = 0; r < R; ++r) {
            const __m256 sumi = _mm256_cvtepi32_ps(dot_unsigned(qw, qa[r]));
            acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a[r].d[b]), sumi, acc[r][c]);
            mins[r][c] += mw * a[r].s[b];
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) out[r * stride + c] = hsum(acc[r][c]) + mins[r][c];
    }
  };
};

}  // namespace

void dot_q8_0_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                   float* out, int64_t stride) {
  tile_dispatch<Signed<Q8_0Codes>::Tile>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_iq4_nl_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                     float* out, int64_t stride) {
  tile_dispatch<Signed<IQ4_NLCodes>::Tile>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q4_0_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                   float* out, int64_t stride) {
  tile_dispatch<Signed<Q4_0Codes>::Tile>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q4_1_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                   float* out, int64_t stride) {
  tile_dispatch<WithMin<Q4_1Codes>::Tile>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q5_0_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                   float* out, int64_t stride) {
  tile_dispatch<Signed<Q5_0Codes>::Tile>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q5_1_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                   float* out, int64_t stride) {
  tile_dispatch<WithMin<Q5_1Codes>::Tile>(w, row_bytes, cols, a, rows, nb, out, stride);
}

}  // namespace oneblock
