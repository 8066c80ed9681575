// The product operators and their CPU implementations (the kernels of the instruction set in use: dispatch.cpp).
//
//   oneblock::block_mm(Tensor x, Tensor blocks, int fmt) -> Tensor            (M, K) float32 -> (M, N) float32
//   oneblock::dequantize_rows(Tensor blocks, Tensor rows, int fmt) -> Tensor  -> (*rows.shape, K) float32
//
// block_mm quantizes each activation row once per call, then cuts the N weight rows into chunks that ATen's
// threads take from a shared counter. A chunk is small enough to stay in cache while every group of up to 4
// activation rows passes over it, so a prompt (M > 1) reads each weight once per call, not once per row. `fmt`
// is a GGUF type id (the file's layout) or an interleaved id (interleaved.h: 16 rows read together).
//
// From kGemmRows activation rows up, integer dots lose to a float GEMM (measured: at M = 64 the integer kernel
// takes 1.5x the time of dequantizing a tile of W and calling at::mm, 2.5x at M = 256), so block_mm returns
// x @ dequantize(W)^T computed one tile of W at a time. Below the threshold a row's result never depends on M;
// decoding (one row per sequence, batches below 32) always stays below it.
//
//   oneblock::block_mm_bf16(Tensor x, Tensor blocks, int fmt) -> Tensor       the same, with bfloat16 tiles
//
// is block_mm with the dense path's tiles and activations rounded to bfloat16 and multiplied by ATen's bfloat16
// GEMM (oneDNN, which runs it on AMX tiles where the CPU has them), each output rounded to bfloat16 and widened
// back; below kGemmRows rows it is block_mm exactly. A prompt's pass takes it where it is faster (see tiles.py).
//
//   oneblock::block_mm_int8(Tensor x, Tensor blocks, int fmt) -> Tensor       the integer kernels at every M
//   oneblock::block_mm_int8_out(Tensor x, Tensor blocks, int fmt, Tensor(a!) out) -> ()   the same, into `out`
//   oneblock::swiglu_int8_out(Tensor x, Tensor blocks, int fmt, Tensor(a!) out) -> ()   silu(gate) * up, (M, F)
//
// never takes the dense path: each row's result is the row's alone. Over the interleaved layouts, whose group
// kernels unpack a sub-block once for 8 activation rows, it is a prompt's fastest path where the CPU has AVX-512
// VNNI (measured on Zen 4: 1.5x the bfloat16 tiles on a Q4_K matrix of 16,384 x 2,048 at 496 rows).
//
// swiglu_int8_out takes the gated feed-forward's stacked [gate; up] matrix (2F rows, interleaved) and writes the
// hidden rows silu(x Wg^T) * (x Wu^T) without the (M, 2F) product: each chunk of 32 columns' gate products go into
// `out`, their up products into the thread's buffer, and ATen's own silu and multiply run over them (whole vectors,
// rows of a multiple of 32 values).
//
// An F16 or BF16 matrix (fmt 1 or 30: two bytes a value) takes none of these roundings: every op multiplies it in
// float32 (float_mm), its values widened exactly, the activations as given.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "dot.h"

namespace oneblock {

at::Tensor dequantize_rows(const at::Tensor& blocks, const at::Tensor& rows, int64_t fmt);

namespace {

constexpr int64_t kGemmRows = 32;       // from this many activation rows up: tiles of float W and at::mm
constexpr int64_t kGemmTileValues = 1 << 19;  // weights dequantized at once: 2 MB of float32
constexpr int kRowsPerCall = 4;        // activation rows sharing a weight row, or weight rows one activation row
constexpr int64_t kSerialBytes = 96 * 1024;  // below this much weight traffic (bytes x rows of x) one thread works
constexpr int64_t kLeastChunkBytes = 16384;  // the least weight bytes a chunk holds: about 16 KB, resident in L1
constexpr int64_t kChunksPerThread = 8;  // enough chunks that a descheduled thread's share is taken by the others

constexpr int64_t kPrefetchRows = 2 * kRowsPerCall;  // how far ahead decoding asks for weight rows
constexpr int64_t kPrefetchRowBytes = 640;            // ... when they are this short or shorter

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 0);
}

// body(begin, end) over [0, units) in chunks of `chunk` units. The threads take chunks from one counter (as
// ggml's mul_mat does), so a thread that the machine's other work holds up leaves its chunks to the others
// instead of making every thread wait at the join.
template <class Body>
void parallel_chunks(int64_t units, int64_t chunk, bool serial, const Body& body) {
  const int64_t count = (units + chunk - 1) / chunk;
  const int threads = serial ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), count));
  if (threads <= 1) {
    body(0, units);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < count;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      body(c * chunk, std::min(units, (c + 1) * chunk));
    }
  });
}

// Weight row i of the matrix at w, whichever layout, as float32.
void decode_any_row(const uint8_t* w, int64_t row_bytes, int64_t fmt, int64_t i, int64_t nb, float* out) {
  if (is_interleaved(fmt)) {
    decode_interleaved_row(w + (i / kGroupRows) * kGroupRows * row_bytes, static_cast<int>(i % kGroupRows), fmt, nb,
                           out);
  } else {
    decode_row(w + i * row_bytes, fmt, nb, out);
  }
}

// float32 -> bfloat16, rounded to nearest even (NaN kept a quiet NaN), as ATen's conversion rounds.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// x (M, K) @ W^T with W dequantized one tile of rows at a time (M >= kGemmRows). With `bf16` each row is decoded
// and rounded to bfloat16 in one pass (through a float row in L1), x rounded once, and ATen's bfloat16 GEMM
// gives the product (rounded to bfloat16, widened back).
at::Tensor block_mm_dense(const at::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t fmt,
                          bool bf16) {
  const int64_t m = x.size(0), k = x.size(1), nb = k / block_values(file_format(fmt));
  const int64_t rows = std::min(n, std::max<int64_t>(1, (bf16 ? 2 : 1) * kGemmTileValues / k));
  at::Tensor out = rows < n ? at::empty({m, n}, x.options()) : at::Tensor();  // one tile: its product is it
  at::Tensor tile = at::empty({rows, k}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const at::Tensor lhs = bf16 ? x.to(at::kBFloat16) : x;
  for (int64_t n0 = 0; n0 < n; n0 += rows) {
    const int64_t count = std::min(rows, n - n0);
    if (bf16) {
      auto* t = reinterpret_cast<uint16_t*>(tile.data_ptr<at::BFloat16>());
      at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> row;
        row.resize(static_cast<size_t>(k));
        for (int64_t i = begin; i < end; ++i) {
          decode_any_row(w, row_bytes, fmt, n0 + i, nb, row.data());
          uint16_t* dst = t + i * k;
          for (int64_t j = 0; j < k; ++j) dst[j] = to_bf16(row[j]);
        }
      });
    } else {
      float* t = tile.data_ptr<float>();
      at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) decode_any_row(w, row_bytes, fmt, n0 + i, nb, t + i * k);
      });
    }
    const at::Tensor product = at::mm(lhs, tile.narrow(0, 0, count).t());  // (M, count)
    if (count == n) return bf16 ? product.to(at::kFloat) : product;
    out.narrow(1, n0, count).copy_(product);
  }
  return out;
}

// Weight rows [begin, end) of the file layout times every activation row.
void rows_file_layout(DotFn dot, const uint8_t* w, int64_t row_bytes, const ActRow* acts, int64_t m, int64_t nb,
                      float* y, int64_t n, int64_t begin, int64_t end) {
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
      dot(w + j * row_bytes, row_bytes, cols, acts, 1, nb, y + j, n);
    }
    return;
  }
  // A chunk is small enough to stay in L1 while every group of up to 4 activation rows passes over it.
  for (int64_t m0 = 0; m0 < m; m0 += kRowsPerCall) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowsPerCall, m - m0));
    for (int64_t j = begin; j < end; ++j) {
      dot(w + j * row_bytes, row_bytes, 1, acts + m0, rows, nb, y + m0 * n + j, n);
    }
  }
}

// What block_mm_any does from kGemmRows activation rows up: float32 tiles, bfloat16 tiles, or the integer kernels.
enum class Rows { kFloat, kBf16, kInteger, kGated };  // kGated: the integer kernels, gate and up halves

constexpr int64_t kGatedColumns = 32;  // a gated chunk's columns come in multiples of this (two vectors of 16)

// Columns [j0, j1) of silu(x Wg^T) * (x Wu^T) over the stacked [Wg; Wu] at w (f rows each) into y (M rows, stride
// f): the gate products straight into y, the up products into this thread's buffer, then ATen's silu and multiply
// in place, one call each over the chunk's (M, j1 - j0) block. Run inside a parallel region, ATen runs them in this
// thread, each row's values in whole vectors: the numbers F.silu(gate) * up gives over a row.
void gate_times_up(DotFn dot, const uint8_t* w, int64_t row_bytes, int64_t j0, int64_t j1, int64_t f,
                   const ActRow* a, int64_t m, int64_t nb, float* y) {
  thread_local std::vector<float> up;
  const int64_t cols = j1 - j0;
  up.resize(static_cast<size_t>(m * cols));
  dot(w + j0 * row_bytes, row_bytes, static_cast<int>(cols), a, static_cast<int>(m), nb, y + j0, f);
  dot(w + (f + j0) * row_bytes, row_bytes, static_cast<int>(cols), a, static_cast<int>(m), nb, up.data(), cols);
  const auto floats = at::TensorOptions().dtype(at::kFloat);
  at::Tensor gate = at::from_blob(y + j0, {m, cols}, {f, 1}, floats);
  at::silu_(gate).mul_(at::from_blob(up.data(), {m, cols}, floats));
}

// The (M, N) float32 product's tensor: `into` (block_mm_int8_out's), checked, or a new one.
at::Tensor output_for(const at::Tensor* into, int64_t m, int64_t n, const at::Tensor& x) {
  if (into == nullptr) return at::empty({m, n}, x.options());
  TORCH_CHECK(into->scalar_type() == at::kFloat && into->dim() == 2 && into->size(0) == m && into->size(1) == n &&
                  into->is_contiguous(),
              "oneblock::block_mm_int8_out: out must be a contiguous (", m, ", ", n, ") float32 tensor");
  return *into;
}

// block_mm_any for an F16 or BF16 matrix: products in float32 at every M, whatever `many` asks (the file's values
// are floats already; rounding them or the activations to bfloat16 or 8 bits would only lose precision), each
// value widened as it is read (float_dot: 4 weight rows against each 4 activation rows in registers where there
// are 4 rows or more). No float copy of the matrix is made at any M: float32 tiles and at::mm read a prompt of the
// 1B F16 file at 46-68 tokens/s where these read it at 91-93 (Zen 4, 2 threads), the tiles' widening alone a
// quarter of the time.
at::Tensor float_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t fmt, const at::Tensor* into) {
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), ld = x.stride(0), row_bytes = blocks.size(1);
  at::Tensor out = output_for(into, m, n, x);
  if (m == 0 || n == 0) return out;
  if (k == 0) return out.zero_();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const float* xs = x.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const bool bf16 = fmt == kBF16;
  const int64_t units = (n + kRowsPerCall - 1) / kRowsPerCall;
  const int64_t least = std::max<int64_t>(1, kLeastChunkBytes / (kRowsPerCall * row_bytes));
  const int64_t chunk = std::max(least, units / (kChunksPerThread * at::get_num_threads()));
  parallel_chunks(units, chunk, n * row_bytes * m < kSerialBytes, [&](int64_t begin, int64_t end) {
    const int64_t j0 = begin * kRowsPerCall, j1 = std::min(n, end * kRowsPerCall);
    float_dot(w + j0 * row_bytes, row_bytes, j1 - j0, xs, ld, m, k, y + j0, n, bf16);
  });
  return out;
}

// `into`: an (M, N) float32 contiguous tensor to write the product into (the integer path only), else a new one.
at::Tensor block_mm_any(const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t fmt, Rows many,
                        const at::Tensor* into = nullptr) {
  const DotFn dot = dot_kernel(fmt);  // the instruction set in use (set_isa)
  TORCH_CHECK(dot != nullptr || is_float_format(fmt), "oneblock::block_mm: unknown format id ", fmt);
  const int64_t nbytes = block_bytes(file_format(fmt));
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "oneblock::block_mm: x must be (M, K) float32");
  TORCH_CHECK(blocks_in.dim() == 2 && blocks_in.scalar_type() == at::kByte,
              "oneblock::block_mm: blocks must be (N, K/32 * nbytes) uint8");
  // Rows apart in memory (a column slice, such as the gated feed-forward's half of a stacked product) are read
  // where they lie: a copy only for elements that are not adjacent within a row.
  const at::Tensor x = x_in.stride(1) == 1 && x_in.stride(0) >= x_in.size(1) ? x_in : x_in.contiguous();
  const at::Tensor blocks = blocks_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), ld = x.stride(0);
  const int64_t qk = block_values(file_format(fmt));
  TORCH_CHECK(k % qk == 0 && blocks.size(1) == k / qk * nbytes, "oneblock::block_mm: x has K = ", k,
              " but the blocks hold rows of ", blocks.size(1), " bytes (", nbytes, " per ", qk, " values)");
  const bool interleaved = is_interleaved(fmt);
  TORCH_CHECK(!interleaved || n % kGroupRows == 0, "oneblock::block_mm: an interleaved matrix has a multiple of ",
              kGroupRows, " rows; got ", n);
  const int64_t nb = k / qk, row_bytes = blocks.size(1);
  const bool gated = many == Rows::kGated;
  TORCH_CHECK(!gated || (interleaved && n % (2 * kGatedColumns) == 0), "oneblock::swiglu_int8_out: the blocks must be ",
              "an interleaved [gate; up] matrix of 2F rows, F a multiple of ", kGatedColumns, "; got ", n, " rows");
  if (is_float_format(fmt)) return float_mm(x, blocks, fmt, into);
  if (m >= kGemmRows && n > 0 && k > 0 && many != Rows::kInteger && !gated) {
    return block_mm_dense(x.contiguous(), blocks.data_ptr<uint8_t>(), row_bytes, n, fmt, many == Rows::kBf16);
  }
  const int64_t n_out = gated ? n / 2 : n;  // output columns
  at::Tensor out = output_for(into, m, n_out, x);
  if (m == 0 || n == 0) return out;
  TORCH_CHECK(k > 0 || !gated, "oneblock::swiglu_int8_out: x has no features");
  if (k == 0) return out.zero_();

  // 1. Activations: each row quantized once, used against all N weight rows. The buffers are kept per thread
  // (a decoding step calls this 121 times a token). K-quants take Q8_K blocks of 256 (scales and 16-code sums).
  const bool sums = has_min(file_format(fmt));
  const bool k_quant = is_k_quant(file_format(fmt));
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, s;
  thread_local std::vector<int16_t> bsums;
  thread_local std::vector<uint8_t> unsigned_q;  // K-quants past kTileRows rows (ActRow::u)
  thread_local std::vector<ActRow> acts;
  q.resize(static_cast<size_t>(m * k));
  d.resize(static_cast<size_t>(m * nb));
  s.resize(static_cast<size_t>(sums ? m * nb : 0));
  bsums.resize(static_cast<size_t>(k_quant ? m * k / 16 : 0));
  const bool with_unsigned = k_quant && m > kTileRows;
  unsigned_q.resize(static_cast<size_t>(with_unsigned ? m * k : 0));
  acts.resize(static_cast<size_t>(m));
  const float* xs = x.data_ptr<float>();
  int8_t* qs = q.data();
  float *ds = d.data(), *ss = sums ? s.data() : nullptr;
  int16_t* bss = bsums.data();
  uint8_t* us = unsigned_q.data();
  ActRow* rows_of = acts.data();
  const auto quantize = [=](int64_t begin, int64_t end) {  // the pointers, not the calling thread's buffers
    for (int64_t i = begin; i < end; ++i) {
      if (k_quant) {
        quantize_row_q8_k(xs + i * ld, k, qs + i * k, ds + i * nb, bss + i * k / 16);
        rows_of[i] = {qs + i * k, ds + i * nb, nullptr, bss + i * k / 16};
        if (with_unsigned) {
          unsigned_codes(qs + i * k, k, us + i * k);
          rows_of[i].u = us + i * k;
        }
      } else {
        quantize_row_q8(xs + i * ld, k, qs + i * k, ds + i * nb, ss ? ss + i * nb : nullptr);
        rows_of[i] = {qs + i * k, ds + i * nb, ss ? ss + i * nb : nullptr};
      }
    }
  };
  if (m * k < kSerialBytes) {
    quantize(0, m);
  } else {  // a prompt's rows: over the threads
    at::parallel_for(0, m, std::max<int64_t>(1, kSerialBytes / k), quantize);
  }

  // 2. Weight rows in chunks over the threads (whole groups of 16 for an interleaved matrix).
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  const int64_t unit = gated ? kGatedColumns : interleaved ? kGroupRows : kRowsPerCall;  // rows per unit of work
  const int64_t units = (n_out + unit - 1) / unit;
  const int64_t unit_bytes = unit * row_bytes;
  const int64_t least = std::max<int64_t>(1, kLeastChunkBytes / unit_bytes);
  // A gated chunk ends in two ATen calls (about 5 us each): half as many chunks a thread.
  const int64_t per_thread = gated ? kChunksPerThread / 2 : kChunksPerThread;
  const int64_t chunk = std::max(least, units / (per_thread * at::get_num_threads()));
  const bool serial = n * row_bytes * m < kSerialBytes;
  const ActRow* a = acts.data();
  parallel_chunks(units, chunk, serial, [&](int64_t begin, int64_t end) {
    const int64_t j0 = begin * unit, j1 = std::min(n_out, end * unit);
    if (gated) {
      gate_times_up(dot, w, row_bytes, j0, j1, n_out, a, m, nb, y);
    } else if (interleaved) {
      dot(w + j0 * row_bytes, row_bytes, static_cast<int>(j1 - j0), a, static_cast<int>(m), nb, y + j0, n);
    } else {
      rows_file_layout(dot, w, row_bytes, a, m, nb, y, n, j0, j1);
    }
  });
  return out;
}

at::Tensor block_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t fmt) {
  return block_mm_any(x, blocks, fmt, Rows::kFloat);
}

at::Tensor block_mm_bf16(const at::Tensor& x, const at::Tensor& blocks, int64_t fmt) {
  return block_mm_any(x, blocks, fmt, Rows::kBf16);
}

at::Tensor block_mm_int8(const at::Tensor& x, const at::Tensor& blocks, int64_t fmt) {
  return block_mm_any(x, blocks, fmt, Rows::kInteger);
}

void block_mm_int8_out(const at::Tensor& x, const at::Tensor& blocks, int64_t fmt, at::Tensor out) {
  block_mm_any(x, blocks, fmt, Rows::kInteger, &out);
}

void swiglu_int8_out(const at::Tensor& x, const at::Tensor& blocks, int64_t fmt, at::Tensor out) {
  block_mm_any(x, blocks, fmt, Rows::kGated, &out);
}

}  // namespace

}  // namespace oneblock

TORCH_LIBRARY(oneblock, m) {
  m.def("block_mm(Tensor x, Tensor blocks, int fmt) -> Tensor");
  m.def("block_mm_bf16(Tensor x, Tensor blocks, int fmt) -> Tensor");
  m.def("block_mm_int8(Tensor x, Tensor blocks, int fmt) -> Tensor");
  m.def("block_mm_int8_out(Tensor x, Tensor blocks, int fmt, Tensor(a!) out) -> ()");
  m.def("swiglu_int8_out(Tensor x, Tensor blocks, int fmt, Tensor(a!) out) -> ()");
  m.def("dequantize_rows(Tensor blocks, Tensor rows, int fmt) -> Tensor");
}

TORCH_LIBRARY_IMPL(oneblock, CPU, m) {
  m.impl("block_mm", &oneblock::block_mm);
  m.impl("block_mm_bf16", &oneblock::block_mm_bf16);
  m.impl("block_mm_int8", &oneblock::block_mm_int8);
  m.impl("block_mm_int8_out", &oneblock::block_mm_int8_out);
  m.impl("swiglu_int8_out", &oneblock::swiglu_int8_out);
  m.impl("dequantize_rows", &oneblock::dequantize_rows);
}
