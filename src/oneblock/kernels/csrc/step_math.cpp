// The float pieces of the native decode step: scalar twins, then AVX2 (compiled by target attribute, called only
// where the CPU reports AVX2, FMA and F16C). See step_math.h for what each mirrors in the Python step.
#include "step_math.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "dot.h"
#include "exp_avx2.h"
#include "sum_avx2.h"

#define OB_AVX2 __attribute__((target("avx2,fma")))

namespace oneblock {

// -- scalar twins: one float operation at a time, in order ----------------------------------------------------

void float_dot_scalar(const float* w, int64_t k, int cols, const float* x, float* out) {
  for (int c = 0; c < cols; ++c) {
    const float* row = w + c * k;
    float acc = 0.0f;
    for (int64_t i = 0; i < k; ++i) acc += row[i] * x[i];
    out[c] = acc;
  }
}

void axpy_scalar(float a, const float* v, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * v[i];
}

// -- AVX2 --------------------------------------------------------------------------------------------------

namespace {

// C weight rows at once (independent accumulators keep the FMA units busy); per output two 8-lane accumulators
// over 16 values a step, then the tail one value at a time: the same instructions for every C.
template <int C>
OB_AVX2 void dot_rows(const float* w, int64_t k, const float* x, float* out) {
  __m256 a0[C], a1[C];
  for (int c = 0; c < C; ++c) a0[c] = a1[c] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    for (int c = 0; c < C; ++c) {
      a0[c] = _mm256_fmadd_ps(_mm256_loadu_ps(w + c * k + i), x0, a0[c]);
      a1[c] = _mm256_fmadd_ps(_mm256_loadu_ps(w + c * k + i + 8), x1, a1[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    float acc = hsum(_mm256_add_ps(a0[c], a1[c]));
    for (int64_t j = i; j < k; ++j) acc += w[c * k + j] * x[j];
    out[c] = acc;
  }
}

}  // namespace

OB_AVX2 void float_dot_avx2(const float* w, int64_t k, int cols, const float* x, float* out) {
  switch (cols) {
    case 1: return dot_rows<1>(w, k, x, out);
    case 2: return dot_rows<2>(w, k, x, out);
    case 3: return dot_rows<3>(w, k, x, out);
    default: return dot_rows<4>(w, k, x, out);
  }
}

OB_AVX2 void axpy_avx2(float a, const float* v, float* y, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(v + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * v[i];
}

void activate_scalar(int64_t kind, const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = up != nullptr ? activation(kind, gate[i]) * up[i] : activation(kind, gate[i]);
}

// x sigmoid(z) for 8 values, z = x (SiLU) or 2 sqrt(2 / pi) (x + 0.044715 x^3) (tanh-GELU: 0.5 x (1 + tanh(z / 2))),
// from t = e^-|z| (exp256's domain): x / (1 + t) for z >= 0, x t / (1 + t) below, so that no 1 - t cancels.
OB_AVX2 inline __m256 x_sigmoid(__m256 x, bool gelu) {
  __m256 z = x;
  if (gelu) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    z = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, x));
  }
  const __m256 t = exp256(_mm256_or_ps(z, _mm256_set1_ps(-0.0f)));  // -|z|
  const __m256 top = _mm256_blendv_ps(x, _mm256_mul_ps(x, t), _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ));
  return _mm256_div_ps(top, _mm256_add_ps(_mm256_set1_ps(1.0f), t));
}

// out[0, 8) = x sigmoid(z) of gate[0, 8), times up[0, 8) unless up is null.
OB_AVX2 inline void activate8(const float* gate, const float* up, float* out, bool gelu) {
  const __m256 y = x_sigmoid(_mm256_loadu_ps(gate), gelu);
  _mm256_storeu_ps(out, up != nullptr ? _mm256_mul_ps(y, _mm256_loadu_ps(up)) : y);
}

OB_AVX2 void activate_avx2(int64_t kind, const float* gate, const float* up, float* out, int64_t n) {
  if (kind != kSilu && kind != kGeluTanh) return activate_scalar(kind, gate, up, out, n);
  const bool gelu = kind == kGeluTanh;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) activate8(gate + i, up != nullptr ? up + i : nullptr, out + i, gelu);
  if (i < n) {  // the last few values through the same vector step, so that every value is computed alike
    float g[8] = {}, u[8] = {}, o[8];
    std::copy(gate + i, gate + n, g);
    if (up != nullptr) std::copy(up + i, up + n, u);
    activate8(g, up != nullptr ? u : nullptr, o, gelu);
    std::copy(o, o + (n - i), out + i);
  }
}

FloatMath float_math(int isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == kScalar || !avx2) {
    return {float_dot_scalar, axpy_scalar, nullptr, nullptr, activate_scalar, narrow_scalar, widen_scalar};
  }
  const bool avx512 = isa >= kAvx512 && __builtin_cpu_supports("avx512f");
  return {float_dot_avx2,
          axpy_avx2,
          avx512 ? attend_heads_avx512 : attend_heads_avx2,
          avx512 ? attend_heads_half_avx512 : attend_heads_half_avx2,
          activate_avx2,
          narrow_f16c,
          widen_f16c};
}

// -- the passes over one row, written once on top of the routines above ----------------------------------------

float activation(int64_t kind, float x) {
  switch (kind) {
    case kGelu: return 0.5f * x * (1.0f + std::erf(x * static_cast<float>(M_SQRT1_2)));
    case kGeluTanh: {
      const float inner = static_cast<float>(0.7978845608028654) * (x + 0.044715f * x * x * x);  // sqrt(2/pi)
      return 0.5f * x * (1.0f + std::tanh(inner));
    }
    case kRelu: return x > 0.0f ? x : 0.0f;
    default: return x / (1.0f + std::exp(-x));  // silu
  }
}

void rms_norm(const FloatMath& m, const float* x, const float* w, float eps, int64_t n, float* out) {
  float ss;
  m.dot(x, n, 1, x, &ss);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);  // as RMSNorm: the weight after the cast back
}

void layer_norm(const float* x, const float* w, const float* b, float eps, int64_t n, float* out) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const float mean = sum / static_cast<float>(n);
  float var = 0.0f;
  for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);  // two passes: no cancellation
  const float r = 1.0f / std::sqrt(var / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] - mean) * r * w[i] + (b != nullptr ? b[i] : 0.0f);
}

void rotate(const float* x, const float* cos, const float* sin, int64_t d_head, float* out) {
  const int64_t half = d_head / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
  for (int64_t i = half; i < d_head; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

void softcap(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::tanh(x[i] / cap) * cap;
}

void attend(const FloatMath& m, const float* q, const float* keys, const float* values, int64_t n, int64_t d_head,
            float scale, float cap, float* scores, float* out) {
  attend(m, q, keys, values, n, nullptr, nullptr, 0, d_head, scale, cap, scores, out);
}

void attend(const FloatMath& m, const float* q, const float* keys, const float* values, int64_t n, const float* keys2,
            const float* values2, int64_t n2, int64_t d_head, float scale, float cap, float* scores, float* out) {
  for (int64_t j = 0; j < n; j += 4) {
    const int cols = static_cast<int>(std::min<int64_t>(4, n - j));
    m.dot(keys + j * d_head, d_head, cols, q, scores + j);
  }
  for (int64_t j = 0; j < n2; j += 4) {
    const int cols = static_cast<int>(std::min<int64_t>(4, n2 - j));
    m.dot(keys2 + j * d_head, d_head, cols, q, scores + n + j);
  }
  const int64_t all = n + n2;
  for (int64_t j = 0; j < all; ++j) scores[j] *= scale;
  if (cap > 0.0f) softcap(scores, all, cap);
  float top = -INFINITY;
  for (int64_t j = 0; j < all; ++j) top = std::max(top, scores[j]);
  float total = 0.0f;
  for (int64_t j = 0; j < all; ++j) {
    scores[j] = std::exp(scores[j] - top);  // the largest term is 1: no overflow, the sum is at least 1
    total += scores[j];
  }
  std::fill(out, out + d_head, 0.0f);
  for (int64_t j = 0; j < n; ++j) m.axpy(scores[j], values + j * d_head, out, d_head);
  for (int64_t j = 0; j < n2; ++j) m.axpy(scores[n + j], values2 + j * d_head, out, d_head);
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < d_head; ++i) out[i] *= inv;
}

}  // namespace oneblock
