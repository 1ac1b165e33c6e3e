// The runtime's entry points for checkpoints of a private pool (core/pool_checkpoint.h), which
// the torch-native library's CUDA graph tree calls use (torch_plugin/native/native_checkpoint.cc).
// C++-facing, exported by libvramledger_plugin.so; never throw; thread-safe.
#ifndef VRAMLEDGER_TORCH_PLUGIN_RUNTIME_CHECKPOINT_API_H_
#define VRAMLEDGER_TORCH_PLUGIN_RUNTIME_CHECKPOINT_API_H_

#include <cstdint>
#include <vector>

#include "core/pool_checkpoint.h"
#include "torch_plugin/runtime/c_errors.h"
#include "vramledger/types.h"

// Each returns VRAMLEDGER_OK, or a vramledger_status with the message in vramledger_last_error():
// the core's errors (torch's words among them), and "Could not find pool of id" for a device
// that has no allocator yet.
extern "C" {

/// DeviceAllocator::CheckpointPool of private pool {pool_first, pool_second} on `device`, into
/// *out.
VRAMLEDGER_EXPORT int vramledger_checkpoint_pool(int device, std::uint64_t pool_first,
                                                 std::uint64_t pool_second,
                                                 vramledger::core::PoolCheckpoint* out);

/// DeviceAllocator::RestorePool of the pool `checkpoint` names, on `device`, into *out.
VRAMLEDGER_EXPORT int vramledger_restore_pool(int device,
                                              const vramledger::core::PoolCheckpoint* checkpoint,
                                              vramledger::core::PoolRestore* out);

/// DeviceAllocator::CheckPoolLiveAllocations of {pool_first, pool_second} on `device` against
/// `live`, into *equal.
VRAMLEDGER_EXPORT int vramledger_check_pool_live(int device, std::uint64_t pool_first,
                                                 std::uint64_t pool_second,
                                                 const std::vector<vramledger::DevicePtr>* live,
                                                 bool* equal);
}  // extern "C"

#endif  // VRAMLEDGER_TORCH_PLUGIN_RUNTIME_CHECKPOINT_API_H_
