// SimBackend's pinned host memory (heap memory under a cap), batched copies, and the modelled
// contents of physical handles that the copies and the tests read and write. Thread-safe (mu_).
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_format.h"
#include "device/sim_backend.h"

namespace vramledger {

SimBackend::~SimBackend() {
  absl::MutexLock lock(&mu_);
  for (const auto& [p, bytes] : pinned_) std::free(p);
}

absl::StatusOr<void*> SimBackend::HostAllocPinned(std::size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (bytes == 0) return absl::InvalidArgumentError("cudaHostAlloc: size 0");
  if (bytes > pinned_cap_ || pinned_used_ > pinned_cap_ - bytes) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("cudaHostAlloc: out of memory (%d pinned bytes asked, %d of %d in use)",
                        bytes, pinned_used_, pinned_cap_));
  }
  void* p = std::malloc(bytes);
  if (p == nullptr) return absl::ResourceExhaustedError("cudaHostAlloc: out of host memory");
  pinned_.emplace(p, bytes);
  pinned_used_ += bytes;
  return p;
}

absl::Status SimBackend::HostFreePinned(void* p) {
  absl::MutexLock lock(&mu_);
  auto it = pinned_.find(p);
  if (it == pinned_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cudaFreeHost: %p is not pinned memory from cudaHostAlloc", p));
  }
  pinned_used_ -= it->second;
  pinned_.erase(it);
  std::free(p);
  return absl::OkStatus();
}

absl::Status SimBackend::CopyInjectedLocked() {
  if (!copy_failure_set_) return absl::OkStatus();
  if (copy_failure_.skip-- > 0) return absl::OkStatus();
  copy_failure_set_ = false;
  ++injected_failures_;
  return copy_failure_.status;
}

absl::Status SimBackend::CopyLocked(absl::Span<const HostCopy> copies, bool to_host) {
  const char* call =
      to_host ? "cudaMemcpyAsync (device to host)" : "cudaMemcpyAsync (host to device)";
  ++copy_waits_;  // the one cudaStreamSynchronize of the batch
  for (const HostCopy& c : copies) {
    // The host side lies inside one pinned allocation, as the contract asks.
    const auto* host = static_cast<const char*>(c.host);
    if (std::none_of(pinned_.begin(), pinned_.end(), [&](const auto& p) {
          const auto* base = static_cast<const char*>(p.first);
          return host >= base && host + c.bytes <= base + p.second;
        })) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: host range %p + %d is not pinned memory", call, c.host, c.bytes));
    }
    if (absl::Status s = CopyInjectedLocked(); !s.ok()) return s;
    absl::Status s = to_host ? ReadLocked(call, c.host, c.device, c.bytes)
                             : WriteLocked(call, c.device, c.host, c.bytes);
    if (!s.ok()) return s;
    ++copies_;
    copied_bytes_ += c.bytes;
  }
  return absl::OkStatus();
}

absl::Status SimBackend::CopyDeviceToHost(absl::Span<const HostCopy> copies) {
  absl::MutexLock lock(&mu_);
  return CopyLocked(copies, /*to_host=*/true);
}

absl::Status SimBackend::CopyHostToDevice(absl::Span<const HostCopy> copies) {
  absl::MutexLock lock(&mu_);
  return CopyLocked(copies, /*to_host=*/false);
}

absl::Status SimBackend::PrepareCopies() {
  absl::MutexLock lock(&mu_);
  ++copy_prepares_;
  return absl::OkStatus();
}

template <typename Fn>
absl::Status SimBackend::ForEachMappedPiece(const char* call, DevicePtr va, std::size_t bytes,
                                            Fn fn) const {
  // Checked whole before any byte moves, so a failed copy changes nothing.
  for (int pass = 0; pass < 2; ++pass) {
    DevicePtr at = va;
    std::size_t done = 0;
    while (done < bytes) {
      auto it = mappings_.upper_bound(at);
      if (it == mappings_.begin() || std::prev(it)->first + std::prev(it)->second.size <= at ||
          !std::prev(it)->second.accessible) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: device address %#x (in [%#x, %#x)) is not mapped with access",
                            call, at, va, va + bytes));
      }
      --it;
      const std::size_t offset = at - it->first;
      const std::size_t n = std::min(bytes - done, it->second.size - offset);
      if (pass == 1) fn(it->second.handle, offset, done, n);
      at += n;
      done += n;
    }
  }
  return absl::OkStatus();
}

absl::Status SimBackend::WriteLocked(const char* call, DevicePtr va, const void* src,
                                     std::size_t bytes) {
  const auto* in = static_cast<const std::uint8_t*>(src);
  return ForEachMappedPiece(
      call, va, bytes,
      [&](PhysicalHandle h, std::size_t offset, std::size_t from, std::size_t n)
          ABSL_NO_THREAD_SAFETY_ANALYSIS {
            while (n > 0) {
              const std::size_t chunk = offset / kContentChunk;
              const std::size_t at = offset % kContentChunk;
              const std::size_t k = std::min(n, kContentChunk - at);
              auto& chunks = contents_[h];
              auto c = chunks.find(chunk);
              const bool zero =
                  std::all_of(in + from, in + from + k, [](std::uint8_t b) { return b == 0; });
              if (c == chunks.end() && !zero) {
                c = chunks.emplace(chunk, std::vector<std::uint8_t>(kContentChunk)).first;
              }
              if (c != chunks.end()) std::memcpy(c->second.data() + at, in + from, k);
              offset += k;
              from += k;
              n -= k;
            }
          });
}

absl::Status SimBackend::ReadLocked(const char* call, void* dst, DevicePtr va,
                                    std::size_t bytes) const {
  auto* out = static_cast<std::uint8_t*>(dst);
  return ForEachMappedPiece(call, va, bytes,
                            [&](PhysicalHandle h, std::size_t offset, std::size_t to, std::size_t n)
                                ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                  const auto handle = contents_.find(h);
                                  while (n > 0) {
                                    const std::size_t chunk = offset / kContentChunk;
                                    const std::size_t at = offset % kContentChunk;
                                    const std::size_t k = std::min(n, kContentChunk - at);
                                    const std::vector<std::uint8_t>* c = nullptr;
                                    if (handle != contents_.end()) {
                                      auto it = handle->second.find(chunk);
                                      if (it != handle->second.end()) c = &it->second;
                                    }
                                    if (c == nullptr) {
                                      std::memset(out + to, 0, k);
                                    } else {
                                      std::memcpy(out + to, c->data() + at, k);
                                    }
                                    offset += k;
                                    to += k;
                                    n -= k;
                                  }
                                });
}

absl::Status SimBackend::WriteDevice(DevicePtr va, const void* src, std::size_t bytes) {
  absl::MutexLock lock(&mu_);
  return WriteLocked("WriteDevice", va, src, bytes);
}

absl::Status SimBackend::ReadDevice(void* dst, DevicePtr va, std::size_t bytes) const {
  absl::MutexLock lock(&mu_);
  return ReadLocked("ReadDevice", dst, va, bytes);
}

void SimBackend::SetPinnedCapacity(std::size_t bytes) {
  absl::MutexLock lock(&mu_);
  pinned_cap_ = bytes;
}

void SimBackend::FailCopy(int skip, absl::Status status) {
  absl::MutexLock lock(&mu_);
  copy_failure_ = {skip, std::move(status)};
  copy_failure_set_ = true;
}

std::size_t SimBackend::pinned_bytes() const {
  absl::MutexLock lock(&mu_);
  return pinned_used_;
}

std::int64_t SimBackend::copies() const {
  absl::MutexLock lock(&mu_);
  return copies_;
}

std::int64_t SimBackend::copy_waits() const {
  absl::MutexLock lock(&mu_);
  return copy_waits_;
}

std::int64_t SimBackend::copy_prepares() const {
  absl::MutexLock lock(&mu_);
  return copy_prepares_;
}

std::size_t SimBackend::copied_bytes() const {
  absl::MutexLock lock(&mu_);
  return copied_bytes_;
}

}  // namespace vramledger
