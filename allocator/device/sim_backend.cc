// SimBackend: fake address space, physical capacity, VMM rule checks, in-order simulated streams
// and the modelled call ledger. Thread-safe: all state behind mu_; the capture mode is per thread.
#include "device/sim_backend.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <type_traits>
#include <utility>

#include "absl/strings/str_format.h"
#include "device/sim_cost_model.h"

namespace vramledger {

static_assert(std::is_base_of_v<DeviceBackend, SimBackend> && !std::is_abstract_v<SimBackend>,
              "SimBackend must implement every DeviceBackend primitive");

namespace {

// First fake address; a user-space-looking base like the ones cudaMalloc hands out.
constexpr DevicePtr kAddressBase = 0x7f0000000000;
constexpr std::size_t kMallocAlignment = 512;
// Distinct id ranges so that an event passed as a physical handle (or the reverse) is rejected.
constexpr EventId kFirstEventId = 0xe0000001;
constexpr PhysicalHandle kFirstHandle = 0x40000001;

// Stream capture modes, with the values of CUDA's cudaStreamCaptureMode.
constexpr int kCaptureModeGlobal = 0;
constexpr int kCaptureModeRelaxed = 2;
// The calling thread's capture mode; per thread, like CUDA's (shared by all SimBackends).
thread_local int tls_capture_mode = kCaptureModeGlobal;

std::size_t RoundUp(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace

SimBackend::SimBackend(Config config)
    : config_(config),
      capacity_(config.capacity),
      top_(kAddressBase),
      next_handle_(kFirstHandle),
      next_event_(kFirstEventId) {
  if (config_.granularity == 0 || config_.granularity % kMallocAlignment != 0) {
    std::fprintf(stderr, "SimBackend: granularity %zu is not a positive multiple of 512\n",
                 config_.granularity);
    std::abort();
  }
}

// ---- Bookkeeping helpers ----

void SimBackend::RecordCallLocked(DriverCall call, double micros) {
  calls_.Record(call, micros);
  if (capturing_.empty()) return;
  if (tls_capture_mode == kCaptureModeRelaxed) {
    ++capture_calls_relaxed_;
  } else {
    ++capture_calls_not_relaxed_;
  }
}

void SimBackend::RecordCallLocked(DriverCall call, std::size_t bytes) {
  RecordCallLocked(call, ModelledCallMicros(call, bytes));
}

absl::Status SimBackend::InjectedLocked(DriverCall call) {
  auto it = injected_.find(call);
  if (it == injected_.end()) return absl::OkStatus();
  if (it->second.skip-- > 0) return absl::OkStatus();
  absl::Status status = std::move(it->second.status);
  injected_.erase(it);
  ++injected_failures_;
  return status;
}

void SimBackend::FailCall(DriverCall call, int skip, absl::Status status) {
  absl::MutexLock lock(&mu_);
  injected_[call] = Injected{skip, std::move(status)};
}

std::int64_t SimBackend::injected_failures() const {
  absl::MutexLock lock(&mu_);
  return injected_failures_;
}

DevicePtr SimBackend::TakeAddressLocked(std::size_t size, std::size_t alignment) {
  // Lowest free range that fits, as the driver tends to reuse low addresses first.
  for (auto it = free_ranges_.begin(); it != free_ranges_.end(); ++it) {
    const DevicePtr start = RoundUp(it->first, alignment);
    const DevicePtr end = it->first + it->second;
    if (start >= end || end - start < size) continue;
    const DevicePtr range_start = it->first;
    const std::size_t range_size = it->second;
    free_ranges_.erase(it);
    if (start > range_start) free_ranges_.emplace(range_start, start - range_start);
    if (start + size < range_start + range_size) {
      free_ranges_.emplace(start + size, range_start + range_size - (start + size));
    }
    return start;
  }
  const DevicePtr start = RoundUp(top_, alignment);
  if (start < top_ || start + size < start) return 0;  // Wrapped around: exhausted.
  if (start > top_) free_ranges_.emplace(top_, start - top_);
  top_ = start + size;
  return start;
}

void SimBackend::GiveBackAddressLocked(DevicePtr ptr, std::size_t size) {
  DevicePtr start = ptr;
  DevicePtr end = ptr + size;
  auto next = free_ranges_.lower_bound(start);
  if (next != free_ranges_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      free_ranges_.erase(prev);
    }
  }
  if (next != free_ranges_.end() && next->first == end) {
    end += next->second;
    free_ranges_.erase(next);
  }
  if (end == top_) {
    top_ = start;  // The freed range is the highest: lower the top instead of keeping it.
  } else {
    free_ranges_.emplace(start, end - start);
  }
}

absl::Status SimBackend::CheckGranular(DriverCall call, const char* what,
                                       std::uint64_t value) const {
  if (value != 0 && value % config_.granularity == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: %s %#x is not a positive multiple of the granularity %d bytes",
                      DriverCallName(call), what, value, config_.granularity));
}

SimBackend::Cover SimBackend::FindCoveringMappings(DriverCall call, DevicePtr va,
                                                   std::size_t size) const {
  Cover cover;
  if (cover.status = CheckGranular(call, "address", va); !cover.status.ok()) return cover;
  if (cover.status = CheckGranular(call, "size", size); !cover.status.ok()) return cover;
  const DevicePtr end = va + size;
  auto it = mappings_.find(va);
  if (it == mappings_.end()) {
    cover.status = absl::FailedPreconditionError(
        absl::StrFormat("%s: no mapping begins at %#x", DriverCallName(call), va));
    return cover;
  }
  DevicePtr at = va;
  for (; it != mappings_.end() && it->first == at && at < end; ++it) {
    at += it->second.size;
    cover.micros += ModelledCallMicros(call, it->second.size);
  }
  if (at != end) {
    cover.status = absl::FailedPreconditionError(absl::StrFormat(
        "%s: [%#x, %#x) is not a run of whole contiguous mappings (mapped run ends at %#x)",
        DriverCallName(call), va, end, at));
  }
  return cover;
}

bool SimBackend::IsCompleteLocked(const Event& event) const {
  if (event.seq == 0) return true;
  auto it = completed_through_.find(event.stream);
  return it != completed_through_.end() && event.seq <= it->second;
}

void SimBackend::CompleteThroughLocked(const Event& event) {
  if (event.seq == 0) return;
  std::uint64_t& through = completed_through_[event.stream];
  through = std::max(through, event.seq);
}

std::size_t SimBackend::FreeBytesLocked() const {
  return used_ >= capacity_ ? 0 : capacity_ - used_;
}

// ---- Plain segments ----

absl::Status SimBackend::Malloc(std::size_t size, DevicePtr* out) {
  absl::MutexLock lock(&mu_);
  RecordCallLocked(DriverCall::kMalloc, size);
  if (absl::Status s = InjectedLocked(DriverCall::kMalloc); !s.ok()) return s;
  if (out == nullptr || size == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cudaMalloc: size %d must be positive and out non-null", size));
  }
  if (size > FreeBytesLocked() || RoundUp(size, kMallocAlignment) > FreeBytesLocked()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cudaMalloc: out of memory allocating %d bytes on simulated device %d (%d of %d used)",
        size, config_.device, used_, capacity_));
  }
  const std::size_t charged = RoundUp(size, kMallocAlignment);
  const std::size_t alignment =
      size >= config_.granularity ? config_.granularity : kMallocAlignment;
  const DevicePtr ptr = TakeAddressLocked(charged, alignment);
  if (ptr == 0) return absl::ResourceExhaustedError("cudaMalloc: fake address space exhausted");
  mallocs_.emplace(ptr, charged);
  used_ += charged;
  *out = ptr;
  return absl::OkStatus();
}

absl::Status SimBackend::Free(DevicePtr ptr) {
  absl::MutexLock lock(&mu_);
  auto it = mallocs_.find(ptr);
  if (it == mallocs_.end()) {
    RecordCallLocked(DriverCall::kFree, std::size_t{0});
    return absl::InvalidArgumentError(
        absl::StrFormat("cudaFree: %#x is not a live cudaMalloc address", ptr));
  }
  const std::size_t charged = it->second;
  RecordCallLocked(DriverCall::kFree, charged);
  if (absl::Status s = InjectedLocked(DriverCall::kFree); !s.ok()) return s;
  mallocs_.erase(it);
  if (!exported_mallocs_.empty() && exported_mallocs_.erase(ptr) > 0) {
    ForgetMallocExport(ProcessId(), config_.device, ptr);  // its IPC handle opens nothing now
  }
  used_ -= charged;
  GiveBackAddressLocked(ptr, charged);
  return absl::OkStatus();
}

// ---- Virtual memory management ----

absl::Status SimBackend::ReserveAddress(std::size_t size, DevicePtr* out) {
  absl::MutexLock lock(&mu_);
  RecordCallLocked(DriverCall::kAddressReserve, size);
  if (out == nullptr) return absl::InvalidArgumentError("cuMemAddressReserve: out is null");
  if (absl::Status s = CheckGranular(DriverCall::kAddressReserve, "size", size); !s.ok()) {
    return s;
  }
  const DevicePtr ptr = TakeAddressLocked(size, config_.granularity);
  if (ptr == 0) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("cuMemAddressReserve: no room for %d bytes of address space", size));
  }
  reservations_.emplace(ptr, size);
  *out = ptr;
  return absl::OkStatus();
}

absl::Status SimBackend::ReleaseAddress(DevicePtr ptr, std::size_t size) {
  absl::MutexLock lock(&mu_);
  RecordCallLocked(DriverCall::kAddressFree, size);
  auto it = reservations_.find(ptr);
  if (it == reservations_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuMemAddressFree: %#x is not the start of a reservation", ptr));
  }
  if (it->second != size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuMemAddressFree: size %d does not match the reservation's %d bytes", size, it->second));
  }
  auto mapped = mappings_.lower_bound(ptr);
  if (mapped != mappings_.end() && mapped->first < ptr + size) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuMemAddressFree: reservation %#x still has a mapping at %#x", ptr, mapped->first));
  }
  reservations_.erase(it);
  GiveBackAddressLocked(ptr, size);
  return absl::OkStatus();
}

absl::Status SimBackend::CreatePhysical(std::size_t size, PhysicalHandle* out) {
  absl::MutexLock lock(&mu_);
  RecordCallLocked(DriverCall::kMemCreate, size);
  if (absl::Status s = InjectedLocked(DriverCall::kMemCreate); !s.ok()) return s;
  if (out == nullptr) return absl::InvalidArgumentError("cuMemCreate: out is null");
  if (absl::Status s = CheckGranular(DriverCall::kMemCreate, "size", size); !s.ok()) return s;
  if (size > FreeBytesLocked()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cuMemCreate: out of memory creating %d bytes on simulated device %d (%d of %d used)", size,
        config_.device, used_, capacity_));
  }
  const PhysicalHandle handle = next_handle_++;
  handles_.emplace(handle, Handle{size, 0});
  used_ += size;
  *out = handle;
  return absl::OkStatus();
}

absl::Status SimBackend::ReleasePhysical(PhysicalHandle handle) {
  absl::MutexLock lock(&mu_);
  auto it = handles_.find(handle);
  RecordCallLocked(DriverCall::kMemRelease, it == handles_.end() ? 0 : it->second.size);
  if (absl::Status s = InjectedLocked(DriverCall::kMemRelease); !s.ok()) return s;
  if (it == handles_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuMemRelease: %#x is not a live physical handle", handle));
  }
  if (it->second.map_count > 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuMemRelease: handle %#x is still mapped %d time(s)", handle, it->second.map_count));
  }
  if (!it->second.imported) used_ -= it->second.size;
  handles_.erase(it);
  contents_.erase(handle);  // a new handle starts with fresh memory
  return absl::OkStatus();
}

absl::Status SimBackend::Map(DevicePtr va, std::size_t size, PhysicalHandle handle) {
  absl::MutexLock lock(&mu_);
  RecordCallLocked(DriverCall::kMemMap, size);
  if (absl::Status s = InjectedLocked(DriverCall::kMemMap); !s.ok()) return s;
  if (absl::Status s = CheckGranular(DriverCall::kMemMap, "address", va); !s.ok()) return s;
  if (absl::Status s = CheckGranular(DriverCall::kMemMap, "size", size); !s.ok()) return s;
  auto h = handles_.find(handle);
  if (h == handles_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuMemMap: %#x is not a live physical handle", handle));
  }
  if (h->second.size != size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cuMemMap: size %d differs from handle %#x's %d bytes (the whole handle is mapped)", size,
        handle, h->second.size));
  }
  auto r = reservations_.upper_bound(va);
  if (r == reservations_.begin() || std::prev(r)->first + std::prev(r)->second < va + size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cuMemMap: [%#x, %#x) is not inside one reservation", va, va + size));
  }
  auto next = mappings_.lower_bound(va);
  if (next != mappings_.end() && next->first < va + size) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuMemMap: [%#x, %#x) overlaps the mapping at %#x", va, va + size, next->first));
  }
  if (next != mappings_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size > va) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "cuMemMap: [%#x, %#x) overlaps the mapping at %#x", va, va + size, prev->first));
    }
  }
  mappings_.emplace(va, Mapping{size, handle, false});
  if (h->second.map_count++ > 0) aliased_ += size;
  mapped_ += size;
  return absl::OkStatus();
}

absl::Status SimBackend::Unmap(DevicePtr va, std::size_t size) {
  absl::MutexLock lock(&mu_);
  Cover cover = FindCoveringMappings(DriverCall::kMemUnmap, va, size);
  RecordCallLocked(DriverCall::kMemUnmap, cover.status.ok()
                                              ? cover.micros
                                              : ModelledCallMicros(DriverCall::kMemUnmap, size));
  if (absl::Status s = InjectedLocked(DriverCall::kMemUnmap); !s.ok()) return s;
  if (!cover.status.ok()) return cover.status;
  auto it = mappings_.find(va);
  while (it != mappings_.end() && it->first < va + size) {
    if (--handles_[it->second.handle].map_count > 0) aliased_ -= it->second.size;
    mapped_ -= it->second.size;
    it = mappings_.erase(it);
  }
  return absl::OkStatus();
}

absl::Status SimBackend::SetAccess(DevicePtr va, std::size_t size) {
  absl::MutexLock lock(&mu_);
  Cover cover = FindCoveringMappings(DriverCall::kMemSetAccess, va, size);
  RecordCallLocked(
      DriverCall::kMemSetAccess,
      cover.status.ok() ? cover.micros : ModelledCallMicros(DriverCall::kMemSetAccess, size));
  if (absl::Status s = InjectedLocked(DriverCall::kMemSetAccess); !s.ok()) return s;
  if (!cover.status.ok()) return cover.status;
  for (auto it = mappings_.find(va); it != mappings_.end() && it->first < va + size; ++it) {
    it->second.accessible = true;
  }
  return absl::OkStatus();
}

// ---- Events and streams ----

absl::Status SimBackend::CreateEvent(EventId* out) {
  absl::MutexLock lock(&mu_);
  RecordCallLocked(DriverCall::kEventCreate, std::size_t{0});
  if (absl::Status s = InjectedLocked(DriverCall::kEventCreate); !s.ok()) return s;
  if (out == nullptr) return absl::InvalidArgumentError("cudaEventCreateWithFlags: out is null");
  const EventId id = next_event_++;
  events_.emplace(id, Event{});
  *out = id;
  return absl::OkStatus();
}

absl::Status SimBackend::RecordEvent(EventId event, StreamId stream) {
  absl::MutexLock lock(&mu_);
  RecordCallLocked(DriverCall::kEventRecord, std::size_t{0});
  if (absl::Status s = InjectedLocked(DriverCall::kEventRecord); !s.ok()) return s;
  auto it = events_.find(event);
  if (it == events_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cudaEventRecord: %#x is not a live event", event));
  }
  it->second = Event{stream, next_seq_++};
  std::uint64_t& through = completed_through_[stream];  // Registers the stream.
  if (config_.auto_complete_events) {
    through = it->second.seq;
  } else if (config_.event_lag_us > 0) {
    lagging_[stream].emplace_back(it->second.seq, now_us_);
  }
  return absl::OkStatus();
}

void SimBackend::AdvanceClock(std::int64_t now_us) {
  absl::MutexLock lock(&mu_);
  now_us_ = std::max(now_us_, now_us);
  if (config_.event_lag_us <= 0) return;
  for (auto& [stream, records] : lagging_) {
    std::uint64_t& through = completed_through_[stream];
    // now - recorded >= lag, not recorded + lag <= now: no overflow for any lag (records are
    // never later than now_us_).
    while (!records.empty() && now_us_ - records.front().second >= config_.event_lag_us) {
      through = std::max(through, records.front().first);
      records.pop_front();
    }
  }
}

absl::StatusOr<bool> SimBackend::QueryEvent(EventId event) {
  absl::MutexLock lock(&mu_);
  RecordCallLocked(DriverCall::kEventQuery, std::size_t{0});
  if (absl::Status s = InjectedLocked(DriverCall::kEventQuery); !s.ok()) return s;
  auto it = events_.find(event);
  if (it == events_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cudaEventQuery: %#x is not a live event", event));
  }
  return IsCompleteLocked(it->second);
}

absl::Status SimBackend::SynchronizeEvent(EventId event) {
  absl::MutexLock lock(&mu_);
  RecordCallLocked(DriverCall::kEventSynchronize, std::size_t{0});
  if (absl::Status s = InjectedLocked(DriverCall::kEventSynchronize); !s.ok()) return s;
  auto it = events_.find(event);
  if (it == events_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cudaEventSynchronize: %#x is not a live event", event));
  }
  CompleteThroughLocked(it->second);
  return absl::OkStatus();
}

absl::Status SimBackend::DestroyEvent(EventId event) {
  absl::MutexLock lock(&mu_);
  RecordCallLocked(DriverCall::kEventDestroy, std::size_t{0});
  if (events_.erase(event) == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cudaEventDestroy: %#x is not a live event", event));
  }
  return absl::OkStatus();
}

absl::Status SimBackend::SynchronizeStream(StreamId stream) {
  absl::MutexLock lock(&mu_);
  RecordCallLocked(DriverCall::kStreamSynchronize, std::size_t{0});
  if (absl::Status s = InjectedLocked(DriverCall::kStreamSynchronize); !s.ok()) return s;
  completed_through_[stream] = next_seq_ - 1;
  return absl::OkStatus();
}

// ---- Device state ----

absl::Status SimBackend::MemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) {
  absl::MutexLock lock(&mu_);
  RecordCallLocked(DriverCall::kMemGetInfo, std::size_t{0});
  if (free_bytes == nullptr || total_bytes == nullptr) {
    return absl::InvalidArgumentError("cudaMemGetInfo: output pointers must be non-null");
  }
  *free_bytes = FreeBytesLocked();
  *total_bytes = capacity_;
  return absl::OkStatus();
}

bool SimBackend::IsCapturing(StreamId stream) {
  absl::MutexLock lock(&mu_);
  return capturing_.contains(stream);
}

int SimBackend::EnterRelaxedCapture() {
  return std::exchange(tls_capture_mode, kCaptureModeRelaxed);
}

void SimBackend::ExitRelaxedCapture(int previous_mode) { tls_capture_mode = previous_mode; }

// ---- Test controls ----

absl::Status SimBackend::CompleteEvent(EventId event) {
  absl::MutexLock lock(&mu_);
  auto it = events_.find(event);
  if (it == events_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("CompleteEvent: %#x is not a live event", event));
  }
  CompleteThroughLocked(it->second);
  return absl::OkStatus();
}

void SimBackend::CompleteStream(StreamId stream) {
  absl::MutexLock lock(&mu_);
  completed_through_[stream] = next_seq_ - 1;
}

void SimBackend::CompleteAllEvents() {
  absl::MutexLock lock(&mu_);
  for (auto& [stream, through] : completed_through_) through = next_seq_ - 1;
}

void SimBackend::SetCapturing(StreamId stream, bool capturing) {
  absl::MutexLock lock(&mu_);
  if (capturing) {
    capturing_.insert(stream);
  } else {
    capturing_.erase(stream);
  }
}

void SimBackend::SetCapacity(std::size_t capacity) {
  absl::MutexLock lock(&mu_);
  capacity_ = capacity;
}

// ---- Observers ----

std::size_t SimBackend::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_;
}

std::size_t SimBackend::mapped_bytes() const {
  absl::MutexLock lock(&mu_);
  return mapped_;
}

std::size_t SimBackend::aliased_bytes() const {
  absl::MutexLock lock(&mu_);
  return aliased_;
}

std::int64_t SimBackend::live_allocations() const {
  absl::MutexLock lock(&mu_);
  return static_cast<std::int64_t>(mallocs_.size() + handles_.size());
}

std::int64_t SimBackend::live_reservations() const {
  absl::MutexLock lock(&mu_);
  return static_cast<std::int64_t>(reservations_.size());
}

std::int64_t SimBackend::live_events() const {
  absl::MutexLock lock(&mu_);
  return static_cast<std::int64_t>(events_.size());
}

bool SimBackend::IsAccessible(DevicePtr va, std::size_t size) const {
  absl::MutexLock lock(&mu_);
  const DevicePtr end = va + size;
  auto it = mappings_.upper_bound(va);
  if (it == mappings_.begin()) return false;
  --it;  // The mapping that starts at or below va.
  DevicePtr at = va;
  for (; it != mappings_.end() && at < end; ++it) {
    const DevicePtr map_end = it->first + it->second.size;
    if (it->first > at || map_end <= at || !it->second.accessible) return false;
    at = map_end;
  }
  return at >= end;
}

std::int64_t SimBackend::calls_during_capture_not_relaxed() const {
  absl::MutexLock lock(&mu_);
  return capture_calls_not_relaxed_;
}

std::int64_t SimBackend::calls_during_capture_relaxed() const {
  absl::MutexLock lock(&mu_);
  return capture_calls_relaxed_;
}

}  // namespace vramledger
