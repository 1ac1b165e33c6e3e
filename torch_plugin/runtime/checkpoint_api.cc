// Checkpoints of a private pool through the runtime's device table (checkpoint_api.h): each call
// finds the device's allocator and forwards to it, reporting a failure across the C ABI.
#include "torch_plugin/runtime/checkpoint_api.h"

#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "torch_plugin/runtime/device_table.h"
#include "vramledger/device_allocator.h"

namespace vramledger {
namespace {

// The allocator of `device`; a device without one has no private pool yet (torch's words).
absl::StatusOr<DeviceAllocator*> AllocatorWithPools(int device, MempoolId pool, const char* call) {
  DeviceTable& table = DeviceTable::Get();
  if (absl::Status s = table.EnsureDevices(); !s.ok()) return s;
  if (absl::Status s = table.CheckDevice(device); !s.ok()) return s;
  DeviceAllocator* allocator = table.Existing(device);
  if (allocator == nullptr) {
    return absl::NotFoundError(
        absl::StrFormat("vramledger: %s: Could not find pool of id (%d, %d) on device %d", call,
                        pool.first, pool.second, device));
  }
  return allocator;
}

}  // namespace
}  // namespace vramledger

extern "C" {

int vramledger_checkpoint_pool(int device, std::uint64_t pool_first, std::uint64_t pool_second,
                               vramledger::core::PoolCheckpoint* out) {
  return vramledger::CatchAll([&]() -> absl::Status {
    const vramledger::MempoolId pool{pool_first, pool_second};
    absl::StatusOr<vramledger::DeviceAllocator*> allocator =
        vramledger::AllocatorWithPools(device, pool, "getCheckpointState");
    if (!allocator.ok()) return allocator.status();
    absl::StatusOr<vramledger::core::PoolCheckpoint> checkpoint =
        (*allocator)->CheckpointPool(pool);
    if (!checkpoint.ok()) return checkpoint.status();
    *out = *std::move(checkpoint);
    return absl::OkStatus();
  });
}

int vramledger_restore_pool(int device, const vramledger::core::PoolCheckpoint* checkpoint,
                            vramledger::core::PoolRestore* out) {
  return vramledger::CatchAll([&]() -> absl::Status {
    absl::StatusOr<vramledger::DeviceAllocator*> allocator =
        vramledger::AllocatorWithPools(device, checkpoint->pool, "setCheckpointPoolState");
    if (!allocator.ok()) return allocator.status();
    absl::StatusOr<vramledger::core::PoolRestore> restored =
        (*allocator)->RestorePool(checkpoint->pool, *checkpoint);
    if (!restored.ok()) return restored.status();
    *out = *std::move(restored);
    return absl::OkStatus();
  });
}

int vramledger_check_pool_live(int device, std::uint64_t pool_first, std::uint64_t pool_second,
                               const std::vector<vramledger::DevicePtr>* live, bool* equal) {
  return vramledger::CatchAll([&]() -> absl::Status {
    const vramledger::MempoolId pool{pool_first, pool_second};
    absl::StatusOr<vramledger::DeviceAllocator*> allocator =
        vramledger::AllocatorWithPools(device, pool, "checkPoolLiveAllocations");
    if (!allocator.ok()) return allocator.status();
    absl::StatusOr<bool> result = (*allocator)->CheckPoolLiveAllocations(pool, *live);
    if (!result.ok()) return result.status();
    *equal = *result;
    return absl::OkStatus();
  });
}

}  // extern "C"
