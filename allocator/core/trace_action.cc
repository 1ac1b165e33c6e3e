// Torch's trace action names (docs/design/torch-facts.md §6.2) for TraceAction, both ways. Pure;
// thread-safe.
#include <array>

#include "vramledger/hooks.h"

namespace vramledger {
namespace {

constexpr std::array<std::string_view, 9> kActionNames = {
    "alloc",       "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap",  "snapshot",       "oom",
};

}  // namespace

std::string_view TraceActionName(TraceAction action) {
  const auto i = static_cast<std::size_t>(action);
  return i < kActionNames.size() ? kActionNames[i] : std::string_view("?");
}

std::optional<TraceAction> ParseTraceAction(std::string_view name) {
  for (std::size_t i = 0; i < kActionNames.size(); ++i) {
    if (kActionNames[i] == name) return static_cast<TraceAction>(i);
  }
  return std::nullopt;
}

}  // namespace vramledger
