// The per-format, per-instruction-set dot kernels and the activation quantizer they share.
//
// A kernel computes the dots of `cols` weight rows (at w + c * row_bytes) with `rows` activation rows: either
// one activation row and up to 4 weight rows (decoding), or up to 4 activation rows and one weight row:
//   out[r * stride + c] = sum over blocks b of  dw_{c,b} * da_{r,b} * sumi_{r,c,b}  (+ mw_{c,b} * sa_{r,b})
// where sumi is the exact integer dot of the block's codes. Each output is computed by the same instructions
// whatever `rows` and `cols` are and whichever rows share the call, so a row never depends on the others.
#pragma once

#include <cstdint>

#include "blocks.h"
#include "interleaved.h"

namespace oneblock {

using DotFn = void (*)(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                      float* out, int64_t stride);

// Calls T<R, C>::run for the shapes above; the vector kernels instantiate T for (1..4, 1) and (1, 1..4).
template <template <int, int> class T>
void tile_dispatch(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                   float* out, int64_t stride) {
  if (rows == 1) {
    switch (cols) {
      case 1: return T<1, 1>::run(w, row_bytes, a, nb, out, stride);
      case 2: return T<1, 2>::run(w, row_bytes, a, nb, out, stride);
      case 3: return T<1, 3>::run(w, row_bytes, a, nb, out, stride);
      default: return T<1, 4>::run(w, row_bytes, a, nb, out, stride);
    }
  }
  switch (rows) {
    case 2: return T<2, 1>::run(w, row_bytes, a, nb, out, stride);
    case 3: return T<3, 1>::run(w, row_bytes, a, nb, out, stride);
    default: return T<4, 1>::run(w, row_bytes, a, nb, out, stride);
  }
}

// A kernel that computes one weight row against one activation row (`One`), called for every (row, column) pair
// of the shapes above: the K-quants' kernels, whose super-blocks are multiplied one row at a time.
template <typename Block, float (*One)(const Block*, const ActRow&, int64_t)>
void each_row(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb, float* out,
              int64_t stride) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) out[r * stride + c] = One(reinterpret_cast<const Block*>(w + c * row_bytes), a[r], nb);
  }
}

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kIsaCount = 4 };

// Float value of every half, indexed by its bits (256 KB): one load per scale in every path.
extern float g_half[1 << 16];

// The kernel of block format `fmt` for the instruction set in use (dispatch.cpp; set_isa switches it).
DotFn dot_kernel(int64_t fmt);

// The instruction set in use (an Isa), chosen at load or by set_isa (dispatch.cpp).
int current_isa();

// Quantizes one (K,) float32 row into `q` (K,) codes, `d` (K/32,) scales and, if `s` is not null, the Q8_1 sums.
void quantize_row_q8(const float* x, int64_t k, int8_t* q, float* d, float* s);

// Quantizes one (K,) float32 row (K a multiple of 256) into Q8_K blocks: `q` (K,) codes, `d` (K/256,) float32
// scales, `bsums` (K/16,) sums of each 16 codes. A super-block holding NaN or inf gets codes 0 and d = NaN.
void quantize_row_q8_k(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums);

// The quantizers per instruction set (the same results; quantize_avx512.cpp), which the two above pick from.
void quantize_row_q8_scalar(const float* x, int64_t k, int8_t* q, float* d, float* s);
void quantize_row_q8_avx512(const float* x, int64_t k, int8_t* q, float* d, float* s);
void quantize_row_q8_k_scalar(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums);
void quantize_row_q8_k_avx512(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums);

// The float32 values of one weight row of `nb` blocks of a file format into out (nb * block_values(fmt),).
void decode_row(const uint8_t* row, int64_t fmt, int64_t nb, float* out);

// F16 (bf16 false) or BF16 values of one row, n of them, widened exactly into out (float_rows.cpp).
void widen_row(const uint8_t* row, bool bf16, int64_t n, float* out);

// y[r * ldy + c] = the float32 sum over j < k of weight row c's value j (widened) times x[r * ldx + j], for the
// `cols` F16 or BF16 weight rows at w (row_bytes apart) and the `rows` float activation rows at x (float_rows.cpp).
void float_dot(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, int64_t ldx, int64_t rows,
               int64_t k, float* y, int64_t ldy, bool bf16);

// The kernel that block_mm runs for format id `fmt` (a GGUF id, or an interleaved one) on the instruction set
// chosen at load (or by set_isa); nullptr for an unknown id. For callers that drive the kernels themselves.
DotFn dot_kernel(int64_t fmt);

void dot_q4_0_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_1_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q8_0_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_0_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_1_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q8_0_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_0_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_1_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q8_0_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_0_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_1_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q8_0_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_0_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_1_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_0_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_1_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_0_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_1_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_0_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_1_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q6_k_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_k_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q6_k_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_k_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_k_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_k_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_iq4_xs_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_iq4_xs_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_iq4_nl_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_iq4_nl_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_0x16_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_0x16_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_0x16_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_0x16_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_kx16_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_kx16_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_kx16_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q5_kx16_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_iq4_xsx16_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_iq4_xsx16_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_iq4_xsx16_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_iq4_xsx16_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q6_kx16_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q6_kx16_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q6_kx16_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q6_kx16_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_kx16_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_kx16_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_kx16_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_kx16_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_0x16_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_1x16_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q8_0x16_scalar(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_0x16_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_1x16_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q8_0x16_avx2(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_0x16_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_1x16_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q8_0x16_avx512(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_0x16_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q4_1x16_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);
void dot_q8_0x16_avx512_vnni(const uint8_t*, int64_t, int, const ActRow*, int, int64_t, float*, int64_t);

}  // namespace oneblock
