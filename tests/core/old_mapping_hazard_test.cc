// Hazards of moved handles and kept old mappings (keep_old_mappings): a DeviceBackend decorator
// over SimBackend that models kernels (per-stream sequence numbers, completed only when the test or
// a synchronize says so) and flags, on a real GPU, hazards: an address unmapped or a handle
// released while a kernel using it may still run, a kernel launched on physical bytes another
// stream's pending kernel uses, a kernel on an unmapped address, and an event destroyed twice (the
// event pool held it twice).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "device/sim_backend.h"
#include "ledger/device_report.h"
#include "sim_forwarding_backend.h"
#include "vramledger/device_allocator.h"
#include "vramledger/device_backend.h"

namespace vramledger {
namespace {

class HazardBackend final : public SimForwardingBackend {
 public:
  explicit HazardBackend(SimBackend* sim) : SimForwardingBackend(sim) {}
  absl::Status ReleasePhysical(PhysicalHandle handle) override {
    Prune();
    for (const Kernel& k : kernels_) {
      for (const Piece& p : k.pieces) {
        if (p.handle == handle)
          Hazard(absl::StrCat("release of handle ", handle, " used by a pending kernel on stream ",
                              k.stream));
      }
    }
    return sim_->ReleasePhysical(handle);
  }
  absl::Status Map(DevicePtr va, std::size_t size, PhysicalHandle handle) override {
    absl::Status s = sim_->Map(va, size, handle);
    if (s.ok()) maps_[va] = {size, handle};
    return s;
  }
  absl::Status Unmap(DevicePtr va, std::size_t size) override {
    Prune();
    for (const Kernel& k : kernels_) {
      for (const Piece& p : k.pieces) {
        if (p.va < va + size && va < p.va + p.size) {
          Hazard(absl::StrCat("unmap of 0x", absl::Hex(va), " under a pending kernel on stream ",
                              k.stream));
        }
      }
    }
    absl::Status s = sim_->Unmap(va, size);
    if (s.ok()) {
      for (auto it = maps_.lower_bound(va); it != maps_.end() && it->first < va + size;) {
        it = maps_.erase(it);
      }
    }
    return s;
  }
  absl::Status CreateEvent(EventId* out) override {
    absl::Status s = sim_->CreateEvent(out);
    if (s.ok()) live_events_.insert(*out);
    return s;
  }
  absl::Status RecordEvent(EventId event, StreamId stream) override {
    absl::Status s = sim_->RecordEvent(event, stream);
    if (s.ok()) events_[event] = {stream, cur_[stream]};
    return s;
  }
  absl::Status SynchronizeEvent(EventId event) override {
    absl::Status s = sim_->SynchronizeEvent(event);
    if (s.ok()) CompleteThrough(event);
    return s;
  }
  absl::Status DestroyEvent(EventId event) override {
    if (live_events_.erase(event) == 0) Hazard(absl::StrCat("event ", event, " destroyed twice"));
    return sim_->DestroyEvent(event);
  }
  absl::Status SynchronizeStream(StreamId stream) override {
    absl::Status s = sim_->SynchronizeStream(stream);
    if (s.ok()) done_[stream] = cur_[stream];
    return s;
  }

  // ---- test side ----
  // A kernel on `stream` touching [ptr, ptr + size). `fresh`: the first kernel of a block just
  // allocated on `stream`: no other stream's pending kernel may touch its physical bytes.
  void Launch(StreamId stream, DevicePtr ptr, std::size_t size, bool fresh = false) {
    Prune();
    Kernel k{stream, ++cur_[stream], {}};
    DevicePtr a = ptr;
    while (a < ptr + size) {
      auto it = maps_.upper_bound(a);
      if (it == maps_.begin() || std::prev(it)->first + std::prev(it)->second.size <= a) {
        Hazard(absl::StrCat("kernel on unmapped 0x", absl::Hex(a)));
        return;
      }
      --it;
      const DevicePtr end = std::min<DevicePtr>(ptr + size, it->first + it->second.size);
      k.pieces.push_back({a, end - a, it->second.handle, a - it->first});
      a = end;
    }
    for (const Kernel& o : kernels_) {
      if (o.stream == stream || !fresh) continue;
      for (const Piece& p : o.pieces) {
        for (const Piece& q : k.pieces) {
          if (p.handle == q.handle && p.off < q.off + q.size && q.off < p.off + p.size) {
            Hazard(absl::StrCat("kernel on stream ", stream, " races a pending kernel on stream ",
                                o.stream, " over handle ", p.handle));
          }
        }
      }
    }
    kernels_.push_back(std::move(k));
  }
  // The GPU catches up with `stream`, fully or through one of the allocator's events on it.
  void Complete(StreamId stream, std::mt19937_64& rng) {
    std::vector<EventId> on;
    for (const auto& [e, r] : events_) {
      if (r.stream == stream && r.seq > done_[stream]) on.push_back(e);
    }
    if (on.empty() || rng() % 2 == 0) {
      sim_->CompleteStream(stream);
      done_[stream] = cur_[stream];
    } else {
      const EventId e = on[rng() % on.size()];
      ASSERT_TRUE(sim_->CompleteEvent(e).ok());
      CompleteThrough(e);
    }
  }
  void CompleteStream(StreamId stream) {
    sim_->CompleteStream(stream);
    done_[stream] = cur_[stream];
  }
  void CompleteAll() {
    sim_->CompleteAllEvents();
    for (auto& [s, c] : cur_) done_[s] = c;
  }
  const std::vector<std::string>& hazards() const { return hazards_; }

 private:
  struct Piece {
    DevicePtr va;
    std::size_t size;
    PhysicalHandle handle;
    std::size_t off;
  };
  struct Kernel {
    StreamId stream;
    std::uint64_t seq;
    std::vector<Piece> pieces;
  };
  struct Rec {
    StreamId stream;
    std::uint64_t seq;
  };
  struct MapEntry {
    std::size_t size;
    PhysicalHandle handle;
  };
  void CompleteThrough(EventId e) {
    auto it = events_.find(e);
    if (it == events_.end()) return;
    done_[it->second.stream] = std::max(done_[it->second.stream], it->second.seq);
  }
  void Prune() {
    std::erase_if(kernels_, [&](const Kernel& k) { return k.seq <= done_[k.stream]; });
  }
  void Hazard(std::string what) {
    if (hazards_.size() < 20) hazards_.push_back(std::move(what));
  }
  std::map<DevicePtr, MapEntry> maps_;
  std::vector<Kernel> kernels_;
  std::map<StreamId, std::uint64_t> cur_, done_;
  std::map<EventId, Rec> events_;
  std::set<EventId> live_events_;
  std::vector<std::string> hazards_;
};

struct Params {
  std::string conf;
  bool errors;
  bool capture;
};

// How gtest prints a case (its default is the struct's bytes).
void PrintTo(const Params& p, std::ostream* os) {
  *os << "{" << p.conf << (p.errors ? ", driver errors" : "") << (p.capture ? ", capture" : "")
      << "}";
}

class OldMappingHazardTest : public ::testing::TestWithParam<Params> {};

constexpr StreamId kStreams[] = {0, 0x33, 0x44};

// A live allocation of a churn: pointer, bytes, stream.
struct Live {
  DevicePtr p;
  std::size_t size;
  StreamId s;
};

// A simulated card of `capacity` bytes, the hazard backend over it and an allocator with options
// `conf` (alloc is null if `conf` does not parse).
struct Rig {
  Rig(const std::string& conf, std::size_t capacity) : sim(Config(capacity)), hb(&sim) {
    if (auto o = ParseOptions(conf); o.ok()) alloc = std::make_unique<DeviceAllocator>(*o, &hb);
  }
  static SimBackend::Config Config(std::size_t capacity) {
    SimBackend::Config config;
    config.capacity = capacity;
    return config;
  }
  // Frees `live`, lets every kernel finish, empties the cache and destroys the allocator.
  void End(const std::vector<Live>& live) {
    for (const Live& l : live) (void)alloc->Free(l.p);
    hb.CompleteAll();
    (void)alloc->EmptyCache();
    (void)alloc->EmptyCache();
    alloc.reset();
  }
  SimBackend sim;
  HazardBackend hb;
  std::unique_ptr<DeviceAllocator> alloc;
};

// The driver calls a churn injects errors into.
constexpr DriverCall kFailingCalls[] = {
    DriverCall::kMemCreate,        DriverCall::kMemRelease,   DriverCall::kMemMap,
    DriverCall::kMemUnmap,         DriverCall::kMemSetAccess, DriverCall::kEventCreate,
    DriverCall::kEventRecord,      DriverCall::kEventQuery,   DriverCall::kEventSynchronize,
    DriverCall::kStreamSynchronize};

TEST_P(OldMappingHazardTest, RandomChurnHasNoHazards) {
  const Params& param = GetParam();
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    Rig rig(param.conf, 2 * kGiB);
    ASSERT_NE(rig.alloc, nullptr) << param.conf;
    SimBackend& sim = rig.sim;
    HazardBackend& hb = rig.hb;
    std::unique_ptr<DeviceAllocator>& alloc = rig.alloc;
    std::mt19937_64 rng(seed);
    std::vector<Live> live;
    bool capturing = false;
    int capture_left = 0;
    std::int64_t reused = 0;
    for (int op = 0; op < 4000; ++op) {
      const int what = static_cast<int>(rng() % 100);
      absl::Status st;
      if (param.errors && rng() % 40 == 0) {
        sim.FailCall(kFailingCalls[rng() % std::size(kFailingCalls)], static_cast<int>(rng() % 20),
                     absl::InternalError("injected"));
      }
      if (param.capture) {
        if (!capturing && rng() % 200 == 0) {
          capturing = true;
          capture_left = 5 + static_cast<int>(rng() % 20);
          sim.SetCapturing(kStreams[0], true);
        } else if (capturing && --capture_left <= 0) {
          capturing = false;
          sim.SetCapturing(kStreams[0], false);
        }
      }
      if (what < 48 || live.empty()) {
        std::size_t size = 1 + static_cast<std::size_t>(std::exp2((rng() % 2600) / 100.0));
        const std::size_t si = rng() % 3;
        const StreamId s = kStreams[si];
        auto p = alloc->Malloc(size, s);
        if (p.ok()) {
          if (!(capturing && s == kStreams[0])) hb.Launch(s, *p, size, true);
          live.push_back({*p, size, s});
          if (rng() % 6 == 0) {
            const StreamId other = kStreams[(si + 1 + rng() % 2) % 3];
            if (other != s && !(capturing && other == kStreams[0])) {
              st = alloc->RecordStream(*p, other);
              hb.Launch(other, *p, size);
            }
          }
        } else {
          st = p.status();
        }
      } else if (what < 90) {
        const std::size_t i = rng() % live.size();
        if (rng() % 3 == 0 && !(capturing && live[i].s == kStreams[0])) {
          hb.Launch(live[i].s, live[i].p, live[i].size);  // more work before the free
        }
        st = alloc->Free(live[i].p);
        live[i] = live.back();
        live.pop_back();
      } else if (what < 98) {
        hb.Complete(kStreams[rng() % 3], rng);
      } else {
        if (!capturing) st = alloc->EmptyCache();
      }
      if (!st.ok()) {
        EXPECT_TRUE(st.code() == absl::StatusCode::kInternal ||
                    st.code() == absl::StatusCode::kResourceExhausted)
            << st;
      }
      absl::Status inv = alloc->CheckInvariants();
      ASSERT_TRUE(inv.ok()) << "seed " << seed << " op " << op << ": " << inv;
      ASSERT_TRUE(hb.hazards().empty())
          << "seed " << seed << " op " << op << ": " << hb.hazards().front();
    }
    if (capturing) sim.SetCapturing(kStreams[0], false);
    reused += FragmentationOf(*alloc).reused_old_mappings;
    rig.End(live);
    ASSERT_TRUE(hb.hazards().empty()) << "seed " << seed << " end: " << hb.hazards().front();
    EXPECT_EQ(sim.live_events(), 0);
    std::printf("seed %d reused_old_mappings %lld\n", static_cast<int>(seed),
                static_cast<long long>(reused));
  }
}

// A move within the stream (its fence recorded), then cuMemMap fails: AbandonPlan releases the
// moved handle, whose ClearOldMappings -> OldMappings::Erase gives the fence back to the pool;
// giving it back a second time (ensure_mapped.cc, AbandonPlan) would let the pool hand the same
// event to two users: here two record_stream frees on different streams, so the block used on
// stream kS1 would be freed when kS2 completed, and reused while kS1's kernel still ran.
TEST(OldMappingFenceTest, AbandonGivesTheFenceBackOnce) {
  SimBackend sim;
  HazardBackend hb(&sim);
  auto o = ParseOptions("expandable_segments:True,expandable_page_mb:2");
  ASSERT_TRUE(o.ok());
  auto alloc = std::make_unique<DeviceAllocator>(*o, &hb);
  constexpr StreamId kS1 = 0x33, kS2 = 0x44;
  auto use = [&](StreamId s, std::size_t size) {
    auto p = alloc->Malloc(size, s);
    EXPECT_TRUE(p.ok()) << p.status();
    hb.Launch(s, *p, size, true);
    return *p;
  };
  DevicePtr a = use(0, 8 * kMiB);
  DevicePtr hole = use(0, 8 * kMiB);
  DevicePtr b = use(0, 8 * kMiB);
  ASSERT_TRUE(alloc->Free(hole).ok());
  sim.FailCall(DriverCall::kMemMap, 0, absl::InternalError("injected"));
  auto big = alloc->Malloc(10 * kMiB, 0);  // moves the hole's handles, then Map fails
  ASSERT_FALSE(big.ok());
  ASSERT_TRUE(alloc->CheckInvariants().ok()) << alloc->CheckInvariants();
  // Two record_stream frees: each takes an event from the pool.
  DevicePtr x = use(0, 8 * kMiB);
  ASSERT_TRUE(alloc->RecordStream(x, kS1).ok());
  hb.Launch(kS1, x, 8 * kMiB);  // still running
  ASSERT_TRUE(alloc->Free(x).ok());
  DevicePtr y = use(0, 8 * kMiB);
  ASSERT_TRUE(alloc->RecordStream(y, kS2).ok());
  hb.Launch(kS2, y, 8 * kMiB);
  ASSERT_TRUE(alloc->Free(y).ok());
  hb.CompleteStream(0);
  hb.CompleteStream(kS2);  // kS2 done; kS1 is not
  std::vector<DevicePtr> more;
  for (int i = 0; i < 4; ++i) more.push_back(use(0, 8 * kMiB));
  EXPECT_TRUE(hb.hazards().empty()) << hb.hazards().front();
  for (DevicePtr p : more) (void)alloc->Free(p);
  (void)alloc->Free(a);
  (void)alloc->Free(b);
  hb.CompleteAll();
  alloc.reset();
  EXPECT_TRUE(hb.hazards().empty()) << hb.hazards().back();
}

// Training-step churn (the same allocation pattern each step, jittered), the pattern that makes
// handles move back and forth and old mappings get taken back.
TEST_P(OldMappingHazardTest, StepChurnHasNoHazards) {
  const Params& param = GetParam();
  std::int64_t total_reused = 0;
  const std::uint64_t seeds =
      std::getenv("STEP_SEEDS") ? std::strtoull(std::getenv("STEP_SEEDS"), nullptr, 10) : 6;
  for (std::uint64_t seed = 1; seed <= seeds; ++seed) {
    Rig rig(param.conf, 4 * kGiB);
    ASSERT_NE(rig.alloc, nullptr) << param.conf;
    SimBackend& sim = rig.sim;
    HazardBackend& hb = rig.hb;
    std::unique_ptr<DeviceAllocator>& alloc = rig.alloc;
    std::mt19937_64 rng(seed);
    std::vector<std::size_t> pattern;
    for (int i = 0; i < 60; ++i) {
      pattern.push_back(1 + static_cast<std::size_t>(std::exp2((rng() % 2500) / 100.0)));
    }
    std::vector<Live> persistent;
    for (int step = 0; step < 60; ++step) {
      std::vector<Live> live;
      bool capturing = param.capture && step % 7 == 3;
      if (capturing) sim.SetCapturing(kStreams[0], true);
      for (std::size_t i = 0; i < pattern.size(); ++i) {
        if (param.errors && rng() % 30 == 0) {
          sim.FailCall(kFailingCalls[rng() % std::size(kFailingCalls)],
                       static_cast<int>(rng() % 10), absl::InternalError("injected"));
        }
        std::size_t size = pattern[i];
        if (rng() % 5 == 0) size = size * (50 + rng() % 100) / 100 + 1;
        const std::size_t si = (i % 7 == 0) ? 1 + rng() % 2 : 0;
        const StreamId s = kStreams[si];
        auto p = alloc->Malloc(size, s);
        if (p.ok()) {
          if (!(capturing && s == kStreams[0])) hb.Launch(s, *p, size, true);
          if (rng() % 10 == 0 && !capturing) {
            const StreamId other = kStreams[(si + 1 + rng() % 2) % 3];
            (void)alloc->RecordStream(*p, other);
            hb.Launch(other, *p, size);
          }
          (rng() % 50 == 0 ? persistent : live).push_back({*p, size, s});
        }
        // Frees interleaved: activations freed in reverse order later in the step.
        if (!live.empty() && rng() % 3 == 0) {
          const std::size_t j = rng() % live.size();
          (void)alloc->Free(live[j].p);
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(j));
        }
        absl::Status inv = alloc->CheckInvariants();
        ASSERT_TRUE(inv.ok()) << "seed " << seed << " step " << step << ": " << inv;
        ASSERT_TRUE(hb.hazards().empty())
            << "seed " << seed << " step " << step << ": " << hb.hazards().front();
      }
      while (!live.empty()) {
        (void)alloc->Free(live.back().p);
        live.pop_back();
      }
      if (persistent.size() > 5) {
        (void)alloc->Free(persistent.front().p);
        persistent.erase(persistent.begin());
      }
      if (capturing) sim.SetCapturing(kStreams[0], false);
      // The GPU lags: streams catch up partly.
      for (int k = 0; k < 2; ++k) hb.Complete(kStreams[rng() % 3], rng);
      if (step % 23 == 22) (void)alloc->EmptyCache();
      {  // per-pool reserved == per-pool mapped (CheckInvariants checks the aggregate only)
        std::size_t small = 0, large = 0;
        for (const auto& seg : SegmentsOf(*alloc)) (seg.is_small ? small : large) += seg.total_size;
        const auto st = alloc->GetStats();
        EXPECT_EQ(st.reserved_bytes[kSmallPool].current, static_cast<std::int64_t>(small))
            << "seed " << seed << " step " << step;
        EXPECT_EQ(st.reserved_bytes[kLargePool].current, static_cast<std::int64_t>(large))
            << "seed " << seed << " step " << step;
      }
      absl::Status inv = alloc->CheckInvariants();
      ASSERT_TRUE(inv.ok()) << "seed " << seed << " step " << step << ": " << inv;
      ASSERT_TRUE(hb.hazards().empty())
          << "seed " << seed << " step " << step << ": " << hb.hazards().front();
    }
    total_reused += FragmentationOf(*alloc).reused_old_mappings;
    rig.End(persistent);
    ASSERT_TRUE(hb.hazards().empty()) << "seed " << seed << " end: " << hb.hazards().front();
    EXPECT_EQ(sim.live_events(), 0);
  }
  std::printf("reused_old_mappings total %lld\n", static_cast<long long>(total_reused));
}

INSTANTIATE_TEST_SUITE_P(
    All, OldMappingHazardTest,
    ::testing::Values(
        Params{"expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8", false,
               false},
        Params{"expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8", true, false},
        Params{"expandable_segments:True,expandable_handle_mb:24", true, false},
        Params{"expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8", false, true},
        Params{"expandable_segments:True,expandable_page_mb:2,expandable_handle_mb:8,"
               "keep_old_mappings:False",
               true, false}),
    // Readable, stable test names (the default prints the struct's bytes, pointers included).
    [](const ::testing::TestParamInfo<Params>& info) {
      const Params& p = info.param;
      std::string name = "Case" + std::to_string(info.index);
      if (p.conf.find("handle_mb:24") != std::string::npos) name += "_Handles24MiB";
      if (p.conf.find("page_mb:2") != std::string::npos) name += "_Pages2MiB";
      if (p.conf.find("keep_old_mappings:False") != std::string::npos) name += "_NoOldMappings";
      if (p.errors) name += "_DriverErrors";
      if (p.capture) name += "_Capture";
      return name;
    });

}  // namespace
}  // namespace vramledger
