// The portable kernels of Q5_K, IQ4_XS (super-blocks of 256, with Q8_K activations) and IQ4_NL (blocks of 32, with
// Q8_0 activations), in the manner of dot_scalar.cpp: per block the exact integer sum, then one float operation (two
// for Q5_K's minimums), blocks in order. They equal the NumPy reference (reference.py) bit for bit.
#include "dot.h"

namespace oneblock {
namespace {

// As Q4_K: the exact integer sums over the 8 sub-blocks of 32 of sc * codes . activations and of m * the
// activations' sum (their two 16-code sums), then two float operations.
float q5_k_one(const BlockQ5_K* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ5_K& w = blocks[b];
    const int8_t* qa = a.q + b * QK_K;
    const int16_t* bs = a.bsums + b * (QK_K / 16);
    int isum = 0, msum = 0;  // at most 256 * 31 * 127 * 63 and 256 * 127 * 63: fit int32
    for (int s = 0; s < QK_K / 32; ++s) {
      int sc, m;
      q4_k_scale_min(w.scales, s, sc, m);
      int sub = 0;
      for (int t = 32 * s; t < 32 * s + 32; ++t) sub += q5_k_code(w, t) * qa[t];
      isum += sc * sub;
      msum += m * (bs[2 * s] + bs[2 * s + 1]);
    }
    acc += static_cast<float>(isum) * (g_half[load_u16(&w.d)] * a.d[b]);
    acc -= static_cast<float>(msum) * (g_half[load_u16(&w.dmin)] * a.d[b]);
  }
  return acc;
}

// Per super-block the exact integer sum over the 8 sub-blocks of (ls - 32) * values . activations, then one float
// multiply-add.
float iq4_xs_one(const BlockIQ4_XS* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const BlockIQ4_XS& w = blocks[b];
    const int8_t* qa = a.q + b * QK_K;
    int isum = 0;  // at most 256 * 127 * 127 * 32 in magnitude: fits int32
    for (int s = 0; s < QK_K / 32; ++s) {
      int sub = 0;
      for (int t = 32 * s; t < 32 * s + 32; ++t) sub += iq4_xs_value(w, t) * qa[t];
      isum += iq4_xs_scale(w, s) * sub;
    }
    acc += static_cast<float>(isum) * (g_half[load_u16(&w.d)] * a.d[b]);
  }
  return acc;
}

float iq4_nl_one(const BlockIQ4_NL* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qa = a.q + b * QK;
    int sumi = 0;
    for (int j = 0; j < QK; ++j) sumi += iq4_nl_value(blocks[b], j) * qa[j];
    acc += static_cast<float>(sumi) * (g_half[load_u16(&blocks[b].d)] * a.d[b]);
  }
  return acc;
}

}  // namespace

void dot_q5_k_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                     float* out, int64_t stride) {
  each_row<BlockQ5_K, q5_k_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_iq4_xs_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                       float* out, int64_t stride) {
  each_row<BlockIQ4_XS, iq4_xs_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_iq4_nl_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                       float* out, int64_t stride) {
  each_row<BlockIQ4_NL, iq4_nl_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}

}  // namespace oneblock
