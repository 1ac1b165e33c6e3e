// Hot-path cost: allocate+free of a cached block (4 KiB - 4 MiB) on SimBackend, ns per pair,
// single-threaded and with 4 threads sharing one device allocator. Target: <= 100 ns.
#include <benchmark/benchmark.h>

#include <memory>
#include <vector>

#include "device/sim_backend.h"
#include "vramledger/device_allocator.h"

namespace vramledger {
namespace {

// One allocator shared by every thread of a benchmark run, warmed so the block is cached.
struct Shared {
  Shared() : alloc(Options(), &sim) {}
  SimBackend sim;
  DeviceAllocator alloc;
};
Shared* shared = nullptr;

// Allocate+free pairs cycling through sizes 4 KiB .. 4 MiB (x4 steps), with one other block
// live so split and coalesce run as in training (the freed block merges with its neighbour).
void BM_CachedPair(benchmark::State& state) {
  if (state.thread_index() == 0) {
    shared = new Shared();
  }
  static const std::size_t kSizes[] = {4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20};
  const StreamId stream = 0x100 + state.thread_index();  // a stream per thread, as torch would
  // Warm: every size cached once on this stream.
  for (std::size_t s : kSizes) {
    auto p = shared->alloc.Malloc(s, stream);
    if (!p.ok()) state.SkipWithError("warm-up allocation failed");
    (void)shared->alloc.Free(*p);
  }
  auto keep = shared->alloc.Malloc(512, stream);
  std::size_t i = 0;
  for (auto _ : state) {
    auto p = shared->alloc.Malloc(kSizes[i], stream);
    benchmark::DoNotOptimize(p);
    (void)shared->alloc.Free(*p);
    i = i + 1 == std::size(kSizes) ? 0 : i + 1;
  }
  (void)shared->alloc.Free(*keep);
  state.SetItemsProcessed(state.iterations());
  state.counters["ns_per_pair"] =
      benchmark::Counter(static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  if (state.thread_index() == 0) {
    state.counters["segments"] =
        static_cast<double>(shared->alloc.GetStats().segment[kAggregate].current);
  }
}
BENCHMARK(BM_CachedPair)->Threads(1)->UseRealTime();
BENCHMARK(BM_CachedPair)->Threads(4)->UseRealTime();

// The same pair with a single fixed 4 KiB size: the floor of the path.
void BM_Cached4KiB(benchmark::State& state) {
  SimBackend sim;
  DeviceAllocator alloc(Options(), &sim);
  auto warm = alloc.Malloc(4096, 0);
  (void)alloc.Free(*warm);
  for (auto _ : state) {
    auto p = alloc.Malloc(4096, 0);
    benchmark::DoNotOptimize(p);
    (void)alloc.Free(*p);
  }
}
BENCHMARK(BM_Cached4KiB);

}  // namespace
}  // namespace vramledger

BENCHMARK_MAIN();
