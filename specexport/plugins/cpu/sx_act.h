// Activations quantized once per row per op (int8 mode): per block of the weight type (32 or 256),
// one float scale, int8 values and the sum of each 16 values (the affine types' min terms).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace sx {

// Functions here are static: each translation unit (compiled with its own -m flags) keeps its own copy.
struct ActRow {
  int8_t* q;     // [K]
  float* d;      // [K / qk]
  int16_t* s16;  // [K / 16] (exact: |sum| <= 2032)
};

static inline size_t act_row_bytes(int64_t K, int qk) { return (size_t)K + 4 * (size_t)(K / qk) + 2 * (size_t)(K / 16); }

static inline ActRow act_row(const void* base, int64_t m, int64_t K, int qk) {
  uint8_t* p = (uint8_t*)base + (size_t)m * act_row_bytes(K, qk);
  ActRow r;  // scales first: aligned for any K
  r.d = (float*)p;
  r.s16 = (int16_t*)(p + 4 * (K / qk));
  r.q = (int8_t*)(p + 4 * (K / qk) + 2 * (K / 16));
  return r;
}

// The sums of each 16 values, from a row's int8 values.
static inline void row_sums(int64_t K, int, ActRow r) {
  for (int64_t g = 0; g < K / 16; ++g) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += r.q[16 * g + i];
    r.s16[g] = (int16_t)s;
  }
}

// Block b's (256 weights) four int16 pairs of its eight 32-value sums, pair p = (A_2p, A_2p+1) in one int32:
// the Q4_K mins' operand, one madd per pair (the lanes tiers' tables).
static inline void k4_min_pairs(const ActRow& a, int64_t b, int32_t* out) {
  for (int p = 0; p < 4; ++p) {
    const int16_t* s = a.s16 + 16 * b + 4 * p;
    out[p] = (int32_t)(uint16_t)(int16_t)(s[0] + s[1]) | (int32_t)((uint32_t)(uint16_t)(int16_t)(s[2] + s[3]) << 16);
  }
}

// d = max|x| / 127, q = round-half-even(x / d) (in the current rounding mode, as nearbyint): the reference
// every path's quantizer equals. A block with a NaN or inf: d = NaN (its outputs NaN), q = 0.
static inline void quantize_row(const float* x, int64_t K, int qk, ActRow r) {
  for (int64_t b = 0; b < K / qk; ++b) {
    const float* xb = x + b * qk;
    float amax = 0.f;
    bool finite = true;
    for (int i = 0; i < qk; ++i) {
      finite = finite && std::isfinite(xb[i]);
      amax = std::fmax(amax, std::fabs(xb[i]));
    }
    const float id = finite && amax > 0.f ? 127.f / amax : 0.f;
    r.d[b] = finite ? amax / 127.f : NAN;
    for (int i = 0; i < qk; ++i) {
      float v = finite ? std::nearbyint(xb[i] * id) : 0.f;
      v = std::isnan(v) ? 0.f : v;  // 0 * inf: a block of subnormals has id = inf
      v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
      r.q[b * qk + i] = (int8_t)v;
    }
  }
  row_sums(K, qk, r);
}

}  // namespace sx
