// Time on the steady clock for the host's bounded waits, the pause between two polls of one, and
// seconds as their messages write them; internal.
#pragma once

#include <chrono>
#include <sstream>
#include <string>
#include <thread>

namespace tp_kernels {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Between two polls of a host wait (an NCCL state, an event, a queue): a yield for the first
// 1000, then 200 us of sleep each, so that a long wait does not hold a core.
inline void pause_between_polls(int polls) {
  if (polls < 1000)
    std::this_thread::yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(200));
}

inline std::string format_seconds(double s) {
  std::ostringstream out;
  out << s;
  return out.str();
}

}  // namespace tp_kernels
