// The AMX tier's machinery shared by its kernels (sx_amx.cc): the tile instructions (real, or emulated in C
// for a test library), the tile configuration, the software-pipelined driver and the fallback.
#pragma once
#include "sx_x86.h"

void sx_avx2_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
__attribute__((weak)) void sx_avx512vnni_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t,
                                              float*, int64_t);

namespace {

using namespace sx;

#ifdef SX_EMULATE_AMX
// The tile registers of this thread and the four instructions used here, as the ISA defines them.
struct Tile {
  int rows = 0, colsb = 0;
  alignas(64) uint8_t d[16][64];
};
thread_local Tile tmm[8];

void emu_config(const uint8_t* rows, const uint16_t* colsb) {
  for (int t = 0; t < 8; ++t) tmm[t].rows = rows[t], tmm[t].colsb = colsb[t];
}
void emu_zero(int t) { std::memset(tmm[t].d, 0, sizeof tmm[t].d); }
void emu_load(int t, const void* base, size_t stride) {
  for (int r = 0; r < tmm[t].rows; ++r) std::memcpy(tmm[t].d[r], (const uint8_t*)base + r * stride, (size_t)tmm[t].colsb);
}
void emu_store(int t, void* base, size_t stride) {
  for (int r = 0; r < tmm[t].rows; ++r) std::memcpy((uint8_t*)base + r * stride, tmm[t].d[r], (size_t)tmm[t].colsb);
}
void emu_dpbssd(int c, int a, int b) {  // C[m][n] += sum_k s8 A[m][k] * s8 B[k / 4][4 n + k % 4]
  Tile &C = tmm[c], &A = tmm[a], &B = tmm[b];
  for (int m = 0; m < C.rows; ++m)
    for (int n = 0; n < C.colsb / 4; ++n) {
      int32_t acc;
      std::memcpy(&acc, &C.d[m][4 * n], 4);
      for (int k = 0; k < A.colsb; ++k) acc += (int32_t)(int8_t)A.d[m][k] * (int8_t)B.d[k / 4][4 * n + k % 4];
      std::memcpy(&C.d[m][4 * n], &acc, 4);
    }
}
void emu_dpbusd(int c, int a, int b) {  // the same with A's bytes unsigned
  Tile &C = tmm[c], &A = tmm[a], &B = tmm[b];
  for (int m = 0; m < C.rows; ++m)
    for (int n = 0; n < C.colsb / 4; ++n) {
      int32_t acc;
      std::memcpy(&acc, &C.d[m][4 * n], 4);
      for (int k = 0; k < A.colsb; ++k) acc += (int32_t)A.d[m][k] * (int8_t)B.d[k / 4][4 * n + k % 4];
      std::memcpy(&C.d[m][4 * n], &acc, 4);
    }
}
#define TILE_DPBSSD(c, a, b) emu_dpbssd(c, a, b)
#define TILE_DPBUSD(c, a, b) emu_dpbusd(c, a, b)
#define TILE_ZERO(t) emu_zero(t)
#define TILE_LOAD(t, base, stride) emu_load(t, base, stride)
#define TILE_STORE(t, base, stride) emu_store(t, base, stride)
#define TILE_RELEASE() ((void)0)
#else
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define TILE_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
#define TILE_RELEASE() _tile_release()
#endif

constexpr int TM = 16;  // weight rows per tile (A's rows, C's rows)
constexpr int TN = 16;  // activation rows per tile at most (B's and C's columns)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 A (16 weight rows x KB bytes: two blocks' codes, or a K type's lo and hi bytes); 2, 3 B (KB / 4 x
// 4M: its activations of M rows, four at a time); 4..7 C (16 x M int32: the 32-weight types' two pairs, one in
// flight while the other is stored; the K types' lo and hi sums in 4 and 5). (Tried for Q4_K: a chunk pair in one 16 x 64 A tile against a block-diagonal B, half the
// products and loads, with its own sums layout: 120 ps a weight against these tiles' 80.)
void configure(int64_t M, int KB) {
  TileConfig c;
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = (uint16_t)KB;
  for (int t : {2, 3}) c.rows[t] = (uint8_t)(KB / 4), c.colsb[t] = (uint16_t)(4 * M);
  for (int t : {4, 5, 6, 7}) c.rows[t] = 16, c.colsb[t] = (uint16_t)(4 * M);
#ifdef SX_EMULATE_AMX
  emu_config(c.rows, c.colsb);
#else
  _tile_loadconfig(&c);
#endif
}

// The accumulators of 16 weight rows x 16 activation rows, as the reference's float chains: weight row i,
// activation row m at i * Kern::LANES + m (LANES = 16; a kernel with fewer activation rows may pack
// 16 / LANES weight rows into one vector).
struct alignas(64) Acc {
  float v[TM][TN];
};

inline uint32_t pair16(int a, int b) { return (uint32_t)(uint16_t)a | (uint32_t)(uint16_t)b << 16; }

#ifdef SX_EMULATE_AMX
// A step's 16 rows unpacked by the shared scalar code (sx_blocks.h) and handed to `fill`, the step before's
// tile pairs in between (as the real tier interleaves them).
template <int PAIRS, class Tiles, class Fill>
void emu_rows(int type, const uint8_t* W, size_t rb, int64_t n, int64_t b, Tiles&& tiles, Fill&& fill) {
  const TypeInfo ti = type_info(type);
  Unpacked u;
  for (int i = 0; i < TM; ++i) {
    if (i % (TM / PAIRS) == 0) tiles(i / (TM / PAIRS));
    sx::unpack(type, W + (size_t)(n + i) * rb + (size_t)b * ti.bytes, u);
    fill(i, u);
  }
}
#endif

// Weight rows [n0, n0 + 16 groups), every block; Y rows m < M. Software-pipelined: step s = (group, block)
// issues its tile products (Kern::pair, one pair of tiles at a time) interleaved with the unpacking of step
// s + 1 (Kern::unpack calls it back), then takes s's sums (Kern::epilogue) into the rows' accumulators.
template <class Kern>
void run_groups(const uint8_t* W, size_t rb, int64_t nb, const typename Kern::Packed& p, int64_t M, int64_t n0,
                int64_t groups, float* Y, int64_t ldy) {  // nb: steps a group (Kern::STEP_K weights each)
  static thread_local typename Kern::Step steps_tls[2];
  static thread_local Acc acc_tls;
  alignas(64) static thread_local typename Kern::Sums C_tls;  // columns past M are never read into Y
  typename Kern::Step* steps = steps_tls;  // thread-local addresses taken once (a call each in a -fPIC library)
  Acc& acc = acc_tls;
  typename Kern::Sums& C = C_tls;
  std::memset(&acc, 0, sizeof acc);
#ifdef SX_EMULATE_AMX
  std::memset(C, 0, sizeof C);
#endif
  const int64_t total = groups * nb;
  Kern::unpack(W, rb, n0, 0, steps[0], [](int) {});
  for (int64_t s = 0; s < total; ++s) {
    const int64_t g = s / nb, b = s % nb;
    const bool odd = s & 1;
    auto tiles = [&](int t) { Kern::pair(steps[odd], p, b, C, t); };
    if (s + 1 < total)
      Kern::unpack(W, rb, n0 + TM * ((s + 1) / nb), (s + 1) % nb, steps[!odd], tiles);
    else
      for (int t = 0; t < Kern::PAIRS; ++t) tiles(t);
    tiles(Kern::PAIRS);                // the last pair's sums
    Kern::epilogue(steps[odd], C, p, b, acc);
    if (b == nb - 1) {                 // the group's outputs
      const int64_t n = n0 + TM * g;
      for (int64_t m = 0; m < M; ++m)
        for (int i = 0; i < TM; ++i) Y[m * ldy + n + i] = (&acc.v[0][0])[i * Kern::LANES + m];
      std::memset(&acc, 0, sizeof acc);
    }
  }
}

// A pair t of tile products into C tiles 4, 5 (t even) or 6, 7 (t odd), and the previous pair's C stored
// while this one multiplies (t = pairs: the last store alone), its rows c_stride bytes apart. A0/A1 and B2/B3:
// the pair's two sub-blocks. Tile numbers are literals (GCC's macros).
inline void tile_pair(const void* a0, const void* a1, size_t a_stride, const void* b0, const void* b1, int t,
                      int pairs, int32_t* c_prev0, int32_t* c_prev1, size_t c_stride = 64) {
  asm volatile("" ::: "memory");  // the tile loads read A: GCC's _tile_loadd declares no memory input
  if (t < pairs) {
    TILE_LOAD(0, a0, a_stride);
    TILE_LOAD(1, a1, a_stride);
    TILE_LOAD(2, b0, 64);
    TILE_LOAD(3, b1, 64);
  }
  if (t % 2 == 0) {
    if (t < pairs) {
      TILE_ZERO(4);
      TILE_ZERO(5);
      TILE_DPBSSD(4, 0, 2);
      TILE_DPBSSD(5, 1, 3);
    }
    if (t > 0) {
      TILE_STORE(6, c_prev0, c_stride);
      TILE_STORE(7, c_prev1, c_stride);
    }
  } else {
    if (t < pairs) {
      TILE_ZERO(6);
      TILE_ZERO(7);
      TILE_DPBSSD(6, 0, 2);
      TILE_DPBSSD(7, 1, 3);
    }
    TILE_STORE(4, c_prev0, c_stride);
    TILE_STORE(5, c_prev1, c_stride);
  }
}

// The pass's int8 activations as B tiles (VNNI layout), once a call: B row r (64 bytes) holds word(r), the
// four values K 4 word(r)..+3, of each token m at bytes 4m..4m+3 (zero past M). Rows are act_row's, a fixed
// stride apart: one gather a B row (the scalar copy it replaces took a fifth of a 16-row call at K = 4096).
template <class Word>
void pack_words(const ActRow* rows, int64_t M, int64_t K, int qk, Word&& word, int8_t* B) {
#ifdef SX_EMULATE_AMX
  (void)qk;
  std::memset(B, 0, (size_t)(K / 4) * 64);
  for (int64_t r = 0; r < K / 4; ++r)
    for (int64_t m = 0; m < M; ++m) std::memcpy(B + r * 64 + 4 * m, rows[m].q + 4 * word(r), 4);
#else
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32((int)act_row_bytes(K, qk)));
  const __mmask16 live = (__mmask16)((1u << M) - 1);
  for (int64_t r = 0; r < K / 4; ++r) {
    const __m512i at = _mm512_add_epi32(idx, _mm512_set1_epi32((int)(4 * word(r))));
    _mm512_storeu_si512(B + r * 64, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, rows[0].q, 1));
  }
#endif
}

// Row i's bytes of the step AHEAD steps after (row group n, step b), a step `step` bytes of each of a
// group's 16 rows (rows rb apart; steps go along the group's rows, then to the next group): what the
// unpacking prefetches. A fixed distance in the weights' own order, which Q6_K's ffn_down (K = 8960: 35
// steps a group, 117 KB) needs: one group ahead, as before, left its lines in L2 only, not L1.
constexpr int64_t AHEAD = 2;
inline const char* ahead(const uint8_t* W, size_t rb, int64_t n, int64_t b, int i, size_t step) {
  const int64_t nb = (int64_t)(rb / step), s = b + AHEAD;
  return (const char*)(W + (size_t)(n + TM * (s / nb) + i) * rb + (size_t)(s % nb) * step);
}

// The split kernels' (Q4_K, Q6_K) step t of a block: A tiles lo, hi (16 rows x 64 bytes each, at
// A + (2 t + 0/1) * 1024) times B (at B + t * 1024) into C tiles 4 (lo, unsigned bytes: tdpbusd) and 5 (hi),
// zeroed at the block's first step; t = steps: their store into C (rows `lanes` int32 apart).
inline void block_step(const int8_t* A, const int8_t* B, int32_t (&C)[2][TM][TN], int t, int steps, int lanes) {
  asm volatile("" ::: "memory");  // the tile loads read A: GCC's _tile_loadd declares no memory input
  if (t == steps) {
    TILE_STORE(4, C[0], 4 * lanes);
    TILE_STORE(5, C[1], 4 * lanes);
    return;
  }
  TILE_LOAD(0, A + 2 * t * 1024, 64);
  TILE_LOAD(1, A + (2 * t + 1) * 1024, 64);
  TILE_LOAD(2, B + t * 1024, 64);
  if (t == 0) {
    TILE_ZERO(4);
    TILE_ZERO(5);
  }
  TILE_DPBUSD(4, 0, 2);
  TILE_DPBSSD(5, 1, 2);
}

void fallback(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
              int64_t ldy) {
  if (n0 >= n1) return;
#ifndef SX_EMULATE_AMX  // the AMX CPUs have AVX-512 VNNI; an emulating CPU may have AVX2 only
  if (sx_avx512vnni_gemm) return sx_avx512vnni_gemm(type, act, M, K, W, n0, n1, Y, ldy);
#endif
  sx_avx2_gemm(type, act, M, K, W, n0, n1, Y, ldy);
}

}  // namespace
