// Trace replay benchmark (after RMM's replay benchmark): the bundled GPT-2 trace's alloc / free
// events through one DeviceAllocator on SimBackend, native and expandable options; ns per event.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "device/sim_backend.h"
#include "replay/replay.h"
#include "replay/trace_reader.h"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"

namespace vramledger {
namespace {

// One allocator call of the trace: Malloc(size, stream) into `slot`, or Free of `slot`.
struct Op {
  bool alloc = false;
  std::uint32_t slot = 0;
  std::size_t size = 0;
  StreamId stream = 0;
};

// The trace as allocator calls (free_completed of unknown addresses dropped; an alloc of a live
// address frees the earlier block first, as Replay() does). Slots are reused once freed.
struct Workload {
  std::vector<Op> ops;
  std::uint32_t slots = 0;
  std::string error;  // non-empty when the trace could not be read
};

// VRAMLEDGER_REPLAY_TRACE, or the bundled GPT-2-medium trace.
std::string TracePath() {
  if (const char* path = std::getenv("VRAMLEDGER_REPLAY_TRACE"); path != nullptr && *path) {
    return path;
  }
  return std::string(VRAMLEDGER_SOURCE_DIR) + "/traces/trace-gpt2m-native.csv.gz";
}

const Workload& LoadWorkload() {
  static const Workload* const workload = [] {
    auto* w = new Workload();
    const std::string path = TracePath();
    absl::StatusOr<std::vector<TraceEvent>> events = ReadTraceFile(path);
    if (!events.ok()) {
      w->error = std::string(events.status().message());
      return w;
    }
    absl::flat_hash_map<DevicePtr, std::uint32_t> live;  // trace address -> slot
    std::vector<std::uint32_t> free_slots;
    for (const TraceEvent& e : *events) {
      if (e.action != TraceAction::kAlloc && e.action != TraceAction::kFreeCompleted) continue;
      if (auto it = live.find(e.addr); it != live.end()) {
        w->ops.push_back({false, it->second, 0, 0});
        free_slots.push_back(it->second);
        live.erase(it);
      } else if (e.action == TraceAction::kFreeCompleted) {
        continue;  // unknown free
      }
      if (e.action == TraceAction::kAlloc) {
        std::uint32_t slot = w->slots;
        if (free_slots.empty()) {
          ++w->slots;
        } else {
          slot = free_slots.back();
          free_slots.pop_back();
        }
        live.emplace(e.addr, slot);
        w->ops.push_back({true, slot, e.size, e.stream});
      }
    }
    return w;
  }();
  return *workload;
}

// Replays the workload once per iteration on a fresh simulated H200 (construction and
// destruction of the allocator are not timed). The time includes SimBackend's own bookkeeping
// of each driver call; the modelled driver time is reported apart, never slept.
void BM_ReplayGpt2(benchmark::State& state, const char* conf) {
  const Workload& w = LoadWorkload();
  if (!w.error.empty()) {
    state.SkipWithError(w.error.c_str());
    return;
  }
  absl::StatusOr<Options> options = ParseOptions(conf);
  if (!options.ok()) {
    state.SkipWithError(std::string(options.status().message()).c_str());
    return;
  }
  SimBackend::Config sim_config;
  sim_config.capacity = kH200TotalBytes;
  sim_config.auto_complete_events = true;
  std::vector<DevicePtr> slots(w.slots);
  double modeled_driver_us = 0;
  double utilization = 0;
  double replay_ns = 0;  // the op loops only, summed over iterations
  for (auto _ : state) {
    state.PauseTiming();
    auto sim = std::make_unique<SimBackend>(sim_config);
    auto allocator = std::make_unique<DeviceAllocator>(*options, sim.get());
    state.ResumeTiming();
    const auto start = std::chrono::steady_clock::now();
    for (const Op& op : w.ops) {
      if (op.alloc) {
        absl::StatusOr<DevicePtr> p = allocator->Malloc(op.size, op.stream);
        if (!p.ok()) {
          state.SkipWithError(std::string(p.status().message()).c_str());
          break;
        }
        slots[op.slot] = *p;
      } else {
        absl::Status s = allocator->Free(slots[op.slot]);
        benchmark::DoNotOptimize(s);
      }
    }
    replay_ns +=
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    state.PauseTiming();
    modeled_driver_us = sim->calls().total_micros();
    utilization = allocator->GetStats().utilization();
    allocator.reset();
    sim.reset();
    state.ResumeTiming();
  }
  const auto events = static_cast<double>(w.ops.size());
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(w.ops.size()));
  state.counters["events"] = events;
  if (state.iterations() > 0) {
    state.counters["ns_per_event"] = replay_ns / (events * static_cast<double>(state.iterations()));
  }
  state.counters["modeled_driver_ms"] = modeled_driver_us / 1000.0;
  state.counters["utilization"] = utilization;
}
BENCHMARK_CAPTURE(BM_ReplayGpt2, native, "")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_ReplayGpt2, expandable, "expandable_segments:True")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_ReplayGpt2, expandable_no_recycling,
                  "expandable_segments:True,page_recycling:False")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace vramledger

BENCHMARK_MAIN();
