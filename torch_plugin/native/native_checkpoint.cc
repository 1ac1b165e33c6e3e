// CUDA graph trees' allocator calls in the torch-native mode (torch.compile's "reduce-overhead"):
// getCheckpointState, setCheckpointPoolState and checkPoolLiveAllocations, answered by the
// core's checkpoints of a private pool (core/pool_checkpoint.h) through the runtime.
#include <c10/util/Exception.h>

#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/pool_checkpoint.h"
#include "torch_plugin/native/native_allocator.h"
#include "torch_plugin/runtime/c_api.h"
#include "torch_plugin/runtime/checkpoint_api.h"

namespace vramledger {
namespace {

namespace torch_alloc = c10::cuda::CUDACachingAllocator;

// torch's opaque AllocatorState for vramledger: the core's checkpoint of one private pool.
struct PoolState final : torch_alloc::AllocatorState {
  explicit PoolState(core::PoolCheckpoint c) : checkpoint(std::move(c)) {}
  const core::PoolCheckpoint checkpoint;
};

// The runtime's status as a c10::Error carrying its message (which names vramledger and the call).
void ThrowIfFailed(int rc) { TORCH_CHECK(rc == VRAMLEDGER_OK, vramledger_last_error()); }

}  // namespace

std::shared_ptr<torch_alloc::AllocatorState> NativeAllocator::getCheckpointState(
    c10::DeviceIndex device, c10::MempoolId_t id) {
  core::PoolCheckpoint checkpoint;
  ThrowIfFailed(vramledger_checkpoint_pool(device, id.first, id.second, &checkpoint));
  return std::make_shared<PoolState>(std::move(checkpoint));
}

torch_alloc::CheckpointDelta NativeAllocator::setCheckpointPoolState(
    c10::DeviceIndex device, std::shared_ptr<torch_alloc::AllocatorState> pps) {
  const auto* state = dynamic_cast<const PoolState*>(pps.get());
  TORCH_CHECK(state != nullptr,
              "vramledger: setCheckpointPoolState: Expected PrivatePoolState, a state that "
              "vramledger's getCheckpointState returned (this one is another allocator's)");
  core::PoolRestore restored;
  ThrowIfFailed(vramledger_restore_pool(device, &state->checkpoint, &restored));
  // torch frees the stale storages' blocks by swapping their deleter for deleteNothing (it
  // compares it with raw_deleter() first), and gives the re-allocated blocks to live storages:
  // their DataPtrs carry the deleter every DataPtr of this allocator has.
  torch_alloc::CheckpointDelta delta;
  delta.ptrs_freed.reserve(restored.freed.size());
  for (DevicePtr ptr : restored.freed) delta.ptrs_freed.push_back(reinterpret_cast<void*>(ptr));
  const c10::Device where(c10::DeviceType::CUDA, device);
  delta.dataptrs_allocd.reserve(restored.allocated.size());
  for (const core::BlockCheckpoint& block : restored.allocated) {
    void* ptr = reinterpret_cast<void*>(block.ptr);
    delta.dataptrs_allocd.emplace_back(ptr, ptr, raw_deleter(), where);
  }
  return delta;
}

bool NativeAllocator::checkPoolLiveAllocations(
    c10::DeviceIndex device, c10::MempoolId_t mempool_id,
    const std::unordered_set<void*>& expected_live_allocations) {
  std::vector<DevicePtr> live;
  live.reserve(expected_live_allocations.size());
  for (void* ptr : expected_live_allocations) live.push_back(reinterpret_cast<DevicePtr>(ptr));
  bool equal = false;
  ThrowIfFailed(
      vramledger_check_pool_live(device, mempool_id.first, mempool_id.second, &live, &equal));
  return equal;
}

}  // namespace vramledger
