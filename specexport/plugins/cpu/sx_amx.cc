// The AMX tier (x86 with AMX-INT8; compiled with -mamx-tile -mamx-int8 and AVX-512 for the steps around the
// tiles). The weights are the A tile, unpacked from the file's blocks straight into 16 weight rows x 64
// weights of a block, or one 32-weight block (no second copy of the weights); the pass's int8 activation rows
// are the B tile (VNNI layout: four K values of a row side by side), packed once a call. The K types' integers
// (code x sub-block scale) are split into two byte tiles summed over the whole block; the 32-weight types'
// sums are a block's; then the reference's float steps in the reference's order (sx_ref.cc), so every
// output's bits equal ref's. Tile kernels: Q4_K and Q6_K (a Q4_K_M file's weights), Q8_0, Q4_0 and Q4_1
// (SmolLM2's file); every other type, and column tails of fewer than 16, run the VNNI or AVX2 kernels (the
// same bits). sx_amx.h: the tiles, their configuration, the pipelined driver.
// SX_EMULATE_AMX (a test library, compiled with AVX2 flags only): the tile instructions computed in C with
// their exact integer semantics and the steps around them in scalar C on the same layouts, so a CPU without
// AMX checks the tiles' layouts, the activations' packing and the scale handling against the reference.
#include "sx_amx.h"

namespace {

// R weight rows share a vector in a kernel's epilogue (R = 16 / LANES, for passes of at most LANES activation
// rows): the C tiles are stored with rows LANES int32 apart, so one vector load takes R rows' sums.
template <int R>
struct Rows {
  static constexpr int LANES = TN / R, SHIFT = R == 1 ? 4 : R == 2 ? 3 : 2;
};

// ---- Q4_K: a block's codes scaled by their chunks' scales, whole-block sums ------------------------------
// Each weight's integer s * v (v the 4-bit code, s its 32-weight chunk's 6-bit scale: <= 945) is split into
// its two bytes, lo and hi (0..3), two A tiles a 64-weight step (tdpbusd: A unsigned, the activations signed),
// accumulated over the block's four steps in one C tile each: the block's integer 256 hi + lo is the
// reference's sum of s * sum v a; the mins' term from the chunks' activation sums (vpdpwssd), then the
// reference's two float steps. (Before: a tile product per chunk, eight C tiles a block, each chunk's sums
// scaled after them: 87 ps a weight at 16 rows against this layout's fewer stores.)

template <int R>
struct Q4K_AMX : Rows<R> {
  static constexpr int PAIRS = 4, KB = 64, STEP_K = 256;
  static constexpr int LANES = Rows<R>::LANES;
  // Step t holds chunks CHUNK[t][0] and [1] side by side (a load of 64 code bytes gives the low nibbles of
  // chunks 2t, 2t + 2 and the high ones of 2t + 1, 2t + 3).
  static constexpr int CHUNK[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};

  // B per step (16 rows x 64 bytes: row i holds activations 4i..4i+3 of the step's two chunks, for each token),
  // the tokens' scales per block (da) and their sums per chunk as int16 pairs (two chunks' sums in one int32
  // lane: vpdpwssd's operand).
  struct Packed {
    std::vector<int8_t> B;      // [nb][4][16][64]
    std::vector<float> da;      // [nb][16]
    std::vector<int32_t> a32;   // [nb][4][16] int16 pairs (chunk 2p, 2p + 1)
  };

  static void pack(const ActRow* rows, int64_t M, int64_t K, int qk, Packed& p) {
    const int64_t nb = K / qk;
    p.B.resize((size_t)(nb * 4 * 1024));
    p.da.assign((size_t)(nb * TN), 0.f);
    p.a32.assign((size_t)(nb * 4 * TN), 0);
    pack_words(rows, M, K, qk, [](int64_t w) {   // B row w: step w / 16 of its block, row w % 16
      const int64_t b = w / 64, t = w / 16 % 4, i = w % 16;
#ifdef SX_PLANT_AMX_PACK  // a planted bug the tests must catch: each chunk's activations from its neighbour
      return b * 64 + 8 * (CHUNK[t][i / 8] ^ 1) + i % 8;
#else
      return b * 64 + 8 * CHUNK[t][i / 8] + i % 8;
#endif
    }, p.B.data());
    for (int64_t m = 0; m < M; ++m) {
      const ActRow& r = rows[m];
      for (int64_t b = 0; b < nb; ++b) {
        p.da[(size_t)(b * TN + m)] = r.d[b];
        for (int j = 0; j < 4; ++j) {
          const int16_t* s = r.s16 + b * (qk / 16) + 4 * j;  // chunks 2j, 2j+1: four sums of 16
          const uint16_t lo = (uint16_t)(s[0] + s[1]), hi = (uint16_t)(s[2] + s[3]);
          p.a32[(size_t)((b * 4 + j) * TN + m)] = (int32_t)((uint32_t)lo | (uint32_t)hi << 16);
        }
      }
    }
  }

  struct Step {
    alignas(64) int8_t A[4][2][TM][64];   // [step][lo, hi][row]
    alignas(64) int32_t mn[TM][4];        // mins as int16 pairs (chunk 2p, 2p + 1)
    alignas(64) float dd[TM], mm[TM];     // d and -dmin
  };

  using Sums = int32_t[2][TM][TN];        // lo, hi: [row * LANES + token] (flat)

#ifdef SX_EMULATE_AMX
  template <class Tiles>
  static void unpack(const uint8_t* W, size_t rb, int64_t n, int64_t b, Step& st, Tiles&& tiles) {
    emu_rows<PAIRS>(Q4_K, W, rb, n, b, tiles, [&](int i, const Unpacked& u) {
      for (int t = 0; t < 4; ++t)
        for (int k = 0; k < 64; ++k) {
          const int c = CHUNK[t][k / 32], w = u.s[2 * c] * u.v[32 * c + k % 32];   // u.s, u.mn: per 16 weights
          st.A[t][0][i][k] = (int8_t)(uint8_t)(w & 0xFF);
          st.A[t][1][i][k] = (int8_t)(w >> 8);
        }
      for (int p = 0; p < 4; ++p) st.mn[i][p] = (int32_t)pair16(u.mn[4 * p], u.mn[4 * p + 2]);
      st.dd[i] = u.d;
      st.mm[i] = -u.m;
    });
  }

  static int32_t dot_pairs(uint32_t a, uint32_t b) {  // vpdpwssd's step on one lane
    return (int16_t)(a & 0xFFFF) * (int16_t)(b & 0xFFFF) + (int16_t)(a >> 16) * (int16_t)(b >> 16);
  }

  static void epilogue(const Step& st, const Sums& C, const Packed& pk, int64_t blk_i, Acc& acc) {
    const float* da = pk.da.data() + blk_i * TN;
    const int32_t* a32 = pk.a32.data() + blk_i * 4 * TN;
    float* out = &acc.v[0][0];
    for (int i = 0; i < TM; ++i)
      for (int m = 0; m < LANES; ++m) {
        const int at = i * LANES + m;
        const int32_t I = (&C[1][0][0])[at] * 256 + (&C[0][0][0])[at];
        int32_t Mn = 0;
        for (int p = 0; p < 4; ++p) Mn += dot_pairs((uint32_t)st.mn[i][p], (uint32_t)a32[p * TN + m]);
        out[at] = std::fmaf((float)I, st.dd[i] * da[m], out[at]);
        out[at] = std::fmaf((float)Mn, st.mm[i] * da[m], out[at]);
      }
  }
#else
  // Interleaved with the tile products of the step before (`tiles`, called after every fourth row): the matrix
  // unit works while the vector units unpack.
  template <class Tiles>
  static void unpack(const uint8_t* W, size_t rb, int64_t n, int64_t b, Step& st, Tiles&& tiles) {
    // byte shuffles giving, in each half of step t's 64 codes, its chunk's scale at the even (E) or odd (O)
    // bytes and zero at the others: vpmaddubsw's operand for one weight of each pair
    alignas(64) static const auto idx = [] {
      struct { int8_t e[4][64], o[4][64]; } x{};
      for (int t = 0; t < 4; ++t)
        for (int k = 0; k < 64; ++k) {
          x.e[t][k] = k % 2 ? (int8_t)0x80 : (int8_t)CHUNK[t][k / 32];
          x.o[t][k] = k % 2 ? (int8_t)CHUNK[t][k / 32] : (int8_t)0x80;
        }
      return x;
    }();
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __mmask64 odd = 0xAAAAAAAAAAAAAAAAull;
    for (int i = 0; i < TM; ++i) {
      if (i % (TM / PAIRS) == 0) tiles(i / (TM / PAIRS));
      const uint8_t* blk = W + (size_t)(n + i) * rb + (size_t)b * 144;
      // a group's 16 rows are 16 short streams the hardware prefetcher does not follow (Qwen's K = 1536: 6
      // blocks a row): the step AHEAD steps on, by hand
      for (int l = 0; l < 144; l += 64) _mm_prefetch(ahead(W, rb, n, b, i, 144) + l, _MM_HINT_T0);
      const __m128i sm = k4_scales(blk + 4);                          // s0..s7, m0..m7
      const __m512i sc = _mm512_broadcast_i32x4(sm);
      for (int h = 0; h < 2; ++h) {                                   // 64 code bytes: steps 2h, 2h + 1
        const __m512i x = _mm512_loadu_si512(blk + 16 + 64 * h);
        for (int nib = 0; nib < 2; ++nib) {
          const int t = 2 * h + nib;
          const __m512i v = _mm512_and_si512(nib ? _mm512_srli_epi16(x, 4) : x, m4);
          const __m512i we = _mm512_maddubs_epi16(v, _mm512_shuffle_epi8(sc, _mm512_load_si512(idx.e[t])));
          const __m512i wo = _mm512_maddubs_epi16(v, _mm512_shuffle_epi8(sc, _mm512_load_si512(idx.o[t])));
          _mm512_store_si512(st.A[t][0][i], _mm512_mask_blend_epi8(odd, we, _mm512_slli_epi16(wo, 8)));
          _mm512_store_si512(st.A[t][1][i], _mm512_mask_blend_epi8(odd, _mm512_srli_epi16(we, 8), wo));
        }
      }
      _mm_store_si128((__m128i*)st.mn[i], _mm256_extracti128_si256(_mm256_cvtepu8_epi16(sm), 1));
      st.dd[i] = half(blk);
      st.mm[i] = -half(blk + 2);
    }
  }

  // The block's integer 256 hi + lo and the mins' term, then the reference's two float steps; a vector holds
  // R weight rows x LANES activation rows (Rows), each lane's scales taken from its row by a permute.
  static void epilogue(const Step& st, const Sums& C, const Packed& pk, int64_t blk_i, Acc& acc) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i tok = _mm512_and_si512(lane, _mm512_set1_epi32(LANES - 1));
    const __m512i row = _mm512_srli_epi32(lane, Rows<R>::SHIFT);
    const __m512 da = _mm512_permutexvar_ps(tok, _mm512_loadu_ps(pk.da.data() + blk_i * TN));
    const int32_t* a32 = pk.a32.data() + blk_i * 4 * TN;
    __m512i a[4];
    for (int p = 0; p < 4; ++p) a[p] = _mm512_permutexvar_epi32(tok, _mm512_loadu_si512(a32 + p * TN));
    const __m512 dd = _mm512_load_ps(st.dd), mm = _mm512_load_ps(st.mm);
    float* out = &acc.v[0][0];
    for (int k = 0; k < TM / R; ++k) {
      const __m512i at = _mm512_add_epi32(row, _mm512_set1_epi32(R * k));     // each lane's weight row
      const __m512i I = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(&C[1][0][0] + 16 * k), 8),
                                         _mm512_load_si512(&C[0][0][0] + 16 * k));
      __m512i Mn = _mm512_setzero_si512();
      if constexpr (R == 1) {
        for (int p = 0; p < 4; ++p) Mn = _mm512_dpwssd_epi32(Mn, _mm512_set1_epi32(st.mn[k][p]), a[p]);
      } else {
        const int g = 4 * (R * k / 4);                                          // the four rows holding them
        const __m512i pos = _mm512_slli_epi32(_mm512_sub_epi32(at, _mm512_set1_epi32(g)), 2);
        const __m512i MN = _mm512_load_si512(st.mn[g]);
        for (int p = 0; p < 4; ++p)
          Mn = _mm512_dpwssd_epi32(Mn, _mm512_permutexvar_epi32(_mm512_add_epi32(pos, _mm512_set1_epi32(p)), MN), a[p]);
      }
      const __m512 d = R == 1 ? _mm512_set1_ps(st.dd[k]) : _mm512_permutexvar_ps(at, dd);
      const __m512 m = R == 1 ? _mm512_set1_ps(st.mm[k]) : _mm512_permutexvar_ps(at, mm);
      __m512 v = _mm512_load_ps(out + 16 * k);
      v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(d, da), v);
      v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Mn), _mm512_mul_ps(m, da), v);
      _mm512_store_ps(out + 16 * k, v);
    }
  }
#endif

  static void pair(const Step& st, const Packed& pk, int64_t b, Sums& C, int t) {
    block_step(&st.A[0][0][0][0], pk.B.data() + (size_t)b * 4 * 1024, C, t, PAIRS, LANES);
  }
};

// ---- Q6_K: a block's weights scaled by their sub-blocks' scales, whole-block sums ------------------------
// Each weight's integer w = s * (code - 32) (|w| <= 4096: an int16) is split into its two bytes, lo (0..255)
// and hi (-16..16), two A tiles a 64-weight step: lo by tdpbusd, hi by tdpbssd, each accumulated over the
// block's four steps in one C tile, so the block's integer is 256 hi + lo, exactly the reference's sum of
// s * sum (code - 32) a. Two tile stores a block instead of sixteen, and no per-sub-block products after them.
// (Before: a tile product per 16-weight sub-block and vpmulld by its scale: 131 ps a weight at every M.)

// Activations for tiles of 64-weight steps: B per step (16 rows x 64 bytes: row i holds activations 4i..4i+3
// of the step's 64, for each token), the tokens' scales per block.
struct Packed64 {
  std::vector<int8_t> B;      // [nb][4][16][64]
  std::vector<float> da;      // [nb][16]
};

void pack64(const ActRow* rows, int64_t M, int64_t K, Packed64& p) {
  const int64_t nb = K / 256;
  p.B.resize((size_t)(nb * 4 * 1024));
  pack_words(rows, M, K, 256, [](int64_t w) { return w; }, p.B.data());
  p.da.assign((size_t)(nb * TN), 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) p.da[(size_t)(b * TN + m)] = rows[m].d[b];
}

template <int R>
struct Q6K_AMX : Rows<R> {
  static constexpr int PAIRS = 4, KB = 64, STEP_K = 256;
  static constexpr int LANES = Rows<R>::LANES;
  using Packed = Packed64;

  static void pack(const ActRow* rows, int64_t M, int64_t K, int, Packed& p) { pack64(rows, M, K, p); }

  struct Step {
    alignas(64) int8_t A[4][2][TM][64];   // [step][lo, hi][row]
    alignas(64) float dd[TM];
  };

  using Sums = int32_t[2][TM][TN];        // lo, hi: [row * LANES + token] (flat)

#ifdef SX_EMULATE_AMX
  template <class Tiles>
  static void unpack(const uint8_t* W, size_t rb, int64_t n, int64_t b, Step& st, Tiles&& tiles) {
    emu_rows<PAIRS>(Q6_K, W, rb, n, b, tiles, [&](int i, const Unpacked& u) {
      for (int k = 0; k < 256; ++k) {
        const int w = u.s[k / 16] * u.v[k];
        st.A[k / 64][0][i][k % 64] = (int8_t)(uint8_t)(w & 0xFF);
        st.A[k / 64][1][i][k % 64] = (int8_t)(w >> 8);
      }
      st.dd[i] = u.d;
    });
  }
#else
  template <class Tiles>
  static void unpack(const uint8_t* W, size_t rb, int64_t n, int64_t b, Step& st, Tiles&& tiles) {
    // byte shuffles giving, in each 16-byte lane L of step t (sub-block 4t + L), its scale at the even (E) or
    // odd (O) bytes and zero at the others: vpmaddubsw's operand for one weight of each pair
    alignas(64) static const auto idx = [] {
      struct { int8_t e[4][64], o[4][64]; } x{};
      for (int t = 0; t < 4; ++t)
        for (int k = 0; k < 64; ++k) {
          x.e[t][k] = k % 2 ? (int8_t)0x80 : (int8_t)(4 * t + k / 16);
          x.o[t][k] = k % 2 ? (int8_t)(4 * t + k / 16) : (int8_t)0x80;
        }
      return x;
    }();
    const __m512i c32 = _mm512_set1_epi8(32);
    const __mmask64 odd = 0xAAAAAAAAAAAAAAAAull;
    for (int i = 0; i < TM; ++i) {
      if (i % (TM / PAIRS) == 0) tiles(i / (TM / PAIRS));
      const uint8_t* blk = W + (size_t)(n + i) * rb + (size_t)b * 210;
      for (int l = 0; l < 210; l += 64) _mm_prefetch(ahead(W, rb, n, b, i, 210) + l, _MM_HINT_T0);
      const Q6K q(blk);
      const __m512i sc = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(blk + 192)));
      __m256i first = _mm256_setzero_si256();
      q.chunks([&](int j, __m256i c) {   // codes 0..63; chunks 2t, 2t + 1 make step t
        if (j % 2 == 0) return void(first = c);
        const int t = j / 2;
        const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(first), c, 1);
        const __m512i se = _mm512_shuffle_epi8(sc, _mm512_load_si512(idx.e[t]));
        const __m512i so = _mm512_shuffle_epi8(sc, _mm512_load_si512(idx.o[t]));
        const __m512i z = _mm512_maddubs_epi16(c32, se);                          // 32 s
        const __m512i we = _mm512_sub_epi16(_mm512_maddubs_epi16(codes, se), z);  // s (code - 32), even weights
        const __m512i wo = _mm512_sub_epi16(_mm512_maddubs_epi16(codes, so), z);  // odd weights
        _mm512_store_si512(st.A[t][0][i], _mm512_mask_blend_epi8(odd, we, _mm512_slli_epi16(wo, 8)));
        _mm512_store_si512(st.A[t][1][i], _mm512_mask_blend_epi8(odd, _mm512_srli_epi16(we, 8), wo));
      });
      st.dd[i] = q.d;
    }
  }
#endif

  // The block's integer 256 hi + lo, then the reference's float step; R weight rows a vector (Rows).
  static void epilogue(const Step& st, const Sums& C, const Packed& pk, int64_t blk_i, Acc& acc) {
    float* out = &acc.v[0][0];
#ifdef SX_EMULATE_AMX
    const float* da = pk.da.data() + blk_i * TN;
    for (int i = 0; i < TM; ++i)
      for (int m = 0; m < LANES; ++m) {
        const int at = i * LANES + m;
        const int32_t I = (&C[1][0][0])[at] * 256 + (&C[0][0][0])[at];
        out[at] = std::fmaf((float)I, st.dd[i] * da[m], out[at]);
      }
#else
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i tok = _mm512_and_si512(lane, _mm512_set1_epi32(LANES - 1));
    const __m512i row = _mm512_srli_epi32(lane, Rows<R>::SHIFT);
    const __m512 da = _mm512_permutexvar_ps(tok, _mm512_loadu_ps(pk.da.data() + blk_i * TN));
    const __m512 dd = _mm512_load_ps(st.dd);
    for (int k = 0; k < TM / R; ++k) {
      const __m512i I = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(&C[1][0][0] + 16 * k), 8),
                                         _mm512_load_si512(&C[0][0][0] + 16 * k));
      const __m512 d = R == 1 ? _mm512_set1_ps(st.dd[k]) : _mm512_permutexvar_ps(_mm512_add_epi32(row, _mm512_set1_epi32(R * k)), dd);
      const __m512 v = _mm512_load_ps(out + 16 * k);
      _mm512_store_ps(out + 16 * k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(d, da), v));
    }
#endif
  }

  static void pair(const Step& st, const Packed& pk, int64_t b, Sums& C, int t) {
    block_step(&st.A[0][0][0][0], pk.B.data() + (size_t)b * 4 * 1024, C, t, PAIRS, LANES);
  }
};

// ---- The 32-weight types' activations for the tiles, once a call: B per block (8 rows x 64 bytes: row i
// holds activations 4i..4i+3 of the block's 32, for each token), each block's scale per token (da) and its
// activation sum (the min term of Q4_1).

struct Packed32 {
  std::vector<int8_t> B;      // [blocks][8][64]
  std::vector<float> da;      // [blocks][16]
  std::vector<int32_t> sum;   // [blocks][16]
};

void pack32(const ActRow* rows, int64_t M, int64_t K, Packed32& p) {
  const int64_t nb = K / 32;
  p.B.resize((size_t)(nb * 512));
  pack_words(rows, M, K, 32, [](int64_t w) { return w; }, p.B.data());
  p.da.assign((size_t)(nb * TN), 0.f);
  p.sum.assign((size_t)(nb * TN), 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      p.da[(size_t)(b * TN + m)] = rows[m].d[b];
      p.sum[(size_t)(b * TN + m)] = (int32_t)rows[m].s16[2 * b] + rows[m].s16[2 * b + 1];
    }
}

// ---- The 32-weight types' steps: two blocks a step, each block's 16 x M sums from one tile product; the
// epilogue packs R weight rows into a vector (R = 16 / LANES, for passes of at most LANES activation rows):
// the C tiles are stored with rows LANES int32 apart, so one vector load takes R rows' sums; R = 4 at
// M <= 4 does a quarter of R = 1's float steps (those steps, two a block and row, are what bound these tiles).

struct Scales32 {
  alignas(64) float dd[2][TM], mm[2][TM];   // [block][row]: d, and m (Q4_1)
};

using Sums32 = int32_t[2][TM][TN];           // [block][row * LANES + activation row] (flat)

#ifdef SX_EMULATE_AMX
template <int R, bool MIN>
void epilogue32(const Scales32& st, const Sums32& C, const Packed32& pk, int64_t s, Acc& acc) {
  constexpr int LANES = Rows<R>::LANES;
  float* a = &acc.v[0][0];
  for (int j = 0; j < 2; ++j) {
    const float* da = pk.da.data() + (2 * s + j) * TN;
    const int32_t* sum = pk.sum.data() + (2 * s + j) * TN;
    const int32_t* c = &C[j][0][0];
    for (int i = 0; i < TM; ++i)
      for (int m = 0; m < LANES; ++m) {
        float& v = a[i * LANES + m];
        v = std::fmaf((float)c[i * LANES + m], st.dd[j][i] * da[m], v);
        if (MIN) v = std::fmaf((float)sum[m], st.mm[j][i] * da[m], v);
      }
  }
}
#else
template <int R, bool MIN>
void epilogue32(const Scales32& st, const Sums32& C, const Packed32& pk, int64_t s, Acc& acc) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i tok = _mm512_and_si512(lane, _mm512_set1_epi32(Rows<R>::LANES - 1));   // the activation row
  const __m512i row = _mm512_srli_epi32(lane, Rows<R>::SHIFT);                         // the row in the vector
  __m512 da[2], sum[2], dd[2], mm[2];
  for (int j = 0; j < 2; ++j) {
    da[j] = _mm512_permutexvar_ps(tok, _mm512_loadu_ps(pk.da.data() + (2 * s + j) * TN));
    sum[j] = _mm512_permutexvar_ps(tok, _mm512_cvtepi32_ps(_mm512_loadu_si512(pk.sum.data() + (2 * s + j) * TN)));
    dd[j] = _mm512_load_ps(st.dd[j]);
    mm[j] = _mm512_load_ps(st.mm[j]);
  }
  float* a = &acc.v[0][0];
  for (int k = 0; k < TM / R; ++k) {      // weight rows R k .. R k + R - 1
    const __m512i at = _mm512_add_epi32(row, _mm512_set1_epi32(R * k));
    __m512 v = _mm512_load_ps(a + 16 * k);
    for (int j = 0; j < 2; ++j) {   // R = 1: the row's scales broadcast from memory (a load, not a permute)
      const __m512 d = R == 1 ? _mm512_set1_ps(st.dd[j][k]) : _mm512_permutexvar_ps(at, dd[j]);
      v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(&C[j][0][0] + 16 * k)), _mm512_mul_ps(d, da[j]), v);
      if (MIN) {
        const __m512 m = R == 1 ? _mm512_set1_ps(st.mm[j][k]) : _mm512_permutexvar_ps(at, mm[j]);
        v = _mm512_fmadd_ps(sum[j], _mm512_mul_ps(m, da[j]), v);
      }
    }
    _mm512_store_ps(a + 16 * k, v);
  }
}

// Each block's d (and m) of the 16 rows: one gather of their first four bytes, converted 16 at once.
template <int BYTES, bool MIN>
void gather_scales(const uint8_t* base, size_t rb, Scales32& st) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)rb));
  for (int j = 0; j < 2; ++j) {
    const __m512i dm = _mm512_i32gather_epi32(rows, base + j * BYTES, 1);
    _mm512_store_ps(st.dd[j], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
    if (MIN) _mm512_store_ps(st.mm[j], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
  }
}
#endif

// ---- Q8_0: the file's int8 values are A tiles as they lie (a tile load at the row stride): nothing unpacked

template <int R>
struct Q8_0_AMX : Rows<R> {
  static constexpr int PAIRS = 1, KB = 32, STEP_K = 64;  // a step: two 32-weight blocks
  using Packed = Packed32;
  using Sums = Sums32;

  static void pack(const ActRow* rows, int64_t M, int64_t K, int, Packed& p) { pack32(rows, M, K, p); }

  struct Step : Scales32 {
    const uint8_t* base;                  // row n's step: its first block
    size_t rb;
  };

  template <class Tiles>
  static void unpack(const uint8_t* W, size_t rb, int64_t n, int64_t s, Step& st, Tiles&& tiles) {
    tiles(0);
    st.base = W + (size_t)n * rb + (size_t)s * 68;
    st.rb = rb;
    for (int i = 0; i < TM; ++i) {
      const uint8_t* blk = st.base + (size_t)i * rb;
      _mm_prefetch(ahead(W, rb, n, s, i, 68), _MM_HINT_T0);   // as in Q4_K's
      _mm_prefetch(ahead(W, rb, n, s, i, 68) + 64, _MM_HINT_T0);
#ifdef SX_EMULATE_AMX
      st.dd[0][i] = half(blk);
      st.dd[1][i] = half(blk + 34);
#endif
    }
#ifndef SX_EMULATE_AMX
    gather_scales<34, false>(st.base, rb, st);
#endif
  }

  static void epilogue(const Step& st, const Sums& C, const Packed& pk, int64_t s, Acc& acc) {
    epilogue32<R, false>(st, C, pk, s, acc);
  }

  static void pair(const Step& st, const Packed& pk, int64_t s, Sums& C, int t) {
    const int8_t* B = pk.B.data() + (size_t)s * 2 * 512;
    tile_pair(st.base + 2, st.base + 36, st.rb, B, B + 512, t, PAIRS, C[0][0], C[1][0], 4 * Rows<R>::LANES);
  }
};

// ---- Q4_0 / Q4_1: each block's nibbles unpacked into an A tile of 32 codes a row (Q4_0's centered: code - 8),
// the block's integer from the tile, then the reference's steps (Q4_1: its min term on the block's activation
// sum).

template <int T, int R>
struct Q4x_AMX : Rows<R> {
  static constexpr int PAIRS = 1, KB = 32, STEP_K = 64;
  static constexpr int BYTES = T == Q4_0 ? 18 : 20, QS = T == Q4_0 ? 2 : 4;
  static constexpr bool MIN = T == Q4_1;
  using Packed = Packed32;
  using Sums = Sums32;

  static void pack(const ActRow* rows, int64_t M, int64_t K, int, Packed& p) { pack32(rows, M, K, p); }

  struct Step : Scales32 {
    alignas(64) int8_t A[2][TM][32];      // [block][row]: its 32 codes in weight order
  };

#ifdef SX_EMULATE_AMX
  template <class Tiles>
  static void unpack(const uint8_t* W, size_t rb, int64_t n, int64_t s, Step& st, Tiles&& tiles) {
    tiles(0);
    Unpacked u;
    for (int i = 0; i < TM; ++i)
      for (int j = 0; j < 2; ++j) {
        sx::unpack(T, W + (size_t)(n + i) * rb + (size_t)(2 * s + j) * BYTES, u);
        for (int k = 0; k < 32; ++k) st.A[j][i][k] = u.v[k];
        st.dd[j][i] = u.d;
        st.mm[j][i] = u.m;
      }
  }
#else
  template <class Tiles>
  static void unpack(const uint8_t* W, size_t rb, int64_t n, int64_t s, Step& st, Tiles&& tiles) {
    tiles(0);                             // the step before's tile products run while this one unpacks
    const __m128i m4 = _mm_set1_epi8(0xF), z = _mm_set1_epi8(T == Q4_0 ? 8 : 0);
    const uint8_t* base = W + (size_t)n * rb + (size_t)s * 2 * BYTES;
    for (int i = 0; i < TM; ++i) {
      const uint8_t* blk = base + (size_t)i * rb;
      for (int l = 0; l < 2 * BYTES; l += 64) _mm_prefetch(ahead(W, rb, n, s, i, 2 * BYTES) + l, _MM_HINT_T0);
      for (int j = 0; j < 2; ++j) {
        const __m128i x = _mm_loadu_si128((const __m128i*)(blk + j * BYTES + QS));
        _mm_store_si128((__m128i*)st.A[j][i], _mm_sub_epi8(_mm_and_si128(x, m4), z));
        _mm_store_si128((__m128i*)(st.A[j][i] + 16), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(x, 4), m4), z));
      }
    }
    gather_scales<BYTES, MIN>(base, rb, st);
  }
#endif

  static void epilogue(const Step& st, const Sums& C, const Packed& pk, int64_t s, Acc& acc) {
    epilogue32<R, MIN>(st, C, pk, s, acc);
  }

  static void pair(const Step& st, const Packed& pk, int64_t s, Sums& C, int t) {
    const int8_t* B = pk.B.data() + (size_t)s * 2 * 512;
    tile_pair(&st.A[0][0][0], &st.A[1][0][0], 32, B, B + 512, t, PAIRS, C[0][0], C[1][0], 4 * Rows<R>::LANES);
  }
};

template <int R>
using Q4_0_AMX = Q4x_AMX<Q4_0, R>;
template <int R>
using Q4_1_AMX = Q4x_AMX<Q4_1, R>;

template <class Kern>
void run(int type, const TypeInfo& ti, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
         int64_t ldy) {
  const int64_t nb = K / Kern::STEP_K;
  const size_t rb = (size_t)(K / ti.qk) * ti.bytes;
  std::vector<ActRow> rows((size_t)M);
  for (int64_t m = 0; m < M; ++m) rows[(size_t)m] = act_row(act, m, K, ti.qk);
  typename Kern::Packed p;
  Kern::pack(rows.data(), M, K, ti.qk, p);
  configure(M, Kern::KB);
  const int64_t groups = (n1 - n0) / TM;
  if (groups) run_groups<Kern>(W, rb, nb, p, M, n0, groups, Y, ldy);
  TILE_RELEASE();
  fallback(type, act, M, K, W, n0 + TM * groups, n1, Y, ldy);
}

// A call of a kernel whose epilogue packs rows (Rows): as many weight rows a vector as its activation rows allow.
template <template <int> class Kern>
void run_by_rows(int type, const TypeInfo& ti, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0,
                 int64_t n1, float* Y, int64_t ldy) {
  if (M <= 4) return run<Kern<4>>(type, ti, act, M, K, W, n0, n1, Y, ldy);
  if (M <= 8) return run<Kern<2>>(type, ti, act, M, K, W, n0, n1, Y, ldy);
  run<Kern<1>>(type, ti, act, M, K, W, n0, n1, Y, ldy);
}

}  // namespace

// The types with tile kernels (sx_amx_gemm's cases; the tier table times the tier on these only).
int sx_amx_owns(int type) { return type == Q4_K || type == Q6_K || type == Q8_0 || type == Q4_0 || type == Q4_1; }

void sx_amx_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
                 int64_t ldy) {
  const TypeInfo ti = type_info(type);
  if (M > TN) return fallback(type, act, M, K, W, n0, n1, Y, ldy);
  switch (type) {
    case Q4_K: return run_by_rows<Q4K_AMX>(type, ti, act, M, K, W, n0, n1, Y, ldy);
    case Q6_K: return run_by_rows<Q6K_AMX>(type, ti, act, M, K, W, n0, n1, Y, ldy);
    case Q8_0:  // the 32-weight types: steps of two blocks
      return K % 64 ? fallback(type, act, M, K, W, n0, n1, Y, ldy) : run_by_rows<Q8_0_AMX>(type, ti, act, M, K, W, n0, n1, Y, ldy);
    case Q4_0:
      return K % 64 ? fallback(type, act, M, K, W, n0, n1, Y, ldy) : run_by_rows<Q4_0_AMX>(type, ti, act, M, K, W, n0, n1, Y, ldy);
    case Q4_1:
      return K % 64 ? fallback(type, act, M, K, W, n0, n1, Y, ldy) : run_by_rows<Q4_1_AMX>(type, ti, act, M, K, W, n0, n1, Y, ldy);
    default: return fallback(type, act, M, K, W, n0, n1, Y, ldy);
  }
}
