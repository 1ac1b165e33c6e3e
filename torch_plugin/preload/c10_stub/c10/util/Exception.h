// Stand-in for torch's c10/util/Exception.h, used only when guard_api.cc is compiled into the
// LD_PRELOAD shim (which must not link torch): its testing entry point catches c10::Error.
#ifndef VRAMLEDGER_PRELOAD_C10_STUB_EXCEPTION_H_
#define VRAMLEDGER_PRELOAD_C10_STUB_EXCEPTION_H_

#include <exception>

namespace c10 {

/// Never thrown inside the shim; exists so that `catch (const c10::Error&)` compiles.
class Error : public std::exception {
 public:
  /// The message, as c10::Error::what_without_backtrace.
  const char* what_without_backtrace() const noexcept { return what(); }
};

}  // namespace c10

#endif  // VRAMLEDGER_PRELOAD_C10_STUB_EXCEPTION_H_
