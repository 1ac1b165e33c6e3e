// Fragmentation figures as JSON (see fragmentation_json.h).
#include "ledger/fragmentation_json.h"

namespace vramledger {

nlohmann::json FragmentationJson(const Fragmentation& f) {
  return {{"utilization", f.utilization},
          {"wasted_bytes", f.wasted_bytes},
          {"wasted_bytes_at_peak", f.wasted_bytes_at_peak},
          {"free_bytes", f.free_bytes},
          {"largest_free_block", f.largest_free_block},
          {"free_space_fragmentation", f.free_space_fragmentation},
          {"holes", f.holes},
          {"mapped_free_pages", f.mapped_free_pages},
          {"other_stream_cached_bytes", f.other_stream_cached_bytes},
          {"page_moves", f.page_moves},
          {"retiring_bytes", f.retiring_bytes},
          {"reused_old_mappings", f.reused_old_mappings}};
}

}  // namespace vramledger
