// Basic value types shared by every layer: device addresses, stream and event ids, size units.
// Plain values; no state, thread-safe by construction.
#ifndef VRAMLEDGER_TYPES_H_
#define VRAMLEDGER_TYPES_H_

#include <cstddef>
#include <cstdint>

namespace vramledger {

/// A device virtual address (what cudaMalloc returns), as an integer. 0 is "no address".
using DevicePtr = std::uintptr_t;
/// A CUDA stream (`cudaStream_t` cast to an integer). 0 is the legacy default stream.
using StreamId = std::uintptr_t;
/// An event handle issued by a DeviceBackend (`cudaEvent_t` cast to an integer for CUDA).
using EventId = std::uintptr_t;
/// A physical memory handle issued by a DeviceBackend (`CUmemGenericAllocationHandle` for CUDA).
using PhysicalHandle = std::uint64_t;

inline constexpr std::size_t kKiB = std::size_t{1} << 10;
inline constexpr std::size_t kMiB = std::size_t{1} << 20;
inline constexpr std::size_t kGiB = std::size_t{1} << 30;

}  // namespace vramledger

#endif  // VRAMLEDGER_TYPES_H_
