// The last-error store and the helpers of c_errors.h.
#include "torch_plugin/runtime/c_errors.h"

#include <cstdlib>
#include <cstring>

namespace vramledger {

std::string& LastError() {
  thread_local std::string error;
  return error;
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
