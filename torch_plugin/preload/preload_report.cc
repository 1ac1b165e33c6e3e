// The LD_PRELOAD shim's reports: the one-screen summary (route, calls seen, peaks, the device
// memory used outside vramledger), the snapshot written beside it, the refusal reports, and the
// introspection entry points (counters as JSON, a dump on demand).
#include <sys/stat.h>
#include <unistd.h>

#include <cxxabi.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <ostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "ledger/atomic_file.h"
#include "ledger/device_report.h"
#include "ledger/snapshot.h"
#include "nlohmann/json.hpp"
#include "torch_plugin/preload/preload_state.h"
#include "torch_plugin/runtime/history_api.h"
#include "torch_plugin/runtime/process_env.h"
#include "vramledger/stats.h"

namespace vramledger::preload {
namespace {

std::string FormatCount(std::int64_t n) { return absl::StrCat(n); }

// What the shim did not see on one device: the growth of the device's used bytes since the
// allocator was created (cudaMemGetInfo through the real runtime), less vramledger's reserved.
struct OutsideBytes {
  bool known = false;
  std::int64_t outside = 0;     // used_delta - reserved (bytes; may be negative)
  std::int64_t used_delta = 0;  // used now - used at the allocator's creation (bytes)
  std::int64_t reserved = 0;    // vramledger's reserved bytes now
  std::string why;              // when not known
};

// Pre: inside an InsideScope (cudaGetDevice/cudaSetDevice go to the runtime).
OutsideBytes MeasureOutsideBytes(Preload& p, int device) {
  OutsideBytes o;
  DeviceFigures figures;
  const std::int64_t baseline = p.BaselineUsed(device);
  if (!p.Figures(device, &figures) || baseline < 0 || Runtime().mem_get_info == nullptr) {
    o.why = "no cudaMemGetInfo baseline";
    return o;
  }
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device && cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    o.why = "cudaSetDevice failed";
    return o;
  }
  std::size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t err = Runtime().mem_get_info(&free_bytes, &total_bytes);
  if (previous >= 0 && previous != device) cudaSetDevice(previous);
  if (err != cudaSuccess) {
    cudaGetLastError();
    o.why = absl::StrCat("cudaMemGetInfo error ", static_cast<int>(err));
    return o;
  }
  o.known = true;
  o.used_delta = static_cast<std::int64_t>(total_bytes - free_bytes) - baseline;
  o.reserved = figures.stats.reserved_bytes[kAggregate].current;
  o.outside = o.used_delta - o.reserved;
  return o;
}

// The one-screen summary: calls seen, then peaks and utilization per device.
std::string Summary(Preload& p, const char* reason) {
  const Counters& c = p.counters();
  std::ostringstream out;
  out << "vramledger preload summary (" << reason << ", pid " << getpid() << ")\n"
      << "options: " << OptionsToString(p.options()) << "\n"
      << "route: " << p.route_note() << "\n";
  if (p.plugin() != nullptr) {  // torch allocates through vramledger; the calls below forward
    out << "refusals " << c.refusals.load() << "\n";
  } else {
    out << "calls seen: cudaMalloc " << c.malloc_calls.load() << ", cudaMallocAsync "
        << c.malloc_async_calls.load() << ", cudaFree " << c.free_calls.load() << ", cudaFreeAsync "
        << c.free_async_calls.load() << "\n"
        << "served: allocations " << c.served_allocs.load() << ", frees " << c.served_frees.load()
        << ", size-0 " << c.zero_size_allocs.load() << "; forwarded frees (not ours) "
        << c.forwarded_frees.load() << "; refusals " << c.refusals.load() << ", errors "
        << c.errors.load() << "\n"
        << "host time in those calls: "
        << (p.options().host_timing ? absl::StrCat(c.interposed_ns.load() / 1000, " us")
                                    : std::string("not measured (host_timing:True measures it)"))
        << "\n";
  }
  for (int d = 0; d < p.DeviceCount(); ++d) {
    DeviceFigures figures;
    if (!p.Figures(d, &figures)) continue;
    const DeviceStats& s = figures.stats;
    const Stat& alloc = s.allocated_bytes[kAggregate];
    const Stat& reserved = s.reserved_bytes[kAggregate];
    out << "device " << d << ": peak allocated " << FormatSize(alloc.peak) << ", peak reserved "
        << FormatSize(reserved.peak) << ", utilization " << figures.utilization << "\n"
        << "  now: allocated " << FormatSize(alloc.current) << ", reserved "
        << FormatSize(reserved.current) << ", largest free block "
        << FormatSize(figures.largest_free_block) << ", holes " << figures.holes << "\n"
        << "  allocations " << FormatCount(s.allocation[kAggregate].allocated) << ", frees "
        << FormatCount(s.allocation[kAggregate].freed) << ", segments "
        << FormatCount(s.segment[kAggregate].allocated) << ", cudaMalloc retries "
        << s.num_alloc_retries << ", OOMs " << s.num_ooms << "\n";
    if (p.options().host_timing) {
      const HostTime& t = figures.host_time;
      out << "  host time inside the allocator: malloc " << t.malloc_ns / 1000 << " us over "
          << FormatCount(t.malloc_calls) << " calls, free " << t.free_ns / 1000 << " us over "
          << FormatCount(t.free_calls) << " calls\n";
    }
    const OutsideBytes o = MeasureOutsideBytes(p, d);
    if (o.known) {
      out << "  device bytes used outside vramledger: " << o.outside << " ("
          << FormatSize(o.outside) << "; cudaMemGetInfo used delta " << o.used_delta
          << " - vramledger reserved " << o.reserved << ")\n";
    } else {
      out << "  device bytes used outside vramledger: unknown (" << o.why << ")\n";
    }
  }
  return out.str();
}

// The direct route's snapshot: the plugin's (torch's dict shape plus "vramledger"), with the
// shim's figures added under "vramledger" as the interposition's snapshot has them.
absl::Status WriteDirectSnapshot(const PluginRuntime& plugin, const std::string& path,
                                 const SnapshotJson& extra) {
  char* text = nullptr;
  if (plugin.snapshot_json(&text) != 0 || text == nullptr) {
    return absl::InternalError("the plugin's snapshot failed");
  }
  SnapshotJson doc = SnapshotJson::parse(text, nullptr, /*allow_exceptions=*/false);
  plugin.string_free(text);
  if (doc.is_discarded()) return absl::InternalError("the plugin's snapshot is not JSON");
  for (const auto& [key, value] : extra.items()) doc["vramledger"][key] = value;
  return WriteFileAtomically(path, [&](std::ostream& out) {
    out << doc.dump(-1, ' ', false, SnapshotJson::error_handler_t::replace);
    return out.good() ? absl::OkStatus() : absl::DataLossError("snapshot write failed");
  });
}

// The figures of one device as the plugin's C ABI gives them (fragmentation_json's keys).
bool PluginFigures(const PluginRuntime& plugin, int device, DeviceFigures* out) {
  if (!plugin.device_stats(device, &out->stats)) return false;
  char* text = nullptr;
  if (plugin.fragmentation_json(device, nullptr, &text) != 0 || text == nullptr) return true;
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  plugin.string_free(text);
  if (j.is_discarded()) return true;
  out->utilization = j.value("utilization", 0.0);
  out->largest_free_block = j.value("largest_free_block", std::int64_t{0});
  out->holes = j.value("holes", std::int64_t{0});
  if (j.contains("host_time")) {
    const nlohmann::json& t = j["host_time"];
    out->host_time.malloc_calls = t["malloc"].value("count", std::int64_t{0});
    out->host_time.malloc_ns = static_cast<std::int64_t>(t["malloc"].value("time_us", 0.0) * 1000);
    out->host_time.free_calls = t["free"].value("count", std::int64_t{0});
    out->host_time.free_ns = static_cast<std::int64_t>(t["free"].value("time_us", 0.0) * 1000);
  }
  return true;
}

}  // namespace

bool Preload::Figures(int device, DeviceFigures* out) const {
  if (const PluginRuntime* plugin = this->plugin()) return PluginFigures(*plugin, device, out);
  const DeviceAllocator* a = Existing(device);
  if (a == nullptr) return false;
  out->stats = a->GetStats();
  const Fragmentation f = FragmentationOf(*a);
  out->utilization = f.utilization;
  out->largest_free_block = f.largest_free_block;
  out->holes = f.holes;
  out->host_time = a->host_time();
  return true;
}

nlohmann::json CountersJson(const Counters& c) {
  return {
      {"cudaMalloc_calls", c.malloc_calls.load()},
      {"cudaMallocAsync_calls", c.malloc_async_calls.load()},
      {"cudaFree_calls", c.free_calls.load()},
      {"cudaFreeAsync_calls", c.free_async_calls.load()},
      {"served_allocations", c.served_allocs.load()},
      {"served_frees", c.served_frees.load()},
      {"forwarded_frees", c.forwarded_frees.load()},
      {"zero_size_allocations", c.zero_size_allocs.load()},
      {"refusals", c.refusals.load()},
      {"errors", c.errors.load()},
      {"inner_runtime_calls", c.inner_calls.load()},
  };
}

void WriteDump(Preload& p, const std::string& tag) {
  InsideScope inside;
  try {
    const std::string base =
        absl::StrCat(p.options().process.dump_dir, "/vramledger-preload-pid", getpid(), "-", tag);
    ::mkdir(p.options().process.dump_dir.c_str(), 0755);  // WriteSnapshotJsonFile needs it to exist
    SnapshotOptions snapshot = PluginSnapshotOptions();
    const Counters& c = p.counters();
    snapshot.extra["preload"] = CountersJson(c);
    snapshot.extra["preload"]["reason"] = tag;
    nlohmann::json outside = nlohmann::json::object();
    for (int d = 0; d < p.DeviceCount(); ++d) {
      const OutsideBytes o = MeasureOutsideBytes(p, d);
      if (o.known) {
        outside[absl::StrCat(d)] = {{"outside_bytes", o.outside},
                                    {"used_delta_bytes", o.used_delta},
                                    {"reserved_bytes", o.reserved}};
      }
    }
    snapshot.extra["preload"]["device_bytes_outside_vramledger"] = outside;
    snapshot.extra["preload"]["route"] = p.route_note();
    const absl::Status s =
        p.plugin() != nullptr
            ? WriteDirectSnapshot(*p.plugin(), base + ".json", snapshot.extra)
            : WriteSnapshotJsonFile(base + ".json", p.Allocators(), &PluginHistory(), snapshot);
    if (!s.ok()) {
      std::fprintf(stderr, "vramledger: preload snapshot not written: %s\n",
                   std::string(s.message()).c_str());
    }
    const std::string summary = Summary(p, tag.c_str());
    const absl::Status t = WriteFileAtomically(base + ".txt", [&](std::ostream& out) {
      out << summary;
      return out.good() ? absl::OkStatus() : absl::DataLossError("summary write failed");
    });
    if (!t.ok()) {
      std::fprintf(stderr, "vramledger: preload summary not written: %s\n",
                   std::string(t.message()).c_str());
    }
    if (!p.options().process.preload_quiet) {
      std::fprintf(stderr, "%swritten: %s.json, %s.txt\n", summary.c_str(), base.c_str(),
                   base.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vramledger: preload dump failed: %s\n", e.what());
  } catch (const abi::__forced_unwind&) {
    throw;  // a thread's exit or cancellation unwinds on (c_errors.h)
  } catch (...) {
    std::fprintf(stderr, "vramledger: preload dump failed\n");
  }
}

std::string RefusalReportPath(const Preload& p, std::int64_t n) {
  return absl::StrCat(p.options().process.dump_dir, "/vramledger-preload-pid", getpid(),
                      "-refusal-", n, ".txt");
}

void WriteRefusalReport(Preload& p, std::int64_t n, absl::string_view report) {
  if (n > std::max(p.options().process.max_dumps, 0)) return;
  try {
    ::mkdir(p.options().process.dump_dir.c_str(), 0755);
    const std::string path = RefusalReportPath(p, n);
    const absl::Status s = WriteFileAtomically(path, [&](std::ostream& out) {
      out << report << "\n";
      return out.good() ? absl::OkStatus() : absl::DataLossError("report write failed");
    });
    if (!s.ok()) {
      std::fprintf(stderr, "vramledger: refusal report not written: %s\n",
                   std::string(s.message()).c_str());
    }
  } catch (const abi::__forced_unwind&) {
    throw;  // a thread's exit or cancellation unwinds on (c_errors.h)
  } catch (...) {
    std::fprintf(stderr, "vramledger: refusal report not written\n");
  }
}

}  // namespace vramledger::preload

// ---- Introspection (tests, scripts through ctypes) ----

using vramledger::preload::Preload;

/// The shim's counters as a JSON object in a malloc'd string (free() it); NULL when inactive.
extern "C" __attribute__((visibility("default"))) char* vramledger_preload_stats_json() {
  return vramledger::preload::NoThrow("vramledger_preload_stats_json", static_cast<char*>(nullptr),
                                      [] { return vramledger::preload::StatsJson(); });
}

namespace vramledger::preload {

char* StatsJson() {
  Preload* p = vramledger::preload::Instance();
  if (p == nullptr) return nullptr;
  const vramledger::preload::Counters& c = p->counters();
  nlohmann::json j = vramledger::preload::CountersJson(c);
  // Host time of the interposed calls, whole and inside the allocators' Malloc and Free, all
  // devices; zeros unless host_timing is on (step-time-measurement.md).
  double malloc_us = 0, free_us = 0;
  vramledger::preload::InsideScope inside;
  for (int d = 0; d < p->DeviceCount(); ++d) {
    vramledger::preload::DeviceFigures figures;
    if (p->Figures(d, &figures)) {
      malloc_us += figures.host_time.malloc_ns / 1e3;
      free_us += figures.host_time.free_ns / 1e3;
    }
  }
  j["route"] = p->plugin() != nullptr ? "direct" : "interposition";
  j["host_time_us"] = {{"interposed_calls", c.interposed_ns.load() / 1e3},
                       {"allocator_malloc", malloc_us},
                       {"allocator_free", free_us}};
  const std::string text = j.dump();
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out != nullptr) std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

}  // namespace vramledger::preload

/// Writes a snapshot and summary now (as SIGUSR1 does), tagged `tag` ("manual" when NULL).
extern "C" __attribute__((visibility("default"))) void vramledger_preload_dump(const char* tag) {
  vramledger::preload::NoThrow("vramledger_preload_dump", 0, [tag] {
    Preload* p = vramledger::preload::Instance();
    if (p != nullptr) vramledger::preload::WriteDump(*p, tag == nullptr ? "manual" : tag);
    return 0;
  });
}
