// AVX2 kernels over the interleaved layouts of the 256-value formats (q4_kx16, q5_kx16, q6_kx16, iq4_xsx16): per lane
// the scalar kernel's exact integer sums of a super-block, then its float operations in its order, so each output
// equals dot_scalar.cpp's (dot_kq_scalar.cpp's) bit for bit.
#include "dot_x16_avx2.h"

namespace oneblock {
namespace x16_avx2 {

// Half h (rows 8h..8h+7) of one Q4_Kx16 group against R activation rows (Q8_K): per lane the exact isum and msum of
// a super-block, then the scalar kernel's float operations in its order, so each output equals dot_scalar.cpp's.
template <int R, int64_t Fmt>
OB_AVX2 void q4_k_half(const uint8_t* group, int h, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<Fmt>;  // kQ4_K, or kQ5_K: a fifth bit per code, bit s of the qh chunks for sub-block s
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), byte = _mm256_set1_epi32(0xFF);
  const __m256i six = _mm256_set1_epi8(0x3F), four = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    const __m256 dw = scales8(blk + L::kScales + 16 * h), mw = scales8(blk + L::kMins + 16 * h);
    // ggml's unpacking of the 12 bytes of 6-bit scales and minimums, as 32-bit words, for 8 rows at once
    const __m256i u0 = load_half(blk + L::kPacked, h), u1 = load_half(blk + L::kPacked + kChunkBytes, h),
                  u2 = load_half(blk + L::kPacked + 2 * kChunkBytes, h);
    const __m256i words[4] = {_mm256_and_si256(u0, six), _mm256_or_si256(_mm256_and_si256(u2, four), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), two), 4)),
                              _mm256_and_si256(u1, six),
                              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), four), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), two), 4))};
    __m256i sc[8], mins[8];  // sub-block s: byte s % 4 of the scales' (minimums') word s / 4
    for (int s = 0; s < 8; ++s) {
      sc[s] = _mm256_and_si256(_mm256_srli_epi32(words[s / 4], 8 * (s % 4)), byte);
      mins[s] = _mm256_and_si256(_mm256_srli_epi32(words[2 + s / 4], 8 * (s % 4)), byte);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* q = a[r].q + b * QK_K;
      const int16_t* bs = a[r].bsums + b * (QK_K / 16);
      __m256i isum = _mm256_setzero_si256(), msum = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {  // chunks 8c .. 8c + 7: sub-blocks 2c (low nibbles) and 2c + 1 (high)
        // a pair of products is at most 2 * 15 * 127 = 3810: a lane's 8 pairs fit int16
        // codes <= 31: a pair of products is at most 2 * 31 * 127 = 7874, 4 pairs fit int16 before each vpmaddwd
        __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i) {
          const __m256i raw = load_half(blk + L::kCodes + (8 * c + i) * kChunkBytes, h);
          __m256i wl = _mm256_and_si256(raw, low), wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
          if constexpr (Fmt == kQ5_K) {
            const __m256i qh = load_half(blk + L::kHigh + i * kChunkBytes, h), one = _mm256_set1_epi8(1);
            wl = _mm256_or_si256(wl, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
            wh = _mm256_or_si256(wh, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
          }
          lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(wl, broadcast4(q + 64 * c + 4 * i)));
          hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(wh, broadcast4(q + 64 * c + 32 + 4 * i)));
          if (i == 3) {  // half way: into int32 before a fifth pair could overflow int16
            isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(_mm256_madd_epi16(lo, ones), sc[2 * c]));
            isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(_mm256_madd_epi16(hi, ones), sc[2 * c + 1]));
            lo = hi = _mm256_setzero_si256();
          }
        }
        isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(_mm256_madd_epi16(lo, ones), sc[2 * c]));
        isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(_mm256_madd_epi16(hi, ones), sc[2 * c + 1]));
      }
      for (int s = 0; s < 8; ++s) {
        msum = _mm256_add_epi32(msum, _mm256_mullo_epi32(mins[s], _mm256_set1_epi32(bs[2 * s] + bs[2 * s + 1])));
      }
      const __m256 da = _mm256_set1_ps(a[r].d[b]);
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, da)));
      acc[r] = _mm256_sub_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(mw, da)));
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * stride, acc[r]);
}

// Half h (rows 8h..8h+7) of one Q6_Kx16 group against R activation rows, as dot_x16_avx512.h's q6_k_group: per lane
// the scalar kernel's exact isum, then its float operations in its order.
template <int R>
OB_AVX2 void q6_k_half(const uint8_t* group, int h, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<kQ6_K>;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x03), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    const __m256 dw = scales8(blk + L::kScales + 16 * h);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = a[r].q + b * QK_K;
      const int16_t* bs = a[r].bsums + b * (QK_K / 16);
      __m256i isum = _mm256_setzero_si256();
      for (int part = 0; part < 2; ++part) {  // values 128 part ..
        for (int half_sub = 0; half_sub < 2; ++half_sub) {
          __m256i sums[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                             _mm256_setzero_si256()};
          for (int i = 0; i < 4; ++i) {
            const uint8_t* triple = blk + L::kCodes + 3 * (8 * part + 4 * half_sub + i) * kChunkBytes;
            const __m256i ql0 = load_half(triple, h), ql1 = load_half(triple + kChunkBytes, h);
            const __m256i qh = load_half(triple + 2 * kChunkBytes, h);
            for (int quarter = 0; quarter < 4; ++quarter) {
              const __m256i ql = quarter % 2 ? ql1 : ql0;
              const __m256i nib = _mm256_and_si256(quarter >= 2 ? _mm256_srli_epi16(ql, 4) : ql, low);
              const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * quarter), pair);
              const __m256i codes = _mm256_or_si256(nib, _mm256_slli_epi16(top, 4));  // [0, 63]: a pair <= 16002
              const __m256i act = broadcast4(q + 128 * part + 32 * quarter + 16 * half_sub + 4 * i);
              sums[quarter] = _mm256_add_epi32(sums[quarter], _mm256_madd_epi16(_mm256_maddubs_epi16(codes, act), ones));
            }
          }
          for (int quarter = 0; quarter < 4; ++quarter) {
            const int s = 8 * part + 2 * quarter + half_sub;
            const __m256i word = load_half(blk + L::kSubScales + (s / 4) * kChunkBytes, h);
            const __m256i scale = _mm256_srai_epi32(_mm256_slli_epi32(word, 24 - 8 * (s % 4)), 24);
            const __m256i centred = _mm256_sub_epi32(sums[quarter], _mm256_set1_epi32(32 * bs[s]));
            isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(centred, scale));
          }
        }
      }
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(a[r].d[b]))));
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * stride, acc[r]);
}

// Half h (rows 8h..8h+7) of one IQ4_XSx16 group, as dot_kx16_avx512.h's iq4_xs_group without VNNI: the values
// looked up by `vpshufb`, |w| meeting the activation with w's sign moved onto it (a pair is at most 2 * 127 * 127 =
// 32258: one pair per int16 lane, widened by vpmaddwd), each sub-block's exact sum times its scale, then the scalar
// kernel's float operations (bit for bit).
template <int R>
OB_AVX2 void iq4_xs_half(const uint8_t* group, int h, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<kIQ4_XS>;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)));
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    const __m256 dw = scales8(blk + L::kScales + 16 * h);
    const __m256i high = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + L::kHigh + 16 * h)));
    const __m256i lows = load_half(blk + L::kLow, h);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = a[r].q + b * QK_K;
      __m256i isum = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {
        const __m256i ls = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi32(lows, 8 * (s / 2) + 4 * (s % 2)), _mm256_set1_epi32(0x0F)),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(high, 2 * s), _mm256_set1_epi32(3)), 4));
        __m256i sub = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
          const __m256i raw = load_half(blk + L::kCodes + (4 * s + i) * kChunkBytes, h);
          const __m256i w[2] = {_mm256_shuffle_epi8(values, _mm256_and_si256(raw, low)),
                                _mm256_shuffle_epi8(values, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low))};
          for (int part = 0; part < 2; ++part) {
            const __m256i act = broadcast4(q + 32 * s + 16 * part + 4 * i);
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w[part], w[part]), _mm256_sign_epi8(act, w[part]));
            sub = _mm256_add_epi32(sub, _mm256_madd_epi16(pairs, ones));
          }
        }
        isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(sub, _mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
      }
      const __m256 da = _mm256_set1_ps(a[r].d[b]);
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, da)));
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * stride, acc[r]);
}

template <int R>
struct Q4_KHalf {
  OB_AVX2 static void run(const uint8_t* g, int h, const ActRow* a, int64_t nb, float* o, int64_t s) {
    q4_k_half<R, kQ4_K>(g, h, a, nb, o, s);
  }
};

template <int R>
struct Q5_KHalf {
  OB_AVX2 static void run(const uint8_t* g, int h, const ActRow* a, int64_t nb, float* o, int64_t s) {
    q4_k_half<R, kQ5_K>(g, h, a, nb, o, s);
  }
};

template <int R>
struct Q6_KHalf {
  OB_AVX2 static void run(const uint8_t* g, int h, const ActRow* a, int64_t nb, float* o, int64_t s) {
    q6_k_half<R>(g, h, a, nb, o, s);
  }
};

template <int R>
struct IQ4_XSHalf {
  OB_AVX2 static void run(const uint8_t* g, int h, const ActRow* a, int64_t nb, float* o, int64_t s) {
    iq4_xs_half<R>(g, h, a, nb, o, s);
  }
};

}  // namespace x16_avx2

void dot_iq4_xsx16_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                        float* out, int64_t stride) {
  x16_avx2::groups<x16_avx2::IQ4_XSHalf>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q5_kx16_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                      float* out, int64_t stride) {
  x16_avx2::groups<x16_avx2::Q5_KHalf>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q6_kx16_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                      float* out, int64_t stride) {
  x16_avx2::groups<x16_avx2::Q6_KHalf>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q4_kx16_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                      float* out, int64_t stride) {
  x16_avx2::groups<x16_avx2::Q4_KHalf>(w, row_bytes, cols, a, rows, nb, out, stride);
}

}  // namespace oneblock
