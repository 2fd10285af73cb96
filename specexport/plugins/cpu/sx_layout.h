// The weights' layouts: the file's (each row's blocks in turn) and r8, written once at build time so that a
// kernel loads eight rows' bytes into a vector's lanes with plain loads (no per-call transposes, no gathers).
// r8 is a permutation of the file's bytes: the same size, the same numbers.
//
//   rows 8g .. 8g+7 (a group) keep their place in the tensor (bytes [8g rb, 8(g+1) rb)); inside it, block b of
//   the eight rows is 8 x the block's bytes at b x 8 x bytes, each field of the block (in the file's order) at
//   8 x its file offset:
//     a 2-byte field (an fp16 d, dmin or m)  -> the eight rows' halves, row c at 2c (one cvtph a group)
//     a 4k-byte field (codes, scales, qh)    -> k dwords x 8 rows: dword j of row c at 32 j + 4 c
//   Q5_0 / Q5_1's fifth bits (qh) permuted inside their dword: the file's bit 4t + k (weight 4t + k) is the
//   stored bit 8k + t, so the eight dwords of codes take theirs with one shift and one mask each.
//   Rows past the last full group (N % 8) stay as in the file.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

#include "sx_blocks.h"

namespace sx {

// Functions here are static: each translation unit (compiled with its own -m flags) keeps its own copy.

constexpr int R8 = 16;  // type | R8: a tensor in the r8 layout (the kernels' type ids; the graph's `layout`)
constexpr int GROUP = 8;

static inline int base_type(int t) { return t & ~R8; }
static inline bool is_r8(int t) { return (t & R8) != 0; }

struct Field {
  int off, len;  // in the file's block
};

// The block's fields in the file's order (sx_blocks.h's unpack reads them); returns their count.
static inline int fields(int t, Field* f) {
  switch (base_type(t)) {
    case Q4_0: f[0] = {0, 2}, f[1] = {2, 16}; return 2;
    case Q4_1: f[0] = {0, 2}, f[1] = {2, 2}, f[2] = {4, 16}; return 3;
    case Q5_0: f[0] = {0, 2}, f[1] = {2, 4}, f[2] = {6, 16}; return 3;
    case Q5_1: f[0] = {0, 2}, f[1] = {2, 2}, f[2] = {4, 4}, f[3] = {8, 16}; return 4;
    case Q8_0: f[0] = {0, 2}, f[1] = {2, 32}; return 2;
    case Q4_K: f[0] = {0, 2}, f[1] = {2, 2}, f[2] = {4, 12}, f[3] = {16, 128}; return 4;
    case Q5_K: f[0] = {0, 2}, f[1] = {2, 2}, f[2] = {4, 12}, f[3] = {16, 32}, f[4] = {48, 128}; return 5;
    case Q6_K: f[0] = {0, 128}, f[1] = {128, 64}, f[2] = {192, 16}, f[3] = {208, 2}; return 4;
    default: return 0;
  }
}

// Q5_0 / Q5_1's qh field: where it is in the block (0: the type has none here).
static inline int q5_qh(int t) { return base_type(t) == Q5_0 ? 2 : base_type(t) == Q5_1 ? 4 : 0; }

static inline uint32_t q5h_store(uint32_t h) {  // file bit 4t + k -> bit 8k + t
  uint32_t o = 0;
  for (int t = 0; t < 8; ++t)
    for (int k = 0; k < 4; ++k) o |= ((h >> (4 * t + k)) & 1u) << (8 * k + t);
  return o;
}

static inline uint32_t q5h_load(uint32_t o) {  // the inverse
  uint32_t h = 0;
  for (int t = 0; t < 8; ++t)
    for (int k = 0; k < 4; ++k) h |= ((o >> (8 * k + t)) & 1u) << (4 * t + k);
  return h;
}

// Row c's block (file bytes, `bytes` long) to or from its place in an r8 group-block gb.
static inline void r8_put(int t, const uint8_t* blk, int c, uint8_t* gb) {
  Field f[5];
  const int nf = fields(t, f);
  for (int i = 0; i < nf; ++i) {
    uint8_t* dst = gb + GROUP * f[i].off;
    if (f[i].len == 2) {
      std::memcpy(dst + 2 * c, blk + f[i].off, 2);
      continue;
    }
    for (int j = 0; j < f[i].len / 4; ++j) std::memcpy(dst + 32 * j + 4 * c, blk + f[i].off + 4 * j, 4);
  }
  if (const int qh = q5_qh(t)) {
    uint32_t h;
    std::memcpy(&h, blk + qh, 4);
    h = q5h_store(h);
    std::memcpy(gb + GROUP * qh + 4 * c, &h, 4);
  }
}

static inline void r8_get(int t, const uint8_t* gb, int c, uint8_t* blk) {
  Field f[5];
  const int nf = fields(t, f);
  for (int i = 0; i < nf; ++i) {
    const uint8_t* src = gb + GROUP * f[i].off;
    if (f[i].len == 2) {
      std::memcpy(blk + f[i].off, src + 2 * c, 2);
      continue;
    }
    for (int j = 0; j < f[i].len / 4; ++j) std::memcpy(blk + f[i].off + 4 * j, src + 32 * j + 4 * c, 4);
  }
  if (const int qh = q5_qh(t)) {
    uint32_t h;
    std::memcpy(&h, blk + qh, 4);
    h = q5h_load(h);
    std::memcpy(blk + qh, &h, 4);
  }
}

// Row n's block b in the file's bytes (out: the type's block bytes), from a tensor W of `rows` rows in the
// layout of t (file or r8). rb: a row's bytes.
static inline const uint8_t* block_at(int t, const uint8_t* W, int64_t rows, size_t rb, int64_t n, int64_t b,
                                      uint8_t* out) {
  const int bytes = type_info(base_type(t)).bytes;
  const int64_t grouped = is_r8(t) ? rows / GROUP * GROUP : 0;
  if (n >= grouped) return W + (size_t)n * rb + (size_t)b * bytes;
  r8_get(t, W + (size_t)(n / GROUP) * GROUP * rb + (size_t)b * GROUP * bytes, (int)(n % GROUP), out);
  return out;
}

// Whole groups: rows [n, n + rows) of W from the file's layout to r8 (to_r8), or from r8 back to the file's;
// out holds those rows alone (rows x rb).
static inline void r8_convert(int t, bool to_r8, const uint8_t* W, int64_t nb, int64_t n, int64_t rows, uint8_t* out) {
  const int bytes = type_info(base_type(t)).bytes;
  const size_t rb = (size_t)nb * bytes;
  for (int64_t g = 0; g < rows / GROUP; ++g)
    for (int64_t b = 0; b < nb; ++b)
      for (int c = 0; c < GROUP; ++c) {
        const size_t file = (size_t)(GROUP * g + c) * rb + (size_t)b * bytes;       // from the rows' start
        const size_t group = (size_t)(GROUP * g) * rb + (size_t)b * GROUP * bytes;
        if (to_r8)
          r8_put(t, W + (size_t)n * rb + file, c, out + group);
        else
          r8_get(t, W + (size_t)n * rb + group, c, out + file);
      }
}

// Groups [n0, n1) (multiples of 8) of an r8 tensor through a kernel of the file's layout (a path with no r8
// kernel of its own, the exact mode): up to 64 rows at a time back in the file's layout in a thread's buffer,
// L2-sized, so a row's bits are the file kernel's. `in`: the activations (int8 mode) or X (exact mode).
template <class In>
static inline void r8_through_file(void (*gemm)(int, In, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t),
                                   int t, In in, int64_t M, int64_t K, const uint8_t* W, int64_t n0, int64_t n1,
                                   float* Y, int64_t ldy) {
  constexpr int64_t CHUNK = 64;
  const TypeInfo ti = type_info(base_type(t));
  const int64_t nb = K / ti.qk;
  const size_t rb = (size_t)nb * ti.bytes;
  thread_local std::vector<uint8_t> buf;
  buf.resize(CHUNK * rb);
  for (int64_t n = n0; n < n1; n += CHUNK) {
    const int64_t rows = n1 - n < CHUNK ? n1 - n : CHUNK;
    r8_convert(t, false, W, nb, n, rows, buf.data());
    gemm(base_type(t), in, M, K, buf.data(), 0, rows, Y + n, ldy);
  }
}

}  // namespace sx
