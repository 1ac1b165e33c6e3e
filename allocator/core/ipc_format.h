// torch's CUDA IPC handle bytes (the `handle` of its ShareableHandle): written by the sender's
// shareIpcHandle, read by the receiver's getIpcDevPtr, so either side may be torch
// (docs/design/ipc.md). Pure functions; thread-safe.
#ifndef VRAMLEDGER_CORE_IPC_FORMAT_H_
#define VRAMLEDGER_CORE_IPC_FORMAT_H_

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "vramledger/device_backend.h"

namespace vramledger::core {

/// The format version torch 2.11 writes first; a newer one is refused as torch refuses it.
inline constexpr char kIpcHandleVersion = 2;
/// The kind byte after it: cudaMalloc'd memory, or pages of an expandable segment.
inline constexpr char kIpcKindMalloc = 'c';
inline constexpr char kIpcKindPages = 'e';

/// One handle, decoded.
struct IpcHandle {
  bool pages = false;         // false: `malloc`; true: the fields below
  IpcMemHandle malloc{};      // the cudaIpcMemHandle_t of the segment's base
  int pid = 0;                // the exporting process
  std::size_t page_size = 0;  // bytes of each physical handle (torch's segment_size)
  std::vector<int> fds;       // the exporter's descriptor of each handle, in address order
};

/// torch's bytes: version, kind, then the 64-byte cudaIpcMemHandle_t, or the header
/// {pid (int32, 4 zero bytes), segment_size (uint64), num_handles (uint64)} and one int32
/// descriptor per handle.
std::string EncodeIpcHandle(const IpcHandle& handle);

/// Decodes torch's bytes, also the bare 64-byte cudaIpcMemHandle_t of older torch versions.
/// InvalidArgument naming what is wrong: a future version (torch's message), an unknown kind,
/// a length that does not match its header, a zero page size or handle count, or expandable
/// pages shared as fabric handles (which vramledger does not import).
absl::StatusOr<IpcHandle> ParseIpcHandle(std::string_view bytes);

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_IPC_FORMAT_H_
