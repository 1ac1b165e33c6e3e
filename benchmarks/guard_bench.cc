// Fast-path cost of the budget guard: allocate+free of a cached 64 KiB block on SimBackend with no
// hooks, with the guard accounting only, with a plan (limit, warn_at, a category limit on the
// thread's tag), and chained with a no-op second hooks object. ns per pair.
#include <benchmark/benchmark.h>

#include <memory>
#include <optional>

#include "device/sim_backend.h"
#include "guard/budget_guard.h"
#include "guard/hooks_chain.h"
#include "guard/plan.h"
#include "guard/tags.h"
#include "vramledger/device_allocator.h"

namespace vramledger::guard {
namespace {

enum Mode { kNoHooks = 0, kAccounting = 1, kPlan = 2, kChained = 3 };

std::optional<DeviceBudget> Budget() {
  auto plan = ParsePlan(R"({"limit": "32GiB", "warn_at": 0.9,
                            "category_limits": {"activations": "16GiB"}})",
                        "bench.json", 1);
  return *ResolvePlan(*plan, 0, 64 * kGiB);
}

void BM_GuardedPair(benchmark::State& state) {
  const auto mode = static_cast<Mode>(state.range(0));
  SimBackend::Config config;
  config.capacity = 64 * kGiB;
  SimBackend sim(config);
  DeviceAllocator alloc(Options(), &sim);
  TagRegistry tags;
  auto guard = *BudgetGuard::Create(0, &tags, mode >= kPlan ? Budget() : std::nullopt);
  AllocatorHooks noop;
  HooksChain chain({guard.get(), &noop});
  if (mode == kAccounting || mode == kPlan) alloc.SetHooks(guard.get());
  if (mode == kChained) alloc.SetHooks(&chain);
  ScopedThreadTag scope(*tags.Intern("activations"));
  auto keep = alloc.Malloc(512, 0);
  auto warm = alloc.Malloc(64 << 10, 0);
  (void)alloc.Free(*warm);
  for (auto _ : state) {
    auto p = alloc.Malloc(64 << 10, 0);
    benchmark::DoNotOptimize(p);
    (void)alloc.Free(*p);
  }
  (void)alloc.Free(*keep);
  alloc.SetHooks(nullptr);
  state.counters["ns_per_pair"] =
      benchmark::Counter(static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_GuardedPair)->Arg(kNoHooks)->Arg(kAccounting)->Arg(kPlan)->Arg(kChained);

}  // namespace
}  // namespace vramledger::guard

BENCHMARK_MAIN();
