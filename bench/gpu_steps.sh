# The steps of the GPU suite (sourced by bench/gpu_suite.sh and bench/gpu_profile.sh), each under
# its own time limit and under the call's budget, so that a call ends, its records written, inside
# the call that runs it:
#
#   budget_s     seconds the whole call may take, counted by bash's SECONDS from its start
#   reserve_s    seconds kept back at the end for the records and the copy of the logs
#   logs         the folder of the part's logs: LOGS/NAME.log per step, LOGS/status.txt a line
#                per step ("NAME STATUS SECONDS")
#   LOGS_ROOT    the folder of every part's logs (LOGS itself when unset)
#   OUT          when set, the logs are copied there (as LOGS_TARBALL) after every step, so that a
#                call stopped from outside still returns what ran
#
# The exit statuses a step records are its command's, or 124 (stopped at its limit) or 125 (not
# started: the budget was spent).
NOT_STARTED=125

# seconds_left: what the budget leaves for steps now
seconds_left() {
  echo $((budget_s - reserve_s - SECONDS))
}

# step_limit LIMIT_S: LIMIT_S, or what the budget leaves for steps when that is less
step_limit() {
  local left
  left=$(seconds_left)
  echo $(($1 < left ? $1 : left))
}

# step NAME LIMIT_S COMMAND...: run COMMAND for at most LIMIT_S seconds (fewer when the budget has
# fewer left), its output to LOGS/NAME.log and the terminal, its exit status to LOGS/status.txt.
# At the limit the command gets SIGINT, so that pytest and the benchmarks stop as on Ctrl-C and
# write what they have (pytest its summary and junit XML), then SIGKILL 15 s later.
step() {
  local name=$1 limit=$2
  shift 2
  local left
  left=$(seconds_left)
  if [ "$left" -lt 5 ]; then
    echo "== $name: not started, the call's budget of ${budget_s} s is spent" >&2
    echo "$name $NOT_STARTED 0" >>"$logs/status.txt"
    save_logs
    return 0
  fi
  limit=$(step_limit "$limit")
  echo "== $name (at most ${limit} s; ${SECONDS} s so far)"
  local start=$SECONDS
  timeout -s INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$logs/$name.log"
  local status=${PIPESTATUS[0]}
  echo "$name $status $((SECONDS - start))" >>"$logs/status.txt"
  [ "$status" -eq 124 ] && echo "$name: stopped after ${limit} s" >&2
  save_logs
  return 0
}

# save_logs: the logs so far, every part's, as one tarball in OUT (when OUT is set)
save_logs() {
  if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/$LOGS_TARBALL" -C "${LOGS_ROOT:-$logs}" .
  fi
  return 0
}
