// The portable path: the block algorithm with one float32 operation at a time, blocks in order. It equals the
// NumPy reference (reference.py) bit for bit; the vector paths equal it within float32 summation order.
#include <algorithm>
#include <cmath>

#include "dot.h"

namespace oneblock {

float g_half[1 << 16];

namespace {
struct HalfTable {
  HalfTable() {
    for (uint32_t h = 0; h < (1u << 16); ++h) g_half[h] = half_to_float(static_cast<uint16_t>(h));
  }
} const g_half_init;

// float -> IEEE half, round to nearest even (as numpy's and torch's casts), for finite inputs.
uint16_t float_to_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504: infinity
  if (abs < 0x38800000u) {                                                 // below 2^-14: a subnormal half
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);             // below 2^-25: rounds to zero
    const uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);  // 14..24
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((abs >> 13) - (112u << 10));  // rebias 127 -> 15, keep 10 mantissa bits
  const uint32_t rest = abs & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // a carry into the exponent is correct
  return static_cast<uint16_t>(sign | half);
}
}  // namespace

void quantize_row_q8_scalar(const float* x, int64_t k, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < k / QK; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < QK; ++j) {
      amax = std::fmax(amax, std::fabs(xb[j]));  // fmax drops a NaN: it is looked for separately
      finite = finite && std::isfinite(xb[j]);
    }
    if (!finite) {  // NaN or inf: zero codes and a NaN scale carry NaN into every output of this row, and no other
      std::memset(q + b * QK, 0, QK);
      d[b] = std::nanf("");
      if (s != nullptr) s[b] = std::nanf("");
      continue;
    }
    const float scale = amax / 127.0f;
    const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inv));  // ties to even (the default rounding mode)
      q[b * QK + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = g_half[float_to_half(scale)];
    if (s != nullptr) s[b] = g_half[float_to_half(scale * static_cast<float>(sum))];
  }
}

void quantize_row_q8_k_scalar(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums) {
  for (int64_t b = 0; b < k / QK_K; ++b) {
    const float* xb = x + b * QK_K;
    int8_t* qb = q + b * QK_K;
    float amax = 0.0f, max = 0.0f;
    bool finite = true;
    for (int j = 0; j < QK_K; ++j) {
      const float ax = std::fabs(xb[j]);
      finite = finite && std::isfinite(xb[j]);
      if (ax > amax) {  // the first value of largest magnitude, sign kept
        amax = ax;
        max = xb[j];
      }
    }
    std::memset(bsums + b * (QK_K / 16), 0, QK_K / 16 * sizeof(int16_t));
    if (!finite || amax == 0.0f) {  // NaN or inf: a NaN scale carries NaN into this row's outputs alone
      std::memset(qb, 0, QK_K);
      d[b] = finite ? 0.0f : std::nanf("");
      continue;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < QK_K; ++j) {
      const int v = static_cast<int>(std::nearbyint(iscale * xb[j]));  // ties to even, as ggml's nearest_int
      qb[j] = static_cast<int8_t>(std::min(127, v));
      bsums[b * (QK_K / 16) + j / 16] = static_cast<int16_t>(bsums[b * (QK_K / 16) + j / 16] + qb[j]);
    }
    d[b] = 1.0f / iscale;
  }
}

namespace {

float q8_0_one(const BlockQ8_0* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qa = a.q + b * QK;
    int sumi = 0;
    for (int j = 0; j < QK; ++j) sumi += blocks[b].qs[j] * qa[j];
    acc += static_cast<float>(sumi) * (g_half[load_u16(&blocks[b].d)] * a.d[b]);
  }
  return acc;
}

float q4_0_one(const BlockQ4_0* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qa = a.q + b * QK;
    int sumi = 0;
    for (int j = 0; j < QK / 2; ++j) {
      sumi += ((blocks[b].qs[j] & 0x0F) - 8) * qa[j] + ((blocks[b].qs[j] >> 4) - 8) * qa[j + QK / 2];
    }
    acc += static_cast<float>(sumi) * (g_half[load_u16(&blocks[b].d)] * a.d[b]);
  }
  return acc;
}

float q4_1_one(const BlockQ4_1* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qa = a.q + b * QK;
    int sumi = 0;
    for (int j = 0; j < QK / 2; ++j) {
      sumi += (blocks[b].qs[j] & 0x0F) * qa[j] + (blocks[b].qs[j] >> 4) * qa[j + QK / 2];
    }
    const float dw = g_half[load_u16(&blocks[b].d)];
    const float mw = g_half[load_u16(&blocks[b].m)];
    acc += static_cast<float>(sumi) * (dw * a.d[b]) + mw * a.s[b];
  }
  return acc;
}

float q5_0_one(const BlockQ5_0* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qa = a.q + b * QK;
    const uint32_t qh = load_u32(blocks[b].qh);
    int sumi = 0;
    for (int j = 0; j < QK; ++j) sumi += (q5_code(blocks[b].qs, qh, j) - 16) * qa[j];
    acc += static_cast<float>(sumi) * (g_half[load_u16(&blocks[b].d)] * a.d[b]);
  }
  return acc;
}

float q5_1_one(const BlockQ5_1* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qa = a.q + b * QK;
    const uint32_t qh = load_u32(blocks[b].qh);
    int sumi = 0;
    for (int j = 0; j < QK; ++j) sumi += q5_code(blocks[b].qs, qh, j) * qa[j];
    const float dw = g_half[load_u16(&blocks[b].d)];
    const float mw = g_half[load_u16(&blocks[b].m)];
    acc += static_cast<float>(sumi) * (dw * a.d[b]) + mw * a.s[b];
  }
  return acc;
}

// Per super-block the exact integer sum over the 16 sub-blocks of scale * (codes - 32) . activations, then one
// float multiply-add.
float q6_k_one(const BlockQ6_K* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ6_K& w = blocks[b];
    const int8_t* qa = a.q + b * QK_K;
    int isum = 0;  // at most 256 * 32 * 127 * 128 in magnitude: fits int32
    for (int j = 0; j < QK_K / 16; ++j) {
      int sub = 0;
      for (int t = 16 * j; t < 16 * j + 16; ++t) sub += (q6_k_code(w, t) - 32) * qa[t];
      isum += w.scales[j] * sub;
    }
    acc += static_cast<float>(isum) * (g_half[load_u16(&w.d)] * a.d[b]);
  }
  return acc;
}

// Per super-block the exact integer sums over the 8 sub-blocks of 32: sc * codes . activations, and m * the
// activations' sum (their two 16-code sums), then two float operations.
float q4_k_one(const BlockQ4_K* blocks, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ4_K& w = blocks[b];
    const int8_t* qa = a.q + b * QK_K;
    const int16_t* bs = a.bsums + b * (QK_K / 16);
    int isum = 0, msum = 0;  // at most 256 * 15 * 127 * 63 and 256 * 127 * 63: fit int32
    for (int s = 0; s < QK_K / 32; ++s) {
      int sc, m;
      q4_k_scale_min(w.scales, s, sc, m);
      int sub = 0;
      for (int t = 32 * s; t < 32 * s + 32; ++t) sub += q4_k_code(w, t) * qa[t];
      isum += sc * sub;
      msum += m * (bs[2 * s] + bs[2 * s + 1]);
    }
    acc += static_cast<float>(isum) * (g_half[load_u16(&w.d)] * a.d[b]);
    acc -= static_cast<float>(msum) * (g_half[load_u16(&w.dmin)] * a.d[b]);
  }
  return acc;
}

}  // namespace

void dot_q8_0_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                     float* out, int64_t stride) {
  each_row<BlockQ8_0, q8_0_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q4_0_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                     float* out, int64_t stride) {
  each_row<BlockQ4_0, q4_0_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q4_1_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                     float* out, int64_t stride) {
  each_row<BlockQ4_1, q4_1_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q6_k_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                     float* out, int64_t stride) {
  each_row<BlockQ6_K, q6_k_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q4_k_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                     float* out, int64_t stride) {
  each_row<BlockQ4_K, q4_k_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q5_0_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                     float* out, int64_t stride) {
  each_row<BlockQ5_0, q5_0_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q5_1_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                     float* out, int64_t stride) {
  each_row<BlockQ5_1, q5_1_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}

}  // namespace oneblock
