// Tag interning and the thread-local tag. The registry's mutex is taken only when a name is
// interned or looked up, never on the allocation path.
#include "guard/tags.h"

#include "absl/strings/str_cat.h"

namespace vramledger::guard {
namespace {

thread_local std::uint32_t t_thread_tag = kUntaggedTag;

}  // namespace

TagRegistry::TagRegistry() {
  absl::MutexLock lock(&mu_);
  ids_["untagged"] = kUntaggedTag;
  names_.push_back("untagged");
  count_.store(1, std::memory_order_release);
}

absl::StatusOr<std::uint32_t> TagRegistry::Intern(std::string_view name) {
  if (name.empty() || name.size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("a tag name must have 1 to 64 bytes, got ", name.size(), " bytes"));
  }
  absl::MutexLock lock(&mu_);
  const std::string key(name);
  if (auto it = ids_.find(key); it != ids_.end()) return it->second;
  if (names_.size() >= kMaxTags) {
    return absl::ResourceExhaustedError(
        absl::StrCat("too many distinct tags (", kMaxTags, "); cannot add '", key, "'"));
  }
  const auto id = static_cast<std::uint32_t>(names_.size());
  ids_.emplace(key, id);
  names_.push_back(key);
  count_.store(id + 1, std::memory_order_release);
  return id;
}

std::string TagRegistry::Name(std::uint32_t id) const {
  absl::MutexLock lock(&mu_);
  if (id < names_.size()) return names_[id];
  return absl::StrCat("tag#", id);
}

std::uint32_t SetThreadTag(std::uint32_t id) {
  const std::uint32_t previous = t_thread_tag;
  t_thread_tag = id;
  return previous;
}

std::uint32_t ThreadTag() { return t_thread_tag; }

}  // namespace vramledger::guard
