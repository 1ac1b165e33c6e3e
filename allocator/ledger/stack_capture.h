// Cheap stack capture for the history: raw native return addresses (glibc backtrace()) and
// Python frames of the running interpreter, found at run time through dlsym (no libpython link).
// Thread-safety: any thread; Python frames are read under the GIL (taken if the thread has none).
#ifndef VRAMLEDGER_LEDGER_STACK_CAPTURE_H_
#define VRAMLEDGER_LEDGER_STACK_CAPTURE_H_

#include <cstdint>
#include <string>
#include <vector>

namespace vramledger {

/// One frame as torch's snapshot shows it: `filename`, `line`, `name` (function), plus whether
/// it is a Python frame (native frames: the shared object as filename, line 0).
struct Frame {
  std::string filename;
  int line = 0;
  std::string name;
  bool python = false;

  bool operator==(const Frame& other) const = default;
};

/// One Python frame as captured: the code object (kept alive by the history once interned, so
/// the pointer identifies it) and where it executes: the instruction offset in bytes
/// (PyFrame_GetLasti, Python >= 3.11; turned into a line by ResolvePythonLines when a snapshot
/// is taken, which saves the line-table walk on every allocation) or, on older Pythons, the line.
struct PythonFrameRef {
  std::uintptr_t code = 0;
  int position = 0;
};

/// When a thread that does not hold the GIL may take it to read its own Python frames.
enum class PythonGilPolicy {
  /// Any thread with a Python thread state (the plugin's default, as torch's own recorder does:
  /// torch's operators release the GIL before they allocate).
  kAnyThreadWithState,
  /// Only the process's main thread (the one that released the GIL for a torch operator);
  /// other threads without the GIL, autograd's among them, give no Python frames and never wait
  /// for the GIL. The LD_PRELOAD shim's choice (docs/design/preload-python-frames.md).
  kMainThreadOnly,
};

/// Sets the policy for PythonStackCapture and CaptureLivePythonFrames (process-wide; a thread
/// that holds the GIL always walks its frames). Thread-safe.
void SetPythonGilPolicy(PythonGilPolicy policy);

/// True when this process has a Python interpreter whose frame API was found with dlsym.
/// Resolved once, on first call.
bool PythonFramesAvailable();

/// Captures up to `max_frames` frames of the calling thread's Python stack, innermost first,
/// into `out`, and holds the GIL until destroyed so that RetainPythonCode can run meanwhile.
/// A thread holding the GIL walks at once. A thread with a Python thread state that released
/// the GIL (torch's operators do so before they allocate) takes it with PyGILState_Ensure for
/// the walk, as torch's own recorder does; threads that never ran Python, a missing interpreter
/// or missing symbols, and interpreter finalisation give 0 frames and take nothing.
/// Pre: the caller holds no lock that a thread holding the GIL could wait for.
class PythonStackCapture {
 public:
  PythonStackCapture(PythonFrameRef* out, int max_frames);
  ~PythonStackCapture();
  PythonStackCapture(const PythonStackCapture&) = delete;
  PythonStackCapture& operator=(const PythonStackCapture&) = delete;
  /// Frames captured.
  int size() const { return size_; }

 private:
  int size_ = 0;
  bool acquired_ = false;  // the GIL was taken here and is released by the destructor
  int gil_state_ = 0;      // PyGILState_STATE
};

/// The source line of each of `frames` (same order), computed with PyCode_Addr2Line under the
/// GIL (taken with PyGILState_Ensure and given back). `lines` is resized to match. Lines are 0
/// when the interpreter is gone or finalising. Pre: the code objects were retained and the
/// caller holds no lock that a thread holding the GIL could wait for.
void ResolvePythonLines(const std::vector<PythonFrameRef>& frames, std::vector<int>* lines);

/// Takes a reference on the code object `code` (so its address is never reused) and returns
/// its `co_filename` and `co_name` in `filename` / `name` ("??" where unreadable).
/// Pre: the calling thread holds the GIL (a PythonStackCapture is alive) and `code` came from
/// that capture.
void RetainPythonCode(std::uintptr_t code, std::string* filename, std::string* name);

/// The calling thread's Python frames, innermost first, at most `max_frames`, read at once
/// (file, line and function; `python` true). Takes the GIL like PythonStackCapture when the
/// thread has a Python thread state but released the GIL (torch's operators do), and gives it
/// back before returning; a thread without Python, a missing interpreter and finalisation give
/// none. Leaves any pending Python exception as it was. Slow (one attribute lookup per frame);
/// for reports, not the allocation path.
/// Pre: the caller holds no lock that a thread holding the GIL could wait for.
std::vector<Frame> CaptureLivePythonFrames(int max_frames);

/// Writes up to `max_frames` native return addresses of the calling thread, innermost first,
/// skipping `skip` frames above the caller, and returns how many. Allocates nothing after the
/// first call in the process (which loads libgcc_s for the unwinder).
int CaptureNativeFrames(std::uintptr_t* out, int max_frames, int skip);

/// Symbolises one native return address: `name` is the demangled function (or "0x<pc>" when
/// unknown), `filename` the shared object or executable holding it, `line` 0. Slow (reads ELF
/// symbol tables); call only when a snapshot is taken.
Frame SymbolizeNativeFrame(std::uintptr_t pc);

}  // namespace vramledger

#endif  // VRAMLEDGER_LEDGER_STACK_CAPTURE_H_
