// The LoRA updates of the native decode step (decode_step.h): the adapters' arguments read into the plan's
// products, and the two halves of an update, computed by the float routines of step_math.h (their scalar twins
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

constexpr const char* kOp = "oneblock::decode_step: ";

bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

const float* lora_matrix(const at::Tensor& t, int64_t rows, int64_t cols, size_t update, const char* what) {
  TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous() &&
                  t.size(0) == rows && t.size(1) == cols,
              kOp, "LoRA update ", update, ": ", what, " must be a contiguous float32 (", rows, ", ", cols,
              ") tensor; got ", t.sizes(), " ", t.scalar_type());
  return t.data_ptr<float>();
}

}  // namespace

void add_lora(Plan& p, const at::Tensor& adapters, at::TensorList weights, at::TensorList lora,
              at::IntArrayRef sites, c10::ArrayRef<double> scales) {
  const size_t count = scales.size();
  TORCH_CHECK(lora.size() == 2 * count && sites.size() == 2 * count, kOp,
              "LoRA updates need 2 tensors (A, B) and 2 sites each, one scale each; got ", lora.size(),
              " tensors, ", sites.size(), " sites and ", count, " scales");
  if (count == 0) return;
  TORCH_CHECK(adapters.scalar_type() == at::kLong && adapters.dim() == 1 && adapters.size(0) == p.rows &&
                  adapters.is_contiguous(),
              kOp, "adapters must be a contiguous (", p.rows, ",) int64 tensor; got ", adapters.sizes(), " ",
              adapters.scalar_type());
  p.adapters = adapters.data_ptr<int64_t>();
  for (int64_t r = 0; r < p.rows; ++r) {
    TORCH_CHECK(p.adapters[r] >= 0, kOp, "row ", r, "'s adapter is ", p.adapters[r], "; 0 (the base) or more");
  }
  for (size_t u = 0; u < count; ++u) {
    const int64_t at = sites[2 * u], adapter = sites[2 * u + 1];
    const int64_t l = (at - kGlobalWeights) / kLayerWeights, slot = (at - kGlobalWeights) % kLayerWeights;
    // The layer's matrices: q_w 2, k_w 4, v_w 6 (the q/k/v product), o_w 8, gate_w 12, up_w 14, down_w 16.
    const bool matrix = at >= kGlobalWeights && l < p.n_layers && slot >= 2 && slot < kLayerMatrices &&
                        slot % 2 == 0 && slot != 10;
    TORCH_CHECK(matrix && present(weights[at]) && adapter >= 1, kOp, "LoRA update ", u, ": weight ", at,
                " is not a layer's matrix the model has, or adapter ", adapter, " is not 1 or more");
    Layer& layer = p.layers[static_cast<size_t>(l)];
    const int64_t first = slot <= 6 ? 2 : slot == 8 ? 8 : slot <= 14 ? 12 : 16;
    Product& prod = first == 2 ? layer.qkv : first == 8 ? layer.o : first == 12 ? layer.up : layer.down;
    LoraUpdate up;
    for (int64_t s = first; s < slot; s += 2) {  // the columns of the product's matrices before this one
      const at::Tensor& before = weights[kGlobalWeights + kLayerWeights * l + s];
      if (present(before)) up.offset += before.size(0);
    }
    up.n = weights[at].size(0);
    up.rank = lora[2 * u].dim() == 2 ? lora[2 * u].size(0) : 0;
    TORCH_CHECK(up.rank > 0, kOp, "LoRA update ", u, ": A must be (rank, K) with rank >= 1; got ",
                lora[2 * u].sizes());
    up.a = lora_matrix(lora[2 * u], up.rank, prod.k, u, "A");
    up.b = lora_matrix(lora[2 * u + 1], up.n, up.rank, u, "B");
    up.adapter = adapter;
    up.scale = static_cast<float>(scales[u]);
    for (const LoraUpdate& other : prod.lora) up.t += other.rank;
    prod.lora.push_back(up);
    p.lora_width = std::max(p.lora_width, up.t + up.rank);
  }
}

void lora_a(const Plan& p, const Product& prod, int64_t r, const float* x, float* t) {
  const int64_t adapter = p.adapters[r];
  for (const LoraUpdate& u : prod.lora) {
    if (u.adapter != adapter) continue;
    for (int64_t i = 0; i < u.rank; i += 4) {  // t_i = A_i . x, four rows of A at a time
      p.math.dot(u.a + i * prod.k, prod.k, static_cast<int>(std::min<int64_t>(4, u.rank - i)), x, t + u.t + i);
    }
  }
}

void lora_b(const Plan& p, const Product& prod, const float* t, int64_t j0, int64_t j1, float* out, int64_t stride) {
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t adapter = p.adapters[r];
    const float* row = t + r * p.lora_width;
    for (const LoraUpdate& u : prod.lora) {
      const int64_t a = std::max(j0, u.offset), b = std::min(j1, u.offset + u.n);
      if (u.adapter != adapter || a >= b) continue;
      float d[4];
      for (int64_t j = a; j < b; j += 4) {  // (t B^T)_j = B_j . t, four columns at a time; then the scale, the add
        const int cols = static_cast<int>(std::min<int64_t>(4, b - j));
        p.math.dot(u.b + (j - u.offset) * u.rank, u.rank, cols, row + u.t, d);
        for (int c = 0; c < cols; ++c) out[r * stride + j + c] += d[c] * u.scale;
      }
    }
  }
}

}  // namespace oneblock
