// Rows of a block matrix back to float32, in the file's layout or an interleaved one: the embedding lookup of a
// quantized token table, and the tiles the backward of block_mm multiplies. The values are d * q (+ m), one float operation each, as formats.py decodes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "dot.h"

namespace oneblock {

void decode_row(const uint8_t* row, int64_t fmt, int64_t nb, float* out) {
  if (is_float_format(fmt)) {  // nb values of two bytes: widened exactly
    widen_row(row, fmt == kBF16, nb, out);
    return;
  }
  if (fmt == kQ6_K) {
    for (int64_t b = 0; b < nb; ++b, out += QK_K) {
      const auto& blk = reinterpret_cast<const BlockQ6_K*>(row)[b];
      const float d = g_half[load_u16(&blk.d)];
      float ds[QK_K / 16];
      for (int i = 0; i < QK_K / 16; ++i) ds[i] = d * static_cast<float>(blk.scales[i]);
      for (int h = 0; h < 2; ++h) {  // q6_k_code's layout, byte by byte: 4 values per byte l of each half
        const uint8_t *ql = blk.ql + 64 * h, *qh = blk.qh + 32 * h;
        float* o = out + 128 * h;
        const float* sc = ds + 8 * h;
        for (int l = 0; l < 32; ++l) {
          o[l] = sc[l / 16] * static_cast<float>(((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32);
          o[l + 32] = sc[2 + l / 16] * static_cast<float>(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
          o[l + 64] = sc[4 + l / 16] * static_cast<float>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          o[l + 96] = sc[6 + l / 16] * static_cast<float>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      }
    }
    return;
  }
  if (fmt == kQ4_K) {
    for (int64_t b = 0; b < nb; ++b, out += QK_K) {
      const auto& blk = reinterpret_cast<const BlockQ4_K*>(row)[b];
      const float d = g_half[load_u16(&blk.d)], dmin = g_half[load_u16(&blk.dmin)];
      for (int s = 0; s < QK_K / 32; ++s) {
        int sc, m;
        q4_k_scale_min(blk.scales, s, sc, m);
        const float ds = d * static_cast<float>(sc), ms = dmin * static_cast<float>(m);
        const uint8_t* qs = blk.qs + 32 * (s / 2);  // sub-block s: the low (s even) or high nibbles of 32 bytes
        for (int l = 0; l < 32; ++l) out[32 * s + l] = ds * static_cast<float>(s % 2 ? qs[l] >> 4 : qs[l] & 0x0F) - ms;
      }
    }
    return;
  }
  if (fmt == kQ5_K) {
    for (int64_t b = 0; b < nb; ++b, out += QK_K) {
      const auto& blk = reinterpret_cast<const BlockQ5_K*>(row)[b];
      const float d = g_half[load_u16(&blk.d)], dmin = g_half[load_u16(&blk.dmin)];
      for (int s = 0; s < QK_K / 32; ++s) {
        int sc, m;
        q4_k_scale_min(blk.scales, s, sc, m);
        const float ds = d * static_cast<float>(sc), ms = dmin * static_cast<float>(m);
        for (int t = 32 * s; t < 32 * s + 32; ++t) out[t] = ds * static_cast<float>(q5_k_code(blk, t)) - ms;
      }
    }
    return;
  }
  if (fmt == kIQ4_XS) {
    for (int64_t b = 0; b < nb; ++b, out += QK_K) {
      const auto& blk = reinterpret_cast<const BlockIQ4_XS*>(row)[b];
      const float d = g_half[load_u16(&blk.d)];
      for (int s = 0; s < QK_K / 32; ++s) {
        const float ds = d * static_cast<float>(iq4_xs_scale(blk, s));
        for (int t = 32 * s; t < 32 * s + 32; ++t) out[t] = ds * static_cast<float>(iq4_xs_value(blk, t));
      }
    }
    return;
  }
  for (int64_t b = 0; b < nb; ++b, out += QK) {
    if (fmt == kIQ4_NL) {
      const auto& blk = reinterpret_cast<const BlockIQ4_NL*>(row)[b];
      const float d = g_half[load_u16(&blk.d)];
      for (int j = 0; j < QK; ++j) out[j] = d * static_cast<float>(iq4_nl_value(blk, j));
    } else if (fmt == kQ8_0) {
      const auto& blk = reinterpret_cast<const BlockQ8_0*>(row)[b];
      const float d = g_half[load_u16(&blk.d)];
      for (int j = 0; j < QK; ++j) out[j] = d * static_cast<float>(blk.qs[j]);
    } else if (fmt == kQ4_0) {
      const auto& blk = reinterpret_cast<const BlockQ4_0*>(row)[b];
      const float d = g_half[load_u16(&blk.d)];
      for (int j = 0; j < QK / 2; ++j) {
        out[j] = d * static_cast<float>((blk.qs[j] & 0x0F) - 8);
        out[j + QK / 2] = d * static_cast<float>((blk.qs[j] >> 4) - 8);
      }
    } else if (fmt == kQ4_1) {
      const auto& blk = reinterpret_cast<const BlockQ4_1*>(row)[b];
      const float d = g_half[load_u16(&blk.d)];
      const float m = g_half[load_u16(&blk.m)];
      for (int j = 0; j < QK / 2; ++j) {
        out[j] = d * static_cast<float>(blk.qs[j] & 0x0F) + m;
        out[j + QK / 2] = d * static_cast<float>(blk.qs[j] >> 4) + m;
      }
    } else if (fmt == kQ5_0) {
      const auto& blk = reinterpret_cast<const BlockQ5_0*>(row)[b];
      const float d = g_half[load_u16(&blk.d)];
      const uint32_t qh = load_u32(blk.qh);
      for (int j = 0; j < QK; ++j) out[j] = d * static_cast<float>(q5_code(blk.qs, qh, j) - 16);
    } else {
      const auto& blk = reinterpret_cast<const BlockQ5_1*>(row)[b];
      const float d = g_half[load_u16(&blk.d)];
      const float m = g_half[load_u16(&blk.m)];
      const uint32_t qh = load_u32(blk.qh);
      for (int j = 0; j < QK; ++j) out[j] = d * static_cast<float>(q5_code(blk.qs, qh, j)) + m;
    }
  }
}

void decode_interleaved_row(const uint8_t* group, int lane, int64_t fmt, int64_t nb, float* out) {
  const int64_t base = file_format(fmt);
  if (base != kQ8_0 && base != kQ4_0 && base != kQ4_1) {  // the row's blocks put back, then decoded as the file's
    uint8_t blk[sizeof(BlockQ6_K)];
    for (int64_t b = 0; b < nb; ++b, out += block_values(base)) {
      gather_block(group, lane, base, b, blk);
      decode_row(blk, base, 1, out);
    }
    return;
  }
  for (int64_t b = 0; b < nb; ++b, out += QK) {
    if (file_format(fmt) == kQ8_0) {
      using L = Interleaved<kQ8_0>;
      const uint8_t* blk = group + b * L::kBytes;
      const float d = g_half[load_u16(blk + L::kScales + 2 * lane)];
      for (int j = 0; j < QK; ++j) {
        out[j] = d * static_cast<float>(static_cast<int8_t>(blk[L::kCodes + (j / 4) * kChunkBytes + lane * 4 + j % 4]));
      }
    } else if (file_format(fmt) == kQ4_0) {
      using L = Interleaved<kQ4_0>;
      const uint8_t* blk = group + b * L::kBytes;
      const float d = g_half[load_u16(blk + L::kScales + 2 * lane)];
      for (int j = 0; j < QK / 2; ++j) {
        const uint8_t v = blk[L::kCodes + (j / 4) * kChunkBytes + lane * 4 + j % 4];
        out[j] = d * static_cast<float>((v & 0x0F) - 8);
        out[j + QK / 2] = d * static_cast<float>((v >> 4) - 8);
      }
    } else {
      using L = Interleaved<kQ4_1>;
      const uint8_t* blk = group + b * L::kBytes;
      const float d = g_half[load_u16(blk + L::kScales + 2 * lane)];
      const float m = g_half[load_u16(blk + L::kMins + 2 * lane)];
      for (int j = 0; j < QK / 2; ++j) {
        const uint8_t v = blk[L::kCodes + (j / 4) * kChunkBytes + lane * 4 + j % 4];
        out[j] = d * static_cast<float>(v & 0x0F) + m;
        out[j + QK / 2] = d * static_cast<float>(v >> 4) + m;
      }
    }
  }
}

at::Tensor dequantize_rows(const at::Tensor& blocks, const at::Tensor& rows, int64_t fmt) {
  const bool interleaved = is_interleaved(fmt);
  const int64_t nbytes = interleaved || !(fmt & kInterleaved) ? block_bytes(file_format(fmt)) : 0;
  TORCH_CHECK(nbytes > 0, "oneblock::dequantize_rows: unknown format id ", fmt);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.size(1) % nbytes == 0,
              "oneblock::dequantize_rows: blocks must be (N, K/", block_values(file_format(fmt)), " * ", nbytes, ") uint8");
  TORCH_CHECK(rows.scalar_type() == at::kLong, "oneblock::dequantize_rows: rows must be int64");
  const at::Tensor w = blocks.contiguous();
  const at::Tensor index = rows.contiguous();
  const int64_t n = w.size(0), row_bytes = w.size(1), nb = row_bytes / nbytes, k = nb * block_values(file_format(fmt));
  const int64_t count = index.numel();
  const int64_t* ids = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < n, "oneblock::dequantize_rows: row index ", ids[i], " outside [0, ", n, ")");
  }
  TORCH_CHECK(!interleaved || n % kGroupRows == 0, "oneblock::dequantize_rows: an interleaved matrix has a multiple of ",
              kGroupRows, " rows; got ", n);
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, w.options().dtype(at::kFloat));
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (interleaved) {
        const int64_t group = ids[i] / kGroupRows * kGroupRows;
        decode_interleaved_row(src + group * row_bytes, static_cast<int>(ids[i] - group), fmt, nb, dst + i * k);
      } else {
        decode_row(src + ids[i] * row_bytes, fmt, nb, dst + i * k);
      }
    }
  });
  return out;
}

}  // namespace oneblock
