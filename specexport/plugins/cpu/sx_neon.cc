// The NEON path (AArch64 with the dot-product extension, e.g. Jetson Orin's Cortex-A78AE; compiled with
// -march=armv8.2-a+dotprod). Equal to sx_ref.cc bit for bit: the integer dot products are exact (sdot on
// the codes and the int8 activations), the float steps the reference's, in its order.
// Not tuned yet: one column at a time, blocks unpacked by the shared scalar code.
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
  std::vector<float> acc(8 * M);
  std::vector<ActRow> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = act_row(act, m, K, ti.qk);
  Unpacked u;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t i = 0; i < 8 * M; ++i) acc[i] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      unpack(type, W + n * rb + b * ti.bytes, u);
      const float mf = ti.kind == KMIN ? -u.m : u.m;
      if (ti.qk == 256) {  // the K types: the reference's eight integer lanes (k_lanes) as two sdot registers
        const int z = k_zero(type);
        int8_t code[256];
        for (int i = 0; i < 256; ++i) code[i] = (int8_t)(u.v[i] + z);  // <= 63: an int8 still
        for (int64_t m = 0; m < M; ++m) {
          const int8_t* q = rows[m].q + b * 256;
          const int16_t* s16 = rows[m].s16 + b * 16;
          int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);  // lanes 0..3: bytes 0..15 of each chunk; 4..7: 16..31
          for (int j = 0; j < 8; ++j) {
            lo = vmlaq_n_s32(lo, vdotq_s32(vdupq_n_s32(0), vld1q_s8(code + 32 * j), vld1q_s8(q + 32 * j)), u.s[2 * j]);
            hi = vmlaq_n_s32(hi, vdotq_s32(vdupq_n_s32(0), vld1q_s8(code + 32 * j + 16), vld1q_s8(q + 32 * j + 16)),
                             u.s[2 * j + 1]);
          }
          int32_t zc[8], mn[8];
          k_lane_terms(type, u, s16, zc, mn);
          lo = vsubq_s32(lo, vld1q_s32(zc));
          hi = vsubq_s32(hi, vld1q_s32(zc + 4));
          const float da = rows[m].d[b];
          const float32x4_t dd = vdupq_n_f32(u.d * da), mm = vdupq_n_f32(mf * da);
          float32x4_t a0 = vld1q_f32(&acc[8 * m]), a1 = vld1q_f32(&acc[8 * m + 4]);
          a0 = vfmaq_f32(a0, vcvtq_f32_s32(lo), dd);
          a1 = vfmaq_f32(a1, vcvtq_f32_s32(hi), dd);
          if (ti.kind != SYM) {
            a0 = vfmaq_f32(a0, vcvtq_f32_s32(vld1q_s32(mn)), mm);
            a1 = vfmaq_f32(a1, vcvtq_f32_s32(vld1q_s32(mn + 4)), mm);
          }
          vst1q_f32(&acc[8 * m], a0);
          vst1q_f32(&acc[8 * m + 4], a1);
        }
        continue;
      }
      for (int64_t m = 0; m < M; ++m) {  // the 32-weight types: lanes 0..3 bytes 0..15, lanes 4..7 bytes 16..31
        const int8_t* q = rows[m].q + b * 32;
        const int32x4_t lo = vdotq_s32(vdupq_n_s32(0), vld1q_s8(u.v), vld1q_s8(q));
        const int32x4_t hi = vdotq_s32(vdupq_n_s32(0), vld1q_s8(u.v + 16), vld1q_s8(q + 16));
        const float da = rows[m].d[b];
        const float32x4_t dd = vdupq_n_f32(u.d * da), mm = vdupq_n_f32(mf * da);
        float32x4_t a0 = vld1q_f32(&acc[8 * m]), a1 = vld1q_f32(&acc[8 * m + 4]);
        a0 = vfmaq_f32(a0, vcvtq_f32_s32(lo), dd);
        a1 = vfmaq_f32(a1, vcvtq_f32_s32(hi), dd);
        if (ti.kind != SYM) {
          a0 = vfmaq_f32(a0, vld1q_f32(rows[m].s4 + 8 * b), mm);
          a1 = vfmaq_f32(a1, vld1q_f32(rows[m].s4 + 8 * b + 4), mm);
        }
        vst1q_f32(&acc[8 * m], a0);
        vst1q_f32(&acc[8 * m + 4], a1);
      }
    }
    for (int64_t m = 0; m < M; ++m) Y[m * ldy + n] = tree8(&acc[8 * m]);
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
