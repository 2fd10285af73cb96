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
#define TILE_DPBSSD(c, a, b) emu_dpbssd(c, a, b)
#define TILE_ZERO(t) emu_zero(t)
#define TILE_LOAD(t, base, stride) emu_load(t, base, stride)
#define TILE_STORE(t, base, stride) emu_store(t, base, stride)
#define TILE_RELEASE() ((void)0)
#else
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define TILE_RELEASE() _tile_release()
#endif

constexpr int TM = 16;  // weight rows per tile (A's rows, C's rows)
constexpr int TN = 16;  // activation rows per tile at most (B's and C's columns)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 A (16 weight rows x 32 bytes: one 32-weight chunk each); 2, 3 B (8 x 4M: the chunk's 32
// activations of M rows, four at a time); 4..7 C (16 x M int32: two pairs, one pair in flight while the other
// is stored). (Tried: a chunk pair in one 16 x 64 A tile against a block-diagonal B, half the products and
// loads, with its own sums layout: 120 ps a weight against these tiles' 80, Q4_K 8960 x 1536, one thread.)
void configure(int64_t M) {
  TileConfig c;
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = 32;
  for (int t : {2, 3}) c.rows[t] = 8, c.colsb[t] = (uint16_t)(4 * M);
  for (int t : {4, 5, 6, 7}) c.rows[t] = 16, c.colsb[t] = (uint16_t)(4 * M);
#ifdef SX_EMULATE_AMX
  emu_config(c.rows, c.colsb);
#else
  _tile_loadconfig(&c);
#endif
}

// A Q4_K block's eight 32-weight chunks in pairs: pair t holds chunks CHUNK[t][0] and [1] side by side (a load
// of 64 code bytes gives the low nibbles of chunks 2t, 2t + 2 and the high ones of 2t + 1, 2t + 3).
constexpr int CHUNK[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};

// The pass's activations for the tiles, once a call: B per chunk (8 rows x 64 bytes: row i holds activations
// 4i..4i+3 of the chunk's 32, for each token), the tokens' scales per block (da) and their sums per chunk as
// int16 pairs (two chunks' sums in one int32 lane: vpdpwssd's operand).
struct Packed {
  std::vector<int8_t> B;      // [nb][8][8][64]
  std::vector<float> da;      // [nb][16]
  std::vector<int32_t> a32;   // [nb][4][16] int16 pairs (chunk 2p, 2p + 1)
};

void pack(const ActRow* rows, int64_t M, int64_t K, int qk, Packed& p) {
  const int64_t nb = K / qk;
  p.B.assign((size_t)(nb * 8 * 512), 0);
  p.da.assign((size_t)(nb * TN), 0.f);
  p.a32.assign((size_t)(nb * 4 * TN), 0);
  for (int64_t m = 0; m < M; ++m) {
    const ActRow& r = rows[m];
    for (int64_t b = 0; b < nb; ++b) {
      for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 8; ++i) {
#ifdef SX_PLANT_AMX_PACK  // a planted bug the tests must catch: each chunk's activations from its neighbour
          const int8_t* q = r.q + b * 256 + 32 * (j ^ 1) + 4 * i;
#else
          const int8_t* q = r.q + b * 256 + 32 * j + 4 * i;
#endif
          std::memcpy(&p.B[(size_t)(((b * 8 + j) * 8 + i) * 64 + 4 * m)], q, 4);
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

// One step's weights, unpacked: A tiles and the integers and floats the epilogue needs, for 16 weight rows x
// one block. Q4_K's codes are centered (v - 8, in -8..7) so that a chunk's sum |sum (v - 8) q| <= 8 * 127 * 32
// fits an int16: two chunks' sums go through one vpdpwssd with their two scales, and 8 * s * (the chunk's
// activation sum) puts the centering back, exactly.
struct Q4KStep {
  alignas(64) int8_t A[4][TM][64];      // [chunk pair][row]: chunks CHUNK[t][0], [1] side by side
  alignas(64) int32_t s[TM][4];         // scales as int16 pairs (chunk 2p, 2p + 1)
  alignas(64) int32_t s8[TM][4];        // 8 x the same
  alignas(64) int32_t mn[TM][4];        // mins as int16 pairs
  alignas(64) float dd[TM], mm[TM];     // d and -dmin
};

// The accumulators of 16 weight rows x 16 activation rows, as the reference's float chains.
struct alignas(64) Acc {
  float v[TM][TN];
};

// Each chunk's sums C[chunk][weight row][activation row] of one step.
using Sums = int32_t[8][TM][TN];

inline uint32_t pair16(int a, int b) { return (uint32_t)(uint16_t)a | (uint32_t)(uint16_t)b << 16; }

#ifdef SX_EMULATE_AMX
// The steps around the tiles in scalar C, on the same layouts (sx_blocks.h's unpack gives the codes).
template <class Tiles>
void q4k_unpack(const uint8_t* W, size_t rb, int64_t n, int64_t b, Q4KStep& st, Tiles&& tiles) {
  Unpacked u;
  for (int i = 0; i < TM; ++i) {
    if (i % 4 == 0) tiles(i / 4);
    unpack(Q4_K, W + (size_t)(n + i) * rb + (size_t)b * 144, u);
    for (int t = 0; t < 4; ++t)
      for (int k = 0; k < 64; ++k) st.A[t][i][k] = (int8_t)(u.v[32 * CHUNK[t][k / 32] + k % 32] - 8);
    for (int p = 0; p < 4; ++p) {  // u.s, u.mn: per 16 weights; chunk j is 2j, 2j + 1
      st.s[i][p] = (int32_t)pair16(u.s[4 * p], u.s[4 * p + 2]);
      st.s8[i][p] = (int32_t)pair16(8 * u.s[4 * p], 8 * u.s[4 * p + 2]);
      st.mn[i][p] = (int32_t)pair16(u.mn[4 * p], u.mn[4 * p + 2]);
    }
    st.dd[i] = u.d;
    st.mm[i] = -u.m;
  }
}

int32_t dot_pairs(uint32_t a, uint32_t b) {  // vpdpwssd's step on one lane
  return (int16_t)(a & 0xFFFF) * (int16_t)(b & 0xFFFF) + (int16_t)(a >> 16) * (int16_t)(b >> 16);
}

void q4k_epilogue(const Q4KStep& st, const Sums& C, const float* da, const int32_t* a32, Acc& acc) {
  for (int i = 0; i < TM; ++i)
    for (int m = 0; m < TN; ++m) {
      int32_t I = 0, Mn = 0;
      for (int p = 0; p < 4; ++p) {
        const uint32_t a = (uint32_t)a32[p * TN + m];
        I += dot_pairs(pair16(C[2 * p][i][m], C[2 * p + 1][i][m]), (uint32_t)st.s[i][p]);
        I += dot_pairs((uint32_t)st.s8[i][p], a);
        Mn += dot_pairs((uint32_t)st.mn[i][p], a);
      }
      acc.v[i][m] = std::fmaf((float)I, st.dd[i] * da[m], acc.v[i][m]);
      acc.v[i][m] = std::fmaf((float)Mn, st.mm[i] * da[m], acc.v[i][m]);
    }
}
#else
// Interleaved with the tile products of the step before (`tiles`, called after every fourth row): the matrix
// unit works while the vector units unpack.
template <class Tiles>
void q4k_unpack(const uint8_t* W, size_t rb, int64_t n, int64_t b, Q4KStep& st, Tiles&& tiles) {
  const __m512i m4 = _mm512_set1_epi8(0xF), eight = _mm512_set1_epi8(8);
  for (int i = 0; i < TM; ++i) {
    if (i % 4 == 0) tiles(i / 4);
    const uint8_t* blk = W + (size_t)(n + i) * rb + (size_t)b * 144;
    // the same block of the next group's row: a group's 16 rows are 16 short streams the hardware prefetcher
    // does not follow (Qwen's K = 1536: 6 blocks a row)
    for (int l = 0; l < 144; l += 64) _mm_prefetch((const char*)(blk + TM * rb + l), _MM_HINT_T0);
    for (int half2 = 0; half2 < 2; ++half2) {                       // 64 code bytes: pairs 2 half2, 2 half2 + 1
      const __m512i x = _mm512_loadu_si512(blk + 16 + 64 * half2);
      _mm512_store_si512(st.A[2 * half2][i], _mm512_sub_epi8(_mm512_and_si512(x, m4), eight));
      _mm512_store_si512(st.A[2 * half2 + 1][i], _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(x, 4), m4), eight));
    }
    const __m256i sm = _mm256_cvtepu8_epi16(k4_scales(blk + 4));    // s0..s7, m0..m7 as int16
    _mm_store_si128((__m128i*)st.s[i], _mm256_castsi256_si128(sm));
    _mm_store_si128((__m128i*)st.s8[i], _mm_slli_epi16(_mm256_castsi256_si128(sm), 3));
    _mm_store_si128((__m128i*)st.mn[i], _mm256_extracti128_si256(sm, 1));
    st.dd[i] = half(blk);
    st.mm[i] = -half(blk + 2);
  }
}

// The block's integers from the chunks' sums, then the reference's two float steps, 16 activation rows at once.
void q4k_epilogue(const Q4KStep& st, const Sums& C, const float* da_b, const int32_t* a32, Acc& acc) {
  const __m512 da = _mm512_loadu_ps(da_b);
  __m512i a[4];
  for (int p = 0; p < 4; ++p) a[p] = _mm512_loadu_si512(a32 + p * TN);
  for (int i = 0; i < TM; ++i) {
    __m512i I = _mm512_setzero_si512(), Mn = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      const __m512i pairs = _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_load_si512(C[2 * p][i]),
                                                    _mm512_slli_epi32(_mm512_load_si512(C[2 * p + 1][i]), 16));
      I = _mm512_dpwssd_epi32(I, pairs, _mm512_set1_epi32(st.s[i][p]));
      I = _mm512_dpwssd_epi32(I, _mm512_set1_epi32(st.s8[i][p]), a[p]);
      Mn = _mm512_dpwssd_epi32(Mn, _mm512_set1_epi32(st.mn[i][p]), a[p]);
    }
    __m512 v = _mm512_load_ps(acc.v[i]);
    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(_mm512_set1_ps(st.dd[i]), da), v);
    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Mn), _mm512_mul_ps(_mm512_set1_ps(st.mm[i]), da), v);
    _mm512_store_ps(acc.v[i], v);
  }
}
#endif

// One chunk pair t of a step's tile products, into C tiles 4, 5 (t even) or 6, 7 (t odd), and the previous
// pair's C stored while this one multiplies (t = 4: the last pair's store alone). Tile numbers are literals
// (GCC's macros).
inline void q4k_pair(const Q4KStep& st, const int8_t* B, Sums& C, int t) {
  asm volatile("" ::: "memory");  // the tile loads read st.A: GCC's _tile_loadd declares no memory input
  if (t < 4) {
    TILE_LOAD(0, &st.A[t][0][0], 64);
    TILE_LOAD(1, &st.A[t][0][32], 64);
    TILE_LOAD(2, B + CHUNK[t][0] * 512, 64);
    TILE_LOAD(3, B + CHUNK[t][1] * 512, 64);
  }
  if (t % 2 == 0) {
    if (t < 4) {
      TILE_ZERO(4);
      TILE_ZERO(5);
      TILE_DPBSSD(4, 0, 2);
      TILE_DPBSSD(5, 1, 3);
    }
    if (t > 0) {
      TILE_STORE(6, C[CHUNK[t - 1][0]], 64);
      TILE_STORE(7, C[CHUNK[t - 1][1]], 64);
    }
  } else {
    TILE_ZERO(6);
    TILE_ZERO(7);
    TILE_DPBSSD(6, 0, 2);
    TILE_DPBSSD(7, 1, 3);
    TILE_STORE(4, C[CHUNK[t - 1][0]], 64);
    TILE_STORE(5, C[CHUNK[t - 1][1]], 64);
  }
}

// Q4_K: weight rows [n0, n0 + 16 groups), every block; Y rows m < M. Software-pipelined: step s = (group,
// block) issues its tile products, then unpacks step s + 1 while the matrix unit works, then takes s's sums.
void q4k_groups(const uint8_t* W, size_t rb, int64_t nb, const Packed& p, int64_t M, int64_t n0, int64_t groups,
                float* Y, int64_t ldy) {
  static thread_local Q4KStep steps_tls[2];
  static thread_local Acc acc_tls;
  alignas(64) static thread_local Sums C_tls;  // columns past M are never read into Y
  Q4KStep* steps = steps_tls;                   // thread-local addresses taken once (a call each in a -fPIC library)
  Acc& acc = acc_tls;
  Sums& C = C_tls;
  std::memset(&acc, 0, sizeof acc);
#ifdef SX_EMULATE_AMX
  std::memset(C, 0, sizeof C);
#endif
  const int64_t total = groups * nb;
  q4k_unpack(W, rb, n0, 0, steps[0], [](int) {});
  for (int64_t s = 0; s < total; ++s) {
    const int64_t g = s / nb, b = s % nb;
    const bool odd = s & 1;
    const int8_t* B = p.B.data() + (size_t)b * 8 * 512;
    auto tiles = [&](int t) { q4k_pair(steps[odd], B, C, t); };
    if (s + 1 < total)
      q4k_unpack(W, rb, n0 + TM * ((s + 1) / nb), (s + 1) % nb, steps[!odd], tiles);
    else
      for (int t = 0; t < 4; ++t) tiles(t);
    tiles(4);                          // the last pair's sums
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
