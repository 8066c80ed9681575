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
//   Q5_0x16: d[r] (32 bytes), then qh (chunk 0: each row's 32 fifth bits), then 4 chunks L = 1..4 of 64 bytes,
//            chunk L holding code bytes 4(L-1)..4(L-1)+3 of each row               = 352 bytes = 16 x 22
//   Q4_Kx16: (per super-block of 256 values) d[r], dmin[r] (2 x 32 bytes), then 3 chunks of the 12 bytes of packed
//            scales and minimums (chunk L: bytes 4L..4L+3 of each row's), then 32 chunks of the 128 bytes of
//            nibbles (chunk L: bytes 4L..4L+3 of each row's)                    = 2304 bytes = 16 x 144
//   Q5_Kx16: as Q4_Kx16 with 8 chunks of each row's 32 bytes of qh between the packed scales and the nibbles
//                                                                                 = 2816 bytes = 16 x 176
//   IQ4_XSx16: (per super-block) d[r], scales_h[r] (2 x 32 bytes), then scales_l (a chunk), then 32 chunks of the
//            indices (chunk 4s + i: bytes 16s + 4i.. of each row's)             = 2176 bytes = 16 x 136
//   Q6_Kx16: (per super-block) d[r] (32 bytes; the file stores it last), then 52 chunks of the rest (ql: chunks
//            0..31 of the file's, qh: 32..47, the 16 int8 scales: 48..51) in the order the kernels read them: the
//            scales' 4, then per t = 0..15 ql chunk 16(t/8) + 4((t/4)%2) + t%4, ql chunk 8 more, qh chunk
//            32 + 8(t/8) + 4((t/4)%2) + t%4 (sequential reads, which the hardware prefetchers follow)
//                                                                                 = 3360 bytes = 16 x 210
//
// So one 64-byte load is 16 int32 lanes, lane r holding 4 consecutive codes of row r, and one broadcast of 4
// activation codes multiplies all 16 rows at once (`vpdpbusd`); the 16 scales convert in one `vcvtph2ps`. In a
// Q4_0 or Q4_1 chunk the low nibbles are values 4L..4L+3 and the high nibbles values 16+4L..16+4L+3, as in the file's
// blocks; in a Q4_Kx16 chunk 8c + i the low nibbles are values 4i..4i+3 of sub-block 2c, the high ones of 2c + 1,
// and a packed chunk is one of the 32-bit words ggml unpacks the 6-bit scales from, for 16 rows at once. Every
// layout is the file's blocks cut into their float16 fields and 4-byte chunks. Group g starts at byte g * 16 * row_bytes: a row range starting at a multiple of 16 is a valid matrix.
#pragma once

#include <xmmintrin.h>

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
constexpr int64_t kQ5_0x16 = kInterleaved | kQ5_0;
constexpr int64_t kQ4_Kx16 = kInterleaved | kQ4_K;
constexpr int64_t kQ5_Kx16 = kInterleaved | kQ5_K;
constexpr int64_t kQ6_Kx16 = kInterleaved | kQ6_K;
constexpr int64_t kIQ4_XSx16 = kInterleaved | kIQ4_XS;

inline bool is_interleaved(int64_t fmt) {
  return fmt == kQ4_0x16 || fmt == kQ4_1x16 || fmt == kQ8_0x16 || fmt == kQ5_0x16 || fmt == kQ4_Kx16 ||
         fmt == kQ5_Kx16 || fmt == kQ6_Kx16 || fmt == kIQ4_XSx16;
}
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
template <>
struct Interleaved<kQ5_0> {
  static constexpr int kScales = 0, kHigh = 32, kCodes = 96, kChunks = 4, kBytes = 352;
};
template <>
struct Interleaved<kQ4_K> {
  static constexpr int kScales = 0, kMins = 32, kPacked = 64, kCodes = 256, kChunks = 32, kBytes = 2304;
};
template <>
struct Interleaved<kQ5_K> {  // Q4_K's, with the 8 chunks of qh between the packed scales and the nibbles
  static constexpr int kScales = 0, kMins = 32, kPacked = 64, kHigh = 256, kCodes = 768, kChunks = 32, kBytes = 2816;
};
template <>
struct Interleaved<kIQ4_XS> {  // d, scales_h (two 16-bit fields), then scales_l (a chunk) and the indices
  static constexpr int kScales = 0, kHigh = 32, kLow = 64, kCodes = 128, kBytes = 2176;
};
template <>
struct Interleaved<kQ6_K> {
  static constexpr int kScales = 0, kSubScales = 32, kCodes = 32 + 4 * 64, kBytes = 3360;  // kCodes: t = 0's chunks
};
static_assert(Interleaved<kQ4_0>::kBytes == kGroupRows * sizeof(BlockQ4_0), "Q4_0x16 holds 16 Q4_0 blocks");
static_assert(Interleaved<kQ4_1>::kBytes == kGroupRows * sizeof(BlockQ4_1), "Q4_1x16 holds 16 Q4_1 blocks");
static_assert(Interleaved<kQ8_0>::kBytes == kGroupRows * sizeof(BlockQ8_0), "Q8_0x16 holds 16 Q8_0 blocks");
static_assert(Interleaved<kQ5_0>::kBytes == kGroupRows * sizeof(BlockQ5_0), "Q5_0x16 holds 16 Q5_0 blocks");
static_assert(Interleaved<kQ4_K>::kBytes == kGroupRows * sizeof(BlockQ4_K), "Q4_Kx16 holds 16 Q4_K blocks");
static_assert(Interleaved<kQ5_K>::kBytes == kGroupRows * sizeof(BlockQ5_K), "Q5_Kx16 holds 16 Q5_K blocks");
static_assert(Interleaved<kIQ4_XS>::kBytes == kGroupRows * sizeof(BlockIQ4_XS), "IQ4_XSx16 holds 16 IQ4_XS blocks");
static_assert(Interleaved<kQ6_K>::kBytes == kGroupRows * sizeof(BlockQ6_K), "Q6_Kx16 holds 16 Q6_K blocks");

// How far past the block a 32-value group kernel multiplies it asks for the weights (a prefetch), in bytes. A matrix
// is read as one stream, but the hardware's prefetchers stop at each 4 KiB page, and with a few activation rows' work
// per block the loads alone keep too few lines in flight. On Zen 4, 2 threads, Q8_0 16,384 x 2,048 times 8 rows:
// 2.3-2.8 ms without, 1.0-1.3 ms with (4 KiB ahead: 1.30 ms; 16 KiB: 1.12 ms); Q4_0 and Q5_0 65,536 x 2,048 times 4
// rows 1.35x faster, one row unchanged. The K-quants' kernels go without: their one-row products of a matrix
// larger than the cache read 20-30% slower with it.
constexpr int64_t kFetchAhead = 8192;

// The block of a group's kFetchAhead bytes past `blk` asked into the cache, a line at a time. A prefetch never
// faults: past the matrix's end it asks for nothing useful, harmlessly.
template <typename Layout>  // Interleaved<Fmt>
inline void fetch_ahead(const uint8_t* blk) {
  for (int64_t at = 0; at < Layout::kBytes; at += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(blk + kFetchAhead + at), _MM_HINT_T0);
  }
}

// The float16 fields of a block of `fmt` (d, and a minimum's scale), at byte half_at(fmt) (Q6_K's d is last): the
// rest of the block, in order, is 4-byte chunks.
inline int64_t half_fields(int64_t fmt) {
  return fmt == kQ4_1 || fmt == kQ4_K || fmt == kQ5_K || fmt == kIQ4_XS ? 2 : 1;
}
inline int64_t half_at(int64_t fmt) { return fmt == kQ6_K ? 208 : 0; }
// The byte of a block where byte `p` of its chunks (the block less its float16 fields) is.
inline int64_t chunk_byte(int64_t fmt, int64_t p) { return p < half_at(fmt) ? p : p + 2 * half_fields(fmt); }
// The chunk of the file's block (the block less its float16 fields) that an interleaved block stores `c`-th.
inline int64_t source_chunk(int64_t fmt, int64_t c) {
  if (fmt != kQ6_K) return c;
  if (c < 4) return 48 + c;  // the scales
  const int64_t t = (c - 4) / 3, part = (c - 4) % 3, at = 4 * ((t / 4) % 2) + t % 4, h = t / 8;
  return part == 0 ? 16 * h + at : part == 1 ? 16 * h + 8 + at : 32 + 8 * h + at;
}

// Row `lane`'s block `b` of an interleaved group, put back as the file stores it (block_bytes(fmt) bytes at out).
void gather_block(const uint8_t* group, int lane, int64_t fmt, int64_t b, uint8_t* out);

// The float32 values of row `lane` (0..15) of the group at `group`, as decode_row computes them.
void decode_interleaved_row(const uint8_t* group, int lane, int64_t fmt, int64_t nb, float* out);

}  // namespace oneblock
