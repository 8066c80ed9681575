// AVX-512 kernels over the K-quants' interleaved layouts (q4_kx16, q5_kx16, q6_kx16, iq4_xsx16; interleaved.h), part of
// dot_x16_avx512.h: included at its end, once per instruction set, in its namespaces (its broadcast4, scales16,
// dot_add and each_group). Each lane sums a super-block's exact integers, then does the scalar kernel's float
// operations in its order, so these equal dot_scalar.cpp bit for bit.

namespace oneblock {
namespace OB_CAT(x16_, OB_SUFFIX) {

// Q4_K's 16 rows' 6-bit scales (scales: s < 4 in lo, s >= 4 in hi; minimums the same) from the 3 packed chunks:
// ggml's unpacking of the 12 bytes as 32-bit words, done for 16 rows at once (byte j of a lane: sub-block j or 4 + j).
struct Q4_KScales {
  __m512i sc_lo, sc_hi, m_lo, m_hi;
};
OB_TARGET inline Q4_KScales q4_k_scales(const uint8_t* packed) {
  const __m512i u0 = _mm512_loadu_si512(packed), u1 = _mm512_loadu_si512(packed + kChunkBytes),
                u2 = _mm512_loadu_si512(packed + 2 * kChunkBytes);
  const __m512i six = _mm512_set1_epi8(0x3F), four = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
  return {_mm512_and_si512(u0, six), _mm512_or_si512(_mm512_and_si512(u2, four), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), two), 4)), _mm512_and_si512(u1, six),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), four), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), two), 4))};
}

// Byte s % 4 of each lane of the 4-sub-block word holding sub-block s, as int32.
OB_TARGET inline __m512i byte_of(__m512i v, int j) {
  return _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), _mm512_set1_epi32(0xFF));
}

// Sub-block s's 32 codes of the 16 rows, 4 to a lane: nibble s % 2 of chunks 8 (s / 2) .. + 7, and for Q5_K (`high`:
// its qh chunks) bit s of each byte as bit 4.
template <int64_t Fmt>
OB_TARGET inline void sub_block_codes(const uint8_t* blk, int s, __m512i* w) {
  using L = Interleaved<Fmt>;
  const __m512i low = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
  for (int i = 0; i < 8; ++i) {
    const __m512i raw = _mm512_loadu_si512(blk + L::kCodes + (8 * (s / 2) + i) * kChunkBytes);
    w[i] = _mm512_and_si512(s % 2 ? _mm512_srli_epi16(raw, 4) : raw, low);
    if constexpr (Fmt == kQ5_K) {
      const __m512i high = _mm512_loadu_si512(blk + L::kHigh + i * kChunkBytes);
      w[i] = _mm512_or_si512(w[i], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(high, s), one), 4));
    }
  }
}

// The exact sums of 8 code chunks (32 codes per lane) with 32 activation codes, in two chains.
OB_TARGET inline __m512i sums32(const __m512i* w, const int8_t* q) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int i = 0; i < 8; i += 2) {
    s0 = dot_add(s0, w[i], broadcast4(q + 4 * i));
    s1 = dot_add(s1, w[i + 1], broadcast4(q + 4 * i + 4));
  }
  return _mm512_add_epi32(s0, s1);
}

// acc + the products of the int16 pairs of each lane of p with the int16 pair m, summed per lane (`vpdpwssd`).
OB_TARGET inline __m512i pair_dot_add(__m512i acc, __m512i p, __m512i m) {
#if OB_VNNI
  return _mm512_dpwssd_epi32(acc, p, m);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, m));
#endif
}

// The int16 pair at p, as one 32-bit word in every lane.
OB_TARGET inline __m512i pair_at(const int16_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_set1_epi32(word);
}

// Lane `lane` of `words` (8 int32, each an int16 pair) in every lane.
OB_TARGET inline __m512i lane_of(__m256i words, int lane) {
  return _mm512_permutexvar_epi32(_mm512_set1_epi32(lane), _mm512_castsi256_si512(words));
}

// Block b's end for R activation rows (`k`: its unpacked scales and minimums): per lane the minimums times the
// activations' sums of 32, as int16 pairs, then the scalar kernel's float operations in its order, into `out`.
template <int R, int64_t Fmt>
OB_TARGET inline void q4_k_finish(const uint8_t* blk, const Q4_KScales& k, const ActRow* a, int64_t b,
                                  const __m512i* isum, float* out, int64_t stride) {
  using L = Interleaved<Fmt>;
  __m512i pairs[4];  // minimums of sub-blocks 2j (low half) and 2j + 1 (high half), as int16
  for (int j = 0; j < 4; ++j) {
    const __m512i lo = j < 2 ? k.m_lo : k.m_hi;
    pairs[j] = _mm512_or_si512(byte_of(lo, (2 * j) % 4), _mm512_slli_epi32(byte_of(lo, (2 * j + 1) % 4), 16));
  }
  const __m512 dw = scales16(blk + L::kScales), mw = scales16(blk + L::kMins);
  for (int r = 0; r < R; ++r) {
    // The activations' sums of the 8 sub-blocks (each at most 32 * 128) as int16: sub-blocks 2j and 2j + 1 in
    // lane j of the low half (j < 2) or j + 2 of the high one.
    const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r].bsums + b * (QK_K / 16)));
    const __m256i sub_sums = _mm256_hadd_epi16(bs, bs);
    __m512i msum = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) msum = pair_dot_add(msum, pairs[j], lane_of(sub_sums, j < 2 ? j : j + 2));
    const __m512 da = _mm512_set1_ps(a[r].d[b]);
    __m512 acc = _mm512_loadu_ps(out + r * stride);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, da)));
    acc = _mm512_sub_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(mw, da)));
    _mm512_storeu_ps(out + r * stride, acc);
  }
}

// One Q4_Kx16 (Q5_Kx16: Fmt kQ5_K, a fifth bit per code from its qh chunks) group against R activation rows (Q8_K).
// Each sub-block's codes are unpacked once and meet every row. Per lane, the super-block's exact isum (the
// sub-blocks' sums times their scales) and msum (the minimums times the activations' sums of 32, as int16 pairs),
// then the scalar kernel's float operations in its order (a multiply, then an add or a subtract): each output equals
// dot_scalar.cpp's bit for bit. The running float sums live in `out` (a line per row, in L1), which leaves the
// registers to the codes and the rows' integer sums (measured 4% faster at R = 8 than in registers).
template <int R, int64_t Fmt>
OB_TARGET void q4_k_group(const uint8_t* group, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<Fmt>;
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, _mm512_setzero_ps());  // the sums, in `out`
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    const Q4_KScales k = q4_k_scales(blk + L::kPacked);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {
      __m512i w[8];
      sub_block_codes<Fmt>(blk, s, w);
      const __m512i sc = byte_of(s < 4 ? k.sc_lo : k.sc_hi, s % 4);
      for (int r = 0; r < R; ++r) {
        const __m512i sums = sums32(w, a[r].q + b * QK_K + 32 * s);
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sums, sc));
      }
    }
    q4_k_finish<R, Fmt>(blk, k, a, b, isum, out, stride);
  }
}

// Q6_K's 4 codes of 16 rows for quarter `quarter` of a half: the nibble (quarter / 2) of ql chunk `ql`, topped by bit
// pair `quarter` of qh chunk `qh`, in [0, 63]. The pair is shifted to bits 4-5 (it is there for quarter 2) and
// masked, and one ternary-logic op keeps the nibble's bits below it: three operations for most quarters.
OB_TARGET inline __m512i q6_k_codes(__m512i ql, __m512i qh, int quarter) {
  const __m512i low = quarter >= 2 ? _mm512_srli_epi16(ql, 4) : ql;
  const __m512i pair = quarter == 2 ? qh : quarter < 2 ? _mm512_slli_epi16(qh, 4 - 2 * quarter) : _mm512_srli_epi16(qh, 2);
  const __m512i top = _mm512_and_si512(pair, _mm512_set1_epi8(0x30));
  return _mm512_ternarylogic_epi32(low, top, _mm512_set1_epi8(0x0F), 0xEC);  // (low & 0x0F) | top
}

// Sub-block s's int8 scale of the 16 rows, sign-extended to int32: byte s % 4 of scale chunk s / 4.
OB_TARGET inline __m512i q6_k_scale(const uint8_t* scales, int s) {
  const __m512i word = _mm512_loadu_si512(scales + (s / 4) * kChunkBytes);
  return _mm512_srai_epi32(_mm512_slli_epi32(word, 24 - 8 * (s % 4)), 24);
}

// Block b's float end for R activation rows, given each lane's exact integer sum: the scalar kernel's float
// operations in its order, added to `out`.
template <int R>
OB_TARGET inline void q6_k_scale_rows(const uint8_t* blk, const ActRow* a, int64_t b, const __m512i* exact, float* out,
                                      int64_t stride) {
  const __m512 dw = scales16(blk + Interleaved<kQ6_K>::kScales);
  for (int r = 0; r < R; ++r) {
    const __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(exact[r]), _mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b])));
    _mm512_storeu_ps(out + r * stride, _mm512_add_ps(_mm512_loadu_ps(out + r * stride), term));
  }
}

// Block b's end for R activation rows: 32 times the scales' products with the activations' sums of 16 (int16 pairs)
// taken off each lane's sum `isum`, then the float end.
template <int R>
OB_TARGET inline void q6_k_finish(const uint8_t* blk, const ActRow* a, int64_t b, const __m512i* isum, float* out,
                                  int64_t stride) {
  using L = Interleaved<kQ6_K>;
  // Scale chunk t's int8 scales as int16 pairs, sub-blocks (4t, 4t + 1) and (4t + 2, 4t + 3): the order the
  // activations' sums of 16 are stored in, so that each row reads its pairs as 32-bit words from memory.
  const __m512i swap = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15));
  __m512i first[4], second[4];
  for (int t = 0; t < 4; ++t) {
    const __m512i word = _mm512_shuffle_epi8(_mm512_loadu_si512(blk + L::kSubScales + t * kChunkBytes), swap);
    first[t] = _mm512_srai_epi16(_mm512_slli_epi16(word, 8), 8);
    second[t] = _mm512_srai_epi16(word, 8);
  }
  __m512i exact[R];
  for (int r = 0; r < R; ++r) {
    const int16_t* sums = a[r].bsums + b * (QK_K / 16);  // the activations' 16 sums: pair j is (2j, 2j + 1)
    __m512i offset = _mm512_setzero_si512();  // per lane: the sum over s of scale s times activation sum s
    for (int t = 0; t < 4; ++t) {
      offset = pair_dot_add(offset, first[t], pair_at(sums + 4 * t));
      offset = pair_dot_add(offset, second[t], pair_at(sums + 4 * t + 2));
    }
    exact[r] = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(offset, 5));
  }
  q6_k_scale_rows<R>(blk, a, b, exact, out, stride);
}

// One Q6_Kx16 group against R activation rows (Q8_K). Sub-block s (16 values) of half h = s / 8 takes ql bytes
// 64h + 32 (quarter % 2) + 16 (s % 2) .. and qh bytes 32h + 16 (s % 2) .., quarter = (s % 8) / 2: chunk triple
// t = 8h + 4 (s % 2) + i (i = 0..3) of the layout holds those 4 bytes of ql, of ql 32 further and of qh, for all 4
// quarters. Each sub-block's codes are built once and meet every row unsigned, its sum times the int8 scale; 32
// times the scales' products with the activations' sums of 16 (int16 pairs) is taken off: per lane the scalar
// kernel's exact isum, then its float operations in its order (bit for bit).
template <int R>
OB_TARGET void q6_k_group(const uint8_t* group, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<kQ6_K>;
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, _mm512_setzero_ps());  // the sums, in `out`
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      for (int half_sub = 0; half_sub < 2; ++half_sub) {  // the first or second 16 values of each quarter
        const uint8_t* triples = blk + L::kCodes + 3 * (8 * h + 4 * half_sub) * kChunkBytes;
        if constexpr (R == 1) {  // triple by triple, in the order they lie: each chunk loaded once
          const int8_t* q = a[0].q + b * QK_K + 128 * h + 16 * half_sub;
          __m512i sum[4];
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) {
            const uint8_t* triple = triples + 3 * i * kChunkBytes;
            const __m512i ql0 = _mm512_loadu_si512(triple), ql1 = _mm512_loadu_si512(triple + kChunkBytes),
                          qh = _mm512_loadu_si512(triple + 2 * kChunkBytes);
#pragma GCC unroll 4
            for (int quarter = 0; quarter < 4; ++quarter) {
              const __m512i codes = q6_k_codes(quarter % 2 ? ql1 : ql0, qh, quarter);
              const __m512i act = broadcast4(q + 32 * quarter + 4 * i);
              sum[quarter] = i == 0 ? dot_add(_mm512_setzero_si512(), codes, act) : dot_add(sum[quarter], codes, act);
            }
          }
#pragma GCC unroll 4
          for (int quarter = 0; quarter < 4; ++quarter) {
            const __m512i sc = q6_k_scale(blk + L::kSubScales, 8 * h + 2 * quarter + half_sub);
            isum[0] = _mm512_add_epi32(isum[0], _mm512_mullo_epi32(sum[quarter], sc));
          }
        } else {  // quarter by quarter: each sub-block's codes built once for the R rows
#pragma GCC unroll 4
          for (int quarter = 0; quarter < 4; ++quarter) {  // unrolled: each quarter's shifts by constants
            __m512i codes[4];
            for (int i = 0; i < 4; ++i) {
              const uint8_t* triple = triples + 3 * i * kChunkBytes;
              const __m512i ql = _mm512_loadu_si512(triple + (quarter % 2) * kChunkBytes);
              codes[i] = q6_k_codes(ql, _mm512_loadu_si512(triple + 2 * kChunkBytes), quarter);
            }
            const __m512i sc = q6_k_scale(blk + L::kSubScales, 8 * h + 2 * quarter + half_sub);
            for (int r = 0; r < R; ++r) {  // R rows' chains cover the multiply-adds' latency
              const int8_t* q = a[r].q + b * QK_K + 128 * h + 32 * quarter + 16 * half_sub;
              __m512i sum = _mm512_setzero_si512();
              for (int i = 0; i < 4; ++i) sum = dot_add(sum, codes[i], broadcast4(q + 4 * i));
              isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sum, sc));
            }
          }
        }
      }
    }
    q6_k_finish<R>(blk, a, b, isum, out, stride);
  }
}

// One IQ4_XSx16 group against R activation rows (Q8_K): the indices become kIq4nlValues by a table lookup
// (`vpshufb`), once per sub-block for every row; with VNNI they meet the activations as unsigned w + 128 (one xor)
// and 128 times the sub-block's activation sum is taken off, without it |w| meets the activation with w's sign moved
// onto it. Each sub-block's exact sum times its 6-bit scale less 32, then the scalar kernel's float operations: bit
// for bit.
template <int R>
OB_TARGET void iq4_xs_group(const uint8_t* group, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<kIQ4_XS>;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i values = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)));
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L::kHigh)));
    const __m512i lows = _mm512_loadu_si512(blk + L::kLow);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {
      const __m512i ls = _mm512_or_si512(
          _mm512_and_si512(_mm512_srli_epi32(lows, 8 * (s / 2) + 4 * (s % 2)), _mm512_set1_epi32(0x0F)),
          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * s), _mm512_set1_epi32(3)), 4));
      const __m512i scale = _mm512_sub_epi32(ls, _mm512_set1_epi32(32));
      __m512i w[8];  // w[i]: values 4i.. (i < 4: low nibbles of chunk i) and 16 + 4(i - 4).. (high nibbles)
      for (int i = 0; i < 4; ++i) {
        const __m512i raw = _mm512_loadu_si512(blk + L::kCodes + (4 * s + i) * kChunkBytes);
        w[i] = _mm512_shuffle_epi8(values, _mm512_and_si512(raw, low));
        w[i + 4] = _mm512_shuffle_epi8(values, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
      }
#if OB_VNNI
      for (int i = 0; i < 8; ++i) w[i] = _mm512_xor_si512(w[i], _mm512_set1_epi8(-128));
#else
      __mmask64 negative[8];
      for (int i = 0; i < 8; ++i) {
        negative[i] = _mm512_movepi8_mask(w[i]);
        w[i] = _mm512_abs_epi8(w[i]);
      }
#endif
      for (int r = 0; r < R; ++r) {
        const int8_t* q = a[r].q + b * QK_K + 32 * s;
        __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int i = 0; i < 8; ++i) {
          const __m512i act = broadcast4(q + 4 * i);
#if OB_VNNI
          sums[i % 2] = dot_add(sums[i % 2], w[i], act);
#else
          sums[i % 2] = dot_add(sums[i % 2], w[i], _mm512_mask_sub_epi8(act, negative[i], _mm512_setzero_si512(), act));
#endif
        }
        __m512i sub = _mm512_add_epi32(sums[0], sums[1]);
#if OB_VNNI
        const int16_t* bs = a[r].bsums + b * (QK_K / 16);
        sub = _mm512_sub_epi32(sub, _mm512_set1_epi32(128 * (bs[2 * s] + bs[2 * s + 1])));
#endif
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sub, scale));
      }
    }
    const __m512 dw = scales16(blk + L::kScales);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b]))));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
}

}  // namespace OB_CAT(x16_, OB_SUFFIX)
}  // namespace oneblock

#include "dot_kx16_rows_avx512.h"  // the many-row paths from unpacked blocks, the groups under one name
