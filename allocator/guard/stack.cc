// Native frames for refusal messages, taken with the ledger's capturer (ledger/stack_capture.h,
// the one place that unwinds and symbolises) and shown by module name; and frame formatting.
// Used only when a refusal is reported, never on the allocation path.
#include "guard/stack.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/strings/str_cat.h"
#include "ledger/stack_capture.h"

namespace vramledger::guard {

// Not inlined: `skip` counts this function as one frame.
ABSL_ATTRIBUTE_NOINLINE std::vector<StackFrame> CaptureNativeFrames(int skip, int max_frames) {
  std::vector<StackFrame> frames;
  if (max_frames <= 0) return frames;
  std::vector<std::uintptr_t> pcs(static_cast<std::size_t>(max_frames));
  // skip + 1: this function as well as the `skip` frames its caller asked to leave out.
  const int depth = vramledger::CaptureNativeFrames(pcs.data(), max_frames, skip + 1);
  frames.reserve(static_cast<std::size_t>(depth));
  for (int i = 0; i < depth; ++i) {
    Frame native = SymbolizeNativeFrame(pcs[static_cast<std::size_t>(i)]);
    StackFrame f;
    f.function = std::move(native.name);
    if (native.filename != "??") {  // the module by its file name only, as refusals show it
      const std::size_t slash = native.filename.rfind('/');
      f.file = slash == std::string::npos ? native.filename : native.filename.substr(slash + 1);
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
