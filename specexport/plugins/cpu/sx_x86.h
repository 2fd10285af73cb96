// The x86 kernels' shared templates (AVX2 registers), included by each x86 translation unit: sx_avx2.cc
// instantiates them with AVX2's integer dot steps, sx_vnni.cc with VNNI's (a file of its own, so an assembler
// that lacks VNNI's encodings loses those paths only). Everything here has internal linkage (an anonymous
// namespace): each unit keeps its own copy, compiled with its own flags, never merged by the linker.
// Equal to sx_ref.cc bit for bit: the integer sums are exact whatever their order, and the float steps are
// the reference's, in its order. Every block's eight integer lanes (one madd register) go straight into the
// output's eight float lanes. The 32-weight types: tiles of up to 4 rows x 4 neighbouring columns, each block
// unpacked once per tile. The K types: one column at a time, a block unpacked once per eight rows.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "sx_act.h"
#include "sx_attn.h"
#include "sx_blocks.h"
#include "sx_kernels.h"

namespace {

using namespace sx;


// The integer dot steps, per path. Each gives the same exact integers: maddubs never saturates here (codes
// of at most 128 in magnitude, activations of at most 127), and VNNI's fused steps do not saturate at all.
// AVX2: int16 pairs through madd, four u8 x s8 products a lane through maddubs + madd.
struct Avx2Dot {
  static __m256i pairs(__m256i acc, __m256i p, __m256i s) { return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s)); }
  static __m256i quads(__m256i u, __m256i a) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
  }
};


constexpr int R = 8;             // rows per weight pass (8: 8-13% faster than 4 at M >= 8, measured)

inline float half(const uint8_t* p) {  // exact, as sx::f16 (F16C converts every finite half alike)
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K's 8 six-bit scales and mins from their 12 bytes, in vector registers: bytes [s0..s7, m0..m7].
inline __m128i k4_scales(const uint8_t* sc) {
  const __m128i x = _mm_loadu_si128((const __m128i*)sc);  // 12 scale bytes, then 4 code bytes (unused)
  const __m128i lo = _mm_shuffle_epi8(x, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i v = _mm_and_si128(_mm_blend_epi32(lo, _mm_srli_epi16(lo, 4), 0x8),  // m4..m7: the high nibbles
                                  _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  const __m128i hi = _mm_shuffle_epi8(x, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  __m128i o = _mm_or_si128(v, _mm_and_si128(_mm_srli_epi16(hi, 2), _mm_set1_epi8(0x30)));  // top two bits of 4..7
#ifdef SX_PLANT_SCALE_OFF_BY_ONE
  o = _mm_shuffle_epi8(o, _mm_setr_epi8(1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15, 8));  // as sx_blocks.h's
#endif
  return o;
}

// A block's codes in 32-weight chunks (unsigned, v + Z; or signed for Q8_0), chunk j's int16 scale vector
// (scale(j)), and per-16 scale/min vectors. One loader per type.
struct Q4K {
  static constexpr int qk = 256, Z = 0;
  static constexpr bool sgn = false, kmin = true;
  const uint8_t* b;
  __m256i sb, mn16;
  float d, m;
  explicit Q4K(const uint8_t* blk) : b(blk) {
    const __m256i sm16 = _mm256_cvtepu8_epi16(k4_scales(b + 4));  // s0..s7, m0..m7 as int16
    sb = _mm256_permute4x64_epi64(sm16, 0x44);                      // s0..s7 in both halves
    mn16 = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(sm16, 0xFA),  // m0,m0,..,m3,m3 | m4,m4,..,m7,m7
                               _mm256_setr_epi8(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7,
                                                0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7));
    d = half(b);
    m = half(b + 2);
  }
  __m256i scale(int j) const { return _mm256_shuffle_epi8(sb, _mm256_set1_epi16((int16_t)((2 * j + 1) << 8 | 2 * j))); }
  template <class F>
  void chunks(F&& f) const {
    const __m256i m4 = _mm256_set1_epi8(0xF);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i x = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * c));
      f(2 * c, _mm256_and_si256(x, m4));
      f(2 * c + 1, _mm256_and_si256(_mm256_srli_epi16(x, 4), m4));
    }
  }
};

struct Q6K {
  static constexpr int qk = 256, Z = 32;
  static constexpr bool sgn = false, kmin = false;
  const uint8_t* b;
  __m256i lo, hi, s16;
  float d, m = 0.f;
  explicit Q6K(const uint8_t* blk) : b(blk) {
    s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192)));  // s0..s15
    lo = _mm256_permute2x128_si256(s16, s16, 0x00);
    hi = _mm256_permute2x128_si256(s16, s16, 0x11);
    d = half(b + 208);
  }
  __m256i scale(int j) const {  // lanes 0..7: s_{2j}, lanes 8..15: s_{2j+1}
    const int a = (2 * j) % 8, c = (2 * j + 1) % 8;
    const __m256i idx = _mm256_set_m128i(_mm_set1_epi16((int16_t)((2 * c + 1) << 8 | 2 * c)),
                                         _mm_set1_epi16((int16_t)((2 * a + 1) << 8 | 2 * a)));
    return _mm256_shuffle_epi8(j < 4 ? lo : hi, idx);
  }
  template <class F>
  void chunks(F&& f) const {  // codes 0..63 as stored are v + 32; the two high bits of each from hb
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
      const __m256i l1 = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
      f(4 * h, _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)));
      f(4 * h + 1, _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)));
      f(4 * h + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30)));
      f(4 * h + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30)));
    }
  }
};

struct Q8_0L {
  static constexpr int qk = 32, Z = 0;
  static constexpr bool sgn = true, affine = false;
  const uint8_t* b;  // d at b (tile32 converts it)
  explicit Q8_0L(const uint8_t* blk) : b(blk) {}
  template <class F>
  void chunks(F&& f) const { f(0, _mm256_loadu_si256((const __m256i*)(b + 2))); }
};

// 32 bits -> 32 bytes, byte i = 0x10 where bit i is set (the fifth bit of Q5_0 / Q5_1 codes).
inline __m256i bits_to_0x10(uint32_t h) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// The 32-weight 4- and 5-bit types: Q4_0 / Q5_0 (v = code - 8 / 16) and Q4_1 / Q5_1 (codes as stored, a
// min applied through the row sums): fp16 d [and m], [32 fifth bits,] 16 bytes of nibbles.
template <int TYPE>
struct Small {
  static constexpr bool affine = TYPE == Q4_1 || TYPE == Q5_1, five = TYPE == Q5_0 || TYPE == Q5_1;
  static constexpr int qk = 32, Z = affine ? 0 : (five ? 16 : 8), off = affine ? 4 : 2;
  static constexpr bool sgn = false;
  const uint8_t* b;  // d (and m) at b (tile32 converts them)
  explicit Small(const uint8_t* blk) : b(blk) {}
  template <class F>
  void chunks(F&& f) const {
    // the 16 bytes in both halves, the upper half's dwords shifted by 4: each byte's high nibble (the byte
    // above's low nibble lands in the high half, which the mask drops); two vector ops, not four
    const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b + off + (five ? 4 : 0))));
    const __m256i low = _mm256_and_si256(_mm256_srlv_epi32(x, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                         _mm256_set1_epi8(0xF));
    if (!five) return f(0, low);
    uint32_t h;
    std::memcpy(&h, b + off, 4);
    f(0, _mm256_or_si256(low, bits_to_0x10(h)));
  }
};

struct Q5K : Q4K {  // Q4_K's scales and mins; a fifth bit per code from qh
  explicit Q5K(const uint8_t* blk) : Q4K(blk) {}
  template <class F>
  void chunks(F&& f) const {
    const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const __m256i hb = _mm256_loadu_si256((const __m256i*)(b + 16));
    for (int c = 0; c < 4; ++c) {
      const __m256i x = _mm256_loadu_si256((const __m256i*)(b + 48 + 32 * c));
      const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4);
      const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4);
      f(2 * c, _mm256_or_si256(_mm256_and_si256(x, m4), h0));
      f(2 * c + 1, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x, 4), m4), h1));
    }
  }
};

// sx_attn.h's tree8 on a vector: ((0+4)+(2+6)) + ((1+5)+(3+7)), the same additions in the same order.
inline float tree8v(__m256 a) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // (0+4, 1+5, 2+6, 3+7)
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));                                 // ((0+4)+(2+6), (1+5)+(3+7))
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}

// Lane i < N: the sum of v[i]'s eight int32 lanes (exact); lanes past N: 0. Nine instructions for eight sums.
template <int N>
inline __m256i sums8(const __m256i* v) {
  const __m256i z = _mm256_setzero_si256();
  auto at = [&](int i) { return i < N ? v[i] : z; };
  const __m256i h01 = _mm256_hadd_epi32(at(0), at(1)), h23 = _mm256_hadd_epi32(at(2), at(3));
  const __m256i h45 = _mm256_hadd_epi32(at(4), at(5)), h67 = _mm256_hadd_epi32(at(6), at(7));
  const __m256i g0 = _mm256_hadd_epi32(h01, h23), g1 = _mm256_hadd_epi32(h45, h67);  // [0..3 | 0..3], [4..7 | 4..7]
  return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
}

// A K block's integers against NR rows, as eight int32 lanes each (their sum is sx_blocks.h's block_ints):
// part[r] for I, mins[r] for Mn. The codes are unsigned (maddubs' first operand); Q6_K's zero point is
// taken out per lane.
template <class L, class D, int NR>
inline void block_rows(const L& blk, const ActRow* rows, int64_t b, __m256i* part, __m256i* mins) {
  __m256i acc[NR];
  const int8_t* q[NR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    acc[r] = _mm256_setzero_si256();
    q[r] = rows[r].q + b * L::qk;
  }
  blk.chunks([&](int j, __m256i w) {
    const __m256i sc = blk.scale(j);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m256i a = _mm256_loadu_si256((const __m256i*)(q[r] + 32 * j));
      acc[r] = D::pairs(acc[r], _mm256_maddubs_epi16(w, a), sc);
      asm("" : "+x"(acc[r]));  // keeps the sum in its register: GCC otherwise spills every product to sum later
    }
  });
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    const __m256i as = _mm256_loadu_si256((const __m256i*)(rows[r].s16 + b * 16));
    if constexpr (L::Z != 0)  // Z = 32: Q6_K's codes are v + 32
      acc[r] = _mm256_sub_epi32(acc[r], _mm256_slli_epi32(_mm256_madd_epi16(blk.s16, as), 5));
    if constexpr (L::kmin) mins[r] = _mm256_madd_epi16(blk.mn16, as);
    part[r] = acc[r];
  }
}

// One column's K blocks (256 weights) against NR rows: each block's integers summed (lane r: row r), then
// acc += I * (d * da); acc += Mn * (-m * da), row r's float steps in lane r, as the reference's. da8: the
// rows' activation scales, eight floats a block (rows in lanes). out: eight floats, row r in lane r.
template <class L, class D, int NR>
inline void kcolumn(const TypeInfo& ti, const uint8_t* col, int64_t nb, const ActRow* rows, const float* da8,
                    float* out) {
  constexpr bool both = L::kmin && NR <= 4;  // I and Mn summed in one pass of sums8
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t l = 0; l < ti.bytes; l += 64)  // eight blocks ahead
      _mm_prefetch((const char*)(col + (b + 8) * ti.bytes + l), _MM_HINT_T0);
    const L blk(col + b * ti.bytes);
    __m256i ints[2 * NR], *mins = ints + NR;
    block_rows<L, D, NR>(blk, rows, b, ints, mins);
    const __m256 da = _mm256_loadu_ps(da8 + 8 * b);
    __m256 I, Mn;
    if constexpr (both) {
      const __m256 both8 = _mm256_cvtepi32_ps(sums8<2 * NR>(ints));  // lanes 0..NR-1: I, NR..2NR-1: Mn
      I = both8;
      Mn = _mm256_permutevar8x32_ps(both8, _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                             _mm256_set1_epi32(NR)));
    } else {
      I = _mm256_cvtepi32_ps(sums8<NR>(ints));
      if constexpr (L::kmin) Mn = _mm256_cvtepi32_ps(sums8<NR>(mins));
    }
    acc = _mm256_fmadd_ps(I, _mm256_mul_ps(_mm256_set1_ps(blk.d), da), acc);
    if constexpr (L::kmin) acc = _mm256_fmadd_ps(Mn, _mm256_mul_ps(_mm256_set1_ps(-blk.m), da), acc);
  }
  _mm256_storeu_ps(out, acc);
}

// One row (a one-row pass) against NC <= 4 neighbouring columns' K blocks: the columns' integers summed in
// one sums8 (lane c: I, lane 4 + c: Mn), then the reference's float steps for column c in lane c. Four
// columns side by side: one column's horizontal sums alone would cost more than its multiply-adds.
template <class L, class D, int NC>
inline void kcolumns1(const TypeInfo& ti, const uint8_t* col, size_t rb, int64_t nb, const ActRow* rows,
                      const float* da8, float* out) {
  static_assert(NC <= 4, "I and Mn of every column in one register");
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i ints[8] = {};
    alignas(32) float d[8] = {}, m[8] = {};
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      const uint8_t* p = col + c * rb + b * ti.bytes;
      // the next NC columns' bytes (contiguous after these), swept in step with this group's: one group ahead
      const uint8_t* next = col + NC * rb + (size_t)(b * NC + c) * ti.bytes;
      for (int64_t l = 0; l < ti.bytes; l += 64) _mm_prefetch((const char*)(next + l), _MM_HINT_T0);
      const L blk(p);
      block_rows<L, D, 1>(blk, rows, b, &ints[c], &ints[4 + c]);
      d[c] = blk.d;
      m[c] = -blk.m;
    }
    const __m256 sums = _mm256_cvtepi32_ps(sums8<L::kmin ? 8 : NC>(ints));  // lanes 0..3: I, 4..7: Mn
    const __m256 da = _mm256_set1_ps(da8[8 * b]);
    acc = _mm256_fmadd_ps(sums, _mm256_mul_ps(_mm256_load_ps(d), da), acc);
    if constexpr (L::kmin) {
      const __m256 Mn = _mm256_permute2f128_ps(sums, sums, 0x81);  // lanes 4..7 to 0..3, zeros above
      acc = _mm256_fmadd_ps(Mn, _mm256_mul_ps(_mm256_load_ps(m), da), acc);
    }
  }
  _mm256_storeu_ps(out, acc);
}

// The 32-weight types: a tile of NR rows x NC columns (NR * NC <= 8), block by block. Each block of the NC
// columns unpacked once into a register (Q8_0 as |v| and the rows' activations given v's sign: maddubs'
// unsigned operand, exact; the others' codes as stored), each row's activations loaded once; each output's
// integer summed into lane r * NC + c, then acc += I * (d * da) [acc += Mn * (m * da)] lane by lane, as the
// reference's. da8 / mn8: the rows' activation scales and block sums (the min and zero-point terms), eight a
// block, rows in lanes.
template <class L, class D, int NR, int NC>
inline void tile32(const TypeInfo& ti, const uint8_t* col, size_t rb, int64_t nb, const ActRow* rows,
                   const float* da8, const float* mn8, float* out) {
  static_assert(NR * NC <= 8, "one register of outputs");
  // Q4_0 / Q5_0 (Z != 0): the codes as stored dotted (unsigned, maddubs' first operand), then Z * the block's
  // activation sum taken out in float: both exact integers under 2^24, so one fma gives I's float exactly.
  constexpr bool plus = L::affine, sgn = L::sgn, zero = L::Z != 0;
  const __m256i to_row = _mm256_setr_epi32(0 / NC, 1 / NC, 2 / NC, 3 / NC, 4 / NC, 5 / NC, 6 / NC, 7 / NC);
  const __m256i to_col = _mm256_setr_epi32(0 % NC, 1 % NC, 2 % NC, 3 % NC, 4 % NC, 5 % NC, 6 % NC, 7 % NC);
  __m256 acc = _mm256_setzero_ps();
  const int64_t step = NC * ti.bytes;
  const uint8_t* next = col + NC * rb;  // the next tile's bytes, in order, as this one's blocks go by
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t off = 0; off < step; off += 64) _mm_prefetch((const char*)(next + b * step + off), _MM_HINT_T0);
    __m256i w[NC], u[NC];
    __m128i dh = _mm_setzero_si128(), mh = dh;  // d (m) of column c in half c
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const uint8_t* p = col + c * rb + b * ti.bytes;
      const L blk(p);
      blk.chunks([&](int, __m256i x) { w[c] = x; });
      u[c] = sgn ? _mm256_sign_epi8(w[c], w[c]) : w[c];
      uint16_t h;
      std::memcpy(&h, p, 2);
      dh = _mm_insert_epi16(dh, h, c);
      if constexpr (plus) {
        std::memcpy(&h, p + 2, 2);
        mh = _mm_insert_epi16(mh, h, c);
      }
    }
    __m256i I[NR * NC];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m256i a = _mm256_loadu_si256((const __m256i*)(rows[r].q + 32 * b));
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) I[r * NC + c] = D::quads(u[c], sgn ? _mm256_sign_epi8(a, w[c]) : a);
    }
    const __m256 da = _mm256_permutevar8x32_ps(_mm256_loadu_ps(da8 + 8 * b), to_row);
    __m256 If = _mm256_cvtepi32_ps(sums8<NR * NC>(I));
    if constexpr (zero)
      If = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(mn8 + 8 * b), to_row),
                           _mm256_set1_ps(-(float)L::Z), If);
    acc = _mm256_fmadd_ps(If, _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_cvtph_ps(dh), to_col), da), acc);
    if constexpr (plus) {
      const __m256 m = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(mh), to_col);
      acc = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(mn8 + 8 * b), to_row), _mm256_mul_ps(m, da), acc);
    }
  }
  _mm256_storeu_ps(out, acc);
}

// Per block, the rows' activation scales (and, for the 32-weight types, their block sums as floats: exact),
// eight floats a block with row r in lane r: what the kernels above load once a block.
inline void row_tables(const ActRow* rows, int64_t nr, int64_t nb, int qk, std::vector<float>& da8,
                       std::vector<float>& mn8) {
  da8.assign((size_t)(8 * nb), 0.f);
  mn8.assign(qk == 32 ? (size_t)(8 * nb) : 0, 0.f);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      da8[(size_t)(8 * b + r)] = rows[r].d[b];
      if (qk == 32) mn8[(size_t)(8 * b + r)] = (float)(rows[r].s16[2 * b] + rows[r].s16[2 * b + 1]);
    }
}

// Columns [n0, n1) of NR rows in tiles of NC columns (the last ones one at a time).
template <class L, class D, int NR, int NC>
void rows32(const TypeInfo& ti, const uint8_t* W, size_t rb, int64_t nb, const ActRow* rows, const float* da8,
            const float* mn8, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  alignas(32) float out[8];
  int64_t n = n0;
  for (; n + NC <= n1; n += NC) {
    tile32<L, D, NR, NC>(ti, W + n * rb, rb, nb, rows, da8, mn8, out);
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NC; ++c) Y[r * ldy + n + c] = out[r * NC + c];
  }
  for (; n < n1; ++n) {
    tile32<L, D, NR, 1>(ti, W + n * rb, rb, nb, rows, da8, mn8, out);
    for (int r = 0; r < NR; ++r) Y[r * ldy + n] = out[r];
  }
}

template <class L, class D>
using Rows32 = void (*)(const TypeInfo&, const uint8_t*, size_t, int64_t, const ActRow*, const float*, const float*,
                        int64_t, int64_t, float*, int64_t);

// Tiles measured on Zen 3 (one thread, K = 576; one row again at K = 896, 1536: 8 columns 10-25% faster
// than 4): 1 row x 8 columns, 2 x 4, then 4 x 2.
template <class L, class D>
Rows32<L, D> rows32_for(int64_t rows) {
  switch (rows) {
    case 1: return rows32<L, D, 1, 8>;
    case 2: return rows32<L, D, 2, 4>;
    case 3: return rows32<L, D, 3, 2>;
    default: return rows32<L, D, 4, 2>;
  }
}

// One column's K blocks against up to eight rows (kcolumn, or another tier's: sx_avx512.cc's).
using KColumnFn = void (*)(const TypeInfo&, const uint8_t*, int64_t, const ActRow*, const float*, float*);
template <class L, class D>
using KColumn = KColumnFn;

template <class L, class D>
KColumn<L, D> kcolumn_for(int64_t rows) {
  switch (rows) {
    case 1: return kcolumn<L, D, 1>;
    case 2: return kcolumn<L, D, 2>;
    case 3: return kcolumn<L, D, 3>;
    case 4: return kcolumn<L, D, 4>;
    case 5: return kcolumn<L, D, 5>;
    case 6: return kcolumn<L, D, 6>;
    case 7: return kcolumn<L, D, 7>;
    default: return kcolumn<L, D, 8>;
  }
}

// columns: the K types' column kernel for nr rows (null: kcolumn, and four columns a step at one row).
template <class L, class D>
void gemm(const TypeInfo& ti, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
          int64_t ldy, KColumnFn (*columns)(int64_t) = nullptr) {
  const int64_t nb = K / L::qk;
  const size_t rb = (size_t)nb * ti.bytes;
  std::vector<ActRow> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = act_row(act, m, K, L::qk);
#ifdef SX_PLANT_DROP_LAST_ROW  // a planted bug the tests must catch: a tile that drops its last row
  const int64_t rows_done = M - (M > 1);
#else
  const int64_t rows_done = M;
#endif
  constexpr int64_t RT = L::qk == 256 ? R : 4;  // rows per tile: each block unpacked once per RT rows
  std::vector<std::vector<float>> da8((size_t)((rows_done + RT - 1) / RT)), mn8(da8.size());
  for (int64_t r = 0; r < rows_done; r += RT)
    row_tables(rows.data() + r, std::min<int64_t>(RT, rows_done - r), nb, L::qk, da8[r / RT], mn8[r / RT]);
  // Past RT rows, columns in chunks of ~96 KB of weights, every row tile over a chunk before the next: the
  // chunk stays in L2 across the tiles and a tile's activations in L1/L2 across the chunk's columns (one
  // pass over DRAM, whatever M).
  const int64_t chunk = rows_done <= RT ? n1 - n0 : std::max<int64_t>(4, (int64_t)((96 << 10) / rb));
  alignas(32) float out[8];
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t c1 = std::min(n1, c0 + chunk);
    for (int64_t r = 0; r < rows_done; r += RT) {
      const int64_t nr = std::min<int64_t>(RT, rows_done - r);
      const float* da = da8[r / RT].data();
      if constexpr (L::qk == 256) {
        const KColumnFn run = columns ? columns(nr) : kcolumn_for<L, D>(nr);
        int64_t n = c0;
        if (nr == 1 && !columns)             // four columns a step (kcolumns1)
          for (; n + 4 <= c1; n += 4) {
            kcolumns1<L, D, 4>(ti, W + n * rb, rb, nb, rows.data() + r, da, out);
            for (int c = 0; c < 4; ++c) Y[r * ldy + n + c] = out[c];
          }
        for (; n < c1; ++n) {  // one column at a time: each thread reads one sequential stream
          run(ti, W + n * rb, nb, rows.data() + r, da, out);
          for (int64_t m = 0; m < nr; ++m) Y[(r + m) * ldy + n] = out[m];
        }
      } else {
        rows32_for<L, D>(nr)(ti, W, rb, nb, rows.data() + r, da, mn8[r / RT].data(), c0, c1, Y + r * ldy, ldy);
      }
    }
  }
}

template <class D>
void gemm_type(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
               int64_t ldy) {
  const TypeInfo ti = type_info(type);
  switch (type) {
    case Q4_K: return gemm<Q4K, D>(ti, act, M, K, W, n0, n1, Y, ldy);
    case Q6_K: return gemm<Q6K, D>(ti, act, M, K, W, n0, n1, Y, ldy);
    case Q4_0: return gemm<Small<Q4_0>, D>(ti, act, M, K, W, n0, n1, Y, ldy);
    case Q8_0: return gemm<Q8_0L, D>(ti, act, M, K, W, n0, n1, Y, ldy);
    case Q5_K: return gemm<Q5K, D>(ti, act, M, K, W, n0, n1, Y, ldy);
    case Q4_1: return gemm<Small<Q4_1>, D>(ti, act, M, K, W, n0, n1, Y, ldy);
    case Q5_0: return gemm<Small<Q5_0>, D>(ti, act, M, K, W, n0, n1, Y, ldy);
    case Q5_1: return gemm<Small<Q5_1>, D>(ti, act, M, K, W, n0, n1, Y, ldy);
  }
}

}  // namespace
