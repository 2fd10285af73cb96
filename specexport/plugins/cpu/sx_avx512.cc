// The 512-bit tier (x86 with AVX-512 F/BW/VL/DQ/VNNI: Intel servers since Ice Lake, AMD Zen 4/5; compiled
// with those flags, run only where the CPU has them). The K types (Q4_K, Q6_K) with 16 weight columns in the
// lanes: each block of 16 neighbouring columns is transposed once (a lane holds its column's code bytes, four
// a dword) and then every row of the pass runs on it with one vpdpbusd per four weights and sixteen columns,
// the row's four activations broadcast from memory: nothing about the activations is repacked, no lane is
// idle at any row count, and a 16-row pass unpacks each block once (the per-row kernels unpack per 8 rows and
// sum each block's lanes horizontally). Per sub-block, its sums times its scale (vpmulld) into the block's
// integer; Q6_K's zero point starts each sub-block's sum at -32 x its activations' sum; Q4_K's mins through
// vpdpwssd; then the reference's float steps in its order (sx_ref.cc), so every output's bits equal ref's.
// Other types, and one-row passes where the column kernel reads the weights faster, run avx512vnni's kernels
// (the same bits). sx_v512.h: the vector operations, real or emulated (SX_EMULATE_AVX512: a test library
// that checks these layouts on a CPU without AVX-512).
#include <algorithm>
#include <cstring>
#include <vector>

#include "sx_act.h"
#include "sx_blocks.h"
#include "sx_v512.h"

void sx_avx2_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
__attribute__((weak)) void sx_avx512vnni_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t,
                                              float*, int64_t);

namespace {

using namespace sx;

constexpr int LC = 16;       // weight columns a group: the lanes
constexpr int MAX_NR = 16;   // rows a sweep (registers: 16 block integers, a sub-block's codes, its sums)

// One block of a group's 16 columns, as every row of the pass reads it: the code bytes' dwords transposed
// (lane 4L + k: column 4k + L, sx_v512.h; the row loop takes each sub-block's codes from them), the sub-block scales as int32
// lanes, Q4_K's min pairs, the block's d and -m.
struct Group {
  V at;  // each lane's column: its offset from lane 0's (load_dword)
  V t[48];
  V s[16];
  V mp[4];
  VF d, nm;
};

// Q4_K: 8 sub-blocks of 32 weights (chunk j / 2's low or high nibbles), the mins' term per row from the
// activations' sums per 32 (int16 pairs: vpdpwssd's operand).
struct LanesQ4K {
  static constexpr int BYTES = 144, NSUB = 8, SW = 8, TAB = 4;
  static void unpack(const uint8_t* const* p, Group& g) {
    V h[4];
    load_lanes<1>(p, 0, h);  // d | dmin, then the 12 scale bytes
    g.d = halves_lo(h[0]);
    g.nm = fneg(halves_hi(h[0]));
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
  static void table(const ActRow& a, int64_t b, int32_t* out) {
    for (int p = 0; p < 4; ++p) {
      const int16_t* s = a.s16 + 16 * b + 4 * p;
      out[p] = (int32_t)(uint16_t)(int16_t)(s[0] + s[1]) | (int32_t)((uint32_t)(uint16_t)(int16_t)(s[2] + s[3]) << 16);
    }
  }
  static void finish(const Group& g, V I, const int32_t* tab, const float* da, float* acc) {
    V mn = vzero();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) mn = dpwssd(mn, g.mp[p], tab + p);
    const VF a = fbcast(da);
    VF f = fmadd(fcvt(I), fmul(g.d, a), fload(acc));
    fstore(acc, fmadd(fcvt(mn), fmul(g.nm, a), f));
  }
};

// Q6_K: 16 sub-blocks of 16 weights; codes v + 32 from four low bits (ql) and two high (qh); each sub-block's
// sum starts at -32 x its activations' sum (the table), so the zero point costs no instruction.
struct LanesQ6K {
  static constexpr int BYTES = 210, NSUB = 16, SW = 4, TAB = 16;
  static void unpack(const uint8_t* const* p, Group& g) {
    V h[4];
    load_lanes<1>(p, 192, h);  // the 16 int8 scales
#pragma GCC unroll 4
    for (int e = 0; e < 4; ++e) {
      g.s[4 * e] = vsra<24>(vsll<24>(h[e]));
      g.s[4 * e + 1] = vsra<24>(vsll<16>(h[e]));
      g.s[4 * e + 2] = vsra<24>(vsll<8>(h[e]));
      g.s[4 * e + 3] = vsra<24>(h[e]);
    }
    g.d = halves_hi(load_dword(p, g.at, 206));  // d: bytes 208-209
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
  static void table(const ActRow& a, int64_t b, int32_t* out) {  // -32 x each 16's sum
    for (int g = 0; g < 16; ++g) out[g] = -32 * (int32_t)a.s16[16 * b + g];
  }
  static void finish(const Group& g, V I, const int32_t*, const float* da, float* acc) {
    fstore(acc, fmadd(fcvt(I), fmul(g.d, fbcast(da)), fload(acc)));
  }
};

// The pass's rows as the row loop reads them, per block b and row r: the block's 256 activations, the type's
// table and the scale (packed once a call, so a block's rows are one base address and constant offsets).
template <class L>
struct Pass {
  std::vector<int8_t> q;     // [nb][M][256]
  std::vector<int32_t> tab;  // [nb][M][TAB]
  std::vector<float> da;     // [nb][M]
  void pack(const void* act, int64_t M, int64_t K) {
    const int64_t nb = K / 256;
    q.resize((size_t)(nb * M * 256));
    tab.resize((size_t)(nb * M * L::TAB));
    da.resize((size_t)(nb * M));
    for (int64_t m = 0; m < M; ++m) {
      const ActRow a = act_row(act, m, K, 256);
      for (int64_t b = 0; b < nb; ++b) {
        std::memcpy(&q[(size_t)(b * M + m) * 256], a.q + 256 * b, 256);
        L::table(a, b, &tab[(size_t)(b * M + m) * L::TAB]);
        da[(size_t)(b * M + m)] = a.d[b];
      }
    }
  }
};

// One block of the group against NR rows (q, tab, da: row 0's, the next rows' follow): each row's block
// integer in its 16 lanes (one per column), then the float steps into acc[r].
template <class L, int NR>
inline void rows_block(const Group& g, const int8_t* q, const int32_t* tab, const float* da, float* acc) {
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
        const int8_t* x = q + 256 * r + 4 * L::SW * j;
#pragma GCC unroll 8
        for (int t = 0; t < L::SW; ++t) a = dpbusd(a, w[t], x + 4 * t);
        I[r] = vadd(I[r], vmullo(a, s));
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) L::finish(g, I[r], tab + L::TAB * r, da + r, acc + LC * r);
}

// Columns [n0, n1) of rows r0 .. r0 + NR of the pass, 16 columns a group (a last group of fewer repeats its last
// column and stores only its own), each group's blocks in order.
template <class L, int NR>
void lanes_rows(const uint8_t* W, size_t rb, int64_t nb, const Pass<L>& pass, int64_t M, int64_t r0, int64_t n0,
                int64_t n1, float* Y, int64_t ldy) {
  alignas(64) Group g;
  alignas(64) float acc[NR][LC];
  for (int64_t n = n0; n < n1; n += LC) {
    const int valid = (int)std::min<int64_t>(LC, n1 - n);
    const uint8_t* col[LC];
    alignas(64) int32_t at[LC];
    for (int c = 0; c < LC; ++c) col[c] = W + (size_t)(n + std::min(c, valid - 1)) * rb;
    for (int lane = 0; lane < LC; ++lane) at[lane] = (int32_t)(col[4 * (lane % 4) + lane / 4] - col[0]);
    g.at = vload(at);
    for (int r = 0; r < NR; ++r) fstore(acc[r], fzero());
    for (int64_t b = 0; b < nb; ++b) {
      // the next group's bytes (contiguous: its 16 rows of W), a 1 / nb of them a block, into L2: one linear
      // stream (16 columns' blocks fetched side by side ran at ~40% of the bandwidth from DRAM)
      const char* next = (const char*)(W + (size_t)(n + LC) * rb + (size_t)b * LC * L::BYTES);
      for (int l = 0; l < LC * L::BYTES; l += 64) _mm_prefetch(next + l, _MM_HINT_T1);
      const uint8_t* p[LC];
      for (int c = 0; c < LC; ++c) p[c] = col[c] + (size_t)b * L::BYTES;
      L::unpack(p, g);
      const size_t at_row = (size_t)(b * M + r0);
      rows_block<L, NR>(g, &pass.q[at_row * 256], &pass.tab[at_row * L::TAB], &pass.da[at_row], &acc[0][0]);
    }
    for (int r = 0; r < NR; ++r) {
      const VF v = unpermute(fload(acc[r]));
      if (valid == LC)
        fstore(Y + r * ldy + n, v);
      else
        fstore_first(Y + r * ldy + n, v, valid);
    }
  }
}

template <class L>
using LanesFn = void (*)(const uint8_t*, size_t, int64_t, const Pass<L>&, int64_t, int64_t, int64_t, int64_t, float*,
                         int64_t);

template <class L, int NR = MAX_NR>
LanesFn<L> lanes_for(int64_t rows) {
  if constexpr (NR == 1) {
    return lanes_rows<L, 1>;
  } else {
    return rows >= NR ? lanes_rows<L, NR> : lanes_for<L, NR - 1>(rows);
  }
}

template <class L>
void lanes_gemm(const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
                int64_t ldy) {
  const int64_t nb = K / 256;
  thread_local Pass<L> pass;
  pass.pack(act, M, K);
  for (int64_t r = 0; r < M; r += MAX_NR) {
    const int64_t nr = std::min<int64_t>(MAX_NR, M - r);
    lanes_for<L>(nr)(W, (size_t)nb * L::BYTES, nb, pass, M, r, n0, n1, Y + r * ldy, ldy);
  }
}

}  // namespace

// The types this tier has kernels of its own for (the tier table times it on these only).
int sx_avx512_owns(int type) { return type == Q4_K || type == Q6_K; }

void sx_avx512_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                    float* Y, int64_t ldy) {
  if (type == Q4_K) return lanes_gemm<LanesQ4K>(act, M, K, W, n0, n1, Y, ldy);
  if (type == Q6_K) return lanes_gemm<LanesQ6K>(act, M, K, W, n0, n1, Y, ldy);
  // avx512vnni's unit may have been left out (an old assembler): AVX2's, the same bits
  return sx_avx512vnni_gemm ? sx_avx512vnni_gemm(type, act, M, K, W, n0, n1, Y, ldy)
                            : sx_avx2_gemm(type, act, M, K, W, n0, n1, Y, ldy);
}
