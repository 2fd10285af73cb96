// Which path runs: the best this CPU has, or the one SPECEXPORT_KERNEL_PATH (ref, avx2, neon) names.
#include <cstdlib>
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "sx_act.h"
#include "sx_attn.h"
#include "sx_blocks.h"
#include "sx_kernels.h"

#if defined(__x86_64__)
void sx_avx2_quantize_row(const float*, int64_t, int, sx::ActRow);
void sx_avx2_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
void sx_avx2_attend(const sx::AttnRow&);
void sx_avx2_attend_group(const sx::AttnRow*, int64_t);
void sx_avx2_gemm_exact(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
void sx_avxvnni_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
void sx_avx512vnni_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
#endif
void sx_ref_gemm_exact(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
#if defined(__aarch64__)
void sx_neon_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
void sx_neon_attend(const sx::AttnRow&);
void sx_neon_gemm_exact(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
#endif
void sx_ref_quantize_row(const float*, int64_t, int, sx::ActRow);
void sx_ref_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
void sx_ref_attend(const sx::AttnRow&);

namespace {

constexpr int ALL[] = {SX_REF, SX_AVX2, SX_AVXVNNI, SX_AVX512VNNI, SX_NEON};
constexpr int BEST_FIRST[] = {SX_NEON, SX_AVX512VNNI, SX_AVXVNNI, SX_AVX2};

// Whether the CPU (and the OS: AVX-512's registers) has the path's instructions.
bool cpu_has(int path) {
  switch (path) {
    case SX_REF: return true;
#if defined(__x86_64__)
    case SX_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#ifdef SX_EMULATE_VNNI  // a test library: the VNNI steps computed with AVX2 (sx_avx2.cc)
    case SX_AVXVNNI:
    case SX_AVX512VNNI: return cpu_has(SX_AVX2);
#else
    case SX_AVXVNNI: return cpu_has(SX_AVX2) && __builtin_cpu_supports("avxvnni");
    case SX_AVX512VNNI:
      return cpu_has(SX_AVX2) && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
#endif
#endif
#if defined(__aarch64__) && defined(__linux__)
    case SX_NEON: return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#endif
    default: return false;
  }
}

const char* name(int path) {
  switch (path) {
    case SX_REF: return "ref";
    case SX_AVX2: return "avx2";
    case SX_NEON: return "neon";
    case SX_AVXVNNI: return "avxvnni";
    case SX_AVX512VNNI: return "avx512vnni";
    default: return "?";
  }
}

// Each path's kernels; a path without its own (or not built for this architecture) runs the reference's.
struct Kernels {
  void (*quantize)(const float*, int64_t, int, sx::ActRow);
  void (*gemm)(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
  void (*exact)(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
  void (*attend)(const sx::AttnRow&);
};

Kernels kernels(int path) {
  switch (path) {
#if defined(__x86_64__)
    case SX_AVX2: return {sx_avx2_quantize_row, sx_avx2_gemm, sx_avx2_gemm_exact, sx_avx2_attend};
    case SX_AVXVNNI: return {sx_avx2_quantize_row, sx_avxvnni_gemm, sx_avx2_gemm_exact, sx_avx2_attend};
    case SX_AVX512VNNI: return {sx_avx2_quantize_row, sx_avx512vnni_gemm, sx_avx2_gemm_exact, sx_avx2_attend};
#endif
#if defined(__aarch64__)
    case SX_NEON: return {sx_ref_quantize_row, sx_neon_gemm, sx_neon_gemm_exact, sx_neon_attend};
#endif
    default: return {sx_ref_quantize_row, sx_ref_gemm, sx_ref_gemm_exact, sx_ref_attend};
  }
}

// The self-check: every type's int8 matmul (quantizer included) on pseudo-random blocks, through the row
// tiles' sizes and a column tail, bit-equal to the reference's. About a millisecond (the reference's share).
bool agrees_with_reference(int path) {
  const Kernels k = kernels(path), ref = kernels(SX_REF);
  uint32_t seed = 12345u;
  auto next = [&] { return seed = seed * 1664525u + 1013904223u; };
  for (int type : {sx::Q4_0, sx::Q4_1, sx::Q5_0, sx::Q5_1, sx::Q8_0, sx::Q4_K, sx::Q5_K, sx::Q6_K}) {
    const sx::TypeInfo ti = sx::type_info(type);
    const int64_t K = 2 * ti.qk, N = 11, nb = K / ti.qk, M = 13;  // 13 rows: an 8-row and a 4-row tile, then 1
    std::vector<uint8_t> W((size_t)(N * nb * ti.bytes));
    for (auto& b : W) b = (uint8_t)(next() >> 24);
    for (int64_t i = 0; i < N * nb; ++i) {  // finite fp16 scales (d, and m or dmin where the type has one)
      uint8_t* blk = W.data() + i * ti.bytes;
      if (type == sx::Q6_K) {
        blk[209] = 0x1c;
      } else {
        blk[1] = 0x1c;
        if (ti.kind != sx::SYM) blk[3] = 0x1c;
      }
    }
    std::vector<float> X((size_t)(M * K));
    for (auto& x : X) x = (float)((int)(next() >> 20) - 2048) / 512.f;
    std::vector<float> want((size_t)(3 * M * N)), got((size_t)(3 * M * N));
    for (const auto& [kk, out] : {std::pair{ref, want.data()}, std::pair{k, got.data()}}) {
      std::vector<uint8_t> act(sx_act_bytes(type, M, K));
      for (int64_t m = 0; m < M; ++m) kk.quantize(X.data() + m * K, K, ti.qk, sx::act_row(act.data(), m, K, ti.qk));
      const int64_t rows[] = {M, 1, 3};  // passes of every row, of one row, of a 3-row tile
      for (int i = 0; i < 3; ++i) kk.gemm(type, act.data(), rows[i], K, W.data(), 0, N, out + i * M * N, N);
    }
    if (std::memcmp(want.data(), got.data(), want.size() * sizeof(float))) return false;
  }
  return true;
}

// Per path: 1 runs, 0 the CPU lacks it, -1 the CPU has it but it disagreed with the reference.
int state(int path) {
  static const std::vector<int> states = [] {
    const char* env = std::getenv("SPECEXPORT_KERNEL_SELFCHECK");
    const bool check = !(env && (!std::strcmp(env, "off") || !std::strcmp(env, "0")));
    std::vector<int> out(8, 0);
    for (int p : ALL)
      if (cpu_has(p)) out[(size_t)p] = p == SX_REF || !check || agrees_with_reference(p) ? 1 : -1;
    return out;
  }();
  return path >= 0 && path < (int)states.size() ? states[(size_t)path] : 0;
}

bool runnable(int path) { return state(path) == 1; }

std::string names_where(int want) {
  std::string out;
  for (int p : ALL) {
    if (state(p) != want) continue;
    if (!out.empty()) out += ",";
    out += name(p);
  }
  return out;
}

}  // namespace

extern "C" int sx_version(void) { return 3; }  // 3: the 32-weight types in eight integer lanes per block too

extern "C" const char* sx_paths(void) {
  static const std::string out = names_where(1);
  return out.c_str();
}

extern "C" const char* sx_refused(void) {
  static const std::string out = names_where(-1);
  return out.c_str();
}

extern "C" int sx_resolve(int forced) {
  if (forced == SX_AUTO) {
    const char* env = std::getenv("SPECEXPORT_KERNEL_PATH");
    if (env && *env) {
      for (int p : ALL)
        if (!std::strcmp(env, name(p))) return runnable(p) ? p : -1;
      return -1;
    }
    for (int p : BEST_FIRST)
      if (runnable(p)) return p;
    return SX_REF;
  }
  return runnable(forced) ? forced : -1;
}


extern "C" void sx_quantize(int type, int path, const float* X, int64_t M, int64_t K, void* act) {
  const sx::TypeInfo ti = sx::type_info(type);
  const Kernels k = kernels(path);
  for (int64_t m = 0; m < M; ++m) k.quantize(X + m * K, K, ti.qk, sx::act_row(act, m, K, ti.qk));
}

extern "C" void sx_gemm_q8(int type, int path, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0,
                           int64_t n1, float* Y, int64_t ldy) {
  kernels(path).gemm(type, act, M, K, W, n0, n1, Y, ldy);
}

extern "C" void sx_gemm_exact(int type, int path, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t n0,
                              int64_t n1, float* Y, int64_t ldy) {
  kernels(path).exact(type, X, M, K, W, n0, n1, Y, ldy);
}

extern "C" void sx_attend(int path, const float* q, const float* K, const float* V, const float* bias, int64_t total,
                          int64_t D, float scale, float* out, float* scratch) {
  kernels(path).attend(sx::AttnRow{q, K, V, bias, total, D, scale, out, scratch});
}

extern "C" void sx_attend_group(int path, int64_t n, const float* const* q, const float* const* bias, float* const* out,
                                const float* K, const float* V, int64_t total, int64_t D, float scale, float* scratch) {
  thread_local std::vector<sx::AttnRow> rows;  // once per thread: this runs per layer per token
  rows.resize((size_t)n);
  for (int64_t i = 0; i < n; ++i) rows[i] = sx::AttnRow{q[i], K, V, bias[i], total, D, scale, out[i], scratch + i * total};
#if defined(__x86_64__)
  if (path == SX_AVX2 || path == SX_AVXVNNI || path == SX_AVX512VNNI) return sx_avx2_attend_group(rows.data(), n);
#endif
  for (const sx::AttnRow& r : rows) kernels(path).attend(r);  // each row as sx_attend computes it
}

extern "C" int sx_matmul(int type, int path, int exact, const float* X, int64_t M, int64_t K, const uint8_t* W,
                         int64_t N, float* Y) {
  if (!sx_row_bytes(type, K)) return 1;
  const int p = sx_resolve(path);
  if (p < 0) return 2;
  if (exact) {
    sx_gemm_exact(type, p, X, M, K, W, 0, N, Y, N);
    return 0;
  }
  std::vector<uint8_t> act(sx_act_bytes(type, M, K));
  sx_quantize(type, p, X, M, K, act.data());
  sx_gemm_q8(type, p, act.data(), M, K, W, 0, N, Y, N);
  return 0;
}
