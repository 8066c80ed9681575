// AVX2 kernels over the interleaved layouts (interleaved.h). A 64-byte chunk is two 256-bit registers (rows 0-7,
// rows 8-15), each 8 int32 lanes of one row's 4 codes; 4 activation codes are broadcast to every lane. The block
// sums are exact integers and the float work per output is the scalar path's, in another order.
#include "dot_x16_avx2.h"

namespace oneblock {
namespace x16_avx2 {

// Half h (rows 8h..8h+7) of one Q4_1x16 group against R activation rows.
template <int R>
OB_AVX2 void q4_1_half(const uint8_t* group, int h, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<kQ4_1>;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    fetch_ahead<L>(blk);
    const __m256 dw = scales8(blk + L::kScales + 16 * h), mw = scales8(blk + L::kMins + 16 * h);
    __m256i w[8];  // w[i]: codes 4i..4i+3 of the 8 rows
    for (int c = 0; c < L::kChunks; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L::kCodes + c * kChunkBytes + 32 * h));
      w[c] = _mm256_and_si256(raw, low);
      w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* q = a[r].q + b * QK;
      // A pair of products is at most 2 * 15 * 127 = 3810 in magnitude: the 8 pairs of a lane fit int16.
      __m256i pairs = _mm256_maddubs_epi16(w[0], broadcast4(q));
      for (int i = 1; i < 8; ++i) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[i], broadcast4(q + 4 * i)));
      const __m256 sumi = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a[r].d[b])), sumi, acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a[r].s[b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * stride, acc[r]);
}

// Q4_0's codes less 8, in [-8, 7], signed as Q8_0's below: |w| <= 8 meets the activation with w's sign moved
// onto it; a pair is at most 2 * 8 * 128 = 2048, so the 8 pairs of a lane fit int16.
template <int R>
OB_AVX2 void q4_0_half(const uint8_t* group, int h, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<kQ4_0>;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    fetch_ahead<L>(blk);
    const __m256 dw = scales8(blk + L::kScales + 16 * h);
    __m256i w[8], mag[8];  // w[i]: codes 4i..4i+3 of the 8 rows, less 8; mag[i]: |w[i]|
    for (int c = 0; c < L::kChunks; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L::kCodes + c * kChunkBytes + 32 * h));
      w[c] = _mm256_sub_epi8(_mm256_and_si256(raw, low), eight);
      w[c + 4] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), eight);
    }
    for (int i = 0; i < 8; ++i) mag[i] = _mm256_sign_epi8(w[i], w[i]);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = a[r].q + b * QK;
      __m256i pairs = _mm256_maddubs_epi16(mag[0], _mm256_sign_epi8(broadcast4(q), w[0]));
      for (int i = 1; i < 8; ++i) {
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(mag[i], _mm256_sign_epi8(broadcast4(q + 4 * i), w[i])));
      }
      const __m256 sumi = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a[r].d[b])), sumi, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * stride, acc[r]);
}

// Q8_0's signed codes: |w| meets the activation with w's sign moved onto it (`vpsignb`); a pair is at most
// 2 * 128 * 127 = 32512, so each pair sum is widened to int32 at once.
template <int R>
OB_AVX2 void q8_0_half(const uint8_t* group, int h, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<kQ8_0>;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    fetch_ahead<L>(blk);
    const __m256 dw = scales8(blk + L::kScales + 16 * h);
    __m256i w[8];
    for (int c = 0; c < L::kChunks; ++c) {
      w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L::kCodes + c * kChunkBytes + 32 * h));
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* q = a[r].q + b * QK;
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int c = 0; c < L::kChunks; c += 2) {
        const __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(w[c], w[c]), _mm256_sign_epi8(broadcast4(q + 4 * c), w[c]));
        const __m256i p1 =
            _mm256_maddubs_epi16(_mm256_sign_epi8(w[c + 1], w[c + 1]), _mm256_sign_epi8(broadcast4(q + 4 * c + 4), w[c + 1]));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(p0, ones));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(p1, ones));
      }
      const __m256 sumi = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a[r].d[b])), sumi, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * stride, acc[r]);
}

// Half h (rows 8h..8h+7) of one Q5_0x16 group: the codes less 16, in [-16, 15], signed as Q4_0's; the fifth bits
// `bit` .. `bit` + 3 of each row's qh word go to bit 4 of its 4 codes (`vpshufb` brings each lane the qh byte holding
// them). |w| <= 16 meets the activation with w's sign moved onto it: a pair is at most 2 * 16 * 127 = 4064 and the 8
// pairs of a lane fit int16.
OB_AVX2 inline __m256i fifth_bits(__m256i qh, int bit) {
  const int byte = bit / 8, shift = bit % 8;
  const __m256i index = _mm256_add_epi32(_mm256_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808,
                                                          0x04040404, 0),
                                         _mm256_set1_epi32(0x01010101 * byte));
  const __m256i bits = _mm256_set1_epi32(static_cast<int>(0x08040201u << shift));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, index), bits), bits);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

template <int R>
OB_AVX2 void q5_0_half(const uint8_t* group, int h, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<kQ5_0>;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    fetch_ahead<L>(blk);
    const __m256 dw = scales8(blk + L::kScales + 16 * h);
    const __m256i qh = load_half(blk + L::kHigh, h);
    __m256i w[8], mag[8];  // w[i]: codes 4i..4i+3 of the 8 rows, less 16; mag[i]: |w[i]|
    for (int c = 0; c < L::kChunks; ++c) {
      const __m256i raw = load_half(blk + L::kCodes + c * kChunkBytes, h);
      w[c] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(raw, low), fifth_bits(qh, 4 * c)), sixteen);
      w[c + 4] = _mm256_sub_epi8(
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), fifth_bits(qh, 16 + 4 * c)), sixteen);
    }
    for (int i = 0; i < 8; ++i) mag[i] = _mm256_sign_epi8(w[i], w[i]);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = a[r].q + b * QK;
      __m256i pairs = _mm256_maddubs_epi16(mag[0], _mm256_sign_epi8(broadcast4(q), w[0]));
      for (int i = 1; i < 8; ++i) {
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(mag[i], _mm256_sign_epi8(broadcast4(q + 4 * i), w[i])));
      }
      const __m256 sumi = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a[r].d[b])), sumi, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * stride, acc[r]);
}

template <int R>
struct Q4_0Half {
  OB_AVX2 static void run(const uint8_t* g, int h, const ActRow* a, int64_t nb, float* o, int64_t s) {
    q4_0_half<R>(g, h, a, nb, o, s);
  }
};
template <int R>
struct Q4_1Half {
  OB_AVX2 static void run(const uint8_t* g, int h, const ActRow* a, int64_t nb, float* o, int64_t s) {
    q4_1_half<R>(g, h, a, nb, o, s);
  }
};
template <int R>
struct Q8_0Half {
  OB_AVX2 static void run(const uint8_t* g, int h, const ActRow* a, int64_t nb, float* o, int64_t s) {
    q8_0_half<R>(g, h, a, nb, o, s);
  }
};

template <int R>
struct Q5_0Half {
  OB_AVX2 static void run(const uint8_t* g, int h, const ActRow* a, int64_t nb, float* o, int64_t s) {
    q5_0_half<R>(g, h, a, nb, o, s);
  }
};

}  // namespace x16_avx2

void dot_q5_0x16_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                      float* out, int64_t stride) {
  x16_avx2::groups<x16_avx2::Q5_0Half>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q4_0x16_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                      float* out, int64_t stride) {
  x16_avx2::groups<x16_avx2::Q4_0Half>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q4_1x16_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                      float* out, int64_t stride) {
  x16_avx2::groups<x16_avx2::Q4_1Half>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q8_0x16_avx2(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                      float* out, int64_t stride) {
  x16_avx2::groups<x16_avx2::Q8_0Half>(w, row_bytes, cols, a, rows, nb, out, stride);
}

}  // namespace oneblock
