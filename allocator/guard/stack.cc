// Native stack capture (glibc backtrace, which unwinds with .eh_frame and so needs no frame
// pointers; absl::Symbolize for names, dladdr for modules) and
// frame formatting. Used only when a refusal is reported, never on the allocation path.
#include "guard/stack.h"

#include <dlfcn.h>
#include <execinfo.h>

#include <cstdint>
#include <string>

#include "absl/debugging/symbolize.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace vramledger::guard {

std::vector<StackFrame> CaptureNativeFrames(int skip, int max_frames) {
  std::vector<StackFrame> frames;
  if (max_frames <= 0) return frames;
  std::vector<void*> pcs(static_cast<std::size_t>(max_frames + skip + 1));
  const int depth = backtrace(pcs.data(), static_cast<int>(pcs.size()));
  for (int i = skip + 1; i < depth; ++i) {
    StackFrame f;
    // A return address points after the call; look up the call itself.
    void* pc = static_cast<char*>(pcs[i]) - 1;
    char symbol[1024];
    if (absl::Symbolize(pc, symbol, sizeof(symbol))) {
      f.function = symbol;
    } else {
      f.function = absl::StrFormat("0x%x", reinterpret_cast<std::uintptr_t>(pcs[i]));
    }
    Dl_info info;
    if (dladdr(pc, &info) != 0 && info.dli_fname != nullptr) {
      std::string module = info.dli_fname;
      const std::size_t slash = module.rfind('/');
      f.file = slash == std::string::npos ? module : module.substr(slash + 1);
    }
    frames.push_back(std::move(f));
  }
  return frames;
}

std::string FormatFrame(const StackFrame& frame) {
  if (frame.python) return absl::StrCat(frame.file, ":", frame.line, " in ", frame.function);
  if (frame.file.empty()) return frame.function;
  return absl::StrCat(frame.file, ": ", frame.function);
}

}  // namespace vramledger::guard
