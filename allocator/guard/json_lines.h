// Line numbers of the values in a JSON text, keyed by their path ("devices/1/limit"), so that a
// plan error can name the line nlohmann's DOM does not keep. Pure functions; thread-safe.
#ifndef VRAMLEDGER_GUARD_JSON_LINES_H_
#define VRAMLEDGER_GUARD_JSON_LINES_H_

#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <utility>

namespace vramledger::guard {

/// Maps the slash-joined path of every value in a JSON text to the 1-based line where it
/// appears: for an object member, the line of its key; for an array element or the root, the line
/// where the value starts. Keys are used as written (escape sequences are kept, not decoded).
class JsonLineIndex {
 public:
  /// Indexes `text`, which should be valid JSON (parse it first); on malformed input the walk
  /// stops early and the index holds what it saw.
  explicit JsonLineIndex(std::string_view text);

  /// Line of `path` ("" is the root, "devices/1/limit" a nested member, "categories/0" an
  /// element). An unknown path falls back to its nearest indexed ancestor; 1 if none.
  int LineOf(std::string_view path) const;

  /// The first member whose key appears twice in one object, as {path, line of its second
  /// appearance}; {"", 0} if none. (JSON parsers keep one of the two values silently.)
  const std::pair<std::string, int>& first_duplicate() const { return first_duplicate_; }

 private:
  std::map<std::string, int, std::less<>> lines_;
  std::pair<std::string, int> first_duplicate_{"", 0};
};

/// 1-based line of byte `offset` in `text` (offsets past the end give the last line).
int LineOfOffset(std::string_view text, std::size_t offset);

}  // namespace vramledger::guard

#endif  // VRAMLEDGER_GUARD_JSON_LINES_H_
