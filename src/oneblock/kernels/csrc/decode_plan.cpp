// The native decode step's arguments read into a Plan (decode_step.h): shapes, dtypes and bounds checked once
// per call, before any thread starts, so the passes index memory without checks.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "decode_step.h"

namespace oneblock {
namespace {

constexpr const char* kOp = "oneblock::decode_step: ";

bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

const float* floats(const at::Tensor& t, int64_t n, const char* what) {
  if (!present(t)) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, kOp, what,
              " must be a contiguous float32 tensor of ", n, " values; got ", t.sizes(), " ", t.scalar_type());
  return t.data_ptr<float>();
}

// A matrix (N, k), float32 or blocks; N read from the tensor, or required to be `n` when n >= 0.
Matrix matrix(const at::Tensor& w, int64_t fmt, const at::Tensor& bias, int64_t k, int64_t n, const char* what) {
  Matrix m;
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), kOp, what, " must be a contiguous 2-D tensor; got ", w.sizes());
  m.fmt = fmt;
  m.n = w.size(0);
  TORCH_CHECK(n < 0 || m.n == n, kOp, what, " has ", m.n, " rows; expected ", n);
  if (fmt == 0) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.size(1) == k, kOp, what, " must be float32 (N, ", k, "); got ",
                w.sizes(), " ", w.scalar_type());
    m.row_bytes = k * static_cast<int64_t>(sizeof(float));
  } else {
    const int64_t nbytes = block_bytes(file_format(fmt));  // an interleaved matrix holds the file's blocks
    TORCH_CHECK(nbytes > 0 && dot_kernel(fmt) != nullptr, kOp, what, ": unknown block format ", fmt);
    TORCH_CHECK(!is_interleaved(fmt) || m.n % kGroupRows == 0, kOp, what, ": an interleaved matrix has a multiple of ",
                kGroupRows, " rows; got ", m.n);
    const int64_t qk = block_values(file_format(fmt));  // 32, or 256 for a K-quant
    TORCH_CHECK(k % qk == 0, kOp, what, ": GGUF type ", fmt, " holds blocks of ", qk, " values, so K = ", k,
                " must be a multiple of ", qk);
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) == k / qk * nbytes, kOp, what, " must be uint8 (N, ",
                k / qk * nbytes, ") blocks (", k / qk, " of ", nbytes, " bytes) for K = ", k, "; got ", w.sizes(),
                " ", w.scalar_type());
    m.row_bytes = w.size(1);
    m.dot = dot_kernel(fmt);
  }
  m.data = static_cast<const uint8_t*>(w.data_ptr());
  m.bias = floats(bias, m.n, what);
  return m;
}

// The present matrices among weights[first], weights[first + 2], ... (biases between), outputs side by side.
Product product(at::TensorList weights, at::IntArrayRef formats, int64_t first, int count, int64_t k, int64_t n,
                const char* what) {
  Product p;
  p.k = k;
  for (int i = 0; i < count; ++i) {
    const int64_t at = first + 2 * i;
    if (!present(weights[at])) continue;
    Matrix m = matrix(weights[at], formats[at], weights[at + 1], k, -1, what);
    const bool k_quant = m.fmt != 0 && is_k_quant(file_format(m.fmt));
    p.block = p.block || (m.fmt != 0 && !k_quant);
    p.k_block = p.k_block || k_quant;
    p.n += m.n;
    p.parts[p.count++] = m;
  }
  TORCH_CHECK(p.n == n, kOp, what, " matrices have ", p.n, " rows together; expected ", n);
  return p;
}

const int64_t* ids(const at::Tensor& t, int64_t rows, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == rows && t.is_contiguous(), kOp, what,
              " must be a contiguous (", rows, ",) int64 tensor; got ", t.sizes(), " ", t.scalar_type());
  return t.data_ptr<int64_t>();
}

}  // namespace

Plan make_plan(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& columns,
               const at::Tensor& starts, at::TensorList weights, at::IntArrayRef formats, at::TensorList keys,
               at::TensorList values, at::IntArrayRef sizes, c10::ArrayRef<double> scalars) {
  TORCH_CHECK(!sizes.empty() && static_cast<int64_t>(sizes.size()) == kSizes + kLayerSizes * sizes[0] &&
                  static_cast<int64_t>(scalars.size()) == kScalars,
              kOp, "sizes needs ", kSizes, " values and ", kLayerSizes, " per layer, scalars ", kScalars, "; got ",
              sizes.size(), " and ", scalars.size());
  Plan p;
  p.rows = tokens.numel();
  p.n_layers = sizes[0], p.d_model = sizes[1], p.heads = sizes[2], p.kv_heads = sizes[3], p.d_head = sizes[4];
  p.d_ff = sizes[5], p.vocab = sizes[6], p.norm = sizes[7], p.ffn = sizes[8], p.act = sizes[9];
  p.position = sizes[10], p.position_offset = sizes[11], p.final_norm = sizes[12] != 0;
  p.out_norm = sizes[13], p.qk_norm = sizes[14];
  p.eps = static_cast<float>(scalars[0]), p.scale = static_cast<float>(scalars[1]);
  p.embed_scale = static_cast<float>(scalars[2]), p.attn_softcap = static_cast<float>(scalars[3]);
  p.logit_softcap = static_cast<float>(scalars[4]), p.residual = static_cast<float>(scalars[5]);
  p.logits_scaling = static_cast<float>(scalars[6]);
  const int64_t L = p.n_layers, C = p.d_model, rows = p.rows;
  TORCH_CHECK(L > 0 && C > 0 && p.heads > 0 && p.kv_heads > 0 && p.heads % p.kv_heads == 0 && p.d_head > 0 &&
                  p.d_ff > 0 && p.vocab > 0 && rows > 0,
              kOp, "impossible sizes ", sizes);
  TORCH_CHECK(p.out_norm >= 0 && p.out_norm <= 2 && p.qk_norm >= 0 && p.qk_norm <= 2 && p.logits_scaling != 0.0f,
              kOp, "out_norm and qk_norm must be 0, 1 or 2 and logits_scaling nonzero; got ", p.out_norm, ", ",
              p.qk_norm, " and ", p.logits_scaling);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kGlobalWeights + kLayerWeights * L &&
                  formats.size() == weights.size(),
              kOp, "expected ", kGlobalWeights + kLayerWeights * L, " weights and formats; got ", weights.size(),
              " and ", formats.size());
  p.tokens = ids(tokens, rows, "tokens");
  p.positions = ids(positions, rows, "positions");
  p.columns = ids(columns, rows, "columns");
  p.starts = ids(starts, rows, "starts");

  // The token table and the positions.
  p.tok = matrix(weights[0], formats[0], at::Tensor(), C, -1, "the token table");
  int64_t table = -1, local_table = -1;  // rows of the position table, of the local rotary tables
  if (p.position == 1) {
    TORCH_CHECK(weights[1].dim() == 2 && weights[1].size(1) == C, kOp, "the position table must be (P, ", C, ")");
    table = weights[1].size(0);
    p.pos = floats(weights[1], table * C, "the position table");
  } else if (p.position == 2) {
    p.rope_dims = weights[2].dim() == 2 ? weights[2].size(1) : 0;
    TORCH_CHECK(p.rope_dims > 0 && p.rope_dims <= p.d_head && p.rope_dims % 2 == 0, kOp,
                "the rotary tables must be (P, R) with R even and at most ", p.d_head, "; got ", weights[2].sizes());
    table = weights[2].size(0);
    p.rope_cos = floats(weights[2], table * p.rope_dims, "rope_cos");
    p.rope_sin = floats(weights[3], table * p.rope_dims, "rope_sin");
  }
  const float* local_cos = nullptr;
  const float* local_sin = nullptr;
  if (p.position == 2 && present(weights[8])) {
    TORCH_CHECK(weights[8].dim() == 2 && weights[8].size(1) == p.rope_dims, kOp,
                "the local rotary tables must be (P, ", p.rope_dims, ")");
    local_table = weights[8].size(0);
    local_cos = floats(weights[8], local_table * p.rope_dims, "rope_local_cos");
    local_sin = floats(weights[9], local_table * p.rope_dims, "rope_local_sin");
  }
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(p.tokens[r] >= 0 && p.tokens[r] < p.tok.n, kOp, "token ", p.tokens[r], " outside [0, ", p.tok.n, ")");
    const int64_t at = p.positions[r] + (p.position == 1 ? p.position_offset : 0);
    TORCH_CHECK(table < 0 || (at >= 0 && at < table), kOp, "position ", p.positions[r], " outside the tables");
    TORCH_CHECK(local_table < 0 || at < local_table, kOp, "position ", p.positions[r], " outside the local tables");
  }
  p.final_w = p.final_norm ? floats(weights[4], C, "final_norm_w") : nullptr;
  p.final_b = p.final_norm ? floats(weights[5], C, "final_norm_b") : nullptr;
  p.head = product(weights, formats, 6, 1, C, p.vocab, "the head");

  // The blocks.
  const int64_t qkv = (p.heads + 2 * p.kv_heads) * p.d_head, ff = p.ffn == 1 ? 2 * p.d_ff : p.d_ff;
  p.layers.resize(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    const int64_t w = kGlobalWeights + kLayerWeights * l;
    Layer& layer = p.layers[static_cast<size_t>(l)];
    layer.attn_norm_w = floats(weights[w], C, "attn_norm_w");
    layer.attn_norm_b = floats(weights[w + 1], C, "attn_norm_b");
    layer.qkv = product(weights, formats, w + 2, 3, C, qkv, "q/k/v");
    layer.o = product(weights, formats, w + 8, 1, p.heads * p.d_head, C, "o_proj");
    layer.ffn_norm_w = floats(weights[w + 10], C, "ffn_norm_w");
    layer.ffn_norm_b = floats(weights[w + 11], C, "ffn_norm_b");
    layer.up = product(weights, formats, w + 12, 2, C, ff, "gate/up");
    layer.down = product(weights, formats, w + 16, 1, p.d_ff, C, "down");
    const bool inputs = p.out_norm != 2;  // output norms alone: no norm before the sublayers
    TORCH_CHECK((layer.attn_norm_w != nullptr && layer.ffn_norm_w != nullptr) == inputs, kOp, "layer ", l,
                inputs ? " lacks a norm" : " has norms before its sublayers (out_norm 2 has none)");
    // The options.
    const int64_t o = w + kLayerMatrices, window = sizes[kSizes + kLayerSizes * l];
    const int64_t rope = sizes[kSizes + kLayerSizes * l + 1];
    if (p.qk_norm != 0) {
      const bool head = p.qk_norm == 1;
      const float* q = floats(weights[o], head ? p.d_head : p.heads * p.d_head, "q_norm_w");
      const float* k = floats(weights[o + 1], head ? p.d_head : p.kv_heads * p.d_head, "k_norm_w");
      TORCH_CHECK(q != nullptr && k != nullptr, kOp, "layer ", l, " lacks a q/k norm");
      (head ? layer.q_norm_w : layer.q_width_norm_w) = q;
      (head ? layer.k_norm_w : layer.k_width_norm_w) = k;
    }
    if (p.out_norm != 0) {
      layer.attn_out_norm_w = floats(weights[o + 2], C, "attn_out_norm_w");
      layer.attn_out_norm_b = floats(weights[o + 3], C, "attn_out_norm_b");
      layer.ffn_out_norm_w = floats(weights[o + 4], C, "ffn_out_norm_w");
      layer.ffn_out_norm_b = floats(weights[o + 5], C, "ffn_out_norm_b");
      TORCH_CHECK(layer.attn_out_norm_w != nullptr && layer.ffn_out_norm_w != nullptr, kOp, "layer ", l,
                  " lacks a norm of its sublayers' outputs");
    }
    TORCH_CHECK(window >= 0, kOp, "layer ", l, "'s window must be 0 (none) or positive; got ", window);
    TORCH_CHECK(rope >= 0 && rope <= 2, kOp, "layer ", l, "'s rope must be 0, 1 or 2; got ", rope);
    TORCH_CHECK(rope != 1 || p.rope_cos != nullptr, kOp, "layer ", l, " rotates with tables the model lacks");
    TORCH_CHECK(rope != 2 || local_cos != nullptr, kOp, "layer ", l, " rotates with local tables the model lacks");
    layer.window = window;
    layer.rope_cos = rope == 2 ? local_cos : rope == 1 ? p.rope_cos : nullptr;
    layer.rope_sin = rope == 2 ? local_sin : rope == 1 ? p.rope_sin : nullptr;
  }

  // The caches: L tensors of all rows (B, Hkv, capacity, Dh), or rows * L tensors (1, Hkv, capacity_r, Dh).
  const bool per_row = static_cast<int64_t>(keys.size()) == rows * L && rows > 1;
  TORCH_CHECK((static_cast<int64_t>(keys.size()) == L || per_row) && keys.size() == values.size(), kOp,
              "expected ", L, " or ", rows * L, " key and value tensors; got ", keys.size(), " and ", values.size());
  p.keys.resize(static_cast<size_t>(rows * L));
  p.values.resize(p.keys.size());
  p.capacity.assign(static_cast<size_t>(rows), -1);
  for (size_t i = 0; i < keys.size(); ++i) {
    for (const at::Tensor* t : {&keys[i], &values[i]}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->is_contiguous() &&
                      t->size(0) == (per_row ? 1 : rows) && t->size(1) == p.kv_heads && t->size(3) == p.d_head &&
                      t->sizes() == keys[i].sizes(),
                  kOp, "cache tensors must be contiguous float32 (", per_row ? 1 : rows, ", ", p.kv_heads,
                  ", capacity, ", p.d_head, "); got ", t->sizes(), " ", t->scalar_type());
    }
    const int64_t cap = keys[i].size(2);
    for (int64_t r = per_row ? static_cast<int64_t>(i) / L : 0; r < (per_row ? static_cast<int64_t>(i) / L + 1 : rows);
         ++r) {
      const int64_t l = per_row ? static_cast<int64_t>(i) % L : static_cast<int64_t>(i);
      const int64_t offset = per_row ? 0 : r * keys[i].stride(0);
      p.keys[static_cast<size_t>(r * L + l)] = keys[i].data_ptr<float>() + offset;
      p.values[static_cast<size_t>(r * L + l)] = values[i].data_ptr<float>() + offset;
      auto& known = p.capacity[static_cast<size_t>(r)];
      TORCH_CHECK(known < 0 || known == cap, kOp, "row ", r, "'s caches differ in capacity");
      known = cap;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // rows sharing a cache: the tokens of one sequence, at distinct columns
    for (int64_t o = 0; o < r; ++o) {
      if (p.keys[static_cast<size_t>(r * L)] != p.keys[static_cast<size_t>(o * L)]) continue;
      p.shared_cache = true;
      TORCH_CHECK(p.columns[r] != p.columns[o], kOp, "rows ", o, " and ", r,
                  " share a cache and write the same column ", p.columns[r]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(p.columns[r] >= 0 && p.columns[r] < p.capacity[static_cast<size_t>(r)] && p.starts[r] >= 0 &&
                    p.starts[r] <= p.columns[r],
                kOp, "row ", r, ": column ", p.columns[r], " and start ", p.starts[r], " must satisfy 0 <= start <= ",
                "column < capacity (", p.capacity[static_cast<size_t>(r)], ")");
  }
  p.math = float_math(dot_kernel(kQ8_0) == dot_q8_0_scalar);  // the float routines follow ONEBLOCK_KERNELS
  return p;
}

}  // namespace oneblock
