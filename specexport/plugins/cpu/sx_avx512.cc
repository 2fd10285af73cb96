// The 512-bit tier (x86 with AVX-512 F/BW/VL/DQ/VNNI: Intel servers since Ice Lake, AMD Zen 4/5; compiled
// with those flags, run only where the CPU has them), with 16 weight columns in the lanes (sx_lanes.h): each
// unit of 256 weights of 16 neighbouring columns is loaded into the lanes once (a lane holds its column's
// code bytes, four a dword) and then every row of the pass runs on it with one vpdpbusd per four weights and
// sixteen columns, the row's four activations broadcast from memory: nothing about the activations is
// repacked, no lane is idle at any row count, and a 16-row pass unpacks each block once (the per-row kernels
// unpack per 8 rows and sum each block's lanes horizontally). The K types (Q4_K, Q6_K): per sub-block its sums
// times its scale (vpmulld) into the block's integer, Q6_K's zero point as each sub-block sum's start, Q4_K's
// mins through vpdpwssd. The 32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): eight blocks a unit, each
// block's sum started at -zero point x its activations' sum. Then the reference's float steps in its order
// (sx_ref.cc), so every output's bits equal ref's. Q5_K runs avx512vnni's kernels (the same bits).
// sx_v512.h: the vector operations, real or emulated (SX_EMULATE_AVX512: a test library that checks these
// layouts on a CPU without AVX-512).
#include "sx_lanes.h"

void sx_avx2_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
__attribute__((weak)) void sx_avx512vnni_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t,
                                              float*, int64_t);

namespace {

// A K type's block against NR rows (q: row 0's activations, row r's qs bytes on; tab, da: row 0's, the next
// rows' follow): each row's block integer in
// its 16 lanes (one per column), a sub-block at a time, then the float steps into acc[r].
template <class L, int NR>
inline void krows(const Group& g, const int8_t* q, int64_t qs, const int32_t* tab, const float* da, float* acc) {
  V I[NR];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) I[r] = vzero();
  for (int j0 = 0; j0 < L::NSUB; j0 += L::PERIOD) {
#pragma GCC unroll 8
    for (int jj = 0; jj < L::PERIOD; ++jj) {  // unrolled: each sub-block's code layout known when compiled
      const int j = j0 + jj;
      V w[L::SW];
#pragma GCC unroll 8
      for (int t = 0; t < L::SW; ++t) w[t] = L::code(g, j0, jj, t);
      const V s = g.s[j];
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        V a = L::start(tab + L::TAB * r, j);
        const int8_t* x = q + qs * r + 4 * L::SW * j;
#pragma GCC unroll 8
        for (int t = 0; t < L::SW; ++t) a = dpbusd(a, w[t], x + 4 * t);
        I[r] = vadd(I[r], vmullo(a, s));
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) L::finish(g, I[r], tab + L::TAB * r, da + r, acc + LC * r);
}

// What the K types share: one block a unit, one scale per row and block.
template <class L>
struct KType {
  static constexpr int QK = 256, UNIT = 1, DA = 1;
  template <int NR>
  static void rows(const Group& g, int, const int8_t* q, int64_t qs, const int32_t* tab, const float* da,
                   float* acc) {
    krows<L, NR>(g, q, qs, tab, da, acc);
  }
};

// Q4_K: 8 sub-blocks of 32 weights (chunk j / 2's low or high nibbles), the mins' term per row from the
// activations' sums per 32 (int16 pairs: vpdpwssd's operand).
struct LanesQ4K : KType<LanesQ4K> {
  static constexpr int BYTES = 144, NSUB = 8, SW = 8, TAB = 4;
  static void unpack(const uint8_t* const* p, int, Group& g) {
    V h[4];
    load_lanes<1>(p, 0, h);  // d | dmin, then the 12 scale bytes
    g.d[0] = halves_lo(h[0]);
    g.m[0] = fneg(halves_hi(h[0]));  // -dmin
    const V m6 = vset1(0x3F3F3F3F), m4 = vset1(0x0F0F0F0F), m30 = vset1(0x30303030), ff = vset1(0xFF);
    // sx_blocks.h's k_scale_min, four sub-blocks a dword: j < 4 from bytes j and j + 4; j >= 4 the low (high)
    // nibble of byte j + 4 with the top two bits of byte j - 4 (byte j) as bits 4-5
    const V s03 = vand(h[1], m6), m03 = vand(h[2], m6);
#ifdef SX_PLANT_AVX512_LANES  // a planted bug the tests must catch: the upper scales' top bits from the wrong place
    const V s47 = vor(vand(h[3], m4), vand(vsrl<4>(h[1]), m30));
#else
    const V s47 = vor(vand(h[3], m4), vand(vsrl<2>(h[1]), m30));
#endif
    const V m47 = vor(vand(vsrl<4>(h[3]), m4), vand(vsrl<2>(h[2]), m30));
    g.s[0] = vand(s03, ff), g.s[1] = vand(vsrl<8>(s03), ff), g.s[2] = vand(vsrl<16>(s03), ff), g.s[3] = vsrl<24>(s03);
    g.s[4] = vand(s47, ff), g.s[5] = vand(vsrl<8>(s47), ff), g.s[6] = vand(vsrl<16>(s47), ff), g.s[7] = vsrl<24>(s47);
    const V hi16 = vset1(0x00FF0000);
    g.mp[0] = vor(vand(m03, ff), vand(vsll<8>(m03), hi16));  // (m0, m1) as int16
    g.mp[1] = vor(vand(vsrl<16>(m03), ff), vand(vsrl<8>(m03), hi16));
    g.mp[2] = vor(vand(m47, ff), vand(vsll<8>(m47), hi16));
    g.mp[3] = vor(vand(vsrl<16>(m47), ff), vand(vsrl<8>(m47), hi16));
    load_lanes<4>(p, 16, g.t);  // the 128 code bytes: 32 dwords
    load_lanes<4>(p, 80, g.t + 16);
  }
  static constexpr int PERIOD = 2;  // sub-blocks j0 + jj, j0 even: chunk j0 / 2's low (jj 0) or high nibbles
  static V code(const Group& g, int j0, int jj, int t) {  // weights 4t..4t+3
    const V x = g.t[4 * j0 + t], m4 = vset1(0x0F0F0F0F);
    return jj ? vand(vsrl<4>(x), m4) : vand(x, m4);
  }
  static V start(const int32_t*, int) { return vzero(); }
  // per row and block: the activations' sums per 32 as int16 pairs (sub-blocks 2p, 2p + 1)
  static void table(const ActRow& a, int64_t b, int, int32_t* out, float* da) {
    da[0] = a.d[b];
    k4_min_pairs(a, b, out);
  }
  static void finish(const Group& g, V I, const int32_t* tab, const float* da, float* acc) {
    V mn = vzero();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) mn = dpwssd(mn, g.mp[p], tab + p);
    const VF a = fbcast(da);
    VF f = fmadd(fcvt(I), fmul(g.d[0], a), fload(acc));
    fstore(acc, fmadd(fcvt(mn), fmul(g.m[0], a), f));
  }
};

// Q6_K: 16 sub-blocks of 16 weights; codes v + 32 from four low bits (ql) and two high (qh); each sub-block's
// sum starts at -32 x its activations' sum (the table), so the zero point costs no instruction.
struct LanesQ6K : KType<LanesQ6K> {
  static constexpr int BYTES = 210, NSUB = 16, SW = 4, TAB = 16;
  static void unpack(const uint8_t* const* p, int, Group& g) {
    V h[4];
    load_lanes<1>(p, 192, h);  // the 16 int8 scales
#pragma GCC unroll 4
    for (int e = 0; e < 4; ++e) {
      g.s[4 * e] = vsra<24>(vsll<24>(h[e]));
      g.s[4 * e + 1] = vsra<24>(vsll<16>(h[e]));
      g.s[4 * e + 2] = vsra<24>(vsll<8>(h[e]));
      g.s[4 * e + 3] = vsra<24>(h[e]);
    }
    g.d[0] = halves_hi(load_dword(p, g.at, 206));  // d: bytes 208-209
    load_lanes<4>(p, 0, g.t);  // ql's 32 dwords, then qh's 16
    load_lanes<4>(p, 64, g.t + 16);
    load_lanes<4>(p, 128, g.t + 32);
  }
  // sub-block j = j0 + jj, weights 4t..4t+3: half h = j / 8, in it quarter q (sx_blocks.h's v[l], v[l + 32], v[l + 64],
  // v[l + 96]) at l = 16 (j % 2) + 4t: ql's low (q 0, 1) or high (q 2, 3) nibbles of byte l (q even) or l + 32,
  // qh's bits 2q, 2q + 1 of byte l as bits 4-5
  static constexpr int PERIOD = 8;  // sub-blocks j0 + jj, j0 = 8h
  static V code(const Group& g, int j0, int jj, int t) {
    const int h = j0 / 8, q = jj / 2, u = 4 * (jj % 2) + t;
    const V L = g.t[16 * h + (q % 2 ? 8 : 0) + u], H = g.t[32 + 8 * h + u];
    const V m4 = vset1(0x0F0F0F0F), m30 = vset1(0x30303030);
    const V lo = q < 2 ? vand(L, m4) : vand(vsrl<4>(L), m4);
    const V hi = q == 0 ? vsll<4>(H) : q == 1 ? vsll<2>(H) : q == 2 ? H : vsrl<2>(H);
    return vor(lo, vand(hi, m30));
  }
  static V start(const int32_t* tab, int j) { return vbcast(tab + j); }
  static void table(const ActRow& a, int64_t b, int, int32_t* out, float* da) {  // -32 x each 16's sum
    da[0] = a.d[b];
    for (int g = 0; g < 16; ++g) out[g] = -32 * (int32_t)a.s16[16 * b + g];
  }
  static void finish(const Group& g, V I, const int32_t*, const float* da, float* acc) {
    fstore(acc, fmadd(fcvt(I), fmul(g.d[0], fbcast(da)), fload(acc)));
  }
};

// The 32-weight types, eight blocks a unit: codes as unsigned bytes (Q8_0's values + 128, Q4_0 / Q5_0's codes as
// stored: v + 8 / v + 16; Q4_1 / Q5_1's as stored, their min through the activations' sum), each block's sum
// started at -zero point x its activations' sum (the table), then acc += I (d da) [acc += A (m da)].
template <int TYPE>
struct LanesSmall {
  static constexpr bool affine = TYPE == Q4_1 || TYPE == Q5_1, five = TYPE == Q5_0 || TYPE == Q5_1, q8 = TYPE == Q8_0;
  static constexpr int QK = 32, UNIT = 8, TAB = 8, DA = 16;  // DA: each block's scale, then its sum (affine)
  static constexpr int BYTES = q8 ? 34 : 18 + 2 * affine + 4 * five;
  static constexpr int QH = affine ? 4 : 2, CODES = q8 ? 2 : QH + 4 * five;  // offsets in a block
  static constexpr int Z = affine ? 0 : q8 ? 128 : five ? 16 : 8;
  static void unpack(const uint8_t* const* p, int nblk, Group& g) {
    for (int b = 0; b < nblk; ++b) {
      const V dm = load_dword(p, g.at, b * BYTES);  // d (and m)
      g.d[b] = halves_lo(dm);
      if constexpr (affine) g.m[b] = halves_hi(dm);
      if constexpr (q8) {
        load_lanes<2>(p, b * BYTES + CODES, g.t + 8 * b);
      } else {
        load_lanes<1>(p, b * BYTES + CODES, g.t + 8 * b);  // 16 bytes: low nibbles weights 0..15, high 16..31
        if constexpr (five) g.qh[b] = load_dword(p, g.at, b * BYTES + QH);
      }
    }
  }
  // block b, weights 4t..4t+3
  static V code(const Group& g, int b, int t) {
    if constexpr (q8) return vxor(g.t[8 * b + t], vset1((int32_t)0x80808080));
    const V x = g.t[8 * b + t % 4], m4 = vset1(0x0F0F0F0F);
    V c = t < 4 ? vand(x, m4) : vand(vsrl<4>(x), m4);
    if constexpr (five) {  // bits 4t..4t+3 of qh to bit 4 of the four bytes (a multiply spreads them 8 apart)
      const V h = vand(vsrl_c(g.qh[b], 4 * t), vset1(0xF));
      c = vor(c, vsll<4>(vand(vmullo(h, vset1(0x00204081)), vset1(0x01010101))));
    }
    return c;
  }
  static void table(const ActRow& a, int64_t b0, int nblk, int32_t* tab, float* da) {
    for (int b = 0; b < nblk; ++b) {
      const int32_t sum = a.s16[2 * (b0 + b)] + a.s16[2 * (b0 + b) + 1];
      tab[b] = -Z * sum;
      da[b] = a.d[b0 + b];
      da[8 + b] = (float)sum;  // the affine types' min term
    }
  }
  template <int NR>
  static void rows(const Group& g, int nblk, const int8_t* q, int64_t qs, const int32_t* tab, const float* da,
                   float* acc) {
    VF f[NR];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) f[r] = fload(acc + LC * r);
    for (int b = 0; b < nblk; ++b) {
      V w[8];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) w[t] = code(g, b, t);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        V a = vbcast(tab + TAB * r + b);
        const int8_t* x = q + qs * r + 32 * b;
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) a = dpbusd(a, w[t], x + 4 * t);
        const VF s = fbcast(da + DA * r + b);
        f[r] = fmadd(fcvt(a), fmul(g.d[b], s), f[r]);
        if constexpr (affine) f[r] = fmadd(fbcast(da + DA * r + 8 + b), fmul(g.m[b], s), f[r]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) fstore(acc + LC * r, f[r]);
  }
};

using GemmFn = void (*)(const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);

// This tier's kernel for `type` (null: none of its own; the one list both the gemm and the tier table read).
GemmFn lanes_kernel(int type) {
  switch (type) {
    case Q4_K: return lanes_gemm<LanesQ4K>;
    case Q6_K: return lanes_gemm<LanesQ6K>;
    case Q8_0: return lanes_gemm<LanesSmall<Q8_0>>;
    case Q4_0: return lanes_gemm<LanesSmall<Q4_0>>;
    case Q4_1: return lanes_gemm<LanesSmall<Q4_1>>;
    case Q5_0: return lanes_gemm<LanesSmall<Q5_0>>;
    case Q5_1: return lanes_gemm<LanesSmall<Q5_1>>;
    default: return nullptr;
  }
}

}  // namespace

// The types this tier has kernels of its own for (the tier table times it on these only).
int sx_avx512_owns(int type) { return lanes_kernel(type) != nullptr; }

void sx_avx512_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                    float* Y, int64_t ldy) {
  if (const GemmFn run = lanes_kernel(type)) return run(act, M, K, W, n0, n1, Y, ldy);
  // avx512vnni's unit may have been left out (an old assembler): AVX2's, the same bits
  return sx_avx512vnni_gemm ? sx_avx512vnni_gemm(type, act, M, K, W, n0, n1, Y, ldy)
                            : sx_avx2_gemm(type, act, M, K, W, n0, n1, Y, ldy);
}
