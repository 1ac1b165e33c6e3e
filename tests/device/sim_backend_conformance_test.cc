// The DeviceBackend conformance suite (backend_conformance.h) on SimBackend, on the CPU: holding
// a stream is the simulator's default (events complete only when told or synchronised).
#include <string>

#include "device/backend_conformance.h"
#include "device/sim_backend.h"

namespace vramledger {
namespace conformance {

class SimHarness {
 public:
  static constexpr bool kCountsRefusedCalls = true;  // every call made is in calls()
  static constexpr int kRounds = 200;
  static constexpr int kPerRound = 8;

  std::string Unavailable() { return ""; }
  void SetUp() {}
  DeviceBackend* backend() { return &sim_; }

  StreamId NewStream() { return next_stream_ += 0x1000; }
  void DestroyStream(StreamId) {}
  // Recorded events stay pending until completed or synchronised: nothing to hold or release.
  void HoldStream(StreamId) {}
  void ReleaseStream(StreamId) {}

  void BeginCapture(StreamId stream) { sim_.SetCapturing(stream, true); }
  void CaptureWork(DevicePtr va, std::size_t size, StreamId) {
    EXPECT_TRUE(sim_.IsAccessible(va, size));  // what a kernel in the graph would touch
  }
  void EndCapture(StreamId stream) {
    // Nothing was called outside the relaxed scope while capturing.
    EXPECT_EQ(sim_.calls_during_capture_not_relaxed(), 0);
    sim_.SetCapturing(stream, false);
  }
  void ExpectThreadCaptureModeGlobal() {
    const int mode = sim_.EnterRelaxedCapture();
    sim_.ExitRelaxedCapture(mode);
    EXPECT_EQ(mode, kCaptureModeGlobal);
  }
  void ExpectNoStickyError() {}  // the simulator keeps no last error
  // No bytes are simulated: the range must be mapped with access set.
  void ExpectWritable(DevicePtr va, std::size_t size, unsigned char) {
    EXPECT_TRUE(sim_.IsAccessible(va, size));
  }
  void ExpectHolds(DevicePtr va, std::size_t size, unsigned char) {
    EXPECT_TRUE(sim_.IsAccessible(va, size));
  }
  void ExpectNothingLive() {
    EXPECT_EQ(sim_.used_bytes(), 0u);
    EXPECT_EQ(sim_.mapped_bytes(), 0u);
    EXPECT_EQ(sim_.live_allocations(), 0);
    EXPECT_EQ(sim_.live_reservations(), 0);
    EXPECT_EQ(sim_.live_events(), 0);
    EXPECT_EQ(sim_.live_exports(), 0);
    EXPECT_EQ(sim_.live_opened(), 0);
  }

 private:
  SimBackend sim_;
  StreamId next_stream_ = 0;
};

INSTANTIATE_TYPED_TEST_SUITE_P(Sim, BackendConformance, SimHarness);
}  // namespace conformance
}  // namespace vramledger
