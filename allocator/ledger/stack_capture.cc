// Native frames via glibc's unwinder and Abseil's symboliser; Python frames via the interpreter's
// C API found once with dlsym(RTLD_DEFAULT). Stateless apart from that table of functions.
#include "ledger/stack_capture.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/debugging/symbolize.h"

namespace vramledger {
namespace {

// The part of the CPython C API the capture needs. Every object is an opaque pointer; the
// functions are exported by any CPython >= 3.9 (the frame accessors appeared in 3.9).
struct PythonApi {
  using IntFn = int (*)();
  using ObjFn = void* (*)();
  using ObjObjFn = void* (*)(void*);
  using IntObjFn = int (*)(void*);
  using RefFn = void (*)(void*);
  using GetAttrFn = void* (*)(void*, const char*);
  using Utf8Fn = const char* (*)(void*);
  using VoidFn = void (*)();
  using FetchFn = void (*)(void**, void**, void**);
  using RestoreFn = void (*)(void*, void*, void*);

  IntFn is_initialized = nullptr;     // Py_IsInitialized
  IntFn gil_check = nullptr;          // PyGILState_Check
  ObjFn this_thread_state = nullptr;  // PyGILState_GetThisThreadState
  IntFn gil_ensure = nullptr;         // PyGILState_Ensure (returns an enum)
  using ReleaseFn = void (*)(int);
  ReleaseFn gil_release = nullptr;         // PyGILState_Release
  IntFn is_finalizing = nullptr;           // Py_IsFinalizing / _Py_IsFinalizing (optional)
  ObjFn thread_state_unchecked = nullptr;  // PyThreadState_GetUnchecked (optional)
  ObjFn get_frame = nullptr;               // PyEval_GetFrame (borrowed)
  ObjObjFn frame_back = nullptr;           // PyFrame_GetBack (new reference)
  ObjObjFn frame_code = nullptr;           // PyFrame_GetCode (new reference)
  IntObjFn frame_line = nullptr;           // PyFrame_GetLineNumber
  IntObjFn frame_lasti = nullptr;          // PyFrame_GetLasti (3.11+, optional)
  using Addr2LineFn = int (*)(void*, int);
  Addr2LineFn addr2line = nullptr;  // PyCode_Addr2Line (optional)
  RefFn incref = nullptr;           // Py_IncRef
  RefFn decref = nullptr;           // Py_DecRef
  GetAttrFn getattr = nullptr;      // PyObject_GetAttrString
  Utf8Fn as_utf8 = nullptr;         // PyUnicode_AsUTF8
  VoidFn err_clear = nullptr;       // PyErr_Clear
  FetchFn err_fetch = nullptr;      // PyErr_Fetch (optional)
  RestoreFn err_restore = nullptr;  // PyErr_Restore (optional)
  bool complete = false;            // every required symbol was found
};

template <typename Fn>
void Resolve(const char* name, Fn* fn) {
  *fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}

PythonApi LoadPythonApi() {
  PythonApi api;
  Resolve("Py_IsInitialized", &api.is_initialized);
  Resolve("PyGILState_Check", &api.gil_check);
  Resolve("PyGILState_GetThisThreadState", &api.this_thread_state);
  Resolve("PyGILState_Ensure", &api.gil_ensure);
  Resolve("PyGILState_Release", &api.gil_release);
  Resolve("Py_IsFinalizing", &api.is_finalizing);  // 3.13+
  if (api.is_finalizing == nullptr) Resolve("_Py_IsFinalizing", &api.is_finalizing);
  Resolve("PyThreadState_GetUnchecked", &api.thread_state_unchecked);  // 3.13+
  if (api.thread_state_unchecked == nullptr) {
    Resolve("_PyThreadState_UncheckedGet", &api.thread_state_unchecked);  // 3.5-3.12
  }
  Resolve("PyEval_GetFrame", &api.get_frame);
  Resolve("PyFrame_GetBack", &api.frame_back);
  Resolve("PyFrame_GetCode", &api.frame_code);
  Resolve("PyFrame_GetLineNumber", &api.frame_line);
  Resolve("PyFrame_GetLasti", &api.frame_lasti);
  Resolve("PyCode_Addr2Line", &api.addr2line);
  if (api.frame_lasti == nullptr || api.addr2line == nullptr) {
    api.frame_lasti = nullptr;  // positions are lines (Python < 3.11)
    api.addr2line = nullptr;
  }
  Resolve("Py_IncRef", &api.incref);
  Resolve("Py_DecRef", &api.decref);
  Resolve("PyObject_GetAttrString", &api.getattr);
  Resolve("PyUnicode_AsUTF8", &api.as_utf8);
  Resolve("PyErr_Clear", &api.err_clear);
  Resolve("PyErr_Fetch", &api.err_fetch);
  Resolve("PyErr_Restore", &api.err_restore);
  api.complete = api.is_initialized != nullptr && api.gil_check != nullptr &&
                 api.this_thread_state != nullptr && api.gil_ensure != nullptr &&
                 api.gil_release != nullptr && api.get_frame != nullptr &&
                 api.frame_back != nullptr && api.frame_code != nullptr &&
                 api.frame_line != nullptr && api.incref != nullptr && api.decref != nullptr &&
                 api.getattr != nullptr && api.as_utf8 != nullptr && api.err_clear != nullptr;
  return api;
}

const PythonApi& Api() {
  static const PythonApi api = LoadPythonApi();  // thread-safe static initialisation
  return api;
}

std::atomic<PythonGilPolicy> g_gil_policy{PythonGilPolicy::kAnyThreadWithState};

// True when the calling thread holds the GIL (an attached thread state is the direct proof:
// PyGILState_Check answers 1 when its check is disabled, as with sub-interpreters).
bool HoldsGil(const PythonApi& api) {
  return api.gil_check() == 1 &&
         (api.thread_state_unchecked == nullptr || api.thread_state_unchecked() != nullptr);
}

// True when a thread that does not hold the GIL may take it for a walk of its own frames: it has
// a Python thread state, the interpreter is not finalising, and the policy admits the thread.
bool MayTakeGil(const PythonApi& api) {
  if (api.this_thread_state() == nullptr) return false;  // the thread never ran Python
  if (api.is_finalizing != nullptr && api.is_finalizing() != 0) return false;
  return g_gil_policy.load(std::memory_order_relaxed) == PythonGilPolicy::kAnyThreadWithState ||
         gettid() == getpid();
}

// The UTF-8 text of attribute `attr` of `object`, or "??"; never leaves an exception set.
std::string StringAttribute(const PythonApi& api, void* object, const char* attr) {
  std::string out = "??";
  void* value = api.getattr(object, attr);
  if (value == nullptr) {
    api.err_clear();
    return out;
  }
  if (const char* text = api.as_utf8(value); text != nullptr) {
    out = text;
  } else {
    api.err_clear();
  }
  api.decref(value);
  return out;
}

// Walks the calling thread's frames; the thread holds the GIL.
int WalkFrames(const PythonApi& api, PythonFrameRef* out, int max_frames) {
  void* frame = api.get_frame();  // borrowed
  if (frame == nullptr) return 0;
  api.incref(frame);  // own every frame the same way below
  int n = 0;
  while (frame != nullptr && n < max_frames) {
    void* code = api.frame_code(frame);
    out[n].code = reinterpret_cast<std::uintptr_t>(code);
    out[n].position = api.frame_lasti != nullptr ? api.frame_lasti(frame) : api.frame_line(frame);
    // The executing frame keeps its code object alive until the allocation returns, which is
    // longer than the history needs to retain it.
    api.decref(code);
    void* back = api.frame_back(frame);
    api.decref(frame);
    frame = back;
    ++n;
  }
  if (frame != nullptr) api.decref(frame);
  return n;
}

}  // namespace

void SetPythonGilPolicy(PythonGilPolicy policy) {
  g_gil_policy.store(policy, std::memory_order_relaxed);
}

bool PythonFramesAvailable() {
  const PythonApi& api = Api();
  return api.complete && api.is_initialized() == 1;
}

PythonStackCapture::PythonStackCapture(PythonFrameRef* out, int max_frames) {
  const PythonApi& api = Api();
  if (!api.complete || max_frames <= 0 || api.is_initialized() != 1) return;
  if (!HoldsGil(api)) {
    // torch's operators release the GIL before they allocate, so the allocating thread usually
    // has a Python thread state but does not hold the GIL. Like torch's own recorder
    // (CapturedTraceback's Python gatherer), take it back for the walk. Threads that never ran
    // Python have no thread state and are skipped; nothing is taken during finalisation, nor on
    // threads the policy (SetPythonGilPolicy) excludes.
    if (!MayTakeGil(api)) return;
    gil_state_ = api.gil_ensure();
    acquired_ = true;
  }
  size_ = WalkFrames(api, out, max_frames);
}

PythonStackCapture::~PythonStackCapture() {
  if (acquired_) Api().gil_release(gil_state_);
}

void ResolvePythonLines(const std::vector<PythonFrameRef>& frames, std::vector<int>* lines) {
  lines->assign(frames.size(), 0);
  const PythonApi& api = Api();
  if (!api.complete) return;
  if (api.addr2line == nullptr) {  // positions are lines already
    for (std::size_t i = 0; i < frames.size(); ++i) (*lines)[i] = frames[i].position;
    return;
  }
  if (frames.empty() || api.is_initialized() != 1) return;
  if (api.is_finalizing != nullptr && api.is_finalizing() != 0) return;
  const int state = api.gil_ensure();  // re-entrant: fine if this thread holds the GIL
  for (std::size_t i = 0; i < frames.size(); ++i) {
    // A negative offset (a frame that has not started) gives co_firstlineno.
    (*lines)[i] = api.addr2line(reinterpret_cast<void*>(frames[i].code), frames[i].position);
  }
  api.gil_release(state);
}

void RetainPythonCode(std::uintptr_t code, std::string* filename, std::string* name) {
  const PythonApi& api = Api();
  if (!api.complete || code == 0) {
    *filename = "??";
    *name = "??";
    return;
  }
  void* object = reinterpret_cast<void*>(code);
  api.incref(object);  // never released: the history identifies code objects by address
  void* type = nullptr;
  void* value = nullptr;
  void* traceback = nullptr;
  const bool save = api.err_fetch != nullptr && api.err_restore != nullptr;
  if (save) api.err_fetch(&type, &value, &traceback);
  *filename = StringAttribute(api, object, "co_filename");
  *name = StringAttribute(api, object, "co_name");
  if (save) api.err_restore(type, value, traceback);
}

std::vector<Frame> CaptureLivePythonFrames(int max_frames) {
  std::vector<Frame> frames;
  const PythonApi& api = Api();
  if (!api.complete || max_frames <= 0 || api.is_initialized() != 1) return frames;
  if (!HoldsGil(api) && !MayTakeGil(api)) return frames;
  const int state = api.gil_ensure();  // re-entrant: fine if this thread holds the GIL
  void* type = nullptr;
  void* value = nullptr;
  void* traceback = nullptr;
  const bool save = api.err_fetch != nullptr && api.err_restore != nullptr;
  if (save) api.err_fetch(&type, &value, &traceback);
  void* frame = api.get_frame();  // borrowed
  if (frame != nullptr) api.incref(frame);
  while (frame != nullptr && static_cast<int>(frames.size()) < max_frames) {
    Frame f;
    f.python = true;
    f.line = api.frame_line(frame);
    void* code = api.frame_code(frame);  // new reference
    if (code != nullptr) {
      f.filename = StringAttribute(api, code, "co_filename");
      f.name = StringAttribute(api, code, "co_name");
      api.decref(code);
    } else {
      api.err_clear();
      f.filename = "??";
      f.name = "??";
    }
    frames.push_back(std::move(f));
    void* back = api.frame_back(frame);
    api.decref(frame);
    frame = back;
  }
  if (frame != nullptr) api.decref(frame);
  if (save) api.err_restore(type, value, traceback);
  api.gil_release(state);
  return frames;
}

int CaptureNativeFrames(std::uintptr_t* out, int max_frames, int skip) {
  // glibc's backtrace() unwinds with the .eh_frame tables, so it works through code built
  // without frame pointers (torch, CPython, this library). absl::GetStackTrace was measured to
  // return 0 frames here: Debian's Abseil 20220623 uses its frame-pointer unwinder on x86-64.
  constexpr int kMax = 192;
  void* pcs[kMax];
  const int want = std::min(max_frames + skip + 1, kMax);
  const int n = ::backtrace(pcs, want);
  const int first = std::min(n, skip + 1);  // this function, then `skip` callers
  const int count = std::min(n - first, max_frames);
  for (int i = 0; i < count; ++i) out[i] = reinterpret_cast<std::uintptr_t>(pcs[first + i]);
  return count;
}

Frame SymbolizeNativeFrame(std::uintptr_t pc) {
  Frame frame;
  // A return address points after the call; pc - 1 lies inside the calling function.
  const void* lookup = reinterpret_cast<const void*>(pc > 0 ? pc - 1 : pc);
  char buffer[1024];
  if (absl::Symbolize(lookup, buffer, sizeof(buffer))) {
    frame.name = buffer;
  } else {
    char hex[32];
    std::snprintf(hex, sizeof(hex), "0x%zx", static_cast<std::size_t>(pc));
    frame.name = hex;
  }
  Dl_info info;
  if (dladdr(lookup, &info) != 0 && info.dli_fname != nullptr) {
    frame.filename = info.dli_fname;
  } else {
    frame.filename = "??";
  }
  return frame;
}

}  // namespace vramledger
