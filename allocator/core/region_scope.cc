// Pausable regions in the allocator, apart from pause and resume (region_pause.cc): entering and
// leaving a region, the private pools created inside one, a paused region's stats and frees, the
// report and the checks. State: core/regions.h. Design: docs/design/regions.md.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::BlockPool;
using core::Segment;

namespace {

// Index of a stat pool in Regions::Withdrawn's arrays.
std::size_t Slot(StatType type) { return type == kSmallPool ? 0 : 1; }

}  // namespace

absl::StatusOr<MempoolId> DeviceAllocatorImpl::BeginRegion(std::string_view name,
                                                           StreamFilter filter) {
  if (name.empty()) return absl::InvalidArgumentError("vramledger: a region needs a name");
  absl::StatusOr<MempoolId> result;
  {
    core::DeviceMutexLock lock(&mu_);
    Region* region = regions_.Find(name, /*create=*/true);
    absl::Status s;
    if (private_pools_.Find(region->id) == nullptr) {
      // The region's own use, never given back: its pool and its ranges last as long as the
      // allocator, so a pause always finds them.
      s = private_pools_.CreateExpandable(region->id, options_.expandable_page_size, 1);
      // The copy stream is made now rather than by the first pause with a backup: the driver
      // keeps device memory for it, which that pause would otherwise fail to give back. Not
      // during a capture, so that no driver call is made beside it; a failure here is not the
      // region's: the pause makes the stream then and reports its error.
      if (s.ok() && !CaptureUnderway()) (void)backend_->PrepareCopies();
    }
    if (s.ok()) s = private_pools_.Begin(region->id, std::move(filter), /*fallback=*/true);
    if (s.ok()) {
      regions_.Enter(region);
      result = region->id;
    } else {
      result = s;  // reported through AfterOperation like every other outcome
    }
  }
  return AfterOperation("begin_region", std::move(result));
}

absl::Status DeviceAllocatorImpl::EndRegion(std::string_view name) {
  absl::Status result;
  {
    core::DeviceMutexLock lock(&mu_);
    absl::StatusOr<Region*> region = regions_.Inside(name);
    if (!region.ok()) {
      result = region.status();  // nothing changes
    } else {
      // The routing entry first: when it fails (the entry was ended through the pool API with
      // the region's id), the thread's region entry still goes, so the two books agree.
      const MempoolId id = (*region)->id;
      result = private_pools_.End(id);
      if (result.ok()) result = private_pools_.Release(id).status();
      const absl::Status left = regions_.Leave(name);  // found above: cannot fail
      if (result.ok()) result = left;
    }
  }
  return AfterOperation("end_region", std::move(result));
}

bool DeviceAllocatorImpl::CreateInRegion(MempoolId id, int uses) {
  Region* region = regions_.Current();
  if (region == nullptr || private_pools_.Find(id) != nullptr) return false;
  if (!private_pools_.CreateExpandable(id, options_.expandable_page_size, uses).ok()) return false;
  regions_.AddPool(region, id);
  // A pool made while its region is paused starts paused with it (it has no pages to release):
  // its requests are refused as the region's are, and the resume runs it with the rest.
  if (region->paused) {
    for (BlockPool* pool : RegionPools(*region)) pool->paused = true;
  }
  return true;
}

std::vector<Segment*> DeviceAllocatorImpl::RegionSegments(const Region& region) const {
  std::vector<Segment*> out;
  for (const auto& seg : page_table_.segments()) {
    if (regions_.OfPool(seg->pool->owner) == &region) out.push_back(seg.get());
  }
  return out;
}

std::vector<BlockPool*> DeviceAllocatorImpl::RegionPools(const Region& region) const {
  std::vector<BlockPool*> out;
  for (MempoolId id : region.pools) {
    if (core::PrivatePools::Pool* pool = private_pools_.Find(id); pool != nullptr) {
      out.push_back(&pool->small);
      out.push_back(&pool->large);
    }
  }
  return out;
}

absl::Status DeviceAllocatorImpl::PausedRegionRefusal(const BlockPool* pool,
                                                      const AllocationRequest& request) const {
  const Region* region = regions_.OfPool(pool->owner);
  return absl::FailedPreconditionError(
      absl::StrCat("vramledger: region '", region != nullptr ? region->name : "?",
                   "' is paused: an allocation of ", FormatSize(request.size), " on stream ",
                   request.stream, " was routed to it; resume it first"));
}

void DeviceAllocatorImpl::ReadmitPausedBlock(Block* block) {
  Region* region = regions_.OfPool(block->pool->owner);
  const StatType type = StatTypesFor(block->pool);
  const std::size_t k = Slot(type);
  const auto bytes = static_cast<std::int64_t>(block->size);
  const auto requested = static_cast<std::int64_t>(block->requested_size);
  core::Regions::Withdrawn& w = region->withdrawn;
  w.allocation[k] -= 1;
  w.allocated_bytes[k] -= bytes;
  w.active[k] -= 1;
  w.active_bytes[k] -= bytes;
  w.requested_bytes[k] -= requested;
  stats_.allocation.Readmit(type, 1, false);
  stats_.allocated_bytes.Readmit(type, bytes, false);
  stats_.active.Readmit(type, 1, false);
  stats_.active_bytes.Readmit(type, bytes, false);
  stats_.requested_bytes.Readmit(type, requested, false);
  block->stream_uses.clear();
}

void DeviceAllocatorImpl::WithdrawStats(Region* region, const std::vector<Segment*>& segments) {
  core::Regions::Withdrawn w;
  for (const Segment* seg : segments) {
    const std::size_t k = Slot(StatTypesFor(seg->pool));
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
      if (!b->allocated) continue;  // no block is pending free after WaitForRegion
      w.allocation[k] += 1;
      w.allocated_bytes[k] += static_cast<std::int64_t>(b->size);
      w.active[k] += 1;
      w.active_bytes[k] += static_cast<std::int64_t>(b->size);
      w.requested_bytes[k] += static_cast<std::int64_t>(b->requested_size);
    }
  }
  for (StatType type : {kSmallPool, kLargePool}) {
    const std::size_t k = Slot(type);
    stats_.allocation.Withdraw(type, w.allocation[k]);
    stats_.allocated_bytes.Withdraw(type, w.allocated_bytes[k]);
    stats_.active.Withdraw(type, w.active[k]);
    stats_.active_bytes.Withdraw(type, w.active_bytes[k]);
    stats_.requested_bytes.Withdraw(type, w.requested_bytes[k]);
  }
  region->withdrawn = w;
}

void DeviceAllocatorImpl::ReadmitStats(Region* region) {
  const core::Regions::Withdrawn& w = region->withdrawn;
  for (StatType type : {kSmallPool, kLargePool}) {
    const std::size_t k = Slot(type);
    stats_.allocation.Readmit(type, w.allocation[k], true);
    stats_.allocated_bytes.Readmit(type, w.allocated_bytes[k], true);
    stats_.active.Readmit(type, w.active[k], true);
    stats_.active_bytes.Readmit(type, w.active_bytes[k], true);
    stats_.requested_bytes.Readmit(type, w.requested_bytes[k], true);
  }
  region->withdrawn = {};
}

std::vector<std::array<const BlockPool*, 2>> DeviceAllocatorImpl::ExpandableGroups() const {
  std::vector<std::array<const BlockPool*, 2>> out = {{&exp_small_pool_, &exp_large_pool_}};
  for (const auto& [id, pool] : private_pools_) {
    if (pool->small.expandable) out.push_back({&pool->small, &pool->large});
  }
  return out;
}

const std::array<const BlockPool*, 2>* DeviceAllocatorImpl::GroupOf(
    const BlockPool* pool, std::array<const BlockPool*, 2>* buf) const {
  if (pool->owner == MempoolId{0, 0}) return nullptr;
  const core::PrivatePools::Pool* owner = private_pools_.Find(pool->owner);
  *buf = {&owner->small, &owner->large};
  return buf;
}

std::vector<RegionInfo> DeviceAllocatorImpl::Regions() const {
  core::DeviceMutexLock lock(&mu_);
  std::vector<RegionInfo> out;
  for (const auto& region : regions_.all()) {
    RegionInfo info;
    info.name = region->name;
    info.pool = region->id;
    info.pools = region->pools;
    info.paused = region->paused;
    for (const Segment* seg : RegionSegments(*region)) {
      info.reserved_bytes += seg->size;
      info.mapped_bytes += seg->mapped_pages * seg->page_size;
      for (const Block* b = seg->head; b != nullptr; b = b->next) {
        if (b->allocated) info.allocated_bytes += b->size;
      }
    }
    // Handles a failed resume could not unmap stay mapped at the region's addresses: device
    // memory the region holds while paused (counted in reserved bytes, too).
    for (const auto& held : region->held) info.mapped_bytes += held.bytes;
    info.lost_bytes = core::Regions::UnmappedLostBytes(*region);
    info.paused_bytes = region->paused_bytes;
    info.backed_up_bytes = region->backed_up_bytes;
    for (const auto& buffer : region->kept) info.host_buffer_bytes += buffer.bytes;
    out.push_back(std::move(info));
  }
  return out;
}

absl::Status DeviceAllocatorImpl::CheckRegions(std::int64_t* withdrawn) const {
  if (absl::Status s = regions_.CheckInvariants(); !s.ok()) return s;
  for (const auto& region : regions_.all()) {
    auto fail = [&](auto&&... parts) {
      return absl::InternalError(absl::StrCat("region '", region->name, "': ", parts...));
    };
    if (private_pools_.Find(region->id) == nullptr) return fail("its pool is gone");
    for (const BlockPool* pool : RegionPools(*region)) {
      if (pool->paused != region->paused) return fail("a pool's paused flag disagrees");
      if (!pool->expandable) return fail("a pool that is not expandable");
    }
    if (!region->paused) continue;
    for (const Segment* seg : RegionSegments(*region)) {
      if (seg->mapped_pages != 0) return fail("paused, yet pages are mapped");
    }
    const core::Regions::Withdrawn& w = region->withdrawn;
    for (std::size_t k = 0; k < 2; ++k) {
      withdrawn[0] += w.allocated_bytes[k];
      withdrawn[1] += w.active_bytes[k];
      withdrawn[2] += w.requested_bytes[k];
      withdrawn[3] += w.allocation[k];
      withdrawn[4] += w.active[k];
    }
  }
  for (const auto& [id, pool] : private_pools_) {
    if (pool->small.paused && regions_.OfPool(id) == nullptr) {
      return absl::InternalError("a paused pool of no region");
    }
  }
  return absl::OkStatus();
}

// ---- Public facade ----

absl::StatusOr<MempoolId> DeviceAllocator::BeginRegion(std::string_view name, StreamFilter filter) {
  return impl_->BeginRegion(name, std::move(filter));
}
absl::Status DeviceAllocator::EndRegion(std::string_view name) { return impl_->EndRegion(name); }
absl::StatusOr<RegionPauseResult> DeviceAllocator::PauseRegion(std::string_view name,
                                                               RegionBackup backup) {
  return impl_->PauseRegion(name, backup);
}
absl::StatusOr<RegionResumeResult> DeviceAllocator::ResumeRegion(std::string_view name,
                                                                 bool keep_host_buffers) {
  return impl_->ResumeRegion(name, keep_host_buffers);
}
std::vector<RegionInfo> DeviceAllocator::Regions() const { return impl_->Regions(); }

}  // namespace vramledger
