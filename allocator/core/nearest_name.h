// The "did you mean" of the option and plan parsers: the accepted name nearest to a mistyped
// one. Pure functions; thread-safe.
#ifndef VRAMLEDGER_CORE_NEAREST_NAME_H_
#define VRAMLEDGER_CORE_NEAREST_NAME_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace vramledger {

/// Edits (insert, delete or substitute one character) that turn `a` into `b`: Levenshtein's
/// distance. O(|a| x |b|) time.
std::size_t EditDistance(absl::string_view a, absl::string_view b);

/// The name of `names` nearest to `typed` (compared in lower case), or "" when none is within
/// max(2, |typed| / 4) edits. Ties go to the first such name.
std::string NearestName(absl::string_view typed, const std::vector<std::string>& names);

/// " (did you mean 'NAME'?)" for NearestName's answer, or "" when there is none.
std::string DidYouMean(absl::string_view typed, const std::vector<std::string>& names);

}  // namespace vramledger

#endif  // VRAMLEDGER_CORE_NEAREST_NAME_H_
