// The instruction-set dispatch: which kernels run (chosen once, at load, from what the CPU reports; set_isa
// switches it, for tests and benchmarks), the block kernels of each format per instruction set, and the ops that
// report and switch it:
//
//   oneblock::isa() -> str, best_isa() -> str, isa_supported(int isa) -> bool, set_isa(int isa) -> ()
#include <torch/library.h>

#include <atomic>
#include <string>

#include "dot.h"

namespace oneblock {
namespace {

const char* const kIsaNames[kIsaCount] = {"scalar", "avx2", "avx512", "avx512_vnni"};

bool supported(int isa) {
  __builtin_cpu_init();
  // F16C converts the interleaved layouts' 16 scales at once; every AVX2 CPU has it, the check keeps it so.
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return avx2;
    case kAvx512: return avx512;
    case kAvx512Vnni: return avx512 && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

int best() {
  for (int isa = kIsaCount - 1; isa > kScalar; --isa) {
    if (supported(isa)) return isa;
  }
  return kScalar;
}

std::atomic<int> g_isa{best()};  // chosen once, at load, from what the CPU reports

// kernels[isa][format]: the file layouts Q4_0, Q4_1, Q8_0, then the interleaved Q4_1x16, Q8_0x16, then the file
// layouts Q5_0, Q5_1, Q6_K, Q4_K, Q5_K, IQ4_NL, IQ4_XS, then the interleaved Q4_0x16, Q4_Kx16, Q6_Kx16, Q5_0x16, Q5_Kx16 and IQ4_XSx16
// (kernel_column). The K-quants
// and the IQ4 formats have scalar and AVX2 kernels so far: the AVX-512 paths run the AVX2 ones.
const DotFn kKernels[kIsaCount][18] = {
    {dot_q4_0_scalar, dot_q4_1_scalar, dot_q8_0_scalar, dot_q4_1x16_scalar, dot_q8_0x16_scalar, dot_q5_0_scalar,
     dot_q5_1_scalar, dot_q6_k_scalar, dot_q4_k_scalar, dot_q5_k_scalar, dot_iq4_nl_scalar, dot_iq4_xs_scalar,
     dot_q4_0x16_scalar, dot_q4_kx16_scalar, dot_q6_kx16_scalar, dot_q5_0x16_scalar, dot_q5_kx16_scalar, dot_iq4_xsx16_scalar},
    {dot_q4_0_avx2, dot_q4_1_avx2, dot_q8_0_avx2, dot_q4_1x16_avx2, dot_q8_0x16_avx2, dot_q5_0_avx2, dot_q5_1_avx2,
     dot_q6_k_avx2, dot_q4_k_avx2, dot_q5_k_avx2, dot_iq4_nl_avx2, dot_iq4_xs_avx2,
     dot_q4_0x16_avx2, dot_q4_kx16_avx2, dot_q6_kx16_avx2, dot_q5_0x16_avx2, dot_q5_kx16_avx2, dot_iq4_xsx16_avx2},
    {dot_q4_0_avx512, dot_q4_1_avx512, dot_q8_0_avx512, dot_q4_1x16_avx512, dot_q8_0x16_avx512, dot_q5_0_avx512,
     dot_q5_1_avx512, dot_q6_k_avx2, dot_q4_k_avx2, dot_q5_k_avx2, dot_iq4_nl_avx2, dot_iq4_xs_avx2,
     dot_q4_0x16_avx512, dot_q4_kx16_avx512, dot_q6_kx16_avx512, dot_q5_0x16_avx512, dot_q5_kx16_avx512, dot_iq4_xsx16_avx512},
    {dot_q4_0_avx512_vnni, dot_q4_1_avx512_vnni, dot_q8_0_avx512_vnni, dot_q4_1x16_avx512_vnni,
     dot_q8_0x16_avx512_vnni, dot_q5_0_avx512_vnni, dot_q5_1_avx512_vnni, dot_q6_k_avx2, dot_q4_k_avx2,
     dot_q5_k_avx2, dot_iq4_nl_avx2, dot_iq4_xs_avx2,
     dot_q4_0x16_avx512_vnni, dot_q4_kx16_avx512_vnni, dot_q6_kx16_avx512_vnni, dot_q5_0x16_avx512_vnni, dot_q5_kx16_avx512_vnni, dot_iq4_xsx16_avx512_vnni},
};

int kernel_column(int64_t fmt) {
  switch (fmt) {
    case kQ4_0: return 0;
    case kQ4_1: return 1;
    case kQ8_0: return 2;
    case kQ4_1x16: return 3;
    case kQ8_0x16: return 4;
    case kQ5_0: return 5;
    case kQ5_1: return 6;
    case kQ6_K: return 7;
    case kQ4_K: return 8;
    case kQ5_K: return 9;
    case kIQ4_NL: return 10;
    case kIQ4_XS: return 11;
    case kQ4_0x16: return 12;
    case kQ4_Kx16: return 13;
    case kQ6_Kx16: return 14;
    case kQ5_0x16: return 15;
    case kQ5_Kx16: return 16;
    case kIQ4_XSx16: return 17;
    default: return -1;
  }
}

std::string isa() { return kIsaNames[g_isa.load()]; }
std::string best_isa() { return kIsaNames[best()]; }
bool isa_supported(int64_t isa) { return supported(static_cast<int>(isa)); }
void set_isa(int64_t isa) {
  TORCH_CHECK(supported(static_cast<int>(isa)), "oneblock::set_isa: this CPU cannot run instruction set ", isa);
  g_isa.store(static_cast<int>(isa));
}

}  // namespace

void quantize_row_q8(const float* x, int64_t k, int8_t* q, float* d, float* s) {
  if (g_isa.load(std::memory_order_relaxed) >= kAvx512) return quantize_row_q8_avx512(x, k, q, d, s);
  quantize_row_q8_scalar(x, k, q, d, s);
}

void quantize_row_q8_k(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums) {
  if (g_isa.load(std::memory_order_relaxed) >= kAvx512) return quantize_row_q8_k_avx512(x, k, q, d, bsums);
  quantize_row_q8_k_scalar(x, k, q, d, bsums);
}

int current_isa() { return g_isa.load(std::memory_order_relaxed); }

DotFn dot_kernel(int64_t fmt) {
  const int column = kernel_column(fmt);
  return column < 0 ? nullptr : kKernels[g_isa.load(std::memory_order_relaxed)][column];
}

}  // namespace oneblock

TORCH_LIBRARY_FRAGMENT(oneblock, m) {
  m.def("isa() -> str", &oneblock::isa);
  m.def("best_isa() -> str", &oneblock::best_isa);
  m.def("isa_supported(int isa) -> bool", &oneblock::isa_supported);
  m.def("set_isa(int isa) -> ()", &oneblock::set_isa);
}
