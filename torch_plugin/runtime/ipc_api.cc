// The runtime's CUDA IPC entry points (c_api.h; docs/design/ipc.md): a block shared from, or a
// handle opened on, the runtime's per-device allocators. Thread-safe as the allocators are.
#include <cuda_runtime_api.h>

#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "torch_plugin/runtime/c_api.h"
#include "torch_plugin/runtime/device_table.h"
#include "vramledger/device_allocator.h"

namespace vramledger {
namespace {

// Runs `fn` on each device's allocator, the current device's first, until one knows `ptr`
// (anything but NotFound); NotFound naming the address when none does.
template <typename Fn>
absl::Status OnOwner(void* ptr, const char* call, Fn fn) {
  DeviceTable& table = DeviceTable::Get();
  if (absl::Status s = table.EnsureDevices(); !s.ok()) return s;
  int current = 0;
  if (table.simulated() || cudaGetDevice(&current) != cudaSuccess) {
    (void)cudaGetLastError();
    current = 0;
  }
  const int count = table.device_count();
  for (int i = 0; i < count; ++i) {
    const int d = i == 0 ? current : (i <= current ? i - 1 : i);  // current, then the rest
    DeviceAllocator* allocator = table.Existing(d);
    if (allocator == nullptr) continue;
    absl::Status s = fn(allocator);
    if (!absl::IsNotFound(s)) return s;
  }
  return absl::NotFoundError(absl::StrFormat(
      "vramledger: %s: invalid device pointer %p: no vramledger allocator handed it out", call,
      ptr));
}

}  // namespace
}  // namespace vramledger

using vramledger::DeviceAllocator;
using vramledger::DevicePtr;

int vramledger_ipc_share(void* ptr, std::ptrdiff_t* offset, std::string* handle) {
  return vramledger::CatchAll([&]() -> absl::Status {
    return vramledger::OnOwner(ptr, "shareIpcHandle", [&](DeviceAllocator* a) -> absl::Status {
      absl::StatusOr<vramledger::IpcShare> share =
          a->ShareIpcHandle(reinterpret_cast<DevicePtr>(ptr));
      if (!share.ok()) return share.status();
      *offset = share->offset;
      *handle = std::move(share->handle);
      return absl::OkStatus();
    });
  });
}

int vramledger_ipc_open(int device, const std::string* handle, std::shared_ptr<void>* out) {
  return vramledger::CatchAll([&]() -> absl::Status {
    vramledger::DeviceTable& table = vramledger::DeviceTable::Get();
    if (absl::Status s = table.EnsureDevices(); !s.ok()) return s;
    if (absl::Status s = table.CheckDevice(device); !s.ok()) return s;
    absl::StatusOr<DeviceAllocator*> allocator = table.GetOrCreate(device);
    if (!allocator.ok()) return allocator.status();
    absl::StatusOr<std::shared_ptr<void>> opened = (*allocator)->OpenIpcHandle(*handle);
    if (!opened.ok()) return opened.status();
    *out = *std::move(opened);
    return absl::OkStatus();
  });
}

int vramledger_base_allocation(void* ptr, void** base, std::size_t* size) {
  return vramledger::CatchAll([&]() -> absl::Status {
    return vramledger::OnOwner(ptr, "getBaseAllocation", [&](DeviceAllocator* a) -> absl::Status {
      auto found = a->BaseAllocation(reinterpret_cast<DevicePtr>(ptr));
      if (!found.ok()) return found.status();
      *base = reinterpret_cast<void*>(found->first);
      if (size != nullptr) *size = found->second;
      return absl::OkStatus();
    });
  });
}
