// The "did you mean" of the option and plan parsers (nearest_name.h).
#include "core/nearest_name.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace vramledger {

std::size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string NearestName(absl::string_view typed, const std::vector<std::string>& names) {
  const std::string lower = absl::AsciiStrToLower(typed);
  std::size_t best_distance = std::max<std::size_t>(2, typed.size() / 4) + 1;
  std::string best;
  for (const std::string& name : names) {
    const std::size_t d = EditDistance(lower, name);
    if (d < best_distance) {
      best_distance = d;
      best = name;
    }
  }
  return best;
}

std::string DidYouMean(absl::string_view typed, const std::vector<std::string>& names) {
  const std::string nearest = NearestName(typed, names);
  return nearest.empty() ? "" : absl::StrCat(" (did you mean '", nearest, "'?)");
}

}  // namespace vramledger
