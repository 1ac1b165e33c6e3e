// Tests of libvramledger_preload.so: runs preload_driver (linked to a fake CUDA runtime
// on host memory) with LD_PRELOAD set and checks what the shim and the "real" runtime saw.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
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

// Runs `program` under the shim with `env` (NAME=value ... prefixed to the command).
Result RunUnderShim(const std::string& env, const std::string& program) {
  const std::string command =
      env + " LD_PRELOAD=" + VRAMLEDGER_PRELOAD_LIB + " " + program + " 2>&1";
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

// Runs the driver under the shim with `env`.
Result RunDriver(const std::string& env) { return RunUnderShim(env, VRAMLEDGER_PRELOAD_DRIVER); }

// The text of the only file in `dir` whose name contains `part` ("" when none or several).
std::string ReadOnlyFile(const std::string& dir, const std::string& part) {
  std::string found;
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().filename().string().find(part) == std::string::npos) continue;
    ++n;
    std::ifstream in(entry.path());
    std::stringstream text;
    text << in.rdbuf();
    found = text.str();
  }
  return n == 1 ? found : "";
}

// Writes a plan limiting the device to 64 MiB reserved and returns its path.
std::string SmallPlan(const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/plan.json";
  std::ofstream(path) << "{\n  \"vramledger_plan\": 1,\n  \"limit\": \"64MiB\"\n}\n";
  return path;
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
  // Host time is not measured unless host_timing is on (HostTimingTimesInterposedCalls).
  EXPECT_EQ(shim["host_time_us"]["interposed_calls"], 0) << r.output;
  EXPECT_EQ(shim["host_time_us"]["allocator_malloc"], 0) << r.output;
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
  EXPECT_THAT(r.output, HasSubstr("host time in those calls: not measured"));
  std::filesystem::remove_all(dumps);
}

// host_timing:True: the interposed calls as a whole take at least what the allocator took inside
// them, and the exit summary says both.
TEST(PreloadTest, HostTimingTimesInterposedCalls) {
  const std::string dumps = TempDir("vl-preload-timing");
  const Result r = RunDriver("VRAMLEDGER_CONF=host_timing:True,dump_dir:" + dumps);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json host = DriverJson(r.output)["shim"]["host_time_us"];
  EXPECT_GT(host["allocator_malloc"].get<double>(), 0) << r.output;
  EXPECT_GT(host["allocator_free"].get<double>(), 0) << r.output;
  EXPECT_GE(host["interposed_calls"].get<double>(),
            host["allocator_malloc"].get<double>() + host["allocator_free"].get<double>())
      << r.output;
  EXPECT_THAT(r.output, HasSubstr("host time inside the allocator: malloc "));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("not measured")));
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

// Memory taken behind the runtime's back (the driver API) is not served, and the exit summary
// says how much: cudaMemGetInfo's growth since the allocator's creation less vramledger's
// reserved bytes, exactly the fake's "outside" bytes.
TEST(PreloadTest, ExitSummaryCountsBytesOutsideVramledger) {
  const std::string dumps = TempDir("vl-preload-out");
  const Result r =
      RunDriver("PRELOAD_DRIVER_OUTSIDE_BYTES=50000000 VRAMLEDGER_CONF=dump_dir:" + dumps);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = DriverJson(r.output);
  EXPECT_EQ(j["failures"], 0) << r.output;
  EXPECT_EQ(j["shim"]["served_allocations"], 16);
  const std::string summary = ReadOnlyFile(dumps, "-exit.txt");
  EXPECT_THAT(summary, HasSubstr("device bytes used outside vramledger: 50000000 ("));
  EXPECT_THAT(summary, HasSubstr("cudaMemGetInfo used delta "));
  // The same figure in the exit snapshot.
  const nlohmann::json snapshot = nlohmann::json::parse(ReadOnlyFile(dumps, "-exit.json"));
  EXPECT_EQ(
      snapshot["vramledger"]["preload"]["device_bytes_outside_vramledger"]["0"]["outside_bytes"],
      50000000);
  std::filesystem::remove_all(dumps);
}

TEST(PreloadTest, ExitSummaryWithNothingOutsideSaysZero) {
  const std::string dumps = TempDir("vl-preload-zero");
  const Result r = RunDriver("VRAMLEDGER_CONF=dump_dir:" + dumps);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(ReadOnlyFile(dumps, "-exit.txt"),
              HasSubstr("device bytes used outside vramledger: 0 ("));
  std::filesystem::remove_all(dumps);
}

// Refusals on a thread of the program come back as CUDA error codes; the process goes on.
TEST(PreloadTest, RefusalsOnAProgramThreadReturnCudaErrors) {
  const std::string dumps = TempDir("vl-preload-thread");
  const Result r = RunDriver("PRELOAD_DRIVER_REFUSE_ON_THREAD=1 VRAMLEDGER_CONF=dump_dir:" + dumps);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = DriverJson(r.output);
  EXPECT_EQ(j["thread_refused"], 4) << r.output;
  EXPECT_EQ(j["thread_freed"], 1) << r.output;
  std::filesystem::remove_all(dumps);
}

// A guard refusal in a program without Python: no crash, the report (stderr and a file in the
// dump directory) names the plan line and shows the native frames.
TEST(PreloadTest, RefusalWithoutPythonShowsNativeFrames) {
  const std::string dumps = TempDir("vl-preload-native");
  const std::string plan = SmallPlan(dumps + "-plan");
  const Result r = RunDriver("VRAMLEDGER_CONF=dump_dir:" + dumps + ",plan:" + plan);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(DriverJson(r.output)["refused"], 1) << r.output;
  const std::string report = ReadOnlyFile(dumps, "-refusal-1.txt");
  EXPECT_THAT(report, HasSubstr("vramledger plan violation: " + plan + ":3: limit"));
  EXPECT_THAT(report, HasSubstr("captured at the refusal"));
  EXPECT_THAT(report, HasSubstr("[native] "));
  EXPECT_THAT(report, HasSubstr("forensic snapshot: " + dumps + "/"));
  EXPECT_THAT(report, ::testing::Not(HasSubstr(".py:")));
  std::filesystem::remove_all(dumps);
  std::filesystem::remove_all(dumps + "-plan");
}

// Runs tests/torch_plugin/preload/python_frames.py in `mode` under the shim with the 64 MiB plan;
// returns the refusal report written to the dump directory (and the output in *output).
std::string PythonRefusalReport(const std::string& mode, std::string* output) {
  const std::string dumps = TempDir(("vl-preload-py-" + mode).c_str());
  const std::string plan = SmallPlan(dumps + "-plan");
  const Result r = RunUnderShim(
      "VRAMLEDGER_PRELOAD_QUIET=1 VRAMLEDGER_CONF=dump_dir:" + dumps + ",plan:" + plan,
      std::string(VRAMLEDGER_PYTHON) + " " + VRAMLEDGER_SOURCE_DIR +
          "/tests/torch_plugin/preload/python_frames.py " + VRAMLEDGER_FAKE_CUDART + " " + mode);
  *output = r.output;
  std::string report;
  if (r.exit_code == 0 && std::filesystem::exists(dumps)) {
    report = ReadOnlyFile(dumps, "-refusal-1.txt");
  }
  std::filesystem::remove_all(dumps);
  std::filesystem::remove_all(dumps + "-plan");
  return report;
}

// The program holds the GIL when it asks (ctypes.PyDLL): the report names its Python frame.
TEST(PreloadPythonTest, RefusalNamesThePythonFrameWhenTheGilIsHeld) {
  std::string output;
  const std::string report = PythonRefusalReport("gil", &output);
  EXPECT_THAT(output, HasSubstr("RESULT mode=gil error=2"));
  EXPECT_THAT(report, HasSubstr("python_frames.py:20 in ask_for_memory")) << output;
  EXPECT_THAT(report, HasSubstr("in main")) << output;
  EXPECT_THAT(report, HasSubstr("[native] ")) << output;
}

// The main thread released the GIL for the call (ctypes.CDLL, like torch's operators): the
// shim takes it back on that thread for the walk, as torch's recorder does.
TEST(PreloadPythonTest, RefusalNamesThePythonFrameOfTheMainThreadThatReleasedTheGil) {
  std::string output;
  const std::string report = PythonRefusalReport("released", &output);
  EXPECT_THAT(output, HasSubstr("RESULT mode=released error=2"));
  EXPECT_THAT(report, HasSubstr("python_frames.py:20 in ask_for_memory")) << output;
}

// Another thread without the GIL (as autograd's are): never waits for it; C++ frames only.
TEST(PreloadPythonTest, RefusalOnAThreadWithoutTheGilShowsNativeFramesOnly) {
  std::string output;
  const std::string report = PythonRefusalReport("thread", &output);
  EXPECT_THAT(output, HasSubstr("RESULT mode=thread error=2"));
  EXPECT_THAT(report, HasSubstr("vramledger plan violation: ")) << output;
  EXPECT_THAT(report, HasSubstr("[native] ")) << output;
  EXPECT_THAT(report, ::testing::Not(HasSubstr("python_frames.py"))) << output;
}

}  // namespace
