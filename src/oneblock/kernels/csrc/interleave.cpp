// oneblock::interleave_rows(Tensor blocks, int fmt) -> Tensor: a Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K or IQ4_XS matrix's rows in the interleaved
// layout of interleaved.h, moved with plain loops, one group of 16 rows per task (kernels/interleave.py renders the
// same layout with tensor permutes, which move one byte at a time and cost seconds on a whole model at load).
//
// oneblock::interleave_parts(Tensor[] parts, Tensor? order, int fmt) -> Tensor: the same layout of the row-wise
// concatenation of `parts`, its rows taken in `order` (int64 indexes into the concatenation; none: in turn), read
// straight from the parts: a loader stacks and reorders the file's matrices (q/k/v, gate/up, the rotary halves of
// q and k) in this one pass over the mapped file, with no stacked or reordered copy in between.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "interleaved.h"

namespace oneblock {
namespace {

constexpr int64_t kLeastTaskBytes = 1 << 20;

// Writes the interleaved layout of the n rows at rows[0..n) (each row_bytes long) to dst.
void interleave_into(const std::vector<const uint8_t*>& rows, int64_t row_bytes, int64_t fmt, uint8_t* dst) {
  const int64_t n = static_cast<int64_t>(rows.size()), nbytes = block_bytes(fmt);
  const int64_t nb = row_bytes / nbytes, halves = half_fields(fmt), chunks = (nbytes - 2 * halves) / 4;
  // A team's fork and join costs more than moving a small matrix: a task moves at least kLeastTaskBytes.
  const int64_t grain = std::max<int64_t>(1, kLeastTaskBytes / (kGroupRows * row_bytes));
  at::parallel_for(0, n / kGroupRows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* o = dst + (g * nb + b) * kGroupRows * nbytes;  // block b of group g: 16 blocks' bytes
        for (int r = 0; r < kGroupRows; ++r) {
          const uint8_t* in = rows[g * kGroupRows + r] + b * nbytes;
          for (int64_t f = 0; f < halves; ++f) std::memcpy(o + f * 32 + 2 * r, in + half_at(fmt) + 2 * f, 2);
          for (int64_t c = 0; c < chunks; ++c) {
            std::memcpy(o + 32 * halves + c * kChunkBytes + 4 * r, in + chunk_byte(fmt, 4 * source_chunk(fmt, c)), 4);
          }
        }
      }
    }
  });
}

void check_format(int64_t fmt, const char* op) {
  TORCH_CHECK(fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ8_0 || fmt == kQ5_0 || fmt == kQ4_K || fmt == kQ5_K ||
                  fmt == kQ6_K || fmt == kIQ4_XS,
              "oneblock::", op, ": only q4_0 (2), q4_1 (3), q5_0 (6), q8_0 (8), q4_k (12), q5_k (13), q6_k (14) and iq4_xs (23); got ",
              fmt);
}

at::Tensor interleave_rows(const at::Tensor& blocks_in, int64_t fmt) {
  check_format(fmt, "interleave_rows");
  TORCH_CHECK(blocks_in.dim() == 2 && blocks_in.scalar_type() == at::kByte,
              "oneblock::interleave_rows: blocks must be (N, K/32 * nbytes) uint8");
  const at::Tensor blocks = blocks_in.contiguous();
  const int64_t n = blocks.size(0), row_bytes = blocks.size(1);
  TORCH_CHECK(n % kGroupRows == 0 && row_bytes % block_bytes(fmt) == 0,
              "oneblock::interleave_rows: rows must be a multiple of 16 and whole blocks; got ", blocks.sizes());
  std::vector<const uint8_t*> rows(n);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) rows[i] = src + i * row_bytes;
  at::Tensor out = at::empty({n, row_bytes}, blocks.options());
  interleave_into(rows, row_bytes, fmt, out.data_ptr<uint8_t>());
  return out;
}

at::Tensor interleave_parts(at::TensorList parts, const std::optional<at::Tensor>& order, int64_t fmt) {
  check_format(fmt, "interleave_parts");
  TORCH_CHECK(!parts.empty(), "oneblock::interleave_parts: no parts");
  const int64_t row_bytes = parts[0].dim() == 2 ? parts[0].size(1) : -1;
  std::vector<const uint8_t*> stacked;
  for (const at::Tensor& part : parts) {
    TORCH_CHECK(part.dim() == 2 && part.scalar_type() == at::kByte && part.size(1) == row_bytes &&
                    (part.size(1) <= 1 || part.stride(1) == 1),
                "oneblock::interleave_parts: every part must be (rows, ", row_bytes,
                ") uint8 with contiguous rows; got ", part.sizes(), " ", part.scalar_type());
    const uint8_t* base = part.data_ptr<uint8_t>();
    for (int64_t i = 0; i < part.size(0); ++i) stacked.push_back(base + i * part.stride(0));
  }
  const int64_t n = static_cast<int64_t>(stacked.size());
  TORCH_CHECK(n % kGroupRows == 0 && row_bytes > 0 && row_bytes % block_bytes(fmt) == 0,
              "oneblock::interleave_parts: the stacked rows must be a multiple of 16 and whole blocks; got ", n,
              " rows of ", row_bytes, " bytes");
  std::vector<const uint8_t*> rows = stacked;
  if (order.has_value()) {
    const at::Tensor index = order->contiguous();
    TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong && index.numel() == n,
                "oneblock::interleave_parts: order must be (", n, ",) int64; got ", index.sizes(), " ",
                index.scalar_type());
    const int64_t* at = index.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(at[i] >= 0 && at[i] < n, "oneblock::interleave_parts: order[", i, "] = ", at[i],
                  " is outside the ", n, " stacked rows");
      rows[i] = stacked[at[i]];
    }
  }
  at::Tensor out = at::empty({n, row_bytes}, parts[0].options());
  interleave_into(rows, row_bytes, fmt, out.data_ptr<uint8_t>());
  return out;
}

}  // namespace

void gather_block(const uint8_t* group, int lane, int64_t fmt, int64_t b, uint8_t* out) {
  const int64_t nbytes = block_bytes(fmt), halves = half_fields(fmt), chunks = (nbytes - 2 * halves) / 4;
  const uint8_t* blk = group + b * kGroupRows * nbytes;
  for (int64_t f = 0; f < halves; ++f) std::memcpy(out + half_at(fmt) + 2 * f, blk + f * 32 + 2 * lane, 2);
  for (int64_t c = 0; c < chunks; ++c) {
    std::memcpy(out + chunk_byte(fmt, 4 * source_chunk(fmt, c)), blk + 32 * halves + c * kChunkBytes + 4 * lane, 4);
  }
}

}  // namespace oneblock

TORCH_LIBRARY_FRAGMENT(oneblock, m) {
  m.def("interleave_rows(Tensor blocks, int fmt) -> Tensor");
  m.def("interleave_parts(Tensor[] parts, Tensor? order, int fmt) -> Tensor");
}
TORCH_LIBRARY_IMPL(oneblock, CPU, m) {
  m.impl("interleave_rows", &oneblock::interleave_rows);
  m.impl("interleave_parts", &oneblock::interleave_parts);
}
