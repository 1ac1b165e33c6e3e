// A randomized run over pausable regions (fixed seeds): allocations in two regions and the
// default pools on two streams, frees (of paused blocks too), record_stream uses, completed
// events, pauses with and without backup, resumes and empty_cache, checked after every step
// against the allocator's invariants, the card's mapped bytes, and a model of the live blocks:
// each region's allocated bytes, the refusal of allocations to a paused region, and the contents
// of every block whose bytes a backup kept.
#include <random>
#include <string>
#include <vector>

#include "regions_fixture.h"

namespace vramledger {
namespace {

struct Live {
  DevicePtr ptr;
  std::size_t size;
  int region;  // -1: the default pools
  std::uint32_t seed;
  bool known;  // its contents are defined (written, not lost to a pause without backup)
};

constexpr std::size_t kHead = 4096;  // bytes of each block the model writes and checks

class RegionsRandomTest : public RegionsTest, public ::testing::WithParamInterface<int> {};

TEST_P(RegionsRandomTest, InterleavedAllocFreePauseResumeKeepEveryInvariant) {
  const int seed = GetParam();
  Make(seed % 2 == 0 ? "expandable_segments:True,expandable_page_mb:2"
                     : "expandable_segments:True,expandable_page_mb:2,page_recycling:True,"
                       "recycle_slack:0",
       8 * kGiB);  // a smaller card: shorter page tables to check after every step
  std::mt19937 rng(static_cast<std::uint32_t>(seed));
  const std::string names[2] = {"r0", "r1"};
  bool paused[2] = {false, false};
  std::vector<Live> live;
  std::uint32_t next_seed = 1;
  for (const std::string& name : names) {  // both exist from the start
    Begin(name);
    End(name);
  }
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  auto head = [](const Live& l) { return std::min(l.size, kHead); };
  auto verify = [&](int region) {
    for (const Live& l : live) {
      if (l.region != region || !l.known) continue;
      ASSERT_EQ(Read(l.ptr, head(l)), Pattern(head(l), l.seed)) << "block 0x" << std::hex << l.ptr;
    }
  };
  for (int step = 0; step < 1500; ++step) {
    SCOPED_TRACE(step);
    const std::size_t op = pick(100);
    if (op < 40) {  // allocate
      const int region = static_cast<int>(pick(3)) - 1;
      const StreamId stream = pick(2);
      const std::size_t size = pick(4) == 0 ? 512 + pick(900 * 1024) : kMiB + pick(6 * kMiB);
      if (region >= 0 && paused[region]) {
        Begin(names[region]);
        auto refused = alloc_->Malloc(size, stream);
        End(names[region]);
        ASSERT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
      } else {
        const DevicePtr p =
            region >= 0 ? AllocIn(names[region], size, stream) : Alloc(size, stream);
        ASSERT_NE(p, 0u);
        Live l{p, size, region, next_seed++, true};
        Write(p, Pattern(head(l), l.seed));
        live.push_back(l);
      }
    } else if (op < 65 && !live.empty()) {  // free
      const std::size_t i = pick(live.size());
      Free(live[i].ptr);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op < 72 && !live.empty()) {  // record_stream on the other stream
      const Live& l = live[pick(live.size())];
      ASSERT_TRUE(alloc_->RecordStream(l.ptr, 1 + pick(2)).ok());
    } else if (op < 77) {  // some work completes
      if (pick(2) == 0) {
        sim_->CompleteAllEvents();
      } else {
        sim_->CompleteStream(pick(3));
      }
    } else if (op < 86) {  // pause
      const int region = static_cast<int>(pick(2));
      const RegionBackup backup = pick(2) == 0 ? RegionBackup::kNone : RegionBackup::kCpu;
      const RegionPauseResult r = Pause(names[region], backup);
      ASSERT_EQ(r.already_paused, paused[region]);
      if (!paused[region] && backup == RegionBackup::kNone) {
        for (Live& l : live) l.known = l.known && l.region != region;
      }
      for (const RegionInfo& info : alloc_->Regions()) {
        if (info.name == names[region]) {
          ASSERT_EQ(info.mapped_bytes, 0u);
        }
      }
      paused[region] = true;
    } else if (op < 95) {  // resume
      const int region = static_cast<int>(pick(2));
      const RegionResumeResult r = Resume(names[region], pick(4) == 0);
      ASSERT_EQ(r.already_running, !paused[region]);
      paused[region] = false;
      verify(region);
    } else {
      ASSERT_TRUE(alloc_->EmptyCache().ok());
    }
    ASSERT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
    Check();
    for (int region = 0; region < 2; ++region) {
      std::size_t allocated = 0;
      for (const Live& l : live) {
        if (l.region == region) allocated += (l.size + 511) / 512 * 512;
      }
      RegionInfo info;
      for (const RegionInfo& r : alloc_->Regions()) {
        if (r.name == names[region]) info = r;
      }
      if (info.name.empty()) continue;  // not created yet
      ASSERT_EQ(info.allocated_bytes, allocated);
      ASSERT_EQ(info.paused, paused[region]);
    }
    if (step % 100 == 99) {
      verify(-1);
      for (int region = 0; region < 2; ++region) {
        if (!paused[region]) verify(region);
      }
    }
  }
  for (int region = 0; region < 2; ++region) {
    if (paused[region]) Resume(names[region]);
    verify(region);
  }
  for (const Live& l : live) Free(l.ptr);
  sim_->CompleteAllEvents();
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  Check();
  // What stays pinned is only what resumes kept for the next pause.
  EXPECT_EQ(sim_->pinned_bytes(), Info("r0").host_buffer_bytes + Info("r1").host_buffer_bytes);
}

INSTANTIATE_TEST_SUITE_P(Seeds, RegionsRandomTest, ::testing::Values(1, 2, 3));

}  // namespace
}  // namespace vramledger
