// The fragmentation figures of one device as a JSON object: the one conversion that the C ABI's
// vramledger_fragmentation_json and the replay's --json output both use. Stateless.
#ifndef VRAMLEDGER_LEDGER_FRAGMENTATION_JSON_H_
#define VRAMLEDGER_LEDGER_FRAGMENTATION_JSON_H_

#include "nlohmann/json.hpp"
#include "vramledger/device_allocator.h"

namespace vramledger {

/// Every field of `f` under its own name (sizes in bytes, "utilization" and
/// "free_space_fragmentation" as fractions in [0, 1]).
nlohmann::json FragmentationJson(const Fragmentation& f);

}  // namespace vramledger

#endif  // VRAMLEDGER_LEDGER_FRAGMENTATION_JSON_H_
