// AVX-512 kernels, included twice by dot_avx512.cpp: once with OB_VNNI 0 (AVX-512BW: `vpmaddubsw` then
// `vpmaddwd`) and once with OB_VNNI 1 (`vpdpbusd`, four byte products summed into an int32 lane in one step).
// Both give the same int32 lane sums, so the two paths return identical floats. Two blocks share one 512-bit
// register (lanes 0-7 the first block, 8-15 the second); an odd last block takes 256-bit instructions.
// Expects OB_TARGET (the target attribute), OB_VNNI and OB_SUFFIX (the exported names' suffix) defined.
#include <immintrin.h>

#include "dot.h"

#define OB_CAT2(a, b) a##b
#define OB_CAT(a, b) OB_CAT2(a, b)

namespace oneblock {
namespace OB_CAT(ns_, OB_SUFFIX) {

OB_TARGET inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Unsigned bytes u times signed bytes s, as int32 lanes of 4 products (pairs fit int16: |u| <= 128, |s| <= 127).
OB_TARGET inline __m512i dot_us(__m512i u, __m512i s) {
#if OB_VNNI
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

OB_TARGET inline __m256i dot_us256(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Signed w times signed a: |w| as unsigned, the sign moved onto a.
OB_TARGET inline __m512i dot_signed(__m512i w, __m512i a) {
  const __mmask64 negative = _mm512_movepi8_mask(w);
  return dot_us(_mm512_abs_epi8(w), _mm512_mask_sub_epi8(a, negative, _mm512_setzero_si512(), a));
}

OB_TARGET inline __m256i dot_signed256(__m256i w, __m256i a) {
  return dot_us256(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

OB_TARGET inline __m512i join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

OB_TARGET inline __m512 scales(float first, float second) {
  return _mm512_insertf32x8(_mm512_set1_ps(first), _mm256_set1_ps(second), 1);
}

// The nibbles of two blocks -> 64 codes in [0, 15], in value order: block b's 0..31, then block b + 1's.
OB_TARGET inline __m512i unpack_two(const uint8_t* qs0, const uint8_t* qs1) {
  const __m256i raw = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs1)),
                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs0)));
  const __m512i parts = join(raw, _mm256_srli_epi16(raw, 4));        // [lo0, lo1, hi0, hi1] (128-bit lanes)
  const __m512i ordered = _mm512_shuffle_i64x2(parts, parts, 0xD8);  // [lo0, hi0, lo1, hi1]
  return _mm512_and_si512(ordered, _mm512_set1_epi8(0x0F));
}

OB_TARGET inline __m256i unpack_one(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// A 5-bit block's fifth bits (qh, little-endian) are a byte mask: bit j set adds 16 to code j. Two blocks' masks
// side by side give the 64 codes of unpack_two's order.
OB_TARGET inline __m512i unpack5_two(const uint8_t* qs0, const uint8_t* qh0, const uint8_t* qs1, const uint8_t* qh1) {
  const __mmask64 fifth = static_cast<__mmask64>(load_u32(qh0)) | (static_cast<__mmask64>(load_u32(qh1)) << 32);
  const __m512i low = unpack_two(qs0, qs1);
  return _mm512_mask_add_epi8(low, fifth, low, _mm512_set1_epi8(16));
}

OB_TARGET inline __m256i unpack5_one(const uint8_t* qs, const uint8_t* qh) {
  const __m256i low = unpack_one(qs);
  return _mm256_mask_add_epi8(low, static_cast<__mmask32>(load_u32(qh)), low, _mm256_set1_epi8(16));
}

OB_TARGET inline __m256i codes256(const int8_t* q) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)); }
OB_TARGET inline __m512i codes512(const int8_t* q) { return _mm512_loadu_si512(q); }

// Signed-code formats (Q8_0, and Q4_0 as code - 8): `wide` gives blocks b and b + 1, `narrow` block b.
struct Q8_0Codes {
  using Block = BlockQ8_0;
  OB_TARGET static __m512i wide(const Block* w) { return join(codes256(w[0].qs), codes256(w[1].qs)); }
  OB_TARGET static __m256i narrow(const Block* w) { return codes256(w[0].qs); }
};
struct Q4_0Codes {
  using Block = BlockQ4_0;
  OB_TARGET static __m512i wide(const Block* w) {
    return _mm512_sub_epi8(unpack_two(w[0].qs, w[1].qs), _mm512_set1_epi8(8));
  }
  OB_TARGET static __m256i narrow(const Block* w) { return _mm256_sub_epi8(unpack_one(w[0].qs), _mm256_set1_epi8(8)); }
};

struct Q5_0Codes {
  using Block = BlockQ5_0;
  OB_TARGET static __m512i wide(const Block* w) {
    return _mm512_sub_epi8(unpack5_two(w[0].qs, w[0].qh, w[1].qs, w[1].qh), _mm512_set1_epi8(16));
  }
  OB_TARGET static __m256i narrow(const Block* w) {
    return _mm256_sub_epi8(unpack5_one(w[0].qs, w[0].qh), _mm256_set1_epi8(16));
  }
};

template <typename Codes>
struct Signed {
  template <int R, int C>
  struct Tile {
    OB_TARGET static void run(const uint8_t* wp, int64_t row_bytes, const ActRow* a, int64_t nb, float* out,
                              int64_t stride) {
      using Block = typename Codes::Block;
      __m512 acc[R][C];
      __m256 tail[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
          acc[r][c] = _mm512_setzero_ps();
          tail[r][c] = _mm256_setzero_ps();
        }
      int64_t b = 0;
      for (; b + 2 <= nb; b += 2) {
        __m512i qa[R];
        for (int r = 0; r < R; ++r) qa[r] = codes512(a[r].q + b * QK);
        for (int c = 0; c < C; ++c) {
          const Block* w = reinterpret_cast<const Block*>(wp + c * row_bytes) + b;
          const __m512i qw = Codes::wide(w);
          const float d0 = g_half[load_u16(&w[0].d)], d1 = g_half[load_u16(&w[1].d)];
          for (int r = 0; r < R; ++r) {
            const __m512 sumi = _mm512_cvtepi32_ps(dot_signed(qw, qa[r]));
            acc[r][c] = _mm512_fmadd_ps(scales(d0 * a[r].d[b], d1 * a[r].d[b + 1]), sumi, acc[r][c]);
          }
        }
      }
      if (b < nb) {
        for (int c = 0; c < C; ++c) {
          const Block* w = reinterpret_cast<const Block*>(wp + c * row_bytes) + b;
          const __m256i qw = Codes::narrow(w);
          const float d0 = g_half[load_u16(&w[0].d)];
          for (int r = 0; r < R; ++r) {
            const __m256 sumi = _mm256_cvtepi32_ps(dot_signed256(qw, codes256(a[r].q + b * QK)));
            tail[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * a[r].d[b]), sumi, tail[r][c]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) out[r * stride + c] = _mm512_reduce_add_ps(acc[r][c]) + hsum256(tail[r][c]);
    }
  };
};

// Formats with a minimum: unsigned codes (Q4_1's in [0, 15], Q5_1's in [0, 31]) and m * s added per block.
struct Q4_1Codes {
  using Block = BlockQ4_1;
  OB_TARGET static __m512i wide(const Block* w) { return unpack_two(w[0].qs, w[1].qs); }
  OB_TARGET static __m256i narrow(const Block* w) { return unpack_one(w[0].qs); }
};
struct Q5_1Codes {
  using Block = BlockQ5_1;
  OB_TARGET static __m512i wide(const Block* w) { return unpack5_two(w[0].qs, w[0].qh, w[1].qs, w[1].qh); }
  OB_TARGET static __m256i narrow(const Block* w) { return unpack5_one(w[0].qs, w[0].qh); }
};

template <typename Codes>
struct WithMin {
  template <int R, int C>
  struct Tile {
    OB_TARGET static void run(const uint8_t* wp, int64_t row_bytes, const ActRow* a, int64_t nb, float* out,
                              int64_t stride) {
      using Block = typename Codes::Block;
      __m512 acc[R][C];
      __m256 tail[R][C];
      float mins[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
          acc[r][c] = _mm512_setzero_ps();
          tail[r][c] = _mm256_setzero_ps();
          mins[r][c] = 0.0f;
        }
      int64_t b = 0;
      for (; b + 2 <= nb; b += 2) {
        __m512i qa[R];
        for (int r = 0; r < R; ++r) qa[r] = codes512(a[r].q + b * QK);
        for (int c = 0; c < C; ++c) {
          const Block* w = reinterpret_cast<const Block*>(wp + c * row_bytes) + b;
          const __m512i qw = Codes::wide(w);
          const float d0 = g_half[load_u16(&w[0].d)], d1 = g_half[load_u16(&w[1].d)];
          const float m0 = g_half[load_u16(&w[0].m)], m1 = g_half[load_u16(&w[1].m)];
          for (int r = 0; r < R; ++r) {
            const __m512 sumi = _mm512_cvtepi32_ps(dot_us(qw, qa[r]));
            acc[r][c] = _mm512_fmadd_ps(scales(d0 * a[r].d[b], d1 * a[r].d[b + 1]), sumi, acc[r][c]);
            mins[r][c] += m0 * a[r].s[b];
            mins[r][c] += m1 * a[r].s[b + 1];
          }
        }
      }
      if (b < nb) {
        for (int c = 0; c < C; ++c) {
          const Block* w = reinterpret_cast<const Block*>(wp + c * row_bytes) + b;
          const __m256i qw = Codes::narrow(w);
          const float d0 = g_half[load_u16(&w[0].d)], m0 = g_half[load_u16(&w[0].m)];
          for (int r = 0; r < R; ++r) {
            const __m256 sumi = _mm256_cvtepi32_ps(dot_us256(qw, codes256(a[r].q + b * QK)));
            tail[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * a[r].d[b]), sumi, tail[r][c]);
            mins[r][c] += m0 * a[r].s[b];
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          out[r * stride + c] = _mm512_reduce_add_ps(acc[r][c]) + hsum256(tail[r][c]) + mins[r][c];
    }
  };
};

template <int R, int C>
using Q8_0Tile = Signed<Q8_0Codes>::Tile<R, C>;
template <int R, int C>
using Q4_0Tile = Signed<Q4_0Codes>::Tile<R, C>;
template <int R, int C>
using Q5_0Tile = Signed<Q5_0Codes>::Tile<R, C>;
template <int R, int C>
using Q4_1Tile = WithMin<Q4_1Codes>::Tile<R, C>;
template <int R, int C>
using Q5_1Tile = WithMin<Q5_1Codes>::Tile<R, C>;

}  // namespace OB_CAT(ns_, OB_SUFFIX)

#define OB_EXPORT(fmt, tile)                                                                                  \
  void OB_CAT(dot_##fmt##_, OB_SUFFIX)(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows,  \
                                       int64_t nb, float* out, int64_t stride) {                                 \
    tile_dispatch<OB_CAT(ns_, OB_SUFFIX)::tile>(w, row_bytes, cols, a, rows, nb, out, stride);                   \
  }
OB_EXPORT(q8_0, Q8_0Tile)
OB_EXPORT(q4_0, Q4_0Tile)
OB_EXPORT(q4_1, Q4_1Tile)
OB_EXPORT(q5_0, Q5_0Tile)
OB_EXPORT(q5_1, Q5_1Tile)
#undef OB_EXPORT

}  // namespace oneblock

#undef OB_CAT
#undef OB_CAT2
