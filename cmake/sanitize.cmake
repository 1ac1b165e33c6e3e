# VRAMLEDGER_SANITIZE: compiles and links every target (Abseil too, when it is built from source)
# with the named sanitizers. Run through scripts/sanitize.sh, which builds build-asan/ or
# build-tsan/ with only the targets that variant runs.
#
#   address,undefined  AddressSanitizer + UndefinedBehaviorSanitizer: the CPU test suites
#   thread             ThreadSanitizer: the multi-threaded tests
#
# A finding stops the test (-fno-sanitize-recover): UBSan's reports count as failures, not as
# noise in the log. ThreadSanitizer needs every lock's own code instrumented: std::mutex is seen
# through its pthread calls, which the runtime intercepts, but absl::Mutex takes its fast path
# with atomics inside libabsl_synchronization and tells the runtime about it only through
# annotations compiled in when Abseil itself is built with -fsanitize=thread. Debian's libabsl is
# not, so the thread build turns VRAMLEDGER_ABSL_FROM_SOURCE on (the same Abseil release, built
# from source with these flags; CMakeLists.txt).
#
# VRAMLEDGER_NO_UNDEFINED: the link option the shared libraries use to prove that nothing is left
# for the loader to find. Empty where clang sanitizes: clang links its sanitizer runtime into the
# executable only (gcc links libasan.so into every object), so a shared library's calls into the
# runtime are resolved at load time, from the test executable.
set(VRAMLEDGER_NO_UNDEFINED "LINKER:--no-undefined")
if(NOT VRAMLEDGER_SANITIZE)
  return()
endif()
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  set(VRAMLEDGER_NO_UNDEFINED "")
endif()
set(_vl_known address undefined thread)
string(REPLACE "," ";" _vl_sanitizers "${VRAMLEDGER_SANITIZE}")
foreach(_vl_s ${_vl_sanitizers})
  if(NOT _vl_s IN_LIST _vl_known)
    message(FATAL_ERROR "VRAMLEDGER_SANITIZE: unknown sanitizer '${_vl_s}' in "
                        "'${VRAMLEDGER_SANITIZE}'; accepted: address, undefined, thread "
                        "(comma-separated; thread alone)")
  endif()
endforeach()
if("thread" IN_LIST _vl_sanitizers AND NOT VRAMLEDGER_SANITIZE STREQUAL "thread")
  message(FATAL_ERROR "VRAMLEDGER_SANITIZE: thread cannot be combined with other sanitizers "
                      "(got '${VRAMLEDGER_SANITIZE}')")
endif()
if("thread" IN_LIST _vl_sanitizers AND DEFINED VRAMLEDGER_ABSL_FROM_SOURCE
   AND NOT VRAMLEDGER_ABSL_FROM_SOURCE)
  message(FATAL_ERROR "VRAMLEDGER_SANITIZE=thread needs VRAMLEDGER_ABSL_FROM_SOURCE=ON: the "
                      "installed Abseil is not instrumented, so absl::Mutex is invisible to "
                      "ThreadSanitizer and every field it guards would be reported as a race")
endif()
set(_vl_flags -fsanitize=${VRAMLEDGER_SANITIZE} -fno-sanitize-recover=all -fno-omit-frame-pointer)
add_compile_options(${_vl_flags})
add_link_options(${_vl_flags})
message(STATUS "vramledger: sanitizers ${VRAMLEDGER_SANITIZE}")
