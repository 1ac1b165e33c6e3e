# Replays one bundled trace with vramledger-replay and compares its whole output, byte for byte,
# with the recorded one in tests/fixtures/replay-golden/: any change of placement, statistics or
# modelled driver calls shows up here. Run by CTest (tests/tools/CMakeLists.txt) as
#   cmake -DREPLAY=... -DTRACE=... -DCONF=... -DFORMAT=txt|json -DEXPECTED=... -DACTUAL_DIR=...
#         -P replay_golden.cmake (ACTUAL_DIR: where a differing output is written)
# Re-record (only for an intended change of figures): tests/fixtures/replay-golden/README.md.
set(_args "${TRACE}")
if(CONF)
  list(APPEND _args --conf "${CONF}")
endif()
if(FORMAT STREQUAL "json")
  list(APPEND _args --json)
endif()
execute_process(COMMAND "${REPLAY}" ${_args} OUTPUT_VARIABLE _out ERROR_VARIABLE _err
                RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "vramledger-replay ${_args} exited ${_rc}: ${_err}")
endif()
file(READ "${EXPECTED}" _expected)
if(NOT _out STREQUAL _expected)
  get_filename_component(_name "${EXPECTED}" NAME)
  set(_actual "${ACTUAL_DIR}/replay-golden-actual-${_name}")
  file(WRITE "${_actual}" "${_out}")
  message(FATAL_ERROR "replay output differs from ${EXPECTED}\n"
                      "actual output written to ${_actual}; compare with:\n"
                      "  diff ${EXPECTED} ${_actual}")
endif()
