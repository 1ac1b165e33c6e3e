// Private pools in the torch-native mode: CUDA graph pools and torch.cuda.MemPool (create or
// incref, a MemPool's own allocator as the pool's segment source, use_on_oom, no_split, use
// counts, use_mem_pool's per-thread begin/end, release, and the empty_cache of one pool).
#include <c10/util/Exception.h>

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "torch_plugin/native/native_allocator.h"
#include "torch_plugin/pluggable/plugin.h"
#include "torch_plugin/runtime/c_errors.h"
#include "vramledger/device_allocator.h"

namespace vramledger {
namespace {

namespace torch_alloc = c10::cuda::CUDACachingAllocator;

vramledger_mempool_id Id(c10::MempoolId_t id) { return {id.first, id.second}; }

// A MemPool's allocator (a CUDAPluggableAllocator) as the pool's segment source: torch takes
// such a pool's segments from its raw_alloc_with_stream and returns them with raw_delete. Called
// under the device allocator's lock, so nothing it throws may leave: errors become statuses (a
// nullptr or c10::OutOfMemoryError is the out-of-memory path's ResourceExhausted).
class AllocatorSource final : public SegmentSource {
 public:
  explicit AllocatorSource(std::shared_ptr<torch_alloc::CUDAAllocator> allocator)
      : allocator_(std::move(allocator)) {}

  absl::StatusOr<DevicePtr> Allocate(std::size_t size, StreamId stream) override {
    void* ptr = nullptr;
    try {
      ptr = allocator_->raw_alloc_with_stream(size, reinterpret_cast<cudaStream_t>(stream));
    } catch (const c10::OutOfMemoryError& e) {
      return absl::ResourceExhaustedError(e.what_without_backtrace());
    } catch (const c10::Error& e) {
      return absl::InternalError(Failed("allocate", e.what_without_backtrace()));
    } catch (const std::exception& e) {
      return absl::InternalError(Failed("allocate", e.what()));
    }
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the MemPool's allocator returned no memory for ", size, " bytes"));
    }
    return reinterpret_cast<DevicePtr>(ptr);
  }

  absl::Status Free(DevicePtr ptr) override {
    try {
      allocator_->raw_delete(reinterpret_cast<void*>(ptr));
    } catch (const c10::Error& e) {
      return absl::InternalError(Failed("free", e.what_without_backtrace()));
    } catch (const std::exception& e) {
      return absl::InternalError(Failed("free", e.what()));
    }
    return absl::OkStatus();
  }

 private:
  static std::string Failed(const char* what, const char* message) {
    return absl::StrCat("vramledger: the MemPool's allocator failed to ", what, ": ", message);
  }

  const std::shared_ptr<torch_alloc::CUDAAllocator> allocator_;
};

}  // namespace

void NativeAllocator::createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                         std::shared_ptr<torch_alloc::CUDAAllocator> allocator) {
  // A MemPool made with torch's current allocator (vramledger itself) takes vramledger's
  // segments: only another allocator is a source of its own.
  std::shared_ptr<SegmentSource> source;
  if (allocator != nullptr && allocator.get() != this) {
    source = std::make_shared<AllocatorSource>(std::move(allocator));
  }
  vramledger_create_or_incref_pool(device, Id(mempool_id), std::move(source));
}

void NativeAllocator::setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                  bool use_on_oom) {
  vramledger_set_use_on_oom(device, Id(mempool_id), use_on_oom);
}

void NativeAllocator::setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  vramledger_set_no_split(device, Id(mempool_id));
}

int NativeAllocator::getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  return vramledger_pool_use_count(device, Id(mempool_id));
}

void NativeAllocator::beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                          std::function<bool(cudaStream_t)> filter) {
  // use_mem_pool's filter accepts its own thread; a capture's, its stream.
  vramledger_begin_allocate_to_pool(device, Id(mempool_id), std::move(filter));
}

void NativeAllocator::endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  vramledger_end_allocate_to_pool(device, Id(mempool_id));
}

void NativeAllocator::releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  vramledger_release_pool(device, Id(mempool_id));
}

void NativeAllocator::emptyCache(c10::MempoolId_t mempool_id) {
  if (mempool_id.first == 0 && mempool_id.second == 0) {
    const int rc = vramledger_empty_cache(-1);  // every pool's free cache, every device
    TORCH_CHECK(rc == VRAMLEDGER_OK, "vramledger: empty_cache: ", vramledger_last_error());
    return;
  }
  vramledger_empty_pool_cache(Id(mempool_id));  // that pool, once it has no use left
}

}  // namespace vramledger
