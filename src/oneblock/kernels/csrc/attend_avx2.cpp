// The query heads of one key/value head attending together (AVX2): the native step's attention when the CPU has
// AVX2 and FMA and the head width is a multiple of 8. Each block of 8 keys is read once for every head and its 8
// scores summed in one register; the exponentials are a vector polynomial; each head's weighted sum of values
// stays in registers over all the keys. It computes what `attend` (step_math.cpp) computes, in another order. A
// float16 cache is read as stored: each 8 keys widened once into a small block that every head reads, each value
// widened in registers as it is weighed. Those are the float32 values a copy widened first would hold, so the result
// is the same bit for bit, without writing and reading back a float32 copy of every key and value.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "exp_avx2.h"
#include "step_math.h"
#include "sum_avx2.h"

#define OB_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace oneblock {
namespace {

// Lane i: the sum of a[i]'s 8 lanes.
OB_AVX2 inline __m256 sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 8 keys' or values' features as float32: float ones as stored, float16 ones widened (exactly).
OB_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
OB_AVX2 inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

constexpr int64_t kWidest = 256;  // float16 keys of heads up to this wide are widened once for every head

// scores[h * stride + i] = scale q_h . k_i for the rep heads and the 8 keys at k (8, dh).
template <typename T>
OB_AVX2 inline void eight_scores(const float* q, int rep, const T* k, int64_t dh, __m256 by, float* scores,
                                 int64_t stride) {
  for (int h = 0; h < rep; ++h) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dh; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + h * dh + d);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(load8(k + i * dh + d), qd, acc[i]);
    }
    _mm256_storeu_ps(scores + h * stride, _mm256_mul_ps(sum8(acc), by));
  }
}

// scores[h * stride + j] = scale q_h . k_j for the rep heads and n keys (n, dh); float16 keys 8 at a time widened
// once into a block the heads read (within kWidest; else each head widens them in its registers).
template <typename T>
OB_AVX2 void scores_of(const float* q, int rep, const T* keys, int64_t n, int64_t dh, float scale, float* scores,
                       int64_t stride) {
  const __m256 by = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const T* k = keys + j * dh;
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (dh <= kWidest) {
        alignas(32) float block[8 * kWidest];
        for (int64_t i = 0; i < 8 * dh; i += 8) _mm256_store_ps(block + i, load8(k + i));
        eight_scores(q, rep, static_cast<const float*>(block), dh, by, scores + j, stride);
        continue;
      }
    }
    eight_scores(q, rep, k, dh, by, scores + j, stride);
  }
  for (; j < n; ++j) {
    for (int h = 0; h < rep; ++h) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < dh; d += 8) {
        acc = _mm256_fmadd_ps(load8(keys + j * dh + d), _mm256_loadu_ps(q + h * dh + d), acc);
      }
      scores[h * stride + j] = hsum(acc) * scale;
    }
  }
}

// s[j] = exp(s[j] - max s) in place; returns their sum.
OB_AVX2 float exponentials(float* s, int64_t n) {
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + j));
  float top = -INFINITY;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  for (float v : lanes) top = std::max(top, v);
  for (int64_t i = j; i < n; ++i) top = std::max(top, s[i]);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total8 = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
    _mm256_storeu_ps(s + j, e);
    total8 = _mm256_add_ps(total8, e);
  }
  float total = hsum(total8);
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - top);
    total += s[j];
  }
  return total;
}

// out[0 .. 8L) = inv * sum_j p[j] v_j[0 .. 8L) over the n values (n, dh) then the n2 at values2; L <= 8 registers.
template <int L, typename T>
OB_AVX2 void weigh(const float* p, const T* values, int64_t n, const T* values2, int64_t n2, int64_t dh, float inv,
                   float* out) {
  __m256 acc[L];
  for (int i = 0; i < L; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_broadcast_ss(p + j);
    for (int i = 0; i < L; ++i) acc[i] = _mm256_fmadd_ps(load8(values + j * dh + 8 * i), pj, acc[i]);
  }
  for (int64_t j = 0; j < n2; ++j) {
    const __m256 pj = _mm256_broadcast_ss(p + n + j);
    for (int i = 0; i < L; ++i) acc[i] = _mm256_fmadd_ps(load8(values2 + j * dh + 8 * i), pj, acc[i]);
  }
  for (int i = 0; i < L; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], _mm256_set1_ps(inv)));
}

template <typename T>
using WeighFn = void (*)(const float*, const T*, int64_t, const T*, int64_t, int64_t, float, float*);
template <typename T>
constexpr WeighFn<T> kWeigh[9] = {nullptr,     weigh<1, T>, weigh<2, T>, weigh<3, T>, weigh<4, T>,
                                  weigh<5, T>, weigh<6, T>, weigh<7, T>, weigh<8, T>};

// Each head's scaled scores (rep, n + n2), soft-capped where `cap` > 0, become its softmax numerators in place;
// inv (rep,) gets each head's 1 / their sum.
template <typename T>
OB_AVX2 void numerators(const float* q, int rep, const T* keys, int64_t n, const T* keys2, int64_t n2, int64_t d_head,
                        float scale, float cap, float* scores, float* inv) {
  const int64_t all = n + n2;
  scores_of(q, rep, keys, n, d_head, scale, scores, all);
  scores_of(q, rep, keys2, n2, d_head, scale, scores + n, all);
  for (int h = 0; h < rep; ++h) {
    float* s = scores + h * all;
    if (cap > 0.0f) softcap(s, all, cap);
    inv[h] = 1.0f / exponentials(s, all);
  }
}

// The heads' scores, their softmax and the weighted values; `wide`: the values weighed for several heads at once
// with AVX-512 (d_head a multiple of 16), the same result bit for bit.
template <typename T>
OB_AVX2 void attend_heads(const float* q, int rep, const T* keys, const T* values, int64_t n, const T* keys2,
                          const T* values2, int64_t n2, int64_t d_head, float scale, float cap, float* scores,
                          float* out, bool wide) {
  const int64_t all = n + n2;
  float* inv = scores + rep * all;
  numerators(q, rep, keys, n, keys2, n2, d_head, scale, cap, scores, inv);
  if (wide) {
    weigh_heads_avx512(scores, rep, all, values, n, values2, n2, d_head, inv, out);
    return;
  }
  for (int h = 0; h < rep; ++h) {
    for (int64_t c = 0; c < d_head; c += 64) {  // 64 features (8 registers) at a time
      const int64_t lanes = std::min<int64_t>(64, d_head - c) / 8;
      kWeigh<T>[lanes](scores + h * all, values + c, n, values2 + c, n2, d_head, inv[h], out + h * d_head + c);
    }
  }
}

}  // namespace

OB_AVX2 void attend_heads_avx2(const float* q, int rep, const float* keys, const float* values, int64_t n,
                               const float* keys2, const float* values2, int64_t n2, int64_t d_head, float scale,
                               float cap, float* scores, float* out) {
  attend_heads(q, rep, keys, values, n, keys2, values2, n2, d_head, scale, cap, scores, out, false);
}

OB_AVX2 void attend_heads_avx512(const float* q, int rep, const float* keys, const float* values, int64_t n,
                                 const float* keys2, const float* values2, int64_t n2, int64_t d_head, float scale,
                                 float cap, float* scores, float* out) {
  attend_heads(q, rep, keys, values, n, keys2, values2, n2, d_head, scale, cap, scores, out, d_head % 16 == 0);
}

OB_AVX2 void attend_heads_half_avx2(const float* q, int rep, const uint16_t* keys, const uint16_t* values, int64_t n,
                                    const uint16_t* keys2, const uint16_t* values2, int64_t n2, int64_t d_head,
                                    float scale, float cap, float* scores, float* out) {
  attend_heads(q, rep, keys, values, n, keys2, values2, n2, d_head, scale, cap, scores, out, false);
}

OB_AVX2 void attend_heads_half_avx512(const float* q, int rep, const uint16_t* keys, const uint16_t* values,
                                      int64_t n, const uint16_t* keys2, const uint16_t* values2, int64_t n2,
                                      int64_t d_head, float scale, float cap, float* scores, float* out) {
  attend_heads(q, rep, keys, values, n, keys2, values2, n2, d_head, scale, cap, scores, out, d_head % 16 == 0);
}

}  // namespace oneblock
