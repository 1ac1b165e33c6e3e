// The shim's direct route into torch: an interposed dlopen notices torch's libc10_cuda.so, then
// libvramledger_native.so (beside the shim) becomes torch's CUDA allocator before CUDA starts,
// or the shim falls back to its interposition with one warning (preload-route.md).
//
// dlopen resolves a bare library name with the calling library's RUNPATH, and glibc takes the
// caller from dlopen's return address, which the wrapper would make the shim's. So a bare name
// is resolved here with the caller's own search path (dlinfo RTLD_DI_SERINFO) first, and every
// library that dlopens its siblings by name (cuDNN, NCCL's plugins) finds them as before.
#include <dlfcn.h>
#include <link.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "torch_plugin/preload/preload_state.h"
#include "torch_plugin/preload/route_choice.h"

#ifndef VRAMLEDGER_NATIVE_TORCH_MINOR
#define VRAMLEDGER_NATIVE_TORCH_MINOR ""  // built without torch: no native library
#endif

namespace vramledger::preload {
namespace {

using DlopenFn = void* (*)(const char*, int);

DlopenFn RealDlopen() {
  static const DlopenFn real = reinterpret_cast<DlopenFn>(dlsym(RTLD_NEXT, "dlopen"));
  return real;
}

enum class Route { kPending, kInterpose, kDirect };
std::atomic<Route> g_route{Route::kPending};
std::atomic<bool> g_predicted{false};  // the version seen before torch loaded already fitted
std::mutex g_decide_mu;                // one decision at a time (taken outside the loader's lock)
// > 0 inside a dlopen (its static initializers included); initial-exec: reading it never allocates.
constinit __attribute__((tls_model("initial-exec"))) thread_local int t_dlopen_depth = 0;

constexpr char kNativeName[] = "libvramledger_native.so";

// The folder this library was loaded from.
std::string ShimDir() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&ShimDir), &info) == 0 || info.dli_fname == nullptr) {
    return ".";
  }
  const std::string path = info.dli_fname;
  const std::size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// libc10_cuda.so when it is loaded (a handle to release with dlclose), else nullptr.
void* LoadedC10Cuda() { return RealDlopen()("libc10_cuda.so", RTLD_LAZY | RTLD_NOLOAD); }

// Sets torch's cudaMallocAsync backend, through which the interposition sees every tensor
// allocation (torch's native caching allocator would keep its own cache over vramledger's).
// Only before libc10_cuda loads: torch picks its backend from the variable at load time and
// asserts later that the variable still names the backend it picked.
void SelectCudaMallocAsyncBackend() {
  const char* conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  if (conf == nullptr || conf[0] == '\0') {
    setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync", 1);
  } else {
    setenv("PYTORCH_CUDA_ALLOC_CONF", absl::StrCat(conf, ",backend:cudaMallocAsync").c_str(), 1);
  }
}

void FallBack(const std::string& warning, const std::string& note) {
  if (!warning.empty()) {
    std::fprintf(stderr, "%s\n", warning.c_str());
    std::fflush(stderr);
  }
  if (Preload* p = Instance()) p->set_route_note(note);
  g_route.store(Route::kInterpose, std::memory_order_release);
}

RouteInputs Inputs(const std::string& running_version) {
  RouteInputs in;
  in.running_version = running_version;
  in.native_dir = ShimDir();
  in.native_present = access((in.native_dir + "/" + kNativeName).c_str(), F_OK) == 0;
  in.built_minor = VRAMLEDGER_NATIVE_TORCH_MINOR;
  return in;
}

// Before `path` is dlopened: when it is one of torch's libraries and the torch it belongs to
// does not fit the native library, fall back now, while torch's backend can still be chosen.
void PredictBeforeLoad(const char* path) {
  if (g_predicted.load(std::memory_order_relaxed) || !MayLoadTorch(path)) return;
  const std::string running = ReadTorchVersionIn(TorchDirOf(path));
  if (running.empty()) return;  // not torch's folder: decide once libc10_cuda is there
  std::lock_guard<std::mutex> lock(g_decide_mu);
  if (g_route.load() != Route::kPending || g_predicted.load()) return;
  if (void* c10 = LoadedC10Cuda()) {  // loaded through another path already
    dlclose(c10);
    return;
  }
  const RouteChoice choice = ChooseRoute(Inputs(running));
  if (choice.direct) {
    g_predicted.store(true);
    return;
  }
  SelectCudaMallocAsyncBackend();
  FallBack(choice.warning,
           absl::StrCat("cudaMalloc/cudaMallocAsync interposition (torch ", running,
                        " through its cudaMallocAsync backend; no native library for it)"));
}

template <typename F>
bool Resolve(void* handle, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(handle, name));
  return *out != nullptr;
}

// libc10_cuda.so is loaded: make the native library torch's allocator, or fall back.
void DecideLoaded(void* c10) {
  std::string c10_path;
  link_map* map = nullptr;
  if (dlinfo(c10, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr) {
    c10_path = map->l_name;
  }
  const std::string running = ReadTorchVersionIn(TorchDirOf(c10_path));
  // The backend torch picked at load time stays; after a fallback here, torch's native caching
  // allocator keeps its cache over the segments the interposition serves.
  const std::string late_note = absl::StrCat("cudaMalloc/cudaMallocAsync interposition (torch ",
                                             running.empty() ? "of unknown version" : running,
                                             " with the backend it chose at load time)");
  RouteChoice choice = ChooseRoute(Inputs(running));
  if (!choice.direct) return FallBack(choice.warning, late_note);
  const std::string native_path = ShimDir() + "/" + kNativeName;
  void* native = RealDlopen()(native_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (native == nullptr) {
    const char* err = dlerror();
    return FallBack(absl::StrCat("vramledger: cannot load ", native_path, ": ",
                                 err != nullptr ? err : "unknown error",
                                 "; the shim serves torch's CUDA memory calls instead"),
                    late_note);
  }
  const char* (*built_version)() = nullptr;
  int (*install)() = nullptr;
  const char* (*install_error)() = nullptr;
  int (*configure)(const char*) = nullptr;
  const char* (*last_error)() = nullptr;
  void (*set_reporter)(void (*)(int, const char*)) = nullptr;
  void (*set_before_create)(void (*)(int)) = nullptr;
  auto plugin = std::make_unique<PluginRuntime>();
  const bool complete =
      Resolve(native, "vramledger_native_torch_version", &built_version) &&
      Resolve(native, "vramledger_native_install", &install) &&
      Resolve(native, "vramledger_native_last_error", &install_error) &&
      Resolve(native, "vramledger_configure", &configure) &&
      Resolve(native, "vramledger_last_error", &last_error) &&
      Resolve(native, "vramledger_set_refusal_reporter", &set_reporter) &&
      Resolve(native, "vramledger_set_before_create", &set_before_create) &&
      Resolve(native, "vramledger_device_count", &plugin->device_count) &&
      Resolve(native, "vramledger_device_stats", &plugin->device_stats) &&
      Resolve(native, "vramledger_fragmentation_json", &plugin->fragmentation_json) &&
      Resolve(native, "vramledger_snapshot_json", &plugin->snapshot_json) &&
      Resolve(native, "vramledger_string_free", &plugin->string_free) &&
      Resolve(native, "vramledger_last_error", &plugin->last_error) &&
      Resolve(native, "vramledger_region_begin", &plugin->regions.begin) &&
      Resolve(native, "vramledger_region_end", &plugin->regions.end) &&
      Resolve(native, "vramledger_region_pause", &plugin->regions.pause) &&
      Resolve(native, "vramledger_region_resume", &plugin->regions.resume) &&
      Resolve(native, "vramledger_region_list", &plugin->regions.list);
  if (!complete) {
    const char* err = dlerror();
    return FallBack(absl::StrCat("vramledger: ", native_path, " is incomplete (",
                                 err != nullptr ? err : "a symbol is missing", ")",
                                 "; the shim serves torch's CUDA memory calls instead"),
                    late_note);
  }
  // The library's own word on the torch it was built for decides (the shim's build may differ).
  RouteInputs in = Inputs(running);
  in.built_minor = built_version();
  choice = ChooseRoute(in);
  if (!choice.direct) return FallBack(choice.warning, late_note);
  // VRAMLEDGER_CONF, which the shim checked at start, configures the plugin's allocators too.
  if (configure(nullptr) != 0) {
    return FallBack(absl::StrCat("vramledger: ", last_error()), late_note);
  }
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(plugin->device_stats), &info) != 0) {
    plugin->base = info.dli_fbase;
  }
  plugin->torch_minor = in.built_minor;
  set_before_create([](int device) {
    if (Preload* p = Instance()) p->BeforeCreate(device);
  });
  set_reporter(&OnDirectRefusal);
  if (install() != 0) {
    set_reporter(nullptr);
    return FallBack(absl::StrCat("vramledger: ", install_error(),
                                 "; the shim serves torch's CUDA memory calls instead"),
                    late_note);
  }
  Preload* p = Instance();
  p->set_route_note(absl::StrCat("direct: vramledger is torch ", running, "'s CUDA allocator (",
                                 native_path, ")"));
  p->set_plugin(plugin.release());  // never freed: read until exit
  g_route.store(Route::kDirect, std::memory_order_release);
  EnterDirectRoute();
}

// False while torch's backend is not stored yet: libc10_cuda.so is loaded but its static
// initializer has not run (a library linked into the program may be initialized after this one),
// and would overwrite whatever were stored now.
// The global scope first: a program linked to libc10_cuda may hold the variable itself (a copy
// relocation, which libc10_cuda's own code then uses too).
bool TorchPickedItsBackend(void* c10) {
  constexpr char kAllocator[] = "_ZN3c104cuda20CUDACachingAllocator9allocatorE";  // `allocator`
  void* symbol = dlsym(RTLD_DEFAULT, kAllocator);
  if (symbol == nullptr) symbol = dlsym(c10, kAllocator);
  const auto* current = reinterpret_cast<const std::atomic<const void*>*>(symbol);
  return current == nullptr || current->load() != nullptr;
}

// After a dlopen returned (outermost only): decides once libc10_cuda.so is there and torch has
// picked its backend.
void AfterLoad() {
  if (g_route.load(std::memory_order_acquire) != Route::kPending) return;
  void* c10 = LoadedC10Cuda();
  if (c10 == nullptr) return;
  if (!TorchPickedItsBackend(c10)) {
    dlclose(c10);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(g_decide_mu);
    ++t_dlopen_depth;  // the native library's own loading decides nothing
    if (g_route.load() == Route::kPending) DecideLoaded(c10);
    --t_dlopen_depth;
  }
  dlclose(c10);
}

// The caller's link map, as dlopen would find it from its return address.
link_map* CallerMap(const void* caller) {
  Dl_info info;
  link_map* map = nullptr;
  if (caller == nullptr ||
      dladdr1(caller, &info, reinterpret_cast<void**>(&map), RTLD_DL_LINKMAP) == 0) {
    return nullptr;
  }
  return map;
}

// dlopen(file, mode) as if `caller` had called it: a bare name is looked up among the loaded
// libraries, then in the caller's search path up to the default folders, then as dlopen would
// from here (ld.so.cache, then the default folders).
void* OpenAsCaller(const char* file, int mode, const void* caller) {
  const DlopenFn real = RealDlopen();
  if (file == nullptr || std::strchr(file, '/') != nullptr) return real(file, mode);
  if (void* loaded = real(file, mode | RTLD_NOLOAD)) return loaded;
  if ((mode & RTLD_NOLOAD) != 0) return nullptr;  // not loaded, and not to be
  if (link_map* map = CallerMap(caller)) {
    Dl_serinfo size;
    if (dlinfo(map, RTLD_DI_SERINFOSIZE, &size) == 0 && size.dls_size > 0) {
      std::unique_ptr<char[]> buffer(new char[size.dls_size]);
      auto* info = reinterpret_cast<Dl_serinfo*>(buffer.get());
      std::memcpy(info, &size, sizeof(size));
      if (dlinfo(map, RTLD_DI_SERINFO, info) == 0) {
        // The default folders come last; dlopen searches them itself, after ld.so.cache.
        unsigned count = info->dls_cnt;
        while (count > 0 && IsDefaultLibraryDir(info->dls_serpath[count - 1].dls_name)) --count;
        for (unsigned i = 0; i < count; ++i) {
          const std::string path = absl::StrCat(info->dls_serpath[i].dls_name, "/", file);
          if (access(path.c_str(), F_OK) != 0) continue;
          if (void* h = real(path.c_str(), mode)) return h;
        }
      }
    }
  }
  return real(file, mode);
}

}  // namespace

void InitTorchRoute() {
  const std::string backend =
      NamedBackend(std::getenv("PYTORCH_CUDA_ALLOC_CONF"), std::getenv("PYTORCH_ALLOC_CONF"));
  if (!backend.empty()) {  // the program chose torch's backend: torch stays its allocator
    return FallBack("", absl::StrCat("cudaMalloc/cudaMallocAsync interposition (torch's "
                                     "allocator settings name backend:",
                                     backend, ")"));
  }
  // torch linked into the program was loaded (and picked its backend) before this constructor.
  AfterLoad();
}

}  // namespace vramledger::preload

extern "C" __attribute__((visibility("default"))) void* dlopen(const char* file, int mode) {
  using namespace vramledger::preload;  // NOLINT(build/namespaces): one function
  const void* caller = __builtin_return_address(0);
  const bool decide = Instance() != nullptr && t_dlopen_depth == 0 &&
                      g_route.load(std::memory_order_acquire) == Route::kPending;
  // A failure in the route's decision leaves the route as it was; the library is opened anyway.
  if (decide && file != nullptr && std::strchr(file, '/') != nullptr) {
    NoThrow("dlopen (route into torch)", 0, [&] {
      PredictBeforeLoad(file);
      return 0;
    });
  }
  ++t_dlopen_depth;
  void* handle = nullptr;
  if (!NoThrow("dlopen", false, [&] {
        handle = OpenAsCaller(file, mode, caller);
        return true;
      })) {
    handle = RealDlopen()(file, mode);
  }
  --t_dlopen_depth;
  if (decide && handle != nullptr) {
    NoThrow("dlopen (route into torch)", 0, [&] {
      AfterLoad();
      return 0;
    });
  }
  return handle;
}
