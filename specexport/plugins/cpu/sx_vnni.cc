// The VNNI paths (avxvnni, avx512vnni): sx_x86.h's kernels with VNNI's integer dot steps. A file of its own:
// an assembler too old for VNNI's encodings (binutils < 2.36) fails this file only, and the library is built
// without these two paths (sx_dispatch.cc sees their functions missing) instead of without any SIMD path.
#include "sx_x86.h"

namespace {

// VNNI: vpdpwssd (pairs) and vpdpbusd (quads), one instruction each, in the VEX encoding (AVX-VNNI: Intel
// since Alder Lake, AMD since Zen 5) or the EVEX one on 256-bit registers (AVX512-VNNI + VL: Intel servers
// since Cascade Lake, AMD Zen 4). Written as assembly so that this file compiles with AVX2 flags only: no
// AVX-512 instruction can reach code the AVX2 path runs. SX_EMULATE_VNNI computes them with AVX2 instead,
// exactly (a test library: these paths' tiles, lanes and scales checked on CPUs without VNNI).
template <bool EVEX>
struct VnniDot {
#ifdef SX_EMULATE_VNNI
  static __m256i pairs(__m256i acc, __m256i p, __m256i s) { return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s)); }
  static __m256i quads(__m256i u, __m256i a) {  // bytes widened to int16 (u zero-, a sign-extended): no saturation
#ifdef SX_PLANT_VNNI_QUADS  // a planted bug the tests must catch: the activations' signs lost
    a = _mm256_abs_epi8(a);
#endif
    const __m256i lo8 = _mm256_set1_epi16(0xFF);
    const __m256i ue = _mm256_and_si256(u, lo8), uo = _mm256_srli_epi16(u, 8);
    const __m256i ae = _mm256_srai_epi16(_mm256_slli_epi16(a, 8), 8), ao = _mm256_srai_epi16(a, 8);
    return _mm256_add_epi32(_mm256_madd_epi16(ue, ae), _mm256_madd_epi16(uo, ao));
  }
#else
  static __m256i pairs(__m256i acc, __m256i p, __m256i s) {
    if constexpr (EVEX)
      asm("%{evex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(p), "xm"(s));
    else
      asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(p), "xm"(s));
    return acc;
  }
  static __m256i quads(__m256i u, __m256i a) {
#ifdef SX_PLANT_VNNI_QUADS
    a = _mm256_abs_epi8(a);
#endif
    __m256i acc = _mm256_setzero_si256();
    if constexpr (EVEX)
      asm("%{evex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "xm"(a));
    else
      asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "xm"(a));
    return acc;
  }
#endif
};

}  // namespace

void sx_avxvnni_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                     float* Y, int64_t ldy) {
  gemm_type<VnniDot<false>>(type, act, M, K, W, n0, n1, Y, ldy);
}

void sx_avx512vnni_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                        float* Y, int64_t ldy) {
  gemm_type<VnniDot<true>>(type, act, M, K, W, n0, n1, Y, ldy);
}
