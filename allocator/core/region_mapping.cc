// The driver calls of a region's pause and resume (docs/design/regions.md): unmapping every
// handle of a pause (mapped back when one fails), creating and mapping a resume's handles with
// access and copies (undone when one fails), and the books of what an undo could not undo: runs
// a pause lost, handles a resume holds. Locking: locking.md (everything under mu_).
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Segment;
using Released = core::Regions::Released;

absl::Status DeviceAllocatorImpl::UnmapRegion(Region* region, const std::vector<Released>& runs) {
  RelaxedCaptureScope relaxed(backend_);
  for (std::size_t k = 0; k < runs.size(); ++k) {
    const Segment* seg = runs[k].segment;
    const DevicePtr va = seg->PageAddress(runs[k].first_page);
    const std::size_t bytes = runs[k].pages * seg->page_size;
    absl::Status s = backend_->Unmap(va, bytes);
    if (s.ok()) continue;
    // The handles unmapped so far still hold their contents: mapped back, nothing is lost.
    std::vector<Released> lost;
    for (std::size_t j = 0; j < k; ++j) {
      const Segment* back = runs[j].segment;
      const DevicePtr at = back->PageAddress(runs[j].first_page);
      const std::size_t n = runs[j].pages * back->page_size;
      absl::Status again = backend_->Map(at, n, back->pages[runs[j].first_page]);
      const bool mapped = again.ok();
      if (mapped) again = backend_->SetAccess(at, n);
      if (again.ok()) continue;
      s = absl::Status(s.code(), absl::StrCat(s.message(), "; mapping 0x", absl::Hex(at),
                                              " back failed too (", again.message(), ")"));
      if (mapped) {
        if (absl::Status gone = backend_->Unmap(at, n); !gone.ok()) {
          // Mapped without access and not unmappable: booked as mapped (it is), and no
          // expandable allocation is served while it exists (driver-errors.md, "Two failures").
          page_table_.MarkInaccessible(back, runs[j].first_page, s);
          continue;
        }
      }
      lost.push_back(runs[j]);
      s = absl::Status(s.code(), absl::StrCat(s.message(), ": its contents are lost"));
    }
    LosePages(region, lost);
    return absl::Status(
        s.code(), absl::StrCat("vramledger: pause of region '", region->name, "': ", s.message()));
  }
  return absl::OkStatus();
}

void DeviceAllocatorImpl::LosePages(Region* region, const std::vector<Released>& lost) {
  // Not mapped anywhere now: the books say so and the handle is released. Live blocks may lie
  // on the run, and a running region's live blocks need pages under them (the stats, the
  // snapshot and the kernels that use them count on it): a new handle is mapped there, its
  // contents undefined, as after a pause without backup. Only when the driver refuses that too
  // does the region keep the run, so that its next pause and resume map pages there again (a
  // kernel that reads the blocks over it faults until then).
  auto book_mapped = [this](const Released& run,
                            PhysicalHandle handle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Segment* seg = run.segment;
    const std::size_t n = run.pages * seg->page_size;
    page_table_.Map(seg, run.first_page, run.pages, handle);
    UpdateStat(stats_.reserved_bytes, StatTypesFor(seg->pool), static_cast<std::int64_t>(n));
    ++stats_.num_device_alloc;
    Emit(TraceAction::kSegmentMap, seg->PageAddress(run.first_page), n, seg->stream, 0, 0,
         seg->pool->owner);
  };
  for (const Released& run : lost) {
    ReleaseUnmappedRun(run);
    const DevicePtr va = run.segment->PageAddress(run.first_page);
    const std::size_t n = run.pages * run.segment->page_size;
    PhysicalHandle handle = 0;
    if (backend_->CreatePhysical(n, &handle).ok()) {
      const bool mapped = backend_->Map(va, n, handle).ok();
      absl::Status access = mapped ? backend_->SetAccess(va, n) : absl::OkStatus();
      if (mapped && access.ok()) {
        book_mapped(run, handle);
        continue;
      }
      if (mapped && !backend_->Unmap(va, n).ok()) {
        // Mapped without access and not unmappable: booked as mapped (it is), as above.
        book_mapped(run, handle);
        page_table_.MarkInaccessible(run.segment, run.first_page, std::move(access));
        continue;
      }
      if (!backend_->ReleasePhysical(handle).ok()) page_table_.KeepUnreleased(handle);
    }
    region->lost.push_back(run);
  }
}

std::size_t DeviceAllocatorImpl::ReleaseUnmappedRun(const Released& run) {
  Segment* seg = run.segment;
  const std::size_t bytes = run.pages * seg->page_size;
  std::size_t pages = 0;
  const PhysicalHandle handle = page_table_.Unmap(seg, run.first_page, &pages);
  page_table_.ForgetInaccessible(seg, run.first_page);
  ++stats_.num_device_free;
  Emit(TraceAction::kSegmentUnmap, seg->PageAddress(run.first_page), bytes, seg->stream, 0, 0,
       seg->pool->owner);
  (void)ReleaseCounted(handle, StatTypesFor(seg->pool), static_cast<std::int64_t>(bytes));
  return bytes;
}

absl::Status DeviceAllocatorImpl::ReleaseHeld(Region* region) {
  // Handles a failed resume could not unmap stay mapped where it mapped them; they go before
  // this resume maps anything there.
  RelaxedCaptureScope relaxed(backend_);
  while (!region->held.empty()) {
    const core::Regions::Held& h = region->held.back();
    if (absl::Status s = backend_->Unmap(h.address, h.bytes); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("vramledger: resume of region '", region->name, "': unmapping 0x",
                                 absl::Hex(h.address), ", left by a failed resume: ", s.message()));
    }
    if (!backend_->ReleasePhysical(h.handle).ok()) page_table_.KeepUnreleased(h.handle);
    UpdateStat(stats_.reserved_bytes, StatTypesFor(h.segment->pool),
               -static_cast<std::int64_t>(h.bytes));
    region->held.pop_back();
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::MapRegion(Region* region, const std::vector<Released>& runs,
                                            std::vector<PhysicalHandle>* handles,
                                            absl::Time* mapped_at) {
  std::size_t mapped = 0;  // runs[0, mapped) have their handle mapped
  auto undo = [&](absl::Status error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (std::size_t k = 0; k < handles->size(); ++k) {
      if (k < mapped) {
        const Segment* seg = runs[k].segment;
        const DevicePtr va = seg->PageAddress(runs[k].first_page);
        const std::size_t n = runs[k].pages * seg->page_size;
        // A handle that will not unmap cannot be released: the region holds it, mapped there,
        // and the next resume unmaps and releases it first (ReleaseHeld).
        if (!backend_->Unmap(va, n).ok()) {
          region->held.push_back({runs[k].segment, va, n, (*handles)[k]});
          UpdateStat(stats_.reserved_bytes, StatTypesFor(seg->pool), static_cast<std::int64_t>(n));
          continue;
        }
      }
      if (!backend_->ReleasePhysical((*handles)[k]).ok()) {
        page_table_.KeepUnreleased((*handles)[k]);  // released by a later empty_cache
      }
    }
    handles->clear();
    return absl::Status(error.code(), absl::StrCat("vramledger: resume of region '", region->name,
                                                   "': ", error.message()));
  };
  RelaxedCaptureScope relaxed(backend_);
  for (const Released& run : runs) {
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
            "CUDA out of memory: it needs ", FormatSize(region->paused_bytes), ", of which ",
            FormatSize(missing), " could not be created with ", FormatSize(free_bytes), " free of ",
            FormatSize(total_bytes), " (", s.message(), ")"));
      }
      return undo(s);
    }
    handles->push_back(handle);
  }
  // Mapped handle by handle; access granted once per contiguous range of them.
  for (std::size_t span = 0; span < runs.size();) {
    std::size_t end = span + 1;
    while (end < runs.size() && runs[end].segment == runs[span].segment &&
           runs[end - 1].first_page + runs[end - 1].pages == runs[end].first_page) {
      ++end;
    }
    for (; mapped < end; ++mapped) {
      const Released& run = runs[mapped];
      const DevicePtr va = run.segment->PageAddress(run.first_page);
      if (absl::Status s =
              backend_->Map(va, run.pages * run.segment->page_size, (*handles)[mapped]);
          !s.ok()) {
        return undo(s);
      }
    }
    const Segment* seg = runs[span].segment;
    const std::size_t pages =
        runs[end - 1].first_page + runs[end - 1].pages - runs[span].first_page;
    if (absl::Status s =
            backend_->SetAccess(seg->PageAddress(runs[span].first_page), pages * seg->page_size);
        !s.ok()) {
      return undo(s);  // mapped without access: undo unmaps them
    }
    span = end;
  }
  *mapped_at = absl::Now();
  if (absl::Status s = RestoreBackups(*region); !s.ok()) return undo(s);
  return absl::OkStatus();
}

}  // namespace vramledger
