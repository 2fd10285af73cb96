// The reference path (portable C++): defines every result the SIMD paths must equal bit for bit.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "sx_act.h"
#include "sx_attn.h"
#include "sx_blocks.h"
#include "sx_kernels.h"
#include "sx_layout.h"

using namespace sx;

extern "C" size_t sx_row_bytes(int type, int64_t K) {
  const TypeInfo ti = type_info(base_type(type));
  if (!ti.qk || K <= 0 || K % ti.qk) return 0;
  return (size_t)(K / ti.qk) * ti.bytes;
}

extern "C" size_t sx_act_bytes(int type, int64_t M, int64_t K) {
  const TypeInfo ti = type_info(base_type(type));
  if (!ti.qk) return 0;
  return (size_t)M * act_row_bytes(K, ti.qk);
}

void sx_ref_quantize_row(const float* x, int64_t K, int qk, ActRow r) { quantize_row(x, K, qk, r); }

// Column n, every row, block by block: the block's two integers (sx_blocks.h's block_ints), then one fused
// multiply-add each into the output's float (acc += I * (d * da); acc += Mn * (m' * da), m' = -m for the K
// types' mins, m for Q4_1/Q5_1's), blocks in order. Each output's float steps are a chain of its own, so a
// kernel may run any columns and rows side by side, and sum each block's integers any way it likes.
void sx_ref_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
                 int64_t ldy) {
  const TypeInfo ti = type_info(type);
  const int64_t nb = K / ti.qk;
  const size_t rb = sx_row_bytes(type, K);
  std::vector<float> acc(M);
  Unpacked u;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) acc[m] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      unpack(type, W + n * rb + b * ti.bytes, u);
      const float mf = ti.kind == KMIN ? -u.m : u.m;
      for (int64_t m = 0; m < M; ++m) {
        const ActRow a = act_row(act, m, K, ti.qk);
        int32_t I, Mn;
        block_ints(ti, u, a.q + b * ti.qk, a.s16 + b * (ti.qk / 16), &I, &Mn);
        const float da = a.d[b];
        acc[m] = std::fmaf((float)I, u.d * da, acc[m]);
        if (ti.kind != SYM) acc[m] = std::fmaf((float)Mn, mf * da, acc[m]);
      }
    }
    for (int64_t m = 0; m < M; ++m) Y[m * ldy + n] = acc[m];
  }
}

// Exact mode: per block, the weights dequantized as gguf does (float32), products with x summed in eight
// float lanes (i mod 8, fused multiply-adds), the lanes reduced ((0+4)+(2+6)) + ((1+5)+(3+7)) (sx_attn.h's
// tree); the blocks' sums added in order in double.
template <class BlockDot>
static void gemm_exact(int type, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                       float* Y, int64_t ldy, BlockDot block_dot) {
  const TypeInfo ti = type_info(type);
  const int64_t nb = K / ti.qk;
  const size_t rb = sx_row_bytes(type, K);
  std::vector<double> acc(M);
  Unpacked u;
  alignas(32) float w[256];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) acc[m] = 0.0;
    for (int64_t b = 0; b < nb; ++b) {
      unpack(type, W + n * rb + b * ti.bytes, u);
      dequant(type, u, w);
      for (int64_t m = 0; m < M; ++m) acc[m] += block_dot(w, X + m * K + b * ti.qk, ti.qk);
    }
    for (int64_t m = 0; m < M; ++m) Y[m * ldy + n] = (float)acc[m];
  }
}

static double block_dot_ref(const float* w, const float* x, int qk) { return dot_ref(w, x, qk); }

void sx_ref_gemm_exact_with(int type, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                            float* Y, int64_t ldy, double (*block_dot)(const float*, const float*, int)) {
  gemm_exact(type, X, M, K, W, n0, n1, Y, ldy, block_dot);  // the SIMD paths pass their block dot (same result)
}

void sx_ref_gemm_exact(int type, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                       float* Y, int64_t ldy) {
  gemm_exact(type, X, M, K, W, n0, n1, Y, ldy, block_dot_ref);
}

extern "C" int sx_repack(int type, int to_r8, const uint8_t* W, int64_t N, int64_t K, uint8_t* out) {
  const int t = base_type(type);
  const size_t rb = sx_row_bytes(t, K);
  if (!rb || N < 0) return 1;
  const int64_t grouped = N / GROUP * GROUP, nb = K / type_info(t).qk;
  r8_convert(t, to_r8 != 0, W, nb, 0, grouped, out);
  std::memcpy(out + grouped * rb, W + grouped * rb, (size_t)(N - grouped) * rb);  // the rows past the last group
  return 0;
}

extern "C" int64_t sx_gather(int type, const uint8_t* W, int64_t N, int64_t K, const int64_t* ids, int64_t count,
                             float* out) {
  const int t = base_type(type);
  const TypeInfo ti = type_info(t);
  const size_t rb = sx_row_bytes(t, K);
  Unpacked u;
  uint8_t blk[256];
  for (int64_t r = 0; r < count; ++r) {
    const int64_t id = ids[r];
    if (id < 0 || id >= N) return r;
    for (int64_t b = 0; b < K / ti.qk; ++b) {
      unpack(t, block_at(type, W, N, rb, id, b, blk), u);
      dequant(t, u, out + r * K + b * ti.qk);
    }
  }
  return -1;
}

void sx_ref_attend(const AttnRow& row) { attend_row(row, dot_ref, accumulate_ref); }
