// Float16 rows of the native step's key/value cache (a float16 cache holds half the bytes the attention reads per
// token): float32 values rounded to float16 as they are stored, widened back as they are read. Rounding is to
// nearest even, as PyTorch's `.to(torch.float16)`, so a cache the step wrote equals one PyTorch wrote.
#include <c10/util/Half.h>
#include <immintrin.h>

#include "step_math.h"

#define OB_F16C __attribute__((target("avx2,fma,f16c")))

namespace oneblock {

void narrow_scalar(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c10::detail::fp16_ieee_from_fp32_value(x[i]);
}

void widen_scalar(const uint16_t* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c10::detail::fp16_ieee_to_fp32_value(x[i]);
}

OB_F16C void narrow_f16c(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  narrow_scalar(x + i, out + i, n - i);
}

OB_F16C void widen_f16c(const uint16_t* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {  // four conversions in flight
    for (int u = 0; u < 4; ++u) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i + 8 * u));
      _mm256_storeu_ps(out + i + 8 * u, _mm256_cvtph_ps(h));
    }
  }
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
  }
  widen_scalar(x + i, out + i, n - i);
}

}  // namespace oneblock
