// The NEON path (AArch64 with the dot-product extension, e.g. Jetson Orin's Cortex-A78AE; compiled with
// -march=armv8.2-a+dotprod). Equal to sx_ref.cc bit for bit: the integer dot products are exact (sdot on
// the codes and the int8 activations), the float steps the reference's, in its order.
// Not tuned yet: one column at a time, blocks unpacked by the shared scalar code. The block's integers in int32
// lanes (exact), then the reference's float steps.
#include <arm_neon.h>

#include <vector>

#include "sx_act.h"
#include "sx_attn.h"
#include "sx_blocks.h"
#include "sx_kernels.h"

using namespace sx;

void sx_neon_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
                  int64_t ldy) {
  const TypeInfo ti = type_info(type);
  const int64_t nb = K / ti.qk;
  const size_t rb = (size_t)nb * ti.bytes;
  std::vector<float> acc(M);
  std::vector<ActRow> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = act_row(act, m, K, ti.qk);
  Unpacked u;
  int8_t code[256];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) acc[m] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      unpack(type, W + n * rb + b * ti.bytes, u);
      const float mf = ti.kind == KMIN ? -u.m : u.m;
      const int z = k_zero(type);  // Q6_K's codes are v + 32 (<= 63: an int8 still); sdot on the codes
      for (int i = 0; i < ti.qk; ++i) code[i] = (int8_t)(u.v[i] + z);
      for (int64_t m = 0; m < M; ++m) {  // the block's integers (sx_blocks.h's block_ints) by sdot, 16 at a time
        const int8_t* q = rows[m].q + b * ti.qk;
        const int16_t* a16 = rows[m].s16 + b * (ti.qk / 16);
        int32x4_t I = vdupq_n_s32(0);
        int32_t Mn = 0, zero = 0;
        for (int g = 0; g < ti.qk / 16; ++g) {
          I = vmlaq_n_s32(I, vdotq_s32(vdupq_n_s32(0), vld1q_s8(code + 16 * g), vld1q_s8(q + 16 * g)), u.s[g]);
          Mn += (int32_t)u.mn[g] * a16[g];
          zero += (int32_t)u.s[g] * a16[g];
        }
        const int32_t isum = vaddvq_s32(I) - z * zero;  // the codes' zero point taken out
        const float da = rows[m].d[b];
        acc[m] = std::fmaf((float)isum, u.d * da, acc[m]);
        if (ti.kind != SYM) acc[m] = std::fmaf((float)Mn, mf * da, acc[m]);
      }
    }
    for (int64_t m = 0; m < M; ++m) Y[m * ldy + n] = acc[m];
  }
}

// Exact mode and attention: the reference's lanes as NEON registers.
void sx_ref_gemm_exact_with(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t,
                            double (*)(const float*, const float*, int));

static inline float dot_neon(const float* q, const float* k, int64_t D);
static double block_dot_neon(const float* w, const float* x, int qk) { return dot_neon(w, x, qk); }

void sx_neon_gemm_exact(int type, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                        float* Y, int64_t ldy) {
  sx_ref_gemm_exact_with(type, X, M, K, W, n0, n1, Y, ldy, block_dot_neon);
}

static inline float dot_neon(const float* q, const float* k, int64_t D) {
  float32x4_t lo = vdupq_n_f32(0), hi = vdupq_n_f32(0);  // lanes 0..3 and 4..7
  for (int64_t d = 0; d < D; d += 8) {
    lo = vfmaq_f32(lo, vld1q_f32(q + d), vld1q_f32(k + d));
    hi = vfmaq_f32(hi, vld1q_f32(q + d + 4), vld1q_f32(k + d + 4));
  }
  const float32x4_t h = vaddq_f32(lo, hi);  // (0+4, 1+5, 2+6, 3+7)
  return (vgetq_lane_f32(h, 0) + vgetq_lane_f32(h, 2)) + (vgetq_lane_f32(h, 1) + vgetq_lane_f32(h, 3));
}

static inline void accumulate_neon(const AttnRow& r, float den) {
  for (int64_t d = 0; d < r.D; d += 4) {
    float32x4_t acc = vdupq_n_f32(0);
    for (int64_t j = 0; j < r.total; ++j) {
      if (r.scores[j] == -INFINITY) continue;
      acc = vfmaq_n_f32(acc, vld1q_f32(r.V + j * r.D + d), r.scores[j]);
    }
    vst1q_f32(r.out + d, vdivq_f32(acc, vdupq_n_f32(den)));
  }
}

void sx_neon_attend(const AttnRow& row) { attend_row(row, dot_neon, accumulate_neon); }
