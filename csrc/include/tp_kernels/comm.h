// A tensor-parallel group's NCCL communicator, its communication stream and its watchdog.
//
// The communicator is created in NCCL's nonblocking mode, so that no call can block the host
// forever: initialisation and every enqueue are polled against a timeout, and a collective that
// does not complete on the GPU within the timeout (a rank missing or dead) is caught by a
// watchdog thread, which aborts the communicator. The error is then raised by the next call on
// this communicator (and by check()), naming the operation, the rank and the timeout.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tp_kernels {

// A new NCCL unique id (the bytes of ncclUniqueId), made by one rank and sent to the others.
std::string nccl_unique_id();

class Communicator {
 public:
  // Joins the group: every rank of `size` calls this with the same `unique_id`. Runs on `device`.
  // The communication stream gets `stream_priority`, clamped to the device's range (lower is
  // higher priority, as in CUDA). Throws tp_kernels::Error when the peers do not all join within
  // `timeout_s` seconds.
  Communicator(const std::string& unique_id, int rank, int size, int device, int stream_priority,
               double timeout_s);
  ~Communicator();  // aborts the communicator if close() was not called; never throws
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  int stream_priority() const { return stream_priority_; }
  cudaStream_t stream() const { return stream_; }
  double timeout_s() const;
  void set_timeout_s(double timeout_s);

  // Throws the error that ended this communicator, if any.
  void check() const;

  // The i-th event of a pool owned by the communicator (created on first use; timing disabled).
  // An op may reuse event i across calls: a stream wait binds to the record made before it.
  cudaEvent_t event(size_t i);

  // Completes an NCCL call made in nonblocking mode: polls while it is in progress, throws on
  // error or after the timeout (the communicator is then aborted).
  void finish(ncclResult_t result, const char* call, const std::string& what);

  // What finish() has seen since the communicator was made: the NCCL calls it completed, how many
  // of them returned ncclInProgress, its polls of those, and the host time it spent polling them.
  struct Progress {
    uint64_t calls, in_progress, polls, polling_ns;
  };
  Progress progress() const;

  // After an op has enqueued its last communication on `stream`: unless the stream is being
  // captured in a CUDA graph, the watchdog checks that this work completes within the timeout.
  void watch(cudaStream_t stream, const std::string& what);

  // The NCCL communicator, for one op at a time: hold lock() while enqueueing.
  ncclComm_t nccl() const { return comm_; }
  std::unique_lock<std::mutex> lock() { return std::unique_lock<std::mutex>(op_mutex_); }

  // Flushes outstanding work and destroys the NCCL communicator (bounded by the timeout).
  void close();

 private:
  // " on rank r of p", for error messages (made only when one is)
  std::string where() const;
  struct Watched {
    cudaEvent_t event;
    std::chrono::steady_clock::time_point start;
    std::string what;
  };

  void fail_locked(const std::string& message);  // record the error, abort; op_mutex_ held
  void watchdog();
  void stop_watchdog();

  int rank_, size_, device_, stream_priority_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;

  std::mutex op_mutex_;  // every use of comm_, its abort included
  mutable std::mutex error_mutex_;
  std::string error_;
  std::atomic<double> timeout_s_;
  std::atomic<uint64_t> finished_{0}, in_progress_{0}, polls_{0}, polling_ns_{0};  // progress()

  std::mutex watch_mutex_;  // queue_, free_events_, stop_
  std::condition_variable watch_cv_;
  std::deque<Watched> queue_;
  std::vector<cudaEvent_t> free_events_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tp_kernels
