// SimBackend: a host-only DeviceBackend with fake addresses, a capacity, the driver's VMM rules,
// events that complete only when told, and modelled call costs. Thread-safe (one absl::Mutex).
#ifndef VRAMLEDGER_DEVICE_SIM_BACKEND_H_
#define VRAMLEDGER_DEVICE_SIM_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "vramledger/device_backend.h"
#include "vramledger/types.h"

namespace vramledger {

/// Settings of a SimBackend. Defaults describe one H200 as torch reports it.
struct SimBackendConfig {
  /// Device index reported by device().
  int device = 0;
  /// Physical memory in bytes (torch's `total_memory` of an H200).
  std::size_t capacity = 150109880320;
  /// VMM granularity in bytes; a positive multiple of 512.
  std::size_t granularity = 2 * kMiB;
  /// If true, RecordEvent completes the event at once (trace replay); else events wait for
  /// CompleteEvent / CompleteStream / CompleteAllEvents or a synchronize.
  bool auto_complete_events = false;
  /// If positive (and auto_complete_events is false): the GPU runs this many microseconds behind
  /// the host; an event completes once the clock (AdvanceClock) has passed its record time by
  /// this much (trace replay with a lagging GPU; synchronizes still complete at once).
  std::int64_t event_lag_us = 0;
  /// The simulated process's id (ProcessId(); 0: the real one). Two backends with different
  /// ids act as two processes sharing memory through IPC (sim_backend_ipc.cc).
  int pid = 0;
};

/// Simulated device. Semantics, beyond the DeviceBackend contract:
/// - Addresses start at 0x7f0000000000; freed ranges are reused lowest-first, as the driver does.
///   Malloc addresses are 512-byte aligned (granularity-aligned for sizes of a granularity or
///   more); reservations are granularity-aligned. Live ranges never overlap.
/// - Physical usage (Malloc'd bytes rounded up to 512, plus CreatePhysical bytes) never exceeds
///   the capacity; Map and ReserveAddress use no physical memory.
/// - Streams run in order: completing an event also completes every event recorded before it on
///   the same stream. An event never recorded counts as complete (as cudaEventQuery says).
/// - Free and Unmap do not synchronise anything (real cudaFree does): events stay pending until
///   the test completes them, which is the conservative choice for the allocator.
/// - Every call, failed ones too, is recorded in calls() with its modelled cost
///   (device/sim_cost_model.h).
class SimBackend final : public DeviceBackend {
 public:
  using Config = SimBackendConfig;

  /// Aborts if config.granularity is 0 or not a multiple of 512.
  explicit SimBackend(Config config = {});
  SimBackend(const SimBackend&) = delete;
  SimBackend& operator=(const SimBackend&) = delete;
  ~SimBackend() override;  // frees pinned host memory still held

  // ---- DeviceBackend ----
  int device() const override { return config_.device; }
  absl::Status Malloc(std::size_t size, DevicePtr* out) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Free(DevicePtr ptr) override ABSL_LOCKS_EXCLUDED(mu_);
  std::size_t Granularity() const override { return config_.granularity; }
  absl::Status ReserveAddress(std::size_t size, DevicePtr* out) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReleaseAddress(DevicePtr ptr, std::size_t size) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CreatePhysical(std::size_t size, PhysicalHandle* out) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReleasePhysical(PhysicalHandle handle) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Map(DevicePtr va, std::size_t size, PhysicalHandle handle) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Unmap(DevicePtr va, std::size_t size) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SetAccess(DevicePtr va, std::size_t size) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CreateEvent(EventId* out) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status RecordEvent(EventId event, StreamId stream) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<bool> QueryEvent(EventId event) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SynchronizeEvent(EventId event) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status DestroyEvent(EventId event) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SynchronizeStream(StreamId stream) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status MemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) override
      ABSL_LOCKS_EXCLUDED(mu_);
  bool IsCapturing(StreamId stream) override ABSL_LOCKS_EXCLUDED(mu_);
  int EnterRelaxedCapture() override;
  void ExitRelaxedCapture(int previous_mode) override;
  // Interprocess sharing (sim_backend_ipc.cc): one registry per host process stands for the
  // driver's; a handle names (process, device, address), a descriptor (process, number). Its
  // mutex is taken inside mu_ (Free forgets an export), never the other way round.
  int ProcessId() const override;
  absl::Status ExportMalloc(DevicePtr base, IpcMemHandle* out) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status OpenMalloc(const IpcMemHandle& handle, DevicePtr* out) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CloseMalloc(DevicePtr ptr) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ExportPhysical(PhysicalHandle handle, int* fd) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CloseExported(int fd) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ImportPhysical(int pid, const std::vector<int>& fds,
                              std::vector<PhysicalHandle>* out) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SynchronizeDevice() override ABSL_LOCKS_EXCLUDED(mu_);
  // Pinned host memory and copies (sim_backend_host.cc): host memory from the heap, counted
  // against a cap (SetPinnedCapacity); a copy reads and writes the modelled contents of the
  // physical handles mapped under its device range, which must be mapped with access.
  absl::StatusOr<void*> HostAllocPinned(std::size_t bytes) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status HostFreePinned(void* p) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CopyDeviceToHost(absl::Span<const HostCopy> copies) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CopyHostToDevice(absl::Span<const HostCopy> copies) override
      ABSL_LOCKS_EXCLUDED(mu_);
  /// Counts the call (copy_prepares()); nothing else to prepare.
  absl::Status PrepareCopies() override ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Device contents (sim_backend_host.cc) ----
  // Only expandable memory (physical handles) holds contents. They are kept per handle in
  // chunks of kContentChunk bytes, made on the first non-zero write: a byte never written reads
  // 0, so a test pays only for what it writes. A released handle's contents are gone.
  static constexpr std::size_t kContentChunk = 64 * 1024;
  /// Writes `bytes` at device range [va, va + bytes), as a kernel would (no call recorded).
  /// InvalidArgument when a byte of it is not mapped with access.
  absl::Status WriteDevice(DevicePtr va, const void* src, std::size_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  /// Reads device range [va, va + bytes) into `dst` (no call recorded); errors as WriteDevice.
  absl::Status ReadDevice(void* dst, DevicePtr va, std::size_t bytes) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Test controls (not driver calls: nothing is recorded in calls()) ----
  /// Completes `event` and every event recorded before it on the same stream.
  /// InvalidArgument if the event does not exist.
  absl::Status CompleteEvent(EventId event) ABSL_LOCKS_EXCLUDED(mu_);
  /// Completes every event recorded on `stream` so far.
  void CompleteStream(StreamId stream) ABSL_LOCKS_EXCLUDED(mu_);
  /// Completes every event recorded on any stream so far.
  void CompleteAllEvents() ABSL_LOCKS_EXCLUDED(mu_);
  /// Sets the host clock to `now_us` (microseconds, non-decreasing) and, with event_lag_us,
  /// completes each stream's events recorded at or before now_us - event_lag_us.
  void AdvanceClock(std::int64_t now_us) ABSL_LOCKS_EXCLUDED(mu_);
  /// Marks `stream` as being captured into a CUDA graph (true) or not (false).
  void SetCapturing(StreamId stream, bool capturing) ABSL_LOCKS_EXCLUDED(mu_);
  /// Sets the physical capacity in bytes. Lowering it below used_bytes() frees nothing; later
  /// allocations fail until usage drops, and MemGetInfo reports 0 free.
  void SetCapacity(std::size_t capacity) ABSL_LOCKS_EXCLUDED(mu_);
  /// Fault injection: the call of kind `call` made after `skip` more such calls fails once with
  /// `status` (recorded, no effect), as a driver error would. One pending failure per kind; a
  /// new one replaces it. Kinds covered: every call that changes device state or waits
  /// (Malloc, Free, CreatePhysical, ReleasePhysical, Map, Unmap, SetAccess, CreateEvent,
  /// RecordEvent, QueryEvent, SynchronizeEvent, SynchronizeStream).
  void FailCall(DriverCall call, int skip, absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  /// Caps the pinned host bytes live at once (default: no cap); HostAllocPinned past it is
  /// ResourceExhausted.
  void SetPinnedCapacity(std::size_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  /// Fault injection for copies: the copy (either direction; one HostCopy of a batch) made after
  /// `skip` more copies fails once with `status`, copying nothing; the batch stops there.
  void FailCopy(int skip, absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  /// Pinned host bytes live now, and copies made so far (either direction) with their bytes;
  /// copy_waits: the batches (CopyDeviceToHost / CopyHostToDevice calls), one wait each.
  std::size_t pinned_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  std::int64_t copies() const ABSL_LOCKS_EXCLUDED(mu_);
  std::int64_t copy_waits() const ABSL_LOCKS_EXCLUDED(mu_);
  /// PrepareCopies calls so far.
  std::int64_t copy_prepares() const ABSL_LOCKS_EXCLUDED(mu_);
  std::size_t copied_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  /// Failures injected by FailCall that have happened.
  std::int64_t injected_failures() const ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Observers ----
  /// Physical bytes in use: live Malloc allocations (rounded up to 512) plus physical handles.
  std::size_t used_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  /// Bytes currently mapped into reservations (a handle mapped at two addresses counts twice).
  std::size_t mapped_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  /// Bytes of second and later mappings of a handle (CUDA lets a handle be mapped at several
  /// addresses at once): mapped_bytes() less this is what the mapped handles hold.
  std::size_t aliased_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  /// Live Malloc allocations plus live physical handles (what holds physical memory).
  std::int64_t live_allocations() const ABSL_LOCKS_EXCLUDED(mu_);
  /// Live virtual address reservations.
  std::int64_t live_reservations() const ABSL_LOCKS_EXCLUDED(mu_);
  /// Descriptors ExportPhysical gave and CloseExported has not closed.
  std::int64_t live_exports() const ABSL_LOCKS_EXCLUDED(mu_);
  /// Addresses OpenMalloc gave and CloseMalloc has not closed.
  std::int64_t live_opened() const ABSL_LOCKS_EXCLUDED(mu_);
  /// The physical handle mapped at `va` (0: none).
  PhysicalHandle HandleAt(DevicePtr va) const ABSL_LOCKS_EXCLUDED(mu_);
  /// Events created and not destroyed.
  std::int64_t live_events() const ABSL_LOCKS_EXCLUDED(mu_);
  /// True if every byte of `[va, va + size)` is mapped and had SetAccess called on it.
  bool IsAccessible(DevicePtr va, std::size_t size) const ABSL_LOCKS_EXCLUDED(mu_);
  /// Driver calls made while some stream was capturing, by threads not in relaxed capture mode
  /// (each one would be an error or a capture invalidation on a real device).
  std::int64_t calls_during_capture_not_relaxed() const ABSL_LOCKS_EXCLUDED(mu_);
  /// Driver calls made while some stream was capturing, by threads in relaxed capture mode.
  std::int64_t calls_during_capture_relaxed() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Mapping {
    std::size_t size = 0;
    PhysicalHandle handle = 0;
    bool accessible = false;
  };
  struct Handle {
    std::size_t size = 0;
    int map_count = 0;
    bool imported = false;  // ImportPhysical's: another process's memory, not in used_
  };
  struct Event {
    StreamId stream = 0;
    std::uint64_t seq = 0;  // Sequence number of its last record; 0 if never recorded.
  };
  // A run of whole mappings exactly covering a range, found by FindCoveringMappings.
  struct Cover {
    absl::Status status;
    double micros = 0;  // Modelled cost of the call over the covered mappings.
  };

  // Calls `fn(handle, offset, done, n)` for each piece of [va, va + bytes), in order: the handle
  // mapped there, the piece's offset in it, the bytes before it and its length; InvalidArgument
  // naming `call` when a byte is not mapped with access.
  template <typename Fn>
  absl::Status ForEachMappedPiece(const char* call, DevicePtr va, std::size_t bytes, Fn fn) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteLocked(const char* call, DevicePtr va, const void* src, std::size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReadLocked(const char* call, void* dst, DevicePtr va, std::size_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CopyInjectedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CopyLocked(absl::Span<const HostCopy> copies, bool to_host)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the IPC export of the allocation at `base` of (pid, device): it was freed.
  static void ForgetMallocExport(int pid, int device, DevicePtr base);
  // The injected failure for `call`, if it is due now (FailCall); OK otherwise.
  absl::Status InjectedLocked(DriverCall call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records one driver call with its modelled cost, and counts it if a capture is under way.
  void RecordCallLocked(DriverCall call, double micros) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordCallLocked(DriverCall call, std::size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `size` bytes of fake address space aligned to `alignment`; 0 if exhausted.
  DevicePtr TakeAddressLocked(std::size_t size, std::size_t alignment)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns `[ptr, ptr + size)` to the fake address space.
  void GiveBackAddressLocked(DevicePtr ptr, std::size_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks that `[va, va + size)` is granularity-aligned and consists of whole, contiguous
  // mappings; the cost is the per-mapping sum of `call`'s modelled cost.
  Cover FindCoveringMappings(DriverCall call, DevicePtr va, std::size_t size) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckGranular(DriverCall call, const char* what, std::uint64_t value) const;
  bool IsCompleteLocked(const Event& event) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteThroughLocked(const Event& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::size_t FreeBytesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Config config_;

  mutable absl::Mutex mu_;
  std::size_t capacity_ ABSL_GUARDED_BY(mu_);
  std::size_t used_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t mapped_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t aliased_ ABSL_GUARDED_BY(mu_) = 0;
  struct Injected {
    int skip = 0;
    absl::Status status;
  };
  absl::flat_hash_map<DriverCall, Injected> injected_ ABSL_GUARDED_BY(mu_);
  std::int64_t injected_failures_ ABSL_GUARDED_BY(mu_) = 0;

  // Fake address space: ranges below top_ that are free, keyed by start, coalesced.
  std::map<DevicePtr, std::size_t> free_ranges_ ABSL_GUARDED_BY(mu_);
  DevicePtr top_ ABSL_GUARDED_BY(mu_);

  // Live Malloc allocations: address -> charged bytes (size rounded up to 512).
  absl::flat_hash_map<DevicePtr, std::size_t> mallocs_ ABSL_GUARDED_BY(mu_);
  // Live reservations and mappings, keyed by start address (ordered for containment lookups).
  std::map<DevicePtr, std::size_t> reservations_ ABSL_GUARDED_BY(mu_);
  std::map<DevicePtr, Mapping> mappings_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<PhysicalHandle, Handle> handles_ ABSL_GUARDED_BY(mu_);
  PhysicalHandle next_handle_ ABSL_GUARDED_BY(mu_);

  absl::flat_hash_map<EventId, Event> events_ ABSL_GUARDED_BY(mu_);
  EventId next_event_ ABSL_GUARDED_BY(mu_);
  std::uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  // Per stream that ever had a record: every record with seq <= this value has completed.
  absl::flat_hash_map<StreamId, std::uint64_t> completed_through_ ABSL_GUARDED_BY(mu_);
  // event_lag_us: per stream, {seq, record time} of records not yet completed by the clock.
  absl::flat_hash_map<StreamId, std::deque<std::pair<std::uint64_t, std::int64_t>>> lagging_
      ABSL_GUARDED_BY(mu_);
  std::int64_t now_us_ ABSL_GUARDED_BY(mu_) = 0;

  // Interprocess sharing: this backend's open descriptors (fd -> handle), its exported Malloc
  // addresses, and the addresses it opened.
  absl::flat_hash_map<int, PhysicalHandle> exports_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<DevicePtr> exported_mallocs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<DevicePtr, std::size_t> opened_ ABSL_GUARDED_BY(mu_);

  // Pinned host memory (pointer -> bytes) and its cap; the injected copy failure; the contents
  // of physical handles, by handle and chunk index (only chunks ever written non-zero).
  absl::flat_hash_map<void*, std::size_t> pinned_ ABSL_GUARDED_BY(mu_);
  std::size_t pinned_used_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t pinned_cap_ ABSL_GUARDED_BY(mu_) = SIZE_MAX;
  Injected copy_failure_ ABSL_GUARDED_BY(mu_);
  bool copy_failure_set_ ABSL_GUARDED_BY(mu_) = false;
  std::int64_t copies_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t copy_waits_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t copy_prepares_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t copied_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<PhysicalHandle, absl::flat_hash_map<std::size_t, std::vector<std::uint8_t>>>
      contents_ ABSL_GUARDED_BY(mu_);

  absl::flat_hash_set<StreamId> capturing_ ABSL_GUARDED_BY(mu_);
  std::int64_t capture_calls_relaxed_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t capture_calls_not_relaxed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace vramledger

#endif  // VRAMLEDGER_DEVICE_SIM_BACKEND_H_
