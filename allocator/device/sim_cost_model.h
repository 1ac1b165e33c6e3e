// Sim cost model: the modelled latency of each driver call on an H200, which SimBackend charges.
// Constant tables and pure functions only; thread-safe.
#ifndef VRAMLEDGER_DEVICE_SIM_COST_MODEL_H_
#define VRAMLEDGER_DEVICE_SIM_COST_MODEL_H_

#include <cstddef>

#include "vramledger/device_backend.h"

namespace vramledger {

/// Modelled host latency, in microseconds, of one call of kind `call` acting on `bytes` bytes.
///
/// Size-dependent kinds (cudaMalloc, cudaFree, cuMemCreate, cuMemRelease, cuMemMap, cuMemUnmap,
/// cuMemSetAccess) use the H200 medians measured at 2 MiB, 20 MiB, 256 MiB and 1 GiB
/// (shared/reference/h200-vmm-latency.txt), interpolated linearly in log(size) between those
/// points and clamped to the end points outside them. Every other kind has a fixed estimate that
/// was not measured (see sim_cost_model.cc); `bytes` is ignored for those.
/// A call spanning several mappings (cuMemUnmap, cuMemSetAccess over a range) costs the sum over
/// its mappings; that is the caller's job (SimBackend), matching the batched measurements.
double ModelledCallMicros(DriverCall call, std::size_t bytes);

/// True if ModelledCallMicros(call, ...) rests on a measurement, false if it is an estimate.
bool IsCallCostMeasured(DriverCall call);

}  // namespace vramledger

#endif  // VRAMLEDGER_DEVICE_SIM_COST_MODEL_H_
