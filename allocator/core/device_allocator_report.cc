// The read side of one device's allocator: stats copies, snapshots, the out-of-memory report
// and invariant checks, plus the public DeviceAllocator facade. Locking: docs/design/locking.md.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::BlockPool;

std::size_t DeviceAllocatorImpl::LargestFreeBlock() const {
  std::size_t largest = 0;
  for (const BlockPool* pool : {&small_pool_, &large_pool_}) {
    for (const Block* b : pool->blocks) largest = std::max(largest, b->size);
  }
  return largest;
}

std::int64_t DeviceAllocatorImpl::CountHoles() const {
  // A hole: a free block inside a segment that also holds live blocks.
  std::int64_t holes = 0;
  for (const BlockPool* pool : {&small_pool_, &large_pool_}) {
    for (const Block* b : pool->blocks) holes += b->is_split() ? 1 : 0;
  }
  return holes;
}

absl::Status DeviceAllocatorImpl::OutOfMemory(const AllocationRequest& request,
                                              std::size_t alloc_size) {
  const std::size_t requested = request.size;
  const StreamId stream = request.stream;
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  (void)backend_->MemGetInfo(&free_bytes, &total_bytes);
  ++stats_.num_ooms;
  Emit(TraceAction::kOom, free_bytes, request.rounded, stream, request.context, request.tag);
  OutOfMemoryInfo& o = last_oom_;
  o = OutOfMemoryInfo();
  o.device = backend_->device();
  o.stream = stream;
  o.requested = requested;
  o.alloc_size = alloc_size;
  o.device_total = total_bytes;
  o.device_free = free_bytes;
  o.allowed = fraction_set_ ? allowed_bytes_ : 0;
  o.allocated = static_cast<std::size_t>(stats_.allocated_bytes[kAggregate].current);
  o.reserved = static_cast<std::size_t>(stats_.reserved_bytes[kAggregate].current);
  o.largest_free_block = LargestFreeBlock();
  o.holes = CountHoles();
  // torch 2.11's text (PYTORCH-FACTS §2 "OOM"), with vramledger's own figures appended.
  o.message = absl::StrCat(
      "CUDA out of memory. Tried to allocate ", FormatSize(alloc_size), ". GPU ", o.device,
      " has a total capacity of ", FormatSize(total_bytes), " of which ", FormatSize(free_bytes),
      " is free. ", fraction_set_ ? absl::StrCat(FormatSize(allowed_bytes_), " allowed; ") : "",
      "Of the allocated memory ", FormatSize(o.allocated), " is allocated by vramledger, and ",
      FormatSize(o.reserved - o.allocated), " is reserved by vramledger but unallocated. ",
      "Largest free block ", FormatSize(o.largest_free_block), ", ", o.holes,
      " holes (request ", FormatSize(requested), " on stream ", stream, ").");
  if (!options_.expandable_segments && o.reserved - o.allocated > alloc_size) {
    absl::StrAppend(&o.message,
                    " If reserved but unallocated memory is large try setting "
                    "VRAMLEDGER_CONF=expandable_segments:True to avoid fragmentation.");
  }
  return absl::ResourceExhaustedError(o.message);
}

DeviceStats DeviceAllocatorImpl::GetStats() const {
  absl::MutexLock lock(&mu_);
  DeviceStats copy = stats_;
  copy.largest_free_block_bytes = static_cast<std::int64_t>(LargestFreeBlock());
  return copy;
}

void DeviceAllocatorImpl::ResetPeakStats() {
  absl::MutexLock lock(&mu_);
  stats_.ResetPeak();
}

void DeviceAllocatorImpl::ResetAccumulatedStats() {
  absl::MutexLock lock(&mu_);
  stats_.ResetAccumulated();
}

OutOfMemoryInfo DeviceAllocatorImpl::last_oom() const {
  absl::MutexLock lock(&mu_);
  return last_oom_;
}

std::vector<SegmentInfo> DeviceAllocatorImpl::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<SegmentInfo> out;
  out.reserve(segments_.size());
  for (const auto& [ptr, segment] : segments_) {
    SegmentInfo info;
    info.device = backend_->device();
    info.address = ptr;
    info.total_size = segment->size;
    info.stream = segment->stream;
    info.is_small = segment->pool->is_small;
    for (const Block* b = segment->head; b != nullptr; b = b->next) {
      BlockInfo bi;
      bi.address = b->ptr;
      bi.size = b->size;
      if (b->allocated) {
        bi.state = "active_allocated";
      } else if (b->event_count > 0) {
        bi.state = "active_pending_free";
      } else {
        bi.state = "inactive";
      }
      bi.requested_size = b->allocated || b->event_count > 0 ? b->requested_size : 0;
      bi.tag = b->is_free() ? 0 : b->tag;
      bi.context = b->is_free() ? 0 : b->context;
      if (b->allocated) info.allocated_size += b->size;
      if (!b->is_free()) {
        info.active_size += b->size;
        info.requested_size += b->requested_size;
      }
      info.blocks.push_back(bi);
    }
    out.push_back(std::move(info));
  }
  return out;
}

absl::Status DeviceAllocatorImpl::CheckInvariants() const {
  absl::MutexLock lock(&mu_);
  auto fail = [](auto&&... parts) { return absl::InternalError(absl::StrCat(parts...)); };
  std::int64_t allocated = 0, active = 0, requested = 0, reserved = 0;
  std::int64_t n_alloc = 0, n_active = 0, n_split = 0, split_bytes = 0, n_free = 0;
  for (const auto& [ptr, segment] : segments_) {
    if (segment->head == nullptr || segment->head->ptr != ptr || segment->head->prev != nullptr) {
      return fail("segment 0x", absl::Hex(ptr), ": head block does not start it");
    }
    reserved += static_cast<std::int64_t>(segment->size);
    DevicePtr expect = ptr;
    for (const Block* b = segment->head; b != nullptr; b = b->next) {
      if (b->ptr != expect) return fail("block 0x", absl::Hex(b->ptr), ": chain is not contiguous");
      if (b->segment != segment.get()) return fail("block 0x", absl::Hex(b->ptr), ": wrong segment");
      if (b->size == 0 || b->size % 512 != 0) return fail("block 0x", absl::Hex(b->ptr), ": bad size");
      if (b->next != nullptr && b->next->prev != b) return fail("block 0x", absl::Hex(b->ptr), ": bad links");
      expect += b->size;
      const bool in_index = b->pool->blocks.contains(const_cast<Block*>(b));
      const bool in_live = live_blocks_.contains(b->ptr) && live_blocks_.at(b->ptr) == b;
      if (b->is_free()) {
        if (!in_index || in_live) return fail("free block 0x", absl::Hex(b->ptr), ": not indexed as free");
        if (b->next != nullptr && b->next->is_free() && b->next->stream_uses.empty()) {
          return fail("free blocks 0x", absl::Hex(b->ptr), " and its successor were not coalesced");
        }
        ++n_free;
        if (b->is_split()) {
          ++n_split;
          split_bytes += static_cast<std::int64_t>(b->size);
        }
      } else {
        if (in_index || !in_live) return fail("live block 0x", absl::Hex(b->ptr), ": indexed as free");
        ++n_active;
        active += static_cast<std::int64_t>(b->size);
        requested += static_cast<std::int64_t>(b->requested_size);
        if (b->allocated) {
          ++n_alloc;
          allocated += static_cast<std::int64_t>(b->size);
        }
      }
    }
    if (expect != ptr + segment->size) return fail("segment 0x", absl::Hex(ptr), ": blocks do not cover it");
  }
  const auto& st = stats_;
  const std::int64_t indexed =
      static_cast<std::int64_t>(small_pool_.blocks.size() + large_pool_.blocks.size());
  if (indexed != n_free) return fail("free index holds ", indexed, " blocks, segments hold ", n_free);
  if (static_cast<std::int64_t>(live_blocks_.size()) != n_active) return fail("live map size mismatch");
  struct Check { const char* name; std::int64_t stat; std::int64_t actual; };
  for (const Check& c : {Check{"allocated_bytes", st.allocated_bytes[kAggregate].current, allocated},
                         Check{"active_bytes", st.active_bytes[kAggregate].current, active},
                         Check{"requested_bytes", st.requested_bytes[kAggregate].current, requested},
                         Check{"reserved_bytes", st.reserved_bytes[kAggregate].current, reserved},
                         Check{"allocation", st.allocation[kAggregate].current, n_alloc},
                         Check{"active", st.active[kAggregate].current, n_active},
                         Check{"inactive_split", st.inactive_split[kAggregate].current, n_split},
                         Check{"inactive_split_bytes", st.inactive_split_bytes[kAggregate].current, split_bytes},
                         Check{"segment", st.segment[kAggregate].current,
                               static_cast<std::int64_t>(segments_.size())}}) {
    if (c.stat != c.actual) return fail("stat ", c.name, " is ", c.stat, " but the blocks say ", c.actual);
  }
  for (const StatArray* a : {&st.allocated_bytes, &st.reserved_bytes, &st.active_bytes, &st.allocation}) {
    if ((*a)[kAggregate].current != (*a)[kSmallPool].current + (*a)[kLargePool].current) {
      return fail("aggregate stat is not small + large");
    }
    for (const Stat& s : *a) {
      if (s.current > s.peak || s.current < 0) return fail("stat current outside [0, peak]");
    }
  }
  if (!(allocated <= active && active <= reserved)) return fail("allocated <= active <= reserved broken");
  return absl::OkStatus();
}

// ---- Public facade ----

DeviceAllocator::DeviceAllocator(const Options& options, DeviceBackend* backend)
    : impl_(std::make_unique<DeviceAllocatorImpl>(options, backend)) {}
DeviceAllocator::~DeviceAllocator() = default;
absl::StatusOr<DevicePtr> DeviceAllocator::Malloc(std::size_t size, StreamId stream) {
  return impl_->Malloc(size, stream);
}
absl::Status DeviceAllocator::Free(DevicePtr ptr) { return impl_->Free(ptr); }
absl::Status DeviceAllocator::RecordStream(DevicePtr ptr, StreamId stream) {
  return impl_->RecordStream(ptr, stream);
}
absl::Status DeviceAllocator::EmptyCache() { return impl_->EmptyCache(); }
absl::Status DeviceAllocator::SetMemoryFraction(double fraction) {
  return impl_->SetMemoryFraction(fraction);
}
DeviceStats DeviceAllocator::GetStats() const { return impl_->GetStats(); }
void DeviceAllocator::ResetPeakStats() { impl_->ResetPeakStats(); }
void DeviceAllocator::ResetAccumulatedStats() { impl_->ResetAccumulatedStats(); }
std::vector<SegmentInfo> DeviceAllocator::Snapshot() const { return impl_->Snapshot(); }
OutOfMemoryInfo DeviceAllocator::last_oom() const { return impl_->last_oom(); }
absl::Status DeviceAllocator::CheckInvariants() const { return impl_->CheckInvariants(); }
const Options& DeviceAllocator::options() const { return impl_->options(); }
DeviceBackend* DeviceAllocator::backend() const { return impl_->backend(); }
void DeviceAllocator::SetHooks(AllocatorHooks* hooks) { impl_->SetHooks(hooks); }

}  // namespace vramledger
