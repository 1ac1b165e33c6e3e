// The CUDAPluggableAllocator route: torch's alloc/free pair and hooks over the runtime's device
// table, with failures thrown as c10 errors (OutOfMemoryError for a refusal, as torch's own
// allocator does). Everything else this library exports comes from the runtime.
#include "torch_plugin/pluggable/plugin.h"

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cxxabi.h>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "torch_plugin/runtime/device_table.h"
#include "torch_plugin/runtime/guard_api.h"
#include "torch_plugin/runtime/oom_observers.h"
#include "torch_plugin/runtime/trace_trackers.h"
#include "vramledger/device_allocator.h"

namespace vramledger {
namespace {

// Throws `status` as the matching c10 error: torch.OutOfMemoryError, ValueError or
// RuntimeError in Python.
[[noreturn]] void Throw(const absl::Status& status) {
  const std::string message(status.message());
  if (absl::IsResourceExhausted(status)) C10_THROW_ERROR(OutOfMemoryError, message);
  if (absl::IsInvalidArgument(status)) C10_THROW_ERROR(ValueError, message);
  C10_THROW_ERROR(Error, message);
}

std::atomic<vramledger_refusal_fn> g_refusal_reporter{nullptr};

// Runs `fn` on the allocator of `device` (created if need be), throwing either one's error as
// the matching c10 error: the shape of every per-device call torch makes.
void OnDevice(int device, absl::FunctionRef<absl::Status(DeviceAllocator*)> fn) {
  absl::StatusOr<DeviceAllocator*> allocator = DeviceTable::Get().GetOrCreate(device);
  if (!allocator.ok()) Throw(allocator.status());
  if (const absl::Status s = fn(*allocator); !s.ok()) Throw(s);
}

MempoolId Id(vramledger_mempool_id id) { return {id.first, id.second}; }

}  // namespace
}  // namespace vramledger

using vramledger::DeviceAllocator;
using vramledger::DevicePtr;
using vramledger::DeviceTable;
using vramledger::StreamId;

extern "C" {

void* vramledger_malloc(std::size_t size, int device, cudaStream_t stream) {
  if (size == 0) return nullptr;
  absl::StatusOr<DeviceAllocator*> allocator = DeviceTable::Get().GetOrCreate(device);
  if (!allocator.ok()) vramledger::Throw(allocator.status());
  const absl::StatusOr<DevicePtr> ptr =
      (*allocator)->Malloc(size, reinterpret_cast<StreamId>(stream));
  // A guard refusal gets its full report; any other failure goes to WithOomDump.
  if (!ptr.ok()) {
    const bool exhausted = absl::IsResourceExhausted(ptr.status());
    if (exhausted) {  // observers first, outside the device lock
      vramledger::NotifyOutOfMemoryObservers(device, size, (*allocator)->last_oom());
    }
    const absl::Status report = vramledger::GuardRefusalOrOomDump(device, ptr.status());
    vramledger_refusal_fn reporter = vramledger::g_refusal_reporter.load();
    if (exhausted && reporter != nullptr) reporter(device, std::string(report.message()).c_str());
    vramledger::Throw(report);
  }
  TORCH_CHECK(*ptr != 0, "vramledger: allocation of ", size, " bytes on device ", device,
              " returned a null address");
  return reinterpret_cast<void*>(*ptr);
}

void vramledger_free(void* ptr, std::size_t size, int device, cudaStream_t stream) {
  (void)stream;
  if (ptr == nullptr) return;
  try {
    vramledger::DeviceTable& state = DeviceTable::Get();
    DeviceAllocator* allocator = state.EnsureDevices().ok() ? state.Existing(device) : nullptr;
    if (allocator == nullptr) {
      std::fprintf(stderr,
                   "vramledger: free of %p (%zu bytes) on device %d, which has no allocator; "
                   "ignored\n",
                   ptr, size, device);
      return;
    }
    const absl::Status s = allocator->Free(reinterpret_cast<DevicePtr>(ptr));
    if (!s.ok()) {
      std::fprintf(stderr, "vramledger: free of %p (%zu bytes) on device %d failed: %s\n", ptr,
                   size, device, std::string(s.message()).c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vramledger: free of %p on device %d threw: %s\n", ptr, device, e.what());
  } catch (const abi::__forced_unwind&) {
    throw;  // a thread's exit or cancellation unwinds on (c_errors.h)
  } catch (...) {
    std::fprintf(stderr, "vramledger: free of %p on device %d threw\n", ptr, device);
  }
}

void vramledger_init(int device_count) {
  const absl::Status s = DeviceTable::Get().EnsureDevices();
  if (!s.ok()) vramledger::Throw(s);
  if (device_count != DeviceTable::Get().device_count()) {
    std::fprintf(stderr, "vramledger: torch reports %d CUDA devices, cudaGetDeviceCount %d\n",
                 device_count, DeviceTable::Get().device_count());
  }
}

void vramledger_reset() {
  const absl::Status s =
      DeviceTable::Get().ForDevices(-1, [](DeviceAllocator* a) { return a->EmptyCache(); });
  if (!s.ok()) vramledger::Throw(s);
}

void vramledger_set_memory_fraction(double fraction, int device) {
  vramledger::OnDevice(
      device, [&](DeviceAllocator* allocator) { return allocator->SetMemoryFraction(fraction); });
}

void vramledger_record_stream(void* ptr, cudaStream_t stream) {
  if (ptr == nullptr) return;
  vramledger::DeviceTable& state = DeviceTable::Get();
  const absl::Status devices = state.EnsureDevices();
  if (!devices.ok()) vramledger::Throw(devices);
  for (int d = 0; d < state.device_count(); ++d) {
    DeviceAllocator* allocator = state.Existing(d);
    if (allocator == nullptr) continue;
    const absl::Status s = allocator->RecordStream(reinterpret_cast<DevicePtr>(ptr),
                                                   reinterpret_cast<StreamId>(stream));
    if (s.ok()) return;
    if (!absl::IsNotFound(s)) vramledger::Throw(s);
  }
  TORCH_CHECK(false, "vramledger: record_stream on ", ptr,
              ", which no vramledger allocator handed out");
}

void vramledger_begin_allocate_to_pool(int device, vramledger_mempool_id pool_id,
                                       std::function<bool(cudaStream_t)> filter) {
  vramledger::OnDevice(device, [&](DeviceAllocator* allocator) {
    return allocator->BeginAllocateToPool(
        vramledger::Id(pool_id), [filter = std::move(filter)](StreamId stream) {
          return filter && filter(reinterpret_cast<cudaStream_t>(stream));
        });
  });
}

void vramledger_end_allocate_to_pool(int device, vramledger_mempool_id pool_id) {
  vramledger::OnDevice(device, [&](DeviceAllocator* allocator) {
    return allocator->EndAllocateToPool(vramledger::Id(pool_id));
  });
}

void vramledger_release_pool(int device, vramledger_mempool_id pool_id) {
  vramledger::OnDevice(device, [&](DeviceAllocator* allocator) {
    return allocator->ReleasePool(vramledger::Id(pool_id));
  });
}

void vramledger_set_refusal_reporter(vramledger_refusal_fn fn) {
  vramledger::g_refusal_reporter.store(fn);
}

void vramledger_set_before_create(void (*fn)(int device)) {
  DeviceTable::Get().SetBeforeCreate([fn](int device) {
    if (fn != nullptr) fn(device);
  });
}

void vramledger_create_or_incref_pool(int device, vramledger_mempool_id pool_id,
                                      std::shared_ptr<vramledger::SegmentSource> source) {
  vramledger::OnDevice(device, [&](DeviceAllocator* allocator) {
    return allocator->CreateOrIncrefPool(vramledger::Id(pool_id), std::move(source));
  });
}

void vramledger_set_use_on_oom(int device, vramledger_mempool_id pool_id, bool use_on_oom) {
  vramledger::OnDevice(device, [&](DeviceAllocator* allocator) {
    return allocator->SetUseOnOOM(vramledger::Id(pool_id), use_on_oom);
  });
}

void vramledger_set_no_split(int device, vramledger_mempool_id pool_id) {
  vramledger::OnDevice(device, [&](DeviceAllocator* allocator) {
    return allocator->SetNoSplit(vramledger::Id(pool_id));
  });
}

int vramledger_pool_use_count(int device, vramledger_mempool_id pool_id) {
  if (absl::Status s = DeviceTable::Get().CheckDevice(device); !s.ok()) vramledger::Throw(s);
  DeviceAllocator* allocator = DeviceTable::Get().Existing(device);
  return allocator == nullptr ? 0 : allocator->PoolUseCount(vramledger::Id(pool_id));
}

void vramledger_empty_pool_cache(vramledger_mempool_id pool_id) {
  const vramledger::MempoolId id = vramledger::Id(pool_id);
  const absl::Status s = DeviceTable::Get().ForDevices(
      -1, [id](DeviceAllocator* allocator) { return allocator->EmptyCache(id); });
  if (!s.ok()) vramledger::Throw(s);
}

void vramledger_attach_trace_tracker(std::function<void(const vramledger::TraceEntry&)> tracker) {
  vramledger::TraceTrackers::Get().Add(std::move(tracker));
}

void* vramledger_testing_malloc(size_t size, int device, char** message_out) {
  if (message_out != nullptr) *message_out = nullptr;
  std::string message;
  try {
    return vramledger_malloc(size, device, nullptr);
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    message = e.what();
  }
  if (message_out != nullptr) {  // released with vramledger_string_free (std::free)
    *message_out = static_cast<char*>(std::malloc(message.size() + 1));
    if (*message_out != nullptr) std::memcpy(*message_out, message.c_str(), message.size() + 1);
  }
  return nullptr;
}

}  // extern "C"
