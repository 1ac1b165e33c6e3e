// Fuzz target: the trace reader and the replay (tools/replay). The input is a trace file, plain or
// gzip: read from a memory file, it parses or is refused with InvalidArgument or DataLoss naming
// the file (valid UTF-8 whatever the bytes); plain text reads the same from memory and from the
// file; parsed events replay on a small simulated card to a result or an error naming the file.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "fuzz_check.h"
#include "replay/replay.h"
#include "replay/trace_reader.h"

namespace {

// The input as a file: a memory file behind /proc/self/fd, so no disk is touched.
class MemoryFile {
 public:
  MemoryFile(const std::uint8_t* data, std::size_t size) {
    fd_ = memfd_create("trace", 0);
    vramledger::fuzz::Check(fd_ >= 0, "memfd_create failed");
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = write(fd_, data + done, size - done);
      vramledger::fuzz::Check(n > 0, "write to the memory file failed");
      done += static_cast<std::size_t>(n);
    }
  }
  ~MemoryFile() { close(fd_); }
  std::string path() const { return absl::StrCat("/proc/self/fd/", fd_); }

 private:
  int fd_ = -1;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace vramledger;
  using fuzz::Check;
  const MemoryFile file(data, size);
  const std::string path = file.path();
  const absl::StatusOr<std::vector<TraceEvent>> events = ReadTraceFile(path);
  const bool gzip = size >= 2 && data[0] == 0x1f && data[1] == 0x8b;
  if (!gzip) {
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    const absl::StatusOr<std::vector<TraceEvent>> same = ParseTraceEvents(text, path);
    Check(same.ok() == events.ok(), "the file and the text readers disagree on success");
    if (same.ok()) {
      Check(same->size() == events->size(), "the file and text readers read different events");
      for (std::size_t i = 0; i < same->size(); ++i) {
        const TraceEvent& a = (*same)[i];
        const TraceEvent& b = (*events)[i];
        Check(a.action == b.action && a.addr == b.addr && a.size == b.size &&
                  a.stream == b.stream && a.time_us == b.time_us && a.line == b.line,
              absl::StrCat("event ", i, " differs between the file and text readers"));
      }
    } else {
      Check(same.status() == events.status(),
            absl::StrCat("different errors: ", same.status().ToString(), " / ",
                         events.status().ToString()));
    }
  }
  if (!events.ok()) {
    const absl::Status& s = events.status();
    Check(s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kDataLoss,
          s.ToString());
    Check(absl::StartsWith(s.message(), path),
          "the message does not name the file: " + std::string(s.message()));
    Check(fuzz::IsUtf8(std::string(s.message())),
          "the message is not UTF-8: " + std::string(s.message()));
    return 0;
  }
  if (events->size() > 4096) return 0;  // a long replay says nothing more per second
  ReplayConfig config;
  config.capacity_bytes = 4 * kGiB;
  config.source = "fuzz.csv";
  config.timeline = true;
  config.gpu_lag_us = size % 2 == 0 ? 0 : 100;
  const absl::StatusOr<ReplayResult> result = Replay(*events, Options(), config);
  if (!result.ok()) {
    Check(absl::StartsWith(result.status().message(), "fuzz.csv:"),
          "a replay error without its line: " + result.status().ToString());
    Check(fuzz::IsUtf8(std::string(result.status().message())),
          "the replay's message is not UTF-8");
  }
  return 0;
}
