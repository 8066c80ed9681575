// oneblock::decode_step: one new token for B rows of a pre-LN decoder, in one call and one parallel region.
//
//   decode_step(StepPlan plan, Tensor tokens, Tensor positions, Tensor columns, Tensor starts, Tensor[] keys,
//               Tensor[] values, Tensor adapters, int logits_from=0) -> Tensor
//                                                                      logits (B - logits_from, V) float32
//
// The plan, a model's tensors read and checked once (decode_plan.cpp), serves every call; a call checks only its
// own arguments (read_call; the layout: decode_step.h).
//
// The passes mirror the Python step (oneblock.inference.decode.LeanDecode.step) one for one (the attention pass's
// store and attend_group: decode_attention.cpp):
//
//   embed                   token row (* embed_scale) (+ learned position row)            per row
//   per layer:
//     attn_norm             norm (none: OLMo 2), and the 8-bit blocks of the result (once, for q, k and v)
//                                                                                        per row
//     qkv                   [q | k | v] = x W^T + b                                      per range of columns
//     (qk_norm 2)           RMSNorm over the whole q row and the whole k row (OLMo 2)    per row
//     attention             normalize q and k per head (qk_norm 1), rotate them (their first rope_dims
//                           features; a local layer with its own tables, a layer without rotary not at all),
//                           write k and v at the row's column, attend over the row's keys (a local layer's
//                           last `window`; scores soft-capped), and the 8-bit blocks of the heads' output
//                                                                                        per (row, kv head)
//                           (rows sharing a cache, the tokens of one prompt: a pass writes every row's k and v
//                           first, so that each row attends over the rows before it)
//     o                     x += (out W_o^T + b) * residual_multiplier                   per range of columns
//     ffn_norm              as attn_norm                                                 per row
//     up                    h = act(gate) * up (gated) or act(x W_1^T + b) (MLP), and its 8-bit blocks
//                                                                                        per range of columns
//     down                  x += (h W_2^T + b) * residual_multiplier                     per range of columns
//   final_norm, head        logits = norm(x) W_head^T / logits_scaling (soft-capped)     per row, per range
//
// A block with output norms (out_norm: sandwich, Gemma; output, OLMo 2) normalizes each sublayer's output before
// the residual add; the norm needs the whole output row, so the add moves from the product's pass to the next
// per-row pass (ffn_norm after o; the next layer's attn_norm, or final_norm, after down): x += norm(y), then that
// pass's own norm, if any. A model without an option computes nothing of it (a test of a flag or a null pointer
// per pass): a residual_multiplier or logits_scaling of 1 multiplies and divides nothing.
//
// The 8-bit blocks are those of the product's matrices (decode_products.cpp): of 32 values for the 32-value
// formats, Q8_K blocks of 256 for the K-quants, both where a product mixes them; a pass that rounds part of a row
// rounds whole blocks of each kind.
//
// With LoRA adapters (decode_lora.cpp), a product some adapter updates gets its update's two halves: x A^T for
// each row's adapter in the pass that completes the product's input row (the norms; a pass of its own for the
// output projection's and down's inputs), and (x A^T) B^T * scale added after the base product, in the
// product's own pass, on the same columns. Without adapters neither is there.
//
// Threads: torch's OpenMP team runs one region per call. Each pass is cut into chunks that the threads claim
// from an atomic counter; a thread that runs out of chunks waits until every chunk of the pass is done, then
// goes on to the next pass. Nothing waits for a number of threads, only for chunks that a running thread has
// claimed: a region that gets fewer threads than asked (one, inside another parallel region) computes the same.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <sched.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "decode_step.h"

// The OpenMP runtime torch is linked with (libgomp; the library links the same one, see kernels/build.py), called
// directly so that one region holds the whole step; weak, so a runtime without it leaves the pointer null and the
// step runs on the calling thread.
extern "C" void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags)
    __attribute__((weak));

namespace oneblock {
namespace {

struct alignas(64) Counter {
  std::atomic<int64_t> claimed{0};
  std::atomic<int64_t> done{0};
};

// One thread's walk through the passes; every thread walks the same passes in the same order.
class Walk {
 public:
  explicit Walk(Counter* counters) : counters_(counters) {}

  template <typename F>
  void pass(int64_t chunks, const F& f) {
    Counter& c = counters_[next_++];
    for (int64_t i; (i = c.claimed.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      f(i);
      c.done.fetch_add(1, std::memory_order_release);
    }
    for (int spins = 0; c.done.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < 1024) {  // a few microseconds: the usual wait between passes
        _mm_pause();
      } else {
        sched_yield();  // a descheduled thread holds a chunk: let it run
      }
    }
  }

 private:
  Counter* counters_;
  int next_ = 0;
};

// Buffers reused from step to step (grown, never shrunk): a step allocates only its logits. A prompt's read (rows
// of one sequence) has its own, freed when it returns.
struct Workspace {
  std::vector<float> x, xn, qkv, att, y, h;
  std::vector<float> lt;  // per row, the low-rank values x A^T of the product being computed (LoRA only)
  InputBlocks bx, batt, bh;  // the 8-bit blocks of xn, att and h
  std::unique_ptr<Counter[]> counters;  // one per pass (atomics do not move: reallocated, never resized)
  int64_t n_counters = 0;
};

template <typename T>
void fit(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

// x normalized into `out`, or copied where the block has no norm before its sublayer (output norms alone: w null).
void normalize(const Plan& p, const Call& c, const float* x, const float* w, const float* b, float* out) {
  if (w == nullptr) {
    std::memcpy(out, x, static_cast<size_t>(p.d_model) * sizeof(float));
  } else if (p.norm == 1) {
    rms_norm(c.math, x, w, p.eps, p.d_model, out);
  } else {
    layer_norm(x, w, b, p.eps, p.d_model, out);
  }
}

// x[i] += y[i] for i < n: a sublayer's output joins the stream, scaled first where the model scales it (Granite's
// residual_multiplier, as Block._joins).
void add(const Plan& p, const float* y, float* x, int64_t n) {
  if (p.residual == 1.0f) {
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
  } else {
    for (int64_t i = 0; i < n; ++i) x[i] += y[i] * p.residual;
  }
}

// A sublayer's output y normalized (in place) before it joins the stream (out_norm): x += norm(y).
void join(const Plan& p, const Call& c, const float* w, const float* b, float* y, float* x) {
  normalize(p, c, y, w, b, y);
  add(p, y, x, p.d_model);
}

void step(const Plan& p, const Call& c, Workspace& ws, float* logits, int64_t threads) {
  const int64_t rows = c.rows, C = p.d_model, F = p.d_ff, hd = p.heads * p.d_head;
  const int64_t nqkv = p.layers[0].qkv.n;
  fit(ws.x, rows * C), fit(ws.xn, rows * C), fit(ws.y, rows * C), fit(ws.qkv, rows * nqkv);
  fit(ws.att, rows * hd), fit(ws.h, rows * F);
  fit(ws.lt, rows * p.lora_width);
  bool k_x = p.head.k_block, k_att = false, k_h = false;  // whether some product of the input is a K-quant
  for (const Layer& layer : p.layers) {
    k_x = k_x || layer.qkv.k_block || layer.up.k_block, k_att = k_att || layer.o.k_block;
    k_h = k_h || layer.down.k_block;
  }
  // At most: the passes before o and down are there only for quantizing the heads' output or for adapters.
  const int64_t passes = 3 + (p.lora_width > 0 ? 9 : 8) * p.n_layers + (c.shared_cache ? p.n_layers : 0) +
                         (p.qk_norm == 2 ? p.n_layers : 0);
  if (ws.n_counters < passes) ws.counters.reset(new Counter[passes]), ws.n_counters = passes;
  for (int64_t i = 0; i < passes; ++i) ws.counters[i].claimed.store(0), ws.counters[i].done.store(0);

  const Input xin = ws.bx.bind(ws.xn.data(), rows, C, k_x);
  const Input ain = ws.batt.bind(ws.att.data(), rows, hd, k_att);
  const Input hin = ws.bh.bind(ws.h.data(), rows, F, k_h);
  float *x = ws.x.data(), *xn = ws.xn.data(), *y = ws.y.data(), *qkv = ws.qkv.data();
  float *att = ws.att.data(), *h = ws.h.data(), *lt = ws.lt.data();
  const int64_t W = p.lora_width;
  // The up pass quantizes h per chunk of its columns: whole Q8_K blocks where down is a K-quant.
  const int64_t cols_c = chunk_columns(C, threads), cols_f = chunk_columns(F, threads, k_h ? QK_K : QK);
  const int64_t cols_qkv = chunk_columns(nqkv, threads), cols_v = chunk_columns(p.vocab, threads);
  auto chunks = [](int64_t n, int64_t per) { return (n + per - 1) / per; };
  // The attention output's blocks can be quantized per kv head when a group of heads is whole blocks (of 32, and
  // of 256 where o is a K-quant); else in a pass of their own.
  const int64_t width = p.heads / p.kv_heads * p.d_head;
  auto blocks_per_group = [&](const Product& o) {
    return (!o.block || width % QK == 0) && (!o.k_block || width % QK_K == 0);
  };

  auto body = [&]() {
    Walk walk(ws.counters.get());
    walk.pass(rows, [&](int64_t r) {
      float* row = x + r * C;
      if (p.tok.fmt == 0) {
        std::memcpy(row, reinterpret_cast<const float*>(p.tok.data) + c.tokens[r] * C, C * sizeof(float));
      } else {
        if (is_interleaved(p.tok.fmt)) {
          const int64_t group = c.tokens[r] / kGroupRows * kGroupRows;
          decode_interleaved_row(p.tok.data + group * p.tok.row_bytes, static_cast<int>(c.tokens[r] - group),
                                 p.tok.fmt, C / block_values(file_format(p.tok.fmt)), row);
        } else {
          decode_row(p.tok.data + c.tokens[r] * p.tok.row_bytes, p.tok.fmt, C / block_values(p.tok.fmt), row);
        }
      }
      if (p.embed_scale != 1.0f) {
        for (int64_t i = 0; i < C; ++i) row[i] *= p.embed_scale;
      }
      if (p.pos != nullptr) {
        const float* pos = p.pos + (c.positions[r] + p.position_offset) * C;
        for (int64_t i = 0; i < C; ++i) row[i] += pos[i];
      }
    });
    for (int64_t l = 0; l < p.n_layers; ++l) {
      const Layer& layer = p.layers[static_cast<size_t>(l)];
      const bool per_group = blocks_per_group(layer.o);
      walk.pass(rows, [&](int64_t r) {
        if (p.out_norm != 0 && l > 0) {  // the previous layer's feed-forward output joins the stream
          const Layer& before = p.layers[static_cast<size_t>(l - 1)];
          join(p, c, before.ffn_out_norm_w, before.ffn_out_norm_b, y + r * C, x + r * C);
        }
        normalize(p, c, x + r * C, layer.attn_norm_w, layer.attn_norm_b, xn + r * C);
        quantize_range(xin, layer.qkv, C, r, 0, C);
        if (!layer.qkv.lora.empty()) lora_a(p, c, layer.qkv, r, xn + r * C, lt + r * W);
      });
      walk.pass(chunks(nqkv, cols_qkv), [&](int64_t i) {
        const int64_t j0 = i * cols_qkv, j1 = std::min(nqkv, j0 + cols_qkv);
        multiply(c, layer.qkv, xin, j0, j1, qkv, nqkv);
        if (!layer.qkv.lora.empty()) lora_b(p, c, layer.qkv, lt, j0, j1, qkv, nqkv);
      });
      if (p.qk_norm == 2) {  // norms over the whole q and k rows: before any head is stored or attends
        walk.pass(rows, [&](int64_t r) { normalize_qk_width(p, c, l, qkv + r * nqkv); });
      }
      if (c.shared_cache) {  // rows of one sequence: every key stored before any row attends
        walk.pass(rows * p.kv_heads, [&](int64_t i) {
          thread_local std::vector<float> scratch;
          const int64_t r = i / p.kv_heads;
          store(p, c, l, r, i % p.kv_heads, qkv + r * nqkv, scratch);
        });
      }
      walk.pass(rows * p.kv_heads, [&](int64_t i) {
        thread_local std::vector<float> scratch;
        const int64_t r = i / p.kv_heads, g = i % p.kv_heads;
        if (!c.shared_cache) store(p, c, l, r, g, qkv + r * nqkv, scratch);
        attend_group(p, c, l, r, g, qkv + r * nqkv, att + r * hd, scratch);
        if (per_group) quantize_range(ain, layer.o, hd, r, g * width, (g + 1) * width);
      });
      if (!per_group || !layer.o.lora.empty()) {
        walk.pass(rows, [&](int64_t r) {
          if (!per_group) quantize_range(ain, layer.o, hd, r, 0, hd);
          if (!layer.o.lora.empty()) lora_a(p, c, layer.o, r, att + r * hd, lt + r * W);
        });
      }
      walk.pass(chunks(C, cols_c), [&](int64_t i) {  // x += attention output W_o^T + b
        const int64_t j0 = i * cols_c, j1 = std::min(C, j0 + cols_c);
        multiply(c, layer.o, ain, j0, j1, y, C);
        if (!layer.o.lora.empty()) lora_b(p, c, layer.o, lt, j0, j1, y, C);
        for (int64_t r = 0; r < rows && p.out_norm == 0; ++r) {  // out_norm: joins in the next pass, normalized
          add(p, y + r * C + j0, x + r * C + j0, j1 - j0);
        }
      });
      walk.pass(rows, [&](int64_t r) {
        if (p.out_norm != 0) join(p, c, layer.attn_out_norm_w, layer.attn_out_norm_b, y + r * C, x + r * C);
        normalize(p, c, x + r * C, layer.ffn_norm_w, layer.ffn_norm_b, xn + r * C);
        quantize_range(xin, layer.up, C, r, 0, C);
        if (!layer.up.lora.empty()) lora_a(p, c, layer.up, r, xn + r * C, lt + r * W);
      });
      walk.pass(chunks(F, cols_f), [&](int64_t i) {  // h = act(gate) * up, or act(x W_1^T + b)
        const int64_t j0 = i * cols_f, j1 = std::min(F, j0 + cols_f), n = j1 - j0;
        // The chunk's columns in this thread's buffer, (rows, n) and for a gated network the up columns beside
        // them, (rows, 2n): a prompt's rows never hold the whole (rows, 2F).
        thread_local std::vector<float> ff;
        const int64_t nff = p.ffn == 1 ? 2 * n : n;
        fit(ff, rows * nff);
        multiply(c, layer.up, xin, j0, j1, ff.data(), nff, -1, j0);
        if (p.ffn == 1) multiply(c, layer.up, xin, F + j0, F + j1, ff.data() + n, nff, -1, F + j0);
        if (!layer.up.lora.empty()) {
          lora_b(p, c, layer.up, lt, j0, j1, ff.data(), nff, j0);
          if (p.ffn == 1) lora_b(p, c, layer.up, lt, F + j0, F + j1, ff.data() + n, nff, F + j0);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const float* in = ff.data() + r * nff;
          c.math.activate(p.act, in, p.ffn == 1 ? in + n : nullptr, h + r * F + j0, n);
          quantize_range(hin, layer.down, F, r, j0, j1);
        }
      });
      if (!layer.down.lora.empty()) {
        walk.pass(rows, [&](int64_t r) { lora_a(p, c, layer.down, r, h + r * F, lt + r * W); });
      }
      walk.pass(chunks(C, cols_c), [&](int64_t i) {  // x += h W_2^T + b
        const int64_t j0 = i * cols_c, j1 = std::min(C, j0 + cols_c);
        multiply(c, layer.down, hin, j0, j1, y, C);
        if (!layer.down.lora.empty()) lora_b(p, c, layer.down, lt, j0, j1, y, C);
        for (int64_t r = 0; r < rows && p.out_norm == 0; ++r) {  // out_norm: joins in the next pass, normalized
          add(p, y + r * C + j0, x + r * C + j0, j1 - j0);
        }
      });
    }
    const int64_t r0 = c.logits_from;  // the rows whose logits are asked for: [r0, rows)
    if (r0 == rows) return;  // none: a prompt's chunk that others follow
    walk.pass(rows - r0, [&](int64_t i) {
      const int64_t r = r0 + i;
      if (p.out_norm != 0) {
        const Layer& last = p.layers.back();
        join(p, c, last.ffn_out_norm_w, last.ffn_out_norm_b, y + r * C, x + r * C);
      }
      if (p.final_norm) {
        normalize(p, c, x + r * C, p.final_w, p.final_b, xn + r * C);
      } else {
        std::memcpy(xn + r * C, x + r * C, C * sizeof(float));
      }
      quantize_range(xin, p.head, C, r, 0, C);
    });
    Input head_in = xin;  // rows [r0, rows)
    head_in.x += r0 * C, head_in.q += r0, head_in.k = xin.k != nullptr ? xin.k + r0 : nullptr;
    walk.pass(chunks(p.vocab, cols_v), [&](int64_t i) {
      const int64_t j0 = i * cols_v, j1 = std::min(p.vocab, j0 + cols_v);
      multiply(c, p.head, head_in, j0, j1, logits, p.vocab, rows - r0);
      if (p.logits_scaling != 1.0f) {  // Granite: logits / logits_scaling, before any softcap
        for (int64_t r = 0; r < rows - r0; ++r) {
          for (int64_t j = j0; j < j1; ++j) logits[r * p.vocab + j] /= p.logits_scaling;
        }
      }
      if (p.logit_softcap > 0.0f) {
        for (int64_t r = 0; r < rows - r0; ++r) softcap(logits + r * p.vocab + j0, j1 - j0, p.logit_softcap);
      }
    });
  };
  if (GOMP_parallel != nullptr && threads > 1) {
    using Body = decltype(body);
    GOMP_parallel([](void* f) { (*static_cast<Body*>(f))(); }, &body, static_cast<unsigned>(threads), 0);
  } else {
    body();
  }
}

at::Tensor decode_step(const c10::intrusive_ptr<StepPlan>& plan, const at::Tensor& tokens, const at::Tensor& positions,
                       const at::Tensor& columns, const at::Tensor& starts, at::TensorList keys, at::TensorList values,
                       const at::Tensor& adapters, int64_t logits_from) {
  const Plan& p = plan->plan();
  const Call c = read_call(p, tokens, positions, columns, starts, keys, values, adapters, logits_from);
  at::Tensor logits = at::empty({c.rows - c.logits_from, p.vocab}, tokens.options().dtype(at::kFloat));
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (c.shared_cache) {  // a prompt's rows: buffers as large as its chunk, freed on return, not kept for the decode
    Workspace ws;
    step(p, c, ws, logits.data_ptr<float>(), threads);
  } else {
    thread_local Workspace ws;  // per calling thread: two decoders on two threads never share buffers
    step(p, c, ws, logits.data_ptr<float>(), threads);
  }
  return logits;
}

}  // namespace
}  // namespace oneblock

// The op's schema: decode_plan.cpp, beside the StepPlan class it takes.
TORCH_LIBRARY_IMPL(oneblock, CPU, m) { m.impl("decode_step", &oneblock::decode_step); }
