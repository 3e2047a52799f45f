// The CUDA driver's entry points and the kernels' images. See driver.h.
#include "tp_kernels/driver.h"

#include <deque>
#include <mutex>

#include "tp_kernels/check.h"

namespace tp_kernels {

const char* const kKernelNames[static_cast<int>(Kernel::kCount)] = {
    "tpk_wait_flags",       "tpk_set_flags",        "tpk_reduce_partials_float32", "tpk_reduce_partials_float16",
    "tpk_reduce_partials_bfloat16", "tpk_all_reduce_float32", "tpk_all_reduce_float16", "tpk_all_reduce_bfloat16"};

namespace {

constexpr int kNumKernels = static_cast<int>(Kernel::kCount);

// The driver functions _C calls, each with the ABI of CUDA 12.0 (the oldest runtime it builds for).
struct Driver {
  CUresult (*write_value32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_get_id)(CUcontext, unsigned long long*) = nullptr;
  CUresult (*ctx_get_device)(CUdevice*) = nullptr;
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                            void**, void**) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  std::string error;  // the first entry point that could not be found, and why
};

template <typename F>
void lookup(const char* symbol, F* fn, std::string* error) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
  const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &status);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(symbol, &p, cudaEnableDefault, &status);
#endif
  if (err == cudaSuccess && status == cudaDriverEntryPointSuccess && p != nullptr) {
    *fn = reinterpret_cast<F>(p);
    return;
  }
  if (error->empty())
    *error = std::string("the CUDA driver does not provide ") + symbol + " (" + cudaGetErrorString(err) + ")";
  cudaGetLastError();  // leave the runtime's last-error state clean
}

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    lookup("cuStreamWriteValue32", &d.write_value32, &d.error);
    lookup("cuCtxGetCurrent", &d.ctx_get_current, &d.error);
    lookup("cuCtxGetId", &d.ctx_get_id, &d.error);
    lookup("cuCtxGetDevice", &d.ctx_get_device, &d.error);
    lookup("cuModuleLoadData", &d.module_load_data, &d.error);
    lookup("cuModuleGetFunction", &d.module_get_function, &d.error);
    lookup("cuLaunchKernel", &d.launch_kernel, &d.error);
    lookup("cuGetErrorString", &d.get_error_string, &d.error);
  });
  return d;
}

const Driver& usable_driver() {
  const Driver& d = driver();
  if (!d.error.empty()) throw Error(d.error);
  return d;
}

void check_driver(CUresult r, const std::string& call) {
  if (r == CUDA_SUCCESS) return;
  const char* meaning = nullptr;
  if (driver().get_error_string == nullptr || driver().get_error_string(r, &meaning) != CUDA_SUCCESS) meaning = nullptr;
  throw Error(call + " failed: CUDA driver error " + std::to_string(static_cast<int>(r)) + " (" +
              (meaning ? meaning : "unknown") + ")");
}

std::string image_targets() {
  std::string s;
  for (int i = 0; i < kKernelImageCount; ++i) s += std::string(i ? ", " : "") + kKernelImages[i].target;
  return s;
}

// A context's loaded kernels. Never unloaded: they live as long as the process (as the kernels of
// a module nvcc builds do), or as their context. Found by the context's id, unique for the
// process's lifetime: a context made again (after cudaDeviceReset) may get the address of the one
// destroyed, whose modules went with it.
struct Loaded {
  unsigned long long context_id = 0;
  CUfunction fn[kNumKernels] = {};
  int sms = 0;
};

std::mutex loaded_mutex;
std::deque<Loaded> loaded;  // deque: references stay valid as it grows
thread_local const Loaded* last_loaded = nullptr;

const Loaded& current() {
  const Driver& d = usable_driver();
  CUcontext ctx = nullptr;
  check_driver(d.ctx_get_current(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) {  // none on this thread yet: the runtime makes the current device's primary context current
    int device = 0;
    TPK_CHECK_CUDA(cudaGetDevice(&device));
    TPK_CHECK_CUDA(cudaSetDevice(device));
    check_driver(d.ctx_get_current(&ctx), "cuCtxGetCurrent");
    if (ctx == nullptr) throw Error("no CUDA context is current, and cudaSetDevice made none");
  }
  unsigned long long id = 0;
  check_driver(d.ctx_get_id(ctx, &id), "cuCtxGetId");
  const Loaded* hit = last_loaded;
  if (hit != nullptr && hit->context_id == id) return *hit;
  std::lock_guard<std::mutex> lock(loaded_mutex);
  for (const Loaded& l : loaded)
    if (l.context_id == id) return *(last_loaded = &l);
  CUdevice device = 0;
  check_driver(d.ctx_get_device(&device), "cuCtxGetDevice");
  int major = 0, minor = 0;
  Loaded l;
  l.context_id = id;
  TPK_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TPK_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  TPK_CHECK_CUDA(cudaDeviceGetAttribute(&l.sms, cudaDevAttrMultiProcessorCount, device));
  const KernelImage* image = kernel_image_for(major, minor);
  const std::string cc = std::to_string(major) + "." + std::to_string(minor);
  if (image == nullptr)
    throw Error("tp_kernels._C has no kernel image for CUDA device " + std::to_string(device) + " (compute capability " +
                cc + "): it holds " + image_targets() + ". Rebuild it with TP_KERNELS_CUDA_ARCHS=" +
                std::to_string(major * 10 + minor));
  CUmodule module = nullptr;
  check_driver(d.module_load_data(&module, image->data),
               std::string("cuModuleLoadData (tp_kernels' ") + image->target + " image, device compute capability " + cc + ")");
  for (int k = 0; k < kNumKernels; ++k)
    check_driver(d.module_get_function(&l.fn[k], module, kKernelNames[k]),
                 std::string("cuModuleGetFunction(") + kKernelNames[k] + ", " + image->target + ")");
  loaded.push_back(l);
  return *(last_loaded = &loaded.back());
}

}  // namespace

const KernelImage* kernel_image_for(int major, int minor) {
  const int cc = major * 10 + minor;
  const KernelImage* cubin = nullptr;
  const KernelImage* ptx = nullptr;
  for (int i = 0; i < kKernelImageCount; ++i) {
    const KernelImage& im = kKernelImages[i];
    if (im.arch > cc || (im.arch_specific && im.arch != cc)) continue;
    if (im.ptx) {
      if (ptx == nullptr || im.arch > ptx->arch) ptx = &im;
    } else if (im.arch / 10 == major && (cubin == nullptr || im.arch > cubin->arch)) {
      cubin = &im;
    }
  }
  return cubin != nullptr ? cubin : ptx;
}

const std::string& driver_error() { return driver().error; }

void stream_write_value32(uint32_t* address, uint32_t value, cudaStream_t stream) {
  const CUresult r = usable_driver().write_value32(reinterpret_cast<CUstream>(stream),
                                                   reinterpret_cast<CUdeviceptr>(address), value,
                                                   CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS) check_driver(r, "cuStreamWriteValue32");
}

void load_kernels() { current(); }

void launch(Kernel kernel, unsigned grid, unsigned block, void** args, cudaStream_t stream) {
  const Loaded& l = current();
  const int k = static_cast<int>(kernel);
  const CUresult r =
      driver().launch_kernel(l.fn[k], grid, 1, 1, block, 1, 1, 0, reinterpret_cast<CUstream>(stream), args, nullptr);
  if (r != CUDA_SUCCESS) check_driver(r, std::string("cuLaunchKernel(") + kKernelNames[k] + ")");  // (no message made per launch)
}

int multiprocessor_count() { return current().sms; }

}  // namespace tp_kernels
