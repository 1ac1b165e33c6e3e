// Old mappings of moved handles (old_mappings.h): their entries, page marks and fences, and the
// unmaps that end them. The page-table side of a move (which handle a page maps now) is the
// allocator's (expandable.cc).
#include "core/old_mappings.h"

#include <algorithm>
#include <tuple>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"

namespace vramledger::core {

std::size_t OldMappings::InUse() const {
  return static_cast<std::size_t>(
      absl::c_count_if(entries_, [](const OldMapping& r) { return r.fence != 0; }));
}

std::int64_t OldMappings::Bytes() const {
  std::int64_t bytes = 0;
  for (const OldMapping& r : entries_) {
    bytes += static_cast<std::int64_t>(r.pages * r.segment->page_size);
  }
  return bytes;
}

std::size_t OldMappings::Find(PhysicalHandle handle) const {
  return static_cast<std::size_t>(
      absl::c_find_if(entries_, [&](const OldMapping& r) { return r.handle == handle; }) -
      entries_.begin());
}

void OldMappings::Add(Segment* seg, std::size_t page, std::size_t pages, PhysicalHandle handle,
                      EventId fence) {
  std::fill_n(seg->old_mapping.begin() + static_cast<std::ptrdiff_t>(page), pages,
              Segment::kOldMappingInUse);
  std::fill_n(seg->old_handle.begin() + static_cast<std::ptrdiff_t>(page), pages, handle);
  entries_.push_back({seg, page, pages, handle, fence});
}

void OldMappings::Erase(std::size_t index, GiveBack give_back) {
  const OldMapping r = entries_[index];
  std::fill_n(r.segment->old_mapping.begin() + static_cast<std::ptrdiff_t>(r.first_page), r.pages,
              std::uint8_t{0});
  std::fill_n(r.segment->old_handle.begin() + static_cast<std::ptrdiff_t>(r.first_page), r.pages,
              PhysicalHandle{0});
  entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(index));
  // The handles moved by one allocation share its fence: back to the pool with the last one.
  if (r.fence != 0 &&
      absl::c_none_of(entries_, [&](const OldMapping& o) { return o.fence == r.fence; })) {
    give_back(r.fence);
  }
}

absl::Status OldMappings::UnmapEntry(DeviceBackend* backend, std::size_t index,
                                     GiveBack give_back) {
  const OldMapping& r = entries_[index];
  const std::size_t bytes = r.pages * r.segment->page_size;
  if (absl::Status s = backend->Unmap(r.segment->PageAddress(r.first_page), bytes); !s.ok()) {
    return s;
  }
  Erase(index, give_back);
  return absl::OkStatus();
}

absl::Status OldMappings::Settle(DeviceBackend* backend, bool wait, bool keep, const Segment* only,
                                 PendingStreams* pending, GiveBack give_back) {
  // Entries sharing a fence are adjacent (one allocation pushes them together): one query or
  // wait per fence. A stream's fences complete in the order they were recorded, which is the
  // order of the entries: after one is found pending, that stream's later ones are not queried,
  // nor, through `pending`, by the rest of the allocation.
  EventId known = 0;
  bool known_done = false;
  PendingStreams local;
  PendingStreams& pending_streams = pending != nullptr && !wait ? *pending : local;
  const bool keep_idle = keep && !wait;
  for (std::size_t i = 0; i < entries_.size();) {
    const EventId fence = entries_[i].fence;
    const StreamId stream = entries_[i].segment->stream;  // the fence was recorded there
    if ((only != nullptr && entries_[i].segment != only) || (fence == 0 && keep_idle)) {
      ++i;
      continue;
    }
    if (fence == 0) {  // kept after its work finished: unmapped now (wait: empty_cache, OOM)
      if (absl::Status s = UnmapEntry(backend, i, give_back); !s.ok()) return s;
      continue;
    }
    if (fence != known) {
      known = fence;
      if (absl::c_linear_search(pending_streams, stream)) {
        known_done = false;
      } else if (wait) {
        if (absl::Status s = backend->SynchronizeEvent(fence); !s.ok()) return s;
        known_done = true;
      } else {
        absl::StatusOr<bool> done = backend->QueryEvent(fence);
        if (!done.ok()) return done.status();
        known_done = *done;
        if (!known_done) pending_streams.push_back(stream);
      }
    }
    if (!known_done) {
      ++i;
      continue;
    }
    if (keep_idle) {  // kept, idle: the fence goes back to the pool with its last entry
      OldMapping& r = entries_[i];
      std::fill_n(r.segment->old_mapping.begin() + static_cast<std::ptrdiff_t>(r.first_page),
                  r.pages, Segment::kOldMappingIdle);
      r.fence = 0;
      if (absl::c_none_of(entries_, [&](const OldMapping& o) { return o.fence == fence; })) {
        give_back(fence);
      }
      ++i;
      continue;
    }
    if (absl::Status s = UnmapEntry(backend, i, give_back); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status OldMappings::Clear(DeviceBackend* backend,
                                absl::FunctionRef<bool(const OldMapping&)> which,
                                bool capture_underway, GiveBack give_back) {
  PendingStreams synced;  // during a capture: streams waited for (their fences are complete)
  for (std::size_t i = 0; i < entries_.size();) {
    if (!which(entries_[i])) {
      ++i;
      continue;
    }
    const StreamId stream = entries_[i].segment->stream;  // the fence was recorded there
    if (entries_[i].fence != 0 && capture_underway) {
      if (!absl::c_linear_search(synced, stream)) {
        if (backend->IsCapturing(stream)) {
          return absl::FailedPreconditionError(absl::StrCat(
              "vramledger: pages at 0x",
              absl::Hex(entries_[i].segment->PageAddress(entries_[i].first_page)),
              " are still mapped for work queued on stream ", stream,
              " before its CUDA graph capture began; they can be reused once the capture ends"));
        }
        if (absl::Status s = backend->SynchronizeStream(stream); !s.ok()) return s;
        synced.push_back(stream);
      }
    } else if (entries_[i].fence != 0) {
      absl::StatusOr<bool> done = backend->QueryEvent(entries_[i].fence);  // waits if it must
      if (!done.ok()) return done.status();
      if (!*done) {
        if (absl::Status s = backend->SynchronizeEvent(entries_[i].fence); !s.ok()) return s;
      }
    }
    if (absl::Status s = UnmapEntry(backend, i, give_back); !s.ok()) return s;
  }
  return absl::OkStatus();
}

bool OldMappings::HeldByCapture(DeviceBackend* backend,
                                absl::FunctionRef<bool(const OldMapping&)> which) const {
  return absl::c_any_of(entries_, [&](const OldMapping& r) {
    return r.fence != 0 && which(r) && backend->IsCapturing(r.segment->stream);
  });
}

bool OldMappings::Reusable(const PageTable& table, const Segment* seg, std::size_t page,
                           const Block* within) const {
  const PhysicalHandle h = seg->old_handle[page];
  if (h == 0 || !reuse_now_) return false;
  // Where h is mapped now: the page's hint when h still begins there in this segment (a handle
  // is mapped at one place, its pages consecutive, so that place is h's home), else its home in
  // the page table (placement asks this for every old-mapping page it weighs: the lookup was 14%
  // of a checkpointed replay's instructions).
  const Segment* at = seg;
  std::size_t first = seg->old_home_hint[page];
  if (first >= seg->page_limit || seg->pages[first] != h ||
      (first > 0 && seg->pages[first - 1] == h)) {
    const PageTable::Home* home = table.HomeOf(h);
    if (home == nullptr) return false;
    std::tie(at, first) = *home;
    if (at == seg) seg->old_home_hint[page] = static_cast<std::uint32_t>(first);
  }
  if (at->stream != seg->stream) return false;  // its work there would race the new block's
  // Its home inside the block being placed in: a placement there may cover both places, and
  // the reuse then leaves the handle at home and maps over this page, which waits for the
  // page's fence while the old mapping is in use (page-recycling.md, "Repeated steps").
  if (within != nullptr && at == within->segment &&
      at->PageAddress(first) < within->ptr + within->size &&
      at->PageAddress(at->HandleEnd(first)) > within->ptr) {
    return false;
  }
  for (std::size_t j = first; j < at->page_limit && at->pages[j] == h; ++j) {
    if (at->use[j] != 0) return false;  // a block there is allocated or pending free
  }
  return true;
}

absl::Status OldMappings::CheckInvariants(const PageTable& table) const {
  auto fail = [](auto&&... parts) { return absl::InternalError(absl::StrCat(parts...)); };
  std::size_t old_pages = 0;
  for (const auto& seg : table.segments()) {
    for (std::size_t i = 0; i < seg->page_limit; ++i) {
      if (seg->old_handle[i] != 0) ++old_pages;
      if ((seg->old_handle[i] != 0) != (seg->old_mapping[i] != 0)) {
        return fail("page ", i, ": old-mapping mark and handle disagree");
      }
      if (seg->old_mapping[i] != 0 && seg->pages[i] != 0) {
        return fail("page ", i, " maps a handle and holds an old mapping");
      }
    }
  }
  std::size_t entry_pages = 0;
  for (const OldMapping& r : entries_) {
    entry_pages += r.pages;
    for (std::size_t i = r.first_page; i < r.first_page + r.pages; ++i) {
      if (r.segment->old_handle[i] != r.handle) return fail("old mapping at page ", i, " lost");
    }
    const std::uint8_t mark = r.fence != 0 ? Segment::kOldMappingInUse : Segment::kOldMappingIdle;
    if (r.segment->old_mapping[r.first_page] != mark) {
      return fail("old mapping at page ", r.first_page, ": its mark disagrees with its fence");
    }
  }
  if (entry_pages != old_pages) {
    return fail(old_pages, " old-mapping pages, ", entry_pages, " listed");
  }
  return absl::OkStatus();
}

}  // namespace vramledger::core
