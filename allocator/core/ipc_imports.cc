// IpcImports: opening, caching and closing memory other processes shared (docs/design/ipc.md).
// Thread-safe: State::mu guards the cache; driver calls of a close run outside it.
#include "core/ipc_imports.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "core/ipc_format.h"

namespace vramledger::core {
namespace {

// One opened handle: cudaIpcOpenMemHandle's address, or a reservation with imported pages.
struct Opened {
  DevicePtr base = 0;
  bool pages = false;
  std::size_t page_size = 0;
  std::vector<PhysicalHandle> handles;  // pages only, in address order
  std::weak_ptr<void> ref;              // the references handed out
  std::uint64_t id = 0;                 // which opening of the handle this is
};

// Unmaps and releases everything `o` holds. The first error is returned; the rest still run.
absl::Status Close(DeviceBackend* backend, const Opened& o) {
  if (!o.pages) return backend->CloseMalloc(o.base);
  // The work that read or wrote the pages may be on any stream of this process.
  absl::Status status = backend->SynchronizeDevice();
  const std::size_t bytes = o.page_size * o.handles.size();
  status.Update(backend->Unmap(o.base, bytes));
  for (PhysicalHandle h : o.handles) status.Update(backend->ReleasePhysical(h));
  status.Update(backend->ReleaseAddress(o.base, bytes));
  return status;
}

// Imports `h`'s pages and maps them in a reservation of their own. Nothing is left on failure.
absl::StatusOr<Opened> OpenPages(DeviceBackend* backend, const IpcHandle& h) {
  Opened o;
  o.pages = true;
  o.page_size = h.page_size;
  if (h.page_size % backend->Granularity() != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "vramledger: CUDA IPC handle: segment_size %d is not a multiple of the device's "
        "granularity %d",
        h.page_size, backend->Granularity()));
  }
  if (absl::Status s = backend->ImportPhysical(h.pid, h.fds, &o.handles); !s.ok()) return s;
  const std::size_t bytes = h.page_size * o.handles.size();
  absl::Status s = backend->ReserveAddress(bytes, &o.base);
  std::size_t mapped = 0;
  for (; s.ok() && mapped < o.handles.size(); ++mapped) {
    s = backend->Map(o.base + mapped * h.page_size, h.page_size, o.handles[mapped]);
    if (!s.ok()) break;
  }
  if (s.ok()) s = backend->SetAccess(o.base, bytes);
  if (s.ok()) return o;
  if (mapped > 0) (void)backend->Unmap(o.base, mapped * h.page_size);
  for (PhysicalHandle handle : o.handles) (void)backend->ReleasePhysical(handle);
  if (o.base != 0) (void)backend->ReleaseAddress(o.base, bytes);
  return s;
}

}  // namespace

struct IpcImports::State {
  explicit State(DeviceBackend* b) : backend(b) {}
  DeviceBackend* const backend;
  mutable absl::Mutex mu;
  absl::flat_hash_map<std::string, Opened> opened ABSL_GUARDED_BY(mu);
  std::uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
};

IpcImports::IpcImports(DeviceBackend* backend) : state_(std::make_shared<State>(backend)) {}

IpcImports::~IpcImports() {
  absl::flat_hash_map<std::string, Opened> left;
  {
    absl::MutexLock lock(&state_->mu);
    left.swap(state_->opened);
  }
  for (const auto& [key, o] : left) (void)Close(state_->backend, o);
}

absl::StatusOr<std::shared_ptr<void>> IpcImports::Open(std::string_view handle) {
  absl::StatusOr<IpcHandle> parsed = ParseIpcHandle(handle);
  if (!parsed.ok()) return parsed.status();
  std::string key(handle);
  // One open at a time, as torch's getIpcDevPtr: two threads opening one handle map it once.
  absl::MutexLock lock(&state_->mu);
  if (auto it = state_->opened.find(key); it != state_->opened.end()) {
    if (std::shared_ptr<void> ref = it->second.ref.lock()) return ref;
    // Its last reference is going on another thread, whose deleter has not taken it out yet:
    // closed here (that deleter then finds another opening and leaves it), opened afresh below.
    (void)Close(state_->backend, it->second);
    state_->opened.erase(it);
  }
  Opened o;
  if (parsed->pages) {
    absl::StatusOr<Opened> pages = OpenPages(state_->backend, *parsed);
    if (!pages.ok()) return pages.status();
    o = *std::move(pages);
  } else if (absl::Status s = state_->backend->OpenMalloc(parsed->malloc, &o.base); !s.ok()) {
    return s;
  }
  // The last reference closes the handle, outside the cache's lock (a close synchronizes the
  // device); after the cache itself is gone (allocator destroyed) it has nothing left to do.
  o.id = state_->next_id++;
  std::weak_ptr<State> weak = state_;
  std::shared_ptr<void> ref(reinterpret_cast<void*>(o.base), [weak, key, id = o.id](void*) {
    std::shared_ptr<State> state = weak.lock();
    if (state == nullptr) return;
    Opened closing;
    {
      absl::MutexLock lock(&state->mu);
      auto it = state->opened.find(key);
      if (it == state->opened.end() || it->second.id != id) return;
      closing = std::move(it->second);
      state->opened.erase(it);
    }
    (void)Close(state->backend, closing);  // a deleter cannot report; the memory is gone anyway
  });
  o.ref = ref;
  state_->opened[key] = std::move(o);
  return ref;
}

std::size_t IpcImports::open_count() const {
  absl::MutexLock lock(&state_->mu);
  return state_->opened.size();
}

}  // namespace vramledger::core
