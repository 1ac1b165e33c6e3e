// The budget guard on SimBackend with a DeviceAllocator: the limit refused only after the cache
// is released, category limits, warn_at once per step, per-tag and per-step peaks, the refusal
// text, the two worked examples (half of the card refuses a 4 GiB request; idle memory of other
// streams is reclaimed before a refusal), and the hooks chain.
#include "guard/budget_guard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "device/sim_backend.h"
#include "guard/hooks_chain.h"
#include "guard/plan.h"
#include "guard/tags.h"
#include "vramledger/device_allocator.h"

namespace vramledger::guard {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

constexpr StreamId kStream = 0;

class GuardTest : public ::testing::Test {
 protected:
  // A device of `capacity` bytes under the plan `plan_json` ("" = no plan: accounting only).
  void Make(const std::string& plan_json, std::size_t capacity = 64 * kGiB,
            const std::string& conf = "") {
    SimBackend::Config config;
    config.capacity = capacity;
    sim_ = std::make_unique<SimBackend>(config);
    auto options = ParseOptions(conf);
    ASSERT_TRUE(options.ok()) << options.status();
    alloc_ = std::make_unique<DeviceAllocator>(*options, sim_.get());
    std::optional<DeviceBudget> budget;
    if (!plan_json.empty()) {
      auto plan = ParsePlan(plan_json, "plan.json", 1);
      ASSERT_TRUE(plan.ok()) << plan.status();
      auto resolved = ResolvePlan(*plan, 0, capacity);
      ASSERT_TRUE(resolved.ok()) << resolved.status();
      budget = *resolved;
    }
    auto guard = BudgetGuard::Create(0, &tags_, budget);
    ASSERT_TRUE(guard.ok()) << guard.status();
    guard_ = *std::move(guard);
    guard_->SetWarningSink([this](const std::string& text) { warnings_.push_back(text); });
    alloc_->SetHooks(guard_.get());
  }
  void TearDown() override {
    if (alloc_) {
      EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
      alloc_->SetHooks(nullptr);
    }
  }
  DevicePtr Alloc(std::size_t size, StreamId stream = kStream) {
    auto p = alloc_->Malloc(size, stream);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : 0;
  }
  std::uint32_t Tag(const std::string& name) { return *tags_.Intern(name); }
  std::int64_t Reserved() { return alloc_->GetStats().reserved_bytes[kAggregate].current; }
  const TagUsage* Usage(const std::vector<TagUsage>& all, const std::string& name) {
    for (const TagUsage& u : all) {
      if (u.name == name) return &u;
    }
    return nullptr;
  }

  TagRegistry tags_;
  std::unique_ptr<SimBackend> sim_;
  std::unique_ptr<DeviceAllocator> alloc_;
  std::unique_ptr<BudgetGuard> guard_;
  std::vector<std::string> warnings_;
};

TEST_F(GuardTest, LimitIsRefusedOnlyAfterTheCacheIsReleased) {
  Make("{\n  \"limit\": \"1GiB\"\n}");
  DevicePtr a = Alloc(600 * kMiB);
  ASSERT_TRUE(alloc_->Free(a).ok());
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(600 * kMiB));  // cached
  // 600 MiB cached + 700 MiB new would pass 1 GiB: the cache goes first, then it fits.
  DevicePtr b = Alloc(700 * kMiB);
  EXPECT_NE(b, 0u);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(700 * kMiB));
  EXPECT_EQ(guard_->refusals(), 0);
  EXPECT_EQ(alloc_->GetStats().num_ooms, 0);
  // Nothing cached is left to release: 700 + 400 MiB is refused.
  auto c = alloc_->Malloc(400 * kMiB, kStream);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(c.status()));
  EXPECT_THAT(
      std::string(c.status().message()),
      StartsWith("vramledger plan violation: plan.json:2: limit: reserved memory would "
                 "grow to 1.07 GiB (1153433600 bytes), past the plan's limit of 1024.00 MiB "
                 "(1073741824 bytes)"));
  EXPECT_EQ(guard_->refusals(), 1);
  EXPECT_EQ(alloc_->GetStats().num_ooms, 1);
  EXPECT_EQ(Reserved(), static_cast<std::int64_t>(700 * kMiB));
  ASSERT_TRUE(alloc_->Free(b).ok());
}

TEST_F(GuardTest, ExpandableSegmentsAreCappedAndTheirPagesCounted) {
  Make("{\"limit\": \"1GiB\"}", 64 * kGiB, "expandable_segments:True");
  DevicePtr a = Alloc(600 * kMiB);
  ASSERT_TRUE(alloc_->Free(a).ok());
  DevicePtr b = Alloc(700 * kMiB);  // reuses or recycles the mapped pages: no refusal
  EXPECT_EQ(guard_->refusals(), 0);
  auto c = alloc_->Malloc(400 * kMiB, kStream);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()),
              StartsWith("vramledger plan violation: plan.json:1: limit: reserved memory would "
                         "grow to "));
  EXPECT_EQ(guard_->refusals(), 1);
  const DeviceStats stats = alloc_->GetStats();
  EXPECT_LE(stats.reserved_bytes[kAggregate].peak, static_cast<std::int64_t>(kGiB));
  const StepRecord step = guard_->EndStep(stats);
  EXPECT_EQ(step.peak_reserved, static_cast<std::uint64_t>(stats.reserved_bytes[kAggregate].peak));
  EXPECT_EQ(step.peak_allocated,
            static_cast<std::uint64_t>(stats.allocated_bytes[kAggregate].peak));
  ASSERT_TRUE(alloc_->Free(b).ok());
}

// The guard refuses the first growth, allows it after the cache is released, and then the device
// itself runs out: that failure is not the guard's, so it is neither counted nor completed as one.
TEST(GuardStaleRefusalTest, ADeviceOomAfterTheGuardRelentedIsNotAPlanViolation) {
  SimBackend::Config config;
  config.capacity = 650 * kMiB;  // the device is smaller than the card the plan was made for
  SimBackend sim(config);
  DeviceAllocator alloc(Options(), &sim);
  TagRegistry tags;
  auto plan = ParsePlan("{\"limit\": \"1GiB\"}", "plan.json", 1);
  ASSERT_TRUE(plan.ok());
  auto guard = BudgetGuard::Create(0, &tags, *ResolvePlan(*plan, 0, 64 * kGiB));
  ASSERT_TRUE(guard.ok());
  alloc.SetHooks(guard->get());
  auto a = alloc.Malloc(600 * kMiB, kStream);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(alloc.Free(*a).ok());
  auto b = alloc.Malloc(700 * kMiB, kStream);  // guard: no, then yes; device: no
  ASSERT_FALSE(b.ok());
  EXPECT_EQ((*guard)->refusals(), 0);
  const absl::Status reported = (*guard)->CompleteRefusal(b.status(), alloc);
  EXPECT_EQ(reported, b.status());  // not completed as a plan violation
  alloc.SetHooks(nullptr);
}

TEST_F(GuardTest, HeadroomLowersTheLimit) {
  Make("{\"limit\": \"1GiB\",\n \"headroom\": \"256MiB\"}");
  EXPECT_NE(Alloc(768 * kMiB), 0u);
  auto refused = alloc_->Malloc(2 * kMiB, kStream);  // a new 2 MiB small segment
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(
      std::string(refused.status().message()),
      HasSubstr("past the plan's limit of 768.00 MiB (805306368 bytes) (limit 1024.00 MiB at "
                "line 1 minus headroom 256.00 MiB at line 2)"));
}

TEST_F(GuardTest, CategoryLimitRefusesAtAllocationForTheThreadTagAndThePhase) {
  Make("{\"category_limits\": {\n  \"activations\": \"100MiB\"\n}}");
  const std::uint32_t act = Tag("activations");
  {
    ScopedThreadTag scope(act);
    EXPECT_NE(Alloc(60 * kMiB), 0u);
    auto over = alloc_->Malloc(50 * kMiB, kStream);
    ASSERT_FALSE(over.ok());
    EXPECT_THAT(std::string(over.status().message()),
                StartsWith("vramledger plan violation: plan.json:2: category_limits.activations: "
                           "live 'activations' bytes would reach 110.00 MiB (115343360 bytes) "
                           "(60.00 MiB live + this request), past the plan's category limit of "
                           "100.00 MiB (104857600 bytes)"));
  }
  EXPECT_NE(Alloc(50 * kMiB), 0u);  // untagged: no limit
  tags_.SetPhase(act);              // e.g. vramledger.phase("backward") on another thread
  EXPECT_FALSE(alloc_->Malloc(50 * kMiB, kStream).ok());
  tags_.SetPhase(kUntaggedTag);
  EXPECT_EQ(guard_->refusals(), 2);
}

TEST_F(GuardTest, WarnAtLogsOncePerStepWithTheBreakdown) {
  Make("{\"limit\": \"1GiB\",\n \"category_limits\": {\"weights\": \"1GiB\"},\n \"warn_at\": 0.5}");
  {
    ScopedThreadTag scope(Tag("weights"));
    Alloc(300 * kMiB);
  }
  EXPECT_TRUE(warnings_.empty());
  Alloc(300 * kMiB);  // reserved 600 MiB > 512 MiB
  Alloc(10 * kMiB);
  Alloc(20 * kMiB);
  ASSERT_EQ(warnings_.size(), 1u);
  EXPECT_THAT(warnings_[0],
              StartsWith("vramledger plan warning: device 0 reserved 600.00 MiB (629145600 bytes) "
                         "passed warn_at 512.00 MiB (536870912 bytes) (plan.json:3, field "
                         "'warn_at') in step 0\n  live bytes by category (current / plan):\n"));
  EXPECT_THAT(warnings_[0],
              HasSubstr("    weights            300.00 MiB / 1024.00 MiB   (plan line 2)\n"));
  EXPECT_EQ(guard_->EndStep(alloc_->GetStats()).warnings, 1);
  Alloc(kMiB);  // still above warn_at in step 1: one more warning
  Alloc(kMiB);
  ASSERT_EQ(warnings_.size(), 2u);
  EXPECT_THAT(warnings_[1], HasSubstr("in step 1"));
  EXPECT_THAT(warnings_[1], HasSubstr("    untagged           330.00 MiB / -"));
  EXPECT_EQ(guard_->warnings(), 2);
}

TEST_F(GuardTest, PerTagCurrentAndPeakAndStepPeaks) {
  Make("");
  const std::uint32_t a = Tag("activations");
  const std::uint32_t w = Tag("weights");
  DevicePtr p1 = 0, p2 = 0, p3 = 0;
  {
    ScopedThreadTag scope(w);
    p1 = Alloc(1000);
  }
  {
    ScopedThreadTag scope(a);
    p2 = Alloc(3 * kMiB);
    p3 = Alloc(5000);
  }
  auto usage = guard_->TagUsages();
  ASSERT_NE(Usage(usage, "activations"), nullptr);
  EXPECT_EQ(Usage(usage, "activations")->current, static_cast<std::int64_t>(3 * kMiB + 5000));
  EXPECT_EQ(Usage(usage, "weights")->current, 1000);
  EXPECT_EQ(Usage(usage, "untagged")->current, 0);
  ASSERT_TRUE(alloc_->Free(p2).ok());
  usage = guard_->TagUsages();
  EXPECT_EQ(Usage(usage, "activations")->current, 5000);
  EXPECT_EQ(Usage(usage, "activations")->peak, static_cast<std::int64_t>(3 * kMiB + 5000));

  StepRecord s0 = guard_->EndStep(alloc_->GetStats());
  EXPECT_EQ(s0.step, 0);
  EXPECT_EQ(s0.peak_allocated, 3 * kMiB + 5120 + 1024);  // rounded block sizes
  EXPECT_EQ(s0.peak_reserved, 2 * kMiB + 20 * kMiB);     // a small and a large segment
  EXPECT_EQ(s0.allocated, 5120u + 1024u);
  ASSERT_EQ(s0.tag_peaks.size(), 2u);
  EXPECT_EQ(s0.tag_peaks[0],
            (std::pair<std::string, std::int64_t>("activations", 3 * kMiB + 5000)));
  EXPECT_EQ(s0.tag_peaks[1], (std::pair<std::string, std::int64_t>("weights", 1000)));
  // The next step starts from what is live now.
  StepRecord s1 = guard_->EndStep(alloc_->GetStats());
  EXPECT_EQ(s1.step, 1);
  EXPECT_EQ(s1.peak_allocated, 5120u + 1024u);
  EXPECT_EQ(s1.tag_peaks[0].second, 5000);
  ASSERT_TRUE(alloc_->Free(p1).ok());
  ASSERT_TRUE(alloc_->Free(p3).ok());
  EXPECT_EQ(guard_->TagUsages()[0].current, 0);
}

// A history stand-in: captures context 77 and symbolises it.
class FakeHistory : public AllocatorHooks, public StackSymbolizer {
 public:
  std::uint64_t CaptureContext(TraceAction) override { return 77; }
  void OnEvent(const TraceEntry&) override { ++events; }
  std::vector<StackFrame> Symbolize(std::uint64_t context) override {
    if (context != 77) return {};
    return {{"model.py", 88, "attention", true}, {"libtorch_cuda.so", 0, "at::empty_cuda", false}};
  }
  int events = 0;
};

TEST_F(GuardTest, CompletedRefusalNamesEverything) {
  Make("{\n  \"limit\": \"1GiB\",\n  \"category_limits\": {\"activations\": \"512MiB\"}\n}");
  guard_->SetPythonStackProvider([] {
    return std::vector<StackFrame>{{"train.py", 42, "forward", true},
                                   {"train.py", 90, "main", true}};
  });
  guard_->SetForensicDump(
      [](int device, const std::string& message) -> absl::StatusOr<std::string> {
        EXPECT_EQ(device, 0);
        EXPECT_THAT(message, StartsWith("vramledger plan violation"));
        return std::string("/dumps/vramledger-oom-0.json");
      });
  {
    ScopedThreadTag scope(Tag("activations"));
    Alloc(500 * kMiB);
  }
  auto refused = alloc_->Malloc(600 * kMiB, kStream);
  ASSERT_FALSE(refused.ok());
  const absl::Status other = absl::ResourceExhaustedError("CUDA out of memory.");
  EXPECT_EQ(guard_->CompleteRefusal(other, *alloc_), other);  // not ours: unchanged
  const absl::Status full = guard_->CompleteRefusal(refused.status(), *alloc_);
  EXPECT_TRUE(absl::IsResourceExhausted(full));
  const std::string text(full.message());
  EXPECT_THAT(text, StartsWith("vramledger plan violation: plan.json:2: limit: reserved memory "
                               "would grow to 1.07 GiB"));
  EXPECT_THAT(text, HasSubstr("\n  request: 600.00 MiB (629145600 bytes) on device 0, stream 0x0, "
                              "tag 'untagged'\n"));
  EXPECT_THAT(text, HasSubstr("  live bytes by category (current / plan):\n    activations"));
  EXPECT_THAT(text, HasSubstr("500.00 MiB / 512.00 MiB    (plan line 3)"));
  EXPECT_THAT(
      text, HasSubstr("  allocated 500.00 MiB (524288000 bytes), reserved 500.00 MiB "
                      "(524288000 bytes) (plan limit 1024.00 MiB), largest free block 0 bytes\n"));
  EXPECT_THAT(text,
              HasSubstr("  stack (innermost first), captured at the refusal:\n"
                        "    train.py:42 in forward\n    train.py:90 in main\n    [native] "));
  EXPECT_THAT(text, HasSubstr("\n  forensic snapshot: /dumps/vramledger-oom-0.json"));
  // Completed once: a second call does not match any more.
  EXPECT_EQ(guard_->CompleteRefusal(refused.status(), *alloc_), refused.status());
}

TEST_F(GuardTest, RefusalUsesTheHistoryStackThroughTheChain) {
  Make("{\"limit\": \"64MiB\"}");
  FakeHistory history;
  HooksChain chain({guard_.get(), &history});
  alloc_->SetHooks(&chain);
  guard_->SetSymbolizer(&history);
  EXPECT_NE(Alloc(40 * kMiB), 0u);
  EXPECT_GT(history.events, 0);
  auto refused = alloc_->Malloc(40 * kMiB, kStream);
  ASSERT_FALSE(refused.ok());
  const std::string text(guard_->CompleteRefusal(refused.status(), *alloc_).message());
  EXPECT_THAT(text, HasSubstr("stack (innermost first), as recorded when the allocation was "
                              "requested:\n    model.py:88 in attention\n    [native] "
                              "libtorch_cuda.so: at::empty_cuda\n"));
  EXPECT_THAT(text, HasSubstr("forensic snapshot: none (no snapshot writer is installed)"));
  alloc_->SetHooks(nullptr);
}

// A recorded stack without a Python frame names no line of the model code: the live frames of the
// refusing thread (the Python provider, then native frames) replace it.
TEST_F(GuardTest, RecordedStackWithoutPythonFramesFallsBackToLiveFrames) {
  struct NativeOnlyHistory : FakeHistory {
    std::vector<StackFrame> Symbolize(std::uint64_t context) override {
      if (context != 77) return {};
      return {{"libtorch_cuda.so", 0, "at::empty_cuda", false}};
    }
  };
  Make("{\"limit\": \"64MiB\"}");
  NativeOnlyHistory history;
  HooksChain chain({guard_.get(), &history});
  alloc_->SetHooks(&chain);
  guard_->SetSymbolizer(&history);
  guard_->SetPythonStackProvider([] {
    return std::vector<StackFrame>{{"model.py", 12, "forward", true}};
  });
  auto refused = alloc_->Malloc(80 * kMiB, kStream);
  ASSERT_FALSE(refused.ok());
  const std::string text(guard_->CompleteRefusal(refused.status(), *alloc_).message());
  EXPECT_THAT(text, HasSubstr("stack (innermost first), captured at the refusal:\n"
                              "    model.py:12 in forward\n    [native] "));
  EXPECT_THAT(text, Not(HasSubstr("at::empty_cuda")));
  alloc_->SetHooks(nullptr);
}

// Scenario: limit 50% of a 10,989 MiB card; 256, 512, 1024, 2048, 4096 MiB kept live.
TEST_F(GuardTest, ScenarioHalfOfTheCardRefusesThe4GiBRequest) {
  const std::size_t card = 10989 * kMiB;
  Make("{\"limit\": 0.5}", card);
  const std::int64_t cap = static_cast<std::int64_t>(card / 2);
  std::vector<DevicePtr> live;
  for (std::size_t mib : {256, 512, 1024, 2048}) {
    live.push_back(Alloc(mib * kMiB));
    EXPECT_LE(alloc_->GetStats().reserved_bytes[kAggregate].peak, cap);
  }
  auto refused = alloc_->Malloc(4096 * kMiB, kStream);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("request: 4.00 GiB (4294967296 bytes)"));
  EXPECT_LE(alloc_->GetStats().reserved_bytes[kAggregate].peak, cap);
  EXPECT_EQ(guard_->refusals(), 1);
  for (DevicePtr p : live) ASSERT_TRUE(alloc_->Free(p).ok());
}

// Scenario: limit 20 GiB; 16 rounds of {new stream, 2 x 1 GiB, synchronize, free both}:
// the idle memory of earlier streams is released before the guard would refuse.
TEST_F(GuardTest, ScenarioIdleMemoryOfOtherStreamsIsReclaimedBeforeRefusing) {
  Make("{\"limit\": \"20GiB\"}", 64 * kGiB);
  for (int round = 0; round < 16; ++round) {
    const StreamId stream = 0x1000 + static_cast<StreamId>(round);
    DevicePtr a = Alloc(kGiB, stream);
    DevicePtr b = Alloc(kGiB, stream);
    ASSERT_NE(a, 0u);
    ASSERT_NE(b, 0u);
    ASSERT_TRUE(sim_->SynchronizeStream(stream).ok());
    ASSERT_TRUE(alloc_->Free(a).ok());
    ASSERT_TRUE(alloc_->Free(b).ok());
  }
  EXPECT_EQ(guard_->refusals(), 0);
  EXPECT_LE(alloc_->GetStats().reserved_bytes[kAggregate].peak,
            static_cast<std::int64_t>(20 * kGiB));
}

TEST(HooksChainTest, FirstNonZeroContextAndTagFirstRefusalAllEvents) {
  struct Fake : AllocatorHooks {
    std::uint64_t context = 0;
    std::uint32_t tag = 0;
    absl::Status verdict;
    int checks = 0;
    int events = 0;
    std::uint64_t CaptureContext(TraceAction) override { return context; }
    std::uint32_t CurrentTag() override { return tag; }
    absl::Status CheckAllocation(const AllocationRequest&, const HookStats&) override {
      ++checks;
      return verdict;
    }
    absl::Status CheckGrowth(const AllocationRequest&, std::size_t, const HookStats&) override {
      ++checks;
      return verdict;
    }
    void OnEvent(const TraceEntry&) override { ++events; }
  };
  Fake first, second;
  second.context = 9;
  second.tag = 4;
  first.verdict = absl::ResourceExhaustedError("first says no");
  second.verdict = absl::ResourceExhaustedError("second says no");
  HooksChain chain({&first, nullptr, &second});
  EXPECT_EQ(chain.hooks().size(), 2u);
  EXPECT_EQ(chain.CaptureContext(TraceAction::kAlloc), 9u);
  EXPECT_EQ(chain.CurrentTag(), 4u);
  first.tag = 2;
  EXPECT_EQ(chain.CurrentTag(), 2u);
  EXPECT_EQ(chain.CheckAllocation({}, {}).message(), "first says no");
  EXPECT_EQ(second.checks, 0);
  first.verdict = absl::OkStatus();
  EXPECT_EQ(chain.CheckGrowth({}, 0, {}).message(), "second says no");
  chain.OnEvent({});
  EXPECT_EQ(first.events, 1);
  EXPECT_EQ(second.events, 1);
}

}  // namespace
}  // namespace vramledger::guard
