// The weighted sums of values of the query heads of one key/value head, all heads at once (AVX-512F): each value
// row is read once for every head instead of once per head. For every output feature the products are added in the
// order of the keys, one fused multiply-add each, then scaled by the head's 1 / sum: what attend_avx2.cpp's `weigh`
// computes, bit for bit, in registers twice as wide; float16 values widened in a register as they are read.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "step_math.h"

#define OB_AVX512 __attribute__((target("avx512f,avx2,fma")))

namespace oneblock {
namespace {

// 16 values' features as float32: float ones as stored, float16 ones widened (exactly).
OB_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
OB_AVX512 inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// out[h][0 .. 16L) = inv[h] * sum_j p[h * stride + j] v_j[0 .. 16L) for H heads, over the n values then the n2 more.
template <int H, int L, typename T>
OB_AVX512 void weigh(const float* p, int64_t stride, const T* values, int64_t n, const T* values2, int64_t n2,
                     int64_t dh, const float* inv, float* out) {
  __m512 acc[H][L];
  for (int h = 0; h < H; ++h) {
    for (int i = 0; i < L; ++i) acc[h][i] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < n + n2; ++j) {
    const T* v = j < n ? values + j * dh : values2 + (j - n) * dh;
    __m512 row[L];
    for (int i = 0; i < L; ++i) row[i] = load16(v + 16 * i);
    for (int h = 0; h < H; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h * stride + j]);
      for (int i = 0; i < L; ++i) acc[h][i] = _mm512_fmadd_ps(row[i], ph, acc[h][i]);
    }
  }
  for (int h = 0; h < H; ++h) {
    for (int i = 0; i < L; ++i) _mm512_storeu_ps(out + h * dh + 16 * i, _mm512_mul_ps(acc[h][i], _mm512_set1_ps(inv[h])));
  }
}

template <typename T>
using WeighFn = void (*)(const float*, int64_t, const T*, int64_t, const T*, int64_t, int64_t, const float*, float*);
// [heads - 1][registers - 1]: up to 4 heads of up to 64 features (16 accumulators) at a time.
template <typename T>
constexpr WeighFn<T> kWeigh[4][4] = {
    {weigh<1, 1, T>, weigh<1, 2, T>, weigh<1, 3, T>, weigh<1, 4, T>},
    {weigh<2, 1, T>, weigh<2, 2, T>, weigh<2, 3, T>, weigh<2, 4, T>},
    {weigh<3, 1, T>, weigh<3, 2, T>, weigh<3, 3, T>, weigh<3, 4, T>},
    {weigh<4, 1, T>, weigh<4, 2, T>, weigh<4, 3, T>, weigh<4, 4, T>},
};

template <typename T>
void weigh_heads(const float* p, int rep, int64_t stride, const T* values, int64_t n, const T* values2, int64_t n2,
                 int64_t d_head, const float* inv, float* out) {
  for (int h0 = 0; h0 < rep; h0 += 4) {
    const int heads = std::min(4, rep - h0);
    for (int64_t c = 0; c < d_head; c += 64) {  // 64 features of each head at a time
      const int64_t lanes = std::min<int64_t>(64, d_head - c) / 16;
      kWeigh<T>[heads - 1][lanes - 1](p + h0 * stride, stride, values + c, n, values2 + c, n2, d_head, inv + h0,
                                      out + h0 * d_head + c);
    }
  }
}

}  // namespace

void weigh_heads_avx512(const float* p, int rep, int64_t stride, const float* values, int64_t n,
                        const float* values2, int64_t n2, int64_t d_head, const float* inv, float* out) {
  weigh_heads(p, rep, stride, values, n, values2, n2, d_head, inv, out);
}

void weigh_heads_avx512(const float* p, int rep, int64_t stride, const uint16_t* values, int64_t n,
                        const uint16_t* values2, int64_t n2, int64_t d_head, const float* inv, float* out) {
  weigh_heads(p, rep, stride, values, n, values2, n2, d_head, inv, out);
}

}  // namespace oneblock
