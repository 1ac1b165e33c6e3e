// torch's CUDA IPC handle bytes: encoding and a checked decoding (docs/design/ipc.md).
// Pure functions; thread-safe.
#include "core/ipc_format.h"

#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace vramledger::core {
namespace {

// torch's ShareHeader as the x86-64 compiler lays it out: pid_t, 4 bytes of padding (written as
// zeros, so that equal shares are equal strings), size_t, size_t.
struct ShareHeader {
  std::int32_t pid;
  std::int32_t padding;
  std::uint64_t segment_size;
  std::uint64_t num_handles;
};
static_assert(sizeof(ShareHeader) == 24);
constexpr std::size_t kFabricHandleBytes = 64;  // a CUmemFabricHandle

absl::Status Bad(std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("vramledger: malformed CUDA IPC handle: ", std::string(what)));
}

}  // namespace

std::string EncodeIpcHandle(const IpcHandle& handle) {
  std::string out;
  out.push_back(kIpcHandleVersion);
  if (!handle.pages) {
    out.push_back(kIpcKindMalloc);
    out.append(reinterpret_cast<const char*>(handle.malloc.data()), handle.malloc.size());
    return out;
  }
  out.push_back(kIpcKindPages);
  const ShareHeader header{handle.pid, 0, handle.page_size, handle.fds.size()};
  out.append(reinterpret_cast<const char*>(&header), sizeof(header));
  for (const std::int32_t fd : handle.fds) {
    out.append(reinterpret_cast<const char*>(&fd), sizeof(fd));
  }
  return out;
}

absl::StatusOr<IpcHandle> ParseIpcHandle(std::string_view bytes) {
  IpcHandle handle;
  if (bytes.size() == handle.malloc.size()) {  // older torch: the bare cudaIpcMemHandle_t
    std::memcpy(handle.malloc.data(), bytes.data(), bytes.size());
    return handle;
  }
  if (bytes.size() < 2) {
    return Bad(absl::StrFormat("%d bytes, too short for a version and a kind", bytes.size()));
  }
  if (static_cast<signed char>(bytes[0]) > kIpcHandleVersion) {
    return absl::InvalidArgumentError(
        "received sharable handle from a future version of torch that this version does not "
        "know how to handle");
  }
  const char kind = bytes[1];
  std::string_view body = bytes.substr(2);
  if (kind == kIpcKindMalloc) {
    if (body.size() != handle.malloc.size()) {
      return Bad(absl::StrFormat("a cudaMalloc handle ('c') has %d bytes after its kind, not %d",
                                 body.size(), handle.malloc.size()));
    }
    std::memcpy(handle.malloc.data(), body.data(), body.size());
    return handle;
  }
  if (kind != kIpcKindPages) {
    return Bad(
        absl::StrFormat("unexpected or illformed shareable handle type %#x (expected 'c' "
                        "for cudaMalloc memory or 'e' for expandable segments)",
                        static_cast<unsigned char>(kind)));
  }
  ShareHeader header{};
  if (body.size() < sizeof(header)) {
    return Bad(
        absl::StrFormat("an expandable-segment handle ('e') has %d bytes, less than its "
                        "%d-byte header",
                        body.size(), sizeof(header)));
  }
  std::memcpy(&header, body.data(), sizeof(header));
  body.remove_prefix(sizeof(header));
  if (header.segment_size == 0 || header.num_handles == 0 || header.pid <= 0) {
    return Bad(
        absl::StrFormat("expandable-segment header with pid %d, segment_size %d and "
                        "num_handles %d (each must be positive)",
                        header.pid, header.segment_size, header.num_handles));
  }
  if (header.num_handles <= body.size() / kFabricHandleBytes &&
      body.size() == header.num_handles * kFabricHandleBytes &&
      body.size() != header.num_handles * sizeof(std::int32_t)) {
    return absl::InvalidArgumentError(
        "vramledger: this CUDA IPC handle shares expandable-segment pages as fabric handles "
        "(the sender's torch uses CU_MEM_HANDLE_TYPE_FABRIC); vramledger imports POSIX file "
        "descriptor handles only");
  }
  if (header.num_handles > body.size() / sizeof(std::int32_t) ||
      body.size() != header.num_handles * sizeof(std::int32_t)) {
    return Bad(
        absl::StrFormat("the header lists %d handles but %d bytes of descriptors follow "
                        "(%d bytes each)",
                        header.num_handles, body.size(), sizeof(std::int32_t)));
  }
  handle.pages = true;
  handle.pid = header.pid;
  handle.page_size = header.segment_size;
  handle.fds.resize(header.num_handles);
  std::memcpy(handle.fds.data(), body.data(), body.size());
  return handle;
}

}  // namespace vramledger::core
