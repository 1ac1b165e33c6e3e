// The last-error store and the helpers of c_errors.h.
#include "torch_plugin/runtime/c_errors.h"

#include <pthread.h>

#include <cstdlib>
#include <cstring>

namespace vramledger {
namespace {

// The key of each thread's last-error string. A pthread key, not a thread_local string: exit()
// runs the calling thread's thread_local destructors before the process's exit handlers (the
// shim's exit report among them) and torch's late frees, which still report through here, and a
// destroyed string written to corrupts the heap. A key's destructor runs only when a thread
// ends, never at exit(), and a thread that reports again while ending gets a fresh string.
// nullptr when the process has no key left: a thread_local string serves then.
const pthread_key_t* ErrorKey() {
  static pthread_key_t key;
  static const bool created =
      pthread_key_create(&key, [](void* text) { delete static_cast<std::string*>(text); }) == 0;
  return created ? &key : nullptr;
}

}  // namespace

std::string& LastError() {
  const pthread_key_t* key = ErrorKey();
  if (key == nullptr) {
    thread_local std::string fallback;
    return fallback;
  }
  auto* text = static_cast<std::string*>(pthread_getspecific(*key));
  if (text == nullptr) {
    text = new std::string();
    pthread_setspecific(*key, text);
  }
  return *text;
}

int ReportFailure(const absl::Status& status) {
  LastError() = std::string(status.message());
  return absl::IsInvalidArgument(status) ? VRAMLEDGER_INVALID_ARGUMENT : VRAMLEDGER_FAILED;
}

absl::Status ExportString(const std::string& text, char** out) {
  char* copy = static_cast<char*>(std::malloc(text.size() + 1));
  if (copy == nullptr) return absl::ResourceExhaustedError("vramledger: out of host memory");
  std::memcpy(copy, text.c_str(), text.size() + 1);
  *out = copy;
  return absl::OkStatus();
}

}  // namespace vramledger

extern "C" {

const char* vramledger_last_error() { return vramledger::LastError().c_str(); }

void vramledger_string_free(char* s) { std::free(s); }

}  // extern "C"
