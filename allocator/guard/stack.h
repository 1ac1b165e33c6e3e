// Stacks for refusal messages: the frame type, the interface through which a history symbolises
// the context id it captured, a provider of live Python frames, and native frames in that type.
// Thread-safety: CaptureNativeFrames is thread-safe; implementations say their own.
#ifndef VRAMLEDGER_GUARD_STACK_H_
#define VRAMLEDGER_GUARD_STACK_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace vramledger::guard {

/// One frame: a Python frame (file, line, function) or a native one (module as `file`, line 0,
/// symbol as `function`).
struct StackFrame {
  std::string file;
  int line = 0;
  std::string function;
  bool python = false;
};

/// Turns a context id returned by AllocatorHooks::CaptureContext into frames. The memory history
/// implements it; the guard asks it first when it builds a refusal message.
class StackSymbolizer {
 public:
  virtual ~StackSymbolizer() = default;
  /// Frames of `context`, innermost first (Python frames, then native ones); empty when the id
  /// is 0 or unknown. Called outside the allocator lock, on the refusing thread.
  virtual std::vector<StackFrame> Symbolize(std::uint64_t context) = 0;
};

/// Returns the Python frames of the calling thread, innermost first (user frames before library
/// ones is the provider's choice); empty when the thread runs no Python. Called outside the
/// allocator lock, on the refusing thread, only when a refusal is reported.
using PythonStackProvider = std::function<std::vector<StackFrame>()>;

/// Native frames of the calling thread, innermost first, at most `max_frames`, skipping the
/// `skip` innermost (CaptureNativeFrames itself is always skipped). Captured and symbolised by the
/// ledger's capturer (ledger/stack_capture.h); `file` is the module's file name without its
/// directory (empty when unknown), `function` the symbol, else the address.
std::vector<StackFrame> CaptureNativeFrames(int skip, int max_frames);

/// "train.py:42 in forward" or "libtorch_cuda.so: at::native::empty_cuda(...)".
std::string FormatFrame(const StackFrame& frame);

}  // namespace vramledger::guard

#endif  // VRAMLEDGER_GUARD_STACK_H_
