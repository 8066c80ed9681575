// The K-quants' group kernels for many activation rows (a prompt's), part of dot_kx16_avx512.h: a group's blocks
// are unpacked once into this thread's buffer, codes and scales, and every 8 rows read them from there, so the rows
// spend their time in the multiply-adds instead of rebuilding codes 8 rows at a time. The integers and the float
// operations are those of the one-pass kernels (q4_k_group, q6_k_group, iq4_xs_group), hence their results bit
// for bit. Then each format's group kernels under one name for `each_group`, and the exported products.

namespace oneblock {
namespace OB_CAT(x16_, OB_SUFFIX) {

// A super-block of 8 sub-blocks of 32 unpacked (Q4_Kx16, Q5_Kx16, IQ4_XSx16): sub-block s's 8 chunks of codes (16
// rows x 4 codes), its scales as int32, and (IQ4_XS) per lane what the unsigned activations add (see Q6_KCodes).
struct Codes32 {
  uint8_t codes[8][8][kChunkBytes];
  uint8_t scales[8][kChunkBytes];
  uint8_t bias[kChunkBytes];
};

template <int64_t Fmt>
OB_TARGET inline void q4_k_unpack(const uint8_t* blk, Codes32* u) {
  const Q4_KScales k = q4_k_scales(blk + Interleaved<Fmt>::kPacked);
  for (int s = 0; s < 8; ++s) {
    __m512i w[8];
    sub_block_codes<Fmt>(blk, s, w);
    for (int i = 0; i < 8; ++i) _mm512_storeu_si512(u->codes[s][i], w[i]);
    _mm512_storeu_si512(u->scales[s], byte_of(s < 4 ? k.sc_lo : k.sc_hi, s % 4));
  }
}

// q4_k_group<R, Fmt> from the group's unpacked blocks (`codes`, nb of them): the same integers and float operations.
template <int R, int64_t Fmt>
OB_TARGET void q4_k_rows(const uint8_t* group, const Codes32* codes, const ActRow* a, int64_t nb, float* out,
                         int64_t stride) {
  using L = Interleaved<Fmt>;
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, _mm512_setzero_ps());
  for (int64_t b = 0; b < nb; ++b) {
    const Codes32& u = codes[b];
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {
      __m512i w[8];
      for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(u.codes[s][i]);
      const __m512i sc = _mm512_loadu_si512(u.scales[s]);
      for (int r = 0; r < R; ++r) {
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sums32(w, a[r].q + b * QK_K + 32 * s), sc));
      }
    }
    const uint8_t* blk = group + b * L::kBytes;
    q4_k_finish<R, Fmt>(blk, q4_k_scales(blk + L::kPacked), a, b, isum, out, stride);
  }
}

// The exact sums of 4 code chunks (16 signed codes per lane) with 16 activation codes given unsigned (code + 128).
OB_TARGET inline __m512i sums16_unsigned(const __m512i* w, const uint8_t* u) {
  const int8_t* q = reinterpret_cast<const int8_t*>(u);
  const __m512i s0 = dot_add(dot_add(_mm512_setzero_si512(), broadcast4(q), w[0]), broadcast4(q + 8), w[2]);
  const __m512i s1 = dot_add(dot_add(_mm512_setzero_si512(), broadcast4(q + 4), w[1]), broadcast4(q + 12), w[3]);
  return _mm512_add_epi32(s0, s1);
}

// Per lane, the sum of the 4 bytes of each 32-bit word of w (signed), added to acc.
OB_TARGET inline __m512i add_word_sums(__m512i acc, __m512i w) { return dot_add(acc, _mm512_set1_epi8(1), w); }

// A Q6_Kx16 block unpacked: sub-block s's 4 chunks of codes less 32 (16 rows x 4 codes, in [-32, 31]), its int8
// scales as int32, and per lane `bias`: 128 times the sum over s of scale s times the sub-block's code sum. The
// activations meet the codes unsigned, code + 128 (ActRow::u), so each sub-block's sum is 128 times its code sum
// over the exact one; `bias` takes that off once per block and row, where the one-pass kernel takes 32 times the
// activations' sums of 16 off (8 pair multiply-adds per row and block).
struct Q6_KCodes {
  uint8_t codes[16][4][kChunkBytes];
  uint8_t scales[16][kChunkBytes];
  uint8_t bias[kChunkBytes];
};

OB_TARGET inline void q6_k_unpack(const uint8_t* blk, Q6_KCodes* u) {
  using L = Interleaved<kQ6_K>;
  const __m512i offset = _mm512_set1_epi8(32);
  __m512i bias = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    for (int half_sub = 0; half_sub < 2; ++half_sub) {
      const uint8_t* triples = blk + L::kCodes + 3 * (8 * h + 4 * half_sub) * kChunkBytes;
#pragma GCC unroll 4
      for (int quarter = 0; quarter < 4; ++quarter) {
        const int s = 8 * h + 2 * quarter + half_sub;
        __m512i sum = _mm512_setzero_si512();
        for (int i = 0; i < 4; ++i) {
          const uint8_t* triple = triples + 3 * i * kChunkBytes;
          const __m512i ql = _mm512_loadu_si512(triple + (quarter % 2) * kChunkBytes);
          const __m512i code = q6_k_codes(ql, _mm512_loadu_si512(triple + 2 * kChunkBytes), quarter);
          const __m512i centred = _mm512_sub_epi8(code, offset);
          _mm512_storeu_si512(u->codes[s][i], centred);
          sum = add_word_sums(sum, centred);
        }
        const __m512i scale = q6_k_scale(blk + L::kSubScales, s);
        _mm512_storeu_si512(u->scales[s], scale);
        bias = _mm512_add_epi32(bias, _mm512_mullo_epi32(sum, scale));
      }
    }
  }
  _mm512_storeu_si512(u->bias, _mm512_slli_epi32(bias, 7));
}

// q6_k_group<R> from the group's unpacked blocks (`codes`, nb of them) and the activations unsigned: per lane the
// same exact integer, then the same float operations.
template <int R>
OB_TARGET void q6_k_rows(const uint8_t* group, const Q6_KCodes* codes, const ActRow* a, int64_t nb, float* out,
                         int64_t stride) {
  using L = Interleaved<kQ6_K>;
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, _mm512_setzero_ps());
  for (int64_t b = 0; b < nb; ++b) {
    const Q6_KCodes& u = codes[b];
    __m512i isum[R];
    const __m512i bias = _mm512_loadu_si512(u.bias);
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int s = 0; s < 16; ++s) {
      __m512i w[4];
      for (int i = 0; i < 4; ++i) w[i] = _mm512_loadu_si512(u.codes[s][i]);
      const __m512i sc = _mm512_loadu_si512(u.scales[s]);
      for (int r = 0; r < R; ++r) {
        const __m512i sum = sums16_unsigned(w, a[r].u + b * QK_K + 16 * s);
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sum, sc));
      }
    }
    for (int r = 0; r < R; ++r) isum[r] = _mm512_sub_epi32(isum[r], bias);
    q6_k_scale_rows<R>(group + b * L::kBytes, a, b, isum, out, stride);
  }
}

#if OB_VNNI
// An IQ4_XSx16 block unpacked (VNNI): sub-block s's values w (kIq4nlValues looked up, signed), its scale less 32,
// and the bias of the unsigned activations: 128 times the sum over s of scale s times the sub-block's value sum.
OB_TARGET inline void iq4_xs_unpack(const uint8_t* blk, Codes32* u) {
  using L = Interleaved<kIQ4_XS>;
  const __m512i values = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)));
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L::kHigh)));
  const __m512i lows = _mm512_loadu_si512(blk + L::kLow);
  __m512i bias = _mm512_setzero_si512();
  for (int s = 0; s < 8; ++s) {
    const __m512i ls = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32(lows, 8 * (s / 2) + 4 * (s % 2)), _mm512_set1_epi32(0x0F)),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * s), _mm512_set1_epi32(3)), 4));
    const __m512i scale = _mm512_sub_epi32(ls, _mm512_set1_epi32(32));
    _mm512_storeu_si512(u->scales[s], scale);
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      const __m512i raw = _mm512_loadu_si512(blk + L::kCodes + (4 * s + i) * kChunkBytes);
      const __m512i w_low = _mm512_shuffle_epi8(values, _mm512_and_si512(raw, low));
      const __m512i w_high = _mm512_shuffle_epi8(values, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
      _mm512_storeu_si512(u->codes[s][i], w_low);
      _mm512_storeu_si512(u->codes[s][i + 4], w_high);
      sum = add_word_sums(add_word_sums(sum, w_low), w_high);
    }
    bias = _mm512_add_epi32(bias, _mm512_mullo_epi32(sum, scale));
  }
  _mm512_storeu_si512(u->bias, _mm512_slli_epi32(bias, 7));
}

// iq4_xs_group<R> from the group's unpacked blocks (`codes`, nb of them) and the activations unsigned: per lane the
// same exact integer, then the same float operations.
template <int R>
OB_TARGET void iq4_xs_rows(const uint8_t* group, const Codes32* codes, const ActRow* a, int64_t nb, float* out,
                           int64_t stride) {
  using L = Interleaved<kIQ4_XS>;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Codes32& u = codes[b];
    const __m512i bias = _mm512_loadu_si512(u.bias);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {
      __m512i w[8];
      for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(u.codes[s][i]);
      const __m512i scale = _mm512_loadu_si512(u.scales[s]);
      for (int r = 0; r < R; ++r) {
        const uint8_t* q = a[r].u + b * QK_K + 32 * s;
        const __m512i sum = _mm512_add_epi32(sums16_unsigned(w, q), sums16_unsigned(w + 4, q + 16));
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sum, scale));
      }
    }
    const __m512 dw = scales16(group + b * L::kBytes + L::kScales);
    for (int r = 0; r < R; ++r) {
      const __m512i exact = _mm512_sub_epi32(isum[r], bias);
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b]))));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * stride, acc[r]);
}
#endif

struct IQ4_XSGroup {
  template <int R>
  OB_TARGET static void run(const uint8_t* group, const ActRow* a, const int32_t* const*, int64_t nb, float* out,
                            int64_t stride) {
    iq4_xs_group<R>(group, a, nb, out, stride);
  }
#if OB_VNNI
  using Codes = Codes32;
  static constexpr bool kUnsignedActs = true;
  OB_TARGET static const Codes* unpack(const uint8_t* group, int64_t nb) {
    return unpack_group<Codes, kIQ4_XS, iq4_xs_unpack>(group, nb);
  }
  template <int R>
  OB_TARGET static void run_unpacked(const uint8_t* group, const Codes* codes, const ActRow* a, const int32_t* const*,
                                     int64_t nb, float* out, int64_t stride) {
    iq4_xs_rows<R>(group, codes, a, nb, out, stride);
  }
#endif
};

// Q4_K (Fmt kQ4_K) or Q5_K (kQ5_K).
template <int64_t Fmt>
struct Q4_KGroupOf {
  using Codes = Codes32;
  static constexpr bool kUnsignedActs = false;
  template <int R>
  OB_TARGET static void run(const uint8_t* group, const ActRow* a, const int32_t* const*, int64_t nb, float* out,
                            int64_t stride) {
    q4_k_group<R, Fmt>(group, a, nb, out, stride);
  }
  OB_TARGET static const Codes* unpack(const uint8_t* group, int64_t nb) {
    return unpack_group<Codes, Fmt, q4_k_unpack<Fmt>>(group, nb);
  }
  template <int R>
  OB_TARGET static void run_unpacked(const uint8_t* group, const Codes* codes, const ActRow* a, const int32_t* const*,
                                     int64_t nb, float* out, int64_t stride) {
    q4_k_rows<R, Fmt>(group, codes, a, nb, out, stride);
  }
};
using Q4_KGroup = Q4_KGroupOf<kQ4_K>;
using Q5_KGroup = Q4_KGroupOf<kQ5_K>;

struct Q6_KGroup {
  using Codes = Q6_KCodes;
  static constexpr bool kUnsignedActs = true;
  template <int R>
  OB_TARGET static void run(const uint8_t* group, const ActRow* a, const int32_t* const*, int64_t nb, float* out,
                            int64_t stride) {
    q6_k_group<R>(group, a, nb, out, stride);
  }
  OB_TARGET static const Codes* unpack(const uint8_t* group, int64_t nb) {
    return unpack_group<Codes, kQ6_K, q6_k_unpack>(group, nb);
  }
  template <int R>
  OB_TARGET static void run_unpacked(const uint8_t* group, const Codes* codes, const ActRow* a, const int32_t* const*,
                                     int64_t nb, float* out, int64_t stride) {
    q6_k_rows<R>(group, codes, a, nb, out, stride);
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
