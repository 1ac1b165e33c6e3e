// The memory history: exactly N most recent entries kept in order, torch's record modes, stack
// interning, symbolisation, OOM entries and concurrent recording, on SimBackend allocators.
#include "ledger/history.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "device/sim_backend.h"
#include "ledger/device_report.h"
#include "vramledger/device_allocator.h"

namespace vramledger {
namespace {

HistorySettings Settings(std::optional<std::string_view> enabled,
                         std::optional<std::string_view> context, std::string_view stacks,
                         std::uint64_t max_entries) {
  absl::StatusOr<HistorySettings> s = ParseHistorySettings(enabled, context, stacks, max_entries);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : HistorySettings();
}

TraceEntry Event(TraceAction action, DevicePtr addr, std::size_t size, int device = 0) {
  TraceEntry e;
  e.action = action;
  e.addr = addr;
  e.size = size;
  e.device = device;
  return e;
}

std::vector<std::size_t> Sizes(const std::vector<RecordedEntry>& entries) {
  std::vector<std::size_t> out;
  for (const RecordedEntry& e : entries) out.push_back(e.size);
  return out;
}

std::vector<std::string> Actions(const std::vector<RecordedEntry>& entries) {
  std::vector<std::string> out;
  for (const RecordedEntry& e : entries) out.emplace_back(TraceActionName(e.action));
  return out;
}

class AllocatorWithHistory : public ::testing::Test {
 protected:
  void Make(const HistorySettings& settings, std::size_t capacity = 64 * kGiB) {
    SimBackend::Config config;
    config.capacity = capacity;
    sim_ = std::make_unique<SimBackend>(config);
    alloc_ = std::make_unique<DeviceAllocator>(Options(), sim_.get());
    history_ = std::make_unique<History>(settings);
    alloc_->SetHooks(history_.get());
  }
  DevicePtr Alloc(std::size_t size, StreamId stream = 0) {
    absl::StatusOr<DevicePtr> p = alloc_->Malloc(size, stream);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : 0;
  }
  void TearDown() override {
    if (alloc_ != nullptr) alloc_->SetHooks(nullptr);
  }

  std::unique_ptr<SimBackend> sim_;
  std::unique_ptr<DeviceAllocator> alloc_;
  std::unique_ptr<History> history_;
};

// A ring of four. Rule: free_requested and free_completed are separate entries, each
// counting towards max_entries (as torch's ring buffer counts them).
TEST_F(AllocatorWithHistory, RingOfFourKeepsTheLastFourEntriesInOrder) {
  Make(Settings("all", "all", "all", 4));
  Alloc(1 * kMiB);
  const DevicePtr two = Alloc(2 * kMiB);
  const DevicePtr four = Alloc(4 * kMiB);
  ASSERT_TRUE(alloc_->Free(two).ok());
  const DevicePtr eight = Alloc(8 * kMiB);
  const std::vector<RecordedEntry> entries = history_->Entries(0);
  EXPECT_EQ(Actions(entries),
            (std::vector<std::string>{"alloc", "free_requested", "free_completed", "alloc"}));
  EXPECT_EQ(Sizes(entries), (std::vector<std::size_t>{4 * kMiB, 2 * kMiB, 2 * kMiB, 8 * kMiB}));
  EXPECT_EQ(entries[0].addr, four);
  EXPECT_EQ(entries[1].addr, two);
  EXPECT_EQ(entries[2].addr, two);
  EXPECT_EQ(entries[3].addr, eight);
  for (std::size_t i = 1; i < entries.size(); ++i) {
    EXPECT_LE(entries[i - 1].time_us, entries[i].time_us);
  }
  EXPECT_GT(entries[0].time_us, 1'600'000'000'000'000);  // epoch microseconds (after 2020)
  // 8 entries were recorded: 2 segment_alloc, 4 alloc, 2 free; the oldest 4 were overwritten.
  EXPECT_EQ(history_->dropped(), 4u);
}

TEST_F(AllocatorWithHistory, UnboundedRingKeepsEveryEntryInTorchOrder) {
  Make(Settings("all", "all", "python", 1000));
  Alloc(1 * kMiB);
  const DevicePtr two = Alloc(2 * kMiB);
  Alloc(4 * kMiB);
  ASSERT_TRUE(alloc_->Free(two).ok());
  Alloc(8 * kMiB);
  const std::vector<RecordedEntry> entries = history_->Entries(0);
  EXPECT_EQ(Actions(entries),
            (std::vector<std::string>{"segment_alloc", "alloc", "segment_alloc", "alloc", "alloc",
                                      "free_requested", "free_completed", "alloc"}));
  EXPECT_EQ(Sizes(entries), (std::vector<std::size_t>{2 * kMiB, 1 * kMiB, 20 * kMiB, 2 * kMiB,
                                                      4 * kMiB, 2 * kMiB, 2 * kMiB, 8 * kMiB}));
  EXPECT_EQ(history_->dropped(), 0u);
}

TEST(HistoryRing, ResizeKeepsTheMostRecentEntries) {
  History h(Settings("all", std::nullopt, "python", 3));
  for (std::size_t i = 0; i < 10; ++i) h.OnEvent(Event(TraceAction::kAlloc, 0x1000 + i, i));
  EXPECT_EQ(Sizes(h.Entries(0)), (std::vector<std::size_t>{7, 8, 9}));
  h.Configure(Settings("all", std::nullopt, "python", 2));
  EXPECT_EQ(Sizes(h.Entries(0)), (std::vector<std::size_t>{8, 9}));
  h.Configure(Settings("all", std::nullopt, "python", 5));
  for (std::size_t i = 10; i < 13; ++i) h.OnEvent(Event(TraceAction::kAlloc, 0x1000 + i, i));
  EXPECT_EQ(Sizes(h.Entries(0)), (std::vector<std::size_t>{8, 9, 10, 11, 12}));
  h.OnEvent(Event(TraceAction::kAlloc, 0x2000, 13));
  EXPECT_EQ(Sizes(h.Entries(0)), (std::vector<std::size_t>{9, 10, 11, 12, 13}));
  h.Configure(Settings("all", std::nullopt, "python", 5), /*clear=*/true);
  EXPECT_TRUE(h.Entries(0).empty());
}

TEST(HistoryRing, DevicesHaveTheirOwnRings) {
  History h(Settings("all", std::nullopt, "python", 2));
  h.OnEvent(Event(TraceAction::kAlloc, 1, 1, 0));
  h.OnEvent(Event(TraceAction::kAlloc, 2, 2, 1));
  h.OnEvent(Event(TraceAction::kAlloc, 3, 3, 1));
  h.OnEvent(Event(TraceAction::kAlloc, 4, 4, 1));
  h.OnEvent(Event(TraceAction::kAlloc, 5, 5, History::kMaxDevices));  // out of range: dropped
  EXPECT_EQ(Sizes(h.Entries(0)), (std::vector<std::size_t>{1}));
  EXPECT_EQ(Sizes(h.Entries(1)), (std::vector<std::size_t>{3, 4}));
  EXPECT_EQ(h.DevicesWithEntries(), (std::vector<int>{0, 1}));
  EXPECT_EQ(h.dropped(), 2u);  // one overwritten on device 1, one out of range
}

TEST(HistoryModes, ParseRejectsUnknownValuesNamingThem) {
  absl::StatusOr<HistorySettings> bad = ParseHistorySettings("everything", "all", "python", 10);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("enabled='everything'"), std::string::npos);
  EXPECT_FALSE(ParseHistorySettings("all", "sometimes", "python", 10).ok());
  EXPECT_FALSE(ParseHistorySettings("all", "all", "cpp", 10).ok());
  EXPECT_FALSE(ParseHistorySettings("all", "all", "python", 0).ok());
  HistorySettings off = Settings(std::nullopt, std::nullopt, "all", 1);
  EXPECT_EQ(off.enabled, HistoryEnabled::kNone);
  EXPECT_EQ(HistoryContextName(HistoryContext::kAlloc), "alloc");
  EXPECT_EQ(HistoryEnabledName(HistoryEnabled::kNone), "None");
}

TEST(HistoryModes, ContextDecidesWhichActionsCaptureAStack) {
  // stacks="all" so that a C++ test has frames (there is no Python here).
  History h(Settings("all", "alloc", "all", 100));
  EXPECT_NE(h.CaptureContext(TraceAction::kAlloc), 0u);
  EXPECT_EQ(h.CaptureContext(TraceAction::kFreeRequested), 0u);  // free stacks need "all"
  h.Configure(Settings("all", "all", "all", 100));
  EXPECT_NE(h.CaptureContext(TraceAction::kFreeRequested), 0u);
  h.Configure(Settings("all", std::nullopt, "all", 100));
  EXPECT_EQ(h.CaptureContext(TraceAction::kAlloc), 0u);
  h.Configure(Settings(std::nullopt, "all", "all", 100));
  EXPECT_EQ(h.CaptureContext(TraceAction::kAlloc), 0u);
  // stacks="python" without an interpreter: no frames, so no stack.
  h.Configure(Settings("all", "all", "python", 100));
  EXPECT_EQ(h.CaptureContext(TraceAction::kAlloc), 0u);
}

TEST_F(AllocatorWithHistory, StateModeKeepsBlockStacksButNoTrace) {
  Make(Settings("state", "all", "all", 100));
  const DevicePtr p = Alloc(3 * kMiB);
  EXPECT_TRUE(history_->Entries(0).empty());
  bool found = false;
  for (const SegmentInfo& s : SegmentsOf(*alloc_)) {
    for (const BlockInfo& b : s.blocks) {
      if (b.address == p) {
        found = true;
        EXPECT_NE(b.context, 0u);
        EXPECT_FALSE(history_->Frames(b.context).empty());
      }
    }
    EXPECT_NE(history_->SegmentStack(0, s.address), 0u);  // segment stacks too
  }
  EXPECT_TRUE(found);
}

TEST_F(AllocatorWithHistory, ContextStateRecordsEntriesWithoutStacks) {
  Make(Settings("all", "state", "all", 100));
  Alloc(3 * kMiB);
  const std::vector<RecordedEntry> entries = history_->Entries(0);
  ASSERT_EQ(entries.size(), 2u);
  for (const RecordedEntry& e : entries) EXPECT_EQ(e.stack, 0u);
  EXPECT_NE(SegmentsOf(*alloc_)[0].blocks[0].context, 0u);
}

TEST_F(AllocatorWithHistory, TurningOffClearsTheHistory) {
  Make(Settings("all", "all", "all", 100));
  Alloc(3 * kMiB);
  EXPECT_EQ(history_->Entries(0).size(), 2u);
  history_->Configure(Settings(std::nullopt, std::nullopt, "python", 1));
  EXPECT_TRUE(history_->Entries(0).empty());
  Alloc(3 * kMiB);
  EXPECT_TRUE(history_->Entries(0).empty());
  EXPECT_EQ(history_->SegmentStack(0, SegmentsOf(*alloc_)[0].address), 0u);
}

TEST_F(AllocatorWithHistory, OomEntryCarriesDeviceFreeBytes) {
  Make(Settings("all", "all", "python", 100), /*capacity=*/64 * kMiB);
  Alloc(40 * kMiB);
  std::size_t free_bytes = 0, total_bytes = 0;
  ASSERT_TRUE(sim_->MemGetInfo(&free_bytes, &total_bytes).ok());
  absl::StatusOr<DevicePtr> p = alloc_->Malloc(100 * kMiB, 0);
  ASSERT_FALSE(p.ok());
  const std::vector<RecordedEntry> entries = history_->Entries(0);
  ASSERT_FALSE(entries.empty());
  EXPECT_EQ(entries.back().action, TraceAction::kOom);
  EXPECT_EQ(entries.back().addr, free_bytes);
  EXPECT_EQ(entries.back().size, 100 * kMiB);  // the rounded request
}

TEST(HistoryInterning, SameStackSameIdOneEntry) {
  History h(Settings("all", "all", "all", 10));
  std::vector<std::uint64_t> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(h.CaptureContext(TraceAction::kAlloc));  // one site
  for (std::uint64_t id : ids) EXPECT_EQ(id, ids[0]);
  EXPECT_NE(ids[0], 0u);
  EXPECT_EQ(h.num_stacks(), 1u);
  const std::uint64_t other = h.CaptureContext(TraceAction::kAlloc);  // another line
  EXPECT_NE(other, ids[0]);
  EXPECT_EQ(h.num_stacks(), 2u);
}

TEST(HistoryInterning, ExplicitStacksInternByContent) {
  History h;
  const std::vector<Frame> names = {{"model.py", 0, "forward"}, {"train.py", 0, "<module>"}};
  const std::uint64_t a = h.InternForTesting({{0x10, 12}, {0x20, 40}}, names, {});
  const std::uint64_t b = h.InternForTesting({{0x10, 12}, {0x20, 40}}, names, {});
  const std::uint64_t c = h.InternForTesting({{0x10, 13}, {0x20, 40}}, names, {});
  const std::uint64_t d = h.InternForTesting({{0x10, 12}, {0x20, 40}}, names, {0x1234});
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a, d);
  EXPECT_NE(c, d);
  EXPECT_EQ(h.num_stacks(), 3u);
  EXPECT_EQ(h.InternForTesting({}, {}, {}), 0u);
  const std::vector<Frame> frames = h.Frames(c);
  ASSERT_EQ(frames.size(), 2u);
  EXPECT_EQ(frames[0], (Frame{"model.py", 13, "forward", true}));
  EXPECT_EQ(frames[1], (Frame{"train.py", 40, "<module>", true}));
  EXPECT_EQ(h.Frames(d).size(), 3u);  // native frame first, then the two Python frames
  EXPECT_EQ(h.Frames(d)[1].name, "forward");
  EXPECT_FALSE(h.Frames(d)[0].python);
  EXPECT_TRUE(h.Frames(0).empty());
  EXPECT_TRUE(h.Frames(99).empty());
}

std::uint64_t __attribute__((noinline)) CaptureFromNamedFunction(History* h) {
  const std::uint64_t id = h->CaptureContext(TraceAction::kAlloc);
  asm volatile("" ::: "memory");  // keep the call from being a tail call
  return id;
}

TEST(HistoryInterning, NativeFramesAreSymbolisedAtReadTime) {
  History h(Settings("all", "all", "all", 10));
  const std::uint64_t id = CaptureFromNamedFunction(&h);
  const std::vector<Frame> frames = h.Frames(id);
  ASSERT_FALSE(frames.empty());
  bool named = false;
  for (const Frame& f : frames) {
    named = named || f.name.find("CaptureFromNamedFunction") != std::string::npos;
  }
  EXPECT_TRUE(named) << "innermost frame: " << frames[0].name << " in " << frames[0].filename;
  EXPECT_FALSE(frames[0].filename.empty());
}

TEST(HistoryThreads, ConcurrentRecordingKeepsExactlyN) {
  History h(Settings("all", "all", "all", 100));
  constexpr int kThreads = 8;
  constexpr int kEvents = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&h, t] {
      for (int i = 0; i < kEvents; ++i) {
        TraceEntry e = Event(TraceAction::kAlloc, static_cast<DevicePtr>(t), 1);
        e.context = h.CaptureContext(TraceAction::kAlloc);
        h.OnEvent(e);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(h.Entries(0).size(), 100u);
  EXPECT_EQ(h.dropped(), static_cast<std::uint64_t>(kThreads * kEvents - 100));
  EXPECT_LE(h.num_stacks(), static_cast<std::size_t>(kThreads));  // one call site per thread body
}

}  // namespace
}  // namespace vramledger
