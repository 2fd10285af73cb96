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
#include <utility>

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

// r[i] lane j <- r[j] lane i: 16 x 16 dwords, off-diagonal blocks of 8, 4, 2, 1 swapped (one two-source
// permute per register and stage).
inline void transpose16(V* r) {
#pragma GCC unroll 4
  for (int s = 8; s >= 1; s /= 2) {
    alignas(64) int32_t ia[16], ib[16];
    for (int j = 0; j < 16; ++j) {
      ia[j] = (j & s) ? 16 + j - s : j;
      ib[j] = (j & s) ? 16 + j : j + s;
    }
    const V a = vload(ia), b = vload(ib);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      if (!(i & s)) {
        const V lo = _mm512_permutex2var_epi32(r[i], a, r[i + s]);
        r[i + s] = _mm512_permutex2var_epi32(r[i], b, r[i + s]);
        r[i] = lo;
      }
  }
}

// Four dwords at p[c] + off for the 16 columns c, lanes = columns: out[e] lane c = dword e of column c.
inline void gather4(const uint8_t* const* p, int off, V* out) {
  V z[4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    V x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(p[4 * k] + off)));
    x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i*)(p[4 * k + 1] + off)), 1);
    x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i*)(p[4 * k + 2] + off)), 2);
    z[k] = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i*)(p[4 * k + 3] + off)), 3);
  }
  // lanes 0..7: dword e of columns 0..7 (z0, z1); lanes 8..15: dword e + 1 of them
  const V i01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
  const V i23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
  const V a = _mm512_permutex2var_epi32(z[0], i01, z[1]), b = _mm512_permutex2var_epi32(z[0], i23, z[1]);
  const V c = _mm512_permutex2var_epi32(z[2], i01, z[3]), d = _mm512_permutex2var_epi32(z[2], i23, z[3]);
  out[0] = _mm512_shuffle_i64x2(a, c, 0x44);
  out[1] = _mm512_shuffle_i64x2(a, c, 0xEE);
  out[2] = _mm512_shuffle_i64x2(b, d, 0x44);
  out[3] = _mm512_shuffle_i64x2(b, d, 0xEE);
}

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

inline void transpose16(V* r) {
  alignas(64) int32_t m[16][16];
  for (int i = 0; i < 16; ++i) vstore(m[i], r[i]);
  for (int i = 0; i < 16; ++i)
    for (int j = i + 1; j < 16; ++j) std::swap(m[i][j], m[j][i]);
  for (int i = 0; i < 16; ++i) r[i] = vload(m[i]);
}

inline void gather4(const uint8_t* const* p, int off, V* out) {
  alignas(64) int32_t m[4][16];
  for (int c = 0; c < 16; ++c)
    for (int e = 0; e < 4; ++e) std::memcpy(&m[e][c], p[c] + off + 4 * e, 4);
  for (int e = 0; e < 4; ++e) out[e] = vload(m[e]);
}

#endif

}  // namespace
