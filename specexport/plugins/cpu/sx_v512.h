// Sixteen 32-bit lanes (one zmm register) and the few operations the 512-bit tier's kernels use
// (sx_avx512.cc), written once for two builds: AVX-512 (F/BW/VL/DQ/VNNI) intrinsics, or, with
// SX_EMULATE_AVX512 (a test library, AVX2 flags only), each operation on two ymm halves with the same
// integer and float results (VNNI's dot steps widened to int16, as sx_vnni.cc's emulation). Why a layer of
// our own: so a CPU without AVX-512 (the Zen 3 CI machines) still runs this tier's layouts, transposes and
// scale handling against the reference; the real instructions run where the CPU has them.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

#ifndef SX_EMULATE_AVX512

using V = __m512i;   // 16 int32 lanes (or 64 bytes)
using VF = __m512;   // 16 float lanes

inline V vload(const void* p) { return _mm512_loadu_si512(p); }
inline void vstore(void* p, V x) { _mm512_storeu_si512(p, x); }
inline V vzero() { return _mm512_setzero_si512(); }
inline V vset1(int32_t x) { return _mm512_set1_epi32(x); }
typedef int32_t __attribute__((may_alias, aligned(1))) word;  // a dword at any address, of any type
inline V vbcast(const void* p) { return _mm512_set1_epi32(*(const word*)p); }  // one dword in every lane
inline V vand(V a, V b) { return _mm512_and_si512(a, b); }
inline V vor(V a, V b) { return _mm512_or_si512(a, b); }
inline V vxor(V a, V b) { return _mm512_xor_si512(a, b); }
inline V vsrl_c(V a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }  // n: any count
inline V vadd(V a, V b) { return _mm512_add_epi32(a, b); }
template <int S> inline V vsrl(V a) { return _mm512_srli_epi32(a, S); }
template <int S> inline V vsll(V a) { return _mm512_slli_epi32(a, S); }
template <int S> inline V vsra(V a) { return _mm512_srai_epi32(a, S); }
inline V vmullo(V a, V b) { return _mm512_mullo_epi32(a, b); }
// acc + the sums of four u8 x s8 products a lane (u's bytes unsigned, the broadcast dword's signed)
// (written as assembly: GCC 12 loads the broadcast into a register of its own instead of embedding it)
inline V dpbusd(V acc, V u, const void* s8x4) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const word*)s8x4));
  return acc;
}
// acc + the sums of two int16 x int16 products a lane (the broadcast dword: two int16)
inline V dpwssd(V acc, V a, const void* s16x2) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*(const word*)s16x2));
  return acc;
}

inline VF fzero() { return _mm512_setzero_ps(); }
inline VF fload(const float* p) { return _mm512_loadu_ps(p); }
inline void fstore(float* p, VF x) { _mm512_storeu_ps(p, x); }
inline void fstore_first(float* p, VF x, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), x); }
inline VF fbcast(const float* p) { return _mm512_set1_ps(*p); }
inline VF fcvt(V a) { return _mm512_cvtepi32_ps(a); }
inline VF fmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF fneg(VF a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.f)); }
inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF halves_lo(V a) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(a)); }  // each lane's low fp16
inline VF halves_hi(V a) { return halves_lo(_mm512_srli_epi32(a, 16)); }      // each lane's high fp16

// The lanes' column order: lane 4L + k holds column 4k + L (what four 128-bit loads and two in-lane
// interleaves give; the outputs are put back in order once a row, unpermute).
inline VF unpermute(VF a) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), a);
}

// 4E dwords at p[c] + off for the 16 columns c, transposed: out[d] lane 4L + k = dword d of column 4k + L.
// Each 16 bytes of four columns by one load and three inserts, then two in-lane interleaves.
template <int E>
inline void load_lanes(const uint8_t* const* p, int off, V* out) {
#pragma GCC unroll 4
  for (int e = 0; e < E; ++e) {
    V z[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      V x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(p[4 * k] + off + 16 * e)));
      x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i*)(p[4 * k + 1] + off + 16 * e)), 1);
      x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i*)(p[4 * k + 2] + off + 16 * e)), 2);
      z[k] = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i*)(p[4 * k + 3] + off + 16 * e)), 3);
    }
    const V t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const V t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[4 * e] = _mm512_unpacklo_epi64(t0, t2);
    out[4 * e + 1] = _mm512_unpackhi_epi64(t0, t2);
    out[4 * e + 2] = _mm512_unpacklo_epi64(t1, t3);
    out[4 * e + 3] = _mm512_unpackhi_epi64(t1, t3);
  }
}

// The dword at p[c] + off of each column, in the lanes' order (one gather; at = p[lane's column] - p[0]).
inline V load_dword(const uint8_t* const* p, V at, int off) { return _mm512_i32gather_epi32(at, p[0] + off, 1); }

#else  // SX_EMULATE_AVX512: lanes 0..7 in lo, 8..15 in hi

struct V { __m256i lo, hi; };
struct VF { __m256 lo, hi; };

inline V vload(const void* p) { return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)p + 1)}; }
inline void vstore(void* p, V x) {
  _mm256_storeu_si256((__m256i*)p, x.lo);
  _mm256_storeu_si256((__m256i*)p + 1, x.hi);
}
inline V vzero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline V vset1(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline V vbcast(const void* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return vset1(x);
}
inline V vand(V a, V b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline V vor(V a, V b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline V vxor(V a, V b) { return {_mm256_xor_si256(a.lo, b.lo), _mm256_xor_si256(a.hi, b.hi)}; }
inline V vsrl_c(V a, int n) {
  const __m128i c = _mm_cvtsi32_si128(n);
  return {_mm256_srl_epi32(a.lo, c), _mm256_srl_epi32(a.hi, c)};
}
inline V vadd(V a, V b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
template <int S> inline V vsrl(V a) { return {_mm256_srli_epi32(a.lo, S), _mm256_srli_epi32(a.hi, S)}; }
template <int S> inline V vsll(V a) { return {_mm256_slli_epi32(a.lo, S), _mm256_slli_epi32(a.hi, S)}; }
template <int S> inline V vsra(V a) { return {_mm256_srai_epi32(a.lo, S), _mm256_srai_epi32(a.hi, S)}; }
inline V vmullo(V a, V b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
inline __m256i quads(__m256i u, __m256i a) {  // bytes widened to int16 (u zero-, a sign-extended): exact
  const __m256i lo8 = _mm256_set1_epi16(0xFF);
  const __m256i ue = _mm256_and_si256(u, lo8), uo = _mm256_srli_epi16(u, 8);
  const __m256i ae = _mm256_srai_epi16(_mm256_slli_epi16(a, 8), 8), ao = _mm256_srai_epi16(a, 8);
  return _mm256_add_epi32(_mm256_madd_epi16(ue, ae), _mm256_madd_epi16(uo, ao));
}
inline V dpbusd(V acc, V u, const void* s8x4) {
  const V a = vbcast(s8x4);
  return {_mm256_add_epi32(acc.lo, quads(u.lo, a.lo)), _mm256_add_epi32(acc.hi, quads(u.hi, a.hi))};
}
inline V dpwssd(V acc, V a, const void* s16x2) {
  const V b = vbcast(s16x2);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a.lo, b.lo)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(a.hi, b.hi))};
}

inline VF fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VF fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void fstore(float* p, VF x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}
inline void fstore_first(float* p, VF x, int n) {
  alignas(32) float t[16];
  fstore(t, x);
  std::memcpy(p, t, 4 * (size_t)n);
}
inline VF fbcast(const float* p) { return {_mm256_set1_ps(*p), _mm256_set1_ps(*p)}; }
inline VF fcvt(V a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline VF fmul(VF a, VF b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline VF fneg(VF a) {
  const __m256 s = _mm256_set1_ps(-0.f);
  return {_mm256_xor_ps(a.lo, s), _mm256_xor_ps(a.hi, s)};
}
inline VF fmadd(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline __m256 halves8(__m256i a) {  // each lane's low fp16 (F16C: exact)
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)),
                                                                      _mm256_setzero_si256()), 0x08);
  return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}
inline VF halves_lo(V a) { return {halves8(a.lo), halves8(a.hi)}; }
inline VF halves_hi(V a) { return halves_lo(vsrl<16>(a)); }

inline VF unpermute(VF a) {
  alignas(64) float in[16], out[16];
  fstore(in, a);
  for (int c = 0; c < 16; ++c) out[c] = in[4 * (c % 4) + c / 4];
  return fload(out);
}

template <int E>
inline void load_lanes(const uint8_t* const* p, int off, V* out) {
  alignas(64) int32_t m[4 * E][16];
  for (int lane = 0; lane < 16; ++lane)
    for (int d = 0; d < 4 * E; ++d) std::memcpy(&m[d][lane], p[4 * (lane % 4) + lane / 4] + off + 4 * d, 4);
  for (int d = 0; d < 4 * E; ++d) out[d] = vload(m[d]);
}

inline V load_dword(const uint8_t* const* p, V, int off) {
  alignas(64) int32_t m[16];
  for (int lane = 0; lane < 16; ++lane) std::memcpy(&m[lane], p[4 * (lane % 4) + lane / 4] + off, 4);
  return vload(m);
}

#endif

}  // namespace
