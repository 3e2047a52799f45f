// A tensor-parallel group's NCCL communicator, its communication stream and its watchdog.
//
// The ranks join in NCCL's nonblocking mode, so that no call can block the host forever:
// initialisation and every enqueue are polled against a timeout, and a collective that does not
// complete on the GPU within the timeout (a rank missing or dead) is caught by a watchdog thread,
// which aborts the communicator. The error is then raised by the next call on this communicator
// (and by check()), naming the operation, the rank and the timeout.
//
// In blocking mode (`blocking`: an experiment, off by default) the ops run on a split of that
// communicator made in NCCL's blocking mode: NCCL (2.28) starts a thread for every call of a
// nonblocking communicator, which the caller then polls, where a blocking one launches the call on
// the caller's thread. Its bound is the watchdog's: an enqueue that has not returned within the
// timeout (a peer missing at a connection NCCL makes on first use, or NCCL's queue of work full
// behind a collective that cannot complete) has its communicator revoked (ncclCommRevoke, NCCL
// 2.28.9 and later: the call returns, nothing is freed under it), then aborted by the op's thread.
// That is the failure path only, and NCCL documents no call beside another on one communicator:
// the revoke is how NCCL stops calls in flight, not a promise that the two threads cannot meet.
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

// Whether the NCCL loaded has ncclCommRevoke (2.28.9 and later), which a Communicator in blocking
// mode needs: its watchdog revokes an enqueue blocked past the timeout.
bool nccl_can_revoke();

class Communicator {
 public:
  // Joins the group: every rank of `size` calls this with the same `unique_id`. Runs on `device`.
  // The communication stream gets `stream_priority`, clamped to the device's range (lower is
  // higher priority, as in CUDA). Throws tp_kernels::Error when the peers do not all join within
  // `timeout_s` seconds.
  // `blocking`: the ops' communicator in NCCL's blocking mode (above); throws where this NCCL has
  // no ncclCommRevoke.
  Communicator(const std::string& unique_id, int rank, int size, int device, int stream_priority,
               double timeout_s, bool blocking = false);
  ~Communicator();  // aborts the communicator if close() was not called; never throws
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  int stream_priority() const { return stream_priority_; }
  bool blocking() const { return blocking_; }
  cudaStream_t stream() const { return stream_; }
  // A second stream on the device, of the default priority, that the pipelined primitives' GEMMs
  // may alternate with (OverlapArgs::side_stream): the communicator's, as one op at a time uses it.
  cudaStream_t gemm_stream() const { return gemm_stream_; }
  double timeout_s() const;
  void set_timeout_s(double timeout_s);

  // Throws the error that ended this communicator, if any.
  void check() const;

  // The i-th event of a pool owned by the communicator (created on first use; timing disabled).
  // An op may reuse event i across calls: a stream wait binds to the record made before it.
  cudaEvent_t event(size_t i);

  // Completes an NCCL call: in nonblocking mode polls while it is in progress; throws on error or
  // after the timeout, or when the watchdog revoked a blocking call (the communicator is then
  // aborted).
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

  // One op's hold of the communicator while it enqueues (lock()): in blocking mode the watchdog
  // bounds how long it may take (above).
  class OpLock {
   public:
    OpLock(Communicator& comm, const std::string& what);
    ~OpLock();
    OpLock(const OpLock&) = delete;
    OpLock& operator=(const OpLock&) = delete;

   private:
    Communicator& comm_;
    std::unique_lock<std::mutex> lock_;
  };

  // The NCCL communicator, for one op at a time: hold lock(what) while enqueueing (`what`: the op,
  // as an error names it).
  ncclComm_t nccl() const { return comm_; }
  OpLock lock(const std::string& what) { return OpLock(*this, what); }

  // Flushes outstanding work and destroys the NCCL communicator (bounded by the timeout).
  void close();

 private:
  // " on rank r of p", for error messages (made only when one is)
  std::string where() const;
  // The error of `subject` not done within `limit` seconds: "tp_kernels: <subject> did not complete
  // within <limit> s on rank r of p<how>. A peer rank may be missing, ...; the communicator was
  // <ending>. The limit is set with ..."
  std::string timed_out(const std::string& subject, double limit, const std::string& how,
                        const std::string& ending) const;
  struct Watched {
    cudaEvent_t event;
    std::chrono::steady_clock::time_point start;
    std::string what;
  };

  void fail_locked(const std::string& message);  // record the error, abort; op_mutex_ held
  void record_error(const std::string& message);  // the first error is the one raised
  // Blocking mode: revokes comm_ (once) when an op's enqueue has not returned within the timeout.
  void revoke_overdue_enqueue();
  void watchdog();
  void stop_watchdog();

  int rank_, size_, device_, stream_priority_ = 0;
  bool blocking_ = false;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr, gemm_stream_ = nullptr;
  std::vector<cudaEvent_t> events_;

  std::mutex op_mutex_;  // every use of comm_, its abort included (but a revoke: abort_mutex_)
  std::mutex abort_mutex_;  // comm_'s abort (under op_mutex_) against the watchdog's revoke (without it)
  std::atomic<bool> revoked_{false};
  std::mutex enqueue_mutex_;  // enqueue_since_, enqueue_what_: the op holding op_mutex_, if any
  std::chrono::steady_clock::time_point enqueue_since_;
  std::string enqueue_what_;  // empty: no op holds op_mutex_
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
