// GGUF block layouts, byte for byte, and the 8-bit activation blocks the products use.
//
// Every format cuts a weight row into blocks of 32 values. Float16 numbers are little-endian IEEE half.
//
//   Q4_0: d (f16), 16 bytes of 4-bit codes            = 18 bytes per 32 weights; w = d * (q - 8)
//   Q4_1: d (f16), m (f16), 16 bytes of 4-bit codes   = 20 bytes per 32 weights; w = d * q + m
//   Q8_0: d (f16), 32 x int8                          = 34 bytes per 32 weights; w = d * q
//   Q5_0: d (f16), qh (4 bytes), 16 bytes of nibbles  = 22 bytes per 32 weights; w = d * (q - 16)
//   Q5_1: d (f16), m (f16), qh, 16 bytes of nibbles   = 24 bytes per 32 weights; w = d * q + m
//
// The K-quants cut a row into super-blocks of 256 values, with integer sub-block scales:
//
//   Q6_K: ql (128 bytes: low 4 bits), qh (64 bytes: high 2 bits), 16 int8 scales, d (f16) = 210 bytes per 256
//         weights; w = d * scales[j / 16] * (q - 32) for weight j. Of each 128 weights (ql and qh advancing by 64
//         and 32 bytes), weight i takes nibble i / 64 of ql[i % 64] and bits 2 * (i / 32) of qh[i % 32].
//   Q4_K: d (f16), dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles = 144 bytes per 256 weights;
//         w = d * sc[s] * q - dmin * m[s] for weight j of sub-block s = j / 32. Sub-blocks 2c and 2c + 1 take the
//         low and the high nibbles of qs[32c .. 32c + 31]; sc and m are unpacked by q4_k_scale_min.
//   Q5_K: d, dmin (f16), 12 bytes of scales and mins (as Q4_K), qh (32 bytes), 128 bytes of nibbles = 176 bytes per
//         256 weights; w = d * sc[s] * q - dmin * m[s]. The nibbles as Q4_K's; bit s of qh[j % 32] is bit 4 of weight
//         j of sub-block s.
//   IQ4_XS: d (f16), scales_h (uint16), scales_l (4 bytes), 128 bytes of nibbles = 136 bytes per 256 weights;
//         w = d * (ls[s] - 32) * kIq4nlValues[q], ls[s] the low nibble s % 2 of scales_l[s / 2] and bits 2s, 2s + 1
//         of scales_h as its top two. Sub-block s holds its 32 indices in qs[16s .. 16s + 15] as the 32-value
//         formats hold theirs.
//
// IQ4_NL: d (f16), 16 bytes of 4-bit indices = 18 bytes per 32 weights; w = d * kIq4nlValues[q] (a block of 32,
// multiplied with Q8_0 activations).
//
// F16 and BF16 matrices hold one float per weight (IEEE half; the top 16 bits of a float32), multiplied in float32
// against float activations: no activation blocks.
//
// In the 4- and 5-bit formats byte j holds the low 4 bits of weight j in its low nibble and those of weight j + 16
// in its high nibble; the 5-bit formats' qh, read as a little-endian uint32, holds bit 4 of weight j in bit j.
#pragma once

#include <cstdint>
#include <cstring>

namespace oneblock {

constexpr int QK = 32;
constexpr int QK_K = 256;  // values per K-quant super-block

struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[QK / 2];
};
struct BlockQ4_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qs[QK / 2];
};
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[QK];
};
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[QK / 2];
};
struct BlockQ5_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qh[4];
  uint8_t qs[QK / 2];
};
struct BlockQ6_K {
  uint8_t ql[QK_K / 2];
  uint8_t qh[QK_K / 4];
  int8_t scales[QK_K / 16];
  uint16_t d;
};
struct BlockQ4_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qs[QK_K / 2];
};
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[QK_K / 8];
  uint8_t qs[QK_K / 2];
};
struct BlockIQ4_NL {
  uint16_t d;
  uint8_t qs[QK / 2];
};
struct BlockIQ4_XS {
  uint16_t d;
  uint16_t scales_h;
  uint8_t scales_l[QK_K / 64];
  uint8_t qs[QK_K / 2];
};
static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 is 18 bytes per block");
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 is 20 bytes per block");
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 is 34 bytes per block");
static_assert(sizeof(BlockQ5_0) == 22, "Q5_0 is 22 bytes per block");
static_assert(sizeof(BlockQ5_1) == 24, "Q5_1 is 24 bytes per block");
static_assert(sizeof(BlockQ6_K) == 210, "Q6_K is 210 bytes per 256 weights");
static_assert(sizeof(BlockQ4_K) == 144, "Q4_K is 144 bytes per 256 weights");
static_assert(sizeof(BlockQ5_K) == 176, "Q5_K is 176 bytes per 256 weights");
static_assert(sizeof(BlockIQ4_NL) == 18, "IQ4_NL is 18 bytes per block");
static_assert(sizeof(BlockIQ4_XS) == 136, "IQ4_XS is 136 bytes per 256 weights");

// The non-linear values of IQ4_NL's and IQ4_XS's 4-bit indices (ggml's kvalues_iq4nl).
inline constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// The GGUF type ids, which are also the `fmt` argument of the ops.
enum Format : int64_t {
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kIQ4_NL = 20,
  kIQ4_XS = 23,
  kBF16 = 30
};

inline int64_t block_bytes(int64_t fmt) {
  switch (fmt) {
    case kQ4_0: return sizeof(BlockQ4_0);
    case kQ4_1: return sizeof(BlockQ4_1);
    case kQ5_0: return sizeof(BlockQ5_0);
    case kQ5_1: return sizeof(BlockQ5_1);
    case kQ8_0: return sizeof(BlockQ8_0);
    case kQ4_K: return sizeof(BlockQ4_K);
    case kQ6_K: return sizeof(BlockQ6_K);
    case kQ5_K: return sizeof(BlockQ5_K);
    case kIQ4_NL: return sizeof(BlockIQ4_NL);
    case kIQ4_XS: return sizeof(BlockIQ4_XS);
    case kF16:
    case kBF16: return 2;
    default: return 0;
  }
}

// Whether a file format is a K-quant: 256-value super-blocks, multiplied with Q8_K activation blocks.
inline bool is_k_quant(int64_t fmt) { return fmt == kQ4_K || fmt == kQ5_K || fmt == kQ6_K || fmt == kIQ4_XS; }

// Whether a file format stores plain float values (F16, BF16: a "block" of one value, two bytes): its products
// take the float activations as they are, widening each weight exactly to float32 (half_dot.cpp).
inline bool is_float_format(int64_t fmt) { return fmt == kF16 || fmt == kBF16; }

// Weights per block of a file format.
inline int64_t block_values(int64_t fmt) { return is_float_format(fmt) ? 1 : is_k_quant(fmt) ? QK_K : QK; }

// Whether a file format stores a minimum m per block (w = d * q + m): its products need the activations' sums.
inline bool has_min(int64_t fmt) { return fmt == kQ4_1 || fmt == kQ5_1; }

// IEEE half -> float, exact (every half is a float). Bit manipulation, so the scalar path needs no F16C.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);  // inf / NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // normal: rebias 15 -> 127
  } else if (mantissa == 0) {
    bits = sign;  // signed zero
  } else {  // subnormal half: normalize into a float
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t load_u16(const void* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);  // blocks are 18 to 34 bytes: their fields are not aligned
  return v;
}

inline uint32_t load_u32(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Code j (0..31) of a 5-bit block: its low nibble, and bit j of qh as bit 4.
inline int q5_code(const uint8_t* qs, uint32_t qh, int j) {
  const int low = j < QK / 2 ? (qs[j] & 0x0F) : (qs[j - QK / 2] >> 4);
  return low | static_cast<int>(((qh >> j) & 1u) << 4);
}

// Code j (0..255) of a Q6_K super-block, in [0, 63] (w = d * scales[j / 16] * (q - 32)).
inline int q6_k_code(const BlockQ6_K& b, int j) {
  const int half = j / 128, i = j % 128, quarter = i / 32, l = i % 32;
  const uint8_t low = b.ql[64 * half + l + (quarter & 1) * 32];
  const int nibble = quarter < 2 ? (low & 0x0F) : (low >> 4);
  return nibble | (((b.qh[32 * half + l] >> (2 * quarter)) & 3) << 4);
}

// Scale and minimum (6 bits each) of sub-block j (0..7) of a Q4_K super-block, as ggml's get_scale_min_k4.
inline void q4_k_scale_min(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Code j (0..255) of a Q4_K super-block, in [0, 15].
inline int q4_k_code(const BlockQ4_K& b, int j) {
  const uint8_t byte = b.qs[32 * (j / 64) + j % 32];
  return (j / 32) % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
}

// Code j (0..255) of a Q5_K super-block, in [0, 31].
inline int q5_k_code(const BlockQ5_K& b, int j) {
  const int s = j / 32, l = j % 32;
  const uint8_t byte = b.qs[32 * (s / 2) + l];
  return (s % 2 == 0 ? (byte & 0x0F) : (byte >> 4)) | (((b.qh[l] >> s) & 1) << 4);
}

// The scale of sub-block s (0..7) of an IQ4_XS super-block, in [-32, 31].
inline int iq4_xs_scale(const BlockIQ4_XS& b, int s) {
  const int low = (b.scales_l[s / 2] >> (4 * (s % 2))) & 0x0F;
  const int high = (load_u16(&b.scales_h) >> (2 * s)) & 3;
  return (low | (high << 4)) - 32;
}

// The value (kIq4nlValues) of weight j (0..255) of an IQ4_XS super-block.
inline int iq4_xs_value(const BlockIQ4_XS& b, int j) {
  const int l = j % 32;
  const uint8_t byte = b.qs[16 * (j / 32) + l % 16];
  return kIq4nlValues[l < 16 ? (byte & 0x0F) : (byte >> 4)];
}

// The value (kIq4nlValues) of weight j (0..31) of an IQ4_NL block.
inline int iq4_nl_value(const BlockIQ4_NL& b, int j) {
  return kIq4nlValues[j < QK / 2 ? (b.qs[j] & 0x0F) : (b.qs[j - QK / 2] >> 4)];
}

// One activation row quantized to 8-bit blocks of 32: codes in [-127, 127], per block the float16-rounded scale
// d (stored as float) and, for Q8_1, s = fp16(d * sum of the codes) (used with Q4_1's and Q5_1's minimum).
//
// For the K-quants the row is in llama.cpp's Q8_K blocks instead: per 256 values a float32 scale d (not rounded),
// codes in [-127, 127] (scale -127 / the value of largest magnitude, as ggml's quantize_row_q8_K_ref) and the int16
// sums of each 16 codes.
struct ActRow {
  const int8_t* q;              // (K,)
  const float* d;               // (K / 32,), or (K / 256,) for Q8_K
  const float* s;               // (K / 32,), or nullptr where the format needs no sums
  const int16_t* bsums = nullptr;  // Q8_K: (K / 16,) sums of each 16 codes
  const uint8_t* u = nullptr;      // Q8_K, many rows: (K,) the codes plus 128, unsigned (see each_group)
};

// Activation rows a group kernel takes at once; past this many, a group's blocks are unpacked once for all of them
// (each_group), and the K-quant rows are also given unsigned (ActRow::u).
constexpr int kTileRows = 8;

// A row's codes plus 128 as unsigned bytes: the operand `vpdpbusd` takes unsigned, so that the codes it meets may
// be signed.
inline void unsigned_codes(const int8_t* q, int64_t k, uint8_t* u) {
  for (int64_t i = 0; i < k; ++i) u[i] = static_cast<uint8_t>(q[i]) ^ 0x80u;
}

}  // namespace oneblock
