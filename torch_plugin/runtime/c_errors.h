// Error reporting across the C ABI, for every route: the status codes, the calling thread's one
// last-error message, the catch-all that turns a status or an exception into a code, and strings
// handed to the caller. Thread-safety: the message is per thread; everything else is stateless.
#ifndef VRAMLEDGER_TORCH_PLUGIN_RUNTIME_C_ERRORS_H_
#define VRAMLEDGER_TORCH_PLUGIN_RUNTIME_C_ERRORS_H_

#define VRAMLEDGER_EXPORT __attribute__((visibility("default")))

extern "C" {

/// Status codes of the ctypes-facing functions (0 on success).
enum vramledger_status {
  VRAMLEDGER_OK = 0,
  VRAMLEDGER_INVALID_ARGUMENT = 1,  // bad options or arguments: Python raises ValueError
  VRAMLEDGER_FAILED = 2,            // anything else (driver error, wrong state): RuntimeError
  // A refusal for memory from the calls that say so (region_api.h): torch.OutOfMemoryError.
  VRAMLEDGER_OUT_OF_MEMORY = 3,
};

/// The message of the last failure on the calling thread ("" if none). Valid until the next
/// vramledger call on this thread.
VRAMLEDGER_EXPORT const char* vramledger_last_error();

/// Releases a string a vramledger function returned (malloc'd). NULL is a no-op.
VRAMLEDGER_EXPORT void vramledger_string_free(char* s);

}  // extern "C"

#ifdef __cplusplus
#include <cxxabi.h>
#include <exception>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace vramledger {

/// The calling thread's message for vramledger_last_error(). Exported, so that the torch-native
/// library, which links the plugin, reports into the same store.
VRAMLEDGER_EXPORT std::string& LastError();

/// Records `status`'s message as the last error and returns its code: VRAMLEDGER_INVALID_ARGUMENT
/// for InvalidArgument, VRAMLEDGER_FAILED for any other failure.
VRAMLEDGER_EXPORT int ReportFailure(const absl::Status& status);

/// Runs the body of a ctypes-facing function (`fn` returns an absl::Status): clears the last
/// error, returns VRAMLEDGER_OK on success, else ReportFailure's code; an exception becomes
/// VRAMLEDGER_FAILED with "vramledger: <what>". Throws nothing but abi::__forced_unwind, the
/// unwinding of a thread that pthread_exit or pthread_cancel ends (Python ends a thread that
/// waits for the GIL while the interpreter finalizes that way): it is not an error but the
/// thread's end, and must run on. Swallowing it aborts the process ("FATAL: exception not
/// rethrown"), and a noexcept frame on its path terminates it ("terminate called without an
/// active exception"), so every catch-all here rethrows it and none of these is noexcept.
template <typename Fn>
int CatchAll(Fn fn) {
  try {
    LastError().clear();
    const absl::Status s = fn();
    return s.ok() ? VRAMLEDGER_OK : ReportFailure(s);
  } catch (const std::exception& e) {
    LastError() = absl::StrCat("vramledger: ", e.what());
  } catch (const abi::__forced_unwind&) {
    throw;  // a thread's exit or cancellation unwinds on (c_errors.h)
  } catch (...) {
    LastError() = "vramledger: unknown C++ exception";
  }
  return VRAMLEDGER_FAILED;
}

/// Copies `text` into a malloc'd string in *out for the caller (vramledger_string_free releases
/// it); ResourceExhausted when host memory is exhausted.
absl::Status ExportString(const std::string& text, char** out);

}  // namespace vramledger
#endif  // __cplusplus

#endif  // VRAMLEDGER_TORCH_PLUGIN_RUNTIME_C_ERRORS_H_
