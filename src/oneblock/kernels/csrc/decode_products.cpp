// The products of the native decode step (decode_step.h): each input row rounded to the 8-bit activation blocks
// its product's matrices read, and the product of a range of its side-by-side output columns.
//
// An F16 or BF16 matrix reads the float input rows as they are, as a float32 one does.
//
// A product's matrices may mix block sizes: the 32-value formats (Q4_0 ... Q8_0, interleaved or not) read Q8_0 /
// Q8_1 blocks of 32, the K-quants (Q4_K, Q6_K: super-blocks of 256) llama.cpp's Q8_K blocks of 256 (a float32
// scale per block, the sums of each 16 codes). An input is rounded to each kind its product needs, once per row,
// and each matrix is multiplied with its own kind, as block_mm multiplies it alone (ops.cpp).
#include <algorithm>

#include "decode_step.h"

namespace oneblock {

namespace {

template <typename T>
void fit(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

}  // namespace

Input InputBlocks::bind(const float* x, int64_t rows, int64_t width, bool k_quant) {
  fit(codes, rows * width), fit(d, rows * width / QK + 1), fit(s, rows * width / QK + 1), fit(acts, rows);
  for (int64_t r = 0; r < rows; ++r) {
    acts[r] = {codes.data() + r * width, d.data() + r * width / QK, s.data() + r * width / QK};
  }
  Input in{x, acts.data(), nullptr, codes.data(), d.data(), s.data(), nullptr, nullptr, nullptr};
  if (k_quant) {  // the width is whole super-blocks (decode_plan.cpp checks each K-quant matrix's K)
    fit(k_codes, rows * width), fit(k_d, rows * width / QK_K), fit(k_sums, rows * width / 16), fit(k_acts, rows);
    for (int64_t r = 0; r < rows; ++r) {
      k_acts[r] = {k_codes.data() + r * width, k_d.data() + r * width / QK_K, nullptr, k_sums.data() + r * width / 16};
    }
    in.k = k_acts.data(), in.k_codes = k_codes.data(), in.k_d = k_d.data(), in.k_sums = k_sums.data();
  }
  return in;
}

void quantize_range(const Input& in, const Product& prod, int64_t k, int64_t r, int64_t j0, int64_t j1) {
  const int64_t at = r * k + j0;
  if (prod.block) quantize_row_q8(in.x + at, j1 - j0, in.codes + at, in.d + at / QK, in.s + at / QK);
  if (prod.k_block) quantize_row_q8_k(in.x + at, j1 - j0, in.k_codes + at, in.k_d + at / QK_K, in.k_sums + at / 16);
}

void multiply(const Call& c, const Product& prod, const Input& in, int64_t j0, int64_t j1, float* out,
              int64_t stride, int64_t rows, int64_t first) {
  if (rows < 0) rows = c.rows;
  const int64_t k = prod.k;
  int64_t offset = 0;
  for (int i = 0; i < prod.count; offset += prod.parts[i].n, ++i) {
    const Matrix& m = prod.parts[i];
    const int64_t a = std::max(j0, offset), b = std::min(j1, offset + m.n);
    const bool k_quant = m.fmt != 0 && is_k_quant(file_format(m.fmt));
    const ActRow* acts = k_quant ? in.k : in.q;
    const int64_t nb = m.fmt == 0 ? 0 : k / block_values(file_format(m.fmt));
    const DotFn dot = m.fmt == 0 ? nullptr : dot_kernel(m.fmt);  // the instruction set in use (set_isa)
    if (is_float_format(m.fmt)) {  // F16 / BF16: the float rows, each weight widened (float_rows.cpp)
      if (a < b) {
        float_dot(m.data + (a - offset) * m.row_bytes, m.row_bytes, b - a, in.x, k, rows, k, out + a - first,
                  stride, m.fmt == kBF16);
      }
    } else if (is_interleaved(m.fmt) && a < b) {
      // Groups of 16 rows: chunks are whole blocks of 32 columns and every part has a multiple of 16 rows, so
      // [a, b) starts and ends on a group. One call serves every activation row.
      const uint8_t* w = m.data + (a - offset) * m.row_bytes;
      dot(w, m.row_bytes, static_cast<int>(b - a), acts, static_cast<int>(rows), nb, out + a - first, stride);
    }
    for (int64_t j = a; j < b && !is_interleaved(m.fmt) && !is_float_format(m.fmt); j += 4) {
      const int cols = static_cast<int>(std::min<int64_t>(4, b - j));
      const uint8_t* w = m.data + (j - offset) * m.row_bytes;
      if (m.fmt == 0) {
        for (int64_t r = 0; r < rows; ++r) {
          c.math.dot(reinterpret_cast<const float*>(w), k, cols, in.x + r * k, out + r * stride + j - first);
        }
      } else if (rows == 1) {
        dot(w, m.row_bytes, cols, acts, 1, nb, out + j - first, stride);
      } else {
        for (int c = 0; c < cols; ++c) {
          for (int64_t r = 0; r < rows; r += 4) {
            const int group = static_cast<int>(std::min<int64_t>(4, rows - r));
            dot(w + c * m.row_bytes, m.row_bytes, 1, acts + r, group, nb, out + r * stride + j - first + c, stride);
          }
        }
      }
    }
    if (m.bias != nullptr) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = a; j < b; ++j) out[r * stride + j - first] += m.bias[j - offset];
      }
    }
  }
}

int64_t chunk_columns(int64_t n, int64_t threads, int64_t unit) {
  const int64_t per = (n + threads * 8 - 1) / (threads * 8);
  return std::clamp<int64_t>((per + unit - 1) / unit * unit, unit, std::max<int64_t>(512, unit));
}

}  // namespace oneblock
