// The read side of one device's allocator: stats copies, the out-of-memory report, the core view
// the ledger's reports read (core_view.h), and invariant checks composed from the parts' own;
// plus the public DeviceAllocator facade. Locking: docs/design/locking.md.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/core_view.h"
#include "core/device_allocator_impl.h"

namespace vramledger {

using core::Block;
using core::BlockPool;
using core::Segment;

namespace core {

std::size_t LargestFreeBlock(const std::array<const BlockPool*, 4>& pools) {
  // Largest blocks first (the index is ordered by stream, then size): a block no larger than
  // the best run so far cannot hold a larger one, so its pages are not walked (MappedRun walks
  // an expandable block page by page; the replay of a step-marked trace asks after every event).
  std::size_t largest = 0;
  for (const BlockPool* pool : pools) {
    for (auto it = pool->blocks.rbegin(); it != pool->blocks.rend(); ++it) {
      if ((*it)->size > largest) largest = std::max(largest, Placement::MappedRun(*it));
    }
  }
  return largest;
}

std::int64_t CountHoles(const std::array<const BlockPool*, 4>& pools) {
  std::int64_t holes = 0;
  for (const BlockPool* pool : pools) {
    for (const Block* b : pool->blocks) {
      holes += pool->expandable ? (b->prev != nullptr && b->next != nullptr) : b->is_split();
    }
  }
  return holes;
}

}  // namespace core

namespace {

// 1 - largest_free_block / free_bytes, the share of cached free bytes outside the largest free
// block (0 when nothing is free).
double FreeSpaceFragmentation(std::size_t free_bytes, std::size_t largest_free_block) {
  if (free_bytes == 0 || largest_free_block >= free_bytes) return 0;
  return 1.0 - static_cast<double>(largest_free_block) / static_cast<double>(free_bytes);
}

}  // namespace

absl::Status DeviceAllocatorImpl::OutOfMemory(const AllocationRequest& request,
                                              std::size_t alloc_size) {
  const std::size_t requested = request.size;
  const StreamId stream = request.stream;
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  {
    RelaxedCaptureScope relaxed(backend_);  // an OOM during a capture must not break it
    (void)backend_->MemGetInfo(&free_bytes, &total_bytes);
  }
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
  o.allocated = static_cast<std::size_t>(stats_.allocated_bytes.current(kAggregate));
  o.reserved = static_cast<std::size_t>(stats_.reserved_bytes.current(kAggregate));
  o.largest_free_block = core::LargestFreeBlock(std::as_const(*this).AllPools());
  o.holes = core::CountHoles(std::as_const(*this).AllPools());
  // torch 2.11's out-of-memory text (its CUDACachingAllocator), with vramledger's own figures
  // appended.
  o.message = absl::StrCat(
      "CUDA out of memory. Tried to allocate ", FormatSize(alloc_size), ". GPU ", o.device,
      " has a total capacity of ", FormatSize(total_bytes), " of which ", FormatSize(free_bytes),
      " is free. ", fraction_set_ ? absl::StrCat(FormatSize(allowed_bytes_), " allowed; ") : "",
      "Of the allocated memory ", FormatSize(o.allocated), " is allocated by vramledger, and ",
      FormatSize(o.reserved - o.allocated), " is reserved by vramledger but unallocated. ",
      "Largest free block ", FormatSize(o.largest_free_block), ", ", o.holes,
      " holes, free-space fragmentation ",
      absl::StrFormat(
          "%.1f%%", 100.0 * FreeSpaceFragmentation(o.reserved - o.allocated, o.largest_free_block)),
      " (request ", FormatSize(requested), " on stream ", stream, ").");
  if (!options_.expandable_segments && o.reserved - o.allocated > alloc_size) {
    absl::StrAppend(&o.message,
                    " If reserved but unallocated memory is large try setting "
                    "VRAMLEDGER_CONF=expandable_segments:True to avoid fragmentation.");
  }
  return absl::ResourceExhaustedError(o.message);
}

DeviceStats DeviceAllocatorImpl::GetStats() const {
  core::DeviceMutexLock lock(&mu_);
  DeviceStats copy = stats_.ToDeviceStats();
  copy.largest_free_block_bytes = static_cast<std::int64_t>(core::LargestFreeBlock(AllPools()));
  return copy;
}

void DeviceAllocatorImpl::ResetPeakStats() {
  core::DeviceMutexLock lock(&mu_);
  stats_.ResetPeak();
}

void DeviceAllocatorImpl::ResetAccumulatedStats() {
  core::DeviceMutexLock lock(&mu_);
  stats_.ResetAccumulated();
}

OutOfMemoryInfo DeviceAllocatorImpl::last_oom() const {
  core::DeviceMutexLock lock(&mu_);
  return last_oom_;
}

void DeviceAllocatorImpl::Read(absl::FunctionRef<void(const core::CoreView&)> reader) const {
  core::DeviceMutexLock lock(&mu_);
  core::CoreView view;
  view.device = device_;
  view.stats = &stats_;
  view.plain_segments = &segments_;
  for (const auto& [id, pool] : private_pools_) {
    view.private_pools.emplace_back(&pool->small, id);
    view.private_pools.emplace_back(&pool->large, id);
  }
  view.pools = AllPools();
  view.page_table = &page_table_;
  view.old_mappings = &old_mappings_;
  view.placement = &placement_;
  view.regions = &regions_;
  reader(view);
}

// counts: [allocated, active, requested, n_alloc, n_active, n_split, split_bytes, n_free]
absl::Status DeviceAllocatorImpl::CheckSegmentChain(const core::Segment& seg,
                                                    std::int64_t* counts) const {
  auto fail = [&](const Block* b, auto&&... parts) {
    return absl::InternalError(absl::StrCat("block 0x", absl::Hex(b->ptr), " of segment 0x",
                                            absl::Hex(seg.ptr), ": ", parts...));
  };
  if (seg.head == nullptr || seg.head->ptr != seg.ptr || seg.head->prev != nullptr) {
    return absl::InternalError(absl::StrCat("segment 0x", absl::Hex(seg.ptr), ": bad head block"));
  }
  DevicePtr expect = seg.ptr;
  for (const Block* b = seg.head; b != nullptr; b = b->next) {
    if (b->ptr != expect) return fail(b, "chain is not contiguous");
    if (b->segment != &seg) return fail(b, "wrong segment");
    if (b->size == 0 || b->size % 512 != 0) return fail(b, "bad size ", b->size);
    if (b->next != nullptr && b->next->prev != b) return fail(b, "bad links");
    if (b->stream != seg.stream || b->pool != seg.pool) return fail(b, "wrong stream or pool");
    expect += b->size;
    const bool in_index = b->pool->blocks.contains(const_cast<Block*>(b));
    const bool in_live = live_blocks_.Find(b->ptr) == b;
    if (b->is_free()) {
      if (!in_index || in_live) return fail(b, "free block not indexed as free");
      if (b->next != nullptr && b->next->is_free() && b->next->stream_uses.empty()) {
        return fail(b, "free block not coalesced with its free successor");
      }
      ++counts[7];
      if (!seg.expandable && b->is_split()) {
        ++counts[5];
        counts[6] += static_cast<std::int64_t>(b->size);
      }
    } else {
      if (in_index || !in_live) return fail(b, "live block indexed as free");
      if (seg.expandable && !seg.pool->paused) {  // a paused region's pages come back
        for (std::size_t i = seg.PageOf(b->ptr); i <= seg.PageOf(b->ptr + b->size - 1); ++i) {
          // A page a failed pause lost stays unmapped under its blocks until the region's next
          // pause and resume (Region::lost).
          const core::Regions::Region* region = regions_.OfPool(seg.pool->owner);
          if (seg.pages[i] == 0 &&
              (region == nullptr || !core::Regions::IsLost(*region, &seg, i))) {
            return fail(b, "live block on unmapped page ", i);
          }
        }
      }
      ++counts[4];
      counts[1] += static_cast<std::int64_t>(b->size);
      counts[2] += static_cast<std::int64_t>(b->requested_size);
      if (b->allocated) {
        ++counts[3];
        counts[0] += static_cast<std::int64_t>(b->size);
      }
    }
  }
  if (expect != seg.ptr + seg.size) {
    return absl::InternalError(
        absl::StrCat("segment 0x", absl::Hex(seg.ptr), ": blocks do not cover it"));
  }
  return absl::OkStatus();
}

absl::Status DeviceAllocatorImpl::CheckInvariants() const {
  core::DeviceMutexLock lock(&mu_);
  // The parts' own invariants first, so every caller of CheckInvariants covers them too.
  if (absl::Status s = CheckParts(); !s.ok()) return s;
  auto fail = [](auto&&... parts) { return absl::InternalError(absl::StrCat(parts...)); };
  std::int64_t counts[8] = {};
  std::int64_t paused_counts[8] = {};  // blocks of paused regions: not in the device's stats
  std::int64_t reserved = 0;
  for (const auto& [ptr, segment] : segments_) {
    if (absl::Status s = CheckSegmentChain(*segment, counts); !s.ok()) return s;
    reserved += static_cast<std::int64_t>(segment->size);
  }
  for (const auto& segment : page_table_.segments()) {
    std::int64_t* into = segment->pool->paused ? paused_counts : counts;
    if (absl::Status s = CheckSegmentChain(*segment, into); !s.ok()) return s;
    reserved += static_cast<std::int64_t>(segment->mapped_pages * segment->page_size);
  }
  for (const auto& region : regions_.all()) {  // handles a failed resume could not unmap
    for (const core::Regions::Held& h : region->held)
      reserved += static_cast<std::int64_t>(h.bytes);
  }
  const auto [allocated, active, requested, n_alloc, n_active, n_split, split_bytes, n_free] =
      std::to_array(counts);
  const DeviceStats st = stats_.ToDeviceStats();
  std::int64_t indexed = 0;
  const core::BlockBestFitLess less;
  for (const BlockPool* pool : AllPools()) {
    indexed += static_cast<std::int64_t>(pool->blocks.size());
    // Keys change in place (Reposition): the index must still be strictly ordered.
    for (auto it = pool->blocks.begin();
         it != pool->blocks.end() && std::next(it) != pool->blocks.end(); ++it) {
      if (!less(*it, *std::next(it)))
        return fail("free index out of order at 0x", absl::Hex((*it)->ptr));
    }
  }
  indexed += PrivatePoolFreeBlocks();  // CUDA graph private pools (graph_pools.cc)
  if (indexed != n_free + paused_counts[7])
    return fail("free index holds ", indexed, " blocks, segments hold ", n_free + paused_counts[7]);
  if (static_cast<std::int64_t>(live_blocks_.size()) != n_active + paused_counts[4])
    return fail("live map size mismatch");
  struct Check {
    const char* name;
    std::int64_t stat;
    std::int64_t actual;
  };
  for (const Check& c :
       {Check{"allocated_bytes", st.allocated_bytes[kAggregate].current, allocated},
        Check{"active_bytes", st.active_bytes[kAggregate].current, active},
        Check{"requested_bytes", st.requested_bytes[kAggregate].current, requested},
        Check{"reserved_bytes", st.reserved_bytes[kAggregate].current, reserved},
        Check{"allocation", st.allocation[kAggregate].current, n_alloc},
        Check{"active", st.active[kAggregate].current, n_active},
        Check{"inactive_split", st.inactive_split[kAggregate].current, n_split},
        Check{"inactive_split_bytes", st.inactive_split_bytes[kAggregate].current, split_bytes},
        Check{"segment", st.segment[kAggregate].current,
              static_cast<std::int64_t>(segments_.size())}}) {
    if (c.stat != c.actual)
      return fail("stat ", c.name, " is ", c.stat, " but the blocks say ", c.actual);
  }
  for (const StatArray* a :
       {&st.allocated_bytes, &st.reserved_bytes, &st.active_bytes, &st.allocation}) {
    if ((*a)[kAggregate].current != (*a)[kSmallPool].current + (*a)[kLargePool].current) {
      return fail("aggregate stat is not small + large");
    }
    for (const Stat& s : *a) {
      if (s.current > s.peak || s.current < 0) return fail("stat current outside [0, peak]");
    }
  }
  // Blocks may lie on pages a failed pause lost (Region::lost): active, not reserved.
  const auto unmapped_live = static_cast<std::int64_t>(regions_.UnmappedLostBytes());
  if (!(allocated <= active && active <= reserved + unmapped_live))
    return fail("allocated <= active <= reserved (+ lost pages) broken");
  // What the paused regions withdrew from the stats is exactly what their blocks hold.
  std::int64_t withdrawn[5] = {};
  if (absl::Status s = CheckRegions(withdrawn); !s.ok()) return s;
  for (int i = 0; i < 5; ++i) {
    if (withdrawn[i] != paused_counts[i]) {
      return fail("paused regions withdrew ", withdrawn[i], " from stat ", i,
                  " but their blocks say ", paused_counts[i]);
    }
  }
  if (absl::Status s = page_table_.CheckInvariants(); !s.ok()) return s;
  if (absl::Status s = CheckExports(); !s.ok()) return s;  // ipc.cc
  return old_mappings_.CheckInvariants(page_table_);
}

// ---- Public facade ----

namespace {
std::int64_t ElapsedNs(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              start)
      .count();
}
}  // namespace

DeviceAllocator::DeviceAllocator(const Options& options, DeviceBackend* backend)
    : impl_(std::make_unique<DeviceAllocatorImpl>(options, backend)),
      host_timing_(options.host_timing) {}
DeviceAllocator::~DeviceAllocator() = default;
absl::StatusOr<DevicePtr> DeviceAllocator::Malloc(std::size_t size, StreamId stream) {
  if (!host_timing_) return impl_->Malloc(size, stream);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<DevicePtr> ptr = impl_->Malloc(size, stream);
  malloc_ns_.fetch_add(ElapsedNs(start), std::memory_order_relaxed);
  malloc_calls_.fetch_add(1, std::memory_order_relaxed);
  return ptr;
}
absl::Status DeviceAllocator::Free(DevicePtr ptr) {
  if (!host_timing_) return impl_->Free(ptr);
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = impl_->Free(ptr);
  free_ns_.fetch_add(ElapsedNs(start), std::memory_order_relaxed);
  free_calls_.fetch_add(1, std::memory_order_relaxed);
  return status;
}
HostTime DeviceAllocator::host_time() const {
  HostTime t;
  t.malloc_calls = malloc_calls_.load(std::memory_order_relaxed);
  t.malloc_ns = malloc_ns_.load(std::memory_order_relaxed);
  t.free_calls = free_calls_.load(std::memory_order_relaxed);
  t.free_ns = free_ns_.load(std::memory_order_relaxed);
  return t;
}
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
void DeviceAllocator::Read(absl::FunctionRef<void(const core::CoreView&)> reader) const {
  impl_->Read(reader);
}
OutOfMemoryInfo DeviceAllocator::last_oom() const { return impl_->last_oom(); }
absl::Status DeviceAllocator::CheckInvariants() const { return impl_->CheckInvariants(); }
const Options& DeviceAllocator::options() const { return impl_->options(); }
DeviceBackend* DeviceAllocator::backend() const { return impl_->backend(); }
void DeviceAllocator::SetHooks(AllocatorHooks* hooks) { impl_->SetHooks(hooks); }

}  // namespace vramledger
