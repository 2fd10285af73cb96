// The AMX tier (x86 with AMX-INT8; compiled with -mamx-tile -mamx-int8 and AVX-512 for the steps around the
// tiles). The weights are the A tile, unpacked from the file's blocks straight into 16 weight rows x two
// chunks of K (no second copy of the weights); the pass's int8 activation rows are the B tile (VNNI layout:
// four K values of a row side by side), packed once a call; C sums a whole block exactly, then the
// reference's float steps in the reference's order (sx_ref.cc), so every output's bits equal ref's.
// Only Q4_K has its tile kernel yet; every other type, and column tails of fewer than 16, run the VNNI or
// AVX2 kernels (the same bits).
// SX_EMULATE_AMX (a test library, compiled with AVX2 flags only): the tile instructions computed in C with
// their exact integer semantics and the steps around them in scalar C on the same layouts, so a CPU without
// AMX checks the tiles' layouts, the activations' packing and the scale split against the reference.
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
void emu_dpbusd(int c, int a, int b) {  // C[m][n] += sum_k u8 A[m][k] * s8 B[k / 4][4 n + k % 4]
  Tile &C = tmm[c], &A = tmm[a], &B = tmm[b];
  for (int m = 0; m < C.rows; ++m)
    for (int n = 0; n < C.colsb / 4; ++n) {
      int32_t acc;
      std::memcpy(&acc, &C.d[m][4 * n], 4);
      for (int k = 0; k < A.colsb; ++k) acc += (int32_t)A.d[m][k] * (int8_t)B.d[k / 4][4 * n + k % 4];
      std::memcpy(&C.d[m][4 * n], &acc, 4);
    }
}
#define TILE_ZERO(t) emu_zero(t)
#define TILE_LOAD(t, base, stride) emu_load(t, base, stride)
#define TILE_STORE(t, base, stride) emu_store(t, base, stride)
#define TILE_DPBUSD(c, a, b) emu_dpbusd(c, a, b)
#define TILE_RELEASE() ((void)0)
#else
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
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

// Tiles: 0, 1 A (16 weight rows x 64 bytes: two 32-weight chunks); 2 B (16 x 4M: the same 64 activations of M
// rows, four at a time); 4..7 C (16 x M int32: two pairs, for steps in flight one after the other).
void configure(int64_t M) {
  TileConfig c;
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = 64;
  c.rows[2] = 16, c.colsb[2] = (uint16_t)(4 * M);
  for (int t : {4, 5, 6, 7}) c.rows[t] = 16, c.colsb[t] = (uint16_t)(4 * M);
#ifdef SX_EMULATE_AMX
  emu_config(c.rows, c.colsb);
#else
  _tile_loadconfig(&c);
#endif
}

// A K block's 256 weights as four tiles of two chunks each: tile u holds chunks CHUNK[u][0] and [1] (a Q4_K
// load of 64 code bytes gives the low nibbles of chunks 2t, 2t + 2 and the high ones of 2t + 1, 2t + 3).
constexpr int CHUNK[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};

// The pass's activations for the tiles, once a call: B per tile (16 rows x 64 bytes: row i holds activations
// 4i..4i+3 of the tile's 64, for each token), the tokens' scales per block (da) and their sums per 32 as
// int16 pairs (for the mins: two chunks' sums in one int32 lane, vpdpwssd's operand).
struct Packed {
  std::vector<int8_t> B;      // [nb][4][16][64]
  std::vector<float> da;      // [nb][16]
  std::vector<int32_t> a32;   // [nb][4][16] int16 pairs (chunk 2p, 2p + 1)
};

void pack(const ActRow* rows, int64_t M, int64_t K, int qk, Packed& p) {
  const int64_t nb = K / qk;
  p.B.assign((size_t)(nb * 4 * 1024), 0);
  p.da.assign((size_t)(nb * TN), 0.f);
  p.a32.assign((size_t)(nb * 4 * TN), 0);
  for (int64_t m = 0; m < M; ++m) {
    const ActRow& r = rows[m];
    for (int64_t b = 0; b < nb; ++b) {
      for (int u = 0; u < 4; ++u)
        for (int i = 0; i < 16; ++i) {
#ifdef SX_PLANT_AMX_PACK  // a planted bug the tests must catch: B's halves from the other chunk
          const int8_t* q = r.q + b * 256 + 32 * CHUNK[u][1 - i / 8] + 4 * (i % 8);
#else
          const int8_t* q = r.q + b * 256 + 32 * CHUNK[u][i / 8] + 4 * (i % 8);
#endif
          std::memcpy(&p.B[(size_t)(((b * 4 + u) * 16 + i) * 64 + 4 * m)], q, 4);
        }
      p.da[(size_t)(b * TN + m)] = r.d[b];
      for (int j = 0; j < 4; ++j) {
        const int16_t* s = r.s16 + b * (qk / 16) + 4 * j;  // chunks 2j, 2j+1: four sums of 16
        const uint16_t lo = (uint16_t)(s[0] + s[1]), hi = (uint16_t)(s[2] + s[3]);
        p.a32[(size_t)((b * 4 + j) * TN + m)] = (int32_t)((uint32_t)lo | (uint32_t)hi << 16);
      }
    }
  }
}

// One step's weights, unpacked: A tiles and the scalars the epilogue needs, for 16 weight rows x one block.
// Q4_K's sub-block scale s (6 bits) is split s = 8 h + l (h, l <= 7), so h * code and l * code (<= 105) are
// bytes: two A tiles whose products sum over the whole block in C, and I = 8 C_h + C_l exactly.
struct Q4KStep {
  alignas(64) uint8_t A[4][2][TM][64];  // [tile][h, l][row]
  alignas(64) int32_t mn[TM][4];        // mins as int16 pairs (chunk 2j, 2j + 1)
  alignas(64) float dd[TM], mm[TM];     // d and -dmin
};

// The accumulators of 16 weight rows x 16 activation rows, as the reference's float chains.
struct alignas(64) Acc {
  float v[TM][TN];
};

#ifdef SX_EMULATE_AMX
// The steps around the tiles in scalar C, on the same layouts (sx_blocks.h's unpack gives the codes).
void q4k_unpack(const uint8_t* W, size_t rb, int64_t n, int64_t b, Q4KStep& st) {
  Unpacked u;
  for (int i = 0; i < TM; ++i) {
    const uint8_t* blk = W + (size_t)(n + i) * rb + (size_t)b * 144;
    unpack(Q4_K, blk, u);
    for (int t = 0; t < 4; ++t)
      for (int part = 0; part < 2; ++part)
        for (int k = 0; k < 64; ++k) {
          const int j = CHUNK[t][k / 32], s = u.s[2 * j];
          st.A[t][part][i][k] = (uint8_t)((part == 0 ? s >> 3 : s & 7) * u.v[32 * j + k % 32]);
        }
    for (int j = 0; j < 4; ++j) st.mn[i][j] = (int32_t)((uint32_t)(uint16_t)u.mn[4 * j] | (uint32_t)u.mn[4 * j + 2] << 16);
    st.dd[i] = u.d;
    st.mm[i] = -u.m;
  }
}

void q4k_epilogue(const Q4KStep& st, int32_t C[2][TM][TN], const float* da, const int32_t* a32, Acc& acc) {
  for (int i = 0; i < TM; ++i)
    for (int m = 0; m < TN; ++m) {
      const int32_t I = 8 * C[0][i][m] + C[1][i][m];
      int32_t Mn = 0;
      for (int j = 0; j < 4; ++j) {
        const uint32_t mp = (uint32_t)st.mn[i][j], ap = (uint32_t)a32[j * TN + m];
        Mn += (int16_t)(mp & 0xFFFF) * (int16_t)(ap & 0xFFFF) + (int16_t)(mp >> 16) * (int16_t)(ap >> 16);
      }
      acc.v[i][m] = std::fmaf((float)I, st.dd[i] * da[m], acc.v[i][m]);
      acc.v[i][m] = std::fmaf((float)Mn, st.mm[i] * da[m], acc.v[i][m]);
    }
}
#else
// s * c for s in 0..7 and c in 0..15, byte s * 16 + c: vpermi2b's 128-byte table.
struct Products {
  __m512i lo, hi;
  Products() {
    alignas(64) uint8_t t[128];
    for (int i = 0; i < 128; ++i) t[i] = (uint8_t)((i >> 4) * (i & 15));
    lo = _mm512_load_si512(t);
    hi = _mm512_load_si512(t + 64);
  }
};

// Per tile u and part (h, l): which byte of [l0 .. l7, h0 .. h7] (the scales' parts shifted to bits 4..6) each
// half of the tile's 64 codes takes.
struct alignas(64) Pick {
  uint8_t v[4][2][64];
  Pick() {
    for (int u = 0; u < 4; ++u)
      for (int part = 0; part < 2; ++part)
        for (int k = 0; k < 64; ++k) v[u][part][k] = (uint8_t)((part == 0 ? 8 : 0) + CHUNK[u][k / 32]);
  }
};

// A's bytes through vpermi2b: index (scale part << 4) | code into the products table.
void q4k_unpack(const uint8_t* W, size_t rb, int64_t n, int64_t b, Q4KStep& st) {
  static const Products prod;
  static const Pick pick;
  const __m512i m4 = _mm512_set1_epi8(0xF);
  for (int i = 0; i < TM; ++i) {
    const uint8_t* blk = W + (size_t)(n + i) * rb + (size_t)b * 144;
    // the same block of the next group's row: a group's 16 rows are 16 short streams the hardware prefetcher
    // does not follow (Qwen's K = 1536: 6 blocks a row)
    for (int l = 0; l < 144; l += 64) _mm_prefetch((const char*)(blk + TM * rb + l), _MM_HINT_T0);
    const __m128i sm = k4_scales(blk + 4);                          // s0..s7, m0..m7 as bytes
    const __m128i l = _mm_slli_epi16(_mm_and_si128(sm, _mm_set1_epi8(7)), 4);
    const __m128i h = _mm_slli_epi16(_mm_and_si128(sm, _mm_set1_epi8(0x38)), 1);
    const __m512i hl = _mm512_broadcast_i32x4(_mm_unpacklo_epi64(l, h));  // [l0..l7 << 4, h0..h7 << 4]
    _mm_store_si128((__m128i*)st.mn[i], _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8)));
    st.dd[i] = half(blk);
    st.mm[i] = -half(blk + 2);
    for (int half2 = 0; half2 < 2; ++half2) {                       // 64 code bytes: tiles 2 half2, 2 half2 + 1
      const __m512i x = _mm512_loadu_si512(blk + 16 + 64 * half2);
      const __m512i codes[2] = {x, _mm512_srli_epi16(x, 4)};       // low nibbles: tile 2 half2, high: + 1
      for (int odd = 0; odd < 2; ++odd) {
        const int u = 2 * half2 + odd;
        for (int part = 0; part < 2; ++part) {
          const __m512i sc = _mm512_permutexvar_epi8(_mm512_load_si512(pick.v[u][part]), hl);
          const __m512i idx = _mm512_ternarylogic_epi32(codes[odd], m4, sc, 0xEA);  // (codes & 15) | sc
          _mm512_store_si512(st.A[u][part][i], _mm512_permutex2var_epi8(prod.lo, idx, prod.hi));
        }
      }
    }
  }
}

// The block's integers from C, then the reference's two float steps, 16 activation rows at a time.
void q4k_epilogue(const Q4KStep& st, int32_t C[2][TM][TN], const float* da_b, const int32_t* a32, Acc& acc) {
  const __m512 da = _mm512_loadu_ps(da_b);
  for (int i = 0; i < TM; ++i) {
    const __m512i I = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(C[0][i]), 3), _mm512_load_si512(C[1][i]));
    __m512i Mn = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) Mn = _mm512_dpwssd_epi32(Mn, _mm512_set1_epi32(st.mn[i][j]), _mm512_loadu_si512(a32 + j * TN));
    __m512 a = _mm512_load_ps(acc.v[i]);
    a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(_mm512_set1_ps(st.dd[i]), da), a);
    a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Mn), _mm512_mul_ps(_mm512_set1_ps(st.mm[i]), da), a);
    _mm512_store_ps(acc.v[i], a);
  }
}
#endif

// Tiles 4, 5 (even steps) or 6, 7 (odd): C_h and C_l of one step. Tile numbers are literals (GCC's macros).
void q4k_tiles(const Q4KStep& st, const int8_t* B, bool odd) {
  asm volatile("" ::: "memory");  // the tile loads read st.A: GCC's _tile_loadd declares no memory input
  if (!odd) {
    TILE_ZERO(4);
    TILE_ZERO(5);
  } else {
    TILE_ZERO(6);
    TILE_ZERO(7);
  }
  for (int u = 0; u < 4; ++u) {
    TILE_LOAD(0, st.A[u][0][0], 64);
    TILE_LOAD(1, st.A[u][1][0], 64);
    TILE_LOAD(2, B + u * 1024, 64);
    if (!odd) {
      TILE_DPBUSD(4, 0, 2);
      TILE_DPBUSD(5, 1, 2);
    } else {
      TILE_DPBUSD(6, 0, 2);
      TILE_DPBUSD(7, 1, 2);
    }
  }
}

// Q4_K: weight rows [n0, n0 + 16 groups), every block; Y rows m < M. Software-pipelined: step s = (group,
// block) issues its tile products, then unpacks step s + 1 while the matrix unit works, then takes s's sums.
void q4k_groups(const uint8_t* W, size_t rb, int64_t nb, const Packed& p, int64_t M, int64_t n0, int64_t groups,
                float* Y, int64_t ldy) {
  static thread_local Q4KStep steps[2];
  static thread_local Acc acc;
  std::memset(&acc, 0, sizeof acc);
  const int64_t total = groups * nb;
  q4k_unpack(W, rb, n0, 0, steps[0]);
  for (int64_t s = 0; s < total; ++s) {
    const int64_t g = s / nb, b = s % nb;
    const bool odd = s & 1;
    q4k_tiles(steps[odd], p.B.data() + (size_t)b * 4 * 1024, odd);
    if (s + 1 < total) q4k_unpack(W, rb, n0 + TM * ((s + 1) / nb), (s + 1) % nb, steps[!odd]);
    alignas(64) int32_t C[2][TM][TN];     // [h, l]; columns past M are never read into Y
#ifdef SX_EMULATE_AMX
    std::memset(C, 0, sizeof C);
#endif
    if (!odd) {
      TILE_STORE(4, C[0][0], 64);
      TILE_STORE(5, C[1][0], 64);
    } else {
      TILE_STORE(6, C[0][0], 64);
      TILE_STORE(7, C[1][0], 64);
    }
    q4k_epilogue(steps[odd], C, p.da.data() + b * TN, p.a32.data() + b * 4 * TN, acc);
    if (b == nb - 1) {                 // the group's outputs
      const int64_t n = n0 + TM * g;
      for (int64_t m = 0; m < M; ++m)
        for (int i = 0; i < TM; ++i) Y[m * ldy + n + i] = acc.v[i][m];
      std::memset(&acc, 0, sizeof acc);
    }
  }
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

void sx_amx_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
                 int64_t ldy) {
  if (type != Q4_K || M > TN) return fallback(type, act, M, K, W, n0, n1, Y, ldy);
  const TypeInfo ti = type_info(type);
  const int64_t nb = K / ti.qk;
  const size_t rb = (size_t)nb * ti.bytes;
  std::vector<ActRow> rows((size_t)M);
  for (int64_t m = 0; m < M; ++m) rows[(size_t)m] = act_row(act, m, K, ti.qk);
  Packed p;
  pack(rows.data(), M, K, ti.qk, p);
  configure(M);
  const int64_t groups = (n1 - n0) / TM;
  if (groups) q4k_groups(W, rb, nb, p, M, n0, groups, Y, ldy);
  TILE_RELEASE();
  fallback(type, act, M, K, W, n0 + TM * groups, n1, Y, ldy);
}
