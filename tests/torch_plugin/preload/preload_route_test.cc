// Tests of the LD_PRELOAD shim's route into torch: the pure decision (route_choice.h), then whole
// processes under the shim: fake torch folders of another minor, a backend the environment names,
// no native library beside the shim, a native library that cannot load, a bare-name dlopen
// through the caller's RUNPATH, and (where torch and the native library are built) a CPU torch
// process whose allocator becomes vramledger's, with a plan refusal and the exit summary.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "torch_plugin/preload/route_choice.h"

namespace vramledger::preload {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

// ---- The decision ----

TEST(RouteChoiceTest, TorchMinorOfAVersion) {
  EXPECT_EQ(TorchMinorOf("2.11.0+cu130"), "2.11");
  EXPECT_EQ(TorchMinorOf("2.9.1"), "2.9");
  EXPECT_EQ(TorchMinorOf("10.0a0"), "10.0");
  EXPECT_EQ(TorchMinorOf("2"), "");
  EXPECT_EQ(TorchMinorOf("v2.11"), "");
  EXPECT_EQ(TorchMinorOf(""), "");
}

fs::path TempDir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / (name + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A fake torch package: <root>/torch/version.py saying `version` and torch/lib/libc10_cuda.so.
fs::path FakeTorch(const fs::path& root, const std::string& version) {
  const fs::path torch = root / "torch";
  fs::create_directories(torch / "lib");
  std::ofstream(torch / "version.py") << "from typing import Optional\n\n"
                                      << "__version__ = '" << version << "'\ndebug = False\n";
  fs::copy_file(VRAMLEDGER_FAKE_C10_CUDA, torch / "lib" / "libc10_cuda.so");
  return torch / "lib" / "libc10_cuda.so";
}

TEST(RouteChoiceTest, VersionBesideTorchsLibraries) {
  const fs::path root = TempDir("vl-route-version");
  const fs::path c10 = FakeTorch(root, "2.11.0+cu130");
  EXPECT_EQ(TorchDirOf(c10.string()), (root / "torch").string());
  EXPECT_EQ(TorchDirOf((root / "torch" / "_C.cpython-311-x86_64-linux-gnu.so").string()),
            (root / "torch").string());
  EXPECT_EQ(ReadTorchVersionIn((root / "torch").string()), "2.11.0+cu130");
  // A libtorch distribution records its version in build-version.
  fs::create_directories(root / "libtorch" / "lib");
  std::ofstream(root / "libtorch" / "build-version") << "2.10.1+cpu\n";
  EXPECT_EQ(TorchDirOf((root / "libtorch" / "lib" / "libtorch.so").string()),
            (root / "libtorch").string());
  EXPECT_EQ(ReadTorchVersionIn((root / "libtorch").string()), "2.10.1+cpu");
  // Elsewhere: no version, no torch folder.
  EXPECT_EQ(TorchDirOf((root / "other" / "libc10_cuda.so").string()), "");
  EXPECT_EQ(ReadTorchVersionIn(""), "");
  fs::remove_all(root);
}

TEST(RouteChoiceTest, OnlyTorchsOwnLibrariesAreWatched) {
  EXPECT_TRUE(MayLoadTorch("/x/torch/lib/libtorch_global_deps.so"));
  EXPECT_TRUE(MayLoadTorch("/x/torch/lib/libc10_cuda.so"));
  EXPECT_TRUE(MayLoadTorch("/x/torch/_C.cpython-311-x86_64-linux-gnu.so"));
  EXPECT_FALSE(MayLoadTorch("/x/numpy/core/_multiarray_umath.so"));
  EXPECT_FALSE(MayLoadTorch("/x/torch/_C/libfoo.so"));
}

TEST(RouteChoiceTest, DefaultLibraryFoldersAreTheLoadersOwn) {
  for (const char* dir : {"/lib", "/usr/lib", "/lib64", "/usr/lib64", "/lib/x86_64-linux-gnu",
                          "/usr/lib/x86_64-linux-gnu/", "/usr/lib/glibc-hwcaps/x86-64-v3",
                          "/lib/x86_64-linux-gnu/glibc-hwcaps/x86-64-v2"}) {
    EXPECT_TRUE(IsDefaultLibraryDir(dir)) << dir;
  }
  for (const char* dir : {"/usr/lib/x86_64-linux-gnu/openmpi/lib", "/usr/local/lib", "/libx",
                          "/opt/venv/lib/python3.11/site-packages/torch/lib", "lib", ""}) {
    EXPECT_FALSE(IsDefaultLibraryDir(dir)) << dir;
  }
}

TEST(RouteChoiceTest, BackendAsTorchReadsIt) {
  EXPECT_EQ(NamedBackend(nullptr, nullptr), "");
  EXPECT_EQ(NamedBackend("expandable_segments:True", nullptr), "");
  EXPECT_EQ(NamedBackend("expandable_segments:True, backend: native", nullptr), "native");
  EXPECT_EQ(NamedBackend(nullptr, "backend:cudaMallocAsync"), "cudaMallocAsync");
  // PYTORCH_CUDA_ALLOC_CONF set hides PYTORCH_ALLOC_CONF, as in torch.
  EXPECT_EQ(NamedBackend("max_split_size_mb:64", "backend:cudaMallocAsync"), "");
}

TEST(RouteChoiceTest, DirectOnlyForTheMinorTheLibraryWasBuiltFor) {
  RouteInputs in{"2.11.0+cu130", true, "/v", "2.11"};
  RouteChoice c = ChooseRoute(in);
  EXPECT_TRUE(c.direct);
  EXPECT_EQ(c.warning, "");
  in.running_version = "2.10.2";
  c = ChooseRoute(in);
  EXPECT_FALSE(c.direct);
  EXPECT_THAT(c.warning, HasSubstr("libvramledger_native.so was built for torch 2.11, but torch "
                                   "2.10 is running"));
  EXPECT_EQ(c.warning.find('\n'), std::string::npos);
  in.running_version = "";
  EXPECT_THAT(ChooseRoute(in).warning, HasSubstr("torch unknown is running"));
  in = {"2.11.0", false, "/opt/vl", "2.11"};
  c = ChooseRoute(in);
  EXPECT_FALSE(c.direct);
  EXPECT_THAT(c.warning, HasSubstr("no libvramledger_native.so beside the shim in /opt/vl "
                                   "(vramledger built for torch 2.11; torch 2.11 is running)"));
}

// ---- Whole processes ----

struct Result {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

Result RunCommand(const std::string& command) {
  Result result;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  char buf[4096];
  std::size_t n = 0;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) result.output.append(buf, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// The driver under `shim`, dlopening `path`; env unset: PYTORCH_CUDA_ALLOC_CONF and
// PYTORCH_ALLOC_CONF start empty unless `env` sets them.
Result DlopenUnderShim(const std::string& shim, const std::string& path,
                       const std::string& env = "") {
  return RunCommand("env -u PYTORCH_CUDA_ALLOC_CONF -u PYTORCH_ALLOC_CONF " + env +
                    " PRELOAD_DRIVER_DLOPEN=" + path + " LD_PRELOAD=" + shim + " " +
                    VRAMLEDGER_PRELOAD_DRIVER);
}

nlohmann::json LastJson(const std::string& output) {
  const std::size_t at = output.rfind("{\"dlopen\"");
  if (at == std::string::npos) return nlohmann::json();
  return nlohmann::json::parse(output.substr(at, output.find('\n', at) - at));
}

int Count(const std::string& text, const std::string& part) {
  int n = 0;
  for (std::size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) {
    ++n;
  }
  return n;
}

// torch of another minor, seen before libc10_cuda.so loads: one warning naming both versions,
// and torch's cudaMallocAsync backend set in time for torch's load-time choice.
TEST(PreloadRouteTest, TorchOfAnotherMinorFallsBackBeforeItLoads) {
  const fs::path root = TempDir("vl-route-minor");
  const fs::path c10 = FakeTorch(root, "2.0.1");
  const Result r = DlopenUnderShim(VRAMLEDGER_PRELOAD_LIB, c10.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = LastJson(r.output);
  EXPECT_EQ(j["dlopen"], true) << r.output;
  EXPECT_EQ(j["probe"], 1) << r.output;
  EXPECT_EQ(j["alloc_conf"], "backend:cudaMallocAsync") << r.output;
  EXPECT_EQ(Count(r.output, "vramledger: "), 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("was built for torch "));
  EXPECT_THAT(r.output, HasSubstr(", but torch 2.0 is running"));
  fs::remove_all(root);
}

// The program named torch's backend itself: torch stays its allocator, silently, as before.
TEST(PreloadRouteTest, NamedBackendKeepsTheInterpositionSilently) {
  const fs::path root = TempDir("vl-route-named");
  const fs::path c10 = FakeTorch(root, "2.0.1");
  const Result r =
      DlopenUnderShim(VRAMLEDGER_PRELOAD_LIB, c10.string(),
                      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,backend:native");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(LastJson(r.output)["alloc_conf"], "expandable_segments:True,backend:native");
  EXPECT_THAT(r.output, Not(HasSubstr("vramledger: ")));
  fs::remove_all(root);
}

// A program without torch: nothing is set, nothing is said.
TEST(PreloadRouteTest, ProgramWithoutTorchIsLeftAlone) {
  const Result r = DlopenUnderShim(VRAMLEDGER_PRELOAD_LIB, VRAMLEDGER_FAKE_CALLER);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(LastJson(r.output)["alloc_conf"], "");
  EXPECT_THAT(r.output, Not(HasSubstr("vramledger: ")));
}

// A library that dlopens its sibling by bare name finds it through its own RUNPATH, although the
// shim's dlopen stands between them.
TEST(PreloadRouteTest, BareNameDlopenKeepsTheCallersRunpath) {
  const Result r = DlopenUnderShim(VRAMLEDGER_PRELOAD_LIB, VRAMLEDGER_FAKE_CALLER);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(LastJson(r.output)["probe"], 42) << r.output;
  // A name found nowhere still fails as dlopen fails.
  const Result missing = DlopenUnderShim(VRAMLEDGER_PRELOAD_LIB, "libvl_no_such_library.so");
  EXPECT_EQ(LastJson(missing.output)["dlopen"], false) << missing.output;
  EXPECT_THAT(LastJson(missing.output)["error"].get<std::string>(),
              HasSubstr("libvl_no_such_library.so"));
}

// The shim's folder without libvramledger_native.so (symbolic links to everything else).
fs::path ShimWithoutNative(const fs::path& dir) {
  fs::create_directories(dir);
  const fs::path shim(VRAMLEDGER_PRELOAD_LIB);
  for (const auto& entry : fs::directory_iterator(shim.parent_path())) {
    if (entry.path().filename() == "libvramledger_native.so") continue;
    fs::create_symlink(entry.path(), dir / entry.path().filename());
  }
  return dir / shim.filename();
}

TEST(PreloadRouteTest, NoNativeLibraryBesideTheShimFallsBackNamingBoth) {
  const fs::path root = TempDir("vl-route-absent");
  const fs::path c10 = FakeTorch(root, "2.11.0+cu130");
  const fs::path shim = ShimWithoutNative(root / "vl");
  const Result r = DlopenUnderShim(shim.string(), c10.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(LastJson(r.output)["alloc_conf"], "backend:cudaMallocAsync") << r.output;
  EXPECT_EQ(Count(r.output, "vramledger: "), 1) << r.output;
  EXPECT_THAT(r.output,
              HasSubstr("no libvramledger_native.so beside the shim in " + (root / "vl").string()));
  EXPECT_THAT(r.output, HasSubstr("torch 2.11 is running"));
  fs::remove_all(root);
}

// A torch of the right minor whose libraries the native library cannot load with (the fake
// libc10_cuda.so has none of torch's symbols): decided after torch loaded, so the warning names
// the failure and torch keeps the backend it chose at load (nothing is set late).
TEST(PreloadRouteTest, NativeLibraryThatCannotLoadFallsBackAfterTorchLoaded) {
  if (!VRAMLEDGER_NATIVE_BUILT) GTEST_SKIP() << "no libvramledger_native.so in this build";
  const fs::path root = TempDir("vl-route-load");
  const fs::path c10 = FakeTorch(root, "2.11.0+cu130");
  const Result r = DlopenUnderShim(VRAMLEDGER_PRELOAD_LIB, c10.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(LastJson(r.output)["probe"], 1) << r.output;
  EXPECT_EQ(LastJson(r.output)["alloc_conf"], "") << r.output;
  EXPECT_EQ(Count(r.output, "vramledger: "), 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("vramledger: cannot load "));
  EXPECT_THAT(r.output, HasSubstr("libvramledger_native.so"));
  fs::remove_all(root);
}

#ifdef VRAMLEDGER_LINKED_TORCH
// A C++ program linked to libtorch: torch loaded and picked its backend before the shim's
// constructor, which decides the route there; a backend the environment names keeps torch's.
TEST(PreloadRouteTest, ProgramLinkedToTorchIsDecidedAtTheConstructor) {
  const std::string env = "env -u PYTORCH_CUDA_ALLOC_CONF -u PYTORCH_ALLOC_CONF ";
  const std::string shim = std::string(" LD_PRELOAD=") + VRAMLEDGER_PRELOAD_LIB + " ";
  EXPECT_THAT(RunCommand(env + VRAMLEDGER_LINKED_TORCH).output, HasSubstr("ALLOCATOR native"));
  const Result direct = RunCommand(env + shim + VRAMLEDGER_LINKED_TORCH);
  EXPECT_EQ(direct.exit_code, 0) << direct.output;
  EXPECT_THAT(direct.output, HasSubstr("ALLOCATOR vramledger"));
  EXPECT_THAT(direct.output, Not(HasSubstr("vramledger: ")));
  const Result named =
      RunCommand(env + "PYTORCH_CUDA_ALLOC_CONF=backend:native" + shim + VRAMLEDGER_LINKED_TORCH);
  EXPECT_THAT(named.output, HasSubstr("ALLOCATOR native"));
}
#endif

// The real thing on a CPU: torch imported under the shim gets vramledger as its allocator before
// CUDA starts (get_allocator_backend), with PYTORCH_CUDA_ALLOC_CONF left alone; allocations of the
// plugin's runtime on a simulated device show in the shim's exit summary and snapshot, and a plan
// refusal writes the shim's refusal report.
TEST(PreloadRouteTest, TorchProcessGetsVramledgerAsItsAllocator) {
  if (!VRAMLEDGER_NATIVE_BUILT) GTEST_SKIP() << "no libvramledger_native.so in this build";
  const std::string python = VRAMLEDGER_PYTHON;
  if (RunCommand(python + " -c 'import torch'").exit_code != 0)
    GTEST_SKIP() << "no torch in " << python;
  const fs::path root = TempDir("vl-route-torch");
  std::ofstream(root / "plan.json") << "{\n  \"vramledger_plan\": 1,\n  \"limit\": \"64MiB\"\n}\n";
  std::ofstream(root / "program.py")
      << "import ctypes, os, sys, torch\n"
         "print('BACKEND', torch.cuda.get_allocator_backend(), "
         "os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))\n"
         "plugin = ctypes.CDLL(sys.argv[1])  # the copy the shim loaded: one runtime\n"
         "assert plugin.vramledger_testing_use_sim_backend(1, ctypes.c_size_t(1 << 30)) == 0\n"
         "plugin.vramledger_testing_malloc.restype = ctypes.c_void_p\n"
         "ok = plugin.vramledger_testing_malloc(ctypes.c_size_t(8 << 20), 0, None)\n"
         "refused = plugin.vramledger_testing_malloc(ctypes.c_size_t(256 << 20), 0, None)\n"
         "print('ALLOCATED', ok is not None, 'REFUSED', refused is None)\n"
         "import signal, time\n"
         "os.kill(os.getpid(), signal.SIGUSR1)  # dumped by the direct route's thread\n"
         "time.sleep(1)\n";
  const fs::path lib_dir = fs::path(VRAMLEDGER_PRELOAD_LIB).parent_path();
  const Result r = RunCommand(
      "env -u PYTORCH_CUDA_ALLOC_CONF -u PYTORCH_ALLOC_CONF VRAMLEDGER_CONF=dump_dir:" +
      (root / "dumps").string() + ",plan:" + (root / "plan.json").string() +
      " LD_PRELOAD=" + VRAMLEDGER_PRELOAD_LIB + " " + python + " " +
      (root / "program.py").string() + " " + (lib_dir / "libvramledger_plugin.so").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("BACKEND vramledger None"));
  EXPECT_THAT(r.output, HasSubstr("ALLOCATED True REFUSED True"));
  EXPECT_THAT(r.output, HasSubstr("route: direct: vramledger is torch "));
  EXPECT_THAT(r.output, HasSubstr("refusals 1\n"));
  EXPECT_THAT(r.output, HasSubstr("device 0: peak allocated 8.00 MiB"));
  EXPECT_THAT(r.output, HasSubstr("vramledger: device 0: allocation refused; report: "));
  std::string report, snapshot, usr1;
  for (const auto& entry : fs::directory_iterator(root / "dumps")) {
    std::stringstream text;
    text << std::ifstream(entry.path()).rdbuf();
    const std::string name = entry.path().filename().string();
    if (name.find("-refusal-1.txt") != std::string::npos) report = text.str();
    if (name.find("-sigusr1-1.txt") != std::string::npos) usr1 = text.str();
    if (name.find("preload-pid") != std::string::npos &&
        name.find("-exit.json") != std::string::npos) {
      snapshot = text.str();
    }
  }
  EXPECT_THAT(report, HasSubstr("vramledger plan violation: " + (root / "plan.json").string() +
                                ":3: limit"));
  EXPECT_THAT(usr1, HasSubstr("vramledger preload summary (sigusr1-1"));
  EXPECT_THAT(usr1, HasSubstr("route: direct: "));
  ASSERT_FALSE(snapshot.empty());
  const nlohmann::json snap = nlohmann::json::parse(snapshot);
  EXPECT_THAT(snap["vramledger"]["preload"]["route"].get<std::string>(), HasSubstr("direct: "));
  EXPECT_EQ(snap["segments"].size(), 1u);
  // preload_disable: the shim decides nothing, torch keeps its allocator.
  const Result off =
      RunCommand("VRAMLEDGER_PRELOAD_DISABLE=1 LD_PRELOAD=" + std::string(VRAMLEDGER_PRELOAD_LIB) +
                 " " + python +
                 " -c 'import torch; print(\"BACKEND\", "
                 "torch.cuda.get_allocator_backend())'");
  EXPECT_THAT(off.output, HasSubstr("BACKEND native")) << off.output;
  fs::remove_all(root);
}

}  // namespace
}  // namespace vramledger::preload
