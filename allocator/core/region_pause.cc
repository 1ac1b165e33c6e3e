// Pause and resume of a region (docs/design/regions.md): a pause waits for the region's queued
// work, backs its live blocks up to pinned host memory when asked, and unmaps and releases every
// physical handle of its segments, keeping their virtual ranges; a resume maps new handles at the
// same addresses and copies the backups back. Each checks and does every step that can fail
// before it changes the books, and undoes its own driver calls when one fails, so a failure
// leaves the region as it was. Locking: locking.md (everything under mu_).
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::BlockPool;
using core::OldMapping;
using core::Segment;
using HostBuffer = core::Regions::HostBuffer;

namespace {
constexpr std::size_t kPinnedRounding = std::size_t{2} << 20;
}  // namespace

absl::StatusOr<RegionPauseResult> DeviceAllocatorImpl::PauseRegion(std::string_view name,
                                                                   RegionBackup backup) {
  absl::StatusOr<RegionPauseResult> result;
  {
    core::DeviceMutexLock lock(&mu_);
    Region* region = regions_.Find(name);
    if (region == nullptr) {
      result = absl::NotFoundError(
          absl::StrCat("vramledger: pause of unknown region '", std::string(name), "'"));
    } else {
      result = PauseLocked(region, backup);
    }
  }
  return AfterOperation("pause_region", std::move(result));
}

absl::StatusOr<RegionResumeResult> DeviceAllocatorImpl::ResumeRegion(std::string_view name,
                                                                     bool keep_host_buffers) {
  absl::StatusOr<RegionResumeResult> result;
  {
    core::DeviceMutexLock lock(&mu_);
    Region* region = regions_.Find(name);
    if (region == nullptr) {
      result = absl::NotFoundError(
          absl::StrCat("vramledger: resume of unknown region '", std::string(name), "'"));
    } else {
      result = ResumeLocked(region, keep_host_buffers);
    }
  }
  return AfterOperation("resume_region", std::move(result));
}

absl::StatusOr<RegionPauseResult> DeviceAllocatorImpl::PauseLocked(Region* region,
                                                                   RegionBackup backup) {
  RegionPauseResult out;
  if (region->paused) {
    out.already_paused = true;
    return out;
  }
  if (CaptureUnderway()) {
    return absl::FailedPreconditionError(
        absl::StrCat("vramledger: region '", region->name,
                     "' cannot be paused while a CUDA graph capture is under way"));
  }
  const std::vector<Segment*> segments = RegionSegments(*region);
  if (absl::Status s = WaitForRegion(*region, segments); !s.ok()) return s;
  std::vector<core::Regions::Released> runs;
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
    if (absl::Status s = BackUpRegion(region, segments); !s.ok()) return s;
  }
  if (absl::Status s = UnmapRegion(*region, runs); !s.ok()) {
    GiveBackBuffers(region, std::exchange(region->buffers, {}), BufferFate::kAsBefore);
    region->backups.clear();
    region->backed_up_bytes = 0;
    return s;
  }
  // Every driver call that could fail is done: the books follow.
  for (const core::Regions::Released& run : runs) {
    Segment* seg = run.segment;
    const std::size_t bytes = run.pages * seg->page_size;
    std::size_t pages = 0;
    const PhysicalHandle handle = page_table_.Unmap(seg, run.first_page, &pages);
    page_table_.ForgetInaccessible(seg, run.first_page);
    ++stats_.num_device_free;
    Emit(TraceAction::kSegmentUnmap, seg->PageAddress(run.first_page), bytes, seg->stream, 0, 0,
         seg->pool->owner);
    // A handle the driver will not release is kept and released by a later empty_cache.
    (void)ReleaseCounted(handle, StatTypesFor(seg->pool), static_cast<std::int64_t>(bytes));
    out.released_bytes += bytes;
  }
  WithdrawStats(region, segments);
  for (BlockPool* pool : RegionPools(*region)) pool->paused = true;
  region->paused = true;
  region->released = std::move(runs);
  region->paused_bytes = out.released_bytes;
  out.backed_up_bytes = region->backed_up_bytes;
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

absl::Status DeviceAllocatorImpl::BackUpRegion(Region* region,
                                               const std::vector<Segment*>& segments) {
  // One pinned buffer per segment holding live blocks, sized to their bytes; each run of
  // neighbouring live blocks is one copy.
  std::vector<HostBuffer> buffers;
  std::vector<core::Regions::Backup> backups;
  std::size_t total = 0;
  absl::Status status;
  for (const Segment* seg : segments) {
    std::vector<std::pair<DevicePtr, std::size_t>> live;
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
      if (!b->allocated) continue;
      if (!live.empty() && live.back().first + live.back().second == b->ptr) {
        live.back().second += b->size;
      } else {
        live.emplace_back(b->ptr, b->size);
      }
    }
    std::size_t bytes = 0;
    for (const auto& run : live) bytes += run.second;
    if (bytes == 0) continue;
    HostBuffer buffer;
    // A buffer kept by an earlier resume (keep_host_buffers) serves if it is large enough: the
    // smallest such, so a small segment's backup does not take the buffer a larger one needs
    // (pinning new host memory costs far more than the copy).
    auto kept = region->kept.end();
    for (auto h = region->kept.begin(); h != region->kept.end(); ++h) {
      if (h->bytes >= bytes && (kept == region->kept.end() || h->bytes < kept->bytes)) kept = h;
    }
    if (kept != region->kept.end()) {
      buffer = *kept;
      buffer.kept = true;  // back to kept if the pause fails
      region->kept.erase(kept);
    } else {
      // Rounded up to 2 MiB, so a later pause whose live bytes grew a little reuses it.
      const std::size_t pinned = (bytes + kPinnedRounding - 1) / kPinnedRounding * kPinnedRounding;
      absl::StatusOr<void*> data = backend_->HostAllocPinned(pinned);
      if (!data.ok()) {
        status = absl::Status(data.status().code(),
                              absl::StrCat("vramledger: pause of region '", region->name,
                                           "': pinned host memory for its backup (",
                                           FormatSize(bytes), "): ", data.status().message()));
        break;
      }
      buffer = {*data, pinned};
    }
    buffers.push_back(buffer);
    std::size_t offset = 0;
    for (const auto& [address, n] : live) {
      status = backend_->CopyDeviceToHost(static_cast<char*>(buffer.data) + offset, address, n);
      if (!status.ok()) {
        status =
            absl::Status(status.code(), absl::StrCat("vramledger: pause of region '", region->name,
                                                     "': its backup: ", status.message()));
        break;
      }
      backups.push_back({address, n, buffers.size() - 1, offset});
      offset += n;
    }
    if (!status.ok()) break;
    total += bytes;
  }
  if (!status.ok()) {
    GiveBackBuffers(region, std::move(buffers), BufferFate::kAsBefore);
    return status;
  }
  region->buffers = std::move(buffers);
  region->backups = std::move(backups);
  region->backed_up_bytes = total;
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::UnmapRegion(const Region& region,
                                              const std::vector<core::Regions::Released>& runs) {
  for (std::size_t k = 0; k < runs.size(); ++k) {
    const Segment* seg = runs[k].segment;
    const DevicePtr va = seg->PageAddress(runs[k].first_page);
    const std::size_t bytes = runs[k].pages * seg->page_size;
    absl::Status s = backend_->Unmap(va, bytes);
    if (s.ok()) continue;
    // The handles unmapped so far still hold their contents: mapped back, nothing is lost.
    for (std::size_t j = 0; j < k; ++j) {
      const Segment* back = runs[j].segment;
      const DevicePtr at = back->PageAddress(runs[j].first_page);
      const std::size_t n = runs[j].pages * back->page_size;
      absl::Status again = backend_->Map(at, n, back->pages[runs[j].first_page]);
      if (again.ok()) again = backend_->SetAccess(at, n);
      if (!again.ok()) {
        s = absl::Status(s.code(), absl::StrCat(s.message(), "; mapping 0x", absl::Hex(at),
                                                " back failed too: ", again.message()));
      }
    }
    return absl::Status(
        s.code(), absl::StrCat("vramledger: pause of region '", region.name, "': ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<RegionResumeResult> DeviceAllocatorImpl::ResumeLocked(Region* region,
                                                                     bool keep_host_buffers) {
  RegionResumeResult out;
  if (!region->paused) {
    out.already_running = true;
    return out;
  }
  if (CaptureUnderway()) {
    return absl::FailedPreconditionError(
        absl::StrCat("vramledger: region '", region->name,
                     "' cannot be resumed while a CUDA graph capture is under way"));
  }
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
  std::vector<PhysicalHandle> handles;
  if (absl::Status s = MapRegion(*region, &handles); !s.ok()) return s;
  for (std::size_t k = 0; k < region->released.size(); ++k) {
    const core::Regions::Released& run = region->released[k];
    Segment* seg = run.segment;
    const std::size_t n = run.pages * seg->page_size;
    page_table_.Map(seg, run.first_page, run.pages, handles[k]);
    UpdateStat(stats_.reserved_bytes, StatTypesFor(seg->pool), static_cast<std::int64_t>(n));
    ++stats_.num_device_alloc;
    Emit(TraceAction::kSegmentMap, seg->PageAddress(run.first_page), n, seg->stream, 0, 0,
         seg->pool->owner);
    out.mapped_bytes += n;
  }
  ReadmitStats(region);
  for (BlockPool* pool : RegionPools(*region)) pool->paused = false;
  out.restored_bytes = region->backed_up_bytes;
  GiveBackBuffers(region, std::exchange(region->buffers, {}),
                  keep_host_buffers ? BufferFate::kKeep : BufferFate::kFree);
  region->backups.clear();
  region->backed_up_bytes = 0;
  region->released.clear();
  region->paused_bytes = 0;
  region->paused = false;
  return out;
}

absl::Status DeviceAllocatorImpl::MapRegion(const Region& region,
                                            std::vector<PhysicalHandle>* handles) {
  const std::vector<core::Regions::Released>& runs = region.released;
  std::size_t mapped = 0;  // runs[0, mapped) have their handle mapped
  auto undo = [&](absl::Status error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (std::size_t k = 0; k < handles->size(); ++k) {
      if (k < mapped) {
        const Segment* seg = runs[k].segment;
        // A handle that will not unmap cannot be released: it stays mapped there, unused, and
        // the next resume's map of that run fails and says so.
        if (!backend_->Unmap(seg->PageAddress(runs[k].first_page), runs[k].pages * seg->page_size)
                 .ok()) {
          continue;
        }
      }
      if (!backend_->ReleasePhysical((*handles)[k]).ok()) {
        page_table_.KeepUnreleased((*handles)[k]);  // released by a later empty_cache
      }
    }
    handles->clear();
    return absl::Status(error.code(), absl::StrCat("vramledger: resume of region '", region.name,
                                                   "': ", error.message()));
  };
  RelaxedCaptureScope relaxed(backend_);
  for (const core::Regions::Released& run : runs) {
    const std::size_t n = run.pages * run.segment->page_size;
    PhysicalHandle handle = 0;
    if (absl::Status s = backend_->CreatePhysical(n, &handle); !s.ok()) {
      if (absl::IsResourceExhausted(s)) {
        std::size_t free_bytes = 0;
        std::size_t total_bytes = 0;
        (void)backend_->MemGetInfo(&free_bytes, &total_bytes);
        std::size_t missing = 0;
        for (std::size_t k = handles->size(); k < runs.size(); ++k) {
          missing += runs[k].pages * runs[k].segment->page_size;
        }
        s = absl::ResourceExhaustedError(absl::StrCat(
            "CUDA out of memory: it needs ", FormatSize(region.paused_bytes), ", of which ",
            FormatSize(missing), " could not be created with ", FormatSize(free_bytes), " free of ",
            FormatSize(total_bytes), " (", s.message(), ")"));
      }
      return undo(s);
    }
    handles->push_back(handle);
  }
  for (; mapped < runs.size(); ++mapped) {
    const core::Regions::Released& run = runs[mapped];
    const DevicePtr va = run.segment->PageAddress(run.first_page);
    const std::size_t n = run.pages * run.segment->page_size;
    if (absl::Status s = backend_->Map(va, n, (*handles)[mapped]); !s.ok()) return undo(s);
    if (absl::Status s = backend_->SetAccess(va, n); !s.ok()) {
      ++mapped;  // mapped without access: undo unmaps it
      return undo(s);
    }
  }
  for (const core::Regions::Backup& b : region.backups) {
    const char* src = static_cast<const char*>(region.buffers[b.buffer].data) + b.offset;
    if (absl::Status s = backend_->CopyHostToDevice(b.address, src, b.bytes); !s.ok()) {
      return undo(s);
    }
  }
  return absl::OkStatus();
}

void DeviceAllocatorImpl::GiveBackBuffers(Region* region, std::vector<HostBuffer> buffers,
                                          BufferFate fate) {
  for (HostBuffer& buffer : buffers) {
    const bool keep = fate == BufferFate::kKeep || (fate == BufferFate::kAsBefore && buffer.kept);
    buffer.kept = false;
    if (keep || !backend_->HostFreePinned(buffer.data).ok()) region->kept.push_back(buffer);
  }
}

}  // namespace vramledger
