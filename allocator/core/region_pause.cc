// Pause and resume of a region (docs/design/regions.md): a pause waits for the region's queued
// work, backs its live blocks up to pinned host memory when asked, and unmaps and releases every
// physical handle of its segments, keeping their virtual ranges; a resume maps fewer, larger
// handles at the same addresses and copies the backups back. Each checks and does every step
// that can fail (region_mapping.cc, region_backup.cc) before it changes the books. Locking:
// locking.md (everything under mu_, but for pinning a backup's buffers ahead and freeing a
// resume's).
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::BlockPool;
using core::OldMapping;
using core::Segment;
using HostBuffer = core::Regions::HostBuffer;

using Released = core::Regions::Released;

namespace {
double Seconds(absl::Time from, absl::Time to) { return absl::ToDoubleSeconds(to - from); }
}  // namespace

absl::StatusOr<RegionPauseResult> DeviceAllocatorImpl::PauseRegion(std::string_view name,
                                                                   RegionBackup backup) {
  std::vector<HostBuffer> pinned;
  if (backup == RegionBackup::kCpu) {
    if (absl::Status s = PinAhead(name, &pinned); !s.ok()) {
      return AfterOperation("pause_region", absl::StatusOr<RegionPauseResult>(std::move(s)));
    }
  }
  absl::StatusOr<RegionPauseResult> result;
  Region* region = nullptr;
  {
    core::DeviceMutexLock lock(&mu_);
    region = regions_.Find(name);
    if (region == nullptr) {
      result = absl::NotFoundError(
          absl::StrCat("vramledger: pause of unknown region '", std::string(name), "'"));
    } else {
      result = PauseLocked(region, backup, &pinned);
    }
  }
  // Buffers pinned ahead for blocks freed in between (or for a pause that failed).
  if (!pinned.empty()) (void)FreePinned(std::move(pinned), region);
  return AfterOperation("pause_region", std::move(result));
}

absl::StatusOr<RegionResumeResult> DeviceAllocatorImpl::ResumeRegion(std::string_view name,
                                                                     bool keep_host_buffers) {
  absl::StatusOr<RegionResumeResult> result;
  std::vector<HostBuffer> to_free;
  Region* region = nullptr;
  {
    core::DeviceMutexLock lock(&mu_);
    region = regions_.Find(name);
    if (region == nullptr) {
      result = absl::NotFoundError(
          absl::StrCat("vramledger: resume of unknown region '", std::string(name), "'"));
    } else {
      result = ResumeLocked(region, keep_host_buffers, &to_free);
    }
  }
  // The backups' buffers are freed without the lock (cudaFreeHost waits for the device); one the
  // backend refuses is kept by the region, and freed by a later empty_cache.
  if (!to_free.empty()) (void)FreePinned(std::move(to_free), region);
  return AfterOperation("resume_region", std::move(result));
}

absl::StatusOr<RegionPauseResult> DeviceAllocatorImpl::PauseLocked(
    Region* region, RegionBackup backup, std::vector<HostBuffer>* pinned) {
  RegionPauseResult out;
  if (region->paused) {
    out.already_paused = true;
    return out;
  }
  if (CaptureUnderway()) {
    return absl::FailedPreconditionError(
        absl::StrCat("vramledger: region '", region->name, "' cannot be paused while a CUDA graph ",
                     "capture is under way (", private_pools_.DescribeCapture(),
                     "): nothing was changed; pause it after the capture ends"));
  }
  const absl::Time start = absl::Now();
  const std::vector<Segment*> segments = RegionSegments(*region);
  if (absl::Status s = WaitForRegion(*region, segments); !s.ok()) return s;
  const absl::Time waited = absl::Now();
  std::vector<Released> runs;  // one per mapped handle
  for (Segment* seg : segments) {
    for (std::size_t i = 0; i < seg->page_limit;) {
      if (seg->pages[i] == 0) {
        ++i;
        continue;
      }
      const std::size_t end = seg->HandleEnd(i);
      runs.push_back({seg, i, end - i});
      i = end;
    }
  }
  if (backup == RegionBackup::kCpu) {
    if (absl::Status s = BackUpRegion(region, segments, pinned); !s.ok()) return s;
  }
  const absl::Time copied = absl::Now();
  if (absl::Status s = UnmapRegion(region, runs); !s.ok()) {
    GiveBackBuffers(region, std::exchange(region->buffers, {}), BufferFate::kAsBefore);
    region->backups.clear();
    region->backed_up_bytes = 0;
    return s;
  }
  // Pages an earlier pause lost (its map-back failed) come back with this resume too, those
  // still unmapped: read before the books release this pause's runs, since a lost page mapped
  // again since (a block placed over it) is one of those runs and comes back once, as such.
  std::vector<Released> lost_runs;
  for (const Released& lost : std::exchange(region->lost, {})) {
    for (std::size_t i = lost.first_page; i < lost.first_page + lost.pages; ++i) {
      if (lost.segment->pages[i] != 0) continue;
      if (!lost_runs.empty() && lost_runs.back().segment == lost.segment &&
          lost_runs.back().first_page + lost_runs.back().pages == i) {
        ++lost_runs.back().pages;
      } else {
        lost_runs.push_back({lost.segment, i, 1, /*lost=*/true});
      }
    }
  }
  // Every driver call that could fail is done: the books follow.
  for (const Released& run : runs) out.released_bytes += ReleaseUnmappedRun(run);
  out.handles = runs.size();
  runs.insert(runs.end(), lost_runs.begin(), lost_runs.end());
  WithdrawStats(region, segments);
  for (BlockPool* pool : RegionPools(*region)) pool->paused = true;
  region->paused = true;
  region->paused_bytes = 0;
  for (const Released& run : runs) region->paused_bytes += run.pages * run.segment->page_size;
  region->released = std::move(runs);
  out.backed_up_bytes = region->backed_up_bytes;
  const absl::Time done = absl::Now();
  out.wait_seconds = Seconds(start, waited);
  out.copy_seconds = Seconds(waited, copied);
  out.driver_seconds = Seconds(copied, done);
  return out;
}

absl::Status DeviceAllocatorImpl::WaitForRegion(const Region& region,
                                                const std::vector<Segment*>& segments) {
  // Frees waiting on record_stream events (and deferred ones) complete first: their blocks are
  // free when the pages go.
  if (absl::Status s =
          SettlePendingFrees(segments, "Events should have synchronized when pausing a region");
      !s.ok()) {
    return s;
  }
  // Then the work queued on the live blocks: their streams and the streams they were used on.
  std::vector<StreamId> streams;
  auto add = [&](StreamId s) {
    if (!absl::c_linear_search(streams, s)) streams.push_back(s);
  };
  for (const Segment* seg : segments) {
    if (seg->mapped_pages == 0) continue;
    add(seg->stream);
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
      for (StreamId s : b->stream_uses) add(s);
    }
  }
  for (StreamId s : streams) {
    if (absl::Status st = backend_->SynchronizeStream(s); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("vramledger: pause of region '", region.name,
                                                  "': waiting for stream ", s, ": ", st.message()));
    }
  }
  // Old mappings inside the region's ranges map handles that are also mapped at their new place
  // in the region; their fences completed with the streams. They go now, so that every handle of
  // the region is mapped at one place only when it is unmapped.
  return ClearOldMappings(
      [&](const OldMapping& r) { return absl::c_linear_search(segments, r.segment); });
}

absl::StatusOr<RegionResumeResult> DeviceAllocatorImpl::ResumeLocked(
    Region* region, bool keep_host_buffers, std::vector<HostBuffer>* to_free) {
  RegionResumeResult out;
  if (!region->paused) {
    out.already_running = true;
    return out;
  }
  if (CaptureUnderway()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "vramledger: region '", region->name, "' cannot be resumed while a CUDA graph ",
        "capture is under way (", private_pools_.DescribeCapture(),
        "): nothing was changed; resume it after the capture ends"));
  }
  if (absl::Status s = ReleaseHeld(region); !s.ok()) return s;
  const std::size_t bytes = region->paused_bytes;
  const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes.current(kAggregate));
  if (fraction_set_ && reserved + bytes > allowed_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("vramledger: resume of region '", region->name, "' needs ", FormatSize(bytes),
                     ", which would take reserved memory to ", FormatSize(reserved + bytes),
                     ", past the memory fraction's cap of ", FormatSize(allowed_bytes_)));
  }
  if (AllocatorHooks* hooks = hooks_.load(std::memory_order_relaxed);
      hooks != nullptr && bytes > 0) {
    AllocationRequest request;
    request.device = device_;
    request.size = bytes;
    request.rounded = bytes;
    request.stream = region->released.front().segment->stream;
    if (absl::Status verdict = hooks->CheckGrowth(request, reserved + bytes, HookView());
        !verdict.ok()) {
      return verdict;
    }
  }
  const absl::Time start = absl::Now();
  // Fewer, larger handles than the pause released (Regions::Regroup): the driver's cost is per
  // handle, and the next pause releases these.
  const std::vector<Released> runs =
      core::Regions::Regroup(region->released, core::kRegionHandleBytes);
  std::vector<PhysicalHandle> handles;
  absl::Time mapped;
  if (absl::Status s = MapRegion(region, runs, &handles, &mapped); !s.ok()) return s;
  const absl::Time copied = absl::Now();
  for (std::size_t k = 0; k < runs.size(); ++k) {
    const Released& run = runs[k];
    Segment* seg = run.segment;
    const std::size_t n = run.pages * seg->page_size;
    page_table_.Map(seg, run.first_page, run.pages, handles[k]);
    UpdateStat(stats_.reserved_bytes, StatTypesFor(seg->pool), static_cast<std::int64_t>(n));
    ++stats_.num_device_alloc;
    Emit(TraceAction::kSegmentMap, seg->PageAddress(run.first_page), n, seg->stream, 0, 0,
         seg->pool->owner);
    out.mapped_bytes += n;
  }
  out.handles = runs.size();
  ReadmitStats(region);
  for (BlockPool* pool : RegionPools(*region)) pool->paused = false;
  out.restored_bytes = region->backed_up_bytes;
  std::vector<HostBuffer> buffers = std::exchange(region->buffers, {});
  if (keep_host_buffers) {
    GiveBackBuffers(region, std::move(buffers), BufferFate::kKeep);
  } else {
    *to_free = std::move(buffers);  // no book names them now
  }
  region->backups.clear();
  region->backed_up_bytes = 0;
  region->released.clear();
  region->paused_bytes = 0;
  region->paused = false;
  out.driver_seconds = Seconds(start, mapped);
  out.copy_seconds = Seconds(mapped, copied);
  return out;
}

}  // namespace vramledger
