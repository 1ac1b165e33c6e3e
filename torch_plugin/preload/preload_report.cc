// The LD_PRELOAD shim's reports: the one-screen summary (calls seen, peaks, the device memory
// used outside vramledger), the snapshot written beside it, and the refusal reports.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
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
  const DeviceAllocator* a = p.Existing(device);
  const std::int64_t baseline = p.BaselineUsed(device);
  if (a == nullptr || baseline < 0 || Runtime().mem_get_info == nullptr) {
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
  o.reserved = a->GetStats().reserved_bytes[kAggregate].current;
  o.outside = o.used_delta - o.reserved;
  return o;
}

// The one-screen summary: calls seen, then peaks and utilization per device.
std::string Summary(Preload& p, const char* reason) {
  const Counters& c = p.counters();
  std::ostringstream out;
  out << "vramledger preload summary (" << reason << ", pid " << getpid() << ")\n"
      << "options: " << OptionsToString(p.options()) << "\n"
      << "calls seen: cudaMalloc " << c.malloc_calls.load() << ", cudaMallocAsync "
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
  for (int d = 0; d < DeviceTable::Get().device_count(); ++d) {
    const DeviceAllocator* a = p.Existing(d);
    if (a == nullptr) continue;
    const DeviceStats s = a->GetStats();
    const Fragmentation f = FragmentationOf(*a);
    const Stat& alloc = s.allocated_bytes[kAggregate];
    const Stat& reserved = s.reserved_bytes[kAggregate];
    out << "device " << d << ": peak allocated " << FormatSize(alloc.peak) << ", peak reserved "
        << FormatSize(reserved.peak) << ", utilization " << f.utilization << "\n"
        << "  now: allocated " << FormatSize(alloc.current) << ", reserved "
        << FormatSize(reserved.current) << ", largest free block "
        << FormatSize(f.largest_free_block) << ", holes " << f.holes << "\n"
        << "  allocations " << FormatCount(s.allocation[kAggregate].allocated) << ", frees "
        << FormatCount(s.allocation[kAggregate].freed) << ", segments "
        << FormatCount(s.segment[kAggregate].allocated) << ", cudaMalloc retries "
        << s.num_alloc_retries << ", OOMs " << s.num_ooms << "\n";
    if (p.options().host_timing) {
      const HostTime t = a->host_time();
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

}  // namespace

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
    for (int d = 0; d < DeviceTable::Get().device_count(); ++d) {
      if (p.Existing(d) == nullptr) continue;
      const OutsideBytes o = MeasureOutsideBytes(p, d);
      if (o.known) {
        outside[absl::StrCat(d)] = {{"outside_bytes", o.outside},
                                    {"used_delta_bytes", o.used_delta},
                                    {"reserved_bytes", o.reserved}};
      }
    }
    snapshot.extra["preload"]["device_bytes_outside_vramledger"] = outside;
    const absl::Status s =
        WriteSnapshotJsonFile(base + ".json", p.Allocators(), &PluginHistory(), snapshot);
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
  } catch (...) {
    std::fprintf(stderr, "vramledger: preload dump failed\n");
  }
}

void WriteRefusalReport(Preload& p, std::int64_t n, absl::string_view report) {
  if (n > std::max(p.options().process.max_dumps, 0)) return;
  try {
    ::mkdir(p.options().process.dump_dir.c_str(), 0755);
    const std::string path = absl::StrCat(p.options().process.dump_dir, "/vramledger-preload-pid",
                                          getpid(), "-refusal-", n, ".txt");
    const absl::Status s = WriteFileAtomically(path, [&](std::ostream& out) {
      out << report << "\n";
      return out.good() ? absl::OkStatus() : absl::DataLossError("report write failed");
    });
    if (!s.ok()) {
      std::fprintf(stderr, "vramledger: refusal report not written: %s\n",
                   std::string(s.message()).c_str());
    }
  } catch (...) {
    std::fprintf(stderr, "vramledger: refusal report not written\n");
  }
}

}  // namespace vramledger::preload
