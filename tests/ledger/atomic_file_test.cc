// A disk that fills up at any byte of a write (RLIMIT_FSIZE: writes past it fail with EFBIG, as
// ENOSPC would): WriteFileAtomically, the snapshot file and the OOM forensic dump leave the old
// file or the complete new one, never a part, and no temporary file; the error names the file.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "device/sim_backend.h"
#include "ledger/atomic_file.h"
#include "ledger/oom_dump.h"
#include "ledger/snapshot.h"
#include "vramledger/device_allocator.h"

namespace vramledger {
namespace {

namespace fs = std::filesystem;

// While alive, a write that would take any file of this process past `bytes` fails (EFBIG).
class DiskFullAt {
 public:
  explicit DiskFullAt(std::size_t bytes) {
    getrlimit(RLIMIT_FSIZE, &old_);
    rlimit limit = old_;
    limit.rlim_cur = bytes;
    EXPECT_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0);
  }
  ~DiskFullAt() { setrlimit(RLIMIT_FSIZE, &old_); }

 private:
  rlimit old_{};
};

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Every file in `dir`, by name.
std::vector<std::string> Files(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  return names;
}

class DiskFullTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Past the limit the kernel also sends SIGXFSZ, which would end the process.
    previous_ = std::signal(SIGXFSZ, SIG_IGN);
    dir_ = fs::temp_directory_path() /
           absl::StrCat("vramledger-diskfull-", ::getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::signal(SIGXFSZ, previous_);
    fs::remove_all(dir_);
  }
  fs::path dir_;
  void (*previous_)(int) = SIG_DFL;
};

// Cut points: the first bytes, both sides of the writer's 256 KiB buffer, and a stride through.
std::vector<std::size_t> CutPoints(std::size_t size) {
  std::vector<std::size_t> cuts = {0, 1, 2, 511, 4096};
  for (std::size_t b = 256 * 1024; b < size; b += 256 * 1024) {
    cuts.insert(cuts.end(), {b - 1, b, b + 1});
  }
  for (std::size_t at = 7; at < size; at += size / 37 + 1) cuts.push_back(at);
  cuts.push_back(size - 1);
  return cuts;
}

TEST_F(DiskFullTest, AnInterruptedWriteLeavesTheOldFileWholeAndNoTemporary) {
  const std::string path = (dir_ / "out.bin").string();
  const std::string old_content(1000, 'o');
  ASSERT_TRUE(WriteFileAtomically(path, [&](std::ostream& out) {
                out << old_content;
                return absl::OkStatus();
              }).ok());
  const std::string content(600 * 1024 + 123, 'n');
  for (const std::size_t cut : CutPoints(content.size())) {
    SCOPED_TRACE(absl::StrCat("disk full at byte ", cut));
    absl::Status status;
    {
      DiskFullAt full(cut);
      status = WriteFileAtomically(path, [&](std::ostream& out) {
        out << content;
        return absl::OkStatus();
      });
    }
    ASSERT_FALSE(status.ok());
    EXPECT_TRUE(absl::StrContains(status.message(), "cannot write " + path + ".tmp-")) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), "File too large")) << status;
    EXPECT_EQ(ReadFile(path), old_content);
    EXPECT_EQ(Files(dir_), std::vector<std::string>{"out.bin"});
  }
  // With room again the new content replaces the old whole.
  ASSERT_TRUE(WriteFileAtomically(path, [&](std::ostream& out) {
                out << content;
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(ReadFile(path), content);
}

// A rename that fails (the target is a directory) removes the temporary file.
TEST_F(DiskFullTest, AFailedRenameLeavesNoTemporary) {
  const fs::path target = dir_ / "taken";
  fs::create_directories(target / "inside");
  const absl::Status status = WriteFileAtomically(target.string(), [](std::ostream& out) {
    out << "x";
    return absl::OkStatus();
  });
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(absl::StrContains(status.message(), "cannot rename")) << status;
  EXPECT_EQ(Files(dir_), std::vector<std::string>{"taken"});
}

class DumpDiskFullTest : public DiskFullTest {
 protected:
  void SetUp() override {
    DiskFullTest::SetUp();
    SimBackend::Config config;
    config.capacity = 8 * kGiB;
    sim_ = std::make_unique<SimBackend>(config);
    alloc_ = std::make_unique<DeviceAllocator>(Options(), sim_.get());
    for (int i = 0; i < 4000; ++i) {  // enough blocks for a dump of more than one buffer
      auto p =
          alloc_->Malloc(static_cast<std::size_t>(1 + i % 500) * 512, static_cast<StreamId>(i % 3));
      ASSERT_TRUE(p.ok()) << p.status();
      if (i % 2 == 0) {
        ASSERT_TRUE(alloc_->Free(*p).ok());
      }
    }
  }
  void TearDown() override {
    alloc_.reset();
    DiskFullTest::TearDown();
  }
  std::unique_ptr<SimBackend> sim_;
  std::unique_ptr<DeviceAllocator> alloc_;
};

// The snapshot file (dump_snapshot's JSON): the old snapshot or the complete new one.
TEST_F(DumpDiskFullTest, SnapshotFileIsTheOldOrTheWholeNewOne) {
  const std::string path = (dir_ / "snap.json").string();
  ASSERT_TRUE(WriteSnapshotJsonFile(path, {alloc_.get()}, nullptr).ok());
  const std::string old_content = ReadFile(path);
  ASSERT_GT(old_content.size(), 256u * 1024) << "the dump should span several buffers";
  ASSERT_TRUE(alloc_->Malloc(kMiB, 0).ok());  // the next snapshot differs
  for (const std::size_t cut : CutPoints(old_content.size())) {
    SCOPED_TRACE(absl::StrCat("disk full at byte ", cut));
    absl::Status status;
    {
      DiskFullAt full(cut);
      status = WriteSnapshotJsonFile(path, {alloc_.get()}, nullptr);
    }
    ASSERT_FALSE(status.ok());
    EXPECT_TRUE(absl::StrContains(status.message(), path)) << status;
    EXPECT_EQ(ReadFile(path), old_content);
    EXPECT_EQ(Files(dir_), std::vector<std::string>{"snap.json"});
  }
  ASSERT_TRUE(WriteSnapshotJsonFile(path, {alloc_.get()}, nullptr).ok());
  EXPECT_NE(ReadFile(path), old_content);
  EXPECT_TRUE(nlohmann::json::accept(ReadFile(path)));
}

// An OOM forensic dump cut short leaves no partial dump beside the complete earlier ones, and
// prunes none of them.
TEST_F(DumpDiskFullTest, AnInterruptedOomDumpLeavesOnlyCompleteDumps) {
  OomDumpConfig config;
  config.dump_dir = (dir_ / "dumps").string();
  config.max_dumps = 2;
  config.message = "CUDA out of memory. Tried to allocate 1.00 GiB.";
  absl::StatusOr<std::string> first = WriteOomDump(config, {alloc_.get()}, nullptr);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string first_content = ReadFile(*first);
  for (const std::size_t cut : CutPoints(first_content.size())) {
    SCOPED_TRACE(absl::StrCat("disk full at byte ", cut));
    absl::StatusOr<std::string> dump;
    {
      DiskFullAt full(cut);
      dump = WriteOomDump(config, {alloc_.get()}, nullptr);
    }
    ASSERT_FALSE(dump.ok());
    EXPECT_TRUE(absl::StrContains(dump.status().message(), config.dump_dir)) << dump.status();
    EXPECT_EQ(Files(config.dump_dir), std::vector<std::string>{fs::path(*first).filename()});
    EXPECT_EQ(ReadFile(*first), first_content);
  }
  absl::StatusOr<std::string> next = WriteOomDump(config, {alloc_.get()}, nullptr);
  ASSERT_TRUE(next.ok()) << next.status();
  for (const std::string& name : Files(config.dump_dir)) {
    EXPECT_TRUE(absl::StartsWith(name, kOomDumpPrefix) && absl::EndsWith(name, kOomDumpSuffix))
        << name;
    EXPECT_TRUE(nlohmann::json::accept(ReadFile(fs::path(config.dump_dir) / name))) << name;
  }
}

}  // namespace
}  // namespace vramledger
