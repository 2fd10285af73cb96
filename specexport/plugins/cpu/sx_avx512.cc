// The 512-bit tier (x86 with AVX-512 F/BW/VL/VNNI: Intel servers since Ice Lake, AMD Zen 4/5; compiled with
// those flags, run only where the CPU has them). The K types: a block's 256 codes in four zmm registers (two
// 32-weight chunks each, from sx_x86.h's loaders), each dotted against every row of the pass with one
// vpmaddubsw and one vpdpwssd (its sub-block scales) per 64 weights: half the instructions of the 256-bit
// paths per row. The block's sixteen int32 lanes are summed to its one integer, then the reference's float
// steps (sx_ref.cc), so every output's bits equal ref's. The 32-weight types run avx512vnni's kernels (the
// same bits).
#include "sx_x86.h"

void sx_avx2_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
__attribute__((weak)) void sx_avx512vnni_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t,
                                              float*, int64_t);

namespace {

using namespace sx;

// A K block against NR rows: I's lanes (16 a row, zmm) and, for the affine types, Mn's (8, ymm); Q6_K's zero
// point taken out per lane.
template <class L, int NR>
inline void block_rows512(const L& blk, const ActRow* rows, int64_t b, __m512i* part, __m256i* mins) {
  __m512i codes[4], scales[4];
  __m256i held_c = _mm256_setzero_si256(), held_s = _mm256_setzero_si256();
  blk.chunks([&](int j, __m256i w) {  // chunks 2k and 2k + 1 side by side: activations 64k .. 64k + 63
    if (j % 2 == 0) {
      held_c = w;
      held_s = blk.scale(j);
      return;
    }
    codes[j / 2] = _mm512_inserti64x4(_mm512_castsi256_si512(held_c), w, 1);
    scales[j / 2] = _mm512_inserti64x4(_mm512_castsi256_si512(held_s), blk.scale(j), 1);
  });
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    const int8_t* q = rows[r].q + b * 256;
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k)
      acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(codes[k], _mm512_loadu_si512(q + 64 * k)), scales[k]);
    const __m256i as = _mm256_loadu_si256((const __m256i*)(rows[r].s16 + b * 16));
    if constexpr (L::Z != 0)  // Z = 32: Q6_K's codes are v + 32
      acc = _mm512_sub_epi32(acc, _mm512_zextsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(blk.s16, as), 5)));
    if constexpr (L::kmin) mins[r] = _mm256_madd_epi16(blk.mn16, as);
    part[r] = acc;
  }
}

// One column's K blocks against NR <= 8 rows: each block's integers summed (lane r: row r), then
// acc += I * (d * da); acc += Mn * (-m * da), as kcolumn (sx_x86.h) and the reference.
template <class L, int NR>
inline void kcolumn512(const TypeInfo& ti, const uint8_t* col, int64_t nb, const ActRow* rows, const float* da8,
                       float* out) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t l = 0; l < ti.bytes; l += 64)  // eight blocks ahead
      _mm_prefetch((const char*)(col + (b + 8) * ti.bytes + l), _MM_HINT_T0);
    const L blk(col + b * ti.bytes);
    __m512i part[NR];
    __m256i halves[NR], mins[NR];
    block_rows512<L, NR>(blk, rows, b, part, mins);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r)
      halves[r] = _mm256_add_epi32(_mm512_castsi512_si256(part[r]), _mm512_extracti64x4_epi64(part[r], 1));
    const __m256 da = _mm256_loadu_ps(da8 + 8 * b);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums8<NR>(halves)), _mm256_mul_ps(_mm256_set1_ps(blk.d), da), acc);
    if constexpr (L::kmin)
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums8<NR>(mins)), _mm256_mul_ps(_mm256_set1_ps(-blk.m), da), acc);
  }
  _mm256_storeu_ps(out, acc);
}

template <class L>
KColumnFn kcolumn512_for(int64_t rows) {
  switch (rows) {
    case 1: return kcolumn512<L, 1>;
    case 2: return kcolumn512<L, 2>;
    case 3: return kcolumn512<L, 3>;
    case 4: return kcolumn512<L, 4>;
    case 5: return kcolumn512<L, 5>;
    case 6: return kcolumn512<L, 6>;
    case 7: return kcolumn512<L, 7>;
    default: return kcolumn512<L, 8>;
  }
}

}  // namespace

void sx_avx512_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                    float* Y, int64_t ldy) {
  const TypeInfo ti = type_info(type);
  switch (type) {
    case Q4_K: return gemm<Q4K, Avx2Dot>(ti, act, M, K, W, n0, n1, Y, ldy, kcolumn512_for<Q4K>);
    case Q5_K: return gemm<Q5K, Avx2Dot>(ti, act, M, K, W, n0, n1, Y, ldy, kcolumn512_for<Q5K>);
    case Q6_K: return gemm<Q6K, Avx2Dot>(ti, act, M, K, W, n0, n1, Y, ldy, kcolumn512_for<Q6K>);
    default:  // avx512vnni's unit may have been left out (an old assembler): AVX2's, the same bits
      return sx_avx512vnni_gemm ? sx_avx512vnni_gemm(type, act, M, K, W, n0, n1, Y, ldy)
                                : sx_avx2_gemm(type, act, M, K, W, n0, n1, Y, ldy);
  }
}
