// A minimal walker over a JSON text that records the line of every value by its path; it only
// tracks structure (objects, arrays, strings, scalars), since nlohmann has already validated it.
#include "guard/json_lines.h"

#include <string>

namespace vramledger::guard {
namespace {

class Walker {
 public:
  Walker(std::string_view text, std::map<std::string, int, std::less<>>* out,
         std::pair<std::string, int>* first_duplicate)
      : text_(text), out_(out), first_duplicate_(first_duplicate) {}

  void Run() {
    SkipSpace();
    Value("", line_);
  }

 private:
  bool AtEnd() const { return pos_ >= text_.size(); }
  char Peek() const { return AtEnd() ? '\0' : text_[pos_]; }

  void SkipSpace() {
    while (!AtEnd()) {
      const char c = text_[pos_];
      if (c == '\n') {
        ++line_;
      } else if (c != ' ' && c != '\t' && c != '\r') {
        return;
      }
      ++pos_;
    }
  }

  // Reads a string token starting at '"'; returns its raw contents (escapes kept).
  std::string String() {
    std::string out;
    ++pos_;  // opening quote
    while (!AtEnd() && text_[pos_] != '"') {
      if (text_[pos_] == '\\' && pos_ + 1 < text_.size()) {
        out.push_back(text_[pos_++]);
      }
      if (text_[pos_] == '\n') ++line_;  // invalid JSON, but keep counting
      out.push_back(text_[pos_++]);
    }
    ++pos_;  // closing quote
    return out;
  }

  void Value(const std::string& path, int line) {
    (*out_)[path] = line;
    if (++depth_ > kMaxDepth) return;
    switch (Peek()) {
      case '{':
        Object(path);
        break;
      case '[':
        Array(path);
        break;
      case '"':
        String();
        break;
      default:  // number, true, false, null
        while (!AtEnd() && Peek() != ',' && Peek() != '}' && Peek() != ']' && Peek() != ' ' &&
               Peek() != '\n' && Peek() != '\t' && Peek() != '\r') {
          ++pos_;
        }
    }
    --depth_;
  }

  void Object(const std::string& path) {
    ++pos_;  // '{'
    SkipSpace();
    while (!AtEnd() && Peek() != '}') {
      if (Peek() != '"') return;  // malformed: stop
      const int key_line = line_;
      const std::string key = String();
      SkipSpace();
      if (Peek() != ':') return;
      ++pos_;
      SkipSpace();
      const std::string member = path.empty() ? key : path + "/" + key;
      if (first_duplicate_->second == 0 && out_->count(member) != 0) {
        *first_duplicate_ = {member, key_line};  // a path is unique but for a repeated key
      }
      Value(member, key_line);
      SkipSpace();
      if (Peek() == ',') {
        ++pos_;
        SkipSpace();
      }
    }
    ++pos_;  // '}'
  }

  void Array(const std::string& path) {
    ++pos_;  // '['
    SkipSpace();
    int index = 0;
    while (!AtEnd() && Peek() != ']') {
      const std::size_t before = pos_;
      Value(path.empty() ? std::to_string(index) : path + "/" + std::to_string(index), line_);
      ++index;
      SkipSpace();
      if (Peek() == ',') {
        ++pos_;
        SkipSpace();
      } else if (pos_ == before) {
        return;  // no progress: malformed
      }
    }
    ++pos_;  // ']'
  }

  static constexpr int kMaxDepth = 256;
  std::string_view text_;
  std::map<std::string, int, std::less<>>* out_;
  std::pair<std::string, int>* first_duplicate_;
  std::size_t pos_ = 0;
  int line_ = 1;
  int depth_ = 0;
};

}  // namespace

JsonLineIndex::JsonLineIndex(std::string_view text) {
  Walker(text, &lines_, &first_duplicate_).Run();
}

int JsonLineIndex::LineOf(std::string_view path) const {
  while (true) {
    if (auto it = lines_.find(path); it != lines_.end()) return it->second;
    if (path.empty()) return 1;
    const std::size_t slash = path.rfind('/');
    path = slash == std::string_view::npos ? std::string_view() : path.substr(0, slash);
  }
}

int LineOfOffset(std::string_view text, std::size_t offset) {
  int line = 1;
  for (std::size_t i = 0; i < text.size() && i < offset; ++i) line += text[i] == '\n' ? 1 : 0;
  return line;
}

}  // namespace vramledger::guard
