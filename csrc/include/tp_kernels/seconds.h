// Time on the steady clock for the host's bounded waits, and seconds as their messages write
// them; internal.
#pragma once

#include <chrono>
#include <sstream>
#include <string>

namespace tp_kernels {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

inline std::string format_seconds(double s) {
  std::ostringstream out;
  out << s;
  return out.str();
}

}  // namespace tp_kernels
