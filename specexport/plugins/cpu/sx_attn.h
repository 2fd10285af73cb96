// Attention over an in-place KV cache, one output row at a time in a fixed order, so a row's bits do not
// depend on the other rows of its pass (ONNX Runtime's GroupQueryAttention computes a one-row pass
// differently from a many-row one). Shared by the reference and the SIMD paths: they differ only in how
// they compute the same sequence of float operations.
#pragma once
#include <cmath>
#include <cstdint>

namespace sx {

constexpr float MASKED = -1e30f;  // a bias at or below this hides the key (the graph's is float32's lowest)

// Eight float lanes reduced in the order every path uses: ((0+4)+(2+6)) + ((1+5)+(3+7)).
static inline float tree8(const float* a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

// q . k over D (a multiple of 8): eight lane sums (fused multiply-adds along d = l mod 8), then tree8.
static inline float dot_ref(const float* q, const float* k, int64_t D) {
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t d = 0; d < D; d += 8)
    for (int l = 0; l < 8; ++l) a[l] = std::fmaf(q[d + l], k[d + l], a[l]);
  return tree8(a);
}

struct AttnRow {
  const float* q;     // [D]
  const float* K;     // [total, D] this row's KV head
  const float* V;
  const float* bias;  // [total] or null
  int64_t total, D;
  float scale;
  float* out;         // [D]
  float* scores;      // [total] scratch
};

// The scores q.k * scale + bias in r.scores (-inf: hidden), key by key; returns their max.
template <class Dot>
static inline float scores_each(const AttnRow& r, Dot dot) {
  float m = -INFINITY;
  for (int64_t j = 0; j < r.total; ++j) {
    const float b = r.bias ? r.bias[j] : 0.f;
    if (b <= MASKED) {
      r.scores[j] = -INFINITY;  // hidden: skipped below (as adding exact zeros would be)
      continue;
    }
    const float s = dot(r.q, r.K + j * r.D, r.D) * r.scale + b;
    r.scores[j] = s;
    m = std::fmax(m, s);
  }
  return m;
}

// softmax(scores) V given the scores and their max m, keys in cache order; hidden keys skipped.
template <class Accumulate>
static inline void softmax_v(const AttnRow& r, float m, Accumulate acc) {
  float den = 0.f;
  for (int64_t j = 0; j < r.total; ++j) {  // exp(-inf) is never taken: hidden stays -inf, a marker
    if (r.scores[j] == -INFINITY) continue;
    const float e = std::exp(r.scores[j] - m);
    r.scores[j] = e;
    den += e;
  }
  acc(r, den);
}

// softmax(q K^T * scale + bias) V, keys in cache order; hidden keys skipped (exactly as adding zeros).
template <class Dot, class Accumulate>
static inline void attend_row(const AttnRow& r, Dot dot, Accumulate acc) {
  softmax_v(r, scores_each(r, dot), acc);
}

// out[d] = (sum_j e_j V[j][d], fused multiply-adds in key order) / den
static inline void accumulate_ref(const AttnRow& r, float den) {
  for (int64_t d = 0; d < r.D; ++d) r.out[d] = 0.f;
  for (int64_t j = 0; j < r.total; ++j) {
    if (r.scores[j] == -INFINITY) continue;
    const float e = r.scores[j];
    for (int64_t d = 0; d < r.D; ++d) r.out[d] = std::fmaf(e, r.V[j * r.D + d], r.out[d]);
  }
  for (int64_t d = 0; d < r.D; ++d) r.out[d] = r.out[d] / den;
}

}  // namespace sx
