// ONNX Runtime custom ops (domain "specexport.cpu"), through the lite custom-op API (headers from
// Debian's libonnxruntime-dev; the C API is versioned, so a library built on 1.21 headers runs on later
// runtimes):
//   GgufMatMul(X float [..., K], W uint8 [N, row bytes]) -> Y float [..., N]   attributes: type, K, N, exact
//   GgufGather(W uint8 [N, row bytes], ids int64 [...]) -> Y float [..., K]    attributes: type, K, N
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "sx_kernels.h"

namespace {

constexpr int64_t COLS_PER_TASK = 64;  // a multiple of 8 (the SIMD tiles)

struct Attrs {
  int64_t type, K, N, exact;
  int path;
  Attrs(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    type = ki.GetAttribute<int64_t>("type");
    K = ki.GetAttribute<int64_t>("K");
    N = ki.GetAttribute<int64_t>("N");
    int64_t e = 0;
    try { e = ki.GetAttribute<int64_t>("exact"); } catch (const Ort::Exception&) {}
    exact = e;
    path = sx_resolve(SX_AUTO);
  }
  // Errors are returned by Compute (a kernel's constructor cannot return a status).
  Ort::Status check(const char* op) const {
    if (!sx_row_bytes((int)type, K))
      return Ort::Status((std::string(op) + ": K=" + std::to_string(K) + " is not a multiple of ggml type " +
                          std::to_string(type) + "'s block, or the type is not one of ours").c_str(), ORT_INVALID_ARGUMENT);
    if (path < 0)
      return Ort::Status((std::string(op) + ": SPECEXPORT_KERNEL_PATH names a path this CPU cannot run (it runs: " +
                          sx_paths() + ")").c_str(), ORT_FAIL);
    return Ort::Status{nullptr};
  }
};

struct Task {
  const Attrs* a;
  const void* act;
  const float* X;
  const uint8_t* W;
  float* Y;
  int64_t M;
};

void run_task(void* p, size_t i) {
  const Task& t = *(const Task*)p;
  const int64_t n0 = (int64_t)i * COLS_PER_TASK, n1 = std::min(n0 + COLS_PER_TASK, t.a->N);
  if (t.a->exact)
    sx_gemm_exact((int)t.a->type, t.X, t.M, t.a->K, t.W, n0, n1, t.Y, t.a->N);
  else
    sx_gemm_q8((int)t.a->type, t.a->path, t.act, t.M, t.a->K, t.W, n0, n1, t.Y, t.a->N);
}

struct GgufMatMul : Attrs {
  using Attrs::Attrs;
  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& X, const Ort::Custom::Tensor<uint8_t>& W,
                      Ort::Custom::Tensor<float>& Y) {
    if (Ort::Status bad = check("GgufMatMul"); !bad.IsOK()) return bad;
    std::vector<int64_t> shape = X.Shape();
    if (shape.empty() || shape.back() != K) return Ort::Status("GgufMatMul: X's last axis is not K", ORT_INVALID_ARGUMENT);
    const std::vector<int64_t> ws = W.Shape();
    if (ws.size() != 2 || ws[0] != N || (size_t)ws[1] != sx_row_bytes((int)type, K))
      return Ort::Status("GgufMatMul: W is not [N, row bytes] for this type and K", ORT_INVALID_ARGUMENT);
    int64_t M = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) M *= shape[i];
    shape.back() = N;
    float* y = Y.Allocate(shape);
    if (M == 0) return Ort::Status{nullptr};
    std::vector<uint8_t> act;
    if (!exact) {  // quantized once per row, before the columns are shared out
      act.resize(sx_act_bytes((int)type, M, K));
      sx_quantize((int)type, X.Data(), M, K, act.data());
    }
    Task task{this, act.data(), X.Data(), W.Data(), y, M};
    const size_t tasks = (size_t)((N + COLS_PER_TASK - 1) / COLS_PER_TASK);
    Ort::KernelContext(ctx).ParallelFor(run_task, tasks, 0, &task);
    return Ort::Status{nullptr};
  }
};

struct GgufGather : Attrs {
  using Attrs::Attrs;
  Ort::Status Compute(const Ort::Custom::Tensor<uint8_t>& W, const Ort::Custom::Tensor<int64_t>& ids,
                      Ort::Custom::Tensor<float>& Y) {
    if (Ort::Status bad = check("GgufGather"); !bad.IsOK()) return bad;
    std::vector<int64_t> shape = ids.Shape();
    const int64_t count = ids.NumberOfElement();
    shape.push_back(K);
    float* y = Y.Allocate(shape);
    const int64_t bad = sx_gather((int)type, W.Data(), N, K, ids.Data(), count, y);
    if (bad >= 0)
      return Ort::Status(("GgufGather: id " + std::to_string(ids.Data()[bad]) + " is outside [0, " + std::to_string(N) + ")").c_str(),
                         ORT_INVALID_ARGUMENT);
    return Ort::Status{nullptr};
  }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (!api) return nullptr;  // a runtime older than our headers: nothing registered, the session says why
  Ort::InitApi(api);
  static Ort::CustomOpDomain domain{"specexport.cpu"};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> matmul{Ort::Custom::CreateLiteCustomOp<GgufMatMul>("GgufMatMul", "CPUExecutionProvider")};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> gather{Ort::Custom::CreateLiteCustomOp<GgufGather>("GgufGather", "CPUExecutionProvider")};
  static bool added = false;
  if (!added) {
    domain.Add(matmul.get());
    domain.Add(gather.get());
    added = true;
  }
  try {
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}
