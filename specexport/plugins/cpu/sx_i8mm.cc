// The i8mm tier (AArch64 with the int8 matrix multiply: Graviton 3/4, AmpereOne, Apple M2 and later under Linux;
// compiled with -march=armv8.2-a+dotprod+i8mm, run only where the CPU has it). `smmla` multiplies a 2 x 8 int8
// block by an 8 x 2 one into 2 x 2 int32: two weight rows against two activation rows at once, 8 weights a
// step, so each unpacked block serves two rows and each loaded activation two columns. Each 16-weight group's
// sums are scaled by its integer scale (1 for the 32-weight types) into the block's integer, then the
// reference's float steps (sx_ref.cc), so every output's bits equal ref's. Checked under qemu-aarch64
// (`-cpu max` has i8mm) in the tests; the blocks are unpacked by the shared scalar code (not tuned yet).
#include <arm_neon.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "sx_act.h"
#include "sx_blocks.h"
#include "sx_kernels.h"

using namespace sx;

namespace {

// Two rows' int8 values interleaved 8 by 8, as smmla reads a 2 x 8 operand: [a0..a7, b0..b7, a8..a15, ...].
void interleave(const int8_t* a, const int8_t* b, int n, int8_t* out) {
  for (int k = 0; k < n; k += 8) {
    std::memcpy(out + 2 * k, a + k, 8);
    std::memcpy(out + 2 * k + 8, b + k, 8);
  }
}

}  // namespace

void sx_i8mm_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
                  int64_t ldy) {
  const TypeInfo ti = type_info(type);
  const int64_t nb = K / ti.qk, qk = ti.qk;
  const size_t rb = (size_t)nb * ti.bytes;
  std::vector<ActRow> rows((size_t)M);
  for (int64_t m = 0; m < M; ++m) rows[(size_t)m] = act_row(act, m, K, ti.qk);
  // the activations in row pairs, interleaved once a call (an odd last row paired with zeros)
  const int64_t pairs = (M + 1) / 2;
  std::vector<int8_t> qa((size_t)(pairs * 2 * K)), zero((size_t)K, 0);
  for (int64_t p = 0; p < pairs; ++p)
    interleave(rows[(size_t)(2 * p)].q, 2 * p + 1 < M ? rows[(size_t)(2 * p + 1)].q : zero.data(), (int)K,
               qa.data() + p * 2 * K);
  std::vector<float> acc((size_t)(2 * M));
  Unpacked u[2];
  alignas(16) int8_t wv[512];
  for (int64_t n = n0; n < n1; n += 2) {
    const bool two = n + 1 < n1;  // an odd last column paired with itself, its second row dropped
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      for (int c = 0; c < 2; ++c) unpack(type, W + (size_t)(two ? n + c : n) * rb + (size_t)b * ti.bytes, u[c]);
      interleave(u[0].v, u[1].v, (int)qk, wv);
      const float mf[2] = {ti.kind == KMIN ? -u[0].m : u[0].m, ti.kind == KMIN ? -u[1].m : u[1].m};
      for (int64_t p = 0; p < pairs; ++p) {
        const int8_t* q = qa.data() + p * 2 * K + 2 * b * qk;
        int32x4_t I = vdupq_n_s32(0);  // [w0 x r0, w0 x r1, w1 x r0, w1 x r1]
        for (int g = 0; g < qk / 16; ++g) {
          int32x4_t part = vdupq_n_s32(0);
          part = vmmlaq_s32(part, vld1q_s8(wv + 32 * g), vld1q_s8(q + 32 * g));
          part = vmmlaq_s32(part, vld1q_s8(wv + 32 * g + 16), vld1q_s8(q + 32 * g + 16));
          const int32_t sc[4] = {u[0].s[g], u[0].s[g], u[1].s[g], u[1].s[g]};
          I = vmlaq_s32(I, part, vld1q_s32(sc));
        }
        int32_t Iv[4];
        vst1q_s32(Iv, I);
        for (int r = 0; r < 2 && 2 * p + r < M; ++r) {
          const int64_t m = 2 * p + r;
          const float da = rows[(size_t)m].d[b];
          const int16_t* a16 = rows[(size_t)m].s16 + b * (qk / 16);
          for (int c = 0; c < 2; ++c) {
            int32_t Mn = 0;
            for (int g = 0; g < qk / 16; ++g) Mn += (int32_t)u[c].mn[g] * a16[g];
            float& a = acc[(size_t)(2 * m + c)];
            a = std::fmaf((float)Iv[2 * c + r], u[c].d * da, a);
            if (ti.kind != SYM) a = std::fmaf((float)Mn, mf[c] * da, a);
          }
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      Y[m * ldy + n] = acc[(size_t)(2 * m)];
      if (two) Y[m * ldy + n + 1] = acc[(size_t)(2 * m + 1)];
    }
  }
}
