// Fuzz target: the settings string parser (core/options.cc; PYTORCH_CUDA_ALLOC_CONF syntax). A
// string is accepted or refused with InvalidArgument and a message (valid UTF-8 when the input
// is); an accepted one writes back (OptionsToString) to a string that parses to the same
// settings, and an allocator built from it serves and frees a few requests with its invariants.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "device/sim_backend.h"
#include "fuzz_check.h"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace vramledger;
  using fuzz::Check;
  const std::string conf(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<Options> parsed = ParseOptions(conf);
  if (!parsed.ok()) {
    Check(parsed.status().code() == absl::StatusCode::kInvalidArgument,
          absl::StrCat("'", conf, "': ", parsed.status().ToString()));
    Check(!parsed.status().message().empty(), "an error without a message");
    Check(!fuzz::IsUtf8(conf) || fuzz::IsUtf8(std::string(parsed.status().message())),
          absl::StrCat("the message for valid UTF-8 input is not UTF-8: ",
                       parsed.status().message()));
    return 0;
  }
  const std::string written = OptionsToString(*parsed);
  const absl::StatusOr<Options> again = ParseOptions(written);
  Check(again.ok(), absl::StrCat("'", conf, "' writes back as '", written,
                                 "', which does not parse: ", again.status().ToString()));
  Check(OptionsToString(*again) == written,
        absl::StrCat("'", written, "' reads back as '", OptionsToString(*again), "'"));

  SimBackend::Config config;
  config.capacity = 2 * kGiB;
  SimBackend sim(config);
  {
    DeviceAllocator alloc(*parsed, &sim);
    DevicePtr live[4] = {};
    const std::size_t sizes[4] = {1, 3 * kMiB + 7, 25 * kMiB, 700 * kMiB};
    for (int i = 0; i < 4; ++i) {
      auto p = alloc.Malloc(sizes[i], static_cast<StreamId>(i % 2));
      Check(p.ok() || p.status().code() == absl::StatusCode::kResourceExhausted,
            absl::StrCat("'", conf, "': malloc: ", p.status().ToString()));
      if (p.ok()) live[i] = *p;
      Check(alloc.CheckInvariants().ok(),
            absl::StrCat("'", conf, "': ", alloc.CheckInvariants().ToString()));
    }
    for (DevicePtr p : live) Check(alloc.Free(p).ok(), "free");
    Check(alloc.EmptyCache().ok(), "empty_cache");
    Check(alloc.GetStats().reserved_bytes[kAggregate].current == 0,
          absl::StrCat("'", conf, "': reserved after empty_cache"));
  }
  Check(sim.used_bytes() == 0, absl::StrCat("'", conf, "': leaked device memory"));
  return 0;
}
