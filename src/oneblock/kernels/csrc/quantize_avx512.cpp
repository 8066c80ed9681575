// The activation quantizers (dot.h's quantize_row_q8 and quantize_row_q8_k) in AVX-512: the scalar ones' results
// exactly. The same float operations on each value (a multiply by the same inverse scale, rounded to nearest even
// by `vcvtps2dq` under the default rounding mode, as `nearbyint` rounds), the same first value of largest
// magnitude, the same float16 rounding of the Q8 scales (`vcvtps2ph`, nearest even, as float_to_half).
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "dot.h"

#define OB_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

namespace oneblock {
namespace {

// Whether any of the n floats at x is NaN or infinite.
OB_TARGET inline bool any_not_finite(const __m512* v, int n) {
  __mmask16 bad = 0;
  for (int i = 0; i < n; ++i) bad |= _mm512_fpclass_ps_mask(v[i], 0x01 | 0x08 | 0x10 | 0x80);  // NaN, +-inf
  return bad != 0;
}

OB_TARGET inline float half_round(float f) {
  return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

}  // namespace

OB_TARGET void quantize_row_q8_avx512(const float* x, int64_t k, int8_t* q, float* d, float* s) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < k / QK; ++b) {
    const __m512 v[2] = {_mm512_loadu_ps(x + b * QK), _mm512_loadu_ps(x + b * QK + 16)};
    if (any_not_finite(v, 2)) {
      std::memset(q + b * QK, 0, QK);
      d[b] = std::nanf("");
      if (s != nullptr) s[b] = std::nanf("");
      continue;
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v[0]), _mm512_andnot_ps(sign, v[1])));
    const float scale = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
    const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[0], inv)), c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[1], inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK), _mm512_cvtepi32_epi8(c0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK + 16), _mm512_cvtepi32_epi8(c1));
    d[b] = half_round(scale);
    if (s != nullptr) {
      const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
      s[b] = half_round(scale * static_cast<float>(sum));
    }
  }
}

OB_TARGET void quantize_row_q8_k_avx512(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums) {
  constexpr int kVectors = QK_K / 16;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < k / QK_K; ++b) {
    const float* xb = x + b * QK_K;
    __m512 v[kVectors];
    __m512 top = _mm512_setzero_ps();
    for (int i = 0; i < kVectors; ++i) {
      v[i] = _mm512_loadu_ps(xb + 16 * i);
      top = _mm512_max_ps(top, _mm512_andnot_ps(sign, v[i]));
    }
    int16_t* sums = bsums + b * kVectors;
    const bool finite = !any_not_finite(v, kVectors);
    const float amax = _mm512_reduce_max_ps(top);
    if (!finite || amax == 0.0f) {
      std::memset(q + b * QK_K, 0, QK_K);
      std::memset(sums, 0, kVectors * sizeof(int16_t));
      d[b] = finite ? 0.0f : std::nanf("");
      continue;
    }
    float max = 0.0f;  // the first value of largest magnitude, sign kept
    for (int i = 0; i < kVectors; ++i) {
      const __mmask16 at = _mm512_cmp_ps_mask(_mm512_andnot_ps(sign, v[i]), _mm512_set1_ps(amax), _CMP_EQ_OQ);
      if (at != 0) {
        max = xb[16 * i + __builtin_ctz(at)];
        break;
      }
    }
    const float iscale = -127.0f / max;
    const __m512 scale = _mm512_set1_ps(iscale);
    for (int i = 0; i < kVectors; ++i) {
      const __m512i c = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], scale)), _mm512_set1_epi32(127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK_K + 16 * i), _mm512_cvtepi32_epi8(c));
      sums[i] = static_cast<int16_t>(_mm512_reduce_add_epi32(c));
    }
    d[b] = 1.0f / iscale;
  }
}

}  // namespace oneblock
