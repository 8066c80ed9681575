// The horizontal sum of 8 float lanes, for the AVX2 files (compiled by target attribute, called only where the CPU
// reports AVX2 and FMA).
#pragma once

#include <immintrin.h>

namespace oneblock {

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace oneblock
