// Cheap stack capture for the history: raw native return addresses (absl::GetStackTrace) and
// Python frames of the running interpreter, found at run time through dlsym (no libpython link).
// Thread-safety: every function may be called from any thread; Python frames only under the GIL.
#ifndef VRAMLEDGER_LEDGER_STACK_CAPTURE_H_
#define VRAMLEDGER_LEDGER_STACK_CAPTURE_H_

#include <cstdint>
#include <string>

namespace vramledger {

/// One frame as torch's snapshot shows it: `filename`, `line`, `name` (function).
struct Frame {
  std::string filename;
  int line = 0;
  std::string name;

  bool operator==(const Frame& other) const = default;
};

/// One Python frame as captured: the code object (kept alive by the history once interned, so
/// the pointer identifies it) and the line being executed.
struct PythonFrameRef {
  std::uintptr_t code = 0;
  int line = 0;
};

/// True when this process has a Python interpreter whose frame API was found with dlsym.
/// Resolved once, on first call.
bool PythonFramesAvailable();

/// Writes up to `max_frames` frames of the calling thread's Python stack, innermost first, and
/// returns how many. Returns 0 when the interpreter or its symbols are missing, or when the
/// calling thread does not hold the GIL (PyGILState_Check() != 1). Allocates nothing.
int CapturePythonFrames(PythonFrameRef* out, int max_frames);

/// Takes a reference on the code object `code` (so its address is never reused) and returns
/// its `co_filename` and `co_name` in `filename` / `name` ("??" where unreadable).
/// Pre: the calling thread holds the GIL and `code` came from CapturePythonFrames just now.
void RetainPythonCode(std::uintptr_t code, std::string* filename, std::string* name);

/// Writes up to `max_frames` native return addresses of the calling thread, innermost first,
/// skipping `skip` frames above the caller, and returns how many. Allocates nothing.
int CaptureNativeFrames(std::uintptr_t* out, int max_frames, int skip);

/// Symbolises one native return address: `name` is the demangled function (or "0x<pc>" when
/// unknown), `filename` the shared object or executable holding it, `line` 0. Slow (reads ELF
/// symbol tables); call only when a snapshot is taken.
Frame SymbolizeNativeFrame(std::uintptr_t pc);

}  // namespace vramledger

#endif  // VRAMLEDGER_LEDGER_STACK_CAPTURE_H_
