// DriverCallName: the CUDA API spelling of each DriverCall kind, for ledgers, logs and reports.
// Pure function over a constant table; thread-safe.
#include <string_view>

#include "vramledger/device_backend.h"

namespace vramledger {

std::string_view DriverCallName(DriverCall call) {
  switch (call) {
    case DriverCall::kMalloc:
      return "cudaMalloc";
    case DriverCall::kFree:
      return "cudaFree";
    case DriverCall::kAddressReserve:
      return "cuMemAddressReserve";
    case DriverCall::kAddressFree:
      return "cuMemAddressFree";
    case DriverCall::kMemCreate:
      return "cuMemCreate";
    case DriverCall::kMemRelease:
      return "cuMemRelease";
    case DriverCall::kMemMap:
      return "cuMemMap";
    case DriverCall::kMemUnmap:
      return "cuMemUnmap";
    case DriverCall::kMemSetAccess:
      return "cuMemSetAccess";
    case DriverCall::kEventCreate:
      return "cudaEventCreateWithFlags";
    case DriverCall::kEventRecord:
      return "cudaEventRecord";
    case DriverCall::kEventQuery:
      return "cudaEventQuery";
    case DriverCall::kEventSynchronize:
      return "cudaEventSynchronize";
    case DriverCall::kEventDestroy:
      return "cudaEventDestroy";
    case DriverCall::kStreamSynchronize:
      return "cudaStreamSynchronize";
    case DriverCall::kMemGetInfo:
      return "cudaMemGetInfo";
    case DriverCall::kCount:
      break;
  }
  return "unknown";
}

}  // namespace vramledger
