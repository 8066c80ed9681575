// AVX-512 kernels over the interleaved layouts (interleaved.h), included twice by dot_x16_avx512.cpp: with
// OB_VNNI 1 (`vpdpbusd`) and OB_VNNI 0 (`vpmaddubsw` + `vpmaddwd`). One 512-bit register is 16 weight rows x 4
// codes; 4 activation codes are broadcast to every lane, so a block of 16 rows takes 8 multiply-adds, and the 16
// rows' scales convert in one instruction. Each int32 lane sum is exact, the block's sum `sumi` is exact, and the
// float work per output is that of the scalar path: `acc += (dw * da) * sumi` (+ `mw * sa`), in another order.
// Both variants give the same integers, hence the same floats.
// Expects OB_TARGET (the target attribute), OB_VNNI and OB_SUFFIX (the exported names' suffix) defined.
#include <immintrin.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "dot.h"
#include "interleaved.h"

#define OB_CAT2(a, b) a##b
#define OB_CAT(a, b) OB_CAT2(a, b)

namespace oneblock {
namespace OB_CAT(x16_, OB_SUFFIX) {

OB_TARGET inline __m512i broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, sizeof v);
  return _mm512_set1_epi32(v);
}

OB_TARGET inline __m512 scales16(const uint8_t* halves) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves)));
}

// acc + the sums of 4 products u * s per int32 lane: u unsigned bytes, s signed. Without VNNI the pairs go
// through int16, which holds them while |u| <= 128 (a pair is at most 2 * 128 * 127 = 32512).
OB_TARGET inline __m512i dot_add(__m512i acc, __m512i u, __m512i s) {
#if OB_VNNI
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

// The exact block sums of 8 chunks against one activation block: w[i] pairs with codes 4i..4i+3 (two chains,
// so consecutive multiply-adds do not wait on each other).
OB_TARGET inline __m512i block_sums(const __m512i* w, const int8_t* q) {
  __m512i s0 = dot_add(_mm512_setzero_si512(), w[0], broadcast4(q));
  __m512i s1 = dot_add(_mm512_setzero_si512(), w[1], broadcast4(q + 4));
  for (int i = 2; i < 8; i += 2) {
    s0 = dot_add(s0, w[i], broadcast4(q + 4 * i));
    s1 = dot_add(s1, w[i + 1], broadcast4(q + 4 * i + 4));
  }
  return _mm512_add_epi32(s0, s1);
}

// One group of 16 rows against R activation rows: out[r * stride + lane].
template <int R>
OB_TARGET void q4_1_group(const uint8_t* group, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<kQ4_1>;
  __m512 acc[R], mins[R];
  for (int r = 0; r < R; ++r) acc[r] = mins[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    fetch_ahead<L>(blk);
    const __m512 dw = scales16(blk + L::kScales), mw = scales16(blk + L::kMins);
    __m512i w[8];  // w[i]: codes 4i..4i+3 of the 16 rows (the low nibbles are values 0..15, the high 16..31)
    for (int c = 0; c < L::kChunks; ++c) {
      const __m512i raw = _mm512_loadu_si512(blk + L::kCodes + c * kChunkBytes);
      w[c] = _mm512_and_si512(raw, low);
      w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sumi = _mm512_cvtepi32_ps(block_sums(w, a[r].q + b * QK));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b])), sumi, acc[r]);
      mins[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a[r].s[b]), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, _mm512_add_ps(acc[r], mins[r]));
}

// Q4_0's codes q - 8: the unsigned nibbles q meet the activations, and 8 times the activation block's code sum
// (`sums`, as code_sums gives it) is taken off the exact int32 sum.
template <int R>
OB_TARGET void q4_0_group(const uint8_t* group, const ActRow* a, const int32_t* const* sums, int64_t nb, float* out,
                          int64_t stride) {
  using L = Interleaved<kQ4_0>;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    fetch_ahead<L>(blk);
    const __m512 dw = scales16(blk + L::kScales);
    __m512i w[8];  // w[i]: codes 4i..4i+3 of the 16 rows, as stored (0..15)
    for (int c = 0; c < L::kChunks; ++c) {
      const __m512i raw = _mm512_loadu_si512(blk + L::kCodes + c * kChunkBytes);
      w[c] = _mm512_and_si512(raw, low);
      w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i offset = _mm512_set1_epi32(8 * sums[r][b]);
      const __m512 sumi = _mm512_cvtepi32_ps(_mm512_sub_epi32(block_sums(w, a[r].q + b * QK), offset));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b])), sumi, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
}

// Q5_0's fifth bits `bit` .. `bit` + 3 of each row's qh word (values 4L..4L+3: bit 4L; 16 + 4L..: bit 16 + 4L), added
// as 16 to the 4 codes of each lane: byte k of a lane takes the qh byte holding its bit (`vpshufb` within the lane),
// tested against that bit.
OB_TARGET inline __m512i add_fifth_bits(__m512i codes, __m512i qh, int bit) {
  const int byte = bit / 8, shift = bit % 8;  // shift is 0 or 4: the 4 bits are in one byte
  const __m512i index = _mm512_add_epi32(_mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0),
                                         _mm512_set1_epi32(0x01010101 * byte));
  const __m512i bits = _mm512_set1_epi32(static_cast<int>(0x08040201u << shift));
  const __mmask64 set = _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, index), bits);
  return _mm512_mask_add_epi8(codes, set, codes, _mm512_set1_epi8(16));
}

// Q5_0's codes q - 16: the unsigned 5-bit codes meet the activations and 16 times the activation block's code sum
// is taken off the exact int32 sum.
template <int R>
OB_TARGET void q5_0_group(const uint8_t* group, const ActRow* a, const int32_t* const* sums, int64_t nb, float* out,
                          int64_t stride) {
  using L = Interleaved<kQ5_0>;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    fetch_ahead<L>(blk);
    const __m512 dw = scales16(blk + L::kScales);
    const __m512i qh = _mm512_loadu_si512(blk + L::kHigh);
    __m512i w[8];  // w[i]: codes 4i..4i+3 of the 16 rows, in [0, 31]
    for (int c = 0; c < L::kChunks; ++c) {
      const __m512i raw = _mm512_loadu_si512(blk + L::kCodes + c * kChunkBytes);
      w[c] = add_fifth_bits(_mm512_and_si512(raw, low), qh, 4 * c);
      w[c + 4] = add_fifth_bits(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), qh, 16 + 4 * c);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i offset = _mm512_set1_epi32(16 * sums[r][b]);
      const __m512 sumi = _mm512_cvtepi32_ps(_mm512_sub_epi32(block_sums(w, a[r].q + b * QK), offset));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b])), sumi, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
}

// Where a group's blocks are unpacked for many activation rows: this thread's buffer for nb blocks, on a cache line
// (valid until its next call).
template <typename Codes>
inline Codes* codes_buffer(int64_t nb) {
  thread_local std::vector<uint8_t> buffer;
  buffer.resize(static_cast<size_t>(nb) * sizeof(Codes) + kChunkBytes);
  const uintptr_t at = (reinterpret_cast<uintptr_t>(buffer.data()) + kChunkBytes - 1) & ~uintptr_t{kChunkBytes - 1};
  return reinterpret_cast<Codes*>(at);
}

// The group's nb blocks, each unpacked by `Unpack` into this thread's buffer.
template <typename Codes, int64_t Fmt, void (*Unpack)(const uint8_t*, Codes*)>
OB_TARGET inline const Codes* unpack_group(const uint8_t* group, int64_t nb) {
  Codes* codes = codes_buffer<Codes>(nb);
  for (int64_t b = 0; b < nb; ++b) Unpack(group + b * Interleaved<Fmt>::kBytes, codes + b);
  return codes;
}

// A Q5_0x16 block unpacked: its 8 chunks of codes in [0, 31] (16 rows x 4 codes), the fifth bits added.
struct Q5_0Codes {
  uint8_t codes[8][kChunkBytes];
};

OB_TARGET inline void q5_0_unpack(const uint8_t* blk, Q5_0Codes* u) {
  using L = Interleaved<kQ5_0>;
  const __m512i low = _mm512_set1_epi8(0x0F), qh = _mm512_loadu_si512(blk + L::kHigh);
  for (int c = 0; c < L::kChunks; ++c) {
    const __m512i raw = _mm512_loadu_si512(blk + L::kCodes + c * kChunkBytes);
    _mm512_storeu_si512(u->codes[c], add_fifth_bits(_mm512_and_si512(raw, low), qh, 4 * c));
    const __m512i high_nibbles = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    _mm512_storeu_si512(u->codes[c + 4], add_fifth_bits(high_nibbles, qh, 16 + 4 * c));
  }
}

// q5_0_group<R> from the group's unpacked blocks (`codes`, nb of them): the same integers and float operations.
template <int R>
OB_TARGET void q5_0_rows(const uint8_t* group, const Q5_0Codes* codes, const ActRow* a, const int32_t* const* sums,
                         int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<kQ5_0>;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 dw = scales16(group + b * L::kBytes + L::kScales);
    __m512i w[8];
    for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(codes[b].codes[i]);
    for (int r = 0; r < R; ++r) {
      const __m512i offset = _mm512_set1_epi32(16 * sums[r][b]);
      const __m512 sumi = _mm512_cvtepi32_ps(_mm512_sub_epi32(block_sums(w, a[r].q + b * QK), offset));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b])), sumi, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
}

// Q8_0's codes are signed. With VNNI they are taken as unsigned w + 128 (one xor) and 128 times the activation
// block's code sum is taken off the int32 sum; without, |w| meets the activation with w's sign moved onto it.
template <int R>
OB_TARGET void q8_0_group(const uint8_t* group, const ActRow* a, const int32_t* const* sums, int64_t nb, float* out,
                          int64_t stride) {
  using L = Interleaved<kQ8_0>;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    fetch_ahead<L>(blk);
    const __m512 dw = scales16(blk + L::kScales);
    __m512i w[8];
#if OB_VNNI
    for (int c = 0; c < L::kChunks; ++c) {
      w[c] = _mm512_xor_si512(_mm512_loadu_si512(blk + L::kCodes + c * kChunkBytes), _mm512_set1_epi8(-128));
    }
    for (int r = 0; r < R; ++r) {
      const __m512i offset = _mm512_set1_epi32(128 * sums[r][b]);
      const __m512 sumi = _mm512_cvtepi32_ps(_mm512_sub_epi32(block_sums(w, a[r].q + b * QK), offset));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b])), sumi, acc[r]);
    }
#else
    __mmask64 negative[8];
    for (int c = 0; c < L::kChunks; ++c) {
      const __m512i raw = _mm512_loadu_si512(blk + L::kCodes + c * kChunkBytes);
      negative[c] = _mm512_movepi8_mask(raw);
      w[c] = _mm512_abs_epi8(raw);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* q = a[r].q + b * QK;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int c = 0; c < L::kChunks; c += 2) {
        const __m512i q0 = broadcast4(q + 4 * c), q1 = broadcast4(q + 4 * c + 4);
        s0 = dot_add(s0, w[c], _mm512_mask_sub_epi8(q0, negative[c], _mm512_setzero_si512(), q0));
        s1 = dot_add(s1, w[c + 1], _mm512_mask_sub_epi8(q1, negative[c + 1], _mm512_setzero_si512(), q1));
      }
      const __m512 sumi = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b])), sumi, acc[r]);
    }
#endif
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
}

// The code sums of each activation block (for Q4_0, Q5_0, and Q8_0 with VNNI): 32 codes + 128 each as unsigned bytes, summed
// by `vpsadbw`, less 32 * 128.
OB_TARGET inline void code_sums(const ActRow& a, int64_t nb, int32_t* out) {
  const __m256i flip = _mm256_set1_epi8(-128);
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i u = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + b * QK)), flip);
    const __m256i s = _mm256_sad_epu8(u, _mm256_setzero_si256());  // 4 x u64
    const __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    out[b] = static_cast<int32_t>(_mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1)) - 32 * 128;
  }
}

// The formats' group kernels under one name, for `each_group`.
struct Q4_1Group {
  template <int R>
  OB_TARGET static void run(const uint8_t* group, const ActRow* a, const int32_t* const*, int64_t nb, float* out,
                            int64_t stride) {
    q4_1_group<R>(group, a, nb, out, stride);
  }
};
struct Q4_0Group {
  template <int R>
  OB_TARGET static void run(const uint8_t* group, const ActRow* a, const int32_t* const* sums, int64_t nb, float* out,
                            int64_t stride) {
    q4_0_group<R>(group, a, sums, nb, out, stride);
  }
};
struct Q8_0Group {
  template <int R>
  OB_TARGET static void run(const uint8_t* group, const ActRow* a, const int32_t* const* sums, int64_t nb, float* out,
                            int64_t stride) {
    q8_0_group<R>(group, a, sums, nb, out, stride);
  }
};

struct Q5_0Group {
  using Codes = Q5_0Codes;
  static constexpr bool kUnsignedActs = false;
  template <int R>
  OB_TARGET static void run(const uint8_t* group, const ActRow* a, const int32_t* const* sums, int64_t nb, float* out,
                            int64_t stride) {
    q5_0_group<R>(group, a, sums, nb, out, stride);
  }
  OB_TARGET static const Codes* unpack(const uint8_t* group, int64_t nb) {
    return unpack_group<Codes, kQ5_0, q5_0_unpack>(group, nb);
  }
  template <int R>
  OB_TARGET static void run_unpacked(const uint8_t* group, const Codes* codes, const ActRow* a,
                                     const int32_t* const* sums, int64_t nb, float* out, int64_t stride) {
    q5_0_rows<R>(group, codes, a, sums, nb, out, stride);
  }
};

}  // namespace OB_CAT(x16_, OB_SUFFIX)
}  // namespace oneblock

#include "dot_x16_each_avx512.h"  // each_group: how a product walks the groups

namespace oneblock {

OB_TARGET void OB_CAT(dot_q4_1x16_, OB_SUFFIX)(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows,
                                     int64_t nb, float* out, int64_t stride) {
  namespace k = OB_CAT(x16_, OB_SUFFIX);
  k::each_group<k::Q4_1Group>(w, row_bytes, cols, a, rows, nb, out, stride, false);
}

OB_TARGET void OB_CAT(dot_q4_0x16_, OB_SUFFIX)(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows,
                                     int64_t nb, float* out, int64_t stride) {
  namespace k = OB_CAT(x16_, OB_SUFFIX);
  k::each_group<k::Q4_0Group>(w, row_bytes, cols, a, rows, nb, out, stride, true);
}

OB_TARGET void OB_CAT(dot_q8_0x16_, OB_SUFFIX)(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows,
                                     int64_t nb, float* out, int64_t stride) {
  namespace k = OB_CAT(x16_, OB_SUFFIX);
  k::each_group<k::Q8_0Group>(w, row_bytes, cols, a, rows, nb, out, stride, OB_VNNI != 0);  // sums: VNNI only
}

OB_TARGET void OB_CAT(dot_q5_0x16_, OB_SUFFIX)(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows,
                                     int64_t nb, float* out, int64_t stride) {
  namespace k = OB_CAT(x16_, OB_SUFFIX);
  k::each_group<k::Q5_0Group>(w, row_bytes, cols, a, rows, nb, out, stride, true);
}

}  // namespace oneblock

#include "dot_kx16_avx512.h"  // the K-quants' groups, in the same namespaces

#undef OB_CAT
#undef OB_CAT2
