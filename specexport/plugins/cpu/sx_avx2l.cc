// The AVX2 lanes tier (path avx2lanes; any x86-64 with AVX2 + FMA + F16C): the 512-bit tier's shape on ymm
// registers, for the CPUs with neither VNNI nor AVX-512 (AMD Zen 2/3, Intel before Ice Lake). Eight
// neighbouring weight columns, one per 32-bit lane; each block of the eight loaded into the lanes once (a
// lane holds its column's code bytes, four a dword: two 16-byte loads and four in-lane interleaves per four
// dwords), then every row of the pass runs on it, the row's four activations broadcast from memory. Why it
// is faster than the per-row kernels (sx_x86.h) at many rows: a lane's products all belong to one column
// and sub-block, so `maddubs`'s int16 pairs are summed as int16 across a sub-block (Q4_K: eight dwords,
// |sum| <= 8 x 2 x 15 x 127 = 30480, exact) and scaled once by one `madd`: 9 multiplies per 256 multiply-adds
// where the per-row kernels need 16 (a `madd` per 32), and no horizontal sums per block and row. Q6_K's
// codes (v + 32 <= 63) pair two dwords a `madd` (|sum| <= 4 x 63 x 127), its zero point taken once a block
// from the activations' sums. The 32-weight 4- and 5-bit types a block at a time, their zero point from the
// block's activation sum. Then the reference's float steps in its order, so every output equals ref's.
// Q8_0 and Q5_K run avx2's kernels (the same bits: Q8_0's signed bytes fill maddubs' int16 at two products).
#include "sx_layout.h"
#include "sx_x86.h"

void sx_avx2_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);

namespace {

constexpr int LC = 8;  // weight columns a group: the lanes

typedef int32_t __attribute__((may_alias, aligned(1))) word;  // a dword at any address
struct Lanes8 {
  __m256i v;  // a vector's element type of its own: std::vector<__m256i> drops the alignment attribute
};
inline __m256i bcast(const int8_t* p) { return _mm256_set1_epi32(*(const word*)p); }

// Eight dwords of the eight columns (w) against a row's 32 activations (x, each dword broadcast): maddubs'
// int16 pairs summed in two chains (dwords 0, 2, 4, 6 and 1, 3, 5, 7), written in the order they issue (eight
// products computed first and summed after spilled w to the stack).
__attribute__((always_inline)) inline void dot8(const __m256i* w, const int8_t* x, __m256i& s0, __m256i& s1) {
  s0 = _mm256_maddubs_epi16(w[0], bcast(x)), s1 = _mm256_maddubs_epi16(w[1], bcast(x + 4));
#pragma GCC unroll 3
  for (int t = 2; t < 8; t += 2) {
    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[t], bcast(x + 4 * t)));
    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[t + 1], bcast(x + 4 * t + 4)));
  }
}

// 16 bytes at p[c] + off of the eight columns, transposed: out[d] lane c = dword d of column c (d < 4).
inline void load4(const uint8_t* const* p, int off, __m256i* out) {
  __m256i x[4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k)
    x[k] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(p[k] + off))),
                                   _mm_loadu_si128((const __m128i*)(p[k + 4] + off)), 1);
  const __m256i t0 = _mm256_unpacklo_epi32(x[0], x[1]), t1 = _mm256_unpackhi_epi32(x[0], x[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(x[2], x[3]), t3 = _mm256_unpackhi_epi32(x[2], x[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2), out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3), out[3] = _mm256_unpackhi_epi64(t1, t3);
}

// Bytes k and k2 of each lane as an int16 pair, zero-extended (or, sgn, sign-extended: each byte put in its
// int16's high half, then an arithmetic shift).
template <bool sgn = false>
inline __m256i byte_pair(__m256i x, int k, int k2) {
  const char z = (char)0x80;
  alignas(32) char idx[32];
  for (int i = 0; i < 8; ++i) {
    const char a = (char)(k + 4 * (i % 4)), b = (char)(k2 + 4 * (i % 4));
    idx[4 * i] = sgn ? z : a, idx[4 * i + 1] = sgn ? a : z, idx[4 * i + 2] = sgn ? z : b, idx[4 * i + 3] = sgn ? b : z;
  }
  const __m256i y = _mm256_shuffle_epi8(x, _mm256_load_si256((const __m256i*)idx));
  return sgn ? _mm256_srai_epi16(y, 8) : y;
}

// Lane c's fp16 at bytes 2k..2k+1 of x's lane c, as eight floats (exact).
inline __m256 halves(__m256i x, int k) {
  const char a = (char)(2 * k), b = (char)(2 * k + 1), z = (char)0x80;
  const __m256i lo = _mm256_shuffle_epi8(x, _mm256_setr_epi8(a, b, a + 4, b + 4, a + 8, b + 8, a + 12, b + 12, z, z, z, z,
                                                             z, z, z, z, a, b, a + 4, b + 4, a + 8, b + 8, a + 12, b + 12, z,
                                                             z, z, z, z, z, z, z));
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(lo, 0x08)));
}

// A block group's code dwords as the kernels read them: loaded into registers from the file's rows (v), or
// read where they lie in an r8 group-block (p): eight columns' dword i are 32 bytes there.
template <int NCODE, bool R8>
struct Codes {
  __m256i v[NCODE];
  __m256i operator[](int i) const { return v[i]; }
};
template <int NCODE>
struct Codes<NCODE, true> {
  const uint8_t* p;
  __m256i operator[](int i) const { return _mm256_loadu_si256((const __m256i*)(p + 32 * i)); }
};

// The pass's rows: their int8 activations where sx_quantize wrote them, and per block and row the type's
// integer table (TAB int32) and activation scale, made once a call (pointers into thread-local buffers,
// taken once: each use of a thread_local in a shared library is a call).
struct Rows {
  const int8_t* q;
  int64_t stride, M;
  const int32_t* tab;  // [block][M][TAB]
  const float* da;     // [block][M]
};

// Q4_K: 8 sub-blocks of 32 weights (chunk j / 2's low or high nibbles); a sub-block's eight dwords summed as
// int16 then one madd by its scale; the mins' term per row from the activations' sums per 32 (int16 pairs).
template <bool R8>
struct Q4KLanes {
  static constexpr int QK = 256, BYTES = 144, TAB = 4;
  static void table(const ActRow& a, int64_t b, int32_t* out) { k4_min_pairs(a, b, out); }
  Codes<32, R8> code;
  __m256i sc[8], mp[4];
  __m256 d, m;  // d, -dmin
  void unpack(const uint8_t* const* p) {
    __m256i h[4];
    load4(p, 0, h);  // d | dmin, then the 12 scale bytes
#ifdef SX_PLANT_AVX2_LANES  // a planted bug the tests must catch: the file's scale bytes read two bits off
    h[1] = _mm256_srli_epi32(h[1], 2);
#endif
    scales(halves(h[0], 0), halves(h[0], 1), h);
#pragma GCC unroll 8
    for (int e = 0; e < 8; ++e) load4(p, 16 + 16 * e, code.v + 4 * e);  // chunk c: dwords code[8c .. 8c + 7]
  }
  void unpack(const uint8_t* gb) {  // r8 (sx_layout.h): d, dmin at 0 and 16, the scales' dwords at 32, codes at 128
    __m256i h[4];
#pragma GCC unroll 3
    for (int j = 1; j < 4; ++j) h[j] = _mm256_loadu_si256((const __m256i*)(gb + 32 * j));
#ifdef SX_PLANT_R8  // a planted bug the tests must catch: r8's dmin read from d's place
    scales(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)gb)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)gb)), h);
#else
    scales(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)gb)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(gb + 16))), h);
#endif
    code.p = gb + 128;
  }
  void scales(__m256 dd, __m256 dmin, const __m256i* h) {
    d = dd;
    m = _mm256_xor_ps(dmin, _mm256_set1_ps(-0.f));
    const __m256i m6 = _mm256_set1_epi8(0x3F), m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    // sx_blocks.h's k_scale_min, four sub-blocks a dword: j < 4 from bytes j and j + 4; j >= 4 the low (high)
    // nibble of byte j + 4 with the top two bits of byte j - 4 (byte j) as bits 4-5
    const __m256i s03 = _mm256_and_si256(h[1], m6), m03 = _mm256_and_si256(h[2], m6);
    const __m256i s47 = _mm256_or_si256(_mm256_and_si256(h[3], m4), _mm256_and_si256(_mm256_srli_epi32(h[1], 2), m30));
    const __m256i m47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(h[3], 4), m4),
                                        _mm256_and_si256(_mm256_srli_epi32(h[2], 2), m30));
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) sc[k] = byte_pair(s03, k, k), sc[4 + k] = byte_pair(s47, k, k);
    mp[0] = byte_pair(m03, 0, 1), mp[1] = byte_pair(m03, 2, 3), mp[2] = byte_pair(m47, 0, 1), mp[3] = byte_pair(m47, 2, 3);
  }
  // Row r's block integer I (lane c: column c) into I[r], every row of the pass; then the float steps.
  template <int NR = 0>  // NR: the pass's rows when known at compile time (one row: registers), else R.M
  void rows(const Rows& R, int64_t b, __m256i* I, float* acc) const {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int64_t M = NR ? NR : R.M, stride = R.stride;  // locals: R is thread_local (an address call per use otherwise)
    for (int64_t r = 0; r < M; ++r) I[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m256i w[8];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t)
        w[t] = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(code[8 * (j / 2) + t], 4) : code[8 * (j / 2) + t], m4);
      const __m256i s = sc[j];
      const int8_t* x = R.q + 256 * b + 32 * j;
      for (int64_t r = 0; r < M; ++r, x += stride) {
        __m256i s0, s1;
        dot8(w, x, s0, s1);
        I[r] = _mm256_add_epi32(I[r], _mm256_madd_epi16(_mm256_add_epi16(s0, s1), s));
      }
    }
    const int32_t* tab = R.tab + (size_t)(b * M) * TAB;
    const float* da = R.da + (size_t)(b * M);
    for (int64_t r = 0; r < M; ++r, tab += TAB) {
      __m256i mn = _mm256_madd_epi16(mp[0], _mm256_set1_epi32(tab[0]));
#pragma GCC unroll 3
      for (int k = 1; k < 4; ++k) mn = _mm256_add_epi32(mn, _mm256_madd_epi16(mp[k], _mm256_set1_epi32(tab[k])));
      const __m256 a = _mm256_set1_ps(da[r]);
      const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r]), _mm256_mul_ps(d, a), _mm256_loadu_ps(acc + LC * r));
      _mm256_storeu_ps(acc + LC * r, _mm256_fmadd_ps(_mm256_cvtepi32_ps(mn), _mm256_mul_ps(m, a), f));
    }
  }
};

// Q6_K: 16 sub-blocks of 16 weights; codes v + 32 from four low bits (ql) and two high (qh), two dwords summed
// as int16 a madd; each row's block integer less 32 x sum_j s_j A_j (A_j: the row's sum over sub-block j).
template <bool R8>
struct Q6KLanes {
  static constexpr int QK = 256, BYTES = 210, TAB = 8;
  static void table(const ActRow& a, int64_t b, int32_t* out) {  // (A_2p, A_2p+1) as int16 pairs
    for (int p = 0; p < 8; ++p)
      out[p] = (int32_t)(uint16_t)a.s16[16 * b + 2 * p] | (int32_t)((uint32_t)(uint16_t)a.s16[16 * b + 2 * p + 1] << 16);
  }
  Codes<48, R8> code;
  __m256i sc[16], sp[8];
  __m256 d;
  void unpack(const uint8_t* const* p) {
    __m256i s[4];
    load4(p, 192, s);  // the 16 int8 scales
    scales(s);
    alignas(16) uint16_t h[8];
    for (int c = 0; c < LC; ++c) std::memcpy(&h[c], p[c] + 208, 2);
    d = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)h));
#pragma GCC unroll 12
    for (int e = 0; e < 12; ++e) load4(p, 16 * e, code.v + 4 * e);  // ql: code[0 .. 31], qh: code[32 .. 47]
  }
  void unpack(const uint8_t* gb) {  // r8: ql's and qh's dwords at 0 (code[0 .. 47]), the scales at 1536, d at 1664
    __m256i s[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) s[j] = _mm256_loadu_si256((const __m256i*)(gb + 1536 + 32 * j));
    scales(s);
    d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(gb + 1664)));
    code.p = gb;
  }
  void scales(const __m256i* s) {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) sc[j] = byte_pair<true>(s[j / 4], j % 4, j % 4);
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) sp[k] = byte_pair<true>(s[k / 2], 2 * (k % 2), 2 * (k % 2) + 1);
  }
  // quarter q of half h (sx_blocks.h's v[l], v[l + 32], v[l + 64], v[l + 96]), dword u (l = 4u .. 4u + 3):
  // ql's low (q 0, 1) or high (q 2, 3) nibbles of byte l (q even) or l + 32, qh's bits 2q, 2q + 1 as bits 4-5
  __m256i codes(int h, int q, int u) const {
    const __m256i L = code[16 * h + (q % 2 ? 8 : 0) + u], H = code[32 + 8 * h + u];
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i lo = q < 2 ? _mm256_and_si256(L, m4) : _mm256_and_si256(_mm256_srli_epi16(L, 4), m4);
    const __m256i hb = q == 0 ? _mm256_slli_epi16(H, 4) : q == 1 ? _mm256_slli_epi16(H, 2) : q == 2 ? H : _mm256_srli_epi16(H, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hb, m30));
  }
  template <int NR = 0>  // NR: the pass's rows when known at compile time (one row: registers), else R.M
  void rows(const Rows& R, int64_t b, __m256i* I, float* acc) const {
    const int64_t M = NR ? NR : R.M, stride = R.stride;
    const int32_t* tab = R.tab + (size_t)(b * M) * TAB;
    for (int64_t r = 0; r < M; ++r) {  // -32 x sum_j s_j A_j
      __m256i z = _mm256_madd_epi16(sp[0], _mm256_set1_epi32(tab[TAB * r]));
#pragma GCC unroll 7
      for (int k = 1; k < 8; ++k) z = _mm256_add_epi32(z, _mm256_madd_epi16(sp[k], _mm256_set1_epi32(tab[TAB * r + k])));
      I[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(z, 5));
    }
#pragma GCC unroll 8
    for (int hq = 0; hq < 8; ++hq) {  // 32 weights: sub-blocks j and j + 1 (unrolled: codes' shifts known when compiled)
      const int h = hq / 4, q = hq % 4, j = 8 * h + 2 * q;
      __m256i w[8];
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) w[u] = codes(h, q, u);
      const __m256i s0 = sc[j], s1 = sc[j + 1];
      const int8_t* x = R.q + 256 * b + 128 * h + 32 * q;
      for (int64_t r = 0; r < M; ++r, x += stride) {
        __m256i p[8];
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) p[t] = _mm256_maddubs_epi16(w[t], bcast(x + 4 * t));
        const __m256i a = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), s0),
                                           _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), s0));
        const __m256i c = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[4], p[5]), s1),
                                           _mm256_madd_epi16(_mm256_add_epi16(p[6], p[7]), s1));
        I[r] = _mm256_add_epi32(I[r], _mm256_add_epi32(a, c));
      }
    }
    const float* da = R.da + (size_t)(b * M);
    for (int64_t r = 0; r < M; ++r) {
      const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r]), _mm256_mul_ps(d, _mm256_set1_ps(da[r])),
                                       _mm256_loadu_ps(acc + LC * r));
      _mm256_storeu_ps(acc + LC * r, f);
    }
  }
};

// The 32-weight 4- and 5-bit types (Q4_0, Q4_1, Q5_0, Q5_1), a block of the eight columns at a time: codes as
// stored (unsigned: v + 8 or v + 16, or the affine types' own), a row's eight dwords summed as int16 (Q4:
// |sum| <= 8 x 2 x 15 x 127) or two sums of four (Q5: 4 x 2 x 31 x 127), one madd by ones; the zero point as
// -Z x the block's activation sum; then acc += I (d da) [acc += A (m da)], as the reference's.
template <int TYPE>
struct SmallLanes {
  static constexpr bool affine = TYPE == Q4_1 || TYPE == Q5_1, five = TYPE == Q5_0 || TYPE == Q5_1;
  static constexpr int QK = 32, TAB = 1, Z = affine ? 0 : (five ? 16 : 8);
  static constexpr int QH = affine ? 4 : 2, QS = QH + (five ? 4 : 0), BYTES = QS + 16;  // offsets in a block
  static void table(const ActRow& a, int64_t b, int32_t* out) { out[0] = a.s16[2 * b] + a.s16[2 * b + 1]; }
  __m256i code[8];
  __m256 d, m;
  static __m256i dwords(const uint8_t* const* p, int off) {  // lane c: the dword at p[c] + off
    return _mm256_setr_epi32(*(const word*)(p[0] + off), *(const word*)(p[1] + off), *(const word*)(p[2] + off),
                             *(const word*)(p[3] + off), *(const word*)(p[4] + off), *(const word*)(p[5] + off),
                             *(const word*)(p[6] + off), *(const word*)(p[7] + off));
  }
  void nibbles(const __m256i* x) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) code[t] = _mm256_and_si256(x[t], m4), code[4 + t] = _mm256_and_si256(_mm256_srli_epi16(x[t], 4), m4);
  }
  void unpack(const uint8_t* const* p) {
    const __m256i hd = dwords(p, 0);  // d [| m]
    d = halves(hd, 0);
    if constexpr (affine) m = halves(hd, 1);
    __m256i x[4];
    load4(p, QS, x);
    nibbles(x);
    if constexpr (five) {  // weight i's fifth bit: bit i of qh; dword t's four from bits 4t..4t+3, spread 8 apart by a multiply
      const __m256i qh = dwords(p, QH);
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m256i h = _mm256_and_si256(_mm256_srli_epi32(qh, 4 * t), _mm256_set1_epi32(0xF));
        const __m256i bits = _mm256_and_si256(_mm256_mullo_epi32(h, _mm256_set1_epi32(0x00204081)), _mm256_set1_epi32(0x01010101));
        code[t] = _mm256_or_si256(code[t], _mm256_slli_epi32(bits, 4));
      }
    }
  }
  void unpack(const uint8_t* gb) {  // r8: d [, m] as halves at 0 [, 16], qh's dwords at 8 QH, the codes' at 8 QS
    d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)gb));
    if constexpr (affine) m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(gb + 16)));
    __m256i x[4];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) x[t] = _mm256_loadu_si256((const __m256i*)(gb + 8 * QS + 32 * t));
    nibbles(x);
    if constexpr (five) {  // stored bit 8k + t: the fifth bit of byte k of code dword t (sx_layout.h)
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(gb + 8 * QH)), m10 = _mm256_set1_epi8(0x10);
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t)
        code[t] = _mm256_or_si256(code[t], _mm256_and_si256(t <= 4 ? _mm256_slli_epi32(qh, 4 - t) : _mm256_srli_epi32(qh, t - 4), m10));
    }
  }
  template <int NR = 0>
  void rows(const Rows& R, int64_t b, __m256i*, float* acc) const {
    const int64_t M = NR ? NR : R.M, stride = R.stride;
    const int32_t* tab = R.tab + (size_t)(b * M);
    const float* da = R.da + (size_t)(b * M);
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* x = R.q + 32 * b;
    for (int64_t r = 0; r < M; ++r, x += stride) {
      __m256i s0, s1;
      dot8(code, x, s0, s1);
      __m256i I = five ? _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones))
                       : _mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones);
      if constexpr (Z != 0) I = _mm256_add_epi32(I, _mm256_set1_epi32(-Z * tab[r]));
      const __m256 a = _mm256_set1_ps(da[r]);
      __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(d, a), _mm256_loadu_ps(acc + LC * r));
      if constexpr (affine) f = _mm256_fmadd_ps(_mm256_set1_ps((float)tab[r]), _mm256_mul_ps(m, a), f);
      _mm256_storeu_ps(acc + LC * r, f);
    }
  }
};

// Q8_0 (r8 only: the file's Q8_0 runs avx2's tiles): signed codes, so maddubs takes |v| and the activations
// given v's sign (exact: |v| <= 128), each dword's two int16 pairs widened by a madd (two products of 128 x 127
// fill an int16).
struct Q8Lanes {
  static constexpr int QK = 32, TAB = 1, BYTES = 34;
  static void table(const ActRow&, int64_t, int32_t* out) { out[0] = 0; }
  __m256i u[8], v[8];
  __m256 d;
  void unpack(const uint8_t* gb) {  // r8: d as halves at 0, the codes' dwords at 16
    d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)gb));
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) v[t] = _mm256_loadu_si256((const __m256i*)(gb + 16 + 32 * t)), u[t] = _mm256_sign_epi8(v[t], v[t]);
  }
  template <int NR = 0>
  void rows(const Rows& R, int64_t b, __m256i*, float* acc) const {
    const int64_t M = NR ? NR : R.M, stride = R.stride;
    const float* da = R.da + (size_t)(b * M);
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* x = R.q + 32 * b;
    for (int64_t r = 0; r < M; ++r, x += stride) {
      __m256i I0 = _mm256_madd_epi16(_mm256_maddubs_epi16(u[0], _mm256_sign_epi8(bcast(x), v[0])), ones);
      __m256i I1 = _mm256_madd_epi16(_mm256_maddubs_epi16(u[1], _mm256_sign_epi8(bcast(x + 4), v[1])), ones);
#pragma GCC unroll 3
      for (int t = 2; t < 8; t += 2) {
        I0 = _mm256_add_epi32(I0, _mm256_madd_epi16(_mm256_maddubs_epi16(u[t], _mm256_sign_epi8(bcast(x + 4 * t), v[t])), ones));
        I1 = _mm256_add_epi32(I1, _mm256_madd_epi16(_mm256_maddubs_epi16(u[t + 1], _mm256_sign_epi8(bcast(x + 4 * t + 4), v[t + 1])), ones));
      }
      const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(I0, I1)), _mm256_mul_ps(d, _mm256_set1_ps(da[r])),
                                       _mm256_loadu_ps(acc + LC * r));
      _mm256_storeu_ps(acc + LC * r, f);
    }
  }
};

// Columns [n0, n1) of every row of the pass, eight columns a group, each group's blocks in order, unpacked
// once for all the rows. R8: W in the r8 layout (sx_layout.h) and n0, n1 multiples of 8: a group's block is
// one run of bytes, read with plain loads; else the file's rows, transposed into the lanes per call.
template <class L, bool R8 = false, int NR = 0>
void lanes8_rows(const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
                 int64_t ldy) {
  const int64_t nb = K / L::QK;
  const size_t rb = (size_t)nb * L::BYTES;
  thread_local std::vector<int32_t> tab;
  thread_local std::vector<float> da, acc_buf;
  thread_local std::vector<Lanes8> I_buf;
  tab.assign((size_t)(nb * M * L::TAB), 0);
  da.assign((size_t)(nb * M), 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const ActRow a = act_row(act, m, K, L::QK);
    for (int64_t b = 0; b < nb; ++b) {
      L::table(a, b, &tab[(size_t)(b * M + m) * L::TAB]);
      da[(size_t)(b * M + m)] = a.d[b];
    }
  }
  I_buf.resize((size_t)M);
  acc_buf.resize((size_t)(M * LC));
  const Rows R{act_row(act, 0, K, L::QK).q, (int64_t)act_row_bytes(K, L::QK), M, tab.data(), da.data()};
  alignas(32) __m256i I_here[NR ? NR : 1];  // NR rows: the sums and outputs in locals (registers)
  alignas(32) float acc_here[NR ? NR * LC : 1];
  __m256i* I = NR ? I_here : &I_buf.data()->v;
  float* acc = NR ? acc_here : acc_buf.data();
  alignas(32) L g;
  for (int64_t n = n0; n < n1; n += LC) {
    const int valid = (int)std::min<int64_t>(LC, n1 - n);
    const uint8_t* col[LC];
    for (int c = 0; c < LC; ++c) col[c] = W + (size_t)(n + std::min(c, valid - 1)) * rb;  // a short group repeats its last
    std::fill(acc, acc + M * LC, 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      // the next group's bytes (its 8 rows of W, contiguous), an nb-th of them a block, into L2: one linear stream
      const char* next = (const char*)(W + (size_t)(n + LC) * rb + (size_t)b * LC * L::BYTES);
      for (int l = 0; l < LC * L::BYTES; l += 64) _mm_prefetch(next + l, _MM_HINT_T1);
      if constexpr (R8) {
        g.unpack(col[0] + (size_t)b * LC * L::BYTES);
      } else {
        const uint8_t* p[LC];
        for (int c = 0; c < LC; ++c) p[c] = col[c] + (size_t)b * L::BYTES;
        g.unpack(p);
      }
      g.template rows<NR>(R, b, I, acc);
    }
    for (int64_t r = 0; r < M; ++r)
      for (int c = 0; c < valid; ++c) Y[r * ldy + n + c] = acc[r * LC + c];
  }
}

// Up to four rows (a one-row pass: vanilla decoding and every draft step; a short chain's verify) with their
// sums in registers; more rows in a loop over the pass's rows.
template <class L, bool R8 = false>
void lanes8_gemm(const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
                 int64_t ldy) {
  switch (M) {
    case 1: return lanes8_rows<L, R8, 1>(act, M, K, W, n0, n1, Y, ldy);
    default: return lanes8_rows<L, R8>(act, M, K, W, n0, n1, Y, ldy);
  }
}

using GemmFn = void (*)(const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);

// This tier's kernel for `type` (null: none of its own; the one list both the gemm and the tier table read).
GemmFn lanes8_kernel(int type) {
  switch (type) {
    case Q4_K: return lanes8_gemm<Q4KLanes<false>>;
    case Q6_K: return lanes8_gemm<Q6KLanes<false>>;
    case Q4_0: return lanes8_gemm<SmallLanes<Q4_0>>;
    case Q4_1: return lanes8_gemm<SmallLanes<Q4_1>>;
    case Q5_0: return lanes8_gemm<SmallLanes<Q5_0>>;
    case Q5_1: return lanes8_gemm<SmallLanes<Q5_1>>;
    case Q4_K | R8: return lanes8_gemm<Q4KLanes<true>, true>;
    case Q6_K | R8: return lanes8_gemm<Q6KLanes<true>, true>;
    case Q4_0 | R8: return lanes8_gemm<SmallLanes<Q4_0>, true>;
    case Q4_1 | R8: return lanes8_gemm<SmallLanes<Q4_1>, true>;
    case Q5_0 | R8: return lanes8_gemm<SmallLanes<Q5_0>, true>;
    case Q5_1 | R8: return lanes8_gemm<SmallLanes<Q5_1>, true>;
    case Q8_0 | R8: return lanes8_gemm<Q8Lanes, true>;
    default: return nullptr;
  }
}

}  // namespace

int sx_avx2lanes_owns(int type) { return !is_r8(type) && lanes8_kernel(type) != nullptr; }

void sx_avx2lanes_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                       float* Y, int64_t ldy) {
  if (const GemmFn run = lanes8_kernel(type)) return run(act, M, K, W, n0, n1, Y, ldy);
  sx_avx2_gemm(type, act, M, K, W, n0, n1, Y, ldy);
}

// Every x86 path's kernel on r8 groups (n0, n1 multiples of 8; sx_layout.h): the lanes above, every M;
// Q5_K's groups back in the file's layout through avx2's kernels.
void sx_avx2_r8_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                     float* Y, int64_t ldy) {
  if (const GemmFn run = lanes8_kernel(type | R8)) return run(act, M, K, W, n0, n1, Y, ldy);
  r8_through_file(sx_avx2_gemm, type, act, M, K, W, n0, n1, Y, ldy);
}
