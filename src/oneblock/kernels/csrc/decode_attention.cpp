// The attention pass of the native decode step (decode_step.cpp), one (row, kv head) at a time: the head's key
// and value stored at the row's cache column, then the query heads it serves attending over the row's keys.
// They mirror oneblock.inference.plan's heads_of_one_token and attend_cached.
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

}  // namespace

// One (row, kv head): normalize (qk_norm), rotate and store the head's key and value at the row's column.
// `scratch` holds a normalized key.
void store(const Plan& p, int64_t l, int64_t r, int64_t g, const float* qkv_row, std::vector<float>& scratch) {
  const Layer& layer = p.layers[static_cast<size_t>(l)];
  const int64_t dh = p.d_head, col = p.columns[r], cap = p.capacity[static_cast<size_t>(r)];
  float* keys = p.keys[static_cast<size_t>(r * p.n_layers + l)] + g * cap * dh;
  float* values = p.values[static_cast<size_t>(r * p.n_layers + l)] + g * cap * dh;
  const float* k = qkv_row + (p.heads + g) * dh;
  const float* v = qkv_row + (p.heads + p.kv_heads + g) * dh;
  if (layer.k_norm_w != nullptr) {
    float* normed = room(scratch, dh);
    rms_norm(p.math, k, layer.k_norm_w, p.eps, dh, normed);
    k = normed;
  }
  if (layer.rope_cos != nullptr) {
    rotate(k, layer.rope_cos + p.positions[r] * dh, layer.rope_sin + p.positions[r] * dh, dh, keys + col * dh);
  } else {
    std::memcpy(keys + col * dh, k, static_cast<size_t>(dh) * sizeof(float));
  }
  std::memcpy(values + col * dh, v, static_cast<size_t>(dh) * sizeof(float));
}

// One (row, kv head): the query heads it serves attend over the row's keys (its own stored already), a local
// layer's over its last `window` columns.
void attend_group(const Plan& p, int64_t l, int64_t r, int64_t g, const float* qkv_row, float* att_row,
                  std::vector<float>& scratch) {
  const Layer& layer = p.layers[static_cast<size_t>(l)];
  const int64_t dh = p.d_head, rep = p.heads / p.kv_heads, col = p.columns[r];
  const int64_t start = layer.window > 0 ? std::max(p.starts[r], col - layer.window + 1) : p.starts[r];
  const int64_t cap = p.capacity[static_cast<size_t>(r)];
  const float* keys = p.keys[static_cast<size_t>(r * p.n_layers + l)] + g * cap * dh;
  const float* values = p.values[static_cast<size_t>(r * p.n_layers + l)] + g * cap * dh;
  const float* cos = layer.rope_cos != nullptr ? layer.rope_cos + p.positions[r] * dh : nullptr;
  const float* sin = layer.rope_sin != nullptr ? layer.rope_sin + p.positions[r] * dh : nullptr;
  const int64_t n = col - start + 1;
  float* scores = room(scratch, n + 2 * dh);
  float* q = scores + n;  // the rotated query
  float* normed = q + dh;  // the normalized one (qk_norm)
  for (int64_t h = g * rep; h < (g + 1) * rep; ++h) {
    const float* query = qkv_row + h * dh;
    if (layer.q_norm_w != nullptr) {
      rms_norm(p.math, query, layer.q_norm_w, p.eps, dh, normed);
      query = normed;
    }
    if (cos != nullptr) {
      rotate(query, cos, sin, dh, q);
      query = q;
    }
    attend(p.math, query, keys + start * dh, values + start * dh, n, dh, p.scale, p.attn_softcap, scores,
           att_row + h * dh);
  }
}

}  // namespace oneblock
