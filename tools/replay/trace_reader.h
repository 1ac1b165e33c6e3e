// Reads allocation traces: the CSV `action,addr,size,stream,time_us` (plain or gzip) that
// traces/ bundles, into TraceEvents with their source line numbers. Stateless, thread-safe.
#ifndef VRAMLEDGER_TOOLS_REPLAY_TRACE_READER_H_
#define VRAMLEDGER_TOOLS_REPLAY_TRACE_READER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "vramledger/hooks.h"
#include "vramledger/types.h"

namespace vramledger {

// TraceAction, TraceActionName and ParseTraceAction come from the core (vramledger/hooks.h).

/// One entry of a recorded trace (the allocator's own live entries are TraceEntry, hooks.h).
/// Sizes in bytes; for alloc/free events `size` is the requested size, for
/// segment events the segment (or mapped range) size.
struct TraceEvent {
  TraceAction action = TraceAction::kAlloc;
  DevicePtr addr = 0;
  std::size_t size = 0;
  StreamId stream = 0;       // cudaStream_t as an integer, as torch records it
  std::int64_t time_us = 0;  // epoch microseconds
  int line = 0;              // line in the source (the header is line 1), or 1-based entry index
};

/// The header line every trace CSV starts with.
inline constexpr std::string_view kTraceHeader = "action,addr,size,stream,time_us";

/// Parses the text of a trace CSV (header line first; blank lines and a trailing '\r' are
/// ignored). `source` names the text in errors.
/// Errors: InvalidArgument "SOURCE:LINE: what was wrong (the line's text)", e.g.
///   "t.csv:7: unknown action 'allocate' (allocate,1,2,0,3)".
absl::StatusOr<std::vector<TraceEvent>> ParseTraceEvents(std::string_view text,
                                                         std::string_view source = "<string>");

/// Reads a trace CSV from `path`, plain or gzip-compressed (detected from the content).
/// Errors: NotFound / PermissionDenied "PATH: cannot open: REASON"; DataLoss for a corrupt
/// gzip stream; InvalidArgument as ParseTraceEvents for malformed lines.
absl::StatusOr<std::vector<TraceEvent>> ReadTraceFile(const std::string& path);

}  // namespace vramledger

#endif  // VRAMLEDGER_TOOLS_REPLAY_TRACE_READER_H_
