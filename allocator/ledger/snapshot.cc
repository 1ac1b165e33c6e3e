// Snapshot assembly: reads segments and stats from each allocator and entries from the history,
// symbolises each distinct stack once, and emits torch's keys (in torch's order) plus vramledger's.
// Thread-safety: stateless; see snapshot.h.
#include "ledger/snapshot.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "ledger/atomic_file.h"
#include "ledger/device_report.h"
#include "vramledger/stats.h"

#ifndef VRAMLEDGER_VERSION
#define VRAMLEDGER_VERSION "0.0.0"
#endif

namespace vramledger {
namespace {

using Json = SnapshotJson;

// What one snapshot reads, all taken before anything is formatted.
struct DeviceCapture {
  int device = 0;
  const DeviceAllocator* allocator = nullptr;
  std::vector<SegmentInfo> segments;
  DeviceStats stats;
};
struct Capture {
  std::vector<DeviceCapture> devices;
  std::vector<std::vector<RecordedEntry>> traces;  // indexed by device
};

Capture Take(const std::vector<const DeviceAllocator*>& allocators, History* history,
             bool record_snapshot_entry) {
  Capture c;
  int max_device = -1;
  for (const DeviceAllocator* a : allocators) {
    if (a == nullptr) continue;
    DeviceCapture d;
    d.allocator = a;
    d.device = a->backend()->device();
    d.segments = SegmentsOf(*a);
    d.stats = a->GetStats();
    max_device = std::max(max_device, d.device);
    if (history != nullptr && record_snapshot_entry) {
      std::size_t active = 0;
      for (const SegmentInfo& s : d.segments) active += s.active_size;
      history->RecordSnapshot(d.device, active);
    }
    c.devices.push_back(std::move(d));
  }
  if (history != nullptr) {
    for (int d : history->DevicesWithEntries()) max_device = std::max(max_device, d);
    c.traces.resize(static_cast<std::size_t>(max_device + 1));
    for (int d = 0; d <= max_device; ++d) c.traces[d] = history->Entries(d);
  } else {
    c.traces.resize(static_cast<std::size_t>(max_device + 1));
  }
  return c;
}

// Symbolised frames per stack id, each computed once per snapshot.
class FrameCache {
 public:
  explicit FrameCache(const History* history) : history_(history) {}
  const Json& Get(std::uint64_t id) {
    if (id == 0 || history_ == nullptr) return empty_;
    auto it = cache_.find(id);
    if (it != cache_.end()) return it->second;
    Json frames = Json::array();
    for (const Frame& f : history_->Frames(id)) {
      Json frame = Json::object();
      frame["name"] = f.name;  // torch's key order: name, filename, line
      frame["filename"] = f.filename;
      frame["line"] = f.line;
      frames.push_back(std::move(frame));
    }
    return cache_.emplace(id, std::move(frames)).first->second;
  }

 private:
  const History* history_;
  const Json empty_ = Json::array();
  absl::flat_hash_map<std::uint64_t, Json> cache_;
};

std::string TagName(const SnapshotOptions& options, std::uint32_t tag) {
  return options.tag_name ? options.tag_name(tag) : absl::StrCat("tag", tag);
}

Json SegmentJson(const SegmentInfo& s, const History* history, FrameCache& frames) {
  Json j = Json::object();
  j["device"] = s.device;
  j["address"] = s.address;
  j["total_size"] = s.total_size;
  j["allocated_size"] = s.allocated_size;
  j["active_size"] = s.active_size;
  j["requested_size"] = s.requested_size;
  j["stream"] = s.stream;
  j["segment_type"] = s.is_small ? "small" : "large";
  j["segment_pool_id"] = Json::array({s.pool_id.first, s.pool_id.second});
  j["is_expandable"] = s.is_expandable;
  j["handles"] = s.handles;  // vramledger's: physical handles backing the segment
  // vramledger's: a paused region's range, whose pages the pause released (regions.md)
  if (s.paused) j["paused"] = true;
  j["frames"] =
      history != nullptr ? frames.Get(history->SegmentStack(s.device, s.address)) : Json::array();
  Json blocks = Json::array();
  for (const BlockInfo& b : s.blocks) {
    Json block = Json::object();
    block["address"] = b.address;
    block["size"] = b.size;
    block["requested_size"] = b.requested_size;
    block["state"] = b.state;
    block["frames"] = frames.Get(b.context);
    block["handles"] = b.handles;  // vramledger's: physical handles under the block
    blocks.push_back(std::move(block));
  }
  j["blocks"] = std::move(blocks);
  return j;
}

Json EntryJson(int device, const RecordedEntry& e, FrameCache& frames) {
  (void)device;
  Json j = Json::object();
  j["action"] = std::string(TraceActionName(e.action));
  if (e.action == TraceAction::kOom) {
    j["device_free"] = e.addr;  // torch's key for oom entries
  } else {
    j["addr"] = e.addr;
  }
  j["size"] = e.size;
  j["stream"] = e.stream;
  j["time_us"] = e.time_us;
  j["compile_context"] = "N/A";
  j["user_metadata"] = "";
  if (e.action != TraceAction::kSnapshot) j["frames"] = frames.Get(e.stack);
  return j;
}

Json StatsJson(const DeviceStats& stats) {
  Json j = Json::object();
  for (const auto& [key, value] : FlattenStats(stats)) j[key] = value;
  j["utilization"] = stats.utilization();
  return j;
}

Json FiguresJson(const SegmentFigures& f) {
  Json j = Json::object();
  j["reserved_bytes"] = f.reserved_bytes;
  j["allocated_bytes"] = f.allocated_bytes;
  j["active_bytes"] = f.active_bytes;
  j["requested_bytes"] = f.requested_bytes;
  j["free_bytes"] = f.free_bytes;
  j["largest_free_block"] = f.largest_free_block;
  j["holes"] = f.holes;
  j["hole_bytes"] = f.hole_bytes;
  j["segments"] = f.segments;
  j["blocks"] = f.blocks;
  j["utilization"] = f.utilization;
  j["free_space_fragmentation"] = f.free_space_fragmentation;
  return j;
}

Json VramledgerSettingsJson(const Options& o) {
  Json j = Json::object();
  j["conf"] = o.conf_string;
  j["max_non_split_rounding"] = o.max_non_split_rounding;
  j["large_segment_size"] = o.large_segment_size;
  j["per_process_memory_fraction"] = o.per_process_memory_fraction;
  j["page_recycling"] = o.page_recycling;
  j["plan"] = o.process.plan;
  j["dump_dir"] = o.process.dump_dir;
  j["max_dumps"] = o.process.max_dumps;
  return j;
}

Json DeviceJson(const DeviceCapture& d, const SnapshotOptions& options) {
  Json j = Json::object();
  j["device"] = d.device;
  j["stats"] = StatsJson(d.stats);
  const SegmentFigures figures = ComputeSegmentFigures(d.segments);
  j["fragmentation"] = FiguresJson(figures);
  Json per_stream = Json::array();
  for (const auto& [stream, s] : figures.per_stream) {
    Json row = Json::object();
    row["stream"] = stream;
    row["holes"] = s.holes;
    row["hole_bytes"] = s.hole_bytes;
    row["free_bytes"] = s.free_bytes;
    row["largest_free_block"] = s.largest_free_block;
    per_stream.push_back(std::move(row));
  }
  j["holes_per_stream"] = std::move(per_stream);
  Json handles = Json::array();  // [segment address, physical handles]
  Json tags = Json::array();     // [block address, tag id, tag name]
  for (const SegmentInfo& s : d.segments) {
    handles.push_back(Json::array({s.address, s.handles}));
    for (const BlockInfo& b : s.blocks) {
      if (b.tag != 0) tags.push_back(Json::array({b.address, b.tag, TagName(options, b.tag)}));
    }
  }
  j["segment_handles"] = std::move(handles);
  j["block_tags"] = std::move(tags);
  j["settings"] = VramledgerSettingsJson(d.allocator->options());
  return j;
}

Json HistoryJson(const History* history) {
  if (history == nullptr) return nullptr;
  const HistorySettings s = history->settings();
  Json j = Json::object();
  // Off is null (Python's None, the value record_memory_history takes), not the word "None".
  j["enabled"] = s.enabled == HistoryEnabled::kNone
                     ? Json(nullptr)
                     : Json(std::string(HistoryEnabledName(s.enabled)));
  j["context"] = s.context == HistoryContext::kNone
                     ? Json(nullptr)
                     : Json(std::string(HistoryContextName(s.context)));
  j["stacks"] = std::string(HistoryStacksName(s.stacks));
  j["max_entries"] =
      std::min<std::uint64_t>(s.max_entries, std::numeric_limits<std::int64_t>::max());
  j["stacks_interned"] = history->num_stacks();
  j["entries_dropped"] = history->dropped();
  return j;
}

// Everything except device_traces, in torch's key order, with a null placeholder for it.
Json Head(const Capture& c, const History* history, const SnapshotOptions& options,
          FrameCache& frames) {
  Json doc = Json::object();
  Json segments = Json::array();
  for (const DeviceCapture& d : c.devices) {
    for (const SegmentInfo& s : d.segments) segments.push_back(SegmentJson(s, history, frames));
  }
  doc["segments"] = std::move(segments);
  doc["device_traces"] = nullptr;
  doc["allocator_settings"] =
      AllocatorSettingsJson(c.devices.empty() ? Options() : c.devices.front().allocator->options());
  doc["external_annotations"] = Json::array();
  Json v = Json::object();
  v["version"] = VRAMLEDGER_VERSION;
  v["time_us"] = absl::GetCurrentTimeNanos() / 1000;
  v["history"] = HistoryJson(history);
  Json devices = Json::array();
  for (const DeviceCapture& d : c.devices) devices.push_back(DeviceJson(d, options));
  v["devices"] = std::move(devices);
  for (const auto& [key, value] : options.extra.items()) v[key] = value;
  doc["vramledger"] = std::move(v);
  return doc;
}

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

}  // namespace

SegmentFigures ComputeSegmentFigures(const std::vector<SegmentInfo>& segments) {
  SegmentFigures f;
  for (const SegmentInfo& s : segments) {
    // A paused region's range holds no memory now: it leaves the figures, as it leaves the
    // device's reserved bytes (regions.md, "In the ledger").
    if (s.paused) continue;
    ++f.segments;
    f.reserved_bytes += static_cast<std::int64_t>(s.total_size);
    f.allocated_bytes += static_cast<std::int64_t>(s.allocated_size);
    f.active_bytes += static_cast<std::int64_t>(s.active_size);
    f.requested_bytes += static_cast<std::int64_t>(s.requested_size);
    const bool has_active = s.active_size > 0;
    SegmentFigures::PerStream& stream = f.per_stream[s.stream];
    for (const BlockInfo& b : s.blocks) {
      ++f.blocks;
      if (std::string_view(b.state) != "inactive") continue;
      const auto size = static_cast<std::int64_t>(b.size);
      f.free_bytes += size;
      f.largest_free_block = std::max(f.largest_free_block, size);
      stream.free_bytes += size;
      stream.largest_free_block = std::max(stream.largest_free_block, size);
      if (has_active) {
        ++f.holes;
        f.hole_bytes += size;
        ++stream.holes;
        stream.hole_bytes += size;
      }
    }
  }
  if (f.reserved_bytes > 0) {
    f.utilization = static_cast<double>(f.allocated_bytes) / static_cast<double>(f.reserved_bytes);
  }
  if (f.free_bytes > 0) {
    f.free_space_fragmentation =
        1.0 - static_cast<double>(f.largest_free_block) / static_cast<double>(f.free_bytes);
  }
  return f;
}

SnapshotJson AllocatorSettingsJson(const Options& o) {
  Json j = Json::object();
  j["PYTORCH_CUDA_ALLOC_CONF"] = o.conf_string;
  j["max_split_size"] =
      o.max_split_size == SIZE_MAX ? std::int64_t{-1} : static_cast<std::int64_t>(o.max_split_size);
  j["garbage_collection_threshold"] = o.garbage_collection_threshold;
  j["expandable_segments"] = o.expandable_segments;
  j["pinned_num_register_threads"] = 1;
  j["release_lock_on_cudamalloc"] = o.release_lock_on_cudamalloc;
  j["pinned_use_cuda_host_register"] = false;
  j["graph_capture_record_stream_reuse"] = false;
  Json divisions = Json::object();
  for (int i = 0; i < kRoundupPower2Intervals; ++i) {
    divisions[std::to_string(std::size_t{1} << i)] = o.roundup_power2_divisions[i];
  }
  j["roundup_power2_divisions"] = std::move(divisions);
  return j;
}

SnapshotJson BuildSnapshot(const std::vector<const DeviceAllocator*>& allocators, History* history,
                           const SnapshotOptions& options) {
  const Capture c = Take(allocators, history, options.record_snapshot_entry);
  FrameCache frames(history);
  Json doc = Head(c, history, options, frames);
  Json traces = Json::array();
  for (std::size_t d = 0; d < c.traces.size(); ++d) {
    Json list = Json::array();
    for (const RecordedEntry& e : c.traces[d]) {
      list.push_back(EntryJson(static_cast<int>(d), e, frames));
    }
    traces.push_back(std::move(list));
  }
  doc["device_traces"] = std::move(traces);
  return doc;
}

absl::Status WriteSnapshotJson(std::ostream& out,
                               const std::vector<const DeviceAllocator*>& allocators,
                               History* history, const SnapshotOptions& options) {
  const Capture c = Take(allocators, history, options.record_snapshot_entry);
  FrameCache frames(history);
  const Json head = Head(c, history, options, frames);
  out << '{';
  bool first_key = true;
  for (const auto& [key, value] : head.items()) {
    if (!first_key) out << ',';
    first_key = false;
    out << Dump(Json(key)) << ':';
    if (key != "device_traces") {
      out << Dump(value);
      continue;
    }
    out << '[';
    for (std::size_t d = 0; d < c.traces.size(); ++d) {
      out << (d == 0 ? "[" : ",[");
      for (std::size_t i = 0; i < c.traces[d].size(); ++i) {
        if (i > 0) out << ',';
        out << Dump(EntryJson(static_cast<int>(d), c.traces[d][i], frames));
      }
      out << ']';
      if (!out.good()) break;
    }
    out << ']';
  }
  out << "}\n";
  if (!out.good()) return absl::DataLossError("writing the snapshot JSON failed");
  return absl::OkStatus();
}

absl::Status WriteSnapshotJsonFile(const std::string& path,
                                   const std::vector<const DeviceAllocator*>& allocators,
                                   History* history, const SnapshotOptions& options) {
  return WriteFileAtomically(path, [&](std::ostream& out) {
    return WriteSnapshotJson(out, allocators, history, options);
  });
}

}  // namespace vramledger
