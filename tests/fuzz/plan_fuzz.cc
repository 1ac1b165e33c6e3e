// Fuzz target: the plan-file parser (guard/plan.cc). The first byte picks the device count;
// the rest is the file. A plan is accepted or refused with InvalidArgument naming the file (valid
// UTF-8 when the input is); an accepted plan resolves against cards of several sizes to a budget
// whose cap lies within the card, or is refused with InvalidArgument naming the file.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "fuzz_check.h"
#include "guard/plan.h"
#include "vramledger/types.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace vramledger;
  using fuzz::Check;
  fuzz::ByteReader in(data, size);
  const int device_count = in.Byte() % 5;
  const std::string_view text = in.Rest();
  const absl::StatusOr<guard::Plan> plan = guard::ParsePlan(text, "plan.json", device_count);
  auto check_error = [&](const absl::Status& s, const std::string& what) {
    Check(s.code() == absl::StatusCode::kInvalidArgument, what + ": " + s.ToString());
    Check(absl::StartsWith(s.message(), "plan.json"),
          absl::StrCat(what, ": the message does not name the file: ", s.message()));
    Check(!fuzz::IsUtf8(text) || fuzz::IsUtf8(std::string(s.message())),
          absl::StrCat(what, ": the message for valid UTF-8 input is not UTF-8: ", s.message()));
  };
  if (!plan.ok()) {
    check_error(plan.status(), "parse");
    return 0;
  }
  for (const std::uint64_t card :
       {std::uint64_t{1}, 80 * kGiB, std::uint64_t{150109880320}, std::uint64_t{1} << 62}) {
    for (int device = 0; device < (device_count > 0 ? device_count : 2); ++device) {
      const absl::StatusOr<guard::DeviceBudget> budget = guard::ResolvePlan(*plan, device, card);
      if (!budget.ok()) {
        check_error(budget.status(), absl::StrCat("resolve on ", card));
        continue;
      }
      Check(budget->limit <= card, absl::StrCat("limit ", budget->limit, " > card ", card));
      Check(budget->headroom <= budget->limit, "headroom above the limit");
      Check(budget->cap() <= card, "cap above the card");
      Check(budget->warn_bytes <= budget->cap() || budget->warn_bytes == 0,
            absl::StrCat("warn_at ", budget->warn_bytes, " above the cap ", budget->cap()));
      for (const auto& c : budget->categories) {
        Check(c.bytes <= card, absl::StrCat("category limit ", c.bytes, " > card ", card));
      }
    }
  }
  return 0;
}
