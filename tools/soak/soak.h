// The soak: a long seeded sequence of allocator operations on SimBackend, two devices at once
// (expandable segments on one, torch's plain segments on the other), with the allocator's
// invariants and a shadow model of the live blocks checked at a fixed period and at the end.
// Single-threaded; one Soak per run.
#ifndef VRAMLEDGER_TOOLS_SOAK_SOAK_H_
#define VRAMLEDGER_TOOLS_SOAK_SOAK_H_

#include <cstdint>
#include <string>
#include <vector>

namespace vramledger::soak {

struct SoakConfig {
  std::int64_t ops = 10'000'000;  // operations to run (each one allocator or backend call)
  std::uint64_t seed = 1;
  std::int64_t check_every = 1000;          // operations between two full checks
  std::size_t capacity = 4ull << 30;        // bytes of each simulated card
  std::size_t max_violations_kept = 20;     // messages kept for the report
};

struct SoakResult {
  std::int64_t ops = 0;
  std::int64_t mallocs = 0;
  std::int64_t frees = 0;
  std::int64_t record_streams = 0;
  std::int64_t event_completions = 0;
  std::int64_t empty_caches = 0;
  std::int64_t pool_entries = 0;  // private pools allocated to
  std::int64_t ooms = 0;          // allocations refused as out of memory (expected under load)
  std::int64_t checks = 0;        // full checks made (each over both devices)
  std::int64_t violations = 0;
  std::int64_t peak_reserved = 0;  // bytes, the larger device's
  double wall_seconds = 0;
  std::vector<std::string> messages;  // the first violations, in order
};

/// Runs the soak. Never throws; every broken invariant is counted in violations.
SoakResult RunSoak(const SoakConfig& config);

}  // namespace vramledger::soak

#endif  // VRAMLEDGER_TOOLS_SOAK_SOAK_H_
