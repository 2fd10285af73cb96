// The AVX2 path (x86-64 with AVX2 + FMA; compiled with -mavx2 -mfma). Equal to sx_ref.cc bit for bit: the
// integer sums are exact whatever their order, and the float steps are the reference's, in its order.
// Every block's eight integer lanes (one madd register) go straight into the output's eight float lanes.
// The 32-weight types: tiles of up to 4 rows x 4 neighbouring columns, each block unpacked once per tile.
// The K types: one column at a time, a block unpacked once per eight rows.
// The same kernels make the VNNI paths (avxvnni, avx512vnni): only the integer dot steps differ (Dot below).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "sx_act.h"
#include "sx_attn.h"
#include "sx_blocks.h"
#include "sx_kernels.h"

using namespace sx;

namespace {

// The integer dot steps, per path. Each gives the same exact integers: maddubs never saturates here (codes
// of at most 128 in magnitude, activations of at most 127), and VNNI's fused steps do not saturate at all.
// AVX2: int16 pairs through madd, four u8 x s8 products a lane through maddubs + madd.
struct Avx2Dot {
  static __m256i pairs(__m256i acc, __m256i p, __m256i s) { return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s)); }
  static __m256i quads(__m256i u, __m256i a) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
  }
};

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
    __m256i acc = _mm256_setzero_si256();
    if constexpr (EVEX)
      asm("%{evex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "xm"(a));
    else
      asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "xm"(a));
    return acc;
  }
#endif
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
    const __m128i x = _mm_loadu_si128((const __m128i*)(b + off + (five ? 4 : 0))), m4 = _mm_set1_epi8(0xF);
    const __m256i low = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m4), _mm_and_si128(x, m4));
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

// A K block's integer lanes against NR rows: part[r] = I's eight lanes, mins[r] = Mn's (sx_blocks.h's
// k_lanes). The codes are unsigned (maddubs' first operand); Q6_K's zero point is taken out per lane.
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

// One column's K blocks (256 weights) against NR rows: each block's eight integer lanes (sx_blocks.h's
// k_lanes) into the row's eight float lanes (acc += I * (d * da); acc += Mn * (-m * da)), as the
// reference; the float lanes stay in registers along the column.
template <class L, class D, int NR>
inline void kcolumn(const TypeInfo& ti, const uint8_t* col, int64_t nb, const ActRow* rows, float* out) {
  __m256 acc[NR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t l = 0; l < ti.bytes; l += 64)  // eight blocks ahead
      _mm_prefetch((const char*)(col + (b + 8) * ti.bytes + l), _MM_HINT_T0);
    const L blk(col + b * ti.bytes);
    __m256i part[NR], mins[NR] = {};
    block_rows<L, D, NR>(blk, rows, b, part, mins);
    const __m256 dv = _mm256_set1_ps(blk.d), mv = _mm256_set1_ps(-blk.m);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m256 da = _mm256_set1_ps(rows[r].d[b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[r]), _mm256_mul_ps(dv, da), acc[r]);
      if constexpr (L::kmin) acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[r]), _mm256_mul_ps(mv, da), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// The 32-weight types: a tile of NR rows x NC columns, block by block. Each block of the NC columns unpacked
// once into a register (signed types as |v| and the rows' activations given v's sign: maddubs' unsigned
// operand, exact), each row's activations loaded once; each output's eight integer lanes (one madd register)
// into its eight float lanes, as the reference. NC columns side by side: one output's float chain is a
// fused multiply-add per block, latency-bound alone.
template <class L, class D, int NR, int NC>
inline void tile32(const TypeInfo& ti, const uint8_t* col, size_t rb, int64_t nb, const ActRow* rows, float* out) {
  constexpr bool plus = L::affine, sgn = L::sgn || L::Z != 0;
  __m256 acc[NR][NC];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  const __m256i lane1 = _mm256_set1_epi32(1);
  const int64_t step = NC * ti.bytes;
  const uint8_t* next = col + NC * rb;  // the next tile's bytes, in order, as this one's blocks go by
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t off = 0; off < step; off += 64) _mm_prefetch((const char*)(next + b * step + off), _MM_HINT_T0);
    __m256i w[NC], u[NC];
    __m128 dm[NC];  // (d, m): both halves converted in one instruction
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const uint8_t* p = col + c * rb + b * ti.bytes;
      const L blk(p);
      blk.chunks([&](int, __m256i x) { w[c] = x; });
      if constexpr (L::Z != 0) w[c] = _mm256_sub_epi8(w[c], _mm256_set1_epi8((char)L::Z));  // v = code - Z
      u[c] = sgn ? _mm256_sign_epi8(w[c], w[c]) : w[c];
      uint32_t h = 0;
      std::memcpy(&h, p, plus ? 4 : 2);
      dm[c] = _mm_cvtph_ps(_mm_cvtsi32_si128((int)h));
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m256i a = _mm256_loadu_si256((const __m256i*)(rows[r].q + 32 * b));
      const __m128 da = _mm_broadcast_ss(rows[r].d + b);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const __m256i I = D::quads(u[c], sgn ? _mm256_sign_epi8(a, w[c]) : a);
        const __m128 s = _mm_mul_ps(dm[c], da);  // (d * da, m * da)
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_broadcastss_ps(s), acc[r][c]);
        if constexpr (plus)
          acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(rows[r].s4 + 8 * b),
                                      _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), lane1), acc[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) out[r * NC + c] = tree8v(acc[r][c]);
}

// Columns [n0, n1) of NR rows in tiles of NC columns (the last ones one at a time).
template <class L, class D, int NR, int NC>
void rows32(const TypeInfo& ti, const uint8_t* W, size_t rb, int64_t nb, const ActRow* rows, int64_t n0, int64_t n1,
            float* Y, int64_t ldy) {
  float out[NR * NC];
  int64_t n = n0;
  for (; n + NC <= n1; n += NC) {
    tile32<L, D, NR, NC>(ti, W + n * rb, rb, nb, rows, out);
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NC; ++c) Y[r * ldy + n + c] = out[r * NC + c];
  }
  for (; n < n1; ++n) {
    tile32<L, D, NR, 1>(ti, W + n * rb, rb, nb, rows, out);
    for (int r = 0; r < NR; ++r) Y[r * ldy + n] = out[r];
  }
}

template <class L, class D>
using Rows32 = void (*)(const TypeInfo&, const uint8_t*, size_t, int64_t, const ActRow*, int64_t, int64_t, float*, int64_t);

// Tiles measured on Zen 3 (one thread, K = 576): 1 row x 4 columns, 2 x 4, then 4 x 2.
template <class L, class D>
Rows32<L, D> rows32_for(int64_t rows) {
  switch (rows) {
    case 1: return rows32<L, D, 1, 4>;
    case 2: return rows32<L, D, 2, 4>;
    case 3: return rows32<L, D, 3, 2>;
    default: return rows32<L, D, 4, 2>;
  }
}

template <class L, class D>
using KColumn = void (*)(const TypeInfo&, const uint8_t*, int64_t, const ActRow*, float*);

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

template <class L, class D>
void gemm(const TypeInfo& ti, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
          int64_t ldy) {
  const int64_t nb = K / L::qk;
  const size_t rb = (size_t)nb * ti.bytes;
  std::vector<ActRow> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = act_row(act, m, K, L::qk);
#ifdef SX_PLANT_DROP_LAST_ROW  // a planted bug the tests must catch: a tile that drops its last row
  const int64_t rows_done = M - (M > 1);
#else
  const int64_t rows_done = M;
#endif
  if constexpr (L::qk == 256) {
    std::vector<float> accv(8 * M);  // row m's eight lanes at 8 m
    float* acc = accv.data();
    // R rows at a time, each block unpacked once per R rows. Past R rows, columns in chunks of ~96 KB of
    // weights, every row tile over a chunk before the next: the chunk stays in L2 across the tiles and a
    // tile's activations in L1/L2 across the chunk's columns (one pass over DRAM, whatever M).
    const int64_t chunk = rows_done <= R ? n1 - n0 : std::max<int64_t>(1, (int64_t)((96 << 10) / rb));
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
      const int64_t c1 = std::min(n1, c0 + chunk);
      for (int64_t r = 0; r < rows_done; r += R) {
        const int64_t nr = std::min<int64_t>(R, rows_done - r);
        const KColumn<L, D> run = kcolumn_for<L, D>(nr);
        for (int64_t n = c0; n < c1; ++n) {  // one column at a time: each thread reads one sequential stream
          run(ti, W + n * rb, nb, rows.data() + r, acc);
          for (int64_t m = 0; m < nr; ++m) Y[(r + m) * ldy + n] = tree8v(_mm256_loadu_ps(acc + 8 * m));
        }
      }
    }
  } else {
    // Row tiles of up to 4 over column chunks of ~96 KB (as the K types): one pass over DRAM whatever M.
    constexpr int64_t RT = 4;
    const int64_t chunk = rows_done <= RT ? n1 - n0 : std::max<int64_t>(4, (int64_t)((96 << 10) / rb));
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
      const int64_t c1 = std::min(n1, c0 + chunk);
      for (int64_t r = 0; r < rows_done; r += RT) {
        const int64_t nr = std::min<int64_t>(RT, rows_done - r);
        rows32_for<L, D>(nr)(ti, W, rb, nb, rows.data() + r, c0, c1, Y + r * ldy, ldy);
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

void sx_avx2_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
                  int64_t ldy) {
  gemm_type<Avx2Dot>(type, act, M, K, W, n0, n1, Y, ldy);
}

void sx_avxvnni_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                     float* Y, int64_t ldy) {
  gemm_type<VnniDot<false>>(type, act, M, K, W, n0, n1, Y, ldy);
}

void sx_avx512vnni_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                        float* Y, int64_t ldy) {
  gemm_type<VnniDot<true>>(type, act, M, K, W, n0, n1, Y, ldy);
}

// sx_act.h's quantize_row, eight values at a time: the same scalar scale, the same products, rounding in
// the current mode (as nearbyint), the same clamp; the sums in integers (exact).
void sx_avx2_quantize_row(const float* x, int64_t K, int qk, ActRow r) {
  const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes packs' interleaving of 128-bit lanes
  for (int64_t b = 0; b < K / qk; ++b) {
    const float* xb = x + b * qk;
    __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int i = 0; i < qk; i += 8) {
      const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i));
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // inf or NaN
      mx = _mm256_max_ps(mx, a);
    }
    const bool finite = _mm256_movemask_ps(bad) == 0;
    const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));  // exact when finite
    const float id = finite && amax > 0.f ? 127.f / amax : 0.f;
    r.d[b] = finite ? amax / 127.f : NAN;
    int8_t* q = r.q + b * qk;
    if (!finite) {
      std::memset(q, 0, (size_t)qk);
      continue;
    }
    const __m256 idv = _mm256_set1_ps(id);
    for (int i = 0; i < qk; i += 32) {
      __m256i v[4];
      for (int j = 0; j < 4; ++j) {
        __m256 y = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * j), idv), _MM_FROUND_CUR_DIRECTION);
        y = _mm256_and_ps(y, _mm256_cmp_ps(y, y, _CMP_ORD_Q));  // NaN (0 * inf) -> 0
        v[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, lo), hi));
      }
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      _mm256_storeu_si256((__m256i*)(q + i), _mm256_permutevar8x32_epi32(p, order));
    }
  }
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < K; i += 32) {
    const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, _mm256_loadu_si256((const __m256i*)(r.q + i))), ones16);
    if (qk == 32) _mm256_storeu_ps(r.s4 + i / 4, _mm256_cvtepi32_ps(s4));
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(s4, s4), s4);  // element 0: lanes 0..3, element 4: 4..7
    r.s16[i / 16] = (int16_t)_mm256_extract_epi32(s, 0);
    r.s16[i / 16 + 1] = (int16_t)_mm256_extract_epi32(s, 4);
  }
}

// Attention (sx_attn.h): the reference's operations, eight lanes at a time.
static inline float dot_avx2(const float* q, const float* k, int64_t D) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
  return tree8v(a);
}

// scores_each over keys [j0, j1) with four keys at a time: four independent chains of fused multiply-adds
// instead of one (one key's chain is latency-bound), each key's operations those of dot_avx2, in its order.
static inline void scores_range(const AttnRow& r, int64_t j0, int64_t j1, float& m) {
  auto keep = [&](int64_t j, float dot) {
    const float b = r.bias ? r.bias[j] : 0.f;
    if (b <= MASKED) {
      r.scores[j] = -INFINITY;  // hidden
      return;
    }
    const float s = dot * r.scale + b;
    r.scores[j] = s;
    m = std::fmax(m, s);
  };
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) {
    const float* k = r.K + j * r.D;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < r.D; d += 8) {
      const __m256 q = _mm256_loadu_ps(r.q + d);
      a0 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + d), a0);
      a1 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + r.D + d), a1);
      a2 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 2 * r.D + d), a2);
      a3 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 3 * r.D + d), a3);
    }
    keep(j, tree8v(a0));
    keep(j + 1, tree8v(a1));
    keep(j + 2, tree8v(a2));
    keep(j + 3, tree8v(a3));
  }
  for (; j < j1; ++j) keep(j, dot_avx2(r.q, r.K + j * r.D, r.D));
}

static inline float scores4_avx2(const AttnRow& r) {
  float m = -INFINITY;
  scores_range(r, 0, r.total, m);
  return m;
}

// NV accumulators of eight dims (out[d0 ..]) over keys [j0, j1): e_j V[j] fused multiply-adds in key order,
// in registers (a compile-time count: a runtime one left them in memory, a store-to-load chain per
// multiply-add), carried in out between calls, so blocks of keys give the bits of one pass over them all.
template <int NV>
static inline void accumulate_range(const AttnRow& r, int64_t d0, int64_t j0, int64_t j1) {
  __m256 acc[NV];
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) acc[i] = _mm256_loadu_ps(r.out + d0 + 8 * i);
  for (int64_t j = j0; j < j1; ++j) {
    if (r.scores[j] == -INFINITY) continue;
    const __m256 e = _mm256_set1_ps(r.scores[j]);
    const float* v = r.V + j * r.D + d0;
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) acc[i] = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 8 * i), acc[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(r.out + d0 + 8 * i, acc[i]);
}

static inline void accumulate_keys(const AttnRow& r, int64_t j0, int64_t j1) {
  int64_t d0 = 0;
  for (; d0 + 64 <= r.D; d0 += 64) accumulate_range<8>(r, d0, j0, j1);
  for (; d0 < r.D; d0 += 8) accumulate_range<1>(r, d0, j0, j1);  // D a multiple of 8
}

static inline void divide_out(const AttnRow& r, float den) {
  const __m256 dv = _mm256_set1_ps(den);
  for (int64_t d = 0; d < r.D; d += 8) _mm256_storeu_ps(r.out + d, _mm256_div_ps(_mm256_loadu_ps(r.out + d), dv));
}

// sx_attn.h's accumulate_ref, eight dims at a time.
static inline void accumulate_avx2(const AttnRow& r, float den) {
  std::fill(r.out, r.out + r.D, 0.f);
  accumulate_keys(r, 0, r.total);
  divide_out(r, den);
}

void sx_avx2_attend(const AttnRow& row) { softmax_v(row, scores4_avx2(row), accumulate_avx2); }

// Rows over the same keys (one KV head's query heads and rows): keys in blocks of KB, every row over a block
// before the next, so a block of K (then of V) is read from memory once for all rows and from L1 after.
// Each row's operations are sx_avx2_attend's, in its order (accumulators carried across blocks in out).
void sx_avx2_attend_group(const AttnRow* rows, int64_t n) {
  constexpr int64_t KB = 16;  // 16 keys x D 128 x 4 bytes x (K or V) = 8 KB a block
  if (n == 1) return sx_avx2_attend(rows[0]);
  const int64_t total = rows[0].total;
  thread_local std::vector<float> m, den;  // once per thread: this runs per layer per token
  m.assign((size_t)n, -INFINITY);
  den.assign((size_t)n, 0.f);
  for (int64_t j0 = 0; j0 < total; j0 += KB)
    for (int64_t i = 0; i < n; ++i) scores_range(rows[i], j0, std::min(total, j0 + KB), m[i]);
  for (int64_t i = 0; i < n; ++i)  // the exponentials, row by row; the accumulation waits for the blocks below
    softmax_v(rows[i], m[i], [&](const AttnRow& r, float d) {
      den[i] = d;
      std::fill(r.out, r.out + r.D, 0.f);
    });
  for (int64_t j0 = 0; j0 < total; j0 += KB) {
    const int64_t j1 = std::min(total, j0 + KB);
    for (int64_t i = 0; i < n; ++i) accumulate_keys(rows[i], j0, j1);
  }
  for (int64_t i = 0; i < n; ++i) divide_out(rows[i], den[i]);
}

// Exact mode (sx_ref.cc's gemm_exact): the attention's dot product over each block.
void sx_ref_gemm_exact_with(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t,
                            double (*)(const float*, const float*, int));

static double block_dot_avx2(const float* w, const float* x, int qk) { return dot_avx2(w, x, qk); }

void sx_avx2_gemm_exact(int type, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                        float* Y, int64_t ldy) {
  sx_ref_gemm_exact_with(type, X, M, K, W, n0, n1, Y, ldy, block_dot_avx2);
}
