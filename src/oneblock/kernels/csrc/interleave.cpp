// oneblock::interleave_rows(Tensor blocks, int fmt) -> Tensor: a Q4_1 or Q8_0 matrix's rows in the interleaved
// layout of interleaved.h, moved with plain loops, one group of 16 rows per task (kernels/interleave.py renders the
// same layout with tensor permutes, which move one byte at a time and cost seconds on a whole model at load).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstring>

#include "interleaved.h"

namespace oneblock {
namespace {

at::Tensor interleave_rows(const at::Tensor& blocks_in, int64_t fmt) {
  TORCH_CHECK(fmt == kQ4_1 || fmt == kQ8_0, "oneblock::interleave_rows: only q4_1 (3) and q8_0 (8); got ", fmt);
  TORCH_CHECK(blocks_in.dim() == 2 && blocks_in.scalar_type() == at::kByte,
              "oneblock::interleave_rows: blocks must be (N, K/32 * nbytes) uint8");
  const at::Tensor blocks = blocks_in.contiguous();
  const int64_t n = blocks.size(0), row_bytes = blocks.size(1), nbytes = block_bytes(fmt);
  TORCH_CHECK(n % kGroupRows == 0 && row_bytes % nbytes == 0,
              "oneblock::interleave_rows: rows must be a multiple of 16 and whole blocks; got ", blocks.sizes());
  const int64_t nb = row_bytes / nbytes, halves = fmt == kQ4_1 ? 2 : 1, chunks = (nbytes - 2 * halves) / 4;
  at::Tensor out = at::empty_like(blocks);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n / kGroupRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* o = dst + (g * nb + b) * kGroupRows * nbytes;  // block b of group g: 16 blocks' bytes
        for (int r = 0; r < kGroupRows; ++r) {
          const uint8_t* in = src + (g * kGroupRows + r) * row_bytes + b * nbytes;
          for (int64_t f = 0; f < halves; ++f) std::memcpy(o + f * 32 + 2 * r, in + 2 * f, 2);
          for (int64_t c = 0; c < chunks; ++c) {
            std::memcpy(o + 32 * halves + c * kChunkBytes + 4 * r, in + 2 * halves + 4 * c, 4);
          }
        }
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace oneblock

TORCH_LIBRARY_FRAGMENT(oneblock, m) { m.def("interleave_rows(Tensor blocks, int fmt) -> Tensor"); }
TORCH_LIBRARY_IMPL(oneblock, CPU, m) { m.impl("interleave_rows", &oneblock::interleave_rows); }
