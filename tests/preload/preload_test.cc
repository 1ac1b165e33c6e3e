// Tests of libvramledger_preload.so (issue 7): runs preload_driver (linked to a fake CUDA runtime
// on host memory) with LD_PRELOAD set and checks what the shim and the "real" runtime saw.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace {

using ::testing::HasSubstr;

struct Result {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

// Runs the driver under the shim with `env` (NAME=value ... prefixed to the command).
Result RunDriver(const std::string& env) {
  const std::string command = env + " LD_PRELOAD=" + VRAMLEDGER_PRELOAD_LIB + " " +
                              VRAMLEDGER_PRELOAD_DRIVER + " 2>&1";
  Result result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) result.output.append(buf, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// The driver's JSON line (its last line starting with '{').
nlohmann::json DriverJson(const std::string& output) {
  const size_t at = output.rfind("\n{\"failures\"");
  const size_t start = at == std::string::npos ? output.find("{\"failures\"") : at + 1;
  const size_t end = output.find('\n', start);
  return nlohmann::json::parse(output.substr(start, end - start));
}

std::string TempDir(const char* name) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / (std::string(name) + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  return dir.string();
}

TEST(PreloadTest, ServesCountsAndForwardsForeignFrees) {
  const std::string dumps = TempDir("vl-preload-a");
  const Result r = RunDriver("VRAMLEDGER_CONF=dump_dir:" + dumps);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = DriverJson(r.output);
  EXPECT_EQ(j["failures"], 0) << r.output;
  EXPECT_EQ(j["refused"], 1) << r.output;
  const nlohmann::json& shim = j["shim"];
  ASSERT_TRUE(shim.is_object()) << r.output;
  // Every call of the program was seen: 10 + 1 (refused) cudaMalloc, 6 cudaMallocAsync,
  // 12 cudaFree (10 ours, 1 foreign, 1 null), 6 cudaFreeAsync.
  EXPECT_EQ(shim["cudaMalloc_calls"], 11);
  EXPECT_EQ(shim["cudaMallocAsync_calls"], 6);
  EXPECT_EQ(shim["cudaFree_calls"], 12);
  EXPECT_EQ(shim["cudaFreeAsync_calls"], 6);
  EXPECT_EQ(shim["served_allocations"], 16);
  EXPECT_EQ(shim["served_frees"], 16);
  EXPECT_EQ(shim["forwarded_frees"], 1);
  EXPECT_EQ(shim["refusals"], 1);
  // The real runtime saw no cudaMallocAsync/cudaFreeAsync (all served from segments), and
  // cudaMalloc only from CudaBackend (segments, plus the refused attempts), with no recursion:
  // every real cudaMalloc was one of vramledger's own inner calls.
  EXPECT_EQ(j["real"]["cudaMallocAsync"], 0);
  EXPECT_EQ(j["real"]["cudaFreeAsync"], 0);
  EXPECT_GE(j["real"]["cudaMalloc"], 1);
  EXPECT_LT(j["real"]["cudaMalloc"], 16);
  // Foreign and null frees reached the real cudaFree (2), plus any segments vramledger released.
  EXPECT_GE(j["real"]["cudaFree"], 2);
  // The refusal wrote a forensic dump; exit wrote a snapshot and a summary.
  bool oom = false, snapshot = false, summary = false;
  for (const auto& entry : std::filesystem::directory_iterator(dumps)) {
    const std::string name = entry.path().filename().string();
    oom |= name.rfind("vramledger-oom-", 0) == 0;
    snapshot |= name.find("-exit.json") != std::string::npos;
    summary |= name.find("-exit.txt") != std::string::npos;
  }
  EXPECT_TRUE(oom);
  EXPECT_TRUE(snapshot);
  EXPECT_TRUE(summary);
  EXPECT_THAT(r.output, HasSubstr("vramledger preload summary (exit"));
  std::filesystem::remove_all(dumps);
}

TEST(PreloadTest, BadConfigExitsNamingTheKey) {
  const Result r = RunDriver("VRAMLEDGER_CONF=max_split_size_mb:banana");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("max_split_size_mb"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("failures")));  // before any work
}

TEST(PreloadTest, UnknownKeyExitsNamingTheKey) {
  const Result r = RunDriver("VRAMLEDGER_CONF=no_such_key:1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("no_such_key"));
}

TEST(PreloadTest, MissingPlanExitsNamingPlan) {
  const Result r = RunDriver("VRAMLEDGER_CONF=plan:/nonexistent/plan.json");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("plan"));
}

}  // namespace
