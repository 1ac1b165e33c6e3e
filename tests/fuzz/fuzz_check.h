// What every fuzz target shares: a check that aborts (the fuzzer's crash signal) with a message,
// a reader of the input's bytes from the front, and a UTF-8 test for error messages.
// Header-only; each target is single-threaded.
#ifndef VRAMLEDGER_TESTS_FUZZ_FUZZ_CHECK_H_
#define VRAMLEDGER_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

namespace vramledger::fuzz {

/// Prints `what` and aborts: libFuzzer saves the input as a crash.
/// Control bytes (a NUL among them) are written as \xNN, so the whole message shows.
[[noreturn]] inline void Fail(const std::string& what) {
  std::string shown;
  for (const char c : what) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      shown += {'\\', 'x', kHex[byte >> 4], kHex[byte & 15]};
    } else {
      shown.push_back(c);
    }
  }
  std::fprintf(stderr, "fuzz check failed: %s\n", shown.c_str());
  std::fflush(stderr);
  std::abort();
}

/// Aborts with `what` unless `cond`.
inline void Check(bool cond, const std::string& what) {
  if (!cond) Fail(what);
}

/// Reads the input from the front, one byte or one little-endian integer at a time; zeros once
/// it is used up (so every input decodes to some sequence of operations).
class ByteReader {
 public:
  ByteReader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  bool done() const { return pos_ >= size_; }
  std::uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  std::uint16_t U16() { return static_cast<std::uint16_t>(Byte() | Byte() << 8); }
  std::uint32_t U32() {
    return static_cast<std::uint32_t>(U16()) | static_cast<std::uint32_t>(U16()) << 16;
  }
  /// The unread bytes, as text.
  std::string_view Rest() const {
    return pos_ < size_
               ? std::string_view(reinterpret_cast<const char*>(data_ + pos_), size_ - pos_)
               : std::string_view();
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

/// True when `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past
/// U+10FFFF): what Python needs to decode an error message.
inline bool IsUtf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = 0;
    std::uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      n = 1;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 2;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    for (int k = 1; k <= n; ++k) {
      if (i + k >= s.size()) return false;
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = cp << 6 | (d & 0x3F);
    }
    if ((n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += n + 1;
  }
  return true;
}

}  // namespace vramledger::fuzz

#endif  // VRAMLEDGER_TESTS_FUZZ_FUZZ_CHECK_H_
