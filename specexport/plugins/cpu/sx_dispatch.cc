// Which path runs: the best this CPU has (each checked against the reference first: sx_selfcheck.cc), or the one
// SPECEXPORT_KERNEL_PATH (ref, avx2, avx2lanes, avxvnni, avx512vnni, avx512, amx, neon, i8mm, tiers) names.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#if defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "sx_act.h"
#include "sx_attn.h"
#include "sx_blocks.h"
#include "sx_kernels.h"
#include "sx_layout.h"
#include "sx_tiers.h"

#if defined(__x86_64__)
void sx_avx2_quantize_row(const float*, int64_t, int, sx::ActRow);
void sx_avx2_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
void sx_avx2_attend(const sx::AttnRow&);
void sx_avx2_attend_group(const sx::AttnRow*, int64_t);
void sx_avx2_gemm_exact(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
// Optional units (sx_vnni.cc): weak, so a library built without them (an assembler too old for their
// encodings) links, and these paths count as missing (cpu_has) instead of every path failing to build.
__attribute__((weak)) void sx_avxvnni_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*,
                                           int64_t);
__attribute__((weak)) void sx_avx512vnni_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t,
                                              float*, int64_t);
__attribute__((weak)) void sx_amx_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*,
                                       int64_t);
__attribute__((weak)) void sx_avx512_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*,
                                          int64_t);
__attribute__((weak)) int sx_avx512_owns(int);
void sx_avx2lanes_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
int sx_avx2lanes_owns(int);
void sx_avx2_r8_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
__attribute__((weak)) int sx_amx_owns(int);
#endif
void sx_ref_gemm_exact(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
#if defined(__aarch64__)
__attribute__((weak)) void sx_i8mm_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*,
                                        int64_t);
void sx_neon_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
void sx_neon_attend(const sx::AttnRow&);
void sx_neon_gemm_exact(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
#endif
void sx_ref_quantize_row(const float*, int64_t, int, sx::ActRow);
void sx_ref_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
void sx_ref_attend(const sx::AttnRow&);

namespace {

constexpr int ALL[] = {SX_REF, SX_AVX2, SX_AVXVNNI, SX_AVX512VNNI, SX_AVX512, SX_AMX, SX_NEON, SX_I8MM, SX_AVX2LANES};
// The default for every M until the tier table is measured (tiers.py's ORDER: the proven vector paths first).
constexpr int BEST_FIRST[] = {SX_NEON, SX_I8MM, SX_AMX, SX_AVX512VNNI, SX_AVXVNNI, SX_AVX512, SX_AVX2, SX_AVX2LANES};
constexpr int NPATHS = 16;  // path ids index the state tables

#if defined(__x86_64__) && defined(__linux__)
// AMX as the OS and hypervisor grant it (MATRIX-ENGINES.md 6.4): the CPU's AMX-TILE and AMX-INT8 bits, the
// OS's XCR0 tile state, the kernel's support and this process's permission (asked once), a palette.
bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    unsigned lo, hi;
    asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return false;
    unsigned long supported = 0;
    if (syscall(SYS_arch_prctl, 0x1021 /* ARCH_GET_XCOMP_SUPP */, &supported) || ((supported >> 17) & 3) != 3)
      return false;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return false;
    return __get_cpuid_count(0x1d, 0, &a, &b, &c, &d) && a >= 1;
  }();
  return ok;
}
#else
bool amx_usable() { return false; }
#endif

void ref_attend_group(const sx::AttnRow* rows, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sx_ref_attend(rows[i]);
}
#if defined(__aarch64__)
void neon_attend_group(const sx::AttnRow* rows, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sx_neon_attend(rows[i]);
}
#endif

#if defined(__aarch64__) && defined(__APPLE__)
bool apple_has(const char* feature) {  // every Apple M-series core has dotprod, M2 on i8mm: asked as the OS names them
  int v = 0;
  size_t n = sizeof(v);
  return sysctlbyname(feature, &v, &n, nullptr, 0) == 0 && v;
}
#endif

// Whether the CPU (and the OS: AVX-512's registers) has the path's instructions, and this library its code.
bool cpu_has(int path) {
  switch (path) {
    case SX_REF: return true;
#if defined(__x86_64__)
    case SX_AVX2:  // F16C: the 32-weight tiles convert their fp16 scales with it
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case SX_AVX2LANES: return cpu_has(SX_AVX2);
#ifdef SX_EMULATE_VNNI  // a test library: the VNNI steps computed with AVX2 (sx_vnni.cc)
    case SX_AVXVNNI: return cpu_has(SX_AVX2) && sx_avxvnni_gemm;
    case SX_AVX512VNNI: return cpu_has(SX_AVX2) && sx_avx512vnni_gemm;
#else
    case SX_AVXVNNI: return cpu_has(SX_AVX2) && sx_avxvnni_gemm && __builtin_cpu_supports("avxvnni");
    case SX_AVX512VNNI:
      return cpu_has(SX_AVX2) && sx_avx512vnni_gemm && __builtin_cpu_supports("avx512vnni") &&
             __builtin_cpu_supports("avx512vl");
#endif
#ifdef SX_EMULATE_AVX512  // a test library: the 512-bit tier's operations on AVX2 register pairs (sx_v512.h)
    case SX_AVX512: return sx_avx512_gemm && cpu_has(SX_AVX2);
#else
    case SX_AVX512:  // zmm registers: the OS must save them (__builtin_cpu_supports checks XCR0 too)
      return sx_avx512_gemm && cpu_has(SX_AVX2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
#endif
#ifdef SX_EMULATE_AMX  // a test library: the tiles computed in C, the steps around them in scalar C
    case SX_AMX: return sx_amx_gemm && cpu_has(SX_AVX2);
#else
    case SX_AMX:  // its steps around the tiles use AVX-512 (BW, VL, VNNI, VBMI)
      return sx_amx_gemm && cpu_has(SX_AVX512VNNI) && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vbmi") && amx_usable();
#endif
#endif
#if defined(__aarch64__) && defined(__linux__)
    case SX_NEON: return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
    case SX_I8MM: return sx_i8mm_gemm && cpu_has(SX_NEON) && (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#elif defined(__aarch64__) && defined(__APPLE__)
    case SX_NEON: return apple_has("hw.optional.arm.FEAT_DotProd");
    case SX_I8MM: return sx_i8mm_gemm && apple_has("hw.optional.arm.FEAT_I8MM");
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
    case SX_AMX: return "amx";
    case SX_AVX512: return "avx512";
    case SX_AVX2LANES: return "avx2lanes";
    case SX_I8MM: return "i8mm";
    case SX_TIERS: return "tiers";
    default: return "?";
  }
}

int best_single();
void tiers_gemm(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);

// Each path's kernels as built; a path without its own (or not built for this architecture) runs the
// reference's. Every x86 path runs r8 weights on the AVX2 lanes (sx_avx2l.cc: one kernel from one row to
// many); the others through their file kernels (sx::r8_through_file).
SxKernels built_kernels(int path) {
  switch (path) {
#if defined(__x86_64__)
    case SX_AVX2:
      return {sx_avx2_quantize_row, sx_avx2_gemm, sx_avx2_gemm_exact, sx_avx2_attend, sx_avx2_attend_group, sx_avx2_r8_gemm};
    case SX_AVXVNNI:
      return {sx_avx2_quantize_row, sx_avxvnni_gemm, sx_avx2_gemm_exact, sx_avx2_attend, sx_avx2_attend_group, sx_avx2_r8_gemm};
    case SX_AVX512VNNI:
      return {sx_avx2_quantize_row, sx_avx512vnni_gemm, sx_avx2_gemm_exact, sx_avx2_attend, sx_avx2_attend_group, sx_avx2_r8_gemm};
    case SX_AMX:
      return {sx_avx2_quantize_row, sx_amx_gemm, sx_avx2_gemm_exact, sx_avx2_attend, sx_avx2_attend_group, sx_avx2_r8_gemm};
    case SX_AVX512:
      return {sx_avx2_quantize_row, sx_avx512_gemm, sx_avx2_gemm_exact, sx_avx2_attend, sx_avx2_attend_group, sx_avx2_r8_gemm};
    case SX_AVX2LANES:
      return {sx_avx2_quantize_row, sx_avx2lanes_gemm, sx_avx2_gemm_exact, sx_avx2_attend, sx_avx2_attend_group, sx_avx2_r8_gemm};
#endif
#if defined(__aarch64__)
    case SX_NEON: return {sx_ref_quantize_row, sx_neon_gemm, sx_neon_gemm_exact, sx_neon_attend, neon_attend_group};
    case SX_I8MM: return {sx_ref_quantize_row, sx_i8mm_gemm, sx_neon_gemm_exact, sx_neon_attend, neon_attend_group};
#endif
    default: return {sx_ref_quantize_row, sx_ref_gemm, sx_ref_gemm_exact, sx_ref_attend, ref_attend_group};
  }
}

SxKernels kernels(int path);

bool checking() {
  const char* env = std::getenv("SPECEXPORT_KERNEL_SELFCHECK");
  return !(env && (!std::strcmp(env, "off") || !std::strcmp(env, "0")));
}

// Per path: 1 runs, 0 the CPU (or this library) lacks it, -1 the CPU has it but it disagreed with the
// reference; and, for a refused path, the first case that differed. Its r8 kernel apart: one that differs
// (r8_why) is not used, r8 weights going through the path's file kernels.
struct States {
  int state[NPATHS] = {0};
  std::string why[NPATHS];     // indexed by path id
  std::string r8_why[NPATHS];
};

const States& states() {
  static const States out = [] {
    States s;
    for (int p : ALL) {
      if (!cpu_has(p)) continue;
      if (p != SX_REF && checking()) s.why[p] = sx_check_against(built_kernels(p), built_kernels(SX_REF));
      s.state[p] = s.why[p].empty() ? 1 : -1;
      if (s.state[p] == 1 && p != SX_REF && checking() && built_kernels(p).gemm_r8)
        s.r8_why[p] = sx_check_r8_against(built_kernels(p), built_kernels(SX_REF));
    }
    return s;
  }();
  return out;
}

// A path's kernels as they run: as built, less an r8 kernel the self-check refused.
SxKernels kernels(int path) {
  if (path == SX_TIERS) {  // the gemm by its tier table; everything else the best single path's
    SxKernels k = kernels(best_single());
    k.gemm = tiers_gemm;
    return k;
  }
  SxKernels k = built_kernels(path);
  if (path >= 0 && path < NPATHS && !states().r8_why[path].empty()) k.gemm_r8 = nullptr;
  return k;
}

int state(int path) { return path >= 0 && path < NPATHS ? states().state[path] : 0; }

bool runnable(int path) { return state(path) == 1; }

std::string names_where(int want) {
  std::string out;
  for (int p : ALL) {
    if (state(p) != want) continue;
    if (!out.empty()) out += ",";
    out += name(p);
  }
  if (want == -1)  // the r8 kernels refused: "avx2.r8"
    for (int p : ALL)
      if (!states().r8_why[p].empty()) out += (out.empty() ? "" : ",") + std::string(name(p)) + ".r8";
  return out;
}

int best_single() {
  for (int p : BEST_FIRST)
    if (runnable(p) && p != SX_AMX) return p;  // the vector paths run every M; the matrix tier only many rows
  return SX_REF;
}

int simd_paths() {
  int n = 0;
  for (int p : ALL) n += p != SX_REF && runnable(p);
  return n;
}

// [type id (| R8)][M - 1]: M 1..16, then 17 for more rows. 0: not set (the best single path).
constexpr int TYPES_MAX = 32, TIER_ROWS = 17;
std::atomic<int> tier_table[TYPES_MAX][TIER_ROWS];

bool known(int type) { return (type & ~(TYPES_MAX - 1)) == 0 && sx::type_info(sx::base_type(type)).qk; }

int tier_of(int type, int64_t M) {
  const int p = tier_table[type & (TYPES_MAX - 1)][std::min<int64_t>(std::max<int64_t>(M, 1), TIER_ROWS) - 1]
                    .load(std::memory_order_relaxed);
  return p > 0 ? p : best_single();
}

void tiers_gemm(int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* Y,
                int64_t ldy) {
  kernels(tier_of(type, M)).gemm(type, act, M, K, W, n0, n1, Y, ldy);
}

// The path a pass runs on: the tier table's for SX_TIERS.
int pass_path(int path, int type, int64_t M) { return path == SX_TIERS ? tier_of(type, M) : path; }

}  // namespace

extern "C" int sx_set_tier(int type, int M, int path) {
  if (!known(type) || M < 1 || M > TIER_ROWS || path == SX_REF || path == SX_TIERS || !runnable(path)) return 1;
  tier_table[type][M - 1].store(path, std::memory_order_relaxed);
  return 0;
}

extern "C" int sx_tier(int type, int M) { return known(type) ? tier_of(type, M) : -1; }

extern "C" int sx_own_kernel(int path, int type) {
  if (!known(type)) return 0;
#if defined(__x86_64__)
  if (sx::is_r8(type)) return kernels(path).gemm_r8 ? path == SX_AVX2 : 1;  // one r8 kernel for every x86 path
  if (path == SX_AVX512) return sx_avx512_owns && sx_avx512_owns(type);
  if (path == SX_AMX) return sx_amx_owns && sx_amx_owns(type);
  if (path == SX_AVX2LANES) return sx_avx2lanes_owns(type);
#endif
  return 1;
}

extern "C" int sx_r8_kernel(int path) { return runnable(path) && kernels(path).gemm_r8 != nullptr; }

// 5: one integer and one float step per block (sx_ref.cc); 6: the r8 layout (sx_layout.h), N in the gemm calls
extern "C" int sx_version(void) { return 6; }

extern "C" const char* sx_paths(void) {
  static const std::string out = names_where(1);
  return out.c_str();
}

extern "C" const char* sx_refused(void) {
  static const std::string out = names_where(-1);
  return out.c_str();
}

extern "C" const char* sx_refused_why(void) {
  static const std::string out = [] {
    std::string o;
    for (int p : ALL)
      if (state(p) == -1) o += (o.empty() ? "" : "; ") + std::string(name(p)) + ": " + states().why[p];
    for (int p : ALL)
      if (!states().r8_why[p].empty()) o += (o.empty() ? "" : "; ") + std::string(name(p)) + ".r8: " + states().r8_why[p];
    return o;
  }();
  return out.c_str();
}

extern "C" const char* sx_selfcheck(void) {
  static const std::string out = [] {
    if (!checking()) return std::string("off (SPECEXPORT_KERNEL_SELFCHECK=off): SIMD paths run unchecked");
    std::string checked;
    for (int p : ALL)
      if (p != SX_REF && state(p) != 0) checked += (checked.empty() ? "" : ",") + std::string(name(p));
    if (checked.empty()) return std::string("nothing to check (the reference path only)");
    return checked + " against ref: " + sx_check_scope();
  }();
  return out.c_str();
}

extern "C" int sx_resolve(int forced) {
  if (forced == SX_AUTO) {
    const char* env = std::getenv("SPECEXPORT_KERNEL_PATH");
    if (env && *env) {
      if (!std::strcmp(env, "tiers")) return SX_TIERS;
      for (int p : ALL)
        if (!std::strcmp(env, name(p))) return runnable(p) ? p : -1;
      return -1;
    }
    return simd_paths() > 1 ? SX_TIERS : best_single();
  }
  return forced == SX_TIERS || runnable(forced) ? forced : -1;
}


extern "C" void sx_quantize(int type, int path, const float* X, int64_t M, int64_t K, void* act) {
  const sx::TypeInfo ti = sx::type_info(sx::base_type(type));
  const SxKernels k = kernels(path);
  for (int64_t m = 0; m < M; ++m) k.quantize(X + m * K, K, ti.qk, sx::act_row(act, m, K, ti.qk));
}

namespace {

template <class In>
using FileGemm = void (*)(int, In, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);

// r8's groups [g0, g1) (multiples of 8) on the path's r8 kernel (int8 mode), else on its file kernel through
// file-layout chunks. W: the tensor's base; Y's columns: its rows.
template <class In>
void groups(SxGemm r8, FileGemm<In> file, int type, In in, int64_t M, int64_t K, const uint8_t* W, int64_t g0,
            int64_t g1, float* Y, int64_t ldy) {
  if constexpr (std::is_same_v<In, const void*>)
    if (r8) return r8(type, in, M, K, W, g0, g1, Y, ldy);
  sx::r8_through_file(file, type, in, M, K, W, g0, g1, Y, ldy);
}

template <class In>
void by_layout(SxGemm r8, FileGemm<In> file, int type, In in, int64_t M, int64_t K, const uint8_t* W, int64_t N,
               int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  if (!sx::is_r8(type)) return file(type, in, M, K, W, n0, n1, Y, ldy);
  const int64_t G = sx::GROUP, grouped = N / G * G;
  if (n1 > grouped) {  // the rows past the last group: the file's layout, in their own place
    file(sx::base_type(type), in, M, K, W, std::max(n0, grouped), n1, Y, ldy);
    n1 = grouped;
  }
  if (n0 >= n1) return;
  // a group the range cuts: its eight columns into scratch, the range's kept
  auto cut = [&](int64_t g, int64_t c0, int64_t c1) {
    thread_local std::vector<float> scratch;
    scratch.assign((size_t)(M * G), 0.f);
    groups(r8, file, type, in, M, K, W + g * (int64_t)sx_row_bytes(type, K), 0, G, scratch.data(), G);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = c0; c < c1; ++c) Y[m * ldy + c] = scratch[(size_t)(m * G + c - g)];
  };
  const int64_t a = (n0 + G - 1) / G * G, b = n1 / G * G;
  if (a > b) return cut(b, n0, n1);  // inside one group
  groups(r8, file, type, in, M, K, W, a, b, Y, ldy);
  if (n0 < a) cut(a - G, n0, a);
  if (b < n1) cut(b, b, n1);
}

}  // namespace

void sx_gemm_layout(const SxKernels& k, int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t N,
                    int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  by_layout<const void*>(k.gemm_r8, k.gemm, type, act, M, K, W, N, n0, n1, Y, ldy);
}

void sx_exact_layout(const SxKernels& k, int type, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t N,
                     int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  by_layout<const float*>(nullptr, k.exact, type, X, M, K, W, N, n0, n1, Y, ldy);
}

extern "C" void sx_gemm_q8(int type, int path, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t N,
                           int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  sx_gemm_layout(kernels(pass_path(path, type, M)), type, act, M, K, W, N, n0, n1, Y, ldy);
}

extern "C" void sx_gemm_exact(int type, int path, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t N,
                              int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  sx_exact_layout(kernels(path), type, X, M, K, W, N, n0, n1, Y, ldy);
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
  kernels(path).attend_group(rows.data(), n);  // each row's bits sx_attend's
}

extern "C" int sx_matmul(int type, int path, int exact, const float* X, int64_t M, int64_t K, const uint8_t* W,
                         int64_t N, float* Y) {
  if (!sx_row_bytes(type, K)) return 1;
  const int p = sx_resolve(path);
  if (p < 0) return 2;
  if (exact) {
    sx_gemm_exact(type, p, X, M, K, W, N, 0, N, Y, N);
    return 0;
  }
  std::vector<uint8_t> act(sx_act_bytes(type, M, K));
  sx_quantize(type, p, X, M, K, act.data());
  sx_gemm_q8(type, p, act.data(), M, K, W, N, 0, N, Y, N);
  return 0;
}
