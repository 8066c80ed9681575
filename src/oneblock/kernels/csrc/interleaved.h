// The interleaved ("x16") layouts: a block matrix's bytes reordered once, at load, so that 16 weight rows are read
// together. Nothing is decoded or widened: the same bytes, the same size, another order.
//
// Rows are taken 16 at a time (a group); N must be a multiple of 16. A group of rows stores its blocks in order,
// and block b of the group holds, for the 16 rows r = 0..15:
//
//   Q4_0x16: d[r] (16 x f16, 32 bytes), then 4 chunks L = 0..3 of 64 bytes, chunk L holding bytes 4L..4L+3 of
//            each row's 16 code bytes, row after row                           = 288 bytes = 16 x 18
//   Q4_1x16: d[r] (16 x f16, 32 bytes), m[r] (16 x f16, 32 bytes), then 4 chunks L = 0..3 of 64 bytes, chunk L
//            holding bytes 4L..4L+3 of each row's 16 code bytes, row after row   = 320 bytes = 16 x 20
//   Q8_0x16: d[r] (16 x f16, 32 bytes), then 8 chunks L = 0..7 of 64 bytes, chunk L holding codes 4L..4L+3 of
//            each row, row after row                                              = 544 bytes = 16 x 34
//
// So one 64-byte load is 16 int32 lanes, lane r holding 4 consecutive codes of row r, and one broadcast of 4
// activation codes multiplies all 16 rows at once (`vpdpbusd`); the 16 scales convert in one `vcvtph2ps`. In a
// Q4_0 or Q4_1 chunk the low nibbles are values 4L..4L+3 and the high nibbles values 16+4L..16+4L+3, as in the file's
// blocks. Group g starts at byte g * 16 * row_bytes: a row range starting at a multiple of 16 is a valid matrix.
#pragma once

#include <cstdint>

#include "blocks.h"

namespace oneblock {

constexpr int kGroupRows = 16;
constexpr int kChunkBytes = 64;  // 16 rows x 4 bytes

// The format ids of the interleaved layouts: the GGUF id of the blocks they hold, plus kInterleaved.
constexpr int64_t kInterleaved = 0x100;
constexpr int64_t kQ4_0x16 = kInterleaved | kQ4_0;
constexpr int64_t kQ4_1x16 = kInterleaved | kQ4_1;
constexpr int64_t kQ8_0x16 = kInterleaved | kQ8_0;

inline bool is_interleaved(int64_t fmt) { return fmt == kQ4_0x16 || fmt == kQ4_1x16 || fmt == kQ8_0x16; }
inline int64_t file_format(int64_t fmt) { return fmt & ~kInterleaved; }

// Byte offsets inside one interleaved block of a group.
template <int64_t Fmt>
struct Interleaved;
template <>
struct Interleaved<kQ4_0> {
  static constexpr int kScales = 0, kCodes = 32, kChunks = 4, kBytes = 288;
};
template <>
struct Interleaved<kQ4_1> {
  static constexpr int kScales = 0, kMins = 32, kCodes = 64, kChunks = 4, kBytes = 320;
};
template <>
struct Interleaved<kQ8_0> {
  static constexpr int kScales = 0, kCodes = 32, kChunks = 8, kBytes = 544;
};
static_assert(Interleaved<kQ4_0>::kBytes == kGroupRows * sizeof(BlockQ4_0), "Q4_0x16 holds 16 Q4_0 blocks");
static_assert(Interleaved<kQ4_1>::kBytes == kGroupRows * sizeof(BlockQ4_1), "Q4_1x16 holds 16 Q4_1 blocks");
static_assert(Interleaved<kQ8_0>::kBytes == kGroupRows * sizeof(BlockQ8_0), "Q8_0x16 holds 16 Q8_0 blocks");

// The float32 values of row `lane` (0..15) of the group at `group`, as decode_row computes them: d * q (+ m), or d * (q - 8).
void decode_interleaved_row(const uint8_t* group, int lane, int64_t fmt, int64_t nb, float* out);

}  // namespace oneblock
