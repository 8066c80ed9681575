// The portable path over the interleaved layouts (interleaved.h): per output, the blocks in order and the same
// float32 operations as dot_scalar.cpp, so it equals the NumPy reference bit for bit, as the file layout's does.
#include <vector>

#include "dot.h"
#include "interleaved.h"

namespace oneblock {
namespace {

// Code j (0..31) of row `lane` in one interleaved block, as an integer.
inline int q4_1_code(const uint8_t* blk, int lane, int j) {
  const int byte = j & 15;  // the file's byte j % 16: low nibble value j, high nibble value j + 16
  const uint8_t v = blk[Interleaved<kQ4_1>::kCodes + (byte / 4) * kChunkBytes + lane * 4 + byte % 4];
  return j < 16 ? (v & 0x0F) : (v >> 4);
}

// Q4_0's code j of row `lane`, less 8: in [-8, 7], as dot_scalar.cpp takes it.
inline int q4_0_code(const uint8_t* blk, int lane, int j) {
  const int byte = j & 15;
  const uint8_t v = blk[Interleaved<kQ4_0>::kCodes + (byte / 4) * kChunkBytes + lane * 4 + byte % 4];
  return (j < 16 ? (v & 0x0F) : (v >> 4)) - 8;
}

inline int q8_0_code(const uint8_t* blk, int lane, int j) {
  return static_cast<int8_t>(blk[Interleaved<kQ8_0>::kCodes + (j / 4) * kChunkBytes + lane * 4 + j % 4]);
}

float q4_1_one(const uint8_t* group, int lane, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * Interleaved<kQ4_1>::kBytes;
    const int8_t* qa = a.q + b * QK;
    int sumi = 0;
    for (int j = 0; j < QK; ++j) sumi += q4_1_code(blk, lane, j) * qa[j];
    const float dw = g_half[load_u16(blk + Interleaved<kQ4_1>::kScales + 2 * lane)];
    const float mw = g_half[load_u16(blk + Interleaved<kQ4_1>::kMins + 2 * lane)];
    acc += static_cast<float>(sumi) * (dw * a.d[b]) + mw * a.s[b];
  }
  return acc;
}

float q4_0_one(const uint8_t* group, int lane, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * Interleaved<kQ4_0>::kBytes;
    const int8_t* qa = a.q + b * QK;
    int sumi = 0;
    for (int j = 0; j < QK; ++j) sumi += q4_0_code(blk, lane, j) * qa[j];
    acc += static_cast<float>(sumi) * (g_half[load_u16(blk + Interleaved<kQ4_0>::kScales + 2 * lane)] * a.d[b]);
  }
  return acc;
}

float q8_0_one(const uint8_t* group, int lane, const ActRow& a, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * Interleaved<kQ8_0>::kBytes;
    const int8_t* qa = a.q + b * QK;
    int sumi = 0;
    for (int j = 0; j < QK; ++j) sumi += q8_0_code(blk, lane, j) * qa[j];
    acc += static_cast<float>(sumi) * (g_half[load_u16(blk + Interleaved<kQ8_0>::kScales + 2 * lane)] * a.d[b]);
  }
  return acc;
}

template <float (*One)(const uint8_t*, int, const ActRow&, int64_t)>
void each(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb, float* out,
          int64_t stride) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const uint8_t* group = w + (c / kGroupRows) * kGroupRows * row_bytes;
      out[r * stride + c] = One(group, c % kGroupRows, a[r], nb);
    }
  }
}

}  // namespace

// Q5_0's and the K-quants' layouts: each row's blocks put back in the file's layout, then the file layout's scalar kernel.
template <int64_t Fmt, DotFn File>
void each_gathered(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb, float* out,
                   int64_t stride) {
  std::vector<uint8_t> row(static_cast<size_t>(row_bytes));
  const int64_t nbytes = block_bytes(Fmt);
  for (int c = 0; c < cols; ++c) {
    const uint8_t* group = w + (c / kGroupRows) * kGroupRows * row_bytes;
    for (int64_t b = 0; b < nb; ++b) gather_block(group, c % kGroupRows, Fmt, b, row.data() + b * nbytes);
    for (int r = 0; r < rows; ++r) File(row.data(), row_bytes, 1, a + r, 1, nb, out + r * stride + c, stride);
  }
}

void dot_q4_kx16_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                        float* out, int64_t stride) {
  each_gathered<kQ4_K, dot_q4_k_scalar>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q5_0x16_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                        float* out, int64_t stride) {
  each_gathered<kQ5_0, dot_q5_0_scalar>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q5_kx16_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                        float* out, int64_t stride) {
  each_gathered<kQ5_K, dot_q5_k_scalar>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_iq4_xsx16_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                          float* out, int64_t stride) {
  each_gathered<kIQ4_XS, dot_iq4_xs_scalar>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q6_kx16_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                        float* out, int64_t stride) {
  each_gathered<kQ6_K, dot_q6_k_scalar>(w, row_bytes, cols, a, rows, nb, out, stride);
}

void dot_q4_0x16_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                        float* out, int64_t stride) {
  each<q4_0_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q4_1x16_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                        float* out, int64_t stride) {
  each<q4_1_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}
void dot_q8_0x16_scalar(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows, int64_t nb,
                        float* out, int64_t stride) {
  each<q8_0_one>(w, row_bytes, cols, a, rows, nb, out, stride);
}

}  // namespace oneblock
