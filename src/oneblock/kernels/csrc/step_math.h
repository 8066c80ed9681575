// The float pieces of the native decode step (decode_step.cpp), each with its scalar twin.
//
// The scalar functions compute one float32 operation at a time in source order (the library is built with
// -ffp-contract=off, so nothing is fused behind the source's back); the AVX2 functions compute the same sums in
// 8-lane order with fused multiply-adds. They mirror the Python step (LeanDecode.step) one for one:
//
//   float_dot     a float32 weight row times an activation row         nn.Linear / F.linear
//   axpy          y += a * v                                            the weighted sum of values in attention
//   rms_norm      w * (x * rsqrt(mean(x^2) + eps))                      oneblock.layers.norms.RMSNorm
//   layer_norm    (x - mean) * rsqrt(var + eps) * w + b                 F.layer_norm
//   rotate        x * cos + rotate_half(x) * sin                        oneblock.layers.rotary.apply_rotary
//   softcap       tanh(x / cap) * cap                                   Gemma 2's capped scores and logits
//   attend        softmax(cap(scale * q K^T)) V over one row's keys     F.scaled_dot_product_attention
//   activation    gelu, gelu_tanh, relu, silu                           oneblock.layers.activations
#pragma once

#include <cstdint>

namespace oneblock {

// out[c] = sum_i w[c * k + i] * x[i] for c < cols (cols <= 4). Each output is computed by the same instructions
// whatever `cols` is, so a result never depends on how the columns were grouped.
using FloatDotFn = void (*)(const float* w, int64_t k, int cols, const float* x, float* out);
// y[i] += a * v[i] for i < n.
using AxpyFn = void (*)(float a, const float* v, float* y, int64_t n);

void float_dot_scalar(const float* w, int64_t k, int cols, const float* x, float* out);
void float_dot_avx2(const float* w, int64_t k, int cols, const float* x, float* out);
void axpy_scalar(float a, const float* v, float* y, int64_t n);
void axpy_avx2(float a, const float* v, float* y, int64_t n);

// The `rep` query heads (rep, d_head) of one key/value head over n keys and values (n, d_head) then n2 more at
// keys2 and values2: out (rep, d_head), each head's `attend` computed together (attend_avx2.cpp); d_head a
// multiple of 8, `scores` scratch for rep * (n + n2 + 1) floats. The AVX-512 variant weighs the values of every head
// at once where d_head is a multiple of 16 (weigh_avx512.cpp), with the same result bit for bit.
using AttendHeadsFn = void (*)(const float* q, int rep, const float* keys, const float* values, int64_t n,
                               const float* keys2, const float* values2, int64_t n2, int64_t d_head, float scale,
                               float cap, float* scores, float* out);

void attend_heads_avx2(const float* q, int rep, const float* keys, const float* values, int64_t n, const float* keys2,
                       const float* values2, int64_t n2, int64_t d_head, float scale, float cap, float* scores,
                       float* out);
void attend_heads_avx512(const float* q, int rep, const float* keys, const float* values, int64_t n,
                         const float* keys2, const float* values2, int64_t n2, int64_t d_head, float scale, float cap,
                         float* scores, float* out);
// The same over a float16 cache read as stored (F16C): each 8 keys widened once into a block every head reads, each
// value in registers as it is weighed; the result bit for bit that of the float32 variant over the widened cache.
using AttendHeadsHalfFn = void (*)(const float* q, int rep, const uint16_t* keys, const uint16_t* values, int64_t n,
                                   const uint16_t* keys2, const uint16_t* values2, int64_t n2, int64_t d_head,
                                   float scale, float cap, float* scores, float* out);

void attend_heads_half_avx2(const float* q, int rep, const uint16_t* keys, const uint16_t* values, int64_t n,
                            const uint16_t* keys2, const uint16_t* values2, int64_t n2, int64_t d_head, float scale,
                            float cap, float* scores, float* out);
void attend_heads_half_avx512(const float* q, int rep, const uint16_t* keys, const uint16_t* values, int64_t n,
                              const uint16_t* keys2, const uint16_t* values2, int64_t n2, int64_t d_head, float scale,
                              float cap, float* scores, float* out);
// out (rep, d_head) = inv[h] * sum_j p[h * stride + j] v_j over the n values then the n2 at values2 (d_head a
// multiple of 16; weigh_avx512.cpp), from float32 or float16 values.
void weigh_heads_avx512(const float* p, int rep, int64_t stride, const float* values, int64_t n,
                        const float* values2, int64_t n2, int64_t d_head, const float* inv, float* out);
void weigh_heads_avx512(const float* p, int rep, int64_t stride, const uint16_t* values, int64_t n,
                        const uint16_t* values2, int64_t n2, int64_t d_head, const float* inv, float* out);

// out[i] = act(gate[i]) * up[i] over n values (`up` null: act(gate[i])), `act` one of `activation`'s. The AVX2 variant
// computes SiLU and tanh-GELU 8 values at a time as x sigmoid(z), within a few ulp of the exact functions
// (step_math.cpp), the others as the scalar one.
using ActivateFn = void (*)(int64_t kind, const float* gate, const float* up, float* out, int64_t n);

void activate_scalar(int64_t kind, const float* gate, const float* up, float* out, int64_t n);
void activate_avx2(int64_t kind, const float* gate, const float* up, float* out, int64_t n);

// out[i] = x[i] rounded to float16 (to nearest even), and back: float16 bits widened to float32 (half_rows.cpp);
// the F16C variants convert 8 values at a time, with the same results.
using NarrowFn = void (*)(const float* x, uint16_t* out, int64_t n);
using WidenFn = void (*)(const uint16_t* x, float* out, int64_t n);

void narrow_scalar(const float* x, uint16_t* out, int64_t n);
void widen_scalar(const uint16_t* x, float* out, int64_t n);
void narrow_f16c(const float* x, uint16_t* out, int64_t n);
void widen_f16c(const uint16_t* x, float* out, int64_t n);

// The float routines of one instruction set (`heads` and `heads_half` null where each head attends alone, by
// `attend`, over a float32 cache or a float16 one widened first).
struct FloatMath {
  FloatDotFn dot;
  AxpyFn axpy;
  AttendHeadsFn heads;
  AttendHeadsHalfFn heads_half;
  ActivateFn activate;
  NarrowFn narrow;
  WidenFn widen;
};

// The routines of the instruction set the block kernels run on (an Isa of dot.h: ONEBLOCK_KERNELS, set_isa): scalar,
// else AVX2 where the CPU has it, the grouped heads' values weighed with AVX-512 from kAvx512 on.
FloatMath float_math(int isa);

enum Activation : int64_t { kGelu = 0, kGeluTanh = 1, kRelu = 2, kSilu = 3 };

float activation(int64_t kind, float x);

// One row of width n, normalized into `out` (which may be `x`); LayerNorm's `b` may be null.
void rms_norm(const FloatMath& m, const float* x, const float* w, float eps, int64_t n, float* out);
void layer_norm(const float* x, const float* w, const float* b, float eps, int64_t n, float* out);

// out = x * cos + rotate_half(x) * sin, with rotate_half([x1, x2]) = [-x2, x1]; `out` must not alias `x`.
void rotate(const float* x, const float* cos, const float* sin, int64_t d_head, float* out);

// x[i] = tanh(x[i] / cap) * cap for i < n, in place (MultiHeadAttention's scores, Decoder.logits).
void softcap(float* x, int64_t n, float cap);

// One query head over `n` cached keys and values (n, d_head) each: out (d_head,) = softmax(scale q.k_j) v, the
// scaled scores soft-capped first where `cap` > 0. `scores` is scratch for n floats.
void attend(const FloatMath& m, const float* q, const float* keys, const float* values, int64_t n, int64_t d_head,
            float scale, float cap, float* scores, float* out);

// `attend` over n keys and values followed by n2 more at keys2 and values2 (a ring's window that wraps: its end,
// then its start), in that order; `scores` is scratch for n + n2 floats.
void attend(const FloatMath& m, const float* q, const float* keys, const float* values, int64_t n, const float* keys2,
            const float* values2, int64_t n2, int64_t d_head, float scale, float cap, float* scores, float* out);

}  // namespace oneblock
