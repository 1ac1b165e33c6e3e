// Torch's size policy as constexpr functions: request rounding, pool choice and segment size.
// Source: c10/cuda/CUDACachingAllocator.cpp, round_size and get_allocation_size.
#ifndef VRAMLEDGER_CORE_SIZE_POLICY_H_
#define VRAMLEDGER_CORE_SIZE_POLICY_H_

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>

#include "vramledger/options.h"
#include "vramledger/types.h"

namespace vramledger::size_policy {

inline constexpr std::size_t kMinBlockSize = 512;         // every size rounds up to a multiple
inline constexpr std::size_t kSmallSize = 1 * kMiB;       // largest request of the small pool
inline constexpr std::size_t kSmallBuffer = 2 * kMiB;     // small-pool segment size
inline constexpr std::size_t kMinLargeAlloc = 10 * kMiB;  // from here segments fit the request
inline constexpr std::size_t kRoundLarge = 2 * kMiB;      // ... rounded up to this
inline constexpr std::size_t kRoundUpPowerOfTwoStart = 1 * kMiB;
/// Requests of this size or more fail at once (torch: "more than 1EB memory").
inline constexpr std::size_t kMaxRequest = std::size_t{1} << 60;

/// Index of the roundup_power2_divisions interval for `size`: [1 MiB, 2 MiB) -> 0, ... capped
/// at 15.
constexpr int PowerTwoInterval(std::size_t size) {
  const int log_size = 63 - std::countl_zero(static_cast<unsigned long long>(size | 1));
  const int start = 63 - std::countl_zero(static_cast<unsigned long long>(kRoundUpPowerOfTwoStart));
  const int index = log_size > start ? log_size - start : 0;
  return index < kRoundupPower2Intervals - 1 ? index : kRoundupPower2Intervals - 1;
}

/// Rounds `size` up to the next of `divisions` equal steps between two powers of two.
constexpr std::size_t RoundUpPowerTwoDivision(std::size_t size, std::size_t divisions) {
  if (std::has_single_bit(size)) return size;
  const std::size_t floor = std::bit_floor(size);
  const std::size_t step =
      floor >> (63 - std::countl_zero(static_cast<unsigned long long>(divisions)));
  if (step == 0) return floor << 1;
  const std::size_t rounded_floor = size & ~(step - 1);
  return rounded_floor == size ? size : rounded_floor + step;
}

/// The block size a request of `size` bytes gets (torch's round_size).
constexpr std::size_t RoundSize(
    std::size_t size, const std::array<std::size_t, kRoundupPower2Intervals>& divisions_table) {
  if (size < kMinBlockSize) return kMinBlockSize;
  const std::size_t divisions = divisions_table[PowerTwoInterval(size)];
  if (divisions > 1 && size > kMinBlockSize * divisions) {
    return RoundUpPowerTwoDivision(size, divisions);
  }
  return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
}

/// True when a rounded request is served by the small pool (1 MiB or less).
constexpr bool IsSmallRequest(std::size_t rounded_size) { return rounded_size <= kSmallSize; }

/// The segment size cudaMalloc'd for a rounded request (torch's get_allocation_size).
constexpr std::size_t AllocationSize(std::size_t rounded_size, std::size_t large_segment_size) {
  if (rounded_size <= kSmallSize) return kSmallBuffer;
  const std::size_t rounded_up = kRoundLarge * ((rounded_size + kRoundLarge - 1) / kRoundLarge);
  // Never below the request: large_segment_size_mb under 10 takes sizes from 2 MiB, and a
  // 4 MiB request in a 2 MiB segment would wrap the split's remainder around.
  if (rounded_size < kMinLargeAlloc) return std::max(large_segment_size, rounded_up);
  return rounded_up;
}

}  // namespace vramledger::size_policy

#endif  // VRAMLEDGER_CORE_SIZE_POLICY_H_
