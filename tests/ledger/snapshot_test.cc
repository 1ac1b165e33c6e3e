// Snapshots against SimBackend allocators: torch's keys and order, exact state strings, segment
// sums equal to the stats, device_traces in order, streamed JSON, atomic writes and OOM dumps.
#include "ledger/snapshot.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "device/sim_backend.h"
#include "ledger/atomic_file.h"
#include "ledger/device_report.h"
#include "ledger/history.h"
#include "ledger/oom_dump.h"

namespace vramledger {
namespace {

namespace fs = std::filesystem;
using Json = SnapshotJson;

constexpr StreamId kSide = 0x5151;

std::vector<std::string> Keys(const Json& j) {
  std::vector<std::string> out;
  for (const auto& [key, value] : j.items()) out.push_back(key);
  return out;
}

std::vector<std::string> TraceActions(const Json& doc, int device = 0) {
  std::vector<std::string> out;
  for (const Json& e : doc["device_traces"][device]) out.push_back(e["action"]);
  return out;
}

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

fs::path TempDir(const std::string& name) {
  fs::path dir =
      fs::temp_directory_path() / ("vramledger-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

class SnapshotTest : public ::testing::Test {
 protected:
  void Make(const std::string& conf = "", std::size_t capacity = 64 * kGiB,
            const std::string& history = "all") {
    SimBackend::Config config;
    config.capacity = capacity;
    sim_ = std::make_unique<SimBackend>(config);
    absl::StatusOr<Options> o = ParseOptions(conf);
    ASSERT_TRUE(o.ok()) << o.status();
    alloc_ = std::make_unique<DeviceAllocator>(*o, sim_.get());
    absl::StatusOr<HistorySettings> s =
        history == "off" ? ParseHistorySettings(std::nullopt, std::nullopt, "python", 1)
                         : ParseHistorySettings(history, "all", "python", 1000);
    ASSERT_TRUE(s.ok()) << s.status();
    history_ = std::make_unique<History>(*s);
    alloc_->SetHooks(history_.get());
  }
  void SetUp() override { Make(); }
  void TearDown() override { alloc_->SetHooks(nullptr); }
  DevicePtr Alloc(std::size_t size, StreamId stream = 0) {
    absl::StatusOr<DevicePtr> p = alloc_->Malloc(size, stream);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : 0;
  }
  Json Snap(const SnapshotOptions& options = SnapshotOptions()) {
    return BuildSnapshot({alloc_.get()}, history_.get(), options);
  }

  std::unique_ptr<SimBackend> sim_;
  std::unique_ptr<DeviceAllocator> alloc_;
  std::unique_ptr<History> history_;
};

TEST_F(SnapshotTest, TopLevelSegmentBlockAndEntryKeysAreTorchs) {
  const DevicePtr p = Alloc(3 * kMiB);
  ASSERT_TRUE(alloc_->Free(p).ok());
  Alloc(1000);
  const Json doc = Snap();
  EXPECT_EQ(Keys(doc), (std::vector<std::string>{"segments", "device_traces", "allocator_settings",
                                                 "external_annotations", "vramledger"}));
  ASSERT_EQ(doc["segments"].size(), 2u);
  EXPECT_EQ(
      Keys(doc["segments"][0]),
      (std::vector<std::string>{"device", "address", "total_size", "allocated_size", "active_size",
                                "requested_size", "stream", "segment_type", "segment_pool_id",
                                "is_expandable", "handles", "frames", "blocks"}));
  EXPECT_EQ(Keys(doc["segments"][0]["blocks"][0]),
            (std::vector<std::string>{"address", "size", "requested_size", "state", "frames",
                                      "handles"}));
  EXPECT_EQ(doc["segments"][0]["segment_pool_id"], Json::array({0, 0}));
  const Json& alloc_entry = doc["device_traces"][0][0];
  EXPECT_EQ(Keys(alloc_entry),
            (std::vector<std::string>{"action", "addr", "size", "stream", "time_us",
                                      "compile_context", "user_metadata", "frames"}));
  EXPECT_EQ(alloc_entry["compile_context"], "N/A");
  EXPECT_EQ(alloc_entry["user_metadata"], "");
  const Json& snapshot_entry = doc["device_traces"][0].back();
  EXPECT_EQ(snapshot_entry["action"], "snapshot");
  EXPECT_FALSE(snapshot_entry.contains("frames"));
  EXPECT_EQ(snapshot_entry["addr"], 0);
  EXPECT_EQ(snapshot_entry["size"], 1024);  // active bytes: the 1000-byte block rounded
  EXPECT_EQ(doc["external_annotations"], Json::array());
}

// A CUDA graph private pool's segment carries the pool's id, as torch's snapshot does.
TEST_F(SnapshotTest, PrivatePoolSegmentsCarryTheirPoolId) {
  constexpr StreamId kCapture = 0x20;
  Alloc(3 * kMiB);
  ASSERT_TRUE(alloc_->BeginAllocateToPool({0, 3}, [](StreamId s) { return s == kCapture; }).ok());
  const DevicePtr captured = Alloc(3 * kMiB, kCapture);
  ASSERT_TRUE(alloc_->EndAllocateToPool({0, 3}).ok());
  const Json doc = Snap();
  ASSERT_EQ(doc["segments"].size(), 2u);
  for (const Json& seg : doc["segments"]) {
    const bool captured_here = seg["address"].get<DevicePtr>() == captured;
    EXPECT_EQ(seg["segment_pool_id"], captured_here ? Json::array({0, 3}) : Json::array({0, 0}));
  }
}

TEST_F(SnapshotTest, DeviceTracesAreTheActionsInOrder) {
  const DevicePtr a = Alloc(3 * kMiB);
  ASSERT_TRUE(alloc_->Free(a).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  const Json doc = Snap();
  EXPECT_EQ(TraceActions(doc),
            (std::vector<std::string>{"segment_alloc", "alloc", "free_requested", "free_completed",
                                      "segment_free", "snapshot"}));
  const Json& t = doc["device_traces"][0];
  EXPECT_EQ(t[0]["size"], 20 * kMiB);
  EXPECT_EQ(t[1]["size"], 3 * kMiB);
  EXPECT_EQ(t[1]["addr"], a);
  EXPECT_EQ(t[4]["addr"], t[0]["addr"]);
  EXPECT_TRUE(doc["segments"].empty());
}

TEST_F(SnapshotTest, StatesAreTorchsThreeAndSegmentTotalsEqualTheStats) {
  const DevicePtr a = Alloc(2 * kMiB);
  const DevicePtr b = Alloc(4 * kMiB);
  Alloc(2 * kMiB);
  Alloc(700, kSide);
  const DevicePtr pending = Alloc(5 * kMiB);
  ASSERT_TRUE(alloc_->RecordStream(pending, kSide).ok());
  ASSERT_TRUE(alloc_->Free(pending).ok());  // its event has not completed: active_pending_free
  ASSERT_TRUE(alloc_->Free(b).ok());
  (void)a;
  const Json doc = Snap();
  const std::set<std::string> torch_states = {"active_allocated", "active_pending_free",
                                              "inactive"};
  std::set<std::string> seen;
  std::int64_t reserved = 0, allocated = 0, active = 0, requested = 0;
  for (const Json& s : doc["segments"]) {
    std::int64_t sum = 0, allocated_blocks = 0;
    for (const Json& b : s["blocks"]) {
      const std::string state = b["state"];
      EXPECT_TRUE(torch_states.contains(state)) << state;
      seen.insert(state);
      sum += b["size"].get<std::int64_t>();
      if (state == "active_allocated") allocated_blocks += b["size"].get<std::int64_t>();
      if (state == "inactive") {
        EXPECT_EQ(b["requested_size"], 0);
      }
    }
    EXPECT_EQ(sum, s["total_size"].get<std::int64_t>());
    EXPECT_EQ(allocated_blocks, s["allocated_size"].get<std::int64_t>());
    reserved += s["total_size"].get<std::int64_t>();
    allocated += s["allocated_size"].get<std::int64_t>();
    active += s["active_size"].get<std::int64_t>();
    requested += s["requested_size"].get<std::int64_t>();
  }
  EXPECT_EQ(seen, torch_states);
  const DeviceStats stats = alloc_->GetStats();
  EXPECT_EQ(reserved, stats.reserved_bytes[kAggregate].current);
  EXPECT_EQ(allocated, stats.allocated_bytes[kAggregate].current);
  EXPECT_EQ(active, stats.active_bytes[kAggregate].current);
  EXPECT_EQ(requested, stats.requested_bytes[kAggregate].current);
  const Json& v = doc["vramledger"]["devices"][0];
  EXPECT_EQ(v["stats"]["reserved_bytes.all.current"], reserved);
  EXPECT_EQ(v["fragmentation"]["reserved_bytes"], reserved);
  EXPECT_EQ(doc["vramledger"]["history"]["enabled"], "all");
}

TEST_F(SnapshotTest, FragmentationFiguresOfAKnownLayout) {
  // One 20 MiB segment: A 2 MiB | hole 4 MiB | C 2 MiB | 12 MiB free tail.
  Alloc(2 * kMiB);
  const DevicePtr b = Alloc(4 * kMiB);
  Alloc(2 * kMiB);
  ASSERT_TRUE(alloc_->Free(b).ok());
  const SegmentFigures f = ComputeSegmentFigures(SegmentsOf(*alloc_));
  EXPECT_EQ(f.reserved_bytes, static_cast<std::int64_t>(20 * kMiB));
  EXPECT_EQ(f.allocated_bytes, static_cast<std::int64_t>(4 * kMiB));
  EXPECT_EQ(f.free_bytes, static_cast<std::int64_t>(16 * kMiB));
  EXPECT_EQ(f.largest_free_block, static_cast<std::int64_t>(12 * kMiB));
  EXPECT_EQ(f.holes, 2);
  EXPECT_DOUBLE_EQ(f.free_space_fragmentation, 0.25);
  EXPECT_DOUBLE_EQ(f.utilization, 0.2);
  ASSERT_EQ(f.per_stream.size(), 1u);
  EXPECT_EQ(f.per_stream.at(0).holes, 2);
  const Json doc = Snap();
  EXPECT_EQ(doc["vramledger"]["devices"][0]["fragmentation"]["largest_free_block"], 12 * kMiB);
  EXPECT_EQ(doc["vramledger"]["devices"][0]["holes_per_stream"][0]["hole_bytes"], 16 * kMiB);
}

TEST_F(SnapshotTest, HistoryOffStillHasSegmentsAndAnEmptyTrace) {
  Make("", 64 * kGiB, "off");
  Alloc(3 * kMiB);
  const Json doc = Snap();
  ASSERT_EQ(doc["segments"].size(), 1u);
  EXPECT_EQ(doc["segments"][0]["blocks"][0]["state"], "active_allocated");
  EXPECT_EQ(doc["segments"][0]["blocks"][0]["frames"], Json::array());
  EXPECT_EQ(doc["device_traces"], Json::array({Json::array()}));
  // Recording off is null, Python's None (it was the word "None").
  EXPECT_TRUE(doc["vramledger"]["history"]["enabled"].is_null());
  EXPECT_TRUE(doc["vramledger"]["history"]["context"].is_null());
  EXPECT_EQ(doc["vramledger"]["history"]["stacks"], "python");
  // No history object at all: the same.
  const Json bare = BuildSnapshot({alloc_.get()}, nullptr);
  EXPECT_EQ(bare["device_traces"], Json::array({Json::array()}));
  EXPECT_TRUE(bare["vramledger"]["history"].is_null());
}

TEST_F(SnapshotTest, OomEntryHasDeviceFreeInsteadOfAddr) {
  Make("", 64 * kMiB);
  Alloc(40 * kMiB);
  ASSERT_FALSE(alloc_->Malloc(100 * kMiB, 0).ok());
  const Json doc = Snap();
  const Json& t = doc["device_traces"][0];
  const Json& oom = t[t.size() - 2];  // the last entry is the snapshot's
  EXPECT_EQ(oom["action"], "oom");
  EXPECT_FALSE(oom.contains("addr"));
  EXPECT_EQ(oom["device_free"], 64 * kMiB - 40 * kMiB);
  EXPECT_EQ(Keys(oom)[1], "device_free");
}

TEST_F(SnapshotTest, AllocatorSettingsUseTorchsKeysAndUnits) {
  Make("max_split_size_mb:200,roundup_power2_divisions:[256:8]");
  Alloc(1 * kMiB);
  const Json s = Snap()["allocator_settings"];
  EXPECT_EQ(Keys(s),
            (std::vector<std::string>{
                "PYTORCH_CUDA_ALLOC_CONF", "max_split_size", "garbage_collection_threshold",
                "expandable_segments", "pinned_num_register_threads", "release_lock_on_cudamalloc",
                "pinned_use_cuda_host_register", "graph_capture_record_stream_reuse",
                "roundup_power2_divisions"}));
  EXPECT_EQ(s["max_split_size"], 200 * kMiB);
  EXPECT_EQ(s["PYTORCH_CUDA_ALLOC_CONF"], "max_split_size_mb:200,roundup_power2_divisions:[256:8]");
  EXPECT_EQ(s["roundup_power2_divisions"].size(), 16u);
  EXPECT_TRUE(s["roundup_power2_divisions"].contains("32768"));
  EXPECT_EQ(AllocatorSettingsJson(Options())["max_split_size"], -1);
}

TEST_F(SnapshotTest, StreamedJsonEqualsTheBuiltDocument) {
  const DevicePtr a = Alloc(3 * kMiB);
  Alloc(5000);
  ASSERT_TRUE(alloc_->Free(a).ok());
  SnapshotOptions options;
  options.record_snapshot_entry = false;
  options.extra["replay"] = Json::object({{"at", "peak"}});
  Json built = Snap(options);
  std::ostringstream out;
  ASSERT_TRUE(WriteSnapshotJson(out, {alloc_.get()}, history_.get(), options).ok());
  Json streamed = Json::parse(out.str());
  built["vramledger"].erase("time_us");
  streamed["vramledger"].erase("time_us");
  EXPECT_EQ(streamed, built);
  EXPECT_EQ(streamed["vramledger"]["replay"]["at"], "peak");
  EXPECT_EQ(Keys(streamed), Keys(built));
}

TEST(AtomicFile, WritesWholeFilesAndLeavesNoTemporary) {
  const fs::path dir = TempDir("atomic");
  const std::string path = (dir / "out.json").string();
  ASSERT_TRUE(WriteFileAtomically(path, [](std::ostream& out) {
                out << "first";
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(ReadFile(path), "first");
  // A writer that fails half-way leaves the old file as it was and no temporary behind.
  const absl::Status failed = WriteFileAtomically(path, [](std::ostream& out) {
    out << std::string(1 << 20, 'x');
    return absl::DataLossError("stopped");
  });
  EXPECT_EQ(failed.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ReadFile(path), "first");
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    (void)entry;
    ++files;
  }
  EXPECT_EQ(files, 1);
  // A large write replaces it whole.
  ASSERT_TRUE(WriteFileAtomically(path, [](std::ostream& out) {
                out << std::string(3 << 20, 'y');
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(fs::file_size(path), 3u << 20);
  // A missing directory is an error naming the path.
  const absl::Status missing = WriteFileAtomically((dir / "no" / "such.json").string(),
                                                   [](std::ostream&) { return absl::OkStatus(); });
  EXPECT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find("no/such.json"), std::string::npos) << missing;
  fs::remove_all(dir);
}

TEST_F(SnapshotTest, SnapshotFileIsAtomicAndParses) {
  const fs::path dir = TempDir("snapfile");
  Alloc(3 * kMiB);
  const std::string path = (dir / "snap.json").string();
  ASSERT_TRUE(WriteSnapshotJsonFile(path, {alloc_.get()}, history_.get()).ok());
  const Json doc = Json::parse(ReadFile(path));
  EXPECT_EQ(doc["segments"].size(), 1u);
  EXPECT_EQ(TraceActions(doc), (std::vector<std::string>{"segment_alloc", "alloc", "snapshot"}));
  fs::remove_all(dir);
}

TEST_F(SnapshotTest, OomDumpsAreNamedAndAtMostMaxDumpsKept) {
  const fs::path dir = TempDir("dumps") / "nested";
  Alloc(3 * kMiB);
  OomDumpConfig config;
  config.dump_dir = dir.string();
  config.max_dumps = 2;
  config.device = 0;
  config.message = "CUDA out of memory. Tried to allocate 1 GiB";
  std::vector<std::string> paths;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::string> path = WriteOomDump(config, {alloc_.get()}, history_.get());
    ASSERT_TRUE(path.ok()) << path.status();
    paths.push_back(*path);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // distinct modification times
  }
  const std::string name = fs::path(paths[2]).filename().string();
  EXPECT_EQ(name.rfind("vramledger-oom-device0-pid" + std::to_string(getpid()) + "-", 0), 0u)
      << name;
  EXPECT_FALSE(fs::exists(paths[0]));
  EXPECT_TRUE(fs::exists(paths[1]));
  EXPECT_TRUE(fs::exists(paths[2]));
  const Json doc = Json::parse(ReadFile(paths[2]));
  EXPECT_EQ(doc["vramledger"]["dump"]["reason"], "oom");
  EXPECT_EQ(doc["vramledger"]["dump"]["message"], config.message);
  config.max_dumps = 0;
  absl::StatusOr<std::string> none = WriteOomDump(config, {alloc_.get()}, history_.get());
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, "");
  fs::remove_all(dir.parent_path());
}

// Each segment says whether it is expandable and how many physical handles back it, each
// block how many handles lie under it.
TEST_F(SnapshotTest, SegmentsAndBlocksShowExpandableAndHandles) {
  Make("expandable_segments:True,expandable_page_mb:20");
  Alloc(8 * kMiB);
  const DevicePtr b = Alloc(30 * kMiB);  // [8, 38) MiB: across the first two 20 MiB handles
  DevicePtr c = 0;
  {
    ContiguousSegmentsScope contiguous;
    c = Alloc(1024 * kMiB);
  }
  const Json doc = Snap();
  ASSERT_EQ(doc["segments"].size(), 2u);
  int seen = 0;
  for (const Json& seg : doc["segments"]) {
    if (seg["address"] == c) {
      ++seen;
      EXPECT_EQ(seg["is_expandable"], false);
      EXPECT_EQ(seg["handles"], 1);
      EXPECT_EQ(seg["total_size"], 1024 * kMiB);
      EXPECT_EQ(seg["blocks"][0]["handles"], 1);
    } else {
      ++seen;
      EXPECT_EQ(seg["is_expandable"], true);
      EXPECT_EQ(seg["handles"], 2);  // 40 MiB mapped
      EXPECT_EQ(seg["total_size"], 40 * kMiB);
      for (const Json& block : seg["blocks"]) {
        if (block["address"] == b) {
          EXPECT_EQ(block["handles"], 2);
        }
      }
    }
  }
  EXPECT_EQ(seen, 2);
}

}  // namespace
}  // namespace vramledger
