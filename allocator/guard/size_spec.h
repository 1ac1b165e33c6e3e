// Sizes as a plan writes them: integer bytes, "40GiB" / "512 MB" strings, "25%" or a fraction of
// the card (0.5). Pure value types and functions; thread-safe.
#ifndef VRAMLEDGER_GUARD_SIZE_SPEC_H_
#define VRAMLEDGER_GUARD_SIZE_SPEC_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace vramledger::guard {

/// A size as written in a plan: absolute bytes, or a fraction of something resolved later
/// (the card's total memory for limits, the enforced limit for warn_at).
struct SizeSpec {
  enum class Kind { kBytes, kFraction };
  Kind kind = Kind::kBytes;
  std::uint64_t bytes = 0;  // kBytes
  double fraction = 0.0;    // kFraction, in (0, 1]
  std::string text;         // as written, for messages ("40GiB", "0.5", "25%", "1073741824")

  /// Bytes for a base of `base_bytes` (a fraction is rounded down to whole bytes).
  std::uint64_t Resolve(std::uint64_t base_bytes) const;
};

/// Parses a JSON value as a size. Accepted:
///   - a JSON integer >= 0: bytes;
///   - a JSON float in (0, 1]: a fraction (1.0 is the whole base);
///   - a string: a number with a unit, case-insensitive, optional space: B, KiB, MiB, GiB, TiB
///     (powers of 1024), KB, MB, GB, TB (powers of 1000), e.g. "40GiB", "1.5 TB"; or a
///     percentage "25%" (a fraction, in (0, 100]).
/// Errors: InvalidArgument whose message says what was expected (no file or line: the caller
/// adds them).
absl::StatusOr<SizeSpec> ParseSize(const nlohmann::json& value);

/// The string form of ParseSize.
absl::StatusOr<SizeSpec> ParseSizeString(std::string_view text);

/// "40.00 GiB (42949672960 bytes)": human-readable size followed by exact bytes ("N bytes" up to
/// 1 KiB).
std::string FormatBytes(std::uint64_t bytes);

}  // namespace vramledger::guard

#endif  // VRAMLEDGER_GUARD_SIZE_SPEC_H_
