// Sim cost model: the one table of H200 driver-call latencies, and its log-size interpolation.
// Constant tables and pure functions only; thread-safe.
#include "device/sim_cost_model.h"

#include <array>
#include <cmath>
#include <cstddef>

#include "vramledger/types.h"

namespace vramledger {
namespace {

// Source: shared/reference/h200-vmm-latency.txt (torch 2.11.0+cu130 era, one H200, medians of 64
// calls per size, 8 at 1 GiB). Granularity min = recommended = 2 MiB on that device.
// The batched lines of that file (64 x 2 MiB: cuMemSetAccess 1365.4 us = 21.3 us per handle,
// cuMemUnmap 885.6 us = 13.8 us per handle) agree with the per-handle medians, which is why a
// range call is charged per mapping it covers.
constexpr int kNumSizePoints = 4;
constexpr std::array<double, kNumSizePoints> kSizePoints = {
    static_cast<double>(2 * kMiB), static_cast<double>(20 * kMiB), static_cast<double>(256 * kMiB),
    static_cast<double>(kGiB)};

struct MeasuredRow {
  DriverCall call;
  std::array<double, kNumSizePoints> micros;  // At kSizePoints, in order.
};

constexpr std::array<MeasuredRow, 7> kMeasured = {{
    {DriverCall::kMemCreate, {7.9, 7.6, 9.7, 17.1}},
    {DriverCall::kMemMap, {0.6, 0.7, 0.6, 0.8}},
    {DriverCall::kMemSetAccess, {22.7, 21.0, 38.0, 54.1}},
    {DriverCall::kMemUnmap, {14.2, 13.8, 20.9, 26.7}},
    {DriverCall::kMemRelease, {9.2, 16.9, 72.0, 296.6}},
    {DriverCall::kMalloc, {30.1, 31.2, 54.0, 117.8}},
    {DriverCall::kFree, {26.1, 34.8, 98.3, 298.4}},
}};

// Estimates, not measured: h200-vmm-latency.txt has no figure for these calls. The values are
// rounded from one informal, unreviewed probe through CudaBackend's ledger on an H200 (driver
// 580.159.04, 500 calls each, idle non-blocking stream, so no waiting): reserve/free of address
// space 1.6/1.7 us, event create/record/query/synchronize/destroy 0.4/0.3/0.2/0.3/0.2 us, stream
// synchronize 0.3 us, cudaMemGetInfo 5.0 us. Treat them as estimates until they are measured
// properly into the reference file. The simulator does not model waiting: a synchronize costs
// only its call.
struct EstimatedRow {
  DriverCall call;
  double micros;
};

constexpr std::array<EstimatedRow, 9> kEstimated = {{
    {DriverCall::kAddressReserve, 1.6},     // estimate, not measured
    {DriverCall::kAddressFree, 1.7},        // estimate, not measured
    {DriverCall::kEventCreate, 0.4},        // estimate, not measured
    {DriverCall::kEventRecord, 0.3},        // estimate, not measured
    {DriverCall::kEventQuery, 0.2},         // estimate, not measured
    {DriverCall::kEventSynchronize, 0.3},   // estimate, not measured (excludes the wait)
    {DriverCall::kEventDestroy, 0.2},       // estimate, not measured
    {DriverCall::kStreamSynchronize, 0.3},  // estimate, not measured (excludes the wait)
    {DriverCall::kMemGetInfo, 5.0},         // estimate, not measured
}};

static_assert(kMeasured.size() + kEstimated.size() == kNumDriverCalls,
              "every DriverCall needs a measured or an estimated cost");

const MeasuredRow* FindMeasured(DriverCall call) {
  for (const MeasuredRow& row : kMeasured) {
    if (row.call == call) return &row;
  }
  return nullptr;
}

double Interpolate(const std::array<double, kNumSizePoints>& micros, std::size_t bytes) {
  const double size = static_cast<double>(bytes);
  if (size <= kSizePoints.front()) return micros.front();
  if (size >= kSizePoints.back()) return micros.back();
  int hi = 1;
  while (kSizePoints[hi] < size) ++hi;
  const int lo = hi - 1;
  const double t = (std::log(size) - std::log(kSizePoints[lo])) /
                   (std::log(kSizePoints[hi]) - std::log(kSizePoints[lo]));
  return micros[lo] + t * (micros[hi] - micros[lo]);
}

}  // namespace

double ModelledCallMicros(DriverCall call, std::size_t bytes) {
  if (const MeasuredRow* row = FindMeasured(call)) return Interpolate(row->micros, bytes);
  for (const EstimatedRow& row : kEstimated) {
    if (row.call == call) return row.micros;
  }
  return 0.0;
}

bool IsCallCostMeasured(DriverCall call) { return FindMeasured(call) != nullptr; }

}  // namespace vramledger
