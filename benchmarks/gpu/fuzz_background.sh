# Sourced by benchmarks/gpu/run.sh when FUZZ_BACKGROUND_S is set: scripts/fuzz_long.sh runs
# allocator_ops_fuzz on the CPU cores the GPU items leave idle, started before the items and
# collected after them (run.sh's header lists the variables). Uses run.sh's BUDGET, OUT, RUN,
# ROOT, ORDER, RESULT and SECONDS_TAKEN.

# Starts the run in the background; its output goes to $RUN/fuzz_long.log.
fuzz_start() {
  local seconds=$FUZZ_BACKGROUND_S jobs=${FUZZ_JOBS:-$(( $(nproc) > 5 ? $(nproc) - 4 : 1 ))}
  (( seconds > BUDGET - 30 )) && seconds=$(( BUDGET - 30 ))
  FUZZ_DIR="$OUT/fuzz-long"
  rm -rf "$FUZZ_DIR"
  mkdir -p "$FUZZ_DIR"
  echo "==== fuzz_long (background): $seconds s, $jobs jobs, ${FUZZ_BINARY:-.devbuild/fuzz/allocator_ops_fuzz}"
  FUZZ_T0=$(date +%s)
  nice -n 10 bash "$ROOT/scripts/fuzz_long.sh" run --seconds "$seconds" --jobs "$jobs" \
    --out "$FUZZ_DIR" --binary "${FUZZ_BINARY:-$ROOT/.devbuild/fuzz/allocator_ops_fuzz}" \
    ${FUZZ_CORPUS:+--corpus "$FUZZ_CORPUS"} >"$RUN/fuzz_long.log" 2>&1 &
  FUZZ_PID=$!
}
# Waits for the run, adds its row to the table and packs its outputs into $OUT/fuzz-long.tar.gz.
fuzz_collect() {
  local rc=0
  echo "==== fuzz_long: waiting for the background run"
  wait "$FUZZ_PID" || rc=$?
  ORDER+=(fuzz_long)
  SECONDS_TAKEN[fuzz_long]=$(( $(date +%s) - FUZZ_T0 ))
  local line
  line="$(grep -E '^fuzz_long' "$RUN/fuzz_long.log" | tail -1 | sed 's/^fuzz_long [a-z_]*: //')"
  case "$rc" in
    0) RESULT[fuzz_long]="PASS: $line" ;;
    *) RESULT[fuzz_long]="FAIL: exit $rc${line:+: $line}" ;;
  esac
  tar czf "$OUT/fuzz-long.tar.gz" -C "$OUT" fuzz-long && rm -rf "$FUZZ_DIR"
}
