// One entry of an option table: its documentation, how to parse and store its value into the
// struct it belongs to, and how to write it back. Immutable after construction; thread-safe.
#ifndef VRAMLEDGER_CORE_OPTION_FIELD_H_
#define VRAMLEDGER_CORE_OPTION_FIELD_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "vramledger/options.h"

namespace vramledger {

/// An option of the settings struct `S` (Options or ProcessOptions).
template <typename S>
struct OptionField {
  OptionDoc doc;
  /// Parses `value` and stores it into `*out`; `*out` is unchanged on an error, which is
  /// InvalidArgument naming the key, the value and the accepted values.
  std::function<absl::Status(absl::string_view value, S* out)> set;
  /// The value as a settings string writes it; nullopt = left out of OptionsToString.
  std::function<std::optional<std::string>(const S& in)> get;
};

/// The device allocator's keys (torch's first, then vramledger's), in the order errors list them.
const std::vector<OptionField<Options>>& AllocatorOptionFields();

/// The process's keys (plan, forensics, step log, the LD_PRELOAD shim's switches).
const std::vector<OptionField<ProcessOptions>>& ProcessOptionFields();

/// InvalidArgument "bad value 'VALUE' for option 'KEY': expected EXPECTED".
absl::Status BadOptionValue(absl::string_view key, absl::string_view value,
                            absl::string_view expected);

}  // namespace vramledger

#endif  // VRAMLEDGER_CORE_OPTION_FIELD_H_
