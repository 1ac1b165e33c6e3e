// Trace CSV parsing: a line parser shared by the in-memory and the file (zlib) readers.
// Stateless between calls; thread-safe.
#include "replay/trace_reader.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace vramledger {
namespace {

// This Abseil may have its own string_view; std::string_view converts through here.
constexpr absl::string_view Absl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

constexpr absl::string_view kHeader = Absl(kTraceHeader);

// time_us bound (exclusive, both signs): any two such times differ by less than 2**63.
constexpr std::int64_t kMaxTimeUs = std::int64_t{1} << 62;

// Lines longer than this are cut in error messages.
constexpr std::size_t kMaxQuotedChars = 160;

// The text as an error message shows it: cut at kMaxQuotedChars, and every byte that is not
// printable ASCII (a NUL, a control character, a non-UTF-8 byte) written as \xNN, so that the
// message stays valid UTF-8 for Python (a Latin-1 byte would make the message undecodable, losing
// the file and line).
std::string Quote(absl::string_view text) {
  const bool cut = text.size() > kMaxQuotedChars;
  if (cut) text = text.substr(0, kMaxQuotedChars);
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f) {
      out.push_back(c);
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(byte, absl::kZeroPad2));
    }
  }
  if (cut) out += "...";
  return out;
}

// Parses a whole field as a decimal integer of type T; false if anything else is there.
template <typename T>
bool ParseInteger(absl::string_view field, T* out) {
  if (field.empty() || field.front() == '+') return false;
  const char* end = field.data() + field.size();
  const auto [ptr, ec] = std::from_chars(field.data(), end, *out);
  return ec == std::errc() && ptr == end;
}

// An address: decimal, as the bundled traces write it, or 0x-prefixed hex, as torch's viewers and
// the replay's own warnings show one (a new user pasted a warning's address into a trace).
bool ParseAddress(absl::string_view field, std::uint64_t* out) {
  if (field.size() > 2 && field[0] == '0' && (field[1] == 'x' || field[1] == 'X')) {
    field.remove_prefix(2);
    const char* end = field.data() + field.size();
    const auto [ptr, ec] = std::from_chars(field.data(), end, *out, 16);
    return ec == std::errc() && ptr == end;
  }
  return ParseInteger(field, out);
}

// Feeds lines one at a time; remembers whether the header was seen.
class LineParser {
 public:
  LineParser(absl::string_view source, std::vector<TraceEvent>* out) : source_(source), out_(out) {}

  // Parses physical line number `line` (without its '\n').
  absl::Status Feed(absl::string_view text, int line) {
    if (!text.empty() && text.back() == '\r') text.remove_suffix(1);
    if (!header_seen_) {
      if (line == 1) absl::ConsumePrefix(&text, "\xEF\xBB\xBF");  // a UTF-8 byte-order mark
      if (!IsHeader(text)) {
        return Error(line, absl::StrCat("expected the header '", kHeader, "'", HeaderDiff(text)),
                     text);
      }
      header_seen_ = true;
      return absl::OkStatus();
    }
    if (absl::StripAsciiWhitespace(text).empty()) return absl::OkStatus();

    std::array<absl::string_view, 5> fields;
    std::size_t n = 0;
    for (absl::string_view f : absl::StrSplit(text, ',')) {
      if (n < fields.size()) fields[n] = absl::StripAsciiWhitespace(f);
      ++n;
    }
    if (n != fields.size()) {
      return Error(line, absl::StrCat("expected 5 columns (", kHeader, "), found ", n), text);
    }
    TraceEvent event;
    event.line = line;
    const std::optional<TraceAction> action =
        ParseTraceAction(std::string_view(fields[0].data(), fields[0].size()));
    if (!action.has_value()) {
      return Error(line, absl::StrCat("unknown action '", Quote(fields[0]), "'"), text);
    }
    event.action = *action;
    std::uint64_t addr = 0, size = 0, stream = 0;
    if (!ParseAddress(fields[1], &addr)) {
      return Error(line,
                   absl::StrCat("addr is not an unsigned integer (decimal, or hex after 0x): '",
                                Quote(fields[1]), "'"),
                   text);
    }
    if (!ParseInteger(fields[2], &size)) return NotNumber(line, "size", fields[2], text);
    if (!ParseInteger(fields[3], &stream)) return NotNumber(line, "stream", fields[3], text);
    if (!ParseInteger(fields[4], &event.time_us)) {
      return Error(line, absl::StrCat("time_us is not an integer: '", Quote(fields[4]), "'"), text);
    }
    // Within +-2**62, so that the difference of any two fits in 64 bits (the span, time order):
    // times at the int64 limits would overflow them.
    if (event.time_us <= -kMaxTimeUs || event.time_us >= kMaxTimeUs) {
      return Error(line,
                   absl::StrCat("time_us ", event.time_us,
                                " is out of range: it must lie strictly between -2**62 and 2**62"),
                   text);
    }
    event.addr = static_cast<DevicePtr>(addr);
    event.size = static_cast<std::size_t>(size);
    event.stream = static_cast<StreamId>(stream);
    out_->push_back(event);
    return absl::OkStatus();
  }

  // Called after the last line; an input without a header is an error.
  absl::Status Finish(int lines) const {
    if (header_seen_) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        source_, ":", lines < 1 ? 1 : lines, ": empty trace; expected the header '", kHeader, "'"));
  }

 private:
  static bool IsHeader(absl::string_view text) {
    std::vector<absl::string_view> names = absl::StrSplit(text, ',');
    std::vector<absl::string_view> want = absl::StrSplit(kHeader, ',');
    if (names.size() != want.size()) return false;
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (absl::StripAsciiWhitespace(names[i]) != want[i]) return false;
    }
    return true;
  }

  // For a first line that names at least two of the header's columns (a header, not data):
  // "; missing C, D", "; unexpected X" or "; columns out of order"; otherwise "".
  static std::string HeaderDiff(absl::string_view text) {
    std::vector<absl::string_view> names = absl::StrSplit(text, ',');
    for (absl::string_view& n : names) n = absl::StripAsciiWhitespace(n);
    const std::vector<absl::string_view> want = absl::StrSplit(kHeader, ',');
    auto has = [](const std::vector<absl::string_view>& v, absl::string_view x) {
      return std::find(v.begin(), v.end(), x) != v.end();
    };
    std::vector<absl::string_view> missing, unexpected;
    for (absl::string_view w : want) {
      if (!has(names, w)) missing.push_back(w);
    }
    for (absl::string_view n : names) {
      if (!has(want, n)) unexpected.push_back(n);
    }
    if (want.size() - missing.size() < 2) return "";
    std::string diff;
    if (!missing.empty()) absl::StrAppend(&diff, "; missing ", absl::StrJoin(missing, ", "));
    if (!unexpected.empty()) {
      // Quoted: a column name may hold any byte, and the message must stay UTF-8.
      absl::StrAppend(&diff, "; unexpected ",
                      absl::StrJoin(unexpected, ", ", [](std::string* out, absl::string_view n) {
                        out->append(Quote(n));
                      }));
    }
    return diff.empty() ? "; columns out of order" : diff;
  }

  absl::Status NotNumber(int line, absl::string_view column, absl::string_view field,
                         absl::string_view text) const {
    return Error(line, absl::StrCat(column, " is not an unsigned integer: '", Quote(field), "'"),
                 text);
  }

  absl::Status Error(int line, absl::string_view what, absl::string_view text) const {
    return absl::InvalidArgumentError(
        absl::StrCat(source_, ":", line, ": ", what, " (", Quote(text), ")"));
  }

  absl::string_view source_;
  std::vector<TraceEvent>* out_;
  bool header_seen_ = false;
};

// Reads a file that is plain text or gzip (one member or several, as `cat a.gz b.gz` makes),
// decompressed in chunks. After the last member only NUL padding may follow, as Python's gzip
// module allows; anything else is an error (zlib's gzread ignores it silently, which would hide
// that a file was corrupted or two files were joined wrongly).
class TraceInput {
 public:
  explicit TraceInput(std::string path) : path_(std::move(path)) {}
  ~TraceInput() {
    if (inflating_) inflateEnd(&zs_);
    if (file_ != nullptr) std::fclose(file_);
  }
  TraceInput(const TraceInput&) = delete;
  TraceInput& operator=(const TraceInput&) = delete;

  absl::Status Open() {
    errno = 0;
    file_ = std::fopen(path_.c_str(), "rb");
    if (file_ == nullptr) {
      return absl::ErrnoToStatus(errno != 0 ? errno : ENOMEM, absl::StrCat(path_, ": cannot open"));
    }
    if (absl::Status s = Fill(); !s.ok()) return s;
    gzip_ = have_ >= 2 && static_cast<unsigned char>(raw_[0]) == 0x1f &&
            static_cast<unsigned char>(raw_[1]) == 0x8b;
    if (gzip_) {
      zs_ = z_stream{};
      if (inflateInit2(&zs_, 15 + 16) != Z_OK) return absl::ResourceExhaustedError("inflateInit2");
      inflating_ = true;
    }
    return absl::OkStatus();
  }

  // Appends the next chunk of text to `out`; false at the end of the input. `line` (the lines
  // read so far) places a corruption in errors.
  absl::StatusOr<bool> Read(std::string* out, int line) {
    if (!gzip_) {
      if (have_ == 0 && !eof_) {
        if (absl::Status s = Fill(); !s.ok()) return s;
      }
      if (have_ == 0) return false;
      out->append(raw_.data() + pos_, have_);
      pos_ = have_ = 0;
      return true;
    }
    for (;;) {
      if (have_ == 0 && !eof_) {
        if (absl::Status s = Fill(); !s.ok()) return s;
      }
      if (member_done_) {  // between members: another member, NUL padding, or garbage
        while (have_ > 0 && raw_[pos_] == '\0') {
          ++pos_;
          --have_;
          ++consumed_;
        }
        if (have_ == 0) {
          if (eof_) return false;
          continue;
        }
        if (static_cast<unsigned char>(raw_[pos_]) != 0x1f) {
          const std::optional<std::size_t> size = FileSize();  // none for a pipe
          return absl::DataLossError(absl::StrCat(
              path_, ": ",
              size.has_value() ? absl::StrCat(*size - consumed_, " bytes") : "the data",
              " after the end of the gzip data (at byte ", consumed_,
              ") are neither gzip nor padding: a corrupted or wrongly joined file"));
        }
        inflateReset(&zs_);
        member_done_ = false;
      }
      if (have_ == 0 && eof_) {
        return absl::DataLossError(
            absl::StrCat(path_, ":", line + 1, ": corrupt gzip data: unexpected end of file"));
      }
      std::array<char, 1 << 16> chunk;
      zs_.next_in = reinterpret_cast<Bytef*>(raw_.data() + pos_);
      zs_.avail_in = static_cast<uInt>(have_);
      zs_.next_out = reinterpret_cast<Bytef*>(chunk.data());
      zs_.avail_out = static_cast<uInt>(chunk.size());
      const int rc = inflate(&zs_, Z_NO_FLUSH);
      const std::size_t used = have_ - zs_.avail_in;
      pos_ += used;
      have_ -= used;
      consumed_ += used;
      const std::size_t produced = chunk.size() - zs_.avail_out;
      if (rc == Z_STREAM_END) {
        member_done_ = true;
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        return absl::DataLossError(absl::StrCat(path_, ":", line + 1, ": corrupt gzip data: ",
                                                zs_.msg != nullptr ? zs_.msg : "inflate failed"));
      }
      if (produced > 0) {
        out->append(chunk.data(), produced);
        return true;
      }
    }
  }

 private:
  absl::Status Fill() {
    pos_ = 0;
    have_ = std::fread(raw_.data(), 1, raw_.size(), file_);
    if (have_ < raw_.size()) {
      if (std::ferror(file_) != 0) {
        return absl::ErrnoToStatus(errno != 0 ? errno : EIO, absl::StrCat(path_, ": read failed"));
      }
      eof_ = true;
    }
    return absl::OkStatus();
  }
  std::optional<std::size_t> FileSize() const {
    std::error_code ec;
    const auto size = std::filesystem::file_size(path_, ec);
    if (ec || size < consumed_) return std::nullopt;
    return static_cast<std::size_t>(size);
  }

  std::string path_;
  std::FILE* file_ = nullptr;
  std::array<char, 1 << 20> raw_;
  std::size_t pos_ = 0;       // next unread byte of raw_
  std::size_t have_ = 0;      // unread bytes in raw_ from pos_
  std::size_t consumed_ = 0;  // compressed bytes consumed (gzip)
  bool eof_ = false;
  bool gzip_ = false;
  bool inflating_ = false;
  bool member_done_ = false;
  z_stream zs_{};
};

}  // namespace

absl::StatusOr<std::vector<TraceEvent>> ParseTraceEvents(std::string_view text,
                                                         std::string_view source) {
  std::vector<TraceEvent> events;
  LineParser parser(Absl(source), &events);
  int line = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    ++line;
    if (absl::Status s = parser.Feed(Absl(text.substr(pos, end - pos)), line); !s.ok()) {
      return s;
    }
    pos = end + 1;
  }
  if (absl::Status s = parser.Finish(line); !s.ok()) return s;
  return events;
}

absl::StatusOr<std::vector<TraceEvent>> ReadTraceFile(const std::string& path) {
  // Heap: TraceInput holds a 1 MiB read buffer.
  auto input = std::make_unique<TraceInput>(path);
  if (absl::Status s = input->Open(); !s.ok()) return s;

  std::vector<TraceEvent> events;
  LineParser parser(path, &events);
  // A split on '\n' of what was read, not a line-reading call: a NUL byte inside a line must not
  // end it (strlen would drop the rest and join it with the next line, blaming the wrong one).
  std::string text;  // read, not yet fed: at most one partial line and the last chunk
  int line = 0;
  for (;;) {
    absl::StatusOr<bool> more = input->Read(&text, line);
    if (!more.ok()) return more.status();
    if (!*more) break;
    std::size_t pos = 0;
    for (std::size_t end; (end = text.find('\n', pos)) != std::string::npos; pos = end + 1) {
      ++line;
      if (absl::Status s = parser.Feed(absl::string_view(text).substr(pos, end - pos), line);
          !s.ok()) {
        return s;
      }
    }
    text.erase(0, pos);
  }
  if (!text.empty()) {  // a last line without '\n'
    ++line;
    if (absl::Status s = parser.Feed(text, line); !s.ok()) return s;
  }
  if (absl::Status s = parser.Finish(line); !s.ok()) return s;
  return events;
}

}  // namespace vramledger
