// WriteFileAtomically: a buffered stream over a POSIX descriptor, fsync, rename.
// Stateless apart from a process-wide counter that keeps temporary names distinct.
#include "ledger/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <streambuf>
#include <vector>

#include "absl/strings/str_cat.h"

namespace vramledger {
namespace {

// A write-only streambuf on a file descriptor with a 256 KiB buffer. Records the first errno.
class FdStreamBuf : public std::streambuf {
 public:
  explicit FdStreamBuf(int fd) : fd_(fd), buffer_(256 * 1024) {
    setp(buffer_.data(), buffer_.data() + buffer_.size());
  }
  int error() const { return error_; }

 protected:
  int_type overflow(int_type ch) override {
    if (!Drain()) return traits_type::eof();
    if (!traits_type::eq_int_type(ch, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(ch);
      pbump(1);
    }
    return traits_type::not_eof(ch);
  }
  int sync() override { return Drain() ? 0 : -1; }

 private:
  bool Drain() {
    const char* p = pbase();
    while (p < pptr()) {
      const ssize_t n = ::write(fd_, p, static_cast<std::size_t>(pptr() - p));
      if (n < 0) {
        if (errno == EINTR) continue;
        if (error_ == 0) error_ = errno;
        return false;
      }
      p += n;
    }
    setp(buffer_.data(), buffer_.data() + buffer_.size());
    return true;
  }

  int fd_;
  std::vector<char> buffer_;
  int error_ = 0;
};

absl::Status SystemError(const std::string& what, const std::string& path, int err) {
  std::string message = absl::StrCat("cannot ", what, " ", path, ": ", std::strerror(err));
  if (err == EACCES || err == EPERM || err == EROFS) {
    return absl::PermissionDeniedError(message);
  }
  return absl::FailedPreconditionError(message);
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path,
                                 const std::function<absl::Status(std::ostream&)>& write) {
  static std::atomic<unsigned> counter{0};
  const std::string temp =
      absl::StrCat(path, ".tmp-", ::getpid(), "-", counter.fetch_add(1, std::memory_order_relaxed));
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return SystemError("create", temp, errno);
  absl::Status status;
  {
    FdStreamBuf buf(fd);
    std::ostream out(&buf);
    status = write(out);
    out.flush();
    if (buf.error() != 0) {
      // The system's error (a full disk) is the cause of a writer's stream failure: name it and
      // the file rather than the writer's own "writing ... failed".
      status = SystemError("write", temp, buf.error());
    } else if (status.ok() && !out.good()) {
      status = SystemError("write", temp, EIO);
    }
  }
  if (status.ok() && ::fsync(fd) != 0) status = SystemError("sync", temp, errno);
  if (::close(fd) != 0 && status.ok()) status = SystemError("close", temp, errno);
  if (status.ok() && ::rename(temp.c_str(), path.c_str()) != 0) {
    status = SystemError(absl::StrCat("rename ", temp, " to"), path, errno);
  }
  if (!status.ok()) ::unlink(temp.c_str());
  return status;
}

}  // namespace vramledger
