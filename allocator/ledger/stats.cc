// Flattens DeviceStats into torch.cuda.memory_stats()'s dotted key names
// (docs/design/torch-facts.md §7). Pure function; thread-safe.
#include <string>

#include "vramledger/stats.h"

namespace vramledger {
namespace {

void AddStat(std::map<std::string, std::int64_t>& out, const std::string& prefix, const Stat& s) {
  out[prefix + ".current"] = s.current;
  out[prefix + ".peak"] = s.peak;
  out[prefix + ".allocated"] = s.allocated;
  out[prefix + ".freed"] = s.freed;
}

void AddArray(std::map<std::string, std::int64_t>& out, const std::string& name,
              const StatArray& a) {
  static constexpr const char* kTypeNames[kNumStatTypes] = {"all", "small_pool", "large_pool"};
  for (int i = 0; i < kNumStatTypes; ++i) AddStat(out, name + "." + kTypeNames[i], a[i]);
}

}  // namespace

std::map<std::string, std::int64_t> FlattenStats(const DeviceStats& s) {
  std::map<std::string, std::int64_t> out;
  AddArray(out, "allocation", s.allocation);
  AddArray(out, "segment", s.segment);
  AddArray(out, "active", s.active);
  AddArray(out, "inactive_split", s.inactive_split);
  AddArray(out, "allocated_bytes", s.allocated_bytes);
  AddArray(out, "reserved_bytes", s.reserved_bytes);
  AddArray(out, "active_bytes", s.active_bytes);
  AddArray(out, "inactive_split_bytes", s.inactive_split_bytes);
  AddArray(out, "requested_bytes", s.requested_bytes);
  AddStat(out, "oversize_allocations", s.oversize_allocations);
  AddStat(out, "oversize_segments", s.oversize_segments);
  out["num_alloc_retries"] = s.num_alloc_retries;
  out["num_ooms"] = s.num_ooms;
  out["num_sync_all_streams"] = s.num_sync_all_streams;
  out["num_device_alloc"] = s.num_device_alloc;
  out["num_device_free"] = s.num_device_free;
  out["max_split_size"] = s.max_split_size;
  out["largest_free_block_bytes"] = s.largest_free_block_bytes;
  return out;
}

}  // namespace vramledger
