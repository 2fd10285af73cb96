// A command-line driver of the kernels' C interface, for running them where Python cannot reach them
// (an AArch64 build under qemu-user: tests/test_cpu_kernels_arm.py). Binary files in, binary files out.
//   driver paths                                        -> prints the paths this CPU runs
//   driver matmul TYPE PATH EXACT M K N IN OUT          IN: X float32 [M, K] then W [N, row bytes]; OUT: Y [M, N]
//   driver attend PATH D TOTAL SCALE IN OUT             IN: q [D], K [TOTAL, D], V [TOTAL, D], bias [TOTAL]; OUT: [D]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "sx_kernels.h"

static std::vector<char> slurp(const char* path) {
  std::vector<char> out;
  FILE* f = std::fopen(path, "rb");
  if (!f) return out;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.insert(out.end(), buf, buf + n);
  std::fclose(f);
  return out;
}

static int spill(const char* path, const void* data, size_t n) {
  FILE* f = std::fopen(path, "wb");
  if (!f || std::fwrite(data, 1, n, f) != n) return 1;
  return std::fclose(f) != 0;
}

int main(int argc, char** argv) {
  if (argc >= 2 && !std::strcmp(argv[1], "paths")) {
    std::printf("%s\n", sx_paths());
    return 0;
  }
  if (argc == 10 && !std::strcmp(argv[1], "matmul")) {
    const int type = std::atoi(argv[2]), path = std::atoi(argv[3]), exact = std::atoi(argv[4]);
    const int64_t M = std::atoll(argv[5]), K = std::atoll(argv[6]), N = std::atoll(argv[7]);
    const std::vector<char> in = slurp(argv[8]);
    const size_t xb = (size_t)M * K * 4, wb = (size_t)N * sx_row_bytes(type, K);
    if (!wb || in.size() != xb + wb) return 2;
    std::vector<float> y((size_t)M * N);
    if (sx_matmul(type, path, exact, (const float*)in.data(), M, K, (const uint8_t*)in.data() + xb, N, y.data())) return 3;
    return spill(argv[9], y.data(), y.size() * 4);
  }
  if (argc == 8 && !std::strcmp(argv[1], "attend")) {
    const int path = std::atoi(argv[2]);
    const int64_t D = std::atoll(argv[3]), total = std::atoll(argv[4]);
    const float scale = (float)std::atof(argv[5]);
    const std::vector<char> in = slurp(argv[6]);
    if (in.size() != (size_t)(D + 2 * total * D + total) * 4) return 2;
    const float* f = (const float*)in.data();
    std::vector<float> out(D), scratch(total);
    sx_attend(path, f, f + D, f + D + total * D, f + D + 2 * total * D, total, D, scale, out.data(), scratch.data());
    return spill(argv[7], out.data(), out.size() * 4);
  }
  std::fprintf(stderr, "usage: see the head of tests/cpu/driver.cc\n");
  return 64;
}
