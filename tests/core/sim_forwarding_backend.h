// A DeviceBackend that forwards every call to a SimBackend. Test backends that watch some calls
// (GpuModelBackend in old_mapping_placement_stress_test.cc, HazardBackend in
// old_mapping_hazard_test.cc) derive from it and override only those.
#ifndef VRAMLEDGER_TESTS_CORE_SIM_FORWARDING_BACKEND_H_
#define VRAMLEDGER_TESTS_CORE_SIM_FORWARDING_BACKEND_H_

#include <cstddef>

#include "device/sim_backend.h"
#include "vramledger/device_backend.h"

namespace vramledger {

/// Forwards each DeviceBackend call to `sim` (not owned; outlives this object).
class SimForwardingBackend : public DeviceBackend {
 public:
  explicit SimForwardingBackend(SimBackend* sim) : sim_(sim) {}

  int device() const override { return sim_->device(); }
  absl::Status Malloc(std::size_t size, DevicePtr* out) override { return sim_->Malloc(size, out); }
  absl::Status Free(DevicePtr ptr) override { return sim_->Free(ptr); }
  std::size_t Granularity() const override { return sim_->Granularity(); }
  absl::Status ReserveAddress(std::size_t size, DevicePtr* out) override {
    return sim_->ReserveAddress(size, out);
  }
  absl::Status ReleaseAddress(DevicePtr ptr, std::size_t size) override {
    return sim_->ReleaseAddress(ptr, size);
  }
  absl::Status CreatePhysical(std::size_t size, PhysicalHandle* out) override {
    return sim_->CreatePhysical(size, out);
  }
  absl::Status ReleasePhysical(PhysicalHandle handle) override {
    return sim_->ReleasePhysical(handle);
  }
  absl::Status Map(DevicePtr va, std::size_t size, PhysicalHandle handle) override {
    return sim_->Map(va, size, handle);
  }
  absl::Status Unmap(DevicePtr va, std::size_t size) override { return sim_->Unmap(va, size); }
  absl::Status SetAccess(DevicePtr va, std::size_t size) override {
    return sim_->SetAccess(va, size);
  }
  absl::Status CreateEvent(EventId* out) override { return sim_->CreateEvent(out); }
  absl::Status RecordEvent(EventId event, StreamId stream) override {
    return sim_->RecordEvent(event, stream);
  }
  absl::StatusOr<bool> QueryEvent(EventId event) override { return sim_->QueryEvent(event); }
  absl::Status SynchronizeEvent(EventId event) override { return sim_->SynchronizeEvent(event); }
  absl::Status DestroyEvent(EventId event) override { return sim_->DestroyEvent(event); }
  absl::Status SynchronizeStream(StreamId stream) override {
    return sim_->SynchronizeStream(stream);
  }
  absl::Status MemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) override {
    return sim_->MemGetInfo(free_bytes, total_bytes);
  }
  bool IsCapturing(StreamId stream) override { return sim_->IsCapturing(stream); }
  int EnterRelaxedCapture() override { return sim_->EnterRelaxedCapture(); }
  void ExitRelaxedCapture(int previous_mode) override { sim_->ExitRelaxedCapture(previous_mode); }
  absl::StatusOr<void*> HostAllocPinned(std::size_t bytes) override {
    return sim_->HostAllocPinned(bytes);
  }
  absl::Status HostFreePinned(void* p) override { return sim_->HostFreePinned(p); }
  absl::Status CopyDeviceToHost(absl::Span<const HostCopy> copies) override {
    return sim_->CopyDeviceToHost(copies);
  }
  absl::Status CopyHostToDevice(absl::Span<const HostCopy> copies) override {
    return sim_->CopyHostToDevice(copies);
  }
  int ProcessId() const override { return sim_->ProcessId(); }
  absl::Status ExportMalloc(DevicePtr base, IpcMemHandle* out) override {
    return sim_->ExportMalloc(base, out);
  }
  absl::Status OpenMalloc(const IpcMemHandle& handle, DevicePtr* out) override {
    return sim_->OpenMalloc(handle, out);
  }
  absl::Status CloseMalloc(DevicePtr ptr) override { return sim_->CloseMalloc(ptr); }
  absl::Status ExportPhysical(PhysicalHandle handle, int* fd) override {
    return sim_->ExportPhysical(handle, fd);
  }
  absl::Status CloseExported(int fd) override { return sim_->CloseExported(fd); }
  absl::Status ImportPhysical(int pid, const std::vector<int>& fds,
                              std::vector<PhysicalHandle>* out) override {
    return sim_->ImportPhysical(pid, fds, out);
  }
  absl::Status SynchronizeDevice() override { return sim_->SynchronizeDevice(); }

 protected:
  SimBackend* sim_;
};

}  // namespace vramledger

#endif  // VRAMLEDGER_TESTS_CORE_SIM_FORWARDING_BACKEND_H_
