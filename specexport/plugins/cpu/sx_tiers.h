// Each kernel path's functions, as the dispatcher and the self-check see them (internal to the library).
#pragma once
#include <cstdint>
#include <string>

#include "sx_act.h"
#include "sx_attn.h"

struct SxKernels {
  void (*quantize)(const float*, int64_t, int, sx::ActRow);
  void (*gemm)(int, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
  void (*exact)(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
  void (*attend)(const sx::AttnRow&);
  void (*attend_group)(const sx::AttnRow*, int64_t);
};

// "" when path `k` computes the reference's bits on every case of the self-check, else the first case that
// differs ("Q4_K K=768 M=5: int8 matmul"). sx_selfcheck.cc.
std::string sx_check_against(const SxKernels& k, const SxKernels& ref);
// What the self-check covers, in a few words.
const char* sx_check_scope();
