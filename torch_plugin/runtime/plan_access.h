// Plan access for every route: checking a plan file, the byte limit a plan sets for a device
// (resolved once per device, no JSON in between), and the C ABI's plan summary for the Python
// package. Thread-safety: every function may be called from any thread.
#ifndef VRAMLEDGER_TORCH_PLUGIN_RUNTIME_PLAN_ACCESS_H_
#define VRAMLEDGER_TORCH_PLUGIN_RUNTIME_PLAN_ACCESS_H_

#include "torch_plugin/runtime/c_errors.h"

extern "C" {

/// Checks the plan file at `path`: parses it (device keys checked against `device_count` when
/// > 0) and, when `card_bytes` > 0, resolves it for each of `device_count` devices (at least 1)
/// against a card of that size. On success *json_out is a JSON summary
/// {"path", "categories", "devices": [{"device", "limit", "headroom", "cap", "warn_bytes",
/// "enforces_limit", "category_limits": {...}}]} (empty "devices" without card_bytes).
/// VRAMLEDGER_INVALID_ARGUMENT with "<path>:<line>: field '<field>': ..." for a bad plan,
/// VRAMLEDGER_FAILED when the file cannot be read.
VRAMLEDGER_EXPORT int vramledger_plan_check(const char* path, int device_count,
                                            unsigned long long card_bytes, char** json_out);

}  // extern "C"

#ifdef __cplusplus
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"

namespace vramledger {

/// Parses the plan file at `path` without resolving it against a card: InvalidArgument
/// "<path>:<line>: field '<field>': ..." for a bad plan, NotFound when it cannot be read.
absl::Status CheckPlanFile(const std::string& path);

/// The byte limit the plan at `path` sets for `device` on a card of `card_bytes`, resolved at the
/// first call for that device and remembered (one plan per process); nullopt when the plan does
/// not parse or resolve, or `device` is outside [0, 64).
std::optional<std::int64_t> PlanLimitBytes(const std::string& path, int device,
                                           std::size_t card_bytes);

}  // namespace vramledger
#endif  // __cplusplus

#endif  // VRAMLEDGER_TORCH_PLUGIN_RUNTIME_PLAN_ACCESS_H_
