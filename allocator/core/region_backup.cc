// A region's backups in pinned host memory (docs/design/regions.md): the pause copies the live
// blocks out, the resume copies them back, each as one batch of copies with one wait; the pinned
// buffers are reused across pauses when a resume keeps them, and freed by empty_cache otherwise.
// Locking: locking.md (everything under mu_, but for freeing buffers already taken out).
#include <algorithm>
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

absl::Status DeviceAllocatorImpl::BackUpRegion(Region* region,
                                               const std::vector<Segment*>& segments) {
  // One pinned buffer per segment holding live blocks, sized to their bytes; each run of
  // neighbouring live blocks is one copy, and all the copies are one batch with one wait.
  std::vector<HostBuffer> buffers;
  std::vector<core::Regions::Backup> backups;
  std::vector<HostCopy> copies;
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
    if (!region->lost.empty()) live = WithoutLostPages(*region, *seg, live);
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
      copies.push_back({static_cast<char*>(buffer.data) + offset, address, n});
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
