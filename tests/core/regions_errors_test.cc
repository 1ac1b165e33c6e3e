// Pausable regions' failures leave everything as it was (docs/design/regions.md, "Failures"):
// a pause whose pinned allocation, copy or unmap fails; a resume whose handles cannot be
// created, whose map or access fails at some page, whose copy back fails, or that the guard
// refuses. Each is compared with a full description of the allocator and the card before and
// after, and the region then pauses or resumes and restores its contents.
#include "regions_fixture.h"

namespace vramledger {
namespace {

class RegionErrorsTest : public RegionsTest {
 protected:
  void SetUp() override {
    RegionsTest::SetUp();
    a_ = AllocIn("train", 9 * kMiB);  // several handles of 2 MiB
    b_ = AllocIn("train", 5 * kMiB);
    c_ = AllocIn("train", 100 * 1024);  // the region's small pool: a segment of its own
    other_ = AllocIn("rollout", 3 * kMiB);
    Write(a_, Pattern(9 * kMiB, 1));
    Write(b_, Pattern(5 * kMiB, 2));
  }
  void ExpectContents() {
    EXPECT_EQ(Read(a_, 9 * kMiB), Pattern(9 * kMiB, 1));
    EXPECT_EQ(Read(b_, 5 * kMiB), Pattern(5 * kMiB, 2));
  }
  // A refused pause or resume: `code`, and nothing changed.
  void ExpectPauseFails(absl::StatusCode code, RegionBackup backup = RegionBackup::kCpu) {
    const std::string before = Describe();
    auto r = alloc_->PauseRegion("train", backup);
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find("train"), std::string::npos) << r.status();
    EXPECT_EQ(Describe(), before);
    Check();
  }
  void ExpectResumeFails(absl::StatusCode code) {
    const std::string before = Describe();
    auto r = alloc_->ResumeRegion("train", false);
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_EQ(Describe(), before);
    Check();
  }

  DevicePtr a_ = 0;
  DevicePtr b_ = 0;
  DevicePtr c_ = 0;
  DevicePtr other_ = 0;
};

TEST_F(RegionErrorsTest, APinnedAllocationThatFailsLeavesTheRegionAsItWas) {
  sim_->SetPinnedCapacity(14 * kMiB + 50 * 1024);  // the large segment's buffer fits, not both
  ExpectPauseFails(absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(sim_->pinned_bytes(), 0u);  // the buffer it did get is freed again
  sim_->SetPinnedCapacity(SIZE_MAX);
  Pause("train", RegionBackup::kCpu);
  Resume("train");
  ExpectContents();
}

TEST_F(RegionErrorsTest, ACopyThatFailsLeavesTheRegionAsItWas) {
  for (int skip : {0, 1}) {
    sim_->FailCopy(skip, absl::InternalError("cudaMemcpy: injected"));
    ExpectPauseFails(absl::StatusCode::kInternal);
    EXPECT_EQ(sim_->pinned_bytes(), 0u);
  }
  Pause("train", RegionBackup::kCpu);
  Resume("train");
  ExpectContents();
}

TEST_F(RegionErrorsTest, AnUnmapThatFailsMidwayMapsTheOthersBack) {
  // Four handles: the large segment's three as the allocations made them (the 4 pages a_ covers
  // whole, the page a_ and b_ share, the 2 pages b_ covers whole) and the small segment's one.
  for (int skip : {0, 2, 3}) {
    sim_->FailCall(DriverCall::kMemUnmap, skip, absl::InternalError("cuMemUnmap: injected"));
    ExpectPauseFails(absl::StatusCode::kInternal, RegionBackup::kNone);
    ExpectContents();  // the same handles, mapped back: nothing lost, no backup needed
  }
  Pause("train", RegionBackup::kNone);
  Resume("train");
}

TEST_F(RegionErrorsTest, AResumeWithoutRoomOnTheCardLeavesItPausedWithItsBackups) {
  Pause("train", RegionBackup::kCpu);
  const std::size_t pinned = sim_->pinned_bytes();
  sim_->SetCapacity(sim_->used_bytes() + 4 * kMiB);  // room for two of its handles only
  const std::string before = Describe();
  auto r = alloc_->ResumeRegion("train", false);
  EXPECT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("region 'train'"), std::string::npos);
  EXPECT_NE(r.status().message().find("out of memory"), std::string::npos);
  EXPECT_EQ(Describe(), before);
  EXPECT_EQ(sim_->pinned_bytes(), pinned);
  sim_->SetCapacity(64 * kGiB);
  Resume("train");
  ExpectContents();
}

TEST_F(RegionErrorsTest, AMapOrAccessThatFailsAtPageKUnmapsWhatItMapped) {
  Pause("train", RegionBackup::kCpu);
  // The resume maps two handles (the large segment's pages are all used: one handle; the small
  // segment's page) and grants access once per segment.
  for (int skip : {0, 1}) {
    sim_->FailCall(DriverCall::kMemMap, skip, absl::InternalError("cuMemMap: injected"));
    ExpectResumeFails(absl::StatusCode::kInternal);
    sim_->FailCall(DriverCall::kMemSetAccess, skip, absl::InternalError("cuMemSetAccess: x"));
    ExpectResumeFails(absl::StatusCode::kInternal);
  }
  Resume("train");
  ExpectContents();
}

TEST_F(RegionErrorsTest, ACopyBackThatFailsKeepsTheBackups) {
  Pause("train", RegionBackup::kCpu);
  sim_->FailCopy(1, absl::InternalError("cudaMemcpy: injected"));
  ExpectResumeFails(absl::StatusCode::kInternal);
  EXPECT_EQ(Info("train").backed_up_bytes, 14 * kMiB + 100 * 1024);
  Resume("train");
  ExpectContents();
}

// A guard that refuses growth past a limit, naming its plan line, as the budget guard does.
class LimitHooks : public AllocatorHooks {
 public:
  absl::Status CheckGrowth(const AllocationRequest& request, std::size_t reserved_after,
                           const HookStats& stats) override {
    last_request = request;
    last_stats = stats;
    if (reserved_after <= limit) return absl::OkStatus();
    return absl::ResourceExhaustedError(
        absl::StrCat("vramledger plan: limit ", limit, " bytes would be exceeded"));
  }
  std::size_t limit = SIZE_MAX;
  AllocationRequest last_request;
  HookStats last_stats;
};

TEST_F(RegionErrorsTest, TheGuardRefusesAResumeWithItsPlanLine) {
  LimitHooks hooks;
  alloc_->SetHooks(&hooks);
  Pause("train", RegionBackup::kCpu);
  // The guard counts the region only while it runs: its live bytes are out of the figures.
  hooks.limit = static_cast<std::size_t>(Reserved());
  const std::string before = Describe();
  auto r = alloc_->ResumeRegion("train", false);
  EXPECT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("vramledger plan: limit"), std::string::npos);
  EXPECT_EQ(hooks.last_request.size, Info("train").paused_bytes);
  EXPECT_EQ(hooks.last_stats.allocated_bytes, Allocated());
  EXPECT_EQ(Describe(), before);
  hooks.limit = SIZE_MAX;
  Resume("train");
  ExpectContents();
  alloc_->SetHooks(nullptr);
}

TEST_F(RegionErrorsTest, TheMemoryFractionCapsAResume) {
  Pause("train", RegionBackup::kNone);
  std::size_t free_bytes = 0;
  std::size_t total = 0;
  ASSERT_TRUE(sim_->MemGetInfo(&free_bytes, &total).ok());
  ASSERT_TRUE(
      alloc_->SetMemoryFraction(static_cast<double>(Reserved() + kMiB) / static_cast<double>(total))
          .ok());
  ExpectResumeFails(absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(alloc_->SetMemoryFraction(1.0).ok());
  Resume("train");
}

// A capture into pool p begun inside use_mem_pool(p) on one thread, and use_mem_pool's end
// before the capture's (torch's private bindings allow that order): the end cannot tell which
// of the two entries it ends, so the capture still counts as under way. A pause or resume of
// any region is refused, naming the capture and saying what to do, with nothing changed; a
// free beside the capture records no event; once the capture ends, both run.
TEST_F(RegionErrorsTest, APauseOrResumeBesideACaptureWhoseUseMemPoolEndedFirstIsRefused) {
  constexpr StreamId kCapture = 0x30;
  constexpr StreamId kEager = 0x20;
  constexpr MempoolId kPool{3, 0};
  Pause("rollout", RegionBackup::kNone);
  ASSERT_TRUE(alloc_->BeginAllocateToPool(kPool, [](StreamId) { return true; }).ok());
  const DevicePtr eager = Alloc(512, kEager);  // use_mem_pool's, on a stream that does not capture
  SimBackend* sim = sim_.get();
  ASSERT_TRUE(alloc_
                  ->BeginAllocateToPool(
                      kPool, [sim](StreamId s) { return s == kCapture && sim->IsCapturing(s); })
                  .ok());
  sim_->SetCapturing(kCapture, true);
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());  // use_mem_pool's end
  const std::string before = Describe();
  for (const bool pause : {true, false}) {
    const absl::Status s = pause ? alloc_->PauseRegion("train", RegionBackup::kCpu).status()
                                 : alloc_->ResumeRegion("rollout", false).status();
    EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
    for (const char* part :
         {pause ? "'train'" : "'rollout'", "CUDA graph capture", "private pool (3, 0)",
          "nothing was changed", "after the capture ends"}) {
      EXPECT_NE(s.message().find(part), std::string_view::npos) << part << " in " << s;
    }
    EXPECT_EQ(Describe(), before);
  }
  ASSERT_TRUE(alloc_->RecordStream(eager, 0).ok());
  const std::int64_t records = Calls(DriverCall::kEventRecord);
  Free(eager);
  EXPECT_EQ(Calls(DriverCall::kEventRecord), records);  // deferred until no capture is under way
  EXPECT_EQ(sim_->calls_during_capture_not_relaxed(), 0);
  sim_->SetCapturing(kCapture, false);
  ASSERT_TRUE(alloc_->EndAllocateToPool(kPool).ok());  // the capture's end
  Pause("train", RegionBackup::kCpu);
  Resume("train");
  Resume("rollout");
  ExpectContents();
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
}

}  // namespace
}  // namespace vramledger
