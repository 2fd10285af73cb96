// The 512-bit tier's driver (sx_avx512.cc's kernels): 16 weight columns a group, one per lane, walked in
// units of 256 weights (a K type's block, or eight 32-weight blocks); each unit of the group unpacked once
// (the type's `unpack`) and every row of the pass run on it (the type's `rows`), each row's activations read
// where sx_quantize wrote them (one base address and the rows' stride: nothing copied per call).
#pragma once
#include <algorithm>
#include <vector>

#include "sx_act.h"
#include "sx_blocks.h"
#include "sx_v512.h"

namespace {

using namespace sx;

constexpr int LC = 16;      // weight columns a group: the lanes
constexpr int MAX_NR = 16;  // rows a sweep: each unit unpacked once for them

// One unit of a group's 16 columns, as every row of the pass reads it (lane 4L + k: column 4k + L,
// sx_v512.h): the code bytes' dwords, and what the type's steps need (sub-block scales as int32 lanes,
// Q4_K's min pairs, each block's d and m or -m, Q5's fifth bits).
struct Group {
  V at;  // each lane's column: its offset from lane 0's (load_dword)
  V t[64];
  V s[16];   // the K types' sub-block scales
  V mp[4];   // Q4_K's min pairs
  V qh[8];   // Q5_0 / Q5_1: each block's fifth bits
  VF d[8], m[8];
};

// The pass's rows: their int8 activations where sx_quantize wrote them (row r's at q + r * stride), and per
// unit u and row r the type's table (TAB int32) and floats (DA: each block's scale, and what else the type
// takes), made once a call.
template <class L>
struct Pass {
  const int8_t* q;
  int64_t stride;
  std::vector<int32_t> tab;  // [units][M][TAB]
  std::vector<float> da;     // [units][M][DA]
  void pack(const void* act, int64_t M, int64_t K) {
    const int64_t nb = K / L::QK, units = (nb + L::UNIT - 1) / L::UNIT;
    q = act_row(act, 0, K, L::QK).q;
    stride = (int64_t)act_row_bytes(K, L::QK);
    tab.assign((size_t)(units * M * L::TAB), 0);
    da.assign((size_t)(units * M * L::DA), 0.f);
    for (int64_t m = 0; m < M; ++m) {
      const ActRow a = act_row(act, m, K, L::QK);
      for (int64_t u = 0; u < units; ++u) {
        const size_t at = (size_t)(u * M + m);
        L::table(a, u * L::UNIT, (int)std::min<int64_t>(L::UNIT, nb - u * L::UNIT), &tab[at * L::TAB],
                 &da[at * L::DA]);
      }
    }
  }
};

// Columns [n0, n1) of rows r0 .. r0 + NR of the pass, 16 columns a group (a last group of fewer repeats its last
// column and stores only its own), each group's units in order.
template <class L, int NR>
void lanes_rows(const uint8_t* W, size_t rb, int64_t nb, const Pass<L>& pass, int64_t M, int64_t r0, int64_t n0,
                int64_t n1, float* Y, int64_t ldy) {
  alignas(64) Group g;
  alignas(64) float acc[NR][LC];
  const int64_t units = (nb + L::UNIT - 1) / L::UNIT;
  constexpr size_t UB = (size_t)L::UNIT * L::BYTES;  // a unit's bytes in a column
  for (int64_t n = n0; n < n1; n += LC) {
    const int valid = (int)std::min<int64_t>(LC, n1 - n);
    const uint8_t* col[LC];
    alignas(64) int32_t at[LC];
    for (int c = 0; c < LC; ++c) col[c] = W + (size_t)(n + std::min(c, valid - 1)) * rb;
    for (int lane = 0; lane < LC; ++lane) at[lane] = (int32_t)(col[4 * (lane % 4) + lane / 4] - col[0]);
    g.at = vload(at);
    for (int r = 0; r < NR; ++r) fstore(acc[r], fzero());
    for (int64_t u = 0; u < units; ++u) {
      // the next group's bytes (contiguous: its 16 rows of W), a 1 / units of them a unit, into L2: one linear
      // stream (16 columns' blocks fetched side by side ran at ~40% of the bandwidth from DRAM)
      const char* next = (const char*)(W + (size_t)(n + LC) * rb + (size_t)u * LC * UB);
      for (size_t l = 0; l < LC * UB; l += 64) _mm_prefetch(next + l, _MM_HINT_T1);
      const int nblk = (int)std::min<int64_t>(L::UNIT, nb - u * L::UNIT);
      const uint8_t* p[LC];
      for (int c = 0; c < LC; ++c) p[c] = col[c] + (size_t)u * UB;
      L::unpack(p, nblk, g);
      const size_t row = (size_t)(u * M + r0);
      L::template rows<NR>(g, nblk, pass.q + r0 * pass.stride + 256 * u, pass.stride, &pass.tab[row * L::TAB],
                           &pass.da[row * L::DA], &acc[0][0]);
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

// A sweep of the most rows `rows` allows: every count 1..16 (each unit unpacked once a pass of up to 16 rows);
// the emulated test library only powers of two (sweeps of 8 + 4 + 1 for 13 rows: the same bits, and a fifth of
// the code to compile at -O1).
#ifdef SX_EMULATE_AVX512
constexpr int STEP = 2;
#else
constexpr int STEP = 1;
#endif
template <class L, int NR = MAX_NR>
LanesFn<L> lanes_for(int64_t rows, int64_t* step) {
  if constexpr (NR == 1) {
    *step = 1;
    return lanes_rows<L, 1>;
  } else {
    if (rows >= NR) {
      *step = NR;
      return lanes_rows<L, NR>;
    }
    return lanes_for<L, STEP == 1 ? NR - 1 : NR / 2>(rows, step);
  }
}

template <class L>
void lanes_gemm(const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
                int64_t ldy) {
  const int64_t nb = K / L::QK;
  thread_local Pass<L> pass;
  pass.pack(act, M, K);
  for (int64_t r = 0, step = 0; r < M; r += step) {
    const LanesFn<L> run = lanes_for<L>(std::min<int64_t>(MAX_NR, M - r), &step);
    run(W, (size_t)nb * L::BYTES, nb, pass, M, r, n0, n1, Y + r * ldy, ldy);
  }
}

}  // namespace
