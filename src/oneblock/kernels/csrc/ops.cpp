// The operators, their CPU implementations and the instruction-set dispatch.
//
//   oneblock::block_mm(Tensor x, Tensor blocks, int fmt) -> Tensor            (M, K) float32 -> (M, N) float32
//   oneblock::dequantize_rows(Tensor blocks, Tensor rows, int fmt) -> Tensor  -> (*rows.shape, K) float32
//
// block_mm quantizes each activation row once per call, then splits the N weight rows over ATen's threads.
// Each thread walks its rows in tiles small enough to stay in cache while every group of up to 4 activation
// rows passes over them, so a prompt (M > 1) reads each weight once per call, not once per row.
//
// From kGemmRows activation rows up, integer dots lose to a float GEMM (measured: at M = 64 the integer kernel
// takes 1.5x the time of dequantizing a tile of W and calling at::mm, 2.5x at M = 256), so block_mm returns
// x @ dequantize(W)^T computed one tile of W at a time. Below the threshold a row's result never depends on M;
// decoding (one row per sequence, batches below 32) always stays below it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <atomic>
#include <string>
#include <vector>

#include "dot.h"

namespace oneblock {

at::Tensor dequantize_rows(const at::Tensor& blocks, const at::Tensor& rows, int64_t fmt);

namespace {

const char* const kIsaNames[kIsaCount] = {"scalar", "avx2", "avx512", "avx512_vnni"};

bool supported(int isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return avx2;
    case kAvx512: return avx512;
    case kAvx512Vnni: return avx512 && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

int best() {
  for (int isa = kIsaCount - 1; isa > kScalar; --isa) {
    if (supported(isa)) return isa;
  }
  return kScalar;
}

std::atomic<int> g_isa{best()};  // chosen once, at load, from what the CPU reports

// kernels[isa][format]: format 0 = Q4_0, 1 = Q4_1, 2 = Q8_0.
const DotFn kKernels[kIsaCount][3] = {
    {dot_q4_0_scalar, dot_q4_1_scalar, dot_q8_0_scalar},
    {dot_q4_0_avx2, dot_q4_1_avx2, dot_q8_0_avx2},
    {dot_q4_0_avx512, dot_q4_1_avx512, dot_q8_0_avx512},
    {dot_q4_0_avx512_vnni, dot_q4_1_avx512_vnni, dot_q8_0_avx512_vnni},
};

DotFn kernel_for(int64_t fmt) {
  const int column = fmt == kQ4_0 ? 0 : fmt == kQ4_1 ? 1 : 2;
  return kKernels[g_isa.load(std::memory_order_relaxed)][column];
}

constexpr int64_t kGemmRows = 32;       // from this many activation rows up: tiles of float W and at::mm
constexpr int64_t kGemmTileValues = 1 << 19;  // weights dequantized at once: 2 MB of float32
constexpr int kRowsPerCall = 4;        // activation rows sharing a weight row, or weight rows one activation row
constexpr int64_t kGrainBytes = 65536;  // the least work worth a thread
constexpr int64_t kTileBytes = 16384;  // weight rows per tile: about 16 KB, resident in L1 while M is swept

constexpr int64_t kPrefetchRows = 2 * kRowsPerCall;  // how far ahead decoding asks for weight rows
constexpr int64_t kPrefetchRowBytes = 640;            // ... when they are this short or shorter

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 0);
}

// x (M, K) @ W^T with W dequantized one tile of rows at a time (M >= kGemmRows).
at::Tensor block_mm_dense(const at::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t fmt) {
  const int64_t m = x.size(0), k = x.size(1), nb = k / QK;
  at::Tensor out = at::empty({m, n}, x.options());
  const int64_t rows = std::min(n, std::max<int64_t>(1, kGemmTileValues / k));
  at::Tensor tile = at::empty({rows, k}, x.options());
  float* t = tile.data_ptr<float>();
  for (int64_t n0 = 0; n0 < n; n0 += rows) {
    const int64_t count = std::min(rows, n - n0);
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) decode_row(w + (n0 + i) * row_bytes, fmt, nb, t + i * k);
    });
    out.narrow(1, n0, count).copy_(at::mm(x, tile.narrow(0, 0, count).t()));  // (M, count)
  }
  return out;
}

at::Tensor block_mm(const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t fmt) {
  const int64_t nbytes = block_bytes(fmt);
  TORCH_CHECK(nbytes > 0, "oneblock::block_mm: unknown format id ", fmt);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "oneblock::block_mm: x must be (M, K) float32");
  TORCH_CHECK(blocks_in.dim() == 2 && blocks_in.scalar_type() == at::kByte,
              "oneblock::block_mm: blocks must be (N, K/32 * nbytes) uint8");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor blocks = blocks_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(k % QK == 0 && blocks.size(1) == k / QK * nbytes, "oneblock::block_mm: x has K = ", k,
              " but the blocks hold rows of ", blocks.size(1), " bytes (", nbytes, " per 32 values)");
  const int64_t nb = k / QK, row_bytes = blocks.size(1);
  if (m >= kGemmRows && n > 0 && k > 0) return block_mm_dense(x, blocks.data_ptr<uint8_t>(), row_bytes, n, fmt);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  if (k == 0) return out.zero_();

  // 1. Activations: each row quantized once, used against all N weight rows.
  const bool sums = fmt == kQ4_1;
  std::vector<int8_t> q(static_cast<size_t>(m * k));
  std::vector<float> d(static_cast<size_t>(m * nb)), s(sums ? static_cast<size_t>(m * nb) : 0);
  const float* xs = x.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      quantize_row_q8(xs + i * k, k, q.data() + i * k, d.data() + i * nb, sums ? s.data() + i * nb : nullptr);
    }
  });
  std::vector<ActRow> acts(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) acts[i] = {q.data() + i * k, d.data() + i * nb, sums ? s.data() + i * nb : nullptr};

  // 2. Weight rows over the threads; within a thread, tiles of rows swept by groups of activation rows.
  const DotFn dot = kernel_for(fmt);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  const int64_t tile = std::max<int64_t>(1, kTileBytes / row_bytes);
  // A thread gets at least kGrainBytes of weights (times the rows of x): waking one costs microseconds.
  const int64_t grain = std::max<int64_t>(16, kGrainBytes / (row_bytes * m));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    if (m == 1) {  // decoding: 4 weight rows at a time, independent accumulators keep the core busy
      for (int64_t j = begin; j < end; j += kRowsPerCall) {
        const int cols = static_cast<int>(std::min<int64_t>(kRowsPerCall, end - j));
        // Rows of a few hundred bytes are too short for the hardware prefetcher to follow: ask for the rows
        // two groups ahead, so they arrive from memory while these are multiplied. (Measured: faster for
        // K = 576 rows, slower for K = 1536 rows, which the hardware follows alone.)
        if (row_bytes <= kPrefetchRowBytes) {
          const int64_t ahead = std::min(end, j + kPrefetchRows);
          prefetch(w + ahead * row_bytes, std::min<int64_t>(end - ahead, kRowsPerCall) * row_bytes);
        }
        dot(w + j * row_bytes, row_bytes, cols, acts.data(), 1, nb, y + j, n);
      }
      return;
    }
    for (int64_t n0 = begin; n0 < end; n0 += tile) {
      const int64_t n1 = std::min(end, n0 + tile);
      for (int64_t m0 = 0; m0 < m; m0 += kRowsPerCall) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsPerCall, m - m0));
        for (int64_t j = n0; j < n1; ++j) {
          dot(w + j * row_bytes, row_bytes, 1, acts.data() + m0, rows, nb, y + m0 * n + j, n);
        }
      }
    }
  });
  return out;
}

std::string isa() { return kIsaNames[g_isa.load()]; }
std::string best_isa() { return kIsaNames[best()]; }
bool isa_supported(int64_t isa) { return supported(static_cast<int>(isa)); }
void set_isa(int64_t isa) {
  TORCH_CHECK(supported(static_cast<int>(isa)), "oneblock::set_isa: this CPU cannot run instruction set ", isa);
  g_isa.store(static_cast<int>(isa));
}

}  // namespace

DotFn dot_kernel(int64_t fmt) { return kernel_for(fmt); }

}  // namespace oneblock

TORCH_LIBRARY(oneblock, m) {
  m.def("block_mm(Tensor x, Tensor blocks, int fmt) -> Tensor");
  m.def("dequantize_rows(Tensor blocks, Tensor rows, int fmt) -> Tensor");
  m.def("isa() -> str", &oneblock::isa);
  m.def("best_isa() -> str", &oneblock::best_isa);
  m.def("isa_supported(int isa) -> bool", &oneblock::isa_supported);
  m.def("set_isa(int isa) -> ()", &oneblock::set_isa);
}

TORCH_LIBRARY_IMPL(oneblock, CPU, m) {
  m.impl("block_mm", &oneblock::block_mm);
  m.impl("dequantize_rows", &oneblock::dequantize_rows);
}
