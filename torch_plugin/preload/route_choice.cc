// The pure route decision of route_choice.h: torch's version from its files, the environment's
// backend, and the choice with its warning line.
#include "torch_plugin/preload/route_choice.h"

#include <cctype>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace vramledger::preload {
namespace {

std::string DirName(absl::string_view path) {
  const std::size_t slash = path.rfind('/');
  return slash == absl::string_view::npos ? "" : std::string(path.substr(0, slash));
}

absl::string_view BaseName(absl::string_view path) {
  const std::size_t slash = path.rfind('/');
  return slash == absl::string_view::npos ? path : path.substr(slash + 1);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return "";
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// `__version__ = '2.11.0+cu130'` (either quote) in version.py's text; "" when absent.
std::string VersionPyValue(const std::string& text) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (!absl::ConsumePrefix(&line, "__version__")) continue;
    line = absl::StripLeadingAsciiWhitespace(line);
    if (!absl::ConsumePrefix(&line, "=")) continue;
    line = absl::StripLeadingAsciiWhitespace(line);
    if (line.empty() || (line[0] != '\'' && line[0] != '"')) continue;
    const char quote = line[0];
    line.remove_prefix(1);
    const std::size_t end = line.find(quote);
    if (end != absl::string_view::npos) return std::string(line.substr(0, end));
  }
  return "";
}

}  // namespace

std::string TorchMinorOf(absl::string_view version) {
  std::size_t i = 0;
  const auto digits = [&] {
    const std::size_t start = i;
    while (i < version.size() && std::isdigit(static_cast<unsigned char>(version[i]))) ++i;
    return i > start;
  };
  if (!digits() || i >= version.size() || version[i] != '.') return "";
  ++i;
  if (!digits()) return "";
  return std::string(version.substr(0, i));
}

std::string ReadTorchVersionIn(const std::string& dir) {
  if (dir.empty()) return "";
  if (std::string v = VersionPyValue(ReadFile(dir + "/version.py")); !v.empty()) return v;
  const std::string build = ReadFile(dir + "/build-version");
  return std::string(absl::StripAsciiWhitespace(build.substr(0, build.find('\n'))));
}

std::string TorchDirOf(const std::string& library_path) {
  const std::string dir = DirName(library_path);
  for (const std::string& candidate :
       {BaseName(dir) == "lib" ? DirName(dir) : std::string(), dir}) {
    if (!candidate.empty() && !ReadTorchVersionIn(candidate).empty()) return candidate;
  }
  return "";
}

bool MayLoadTorch(absl::string_view path) {
  const absl::string_view name = BaseName(path);
  return absl::StartsWith(name, "libtorch") || absl::StartsWith(name, "libc10") ||
         absl::StartsWith(name, "_C.");
}

bool IsDefaultLibraryDir(absl::string_view dir) {
  absl::string_view rest = dir;
  if (!absl::ConsumePrefix(&rest, "/usr/lib") && !absl::ConsumePrefix(&rest, "/lib")) return false;
  absl::ConsumePrefix(&rest, "64");
  if (rest.empty()) return true;
  if (!absl::ConsumePrefix(&rest, "/")) return false;
  const std::size_t hwcaps = rest.find("glibc-hwcaps");
  if (hwcaps != absl::string_view::npos) rest = rest.substr(0, hwcaps);
  absl::ConsumeSuffix(&rest, "/");
  // One folder (the multiarch triplet) at most, besides glibc-hwcaps/...
  return rest.find('/') == absl::string_view::npos;
}

std::string NamedBackend(const char* cuda_alloc_conf, const char* alloc_conf) {
  // torch reads the first of the two that is set (c10/cuda/CUDAAllocatorConfig.h), then splits
  // on commas and colons (allowing spaces).
  const char* conf = cuda_alloc_conf != nullptr ? cuda_alloc_conf : alloc_conf;
  if (conf == nullptr) return "";
  for (absl::string_view item : absl::StrSplit(conf, ',')) {
    const std::vector<absl::string_view> kv = absl::StrSplit(item, ':');
    if (kv.size() >= 2 && absl::StripAsciiWhitespace(kv[0]) == "backend") {
      return std::string(absl::StripAsciiWhitespace(kv[1]));
    }
  }
  return "";
}

RouteChoice ChooseRoute(const RouteInputs& in) {
  RouteChoice out;
  const std::string running = TorchMinorOf(in.running_version);
  const std::string built = in.built_minor.empty() ? "unknown" : in.built_minor;
  const std::string running_text = running.empty() ? "unknown" : running;
  std::string why;
  if (!in.native_present) {
    why = absl::StrCat("no libvramledger_native.so beside the shim in ", in.native_dir,
                       " (vramledger built for torch ", built, "; torch ", running_text,
                       " is running)");
  } else if (running.empty() || running != in.built_minor) {
    why = absl::StrCat("libvramledger_native.so was built for torch ", built, ", but torch ",
                       running_text, " is running");
  } else {
    out.direct = true;
    return out;
  }
  out.warning = absl::StrCat(
      "vramledger: ", why,
      "; the shim serves torch's CUDA memory calls instead of becoming torch's allocator "
      "(torch.cuda.memory_stats, MemPool and graph trees then do not see vramledger; rebuild "
      "vramledger against this torch for them)");
  return out;
}

}  // namespace vramledger::preload
