// The per-format, per-instruction-set dot kernels and the activation quantizer they share.
//
// A kernel computes the dots of ONE weight row with `rows` (<= 4) activation rows:
//   out[r * stride] = sum over blocks b of  dw_b * da_{r,b} * sumi_{r,b}  (+ mw_b * sa_{r,b} for Q4_1)
// where sumi is the exact integer dot of the block's codes. Each activation row's result is computed by the
// same instructions whatever `rows` is and whichever rows share the call, so a row never depends on the others.
#pragma once

#include <cstdint>

#include "blocks.h"

namespace oneblock {

using DotFn = void (*)(const uint8_t* w, const ActRow* a, int rows, int64_t nb, float* out, int64_t stride);

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kIsaCount = 4 };

// Float value of every half, indexed by its bits (256 KB): one load per scale in every path.
extern float g_half[1 << 16];

// Quantizes one (K,) float32 row into `q` (K,) codes, `d` (K/32,) scales and, if `s` is not null, the Q8_1 sums.
void quantize_row_q8(const float* x, int64_t k, int8_t* q, float* d, float* s);

// The float32 values of one weight row of `nb` blocks, d * q (+ m), into out (nb * 32,).
void decode_row(const uint8_t* row, int64_t fmt, int64_t nb, float* out);

void dot_q4_0_scalar(const uint8_t*, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_1_scalar(const uint8_t*, const ActRow*, int, int64_t, float*, int64_t);
void dot_q8_0_scalar(const uint8_t*, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_0_avx2(const uint8_t*, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_1_avx2(const uint8_t*, const ActRow*, int, int64_t, float*, int64_t);
void dot_q8_0_avx2(const uint8_t*, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_0_avx512(const uint8_t*, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_1_avx512(const uint8_t*, const ActRow*, int, int64_t, float*, int64_t);
void dot_q8_0_avx512(const uint8_t*, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_0_avx512_vnni(const uint8_t*, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_1_avx512_vnni(const uint8_t*, const ActRow*, int, int64_t, float*, int64_t);
void dot_q8_0_avx512_vnni(const uint8_t*, const ActRow*, int, int64_t, float*, int64_t);

}  // namespace oneblock
