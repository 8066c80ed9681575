// The AVX-512 K-quant paths: AVX-512BW, and AVX-512BW with VNNI. See dot_kq_avx512.h.
#define OB_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define OB_VNNI 0
#define OB_SUFFIX avx512
#include "dot_kq_avx512.h"
#undef OB_TARGET
#undef OB_VNNI
#undef OB_SUFFIX

#define OB_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")))
#define OB_VNNI 1
#define OB_SUFFIX avx512_vnni
#include "dot_kq_avx512.h"
