// GGUF (ggml) weight blocks, read verbatim from the file's bytes, in one canonical form every kernel shares.
// The layouts are ggml's (ggml/src/ggml-common.h); this code is ours.
#pragma once
#include <cstdint>
#include <cstring>

namespace sx {

// Functions here are static: each translation unit (compiled with its own -m flags) keeps its own copy.

// ggml's type ids: the graph's `type` attribute.
enum Type : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// How the float part of a weight is made: w = (d * s) * v  [- m * mn  (KMIN)]  [+ m  (PLUS)].
enum Kind : int { SYM = 0, KMIN = 1, PLUS = 2 };

struct TypeInfo {
  int qk;      // weights per block (super-block for the K types): the activation scale's span too
  int bytes;   // bytes per block in the file
  Kind kind;
};

// qk == 0: not a type of ours.
static inline TypeInfo type_info(int t) {
  switch (t) {
    case Q4_0: return {32, 18, SYM};
    case Q4_1: return {32, 20, PLUS};
    case Q5_0: return {32, 22, SYM};
    case Q5_1: return {32, 24, PLUS};
    case Q8_0: return {32, 34, SYM};
    case Q4_K: return {256, 144, KMIN};
    case Q5_K: return {256, 176, KMIN};
    case Q6_K: return {256, 210, SYM};
    default: return {0, 0, SYM};
  }
}

// IEEE half -> float, exact (portable: no F16C needed, the same bits on every path).
static inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do { man <<= 1; ++e; } while (!(man & 0x400));
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One block unpacked: v = code - zero point (int8), s and mn per 16 weights (integer sub-block scale and
// min), d and m the block's floats. Every kernel computes from this, so every path reads the file alike.
struct Unpacked {
  int8_t v[256];
  int16_t s[16];
  int16_t mn[16];
  float d, m;
};

static inline void k_scale_min(int j, const uint8_t* q, int16_t* sc, int16_t* mn) {  // 6-bit pairs packed in 12 bytes
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

static inline void unpack(int t, const uint8_t* b, Unpacked& u) {
  switch (t) {
    case Q4_0:
    case Q4_1: {
      const uint8_t* qs = b + (t == Q4_0 ? 2 : 4);
      const int z = t == Q4_0 ? 8 : 0;
      for (int i = 0; i < 16; ++i) {
        u.v[i] = (int8_t)((qs[i] & 0xF) - z);
        u.v[i + 16] = (int8_t)((qs[i] >> 4) - z);
      }
      u.d = f16(b);
      u.m = t == Q4_1 ? f16(b + 2) : 0.f;
      u.s[0] = u.s[1] = 1;
      u.mn[0] = u.mn[1] = t == Q4_1 ? 1 : 0;
      return;
    }
    case Q5_0:
    case Q5_1: {
      const int off = t == Q5_0 ? 2 : 4;
      uint32_t qh;
      std::memcpy(&qh, b + off, 4);
      const uint8_t* qs = b + off + 4;
      const int z = t == Q5_0 ? 16 : 0;
      for (int i = 0; i < 16; ++i) {
        u.v[i] = (int8_t)(((qs[i] & 0xF) | (((qh >> i) & 1) << 4)) - z);
        u.v[i + 16] = (int8_t)(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - z);
      }
      u.d = f16(b);
      u.m = t == Q5_1 ? f16(b + 2) : 0.f;
      u.s[0] = u.s[1] = 1;
      u.mn[0] = u.mn[1] = t == Q5_1 ? 1 : 0;
      return;
    }
    case Q8_0: {
      std::memcpy(u.v, b + 2, 32);
      u.d = f16(b);
      u.m = 0.f;
      u.s[0] = u.s[1] = 1;
      u.mn[0] = u.mn[1] = 0;
      return;
    }
    case Q4_K:
    case Q5_K: {
      const uint8_t* sc = b + 4;
      const uint8_t* qh = b + 16;                       // Q5_K only
      const uint8_t* qs = b + (t == Q4_K ? 16 : 48);
      for (int c = 0; c < 4; ++c) {                     // 64 weights: 32 low nibbles, then 32 high
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * c + l] & 0xF, hi = qs[32 * c + l] >> 4;
          if (t == Q5_K) {
            lo |= ((qh[l] >> (2 * c)) & 1) << 4;
            hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
          }
          u.v[64 * c + l] = (int8_t)lo;
          u.v[64 * c + 32 + l] = (int8_t)hi;
        }
      }
      for (int j = 0; j < 8; ++j) {
        int16_t s, mn;
#ifdef SX_PLANT_SCALE_OFF_BY_ONE  // a planted bug the tests must catch (tests/test_cpu_kernels.py)
        k_scale_min((j + 1) % 8, sc, &s, &mn);
#else
        k_scale_min(j, sc, &s, &mn);
#endif
        u.s[2 * j] = u.s[2 * j + 1] = s;
        u.mn[2 * j] = u.mn[2 * j + 1] = mn;
      }
      u.d = f16(b);
      u.m = f16(b + 2);
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = (const int8_t*)(b + 192);
      for (int h = 0; h < 2; ++h) {                     // two halves of 128 weights
        const uint8_t* L = ql + 64 * h;
        const uint8_t* H = qh + 32 * h;
        int8_t* v = u.v + 128 * h;
        for (int l = 0; l < 32; ++l) {
          v[l] = (int8_t)(((L[l] & 0xF) | ((H[l] & 3) << 4)) - 32);
          v[l + 32] = (int8_t)(((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32);
          v[l + 64] = (int8_t)(((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32);
          v[l + 96] = (int8_t)(((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32);
        }
      }
      for (int g = 0; g < 16; ++g) {
        u.s[g] = sc[g];
        u.mn[g] = 0;
      }
      u.d = f16(b + 208);
      u.m = 0.f;
      return;
    }
    default:
      u.d = u.m = 0.f;
  }
}

// The K types' zero point in the stored codes (code = v + Z): Q6_K's 6-bit codes are v + 32.
static inline int k_zero(int t) { return t == Q6_K ? 32 : 0; }

// int8 mode: a block's two exact integers against one row of quantized activations q (its block) with
// a16 the row's sums of each 16 q (sx_act.h):
//   I  = sum_k s[k/16] * v[k] * q[k]            (every type: s = 1 for the 32-weight types)
//   Mn = sum_g mn[g] * a16[g]                    (the affine types' min term: Q4_K/Q5_K's mins, Q4_1/Q5_1's 1s)
// |I| < 2^28 and |Mn| < 2^22: exact in int32 whatever the order of the additions, so every kernel may sum them
// in any order (lanes, tiles, matrix units) and still give these integers.
static inline void block_ints(const TypeInfo& ti, const Unpacked& u, const int8_t* q, const int16_t* a16, int32_t* I,
                              int32_t* Mn) {
  int32_t acc = 0, mins = 0;
  for (int k = 0; k < ti.qk; ++k) acc += (int32_t)u.s[k / 16] * u.v[k] * q[k];
  if (ti.kind != SYM)
    for (int g = 0; g < ti.qk / 16; ++g) mins += (int32_t)u.mn[g] * a16[g];
  *I = acc;
  *Mn = mins;
}

// The block's float weights, computed as the gguf package's dequantization computes them (float32).
static inline void dequant(int t, const Unpacked& u, float* w) {
  const TypeInfo ti = type_info(t);
  for (int i = 0; i < ti.qk; ++i) {
    const int g = i / 16;
    float x = (u.d * (float)u.s[g]) * (float)u.v[i];
    if (ti.kind == KMIN) x = x - u.m * (float)u.mn[g];
    if (ti.kind == PLUS) x = x + u.m;
    w[i] = x;
  }
}

}  // namespace sx
