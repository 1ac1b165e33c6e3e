// The receiver's side of CUDA IPC: memory another process shared, opened once per handle and
// closed when the last reference goes, as torch's getIpcDevPtr cache does (docs/design/ipc.md).
// Thread-safe: its own mutex, never the allocator's (opened memory is not the allocator's).
#ifndef VRAMLEDGER_CORE_IPC_IMPORTS_H_
#define VRAMLEDGER_CORE_IPC_IMPORTS_H_

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "vramledger/device_backend.h"

namespace vramledger::core {

class IpcImports {
 public:
  /// `backend` is borrowed and must outlive this object.
  explicit IpcImports(DeviceBackend* backend);
  /// Closes what is still open; a reference that outlives this object then points at nothing.
  ~IpcImports();
  IpcImports(const IpcImports&) = delete;
  IpcImports& operator=(const IpcImports&) = delete;

  /// The base of the memory `handle` (torch's bytes, ipc_format.h) names, mapped here: opened
  /// on first use (cudaIpcOpenMemHandle; or the pages imported, reserved, mapped and given
  /// access), shared while any reference lives, closed when the last one goes (imported pages
  /// after a device synchronize). Errors: the handle's own (ParseIpcHandle), the backend's.
  absl::StatusOr<std::shared_ptr<void>> Open(std::string_view handle);

  /// Handles open now.
  std::size_t open_count() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_IPC_IMPORTS_H_
