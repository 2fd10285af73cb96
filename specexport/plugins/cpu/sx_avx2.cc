// The AVX2 path (x86-64 with AVX2 + FMA + F16C; compiled with -mavx2 -mfma -mf16c): sx_x86.h's kernels with
// AVX2's integer dot steps, the activation quantizer, attention and the exact mode. Equal to sx_ref.cc bit for bit.
#include "sx_x86.h"

void sx_avx2_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
                  int64_t ldy) {
  gemm_type<Avx2Dot>(type, act, M, K, W, n0, n1, Y, ldy);
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
