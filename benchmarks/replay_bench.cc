// Trace replay benchmark (after RMM's replay benchmark): the bundled GPT-2 trace's alloc / free
// events (or VRAMLEDGER_REPLAY_TRACE's) through one DeviceAllocator on SimBackend, native and
// expandable options; ns per event, for a fresh allocator (BM_ReplayGpt2) and in the steady
// state (BM_ReplaySteady), and ns per call in the steady state from cold caches
// (BM_ReplayCold).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
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
// The workload and the options `conf` for a benchmark, or nullopt after SkipWithError.
std::optional<Options> WorkloadOptions(benchmark::State& state, const char* conf) {
  const TraceOps& w = LoadWorkload();
  if (!w.error.empty()) {
    state.SkipWithError(w.error.c_str());
    return std::nullopt;
  }
  absl::StatusOr<Options> options = ParseOptions(conf);
  if (!options.ok()) {
    state.SkipWithError(std::string(options.status().message()).c_str());
    return std::nullopt;
  }
  return *options;
}

// A simulated H200 whose events complete at once.
SimBackend::Config H200Config() {
  SimBackend::Config config;
  config.capacity = kH200TotalBytes;
  config.auto_complete_events = true;
  return config;
}

void BM_ReplayGpt2(benchmark::State& state, const char* conf) {
  const std::optional<Options> options = WorkloadOptions(state, conf);
  if (!options) return;
  const TraceOps& w = LoadWorkload();
  const SimBackend::Config sim_config = H200Config();
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

// One steady-state pass of `w` through `allocator`: each call made through `around(call)` (which
// may work or time around it), then what the pass left live (weights, optimizer state) freed.
// False after SkipWithError (an allocation failed).
template <typename Around>
bool SteadyPass(benchmark::State& state, const TraceOps& w, DeviceAllocator& allocator,
                std::vector<DevicePtr>& slots, Around around) {
  bool ok = true;
  for (const TraceOp& op : w.ops) {
    around([&] {
      if (!op.alloc) {
        benchmark::DoNotOptimize(allocator.Free(slots[op.slot]));
        slots[op.slot] = 0;
        return;
      }
      absl::StatusOr<DevicePtr> p = allocator.Malloc(op.size, op.stream);
      if (!p.ok()) {
        state.SkipWithError(std::string(p.status().message()).c_str());
        ok = false;
        return;
      }
      slots[op.slot] = *p;
    });
    if (!ok) return false;
  }
  for (DevicePtr& p : slots) {
    if (p != 0) benchmark::DoNotOptimize(allocator.Free(p));
    p = 0;
  }
  return true;
}

// The steady state, as gpu/host_cost_bench measures it on a device: one allocator replays the
// workload pass after pass (what a pass leaves live is freed at its end), and only the passes
// after the first are timed, so memory is mapped already and the host cost per call is the
// allocator's bookkeeping. ns per event; modelled driver time of the timed passes apart.
void BM_ReplaySteady(benchmark::State& state, const char* conf) {
  const std::optional<Options> options = WorkloadOptions(state, conf);
  if (!options) return;
  const TraceOps& w = LoadWorkload();
  SimBackend sim(H200Config());
  DeviceAllocator allocator(*options, &sim);
  std::vector<DevicePtr> slots(w.slots, 0);
  auto pass = [&]() { return SteadyPass(state, w, allocator, slots, [](auto call) { call(); }); };
  if (!pass()) return;  // the first pass maps the memory: not timed
  const double micros_before = sim.calls().total_micros();
  for (auto _ : state) {
    if (!pass()) break;
  }
  const auto events = static_cast<double>(w.ops.size());
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(w.ops.size()));
  if (state.iterations() > 0) {
    state.counters["modeled_driver_ms_per_pass"] =
        (sim.calls().total_micros() - micros_before) / 1000.0 /
        static_cast<double>(state.iterations());
  }
  state.counters["ns_per_event"] = benchmark::Counter(
      events, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

// The steady state as in a training process, where the framework's own work runs between two
// allocator calls and evicts the allocator's state from the CPU caches: between calls, a sweep
// over `state.range(0)` KiB of other memory (a cache line each 64 bytes). Only the calls are
// timed (a clock read before and after each), so ns_per_call is the allocator's cost from cold
// caches, the clock reads included.
void BM_ReplayCold(benchmark::State& state, const char* conf) {
  const std::optional<Options> options = WorkloadOptions(state, conf);
  if (!options) return;
  const TraceOps& w = LoadWorkload();
  SimBackend sim(H200Config());
  DeviceAllocator allocator(*options, &sim);
  std::vector<DevicePtr> slots(w.slots, 0);
  std::vector<std::uint64_t> other(static_cast<std::size_t>(state.range(0)) * 1024 / 8, 1);
  std::uint64_t sum = 0;
  double call_ns = 0;
  std::int64_t calls = 0;
  auto sweep = [&]() {
    for (std::size_t i = 0; i < other.size(); i += 8) sum += other[i]++;
  };
  auto pass = [&](bool timed) {
    return SteadyPass(state, w, allocator, slots, [&](auto call) {
      sweep();
      const auto start = std::chrono::steady_clock::now();
      call();
      if (!timed) return;
      const auto elapsed = std::chrono::steady_clock::now() - start;
      call_ns += std::chrono::duration<double, std::nano>(elapsed).count();
      ++calls;
    });
  };
  if (!pass(false)) return;
  for (auto _ : state) {
    if (!pass(true)) break;
  }
  benchmark::DoNotOptimize(sum);
  if (calls > 0) state.counters["ns_per_call"] = call_ns / static_cast<double>(calls);
}
BENCHMARK_CAPTURE(BM_ReplayCold, native, "")
    ->Arg(0)
    ->Arg(64)
    ->Arg(1024)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK_CAPTURE(BM_ReplayCold, expandable, "expandable_segments:True")
    ->Arg(0)
    ->Arg(64)
    ->Arg(1024)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

BENCHMARK_CAPTURE(BM_ReplaySteady, native, "")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_ReplaySteady, expandable, "expandable_segments:True")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

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
