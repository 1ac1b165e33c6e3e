// Trace entries of the allocator on SimBackend as trackers see them (the hooks' OnEvent): each
// block's and segment's pool, and the mapped pages of expandable segments followed exactly
// through page recycling, old mappings taken back and multi-page handles.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "mem_pools_fixture.h"

namespace vramledger {
namespace {

TEST_F(MemPoolsTest, TraceEntriesNameThePoolOfEachSegmentAndBlock) {
  RecordingHooks hooks;
  alloc_->SetHooks(&hooks);
  ASSERT_TRUE(alloc_->CreateOrIncrefPool(kPool).ok());
  DevicePtr a = 0;
  OnThisThreadIn(kPool, [&] { a = Alloc(4 * kMiB); });
  const DevicePtr b = Alloc(4 * kMiB);
  Free(a);
  Free(b);
  ASSERT_TRUE(alloc_->ReleasePool(kPool).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  alloc_->SetHooks(nullptr);
  std::vector<std::pair<TraceAction, MempoolId>> seen;
  for (const TraceEntry& e : hooks.events) {
    if (e.addr == a || e.addr == b) seen.emplace_back(e.action, e.pool);
  }
  using A = TraceAction;
  const std::vector<std::pair<TraceAction, MempoolId>> want = {
      {A::kSegmentAlloc, kPool},   {A::kAlloc, kPool},          {A::kSegmentAlloc, {0, 0}},
      {A::kAlloc, {0, 0}},         {A::kFreeRequested, kPool},  {A::kFreeCompleted, kPool},
      {A::kFreeRequested, {0, 0}}, {A::kFreeCompleted, {0, 0}}, {A::kSegmentFree, kPool},
      {A::kSegmentFree, {0, 0}}};
  EXPECT_EQ(seen, want);
}

// The pages a tracker sees mapped (segment alloc/map minus free/unmap) are the allocator's
// segments after every operation, through random churn with page recycling; a page is never
// mapped twice nor unmapped unmapped, and an allocation's pages are mapped before its alloc
// event.
class PageTracker final : public AllocatorHooks {
 public:
  void OnEvent(const TraceEntry& e) override {
    switch (e.action) {
      case TraceAction::kSegmentAlloc:
      case TraceAction::kSegmentMap:
        for (DevicePtr p = e.addr; p < e.addr + e.size; p += kPage) {
          if (!pages.insert(p).second) ++errors;
        }
        break;
      case TraceAction::kSegmentFree:
      case TraceAction::kSegmentUnmap:
        for (DevicePtr p = e.addr; p < e.addr + e.size; p += kPage) {
          if (pages.erase(p) != 1) ++errors;
        }
        break;
      case TraceAction::kAlloc:
        for (DevicePtr p = e.addr / kPage * kPage; p < e.addr + e.size; p += kPage) {
          if (pages.count(p) == 0) ++errors;
        }
        break;
      default:
        break;
    }
  }
  static constexpr std::size_t kPage = 2 * kMiB;
  std::set<DevicePtr> pages;
  int errors = 0;
};

class TrackerTest : public MemPoolsTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(TrackerTest, FollowsMappedPagesThroughRecycling) {
  Make(GetParam(), 1 * kGiB);
  PageTracker tracker;
  alloc_->SetHooks(&tracker);
  std::uint64_t x = 7;
  std::vector<DevicePtr> live;
  for (int op = 0; op < 3000; ++op) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const unsigned r = static_cast<unsigned>(x >> 33);
    if (r % 100 < 55 || live.empty()) {
      auto p = alloc_->Malloc(1 + (r % (48 * kMiB)), op % 3 == 0 ? 0 : kStream);
      if (p.ok()) live.push_back(*p);
    } else if (r % 100 < 98) {
      const std::size_t i = r % live.size();
      ASSERT_TRUE(alloc_->Free(live[i]).ok());
      live[i] = live.back();
      live.pop_back();
    } else {
      ASSERT_TRUE(alloc_->EmptyCache().ok());
    }
    std::set<DevicePtr> want;
    for (const SegmentInfo& s : SegmentsOf(*alloc_)) {
      for (DevicePtr p = s.address; p < s.address + s.total_size; p += PageTracker::kPage) {
        want.insert(p);
      }
    }
    ASSERT_EQ(tracker.pages, want) << "op " << op;
    ASSERT_EQ(tracker.errors, 0) << "op " << op;
  }
  EXPECT_GT(FragmentationOf(*alloc_).page_moves, 0);
  if (std::string(GetParam()).find("keep_old_mappings:True") != std::string::npos) {
    EXPECT_GT(FragmentationOf(*alloc_).reused_old_mappings, 0);
  }
  for (DevicePtr p : live) ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_TRUE(tracker.pages.empty());
  alloc_->SetHooks(nullptr);
}

// Page moves, old mappings taken back, and handles of several pages.
INSTANTIATE_TEST_SUITE_P(
    ExpandableKinds, TrackerTest,
    ::testing::Values("expandable_segments:True,expandable_page_mb:2",
                      "expandable_segments:True,expandable_page_mb:2,keep_old_mappings:True",
                      "expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8"));

}  // namespace
}  // namespace vramledger
