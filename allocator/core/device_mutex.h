// DeviceMutex: the lock of one device allocator: std::mutex (a futex word; its uncontended
// lock+unlock is a pair of atomic operations) wearing Abseil's thread-safety annotations, so that
// -Wthread-safety checks every ABSL_GUARDED_BY(mu_) as with absl::Mutex. Chosen over absl::Mutex
// for the hot path by measurement (docs/design/locking.md, "Hot path").
#ifndef VRAMLEDGER_CORE_DEVICE_MUTEX_H_
#define VRAMLEDGER_CORE_DEVICE_MUTEX_H_

#include <mutex>

#include "absl/base/thread_annotations.h"

namespace vramledger::core {

class ABSL_LOCKABLE DeviceMutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }

 private:
  std::mutex mu_;
};

/// RAII lock of a DeviceMutex, as absl::MutexLock.
class ABSL_SCOPED_LOCKABLE DeviceMutexLock {
 public:
  explicit DeviceMutexLock(DeviceMutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
  }
  ~DeviceMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  DeviceMutexLock(const DeviceMutexLock&) = delete;
  DeviceMutexLock& operator=(const DeviceMutexLock&) = delete;

 private:
  DeviceMutex* const mu_;
};

}  // namespace vramledger::core

#endif  // VRAMLEDGER_CORE_DEVICE_MUTEX_H_
