// The attention pass of the native decode step (decode_step.cpp), one (row, kv head) at a time: the head's key
// and value stored at the row's cache column, then the query heads it serves attending over the row's keys.
// They mirror oneblock.inference.plan's heads_of_one_token and attend_cached; a layer's options are null pointers
// where it does not have them (no q/k norm, no rotary), and then cost nothing.
#include <algorithm>
#include <cstring>
#include <vector>

#include "decode_step.h"

namespace oneblock {
namespace {

// `scratch` grown to at least n floats (never shrunk: a thread reuses it from call to call).
float* room(std::vector<float>& scratch, int64_t n) {
  if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(static_cast<size_t>(n));
  return scratch.data();
}

// One head (Dh,) rotated at row r's position into `out`: its first rope_dims features turned
// (rotate_half over them), the rest copied (partial rotary: apply_rotary with tables narrower than the head).
void turn(const Plan& p, const Call& c, const Layer& layer, int64_t r, const float* x, float* out) {
  const int64_t dh = p.d_head, rd = p.rope_dims, at = c.positions[r] * rd;
  rotate(x, layer.rope_cos + at, layer.rope_sin + at, rd, out);
  if (rd < dh) std::memcpy(out + rd, x + rd, static_cast<size_t>(dh - rd) * sizeof(float));
}

// One head (Dh,) as attention reads it, into `out`: normalized by `norm_w` where not null (`normed`: scratch for
// Dh floats), then rotated at row r's position where the layer has rotary, else copied.
void place(const Plan& p, const Call& c, const Layer& layer, int64_t r, const float* x, const float* norm_w,
           float* normed, float* out) {
  if (norm_w != nullptr) {
    rms_norm(c.math, x, norm_w, p.eps, p.d_head, normed);
    x = normed;
  }
  if (layer.rope_cos != nullptr) {
    turn(p, c, layer, r, x, out);
  } else {
    std::memcpy(out, x, static_cast<size_t>(p.d_head) * sizeof(float));
  }
}

}  // namespace

// OLMo 2's q/k norms: one RMSNorm over the row's H Dh query features, one over its Hkv Dh key features (the heads
// side by side, as projected), in place, before any head is rotated or stored.
void normalize_qk_width(const Plan& p, const Call& c, int64_t l, float* qkv_row) {
  const Layer& layer = p.layers[static_cast<size_t>(l)];
  const int64_t hq = p.heads * p.d_head, hk = p.kv_heads * p.d_head;
  rms_norm(c.math, qkv_row, layer.q_width_norm_w, p.eps, hq, qkv_row);
  rms_norm(c.math, qkv_row + hq, layer.k_width_norm_w, p.eps, hk, qkv_row + hq);
}

// One (row, kv head): normalize (qk_norm), rotate and store the head's key and value at the row's column, rounded
// to float16 in a float16 cache. `scratch` holds a normalized key, and the key placed before it is rounded.
void store(const Plan& p, const Call& c, int64_t l, int64_t r, int64_t g, const float* qkv_row, std::vector<float>& scratch) {
  const Layer& layer = p.layers[static_cast<size_t>(l)];
  const size_t at = static_cast<size_t>(r * p.n_layers + l);
  const int64_t dh = p.d_head, cap = c.capacity[at], col = c.columns[r] % cap;  // a ring's column wraps
  const int64_t offset = (g * cap + col) * dh;  // the head's column, in values
  const float* k = qkv_row + (p.heads + g) * dh;
  const float* v = qkv_row + (p.heads + p.kv_heads + g) * dh;
  if (c.half) {
    float* placed = room(scratch, 2 * dh);
    place(p, c, layer, r, k, layer.k_norm_w, placed + dh, placed);
    c.math.narrow(placed, static_cast<uint16_t*>(c.keys[at]) + offset, dh);
    c.math.narrow(v, static_cast<uint16_t*>(c.values[at]) + offset, dh);
    return;
  }
  place(p, c, layer, r, k, layer.k_norm_w, room(scratch, dh), static_cast<float*>(c.keys[at]) + offset);
  std::memcpy(static_cast<float*>(c.values[at]) + offset, v, static_cast<size_t>(dh) * sizeof(float));
}

// One (row, kv head): the query heads it serves attend over the row's keys (its own stored already), a local
// layer's over its last `window` columns, in order: a ring's window that wraps is its end, then its start.
void attend_group(const Plan& p, const Call& c, int64_t l, int64_t r, int64_t g, const float* qkv_row, float* att_row,
                  std::vector<float>& scratch) {
  const Layer& layer = p.layers[static_cast<size_t>(l)];
  const int64_t dh = p.d_head, rep = p.heads / p.kv_heads, col = c.columns[r];
  const int64_t start = layer.window > 0 ? std::max(c.starts[r], col - layer.window + 1) : c.starts[r];
  const size_t at = static_cast<size_t>(r * p.n_layers + l);
  const int64_t cap = c.capacity[at];
  const int64_t n = col - start + 1, first = start % cap;
  const int64_t n1 = std::min(n, cap - first), n2 = n - n1;  // n2 > 0: the window wraps past the ring's end
  const bool together = dh % 8 == 0 && (c.half ? c.math.heads_half != nullptr : c.math.heads != nullptr);
  const int64_t wide = c.half && !together ? 2 * n * dh : 0;  // a float16 cache's keys and values, widened
  float* scores = room(scratch, rep * (n + 1 + dh) + dh + wide);  // (rep, n) scores, then each head's 1 / sum
  float* qs = scores + rep * (n + 1);  // (rep, dh): the group's queries side by side, normalized and rotated
  float* normed = qs + rep * dh;
  const float* queries = qkv_row + g * rep * dh;  // as projected, when neither normalized nor rotated
  if (layer.q_norm_w != nullptr || layer.rope_cos != nullptr) {
    for (int64_t i = 0; i < rep; ++i) place(p, c, layer, r, queries + i * dh, layer.q_norm_w, normed, qs + i * dh);
    queries = qs;
  }
  float* out = att_row + g * rep * dh;
  if (c.half && together) {  // the group's heads together, over the float16 cache as stored
    const uint16_t* keys = static_cast<const uint16_t*>(c.keys[at]) + g * cap * dh;
    const uint16_t* values = static_cast<const uint16_t*>(c.values[at]) + g * cap * dh;
    c.math.heads_half(queries, static_cast<int>(rep), keys + first * dh, values + first * dh, n1, keys, values, n2,
                      dh, p.scale, p.attn_softcap, scores, out);
    return;
  }
  // The window's keys and values: n1 from column `first` on, then n2 from column 0 (a ring that wraps).
  const float *k1, *v1, *k2, *v2;
  if (c.half) {  // widened into scratch, side by side
    const uint16_t* keys = static_cast<const uint16_t*>(c.keys[at]) + g * cap * dh;
    const uint16_t* values = static_cast<const uint16_t*>(c.values[at]) + g * cap * dh;
    float* k = normed + dh;
    float* v = k + n * dh;
    c.math.widen(keys + first * dh, k, n1 * dh);
    c.math.widen(keys, k + n1 * dh, n2 * dh);
    c.math.widen(values + first * dh, v, n1 * dh);
    c.math.widen(values, v + n1 * dh, n2 * dh);
    k1 = k, v1 = v, k2 = k + n1 * dh, v2 = v + n1 * dh;
  } else {
    const float* keys = static_cast<const float*>(c.keys[at]) + g * cap * dh;
    const float* values = static_cast<const float*>(c.values[at]) + g * cap * dh;
    k1 = keys + first * dh, v1 = values + first * dh, k2 = keys, v2 = values;
  }
  if (together) {  // the group's heads together
    c.math.heads(queries, static_cast<int>(rep), k1, v1, n1, k2, v2, n2, dh, p.scale, p.attn_softcap, scores, out);
    return;
  }
  for (int64_t i = 0; i < rep; ++i) {
    attend(c.math, queries + i * dh, k1, v1, n1, k2, v2, n2, dh, p.scale, p.attn_softcap, scores, out + i * dh);
  }
}

}  // namespace oneblock
