// CUDA IPC, the allocator's side (docs/design/ipc.md): torch's shareIpcHandle and
// getBaseAllocation of a live block, the descriptors of shared physical handles, and the public
// entry points to both sides. Locking: the device mutex for exports; imports are IpcImports'.
#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/str_format.h"
#include "core/device_allocator_impl.h"
#include "core/ipc_format.h"

namespace vramledger {

using core::Block;
using core::Segment;

absl::StatusOr<const Block*> DeviceAllocatorImpl::SharedBlock(DevicePtr ptr,
                                                              const char* call) const {
  if (const Block* b = live_blocks_.Find(ptr); b != nullptr) {
    if (b->allocated) return b;
    return absl::FailedPreconditionError(absl::StrFormat(
        "vramledger: %s: the block at %#x on device %d was freed (it waits for the streams "
        "that used it); memory of a freed block cannot be shared",
        call, ptr, device_));
  }
  // Not a live block's start: find what holds the address, for the message.
  const Segment* seg = nullptr;
  if (auto it = segments_.upper_bound(ptr); it != segments_.begin()) {
    const Segment* s = std::prev(it)->second.get();
    if (ptr < s->ptr + s->size) seg = s;
  }
  for (const auto& s : page_table_.segments()) {
    if (seg == nullptr && ptr >= s->ptr && ptr < s->ptr + s->size) seg = s.get();
  }
  if (seg == nullptr) {
    return absl::NotFoundError(absl::StrFormat(
        "vramledger: %s: invalid device pointer %#x: vramledger never allocated it on device %d",
        call, ptr, device_));
  }
  const Block* b = seg->head;
  while (b != nullptr && ptr >= b->ptr + b->size) b = b->next;
  if (b != nullptr && b->allocated) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "vramledger: %s: %#x lies inside the live block at %#x (%d bytes) on device %d; share "
        "the storage, which starts at its block",
        call, ptr, b->ptr, b->size, device_));
  }
  return absl::FailedPreconditionError(absl::StrFormat(
      "vramledger: %s: %#x lies in freed memory on device %d (its block was freed); memory of a "
      "freed block cannot be shared",
      call, ptr, device_));
}

absl::StatusOr<int> DeviceAllocatorImpl::ExportedFd(PhysicalHandle handle) {
  if (auto it = exported_fds_.find(handle); it != exported_fds_.end()) return it->second;
  int fd = -1;
  if (absl::Status s = backend_->ExportPhysical(handle, &fd); !s.ok()) return s;
  exported_fds_.emplace(handle, fd);
  return fd;
}

void DeviceAllocatorImpl::CloseExportedFd(PhysicalHandle handle) {
  const auto it = exported_fds_.find(handle);
  if (it == exported_fds_.end()) return;
  (void)backend_->CloseExported(it->second);  // the handle is gone: nothing else to do on error
  exported_fds_.erase(it);
}

absl::Status DeviceAllocatorImpl::CheckExports() const {
  for (const auto& [handle, fd] : exported_fds_) {
    if (page_table_.HomeOf(handle) != nullptr ||
        old_mappings_.Find(handle) != old_mappings_.entries().size() ||
        absl::c_linear_search(page_table_.unreleased(), handle)) {
      continue;
    }
    return absl::InternalError(absl::StrFormat(
        "exported descriptor %d names handle %#x, which the allocator no longer holds", fd,
        handle));
  }
  return absl::OkStatus();
}

absl::StatusOr<IpcShare> DeviceAllocatorImpl::ShareIpcHandle(DevicePtr ptr) {
  absl::StatusOr<IpcShare> result;
  {
    core::DeviceMutexLock lock(&mu_);
    result = ShareLocked(ptr);
  }
  return AfterOperation("shareIpcHandle", std::move(result));
}

absl::StatusOr<IpcShare> DeviceAllocatorImpl::ShareLocked(DevicePtr ptr) {
  absl::StatusOr<const Block*> found = SharedBlock(ptr, "shareIpcHandle");
  if (!found.ok()) return found.status();
  const Block* block = *found;
  const Segment* seg = block->segment;
  // A paused region's block has no pages to share until its region is resumed.
  if (seg->pool->paused) {
    const Region* region = regions_.OfPool(seg->pool->owner);
    return absl::FailedPreconditionError(absl::StrFormat(
        "vramledger: shareIpcHandle: the block at %#x is in region '%s', which is paused; "
        "resume it first",
        block->ptr, region != nullptr ? region->name : "?"));
  }
  core::IpcHandle handle;
  IpcShare share;
  if (!seg->expandable) {  // the whole cudaMalloc'd segment, as torch shares it
    if (absl::Status s = backend_->ExportMalloc(seg->ptr, &handle.malloc); !s.ok()) return s;
    share.offset = static_cast<std::ptrdiff_t>(block->ptr - seg->ptr);
    share.handle = core::EncodeIpcHandle(handle);
    return share;
  }
  // The handles under the block's pages, whole: a handle maps only as a whole (torch shares the
  // pages under the block; with one handle per page, the same ones).
  std::size_t first = seg->PageOf(block->ptr);
  const std::size_t last = seg->PageOf(block->ptr + block->size - 1);
  while (first > 0 && seg->pages[first] != 0 && seg->pages[first - 1] == seg->pages[first]) {
    --first;
  }
  const std::size_t end = seg->HandleEnd(last);
  handle.pages = true;
  handle.pid = backend_->ProcessId();
  for (std::size_t i = first, j = 0; i < end; i = j) {
    if (seg->pages[i] == 0) {
      return absl::InternalError(absl::StrFormat(
          "vramledger: shareIpcHandle: page %d under the live block at %#x is not mapped", i,
          block->ptr));
    }
    j = seg->HandleEnd(i);
    const std::size_t bytes = (j - i) * seg->page_size;
    if (handle.page_size != 0 && bytes != handle.page_size) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "vramledger: shareIpcHandle: the block at %#x lies on physical handles of %d and %d "
          "bytes, and torch's IPC format needs one size; share memory allocated with "
          "expandable_handle_mb:0 (one handle per page) or inside vramledger.contiguous_segments()",
          block->ptr, handle.page_size, bytes));
    }
    handle.page_size = bytes;
    absl::StatusOr<int> fd = ExportedFd(seg->pages[i]);
    if (!fd.ok()) return fd.status();
    handle.fds.push_back(*fd);
  }
  share.offset = static_cast<std::ptrdiff_t>(block->ptr - seg->PageAddress(first));
  share.handle = core::EncodeIpcHandle(handle);
  return share;
}

absl::StatusOr<std::pair<DevicePtr, std::size_t>> DeviceAllocatorImpl::BaseAllocation(
    DevicePtr ptr) const {
  core::DeviceMutexLock lock(&mu_);
  absl::StatusOr<const Block*> found = SharedBlock(ptr, "getBaseAllocation");
  if (!found.ok()) return found.status();
  const Segment* seg = (*found)->segment;
  if (seg->expandable) {
    return absl::FailedPreconditionError(
        "Tensors allocated with expandable_segments:True cannot be shared between processes "
        "through getBaseAllocation: no single cudaMalloc backs them. torch.multiprocessing "
        "shares them (shareIpcHandle); for a base allocation, allocate inside "
        "vramledger.contiguous_segments() or with expandable_segments=False");
  }
  return std::make_pair(seg->ptr, seg->size);
}

// ---- The public entry points ----

absl::StatusOr<IpcShare> DeviceAllocator::ShareIpcHandle(DevicePtr ptr) {
  return impl_->ShareIpcHandle(ptr);
}

absl::StatusOr<std::shared_ptr<void>> DeviceAllocator::OpenIpcHandle(std::string_view handle) {
  return impl_->ipc_imports().Open(handle);
}

std::size_t DeviceAllocator::open_ipc_handles() const { return impl_->ipc_imports().open_count(); }

absl::StatusOr<std::pair<DevicePtr, std::size_t>> DeviceAllocator::BaseAllocation(
    DevicePtr ptr) const {
  return impl_->BaseAllocation(ptr);
}

}  // namespace vramledger
