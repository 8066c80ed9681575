// A vector exponential for the AVX2 files (compiled by target attribute, called only where the CPU reports AVX2 and
// FMA): the attention's softmax and the feed-forward's SiLU.
#pragma once

#include <immintrin.h>

namespace oneblock {

// exp(x) for x <= 0 (Cephes' expf: a degree-5 polynomial on the reduced argument, within 2 ulp); 0 below -87.3.
__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 x) {
  const __m256 least = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, least, _CMP_LT_OQ);
  x = _mm256_max_ps(x, least);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n ln 2, ln 2 in two parts
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(two_n)));
}

}  // namespace oneblock
