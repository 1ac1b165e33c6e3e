// Host cost per allocation on a real device, torch's native allocator and vramledger side by side
// in one process (docs/design/step-time-measurement.md, "Time inside the allocator").
//
// Replays a recorded trace's alloc / free calls (benchmarks/trace_ops.h) through
//   native      torch's CUDACachingAllocator (raw_alloc_with_stream / raw_delete), as torch
//               itself calls it for every tensor: its native backend, or whichever backend
//               PYTORCH_CUDA_ALLOC_CONF selects (the LD_PRELOAD shim selects cudaMallocAsync,
//               whose calls it then serves: run under the shim, this row is the shim's path);
//   vramledger  a DeviceAllocator on CudaBackend with --conf (default expandable_segments:True);
//   plugin      vramledger's plugin library (libvramledger_plugin.so: VRAMLEDGER_PLUGIN, else the
//               one beside this program), its C entry points vramledger_malloc / vramledger_free
//               called directly, configured with the same --conf: the allocator with the budget
//               guard and the ledger's hooks that install() attaches;
//   pluggable   the same entry points behind torch's CUDAPluggableAllocator (its
//               raw_alloc_with_stream / raw_delete; install()'s route reaches the same map and
//               mutex through its allocate() and raw deleter): pluggable - plugin is torch's glue
//               per call (docs/design/torch-native-mode.md), plugin - vramledger the hooks';
//   torch-native the torch-native mode (libvramledger_native.so beside the plugin, the same
//               allocators): NativeAllocator::allocate(), as torch calls it for every tensor, and
//               the DataPtr's own deleter; torch-native - plugin is that route's glue (no map);
//   harness     the same loop with no allocator (the loop's own cost, subtracted from both),
// in interleaved passes whose order rotates, on the legacy default stream. Each pass replays the
// whole trace; blocks still live at its end are freed untimed, so every pass starts from the
// allocator's cached state. Pass 1 of each fills the caches (cudaMalloc / page maps) and is
// reported apart; the verdict is on the median of the later passes. Two processes of the same
// script differ by up to 15% on this machine (step_ab's A/A control); one process does not, and
// the vramledger row, the same code in every process, lets two processes' torch rows be compared
// (torch / vramledger in each, then their ratio).
//
// Usage: vramledger_host_cost_bench TRACE.csv[.gz] [--passes N (7)] [--conf CONF (default
// expandable_segments:True,host_timing:True)]
// Prints one line per pass, then a table: ns per call (gross, net of the harness), the ratio
// vramledger / native, vramledger's own HostTime per call with its driver calls after pass 1,
// and, under the LD_PRELOAD shim, the shim's own time per call of torch's row.
// Exit status: 0 on success, 2 on bad arguments or an unreadable trace, 1 on a failed call.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "benchmarks/trace_ops.h"
#include "device/cuda_backend.h"
#include "nlohmann/json.hpp"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"

namespace vramledger {
namespace {

enum Which {
  kNative = 0,
  kVramledger = 1,
  kPlugin = 2,
  kPluggable = 3,
  kTorchNative = 4,
  kHarness = 5,
  kNumWhich = 6
};
constexpr std::array<const char*, kNumWhich> kNames = {"native",    "vramledger",   "plugin",
                                                       "pluggable", "torch-native", "harness"};

// The plugin library's entry points (torch_plugin/pluggable/plugin.h), loaded with dlopen.
struct PluginApi {
  int (*configure)(const char*) = nullptr;
  void* (*malloc)(std::size_t, int, cudaStream_t) = nullptr;
  void (*free)(void*, std::size_t, int, cudaStream_t) = nullptr;
  int (*empty_cache)(int) = nullptr;
  const char* (*last_error)() = nullptr;
  std::string path;  // where it was loaded from
};

// Loads the plugin: VRAMLEDGER_PLUGIN, else libvramledger_plugin.so beside this program. Returns
// an error naming the path and dlerror() when it or one of its entry points is missing.
absl::StatusOr<PluginApi> LoadPlugin() {
  std::string path;
  if (const char* env = std::getenv("VRAMLEDGER_PLUGIN"); env != nullptr && *env != '\0') {
    path = env;
  } else {
    std::string self(4096, '\0');
    const ssize_t n = readlink("/proc/self/exe", self.data(), self.size() - 1);
    self.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
    path = self.substr(0, self.rfind('/') + 1) + "libvramledger_plugin.so";
  }
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return absl::NotFoundError(absl::StrCat("the plugin library ", path, ": ", dlerror()));
  }
  PluginApi api;
  auto load = [lib](const char* name, auto* fn) {
    *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, name));
    return *fn != nullptr;
  };
  if (!load("vramledger_configure", &api.configure) || !load("vramledger_malloc", &api.malloc) ||
      !load("vramledger_free", &api.free) || !load("vramledger_empty_cache", &api.empty_cache) ||
      !load("vramledger_last_error", &api.last_error)) {
    return absl::NotFoundError(absl::StrCat(path, ": an entry point is missing: ", dlerror()));
  }
  api.path = path;
  return api;
}

// The torch-native mode's allocator (torch_plugin/native/native_allocator.h), from the library
// beside the plugin that `plugin_path` names; it links that plugin, so both share its allocators.
absl::StatusOr<c10::cuda::CUDACachingAllocator::CUDAAllocator*> LoadNative(
    const std::string& plugin_path) {
  const std::string path =
      plugin_path.substr(0, plugin_path.rfind('/') + 1) + "libvramledger_native.so";
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return absl::NotFoundError(absl::StrCat("the torch-native library ", path, ": ", dlerror()));
  }
  auto get = reinterpret_cast<void* (*)()>(dlsym(lib, "vramledger_native_allocator"));
  if (get == nullptr) return absl::NotFoundError(absl::StrCat(path, ": ", dlerror()));
  return static_cast<c10::cuda::CUDACachingAllocator::CUDAAllocator*>(get());
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0 : (n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2);
}

// The LD_PRELOAD shim's interposed calls so far and their host time (us); calls -1 without the
// shim (or with host_timing off: no time).
struct ShimTime {
  double us = 0;
  std::int64_t calls = -1;
};
ShimTime ShimInterposed() {
  using StatsFn = char* (*)();
  auto stats = reinterpret_cast<StatsFn>(dlsym(RTLD_DEFAULT, "vramledger_preload_stats_json"));
  char* json = stats != nullptr ? stats() : nullptr;
  if (json == nullptr) return {};
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  std::free(json);
  if (!j.is_object() || !j.contains("host_time_us")) return {};
  ShimTime t;
  t.us = j["host_time_us"].value("interposed_calls", 0.0);
  t.calls = 0;
  for (const char* key :
       {"cudaMalloc_calls", "cudaMallocAsync_calls", "cudaFree_calls", "cudaFreeAsync_calls"}) {
    t.calls += j.value(key, std::int64_t{0});
  }
  return t;
}

// One timed pass of `ops` through alloc / free; returns nanoseconds of the op loop. Frees the
// blocks left live at the end, untimed. Returns -1 (after printing why) if a call failed.
double Pass(const TraceOps& w, std::vector<void*>& slots,
            const std::function<void*(std::size_t)>& alloc,
            const std::function<void(void*)>& free) {
  std::vector<bool> live(w.slots, false);
  const auto start = std::chrono::steady_clock::now();
  for (const TraceOp& op : w.ops) {
    if (op.alloc) {
      if (op.size == 0) continue;  // no memory, as torch makes none for an empty tensor
      void* p = alloc(op.size);
      if (p == nullptr) return -1;
      slots[op.slot] = p;
      live[op.slot] = true;
    } else if (live[op.slot]) {
      free(slots[op.slot]);
      live[op.slot] = false;
    }
  }
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  for (std::uint32_t s = 0; s < w.slots; ++s) {
    if (live[s]) free(slots[s]);
  }
  return ns;
}

int Main(int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') {
    std::fprintf(stderr, "usage: %s TRACE.csv[.gz] [--passes N] [--conf CONF]\n", argv[0]);
    return 2;
  }
  const std::string trace = argv[1];
  int passes = 7;
  std::string conf = "expandable_segments:True,host_timing:True";
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--passes" || arg == "--conf") && i + 1 >= argc) {
      std::fprintf(stderr, "host_cost_bench: %s needs a value\n", arg.c_str());
      return 2;
    }
    if (arg == "--passes") {
      if (!absl::SimpleAtoi(argv[++i], &passes)) {
        std::fprintf(stderr, "host_cost_bench: --passes: not an integer: '%s'\n", argv[i]);
        return 2;
      }
    } else if (arg == "--conf") {
      conf = argv[++i];
    } else {
      std::fprintf(stderr, "host_cost_bench: unknown argument %s\n", arg.c_str());
      return 2;
    }
  }
  if (passes < 2) {
    std::fprintf(stderr, "host_cost_bench: --passes must be at least 2 (pass 1 is warm-up)\n");
    return 2;
  }
  const TraceOps w = LoadTraceOps(trace);
  if (!w.error.empty()) {
    std::fprintf(stderr, "host_cost_bench: %s\n", w.error.c_str());
    return 2;
  }
  if (w.ops.empty()) {
    std::fprintf(stderr, "host_cost_bench: %s: no alloc or free_completed event to replay\n",
                 trace.c_str());
    return 2;
  }
  absl::StatusOr<Options> options = ParseOptions(conf);
  if (!options.ok()) {
    std::fprintf(stderr, "host_cost_bench: --conf: %s\n",
                 std::string(options.status().message()).c_str());
    return 2;
  }
  if (cudaSetDevice(0) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {
    std::fprintf(stderr, "host_cost_bench: no CUDA device\n");
    return 2;
  }
  namespace torch_alloc = c10::cuda::CUDACachingAllocator;
  torch_alloc::init(c10::cuda::device_count());
  CudaBackend backend(0);
  DeviceAllocator vl(*options, &backend);
  absl::StatusOr<PluginApi> plugin = LoadPlugin();
  if (!plugin.ok()) {
    std::fprintf(stderr, "host_cost_bench: %s\n", std::string(plugin.status().message()).c_str());
    return 2;
  }
  if (plugin->configure(conf.c_str()) != 0) {
    std::fprintf(stderr, "host_cost_bench: the plugin refused --conf: %s\n", plugin->last_error());
    return 2;
  }
  const PluginApi api = *plugin;
  auto plugin_alloc = [api](std::size_t n, int device, cudaStream_t stream) -> void* {
    try {  // the plugin raises c10::Error (torch's OutOfMemoryError) on a refusal
      return api.malloc(n, device, stream);
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "plugin: %s\n", e.what_without_backtrace());
      return nullptr;
    }
  };
  const std::shared_ptr<torch_alloc::CUDAAllocator> pluggable =
      torch::cuda::CUDAPluggableAllocator::createCustomAllocator(plugin_alloc, api.free);
  absl::StatusOr<torch_alloc::CUDAAllocator*> loaded_native = LoadNative(api.path);
  if (!loaded_native.ok()) {
    std::fprintf(stderr, "host_cost_bench: %s\n",
                 std::string(loaded_native.status().message()).c_str());
    return 2;
  }
  torch_alloc::CUDAAllocator* const torch_native = *loaded_native;
  c10::DeleterFnPtr native_deleter = nullptr;  // the DataPtrs' deleter (one per device)
  const std::array<std::function<void*(std::size_t)>, kNumWhich> allocs = {
      [](std::size_t n) -> void* {
        try {  // torch raises c10::Error (its OutOfMemoryError) instead of returning null
          return torch_alloc::raw_alloc_with_stream(n, nullptr);
        } catch (const c10::Error& e) {
          std::fprintf(stderr, "torch: %s\n", e.what_without_backtrace());
          return nullptr;
        }
      },
      [&vl](std::size_t n) -> void* {
        absl::StatusOr<DevicePtr> p = vl.Malloc(n, 0);
        if (!p.ok()) std::fprintf(stderr, "vramledger: %s\n", p.status().ToString().c_str());
        return p.ok() ? reinterpret_cast<void*>(*p) : nullptr;
      },
      [&plugin_alloc](std::size_t n) { return plugin_alloc(n, 0, nullptr); },
      [&pluggable](std::size_t n) -> void* {
        try {  // a null from the allocation function comes back as null (printed there)
          return pluggable->raw_alloc_with_stream(n, nullptr);
        } catch (const c10::Error& e) {
          std::fprintf(stderr, "pluggable: %s\n", e.what_without_backtrace());
          return nullptr;
        }
      },
      [torch_native, &native_deleter](std::size_t n) -> void* {
        try {  // as a tensor: allocate() on the current device and stream, then its deleter
          c10::DataPtr d = torch_native->allocate(n);
          native_deleter = d.get_deleter();
          return d.release_context();  // the context is the address (native_allocator.cc)
        } catch (const c10::Error& e) {
          std::fprintf(stderr, "torch-native: %s\n", e.what_without_backtrace());
          return nullptr;
        }
      },
      [](std::size_t n) { return reinterpret_cast<void*>(n | 1); }};
  const std::array<std::function<void(void*)>, kNumWhich> frees = {
      [](void* p) {
        try {
          torch_alloc::raw_delete(p);
        } catch (const c10::Error& e) {
          std::fprintf(stderr, "torch: %s\n", e.what_without_backtrace());
        }
      },
      [&vl](void* p) { (void)vl.Free(reinterpret_cast<DevicePtr>(p)); },
      [api](void* p) { api.free(p, 0, 0, nullptr); },
      [&pluggable](void* p) { pluggable->raw_delete(p); },
      [&native_deleter](void* p) { native_deleter(p); },
      [](void* p) { (void)p; }};

  std::printf("trace %s: %zu calls; torch allocator backend: %s; vramledger conf: %s\n",
              trace.c_str(), w.ops.size(), torch_alloc::name().c_str(), conf.c_str());
  std::array<std::vector<double>, kNumWhich> warm;  // ns per call, passes after the first
  std::array<double, kNumWhich> first{};
  std::vector<void*> slots(w.slots, nullptr);
  HostTime host_after_first;
  std::int64_t driver_after_first = 0;
  double driver_us_after_first = 0;
  ShimTime shim_after_first = ShimInterposed();
  for (int pass = 0; pass < passes; ++pass) {
    for (int k = 0; k < kNumWhich; ++k) {
      const int which = (pass + k) % kNumWhich;  // rotate the order every pass
      const double ns = Pass(w, slots, allocs[which], frees[which]);
      if (ns < 0) {
        std::fprintf(stderr, "host_cost_bench: %s failed in pass %d\n", kNames[which], pass + 1);
        return 1;
      }
      const double per_call = ns / static_cast<double>(w.ops.size());
      if (pass == 0) {
        first[which] = per_call;
      } else {
        warm[which].push_back(per_call);
      }
      std::printf("pass %d %-10s %8.1f ns per call\n", pass + 1, kNames[which], per_call);
    }
    cudaDeviceSynchronize();
    if (pass == 0) {
      host_after_first = vl.host_time();
      driver_after_first = backend.calls().total_count();
      driver_us_after_first = backend.calls().total_micros();
      shim_after_first = ShimInterposed();
    }
  }
  const HostTime host = vl.host_time();
  const double vl_calls = static_cast<double>((host.malloc_calls - host_after_first.malloc_calls) +
                                              (host.free_calls - host_after_first.free_calls));
  const double vl_inside = static_cast<double>((host.malloc_ns - host_after_first.malloc_ns) +
                                               (host.free_ns - host_after_first.free_ns)) /
                           vl_calls;
  const double harness = Median(warm[kHarness]);
  const double native = Median(warm[kNative]);
  const double ours = Median(warm[kVramledger]);
  std::printf("\n| allocator | pass 1 ns/call | median ns/call, passes 2-%d | net of harness |\n",
              passes);
  std::printf("|---|---|---|---|\n");
  for (int which = 0; which < kNumWhich; ++which) {
    const double m = Median(warm[which]);
    std::printf("| %s | %.1f | %.1f | %.1f |\n", kNames[which], first[which], m,
                which == kHarness ? 0.0 : m - harness);
  }
  std::printf("\nvramledger / torch (%s), ns per call: gross %.3f, net of harness %.3f\n",
              torch_alloc::name().c_str(), ours / native, (ours - harness) / (native - harness));
  const double plugin_ns = Median(warm[kPlugin]);
  const double plugged = Median(warm[kPluggable]);
  std::printf(
      "the plugin's hooks (budget guard, ledger): %+.1f ns per call (plugin - vramledger); "
      "torch's CUDAPluggableAllocator around the plugin: %+.1f ns per call (pluggable - "
      "plugin); pluggable / torch (%s) net of harness %.3f\n",
      plugin_ns - ours, plugged - plugin_ns, torch_alloc::name().c_str(),
      (plugged - harness) / (native - harness));
  const double native_mode = Median(warm[kTorchNative]);
  std::printf(
      "the torch-native mode around the plugin: %+.1f ns per call (torch-native - plugin); "
      "torch-native - pluggable %+.1f ns per call; torch-native / torch (%s) net of harness "
      "%.3f\n",
      native_mode - plugin_ns, native_mode - plugged, torch_alloc::name().c_str(),
      (native_mode - harness) / (native - harness));
  const std::int64_t driver_calls = backend.calls().total_count() - driver_after_first;
  std::printf(
      "vramledger HostTime inside Malloc/Free, passes 2-%d (end-of-pass frees included): %.1f ns "
      "per call, of which driver calls %.1f ns (%lld calls)\n",
      passes, vl_inside, (backend.calls().total_micros() - driver_us_after_first) * 1e3 / vl_calls,
      static_cast<long long>(driver_calls));
  // Under the LD_PRELOAD shim: its own time per interposed call (torch's row, passes 2-N, the
  // untimed end-of-pass frees included), from its counters.
  if (const ShimTime shim = ShimInterposed(); shim.calls > shim_after_first.calls) {
    std::printf("LD_PRELOAD shim: %.1f ns per interposed call (%lld calls, passes 2-%d)\n",
                (shim.us - shim_after_first.us) * 1e3 /
                    static_cast<double>(shim.calls - shim_after_first.calls),
                static_cast<long long>(shim.calls - shim_after_first.calls), passes);
  }
  (void)vl.EmptyCache();
  (void)api.empty_cache(0);
  torch_alloc::emptyCache();
  return 0;
}

}  // namespace
}  // namespace vramledger

int main(int argc, char** argv) { return vramledger::Main(argc, argv); }
