// specexport's CPU kernels on GGUF blocks: the C interface (ctypes, the ONNX Runtime ops, the test binary).
//   Y[M, N] = X[M, K] . W^T, W = N rows of the file's blocks, verbatim or in the r8 layout (sx_layout.h: the
//   same bytes, eight rows interleaved; `type` | 16 names a weight in it, ggml's type id alone the file's).
// Every output is computed by one thread in a fixed order (block by block, the same integer and float
// operations whatever M, the other rows or the path), so a row's bits never depend on the pass.
#pragma once
#include <cstddef>
#include <cstdint>

#define SX_API __attribute__((visibility("default")))

extern "C" {

// Kernel paths; every path equals SX_REF bit for bit. The VNNI paths are the AVX2 path with VNNI's integer dot
// products (AVX-VNNI's VEX encoding, or AVX512-VNNI's EVEX on ymm); SX_AVX512 the K types on zmm; SX_AVX2LANES
// the K types with eight columns in a ymm register's lanes; SX_AMX the
// matrix tiles (Q4_K, Q6_K); SX_NEON and SX_I8MM AArch64's sdot and smmla. SX_TIERS is no instruction set: each
// pass runs the path its type and row count were measured fastest on (sx_set_tier; every path gives the same
// bits, so the choice never changes an output). SX_AUTO: what sx_resolve picks.
enum {
  SX_AUTO = -1, SX_REF = 0, SX_AVX2 = 1, SX_NEON = 3, SX_AVXVNNI = 4, SX_AVX512VNNI = 5, SX_AMX = 6, SX_TIERS = 7,
  SX_AVX512 = 8, SX_I8MM = 9, SX_AVX2LANES = 10
};

SX_API int sx_version(void);
// Path names, "ref,avx2": those this CPU and this build can run. A SIMD path runs only after it computed the
// reference's bits on every op, type and row count (sx_selfcheck.cc, at first use: a CPU, compiler or change
// that gets an instruction wrong is never used); SPECEXPORT_KERNEL_SELFCHECK=off skips it (planted-bug tests).
SX_API const char* sx_paths(void);
// Paths this CPU has whose self-check disagreed with the reference ("" when none): they do not run.
SX_API const char* sx_refused(void);
// For each refused path, the first case that differed ("avx2: Q4_K K=768 M=5: int8 matmul; ...").
SX_API const char* sx_refused_why(void);
// What the self-check covered here, or that it was turned off.
SX_API const char* sx_selfcheck(void);
// The path SX_AUTO resolves to (or `forced` if runnable; -1 if not): SX_TIERS where more than one SIMD path
// runs here, else the one that does.
SX_API int sx_resolve(int forced);
// SX_TIERS's table: passes of M rows (1..16; 17: more) of weights of `type` (either layout: each has its own
// entries) run on `path` (a runnable SIMD path). Returns 0, or 1 for an unknown type, row count or path. Until
// set: the best path for every M.
SX_API int sx_set_tier(int type, int M, int path);
SX_API int sx_tier(int type, int M);
// 1 where `path` runs a kernel of its own for `type`; 0 where it hands the type to another path's (the 512-bit
// tier's Q5_K, AMX's Q5 types; every x86 path's r8 weights, avx2's lanes): timing it there would time that
// path's kernel twice.
SX_API int sx_own_kernel(int path, int type);
// 1 where `path` runs r8 weights on an r8 kernel (one read of a group's bytes a block); 0 where it runs them
// through its file kernels (a copy back to the file's layout per 64 rows), or cannot run.
SX_API int sx_r8_kernel(int path);
// Bytes per row of W for `type` and K; 0 if the type is unknown or K not a multiple of its block.
SX_API size_t sx_row_bytes(int type, int64_t K);
// Activation buffer bytes for M rows (int8 mode).
SX_API size_t sx_act_bytes(int type, int64_t M, int64_t K);
// int8 mode, step 1: quantize M rows of X into `act` (per block of the type: one scale, int8 values,
// sums per 16 and, for the 32-weight types, per 4), on `path` (every path writes the reference's bytes).
SX_API void sx_quantize(int type, int path, const float* X, int64_t M, int64_t K, void* act);
// int8 mode, step 2: columns [n0, n1) of Y for all M rows; W has N rows (where r8's groups end).
SX_API void sx_gemm_q8(int type, int path, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t N,
                int64_t n0, int64_t n1, float* Y, int64_t ldy);
// Exact mode: float activations, weights dequantized as the gguf package does, dot products in double
// (per block in four lanes, sx_ref.cc).
SX_API void sx_gemm_exact(int type, int path, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t N,
                          int64_t n0, int64_t n1, float* Y, int64_t ldy);
// W [N, row bytes] of ggml type `type` from the file's layout to r8 (to_r8 = 1) or back (0) into out (the same
// size; rows past the last group of 8 copied as they are). Returns 0, or 1 for an unknown type or K.
SX_API int sx_repack(int type, int to_r8, const uint8_t* W, int64_t N, int64_t K, uint8_t* out);
// Rows `ids` of W (either layout) dequantized (an embedding's gather). Returns the first id out of [0, N), or -1.
SX_API int64_t sx_gather(int type, const uint8_t* W, int64_t N, int64_t K, const int64_t* ids, int64_t count, float* out);
// Attention for one query row over its KV head's rows in cache order (sx_attn.h): out [D], scratch [total].
// bias [total] (null: none); a bias <= -1e30 hides the key. D a multiple of 8.
SX_API void sx_attend(int path, const float* q, const float* K, const float* V, const float* bias, int64_t total,
                      int64_t D, float scale, float* out, float* scratch);
// sx_attend for n rows over the same keys (one KV head: its query heads, every row of a pass): each row's
// bits are sx_attend's; the keys are read in blocks shared by the rows. bias[i] may be null; scratch
// [n, total].
SX_API void sx_attend_group(int path, int64_t n, const float* const* q, const float* const* bias, float* const* out,
                            const float* K, const float* V, int64_t total, int64_t D, float scale, float* scratch);
// One call, one thread: quantize (unless exact) and multiply. For tests and the kernel curve.
SX_API int sx_matmul(int type, int path, int exact, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t N,
              float* Y);
}
