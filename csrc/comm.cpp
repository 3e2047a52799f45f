// The NCCL communicator of a group: nonblocking initialisation and enqueues bounded by a timeout
// (or, in blocking mode, enqueues bounded by the watchdog), a prioritised communication stream,
// an event pool and a watchdog thread.
#include "tp_kernels/comm.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>

#include "tp_kernels/check.h"
#include "tp_kernels/detail.h"
#include "tp_kernels/seconds.h"

namespace tp_kernels {
namespace {

using RevokeFn = ncclResult_t (*)(ncclComm_t, int);

// ncclCommRevoke of the NCCL library loaded (2.28.9 and later), else nullptr: looked up at run
// time, since the library loaded may be older than the headers built against.
RevokeFn nccl_revoke() {
  static const RevokeFn fn = [] {
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    void* sym = lib != nullptr ? dlsym(lib, "ncclCommRevoke") : nullptr;
    return reinterpret_cast<RevokeFn>(sym != nullptr ? sym : dlsym(RTLD_DEFAULT, "ncclCommRevoke"));
  }();
  return fn;
}

}  // namespace

bool nccl_can_revoke() { return nccl_revoke() != nullptr; }

std::string nccl_unique_id() {
  ncclUniqueId id;
  TPK_CHECK_NCCL(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

Communicator::Communicator(const std::string& unique_id, int rank, int size, int device, int stream_priority,
                           double timeout_s, bool blocking)
    : rank_(rank), size_(size), device_(device), blocking_(blocking), timeout_s_(timeout_s) {
  if (unique_id.size() != sizeof(ncclUniqueId))
    throw Error("Communicator: unique_id must be " + std::to_string(sizeof(ncclUniqueId)) + " bytes, got " +
                std::to_string(unique_id.size()));
  if (size < 1 || rank < 0 || rank >= size)
    throw Error("Communicator: rank " + std::to_string(rank) + " is not in [0, " + std::to_string(size) + ")");
  if (!(timeout_s > 0)) throw Error("Communicator: timeout_s must be positive");
  if (blocking && nccl_revoke() == nullptr) {
    int version = 0;
    ncclGetVersion(&version);
    throw Error("Communicator: blocking mode needs ncclCommRevoke (NCCL 2.28.9 or later) to bound a blocked call; "
                "this NCCL is " + std::to_string(version) + ". Leave TP_KERNELS_NCCL_BLOCKING unset there.");
  }
  DeviceGuard guard(device);
  int least = 0, greatest = 0;  // CUDA: a lower number is a higher priority
  TPK_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  stream_priority_ = std::min(std::max(stream_priority, greatest), least);
  TPK_CHECK_CUDA(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, stream_priority_));
  if (cudaError_t e = cudaStreamCreateWithFlags(&gemm_stream_, cudaStreamNonBlocking); e != cudaSuccess) {
    cudaStreamDestroy(stream_);
    TPK_CHECK_CUDA(e);
  }

  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; finish() polls it against the timeout
  config.splitShare = 0;  // a blocking split owns its resources: this communicator is destroyed then
  const std::string joining = "joining the NCCL communicator";
  ncclComm_t split = nullptr;
  try {
    auto guard_op = lock(joining);
    finish(ncclCommInitRankConfig(&comm_, size, id, rank, &config), "ncclCommInitRankConfig", joining);
    if (blocking) {
      // The ops' communicator: a split of this one in blocking mode, made as this one's calls are
      // (the split polled on it, nonblocking), then this one finalized with the peers and destroyed.
      ncclConfig_t split_config = NCCL_CONFIG_INITIALIZER;
      split_config.blocking = 1;
      const std::string splitting = "making the NCCL communicator's blocking split";
      // On a nonblocking parent the split runs on NCCL's thread, and ncclCommSplit may return
      // ncclSuccess before it is done (NCCL 2.28.9 did, on an H200: the new communicator not yet
      // written when it returned): finish() polls the parent's state, then the new communicator is
      // waited for in `slot`, which NCCL's thread writes as the split ends. The slot is on the
      // heap, left behind if that wait times out (the thread may still write it).
      auto slot = std::make_unique<ncclComm_t>(nullptr);
      const ncclResult_t started = ncclCommSplit(comm_, 0, rank, slot.get(), &split_config);
      finish(started == ncclSuccess ? ncclInProgress : started, "ncclCommSplit", splitting);
      const Clock::time_point start = Clock::now();
      ncclResult_t state = ncclInProgress;  // the new communicator's, once written
      for (int polls = 0; state == ncclInProgress; ++polls) {
        split = __atomic_load_n(slot.get(), __ATOMIC_ACQUIRE);
        if (split != nullptr && ncclCommGetAsyncError(split, &state) != ncclSuccess) state = ncclInternalError;
        if (state != ncclInProgress) break;
        const double limit = timeout_s_.load();
        if (seconds_since(start) > limit) {
          if (split == nullptr) (void)slot.release();
          fail_locked(timed_out(splitting + ": ncclCommSplit's new communicator", limit, "", "aborted"));
          check();
        }
        pause_between_polls(polls);
      }
      if (state != ncclSuccess) {
        const char* detail = ncclGetLastError(split);
        fail_locked("tp_kernels: " + splitting + ": the new communicator failed" + where() + ": NCCL error " +
                    std::to_string(state) + " (" + ncclGetErrorString(state) + ")" +
                    (detail && *detail ? std::string(": ") + detail : "") + ". The communicator was aborted.");
        check();
      }
      finish(ncclCommFinalize(comm_), "ncclCommFinalize", splitting);
      TPK_CHECK_NCCL(ncclCommDestroy(comm_));
      comm_ = split;
      split = nullptr;
    }
  } catch (...) {
    if (split != nullptr) ncclCommAbort(split);
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    cudaStreamDestroy(stream_);
    cudaStreamDestroy(gemm_stream_);
    throw;
  }
  thread_ = std::thread(&Communicator::watchdog, this);
}

Communicator::~Communicator() {
  stop_watchdog();
  if (comm_ != nullptr) ncclCommAbort(comm_);  // close() was not called: free it without waiting
  for (cudaEvent_t e : events_)
    if (e != nullptr) cudaEventDestroy(e);
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  for (Watched& w : queue_) cudaEventDestroy(w.event);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (gemm_stream_ != nullptr) cudaStreamDestroy(gemm_stream_);
}

double Communicator::timeout_s() const { return timeout_s_.load(); }

void Communicator::set_timeout_s(double timeout_s) {
  if (!(timeout_s > 0)) throw Error("set_timeout_s: timeout_s must be positive");
  timeout_s_.store(timeout_s);
}

void Communicator::check() const {
  std::lock_guard<std::mutex> guard(error_mutex_);
  if (!error_.empty()) throw Error(error_);
}

cudaEvent_t Communicator::event(size_t i) {
  if (i >= events_.size()) events_.resize(i + 1, nullptr);
  if (events_[i] == nullptr) {
    DeviceGuard guard(device_);
    TPK_CHECK_CUDA(cudaEventCreateWithFlags(&events_[i], cudaEventDisableTiming));
  }
  return events_[i];
}

Communicator::OpLock::OpLock(Communicator& comm, const std::string& what) : comm_(comm), lock_(comm.op_mutex_) {
  if (!comm_.blocking_) return;  // (finish() bounds a nonblocking call itself)
  std::lock_guard<std::mutex> guard(comm_.enqueue_mutex_);
  comm_.enqueue_since_ = Clock::now();
  comm_.enqueue_what_ = what;
}

Communicator::OpLock::~OpLock() {
  if (!comm_.blocking_) return;
  std::lock_guard<std::mutex> guard(comm_.enqueue_mutex_);
  comm_.enqueue_what_.clear();
}

void Communicator::record_error(const std::string& message) {
  std::lock_guard<std::mutex> guard(error_mutex_);
  if (error_.empty()) error_ = message;
}

void Communicator::fail_locked(const std::string& message) {
  if (!message.empty()) record_error(message);
  std::lock_guard<std::mutex> guard(abort_mutex_);
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);  // ends NCCL kernels still waiting for a peer, here and in the queue
    comm_ = nullptr;
  }
}

void Communicator::revoke_overdue_enqueue() {
  if (!blocking_ || revoked_.load()) return;
  const double limit = timeout_s_.load();
  std::string what;
  {
    std::lock_guard<std::mutex> guard(enqueue_mutex_);
    if (enqueue_what_.empty() || seconds_since(enqueue_since_) <= limit) return;
    what = enqueue_what_;
  }
  const std::string message =
      timed_out(what, limit, ": an NCCL call blocked the host (the communicator is in blocking mode)",
                "revoked and aborted, and later calls on this group raise this error");
  std::fprintf(stderr, "%s\n", message.c_str());
  record_error(message);
  // Revoked, not aborted: the blocked call returns (NCCL's abort flags), and nothing it uses is
  // freed under it; its thread aborts the communicator then (finish(), under op_mutex_).
  std::lock_guard<std::mutex> guard(abort_mutex_);
  if (comm_ != nullptr && !revoked_.exchange(true)) nccl_revoke()(comm_, 0);
}

std::string Communicator::where() const {
  return " on rank " + std::to_string(rank_) + " of " + std::to_string(size_);
}

std::string Communicator::timed_out(const std::string& subject, double limit, const std::string& how,
                                    const std::string& ending) const {
  return "tp_kernels: " + subject + " did not complete within " + format_seconds(limit) + " s" + where() + how +
         ". A peer rank may be missing, dead, or running a different collective; the communicator was " + ending +
         ". The limit is set with tp_kernels.set_timeout() or TP_KERNELS_TIMEOUT_S.";
}

Communicator::Progress Communicator::progress() const {
  return {finished_.load(), in_progress_.load(), polls_.load(), polling_ns_.load()};
}

void Communicator::finish(ncclResult_t result, const char* call, const std::string& what) {
  const Clock::time_point start = Clock::now();
  finished_.fetch_add(1, std::memory_order_relaxed);
  if (result == ncclInProgress) in_progress_.fetch_add(1, std::memory_order_relaxed);
  int polls = 0;
  for (; result == ncclInProgress; ++polls) {
    double limit = timeout_s_.load();
    if (seconds_since(start) > limit) {
      fail_locked(timed_out(what + ": " + call, limit, "", "aborted"));
      check();
    }
    pause_between_polls(polls);
    if (comm_ == nullptr) break;
    ncclResult_t query = ncclCommGetAsyncError(comm_, &result);
    if (query != ncclSuccess) result = query;
  }
  if (polls > 0) {
    polls_.fetch_add(static_cast<uint64_t>(polls), std::memory_order_relaxed);
    polling_ns_.fetch_add(static_cast<uint64_t>(
                              std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count()),
                          std::memory_order_relaxed);
  }
  if (revoked_.load()) {  // the watchdog revoked the communicator under this call (blocking mode): its error
    fail_locked("");
    check();
  }
  if (result != ncclSuccess) {
    const char* detail = comm_ != nullptr ? ncclGetLastError(comm_) : nullptr;
    fail_locked("tp_kernels: " + what + ": " + call + " failed" + where() + ": NCCL error " + std::to_string(result) +
                " (" + ncclGetErrorString(result) + ")" + (detail && *detail ? std::string(": ") + detail : "") +
                ". The communicator was aborted.");
    check();
  }
}

void Communicator::watch(cudaStream_t stream, const std::string& what) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TPK_CHECK_CUDA(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;  // a graph's replays are the caller's to wait for
  cudaEvent_t e = nullptr;
  {
    std::lock_guard<std::mutex> guard(watch_mutex_);
    if (!free_events_.empty()) {
      e = free_events_.back();
      free_events_.pop_back();
    }
  }
  if (e == nullptr) TPK_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  TPK_CHECK_CUDA(cudaEventRecord(e, stream));
  {
    std::lock_guard<std::mutex> guard(watch_mutex_);
    queue_.push_back(Watched{e, Clock::now(), what});
  }
  watch_cv_.notify_one();
}

void Communicator::watchdog() {
  cudaSetDevice(device_);
  // Querying events must not disturb a CUDA graph capture running in another thread.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  std::unique_lock<std::mutex> lk(watch_mutex_);
  while (!stop_) {
    if (blocking_) {  // an enqueue blocked past the timeout is revoked (its op holds op_mutex_)
      lk.unlock();
      revoke_overdue_enqueue();
      lk.lock();
      if (stop_) break;
    }
    if (queue_.empty()) {
      if (blocking_)
        watch_cv_.wait_for(lk, std::chrono::milliseconds(100));
      else
        watch_cv_.wait(lk);
      continue;
    }
    Watched& w = queue_.front();
    cudaError_t status = cudaEventQuery(w.event);
    if (status == cudaSuccess) {
      free_events_.push_back(w.event);
      queue_.pop_front();
      continue;
    }
    std::string message;
    double limit = timeout_s_.load();
    if (status != cudaErrorNotReady) {
      message = "tp_kernels: " + w.what + ": CUDA error while waiting for it" + where() + ": " +
                cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")";
    } else if (seconds_since(w.start) > limit) {
      message = timed_out(w.what, limit, "", "aborted and later calls on this group raise this error");
    }
    std::string what = w.what;
    lk.unlock();
    bool failed = false;
    {
      // An asynchronous NCCL error (a peer's connection lost) ends the wait early. try_lock: an op
      // being enqueued is not held up by the watchdog (in blocking mode not even past the timeout:
      // an op blocked in NCCL holds the lock until revoke_overdue_enqueue() ends its call).
      std::unique_lock<std::mutex> op(op_mutex_, std::defer_lock);
      if (!message.empty() && !blocking_) op.lock();
      else op.try_lock();
      if (op.owns_lock() && comm_ != nullptr) {
        ncclResult_t state = ncclSuccess;
        if (message.empty() && ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
            state != ncclInProgress)
          message = "tp_kernels: " + what + " failed" + where() + ": NCCL error " + std::to_string(state) + " (" +
                    ncclGetErrorString(state) + "). The communicator was aborted.";
        if (!message.empty()) {
          std::fprintf(stderr, "%s\n", message.c_str());
          fail_locked(message);
          failed = true;
        }
      } else if (op.owns_lock() && !message.empty()) {
        failed = true;  // already aborted: drop the queue
      }
    }
    lk.lock();
    if (failed) {
      for (Watched& q : queue_) free_events_.push_back(q.event);
      queue_.clear();
    } else {
      watch_cv_.wait_for(lk, std::chrono::milliseconds(1));
    }
  }
}

void Communicator::stop_watchdog() {
  {
    std::lock_guard<std::mutex> guard(watch_mutex_);
    stop_ = true;
  }
  watch_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Communicator::close() {
  {
    const std::string closing = "closing the NCCL communicator";
    auto guard = lock(closing);
    check();
    DeviceGuard device(device_);
    if (blocking_) {
      // A blocking ncclCommFinalize would wait for the outstanding work unbounded, and cannot be
      // revoked: the work the watchdog watches is waited for first, within the timeout (past it the
      // watchdog revokes this wait), then the communicator, with nothing left to end, aborted.
      const Clock::time_point start = Clock::now();
      for (int polls = 0;; ++polls) {
        {
          std::lock_guard<std::mutex> watched(watch_mutex_);
          if (queue_.empty()) break;
        }
        if (revoked_.load() || seconds_since(start) > 2 * timeout_s_.load()) {
          fail_locked("tp_kernels: " + closing + ": its outstanding work did not complete" + where() +
                      "; the communicator was aborted");
          check();
        }
        pause_between_polls(polls);
      }
      check();
      std::lock_guard<std::mutex> abort(abort_mutex_);
      ncclCommAbort(comm_);
      comm_ = nullptr;
    } else {
      finish(ncclCommFinalize(comm_), "ncclCommFinalize", closing);
      TPK_CHECK_NCCL(ncclCommDestroy(comm_));
      std::lock_guard<std::mutex> abort(abort_mutex_);
      comm_ = nullptr;
    }
    std::lock_guard<std::mutex> error(error_mutex_);
    error_ = "tp_kernels: this NCCL communicator was closed";
  }
  stop_watchdog();
}

}  // namespace tp_kernels
