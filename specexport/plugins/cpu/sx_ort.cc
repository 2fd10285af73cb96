// ONNX Runtime custom ops (domain "specexport.cpu"), through the lite custom-op API (headers from
// Debian's libonnxruntime-dev; the C API is versioned, so a library built on 1.21 headers runs on later
// runtimes):
//   GgufMatMul(X float [..., K], W uint8 [N, row bytes][, C float]) -> Y float [..., N]   attributes: type,
//     K, N, exact, layout. C (optional), added after the product: a bias [N] or a tensor of Y's shape (a
//     residual); Y = X W^T + C in float, the bits of an Add after it. layout (optional): "file" (the file's
//     blocks verbatim, the default) or "r8" (sx_layout.h); another is refused by name.
//   GgufMatMulN(X, W_0 .. W_n-1, C...) -> Y_0 .. Y_n-1: n GgufMatMuls of one input in one node (q, k, v;
//     gate, up), each output's bits those of its own GgufMatMul   attributes: types, Ns (one per weight),
//     K, exact, adds (optional, one 0/1 per output: the C inputs after the weights, in the outputs' order),
//     layout (every weight's)
//   GgufGather(W uint8 [N, row bytes], ids int64 [...]) -> Y float [..., K]    attributes: type, K, N, layout
//   GroupQueryAttention: ONNX Runtime's contract, each row computed alone (below)
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sx_blocks.h"
#include "sx_kernels.h"
#include "sx_layout.h"

namespace {

// Columns are shared out in a few contiguous ranges (a multiple of 8: the SIMD tiles): ONNX Runtime's
// ParallelFor schedules each index as a task of its own, so many small ones cost more than they compute.
constexpr int64_t MAX_TASKS = 16, MIN_COLS = 64;

int64_t task_cols(int64_t N) {
  const int64_t tasks = std::max<int64_t>(1, std::min(MAX_TASKS, N / MIN_COLS));
  return ((N + tasks - 1) / tasks + 7) / 8 * 8;
}

// `exact` is optional (graphs written before it default to int8 mode).
int64_t exact_attr(const Ort::ConstKernelInfo& ki) {
  try { return ki.GetAttribute<int64_t>("exact"); } catch (const Ort::Exception&) { return 0; }
}

// The weights' layout: 0 (the file's; graphs written before the attribute) or sx::R8; -1 for a name this
// library does not know (*name: it, for the error).
int layout_attr(const Ort::ConstKernelInfo& ki, std::string* name) {
  try {
    *name = ki.GetAttribute<std::string>("layout");
  } catch (const Ort::Exception&) {
    *name = "file";
  }
  return *name == "file" ? 0 : *name == "r8" ? sx::R8 : -1;
}

Ort::Status bad_layout(const char* op, const std::string& name) {
  return Ort::Status((std::string(op) + ": weight layout '" + name + "' is not one these kernels know (file, r8; kernel "
                      "version " + std::to_string(sx_version()) + "): the graph was written by a newer specexport").c_str(),
                     ORT_INVALID_ARGUMENT);
}

struct Attrs {
  int64_t type, K, N, exact;  // type: ggml's id | the layout's (sx_layout.h)
  int path, layout;
  std::string layout_name;
  Attrs(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    layout = layout_attr(ki, &layout_name);
    type = ki.GetAttribute<int64_t>("type") | std::max(layout, 0);
    K = ki.GetAttribute<int64_t>("K");
    N = ki.GetAttribute<int64_t>("N");
    exact = exact_attr(ki);
    path = sx_resolve(SX_AUTO);
  }
  // Errors are returned by Compute (a kernel's constructor cannot return a status).
  Ort::Status check(const char* op) const {
    if (layout < 0) return bad_layout(op, layout_name);
    if (!sx_row_bytes((int)type, K))
      return Ort::Status((std::string(op) + ": K=" + std::to_string(K) + " is not a multiple of ggml type " +
                          std::to_string(type) + "'s block, or the type is not one of ours").c_str(), ORT_INVALID_ARGUMENT);
    if (path < 0)
      return Ort::Status((std::string(op) + ": SPECEXPORT_KERNEL_PATH names a path this CPU cannot run (it runs: " +
                          sx_paths() + ")").c_str(), ORT_FAIL);
    return Ort::Status{nullptr};
  }
};

// An addend's shape: [N] (a bias, every row) or Y's, leading 1s aside (a residual: the same elements in the
// same order). Sets *full for the latter.
Ort::Status addend_shape(const std::string& op, const std::vector<int64_t>& c, const std::vector<int64_t>& y, bool* full) {
  auto core = [](const std::vector<int64_t>& v) {
    size_t i = 0;
    while (i + 1 < v.size() && v[i] == 1) ++i;
    return std::vector<int64_t>(v.begin() + (std::ptrdiff_t)i, v.end());
  };
  *full = core(c) == core(y);
  if (*full || (c.size() == 1 && c[0] == y.back())) return Ort::Status{nullptr};
  auto dims = [](const std::vector<int64_t>& v) {
    std::string t = "[";
    for (size_t i = 0; i < v.size(); ++i) t += (i ? ", " : "") + std::to_string(v[i]);
    return t + "]";
  };
  return Ort::Status((op + ": the addend C is " + dims(c) + ", neither Y's shape " + dims(y) + " nor [N]").c_str(),
                     ORT_INVALID_ARGUMENT);
}

// Columns [n0, n1) of Y's M rows plus C's: the float add of the Add node this replaces.
void add_cols(float* y, const float* c, bool full, int64_t M, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; ++m) {
    float* row = y + m * N;
    const float* add = full ? c + m * N : c;
    for (int64_t n = n0; n < n1; ++n) row[n] = row[n] + add[n];
  }
}

struct Task {
  const Attrs* a;
  int64_t cols;
  const void* act;
  const float* X;
  const uint8_t* W;
  float* Y;
  int64_t M;
  const float* C;  // the addend or null
  bool full;
};

void run_task(void* p, size_t i) {
  const Task& t = *(const Task*)p;
  const int64_t n0 = (int64_t)i * t.cols, n1 = std::min(n0 + t.cols, t.a->N);
  if (t.a->exact)
    sx_gemm_exact((int)t.a->type, t.a->path, t.X, t.M, t.a->K, t.W, t.a->N, n0, n1, t.Y, t.a->N);
  else
    sx_gemm_q8((int)t.a->type, t.a->path, t.act, t.M, t.a->K, t.W, t.a->N, n0, n1, t.Y, t.a->N);
  if (t.C) add_cols(t.Y, t.C, t.full, t.M, t.a->N, n0, n1);
}

struct GgufMatMul : Attrs {
  using Attrs::Attrs;
  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& X, const Ort::Custom::Tensor<uint8_t>& W,
                      std::optional<const Ort::Custom::Tensor<float>*> C, Ort::Custom::Tensor<float>& Y) {
    if (Ort::Status bad = check("GgufMatMul"); !bad.IsOK()) return bad;
    std::vector<int64_t> shape = X.Shape();
    if (shape.empty() || shape.back() != K) return Ort::Status("GgufMatMul: X's last axis is not K", ORT_INVALID_ARGUMENT);
    const std::vector<int64_t> ws = W.Shape();
    if (ws.size() != 2 || ws[0] != N || (size_t)ws[1] != sx_row_bytes((int)type, K))
      return Ort::Status("GgufMatMul: W is not [N, row bytes] for this type and K", ORT_INVALID_ARGUMENT);
    int64_t M = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) M *= shape[i];
    shape.back() = N;
    bool full = false;
    if (C.has_value())
      if (Ort::Status bad = addend_shape("GgufMatMul", (*C)->Shape(), shape, &full); !bad.IsOK()) return bad;
    float* y = Y.Allocate(shape);
    if (M == 0) return Ort::Status{nullptr};
    std::vector<uint8_t> act;
    if (!exact) {  // quantized once per row, before the columns are shared out
      act.resize(sx_act_bytes((int)type, M, K));
      sx_quantize((int)type, path, X.Data(), M, K, act.data());
    }
    Task task{this, task_cols(N), act.data(), X.Data(), W.Data(), y, M, C.has_value() ? (*C)->Data() : nullptr, full};
    const size_t tasks = (size_t)((N + task.cols - 1) / task.cols);
    Ort::KernelContext(ctx).ParallelFor(run_task, tasks, 0, &task);
    return Ort::Status{nullptr};
  }
};

// Several weights of one input: X quantized once per block size, every weight's column ranges in one
// ParallelFor. Why: a small model's matmuls are small (SmolLM2's k and v: 69 KB each), so a node's fixed
// cost (the op call, the quantization, waking the pool) is a large part of it, and a lone 192-column
// matmul is three tasks on two threads.
struct GgufMatMulN {
  std::vector<int64_t> types, Ns, adds;  // types: ggml's ids | the layout's
  int64_t K, exact;
  int path, layout;
  std::string layout_name;
  GgufMatMulN(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    layout = layout_attr(ki, &layout_name);
    types = ki.GetAttributes<int64_t>("types");
    for (int64_t& t : types) t |= std::max(layout, 0);
    Ns = ki.GetAttributes<int64_t>("Ns");
    try { adds = ki.GetAttributes<int64_t>("adds"); } catch (const Ort::Exception&) { adds.assign(types.size(), 0); }
    K = ki.GetAttribute<int64_t>("K");
    exact = exact_attr(ki);
    path = sx_resolve(SX_AUTO);
  }

  struct Part {
    int type;
    int64_t N, n0, n1;
    const uint8_t* W;
    const void* act;
    float* Y;
    const float* C;  // the addend or null
    bool full;
  };
  struct Job {
    const GgufMatMulN* op;
    const float* X;
    int64_t M;
    std::vector<Part> parts;
  };

  static void run(void* p, size_t i) {
    const Job& j = *(const Job*)p;
    const Part& t = j.parts[i];
    if (j.op->exact)
      sx_gemm_exact(t.type, j.op->path, j.X, j.M, j.op->K, t.W, t.N, t.n0, t.n1, t.Y, t.N);
    else
      sx_gemm_q8(t.type, j.op->path, t.act, j.M, j.op->K, t.W, t.N, t.n0, t.n1, t.Y, t.N);
    if (t.C) add_cols(t.Y, t.C, t.full, j.M, t.N, t.n0, t.n1);
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& X, const Ort::Custom::Variadic& Ws,
                      Ort::Custom::Variadic& Ys) {
    const size_t n = types.size();
    size_t n_adds = 0;
    for (int64_t a : adds) n_adds += a != 0;
    if (layout < 0) return bad_layout("GgufMatMulN", layout_name);
    if (Ns.size() != n || adds.size() != n || Ws.Size() != n + n_adds)
      return Ort::Status("GgufMatMulN: the attributes types, Ns and adds, the weights and the addends are not one per output",
                         ORT_INVALID_ARGUMENT);
    if (path < 0)
      return Ort::Status((std::string("GgufMatMulN: SPECEXPORT_KERNEL_PATH names a path this CPU cannot run (it runs: ") +
                          sx_paths() + ")").c_str(), ORT_FAIL);
    std::vector<int64_t> shape = X.Shape();
    if (shape.empty() || shape.back() != K) return Ort::Status("GgufMatMulN: X's last axis is not K", ORT_INVALID_ARGUMENT);
    int64_t M = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) M *= shape[i];
    Job job{this, X.Data(), M, {}};
    std::vector<uint8_t> act32, act256;  // X quantized per block size (32, or 256 for the K types)
    for (size_t i = 0, next_add = n; i < n; ++i) {
      const int type = (int)types[i];
      const size_t rb = sx_row_bytes(type, K);
      const std::vector<int64_t>& ws = Ws[i]->Shape();
      if (!rb || ws.size() != 2 || ws[0] != Ns[i] || (size_t)ws[1] != rb)
        return Ort::Status(("GgufMatMulN: weight " + std::to_string(i) + " is not [N, row bytes] for its type and K").c_str(),
                           ORT_INVALID_ARGUMENT);
      shape.back() = Ns[i];
      const float* c = nullptr;
      bool full = false;
      if (adds[i]) {  // read through the context: the lite API types every variadic input as the first one
        const Ort::ConstValue C = Ort::KernelContext(ctx).GetInput(1 + next_add++);
        const Ort::TensorTypeAndShapeInfo info = C.GetTensorTypeAndShapeInfo();
        if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
          return Ort::Status(("GgufMatMulN: addend of output " + std::to_string(i) + " is not float").c_str(), ORT_INVALID_ARGUMENT);
        if (Ort::Status bad = addend_shape("GgufMatMulN output " + std::to_string(i), info.GetShape(), shape, &full); !bad.IsOK())
          return bad;
        c = C.GetTensorData<float>();
      }
      float* y = Ys.AllocateOutput<float>(i, shape);
      std::vector<uint8_t>& act = sx::type_info(sx::base_type(type)).qk == 32 ? act32 : act256;
      if (!exact && M > 0 && act.empty()) {
        act.resize(sx_act_bytes(type, M, K));
        sx_quantize(type, path, X.Data(), M, K, act.data());
      }
      const int64_t cols = task_cols(Ns[i]);
      for (int64_t n0 = 0; n0 < Ns[i] && M > 0; n0 += cols)
        job.parts.push_back(Part{type, Ns[i], n0, std::min(n0 + cols, Ns[i]), (const uint8_t*)Ws[i]->DataRaw(), act.data(), y, c, full});
    }
    if (!job.parts.empty()) Ort::KernelContext(ctx).ParallelFor(run, job.parts.size(), 0, &job);
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

// GroupQueryAttention's contract (ONNX Runtime's com.microsoft op, as export/gqa.py uses it: no rotary
// inside, an additive bias) with rows computed one at a time in a fixed order (sx_attn.h):
//   query [B, T, Hq*D], key/value [B, T, Hkv*D], past_key/past_value [B, Hkv, C, D], seqlens_k int32 [B]
//   (P+T-1), total_sequence_length int32 [], attention_bias [B, 1, T, >= P+T]
//   -> output [B, T, Hq*D], present_key/present_value [B, Hkv, max(C, P+T), D]: the runtime binds each
//   present to its past buffer (rows P.. written in place); otherwise the past rows are copied over.
struct Attention {
  int64_t Hq, Hkv;
  float scale;
  int path;
  Attention(const OrtApi*, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    Hq = ki.GetAttribute<int64_t>("num_heads");
    Hkv = ki.GetAttribute<int64_t>("kv_num_heads");
    scale = ki.GetAttribute<float>("scale");
    path = sx_resolve(SX_AUTO);
  }

  struct Job {
    const Attention* op;
    const float *q, *K, *V, *bias;
    float* out;
    const int32_t* seqlens;
    int64_t B, T, D, C, W, parts;
  };

  // One task per (batch row, KV head, part): the KV head's query heads x the pass's rows go through
  // sx_attend_group together, so its keys are read once for them all (not once per query head and row).
  static void run(void* p, size_t i) {
    const Job& j = *(const Job*)p;
    const int64_t group = j.op->Hq / j.op->Hkv, pairs = group * j.T;
    const int64_t part = (int64_t)i % j.parts, g = (int64_t)i / j.parts % j.op->Hkv, b = (int64_t)i / j.parts / j.op->Hkv;
    const int64_t p0 = pairs * part / j.parts, p1 = pairs * (part + 1) / j.parts, n = p1 - p0;
    const int64_t total = (int64_t)j.seqlens[b] + 1;
    thread_local std::vector<float> scratch;
    thread_local std::vector<const float*> qs, biases;
    thread_local std::vector<float*> outs;
    if ((int64_t)scratch.size() < n * total) scratch.resize(n * total);
    qs.resize(n);
    biases.resize(n);
    outs.resize(n);
    for (int64_t x = p0; x < p1; ++x) {  // pair x: row t = x / group, query head h = g * group + x % group
      const int64_t t = x / group, h = g * group + x % group, row = (b * j.T + t) * j.op->Hq + h;
      qs[x - p0] = j.q + row * j.D;
      outs[x - p0] = j.out + row * j.D;
      biases[x - p0] = j.bias ? j.bias + (b * j.T + t) * j.W : nullptr;
    }
    const float* K = j.K + ((b * j.op->Hkv + g) * j.C) * j.D;
    const float* V = j.V + ((b * j.op->Hkv + g) * j.C) * j.D;
    sx_attend_group(j.op->path, n, qs.data(), biases.data(), outs.data(), K, V, total, j.D, j.op->scale, scratch.data());
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<float>& q, const Ort::Custom::Tensor<float>& k,
                      const Ort::Custom::Tensor<float>& v, const Ort::Custom::Tensor<float>& pk,
                      const Ort::Custom::Tensor<float>& pv, const Ort::Custom::Tensor<int32_t>& seqlens,
                      const Ort::Custom::Tensor<int32_t>& total_len, const Ort::Custom::Tensor<float>& bias,
                      Ort::Custom::Tensor<float>& out, Ort::Custom::Tensor<float>& presk,
                      Ort::Custom::Tensor<float>& presv) {
    const auto qs = q.Shape(), ps = pk.Shape(), bs = bias.Shape();
    if (qs.size() != 3 || ps.size() != 4 || bs.size() != 4 || ps[1] != Hkv || Hq % Hkv)
      return Ort::Status("specexport.cpu GroupQueryAttention: unexpected input ranks or head counts", ORT_INVALID_ARGUMENT);
    const int64_t B = qs[0], T = qs[1], D = ps[3], C = ps[2], W = bs[3];
    if (qs[2] != Hq * D || D % 8)
      return Ort::Status("specexport.cpu GroupQueryAttention: query is not [B, T, num_heads * D] with D a multiple of 8",
                         ORT_INVALID_ARGUMENT);
    const int64_t total = total_len.Data()[0];
    int64_t cap = C;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t tb = (int64_t)seqlens.Data()[b] + 1;
      if (tb < T || tb > W) return Ort::Status("specexport.cpu GroupQueryAttention: seqlens_k out of range", ORT_INVALID_ARGUMENT);
      cap = std::max(cap, tb);
    }
    cap = std::max(cap, total);
    const std::vector<int64_t> present{B, Hkv, cap, D};
    float* K = presk.Allocate(present);
    float* V = presv.Allocate(present);
    float* y = out.Allocate({B, T, Hq * D});
    for (int64_t b = 0; b < B; ++b) {
      const int64_t P = (int64_t)seqlens.Data()[b] + 1 - T;
      for (int64_t g = 0; g < Hkv; ++g) {
        float* kd = K + (b * Hkv + g) * cap * D;
        float* vd = V + (b * Hkv + g) * cap * D;
        if (K != pk.Data())  // not bound in place: the committed rows first
          std::copy(pk.Data() + (b * Hkv + g) * C * D, pk.Data() + ((b * Hkv + g) * C + std::min(P, C)) * D, kd);
        if (V != pv.Data())
          std::copy(pv.Data() + (b * Hkv + g) * C * D, pv.Data() + ((b * Hkv + g) * C + std::min(P, C)) * D, vd);
        for (int64_t t = 0; t < T; ++t) {
          std::copy_n(k.Data() + ((b * T + t) * Hkv + g) * D, D, kd + (P + t) * D);
          std::copy_n(v.Data() + ((b * T + t) * Hkv + g) * D, D, vd + (P + t) * D);
        }
      }
    }
    // Parts per KV head: at least four tasks in all (a model with one or two KV heads still fills the
    // threads), each at least one query row.
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>((Hq / Hkv) * T, (4 + B * Hkv - 1) / (B * Hkv)));
    Job job{this, q.Data(), K, V, bias.Data(), y, seqlens.Data(), B, T, D, cap, W, parts};
    Ort::KernelContext(ctx).ParallelFor(run, (size_t)(B * Hkv * parts), 0, &job);
    return Ort::Status{nullptr};
  }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (!api) {  // a runtime older than our headers: say so through the first API version, which every runtime has
    const OrtApi* v1 = api_base->GetApi(1);
    const std::string why = "specexport's CPU kernels need ONNX Runtime >= 1." + std::to_string(ORT_API_VERSION) +
                            " (C API " + std::to_string(ORT_API_VERSION) + "); this runtime is " +
                            api_base->GetVersionString();
    return v1 ? v1->CreateStatus(ORT_FAIL, why.c_str()) : nullptr;
  }
  Ort::InitApi(api);
  static Ort::CustomOpDomain domain{"specexport.cpu"};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> matmul{Ort::Custom::CreateLiteCustomOp<GgufMatMul>("GgufMatMul", "CPUExecutionProvider")};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> matmul_n{
      Ort::Custom::CreateLiteCustomOp<GgufMatMulN>("GgufMatMulN", "CPUExecutionProvider")};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> gather{Ort::Custom::CreateLiteCustomOp<GgufGather>("GgufGather", "CPUExecutionProvider")};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> attention{
      Ort::Custom::CreateLiteCustomOp<Attention>("GroupQueryAttention", "CPUExecutionProvider")};
  static bool added = false;
  if (!added) {
    domain.Add(matmul.get());
    domain.Add(matmul_n.get());
    domain.Add(gather.get());
    domain.Add(attention.get());
    added = true;
  }
  try {
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}
