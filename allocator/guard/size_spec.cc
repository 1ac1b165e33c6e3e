// Size parsing for plans: bytes, unit strings and fractions (see size_spec.h). Pure functions.
#include "guard/size_spec.h"

#include <cmath>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "vramledger/device_allocator.h"

namespace vramledger::guard {
namespace {

constexpr std::string_view kExpected =
    "bytes (an integer), a string such as \"40GiB\", \"512 MiB\", \"1.5TB\" or \"25%\", or a "
    "fraction of the card in (0, 1] such as 0.5";

struct Unit {
  std::string_view name;  // lower case
  double scale;
};

constexpr Unit kUnits[] = {
    {"tib", 1099511627776.0},
    {"gib", 1073741824.0},
    {"mib", 1048576.0},
    {"kib", 1024.0},
    {"tb", 1e12},
    {"gb", 1e9},
    {"mb", 1e6},
    {"kb", 1e3},
    {"b", 1.0},
};

inline absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::Status Bad(std::string_view got) {
  return absl::InvalidArgumentError(absl::StrCat("expected ", AV(kExpected), ", got ", AV(got)));
}

absl::StatusOr<SizeSpec> FromFraction(double f, std::string text) {
  if (!(f > 0.0 && f <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a fraction of the card must be in (0, 1], got ", text));
  }
  SizeSpec s;
  s.kind = SizeSpec::Kind::kFraction;
  s.fraction = f;
  s.text = std::move(text);
  return s;
}

}  // namespace

std::uint64_t SizeSpec::Resolve(std::uint64_t base_bytes) const {
  if (kind == Kind::kBytes) return bytes;
  return static_cast<std::uint64_t>(std::floor(fraction * static_cast<double>(base_bytes)));
}

absl::StatusOr<SizeSpec> ParseSizeString(std::string_view std_text) {
  const std::string original(std_text);
  std::string lower = absl::AsciiStrToLower(absl::StripAsciiWhitespace(original));
  if (lower.empty()) return Bad("\"\"");
  if (lower.back() == '%') {
    double pct = 0;
    std::string number(absl::StripAsciiWhitespace(lower.substr(0, lower.size() - 1)));
    if (!absl::SimpleAtod(number, &pct)) return Bad(absl::StrCat("\"", original, "\""));
    return FromFraction(pct / 100.0, original);
  }
  for (const Unit& unit : kUnits) {
    if (lower.size() <= unit.name.size() ||
        lower.compare(lower.size() - unit.name.size(), unit.name.size(), unit.name) != 0) {
      continue;
    }
    std::string number(
        absl::StripAsciiWhitespace(lower.substr(0, lower.size() - unit.name.size())));
    double value = 0;
    // Decimal only: SimpleAtod also reads "0x10", which made "0x10GiB" mean 16 GiB.
    if (number.empty() || absl::StrContains(number, 'x') || !absl::SimpleAtod(number, &value) ||
        !(value >= 0.0) || !std::isfinite(value) || value * unit.scale >= 1.8e19) {
      return Bad(absl::StrCat("\"", original, "\""));
    }
    if (unit.scale == 1.0 && value != std::floor(value)) {  // "1.5B": a typo for GB, not 2 bytes
      return absl::InvalidArgumentError(absl::StrCat(
          "\"", original, "\": a number of bytes (B) is whole; for gigabytes write GB or GiB"));
    }
    SizeSpec s;
    s.kind = SizeSpec::Kind::kBytes;
    s.bytes = static_cast<std::uint64_t>(std::llround(value * unit.scale));
    s.text = original;
    return s;
  }
  // A bare number in a string: bytes if integral, else a fraction.
  std::uint64_t integer = 0;
  if (absl::SimpleAtoi(lower, &integer)) {
    SizeSpec s;
    s.bytes = integer;
    s.text = original;
    return s;
  }
  double f = 0;
  if (absl::SimpleAtod(lower, &f)) return FromFraction(f, original);
  return Bad(absl::StrCat("\"", original, "\""));
}

absl::StatusOr<SizeSpec> ParseSize(const nlohmann::json& value) {
  if (value.is_number_unsigned() || value.is_number_integer()) {
    if (value.is_number_integer() && !value.is_number_unsigned() && value.get<std::int64_t>() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("a size cannot be negative, got ", value.dump()));
    }
    SizeSpec s;
    s.bytes = value.get<std::uint64_t>();
    s.text = value.dump();
    return s;
  }
  if (value.is_number_float()) return FromFraction(value.get<double>(), value.dump());
  if (value.is_string()) return ParseSizeString(value.get<std::string>());
  return Bad(value.dump());
}

std::string FormatBytes(std::uint64_t bytes) {
  if (bytes <= 1024) return FormatSize(bytes);  // already "N bytes"
  return absl::StrCat(FormatSize(bytes), " (", bytes, " bytes)");
}

}  // namespace vramledger::guard
