// A region's backups in pinned host memory (docs/design/regions.md): the pause copies the live
// blocks out, the resume copies them back, each as one batch of copies with one wait; the pinned
// buffers are reused across pauses when a resume keeps them, and freed by empty_cache otherwise.
// Locking: locking.md (everything under mu_, but for pinning a pause's buffers ahead and freeing
// buffers already taken out: cudaHostAlloc and cudaFreeHost take up to a second per few GiB).
#include <algorithm>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::Segment;
using HostBuffer = core::Regions::HostBuffer;

namespace {
constexpr std::size_t kPinnedRounding = std::size_t{2} << 20;

// `live` less the pages a failed pause lost (Region::lost) that are still unmapped: nothing is
// mapped there to copy, and their contents are gone already.
std::vector<std::pair<DevicePtr, std::size_t>> WithoutLostPages(
    const core::Regions::Region& region, const Segment& seg,
    const std::vector<std::pair<DevicePtr, std::size_t>>& live) {
  std::vector<std::pair<DevicePtr, std::size_t>> out;
  for (const auto& [address, n] : live) {
    for (DevicePtr at = address; at < address + n;) {
      const std::size_t page = seg.PageOf(at);
      const DevicePtr end = std::min(address + n, seg.PageAddress(page + 1));
      // A lost page mapped again since (its block freed, the page grown into) holds data.
      if (seg.pages[page] != 0 || !core::Regions::IsLost(region, &seg, page)) {
        if (!out.empty() && out.back().first + out.back().second == at) {
          out.back().second += end - at;
        } else {
          out.emplace_back(at, end - at);
        }
      }
      at = end;
    }
  }
  return out;
}
}  // namespace

namespace {
// The runs of neighbouring live blocks of `seg`, less lost pages.
std::vector<std::pair<DevicePtr, std::size_t>> LiveRuns(const core::Regions::Region& region,
                                                        const Segment& seg) {
  std::vector<std::pair<DevicePtr, std::size_t>> live;
  for (const Block* b = seg.head; b != nullptr; b = b->next) {
    if (!b->allocated) continue;
    if (!live.empty() && live.back().first + live.back().second == b->ptr) {
      live.back().second += b->size;
    } else {
      live.emplace_back(b->ptr, b->size);
    }
  }
  if (!region.lost.empty()) live = WithoutLostPages(region, seg, live);
  return live;
}

std::size_t Bytes(const std::vector<std::pair<DevicePtr, std::size_t>>& runs) {
  std::size_t bytes = 0;
  for (const auto& run : runs) bytes += run.second;
  return bytes;
}

// Rounded up to 2 MiB, so a later pause whose live bytes grew a little reuses the buffer.
std::size_t PinnedSize(std::size_t bytes) {
  return (bytes + kPinnedRounding - 1) / kPinnedRounding * kPinnedRounding;
}

// Takes the smallest buffer of `from` holding `bytes`, so a small segment's backup does not take
// the buffer a larger one needs (pinning new host memory costs far more than the copy).
std::optional<HostBuffer> TakeSmallestFitting(std::vector<HostBuffer>* from, std::size_t bytes) {
  auto best = from->end();
  for (auto h = from->begin(); h != from->end(); ++h) {
    if (h->bytes >= bytes && (best == from->end() || h->bytes < best->bytes)) best = h;
  }
  if (best == from->end()) return std::nullopt;
  HostBuffer out = *best;
  from->erase(best);
  return out;
}

absl::Status PinFailure(const core::Regions::Region& region, std::size_t bytes,
                        const absl::Status& cause) {
  return absl::Status(cause.code(), absl::StrCat("vramledger: pause of region '", region.name,
                                                 "': pinned host memory for its backup (",
                                                 FormatSize(bytes), "): ", cause.message()));
}
}  // namespace

std::vector<DeviceAllocatorImpl::PinRequest> DeviceAllocatorImpl::BackupPins(
    const Region& region) const {
  // The same choice BackUpRegion makes, on sizes only: a kept buffer where one fits.
  std::vector<HostBuffer> kept = region.kept;
  std::vector<PinRequest> out;
  for (const Segment* seg : RegionSegments(region)) {
    const std::size_t bytes = Bytes(LiveRuns(region, *seg));
    if (bytes == 0 || TakeSmallestFitting(&kept, bytes).has_value()) continue;
    out.push_back({bytes, PinnedSize(bytes)});
  }
  return out;
}

absl::Status DeviceAllocatorImpl::PinAhead(std::string_view name, std::vector<HostBuffer>* pinned) {
  std::vector<PinRequest> requests;
  Region* region = nullptr;
  {
    core::DeviceMutexLock lock(&mu_);
    region = regions_.Find(name);
    // What the pause will refuse or skip pins nothing.
    if (region == nullptr || region->paused || CaptureUnderway()) return absl::OkStatus();
    requests = BackupPins(*region);
  }
  for (const PinRequest& request : requests) {
    absl::StatusOr<void*> data = backend_->HostAllocPinned(request.pinned);
    if (!data.ok()) {
      (void)FreePinned(std::exchange(*pinned, {}), region);
      return PinFailure(*region, request.bytes, data.status());
    }
    pinned->push_back({*data, request.pinned});
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::BackUpRegion(Region* region,
                                               const std::vector<Segment*>& segments,
                                               std::vector<HostBuffer>* pinned) {
  // One pinned buffer per segment holding live blocks, sized to their bytes; each run of
  // neighbouring live blocks is one copy, and all the copies are one batch with one wait.
  std::vector<HostBuffer> buffers;
  std::vector<core::Regions::Backup> backups;
  std::vector<HostCopy> copies;
  std::size_t total = 0;
  absl::Status status;
  for (const Segment* seg : segments) {
    const std::vector<std::pair<DevicePtr, std::size_t>> live = LiveRuns(*region, *seg);
    const std::size_t bytes = Bytes(live);
    if (bytes == 0) continue;
    // A buffer kept by an earlier resume (keep_host_buffers) serves if it is large enough, then
    // one pinned ahead of the lock; only blocks allocated since need pinning here.
    std::optional<HostBuffer> buffer = TakeSmallestFitting(&region->kept, bytes);
    if (buffer.has_value()) {
      buffer->kept = true;  // back to kept if the pause fails
    } else {
      buffer = TakeSmallestFitting(pinned, bytes);
    }
    if (!buffer.has_value()) {
      const std::size_t size = PinnedSize(bytes);
      absl::StatusOr<void*> data = backend_->HostAllocPinned(size);
      if (!data.ok()) {
        status = PinFailure(*region, bytes, data.status());
        break;
      }
      buffer = HostBuffer{*data, size};
    }
    buffers.push_back(*buffer);
    std::size_t offset = 0;
    for (const auto& [address, n] : live) {
      copies.push_back({static_cast<char*>(buffer->data) + offset, address, n});
      backups.push_back({address, n, buffers.size() - 1, offset});
      offset += n;
    }
    total += bytes;
  }
  if (status.ok()) {
    status = backend_->CopyDeviceToHost(copies);
    if (!status.ok()) {
      status =
          absl::Status(status.code(), absl::StrCat("vramledger: pause of region '", region->name,
                                                   "': its backup: ", status.message()));
    }
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

absl::Status DeviceAllocatorImpl::RestoreBackups(const Region& region) {
  std::vector<HostCopy> copies;
  copies.reserve(region.backups.size());
  for (const core::Regions::Backup& b : region.backups) {
    copies.push_back(
        {static_cast<char*>(region.buffers[b.buffer].data) + b.offset, b.address, b.bytes});
  }
  return backend_->CopyHostToDevice(copies);
}

void DeviceAllocatorImpl::GiveBackBuffers(Region* region, std::vector<HostBuffer> buffers,
                                          BufferFate fate) {
  for (HostBuffer& buffer : buffers) {
    const bool keep = fate == BufferFate::kKeep || (fate == BufferFate::kAsBefore && buffer.kept);
    buffer.kept = false;
    if (keep || !backend_->HostFreePinned(buffer.data).ok()) region->kept.push_back(buffer);
  }
}

std::vector<HostBuffer> DeviceAllocatorImpl::TakeKeptBuffers() {
  std::vector<HostBuffer> out;
  if (CaptureUnderway()) return out;  // cudaFreeHost would end a capture in global mode
  for (const auto& region : regions_.all()) {
    for (HostBuffer& buffer : region->kept) out.push_back(buffer);
    region->kept.clear();
  }
  return out;
}

absl::Status DeviceAllocatorImpl::FreePinned(std::vector<HostBuffer> buffers, Region* home) {
  // Called without the lock: cudaFreeHost waits for the device, and no book names these buffers
  // any more. One the backend refuses goes back to `home`'s kept buffers (the first region's
  // when null), to be freed by a later empty_cache; the first error is returned.
  absl::Status first;
  std::vector<HostBuffer> refused;
  for (const HostBuffer& buffer : buffers) {
    if (absl::Status s = backend_->HostFreePinned(buffer.data); !s.ok()) {
      if (first.ok()) {
        first = absl::Status(
            s.code(), absl::StrCat("vramledger: freeing a region's pinned buffer: ", s.message()));
      }
      refused.push_back(buffer);
    }
  }
  if (!refused.empty()) {
    core::DeviceMutexLock lock(&mu_);
    auto& kept = (home != nullptr ? home : regions_.all().front().get())->kept;
    kept.insert(kept.end(), refused.begin(), refused.end());
  }
  return first;
}

}  // namespace vramledger
