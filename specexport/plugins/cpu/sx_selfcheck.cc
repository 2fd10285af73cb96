// The self-check: before a SIMD path runs, everything it computes is computed on pseudo-random inputs and
// compared bit for bit with the reference: the activation quantizer, the int8 matmul of every type at two K
// and every row count 1..9, 12, 13, 16, 17 (each row tile and its tails, for every tier), a column range that
// starts inside a tile, the exact matmul, and attention one row and many rows at a time. The reference runs
// once (a row's bits never depend on its pass, so each pass's rows are compared with the first rows of one
// 17-row pass); the paths' share is a fraction of a millisecond each.
#include <cstring>
#include <string>
#include <vector>

#include "sx_blocks.h"
#include "sx_kernels.h"
#include "sx_layout.h"
#include "sx_tiers.h"

namespace {

constexpr int64_t N = 37, MMAX = 17;  // 37 columns: two 16-column tiles and a tail of 5
constexpr int64_t ROWS[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17};
constexpr int TYPES[] = {sx::Q4_0, sx::Q4_1, sx::Q5_0, sx::Q5_1, sx::Q8_0, sx::Q4_K, sx::Q5_K, sx::Q6_K};

struct Rng {
  uint32_t s = 12345u;
  uint32_t next() { return s = s * 1664525u + 1013904223u; }
  float normalish() { return (float)((int)(next() >> 20) - 2048) / 512.f; }
};

// Blocks of random bytes with finite fp16 scales (d, and m or dmin where the type has one).
std::vector<uint8_t> blocks(int type, int64_t K, Rng& rng) {
  const sx::TypeInfo ti = sx::type_info(type);
  std::vector<uint8_t> W((size_t)(N * (K / ti.qk) * ti.bytes));
  for (auto& b : W) b = (uint8_t)(rng.next() >> 24);
  for (size_t i = 0; i < W.size(); i += (size_t)ti.bytes) {
    uint8_t* blk = W.data() + i;
    if (type == sx::Q6_K) {
      blk[209] = 0x1c;
    } else {
      blk[1] = 0x1c;
      if (ti.kind != sx::SYM) blk[3] = (uint8_t)(0x18 | (rng.next() >> 31));
    }
  }
  return W;
}

const char* type_name(int type) {
  switch (type) {
    case sx::Q4_0: return "Q4_0";
    case sx::Q4_1: return "Q4_1";
    case sx::Q5_0: return "Q5_0";
    case sx::Q5_1: return "Q5_1";
    case sx::Q8_0: return "Q8_0";
    case sx::Q4_K: return "Q4_K";
    case sx::Q5_K: return "Q5_K";
    default: return "Q6_K";
  }
}

std::string where(int type, int64_t K, int64_t M, const char* what) {
  return std::string(type_name(type)) + " K=" + std::to_string(K) + " M=" + std::to_string(M) + ": " + what;
}

bool same(const float* a, const float* b, size_t n) { return !std::memcmp(a, b, n * sizeof(float)); }

std::string check_matmuls(const SxKernels& k, const SxKernels& ref, int type, int64_t K, Rng& rng) {
  const sx::TypeInfo ti = sx::type_info(type);
  const std::vector<uint8_t> W = blocks(type, K, rng);
  std::vector<float> X((size_t)(MMAX * K));
  for (auto& x : X) x = rng.normalish();
  for (int64_t i = 0; i < ti.qk; ++i) X[(size_t)(2 * K + i)] = 0.f;  // an all-zero activation block
  const size_t ab = sx_act_bytes(type, MMAX, K);
  std::vector<uint8_t> act(ab), mine(ab);
  for (int64_t m = 0; m < MMAX; ++m) {
    ref.quantize(X.data() + m * K, K, ti.qk, sx::act_row(act.data(), m, K, ti.qk));
    k.quantize(X.data() + m * K, K, ti.qk, sx::act_row(mine.data(), m, K, ti.qk));
  }
  if (std::memcmp(act.data(), mine.data(), ab)) return where(type, K, MMAX, "activation quantizer");
  std::vector<float> want((size_t)(MMAX * N)), got((size_t)(MMAX * N));
  ref.gemm(type, act.data(), MMAX, K, W.data(), 0, N, want.data(), N);
  for (int64_t M : ROWS) {
    k.gemm(type, act.data(), M, K, W.data(), 0, N, got.data(), N);
    if (!same(got.data(), want.data(), (size_t)(M * N))) return where(type, K, M, "int8 matmul");
  }
  const int64_t n0 = 5, n1 = 29, M = 6;  // a column range that starts and ends inside tiles
  std::fill(got.begin(), got.end(), 0.f);
  k.gemm(type, act.data(), M, K, W.data(), n0, n1, got.data(), N);
  for (int64_t m = 0; m < M; ++m)
    if (!same(got.data() + m * N + n0, want.data() + m * N + n0, (size_t)(n1 - n0)))
      return where(type, K, M, "int8 matmul of columns 5..28");
  for (int64_t M : {(int64_t)1, (int64_t)5}) {
    ref.exact(type, X.data(), M, K, W.data(), 0, N, want.data(), N);
    k.exact(type, X.data(), M, K, W.data(), 0, N, got.data(), N);
    if (!same(got.data(), want.data(), (size_t)(M * N))) return where(type, K, M, "exact matmul");
  }
  return "";
}

// The r8 layout: the same weights interleaved (four groups and a tail of five rows), k's r8 kernel (or its
// file kernels through r8_through_file) against the reference on the file's bytes.
std::string check_r8(const SxKernels& k, const SxKernels& ref, int type, int64_t K, Rng& rng) {
  const sx::TypeInfo ti = sx::type_info(type);
  const std::vector<uint8_t> W = blocks(type, K, rng);
  std::vector<float> X((size_t)(MMAX * K));
  for (auto& x : X) x = rng.normalish();
  const size_t ab = sx_act_bytes(type, MMAX, K);
  std::vector<uint8_t> act(ab);
  for (int64_t m = 0; m < MMAX; ++m) ref.quantize(X.data() + m * K, K, ti.qk, sx::act_row(act.data(), m, K, ti.qk));
  std::vector<float> want((size_t)(MMAX * N)), got((size_t)(MMAX * N));
  ref.gemm(type, act.data(), MMAX, K, W.data(), 0, N, want.data(), N);
  const int64_t n0 = 5, n1 = 29, M = 6;  // a range that cuts the first and last of its groups
  std::vector<uint8_t> W8(W.size());
  sx_repack(type, 1, W.data(), N, K, W8.data());
  for (int64_t M : ROWS) {
    sx_gemm_layout(k, type | sx::R8, act.data(), M, K, W8.data(), N, 0, N, got.data(), N);
    if (!same(got.data(), want.data(), (size_t)(M * N))) return where(type, K, M, "int8 matmul, r8 layout");
  }
  std::fill(got.begin(), got.end(), 0.f);
  sx_gemm_layout(k, type | sx::R8, act.data(), M, K, W8.data(), N, n0, n1, got.data(), N);
  for (int64_t m = 0; m < M; ++m)
    if (!same(got.data() + m * N + n0, want.data() + m * N + n0, (size_t)(n1 - n0)))
      return where(type, K, M, "int8 matmul of columns 5..28, r8 layout");
  ref.exact(type, X.data(), 3, K, W.data(), 0, N, want.data(), N);
  sx_exact_layout(k, type | sx::R8, X.data(), 3, K, W8.data(), N, 0, N, got.data(), N);
  if (!same(got.data(), want.data(), (size_t)(3 * N))) return where(type, K, 3, "exact matmul, r8 layout");
  return "";
}

std::string check_attention(const SxKernels& k, const SxKernels& ref, Rng& rng) {
  for (int64_t D : {(int64_t)64, (int64_t)80}) {
    const int64_t total = 37, n = 6;
    std::vector<float> q((size_t)(n * D)), K((size_t)(total * D)), V((size_t)(total * D)), bias((size_t)(n * total));
    for (auto* v : {&q, &K, &V})
      for (auto& x : *v) x = rng.normalish();
    for (auto& b : bias) b = rng.next() % 4 == 0 ? -3.4e38f : rng.normalish();
    std::vector<float> want((size_t)(n * D)), got((size_t)(n * D)), scratch((size_t)(n * total));
    std::vector<sx::AttnRow> rows((size_t)n);
    for (int64_t i = 0; i < n; ++i) {
      const sx::AttnRow r{q.data() + i * D, K.data(), V.data(), i == 3 ? nullptr : bias.data() + i * total, total, D,
                          0.09f, want.data() + i * D, scratch.data() + i * total};
      ref.attend(r);
      rows[(size_t)i] = r;
      rows[(size_t)i].out = got.data() + i * D;
    }
    for (int64_t i = 0; i < n; ++i) k.attend(rows[(size_t)i]);
    if (!same(got.data(), want.data(), got.size())) return "attention, D=" + std::to_string(D) + ": one row";
    std::fill(got.begin(), got.end(), 0.f);
    k.attend_group(rows.data(), n);
    if (!same(got.data(), want.data(), got.size())) return "attention, D=" + std::to_string(D) + ": rows together";
  }
  return "";
}

}  // namespace

namespace {

template <class Check>
std::string each_type(Rng& rng, Check check) {
  for (int type : TYPES) {
    const int qk = sx::type_info(type).qk;
    // 32-weight types: odd counts of blocks (a kernel's tail) and an even one (the AMX tiles take blocks in
    // pairs: without it their tile kernels would fall back here and never be checked)
    const std::vector<int64_t> counts = qk == 256 ? std::vector<int64_t>{1, 3} : std::vector<int64_t>{1, 5, 6};
    for (int64_t nb : counts) {
      std::string bad = check(type, nb * qk);
      if (!bad.empty()) return bad;
    }
  }
  return "";
}

}  // namespace

std::string sx_check_against(const SxKernels& k, const SxKernels& ref) {
  Rng rng;
  const std::string bad = each_type(rng, [&](int type, int64_t K) { return check_matmuls(k, ref, type, K, rng); });
  return bad.empty() ? check_attention(k, ref, rng) : bad;
}

std::string sx_check_r8_against(const SxKernels& k, const SxKernels& ref) {
  Rng rng;
  return each_type(rng, [&](int type, int64_t K) { return check_r8(k, ref, type, K, rng); });
}

const char* sx_check_scope() {
  return "quantizer, int8 matmul (8 types, 2 K, rows 1-9/12/13/16/17, 37 columns; file and r8 layouts), exact matmul, "
         "attention";
}
