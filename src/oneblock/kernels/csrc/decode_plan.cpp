// The native decode step's plan (decode_step.h): a StepPlan reads a model's named tensors, sizes and scalars into a
// Plan once, checking every shape, dtype and format, so that a call checks only its rows and the passes index
// memory without checks; read_call reads and checks a call's arguments.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <iterator>

#include "decode_step.h"

namespace oneblock {
namespace {

constexpr const char* kPlan = "oneblock::StepPlan: ";
constexpr const char* kOp = "oneblock::decode_step: ";

template <size_t N>
int index_of(const char* const (&keys)[N], const std::string& key) {
  for (size_t i = 0; i < N; ++i) {
    if (key == keys[i]) return static_cast<int>(i);
  }
  return -1;
}

template <size_t N>
std::string listed(const char* const (&keys)[N]) {
  std::string out;
  for (size_t i = 0; i < N; ++i) out += (i ? ", " : "") + std::string(keys[i]);
  return out;
}

// The values of `dict` in the order of `keys`, every key required; a key not among them refused by name.
template <typename T, size_t N>
std::array<T, N> required(const c10::Dict<std::string, T>& dict, const char* const (&keys)[N], const char* what) {
  std::array<T, N> out{};
  for (const auto& item : dict) {
    const int i = index_of(keys, item.key());
    TORCH_CHECK(i >= 0, kPlan, what, " has an unknown key '", item.key(), "'; the keys are ", listed(keys));
    out[static_cast<size_t>(i)] = item.value();
  }
  for (size_t i = 0; i < N; ++i) {
    TORCH_CHECK(dict.contains(keys[i]), kPlan, what, " lacks '", keys[i], "'");
  }
  return out;
}

// The tensors of `dict` in the order of `keys`, undefined where absent; a key not among them refused by name.
template <size_t N>
std::array<at::Tensor, N> named(const c10::Dict<std::string, at::Tensor>& dict, const char* const (&keys)[N],
                                const std::string& what) {
  std::array<at::Tensor, N> out;
  for (const auto& item : dict) {
    const int i = index_of(keys, item.key());
    TORCH_CHECK(i >= 0, kPlan, what, " has an unknown tensor '", item.key(), "'; the tensors are ", listed(keys));
    TORCH_CHECK(item.value().defined() && item.value().device().is_cpu(), kPlan, what, "'s ", item.key(),
                " must be a tensor on the CPU");
    out[static_cast<size_t>(i)] = item.value();
  }
  return out;
}

// The formats of the matrices of `tensors` (0 where absent): a format names a matrix that is there.
template <size_t N>
std::array<int64_t, N> formats_of(const c10::Dict<std::string, int64_t>& formats, const char* const (&keys)[N],
                                  const std::array<at::Tensor, N>& tensors, std::initializer_list<int> matrices,
                                  const std::string& what) {
  std::array<int64_t, N> out{};
  for (const auto& item : formats) {
    const int i = index_of(keys, item.key());
    bool matrix = false;
    for (int m : matrices) matrix = matrix || m == i;
    TORCH_CHECK(matrix && tensors[static_cast<size_t>(i)].defined(), kPlan, what, " gives a format to '",
                item.key(), "', which is not a matrix it holds");
    out[static_cast<size_t>(i)] = item.value();
  }
  return out;
}

const float* floats(const at::Tensor& t, int64_t n, const std::string& what) {
  if (!t.defined()) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, kPlan, what,
              " must be a contiguous float32 tensor of ", n, " values; got ", t.sizes(), " ", t.scalar_type());
  return t.data_ptr<float>();
}

// A matrix (N, k), float32 or blocks; N read from the tensor.
Matrix matrix(const at::Tensor& w, int64_t fmt, const at::Tensor& bias, int64_t k, const std::string& what) {
  Matrix m;
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), kPlan, what, " must be a contiguous 2-D tensor; got ", w.sizes());
  m.fmt = fmt;
  m.n = w.size(0);
  if (fmt == 0) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.size(1) == k, kPlan, what, " must be float32 (N, ", k, "); got ",
                w.sizes(), " ", w.scalar_type());
    m.row_bytes = k * static_cast<int64_t>(sizeof(float));
  } else {
    const int64_t nbytes = block_bytes(file_format(fmt));  // an interleaved matrix holds the file's blocks
    TORCH_CHECK(nbytes > 0 && (dot_kernel(fmt) != nullptr || is_float_format(fmt)), kPlan, what,
                ": unknown block format ", fmt);
    TORCH_CHECK(!is_interleaved(fmt) || m.n % kGroupRows == 0, kPlan, what,
                ": an interleaved matrix has a multiple of ", kGroupRows, " rows; got ", m.n);
    const int64_t qk = block_values(file_format(fmt));  // 32, 256 for a K-quant, 1 for F16 / BF16
    TORCH_CHECK(k % qk == 0, kPlan, what, ": GGUF type ", fmt, " holds blocks of ", qk, " values, so K = ", k,
                " must be a multiple of ", qk);
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) == k / qk * nbytes, kPlan, what, " must be uint8 (N, ",
                k / qk * nbytes, ") blocks (", k / qk, " of ", nbytes, " bytes) for K = ", k, "; got ", w.sizes(),
                " ", w.scalar_type());
    m.row_bytes = w.size(1);
  }
  m.data = static_cast<const uint8_t*>(w.data_ptr());
  m.bias = floats(bias, m.n, what);
  return m;
}

// The present matrices among w[first], w[first + 2], ... (biases between), outputs side by side; `its` prefixes
// their keys in messages.
template <size_t N>
Product product(const std::array<at::Tensor, N>& w, const std::array<int64_t, N>& formats,
                const char* const (&keys)[N], size_t first, int count, int64_t k, int64_t n, const std::string& its,
                const char* what) {
  Product p;
  p.k = k;
  for (int i = 0; i < count; ++i) {
    const size_t at = first + 2 * static_cast<size_t>(i);
    if (!w[at].defined()) continue;
    Matrix m = matrix(w[at], formats[at], w[at + 1], k, its + keys[at]);
    const bool k_quant = m.fmt != 0 && is_k_quant(file_format(m.fmt));
    p.block = p.block || (m.fmt != 0 && !k_quant && !is_float_format(m.fmt));  // F16 / BF16 read the float rows
    p.k_block = p.k_block || k_quant;
    p.n += m.n;
    p.parts[p.count++] = m;
  }
  TORCH_CHECK(p.n == n, kPlan, its, what, " matrices have ", p.n, " rows together; expected ", n);
  return p;
}

// A (P, R) table: its rows, its data checked.
const float* table(const at::Tensor& t, int64_t r, const std::string& what, int64_t* rows) {
  TORCH_CHECK(t.defined() && t.dim() == 2 && t.size(1) == r, kPlan, what, " must be (P, ", r, ")");
  *rows = t.size(0);
  return floats(t, t.size(0) * r, what);
}

const int64_t* ids(const at::Tensor& t, int64_t rows, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == rows && t.is_contiguous(), kOp, what,
              " must be a contiguous (", rows, ",) int64 tensor; got ", t.sizes(), " ", t.scalar_type());
  return t.data_ptr<int64_t>();
}

}  // namespace

StepPlan::StepPlan(c10::Dict<std::string, int64_t> sizes, c10::Dict<std::string, double> scalars,
                   c10::Dict<std::string, at::Tensor> tensors, c10::Dict<std::string, int64_t> formats,
                   c10::List<c10::Dict<std::string, int64_t>> layer_sizes,
                   c10::List<c10::Dict<std::string, at::Tensor>> layers,
                   c10::List<c10::Dict<std::string, int64_t>> layer_formats)
    : tensors_(std::move(tensors)), layers_(std::move(layers)) {
  Plan& p = plan_;
  const auto s = required(sizes, kSizeKeys, "sizes");
  const auto x = required(scalars, kScalarKeys, "scalars");
  p.n_layers = static_cast<int64_t>(layers_.size());
  p.d_model = s[0], p.heads = s[1], p.kv_heads = s[2], p.d_head = s[3], p.d_ff = s[4], p.vocab = s[5];
  p.norm = s[6], p.ffn = s[7], p.act = s[8], p.position = s[9], p.position_offset = s[10];
  p.final_norm = s[11] != 0, p.out_norm = s[12], p.qk_norm = s[13];
  p.eps = static_cast<float>(x[0]), p.scale = static_cast<float>(x[1]), p.embed_scale = static_cast<float>(x[2]);
  p.attn_softcap = static_cast<float>(x[3]), p.logit_softcap = static_cast<float>(x[4]);
  p.residual = static_cast<float>(x[5]), p.logits_scaling = static_cast<float>(x[6]);
  const int64_t L = p.n_layers, C = p.d_model;
  TORCH_CHECK(L > 0 && C > 0 && p.heads > 0 && p.kv_heads > 0 && p.heads % p.kv_heads == 0 && p.d_head > 0 &&
                  p.d_ff > 0 && p.vocab > 0,
              kPlan, "impossible sizes for ", L, " layers: d_model ", C, ", n_heads ", p.heads, ", n_kv_heads ",
              p.kv_heads, ", d_head ", p.d_head, ", d_ff ", p.d_ff, ", vocab ", p.vocab);
  TORCH_CHECK(p.out_norm >= 0 && p.out_norm <= 2 && p.qk_norm >= 0 && p.qk_norm <= 2 && p.logits_scaling != 0.0f,
              kPlan, "out_norm and qk_norm must be 0, 1 or 2 and logits_scaling nonzero; got ", p.out_norm, ", ",
              p.qk_norm, " and ", p.logits_scaling);
  TORCH_CHECK(static_cast<int64_t>(layer_sizes.size()) == L && static_cast<int64_t>(layer_formats.size()) == L,
              kPlan, "expected the sizes and formats of ", L, " layers; got ", layer_sizes.size(), " and ",
              layer_formats.size());
  const auto w = named(tensors_, kModelKeys, "tensors");
  const auto f = formats_of(formats, kModelKeys, w, {0, 6}, "formats");  // tok, head_w

  // The token table and the positions.
  TORCH_CHECK(w[0].defined() && w[6].defined(), kPlan, "tensors lacks the token table (tok) or the head (head_w)");
  p.tok = matrix(w[0], f[0], at::Tensor(), C, "the token table (tok)");
  if (p.position == 1) {
    p.pos = table(w[1], C, "the position table", &p.table);
  } else if (p.position == 2) {
    p.rope_dims = w[2].defined() && w[2].dim() == 2 ? w[2].size(1) : 0;
    TORCH_CHECK(p.rope_dims > 0 && p.rope_dims <= p.d_head && p.rope_dims % 2 == 0, kPlan,
                "the rotary tables must be (P, R) with R even and at most ", p.d_head, "; got ",
                w[2].defined() ? w[2].sizes() : at::IntArrayRef{});
    p.rope_cos = table(w[2], p.rope_dims, "rope_cos", &p.table);
    p.rope_sin = floats(w[3], p.table * p.rope_dims, "rope_sin");
    TORCH_CHECK(p.rope_sin != nullptr, kPlan, "tensors lacks rope_sin");
  }
  const float* local_cos = nullptr;
  const float* local_sin = nullptr;
  if (p.position == 2 && w[8].defined()) {
    local_cos = table(w[8], p.rope_dims, "the local rotary tables", &p.local_table);
    local_sin = floats(w[9], p.local_table * p.rope_dims, "rope_local_sin");
    TORCH_CHECK(local_sin != nullptr, kPlan, "tensors lacks rope_local_sin");
  }
  p.final_w = p.final_norm ? floats(w[4], C, "final_norm_w") : nullptr;
  p.final_b = p.final_norm ? floats(w[5], C, "final_norm_b") : nullptr;
  TORCH_CHECK(!p.final_norm || p.final_w != nullptr, kPlan, "tensors lacks final_norm_w (final_norm is 1)");
  p.head = product(w, f, kModelKeys, 6, 1, C, p.vocab, "", "the head");

  // The blocks.
  const int64_t qkv = (p.heads + 2 * p.kv_heads) * p.d_head, ff = p.ffn == 1 ? 2 * p.d_ff : p.d_ff;
  p.layers.resize(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    const std::string name = "layer " + std::to_string(l), its = name + "'s ";
    const auto t = named(layers_.get(static_cast<size_t>(l)), kLayerKeys, name);
    const auto lf = formats_of(layer_formats.get(static_cast<size_t>(l)), kLayerKeys, t,
                               {2, 4, 6, 8, 12, 14, 16}, name + "'s formats");
    const auto ls = required(layer_sizes.get(static_cast<size_t>(l)), kLayerSizeKeys, (name + "'s sizes").c_str());
    Layer& layer = p.layers[static_cast<size_t>(l)];
    layer.attn_norm_w = floats(t[0], C, its + "attn_norm_w");
    layer.attn_norm_b = floats(t[1], C, its + "attn_norm_b");
    layer.qkv = product(t, lf, kLayerKeys, 2, 3, C, qkv, its, "q/k/v");
    layer.o = product(t, lf, kLayerKeys, 8, 1, p.heads * p.d_head, C, its, "o_w");
    layer.ffn_norm_w = floats(t[10], C, its + "ffn_norm_w");
    layer.ffn_norm_b = floats(t[11], C, its + "ffn_norm_b");
    layer.up = product(t, lf, kLayerKeys, 12, 2, C, ff, its, "gate/up");
    layer.down = product(t, lf, kLayerKeys, 16, 1, p.d_ff, C, its, "down_w");
    const bool inputs = p.out_norm != 2;  // output norms alone: no norm before the sublayers
    TORCH_CHECK((layer.attn_norm_w != nullptr && layer.ffn_norm_w != nullptr) == inputs, kPlan, name,
                inputs ? " lacks a norm" : " has norms before its sublayers (out_norm 2 has none)");
    // The options.
    if (p.qk_norm != 0) {
      const bool head = p.qk_norm == 1;
      const float* q = floats(t[18], head ? p.d_head : p.heads * p.d_head, its + "q_norm_w");
      const float* k = floats(t[19], head ? p.d_head : p.kv_heads * p.d_head, its + "k_norm_w");
      TORCH_CHECK(q != nullptr && k != nullptr, kPlan, name, " lacks a q/k norm");
      (head ? layer.q_norm_w : layer.q_width_norm_w) = q;
      (head ? layer.k_norm_w : layer.k_width_norm_w) = k;
    }
    if (p.out_norm != 0) {
      layer.attn_out_norm_w = floats(t[20], C, its + "attn_out_norm_w");
      layer.attn_out_norm_b = floats(t[21], C, its + "attn_out_norm_b");
      layer.ffn_out_norm_w = floats(t[22], C, its + "ffn_out_norm_w");
      layer.ffn_out_norm_b = floats(t[23], C, its + "ffn_out_norm_b");
      TORCH_CHECK(layer.attn_out_norm_w != nullptr && layer.ffn_out_norm_w != nullptr, kPlan, name,
                  " lacks a norm of its sublayers' outputs");
    }
    const int64_t window = ls[0], rope = ls[1];
    TORCH_CHECK(window >= 0, kPlan, name, "'s window must be 0 (none) or positive; got ", window);
    TORCH_CHECK(rope >= 0 && rope <= 2, kPlan, name, "'s rope must be 0, 1 or 2; got ", rope);
    TORCH_CHECK(rope != 1 || p.rope_cos != nullptr, kPlan, name, " rotates with tables the model lacks");
    TORCH_CHECK(rope != 2 || local_cos != nullptr, kPlan, name, " rotates with local tables the model lacks");
    layer.window = window;
    layer.rope_cos = rope == 2 ? local_cos : rope == 1 ? p.rope_cos : nullptr;
    layer.rope_sin = rope == 2 ? local_sin : rope == 1 ? p.rope_sin : nullptr;
  }
}

Call read_call(const Plan& p, const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& columns,
               const at::Tensor& starts, at::TensorList keys, at::TensorList values, const at::Tensor& adapters,
               int64_t logits_from) {
  Call c;
  const int64_t rows = c.rows = tokens.numel(), L = p.n_layers;
  TORCH_CHECK(rows > 0, kOp, "a call needs one row or more");
  TORCH_CHECK(logits_from >= 0 && logits_from <= rows, kOp, "logits_from must be in [0, B] = [0, ", rows, "]; got ",
              logits_from);
  c.logits_from = logits_from;
  c.tokens = ids(tokens, rows, "tokens");
  c.positions = ids(positions, rows, "positions");
  c.columns = ids(columns, rows, "columns");
  c.starts = ids(starts, rows, "starts");
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(c.tokens[r] >= 0 && c.tokens[r] < p.tok.n, kOp, "token ", c.tokens[r], " outside [0, ", p.tok.n, ")");
    const int64_t at = c.positions[r] + (p.position == 1 ? p.position_offset : 0);
    TORCH_CHECK(p.table < 0 || (at >= 0 && at < p.table), kOp, "position ", c.positions[r], " outside the tables");
    TORCH_CHECK(p.local_table < 0 || at < p.local_table, kOp, "position ", c.positions[r],
                " outside the local tables");
  }
  if (p.lora_width > 0) {
    c.adapters = ids(adapters, rows, "adapters");
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(c.adapters[r] >= 0, kOp, "row ", r, "'s adapter is ", c.adapters[r], "; 0 (the base) or more");
    }
  }

  // The caches: L tensors of all rows (B, Hkv, capacity, Dh), or rows * L tensors (1, Hkv, capacity_r, Dh).
  const bool per_row = static_cast<int64_t>(keys.size()) == rows * L && rows > 1;
  TORCH_CHECK((static_cast<int64_t>(keys.size()) == L || per_row) && keys.size() == values.size(), kOp,
              "expected ", L, " or ", rows * L, " key and value tensors; got ", keys.size(), " and ", values.size());
  c.keys.resize(static_cast<size_t>(rows * L));
  c.values.resize(c.keys.size());
  c.capacity.assign(c.keys.size(), -1);
  c.half = !keys.empty() && keys[0].scalar_type() == at::kHalf;
  const at::ScalarType dtype = c.half ? at::kHalf : at::kFloat;
  for (size_t i = 0; i < keys.size(); ++i) {
    for (const at::Tensor* t : {&keys[i], &values[i]}) {
      TORCH_CHECK(t->scalar_type() == dtype && t->dim() == 4 && t->is_contiguous() &&
                      t->size(0) == (per_row ? 1 : rows) && t->size(1) == p.kv_heads && t->size(3) == p.d_head &&
                      t->sizes() == keys[i].sizes(),
                  kOp, "cache tensors must be contiguous float32 or float16, all of one dtype, (", per_row ? 1 : rows,
                  ", ", p.kv_heads, ", capacity, ", p.d_head, "); got ", t->sizes(), " ", t->scalar_type(),
                  " beside ", keys[0].scalar_type());
    }
    const int64_t cap = keys[i].size(2);
    for (int64_t r = per_row ? static_cast<int64_t>(i) / L : 0; r < (per_row ? static_cast<int64_t>(i) / L + 1 : rows);
         ++r) {
      const int64_t l = per_row ? static_cast<int64_t>(i) % L : static_cast<int64_t>(i);
      const int64_t offset = per_row ? 0 : r * keys[i].stride(0);
      const int64_t bytes = offset * static_cast<int64_t>(keys[i].element_size());
      c.keys[static_cast<size_t>(r * L + l)] = static_cast<uint8_t*>(keys[i].data_ptr()) + bytes;
      c.values[static_cast<size_t>(r * L + l)] = static_cast<uint8_t*>(values[i].data_ptr()) + bytes;
      c.capacity[static_cast<size_t>(r * L + l)] = cap;
    }
  }
  std::vector<int64_t> last(c.columns, c.columns + rows);  // per row, the last column written to its cache
  for (int64_t r = 0; r < rows; ++r) {  // rows sharing a cache: the tokens of one sequence, at distinct columns
    for (int64_t o = 0; o < rows; ++o) {
      if (o == r || c.keys[static_cast<size_t>(r * L)] != c.keys[static_cast<size_t>(o * L)]) continue;
      c.shared_cache = true;
      TORCH_CHECK(c.columns[r] != c.columns[o], kOp, "rows ", std::min(o, r), " and ", std::max(o, r),
                  " share a cache and write the same column ", c.columns[r]);
      last[static_cast<size_t>(r)] = std::max(last[static_cast<size_t>(r)], c.columns[o]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(c.columns[r] >= 0 && c.starts[r] >= 0 && c.starts[r] <= c.columns[r], kOp, "row ", r, ": column ",
                c.columns[r], " and start ", c.starts[r], " must satisfy 0 <= start <= column");
  }
  for (int64_t r = 0; r < rows; ++r) {  // a column past a layer's capacity wraps: only a local layer's ring may
    for (int64_t l = 0; l < L; ++l) {
      const int64_t cap = c.capacity[static_cast<size_t>(r * L + l)], window = p.layers[static_cast<size_t>(l)].window;
      const int64_t need = last[static_cast<size_t>(r)] - c.columns[r] + window;  // its window, and later rows'
      TORCH_CHECK(last[static_cast<size_t>(r)] < cap || (window > 0 && cap >= need), kOp, "row ", r, ", layer ", l,
                  ": column ", c.columns[r], " outside a cache of ", cap, " columns; only a local layer's ring of ",
                  "its window and the columns later rows of its sequence write (", window > 0 ? need : 0,
                  " here) may hold fewer than its columns");
    }
  }
  c.math = float_math(current_isa());  // the float routines follow ONEBLOCK_KERNELS
  return c;
}

}  // namespace oneblock

namespace {

std::vector<std::string> keys_of(const std::string& group) {
  using namespace oneblock;
  auto all = [](const auto& keys) { return std::vector<std::string>(std::begin(keys), std::end(keys)); };
  if (group == "sizes") return all(kSizeKeys);
  if (group == "scalars") return all(kScalarKeys);
  if (group == "tensors") return all(kModelKeys);
  if (group == "layer_sizes") return all(kLayerSizeKeys);
  TORCH_CHECK(group == "layers", kPlan, "no group of keys '", group,
              "'; the groups are sizes, scalars, tensors, layer_sizes, layers");
  return all(kLayerKeys);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(oneblock, m) {
  using oneblock::StepPlan;
  m.class_<StepPlan>("StepPlan")
      .def(torch::init<c10::Dict<std::string, int64_t>, c10::Dict<std::string, double>,
                       c10::Dict<std::string, at::Tensor>, c10::Dict<std::string, int64_t>,
                       c10::List<c10::Dict<std::string, int64_t>>, c10::List<c10::Dict<std::string, at::Tensor>>,
                       c10::List<c10::Dict<std::string, int64_t>>>())
      .def("add_lora", &StepPlan::add_lora)
      .def("vocab", [](const c10::intrusive_ptr<StepPlan>& self) { return self->plan().vocab; })
      .def("n_layers", [](const c10::intrusive_ptr<StepPlan>& self) { return self->plan().n_layers; })
      // A trace (torch.compile, FakeTensorMode) passes the real plan to the fake kernel, which reads its vocab; one
      // plan is equal to itself only.
      .def("tracing_mode", [](const c10::intrusive_ptr<StepPlan>&) { return std::string("real"); })
      .def("__eq__", [](const c10::intrusive_ptr<StepPlan>& self, const c10::intrusive_ptr<StepPlan>& other) {
        return self.get() == other.get();
      })
      .def_static("keys", &keys_of);
  m.def(
      "decode_step(__torch__.torch.classes.oneblock.StepPlan plan, Tensor tokens, Tensor positions, Tensor columns, "
      "Tensor starts, Tensor[] keys, Tensor[] values, Tensor adapters, int logits_from=0) -> Tensor");
}
