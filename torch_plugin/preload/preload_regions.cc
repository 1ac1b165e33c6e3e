// The shim's pausable-region calls, which the Python package uses in a program run under the
// shim (vramledger/_regions.py): vramledger_preload_region_* forward to the runtime that serves
// the program: the plugin's on the direct route, the shim's own on the interposition
// (runtime/region_api.h has their contract). Named apart from the plugin's vramledger_region_*
// so that neither library's exports interpose the other's (exports.map). Never throw.
#include <cstdlib>

#include "absl/status/status.h"

#include "torch_plugin/preload/preload_state.h"
#include "torch_plugin/runtime/c_errors.h"
#include "torch_plugin/runtime/region_api.h"

namespace vramledger::preload {
namespace {

// The shim's own runtime's calls (hidden in this library by its version script).
constexpr RegionCalls kOwnCalls = {&vramledger_region_begin, &vramledger_region_end,
                                   &vramledger_region_pause, &vramledger_region_resume,
                                   &vramledger_region_list};

// The calls of the runtime serving the program; nullptr when the shim is off (disabled).
const RegionCalls* Serving() {
  Preload* p = Instance();
  if (p == nullptr) return nullptr;
  const PluginRuntime* plugin = p->plugin();
  return plugin != nullptr ? &plugin->regions : &kOwnCalls;
}

// Runs `call` on the serving runtime inside the shim's recursion guard (the allocator's own
// driver calls go to the real runtime); VRAMLEDGER_FAILED with a message when the shim is off.
template <typename Call>
int Forward(Call call) {
  const RegionCalls* calls = Serving();
  if (calls == nullptr) {
    return CatchAll([] {
      return absl::FailedPreconditionError(
          "vramledger: the LD_PRELOAD shim is disabled in this process (preload_disable)");
    });
  }
  InsideScope inside;
  return call(*calls);
}

}  // namespace
}  // namespace vramledger::preload

using vramledger::preload::Forward;
using vramledger::preload::RegionCalls;

#define VRAMLEDGER_PRELOAD_EXPORT extern "C" __attribute__((visibility("default")))

VRAMLEDGER_PRELOAD_EXPORT int vramledger_preload_region_begin(int device, const char* name) {
  return Forward([&](const RegionCalls& c) { return c.begin(device, name); });
}

VRAMLEDGER_PRELOAD_EXPORT int vramledger_preload_region_end(int device, const char* name) {
  return Forward([&](const RegionCalls& c) { return c.end(device, name); });
}

VRAMLEDGER_PRELOAD_EXPORT int vramledger_preload_region_pause(int device, const char* name,
                                                              int backup, char** json_out) {
  return Forward([&](const RegionCalls& c) { return c.pause(device, name, backup, json_out); });
}

VRAMLEDGER_PRELOAD_EXPORT int vramledger_preload_region_resume(int device, const char* name,
                                                               int keep_host_buffers,
                                                               char** json_out) {
  return Forward(
      [&](const RegionCalls& c) { return c.resume(device, name, keep_host_buffers, json_out); });
}

VRAMLEDGER_PRELOAD_EXPORT int vramledger_preload_region_list(int device, char** json_out) {
  return Forward([&](const RegionCalls& c) { return c.list(device, json_out); });
}

/// The calling thread's last region error, from the runtime that reported it.
VRAMLEDGER_PRELOAD_EXPORT const char* vramledger_preload_last_error() {
  vramledger::preload::Preload* p = vramledger::preload::Instance();
  const vramledger::preload::PluginRuntime* plugin = p != nullptr ? p->plugin() : nullptr;
  return plugin != nullptr ? plugin->last_error() : vramledger_last_error();
}

/// Releases a string a vramledger_preload_region_* call returned (both runtimes use malloc).
VRAMLEDGER_PRELOAD_EXPORT void vramledger_preload_string_free(char* s) { std::free(s); }
