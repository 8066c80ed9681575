// The plan of the native decode step: a StepPlan (decode_plan.cpp) reads and checks a model's tensors once, by
// name, into pointers (Plan); each call adds its rows (Call) and runs the passes of decode_step.cpp. The StepPlan
// holds the tensors it points into; Plan and Call own no memory.
//
// torch.classes.oneblock.StepPlan(sizes, scalars, tensors, formats, layer_sizes, layers, layer_formats), built
// once per generation by oneblock/inference/native_step.py; every key below is required unless marked optional,
// and a key not listed is refused by name:
//
//   sizes         {str: int}  kSizeKeys: d_model, n_heads, n_kv_heads, d_head, d_ff, vocab, norm, ffn, activation,
//                 position, position_offset, final_norm, out_norm, qk_norm
//                 norm 0 LayerNorm / 1 RMSNorm; ffn 0 MLP / 1 gated (act(gate) * up); activation as step_math.h;
//                 position 0 none / 1 learned / 2 rotary (tables (P, R): the first R <= Dh features of each head
//                 rotate, the rest pass unchanged, as Phi-4-mini's); out_norm 0 none / 1 sandwich: each sublayer's
//                 output normalized before the residual add too (Gemma) / 2 output: only that, no norm before the
//                 sublayers (OLMo 2: no attn_norm, ffn_norm); qk_norm 0 none / 1 an RMSNorm over each head of q and
//                 of k before rotary (Qwen3) / 2 one over the whole q row (H Dh) and one over the whole k row
//                 (Hkv Dh) (OLMo 2)
//   scalars       {str: float}  kScalarKeys: norm_eps, attn_scale, embed_scale, attn_softcap, logit_softcap,
//                 residual_multiplier, logits_scaling
//                 embed_scale multiplies the token row (1: none; Granite's embedding_multiplier); a softcap of 0 is
//                 none, else s -> tanh(s / cap) * cap on the scaled scores before the softmax / on the logits;
//                 residual_multiplier scales each sublayer's output (normalized first where out_norm) before the
//                 residual add, logits_scaling divides the logits before their softcap (Granite; 1: none)
//   tensors       {str: Tensor}  kModelKeys: tok (V, C), head_w (V, C); optional: pos (P, C) (position 1),
//                 rope_cos, rope_sin (P, R) (position 2), rope_local_cos, rope_local_sin (P, R) (Gemma 3's local
//                 layers), final_norm_w, final_norm_b (C,) (final_norm 1), head_b (V,)
//   formats       {str: int}  the format of a matrix among tensors (tok, head_w); optional, absent: 0
//   layer_sizes   [{str: int}] one per layer, kLayerSizeKeys: window 0 (the whole context) or W (a query at column
//                 c sees columns > c - W), rope 0 no rotary (SmolLM3's layers without positions) / 1 the model's
//                 tables / 2 the local tables (Gemma 3's local layers)
//   layers        [{str: Tensor}] one per layer, kLayerKeys, all optional as the model has them:
//                 attn_norm_w, attn_norm_b, q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, ffn_norm_w, ffn_norm_b,
//                 gate_w, gate_b, up_w, up_b, down_w, down_b, q_norm_w, k_norm_w, attn_out_norm_w,
//                 attn_out_norm_b, ffn_out_norm_w, ffn_out_norm_b
//                 q_w may hold q, k and v stacked (no k_w, v_w); gate_w gate and up stacked (no up_w), or the MLP's
//                 first matrix; q_norm_w, k_norm_w (Dh,) each, or (H Dh,) and (Hkv Dh,) over the width
//   layer_formats [{str: int}] one per layer: the format of its matrices (q_w ... down_w); absent: 0
//
// A format is 0 = float32 (N, K), else the GGUF type of (N, K / n * nbytes) uint8 blocks of n values: 32, or 256
// for the K-quants (Q4_K, Q6_K), whose K must be a multiple of 256.
//
// LoRA adapters, rows of different adapters in one step (oneblock/adapters/multi.py, MultiLoraLinear), added to
// the plan one update at a time (decode_lora.cpp):
//
//   plan.add_lora(layer, matrix, adapter, scale, A, B)    matrix one of q_w ... down_w the layer has; adapter >= 1;
//                                                         A (r, K), B (N, r) float32; scale alpha / r
//   a row of adapter k:  out[:, matrix's columns] = (x W^T + b) + (x A_k^T) B_k^T * scale_k    as MultiLoraLinear
//
// A call, oneblock::decode_step(plan, tokens, positions, columns, starts, keys, values, adapters, logits_from)
// (decode_step.cpp), checks only its own arguments:
//
//   tokens, positions, columns, starts   (B,) int64 each: token id, position (rotary / learned), cache column
//                                        written, first cache column attended
//   keys, values   per layer one (B, Hkv, capacity, Dh) float32 or float16 buffer (all of one dtype; float16
//                  rounded as stored, widened as read), or per row and layer one (1, Hkv,
//                  capacity_r, Dh) buffer (keys[r * L + l]); rows sharing one are the tokens of one prompt.
//                  Column c lives at c % capacity: a layer's capacity exceeds every column (the whole context),
//                  or, for a local layer, it is a ring (oneblock.layers.kv_cache.RingKVCache) of at least its
//                  window plus the columns that later rows sharing it write before this row attends
//   adapters       (B,) int64: each row's adapter, 0 for the base (read only when the plan holds LoRA updates)
//   logits_from    the first row whose logits are computed (the op returns (B - logits_from, V)): a prompt read
//                  in one call as rows of one sequence needs only its last row's, a chunk before its last none (B).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dot.h"
#include "step_math.h"

namespace oneblock {

// The keys of a StepPlan's dicts, in the order of its arrays (oneblock/kernels/decode_step.py names them once more;
// StepPlan.keys returns these, and a test checks that both agree).
inline constexpr const char* kSizeKeys[] = {
    "d_model", "n_heads", "n_kv_heads", "d_head", "d_ff", "vocab", "norm", "ffn", "activation", "position",
    "position_offset", "final_norm", "out_norm", "qk_norm"};
inline constexpr const char* kScalarKeys[] = {"norm_eps",      "attn_scale",          "embed_scale",   "attn_softcap",
                                              "logit_softcap", "residual_multiplier", "logits_scaling"};
inline constexpr const char* kModelKeys[] = {"tok",    "pos",    "rope_cos", "rope_sin",       "final_norm_w",
                                             "final_norm_b", "head_w", "head_b",   "rope_local_cos", "rope_local_sin"};
inline constexpr const char* kLayerSizeKeys[] = {"window", "rope"};
inline constexpr const char* kLayerKeys[] = {
    "attn_norm_w", "attn_norm_b", "q_w", "q_b", "k_w", "k_b", "v_w", "v_b", "o_w", "o_b", "ffn_norm_w", "ffn_norm_b",
    "gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b",  // the norms and matrices, (weight, bias) pairs
    "q_norm_w", "k_norm_w", "attn_out_norm_w", "attn_out_norm_b", "ffn_out_norm_w", "ffn_out_norm_b"};
constexpr int64_t kMaxParts = 3;

// One weight matrix (N, K): float32 rows (fmt 0) or GGUF block rows (K / 32 blocks, K / 256 for a K-quant).
struct Matrix {
  const uint8_t* data = nullptr;
  int64_t fmt = 0;
  int64_t n = 0;
  int64_t row_bytes = 0;
  const float* bias = nullptr;  // (N,) or null
};

// One adapter's low-rank update of one matrix of a product, for the rows of that adapter.
struct LoraUpdate {
  const float* a = nullptr;  // (rank, K)
  const float* b = nullptr;  // (n, rank)
  int64_t rank = 0;
  int64_t adapter = 0;  // the rows whose adapter index is this one (>= 1)
  float scale = 0.0f;
  int64_t offset = 0;  // the matrix's first column among the product's outputs
  int64_t n = 0;       // the matrix's rows
  int64_t t = 0;       // where its (rank,) values x A^T sit in a row of the low-rank buffer
};

// Matrices reading the same input, their outputs side by side: [q | k | v], [gate | up], or one matrix.
struct Product {
  Matrix parts[kMaxParts];
  int count = 0;
  int64_t n = 0;  // the sum of the parts' N
  int64_t k = 0;
  // The 8-bit activation blocks its parts read, each kind quantized once per input row for all of them:
  bool block = false;    // some part is of 32-value blocks: Q8_0 / Q8_1 blocks of 32
  bool k_block = false;  // some part is a K-quant: Q8_K blocks of 256
  std::vector<LoraUpdate> lora;  // empty without adapters
};

// The input rows of a product (decode_products.cpp): float rows (float32 matrices) and their 8-bit blocks,
// of 32 (codes, d and the Q8_1 sums s per 32 values) and of 256 (Q8_K: codes, d per 256, sums per 16; null
// where no product of the input reads them).
struct Input {
  const float* x;
  const ActRow* q;
  const ActRow* k;
  int8_t* codes;
  float* d;
  float* s;
  int8_t* k_codes;
  float* k_d;
  int16_t* k_sums;
};

// The block buffers of an input, reused from call to call (grown, never shrunk).
struct InputBlocks {
  std::vector<int8_t> codes, k_codes;
  std::vector<float> d, s, k_d;
  std::vector<int16_t> k_sums;
  std::vector<ActRow> acts, k_acts;
  // The input of `rows` rows of `width` floats at x; with Q8_K blocks where `k_quant` (width whole 256-blocks).
  Input bind(const float* x, int64_t rows, int64_t width, bool k_quant);
};

struct Layer {
  const float* attn_norm_w;
  const float* attn_norm_b;
  const float* ffn_norm_w;
  const float* ffn_norm_b;
  Product qkv, o, up, down;
  // The options, null / 0 where the model does not have them.
  const float* q_norm_w = nullptr;  // (Dh,) each: per head
  const float* k_norm_w = nullptr;
  const float* q_width_norm_w = nullptr;  // (H Dh,), (Hkv Dh,): over the width
  const float* k_width_norm_w = nullptr;
  const float* attn_out_norm_w = nullptr;  // (C,) each: a sandwich block's
  const float* attn_out_norm_b = nullptr;
  const float* ffn_out_norm_w = nullptr;
  const float* ffn_out_norm_b = nullptr;
  int64_t window = 0;  // a local layer's last columns attended; 0: all
  const float* rope_cos = nullptr;  // (P, rope_dims): the model's tables or the local ones, or null
  const float* rope_sin = nullptr;
};

// The model, read and checked once (StepPlan, decode_plan.cpp): every call reads it, none writes it.
struct Plan {
  int64_t n_layers, d_model, heads, kv_heads, d_head, d_ff, vocab;
  int64_t norm, ffn, act, position, position_offset;
  int64_t out_norm, qk_norm;  // as in sizes: 0 none; out_norm 1 sandwich / 2 output; qk_norm 1 head / 2 width
  bool final_norm;
  int64_t rope_dims = 0;  // R: the rotary tables' width, <= d_head
  float eps, scale, embed_scale, attn_softcap, logit_softcap, residual, logits_scaling;
  Matrix tok;              // (V, C) token table
  const float* pos = nullptr;  // (P, C) learned positions, or null
  const float* rope_cos = nullptr;  // (P, rope_dims), or null
  const float* rope_sin = nullptr;
  int64_t table = -1, local_table = -1;  // the rows P of the position or rotary tables, of the local ones; -1: none
  const float* final_w = nullptr;
  const float* final_b = nullptr;
  Product head;
  std::vector<Layer> layers;
  // The width of a row of the low-rank buffer (the largest sum of ranks over one product's updates); 0: no LoRA.
  int64_t lora_width = 0;
};

// One call's rows, read and checked by each call (decode_step.cpp).
struct Call {
  int64_t rows;
  // Per row: token id, position (rotary / learned), cache column written, first cache column attended.
  const int64_t* tokens;
  const int64_t* positions;
  const int64_t* columns;
  const int64_t* starts;
  const int64_t* adapters = nullptr;  // per row: its adapter (0: the base), or null without LoRA updates
  // The caches of row r, layer l: keys[r * n_layers + l] and values[...], each (Hkv, capacity[r * n_layers + l],
  // Dh) float32, or float16 where `half` (every cache of a call has one dtype), column c at c % capacity (a local
  // layer's ring).
  std::vector<void*> keys, values;
  std::vector<int64_t> capacity;
  bool half = false;
  // Rows that share a cache (the tokens of one prompt, at their own columns): every row's key and value are
  // written before any row attends, so a row sees the rows before it.
  bool shared_cache = false;
  int64_t logits_from = 0;  // the logits computed: rows [logits_from, rows)
  FloatMath math;           // the float routines of the instruction set in use (set_isa)
};

// Reads and checks one call's arguments against the plan (decode_plan.cpp). The tensors must outlive the call.
Call read_call(const Plan& p, const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& columns,
               const at::Tensor& starts, at::TensorList keys, at::TensorList values, const at::Tensor& adapters,
               int64_t logits_from);

// torch.classes.oneblock.StepPlan (decode_plan.cpp): a model's Plan, read and checked once from named tensors
// (the arguments above), holding the tensors it points into.
class StepPlan : public torch::CustomClassHolder {
 public:
  StepPlan(c10::Dict<std::string, int64_t> sizes, c10::Dict<std::string, double> scalars,
           c10::Dict<std::string, at::Tensor> tensors, c10::Dict<std::string, int64_t> formats,
           c10::List<c10::Dict<std::string, int64_t>> layer_sizes, c10::List<c10::Dict<std::string, at::Tensor>> layers,
           c10::List<c10::Dict<std::string, int64_t>> layer_formats);
  // One LoRA update of a layer's matrix (decode_lora.cpp), checked as it is added.
  void add_lora(int64_t layer, const std::string& matrix, int64_t adapter, double scale, const at::Tensor& a,
                const at::Tensor& b);
  const Plan& plan() const { return plan_; }

 private:
  Plan plan_;
  c10::Dict<std::string, at::Tensor> tensors_;  // what plan_ points into
  c10::List<c10::Dict<std::string, at::Tensor>> layers_;
  std::vector<at::Tensor> lora_;
};

// The blocks that `prod` reads of columns [j0, j1) of row r of an input of width k (decode_products.cpp):
// whole blocks of 32, and of 256 where a part is a K-quant.
void quantize_range(const Input& in, const Product& prod, int64_t k, int64_t r, int64_t j0, int64_t j1);

// out[r * stride + j - first] = in_r . W_j + b_j for every row r (c.rows where rows < 0) and columns [j0, j1) of
// the product's side-by-side outputs (`first`: the column out[0] holds, j0 or below), each part with the blocks of
// its own size. Every output is computed by the same instructions whatever the rows and the range.
void multiply(const Call& c, const Product& prod, const Input& in, int64_t j0, int64_t j1, float* out,
              int64_t stride, int64_t rows = -1, int64_t first = 0);

// Columns per chunk of a pass over n columns: about eight chunks per thread, in whole units of columns (32, or
// 256 where a chunk's columns are quantized to Q8_K blocks).
int64_t chunk_columns(int64_t n, int64_t threads, int64_t unit = QK);

// The attention pass, one (row r, kv head g) of layer l at a time (decode_attention.cpp); `qkv_row` is row r's
// [q | k | v], `scratch` a thread's own buffer:
//   normalize_qk_width  (qk_norm 2, a pass per row before the others) q and k of the row normalized in place
//   store         the head's key (normalized, rotated) and value written at the row's cache column (modulo the
//                 capacity: a ring)
//   attend_group  the query heads of group g (normalized, rotated) over the row's keys, a local layer's last
//                 `window` (in order, across a ring's end), into att_row's heads (the row's key stored already)
void normalize_qk_width(const Plan& p, const Call& c, int64_t l, float* qkv_row);
void store(const Plan& p, const Call& c, int64_t l, int64_t r, int64_t g, const float* qkv_row, std::vector<float>& scratch);
void attend_group(const Plan& p, const Call& c, int64_t l, int64_t r, int64_t g, const float* qkv_row, float* att_row,
                  std::vector<float>& scratch);

// The updates of a product, in two halves around its pass (decode_lora.cpp):
//   lora_a  before the pass, per row: t = x A^T for each update of row r's adapter      (rank,) values each
//   lora_b  in the pass, after the base product of columns [j0, j1): out += (t B^T) * scale on every row's own
//           adapter's columns (out[0] holding column `first`, as multiply's)
void lora_a(const Plan& p, const Call& c, const Product& prod, int64_t r, const float* x, float* t);
void lora_b(const Plan& p, const Call& c, const Product& prod, const float* t, int64_t j0, int64_t j1, float* out, int64_t stride,
            int64_t first = 0);

}  // namespace oneblock
