// Trace replay benchmark (after RMM's replay benchmark): the bundled GPT-2 trace's alloc / free
// events through one DeviceAllocator on SimBackend, native and expandable options; ns per event.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "benchmarks/trace_ops.h"
#include "device/sim_backend.h"
#include "replay/replay.h"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"

namespace vramledger {
namespace {

// VRAMLEDGER_REPLAY_TRACE, or the bundled GPT-2-medium trace.
std::string TracePath() {
  if (const char* path = std::getenv("VRAMLEDGER_REPLAY_TRACE"); path != nullptr && *path) {
    return path;
  }
  return std::string(VRAMLEDGER_SOURCE_DIR) + "/traces/trace-gpt2m-native.csv.gz";
}

const TraceOps& LoadWorkload() {
  static const TraceOps* const workload = new TraceOps(LoadTraceOps(TracePath()));
  return *workload;
}

// Replays the workload once per iteration on a fresh simulated H200 (construction and
// destruction of the allocator are not timed). The time includes SimBackend's own bookkeeping
// of each driver call; the modelled driver time is reported apart, never slept.
void BM_ReplayGpt2(benchmark::State& state, const char* conf) {
  const TraceOps& w = LoadWorkload();
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
    for (const TraceOp& op : w.ops) {
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
