// The ledger part of `vramledger._core`: snapshots of replayed traces, and SimAllocator, a
// simulated device with the memory history (Python stacks are captured under the GIL).
// Thread-safety: SimAllocator locks like DeviceAllocator; the replay functions release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "device/sim_backend.h"
#include "ledger/history.h"
#include "ledger/oom_dump.h"
#include "ledger/snapshot.h"
#include "replay/replay_snapshot.h"
#include "replay/trace_reader.h"
#include "vramledger/device_allocator.h"
#include "vramledger/options.h"

namespace py = pybind11;

namespace vramledger {
namespace {

constexpr std::uint64_t kMaxEntriesDefault = std::numeric_limits<std::int64_t>::max();

// As python_module.cc: ValueError for bad input, FileNotFoundError / PermissionError for files,
// MemoryError for a simulated out-of-memory, RuntimeError otherwise.
[[noreturn]] void Raise(const absl::Status& status) {
  const std::string message(status.message());
  PyObject* type = PyExc_RuntimeError;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kDataLoss:
      type = PyExc_ValueError;
      break;
    case absl::StatusCode::kNotFound:
      type = PyExc_FileNotFoundError;
      break;
    case absl::StatusCode::kPermissionDenied:
      type = PyExc_PermissionError;
      break;
    case absl::StatusCode::kResourceExhausted:
      type = PyExc_MemoryError;
      break;
    default:
      break;
  }
  PyErr_SetString(type, message.c_str());
  throw py::error_already_set();
}

template <typename T>
T ValueOrRaise(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

void OkOrRaise(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

// The snapshot document as plain Python values (dict, list, int, float, str, bool, None).
py::object ToPython(const SnapshotJson& j) {
  switch (j.type()) {
    case SnapshotJson::value_t::object: {
      py::dict d;
      for (const auto& [key, value] : j.items()) d[py::str(key)] = ToPython(value);
      return d;
    }
    case SnapshotJson::value_t::array: {
      py::list l(j.size());
      std::size_t i = 0;
      for (const auto& value : j) l[i++] = ToPython(value);
      return l;
    }
    case SnapshotJson::value_t::number_integer:
      return py::int_(j.get<std::int64_t>());
    case SnapshotJson::value_t::number_unsigned:
      return py::int_(j.get<std::uint64_t>());
    case SnapshotJson::value_t::number_float:
      return py::float_(j.get<double>());
    case SnapshotJson::value_t::string:
      return py::str(j.get_ref<const std::string&>());
    case SnapshotJson::value_t::boolean:
      return py::bool_(j.get<bool>());
    default:
      return py::none();
  }
}

Options OptionsFor(const std::string& conf, bool use_env) {
  return ValueOrRaise(use_env ? OptionsFromEnvAndString(conf) : ParseOptions(conf));
}

ReplaySnapshotConfig SnapshotConfig(std::size_t capacity_bytes, const std::string& source,
                                    const std::string& at, std::uint64_t max_entries,
                                    std::int64_t gpu_lag_us, bool follow_releases) {
  const std::optional<SnapshotMoment> moment = ParseSnapshotMoment(at);
  if (!moment.has_value()) {
    throw py::value_error(absl::StrCat("at='", at, "' is not accepted; expected 'peak' or 'end'"));
  }
  if (max_entries < 1) throw py::value_error("max_entries must be at least 1");
  if (gpu_lag_us < 0) throw py::value_error("gpu_lag_us must be 0 (none) or positive");
  ReplaySnapshotConfig config;
  config.replay.gpu_lag_us = gpu_lag_us;
  config.replay.follow_releases = follow_releases;
  // A plan in the options stops the snapshot's replay where Replay() stops (the first refusal).
  config.replay.capacity_bytes = capacity_bytes;
  config.replay.source = source;
  config.at = *moment;
  config.max_entries = static_cast<std::size_t>(max_entries);
  return config;
}

py::object RunReplaySnapshot(const std::vector<TraceEvent>& events, const Options& options,
                             const ReplaySnapshotConfig& config) {
  absl::StatusOr<SnapshotJson> doc;
  {
    py::gil_scoped_release release;
    doc = ReplaySnapshot(events, options, config);
  }
  return ToPython(ValueOrRaise(std::move(doc)));
}

py::object ReplaySnapshotFile(const std::string& path, const std::string& conf,
                              std::size_t capacity_bytes, const std::string& at, bool use_env,
                              std::uint64_t max_entries, std::int64_t gpu_lag_us,
                              bool follow_releases) {
  const Options options = OptionsFor(conf, use_env);
  const ReplaySnapshotConfig config =
      SnapshotConfig(capacity_bytes, path, at, max_entries, gpu_lag_us, follow_releases);
  absl::StatusOr<std::vector<TraceEvent>> events;
  {
    py::gil_scoped_release release;
    events = ReadTraceFile(path);
  }
  return RunReplaySnapshot(ValueOrRaise(std::move(events)), options, config);
}

using EventTuple =
    std::tuple<std::string, std::uint64_t, std::uint64_t, std::uint64_t, std::int64_t>;

py::object ReplaySnapshotEvents(const std::vector<EventTuple>& tuples, const std::string& conf,
                                std::size_t capacity_bytes, const std::string& source,
                                const std::string& at, bool use_env, std::uint64_t max_entries,
                                std::int64_t gpu_lag_us, bool follow_releases) {
  const Options options = OptionsFor(conf, use_env);
  const ReplaySnapshotConfig config =
      SnapshotConfig(capacity_bytes, source, at, max_entries, gpu_lag_us, follow_releases);
  std::vector<TraceEvent> events;
  events.reserve(tuples.size());
  for (std::size_t i = 0; i < tuples.size(); ++i) {
    const auto& [action_name, addr, size, stream, time_us] = tuples[i];
    const std::optional<TraceAction> action = ParseTraceAction(action_name);
    if (!action.has_value()) {
      throw py::value_error(
          absl::StrCat(source, ":", i + 1, ": unknown action '", action_name, "'"));
    }
    events.push_back(TraceEvent{*action, static_cast<DevicePtr>(addr),
                                static_cast<std::size_t>(size), static_cast<StreamId>(stream),
                                time_us, static_cast<int>(i + 1)});
  }
  return RunReplaySnapshot(events, options, config);
}

// A simulated device with its own allocator and history, for Python tests and experiments.
class SimAllocator {
 public:
  SimAllocator(std::size_t capacity_bytes, const std::string& conf, int device) {
    SimBackend::Config config;
    config.capacity = capacity_bytes;
    config.device = device;
    backend_ = std::make_unique<SimBackend>(config);
    allocator_ = std::make_unique<DeviceAllocator>(OptionsFor(conf, false), backend_.get());
    allocator_->SetHooks(&history_);
  }
  ~SimAllocator() { allocator_->SetHooks(nullptr); }

  // `release_gil` mimics torch's operators, which release the GIL before they allocate: the
  // history then takes it back to read the caller's Python frames.
  std::uint64_t Malloc(std::size_t size, std::uint64_t stream, bool release_gil) {
    absl::StatusOr<DevicePtr> ptr;
    if (release_gil) {
      py::gil_scoped_release release;
      ptr = allocator_->Malloc(size, static_cast<StreamId>(stream));
    } else {
      ptr = allocator_->Malloc(size, static_cast<StreamId>(stream));
    }
    return ValueOrRaise(std::move(ptr));
  }
  void Free(std::uint64_t ptr) { OkOrRaise(allocator_->Free(static_cast<DevicePtr>(ptr))); }
  void RecordStream(std::uint64_t ptr, std::uint64_t stream) {
    OkOrRaise(allocator_->RecordStream(static_cast<DevicePtr>(ptr), static_cast<StreamId>(stream)));
  }
  void EmptyCache() { OkOrRaise(allocator_->EmptyCache()); }
  void CompleteEvents() { backend_->CompleteAllEvents(); }

  void RecordMemoryHistory(std::optional<std::string> enabled, std::optional<std::string> context,
                           const std::string& stacks, std::uint64_t max_entries, bool clear) {
    std::optional<std::string_view> e, c;
    if (enabled.has_value()) e = *enabled;
    if (context.has_value()) c = *context;
    history_.Configure(ValueOrRaise(ParseHistorySettings(e, c, stacks, max_entries)), clear);
  }
  py::object Snapshot() { return ToPython(BuildSnapshot({allocator_.get()}, &history_)); }
  void DumpSnapshotJson(const std::string& path) {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = WriteSnapshotJsonFile(path, {allocator_.get()}, &history_);
    }
    OkOrRaise(s);
  }
  std::string WriteOomDumpTo(const std::string& dump_dir, int max_dumps) {
    OomDumpConfig config;
    config.dump_dir = dump_dir;
    config.max_dumps = max_dumps;
    config.device = backend_->device();
    return ValueOrRaise(WriteOomDump(config, {allocator_.get()}, &history_));
  }

 private:
  std::unique_ptr<SimBackend> backend_;
  std::unique_ptr<DeviceAllocator> allocator_;
  History history_;
};

}  // namespace

void RegisterLedgerBindings(py::module_& m) {
  m.def("replay_snapshot_file", &ReplaySnapshotFile, py::arg("path"), py::arg("conf") = "",
        py::arg("capacity_bytes") = kH200TotalBytes, py::arg("at") = "peak",
        py::arg("use_env") = true, py::arg("max_entries") = kMaxEntriesDefault,
        py::arg("gpu_lag_us") = 0, py::arg("follow_releases") = true,
        "Replays a trace CSV (plain or .gz) on SimBackend with the memory history on and "
        "returns the snapshot dict (torch's shape) at the peak of reserved memory (at='peak') "
        "or after the last event (at='end'); vramledger.replay says where it stopped. "
        "gpu_lag_us > 0: fences complete that many microseconds of trace time late, as in "
        "replay_file; follow_releases as there.\n"
        "Raises ValueError (malformed trace, options or `at`), FileNotFoundError, MemoryError "
        "(the simulated device ran out; names the line).");
  m.def("replay_snapshot_events", &ReplaySnapshotEvents, py::arg("events"), py::arg("conf") = "",
        py::arg("capacity_bytes") = kH200TotalBytes, py::arg("source") = "<events>",
        py::arg("at") = "peak", py::arg("use_env") = true,
        py::arg("max_entries") = kMaxEntriesDefault, py::arg("gpu_lag_us") = 0,
        py::arg("follow_releases") = true,
        "As replay_snapshot_file, for a list of (action, addr, size, stream, time_us) tuples.");
  py::class_<SimAllocator>(m, "SimAllocator",
                           "A simulated device (SimBackend) with vramledger's allocator and "
                           "memory history; sizes in bytes. History starts off.")
      .def(py::init<std::size_t, const std::string&, int>(), py::arg("capacity_bytes"),
           py::arg("conf") = "", py::arg("device") = 0)
      .def("malloc", &SimAllocator::Malloc, py::arg("size"), py::arg("stream") = 0,
           py::arg("release_gil") = false,
           "Address of a new block; MemoryError with torch's message when the device is full. "
           "release_gil=True allocates without the GIL, as torch's operators do.")
      .def("free", &SimAllocator::Free, py::arg("ptr"))
      .def("record_stream", &SimAllocator::RecordStream, py::arg("ptr"), py::arg("stream"))
      .def("empty_cache", &SimAllocator::EmptyCache)
      .def("complete_events", &SimAllocator::CompleteEvents)
      .def("record_memory_history", &SimAllocator::RecordMemoryHistory, py::arg("enabled") = "all",
           py::arg("context") = "all", py::arg("stacks") = "python",
           py::arg("max_entries") = kMaxEntriesDefault, py::arg("clear_history") = false,
           "torch's _record_memory_history arguments; ValueError for an unknown value.")
      .def("snapshot", &SimAllocator::Snapshot, "The snapshot dict (torch's shape).")
      .def("dump_snapshot_json", &SimAllocator::DumpSnapshotJson, py::arg("path"),
           "Writes the snapshot as JSON, atomically (streamed).")
      .def("write_oom_dump", &SimAllocator::WriteOomDumpTo, py::arg("dump_dir"),
           py::arg("max_dumps") = 8,
           "Writes an OOM forensic snapshot into dump_dir; returns its path ('' if max_dumps<=0).");
}

}  // namespace vramledger
