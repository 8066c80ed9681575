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

// The exact sums of sub-block s (32 codes of the 16 rows: chunks raw[0..7], nibble s % 2, and for Q5_K bit s of the
// qh chunks high[0..7] as bit 4) with 32 activation codes.
OB_TARGET inline __m512i sub_block_sums(const __m512i* raw, const __m512i* high, int s, const int8_t* q) {
  const __m512i low = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
  __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int i = 0; i < 8; ++i) {
    __m512i w = _mm512_and_si512(s % 2 ? _mm512_srli_epi16(raw[i], 4) : raw[i], low);
    if (high != nullptr) w = _mm512_or_si512(w, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(high[i], s), one), 4));
    sums[i % 2] = dot_add(sums[i % 2], w, broadcast4(q + 4 * i));
  }
  return _mm512_add_epi32(sums[0], sums[1]);
}

// One Q4_Kx16 (Q5_Kx16: Fmt kQ5_K, a fifth bit per code from its qh chunks) group against R activation rows (Q8_K).
// Per lane, the super-block's exact isum (the sub-blocks' sums
// times their scales) and msum (the minimums times the activations' sums of 32), then the scalar kernel's float
// operations in its order (a multiply, then an add or a subtract): each output equals dot_scalar.cpp's bit for bit.
template <int R, int64_t Fmt>
OB_TARGET void q4_k_group(const uint8_t* group, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<Fmt>;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    const __m512 dw = scales16(blk + L::kScales), mw = scales16(blk + L::kMins);
    const Q4_KScales k = q4_k_scales(blk + L::kPacked);
    __m512i sc[8], mins[8];
    for (int s = 0; s < 8; ++s) {
      sc[s] = byte_of(s < 4 ? k.sc_lo : k.sc_hi, s % 4);
      mins[s] = byte_of(s < 4 ? k.m_lo : k.m_hi, s % 4);
    }
    __m512i high[8];  // Q5_K: chunk i holds bytes 4i..4i+3 of each row's qh (bit s: sub-block s's fifth bits)
    if constexpr (Fmt == kQ5_K) {
      for (int i = 0; i < 8; ++i) high[i] = _mm512_loadu_si512(blk + L::kHigh + i * kChunkBytes);
    }
    const __m512i* fifth = Fmt == kQ5_K ? high : nullptr;
    for (int r = 0; r < R; ++r) {
      const int8_t* q = a[r].q + b * QK_K;
      const int16_t* bs = a[r].bsums + b * (QK_K / 16);
      __m512i isum = _mm512_setzero_si512(), msum = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {  // chunks 8c .. 8c + 7: sub-blocks 2c (low nibbles) and 2c + 1 (high)
        __m512i raw[8];
        for (int i = 0; i < 8; ++i) raw[i] = _mm512_loadu_si512(blk + L::kCodes + (8 * c + i) * kChunkBytes);
        isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(sub_block_sums(raw, fifth, 2 * c, q + 64 * c), sc[2 * c]));
        isum = _mm512_add_epi32(isum,
                                _mm512_mullo_epi32(sub_block_sums(raw, fifth, 2 * c + 1, q + 64 * c + 32), sc[2 * c + 1]));
      }
      for (int s = 0; s < 8; ++s) {
        msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(mins[s], _mm512_set1_epi32(bs[2 * s] + bs[2 * s + 1])));
      }
      const __m512 da = _mm512_set1_ps(a[r].d[b]);
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, da)));
      acc[r] = _mm512_sub_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(mw, da)));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
}

// Q6_K's 4 codes of 16 rows for quarter `quarter` of a half: the nibble (quarter / 2) of ql chunk `ql`, topped by bit
// pair `quarter` of qh chunk `qh`, in [0, 63].
OB_TARGET inline __m512i q6_k_codes(__m512i ql, __m512i qh, int quarter) {
  const __m512i low = _mm512_and_si512(quarter >= 2 ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(0x0F));
  const __m512i top = _mm512_and_si512(_mm512_srli_epi16(qh, 2 * quarter), _mm512_set1_epi8(0x03));
  return _mm512_or_si512(low, _mm512_slli_epi16(top, 4));
}

// One Q6_Kx16 group against R activation rows (Q8_K). Sub-block s (16 values) of half h = s / 8 takes ql bytes
// 64h + 32 (quarter % 2) + 16 (s % 2) .. and qh bytes 32h + 16 (s % 2) .., quarter = (s % 8) / 2: chunk triple
// t = 8h + 4 (s % 2) + i (i = 0..3) of the layout holds those 4 bytes of ql, of ql 32 further and of qh, for all 4
// quarters. The codes meet the activations unsigned; 32 times the activations' sum of 16 is taken off, then the sum
// is multiplied by the sub-block's int8 scale: per lane the scalar kernel's exact isum, then its float operations in
// its order (bit for bit).
template <int R>
OB_TARGET void q6_k_group(const uint8_t* group, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<kQ6_K>;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    const __m512 dw = scales16(blk + L::kScales);
    __m512i sc[16];  // sub-block s: int8 byte s % 4 of scale chunk s / 4, sign-extended
    for (int s = 0; s < 16; ++s) {
      const __m512i word = _mm512_loadu_si512(blk + L::kSubScales + (s / 4) * kChunkBytes);
      sc[s] = _mm512_srai_epi32(_mm512_slli_epi32(word, 24 - 8 * (s % 4)), 24);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* q = a[r].q + b * QK_K;
      const int16_t* bs = a[r].bsums + b * (QK_K / 16);
      __m512i isum = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        for (int half_sub = 0; half_sub < 2; ++half_sub) {  // the first or second 16 values of each quarter
          __m512i sums[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                             _mm512_setzero_si512()};
          for (int i = 0; i < 4; ++i) {
            const uint8_t* triple = blk + L::kCodes + 3 * (8 * h + 4 * half_sub + i) * kChunkBytes;
            const __m512i ql0 = _mm512_loadu_si512(triple), ql1 = _mm512_loadu_si512(triple + kChunkBytes);
            const __m512i qh = _mm512_loadu_si512(triple + 2 * kChunkBytes);
            for (int quarter = 0; quarter < 4; ++quarter) {
              const __m512i codes = q6_k_codes(quarter % 2 ? ql1 : ql0, qh, quarter);
              sums[quarter] = dot_add(sums[quarter], codes, broadcast4(q + 128 * h + 32 * quarter + 16 * half_sub + 4 * i));
            }
          }
          for (int quarter = 0; quarter < 4; ++quarter) {
            const int s = 8 * h + 2 * quarter + half_sub;
            const __m512i centred = _mm512_sub_epi32(sums[quarter], _mm512_set1_epi32(32 * bs[s]));
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(centred, sc[s]));
          }
        }
      }
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b]))));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
}

// One IQ4_XSx16 group against R activation rows (Q8_K): the indices become kIq4nlValues by a table lookup
// (`vpshufb`); with VNNI they meet the activations as unsigned w + 128 (one xor) and 128 times the sub-block's
// activation sum is taken off, without it |w| meets the activation with w's sign moved onto it. Each sub-block's
// exact sum times its 6-bit scale less 32, then the scalar kernel's float operations: bit for bit.
template <int R>
OB_TARGET void iq4_xs_group(const uint8_t* group, const ActRow* a, int64_t nb, float* out, int64_t stride) {
  using L = Interleaved<kIQ4_XS>;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i values = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)));
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * L::kBytes;
    const __m512 dw = scales16(blk + L::kScales);
    const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L::kHigh)));
    const __m512i lows = _mm512_loadu_si512(blk + L::kLow);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = a[r].q + b * QK_K;
      const int16_t* bs = a[r].bsums + b * (QK_K / 16);
      __m512i isum = _mm512_setzero_si512();
      for (int s = 0; s < 8; ++s) {
        const __m512i ls = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi32(lows, 8 * (s / 2) + 4 * (s % 2)), _mm512_set1_epi32(0x0F)),
            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * s), _mm512_set1_epi32(3)), 4));
        __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int i = 0; i < 4; ++i) {
          const __m512i raw = _mm512_loadu_si512(blk + L::kCodes + (4 * s + i) * kChunkBytes);
          const __m512i w[2] = {_mm512_shuffle_epi8(values, _mm512_and_si512(raw, low)),
                                _mm512_shuffle_epi8(values, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low))};
          for (int part = 0; part < 2; ++part) {  // values 4i.. (low nibbles) and 16 + 4i.. (high)
            const __m512i act = broadcast4(q + 32 * s + 16 * part + 4 * i);
#if OB_VNNI
            sums[part] = _mm512_dpbusd_epi32(sums[part], _mm512_xor_si512(w[part], _mm512_set1_epi8(-128)), act);
#else
            const __mmask64 negative = _mm512_movepi8_mask(w[part]);
            sums[part] = dot_add(sums[part], _mm512_abs_epi8(w[part]),
                                 _mm512_mask_sub_epi8(act, negative, _mm512_setzero_si512(), act));
#endif
          }
        }
        __m512i sub = _mm512_add_epi32(sums[0], sums[1]);
#if OB_VNNI
        sub = _mm512_sub_epi32(sub, _mm512_set1_epi32(128 * (bs[2 * s] + bs[2 * s + 1])));
#endif
        isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(sub, _mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
      }
      const __m512 da = _mm512_set1_ps(a[r].d[b]);
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, da)));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
}

struct IQ4_XSGroup {
  template <int R>
  OB_TARGET static void run(const uint8_t* group, const ActRow* a, const int32_t* const*, int64_t nb, float* out,
                            int64_t stride) {
    iq4_xs_group<R>(group, a, nb, out, stride);
  }
};

struct Q4_KGroup {
  template <int R>
  OB_TARGET static void run(const uint8_t* group, const ActRow* a, const int32_t* const*, int64_t nb, float* out,
                            int64_t stride) {
    q4_k_group<R, kQ4_K>(group, a, nb, out, stride);
  }
};

struct Q5_KGroup {
  template <int R>
  OB_TARGET static void run(const uint8_t* group, const ActRow* a, const int32_t* const*, int64_t nb, float* out,
                            int64_t stride) {
    q4_k_group<R, kQ5_K>(group, a, nb, out, stride);
  }
};

struct Q6_KGroup {
  template <int R>
  OB_TARGET static void run(const uint8_t* group, const ActRow* a, const int32_t* const*, int64_t nb, float* out,
                            int64_t stride) {
    q6_k_group<R>(group, a, nb, out, stride);
  }
};

}  // namespace OB_CAT(x16_, OB_SUFFIX)

OB_TARGET void OB_CAT(dot_q4_kx16_, OB_SUFFIX)(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows,
                                     int64_t nb, float* out, int64_t stride) {
  namespace k = OB_CAT(x16_, OB_SUFFIX);
  k::each_group<k::Q4_KGroup>(w, row_bytes, cols, a, rows, nb, out, stride, false);
}

OB_TARGET void OB_CAT(dot_q5_kx16_, OB_SUFFIX)(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows,
                                     int64_t nb, float* out, int64_t stride) {
  namespace k = OB_CAT(x16_, OB_SUFFIX);
  k::each_group<k::Q5_KGroup>(w, row_bytes, cols, a, rows, nb, out, stride, false);
}

OB_TARGET void OB_CAT(dot_iq4_xsx16_, OB_SUFFIX)(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a,
                                       int rows, int64_t nb, float* out, int64_t stride) {
  namespace k = OB_CAT(x16_, OB_SUFFIX);
  k::each_group<k::IQ4_XSGroup>(w, row_bytes, cols, a, rows, nb, out, stride, false);
}

OB_TARGET void OB_CAT(dot_q6_kx16_, OB_SUFFIX)(const uint8_t* w, int64_t row_bytes, int cols, const ActRow* a, int rows,
                                     int64_t nb, float* out, int64_t stride) {
  namespace k = OB_CAT(x16_, OB_SUFFIX);
  k::each_group<k::Q6_KGroup>(w, row_bytes, cols, a, rows, nb, out, stride, false);
}

}  // namespace oneblock
