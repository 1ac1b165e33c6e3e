// Pausable regions' state (regions.h): names, ids in the regions' id space, member pools, the
// threads inside each region, and its invariants. Not locked: the owner's mutex guards it.
#include "core/regions.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace vramledger::core {

Regions::Region* Regions::Find(std::string_view name, bool create) {
  for (const auto& r : regions_) {
    if (r->name == name) return r.get();
  }
  if (!create) return nullptr;
  auto region = std::make_unique<Region>();
  region->name = std::string(name);
  region->id = {kRegionIdSpace, next_id_++};
  region->pools.push_back(region->id);
  by_pool_[region->id] = region.get();
  regions_.push_back(std::move(region));
  return regions_.back().get();
}

void Regions::AddPool(Region* region, MempoolId id) {
  if (by_pool_.try_emplace(id, region).second) region->pools.push_back(id);
}

void Regions::Enter(Region* region) { entered_.push_back({region, std::this_thread::get_id()}); }

absl::Status Regions::Leave(std::string_view name) {
  const std::thread::id self = std::this_thread::get_id();
  auto mine = std::find_if(entered_.rbegin(), entered_.rend(), [&](const Entry& e) {
    return e.owner == self && e.region->name == name;
  });
  if (mine == entered_.rend()) {
    return absl::NotFoundError(absl::StrCat("vramledger: end of region '", std::string(name),
                                            "', which this thread is not inside"));
  }
  entered_.erase(std::next(mine).base());
  return absl::OkStatus();
}

Regions::Region* Regions::Current() const {
  const std::thread::id self = std::this_thread::get_id();
  for (auto it = entered_.rbegin(); it != entered_.rend(); ++it) {
    if (it->owner == self) return it->region;
  }
  return nullptr;
}

absl::Status Regions::CheckInvariants() const {
  for (const auto& r : regions_) {
    auto fail = [&](auto&&... parts) {
      return absl::InternalError(absl::StrCat("region '", r->name, "': ", parts...));
    };
    if (r->pools.empty() || r->pools.front() != r->id) return fail("its own pool is not first");
    for (MempoolId id : r->pools) {
      if (OfPool(id) != r.get()) return fail("a pool does not name it back");
    }
    if (!r->paused) {
      if (!r->released.empty() || r->paused_bytes != 0 || !r->buffers.empty() ||
          !r->backups.empty() || r->backed_up_bytes != 0) {
        return fail("running, yet holding what a pause keeps");
      }
      for (std::int64_t v : r->withdrawn.allocated_bytes) {
        if (v != 0) return fail("running, yet its stats are withdrawn");
      }
      continue;
    }
    std::size_t released = 0;
    for (const Released& run : r->released) {
      const Segment* seg = run.segment;
      if (run.pages == 0 || run.first_page + run.pages > seg->pages.size()) {
        return fail("a released run outside its segment");
      }
      released += run.pages * seg->page_size;
    }
    if (released != r->paused_bytes)
      return fail("paused bytes ", r->paused_bytes, " but ", released, " released");
    std::size_t backed = 0;
    for (const Backup& b : r->backups) {
      if (b.buffer >= r->buffers.size() || b.offset + b.bytes > r->buffers[b.buffer].bytes) {
        return fail("a backup outside its buffer");
      }
      backed += b.bytes;
    }
    if (backed != r->backed_up_bytes) return fail("backed-up bytes do not add up");
  }
  for (const Entry& e : entered_) {
    if (std::none_of(regions_.begin(), regions_.end(),
                     [&](const auto& r) { return r.get() == e.region; })) {
      return absl::InternalError("an entered region is unknown");
    }
  }
  return absl::OkStatus();
}

}  // namespace vramledger::core
