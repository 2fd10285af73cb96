// Each kernel path's functions, as the dispatcher and the self-check see them (internal to the library).
#pragma once
#include <cstdint>
#include <string>

#include "sx_act.h"
#include "sx_attn.h"

using SxGemm = void (*)(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);

struct SxKernels {
  void (*quantize)(const float*, int64_t, int, sx::ActRow);
  SxGemm gemm;
  void (*exact)(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
  void (*attend)(const sx::AttnRow&);
  void (*attend_group)(const sx::AttnRow*, int64_t);
  SxGemm gemm_r8 = nullptr;  // its kernel on r8 groups (sx_layout.h; n0, n1 multiples of 8), or null
};

// Columns [n0, n1) of an N-row weight in type's layout (file, or r8: type | sx::R8) on kernels k: r8's whole
// groups on k's r8 kernel (or its file kernel through sx::r8_through_file), a group cut by n0 or n1 through a
// scratch row, the rows past the last group (as in the file) on its file kernel. sx_dispatch.cc.
void sx_gemm_layout(const SxKernels& k, int type, const void* act, int64_t M, int64_t K, const uint8_t* W, int64_t N,
                    int64_t n0, int64_t n1, float* Y, int64_t ldy);
void sx_exact_layout(const SxKernels& k, int type, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t N,
                     int64_t n0, int64_t n1, float* Y, int64_t ldy);

// "" when path `k` computes the reference's bits on every case of the self-check, else the first case that
// differs ("Q4_K K=768 M=5: int8 matmul"). sx_selfcheck.cc.
std::string sx_check_against(const SxKernels& k, const SxKernels& ref);
// The same for the r8 layout (k.gemm_r8, or k's file kernels through sx::r8_through_file): checked apart, so a
// path whose r8 kernel differs keeps its file kernels and runs r8 through them.
std::string sx_check_r8_against(const SxKernels& k, const SxKernels& ref);
// What the self-check covers, in a few words.
const char* sx_check_scope();
