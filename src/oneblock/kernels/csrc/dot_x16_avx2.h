// The AVX2 kernels' shared pieces over the interleaved layouts (interleaved.h), for dot_x16_avx2.cpp (the 32-value
// formats) and dot_kx16_avx2.cpp (the 256-value ones). A 64-byte chunk is two 256-bit registers (rows 0-7, rows
// 8-15), each 8 int32 lanes of one row's 4 codes; 4 activation codes are broadcast to every lane.
#pragma once

#include <immintrin.h>

#include <cstring>

#include "dot.h"
#include "interleaved.h"

#define OB_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace oneblock {
namespace x16_avx2 {

OB_AVX2 inline __m256i broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, sizeof v);
  return _mm256_set1_epi32(v);
}

OB_AVX2 inline __m256 scales8(const uint8_t* halves) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
}

// Rows 8h..8h+7 of a 64-byte chunk.
OB_AVX2 inline __m256i load_half(const uint8_t* chunk, int h) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * h));
}

template <template <int> class Half>
OB_AVX2 void groups(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb, float* out,
                    int64_t stride) {
  for (int c = 0; c < cols; c += kGroupRows) {
    const uint8_t* group = w + c * row_bytes;
    for (int h = 0; h < 2; ++h) {
      for (int r = 0; r < rows; r += 4) {
        float* o = out + r * stride + c + 8 * h;
        switch (rows - r) {
          case 1: Half<1>::run(group, h, a + r, nb, o, stride); break;
          case 2: Half<2>::run(group, h, a + r, nb, o, stride); break;
          case 3: Half<3>::run(group, h, a + r, nb, o, stride); break;
          default: Half<4>::run(group, h, a + r, nb, o, stride); break;
        }
      }
    }
  }
}

}  // namespace x16_avx2
}  // namespace oneblock
