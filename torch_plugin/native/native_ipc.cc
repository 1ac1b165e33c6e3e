// NativeAllocator's CUDA IPC: torch's shareIpcHandle, getIpcDevPtr and getBaseAllocation
// answered by the runtime's allocators, in torch's byte format so either process may run torch's
// own allocator (docs/design/ipc.md). Thread-safe.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <memory>
#include <string>
#include <string_view>

#include "torch_plugin/native/native_allocator.h"
#include "torch_plugin/pluggable/plugin.h"

namespace vramledger {
namespace {

namespace torch_alloc = c10::cuda::CUDACachingAllocator;

// The runtime's message as a c10::Error, named after `call` unless it names itself.
void ThrowIpcError(int rc, const char* call) {
  if (rc == VRAMLEDGER_OK) return;
  const std::string message = vramledger_last_error();
  if (std::string_view(message).substr(0, 12) == "vramledger: ") TORCH_CHECK(false, message);
  TORCH_CHECK(false, "vramledger: ", call, ": ", message);
}

}  // namespace

torch_alloc::ShareableHandle NativeAllocator::shareIpcHandle(void* ptr) {
  torch_alloc::ShareableHandle out{0, {}};
  std::ptrdiff_t offset = 0;
  ThrowIpcError(vramledger_ipc_share(ptr, &offset, &out.handle), "shareIpcHandle");
  out.offset = offset;
  return out;
}

std::shared_ptr<void> NativeAllocator::OpenIpcOn(c10::DeviceIndex device,
                                                 const std::string& handle) {
  std::shared_ptr<void> opened;
  ThrowIpcError(vramledger_ipc_open(device, &handle, &opened), "getIpcDevPtr");
  return opened;
}

std::shared_ptr<void> NativeAllocator::getIpcDevPtr(std::string handle) {
  // torch opens on the current device (its _new_shared_cuda sets it to the storage's).
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return OpenIpcOn(device, handle);
}

void* NativeAllocator::getBaseAllocation(void* ptr, std::size_t* size) {
  void* base = nullptr;
  ThrowIpcError(vramledger_base_allocation(ptr, &base, size), "getBaseAllocation");
  return base;
}

}  // namespace vramledger
