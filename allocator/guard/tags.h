// Tags: names interned to small ids (0 = "untagged"), the calling thread's tag and the
// process-wide phase. Thread-safety: the registry locks on Intern/Name; tag reads are lock-free.
#ifndef VRAMLEDGER_GUARD_TAGS_H_
#define VRAMLEDGER_GUARD_TAGS_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace vramledger::guard {

/// The id of bytes allocated outside any tag or phase.
inline constexpr std::uint32_t kUntaggedTag = 0;
/// Ids are below this; per-tag counters are arrays of this size.
inline constexpr std::uint32_t kMaxTags = 1024;

/// Interns tag names to ids and holds the phase. One per process in the plugin; tests make
/// their own. Id 0 is "untagged"; ids are dense and never reused.
class TagRegistry {
 public:
  TagRegistry();
  TagRegistry(const TagRegistry&) = delete;
  TagRegistry& operator=(const TagRegistry&) = delete;

  /// The id of `name`, interning it on first use. InvalidArgument for an empty name or one over
  /// 64 bytes; ResourceExhausted once kMaxTags names exist. "untagged" is 0.
  absl::StatusOr<std::uint32_t> Intern(std::string_view name) ABSL_LOCKS_EXCLUDED(mu_);

  /// The name of `id`; "tag#<id>" for an id never issued.
  std::string Name(std::uint32_t id) const ABSL_LOCKS_EXCLUDED(mu_);

  /// Number of ids issued (including 0).
  std::uint32_t size() const { return count_.load(std::memory_order_acquire); }

  /// Sets the process-wide phase (the tag of threads that set none); returns the previous one.
  std::uint32_t SetPhase(std::uint32_t id) {
    return phase_.exchange(id, std::memory_order_relaxed);
  }
  std::uint32_t phase() const { return phase_.load(std::memory_order_relaxed); }

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::uint32_t> ids_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> names_ ABSL_GUARDED_BY(mu_);
  std::atomic<std::uint32_t> count_{0};
  std::atomic<std::uint32_t> phase_{kUntaggedTag};
};

/// Sets the calling thread's tag id (0 = none, the phase applies); returns the previous one.
std::uint32_t SetThreadTag(std::uint32_t id);
/// The calling thread's tag id (0 when none is set).
std::uint32_t ThreadTag();

/// The tag an allocation on this thread gets: the thread's tag if set, else the phase.
inline std::uint32_t EffectiveTag(const TagRegistry& tags) {
  const std::uint32_t own = ThreadTag();
  return own != kUntaggedTag ? own : tags.phase();
}

/// Sets the thread's tag for a scope and restores the previous one (C++ callers).
class ScopedThreadTag {
 public:
  explicit ScopedThreadTag(std::uint32_t id) : previous_(SetThreadTag(id)) {}
  ~ScopedThreadTag() { SetThreadTag(previous_); }
  ScopedThreadTag(const ScopedThreadTag&) = delete;
  ScopedThreadTag& operator=(const ScopedThreadTag&) = delete;

 private:
  std::uint32_t previous_;
};

}  // namespace vramledger::guard

#endif  // VRAMLEDGER_GUARD_TAGS_H_
