// Fuzz target: sequences of allocator operations on SimBackend decoded from the input (sizes from
// 0 to SIZE_MAX, streams, frees of live, unknown and freed addresses, record_stream, event
// completion, empty_cache, captures into graph pools, MemPools, checkpoints, pausable regions,
// injected driver errors), under options chosen by the first bytes. After every operation: the full
// invariant check and a shadow model of the live blocks (tests/fuzz/allocator_ops_model.h); at the
// end, everything freed and the cache emptied, nothing may be left on the device.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "allocator_ops_model.h"
#include "core/core_view.h"
#include "core/pool_checkpoint.h"
#include "device/sim_backend.h"
#include "fuzz_check.h"
#include "vramledger/device_allocator.h"

namespace vramledger::fuzz {
namespace {

constexpr StreamId kStreams[] = {0, 0x11, 0x22, 0x33};
constexpr StreamId kCaptureStreams[] = {0x20, 0x30};
constexpr MempoolId kPools[] = {{1, 0}, {2, 0}, {3, 0}};
constexpr const char* kRegions[] = {"ra", "rb"};
constexpr std::size_t kPinnedCapacity = 256 * kMiB;

// Options from the first two bytes: every setting that changes where a block goes.
std::string ConfFrom(ByteReader& in) {
  const std::uint8_t a = in.Byte();
  const std::uint8_t b = in.Byte();
  std::string conf = absl::StrCat("expandable_segments:", a & 1 ? "True" : "False");
  if (a & 2) conf += ",page_recycling:False";
  if (a & 4) conf += ",keep_old_mappings:False";
  if (a & 8) conf += ",recycle_tails_first:True";
  if (a & 16) conf += ",expandable_page_mb:2";
  if (a & 32) conf += ",expandable_handle_mb:12";
  if (a & 64) conf += ",garbage_collection_threshold:0.5";
  if (a & 128) conf += ",recycle_slack:0";
  static constexpr const char* kSplit[] = {"", ",max_split_size_mb:20", ",max_split_size_mb:64",
                                           ",max_split_size_mb:20,max_non_split_rounding_mb:40"};
  static constexpr const char* kRound[] = {"", ",roundup_power2_divisions:4",
                                           ",roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
                                           ",roundup_power2_divisions:1"};
  static constexpr const char* kSegment[] = {"", ",large_segment_size_mb:2"};
  conf += kSplit[b & 3];
  conf += kRound[(b >> 2) & 3];
  conf += kSegment[(b >> 4) & 1];
  if (b & 32) conf += ",grow_under_cap:False";
  return conf;
}

std::size_t CapacityFrom(std::uint8_t byte) {
  static constexpr std::size_t kCapacities[] = {256 * kMiB, 1 * kGiB, 4 * kGiB, 16 * kGiB};
  return kCapacities[byte & 3];
}

// A request size: the edges (0, 1, 511/512/513, the small/large pool border, segment sizes, more
// than the card, SIZE_MAX) or a random size of each pool.
std::size_t SizeFrom(ByteReader& in, std::size_t capacity) {
  const std::uint8_t kind = in.Byte();
  switch (kind % 16) {
    case 0:
      return 0;
    case 1:
      return 1 + kind / 16;
    case 2:
      return 511 + kind / 16 % 3;
    case 3:
      return kMiB - 1 + kind / 16 % 3;
    case 4:
      return 2 * kMiB + (kind / 16) * kMiB;
    case 5:
      return 10 * kMiB + kind / 16 % 3 - 1;
    case 6:
      return capacity + 1;
    case 7:
      return kind & 16 ? std::numeric_limits<std::size_t>::max()
                       : std::numeric_limits<std::size_t>::max() / 2 + 1;
    case 8:
      return std::numeric_limits<std::size_t>::max() - 511 + kind / 16;
    case 9:
      return capacity / 2 + kind;
    case 10:
    case 11:
    case 12:
      return 1 + in.U16();  // small pool
    case 13:
    case 14:
      return kMiB + static_cast<std::size_t>(in.U16()) * 1024;  // large pool, to 65 MiB
    default:
      return static_cast<std::size_t>(in.U16() % 512 + 1) * kMiB;
  }
}

// VRAMLEDGER_FUZZ_TRACE=1 prints each operation (to read a crash's input).
bool Tracing() {
  static const bool on = std::getenv("VRAMLEDGER_FUZZ_TRACE") != nullptr;
  return on;
}

class Run {
 public:
  Run(const std::string& conf, std::size_t capacity) : capacity_(capacity) {
    SimBackend::Config config;
    config.capacity = capacity;
    sim_ = std::make_unique<SimBackend>(config);
    // A region's CPU backup is real host memory here: capped, so that a pause of a region of
    // gigabytes is refused (ResourceExhausted, a path of its own) instead of exhausting the
    // fuzzer's memory limit.
    sim_->SetPinnedCapacity(kPinnedCapacity);
    auto options = ParseOptions(conf);
    Check(options.ok(), absl::StrCat("options '", conf, "': ", options.status().ToString()));
    alloc_ = std::make_unique<DeviceAllocator>(*options, sim_.get());
    model_ = std::make_unique<Model>(alloc_.get(), sim_.get(), options->roundup_power2_divisions);
  }

  void Step(ByteReader& in) {
    const std::uint8_t op = in.Byte();
    const std::string name = absl::StrCat("op ", ops_++, " (", static_cast<int>(op % 24), ")");
    model_->BeginOp(capturing_ > 0);
    if (Tracing()) std::fprintf(stderr, "%s\n", name.c_str());
    switch (op % 24) {
      case 0:
      case 1:
      case 2:
      case 3:
      case 4:
      case 5:
        Malloc(in, name);
        break;
      case 6:
      case 7:
      case 8:
        FreeLive(in, name);
        break;
      case 9:
        FreeUnknown(in, name);
        break;
      case 10:
        RecordStream(in, name);
        break;
      case 11:
        Complete(in);
        break;
      case 12:
        model_->Allowed(name, alloc_->EmptyCache(), {});
        break;
      case 13:
        BeginCapture(in, name);
        break;
      case 14:
        EndCapture(in, name);
        break;
      case 15:
        ReleasePool(in, name);
        break;
      case 16:
        MemPool(in, name);
        break;
      case 17:
        model_->Allowed(name, alloc_->EmptyCache(kPools[in.Byte() % 3]), {});
        break;
      case 18:
        Inject(in);
        break;
      case 19:
        Fraction(in, name);
        break;
      case 20:
        Checkpoint(in, name);
        break;
      case 21:
        Restore(in, name);
        break;
      case 22:
        Share(in, name);
        break;
      default:
        Region(in, name);
        break;
    }
    NoteForgottenPools();
    model_->CheckAll(name);
  }

  // Everything freed, every pool released, the GPU caught up: the cache empties to nothing.
  void Finish() {
    for (int k = 0; k < kNumDriverCalls; ++k) {
      sim_->FailCall(static_cast<DriverCall>(k), 1 << 30, absl::InternalError("never"));
    }
    for (int c = 0; c < 2; ++c) {
      if (capture_pool_[c].has_value()) {
        sim_->SetCapturing(kCaptureStreams[c], false);
        capture_id_[c] = 0;
        const absl::Status ended = alloc_->EndAllocateToPool(*capture_pool_[c]);
        Check(ended.ok(), absl::StrCat("end capture at finish: ", ended.ToString()));
      }
    }
    for (const MempoolId& pool : kPools) {
      while (routed_[pool.first] > 0) {
        const absl::Status ended = alloc_->EndAllocateToPool(pool);
        Check(ended.ok(), absl::StrCat("end use_mem_pool at finish: ", ended.ToString()));
        --routed_[pool.first];
      }
    }
    while (!region_stack_.empty()) {
      Check(alloc_->EndRegion(region_stack_.back()).ok(), "end region at finish");
      region_stack_.pop_back();
    }
    model_->BeginOp(/*capturing=*/false);
    model_->FreeEverything();
    for (const MempoolId& pool : kPools) {
      for (int guard = 0; alloc_->PoolUseCount(pool) > 0 && guard < 1000; ++guard) {
        Check(alloc_->ReleasePool(pool).ok(), "release pool at finish");
      }
    }
    // A paused region keeps its virtual ranges until it runs again: resumed (its free pages
    // only, nothing is live), then emptied. A resume asks for every page the pause released, as
    // any growth of reserved memory: with the fraction lifted, a region alone fits on the card
    // (it did before its pause), so each resume comes after every other byte is released. The
    // one exception: pages a failed pause lost stay unmapped under their blocks, later growth
    // may take the memory they had, and the region's next pause then releases more than the
    // card holds. Its resume is refused as out of memory with nothing changed (regions.md,
    // "Resume"); the region stays paused and its addresses go with the allocator.
    Check(alloc_->SetMemoryFraction(1.0).ok(), "fraction at finish");
    sim_->CompleteAllEvents();
    Check(alloc_->EmptyCache().ok(), "empty_cache before the resumes at finish");
    for (const char* region : kRegions) {
      const auto r = alloc_->ResumeRegion(region, /*keep_host_buffers=*/false);
      if (!r.ok() && r.status().code() == absl::StatusCode::kResourceExhausted &&
          PausedBytes(region) > sim_capacity()) {
        continue;
      }
      Check(r.ok() || r.status().code() == absl::StatusCode::kNotFound,
            absl::StrCat("resume of region ", region, " at finish: ", r.status().ToString()));
      model_->SetPaused(region, false);
      const absl::Status emptied = alloc_->EmptyCache();
      Check(emptied.ok(), absl::StrCat("empty_cache at finish: ", emptied.ToString()));
    }
    model_->CheckAll("finish");
    model_->CheckEmpty();
    model_.reset();
    alloc_.reset();
    Check(sim_->live_reservations() == 0, "an address reservation outlived the allocator");
    Check(sim_->live_events() == 0, "an event outlived the allocator");
  }

 private:
  void Malloc(ByteReader& in, const std::string& name) {
    const std::size_t size = SizeFrom(in, sim_capacity());
    const std::uint8_t s = in.Byte();
    const StreamId stream = s & 8 ? kCaptureStreams[s & 1] : kStreams[s & 3];
    if (Tracing()) std::fprintf(stderr, "  malloc(%zu, stream 0x%lx)\n", size, stream);
    model_->Malloc(name, size, stream, alloc_->Malloc(size, stream));
  }
  void FreeLive(ByteReader& in, const std::string& name) {
    if (auto p = model_->Pick(in.U16()); p.has_value()) model_->Free(name, *p);
  }
  void FreeUnknown(ByteReader& in, const std::string& name) {
    const std::uint8_t how = in.Byte();
    DevicePtr p = 0;
    if (how % 3 == 0) p = model_->LastFreed();                 // a double free
    if (how % 3 == 1) p = 0x7f0000000000 + in.U32() * 512ull;  // inside the sim's range
    if (how % 3 == 2)
      if (auto q = model_->Pick(in.U16())) p = *q + 512 * (1 + how / 3);  // inside
    model_->FreeUnknown(name, p);
  }
  void RecordStream(ByteReader& in, const std::string& name) {
    const auto p = model_->Pick(in.U16());
    const StreamId stream = kStreams[in.Byte() & 3];
    if (p.has_value()) model_->Allowed(name, alloc_->RecordStream(*p, stream), {});
  }
  void Complete(ByteReader& in) {
    const std::uint8_t how = in.Byte();
    if (how % 4 == 0)
      sim_->CompleteAllEvents();
    else
      sim_->CompleteStream(how & 128 ? kCaptureStreams[how & 1] : kStreams[(how >> 2) & 3]);
  }
  void BeginCapture(ByteReader& in, const std::string& name) {
    const std::uint8_t b = in.Byte();
    const int c = b & 1;
    if (capture_pool_[c].has_value()) return;
    const MempoolId pool = kPools[(b >> 1) % 3];
    SimBackend* sim = sim_.get();
    const StreamId stream = kCaptureStreams[c];
    // torch's capture filter: the stream's current capture is this one (its capture id), so an
    // entry left of an ended capture never takes a later capture's allocations on its stream.
    const std::uint64_t id = ++captures_begun_;
    const std::uint64_t* current = &capture_id_[c];
    const absl::Status s =
        alloc_->BeginAllocateToPool(pool, [sim, stream, current, id](StreamId x) {
          return x == stream && sim->IsCapturing(x) && *current == id;
        });
    model_->Allowed(name, s, {absl::StatusCode::kInvalidArgument});
    if (!s.ok()) return;
    sim_->SetCapturing(stream, true);
    if (Tracing()) std::fprintf(stderr, "  capture on 0x%lx into pool %lu\n", stream, pool.first);
    capture_pool_[c] = pool;
    capture_id_[c] = id;
    ++capturing_;
  }
  void EndCapture(ByteReader& in, const std::string& name) {
    const int c = in.Byte() & 1;
    if (!capture_pool_[c].has_value()) return;
    const MempoolId pool = *capture_pool_[c];
    if (Tracing()) std::fprintf(stderr, "  end capture on 0x%lx\n", kCaptureStreams[c]);
    sim_->SetCapturing(kCaptureStreams[c], false);
    capture_pool_[c].reset();
    capture_id_[c] = 0;
    --capturing_;
    // The capture has ended before its pool's end: what that end does (deferred frees) is
    // checked against the captures still under way.
    model_->BeginOp(capturing_ > 0);
    model_->Allowed(name, alloc_->EndAllocateToPool(pool), {});
  }
  void ReleasePool(ByteReader& in, const std::string& name) {
    const MempoolId pool = kPools[in.Byte() % 3];
    if (Tracing()) std::fprintf(stderr, "  release pool %lu\n", pool.first);
    model_->Allowed(name, alloc_->ReleasePool(pool),
                    {absl::StatusCode::kNotFound, absl::StatusCode::kFailedPrecondition});
  }
  // torch.cuda.MemPool: create or add a use, route every stream to it (use_mem_pool) or stop,
  // use_on_oom, no_split.
  void MemPool(ByteReader& in, const std::string& name) {
    const std::uint8_t b = in.Byte();
    const MempoolId pool = kPools[b % 3];
    if (Tracing()) std::fprintf(stderr, "  mem pool %lu: call %d\n", pool.first, (b >> 2) % 5);
    switch ((b >> 2) % 5) {
      case 0:
        model_->Allowed(name, alloc_->CreateOrIncrefPool(pool), {});
        break;
      case 1: {
        const absl::Status s = alloc_->BeginAllocateToPool(pool, [](StreamId) { return true; });
        model_->Allowed(name, s, {absl::StatusCode::kInvalidArgument});
        if (s.ok()) ++routed_[pool.first];
        break;
      }
      case 2:
        if (routed_[pool.first] > 0) {
          model_->Allowed(name, alloc_->EndAllocateToPool(pool), {});
          --routed_[pool.first];
        }
        break;
      case 3:
        model_->Allowed(name, alloc_->SetUseOnOOM(pool, b & 128), {absl::StatusCode::kNotFound});
        break;
      default:
        model_->Allowed(name, alloc_->SetNoSplit(pool), {absl::StatusCode::kNotFound});
    }
  }
  void Inject(ByteReader& in) {
    const std::uint8_t kind = in.Byte();
    const std::uint8_t skip = in.Byte();
    if (Tracing()) {
      std::fprintf(
          stderr, "  fail %s after %d calls\n",
          std::string(DriverCallName(static_cast<DriverCall>(kind % kNumDriverCalls))).c_str(),
          skip % 8);
    }
    sim_->FailCall(static_cast<DriverCall>(kind % kNumDriverCalls), skip % 8,
                   absl::InternalError("injected driver error"));
  }
  void Fraction(ByteReader& in, const std::string& name) {
    static constexpr double kFractions[] = {
        0.0, 0.05, 0.5, 1.0, 1.5, -0.1, std::numeric_limits<double>::quiet_NaN(), 0.9};
    const double f = kFractions[in.Byte() % 8];
    const absl::Status s = alloc_->SetMemoryFraction(f);
    const bool valid = f >= 0.0 && f <= 1.0;
    Check(s.ok() == valid, absl::StrCat(name, ": set_memory_fraction(", f, "): ", s.ToString()));
    if (!valid) Check(s.code() == absl::StatusCode::kInvalidArgument, name + ": fraction code");
  }
  void Checkpoint(ByteReader& in, const std::string& name) {
    const int i = in.Byte() % 3;
    auto cp = alloc_->CheckpointPool(kPools[i]);
    if (Tracing())
      std::fprintf(stderr, "  checkpoint pool %d: %s\n", i + 1, cp.status().ToString().c_str());
    // A pool made inside a region has the region's expandable segments, which checkpoints do
    // not cover (docs/design/regions.md): refused as unimplemented, saying so.
    if (cp.status().code() == absl::StatusCode::kUnimplemented) {
      Check(cp.status().message().find("expandable segments") != std::string_view::npos,
            absl::StrCat(name, ": ", cp.status().ToString()));
      return;
    }
    model_->Allowed(name, cp.status(),
                    {absl::StatusCode::kNotFound, absl::StatusCode::kFailedPrecondition});
    if (cp.ok()) {
      checkpoints_[i] = *std::move(cp);
      checkpoint_pool_forgotten_[i] = false;
    }
  }
  void Restore(ByteReader& in, const std::string& name) {
    const int i = in.Byte() % 3;
    if (!checkpoints_[i].has_value()) return;
    if (Tracing()) {
      std::fprintf(stderr, "  restore pool %d (its checkpoint's pool %s)\n", i + 1,
                   checkpoint_pool_forgotten_[i] ? "forgotten since" : "kept");
    }
    const auto r = alloc_->RestorePool(kPools[i], *checkpoints_[i]);
    const bool other_incarnation =
        !r.ok() && r.status().message().find("released and forgotten since") != std::string::npos;
    if (!checkpoint_pool_forgotten_[i]) {
      Check(!other_incarnation, absl::StrCat(name, ": ", r.status().ToString()));
      model_->Restore(name, kPools[i], r);
      return;
    }
    // The pool it was taken from is gone: no pool of the id (NotFound), or another pool made
    // since under the id, which the checkpoint does not restore (FailedPrecondition, saying so).
    if (!PoolKnown(kPools[i])) {
      Check(r.status().code() == absl::StatusCode::kNotFound,
            absl::StrCat(name, ": restore into a forgotten pool: ", r.status().ToString()));
    } else {
      Check(r.status().code() == absl::StatusCode::kFailedPrecondition && other_incarnation,
            absl::StrCat(name, ": restore of a checkpoint of a forgotten pool into another: ",
                         r.status().ToString()));
    }
  }
  // Whether the allocator holds pool `id` (in use, or released with segments left).
  bool PoolKnown(MempoolId id) const {
    bool known = false;
    alloc_->Read([&](const core::CoreView& view) {
      for (const auto& [blocks, owner] : view.private_pools) known = known || owner == id;
    });
    return known;
  }
  // A checkpoint's pool forgotten by the allocator stays so for that checkpoint, whatever pool
  // is made later under its id.
  void NoteForgottenPools() {
    for (int i = 0; i < 3; ++i) {
      if (checkpoints_[i].has_value() && !PoolKnown(kPools[i])) {
        checkpoint_pool_forgotten_[i] = true;
      }
    }
  }
  void Share(ByteReader& in, const std::string& name) {
    const auto p = model_->Pick(in.U16());
    if (!p.has_value()) return;
    model_->Allowed(name, alloc_->ShareIpcHandle(*p).status(),
                    {absl::StatusCode::kFailedPrecondition});
  }
  // Pausable regions (op 23, whose byte also chose the peak reset it was alone): begin (every
  // stream routed to it) or end a scope, pause (with or without a CPU backup), resume.
  void Region(ByteReader& in, const std::string& name) {
    const std::uint8_t b = in.Byte();
    const char* region = kRegions[(b >> 3) & 1];
    if (Tracing()) std::fprintf(stderr, "  region %s: call %d\n", region, b % 5);
    switch (b % 5) {
      case 0:
        alloc_->ResetPeakStats();
        break;
      case 1: {
        const auto pool = alloc_->BeginRegion(region, [](StreamId) { return true; });
        model_->Allowed(name, pool.status(), {});
        if (!pool.ok()) return;
        region_stack_.push_back(region);
        break;
      }
      case 2:
        if (region_stack_.empty()) return;
        model_->Allowed(name, alloc_->EndRegion(region_stack_.back()), {});
        region_stack_.pop_back();
        break;
      case 3: {
        const RegionBackup backup = b & 128 ? RegionBackup::kCpu : RegionBackup::kNone;
        const auto r = alloc_->PauseRegion(region, backup);
        model_->Allowed(name, r.status(),
                        {absl::StatusCode::kNotFound, absl::StatusCode::kFailedPrecondition,
                         absl::StatusCode::kResourceExhausted});
        if (Tracing())
          std::fprintf(stderr, "  pause %s: %s\n", region, r.status().ToString().c_str());
        if (r.ok()) model_->SetPaused(region, true);
        break;
      }
      default: {
        const auto r = alloc_->ResumeRegion(region, /*keep_host_buffers=*/b & 64);
        model_->Allowed(name, r.status(),
                        {absl::StatusCode::kNotFound, absl::StatusCode::kFailedPrecondition,
                         absl::StatusCode::kResourceExhausted});
        if (Tracing())
          std::fprintf(stderr, "  resume %s: %s\n", region, r.status().ToString().c_str());
        if (r.ok()) model_->SetPaused(region, false);
      }
    }
  }
  std::size_t sim_capacity() const { return capacity_; }
  std::size_t PausedBytes(const char* region) const {
    for (const RegionInfo& r : alloc_->Regions()) {
      if (r.name == region) return r.paused_bytes;
    }
    return 0;
  }

  const std::size_t capacity_;
  std::unique_ptr<SimBackend> sim_;
  std::unique_ptr<DeviceAllocator> alloc_;
  std::unique_ptr<Model> model_;
  std::optional<MempoolId> capture_pool_[2];
  std::uint64_t capture_id_[2] = {0, 0};  // the capture under way on each stream (0: none)
  std::uint64_t captures_begun_ = 0;
  int capturing_ = 0;
  std::map<std::uint64_t, int> routed_;  // open use_mem_pool routes by pool
  std::optional<core::PoolCheckpoint> checkpoints_[3];
  bool checkpoint_pool_forgotten_[3] = {false, false, false};  // since its checkpoint was taken
  std::vector<std::string> region_stack_;  // this thread's open BeginRegion scopes, innermost last
  int ops_ = 0;
};

}  // namespace
}  // namespace vramledger::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace vramledger::fuzz;
  ByteReader in(data, size);
  const std::string conf = ConfFrom(in);
  const std::size_t capacity = CapacityFrom(in.Byte());
  Run run(conf, capacity);
  while (!in.done()) run.Step(in);
  run.Finish();
  return 0;
}
