// The soak's driver and its checks (soak.h).
#include "soak/soak.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "device/sim_backend.h"
#include "ledger/device_report.h"
#include "vramledger/device_allocator.h"

namespace vramledger::soak {
namespace {

// Streams every device uses; the last one is the "capture" stream a private pool serves.
constexpr StreamId kStreams[] = {0, 0x11, 0x22, 0x33};
constexpr StreamId kPoolStream = 0x900;
// Live blocks kept at most per device: enough to fill the card with large requests (so that the
// out-of-memory path is taken) without the shadow model growing without bound.
constexpr std::size_t kMaxLive = 2048;

struct LiveBlock {
  std::size_t requested = 0;
  MempoolId pool = {0, 0};
};

// One simulated device, its allocator, the shadow model of its live blocks and its private
// pool's state.
struct Device {
  std::string name;
  std::unique_ptr<SimBackend> sim;
  std::unique_ptr<DeviceAllocator> alloc;
  std::map<DevicePtr, LiveBlock> live;
  std::vector<DevicePtr> order;  // the live addresses, for a uniform random pick
  MempoolId pool = {0, 0};       // the private pool being allocated to; {0, 0}: none
  std::uint64_t next_pool = 1;
  std::vector<MempoolId> released;  // pools released, emptied at the end
};

class Runner {
 public:
  explicit Runner(const SoakConfig& config) : config_(config), rng_(config.seed) {
    AddDevice("expandable", "expandable_segments:True,expandable_page_mb:2", 0);
    AddDevice("plain", "max_split_size_mb:256,garbage_collection_threshold:0.8", 1);
  }

  SoakResult Run() {
    const auto start = std::chrono::steady_clock::now();
    for (std::int64_t op = 0; op < config_.ops; ++op) {
      Step(devices_[rng_() % devices_.size()]);
      ++result_.ops;
      if ((op + 1) % config_.check_every == 0) CheckAll("op " + std::to_string(op + 1));
    }
    CheckAll("end of the sequence");
    for (Device& d : devices_) DrainAndCheckEmpty(d);
    result_.wall_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return std::move(result_);
  }

 private:
  void AddDevice(std::string name, const std::string& conf, int index) {
    SimBackend::Config sim_config;
    sim_config.device = index;
    sim_config.capacity = config_.capacity;
    Device d;
    d.name = std::move(name);
    d.sim = std::make_unique<SimBackend>(sim_config);
    auto options = ParseOptions(conf);
    if (!options.ok()) {
      Violation("options", options.status().ToString());
      options = Options();
    }
    d.alloc = std::make_unique<DeviceAllocator>(*options, d.sim.get());
    devices_.push_back(std::move(d));
  }

  void Violation(const Device& d, absl::string_view where, absl::string_view what) {
    Violation(absl::StrCat(d.name, " ", where), what);
  }
  void Violation(absl::string_view where, absl::string_view what) {
    ++result_.violations;
    if (result_.messages.size() < config_.max_violations_kept) {
      result_.messages.push_back(absl::StrCat(where, ": ", what));
    }
  }

  // Log-uniform over [1 B, 256 MiB], with a few exact granularity multiples.
  std::size_t RandomSize() {
    if (rng_() % 16 == 0) return (1 + rng_() % 8) * 2 * kMiB;
    std::uniform_real_distribution<double> lg(0.0, 28.0);
    return static_cast<std::size_t>(std::exp2(lg(rng_))) + rng_() % 512;
  }

  void Step(Device& d) {
    const int what = static_cast<int>(rng_() % 1000);
    if (what < 450 && d.live.size() < kMaxLive) {
      Malloc(d, rng_() % 8 == 0 && d.pool != MempoolId{0, 0}
                    ? kPoolStream
                    : kStreams[rng_() % std::size(kStreams)]);
    } else if (what < 900 && !d.order.empty()) {
      const std::size_t i = rng_() % d.order.size();
      const DevicePtr p = d.order[i];
      if (rng_() % 5 == 0) {
        ++result_.record_streams;
        const absl::Status s = d.alloc->RecordStream(p, kStreams[rng_() % std::size(kStreams)]);
        if (!s.ok()) Violation(d, "record_stream", s.ToString());
      }
      ++result_.frees;
      const absl::Status s = d.alloc->Free(p);
      if (!s.ok()) Violation(d, "free", s.ToString());
      d.order[i] = d.order.back();
      d.order.pop_back();
      d.live.erase(p);
    } else if (what < 960) {
      ++result_.event_completions;
      if (rng_() % 4 == 0) {
        d.sim->CompleteAllEvents();
      } else {
        d.sim->CompleteStream(kStreams[rng_() % std::size(kStreams)]);
      }
    } else if (what < 970) {
      ++result_.empty_caches;
      const absl::Status s = d.alloc->EmptyCache();
      if (!s.ok()) Violation(d, "empty_cache", s.ToString());
    } else if (what < 985) {
      TogglePool(d);
    } else {
      // Reads as a monitoring thread would make them (the stats identities are checked at the
      // period; here only that they are readable without disturbing anything).
      const DeviceStats s = d.alloc->GetStats();
      result_.peak_reserved = std::max(result_.peak_reserved, s.reserved_bytes[kAggregate].peak);
    }
  }

  void Malloc(Device& d, StreamId stream) {
    const std::size_t size = RandomSize();
    ++result_.mallocs;
    absl::StatusOr<DevicePtr> p = d.alloc->Malloc(size, stream);
    if (!p.ok()) {
      if (p.status().code() == absl::StatusCode::kResourceExhausted) {
        ++result_.ooms;
      } else {
        Violation(d, "malloc", p.status().ToString());
      }
      return;
    }
    if (*p == 0) return Violation(d, "malloc", absl::StrCat("null pointer for ", size, " bytes"));
    const MempoolId pool = stream == kPoolStream ? d.pool : MempoolId{0, 0};
    if (!d.live.emplace(*p, LiveBlock{size, pool}).second) {
      return Violation(d, "malloc", absl::StrCat("address ", *p, " handed out twice"));
    }
    d.order.push_back(*p);
  }

  // Starts allocating the pool stream's requests to a new private pool, or stops and releases
  // the current one (torch's capture begin / end and graph reset).
  void TogglePool(Device& d) {
    if (d.pool == MempoolId{0, 0}) {
      const MempoolId pool{d.next_pool++, 0};
      const absl::Status s =
          d.alloc->BeginAllocateToPool(pool, [](StreamId s) { return s == kPoolStream; });
      if (!s.ok()) return Violation(d, "begin pool", s.ToString());
      d.pool = pool;
      ++result_.pool_entries;
      return;
    }
    absl::Status s = d.alloc->EndAllocateToPool(d.pool);
    if (!s.ok()) Violation(d, "end pool", s.ToString());
    s = d.alloc->ReleasePool(d.pool);
    if (!s.ok()) Violation(d, "release pool", s.ToString());
    d.released.push_back(d.pool);
    d.pool = {0, 0};
  }

  void CheckAll(absl::string_view where) {
    ++result_.checks;
    for (const Device& d : devices_) Check(d, where);
  }

  // The allocator's own invariants, then the four checks against the backend and the model.
  void Check(const Device& d, absl::string_view where) {
    const absl::Status inv = d.alloc->CheckInvariants();
    if (!inv.ok()) Violation(d, where, inv.ToString());
    const DeviceStats stats = d.alloc->GetStats();
    std::int64_t plain = 0, active_allocated = 0, live_requested = 0, block_requested = 0;
    std::size_t live_blocks = 0;
    for (const SegmentInfo& seg : SegmentsOf(*d.alloc)) {
      if (!seg.is_expandable) plain += static_cast<std::int64_t>(seg.total_size);
      for (const BlockInfo& b : seg.blocks) {
        if (absl::string_view(b.state) == "inactive") continue;
        block_requested += static_cast<std::int64_t>(b.requested_size);
        // A live block sits on mapped, accessible pages (plain segments are wholly backed).
        if (seg.is_expandable && !d.sim->IsAccessible(b.address, b.size)) {
          Violation(d, where, absl::StrCat("live block at ", b.address, " of ", b.size,
                                           " bytes is not on mapped pages"));
        }
        if (absl::string_view(b.state) != "active_allocated") continue;
        ++live_blocks;
        active_allocated += static_cast<std::int64_t>(b.size);
        auto it = d.live.find(b.address);
        if (it == d.live.end()) {
          Violation(d, where, absl::StrCat("allocated block at ", b.address, " not in the model"));
          continue;
        }
        live_requested += static_cast<std::int64_t>(it->second.requested);
        if (b.requested_size != it->second.requested) {
          Violation(d, where, absl::StrCat("block at ", b.address, " requested ",
                                           b.requested_size, ", model ", it->second.requested));
        }
        if (b.size < it->second.requested) {
          Violation(d, where, absl::StrCat("block at ", b.address, " smaller than its request"));
        }
      }
    }
    // Reserved equals the pages the driver has mapped (each handle once) plus plain segments.
    const std::int64_t mapped =
        static_cast<std::int64_t>(d.sim->mapped_bytes() - d.sim->aliased_bytes());
    const std::int64_t reserved = stats.reserved_bytes[kAggregate].current;
    if (reserved != mapped + plain) {
      Violation(d, where, absl::StrCat("reserved ", reserved, " != mapped ", mapped,
                                       " + plain segments ", plain));
    }
    // Allocated equals the model's live blocks, byte for byte and block for block.
    if (live_blocks != d.live.size()) {
      Violation(d, where, absl::StrCat(live_blocks, " allocated blocks, model ", d.live.size()));
    }
    std::int64_t model_requested = 0;
    for (const auto& [p, block] : d.live) model_requested += block.requested;
    if (model_requested != live_requested) {
      Violation(d, where, absl::StrCat("allocated blocks requested ", live_requested,
                                       " bytes, model ", model_requested));
    }
    // requested_bytes, as torch's, still counts blocks freed while waiting for their streams.
    if (stats.requested_bytes[kAggregate].current != block_requested) {
      Violation(d, where, absl::StrCat("requested bytes ", stats.requested_bytes[kAggregate].current,
                                       ", active blocks ", block_requested));
    }
    if (stats.allocated_bytes[kAggregate].current != active_allocated) {
      Violation(d, where, absl::StrCat("allocated bytes ", stats.allocated_bytes[kAggregate].current,
                                       ", allocated blocks ", active_allocated));
    }
    if (stats.allocation[kAggregate].current != static_cast<std::int64_t>(d.live.size())) {
      Violation(d, where, absl::StrCat("allocations ", stats.allocation[kAggregate].current,
                                       ", model ", d.live.size()));
    }
    result_.peak_reserved = std::max(result_.peak_reserved, stats.reserved_bytes[kAggregate].peak);
  }

  // Frees every block, completes every event, empties the cache and each released pool: nothing
  // may stay reserved or held from the driver.
  void DrainAndCheckEmpty(Device& d) {
    if (d.pool != MempoolId{0, 0}) TogglePool(d);
    for (DevicePtr p : d.order) {
      const absl::Status s = d.alloc->Free(p);
      if (!s.ok()) Violation(d, "final free", s.ToString());
    }
    d.order.clear();
    d.live.clear();
    d.sim->CompleteAllEvents();
    absl::Status s = d.alloc->EmptyCache();
    if (!s.ok()) Violation(d, "final empty_cache", s.ToString());
    for (MempoolId pool : d.released) {
      s = d.alloc->EmptyCache(pool);
      if (!s.ok()) Violation(d, "final empty_cache(pool)", s.ToString());
    }
    ++result_.checks;
    Check(d, "after freeing everything");
    const DeviceStats stats = d.alloc->GetStats();
    if (stats.reserved_bytes[kAggregate].current != 0) {
      Violation(d, "after freeing everything",
                absl::StrCat("reserved ", stats.reserved_bytes[kAggregate].current, " != 0"));
    }
    if (d.sim->used_bytes() != 0 || d.sim->mapped_bytes() != 0) {
      Violation(d, "after freeing everything",
                absl::StrCat("the driver still holds ", d.sim->used_bytes(), " bytes, maps ",
                             d.sim->mapped_bytes()));
    }
  }

  const SoakConfig config_;
  std::mt19937_64 rng_;
  std::vector<Device> devices_;
  SoakResult result_;
};

}  // namespace

SoakResult RunSoak(const SoakConfig& config) { return Runner(config).Run(); }

}  // namespace vramledger::soak
