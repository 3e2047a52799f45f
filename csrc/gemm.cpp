// cuBLASLt GEMM for Y = X W^T (+ b): one handle per device, descriptors and the heuristic's
// algorithm cached per problem (shape, dtype, bias, pointer alignment, workspace size).
#include "tp_kernels/gemm.h"

#include <cublasLt.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "tp_kernels/check.h"
#include "tp_kernels/device_guard.h"
#include "tp_kernels/seconds.h"

namespace tp_kernels {
namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kFloat16: return CUDA_R_16F;
    case DType::kBFloat16: return CUDA_R_16BF;
    default: break;
  }
  throw Error(std::string("linear: no GEMM in ") + dtype_name(t));
}

int alignment(const void* p) {  // the largest power of two (<= 256) dividing the address
  auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && v % a) a /= 2;
  return a;
}

// The alignment every matrix of a batch shares: that of the base and of the batch stride in bytes.
int alignment(const void* p, int64_t batch, int64_t stride, size_t elem) {
  int a = alignment(p);
  if (batch > 1) {
    int b = alignment(reinterpret_cast<const void*>(static_cast<uintptr_t>(stride) * elem));
    a = a < b ? a : b;
  }
  return a;
}

// Descriptors and the chosen algorithm of one problem, with the heuristic's figures for it
// (gemm_plans). Never freed: a process sees few shapes.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  float waves = 0.0f;
  size_t workspace_needed = 0;
  GemmTuningInfo tuning;  // what its making timed (set_gemm_tuning)
};

// The tuning of the plans made from now on (set_gemm_tuning; g_mutex held).
struct Tuning {
  int candidates = 0;  // 0: off
  int iters = 5;
  double timeout_s = 300.0;
};

// How much faster than the heuristic's first a proposal must run to be kept: the timing's own
// spread between two runs of one algorithm, so that a tie keeps the heuristic's choice.
constexpr float kTuneMargin = 0.02f;

using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, bool, int, int, int,
                       int, size_t, bool, int64_t, int64_t, int64_t>;

std::mutex g_mutex;
std::map<int, cublasLtHandle_t> g_handles;  // per device
std::map<Key, Plan> g_plans;
Tuning g_tuning;

cublasLtHandle_t handle_for(int device) {
  auto it = g_handles.find(device);
  if (it != g_handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  TPK_CHECK_CUBLAS(cublasLtCreate(&h));
  g_handles[device] = h;
  return h;
}

// Column-major view of the row-major problem: Y^T [n, m] = W [n, k] . X^T [k, m], i.e.
// C = op(A) op(B) with B = X stored as a column-major [k, m] and A = W: a row-major W is a
// column-major [k, n] (op(A) = A^T); a column-major W is already [n, k] (op(A) = A).
// The descriptors of the problem of `p`, no algorithm yet.
Plan describe_problem(const LinearArgs& p) {
  Plan plan;
  cudaDataType_t t = cuda_type(p.dtype);
  TPK_CHECK_CUBLAS(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t transa = p.w_col_major ? CUBLAS_OP_N : CUBLAS_OP_T, transb = CUBLAS_OP_N;
  TPK_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)));
  TPK_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)));
  if (p.bias != nullptr) {
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;  // bias[n] along C's rows
    TPK_CHECK_CUBLAS(
        cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  }
  if (p.w_col_major)
    TPK_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&plan.a, t, p.n, p.k, p.ldw));  // W
  else
    TPK_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&plan.a, t, p.k, p.n, p.ldw));  // W
  TPK_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&plan.b, t, p.k, p.m, p.ldx));  // X
  TPK_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&plan.c, t, p.n, p.m, p.ldy));  // Y
  if (p.batch > 1) {  // one W for every product: its batch stride is 0
    int32_t count = static_cast<int32_t>(p.batch);
    int64_t zero = 0;
    auto set = [&](cublasLtMatrixLayout_t layout, int64_t stride) {
      TPK_CHECK_CUBLAS(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      TPK_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                        &stride, sizeof(stride)));
    };
    set(plan.a, zero);
    set(plan.b, p.stride_x);
    set(plan.c, p.stride_y);
  }
  return plan;
}

// Frees the descriptors of a plan that is not kept (gemm_candidates').
void release(Plan& plan) {
  if (plan.c) cublasLtMatrixLayoutDestroy(plan.c);
  if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
  if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
  if (plan.op) cublasLtMatmulDescDestroy(plan.op);
  plan = Plan{};
}

// The first `count` algorithms the heuristic proposes for the problem of `plan` and `p` (its
// workspace and its pointers' alignment), best first; none is an error.
std::vector<cublasLtMatmulHeuristicResult_t> heuristics(cublasLtHandle_t h, const Plan& plan, const LinearArgs& p,
                                                        int count) {
  cublasLtMatmulPreference_t pref = nullptr;
  TPK_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = p.workspace_bytes;
  size_t elem = dtype_size(p.dtype);
  uint32_t align_a = alignment(p.w), align_b = alignment(p.x, p.batch, p.stride_x, elem),
           align_c = alignment(p.y, p.batch, p.stride_y, elem);
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* value, size_t size) {
    if (status == CUBLAS_STATUS_SUCCESS) status = cublasLtMatmulPreferenceSetAttribute(pref, attr, value, size);
  };
  prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a));
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b));
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c));
  prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c));
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(count));
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS)
    status = cublasLtMatmulAlgoGetHeuristic(h, plan.op, plan.a, plan.b, plan.c, plan.c, pref, count, results.data(),
                                            &found);
  cublasLtMatmulPreferenceDestroy(pref);
  TPK_CHECK_CUBLAS(status);
  if (found == 0)
    throw Error("linear: cuBLASLt found no algorithm for m=" + std::to_string(p.m) + " n=" + std::to_string(p.n) +
                " k=" + std::to_string(p.k) + " " + dtype_name(p.dtype));
  results.resize(static_cast<size_t>(found));
  return results;
}

// Configuration attribute `attr` of `algo`, stored as T, or -1 where cuBLASLt does not report it.
template <typename T>
int config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T value{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written) != CUBLAS_STATUS_SUCCESS ||
      written != sizeof(value))
    return -1;
  return static_cast<int>(value);
}

GemmAlgoInfo algo_info(const cublasLtMatmulAlgo_t& a, float waves, size_t workspace_needed) {
  GemmAlgoInfo info;
  info.algo_id = config<int32_t>(a, CUBLASLT_ALGO_CONFIG_ID);
  info.tile_id = config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID);
  info.stages_id = config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID);
  info.splitk = config<int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  info.reduction_scheme = config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
  info.swizzle = config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING);
  info.custom_option = config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION);
  info.inner_shape_id = config<uint16_t>(a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID);
  info.cluster_shape_id = config<uint16_t>(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
  info.waves = waves;
  info.workspace_needed = workspace_needed;
  return info;
}

// Enqueues Y = X W^T (+ b) of `p` by `algo` on the plan's descriptors (the bias pointer set first).
void run(cublasLtHandle_t h, Plan& plan, const cublasLtMatmulAlgo_t& algo, const LinearArgs& p) {
  if (p.bias != nullptr) {
    TPK_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                                    sizeof(p.bias)));
  }
  const float alpha = 1.0f, beta = 0.0f;
  TPK_CHECK_CUBLAS(cublasLtMatmul(h, plan.op, &alpha, p.w, plan.a, p.x, plan.b, &beta, p.y, plan.c, p.y, plan.c,
                                  &algo, p.workspace, p.workspace_bytes, p.stream));
}

bool same_algo(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b) {
  return std::memcmp(&a, &b, sizeof(a)) == 0;
}

// Returns once `event` has completed, polling it; throws past `timeout_s` seconds (the work
// before it still queued: a GEMM behind a wait that never ends, a collective a peer never joins).
// `what` names the caller in the error.
void wait_for(cudaEvent_t event, double timeout_s, const LinearArgs& p, const char* what) {
  const Clock::time_point start = Clock::now();
  for (int polls = 0;; ++polls) {
    const cudaError_t status = cudaEventQuery(event);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) TPK_CHECK_CUDA(status);
    if (seconds_since(start) > timeout_s) {
      throw Error(std::string("tp_kernels: ") + what + ": the GEMMs it timed (m=" + std::to_string(p.m) + " n=" +
                  std::to_string(p.n) + " k=" + std::to_string(p.k) + "), and the work queued on the stream before "
                  "them, did not complete within " + format_seconds(timeout_s) +
                  " s; they stay queued. The limit is set with tp_kernels.set_timeout() or TP_KERNELS_TIMEOUT_S.");
    }
    pause_between_polls(polls);
  }
}

// The mean time of a run of `algo` for the problem of `p` (on p.stream, into p.y and p.workspace):
// one run, then `iters` between `start` and `stop`, waited for within `timeout_s` (`what` names the
// wait in its error); -1 where cuBLASLt would not run it (a cuBLAS error; a CUDA error is thrown).
float time_algo(cublasLtHandle_t h, Plan& plan, const cublasLtMatmulAlgo_t& algo, const LinearArgs& p, int iters,
                cudaEvent_t start, cudaEvent_t stop, double timeout_s, const char* what) {
  auto runs = [&](int times) {
    try {
      for (int i = 0; i < times; ++i) run(h, plan, algo, p);
      return true;
    } catch (const Error&) {
      return false;
    }
  };
  if (!runs(1)) return -1.0f;  // (its warm-up)
  TPK_CHECK_CUDA(cudaEventRecord(start, p.stream));
  const bool ran = runs(iters);
  TPK_CHECK_CUDA(cudaEventRecord(stop, p.stream));
  wait_for(stop, timeout_s, p, what);
  float ms = 0.0f;
  TPK_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  return ran ? ms / static_cast<float>(iters) : -1.0f;
}

// The elements from X's, or Y's, first to its last of the problem of `p` (rows `ld` apart, `cols`
// wide, batches `stride` apart).
size_t extent(int64_t m, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  return static_cast<size_t>((batch - 1) * stride + (m - 1) * ld + cols);
}

// Times `proposals` (the heuristic's, best first) for the problem of `p` as `t` says and keeps the
// fastest in `plan` where it beats the first by more than kTuneMargin (set_gemm_tuning); what it
// timed, or why it did not, in plan.tuning. On a stream of its own, into an output and a workspace
// of its own: nothing waits for the caller's stream, and the caller's output and workspace are
// left alone. A CUDA error leaves the first (its message in the note; a non-sticky one cleared).
void tune(cublasLtHandle_t h, Plan& plan, const std::vector<cublasLtMatmulHeuristicResult_t>& proposals,
          const LinearArgs& p, const Tuning& t) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  const cudaError_t asked = cudaStreamIsCapturing(p.stream, &capturing);
  if (asked != cudaSuccess) {
    cudaGetLastError();
    plan.tuning.note = std::string("whether its stream was captured could not be asked (") +
                       cudaGetErrorString(asked) + "): the heuristic's first, untimed";
    return;
  }
  if (capturing != cudaStreamCaptureStatusNone) {
    plan.tuning.note = "made while its stream was captured: the heuristic's first, untimed";
    return;
  }
  struct Scratch {  // freed however the timing ends: stream-ordered, after the GEMMs queued on it
    cudaStream_t stream = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    void* y = nullptr;
    void* workspace = nullptr;
    ~Scratch() {
      if (y) cudaFreeAsync(y, stream);
      if (workspace) cudaFreeAsync(workspace, stream);
      if (start) cudaEventDestroy(start);
      if (stop) cudaEventDestroy(stop);
      if (stream) cudaStreamDestroy(stream);
    }
  };
  std::vector<float> ms;
  try {
    Scratch s;
    TPK_CHECK_CUDA(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    TPK_CHECK_CUDA(cudaEventCreate(&s.start));
    TPK_CHECK_CUDA(cudaEventCreate(&s.stop));
    LinearArgs q = p;
    q.stream = s.stream;
    TPK_CHECK_CUDA(cudaMallocAsync(&s.y, extent(p.m, p.n, p.ldy, p.batch, p.stride_y) * dtype_size(p.dtype),
                                   s.stream));
    q.y = s.y;
    if (p.workspace_bytes > 0) {
      TPK_CHECK_CUDA(cudaMallocAsync(&s.workspace, p.workspace_bytes, s.stream));
      q.workspace = s.workspace;
    }
    for (const cublasLtMatmulHeuristicResult_t& r : proposals)
      ms.push_back(time_algo(h, plan, r.algo, q, t.iters, s.start, s.stop, t.timeout_s, "tuning a GEMM's plan"));
  } catch (const Error& e) {
    cudaGetLastError();
    plan.tuning.note = std::string("its timing failed, the heuristic's first kept: ") + e.what();
    return;
  }
  size_t chosen = 0;
  for (size_t i = 1; i < ms.size(); ++i)
    if (ms[i] > 0 && (ms[chosen] <= 0 || ms[i] < ms[chosen])) chosen = i;
  if (chosen != 0 && ms[0] > 0 && ms[chosen] >= ms[0] * (1.0f - kTuneMargin)) chosen = 0;
  plan.tuning.timed = static_cast<int>(ms.size());
  plan.tuning.first_ms = ms[0];
  plan.tuning.chosen_ms = ms[chosen];
  plan.algo = proposals[chosen].algo;
  plan.waves = proposals[chosen].wavesCount;
  plan.workspace_needed = proposals[chosen].workspaceSize;
}

// The plan of the problem of `p`: the heuristic's first algorithm, or, with tuning on
// (set_gemm_tuning), the fastest of its first proposals (tune).
Plan make_plan(cublasLtHandle_t h, const LinearArgs& p) {
  const Tuning t = g_tuning;
  Plan plan = describe_problem(p);
  const std::vector<cublasLtMatmulHeuristicResult_t> proposals =
      heuristics(h, plan, p, t.candidates > 1 ? t.candidates : 1);
  plan.algo = proposals[0].algo;
  plan.waves = proposals[0].wavesCount;
  plan.workspace_needed = proposals[0].workspaceSize;
  if (t.candidates > 1 && p.m > 0 && p.n > 0 && p.k > 0 && p.batch > 0) tune(h, plan, proposals, p, t);
  return plan;
}

// The plan of the problem of `p` on `device`, made on its first use (g_mutex held).
Plan& plan_for(cublasLtHandle_t h, int device, const LinearArgs& p) {
  Key key{device, p.m, p.n, p.k, p.ldx, p.ldw, p.ldy, static_cast<int>(p.dtype), p.bias != nullptr,
          alignment(p.x, p.batch, p.stride_x, dtype_size(p.dtype)), alignment(p.w),
          alignment(p.y, p.batch, p.stride_y, dtype_size(p.dtype)), p.bias ? alignment(p.bias) : 0, p.workspace_bytes,
          p.w_col_major, p.batch, p.stride_x, p.stride_y};
  auto it = g_plans.find(key);
  if (it == g_plans.end()) it = g_plans.emplace(key, make_plan(h, p)).first;
  return it->second;
}

}  // namespace

std::vector<GemmPlanInfo> gemm_plans() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<GemmPlanInfo> out;
  out.reserve(g_plans.size());
  for (const auto& [key, plan] : g_plans) {
    GemmPlanInfo info;
    info.device = std::get<0>(key);
    info.m = std::get<1>(key);
    info.n = std::get<2>(key);
    info.k = std::get<3>(key);
    info.ldx = std::get<4>(key);
    info.ldw = std::get<5>(key);
    info.ldy = std::get<6>(key);
    info.dtype = static_cast<DType>(std::get<7>(key));
    info.bias = std::get<8>(key);
    info.workspace_bytes = std::get<13>(key);
    info.w_col_major = std::get<14>(key);
    info.batch = std::get<15>(key);
    info.algo = algo_info(plan.algo, plan.waves, plan.workspace_needed);
    info.tuning = plan.tuning;
    out.push_back(info);
  }
  return out;
}

void forget_gemm_plans() {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& [key, plan] : g_plans) release(plan);
  g_plans.clear();
}

void set_gemm_tuning(int candidates, int iters, double timeout_s) {
  if (candidates != 0 && (candidates < 2 || candidates > 32))
    throw ArgumentError("candidates: GEMM tuning times 2 to 32 of cuBLASLt's proposals (0: off), got " +
                        std::to_string(candidates));
  if (iters < 1 || iters > 1000)
    throw ArgumentError("iters: GEMM tuning runs each proposal 1 to 1000 times, got " + std::to_string(iters));
  if (!(timeout_s > 0) || !std::isfinite(timeout_s))
    throw ArgumentError("timeout_s: GEMM tuning waits for its GEMMs at most a positive number of seconds, got " +
                        format_seconds(timeout_s));
  std::lock_guard<std::mutex> lock(g_mutex);
  g_tuning = Tuning{candidates, iters, timeout_s};
}

std::vector<GemmCandidate> gemm_candidates(const LinearArgs& p, int count, int iters, double timeout_s) {
  if (count < 1 || count > 32)
    throw ArgumentError("count: gemm_candidates takes 1 to 32 algorithms, got " + std::to_string(count));
  if (iters < 1) throw ArgumentError("iters: gemm_candidates runs each algorithm at least once, got " +
                                     std::to_string(iters));
  if (!(timeout_s > 0))
    throw ArgumentError("timeout_s: gemm_candidates waits for its GEMMs at most a positive number of seconds, got " +
                        format_seconds(timeout_s));
  if (p.m == 0 || p.n == 0 || p.k == 0 || p.batch == 0)
    throw ArgumentError("x: gemm_candidates times a GEMM with work to do, got m=" + std::to_string(p.m) +
                        " n=" + std::to_string(p.n) + " k=" + std::to_string(p.k));
  std::optional<DeviceGuard> on;
  if (p.device >= 0) on.emplace(p.device);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  TPK_CHECK_CUDA(cudaStreamIsCapturing(p.stream, &capturing));
  if (capturing != cudaStreamCaptureStatusNone)
    throw Error("gemm_candidates: the stream is being captured; it times GEMMs, which a capture cannot");
  int device = 0;
  TPK_CHECK_CUDA(cudaGetDevice(&device));
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulHeuristicResult_t planned{};  // what `linear` runs for this problem: the first candidate
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    h = handle_for(device);
    const Plan& cached = plan_for(h, device, p);
    planned.algo = cached.algo;
    planned.wavesCount = cached.waves;
    planned.workspaceSize = cached.workspace_needed;
  }
  // The descriptors and events of the timing, freed however it ends (an event still pending too:
  // CUDA frees it once it completes)
  struct Timing {
    Plan plan;
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Timing() {
      if (start) cudaEventDestroy(start);
      if (stop) cudaEventDestroy(stop);
      release(plan);
    }
  } timing{describe_problem(p)};
  Plan& plan = timing.plan;
  std::vector<cublasLtMatmulHeuristicResult_t> results{planned};
  for (const cublasLtMatmulHeuristicResult_t& r : heuristics(h, plan, p, count))
    if (static_cast<int>(results.size()) < count && !same_algo(r.algo, planned.algo)) results.push_back(r);
  TPK_CHECK_CUDA(cudaEventCreate(&timing.start));
  TPK_CHECK_CUDA(cudaEventCreate(&timing.stop));
  std::vector<GemmCandidate> out;
  for (const cublasLtMatmulHeuristicResult_t& r : results) {
    GemmCandidate c;
    c.algo = algo_info(r.algo, r.wavesCount, r.workspaceSize);
    // -1 where cuBLASLt would not run it; a CUDA error (the events') is the caller's
    c.ms = time_algo(h, plan, r.algo, p, iters, timing.start, timing.stop, timeout_s, "gemm_candidates");
    out.push_back(c);
  }
  return out;
}

void linear(const LinearArgs& p) {
  if (p.m == 0 || p.n == 0 || p.k == 0 || p.batch == 0) return;  // no work, or an empty sum (see gemm.h)
  std::optional<DeviceGuard> on;
  if (p.device >= 0) on.emplace(p.device);
  int device = 0;
  TPK_CHECK_CUDA(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(g_mutex);
  cublasLtHandle_t h = handle_for(device);
  Plan& plan = plan_for(h, device, p);
  run(h, plan, plan.algo, p);
}

}  // namespace tp_kernels
