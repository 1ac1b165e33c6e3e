# vramledger-replay with a plan: a refusal is reported (trace line, plan line and rule) with exit
# status 1, --plan-keep-going counts each, a plan that holds exits 0, a bad plan file exits 2
# naming it; --ignore-releases keeps the trace's release out of the replay. Run by CTest as
#   cmake -DREPLAY=... -DWORK_DIR=... -P replay_plan_exit.cmake
file(MAKE_DIRECTORY "${WORK_DIR}")
set(_trace "${WORK_DIR}/over-plan.csv")
file(WRITE "${_trace}" "action,addr,size,stream,time_us\n"
                       "alloc,4096,629145600,0,1\n"
                       "alloc,8589934592,629145600,0,2\n"
                       "free_completed,8589934592,629145600,0,3\n"
                       "alloc,17179869184,629145600,0,4\n"
                       "free_completed,4096,629145600,0,5\n"
                       "segment_free,4096,629145600,0,6\n")
file(WRITE "${WORK_DIR}/small.json" "{\n  \"limit\": \"1GiB\"\n}\n")
file(WRITE "${WORK_DIR}/roomy.json" "{\"limit\": \"4GiB\"}\n")
file(WRITE "${WORK_DIR}/bad.json" "{\n  \"limit\": \"1 parsec\"\n}\n")

function(run_replay expected_rc)
  execute_process(COMMAND "${REPLAY}" "${_trace}" ${ARGN} OUTPUT_VARIABLE _out
                  ERROR_VARIABLE _err RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL expected_rc)
    message(FATAL_ERROR "vramledger-replay ${ARGN}: exit ${_rc}, expected ${expected_rc}\n"
                        "${_out}\n${_err}")
  endif()
  set(out "${_out}${_err}" PARENT_SCOPE)
endfunction()

function(expect text)
  string(FIND "${out}" "${text}" _at)
  if(_at EQUAL -1)
    message(FATAL_ERROR "missing '${text}' in:\n${out}")
  endif()
endfunction()

run_replay(1 --conf "plan:${WORK_DIR}/small.json")
expect("refusal 1 at ${_trace}:3 (trace event 2): alloc,8589934592,629145600,0,2")
expect("vramledger plan violation: ${WORK_DIR}/small.json:2: limit: ")
expect("live bytes by category (current / plan):")
expect("refusals: 1 (the replay stopped at the first)")
run_replay(1 --conf "plan:${WORK_DIR}/small.json" --plan-keep-going --json)
expect("\"refusals\": 2")
run_replay(0 --conf "plan:${WORK_DIR}/roomy.json")
expect("refusals: 0; warn_at warnings: 0")
expect("applied 1 (the replay's cache emptied there")
run_replay(0 --ignore-releases)
expect("not applied (--ignore-releases): the replay kept its cache")
run_replay(2 --conf "plan:${WORK_DIR}/bad.json")
expect("vramledger-replay: error: ${WORK_DIR}/bad.json:2: field 'limit'")
