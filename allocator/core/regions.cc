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

void Regions::ForgetPools(absl::FunctionRef<bool(MempoolId)> gone) {
  for (const auto& region : regions_) {
    std::vector<MempoolId>& pools = region->pools;
    // The region's own pool (first) lasts as long as the allocator.
    for (auto it = pools.begin() + 1; it != pools.end();) {
      if (gone(*it)) {
        by_pool_.erase(*it);
        it = pools.erase(it);
      } else {
        ++it;
      }
    }
  }
}

std::vector<Regions::Released> Regions::Regroup(std::vector<Released> released,
                                                std::size_t handle_bytes) {
  std::sort(released.begin(), released.end(), [](const Released& a, const Released& b) {
    return a.segment->ptr != b.segment->ptr ? a.segment->ptr < b.segment->ptr
                                            : a.first_page < b.first_page;
  });
  std::vector<Released> out;
  for (std::size_t k = 0; k < released.size();) {
    // One contiguous span of released pages in one segment.
    Segment* seg = released[k].segment;
    const std::size_t first = released[k].first_page;
    std::size_t end = first + released[k].pages;
    for (++k; k < released.size() && released[k].segment == seg && released[k].first_page == end;
         ++k) {
      end += released[k].pages;
    }
    const std::size_t max_pages = std::max<std::size_t>(1, handle_bytes / seg->page_size);
    for (std::size_t i = first; i < end; ++i) {
      const bool used = seg->use[i] > 0;
      if (i == first || out.back().pages == max_pages || used != (seg->use[i - 1] > 0)) {
        out.push_back({seg, i, 1});
      } else {
        ++out.back().pages;
      }
    }
  }
  return out;
}

bool Regions::IsLost(const Region& region, const Segment* seg, std::size_t page) {
  return std::any_of(region.lost.begin(), region.lost.end(), [&](const Released& r) {
    return r.segment == seg && page >= r.first_page && page < r.first_page + r.pages;
  });
}

std::size_t Regions::UnmappedLostBytes(const Region& region) {
  std::size_t bytes = 0;
  for (const Released& run : region.lost) {
    for (std::size_t i = run.first_page; i < run.first_page + run.pages; ++i) {
      if (run.segment->pages[i] == 0) bytes += run.segment->page_size;
    }
  }
  return bytes;
}

std::size_t Regions::UnmappedLostBytes() const {
  std::size_t bytes = 0;
  for (const auto& region : regions_) bytes += UnmappedLostBytes(*region);
  return bytes;
}

absl::StatusOr<Regions::Region*> Regions::Inside(std::string_view name) const {
  const std::thread::id self = std::this_thread::get_id();
  for (auto it = entered_.rbegin(); it != entered_.rend(); ++it) {
    if (it->owner == self && it->region->name == name) return it->region;
  }
  return absl::NotFoundError(absl::StrCat("vramledger: end of region '", std::string(name),
                                          "', which this thread is not inside"));
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
          !r->backups.empty() || r->backed_up_bytes != 0 || !r->held.empty()) {
        return fail("running, yet holding what a pause keeps");
      }
      for (std::int64_t v : r->withdrawn.allocated_bytes) {
        if (v != 0) return fail("running, yet its stats are withdrawn");
      }
      continue;
    }
    if (!r->lost.empty()) return fail("paused, yet holding lost runs (its pause takes them)");
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
