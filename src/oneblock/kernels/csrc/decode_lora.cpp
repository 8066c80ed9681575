// The LoRA updates of the native decode step (decode_step.h): each update checked and added to its product once,
// as the plan is built, and the two halves of an update, computed by the float routines of step_math.h (their scalar twins
// under ONEBLOCK_KERNELS=scalar). They mirror MultiLoraLinear (oneblock/adapters/multi.py):
//
//   y = base(x);  y[rows_k] = y[rows_k] + (x[rows_k] A_k^T) B_k^T * scale_k      for each adapter k of the batch
//
// a row computing only with its own adapter's matrices, so that a row never depends on the others.
#include <c10/util/Exception.h>

#include <algorithm>

#include "decode_step.h"

namespace oneblock {
namespace {

constexpr const char* kPlan = "oneblock::StepPlan: ";

const float* lora_matrix(const at::Tensor& t, int64_t rows, int64_t cols, size_t update, const char* what) {
  TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous() &&
                  t.size(0) == rows && t.size(1) == cols,
              kPlan, "LoRA update ", update, ": ", what, " must be a contiguous float32 (", rows, ", ", cols,
              ") tensor; got ", t.sizes(), " ", t.scalar_type());
  return t.data_ptr<float>();
}

}  // namespace

void StepPlan::add_lora(int64_t l, const std::string& matrix, int64_t adapter, double scale, const at::Tensor& a,
                        const at::Tensor& b) {
  Plan& p = plan_;
  const size_t u = lora_.size() / 2;
  // The layer's matrices (decode_step.h's kLayerKeys) and the products they belong to: [q | k | v], o, [gate | up],
  // down.
  static const char* const kMatrices[] = {"q_w", "k_w", "v_w", "o_w", "gate_w", "up_w", "down_w"};
  static const int kFirst[] = {0, 0, 0, 3, 4, 4, 6};  // each matrix's product's first matrix
  int m = -1;
  for (int i = 0; i < 7; ++i) m = matrix == kMatrices[i] ? i : m;
  TORCH_CHECK(l >= 0 && l < p.n_layers, kPlan, "LoRA update ", u, ": layer ", l, " outside [0, ", p.n_layers, ")");
  const auto& tensors = layers_.get(static_cast<size_t>(l));
  TORCH_CHECK(m >= 0 && tensors.contains(matrix), kPlan, "LoRA update ", u, ": '", matrix,
              "' is not a matrix layer ", l, " has (q_w, k_w, v_w, o_w, gate_w, up_w, down_w)");
  TORCH_CHECK(adapter >= 1, kPlan, "LoRA update ", u, ": adapter ", adapter, " is not 1 or more");
  Layer& layer = p.layers[static_cast<size_t>(l)];
  Product& prod = kFirst[m] == 0 ? layer.qkv : kFirst[m] == 3 ? layer.o : kFirst[m] == 4 ? layer.up : layer.down;
  LoraUpdate up;
  for (int before = kFirst[m]; before < m; ++before) {  // the columns of the product's matrices before this one
    if (tensors.contains(kMatrices[before])) up.offset += tensors.at(kMatrices[before]).size(0);
  }
  up.n = tensors.at(matrix).size(0);
  up.rank = a.defined() && a.dim() == 2 ? a.size(0) : 0;
  TORCH_CHECK(up.rank > 0, kPlan, "LoRA update ", u, ": A must be (rank, K) with rank >= 1; got ",
              a.defined() ? a.sizes() : at::IntArrayRef{});
  up.a = lora_matrix(a, up.rank, prod.k, u, "A");
  up.b = lora_matrix(b, up.n, up.rank, u, "B");
  up.adapter = adapter;
  up.scale = static_cast<float>(scale);
  for (const LoraUpdate& other : prod.lora) up.t += other.rank;
  prod.lora.push_back(up);
  p.lora_width = std::max(p.lora_width, up.t + up.rank);
  lora_.push_back(a);
  lora_.push_back(b);
}

void lora_a(const Plan& p, const Call& c, const Product& prod, int64_t r, const float* x, float* t) {
  const int64_t adapter = c.adapters[r];
  for (const LoraUpdate& u : prod.lora) {
    if (u.adapter != adapter) continue;
    for (int64_t i = 0; i < u.rank; i += 4) {  // t_i = A_i . x, four rows of A at a time
      c.math.dot(u.a + i * prod.k, prod.k, static_cast<int>(std::min<int64_t>(4, u.rank - i)), x, t + u.t + i);
    }
  }
}

void lora_b(const Plan& p, const Call& c, const Product& prod, const float* t, int64_t j0, int64_t j1, float* out,
            int64_t stride, int64_t first) {
  for (int64_t r = 0; r < c.rows; ++r) {
    const int64_t adapter = c.adapters[r];
    const float* row = t + r * p.lora_width;
    for (const LoraUpdate& u : prod.lora) {
      const int64_t a = std::max(j0, u.offset), b = std::min(j1, u.offset + u.n);
      if (u.adapter != adapter || a >= b) continue;
      float d[4];
      for (int64_t j = a; j < b; j += 4) {  // (t B^T)_j = B_j . t, four columns at a time; then the scale, the add
        const int cols = static_cast<int>(std::min<int64_t>(4, b - j));
        c.math.dot(u.b + (j - u.offset) * u.rank, u.rank, cols, row + u.t, d);
        for (int c = 0; c < cols; ++c) out[r * stride + j - first + c] += d[c] * u.scale;
      }
    }
  }
}

}  // namespace oneblock
