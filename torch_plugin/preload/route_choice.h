// Which route the LD_PRELOAD shim takes into a torch process, as pure functions of what it found:
// torch's version beside its libraries, the native library beside the shim, and the backend the
// environment names (preload-route.md). No state; the shim's dlopen hook (direct_route.cc) calls
// them.
#ifndef VRAMLEDGER_TORCH_PLUGIN_PRELOAD_ROUTE_CHOICE_H_
#define VRAMLEDGER_TORCH_PLUGIN_PRELOAD_ROUTE_CHOICE_H_

#include <string>
#include "absl/strings/string_view.h"

namespace vramledger::preload {

/// "MAJOR.MINOR" of a torch version ("2.11.0+cu130" -> "2.11"); "" when it does not start so.
std::string TorchMinorOf(absl::string_view version);

/// The torch version recorded in `dir`: `__version__` of version.py (a Python package's torch/),
/// else the first line of build-version (a libtorch distribution); "" when neither says.
std::string ReadTorchVersionIn(const std::string& dir);

/// The folder that holds the version of the torch a library at `library_path` belongs to:
/// torch/ for torch/lib/<lib> and torch/<module>.so, libtorch/ for libtorch/lib/<lib>; "" when
/// that folder records no version.
std::string TorchDirOf(const std::string& library_path);

/// True for a path whose file name is one of torch's libraries or its Python extension
/// (libtorch*, libc10*, _C.*): what loads libc10_cuda.so with it.
bool MayLoadTorch(absl::string_view path);

/// The value of `backend` in torch's allocator settings as torch reads them
/// (PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF); "" when none is named.
std::string NamedBackend(const char* cuda_alloc_conf, const char* alloc_conf);

/// True for the dynamic loader's default folders (/lib, /usr/lib, /lib64, /usr/lib64, a
/// multiarch folder under one of them, or a glibc-hwcaps folder under those), which it searches
/// after ld.so.cache: a bare-name dlopen made on another library's behalf leaves them, and the
/// cache before them, to dlopen itself.
bool IsDefaultLibraryDir(absl::string_view dir);

/// What the shim found when torch's libraries appeared.
struct RouteInputs {
  std::string running_version;  // torch's own version ("" unknown)
  bool native_present = false;  // libvramledger_native.so beside the shim
  std::string native_dir;       // where it was looked for
  std::string built_minor;      // the torch minor it was built for ("" unknown)
};

struct RouteChoice {
  bool direct = false;
  std::string warning;  // one line (no newline) when falling back, naming both versions
};

/// The direct route when the native library is present and built for the running torch's minor;
/// otherwise the interposition, with one warning line naming both versions.
RouteChoice ChooseRoute(const RouteInputs& in);

}  // namespace vramledger::preload

#endif  // VRAMLEDGER_TORCH_PLUGIN_PRELOAD_ROUTE_CHOICE_H_
